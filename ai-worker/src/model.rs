//! TorchScript models through libtorch (`tch`). This is the only module in vramgate that
//! knows libtorch: the rest of the worker sees [`Model`], [`InputTensor`] and [`ModelError`].
//!
//! A model is loaded once, warmed up with a probe input (so the first request doesn't pay
//! TorchScript's compilation), and called from blocking threads. Calls into one model are
//! serialised by a mutex: Silero VAD keeps recurrent state inside the module, so two
//! concurrent calls into one instance would corrupt each other's results.

use std::panic::AssertUnwindSafe;
use std::sync::Mutex;
use std::time::Instant;

use tch::{CModule, Device, IValue, Kind, Tensor};

use crate::config::{DeviceChoice, ModelConfig, ModelKind};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("loading model '{name}' from {path}: {message}")]
    Load { name: String, path: String, message: String },
    #[error("cuda was requested but libtorch sees no cuda device")]
    NoCuda,
    #[error("{0}")]
    BadInput(String),
    #[error("model '{name}' failed: {message}")]
    Runtime { name: String, message: String },
    #[error("model '{name}' panicked: {message}")]
    Panic { name: String, message: String },
}

/// Picks the device once per process and applies process-wide libtorch settings.
pub fn init_torch(choice: DeviceChoice, threads: usize) -> Result<Device, ModelError> {
    // The profiling executor re-specialises graphs over the first calls, which costs seconds
    // per new input shape on CPU; audio lengths vary per request, so it would never settle.
    tch::jit::set_profiling_mode(false);
    if threads > 0 {
        tch::set_num_threads(threads as i32);
    }
    let cuda = tch::Cuda::is_available();
    match (choice, cuda) {
        (DeviceChoice::Cuda, false) => Err(ModelError::NoCuda),
        (DeviceChoice::Cpu, _) | (DeviceChoice::Auto, false) => Ok(Device::Cpu),
        (DeviceChoice::Cuda | DeviceChoice::Auto, true) => Ok(Device::Cuda(0)),
    }
}

/// Human-readable name of a device, for logs and metadata.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(i) => format!("cuda:{i}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// An input tensor as the HTTP layer hands it over: f32 data, row-major, with its shape.
#[derive(Debug, Clone)]
pub struct InputTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// A model's output, row-major f32 with its shape.
#[derive(Debug, Clone)]
pub struct OutputTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

pub struct Model {
    config: ModelConfig,
    device: Device,
    module: Mutex<CModule>,
}

impl Model {
    /// Loads the TorchScript file onto `device` and runs one warm-up call.
    pub fn load(config: ModelConfig, device: Device) -> Result<Model, ModelError> {
        let started = Instant::now();
        let (name, path) = (config.name.clone(), config.path.display().to_string());
        let load_err = |message: String| ModelError::Load { name: name.clone(), path: path.clone(), message };
        let mut module = CModule::load_on_device(&config.path, device)
            .map_err(|e| load_err(first_line(&e.to_string())))?;
        module.set_eval();
        let model = Model { config, device, module: Mutex::new(module) };
        let probe = model.warmup_input();
        model.infer(&probe).map_err(|e| load_err(format!("warm-up call failed: {e}")))?;
        tracing::info!(
            model = %model.config.name,
            device = %device_name(device),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "model loaded and warmed up"
        );
        Ok(model)
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn input_name(&self) -> &'static str {
        match self.config.kind {
            ModelKind::VoiceActivity => "audio",
        }
    }

