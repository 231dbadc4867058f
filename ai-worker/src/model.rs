//! TorchScript models through libtorch (`tch`). This is the only module in vramgate that
//! knows libtorch: the rest of the worker sees [`Model`], [`InputTensor`] and [`ModelError`].
//!
//! A model is loaded once, warmed up with a probe input (so the first request doesn't pay
//! TorchScript's compilation), and called from blocking threads. Calls into one loaded copy
//! are serialised by a mutex: Silero VAD keeps recurrent state inside the module, so two
//! concurrent calls into one copy would corrupt each other's results. `instances` loads
//! several copies, so that several batches of one model can run at once.
//!
//! Two kinds have their tensors written here (Silero VAD, MTCNN P-Net; all FP32); a
//! `declared` model's come from its config entry ([`TensorSpec`]s built at load, each with its
//! datatype), so that a model of one input is served with no code of its own. An input's
//! bytes become a libtorch tensor of its datatype's kind directly; an output is answered in
//! its declared datatype, converted only where that is exact (see [`widens_exactly`]).

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use tch::{CModule, Device, IValue, Kind, Tensor};
use vramgate_shared::oip::{DataType, TensorData, F16};

use crate::config::{ConstArg, DeclaredTensor, DeviceChoice, ModelConfig, ModelKind, DEFAULT_PROBE_SIZES};

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

/// An input tensor as the HTTP layer hands it over: values of one datatype, row-major, with
/// its shape. The values stay little-endian bytes (OIP's binary encoding) until the batch
/// tensor is built, so a binary request's body is copied once, into that tensor: `data` is
/// usually a slice of the body itself.
#[derive(Debug, Clone)]
pub struct InputTensor {
    pub shape: Vec<usize>,
    datatype: DataType,
    /// Little-endian values of `datatype` at any alignment; a whole number of them.
    data: Bytes,
}

impl InputTensor {
    /// Takes `data` as little-endian values of `datatype`; refuses a length that is not a
    /// whole number of them. Whether they fill `shape`, and whether the model takes
    /// `datatype`, is [`Model::validate`]'s check.
    pub fn from_le_bytes(shape: Vec<usize>, datatype: DataType, data: Bytes) -> Result<InputTensor, ModelError> {
        let size = datatype.element_size().unwrap_or(1);
        if data.len() % size != 0 {
            return Err(ModelError::BadInput(format!(
                "{datatype} data must be a whole number of {size}-byte values, got {} bytes",
                data.len()
            )));
        }
        Ok(InputTensor { shape, datatype, data })
    }

    /// Takes values already decoded (JSON inputs, probes), in their own datatype.
    pub fn from_data(shape: Vec<usize>, values: &TensorData) -> InputTensor {
        let mut data = Vec::with_capacity(values.byte_len());
        values.write_le_bytes(&mut data);
        InputTensor { shape, datatype: values.datatype(), data: Bytes::from(data) }
    }

    /// Takes FP32 values already decoded.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> InputTensor {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        InputTensor { shape, datatype: DataType::Fp32, data: Bytes::from(data) }
    }

    pub fn datatype(&self) -> DataType {
        self.datatype
    }

    pub fn elements(&self) -> u64 {
        (self.data.len() / self.datatype.element_size().unwrap_or(1)) as u64
    }

    /// The values' little-endian bytes.
    pub fn le_bytes(&self) -> &[u8] {
        &self.data
    }

    /// A host tensor of these values in `shape`, of the datatype's kind: one copy of the bytes
    /// (on a big-endian host, a byte swap and a copy).
    fn to_tensor(&self, shape: &[i64]) -> Result<Tensor, tch::TchError> {
        let kind = tensor_kind(self.datatype)
            .ok_or_else(|| tch::TchError::Kind(format!("no libtorch kind for datatype {}", self.datatype)))?;
        let size = kind.elt_size_in_bytes();
        // libtorch copies as many bytes as the shape needs: they must all be there.
        let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?));
        if numel.and_then(|n| n.checked_mul(size)) != Some(self.data.len()) {
            return Err(tch::TchError::Shape(format!("{} bytes of {} do not fill shape {shape:?}", self.data.len(), self.datatype)));
        }
        if cfg!(target_endian = "little") {
            Tensor::f_from_data_size(&self.data, shape, kind)
        } else {
            let swapped: Vec<u8> = self.data.chunks_exact(size).flat_map(|b| b.iter().rev().copied()).collect();
            Tensor::f_from_data_size(&swapped, shape, kind)
        }
    }
}

/// The libtorch kind of a datatype a model may take or give; `None` for the others.
fn tensor_kind(datatype: DataType) -> Option<Kind> {
    match datatype {
        DataType::Bool => Some(Kind::Bool),
        DataType::Uint8 => Some(Kind::Uint8),
        DataType::Int32 => Some(Kind::Int),
        DataType::Int64 => Some(Kind::Int64),
        DataType::Fp16 => Some(Kind::Half),
        DataType::Fp32 => Some(Kind::Float),
        _ => None,
    }
}

/// Whether every value of kind `from` is a value of kind `to`, so that a model returning
/// `from` may be answered in `to` by a cast. Anything else is refused: a silent narrowing
/// (FP32 → FP16, INT64 → INT32) or a rounding (INT32 → FP32) would change the answer.
fn widens_exactly(from: Kind, to: Kind) -> bool {
    use Kind::{BFloat16, Bool, Float, Half, Int, Int16, Int64, Int8, Uint8};
    from == to
        || match to {
            Uint8 => matches!(from, Bool),
            Int => matches!(from, Bool | Uint8 | Int8 | Int16),
            Int64 => matches!(from, Bool | Uint8 | Int8 | Int16 | Int),
            // 11 significant bits: every 8-bit integer.
            Half => matches!(from, Bool | Uint8 | Int8),
            // 24 significant bits: every 16-bit integer and every half and bfloat16 value.
            Float => matches!(from, Bool | Uint8 | Int8 | Int16 | Half | BFloat16),
            _ => false,
        }
}

/// A CPU tensor's values as the datatype's [`TensorData`]; the tensor is of its kind.
fn tensor_data(t: &Tensor, datatype: DataType) -> Result<TensorData, tch::TchError> {
    Ok(match datatype {
        DataType::Bool => TensorData::Bool(Vec::try_from(t)?),
        DataType::Uint8 => TensorData::Uint8(Vec::try_from(t)?),
        DataType::Int32 => TensorData::Int32(Vec::try_from(t)?),
        DataType::Int64 => TensorData::Int64(Vec::try_from(t)?),
        // The bits as they are: a view as 16-bit integers reinterprets, it does not convert.
        DataType::Fp16 => {
            let bits = Vec::<i16>::try_from(&t.f_view_dtype(Kind::Int16)?)?;
            TensorData::Fp16(bits.into_iter().map(|b| F16::from_bits(b as u16)).collect())
        }
        DataType::Fp32 => TensorData::Fp32(Vec::try_from(t)?),
        other => return Err(tch::TchError::Kind(format!("no libtorch kind for datatype {other}"))),
    })
}

