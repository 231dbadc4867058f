//! TorchScript models through libtorch (`tch`). This is the only module in vramgate that
//! knows libtorch: the rest of the worker sees [`Model`], [`InputTensor`] and [`ModelError`].
//!
//! A model is loaded once, warmed up with a probe input (so the first request doesn't pay
//! TorchScript's compilation), and called from blocking threads. Calls into one loaded copy
//! are serialised by a mutex: Silero VAD keeps recurrent state inside the module, so two
//! concurrent calls into one copy would corrupt each other's results. `instances` loads
//! several copies, so that several batches of one model can run at once.

use std::panic::AssertUnwindSafe;
use std::sync::Mutex;
use std::time::Instant;

use bytes::Bytes;
use tch::{CModule, Device, IValue, Kind, Tensor};

use crate::config::{DeviceChoice, ModelConfig, ModelKind};

#[derive(Debug, Clone, thiserror::Error)]
pub enum ModelError {
    #[error("loading model '{name}' from {path}: {message}")]
    Load { name: String, path: String, message: String },
    #[error("cuda was requested but libtorch sees no cuda device")]
    NoCuda,
    #[error("{0}")]
    BadInput(String),
    /// An allocation failed: the device (or the memory cap) had no room for this batch.
    #[error("model '{name}' ran out of memory: {message}")]
    OutOfMemory { name: String, message: String },
    #[error("model '{name}' failed: {message}")]
    Runtime { name: String, message: String },
    #[error("model '{name}' panicked: {message}")]
    Panic { name: String, message: String },
}

/// The device the models run on, as the rest of the worker sees it (tch's `Device` stays in
/// this module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeDevice {
    Cpu,
    /// A CUDA device, by index.
    Cuda(usize),
}

impl ComputeDevice {
    fn tch(self) -> Device {
        match self {
            ComputeDevice::Cpu => Device::Cpu,
            ComputeDevice::Cuda(index) => Device::Cuda(index),
        }
    }
}

impl std::fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ComputeDevice::Cpu => write!(f, "cpu"),
            ComputeDevice::Cuda(index) => write!(f, "cuda:{index}"),
        }
    }
}

/// Picks the device once per process and applies process-wide libtorch settings.
pub fn init_torch(choice: DeviceChoice, threads: usize) -> Result<ComputeDevice, ModelError> {
    // The profiling executor re-specialises graphs over the first calls, which costs seconds
    // per new input shape on CPU; audio lengths vary per request, so it would never settle.
    // At a fixed shape both executors run equally fast (docs/performance-notes.md).
    tch::jit::set_profiling_mode(false);
    if threads > 0 {
        tch::set_num_threads(threads as i32);
    }
    let cuda = tch::Cuda::is_available();
    match (choice, cuda) {
        (DeviceChoice::Cuda, false) => Err(ModelError::NoCuda),
        (DeviceChoice::Cpu, _) | (DeviceChoice::Auto, false) => Ok(ComputeDevice::Cpu),
        (DeviceChoice::Cuda | DeviceChoice::Auto, true) => Ok(ComputeDevice::Cuda(0)),
    }
}

/// An input tensor as the HTTP layer hands it over: f32 values, row-major, with its shape.
/// The values stay little-endian bytes (OIP's binary encoding) until the batch tensor is
/// built, so a binary request's body is copied once, into that tensor: `data` is usually a
/// slice of the body itself.
#[derive(Debug, Clone)]
pub struct InputTensor {
    pub shape: Vec<usize>,
    /// Little-endian f32 values at any alignment; a whole number of them.
    data: Bytes,
}

impl InputTensor {
    /// Takes `data` as little-endian f32 values; refuses a length that is not a whole number of
    /// them. Whether they fill `shape` is [`Model::validate`]'s check.
    pub fn from_le_bytes(shape: Vec<usize>, data: Bytes) -> Result<InputTensor, ModelError> {
        if data.len() % F32_BYTES != 0 {
            return Err(ModelError::BadInput(format!(
                "FP32 data must be a whole number of {F32_BYTES}-byte values, got {} bytes",
                data.len()
            )));
        }
        Ok(InputTensor { shape, data })
    }

    /// Takes values already decoded (JSON inputs, probes).
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> InputTensor {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        InputTensor { shape, data: Bytes::from(data) }
    }

    pub fn elements(&self) -> u64 {
        (self.data.len() / F32_BYTES) as u64
    }

    /// The values' little-endian bytes.
    pub fn le_bytes(&self) -> &[u8] {
        &self.data
    }