    pub fn output_name(&self) -> &'static str {
        match self.config.kind {
            ModelKind::VoiceActivity => "speech_prob",
        }
    }

    fn warmup_input(&self) -> InputTensor {
        match self.config.kind {
            // One second of a quiet tone: exercises every layer without special-casing silence.
            ModelKind::VoiceActivity => {
                let n = self.config.sample_rate_hz as usize;
                let data = (0..n).map(|i| 0.01 * (i as f32 * 0.05).sin()).collect();
                InputTensor { shape: vec![1, n], data }
            }
        }
    }

    /// Checks an input's shape against what the model takes, before any libtorch call.
    pub fn validate(&self, input: &InputTensor) -> Result<(), ModelError> {
        let elements: usize = input.shape.iter().product();
        if elements != input.data.len() {
            return Err(ModelError::BadInput(format!(
                "shape {:?} holds {elements} elements but {} were sent",
                input.shape,
                input.data.len()
            )));
        }
        match self.config.kind {
            ModelKind::VoiceActivity => {
                let [batch, samples] = input.shape[..] else {
                    return Err(ModelError::BadInput(format!(
                        "input 'audio' must have shape [batch, samples], got {:?}",
                        input.shape
                    )));
                };
                if batch == 0 || samples < self.config.window_samples as usize {
                    return Err(ModelError::BadInput(format!(
                        "input 'audio' needs at least one batch row and {} samples, got shape {:?}",
                        self.config.window_samples, input.shape
                    )));
                }
            }
        }
        if elements > self.config.max_input_elements {
            return Err(ModelError::BadInput(format!(
                "input has {elements} elements, more than this model's limit of {}",
                self.config.max_input_elements
            )));
        }
        Ok(())
    }

    /// Runs the model. Blocking: call it from a blocking thread, never from an async task.
    /// A libtorch error or a panic inside the call becomes a [`ModelError`]; the model stays
    /// usable for the next request.
    pub fn infer(&self, input: &InputTensor) -> Result<OutputTensor, ModelError> {
        self.validate(input)?;
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.infer_unchecked(input)));
        match outcome {
            Ok(result) => result,
            Err(panic) => Err(ModelError::Panic {
                name: self.config.name.clone(),
                message: panic_message(&panic),
            }),
        }
    }

    fn infer_unchecked(&self, input: &InputTensor) -> Result<OutputTensor, ModelError> {
        let runtime = |e: tch::TchError| ModelError::Runtime {
            name: self.config.name.clone(),
            message: first_line(&e.to_string()),
        };
        let shape: Vec<i64> = input.shape.iter().map(|&d| d as i64).collect();
        let module = self.module.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let output = tch::no_grad(|| -> Result<Tensor, tch::TchError> {
            let x = Tensor::f_from_slice(&input.data)?.f_reshape(&shape)?.f_to_device(self.device)?;
            match self.config.kind {
                ModelKind::VoiceActivity => {
                    let sr = IValue::Int(i64::from(self.config.sample_rate_hz));
                    match module.method_is("audio_forward", &[IValue::Tensor(x), sr])? {
                        IValue::Tensor(t) => Ok(t),
                        other => Err(tch::TchError::Kind(format!(
                            "audio_forward returned {other:?}, expected a tensor"
                        ))),
                    }
                }
            }
        })
        .map_err(runtime)?;
        drop(module);
        let output = output.f_to_kind(Kind::Float).and_then(|t| t.f_to_device(Device::Cpu)).map_err(runtime)?;
        let shape: Vec<usize> = output.size().iter().map(|&d| d.max(0) as usize).collect();
        let flat = output.f_reshape([-1]).map_err(runtime)?;
        let data = Vec::<f32>::try_from(&flat).map_err(runtime)?;
        Ok(OutputTensor { shape, data })
    }
}

/// libtorch appends a C++ stack trace to its messages; the first line is the useful part.
pub fn first_line(message: &str) -> String {
    message.lines().find(|l| !l.trim().is_empty()).unwrap_or("").trim().to_string()
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        first_line(s)
    } else {
        "unknown panic payload".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_line_drops_cpp_stack() {
        let msg = "\n  CUDA out of memory. Tried to allocate 2.00 GiB\nException raised from malloc at …\nframe #0: …";
        assert_eq!(first_line(msg), "CUDA out of memory. Tried to allocate 2.00 GiB");
    }
}