/// A constant argument as TorchScript takes it.
fn ivalue(arg: &ConstArg) -> IValue {
    match *arg {
        ConstArg::Int(n) => IValue::Int(n),
        ConstArg::Float(x) => IValue::Double(x),
        ConstArg::Bool(b) => IValue::Bool(b),
    }
}

/// A tensor a model takes or gives, as OIP metadata shows it (`-1`: a variable dimension).
/// The name is shared with every [`OutputTensor`] of it, so answers copy no string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: Arc<str>,
    pub shape: Vec<i64>,
    /// One of the datatypes [`tensor_kind`] knows.
    pub datatype: DataType,
}

impl TensorSpec {
    /// An FP32 tensor (every tensor of the built-in kinds).
    fn new(name: &str, shape: &[i64]) -> TensorSpec {
        TensorSpec { name: name.into(), shape: shape.to_vec(), datatype: DataType::Fp32 }
    }

    /// Refuses an input sent in another datatype than this one, naming both.
    /// Whether a tensor sent as `name` (the request's own name for it) has this datatype.
    pub fn check_datatype(&self, name: &str, sent: DataType) -> Result<(), ModelError> {
        if sent == self.datatype {
            return Ok(());
        }
        Err(ModelError::BadInput(format!("input '{name}' must be {}, got {sent}", self.datatype)))
    }

    fn kind(&self) -> Kind {
        tensor_kind(self.datatype).unwrap_or(Kind::Float)
    }
}

/// A model's output, row-major in its datatype, with its shape.
#[derive(Debug, Clone)]
pub struct OutputTensor {
    pub name: Arc<str>,
    pub shape: Vec<usize>,
    pub data: TensorData,
}

pub struct Model {
    config: ModelConfig,
    device: Device,
    /// The one input and the outputs, in the order [`Model::infer_batch`] returns them.
    input: TensorSpec,
    outputs: Vec<TensorSpec>,
    /// One loaded copy per configured instance; a batch runs on whichever is free.
    modules: Vec<Mutex<CModule>>,
}

/// A model's input and outputs: written here for the two built-in kinds, the config entry's
/// for `declared` (which `config.rs` validated; a config built in code is checked here too).
fn tensor_specs(config: &ModelConfig) -> Result<(TensorSpec, Vec<TensorSpec>), String> {
    Ok(match config.kind {
        ModelKind::VoiceActivity => (TensorSpec::new("audio", &[-1, -1]), vec![TensorSpec::new("speech_prob", &[-1, -1])]),
        ModelKind::FaceDetection => (
            TensorSpec::new("image", &[-1, 3, -1, -1]),
            vec![TensorSpec::new("face_prob", &[-1, -1, -1]), TensorSpec::new("box_offsets", &[-1, 4, -1, -1])],
        ),
        ModelKind::Declared => {
            let spec = |t: &DeclaredTensor| TensorSpec { name: t.name.as_str().into(), shape: t.shape.clone(), datatype: t.datatype };
            let input = config.input.as_ref().map(spec).ok_or("kind 'declared' needs an input")?;
            let outputs: Vec<TensorSpec> = config.outputs.iter().flatten().map(spec).collect();
            if outputs.is_empty() {
                return Err("kind 'declared' needs at least one output".into());
            }
            let mut all = std::iter::once(&input).chain(&outputs);
            if all.clone().any(|t| t.shape.first() != Some(&-1)) {
                return Err("a declared tensor's first dimension must be -1 (the batch)".into());
            }
            if let Some(t) = all.find(|t| tensor_kind(t.datatype).is_none()) {
                return Err(format!("tensor '{}' is declared {}, which no model here takes or gives", t.name, t.datatype));
            }
            (input, outputs)
        }
    })
}