    /// A host tensor of these values in `shape`: one copy of the bytes (on a big-endian host,
    /// a decode and a copy).
    fn to_tensor(&self, shape: &[i64]) -> Result<Tensor, tch::TchError> {
        if cfg!(target_endian = "little") {
            Tensor::f_from_data_size(&self.data, shape, Kind::Float)
        } else {
            let values: Vec<f32> =
                self.data.chunks_exact(F32_BYTES).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            Tensor::f_from_slice(&values)?.f_reshape(shape)
        }
    }
}

const F32_BYTES: usize = std::mem::size_of::<f32>();

/// A tensor a model takes or gives, as OIP metadata shows it (`-1`: a variable dimension).
#[derive(Debug, Clone, Copy)]
pub struct TensorSpec {
    pub name: &'static str,
    pub shape: &'static [i64],
}

/// A model's output, row-major f32 with its shape.
#[derive(Debug, Clone)]
pub struct OutputTensor {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

pub struct Model {
    config: ModelConfig,
    device: Device,
    /// One loaded copy per configured instance; a batch runs on whichever is free.
    modules: Vec<Mutex<CModule>>,
}

impl Model {
    /// Loads the TorchScript file onto `device` and runs one warm-up call.
    pub fn load(config: ModelConfig, device: ComputeDevice) -> Result<Model, ModelError> {
        let device = device.tch();
        let started = Instant::now();
        let (name, path) = (config.name.clone(), config.path.display().to_string());
        let load_err = |message: String| ModelError::Load { name: name.clone(), path: path.clone(), message };
        let mut modules = Vec::new();
        for _ in 0..config.instances.max(1) {
            let mut module = CModule::load_on_device(&config.path, device)
                .map_err(|e| load_err(first_line(&e.to_string())))?;
            module.set_eval();
            modules.push(Mutex::new(module));
        }
        let model = Model { config, device, modules };
        let probe = model.probe_input(1, model.smallest_probe());
        model.infer(&probe).map_err(|e| load_err(format!("warm-up call failed: {e}")))?;
        tracing::info!(
            model = %model.config.name,
            device = ?device,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "model loaded and warmed up"
        );
        Ok(model)
    }