impl Model {
    /// Loads the TorchScript file onto `device` and runs one warm-up call.
    pub fn load(config: ModelConfig, device: ComputeDevice) -> Result<Model, ModelError> {
        let device = device.tch();
        let started = Instant::now();
        let (name, path) = (config.name.clone(), config.path.display().to_string());
        let load_err = |message: String| ModelError::Load { name: name.clone(), path: path.clone(), message };
        let (input, outputs) = tensor_specs(&config).map_err(load_err)?;
        let mut modules = Vec::new();
        for _ in 0..config.instances.max(1) {
            let mut module = CModule::load_on_device(&config.path, device)
                .map_err(|e| load_err(first_line(&e.to_string())))?;
            module.set_eval();
            modules.push(Mutex::new(module));
        }
        let model = Model { config, device, input, outputs, modules };
        let probe = model.probe_input(1, model.smallest_probe());
        model.infer(&probe).map_err(|e| {
            load_err(format!(
                "warm-up call of method '{}' with input '{}' of datatype {} and shape {:?} failed: {e}",
                model.method(),
                model.input.name,
                model.input.datatype,
                probe.shape
            ))
        })?;
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
    pub fn input_spec(&self) -> &TensorSpec {
        &self.input
    }

    /// The model's output tensors, in the order [`Model::infer_batch`] returns them.
    pub fn output_specs(&self) -> &[TensorSpec] {
        &self.outputs
    }

    /// The TorchScript method a batch is run through.
    fn method(&self) -> &str {
        match self.config.kind {
            ModelKind::VoiceActivity => "audio_forward",
            ModelKind::FaceDetection => "forward",
            ModelKind::Declared => self.config.method(),
        }
    }

    /// For `declared`: whether every non-batch input dimension is fixed, so that inputs differ
    /// only in rows and a probe's size is a row multiplier.
    fn rows_only(&self) -> bool {
        self.input.shape[1..].iter().all(|&d| d > 0)
    }

    /// For `declared`: the probe sizes of the variable dimensions, ascending.
    fn declared_probe_sizes(&self) -> Vec<usize> {
        let mut sizes = self.config.probe_sizes().to_vec();
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    fn smallest_probe(&self) -> usize {
        match self.config.kind {
            ModelKind::VoiceActivity => self.config.sample_rate_hz as usize,
            ModelKind::FaceDetection => 64,
            ModelKind::Declared if self.rows_only() => 1,
            ModelKind::Declared => self.declared_probe_sizes().first().copied().unwrap_or(DEFAULT_PROBE_SIZES[0]),
        }
    }

    /// The probe inputs of the start-up memory calibration, small to large: three sizes, each
    /// at batch 1 and 2 (sizes: 1, 4 and 16 s of audio; 128², 256² and 512² images; for a
    /// `declared` model 1, 8 and 32 rows when its other dimensions are fixed, else its probe
    /// sizes, with batch 4 too when it names only one, as the fit needs three probes).
    pub fn calibration_inputs(&self) -> Vec<InputTensor> {
        let (sizes, batches): (Vec<usize>, &[usize]) = match self.config.kind {
            ModelKind::VoiceActivity => {
                let sr = self.config.sample_rate_hz as usize;
                (vec![sr, 4 * sr, 16 * sr], &[1, 2])
            }
            ModelKind::FaceDetection => (vec![128, 256, 512], &[1, 2]),
            ModelKind::Declared if self.rows_only() => (vec![1, 8, 32], &[1, 2]),
            ModelKind::Declared => {
                let sizes = self.declared_probe_sizes();
                let batches: &[usize] = if sizes.len() == 1 { &[1, 2, 4] } else { &[1, 2] };
                (sizes, batches)
            }
        };
        let mut probes = Vec::new();
        for size in sizes {
            for &batch in batches {
                let probe = self.probe_input(batch, size);
                if probe.elements() <= self.config.max_input_elements as u64 {
                    probes.push(probe);
                }
            }
        }
        probes
    }

    /// The input sizes the start-up throughput calibration times (see `batching.rs`), small to
    /// large: 1 and 4 s of audio; 64², 128², 256² and 512² images; a `declared` model's probe
    /// sizes. Each size is one size class; sizes between them take the nearest class's
    /// figures until measured online. A `declared` model whose non-batch dimensions are all
    /// fixed has one class (the sizer's classes are by elements per row, and all its rows are
    /// alike), so it is timed at one row per item only: a larger row multiplier would file
    /// `size` rows as one item of a class no request ever falls in.
    pub fn batching_probe_sizes(&self) -> Vec<usize> {
        let sizes = match self.config.kind {
            ModelKind::VoiceActivity => {
                let sr = self.config.sample_rate_hz as usize;
                vec![sr, 4 * sr]
            }
            ModelKind::FaceDetection => vec![64, 128, 256, 512],
            ModelKind::Declared if self.rows_only() => vec![1],
            ModelKind::Declared => self.declared_probe_sizes(),
        };
        sizes.into_iter().filter(|&size| self.probe_input_elements(1, size) <= self.config.max_input_elements).collect()
    }

    /// How many elements [`Model::probe_input`] holds for `batch` rows of `size`.
    pub fn probe_input_elements(&self, batch: usize, size: usize) -> usize {
        match self.config.kind {
            ModelKind::VoiceActivity => batch * size,
            ModelKind::FaceDetection => batch * 3 * size * size,
            ModelKind::Declared => self.declared_probe_shape(batch, size).iter().product(),
        }
    }

    /// For `declared`: the shape of a probe of `batch` at `size`: `batch × size` rows of the
    /// declared shape when it is fixed, else `batch` rows with every variable dimension `size`.
    fn declared_probe_shape(&self, batch: usize, size: usize) -> Vec<usize> {
        let rows = if self.rows_only() { batch * size } else { batch };
        std::iter::once(rows).chain(self.input.shape[1..].iter().map(|&d| if d > 0 { d as usize } else { size })).collect()
    }

    /// A deterministic, non-trivial input of `batch` rows: a quiet tone of `size` samples for
    /// audio, a gradient of `size`² pixels for images; for a `declared` model of a float
    /// datatype a gradient from 1 down to above -1 along each row, of an integer or BOOL one
    /// 0 and 1 in turn along each row (never all zeros, whatever the shape; valid as an index
    /// into anything of two entries or more).
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
            ModelKind::Declared => {
                let shape = self.declared_probe_shape(batch, size);
                let per_row = shape[1..].iter().product::<usize>().max(1);
                let at = (0..shape.iter().product::<usize>()).map(|i| i % per_row);
                let gradient = at.clone().map(|i| 1.0 - 2.0 * i as f64 / per_row as f64);
                let parity = at.map(|i| (i % 2) as u8);
                let data = match self.input.datatype {
                    DataType::Bool => TensorData::Bool(parity.map(|p| p == 1).collect()),
                    DataType::Uint8 => TensorData::Uint8(parity.collect()),
                    DataType::Int32 => TensorData::Int32(parity.map(i32::from).collect()),
                    DataType::Int64 => TensorData::Int64(parity.map(i64::from).collect()),
                    DataType::Fp16 => TensorData::Fp16(gradient.map(|x| F16::from_f64(x).unwrap_or_default()).collect()),
                    _ => TensorData::Fp32(gradient.map(|x| x as f32).collect()),
                };
                InputTensor::from_data(shape, &data)
            }
        }
    }

    /// Whether inputs of different sizes may share a batch, padded (see `engine.rs`): audio
    /// yes (Silero runs forward in time, so trailing silence leaves earlier windows as they
    /// were), images no (ceil-mode pooling sees the padding at a smaller image's edge),
    /// `declared` models no (nothing says what padding would do to them).
    pub fn can_pad(&self) -> bool {
        match self.config.kind {
            ModelKind::VoiceActivity => true,
            ModelKind::FaceDetection | ModelKind::Declared => false,
        }
    }

    /// Checks an input's datatype and shape against what the model takes, before any libtorch
    /// call.
    pub fn validate(&self, input: &InputTensor) -> Result<(), ModelError> {
        self.input.check_datatype(&self.input.name, input.datatype)?;
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
            ModelKind::Declared => {
                let declared = &self.input.shape;
                let fits = input.shape.len() == declared.len()
                    && input.shape.first().is_some_and(|&rows| rows >= 1)
                    && input.shape.iter().zip(declared).skip(1).all(|(&n, &d)| if d > 0 { n as i64 == d } else { n >= 1 });
                if !fits {
                    return Err(ModelError::BadInput(format!(
                        "input '{}' must have shape {declared:?} (-1: any size), got {:?}",
                        self.input.name, input.shape
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
            // Never padded: each output is the rows of the returned tensor (`infer_unchecked`).
            ModelKind::Declared => Vec::new(),
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
        if self.config.kind == ModelKind::Declared && inputs.windows(2).any(|w| w[0].shape[1..] != w[1].shape[1..]) {
            // The engine never forms such a batch (`can_pad`); outputs could not be split.
            return Err(ModelError::BadInput(format!(
                "model '{}' batches only inputs of one shape but rows alone, got {:?}",
                self.config.name,
                inputs.iter().map(|i| &i.shape).collect::<Vec<_>>()
            )));
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
        let raw = tch::no_grad(|| -> Result<Vec<Tensor>, ModelError> {
            let x = batch_input.f_to_device(self.device).map_err(failed)?;
            match self.config.kind {
                ModelKind::VoiceActivity => {
                    let sr = IValue::Int(i64::from(self.config.sample_rate_hz));
                    match module.method_is("audio_forward", &[IValue::Tensor(x), sr]).map_err(failed)? {
                        IValue::Tensor(t) => Ok(vec![t]),
                        other => Err(failed(tch::TchError::Kind(format!("audio_forward returned {other:?}, expected a tensor")))),
                    }
                }
                ModelKind::FaceDetection => match module.forward_is(&[IValue::Tensor(x)]).map_err(failed)? {
                    IValue::Tuple(mut parts) if parts.len() == 2 => {
                        let (Some(IValue::Tensor(probs)), Some(IValue::Tensor(boxes))) = (parts.pop(), parts.pop()) else {
                            return Err(failed(tch::TchError::Kind("forward must return (boxes, probs) tensors".into())));
                        };
                        Ok(vec![probs.f_select(1, 1).map_err(failed)?, boxes])
                    }
                    other => Err(failed(tch::TchError::Kind(format!("forward returned {other:?}, expected (boxes, probs)")))),
                },
                ModelKind::Declared => {
                    let method = self.method();
                    let in_method = |e: ModelError| match e {
                        ModelError::Runtime { name, message } => {
                            ModelError::Runtime { name, message: format!("method '{method}': {message}") }
                        }
                        other => other,
                    };
                    let args: Vec<IValue> = std::iter::once(IValue::Tensor(x)).chain(self.config.args().iter().map(ivalue)).collect();
                    let returned = module.method_is(method, &args).map_err(|e| in_method(failed(e)))?;
                    let tensors = returned_tensors(returned).map_err(|message| self.declared_error(&message))?;
                    self.check_declared_outputs(&tensors, shape[0])?;
                    Ok(tensors)
                }
            }
        })?;
        drop(module);
        drop(batch_input);

        // Each in its declared kind (a declared model's outputs were checked to widen into it
        // exactly; the built-in kinds' are FP32 whatever the module returns).
        let specs = self.output_specs();
        let raw: Vec<Tensor> = raw
            .into_iter()
            .zip(specs)
            .map(|(t, spec)| t.f_to_kind(spec.kind()).and_then(|t| t.f_to_device(Device::Cpu)))
            .collect::<Result<_, _>>()
            .map_err(failed)?;
        let mut row = 0i64;
        let mut per_request = Vec::with_capacity(inputs.len());
        for input in inputs {
            let rows = input.shape[0] as i64;
            let wants = match self.config.kind {
                // Unpadded: the returned tensors' own dimensions, this request's rows.
                ModelKind::Declared => raw
                    .iter()
                    .map(|t| std::iter::once(input.shape[0]).chain(t.size().into_iter().skip(1).map(|d| d as usize)).collect())
                    .collect(),
                _ => self.output_shapes(&input.shape),
            };
            let mut outputs = Vec::with_capacity(specs.len());
            for ((spec, tensor), want) in specs.iter().zip(&raw).zip(wants) {
                let mut t = tensor.f_narrow(0, row, rows).map_err(failed)?;
                for (dim, &n) in want.iter().enumerate().skip(1) {
                    t = t.f_narrow(dim as i64, 0, n as i64).map_err(failed)?;
                }
                let flat = t.f_contiguous().and_then(|t| t.f_reshape([-1])).map_err(failed)?;
                let data = tensor_data(&flat, spec.datatype).map_err(failed)?;
                outputs.push(OutputTensor { name: spec.name.clone(), shape: want, data });
            }
            row += rows;
            per_request.push(outputs);
        }
        Ok(per_request)
    }

    /// A `declared` model's method returned something its declaration does not allow.
    fn declared_error(&self, message: &str) -> ModelError {
        ModelError::Runtime { name: self.config.name.clone(), message: format!("method '{}' {message}", self.method()) }
    }

    /// Checks a `declared` model's returned tensors against its declared outputs: as many,
    /// each of the declared rank, `rows` rows, the declared size in each fixed dimension, and
    /// of the declared datatype's kind or one that widens into it exactly.
    fn check_declared_outputs(&self, tensors: &[Tensor], rows: usize) -> Result<(), ModelError> {
        let names = || self.outputs.iter().map(|o| &*o.name).collect::<Vec<_>>().join(", ");
        if tensors.len() != self.outputs.len() {
            return Err(self.declared_error(&format!(
                "returned {} tensor{}, but {} output{} declared ({})",
                tensors.len(),
                if tensors.len() == 1 { "" } else { "s" },
                self.outputs.len(),
                if self.outputs.len() == 1 { " is" } else { "s are" },
                names()
            )));
        }
        for (spec, tensor) in self.outputs.iter().zip(tensors) {
            let got = tensor.size();
            let fits = got.len() == spec.shape.len()
                && got[0] == rows as i64
                && got.iter().zip(&spec.shape).skip(1).all(|(&n, &d)| d < 0 || n == d);
            if !fits {
                let why = if got.len() != spec.shape.len() {
                    "its rank differs".to_string()
                } else if got[0] != rows as i64 {
                    format!("its first dimension is not the batch's {rows} rows")
                } else {
                    "a fixed dimension differs".to_string()
                };
                return Err(self.declared_error(&format!(
                    "returned output '{}' of shape {got:?}, declared {:?} (-1: any size): {why}",
                    spec.name, spec.shape
                )));
            }
            let kind = tensor.kind();
            if !widens_exactly(kind, spec.kind()) {
                return Err(self.declared_error(&format!(
                    "returned output '{}' as {kind:?}, declared {}: only a kind that converts exactly is converted \
                     (declare the datatype the model returns, or convert in the model)",
                    spec.name, spec.datatype
                )));
            }
        }
        Ok(())
    }
}

/// The tensors a method returned: one tensor, or a tuple or list of tensors; else what was
/// returned instead, for the error.
fn returned_tensors(value: IValue) -> Result<Vec<Tensor>, String> {
    match value {
        IValue::Tensor(t) => Ok(vec![t]),
        IValue::TensorList(ts) => Ok(ts),
        IValue::Tuple(parts) | IValue::GenericList(parts) => parts
            .into_iter()
            .enumerate()
            .map(|(i, part)| match part {
                IValue::Tensor(t) => Ok(t),
                other => Err(format!("returned {} at position {i} where a tensor was expected", describe(&other))),
            })
            .collect(),
        other => Err(format!("returned {}, expected a tensor or a tuple or list of tensors", describe(&other))),
    }
}

/// What kind of value an `IValue` is, in words (its `Debug` may print a whole tensor).
fn describe(value: &IValue) -> String {
    match value {
        IValue::None => "None".into(),
        IValue::Tensor(_) => "a tensor".into(),
        IValue::Double(_) => "a float".into(),
        IValue::Int(_) => "an int".into(),
        IValue::Bool(_) => "a bool".into(),
        IValue::Tuple(v) => format!("a tuple of {} values", v.len()),
        IValue::IntList(v) => format!("a list of {} ints", v.len()),
        IValue::DoubleList(v) => format!("a list of {} floats", v.len()),
        IValue::BoolList(v) => format!("a list of {} bools", v.len()),
        IValue::String(_) => "a string".into(),
        IValue::StringList(v) => format!("a list of {} strings", v.len()),
        IValue::TensorList(v) => format!("a list of {} tensors", v.len()),
        IValue::GenericList(v) => format!("a list of {} values", v.len()),
        IValue::GenericDict(v) => format!("a dict of {} entries", v.len()),
        IValue::Object(_) => "an object".into(),
        IValue::Device(_) => "a device".into(),
        _ => "a value of another type".into(),
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
    let kind = tensor_kind(inputs[0].datatype).unwrap_or(Kind::Float);
    let batch = Tensor::f_zeros(&dims, (kind, Device::Cpu))?;
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

/// Models of the repository's `models/` folder for the crate's tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::path::{Path, PathBuf};

    use figment::providers::{Format, Toml};

    use super::*;
    use crate::config::DeviceChoice;

    /// A file of `models/` (exported by `scripts/setup`).
    pub fn model_file(file: &str) -> PathBuf {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models").join(file);
        assert!(path.is_file(), "{} missing: run scripts/setup", path.display());
        path
    }

    /// A `[[models]]` entry of the file at `path` named `name`, of `kind`, with more `keys`.
    pub fn entry(path: &Path, name: &str, kind: &str, keys: &str) -> ModelConfig {
        let text = format!("name = \"{name}\"\npath = \"{}\"\nkind = \"{kind}\"\n{keys}\n", path.display());
        figment::Figment::from(Toml::string(&text)).extract().expect("a model entry")
    }

    /// A `[[models]]` entry of `mtcnn_pnet.jit` named `name`, of `kind`, with more `keys`.
    pub fn pnet_entry(name: &str, kind: &str, keys: &str) -> ModelConfig {
        entry(&model_file("mtcnn_pnet.jit"), name, kind, keys)
    }

    /// A TorchScript module of one UINT8 input `x` `[rows, n]` and one output, `f(x)`, traced
    /// here (`models/` has no model of an integer input) and saved under the temp folder as
    /// `name` (a traced module may return only one tensor to be saved).
    fn traced_uint8_model(name: &str, f: fn(&Tensor) -> Tensor) -> PathBuf {
        let example = Tensor::from_slice(&[0u8, 100, 200, 255, 128, 127]).reshape([2, 3]);
        let module = CModule::create_by_tracing(name, "forward", &[example], &mut |x| vec![f(&x[0])]).expect("a traced module");
        let path = std::env::temp_dir().join(format!("vramgate-{name}-{}.jit", std::process::id()));
        module.save(&path).expect("the traced module saved");
        path
    }

    /// A module of a UINT8 input `x` `[rows, n]` answering `x > 127` (BOOL, `[rows, n]`).
    pub fn bright_model() -> &'static Path {
        static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
        PATH.get_or_init(|| traced_uint8_model("bright", |x| x.gt(127)))
    }

    /// A module of a UINT8 input `x` `[rows, n]` answering each row's sum (INT64, `[rows, 1]`).
    pub fn row_sum_model() -> &'static Path {
        static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
        PATH.get_or_init(|| traced_uint8_model("row_sum", |x| x.to_kind(Kind::Int64).sum_dim_intlist(1, true, Kind::Int64)))
    }

    /// [`bright_model`] declared: input `pixels` (UINT8), output `bright` (BOOL).
    pub const DECLARED_BRIGHT: &str = "input = { name = \"pixels\", shape = [-1, -1], datatype = \"UINT8\" }\n\
        outputs = [ { name = \"bright\", shape = [-1, -1], datatype = \"BOOL\" } ]\n";

    /// Loads `config` on the CPU with the worker's libtorch settings.
    pub fn load(config: ModelConfig) -> Result<Model, ModelError> {
        let device = init_torch(DeviceChoice::Cpu, 1)?;
        Model::load(config, device)
    }

    /// P-Net declared with its own tensors: its image, box offsets and both probabilities.
    pub const DECLARED_PNET: &str = "input = { name = \"image\", shape = [-1, 3, -1, -1] }\n\
        outputs = [ { name = \"box_offsets\", shape = [-1, 4, -1, -1] }, { name = \"probs\", shape = [-1, 2, -1, -1] } ]\n";
}

#[cfg(test)]
mod tests {
    use super::testing::{load, pnet_entry, DECLARED_PNET};
    use super::*;

    /// An image of `rows` × 3 × `h` × `w`, a gradient shifted by `seed`.
    fn image(rows: usize, h: usize, w: usize, seed: f32) -> InputTensor {
        let n = rows * 3 * h * w;
        let data: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37 + seed).sin() * 0.8).collect();
        InputTensor::from_f32(vec![rows, 3, h, w], &data)
    }

    fn bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|v| v.to_bits()).collect()
    }

    /// An output's values, which must be FP32.
    fn fp32(data: &TensorData) -> &[f32] {
        match data {
            TensorData::Fp32(values) => values,
            other => panic!("an FP32 output, got {}", other.datatype()),
        }
    }

    #[test]
    fn declared_pnet_answers_what_face_detection_answers_bit_for_bit() {
        let built_in = load(pnet_entry("pnet", "face_detection", "")).expect("P-Net as face_detection");
        let declared = load(pnet_entry("pnet_declared", "declared", DECLARED_PNET)).expect("P-Net declared");
        assert_eq!(declared.input_spec(), &TensorSpec::new("image", &[-1, 3, -1, -1]));
        assert_eq!(
            declared.output_specs(),
            [TensorSpec::new("box_offsets", &[-1, 4, -1, -1]), TensorSpec::new("probs", &[-1, 2, -1, -1])]
        );
        let small = declared.probe_input(1, 24);
        assert_eq!(small.shape, [1, 3, 24, 24]);
        let (two, wide) = (image(2, 24, 24, 1.0), image(1, 30, 40, 2.0));
        for batch in [vec![&small, &two], vec![&wide]] {
            let want = built_in.infer_batch(&batch).expect("face_detection");
            let got = declared.infer_batch(&batch).expect("declared");
            for ((input, want), got) in batch.iter().zip(&want).zip(&got) {
                let [face_prob, boxes] = &want[..] else { panic!("face_detection answers two tensors") };
                let [box_offsets, probs] = &got[..] else { panic!("two declared outputs") };
                assert_eq!((&*box_offsets.name, &*probs.name), ("box_offsets", "probs"));
                assert_eq!(box_offsets.shape, boxes.shape, "{:?}", input.shape);
                assert_eq!(bits(fp32(&box_offsets.data)), bits(fp32(&boxes.data)), "{:?}", input.shape);
                let [rows, h, w] = face_prob.shape[..] else { panic!("face_prob is [rows, h, w]") };
                assert_eq!(probs.shape, [rows, 2, h, w]);
                let channel_1: Vec<f32> = fp32(&probs.data).chunks(h * w).skip(1).step_by(2).flatten().copied().collect();
                assert_eq!(bits(&channel_1), bits(fp32(&face_prob.data)), "{:?}", input.shape);
            }
        }
        let err = declared.infer_batch(&[&small, &wide]).expect_err("two shapes in one batch");
        assert!(err.to_string().contains("batches only inputs of one shape"), "{err}");
    }

    #[test]
    fn declared_inputs_must_fit_the_declared_shape() {
        // P-Net at 24² only: every non-batch dimension fixed.
        let keys = "input = { name = \"image\", shape = [-1, 3, 24, 24] }\n\
            outputs = [ { name = \"box_offsets\", shape = [-1, 4, 7, 7] }, { name = \"probs\", shape = [-1, 2, 7, 7] } ]\n\
            max_input_elements = 6912\n";
        let model = load(pnet_entry("pnet24", "declared", keys)).expect("P-Net at 24²");
        let check = |shape: &[usize], want: Result<(), String>| {
            let elements = shape.iter().product::<usize>();
            let input = InputTensor::from_f32(shape.to_vec(), &vec![0.5; elements]);
            match (model.validate(&input), want) {
                (Ok(()), Ok(())) => {}
                (Err(ModelError::BadInput(got)), Err(want)) => assert_eq!(got, want, "{shape:?}"),
                (got, want) => panic!("{shape:?}: got {got:?}, want {want:?}"),
            }
        };
        let wrong = |got: &str| format!("input 'image' must have shape [-1, 3, 24, 24] (-1: any size), got {got}");
        check(&[1, 3, 24, 24], Ok(()));
        check(&[4, 3, 24, 24], Ok(()));
        check(&[2, 3, 25, 24], Err(wrong("[2, 3, 25, 24]")));
        check(&[0, 3, 24, 24], Err(wrong("[0, 3, 24, 24]")));
        check(&[3, 24, 24], Err(wrong("[3, 24, 24]")));
        check(&[1, 1, 3, 24, 24], Err(wrong("[1, 1, 3, 24, 24]")));
        check(&[], Err(wrong("[]")));
        check(&[5, 3, 24, 24], Err("input has 8640 elements, more than this model's limit of 6912".into()));

        // Fixed dimensions: a probe's size multiplies rows.
        let probe = model.probe_input(2, 8);
        assert_eq!(probe.shape, [16, 3, 24, 24]);
        assert_eq!(model.probe_input_elements(2, 8), 16 * 1728);
        let rows = |probes: Vec<InputTensor>| probes.iter().map(|p| p.shape[0]).collect::<Vec<_>>();
        assert_eq!(rows(model.calibration_inputs()), [1, 2], "filtered by max_input_elements (4 rows)");
        assert_eq!(model.batching_probe_sizes(), [1]);
        let unbounded = load(pnet_entry("pnet24", "declared", &keys.replace("6912", "100000000"))).expect("no limit");
        let outputs = unbounded.infer(&probe).expect("16 rows");
        assert_eq!(outputs.iter().map(|o| o.shape.clone()).collect::<Vec<_>>(), [vec![16, 4, 7, 7], vec![16, 2, 7, 7]]);
        assert_eq!(rows(unbounded.calibration_inputs()), [1, 2, 8, 16, 32, 64]);
        for p in unbounded.calibration_inputs() {
            let values: Vec<f32> = p.le_bytes().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            assert!(values.iter().all(|v| (-1.0..=1.0).contains(v)) && values.iter().any(|&v| v != 0.0));
            assert_eq!(p.elements(), unbounded.probe_input_elements(p.shape[0], 1) as u64);
        }
    }

    #[test]
    fn variable_dimensions_take_the_probe_sizes() {
        let model = load(pnet_entry("pnet", "declared", &format!("{DECLARED_PNET}probe_sizes = [48, 16]\n"))).expect("P-Net");
        assert_eq!(model.probe_input(2, 16).shape, [2, 3, 16, 16]);
        assert_eq!(model.probe_input_elements(2, 16), 2 * 3 * 256);
        assert_eq!(model.batching_probe_sizes(), [16, 48]);
        let shapes: Vec<Vec<usize>> = model.calibration_inputs().into_iter().map(|p| p.shape).collect();
        assert_eq!(shapes, [[1, 3, 16, 16], [2, 3, 16, 16], [1, 3, 48, 48], [2, 3, 48, 48]]);
        let one = load(pnet_entry("pnet", "declared", &format!("{DECLARED_PNET}probe_sizes = [20]\n"))).expect("P-Net");
        let rows: Vec<usize> = one.calibration_inputs().iter().map(|p| p.shape[0]).collect();
        assert_eq!(rows, [1, 2, 4], "three probes for the fit from one size");
        assert!(model.validate(&image(1, 12, 500, 0.0)).is_ok());
        let err = model.validate(&image(1, 0, 12, 0.0)).expect_err("an empty dimension").to_string();
        assert_eq!(err, "input 'image' must have shape [-1, 3, -1, -1] (-1: any size), got [1, 3, 0, 12]");
    }

    #[test]
    fn a_declared_model_that_refuses_its_declaration_stops_at_load() {
        let check = |keys: &str, wants: &[&str]| {
            let err = load(pnet_entry("wrong_pnet", "declared", keys)).err().expect("refused at load").to_string();
            assert!(err.starts_with("loading model 'wrong_pnet' from "), "{err}");
            for want in wants {
                assert!(err.contains(want), "want {want:?} in: {err}");
            }
        };
        let image = "input = { name = \"image\", shape = [-1, 3, -1, -1] }\n";
        let boxes = "{ name = \"box_offsets\", shape = [-1, 4, -1, -1] }";
        check(
            &format!("{image}outputs = [ {boxes} ]\n"),
            &["method 'forward'", "shape [1, 3, 32, 32]", "returned 2 tensors, but 1 output is declared (box_offsets)"],
        );
        check(
            &format!("{DECLARED_PNET}method = \"detect\"\n"),
            &["warm-up call of method 'detect' with input 'image' of datatype FP32 and shape [1, 3, 32, 32] failed", "method 'detect': ", "detect"],
        );
        // P-Net's convolutions take floats: declared UINT8, its warm-up fails and says why.
        check(
            &DECLARED_PNET.replace("-1, -1] }\n", "-1, -1], datatype = \"UINT8\" }\n"),
            &["warm-up call of method 'forward' with input 'image' of datatype UINT8 and shape [1, 3, 32, 32] failed", "method 'forward': "],
        );
        // Its outputs are FP32: declared narrower or integer, they are refused, not cast.
        for datatype in ["FP16", "INT64", "BOOL"] {
            check(
                &DECLARED_PNET.replace("[-1, 2, -1, -1] }", &format!("[-1, 2, -1, -1], datatype = \"{datatype}\" }}")),
                &[&format!("method 'forward' returned output 'probs' as Float, declared {datatype}: only a kind that converts exactly is converted")],
            );
        }
        // A constant argument the method does not take.
        check(&format!("{DECLARED_PNET}args = [16000]\n"), &["method 'forward': ", "argument"]);
        check(
            &DECLARED_PNET.replace("[-1, 3, -1, -1]", "[-1, 4, -1, -1]"),
            &["method 'forward'", "shape [1, 4, 32, 32]", "channels"],
        );
        check(
            &DECLARED_PNET.replace("[-1, 4, -1, -1]", "[-1, 4]"),
            &["returned output 'box_offsets' of shape [1, 4, 11, 11], declared [-1, 4] (-1: any size): its rank differs"],
        );
        check(
            &DECLARED_PNET.replace("[-1, 2, -1, -1]", "[-1, 3, -1, -1]"),
            &["returned output 'probs' of shape [1, 2, 11, 11], declared [-1, 3, -1, -1] (-1: any size): a fixed dimension differs"],
        );
        check(
            &DECLARED_PNET.replace(" ]", ", { name = \"extra\", shape = [-1] } ]"),
            &["returned 2 tensors, but 3 outputs are declared (box_offsets, probs, extra)"],
        );
    }

    #[test]
    fn only_tensors_or_sequences_of_them_are_outputs() {
        let t = || IValue::Tensor(Tensor::from_slice(&[1.0f32, 2.0]));
        assert_eq!(returned_tensors(t()).map(|v| v.len()), Ok(1));
        assert_eq!(returned_tensors(IValue::Tuple(vec![t(), t()])).map(|v| v.len()), Ok(2));
        assert_eq!(returned_tensors(IValue::GenericList(vec![t(), t(), t()])).map(|v| v.len()), Ok(3));
        assert_eq!(returned_tensors(IValue::TensorList(vec![Tensor::from_slice(&[1.0f32])])).map(|v| v.len()), Ok(1));
        assert_eq!(
            returned_tensors(IValue::Tuple(vec![t(), IValue::Int(3)])).map(|v| v.len()),
            Err("returned an int at position 1 where a tensor was expected".into())
        );
        assert_eq!(
            returned_tensors(IValue::GenericDict(vec![])).map(|v| v.len()),
            Err("returned a dict of 0 entries, expected a tensor or a tuple or list of tensors".into())
        );
    }

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
            let input = InputTensor::from_le_bytes(vec![1, 2, 3], DataType::Fp32, slice.clone()).expect("whole values");
            assert_eq!(input.elements(), 6);
            let tensor = input.to_tensor(&[1, 2, 3]).expect("a tensor");
            assert_eq!(tensor.size(), vec![1, 2, 3]);
            let back = Vec::<f32>::try_from(&tensor.reshape([-1])).expect("f32 values");
            let want: Vec<f32> = slice.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            assert_eq!(back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
        let aligned = InputTensor::from_le_bytes(vec![6], DataType::Fp32, bytes.slice(3..)).expect("whole values");
        assert_eq!(Vec::<f32>::try_from(&aligned.to_tensor(&[6]).expect("a tensor")).expect("f32"), values);
        let err = InputTensor::from_le_bytes(vec![6], DataType::Fp32, bytes.slice(3..26)).expect_err("23 bytes");
        assert_eq!(err.to_string(), "FP32 data must be a whole number of 4-byte values, got 23 bytes");
        let err = InputTensor::from_le_bytes(vec![3], DataType::Int64, bytes.slice(3..26)).expect_err("23 bytes");
        assert_eq!(err.to_string(), "INT64 data must be a whole number of 8-byte values, got 23 bytes");
        assert_eq!(InputTensor::from_f32(vec![6], &values).le_bytes(), &bytes[3..]);
    }

    #[test]
    fn declared_silero_with_a_constant_argument_answers_what_voice_activity_answers_bit_for_bit() {
        let path = super::testing::model_file("silero_vad.jit");
        let built_in = load(super::testing::entry(&path, "vad", "voice_activity", "")).expect("Silero as voice_activity");
        let keys = "method = \"audio_forward\"\nargs = [16000]\nprobe_sizes = [16000]\n\
            input = { name = \"audio\", shape = [-1, -1] }\noutputs = [ { name = \"speech_prob\", shape = [-1, -1] } ]\n";
        let declared = load(super::testing::entry(&path, "vad_declared", "declared", keys)).expect("Silero declared");
        assert_eq!(declared.input_spec(), built_in.input_spec());
        assert_eq!(declared.output_specs(), built_in.output_specs());
        for (rows, seconds) in [(1, 1), (1, 3), (2, 3)] {
            let samples = seconds * 16_000;
            // A tone that swells and fades, with a little noise: some windows speech-like, some not.
            let audio: Vec<f32> = (0..rows * samples)
                .map(|i| {
                    let t = (i % samples) as f32 / 16_000.0;
                    0.3 * (t * 3.0).sin().abs() * (t * 2.0 * std::f32::consts::PI * 220.0).sin() + 0.01 * (i as f32 * 12.9898).sin()
                })
                .collect();
            let input = InputTensor::from_f32(vec![rows, samples], &audio);
            let want = built_in.infer(&input).expect("voice_activity");
            let got = declared.infer(&input).expect("declared");
            let ([want], [got]) = (&want[..], &got[..]) else { panic!("one output each") };
            assert_eq!((&*got.name, &got.shape), (&*want.name, &want.shape), "{seconds} s × {rows}");
            assert_eq!(got.shape, [rows, samples.div_ceil(512)]);
            assert_eq!(bits(fp32(&got.data)), bits(fp32(&want.data)), "{seconds} s × {rows}");
        }
    }

    #[test]
    fn a_declared_model_takes_and_gives_other_datatypes() {
        use super::testing::{bright_model, entry, row_sum_model, DECLARED_BRIGHT};
        let bright = load(entry(bright_model(), "bright", "declared", DECLARED_BRIGHT)).expect("UINT8 in, BOOL out");
        assert_eq!((bright.input_spec().datatype, bright.output_specs()[0].datatype), (DataType::Uint8, DataType::Bool));
        let probe = bright.probe_input(2, 4);
        assert_eq!((probe.datatype(), probe.shape.clone(), probe.le_bytes()), (DataType::Uint8, vec![2, 4], &[0, 1, 0, 1, 0, 1, 0, 1][..]));
        let (a, b) = (
            InputTensor::from_data(vec![1, 3], &TensorData::Uint8(vec![0, 128, 255])),
            InputTensor::from_le_bytes(vec![2, 3], DataType::Uint8, Bytes::from_static(&[127, 1, 2, 200, 3, 4])).expect("6 bytes"),
        );
        let values = |answers: Vec<Vec<OutputTensor>>| -> Vec<(Vec<usize>, TensorData)> {
            answers.into_iter().flatten().map(|o| (o.shape, o.data)).collect()
        };
        assert_eq!(values(bright.infer_batch(&[&a, &b]).expect("a batch of two")), [
            (vec![1, 3], TensorData::Bool(vec![false, true, true])),
            (vec![2, 3], TensorData::Bool(vec![false, false, false, true, false, false])),
        ]);
        let err = bright.validate(&InputTensor::from_f32(vec![1, 3], &[0.0; 3])).expect_err("FP32 sent");
        assert_eq!(err.to_string(), "input 'pixels' must be UINT8, got FP32");

        let sum_keys = DECLARED_BRIGHT.replace("\"bright\", shape = [-1, -1], datatype = \"BOOL\"", "\"total\", shape = [-1, 1], datatype = \"INT64\"");
        let sum = load(entry(row_sum_model(), "sum", "declared", &sum_keys)).expect("UINT8 in, INT64 out");
        assert_eq!(values(sum.infer_batch(&[&a, &b]).expect("a batch of two")), [
            (vec![1, 1], TensorData::Int64(vec![383])),
            (vec![2, 1], TensorData::Int64(vec![130, 207])),
        ]);

        // An output whose kind widens exactly into the declared datatype is converted (BOOL
        // answered as UINT8, as FP32); a narrower declaration is refused at load.
        for (datatype, want) in [("UINT8", TensorData::Uint8(vec![0, 1, 1])), ("FP32", TensorData::Fp32(vec![0.0, 1.0, 1.0]))] {
            let keys = DECLARED_BRIGHT.replace("\"BOOL\"", &format!("\"{datatype}\""));
            let widened = load(entry(bright_model(), "bright", "declared", &keys)).expect(datatype);
            assert_eq!(widened.infer(&a).expect("an answer")[0].data, want);
        }
        let err = load(entry(row_sum_model(), "sum", "declared", &sum_keys.replace("INT64", "INT32"))).err().expect("INT64 as INT32");
        assert!(err.to_string().contains("method 'forward' returned output 'total' as Int64, declared INT32"), "{err}");
    }

    /// The values of every datatype a model takes, with their extremes.
    fn every_datatype() -> Vec<(TensorData, Kind)> {
        vec![
            (TensorData::Bool(vec![true, false, false, true, true, false]), Kind::Bool),
            (TensorData::Uint8(vec![0, 1, 127, 128, 254, 255]), Kind::Uint8),
            (TensorData::Int32(vec![i32::MIN, -1, 0, 1, 1 << 24 | 1, i32::MAX]), Kind::Int),
            (TensorData::Int64(vec![i64::MIN, -1, 0, 1, (1 << 53) + 1, i64::MAX]), Kind::Int64),
            // 1/3 (rounded), -0, the largest, the smallest subnormal, the smallest normal, -1.5.
            (TensorData::Fp16([0x3555u16, 0x8000, 0x7bff, 0x0001, 0x0400, 0xbe00].map(F16::from_bits).to_vec()), Kind::Half),
            (TensorData::Fp32(vec![0.1, -0.0, f32::MAX, f32::MIN_POSITIVE, 1e-45, -1.5]), Kind::Float),
        ]
    }

    #[test]
    fn every_datatype_goes_from_bytes_to_a_tensor_of_its_kind_and_back_unchanged() {
        for (values, kind) in every_datatype() {
            let datatype = values.datatype();
            let decoded = InputTensor::from_data(vec![2, 3], &values);
            let mut le = vec![0u8; 1];
            values.write_le_bytes(&mut le);
            // A binary input is a slice of the body at any alignment.
            let binary = InputTensor::from_le_bytes(vec![2, 3], datatype, Bytes::from(le).slice(1..)).expect("whole values");
            for input in [decoded, binary] {
                assert_eq!((input.datatype(), input.elements()), (datatype, 6));
                let tensor = input.to_tensor(&[2, 3]).expect("a tensor");
                assert_eq!((tensor.kind(), tensor.size()), (kind, vec![2, 3]), "{datatype}");
                let back = tensor_data(&tensor.reshape([-1]), datatype).expect("its values");
                assert_eq!(back, values, "{datatype}");
            }
        }
        // libtorch reads the FP16 bits as the values F16 says they are, and writes them back.
        let halves = [0x3555u16, 0x8000, 0x7bff, 0x0001, 0x0400, 0xbe00].map(F16::from_bits);
        let tensor = InputTensor::from_data(vec![6], &TensorData::Fp16(halves.to_vec())).to_tensor(&[6]).expect("FP16");
        let floats = Vec::<f32>::try_from(&tensor.to_kind(Kind::Float)).expect("as f32");
        assert_eq!(bits(&floats), bits(&halves.map(F16::to_f32)));
        let from_floats = Tensor::from_slice(&floats).to_kind(Kind::Half);
        assert_eq!(tensor_data(&from_floats, DataType::Fp16).expect("FP16 values"), TensorData::Fp16(halves.to_vec()));
        // BOOL: libtorch's own logic sees the values.
        let bools = InputTensor::from_data(vec![4], &TensorData::Bool(vec![true, false, true, true])).to_tensor(&[4]).expect("BOOL");
        assert_eq!(Vec::<bool>::try_from(&bools.logical_not()).expect("bools"), [false, true, false, false]);
        assert_eq!(i64::try_from(&bools.sum(Kind::Int64)).expect("a count"), 3);
        // Bytes that do not fill the shape never reach libtorch.
        let short = InputTensor::from_data(vec![2, 3], &TensorData::Int32(vec![1, 2, 3]));
        assert!(short.to_tensor(&[2, 3]).is_err());
    }

    #[test]
    fn only_exact_widenings_convert_an_output() {
        use Kind::*;
        let check = |to: Kind, widening: &[Kind]| {
            for from in [Bool, Uint8, Int8, Int16, Int, Int64, Half, BFloat16, Float, Double] {
                assert_eq!(widens_exactly(from, to), from == to || widening.contains(&from), "{from:?} → {to:?}");
            }
        };
        check(Bool, &[]);
        check(Uint8, &[Bool]);
        check(Int, &[Bool, Uint8, Int8, Int16]);
        check(Int64, &[Bool, Uint8, Int8, Int16, Int]);
        check(Half, &[Bool, Uint8, Int8]);
        check(Float, &[Bool, Uint8, Int8, Int16, Half, BFloat16]);
        // What a widening gives is the same values.
        for (values, kind) in every_datatype() {
            for (_, to) in every_datatype().into_iter().filter(|(_, to)| widens_exactly(kind, *to) && *to != kind) {
                let tensor = InputTensor::from_data(vec![6], &values).to_tensor(&[6]).expect("a tensor");
                let there_and_back = tensor.to_kind(to).to_kind(kind);
                assert_eq!(tensor_data(&there_and_back, values.datatype()).expect("values"), values, "{kind:?} → {to:?}");
            }
        }
    }

    #[test]
    fn first_line_drops_cpp_stack() {
        let msg = "\n  CUDA out of memory. Tried to allocate 2.00 GiB\nException raised from malloc at …\nframe #0: …";
        assert_eq!(first_line(msg), "CUDA out of memory. Tried to allocate 2.00 GiB");
    }
}