    /// The device it runs on, as `cpu` or `cuda:N`.
    pub fn device_name(&self) -> String {
        match self.device {
            Device::Cuda(index) => format!("cuda:{index}"),
            _ => "cpu".into(),
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The model's one input tensor: its name and OIP shape (`-1`: variable).
    pub fn input_spec(&self) -> TensorSpec {
        match self.config.kind {
            ModelKind::VoiceActivity => TensorSpec { name: "audio", shape: &[-1, -1] },
            ModelKind::FaceDetection => TensorSpec { name: "image", shape: &[-1, 3, -1, -1] },
        }
    }

    /// The model's output tensors, in the order [`Model::infer_batch`] returns them.
    pub fn output_specs(&self) -> &'static [TensorSpec] {
        match self.config.kind {
            ModelKind::VoiceActivity => &[TensorSpec { name: "speech_prob", shape: &[-1, -1] }],
            ModelKind::FaceDetection => &[
                TensorSpec { name: "face_prob", shape: &[-1, -1, -1] },
                TensorSpec { name: "box_offsets", shape: &[-1, 4, -1, -1] },
            ],
        }
    }

    fn smallest_probe(&self) -> usize {
        match self.config.kind {
            ModelKind::VoiceActivity => self.config.sample_rate_hz as usize,
            ModelKind::FaceDetection => 64,
        }
    }

    /// The probe inputs of the start-up memory calibration, small to large: three sizes, each
    /// at batch 1 and 2 (sizes: 1, 4 and 16 s of audio; 128², 256² and 512² images).
    pub fn calibration_inputs(&self) -> Vec<InputTensor> {
        let sizes: [usize; 3] = match self.config.kind {
            ModelKind::VoiceActivity => {
                let sr = self.config.sample_rate_hz as usize;
                [sr, 4 * sr, 16 * sr]
            }
            ModelKind::FaceDetection => [128, 256, 512],
        };
        let mut probes = Vec::new();
        for size in sizes {
            for batch in [1, 2] {
                let probe = self.probe_input(batch, size);
                if probe.elements() <= self.config.max_input_elements as u64 {
                    probes.push(probe);
                }
            }
        }
        probes
    }

    /// The input sizes the start-up throughput calibration times (see `batching.rs`), small to
    /// large: 1 and 4 s of audio; 64², 128², 256² and 512² images. Each size is one size
    /// class; sizes between them take the nearest class's figures until measured online.
    pub fn batching_probe_sizes(&self) -> Vec<usize> {
        let sizes = match self.config.kind {
            ModelKind::VoiceActivity => {
                let sr = self.config.sample_rate_hz as usize;
                vec![sr, 4 * sr]
            }
            ModelKind::FaceDetection => vec![64, 128, 256, 512],
        };
        sizes.into_iter().filter(|&size| self.probe_input_elements(1, size) <= self.config.max_input_elements).collect()
    }

    /// How many elements [`Model::probe_input`] holds for `batch` rows of `size`.
    pub fn probe_input_elements(&self, batch: usize, size: usize) -> usize {
        match self.config.kind {
            ModelKind::VoiceActivity => batch * size,
            ModelKind::FaceDetection => batch * 3 * size * size,
        }
    }

    /// A deterministic, non-trivial input of `batch` rows: a quiet tone of `size` samples for
    /// audio, a gradient of `size`² pixels for images.
    pub fn probe_input(&self, batch: usize, size: usize) -> InputTensor {
        match self.config.kind {
            ModelKind::VoiceActivity => {
                let data: Vec<f32> = (0..batch * size).map(|i| 0.01 * ((i % size) as f32 * 0.05).sin()).collect();
                InputTensor::from_f32(vec![batch, size], &data)
            }
            ModelKind::FaceDetection => {
                let plane = size * size;
                let data: Vec<f32> = (0..batch * 3 * plane).map(|i| ((i % plane) as f32 / plane as f32) - 0.5).collect();
                InputTensor::from_f32(vec![batch, 3, size, size], &data)
            }
        }
    }

    /// Whether inputs of different sizes may share a batch, padded (see `engine.rs`): audio
    /// yes (Silero runs forward in time, so trailing silence leaves earlier windows as they
    /// were), images no (ceil-mode pooling sees the padding at a smaller image's edge).
    pub fn can_pad(&self) -> bool {
        match self.config.kind {
            ModelKind::VoiceActivity => true,
            ModelKind::FaceDetection => false,
        }
    }

    /// Checks an input's shape against what the model takes, before any libtorch call.
    pub fn validate(&self, input: &InputTensor) -> Result<(), ModelError> {
        let elements: usize = input.shape.iter().product();
        if elements as u64 != input.elements() {
            return Err(ModelError::BadInput(format!(
                "shape {:?} holds {elements} elements but {} were sent",
                input.shape,
                input.elements()
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
            ModelKind::FaceDetection => {
                let [batch, 3, height, width] = input.shape[..] else {
                    return Err(ModelError::BadInput(format!(
                        "input 'image' must have shape [batch, 3, height, width], got {:?}",
                        input.shape
                    )));
                };
                if batch == 0 || height < 12 || width < 12 {
                    return Err(ModelError::BadInput(format!(
                        "input 'image' needs at least one image of 12×12 pixels, got shape {:?}",
                        input.shape
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

    /// The shape a batch of `inputs` is padded to: their rows stacked, every other dimension
    /// the largest among them. Audio is padded with silence at the end, images with zeros
    /// (mid-grey after normalisation) at the right and bottom; neither changes the outputs
    /// of the unpadded region, which is all that is returned.
    pub fn padded_shape(inputs: &[&InputTensor]) -> Vec<usize> {
        let mut shape = inputs[0].shape.clone();
        shape[0] = inputs.iter().map(|i| i.shape[0]).sum();
        for input in &inputs[1..] {
            for (d, &n) in shape.iter_mut().zip(&input.shape).skip(1) {
                *d = (*d).max(n);
            }
        }
        shape
    }

    /// What one request's outputs look like for its own (unpadded) input shape.
    fn output_shapes(&self, input_shape: &[usize]) -> Vec<Vec<usize>> {
        match self.config.kind {
            ModelKind::VoiceActivity => {
                let window = self.config.window_samples as usize;
                vec![vec![input_shape[0], input_shape[1].div_ceil(window)]]
            }
            ModelKind::FaceDetection => {
                let cells = |n: usize| (n - 2).div_ceil(2) - 4;
                let (h, w) = (cells(input_shape[2]), cells(input_shape[3]));
                vec![vec![input_shape[0], h, w], vec![input_shape[0], 4, h, w]]
            }
        }
    }

    /// Runs one input on its own. Blocking.
    pub fn infer(&self, input: &InputTensor) -> Result<Vec<OutputTensor>, ModelError> {
        self.infer_batch(&[input]).map(|mut outs| outs.remove(0))
    }

    /// Runs several requests as one batch, padded to a common shape, and splits the outputs
    /// back per request. Blocking: call it from a blocking thread, never from an async task.
    /// A libtorch error or a panic inside the call becomes a [`ModelError`] (an allocation
    /// failure becomes [`ModelError::OutOfMemory`]); the model stays usable.
    pub fn infer_batch(&self, inputs: &[&InputTensor]) -> Result<Vec<Vec<OutputTensor>>, ModelError> {
        for input in inputs {
            self.validate(input)?;
        }
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.infer_unchecked(inputs)));
        match outcome {
            Ok(result) => result,
            Err(panic) => Err(ModelError::Panic {
                name: self.config.name.clone(),
                message: panic_message(&panic),
            }),
        }
    }

    fn infer_unchecked(&self, inputs: &[&InputTensor]) -> Result<Vec<Vec<OutputTensor>>, ModelError> {
        let failed = |e: tch::TchError| {
            let message = e.to_string();
            match out_of_memory_line(&message) {
                Some(line) => ModelError::OutOfMemory { name: self.config.name.clone(), message: line },
                None => ModelError::Runtime { name: self.config.name.clone(), message: error_line(&message) },
            }
        };
        let shape = Self::padded_shape(inputs);
        let batch_input = tch::no_grad(|| pad_into_tensor(inputs, &shape)).map_err(failed)?;
        let module = self.free_instance();
        let raw = tch::no_grad(|| -> Result<Vec<Tensor>, tch::TchError> {
            let x = batch_input.f_to_device(self.device)?;
            match self.config.kind {
                ModelKind::VoiceActivity => {
                    let sr = IValue::Int(i64::from(self.config.sample_rate_hz));
                    match module.method_is("audio_forward", &[IValue::Tensor(x), sr])? {
                        IValue::Tensor(t) => Ok(vec![t]),
                        other => Err(tch::TchError::Kind(format!("audio_forward returned {other:?}, expected a tensor"))),
                    }
                }
                ModelKind::FaceDetection => match module.forward_is(&[IValue::Tensor(x)])? {
                    IValue::Tuple(mut parts) if parts.len() == 2 => {
                        let (Some(IValue::Tensor(probs)), Some(IValue::Tensor(boxes))) = (parts.pop(), parts.pop()) else {
                            return Err(tch::TchError::Kind("forward must return (boxes, probs) tensors".into()));
                        };
                        Ok(vec![probs.f_select(1, 1)?, boxes])
                    }
                    other => Err(tch::TchError::Kind(format!("forward returned {other:?}, expected (boxes, probs)"))),
                },
            }
        })
        .map_err(failed)?;
        drop(module);
        drop(batch_input);

        let raw: Vec<Tensor> = raw
            .into_iter()
            .map(|t| t.f_to_kind(Kind::Float).and_then(|t| t.f_to_device(Device::Cpu)))
            .collect::<Result<_, _>>()
            .map_err(failed)?;
        let specs = self.output_specs();
        let mut row = 0i64;
        let mut per_request = Vec::with_capacity(inputs.len());
        for input in inputs {
            let rows = input.shape[0] as i64;
            let mut outputs = Vec::with_capacity(specs.len());
            for ((spec, tensor), want) in specs.iter().zip(&raw).zip(self.output_shapes(&input.shape)) {
                let mut t = tensor.f_narrow(0, row, rows).map_err(failed)?;
                for (dim, &n) in want.iter().enumerate().skip(1) {
                    t = t.f_narrow(dim as i64, 0, n as i64).map_err(failed)?;
                }
                let flat = t.f_contiguous().and_then(|t| t.f_reshape([-1])).map_err(failed)?;
                let data = Vec::<f32>::try_from(&flat).map_err(failed)?;
                outputs.push(OutputTensor { name: spec.name, shape: want, data });
            }
            row += rows;
            per_request.push(outputs);
        }
        Ok(per_request)
    }
}

impl Model {
    /// The first instance nobody is running, else the first one (waiting for it).
    fn free_instance(&self) -> std::sync::MutexGuard<'_, CModule> {
        for m in &self.modules {
            match m.try_lock() {
                Ok(guard) => return guard,
                Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
        }
        self.modules[0].lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn instances(&self) -> usize {
        self.modules.len()
    }
}

/// Copies the inputs into one host tensor of `shape`: a lone unpadded input is one copy of
/// its bytes; otherwise a zero-padded tensor and one copy per input into it.
fn pad_into_tensor(inputs: &[&InputTensor], shape: &[usize]) -> Result<Tensor, tch::TchError> {
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    if inputs.len() == 1 && inputs[0].shape == shape {
        return inputs[0].to_tensor(&dims);
    }
    let batch = Tensor::f_zeros(&dims, (Kind::Float, Device::Cpu))?;
    let mut row = 0i64;
    for input in inputs {
        let own: Vec<i64> = input.shape.iter().map(|&d| d as i64).collect();
        let mut view = batch.f_narrow(0, row, own[0])?;
        for (dim, &n) in own.iter().enumerate().skip(1) {
            view = view.f_narrow(dim as i64, 0, n)?;
        }
        view.f_copy_(&input.to_tensor(&own)?)?;
        row += own[0];
    }
    Ok(batch)
}

/// The line of a libtorch message that says an allocation failed, if one does. TorchScript
/// wraps the original error in a traceback, so the whole message is searched.
pub fn out_of_memory_line(message: &str) -> Option<String> {
    const MARKERS: [&str; 4] =
        ["CUDA out of memory", "CUDNN_STATUS_ALLOC_FAILED", "can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED"];
    message
        .lines()
        .find(|l| MARKERS.iter().any(|m| l.contains(m)))
        .map(|l| l.trim().trim_start_matches("RuntimeError: ").to_string())
}

/// The useful line of a libtorch error: TorchScript puts "The following operation failed"
/// first and the real error after the traceback; plain errors put it first.
fn error_line(message: &str) -> String {
    if message.contains("The following operation failed in the TorchScript interpreter") {
        if let Some(line) = message.lines().rev().find(|l| l.contains("Error: ")) {
            return line.trim().to_string();
        }
    }
    first_line(message)
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
    fn out_of_memory_is_found_inside_a_torchscript_traceback() {
        let msg = "The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript (most recent call last):\n  File \"x.py\", line 10\n        return F.conv2d(\nRuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 534775808 bytes. Error code 12 (Cannot allocate memory)\n";
        let line = out_of_memory_line(msg).expect("an OOM");
        assert!(line.starts_with("[enforce fail"), "{line}");
        assert!(line.contains("534775808 bytes"));
        assert!(out_of_memory_line("\n  CUDA out of memory. Tried to allocate 2.00 GiB\nframe #0").is_some());
        assert!(out_of_memory_line("Expected 4D input").is_none());
        assert_eq!(error_line(msg.replace("can't allocate memory", "bad shape").as_str()).split(':').next(), Some("RuntimeError"));
    }

    #[test]
    fn padded_shape_takes_rows_and_the_largest_other_dims() {
        let a = InputTensor::from_f32(vec![1, 3, 20, 30], &[0.0; 1800]);
        let b = InputTensor::from_f32(vec![2, 3, 25, 12], &[0.0; 1800]);
        assert_eq!(Model::padded_shape(&[&a, &b]), vec![3, 3, 25, 30]);
    }

    #[test]
    fn input_bytes_become_a_tensor_at_any_alignment_and_only_whole_values_are_taken() {
        let values = [1.0f32, -2.5, 3.25, 0.0, 7.5, -0.125];
        let mut bytes = vec![0u8; 3];
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        let bytes = Bytes::from(bytes);
        for skip in 0..3 {
            // Only the slice that starts 3 bytes in holds the values; the others test alignment
            // of whatever is there (it must be copied bit for bit).
            let slice = bytes.slice(skip..skip + 24);
            let input = InputTensor::from_le_bytes(vec![1, 2, 3], slice.clone()).expect("whole values");
            assert_eq!(input.elements(), 6);
            let tensor = input.to_tensor(&[1, 2, 3]).expect("a tensor");
            assert_eq!(tensor.size(), vec![1, 2, 3]);
            let back = Vec::<f32>::try_from(&tensor.reshape([-1])).expect("f32 values");
            let want: Vec<f32> = slice.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            assert_eq!(back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
        let aligned = InputTensor::from_le_bytes(vec![6], bytes.slice(3..)).expect("whole values");
        assert_eq!(Vec::<f32>::try_from(&aligned.to_tensor(&[6]).expect("a tensor")).expect("f32"), values);
        let err = InputTensor::from_le_bytes(vec![6], bytes.slice(3..26)).expect_err("23 bytes");
        assert!(err.to_string().contains("whole number of 4-byte values, got 23 bytes"), "{err}");
        assert_eq!(InputTensor::from_f32(vec![6], &values).le_bytes(), &bytes[3..]);
    }

    #[test]
    fn first_line_drops_cpp_stack() {
        let msg = "\n  CUDA out of memory. Tried to allocate 2.00 GiB\nException raised from malloc at …\nframe #0: …";
        assert_eq!(first_line(msg), "CUDA out of memory. Tried to allocate 2.00 GiB");
    }
}
