//! TorchScript models through libtorch (`tch`). This is the only module in vramgate that
//! knows libtorch: the rest of the worker sees [`Model`], [`InputTensor`] and [`ModelError`].
//!
//! A model is loaded once, warmed up with a probe input (so the first request doesn't pay
//! TorchScript's compilation), and called from blocking threads. Calls into one loaded copy
//! are serialised by a mutex: a module may keep state inside it (Silero VAD's recurrent
//! state), so two concurrent calls into one copy could corrupt each other's results.
//! `instances` loads several copies, so that several batches of one model can run at once.
//!
//! No model has code of its own here: every model's tensors, method, constant arguments,
//! batching rule, minimum shape and probe sizes come from its config entry ([`TensorSpec`]s
//! built at load, each with its datatype). An input's bytes become a libtorch tensor of its
//! datatype's kind directly; an output is answered in its declared datatype, converted only
//! where that is exact (see [`widens_exactly`]).

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use tch::{CModule, Device, IValue, Kind, Tensor};
use vramgate_shared::oip::{DataType, TensorData, F16};
use vramgate_shared::telemetry::bounded;

use crate::config::{Batching, ConstArg, DeclaredTensor, DeviceChoice, ModelConfig};

#[derive(Debug, Clone, thiserror::Error)]
pub enum ModelError {
    #[error("loading model '{name}' from {path}: {message}")]
    Load { name: String, path: String, message: String },
    #[error("cuda was requested but libtorch sees no cuda device")]
    NoCuda,
    #[error("{0}")]
    BadInput(String),
    /// Well formed, but more elements than the model's `max_input_elements`: the input's size
    /// is what is wrong (413, as an input over the memory budget), not its form.
    #[error("{0}")]
    TooLarge(String),
    /// An allocation failed: the device (or the memory cap) had no room for this batch.
    #[error("model '{name}' ran out of memory: {message}")]
    OutOfMemory { name: String, message: String },
    #[error("model '{name}' failed: {message}")]
    Runtime { name: String, message: String },
    /// The model's own method raised on this input: neither an allocation failure nor a
    /// fault of the device ([`method_error`]). Run alone, the same input raises again on any
    /// worker: the input's fault, not the worker's.
    #[error("model '{name}' raised an error on this input: {message}")]
    Raised { name: String, message: String },
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

/// Where the last batch a thread ran spent its time, in seconds: building the batch's input
/// tensors on the host (`inputs`: on CUDA into the instance's pinned buffer); queueing their
/// copy to the device (`to_device`: on CUDA a non-blocking copy, so little); the model's call
/// (`model`: on CUDA up to the instance's stream being done, so the copy and the kernels);
/// and bringing the outputs back and splitting them per request (`outputs`). Read by the
/// engine right after [`Model::infer_batch`] on the same thread ([`last_phases`]), exported
/// as `inference_phase_seconds`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Phases {
    pub inputs: f64,
    pub to_device: f64,
    pub model: f64,
    pub outputs: f64,
}

impl Phases {
    /// Each phase with its metric label.
    pub fn labelled(&self) -> [(&'static str, f64); 4] {
        [("inputs", self.inputs), ("to_device", self.to_device), ("model", self.model), ("outputs", self.outputs)]
    }
}

thread_local! {
    static LAST_PHASES: std::cell::Cell<Phases> = const { std::cell::Cell::new(Phases { inputs: 0.0, to_device: 0.0, model: 0.0, outputs: 0.0 }) };
}

/// The phases of the last batch that ran to its outputs on this thread (zeros before any).
pub fn last_phases() -> Phases {
    LAST_PHASES.with(|p| p.get())
}

/// The process-wide libtorch settings ([`init_torch`]) that each model call applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TorchSettings {
    /// Calls run under `InferenceMode` (where the shim has it), else under `no_grad`.
    pub inference_mode: bool,
    /// The graph executor's optimisation, set on every thread that calls a model.
    pub jit_optimize: bool,
    /// cuDNN's autotuner.
    pub cudnn_benchmark: bool,
}

impl Default for TorchSettings {
    fn default() -> Self {
        TorchSettings { inference_mode: true, jit_optimize: true, cudnn_benchmark: false }
    }
}

static SETTINGS: std::sync::OnceLock<TorchSettings> = std::sync::OnceLock::new();

fn settings() -> TorchSettings {
    SETTINGS.get().copied().unwrap_or_default()
}

/// Picks the device once per process and applies process-wide libtorch settings.
pub fn init_torch(choice: DeviceChoice, threads: usize, torch: TorchSettings) -> Result<ComputeDevice, ModelError> {
    // The profiling executor re-specialises graphs over the first calls, which costs seconds
    // per new input shape on CPU; audio lengths vary per request, so it would never settle.
    // At a fixed shape both executors run equally fast (docs/performance-notes.md).
    tch::jit::set_profiling_mode(false);
    if threads > 0 {
        tch::set_num_threads(threads as i32);
    }
    // First set wins: one process, one set of settings (tests start several workers' engines
    // in one process with the defaults).
    let _ = SETTINGS.set(torch);
    prepare_thread_settings();
    let cuda = tch::Cuda::is_available();
    if cuda {
        tch::Cuda::cudnn_set_benchmark(settings().cudnn_benchmark);
    }
    match (choice, cuda) {
        (DeviceChoice::Cuda, false) => Err(ModelError::NoCuda),
        (DeviceChoice::Cpu, _) | (DeviceChoice::Auto, false) => Ok(ComputeDevice::Cpu),
        (DeviceChoice::Cuda | DeviceChoice::Auto, true) => Ok(ComputeDevice::Cuda(0)),
    }
}

/// Applies the thread-local settings of [`TorchSettings`] to the calling thread (libtorch keeps
/// the graph executor's optimisation per thread: a setting made on another thread does not
/// reach the one that runs the model).
fn prepare_thread_settings() {
    tch::jit::set_graph_executor_optimize(settings().jit_optimize);
}

/// Inference mode for one model call where it is on and the shim has it; `None` leaves the
/// call to `no_grad`.
fn inference_guard() -> Option<crate::cuda_memory::InferenceMode> {
    if settings().inference_mode {
        crate::cuda_memory::InferenceMode::enter()
    } else {
        None
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
            // Not `Tensor::f_from_data_size`: it fills a fresh tensor with zeros before copying
            // into it, a second pass over a request's whole input.
            let tensor = Tensor::f_empty(shape, (kind, Device::Cpu))?;
            if !self.data.is_empty() {
                // SAFETY: `tensor` is a fresh contiguous CPU tensor of `shape` and `kind`, whose
                // bytes were just checked to be `self.data.len()`; the two do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(self.data.as_ptr(), tensor.data_ptr().cast::<u8>(), self.data.len()) };
            }
            Ok(tensor)
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
        DataType::Bool => TensorData::Bool(host_values(t)?),
        DataType::Uint8 => TensorData::Uint8(host_values(t)?),
        DataType::Int32 => TensorData::Int32(host_values(t)?),
        DataType::Int64 => TensorData::Int64(host_values(t)?),
        // The bits as they are: a view as 16-bit integers reinterprets, it does not convert.
        DataType::Fp16 => {
            let bits = Vec::<i16>::try_from(&t.f_view_dtype(Kind::Int16)?)?;
            TensorData::Fp16(bits.into_iter().map(|b| F16::from_bits(b as u16)).collect())
        }
        DataType::Fp32 => TensorData::Fp32(host_values(t)?),
        other => return Err(tch::TchError::Kind(format!("no libtorch kind for datatype {other}"))),
    })
}

/// Marks the element types [`host_values`] may copy a tensor's bytes into: every bit pattern
/// libtorch stores for the kind is a valid value (a BOOL tensor holds only 0 and 1).
trait HostElement: tch::kind::Element + Copy {}
impl HostElement for bool {}
impl HostElement for u8 {}
impl HostElement for i32 {}
impl HostElement for i64 {}
impl HostElement for f32 {}

/// A tensor's values, copied once into a fresh vector. On every answer's path: tch's own
/// conversion fills the vector with zeros before copying into it (a second pass over the
/// output, and the one that pays the fresh pages' faults), so a contiguous CPU tensor of the
/// element's kind is copied straight into the vector's spare capacity; anything else goes
/// the tch way.
fn host_values<T: HostElement>(t: &Tensor) -> Result<Vec<T>, tch::TchError> {
    if t.device() != Device::Cpu || t.kind() != T::KIND || !t.is_contiguous() {
        return Vec::try_from(t);
    }
    let n = t.numel();
    let mut values = Vec::<T>::with_capacity(n);
    if n > 0 {
        // SAFETY: `t` is a contiguous CPU tensor of `n` elements of `T`'s kind, so `data_ptr`
        // (its first element, storage offset included) starts `n` valid values of `T`; the
        // vector has room for `n` and is a distinct allocation. `set_len` follows the copy
        // that initialised them.
        unsafe {
            std::ptr::copy_nonoverlapping(t.data_ptr().cast::<T>(), values.as_mut_ptr(), n);
            values.set_len(n);
        }
    }
    Ok(values)
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
    /// An input that may also be sent as UINT8 (`from_uint8`), converted on the device.
    pub accepts_uint8: bool,
}

impl TensorSpec {
    /// Whether a tensor sent as `name` (the request's own name for it) has this datatype (or
    /// UINT8, where the input takes it).
    pub fn check_datatype(&self, name: &str, sent: DataType) -> Result<(), ModelError> {
        if sent == self.datatype || (self.accepts_uint8 && sent == DataType::Uint8) {
            return Ok(());
        }
        let or_bytes = if self.accepts_uint8 { " (or UINT8, normalised on the device)" } else { "" };
        Err(ModelError::BadInput(format!("input '{name}' must be {}{or_bytes}, got {sent}", self.datatype)))
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

/// One request's inputs: a tensor per declared input, in the declared order. As the worker runs
/// them (after [`Model::accept`]), each has the batch (its rows) as dimension 0, and all have as
/// many rows.
#[derive(Debug, Clone)]
pub struct Inputs(Vec<InputTensor>);

impl Inputs {
    pub fn tensors(&self) -> &[InputTensor] {
        &self.0
    }

    /// The rows (dimension 0 of the first input): how many items of a batch it is.
    pub fn rows(&self) -> usize {
        self.0.first().and_then(|t| t.shape.first()).copied().unwrap_or(0)
    }

    /// Its elements, all inputs together.
    pub fn elements(&self) -> u64 {
        self.0.iter().map(InputTensor::elements).sum()
    }

    /// Rows `start..start + len` of every input (rows are dimension 0 of each, and every input
    /// has as many): a request of its own, sharing the bytes. `None` past its rows.
    pub fn row_range(&self, start: usize, len: usize) -> Option<Inputs> {
        let rows = self.rows();
        if len == 0 || start.checked_add(len)? > rows {
            return None;
        }
        let mut part = Vec::with_capacity(self.0.len());
        for t in &self.0 {
            if t.shape.first() != Some(&rows) || t.data.len() % rows != 0 {
                return None;
            }
            let row_bytes = t.data.len() / rows;
            let mut shape = t.shape.clone();
            shape[0] = len;
            part.push(InputTensor { shape, datatype: t.datatype, data: t.data.slice(start * row_bytes..(start + len) * row_bytes) });
        }
        Some(Inputs(part))
    }
}

/// The outputs of consecutive row ranges of one request, joined along the rows: what the
/// request as a whole would have been answered. Every other dimension must agree.
pub fn join_rows(mut first: Vec<OutputTensor>, next: Vec<OutputTensor>) -> Result<Vec<OutputTensor>, String> {
    if first.len() != next.len() {
        return Err(format!("parts answered {} and {} outputs", first.len(), next.len()));
    }
    for (a, b) in first.iter_mut().zip(next) {
        if a.name != b.name || a.shape.len() != b.shape.len() || a.shape.is_empty() || a.shape[1..] != b.shape[1..] {
            return Err(format!("output '{}': parts of shapes {:?} and {:?} do not join along their rows", a.name, a.shape, b.shape));
        }
        macro_rules! join {
            ($($variant:ident),*) => {
                match (&mut a.data, b.data) {
                    $((TensorData::$variant(x), TensorData::$variant(y)) => x.extend(y),)*
                    _ => return Err(format!("output '{}': parts answered different datatypes", a.name)),
                }
            };
        }
        join!(Bool, Uint8, Uint16, Uint32, Uint64, Int8, Int16, Int32, Int64, Fp16, Fp32, Fp64);
        a.shape[0] += b.shape[0];
    }
    Ok(first)
}

impl From<InputTensor> for Inputs {
    fn from(tensor: InputTensor) -> Inputs {
        Inputs(vec![tensor])
    }
}

/// A declared input as the worker runs it.
struct InputRule {
    /// As run: batch first (one added in front for a model without a batch dimension).
    spec: TensorSpec,
    /// How requests of different sizes batch, and what a padded input is filled with.
    batching: Batching,
    pad_value: f64,
    /// The step every variable non-batch dimension of a batch is rounded up to (1: none).
    bucket: usize,
    /// The smallest request shape taken, as run (1 where unset).
    min_shape: Vec<usize>,
    /// `(scale, offset)` of an input that may come as UINT8, applied on the device.
    from_uint8: Option<(f64, f64)>,
}

/// An output's variable dimension's size for one request, by dimensions as run (see
/// [`Follows`]).
#[derive(Debug, Clone, Copy)]
struct Rule {
    dim: usize,
    input: usize,
    input_dim: usize,
    divisor: u64,
}

pub struct Model {
    config: ModelConfig,
    device: Device,
    /// Whether the model itself takes the batch dimension (else `max_batch_size = 0`: each
    /// request runs alone, and the batch dimension is added before the call and taken off
    /// its answers here).
    batched: bool,
    /// The inputs, in the order the method takes them. Requests, batches and probes have
    /// their shapes as run.
    inputs: Vec<InputRule>,
    /// The outputs as run (batch first), in the order [`Model::infer_batch`] returns them.
    outputs: Vec<TensorSpec>,
    /// The inputs and outputs as declared, what metadata shows and answers have.
    shown_inputs: Vec<TensorSpec>,
    shown_outputs: Vec<TensorSpec>,
    /// Per output, the rules of its variable dimensions (for a padded input).
    follows: Vec<Vec<Rule>>,
    /// One loaded copy per configured instance; a batch runs on whichever is free.
    modules: Vec<Mutex<Instance>>,
    /// The batch sizes (rows) a batch is padded up to, ascending (empty: none); see
    /// [`ModelConfig::batch_buckets`].
    row_buckets: Vec<usize>,
}

/// One loaded copy of a model, and (on CUDA) the pinned host buffer its batches are built in.
struct Instance {
    module: CModule,
    /// Grown as needed, reused by every batch of this instance: a batch is copied into it
    /// once and sent to the device with one non-blocking copy. The next batch writes it only
    /// after this one's outputs came back on the same stream, so the copy is done by then.
    staging: Option<Tensor>,
}

/// The batch buckets of a model when its config names none: on CUDA 1, 2, 4, …, 64 up to its
/// `max_batch_size`; on the CPU none (see [`ModelConfig::batch_buckets`]).
fn default_row_buckets(config: &ModelConfig, device: Device) -> Vec<usize> {
    if !config.batched() || device == Device::Cpu {
        return Vec::new();
    }
    let bound = config.max_batch_size.unwrap_or(DEFAULT_BUCKETS_UP_TO).min(DEFAULT_BUCKETS_UP_TO);
    std::iter::successors(Some(1usize), |b| Some(b * 2)).take_while(|&b| b <= bound).collect()
}

/// The largest of the default batch buckets on CUDA.
pub const DEFAULT_BUCKETS_UP_TO: usize = 64;

/// Longest one thread spends warming a model's shapes (each bucket at each probe size, twice);
/// shapes past it are met first by a request, and the log says which were left.
pub const WARM_UP_BUDGET: std::time::Duration = std::time::Duration::from_secs(120);

/// What one warm-up did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmUp {
    /// Shapes run (each twice).
    pub warmed: usize,
    /// Shapes left out: past the memory allowed, `max_input_elements`, or the time budget.
    pub skipped: usize,
}

/// The declared inputs and outputs of a config entry, checked as at config load (a config
/// built in code is checked here too).
fn declared(config: &ModelConfig) -> Result<(&[DeclaredTensor], &[DeclaredTensor]), String> {
    config.validate("")?;
    Ok((config.declared_inputs(), config.outputs.as_deref().unwrap_or_default()))
}

fn spec(t: &DeclaredTensor) -> TensorSpec {
    TensorSpec { name: t.name.as_str().into(), shape: t.shape.clone(), datatype: t.datatype, accepts_uint8: t.from_uint8.is_some() }
}

/// `shown` as the worker runs it: with a batch dimension (`-1`) in front when the model takes
/// none (`batched` false), sharing the name.
fn as_run(shown: &TensorSpec, batched: bool) -> TensorSpec {
    let mut spec = shown.clone();
    if !batched {
        spec.shape.insert(0, -1);
    }
    spec
}

impl Model {
    /// Loads the TorchScript file onto `device` and runs one warm-up call.
    pub fn load(config: ModelConfig, device: ComputeDevice) -> Result<Model, ModelError> {
        let device = device.tch();
        let started = Instant::now();
        let (name, path) = (config.name.clone(), config.path.display().to_string());
        let load_err = |message: String| ModelError::Load { name: name.clone(), path: path.clone(), message };
        let (declared_inputs, declared_outputs) = declared(&config).map_err(load_err)?;
        let batched = config.batched();
        // Dimension indices as run: one more than declared where the worker adds the batch.
        let shift = usize::from(!batched);
        let shown_inputs: Vec<TensorSpec> = declared_inputs.iter().map(spec).collect();
        let shown_outputs: Vec<TensorSpec> = declared_outputs.iter().map(spec).collect();
        let inputs = declared_inputs
            .iter()
            .zip(&shown_inputs)
            .map(|(declared, shown)| {
                let spec = as_run(shown, batched);
                let min_shape = match &declared.min_shape {
                    Some(min) => std::iter::repeat_n(1, shift).chain(min.iter().map(|&n| n as usize)).collect(),
                    None => vec![1; spec.shape.len()],
                };
                let from_uint8 = declared.from_uint8.map(|a| (a.scale, a.offset));
                InputRule { spec, batching: declared.batching(), pad_value: declared.pad_value(), bucket: declared.bucket(), min_shape, from_uint8 }
            })
            .collect();
        let outputs = shown_outputs.iter().map(|o| as_run(o, batched)).collect();
        let input_index = |name: &Option<String>| name.as_ref().and_then(|n| declared_inputs.iter().position(|i| &i.name == n)).unwrap_or(0);
        let follows = declared_outputs
            .iter()
            .map(|o| {
                o.follows()
                    .iter()
                    .map(|r| Rule { dim: r.dim + shift, input: input_index(&r.input), input_dim: r.input_dim + shift, divisor: r.divisor })
                    .collect()
            })
            .collect();
        let mut modules = Vec::new();
        for _ in 0..config.instances.max(1) {
            let mut module = CModule::load_on_device(&config.path, device)
                .map_err(|e| load_err(first_line(&e.to_string())))?;
            module.set_eval();
            modules.push(Mutex::new(Instance { module, staging: None }));
        }
        let row_buckets = config.batch_buckets.clone().unwrap_or_else(|| default_row_buckets(&config, device));
        let model = Model { config, device, batched, inputs, outputs, shown_inputs, shown_outputs, follows, modules, row_buckets };
        let probe = model.probe_input(1, model.smallest_probe());
        model.infer(&probe).map_err(|e| {
            let sent: Vec<String> = model
                .shown_inputs
                .iter()
                .zip(probe.tensors())
                .map(|(spec, t)| format!("'{}' of datatype {} and shape {:?}", spec.name, spec.datatype, model.shown(&t.shape)))
                .collect();
            let noun = if sent.len() == 1 { "input" } else { "inputs" };
            load_err(format!("warm-up call of method '{}' with {noun} {} failed: {e}", model.method(), sent.join(", ")))
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

    /// The model's input tensors as declared, in the order its method takes them: each one's
    /// name and OIP shape (`-1`: variable).
    pub fn input_specs(&self) -> &[TensorSpec] {
        &self.shown_inputs
    }

    /// The model's output tensors as declared, in the order [`Model::infer_batch`] returns
    /// them.
    pub fn output_specs(&self) -> &[TensorSpec] {
        &self.shown_outputs
    }

    /// Whether the model takes the batch dimension itself (`max_batch_size` is not 0). When it
    /// does not, each request runs alone.
    pub fn batched(&self) -> bool {
        self.batched
    }

    /// A shape as run (batch first) as the declaration shows it: without the batch
    /// dimension the worker adds for a model that takes none.
    fn shown<'a, T>(&self, shape: &'a [T]) -> &'a [T] {
        if self.batched { shape } else { shape.get(1..).unwrap_or_default() }
    }

    /// A request's inputs as the client sent them (the declared shapes, in the declared
    /// order), as the worker runs them (a batch of one added for a model without a batch
    /// dimension), checked by [`Model::validate`].
    pub fn accept(&self, mut tensors: Vec<InputTensor>) -> Result<Inputs, ModelError> {
        if !self.batched {
            for t in &mut tensors {
                t.shape.insert(0, 1);
            }
        }
        let inputs = Inputs(tensors);
        self.validate(&inputs)?;
        Ok(inputs)
    }

    /// The TorchScript method a batch is run through.
    fn method(&self) -> &str {
        self.config.method()
    }

    /// Whether every non-batch dimension of every input is fixed, so that inputs differ only
    /// in rows and a probe's size is a row multiplier.
    fn rows_only(&self) -> bool {
        self.inputs.iter().all(|i| i.spec.shape[1..].iter().all(|&d| d > 0))
    }

    /// `sizes` ascending, each once.
    fn ascending(sizes: &[usize]) -> Vec<usize> {
        let mut sizes = sizes.to_vec();
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    /// The warm-up probe's size: the smallest of either calibration's.
    fn smallest_probe(&self) -> usize {
        if self.rows_only() {
            return 1;
        }
        self.config.probe_sizes().iter().chain(self.config.batch_probe_sizes()).copied().min().unwrap_or(1)
    }

    /// The probe inputs of the start-up memory calibration, small to large: 1, 8 and 32 rows
    /// when the inputs' other dimensions are fixed, else the `probe_sizes`, each at batch 1
    /// and 2 (and 4 when only one size is named, as the fit needs three probes). Probes past
    /// `max_input_elements` are left out.
    ///
    /// A model without a batch dimension runs one request at a time, so it is probed at batch
    /// 1 only: at the `probe_sizes` (the largest doubled until there are three), or, when its
    /// shape is fixed, three times at that one shape (the estimate is then the largest peak).
    pub fn calibration_inputs(&self) -> Vec<Inputs> {
        let (sizes, batches): (Vec<usize>, &[usize]) = if !self.batched {
            let mut sizes = if self.rows_only() { vec![1] } else { Self::ascending(self.config.probe_sizes()) };
            while sizes.len() < 3 {
                let next = if self.rows_only() { 1 } else { sizes[sizes.len() - 1].saturating_mul(2) };
                sizes.push(next);
            }
            (sizes, &[1])
        } else if self.rows_only() {
            (vec![1, 8, 32], &[1, 2])
        } else {
            let sizes = Self::ascending(self.config.probe_sizes());
            let batches: &[usize] = if sizes.len() == 1 { &[1, 2, 4] } else { &[1, 2] };
            (sizes, batches)
        };
        self.probes(&sizes, batches)
    }

    /// The probe inputs of every size at every batch, sizes outer, leaving out those past
    /// `max_input_elements`.
    fn probes(&self, sizes: &[usize], batches: &[usize]) -> Vec<Inputs> {
        let mut probes = Vec::new();
        for &size in sizes {
            for &batch in batches {
                if self.probe_input_elements(batch, size) <= self.config.max_input_elements {
                    probes.push(self.probe_input(batch, size));
                }
            }
        }
        probes
    }

    /// The input sizes the start-up throughput calibration times (see `batching.rs`), small to
    /// large: the `batch_probe_sizes`. Each size is one size class; sizes between them take
    /// the nearest class's figures until measured online. A model whose non-batch dimensions
    /// are all fixed has one class (the sizer's classes are by elements per row, and all its
    /// rows are alike), so it is timed at one row per item only: a larger row multiplier
    /// would file `size` rows as one item of a class no request ever falls in.
    ///
    /// A model without a batch dimension has nothing to time: its batches are of one request.
    pub fn batching_probe_sizes(&self) -> Vec<usize> {
        if !self.batched {
            return Vec::new();
        }
        let sizes = if self.rows_only() { vec![1] } else { Self::ascending(self.config.batch_probe_sizes()) };
        sizes.into_iter().filter(|&size| self.probe_input_elements(1, size) <= self.config.max_input_elements).collect()
    }

    /// How many elements [`Model::probe_input`] holds for `batch` rows of `size`, all inputs
    /// together (saturating: a probe that large is never built).
    pub fn probe_input_elements(&self, batch: usize, size: usize) -> usize {
        self.inputs
            .iter()
            .map(|input| self.probe_shape(input, batch, size).iter().fold(1usize, |n, &d| n.saturating_mul(d)))
            .fold(0usize, usize::saturating_add)
    }

    /// The shape of `input`'s probe of `batch` at `size`: `batch × size` rows of the declared
    /// shape when every input's is fixed, else `batch` rows with every variable dimension
    /// `size` rounded up to the input's `bucket`: a probe is a shape the model is really
    /// called with, so the memory fit and the batch timings see what requests of that size
    /// run as.
    fn probe_shape(&self, input: &InputRule, batch: usize, size: usize) -> Vec<usize> {
        let rows = if self.rows_only() { batch.saturating_mul(size) } else { batch };
        let size = round_up(size, input.bucket);
        std::iter::once(rows).chain(input.spec.shape[1..].iter().map(|&d| if d > 0 { d as usize } else { size })).collect()
    }

    /// A deterministic, non-trivial request of `batch` rows: for a float datatype a gradient
    /// from 1 down to above -1 along each row, for an integer or BOOL one 0 and 1 in turn
    /// along each row (never all zeros, whatever the shape; valid as an index into anything
    /// of two entries or more).
    pub fn probe_input(&self, batch: usize, size: usize) -> Inputs {
        Inputs(self.inputs.iter().map(|input| self.probe_tensor(input, batch, size)).collect())
    }

    /// `input`'s tensor of [`Model::probe_input`].
    fn probe_tensor(&self, input: &InputRule, batch: usize, size: usize) -> InputTensor {
        let shape = self.probe_shape(input, batch, size);
        let per_row = shape[1..].iter().product::<usize>().max(1);
        let at = (0..shape.iter().product::<usize>()).map(|i| i % per_row);
        let gradient = at.clone().map(|i| 1.0 - 2.0 * i as f64 / per_row as f64);
        let parity = at.map(|i| (i % 2) as u8);
        let data = match input.spec.datatype {
            DataType::Bool => TensorData::Bool(parity.map(|p| p == 1).collect()),
            DataType::Uint8 => TensorData::Uint8(parity.collect()),
            DataType::Int32 => TensorData::Int32(parity.map(i32::from).collect()),
            DataType::Int64 => TensorData::Int64(parity.map(i64::from).collect()),
            DataType::Fp16 => TensorData::Fp16(gradient.map(|x| F16::from_f64(x).unwrap_or_default()).collect()),
            _ => TensorData::Fp32(gradient.map(|x| x as f32).collect()),
        };
        InputTensor::from_data(shape, &data)
    }

    /// Whether requests `a` and `b` may share a batch (see `engine.rs`): each input that
    /// declares `batching = "pad"` is padded to the largest of the batch (Silero VAD: it runs
    /// forward in time, so trailing silence leaves earlier windows as they were), and then
    /// also rounded up to its `bucket` when set; every other input must be of one shape but
    /// rows (P-Net: its ceil-mode pooling sees padding at a smaller image's edge).
    pub fn can_share(&self, a: &Inputs, b: &Inputs) -> bool {
        self.inputs
            .iter()
            .zip(a.tensors().iter().zip(b.tensors()))
            .all(|(input, (x, y))| {
                x.datatype == y.datatype && (input.batching == Batching::Pad || x.shape.get(1..) == y.shape.get(1..))
            })
    }

    /// Checks a request's inputs, as run (batch first): as many as declared, each of its
    /// datatype and shape, all of one number of rows, before any libtorch call. Messages show
    /// shapes as declared.
    pub fn validate(&self, inputs: &Inputs) -> Result<(), ModelError> {
        if inputs.0.len() != self.inputs.len() {
            let names: Vec<&str> = self.inputs.iter().map(|i| &*i.spec.name).collect();
            return Err(ModelError::BadInput(format!(
                "model '{}' takes {} input{} ({}), got {}",
                self.config.name,
                names.len(),
                if names.len() == 1 { "" } else { "s" },
                names.join(", "),
                inputs.0.len()
            )));
        }
        let mut total = 0usize;
        for ((rule, shown), input) in self.inputs.iter().zip(&self.shown_inputs).zip(&inputs.0) {
            let spec = &rule.spec;
            spec.check_datatype(&spec.name, input.datatype)?;
            let elements: usize = input.shape.iter().product();
            if elements as u64 != input.elements() {
                return Err(ModelError::BadInput(format!(
                    "input '{}' of shape {:?} holds {elements} elements but {} were sent",
                    spec.name,
                    self.shown(&input.shape),
                    input.elements()
                )));
            }
            let declared = &spec.shape;
            let fits = input.shape.len() == declared.len()
                && input.shape.first().is_some_and(|&rows| rows >= 1 && (self.batched || rows == 1))
                && input.shape.iter().zip(declared).skip(1).all(|(&n, &d)| if d > 0 { n as i64 == d } else { n >= 1 });
            if !fits {
                return Err(ModelError::BadInput(format!(
                    "input '{}' must have shape {:?} (-1: any size), got {:?}",
                    spec.name,
                    shown.shape,
                    self.shown(&input.shape)
                )));
            }
            if input.shape.iter().zip(&rule.min_shape).any(|(&n, &min)| n < min) {
                return Err(ModelError::BadInput(format!(
                    "input '{}' must have at least shape {:?} (min_shape), got {:?}",
                    spec.name,
                    self.shown(&rule.min_shape),
                    self.shown(&input.shape)
                )));
            }
            total = total.saturating_add(elements);
        }
        if let Some(other) = inputs.0.iter().position(|t| t.shape[0] != inputs.rows()) {
            return Err(ModelError::BadInput(format!(
                "inputs '{}' and '{}' must have as many rows (dimension 0, the batch), got {} and {}",
                self.inputs[0].spec.name,
                self.inputs[other].spec.name,
                inputs.rows(),
                inputs.0[other].shape[0]
            )));
        }
        if total > self.config.max_input_elements {
            return Err(ModelError::TooLarge(format!(
                "input has {total} elements, more than this model's limit of {}",
                self.config.max_input_elements
            )));
        }
        Ok(())
    }

    /// The largest step a padded input's variable dimensions are rounded up to (1: no
    /// bucketing).
    pub fn bucket(&self) -> usize {
        self.inputs.iter().map(|i| i.bucket).max().unwrap_or(1)
    }

    /// The batch buckets (rows), ascending; empty: batches run at the rows they have.
    pub fn row_buckets(&self) -> &[usize] {
        &self.row_buckets
    }

    /// The rows a batch of `rows` rows runs at: the smallest batch bucket that holds them, or
    /// `rows` itself past the largest (or without buckets).
    pub fn batch_rows(&self, rows: usize) -> usize {
        self.row_buckets.iter().copied().find(|&b| b >= rows).unwrap_or(rows)
    }

    /// The shape each input of a batch of `requests` is run as (see [`padded_shape`]), its rows
    /// padded up to the batch bucket ([`Model::batch_rows`]): a batch of one request too,
    /// which bucketing may pad. What admission prices, the batch former weighs and the model
    /// is called with.
    pub fn padded_shapes(&self, requests: &[&Inputs]) -> Vec<Vec<usize>> {
        self.shapes_at(requests, true)
    }

    /// [`Model::padded_elements`] with the rows as the requests bring them, not padded up to a
    /// batch bucket: what a batch still being formed costs once more members fill its bucket.
    pub fn elements_at_own_rows(&self, requests: &[&Inputs]) -> u64 {
        elements(&self.shapes_at(requests, false))
    }

    fn shapes_at(&self, requests: &[&Inputs], bucket_rows: bool) -> Vec<Vec<usize>> {
        self.inputs
            .iter()
            .enumerate()
            .map(|(k, input)| {
                let tensors: Vec<&InputTensor> = requests.iter().map(|r| &r.0[k]).collect();
                let mut shape = padded_shape(&tensors, &input.spec.shape, input.bucket);
                if let Some(rows) = shape.first_mut().filter(|_| bucket_rows) {
                    *rows = self.batch_rows(*rows);
                }
                shape
            })
            .collect()
    }

    /// The most rows the batch sizer may choose, from the configured bound (`max_batch_size`,
    /// else `batching.max_batch_size`): 1 for a model without a batch dimension, and never past
    /// the largest batch bucket (a batch there would be a shape nobody warmed).
    pub fn batch_bound(&self, configured: Option<usize>) -> Option<usize> {
        if !self.batched {
            return Some(1);
        }
        match (configured, self.row_buckets.last()) {
            (Some(b), Some(&largest)) => Some(b.min(largest)),
            (None, Some(&largest)) => Some(largest),
            (bound, None) => bound,
        }
    }

    /// The batches a load warms, as single requests: every batch bucket (one row where there
    /// are none) at every size the batch sizes are timed at (the smallest probe for a model
    /// timed at none), small to large. A model that takes no batch dimension gets its smallest
    /// probe alone.
    pub fn warm_up_inputs(&self) -> Vec<Inputs> {
        let sizes = match self.batching_probe_sizes() {
            sizes if sizes.is_empty() => vec![self.smallest_probe()],
            sizes => sizes,
        };
        let buckets: &[usize] = if self.row_buckets.is_empty() { &[1] } else { &self.row_buckets };
        self.probes(&sizes, buckets)
    }

    /// Runs every shape of [`Model::warm_up_inputs`] twice on the calling thread, after
    /// applying the thread's settings, so that neither libtorch's first call at a shape (plans,
    /// kernel choices, the allocator's growth on this thread's stream) nor a thread-local
    /// setting is met by a request. Shapes whose estimated memory `affordable` refuses are
    /// left out, and so is what [`WARM_UP_BUDGET`] leaves no time for. A failed call ends it
    /// (the error is the load's, or the first request's, to report).
    pub fn warm_up(&self, affordable: impl Fn(u64) -> bool) -> Result<WarmUp, ModelError> {
        prepare_thread_settings();
        let started = Instant::now();
        let mut done = WarmUp::default();
        for input in self.warm_up_inputs() {
            let elements = self.padded_elements(&[&input]);
            if !affordable(elements) || started.elapsed() >= WARM_UP_BUDGET {
                done.skipped += 1;
                continue;
            }
            for _ in 0..2 {
                self.infer(&input)?;
            }
            done.warmed += 1;
        }
        Ok(done)
    }

    /// On CUDA, gives the calling thread a stream of its own from libtorch's pool for the rest
    /// of its life (a batch thread's copies and kernels then overlap another instance's). For
    /// the model's batch threads only, before their warm-up: a loading thread (the runtime's
    /// blocking pool) keeps the default stream.
    pub fn use_own_stream(&self) {
        if let Device::Cuda(index) = self.device {
            if let Err(e) = crate::cuda_memory::use_pool_stream(index as i32) {
                tracing::debug!(model = %self.config.name, error = %e, "no stream of its own; the thread uses the default stream");
            }
        }
    }

    /// The elements of [`Model::padded_shapes`], all inputs together: what a batch of
    /// `requests` costs. For one request, its admission price's elements (its own, or its
    /// bucket's).
    pub fn padded_elements(&self, requests: &[&Inputs]) -> u64 {
        elements(&self.shapes_at(requests, true))
    }

    /// Elements of one item (row) of the padded (and bucketed) batch of `requests`, all
    /// inputs together: what its size class is of.
    pub fn row_elements(&self, requests: &[&Inputs]) -> u64 {
        self.padded_shapes(requests).iter().map(|shape| shape.iter().skip(1).map(|&d| d as u64).product::<u64>()).sum()
    }

    /// What one request's outputs look like for its own input shapes, from the batch's
    /// returned tensors: its rows, each fixed dimension as returned, each variable dimension
    /// of a padded model as its rule says (`follows`), else as returned.
    fn output_shapes(&self, request: &Inputs, returned: &[Tensor]) -> Result<Vec<Vec<usize>>, ModelError> {
        let mut shapes = Vec::with_capacity(returned.len());
        for ((spec, rules), t) in self.outputs.iter().zip(&self.follows).zip(returned) {
            let size = t.size();
            let mut shape = vec![request.rows()];
            for (dim, &got) in size.iter().enumerate().skip(1) {
                let want = match rules.iter().find(|r| r.dim == dim) {
                    Some(rule) if self.inputs[rule.input].batching == Batching::Pad => {
                        (request.0[rule.input].shape[rule.input_dim] as u64).div_ceil(rule.divisor) as usize
                    }
                    _ => got as usize,
                };
                if want as i64 > got {
                    let own = &request.0[rules.iter().find(|r| r.dim == dim).map_or(0, |r| r.input)];
                    return Err(self.declared_error(&format!(
                        "returned output '{}' of shape {:?}, smaller than its follows rule makes dimension {} \
                         ({want}) for a request of shape {:?}",
                        spec.name,
                        self.shown(&size),
                        dim - usize::from(!self.batched),
                        self.shown(&own.shape)
                    )));
                }
                shape.push(want);
            }
            shapes.push(shape);
        }
        Ok(shapes)
    }

    /// Runs one request on its own. Blocking.
    pub fn infer(&self, request: &Inputs) -> Result<Vec<OutputTensor>, ModelError> {
        self.infer_batch(&[request]).map(|mut outs| outs.remove(0))
    }

    /// Runs several requests as one batch, padded to a common shape, and splits the outputs
    /// back per request. Blocking: call it from a blocking thread, never from an async task.
    /// A libtorch error or a panic inside the call becomes a [`ModelError`] (an allocation
    /// failure becomes [`ModelError::OutOfMemory`]); the model stays usable.
    pub fn infer_batch(&self, requests: &[&Inputs]) -> Result<Vec<Vec<OutputTensor>>, ModelError> {
        for request in requests {
            self.validate(request)?;
        }
        if requests.windows(2).any(|w| !self.can_share(w[0], w[1])) {
            // The engine never forms such a batch (`can_share`); outputs could not be split.
            return Err(ModelError::BadInput(format!(
                "model '{}' batches only inputs of one shape but rows alone (or padded ones), got {:?}",
                self.config.name,
                requests.iter().map(|r| r.0.iter().map(|t| &t.shape).collect::<Vec<_>>()).collect::<Vec<_>>()
            )));
        }
        if !self.batched && requests.len() > 1 {
            // The engine never forms such a batch (its batch size bound is 1): the model is
            // called on one request.
            return Err(ModelError::BadInput(format!(
                "model '{}' takes no batch dimension: one request per call, got {}",
                self.config.name,
                requests.len()
            )));
        }
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.infer_unchecked(requests)));
        match outcome {
            Ok(result) => result,
            Err(panic) => Err(ModelError::Panic {
                name: self.config.name.clone(),
                message: panic_message(&panic),
            }),
        }
    }

    fn infer_unchecked(&self, requests: &[&Inputs]) -> Result<Vec<Vec<OutputTensor>>, ModelError> {
        let failed = |e: tch::TchError| {
            let message = e.to_string();
            match out_of_memory_line(&message) {
                Some(line) => ModelError::OutOfMemory { name: self.config.name.clone(), message: line },
                None => ModelError::Runtime { name: self.config.name.clone(), message: error_line(&message) },
            }
        };
        let _inference = inference_guard();
        let started = Instant::now();
        let shapes = self.padded_shapes(requests);
        let rows = shapes.first().and_then(|s| s.first()).copied().unwrap_or(0);
        let mut instance = self.free_instance();
        let cuda = if let Device::Cuda(index) = self.device { Some(index as i32) } else { None };
        // The pinned buffer needs the stream synchronised before it is written again, which
        // only the shim can do; without it a batch goes the plain way (pageable, blocking).
        let staged = cuda.is_some() && crate::cuda_memory::BUILT;
        let host_inputs = tch::no_grad(|| -> Result<Vec<Tensor>, tch::TchError> {
            let Instance { staging, .. } = &mut *instance;
            let mut staging = staged.then_some(staging);
            let mut built = Vec::with_capacity(self.inputs.len());
            for (k, (input, shape)) in self.inputs.iter().zip(&shapes).enumerate() {
                let tensors: Vec<&InputTensor> = requests.iter().map(|r| &r.0[k]).collect();
                // Several inputs share one buffer only one at a time: the first is staged,
                // the others (rare: Silero's state) go the plain way.
                let buffer = if k == 0 { staging.take() } else { None };
                built.push(batch_tensor(&tensors, shape, input.pad_value, buffer, self.device)?);
            }
            Ok(built)
        })
        .map_err(failed)?;
        let inputs_built = Instant::now();
        let mut copied = inputs_built;
        let raw = tch::no_grad(|| -> Result<Vec<Tensor>, ModelError> {
            let mut args = Vec::with_capacity(host_inputs.len() + self.config.args().len());
            for (t, rule) in host_inputs.iter().zip(&self.inputs) {
                // One copy to the device; non-blocking from pinned memory (queued on this
                // thread's stream, ahead of the model's kernels).
                let x = if cuda.is_some() { t.f_to_device_(self.device, t.kind(), staged, false).map_err(failed)? } else { t.shallow_clone() };
                // Bytes sent for a floating-point input become its values here, on the device.
                let x = match rule.from_uint8 {
                    Some((scale, offset)) if x.kind() == Kind::Uint8 => x
                        .f_to_kind(Kind::Float)
                        .and_then(|x| x.f_mul_scalar(scale))
                        .and_then(|x| x.f_add_scalar(offset))
                        .and_then(|x| x.f_to_kind(rule.spec.kind()))
                        .map_err(failed)?,
                    _ => x,
                };
                // A model without a batch dimension is called on the batch's one request.
                let x = if self.batched { x } else { x.f_select(0, 0).map_err(failed)? };
                args.push(IValue::Tensor(x));
            }
            copied = Instant::now();
            args.extend(self.config.args().iter().map(ivalue));
            let method = self.method();
            let returned = instance
                .module
                .method_is(method, &args)
                .map_err(|e| method_error(&self.config.name, method, &e.to_string()));
            // The stream is done with this batch (its copy from the pinned buffer too) before
            // anything else happens on this instance, success or not; and the model's phase
            // then holds the device's time, not only the launches.
            if let (Some(index), true) = (cuda, staged) {
                if let Err(e) = crate::cuda_memory::sync_current_stream(index) {
                    tracing::debug!(model = %self.config.name, error = %e, "stream synchronisation failed");
                }
            }
            let names: Vec<&str> = self.outputs.iter().map(|o| &*o.name).collect();
            let tensors = returned_tensors(returned?, &names).map_err(|message| self.declared_error(&message))?;
            self.check_declared_outputs(&tensors, rows)?;
            if self.batched {
                return Ok(tensors);
            }
            tensors.into_iter().map(|t| t.f_unsqueeze(0).map_err(failed)).collect()
        });
        // On the CPU an output may share memory with an input (an identity model): the inputs
        // live until the outputs are copied out, and the instance stays ours until then.
        let raw = raw?;
        let called = Instant::now();

        // Each in its declared kind (the outputs were checked to widen into it exactly).
        let specs = &self.outputs;
        let raw: Vec<Tensor> = raw
            .into_iter()
            .zip(specs)
            .map(|(t, spec)| t.f_to_kind(spec.kind()).and_then(|t| t.f_to_device(Device::Cpu)))
            .collect::<Result<_, _>>()
            .map_err(failed)?;
        let mut row = 0i64;
        let mut per_request = Vec::with_capacity(requests.len());
        for request in requests {
            let rows = request.rows() as i64;
            let wants = self.output_shapes(request, &raw)?;
            let mut outputs = Vec::with_capacity(specs.len());
            for ((spec, tensor), want) in specs.iter().zip(&raw).zip(wants) {
                let mut t = tensor.f_narrow(0, row, rows).map_err(failed)?;
                for (dim, &n) in want.iter().enumerate().skip(1) {
                    t = t.f_narrow(dim as i64, 0, n as i64).map_err(failed)?;
                }
                let flat = t.f_contiguous().and_then(|t| t.f_reshape([-1])).map_err(failed)?;
                let data = tensor_data(&flat, spec.datatype).map_err(failed)?;
                let shape = self.shown(&want).to_vec();
                outputs.push(OutputTensor { name: spec.name.clone(), shape, data });
            }
            row += rows;
            per_request.push(outputs);
        }
        drop(host_inputs);
        drop(instance);
        let phases = Phases {
            inputs: (inputs_built - started).as_secs_f64(),
            to_device: (copied - inputs_built).as_secs_f64(),
            model: (called - copied).as_secs_f64(),
            outputs: called.elapsed().as_secs_f64(),
        };
        LAST_PHASES.with(|p| p.set(phases));
        Ok(per_request)
    }

    /// The method returned something its declaration does not allow.
    fn declared_error(&self, message: &str) -> ModelError {
        ModelError::Runtime { name: self.config.name.clone(), message: format!("method '{}' {message}", self.method()) }
    }

    /// Checks the returned tensors against its declared outputs: as many,
    /// each of the declared rank, `rows` rows (when the model takes the batch dimension), the
    /// declared size in each fixed dimension, and of the declared datatype's kind or one that
    /// widens into it exactly.
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
        let first = usize::from(self.batched);
        for (spec, tensor) in self.shown_outputs.iter().zip(tensors) {
            let got = tensor.size();
            let fits = got.len() == spec.shape.len()
                && (!self.batched || got[0] == rows as i64)
                && got.iter().zip(&spec.shape).skip(first).all(|(&n, &d)| d < 0 || n == d);
            if !fits {
                let why = if got.len() != spec.shape.len() {
                    "its rank differs".to_string()
                } else if self.batched && got[0] != rows as i64 {
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

/// The tensors a method returned: one tensor, a tuple or list of tensors (in the declared
/// outputs' order), or a dict of tensors keyed by the declared outputs' `names` (taken in that
/// order; keys not declared are dropped); else what was returned instead, for the error.
fn returned_tensors(value: IValue, names: &[&str]) -> Result<Vec<Tensor>, String> {
    match value {
        IValue::GenericDict(entries) => {
            let mut by_key: Vec<(String, IValue)> = Vec::with_capacity(entries.len());
            for (key, entry) in entries {
                match key {
                    IValue::String(key) => by_key.push((key, entry)),
                    other => return Err(format!("returned a dict with {} as a key where a string was expected", describe(&other))),
                }
            }
            names
                .iter()
                .map(|&name| match by_key.iter().position(|(key, _)| key == name) {
                    Some(at) => match by_key.swap_remove(at).1 {
                        IValue::Tensor(t) => Ok(t),
                        other => Err(format!("returned {} under the key '{name}' where a tensor was expected", describe(&other))),
                    },
                    None => {
                        // The model's keys, in bounds: at most 16, each cut to 64 bytes.
                        let mut keys: Vec<&str> = by_key.iter().map(|(k, _)| bounded(k, 64)).collect();
                        keys.sort_unstable();
                        let more = keys.len().saturating_sub(16);
                        keys.truncate(16);
                        let more = if more > 0 { format!(" and {more} more") } else { String::new() };
                        Err(format!("returned a dict without the key '{name}' (a declared output); its keys: {}{more}", keys.join(", ")))
                    }
                })
                .collect()
        }
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
        other => Err(format!("returned {}, expected a tensor, a tuple or list of tensors, or a dict of them", describe(&other))),
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
    fn free_instance(&self) -> std::sync::MutexGuard<'_, Instance> {
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

/// The shape a batch of `inputs` is padded to: their rows stacked, every other dimension the
/// largest among them (padded at the end with `pad_value`; only a `batching = "pad"` model's
/// batches have inputs of different sizes), and each variable (`-1` in `declared`) one of them
/// then rounded up to a multiple of `bucket` (1: as it is).
fn padded_shape(inputs: &[&InputTensor], declared: &[i64], bucket: usize) -> Vec<usize> {
    let Some(first) = inputs.first().filter(|i| !i.shape.is_empty()) else { return Vec::new() };
    let mut shape = first.shape.clone();
    shape[0] = inputs.iter().map(|i| i.shape.first().copied().unwrap_or(0)).sum();
    for input in &inputs[1..] {
        for (d, &n) in shape.iter_mut().zip(&input.shape).skip(1) {
            *d = (*d).max(n);
        }
    }
    for (d, &declared) in shape.iter_mut().zip(declared).skip(1) {
        if declared == -1 {
            *d = round_up(*d, bucket);
        }
    }
    shape
}

/// The elements of every shape of `shapes`, together.
fn elements(shapes: &[Vec<usize>]) -> u64 {
    shapes.iter().map(|shape| shape.iter().map(|&d| d as u64).product::<u64>()).sum()
}

/// `n` rounded up to a multiple of `step` (saturating; a step of 0 or 1 leaves it).
fn round_up(n: usize, step: usize) -> usize {
    if step <= 1 {
        return n;
    }
    n.div_ceil(step).saturating_mul(step)
}

/// The host tensor of one input of a batch, of `shape` (the inputs' rows stacked, then
/// padded): in `staging` (grown as needed, pinned for `device`) when given, else newly made.
/// Inputs that fill whole rows of the shape (every batch of a model that batches equal shapes)
/// are one copy of their bytes each and the padding rows are filled after them; otherwise the
/// tensor is filled with `pad_value` and each input copied into its corner.
fn batch_tensor(
    inputs: &[&InputTensor],
    shape: &[usize],
    pad_value: f64,
    staging: Option<&mut Option<Tensor>>,
    device: Device,
) -> Result<Tensor, tch::TchError> {
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let kind = tensor_kind(inputs[0].datatype)
        .ok_or_else(|| tch::TchError::Kind(format!("no libtorch kind for datatype {}", inputs[0].datatype)))?;
    let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let bytes = numel
        .and_then(|n| n.checked_mul(kind.elt_size_in_bytes()))
        .ok_or_else(|| tch::TchError::Shape(format!("shape {shape:?} is too large")))?;
    let mut batch = match staging {
        Some(buffer) => {
            let have = buffer.as_ref().map_or(0, |t| t.numel());
            if have < bytes {
                // Doubling, so a growing load re-pins rarely; pinning is slow (page-locking).
                let capacity = bytes.max(have.saturating_mul(2)).max(1 << 20);
                let fresh = Tensor::f_empty([capacity as i64], (Kind::Uint8, Device::Cpu))?;
                // Pinned for a device to copy from without a bounce; for the CPU (the tests) a
                // plain buffer, used the same way.
                let fresh = if device == Device::Cpu { fresh } else { fresh.f_pin_memory(device)? };
                *buffer = Some(fresh);
            }
            let whole = buffer.as_ref().expect("the staging buffer was just made");
            whole.f_narrow(0, 0, bytes as i64)?.f_view_dtype(kind)?.f_view(dims.as_slice())?
        }
        None if inputs.len() == 1 && inputs[0].shape == shape => return inputs[0].to_tensor(&dims),
        None => Tensor::f_empty(dims.as_slice(), (kind, Device::Cpu))?,
    };
    let rows: usize = inputs.iter().map(|i| i.shape.first().copied().unwrap_or(0)).sum();
    let whole_rows = cfg!(target_endian = "little") && inputs.iter().all(|i| i.shape.get(1..) == shape.get(1..));
    if whole_rows && rows <= shape.first().copied().unwrap_or(0) {
        let base = batch.data_ptr().cast::<u8>();
        let mut at = 0usize;
        for input in inputs {
            let data = input.le_bytes();
            // SAFETY: `batch` is a fresh contiguous tensor (or a view of the start of the
            // staging buffer) of `bytes` bytes; the inputs' whole rows fill its first
            // `rows` rows, so `at + data.len() <= bytes` (each input's bytes are exactly its
            // shape's, checked by `validate` and `from_le_bytes`); source and destination are
            // distinct allocations.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base.add(at), data.len()) };
            at += data.len();
        }
        if rows < shape[0] {
            let _ = batch.f_narrow(0, rows as i64, (shape[0] - rows) as i64)?.f_fill_(pad_value)?;
        }
        return Ok(batch);
    }
    let _ = batch.f_fill_(pad_value)?;
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

pub fn out_of_memory_line(message: &str) -> Option<String> {
    const MARKERS: [&str; 4] =
        ["CUDA out of memory", "CUDNN_STATUS_ALLOC_FAILED", "can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED"];
    message
        .lines()
        .find(|l| MARKERS.iter().any(|m| l.contains(m)))
        .map(|l| l.trim().trim_start_matches("RuntimeError: ").to_string())
}

/// Longest stretch of a model's own error message that goes into an answer: its error line,
/// never a whole traceback.
pub const MODEL_MESSAGE_MAX_BYTES: usize = 512;

/// What the error `message` of the model's method `method` says about the request: an
/// allocation failure ([`ModelError::OutOfMemory`]), a fault of the device
/// ([`ModelError::Runtime`]: the request is not to blame, and another worker may serve it), or
/// the model's own refusal of this input ([`ModelError::Raised`]), its line bounded by
/// [`MODEL_MESSAGE_MAX_BYTES`].
fn method_error(name: &str, method: &str, message: &str) -> ModelError {
    let name = name.to_string();
    if let Some(line) = out_of_memory_line(message) {
        return ModelError::OutOfMemory { name, message: line };
    }
    let line = format!("method '{method}': {}", error_line(message));
    if is_device_fault(message) {
        ModelError::Runtime { name, message: line }
    } else {
        ModelError::Raised { name, message: bounded(&line, MODEL_MESSAGE_MAX_BYTES).to_string() }
    }
}

/// Whether a libtorch error is the device's (or its libraries') rather than the model's: CUDA
/// errors (a device-side assert, an illegal memory access, a launch failure; ROCm's HIP errors),
/// cuDNN, cuBLAS and the other CUDA libraries, NCCL. Such an error can follow any input (a CUDA error is sticky:
/// the context may fail every later call), so it is never the request's fault. Looked for
/// anywhere in the message, as TorchScript puts the error after its traceback.
pub fn is_device_fault(message: &str) -> bool {
    const MARKERS: [&str; 13] = [
        "cuda error",
        "cuda driver error",
        "cuda kernel errors",
        "device-side assert",
        "illegal memory access",
        "hip error",
        "misaligned address",
        "unspecified launch failure",
        "cudnn",
        "cublas",
        "cusolver",
        "cufft",
        "nccl",
    ];
    let lower = message.to_ascii_lowercase();
    MARKERS.iter().any(|m| lower.contains(m))
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

    /// A `[[models]]` entry of the file at `path` named `name`, with more `keys`.
    pub fn entry(path: &Path, name: &str, keys: &str) -> ModelConfig {
        let text = format!("name = \"{name}\"\npath = \"{}\"\n{keys}\n", path.display());
        figment::Figment::from(Toml::string(&text)).extract().expect("a model entry")
    }

    /// A `[[models]]` entry of `mtcnn_pnet.jit` named `name`, with more `keys`.
    pub fn pnet_entry(name: &str, keys: &str) -> ModelConfig {
        entry(&model_file("mtcnn_pnet.jit"), name, keys)
    }

    /// The entry named `name` of the shipped `config/worker.toml`, its path resolved from the
    /// repository's root (as the worker runs there).
    pub fn shipped(name: &str) -> ModelConfig {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let config = crate::config::WorkerConfig::load(Some(&root.join("config/worker.toml"))).expect("config/worker.toml loads");
        let mut model = config.models.into_iter().find(|m| m.name == name).expect("the shipped entry");
        model.path = root.join(&model.path);
        model
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

    /// One-input conveniences for the tests, whose models (but one) take one input.
    impl Model {
        /// The first input's spec.
        pub fn input_spec(&self) -> &TensorSpec {
            &self.shown_inputs[0]
        }

        /// Whether any input pads.
        pub fn can_pad(&self) -> bool {
            self.inputs.iter().any(|i| i.batching == Batching::Pad)
        }

        pub fn infer_one(&self, input: &InputTensor) -> Result<Vec<OutputTensor>, ModelError> {
            self.infer(&Inputs(vec![input.clone()]))
        }

        pub fn infer_batch_one(&self, inputs: &[&InputTensor]) -> Result<Vec<Vec<OutputTensor>>, ModelError> {
            let requests: Vec<Inputs> = inputs.iter().map(|&i| Inputs(vec![i.clone()])).collect();
            self.infer_batch(&requests.iter().collect::<Vec<_>>())
        }

        pub fn padded_elements_one(&self, inputs: &[&InputTensor]) -> u64 {
            self.padded_shape_one(inputs).iter().map(|&d| d as u64).product()
        }

        pub fn validate_one(&self, input: &InputTensor) -> Result<(), ModelError> {
            self.validate(&Inputs(vec![input.clone()]))
        }

        pub fn padded_shape_one(&self, inputs: &[&InputTensor]) -> Vec<usize> {
            let requests: Vec<Inputs> = inputs.iter().map(|&i| Inputs(vec![i.clone()])).collect();
            self.padded_shapes(&requests.iter().collect::<Vec<_>>()).remove(0)
        }
    }

    impl Inputs {
        /// The first input's tensor.
        pub fn first(&self) -> &InputTensor {
            &self.0[0]
        }
    }

    /// Loads `config` on the CPU with the worker's libtorch settings.
    pub fn load(config: ModelConfig) -> Result<Model, ModelError> {
        let device = init_torch(DeviceChoice::Cpu, 1, TorchSettings::default())?;
        Model::load(config, device)
    }

    /// P-Net declared with its own tensors: its image, box offsets and both probabilities.
    pub const DECLARED_PNET: &str = "input = { name = \"image\", shape = [-1, 3, -1, -1] }\n\
        outputs = [ { name = \"box_offsets\", shape = [-1, 4, -1, -1] }, { name = \"probs\", shape = [-1, 2, -1, -1] } ]\n";
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::testing::{load, model_file, pnet_entry, shipped, DECLARED_PNET};
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

    #[test]
    fn a_request_s_rows_split_and_its_answers_join_back() {
        // Two inputs of 3 rows: a [3, 2] FP32 and a [3] UINT8.
        let a = InputTensor::from_f32(vec![3, 2], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let b = InputTensor::from_le_bytes(vec![3], DataType::Uint8, Bytes::from_static(&[7, 8, 9])).expect("bytes");
        let input = Inputs(vec![a, b]);
        let tail = input.row_range(1, 2).expect("rows 1 and 2");
        assert_eq!((tail.rows(), tail.tensors()[0].shape.clone(), tail.tensors()[1].shape.clone()), (2, vec![2, 2], vec![2]));
        assert_eq!(&tail.tensors()[0].data[..], &input.tensors()[0].data[8..]);
        assert_eq!(&tail.tensors()[1].data[..], &[8, 9]);
        assert!(input.row_range(2, 2).is_none() && input.row_range(0, 0).is_none());

        let out = |rows: usize, values: Vec<f32>| vec![OutputTensor { name: "y".into(), shape: vec![rows, 2], data: TensorData::Fp32(values) }];
        let joined = join_rows(out(1, vec![0.0, 1.0]), out(2, vec![2.0, 3.0, 4.0, 5.0])).expect("joins");
        assert_eq!((joined[0].shape.clone(), joined[0].data.clone()), (vec![3, 2], TensorData::Fp32(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0])));
        let wide = vec![OutputTensor { name: "y".into(), shape: vec![1, 3], data: TensorData::Fp32(vec![0.0; 3]) }];
        assert!(join_rows(out(1, vec![0.0, 1.0]), wide).expect_err("shapes differ").contains("do not join"));
    }

    /// An output's values, which must be FP32.
    fn fp32(data: &TensorData) -> &[f32] {
        match data {
            TensorData::Fp32(values) => values,
            other => panic!("an FP32 output, got {}", other.datatype()),
        }
    }

    /// What the module's method answers for `input` called directly, as tch gives it (each
    /// returned tensor's shape and FP32 values).
    fn direct(path: &Path, method: &str, args: &[i64], input: &InputTensor) -> Vec<(Vec<usize>, Vec<f32>)> {
        let module = CModule::load(path).expect("the module");
        let x = input.to_tensor(&input.shape.iter().map(|&d| d as i64).collect::<Vec<_>>()).expect("a tensor");
        let all: Vec<IValue> = std::iter::once(IValue::Tensor(x)).chain(args.iter().map(|&n| IValue::Int(n))).collect();
        let returned = tch::no_grad(|| module.method_is(method, &all)).expect("a direct call");
        returned_tensors(returned, &[])
            .expect("tensors")
            .iter()
            .map(|t| (t.size().iter().map(|&d| d as usize).collect(), Vec::<f32>::try_from(&t.reshape([-1])).expect("f32 values")))
            .collect()
    }

    /// The inputs stacked as one batch (all of one shape but rows).
    fn stacked(inputs: &[&InputTensor]) -> InputTensor {
        let mut shape = inputs[0].shape.clone();
        shape[0] = inputs.iter().map(|i| i.shape[0]).sum();
        let bytes: Vec<u8> = inputs.iter().flat_map(|i| i.le_bytes().iter().copied()).collect();
        InputTensor::from_le_bytes(shape, DataType::Fp32, Bytes::from(bytes)).expect("whole values")
    }

    #[test]
    fn a_batch_leaves_its_phases_on_its_thread() {
        let pnet = load(shipped("mtcnn_pnet")).expect("the shipped P-Net");
        let input = image(2, 64, 64, 0.5);
        let before = std::time::Instant::now();
        pnet.infer_batch_one(&[&input]).expect("an answer");
        let took = before.elapsed().as_secs_f64();
        let p = last_phases();
        assert!(p.inputs >= 0.0 && p.to_device >= 0.0 && p.outputs >= 0.0 && p.model > 0.0, "{p:?}");
        assert!(p.inputs + p.to_device + p.model + p.outputs <= took, "{p:?} within the {took} s the call took");
        // Another thread has run nothing: its phases are zeros.
        let other = std::thread::spawn(last_phases).join().expect("the thread ends");
        assert_eq!(other, Phases::default());
    }

    #[test]
    fn a_batch_is_padded_up_to_its_bucket_and_answers_stay_each_request_s_own() {
        let pnet = load(pnet_entry("bucketed", &format!("batch_buckets = [1, 2, 4]\n{DECLARED_PNET}"))).expect("P-Net");
        assert_eq!(pnet.row_buckets(), [1, 2, 4]);
        assert_eq!([1, 2, 3, 4, 5, 9].map(|rows| pnet.batch_rows(rows)), [1, 2, 4, 4, 5, 9], "past the largest, as it is");
        let (a, b, c) = (image(1, 24, 24, 0.1), image(1, 24, 24, 0.2), image(1, 24, 24, 0.3));
        let batch = [&a, &b, &c];
        let inputs: Vec<Inputs> = batch.iter().map(|&t| Inputs::from(t.clone())).collect();
        let refs: Vec<&Inputs> = inputs.iter().collect();
        assert_eq!(pnet.padded_shapes(&refs), [vec![4, 3, 24, 24]], "three rows run as four");
        assert_eq!(pnet.padded_elements(&refs), 4 * 3 * 24 * 24, "and are priced as four");
        assert_eq!(pnet.padded_elements(&refs[..1]), 3 * 24 * 24, "a lone row is its own bucket");
        // The module called on the padded batch (a fourth row of zeros): each request's rows of
        // it, bit for bit; the padding row's answers go nowhere.
        let zeros = InputTensor::from_f32(vec![1, 3, 24, 24], &[0.0; 3 * 24 * 24]);
        let want = direct(&model_file("mtcnn_pnet.jit"), "forward", &[], &stacked(&[&a, &b, &c, &zeros]));
        let got = pnet.infer_batch_one(&batch).expect("an answer");
        assert_eq!(got.len(), 3);
        for (row, outputs) in got.iter().enumerate() {
            for (out, (shape, values)) in outputs.iter().zip(&want) {
                let per_row = values.len() / shape[0];
                assert_eq!(out.shape, [&[1][..], &shape[1..]].concat());
                assert_eq!(bits(fp32(&out.data)), bits(&values[row * per_row..(row + 1) * per_row]), "row {row}");
            }
        }
    }

    #[test]
    fn a_staged_batch_is_the_inputs_then_its_padding_in_one_reused_buffer() {
        let values = |t: &Tensor| Vec::<f32>::try_from(&t.reshape([-1])).expect("f32 values");
        let own = |i: &InputTensor| values(&i.to_tensor(&i.shape.iter().map(|&d| d as i64).collect::<Vec<_>>()).expect("a tensor"));
        let (a, b) = (image(1, 4, 5, 0.1), image(2, 4, 5, 0.2));
        let mut staging = None;
        // Whole rows: the inputs' bytes one after the other, then a padding row.
        let batch = batch_tensor(&[&a, &b], &[4, 3, 4, 5], -1.0, Some(&mut staging), Device::Cpu).expect("a batch");
        assert_eq!(batch.size(), [4, 3, 4, 5]);
        let want: Vec<f32> = [own(&a), own(&b), vec![-1.0; 3 * 4 * 5]].concat();
        assert_eq!(bits(&values(&batch)), bits(&want));
        let buffer = staging.as_ref().expect("a buffer").data_ptr();
        assert_eq!(batch.data_ptr(), buffer, "built in the buffer");
        assert!(staging.as_ref().expect("a buffer").numel() >= 1 << 20, "at least 1 MiB, so small batches never re-grow it");
        // A smaller batch reuses it; one of another size in a padded dimension is filled and
        // copied corner by corner.
        let small = image(1, 2, 3, 0.3);
        let padded = batch_tensor(&[&small, &a], &[2, 3, 4, 5], 0.5, Some(&mut staging), Device::Cpu).expect("a batch");
        assert_eq!(padded.data_ptr(), buffer, "the same buffer");
        let got = values(&padded);
        let corner: Vec<f32> = (0..3).flat_map(|c| (0..4).flat_map(move |y| (0..5).map(move |x| (c, y, x)))).map(|(c, y, x)| got[(c * 4 + y) * 5 + x]).collect();
        let small_own = own(&small);
        for (i, v) in corner.iter().enumerate() {
            let (c, y, x) = (i / 20, (i / 5) % 4, i % 5);
            let want = if y < 2 && x < 3 { small_own[(c * 2 + y) * 3 + x] } else { 0.5 };
            assert_eq!(v.to_bits(), want.to_bits(), "row 0 at {c},{y},{x}");
        }
        assert_eq!(bits(&got[60..]), bits(&own(&a)));
        // Past its size it grows (doubling) into a new buffer.
        let big = image(64, 48, 48, 0.4);
        let grown = batch_tensor(&[&big], &[64, 3, 48, 48], 0.0, Some(&mut staging), Device::Cpu).expect("a batch");
        assert_ne!(grown.data_ptr(), buffer);
        assert_eq!(bits(&values(&grown)), bits(&own(&big)));
    }

    #[test]
    fn a_load_warms_every_bucket_at_every_timed_size() {
        let keys = format!("batch_buckets = [1, 2, 4]\nbatch_probe_sizes = [16, 32]\n{DECLARED_PNET}");
        let pnet = load(pnet_entry("warmed", &keys)).expect("P-Net");
        let shapes: Vec<Vec<usize>> = pnet.warm_up_inputs().iter().map(|i| i.tensors()[0].shape.clone()).collect();
        let want: Vec<Vec<usize>> =
            [16, 32].iter().flat_map(|&size| [1, 2, 4].map(|rows| vec![rows, 3, size, size])).collect();
        assert_eq!(shapes, want);
        let all = pnet.warm_up(|_| true).expect("warmed");
        assert_eq!(all, WarmUp { warmed: 6, skipped: 0 });
        // What the memory allowed: the shapes past it are left for later, not run.
        let small = pnet.warm_up(|elements| elements <= 2 * 3 * 16 * 16).expect("warmed");
        assert_eq!(small, WarmUp { warmed: 2, skipped: 4 });
        // Without buckets (the CPU's default), one row at each size; a model whose rows are all
        // alike has one size.
        let plain = load(pnet_entry("plain", &format!("batch_probe_sizes = [16, 32]\n{DECLARED_PNET}"))).expect("P-Net");
        assert!(plain.row_buckets().is_empty(), "no buckets on the CPU unless named");
        let shapes: Vec<Vec<usize>> = plain.warm_up_inputs().iter().map(|i| i.tensors()[0].shape.clone()).collect();
        assert_eq!(shapes, [vec![1, 3, 16, 16], vec![1, 3, 32, 32]]);
        let rnet = load(shipped("mtcnn_rnet")).expect("R-Net");
        assert_eq!(rnet.warm_up_inputs().len(), 1);
    }

    #[test]
    fn no_batch_is_formed_past_the_largest_bucket() {
        let bucketed = load(pnet_entry("b", &format!("batch_buckets = [1, 2, 4]\n{DECLARED_PNET}"))).expect("P-Net");
        assert_eq!([None, Some(2), Some(16)].map(|c| bucketed.batch_bound(c)), [Some(4), Some(2), Some(4)]);
        let plain = load(pnet_entry("p", DECLARED_PNET)).expect("P-Net");
        assert_eq!([None, Some(16)].map(|c| plain.batch_bound(c)), [None, Some(16)]);
    }

    #[test]
    fn the_default_buckets_are_powers_of_two_on_cuda_only() {
        let pnet = pnet_entry("p", DECLARED_PNET);
        assert_eq!(default_row_buckets(&pnet, Device::Cuda(0)), [1, 2, 4, 8, 16, 32, 64]);
        assert!(default_row_buckets(&pnet, Device::Cpu).is_empty());
        let capped = pnet_entry("p", &format!("max_batch_size = 12\n{DECLARED_PNET}"));
        assert_eq!(default_row_buckets(&capped, Device::Cuda(0)), [1, 2, 4, 8]);
    }

    #[test]
    fn bytes_sent_for_a_float_input_are_normalised_on_the_device_as_the_host_would() {
        // P-Net's own normalisation, (x - 127.5) / 128, as the model folder declares it.
        let keys = "input = { name = \"image\", shape = [-1, 3, -1, -1], from_uint8 = { scale = 0.0078125, offset = -0.99609375 } }\n\
            outputs = [ { name = \"box_offsets\", shape = [-1, 4, -1, -1] }, { name = \"probs\", shape = [-1, 2, -1, -1] } ]\n";
        let pnet = load(pnet_entry("bytes", keys)).expect("P-Net");
        let (h, w) = (37, 53);
        let pixels: Vec<u8> = (0..3 * h * w).map(|i| ((i * 7919) % 256) as u8).collect();
        let bytes = InputTensor::from_le_bytes(vec![1, 3, h, w], DataType::Uint8, Bytes::from(pixels.clone())).expect("bytes");
        let floats: Vec<f32> = pixels.iter().map(|&p| (p as f32 - 127.5) / 128.0).collect();
        let host = InputTensor::from_f32(vec![1, 3, h, w], &floats);
        pnet.validate_one(&bytes).expect("UINT8 is taken");
        let from_bytes = pnet.infer_batch_one(&[&bytes]).expect("an answer");
        let from_floats = pnet.infer_batch_one(&[&host]).expect("an answer");
        for (a, b) in from_bytes[0].iter().zip(&from_floats[0]) {
            assert_eq!(a.shape, b.shape);
            let worst = fp32(&a.data).iter().zip(fp32(&b.data)).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(worst <= 1e-6, "{}: {worst}", a.name);
        }
        // Requests of the two datatypes never share a batch (one tensor has one kind).
        let (x, y) = (Inputs::from(bytes.clone()), Inputs::from(host.clone()));
        assert!(!pnet.can_share(&x, &y));
        // Other datatypes are refused, naming what is taken; a model that does not declare it
        // refuses bytes.
        let int32 = InputTensor::from_le_bytes(vec![1, 3, 1, 1], DataType::Int32, Bytes::from(vec![0u8; 12])).expect("int32");
        let err = pnet.validate_one(&int32).expect_err("INT32");
        assert!(err.to_string().contains("must be FP32 (or UINT8, normalised on the device), got INT32"), "{err}");
        let plain = load(pnet_entry("floats", DECLARED_PNET)).expect("P-Net");
        let err = plain.validate_one(&bytes).expect_err("UINT8 without from_uint8");
        assert!(err.to_string().contains("must be FP32, got UINT8"), "{err}");
    }

    #[test]
    fn the_shipped_pnet_answers_what_its_forward_answers_bit_for_bit() {
        let pnet = load(shipped("mtcnn_pnet")).expect("the shipped P-Net");
        let tensor = |name: &str, shape: &[i64]| TensorSpec { name: name.into(), shape: shape.to_vec(), datatype: DataType::Fp32, accepts_uint8: false };
        // Its picture may come as bytes too (from_uint8, MTCNN's own normalisation).
        assert_eq!(pnet.input_spec(), &TensorSpec { accepts_uint8: true, ..tensor("image", &[-1, 3, -1, -1]) });
        assert_eq!(pnet.output_specs(), [tensor("box_offsets", &[-1, 4, -1, -1]), tensor("face_prob", &[-1, 2, -1, -1])]);
        assert!(!pnet.can_pad(), "ceil-mode pooling sees padding: equal shapes only");
        let calibration: Vec<Vec<usize>> = pnet.calibration_inputs().into_iter().map(|p| p.first().shape.clone()).collect();
        assert_eq!(calibration, [[1, 3, 128, 128], [2, 3, 128, 128], [1, 3, 256, 256], [2, 3, 256, 256], [1, 3, 512, 512], [2, 3, 512, 512]]);
        assert_eq!(pnet.batching_probe_sizes(), [64, 128, 256, 512]);
        let small = pnet.probe_input(1, 24).first().clone();
        assert_eq!(small.shape, [1, 3, 24, 24]);
        let (two, wide) = (image(2, 24, 24, 1.0), image(1, 30, 40, 2.0));
        let path = model_file("mtcnn_pnet.jit");
        for batch in [vec![&small, &two], vec![&wide]] {
            // The module called on the same batch: the (boxes, probs) it returns, split by rows.
            let want = direct(&path, "forward", &[], &stacked(&batch));
            let got = pnet.infer_batch_one(&batch).expect("an answer");
            let mut row = 0;
            for (input, got) in batch.iter().zip(&got) {
                let rows = input.shape[0];
                let [box_offsets, face_prob] = &got[..] else { panic!("two outputs") };
                assert_eq!((&*box_offsets.name, &*face_prob.name), ("box_offsets", "face_prob"));
                for (out, (shape, values)) in [box_offsets, face_prob].into_iter().zip(&want) {
                    let per_row = values.len() / shape[0];
                    assert_eq!(out.shape, [&[rows][..], &shape[1..]].concat(), "{:?}", input.shape);
                    assert_eq!(bits(fp32(&out.data)), bits(&values[row * per_row..(row + rows) * per_row]), "{:?}", input.shape);
                }
                row += rows;
            }
        }
        let err = pnet.infer_batch_one(&[&small, &wide]).expect_err("two shapes in one batch");
        assert!(err.to_string().contains("batches only inputs of one shape"), "{err}");
        for shape in [[1, 3, 11, 40], [1, 3, 40, 11]] {
            let err = pnet.validate_one(&image(1, shape[2], shape[3], 0.0)).expect_err("below min_shape");
            let want = format!("input 'image' must have at least shape [1, 3, 12, 12] (min_shape), got {shape:?}");
            assert!(matches!(&err, ModelError::BadInput(m) if *m == want), "{err}");
        }
        assert!(pnet.validate_one(&image(1, 12, 12, 0.0)).is_ok());
    }

    /// `seconds` of a tone that swells and fades, with a little noise: some windows speech-like,
    /// some not; `seed` shifts it.
    fn audio(rows: usize, samples: usize, seed: f32) -> InputTensor {
        let data: Vec<f32> = (0..rows * samples)
            .map(|i| {
                let t = (i % samples) as f32 / 16_000.0 + seed;
                0.3 * (t * 3.0).sin().abs() * (t * 2.0 * std::f32::consts::PI * 220.0).sin() + 0.01 * (i as f32 * 12.9898).sin()
            })
            .collect();
        InputTensor::from_f32(vec![rows, samples], &data)
    }

    #[test]
    fn the_shipped_silero_pads_a_batch_without_the_padding_changing_an_answer() {
        let vad = load(shipped("silero_vad")).expect("the shipped Silero VAD");
        assert!(vad.can_pad());
        let calibration: Vec<Vec<usize>> = vad.calibration_inputs().into_iter().map(|p| p.first().shape.clone()).collect();
        assert_eq!(calibration, [[1, 16_000], [2, 16_000], [1, 64_000], [2, 64_000], [1, 256_000], [2, 256_000]]);
        assert_eq!(vad.batching_probe_sizes(), [16_000, 64_000]);
        let path = model_file("silero_vad.jit");
        let (a, b, c) = (audio(1, 16_000, 0.0), audio(2, 20_000, 0.5), audio(1, 48_000, 1.0));
        let alone: Vec<Vec<OutputTensor>> = [&a, &b, &c].iter().map(|i| vad.infer_one(i).expect("alone")).collect();
        for (input, answer) in [&a, &b, &c].iter().zip(&alone) {
            let [prob] = &answer[..] else { panic!("one output") };
            assert_eq!((&*prob.name, prob.shape.clone()), ("speech_prob", vec![input.shape[0], input.shape[1].div_ceil(512)]));
            // Alone, what `audio_forward(x, 16000)` answers, cut to one value per started window.
            let [(shape, values)] = &direct(&path, "audio_forward", &[16_000], input)[..] else { panic!("one tensor") };
            let per_row = shape[1];
            let want: Vec<f32> = values.chunks(per_row).flat_map(|row| &row[..prob.shape[1]]).copied().collect();
            assert_eq!(bits(fp32(&prob.data)), bits(&want), "{:?}", input.shape);
        }
        // Padded with silence to the batch's length, each answers alone what it answers
        // unpadded: the padding is never seen.
        let padded = |input: &InputTensor, samples: usize| {
            let values: Vec<f32> = input.le_bytes().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let rows: Vec<f32> = values.chunks(input.shape[1]).flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0.0, samples - row.len()))).collect();
            InputTensor::from_f32(vec![input.shape[0], samples], &rows)
        };
        for (input, want) in [&a, &b, &c].iter().zip(&alone) {
            let [(shape, values)] = &direct(&path, "audio_forward", &[16_000], &padded(input, 48_000))[..] else { panic!("one tensor") };
            let got: Vec<f32> = values.chunks(shape[1]).flat_map(|row| &row[..want[0].shape[1]]).copied().collect();
            assert_eq!(bits(&got), bits(fp32(&want[0].data)), "{:?} padded to 48000 alone", input.shape);
        }
        // In one batch, each request gets its rows of what the module answers for the padded
        // batch, cut to its own windows; batch rows change the float arithmetic's order in the
        // last bits only.
        let batch = [&a, &b, &c];
        let batched = vad.infer_batch_one(&batch).expect("a padded batch");
        let stacked_padded = stacked(&batch.map(|i| padded(i, 48_000)).iter().collect::<Vec<_>>());
        let [(shape, values)] = &direct(&path, "audio_forward", &[16_000], &stacked_padded)[..] else { panic!("one tensor") };
        let mut row = 0;
        for ((input, got), alone) in batch.iter().zip(&batched).zip(&alone) {
            assert_eq!(got[0].shape, alone[0].shape, "{:?}", input.shape);
            let rows = &values[row * shape[1]..(row + input.shape[0]) * shape[1]];
            let want: Vec<f32> = rows.chunks(shape[1]).flat_map(|r| &r[..got[0].shape[1]]).copied().collect();
            assert_eq!(bits(fp32(&got[0].data)), bits(&want), "{:?} in a batch padded to 48000", input.shape);
            for (x, y) in fp32(&got[0].data).iter().zip(fp32(&alone[0].data)) {
                assert!((x - y).abs() < 1e-5, "{:?}: {x} batched, {y} alone", input.shape);
            }
            row += input.shape[0];
        }
        let err = vad.validate_one(&audio(1, 511, 0.0)).expect_err("below one window");
        assert_eq!(err.to_string(), "input 'audio' must have at least shape [1, 512] (min_shape), got [1, 511]");
    }

    #[test]
    fn padding_fills_with_the_pad_value_and_outputs_are_cut_to_their_rule() {
        use super::testing::{bright_model, entry, row_sum_model};
        // Each row's sum sees the padding: what it is filled with shows in the sums.
        let sum_keys = |pad: &str| {
            format!(
                "input = {{ name = \"pixels\", shape = [-1, -1], datatype = \"UINT8\", batching = \"pad\"{pad} }}\n\
                 outputs = [ {{ name = \"total\", shape = [-1, 1], datatype = \"INT64\" }} ]\n"
            )
        };
        let (short, long) = (
            InputTensor::from_data(vec![1, 3], &TensorData::Uint8(vec![0, 128, 255])),
            InputTensor::from_data(vec![1, 5], &TensorData::Uint8(vec![1, 2, 3, 4, 5])),
        );
        let sums = |model: &Model| -> Vec<TensorData> {
            model.infer_batch_one(&[&short, &long]).expect("a padded batch").into_iter().flatten().map(|o| o.data).collect()
        };
        let zero = load(entry(row_sum_model(), "sum", &sum_keys(""))).expect("padded with 0");
        assert_eq!(sums(&zero), [TensorData::Int64(vec![383]), TensorData::Int64(vec![15])]);
        let seven = load(entry(row_sum_model(), "sum", &sum_keys(", pad_value = 7"))).expect("padded with 7");
        assert_eq!(sums(&seven), [TensorData::Int64(vec![383 + 14]), TensorData::Int64(vec![15])]);
        // An output of the input's length, cut back to each request's own by its rule.
        let keys = "input = { name = \"pixels\", shape = [-1, -1], datatype = \"UINT8\", batching = \"pad\", pad_value = 255 }\n\
            outputs = [ { name = \"bright\", shape = [-1, -1], datatype = \"BOOL\", follows = [{ dim = 1, input_dim = 1 }] } ]\n";
        let bright = load(entry(bright_model(), "bright", keys)).expect("padded with 255");
        let answers: Vec<(Vec<usize>, TensorData)> =
            bright.infer_batch_one(&[&short, &long]).expect("a padded batch").into_iter().flatten().map(|o| (o.shape, o.data)).collect();
        assert_eq!(answers, [
            (vec![1, 3], TensorData::Bool(vec![false, true, true])),
            (vec![1, 5], TensorData::Bool(vec![false; 5])),
        ]);
    }

    /// `input` (FP32 `[rows, n]`) padded at the end of each row with zeros to `samples`.
    fn zero_padded(input: &InputTensor, samples: usize) -> InputTensor {
        let values: Vec<f32> = input.le_bytes().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let rows: Vec<f32> =
            values.chunks(input.shape[1]).flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0.0, samples - row.len()))).collect();
        InputTensor::from_f32(vec![input.shape[0], samples], &rows)
    }

    #[test]
    fn a_bucket_pads_every_batch_to_its_step_and_answers_stay_the_requests_own() {
        use super::testing::{bright_model, entry, row_sum_model};
        let uint8 = |values: &[u8]| InputTensor::from_data(vec![1, values.len()], &TensorData::Uint8(values.to_vec()));
        let (short, long) = (uint8(&[0, 128, 255]), uint8(&[1, 2, 3, 4, 200]));
        let answers = |outputs: Vec<Vec<OutputTensor>>| -> Vec<(Vec<usize>, TensorData)> {
            outputs.into_iter().flatten().map(|o| (o.shape, o.data)).collect()
        };

        // Each row's sum sees the padding: a lone request is padded to its bucket too.
        let sum_keys = "input = { name = \"pixels\", shape = [-1, -1], datatype = \"UINT8\", batching = \"pad\", pad_value = 7, bucket = 4 }\n\
            outputs = [ { name = \"total\", shape = [-1, 1], datatype = \"INT64\" } ]\n";
        let sum = load(entry(row_sum_model(), "sum", sum_keys)).expect("bucketed by 4");
        assert_eq!((sum.bucket(), sum.padded_shape_one(&[&short]), sum.padded_elements_one(&[&short])), (4, vec![1, 4], 4));
        assert_eq!((sum.padded_shape_one(&[&short, &long]), sum.padded_elements_one(&[&long])), (vec![2, 8], 8));
        assert_eq!(answers(sum.infer_batch_one(&[&short]).expect("alone")), [(vec![1, 1], TensorData::Int64(vec![383 + 7]))]);
        assert_eq!(answers(sum.infer_batch_one(&[&short, &long]).expect("a batch padded to 8")), [
            (vec![1, 1], TensorData::Int64(vec![383 + 5 * 7])),
            (vec![1, 1], TensorData::Int64(vec![210 + 3 * 7])),
        ]);
        // The probes are bucketed, so calibration measures shapes the model is called with.
        let probes: Vec<Vec<usize>> = sum.calibration_inputs().into_iter().map(|p| p.first().shape.clone()).collect();
        assert_eq!(probes, [[1, 32], [2, 32], [1, 64], [2, 64], [1, 128], [2, 128]]);

        // An elementwise model: a request answered in a bucketed batch is bit for bit what it
        // answers padded to its bucket and run alone, in its own shape.
        let bright_keys = |bucket: &str| {
            format!(
                "input = {{ name = \"pixels\", shape = [-1, -1], datatype = \"UINT8\", batching = \"pad\", pad_value = 255{bucket} }}\n\
                 outputs = [ {{ name = \"bright\", shape = [-1, -1], datatype = \"BOOL\", follows = [{{ dim = 1, input_dim = 1 }}] }} ]\n"
            )
        };
        let bucketed = load(entry(bright_model(), "bright", &bright_keys(", bucket = 4"))).expect("bucketed by 4");
        let plain = load(entry(bright_model(), "bright", &bright_keys(""))).expect("padded, no bucket");
        assert_eq!((plain.bucket(), plain.padded_shape_one(&[&short])), (1, vec![1, 3]));
        let in_batch = answers(bucketed.infer_batch_one(&[&short, &long]).expect("a batch padded to 8"));
        let want = [(vec![1, 3], TensorData::Bool(vec![false, true, true])), (vec![1, 5], TensorData::Bool(vec![false, false, false, false, true]))];
        assert_eq!(in_batch, want);
        for ((input, padded), want) in [(&short, uint8(&[0, 128, 255, 255])), (&long, uint8(&[1, 2, 3, 4, 200, 255, 255, 255]))].into_iter().zip(&want) {
            assert_eq!(&answers(vec![bucketed.infer_one(input).expect("alone")])[0], want, "{:?} alone, bucketed", input.shape);
            let [alone] = &plain.infer_one(&padded).expect("padded by hand")[..] else { panic!("one output") };
            let TensorData::Bool(values) = &alone.data else { panic!("BOOL") };
            assert_eq!(TensorData::Bool(values[..input.shape[1]].to_vec()), want.1, "{:?} padded to its bucket alone", input.shape);
        }

        // Silero VAD with bucket = 512: its padding is invisible to earlier windows.
        let mut config = shipped("silero_vad");
        config.input.as_mut().expect("an input").bucket = Some(512);
        let vad = load(config).expect("Silero VAD bucketed by 512");
        let probes: Vec<Vec<usize>> = vad.calibration_inputs().into_iter().map(|p| p.first().shape.clone()).collect();
        assert_eq!(probes, [[1, 16_384], [2, 16_384], [1, 64_000], [2, 64_000], [1, 256_000], [2, 256_000]]);
        assert_eq!(vad.probe_input_elements(2, 16_000), 2 * 16_384);
        let (a, b, c) = (audio(1, 16_000, 0.0), audio(2, 20_000, 0.5), audio(1, 47_700, 1.0));
        // Admission prices a request at its bucket: what it runs as alone.
        assert_eq!([&a, &b, &c].map(|i| vad.padded_elements_one(&[i])), [16_384, 2 * 20_480, 48_128]);
        let path = model_file("silero_vad.jit");
        let batch = [&a, &b, &c];
        let batched = vad.infer_batch_one(&batch).expect("a bucketed batch");
        assert_eq!(vad.padded_shape_one(&batch), [4, 48_128]);
        let stacked_padded = stacked(&batch.map(|i| zero_padded(i, 48_128)).iter().collect::<Vec<_>>());
        let [(shape, values)] = &direct(&path, "audio_forward", &[16_000], &stacked_padded)[..] else { panic!("one tensor") };
        let mut row = 0;
        for (input, got) in batch.iter().zip(&batched) {
            let [prob] = &got[..] else { panic!("one output") };
            let windows = input.shape[1].div_ceil(512);
            assert_eq!(prob.shape, [input.shape[0], windows], "its own windows, not its bucket's");
            // The batch's rows of what the module answers for the bucketed batch.
            let rows = &values[row * shape[1]..(row + input.shape[0]) * shape[1]];
            let want: Vec<f32> = rows.chunks(shape[1]).flat_map(|r| &r[..windows]).copied().collect();
            assert_eq!(bits(fp32(&prob.data)), bits(&want), "{:?} in a batch bucketed to 48128", input.shape);
            // Alone, bucketed: what the module answers for the request padded to its bucket,
            // and what the unbucketed model answers (the padding is never seen).
            let bucket = vad.padded_shape_one(&[input])[1];
            let [(one_shape, one)] = &direct(&path, "audio_forward", &[16_000], &zero_padded(input, bucket))[..] else { panic!("one tensor") };
            let want_alone: Vec<f32> = one.chunks(one_shape[1]).flat_map(|r| &r[..windows]).copied().collect();
            let [alone] = &vad.infer_one(input).expect("alone")[..] else { panic!("one output") };
            assert_eq!((alone.shape.clone(), bits(fp32(&alone.data))), (prob.shape.clone(), bits(&want_alone)), "{:?} alone", input.shape);
            for (x, y) in fp32(&prob.data).iter().zip(&want_alone) {
                assert!((x - y).abs() < 1e-5, "{:?}: {x} batched, {y} alone", input.shape);
            }
            row += input.shape[0];
        }
        let unbucketed = load(shipped("silero_vad")).expect("the shipped Silero VAD");
        let [alone] = &vad.infer_one(&a).expect("alone")[..] else { panic!("one output") };
        let [plain_alone] = &unbucketed.infer_one(&a).expect("alone, unbucketed")[..] else { panic!("one output") };
        assert_eq!((alone.shape.clone(), bits(fp32(&alone.data))), (plain_alone.shape.clone(), bits(fp32(&plain_alone.data))));
    }

    #[test]
    fn declared_inputs_must_fit_the_declared_shape() {
        // P-Net at 24² only: every non-batch dimension fixed.
        let keys = "input = { name = \"image\", shape = [-1, 3, 24, 24] }\n\
            outputs = [ { name = \"box_offsets\", shape = [-1, 4, 7, 7] }, { name = \"probs\", shape = [-1, 2, 7, 7] } ]\n\
            max_input_elements = 6912\n";
        let model = load(pnet_entry("pnet24", keys)).expect("P-Net at 24²");
        let check = |shape: &[usize], want: Result<(), String>| {
            let elements = shape.iter().product::<usize>();
            let input = InputTensor::from_f32(shape.to_vec(), &vec![0.5; elements]);
            match (model.validate_one(&input), want) {
                (Ok(()), Ok(())) => {}
                (Err(ModelError::BadInput(got) | ModelError::TooLarge(got)), Err(want)) => assert_eq!(got, want, "{shape:?}"),
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
        let over = model.validate_one(&InputTensor::from_f32(vec![5, 3, 24, 24], &[0.5; 8640]));
        assert!(matches!(over, Err(ModelError::TooLarge(_))), "a size over the limit is too large, not malformed: {over:?}");

        // Fixed dimensions: a probe's size multiplies rows.
        let probe = model.probe_input(2, 8).first().clone();
        assert_eq!(probe.shape, [16, 3, 24, 24]);
        assert_eq!(model.probe_input_elements(2, 8), 16 * 1728);
        let rows = |probes: Vec<Inputs>| probes.iter().map(|p| p.rows()).collect::<Vec<_>>();
        assert_eq!(rows(model.calibration_inputs()), [1, 2], "filtered by max_input_elements (4 rows)");
        assert_eq!(model.batching_probe_sizes(), [1]);
        let unbounded = load(pnet_entry("pnet24", &keys.replace("6912", "100000000"))).expect("no limit");
        let outputs = unbounded.infer_one(&probe).expect("16 rows");
        assert_eq!(outputs.iter().map(|o| o.shape.clone()).collect::<Vec<_>>(), [vec![16, 4, 7, 7], vec![16, 2, 7, 7]]);
        assert_eq!(rows(unbounded.calibration_inputs()), [1, 2, 8, 16, 32, 64]);
        for p in unbounded.calibration_inputs() {
            let values: Vec<f32> = p.first().le_bytes().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            assert!(values.iter().all(|v| (-1.0..=1.0).contains(v)) && values.iter().any(|&v| v != 0.0));
            assert_eq!(p.elements(), unbounded.probe_input_elements(p.rows(), 1) as u64);
        }
    }

    #[test]
    fn variable_dimensions_take_the_probe_sizes() {
        let model = load(pnet_entry("pnet", &format!("{DECLARED_PNET}probe_sizes = [48, 16]\n"))).expect("P-Net");
        assert_eq!(model.probe_input(2, 16).first().clone().shape, [2, 3, 16, 16]);
        assert_eq!(model.probe_input_elements(2, 16), 2 * 3 * 256);
        assert_eq!(model.batching_probe_sizes(), [16, 48]);
        let shapes: Vec<Vec<usize>> = model.calibration_inputs().into_iter().map(|p| p.first().shape.clone()).collect();
        assert_eq!(shapes, [[1, 3, 16, 16], [2, 3, 16, 16], [1, 3, 48, 48], [2, 3, 48, 48]]);
        let one = load(pnet_entry("pnet", &format!("{DECLARED_PNET}probe_sizes = [20]\n"))).expect("P-Net");
        let rows: Vec<usize> = one.calibration_inputs().iter().map(|p| p.rows()).collect();
        assert_eq!(rows, [1, 2, 4], "three probes for the fit from one size");
        assert!(model.validate_one(&image(1, 12, 500, 0.0)).is_ok());
        let err = model.validate_one(&image(1, 0, 12, 0.0)).expect_err("an empty dimension").to_string();
        assert_eq!(err, "input 'image' must have shape [-1, 3, -1, -1] (-1: any size), got [1, 3, 0, 12]");
    }

    #[test]
    fn a_declared_model_that_refuses_its_declaration_stops_at_load() {
        let check = |keys: &str, wants: &[&str]| {
            let err = load(pnet_entry("wrong_pnet", keys)).err().expect("refused at load").to_string();
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
    fn only_tensors_sequences_or_dicts_of_them_are_outputs() {
        let t = || IValue::Tensor(Tensor::from_slice(&[1.0f32, 2.0]));
        let none: &[&str] = &[];
        assert_eq!(returned_tensors(t(), none).map(|v| v.len()), Ok(1));
        assert_eq!(returned_tensors(IValue::Tuple(vec![t(), t()]), none).map(|v| v.len()), Ok(2));
        assert_eq!(returned_tensors(IValue::GenericList(vec![t(), t(), t()]), none).map(|v| v.len()), Ok(3));
        assert_eq!(returned_tensors(IValue::TensorList(vec![Tensor::from_slice(&[1.0f32])]), none).map(|v| v.len()), Ok(1));
        assert_eq!(
            returned_tensors(IValue::Tuple(vec![t(), IValue::Int(3)]), none).map(|v| v.len()),
            Err("returned an int at position 1 where a tensor was expected".into())
        );
        assert_eq!(
            returned_tensors(IValue::Int(3), none).map(|v| v.len()),
            Err("returned an int, expected a tensor, a tuple or list of tensors, or a dict of them".into())
        );
    }

    #[test]
    fn a_dict_output_is_taken_by_the_declared_names_in_their_order() {
        let key = |k: &str| IValue::String(k.to_string());
        let t = |v: f32| IValue::Tensor(Tensor::from_slice(&[v]));
        let dict = || IValue::GenericDict(vec![(key("scores"), t(1.0)), (key("boxes"), t(2.0)), (key("debug"), t(3.0))]);
        let got = returned_tensors(dict(), &["boxes", "scores"]).expect("two tensors");
        let values: Vec<f32> = got.iter().map(|t| t.double_value(&[0]) as f32).collect();
        assert_eq!(values, [2.0, 1.0], "declared order, the undeclared key dropped");
        assert_eq!(
            returned_tensors(dict(), &["boxes", "labels"]).map(|v| v.len()),
            Err("returned a dict without the key 'labels' (a declared output); its keys: debug, scores".into())
        );
        assert_eq!(
            returned_tensors(IValue::GenericDict(vec![(key("boxes"), IValue::Int(1))]), &["boxes"]).map(|v| v.len()),
            Err("returned an int under the key 'boxes' where a tensor was expected".into())
        );
        assert_eq!(
            returned_tensors(IValue::GenericDict(vec![(IValue::Int(0), t(1.0))]), &["boxes"]).map(|v| v.len()),
            Err("returned a dict with an int as a key where a string was expected".into())
        );
        let many = IValue::GenericDict((0..20).map(|i| (key(&format!("k{i:02}{}", "x".repeat(100))), t(0.0))).collect());
        let message = returned_tensors(many, &["boxes"]).map(|v| v.len()).expect_err("no such key");
        assert!(message.ends_with(" and 4 more") && message.len() < 16 * 70 + 120, "{message}");
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
    fn a_method_error_is_the_input_s_fault_unless_memory_or_the_device_failed() {
        let traceback = |error: &str| {
            format!(
                "The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript, serialized code \
                 (most recent call last):\n  File \"code/__torch__/torch/nn/modules/sparse.py\", line 12, in forward\n    \
                 _0 = torch.embedding(weight, input)\n{error}\n"
            )
        };
        let check = |message: &str, want: &str| {
            let got = match method_error("m", "forward", message) {
                ModelError::OutOfMemory { .. } => "oom",
                ModelError::Runtime { .. } => "device",
                ModelError::Raised { .. } => "input",
                other => panic!("{other:?}"),
            };
            assert_eq!(got, want, "{message}");
        };
        for input_fault in [
            traceback("RuntimeError: index out of range in self"),
            traceback("builtins.ValueError: audio samples must lie in [-1, 1]"),
            "Expected 4D input for 4D weight [10, 3, 3, 3], but got 3D input\nException raised from ...".to_string(),
        ] {
            check(&input_fault, "input");
        }
        for device_fault in [
            "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported at some other API call",
            "CUDA error: an illegal memory access was encountered",
            "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
            "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k)`",
            "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:219, unhandled cuda error",
            "CUDA error: misaligned address",
            "CUDA error: unspecified launch failure",
        ] {
            check(&traceback(&format!("RuntimeError: {device_fault}")), "device");
        }
        check(&traceback("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"), "oom");
        check(&traceback("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 5 bytes"), "oom");

        // The model's line, bounded, named by its method: never the traceback.
        match method_error("m", "forward", &traceback("RuntimeError: index out of range in self")) {
            ModelError::Raised { message, .. } => assert_eq!(message, "method 'forward': RuntimeError: index out of range in self"),
            other => panic!("{other:?}"),
        }
        let long = traceback(&format!("RuntimeError: {}", "é".repeat(2 * MODEL_MESSAGE_MAX_BYTES)));
        match method_error("m", "forward", &long) {
            ModelError::Raised { message, .. } => assert!(message.len() <= MODEL_MESSAGE_MAX_BYTES && message.len() > 500, "{}", message.len()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn padded_shape_takes_rows_and_the_largest_other_dims() {
        let a = InputTensor::from_f32(vec![1, 3, 20, 30], &[0.0; 1800]);
        let b = InputTensor::from_f32(vec![2, 3, 25, 12], &[0.0; 1800]);
        let declared = [-1, 3, -1, -1];
        assert_eq!(padded_shape(&[&a, &b], &declared, 1), vec![3, 3, 25, 30]);
        // Bucketed: the variable dimensions rounded up after the largest is taken, the batch
        // and the fixed dimension as they are; a lone request is rounded up too.
        assert_eq!(padded_shape(&[&a, &b], &declared, 8), vec![3, 3, 32, 32]);
        assert_eq!(padded_shape(&[&a, &b], &declared, 2), vec![3, 3, 26, 30]);
        assert_eq!(padded_shape(&[&b], &declared, 5), vec![2, 3, 25, 15]);
        assert_eq!(padded_shape(&[&a], &declared, 1 << 20), vec![1, 3, 1 << 20, 1 << 20]);
        assert_eq!(padded_shape(&[], &declared, 8), Vec::<usize>::new());
        assert_eq!((round_up(0, 8), round_up(9, 0), round_up(usize::MAX, 2)), (0, 9, usize::MAX));
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

    /// A model that returns a dict (scripts/export_models.py's `dict_outputs.jit` fixture):
    /// its tensors are answered under the declared names, in the declared order, each cut per
    /// request; a key it does not return stops the load with the keys it has.
    #[test]
    fn a_dict_returning_model_answers_by_key() {
        use super::testing::entry;
        let keys = |outputs: &str| {
            format!("input = {{ name = \"x\", shape = [-1, -1] }}\noutputs = [ {outputs} ]\n")
        };
        let path = model_file("dict_outputs.jit");
        let model = load(entry(&path, "dict", &keys("{ name = \"row_sum\", shape = [-1] }, { name = \"doubled\", shape = [-1, -1] }")))
            .expect("a dict model declared by two of its keys");
        let (a, b) = (InputTensor::from_f32(vec![1, 3], &[1.0, 2.0, 3.0]), InputTensor::from_f32(vec![2, 3], &[0.5, 0.5, 0.5, 4.0, 5.0, 6.0]));
        let answers = model.infer_batch_one(&[&a, &b]).expect("a batch of two");
        let got: Vec<Vec<(String, Vec<usize>, Vec<f32>)>> = answers
            .iter()
            .map(|outputs| outputs.iter().map(|o| (o.name.to_string(), o.shape.clone(), fp32(&o.data).to_vec())).collect())
            .collect();
        assert_eq!(got, [
            vec![("row_sum".into(), vec![1], vec![6.0]), ("doubled".into(), vec![1, 3], vec![2.0, 4.0, 6.0])],
            vec![("row_sum".into(), vec![2], vec![1.5, 15.0]), ("doubled".into(), vec![2, 3], vec![1.0, 1.0, 1.0, 8.0, 10.0, 12.0])],
        ]);
        let err = load(entry(&path, "dict", &keys("{ name = \"scores\", shape = [-1] }"))).err().expect("no such key").to_string();
        assert!(err.contains("returned a dict without the key 'scores' (a declared output); its keys: doubled, row_sum, unused"), "{err}");
    }

    /// A module traced here from an FP32 `example`, answering `f(x)`, saved as `name`.
    fn traced_fp32_model(name: &str, example: Tensor, f: fn(&Tensor) -> Tensor) -> std::path::PathBuf {
        let module = CModule::create_by_tracing(name, "forward", &[example], &mut |x| vec![f(&x[0])]).expect("a traced module");
        let path = std::env::temp_dir().join(format!("vramgate-{name}-{}.jit", std::process::id()));
        module.save(&path).expect("the traced module saved");
        path
    }

    /// A model of two inputs (`inputs`): each request carries both, in the declared order;
    /// requests of different sizes share a padded batch, each input padded on its own, and an
    /// output follows the input its rule names.
    #[test]
    fn a_model_of_two_inputs_takes_both_and_batches_them_together() {
        use super::testing::entry;
        let example = [Tensor::ones([2, 3], (Kind::Float, Device::Cpu)), Tensor::ones([2, 3], (Kind::Float, Device::Cpu))];
        let module = CModule::create_by_tracing("product", "forward", &example, &mut |x| vec![&x[0] * &x[1]]).expect("traced");
        let path = std::env::temp_dir().join(format!("vramgate-product-{}.jit", std::process::id()));
        module.save(&path).expect("saved");
        let keys = "inputs = [ { name = \"a\", shape = [-1, -1], batching = \"pad\" }, { name = \"b\", shape = [-1, -1], batching = \"pad\", pad_value = 7 } ]\n\
                    outputs = [ { name = \"p\", shape = [-1, -1], follows = [{ input = \"b\", dim = 1, input_dim = 1 }] } ]\n";
        let model = load(entry(&path, "product", keys)).expect("two inputs");
        let names: Vec<&str> = model.input_specs().iter().map(|s| &*s.name).collect();
        assert_eq!(names, ["a", "b"]);
        let request = |a: &[f32], b: &[f32], rows: usize| {
            model
                .accept(vec![InputTensor::from_f32(vec![rows, a.len() / rows], a), InputTensor::from_f32(vec![rows, b.len() / rows], b)])
                .expect("valid")
        };
        let (one, two) = (request(&[1.0, 2.0], &[3.0, 4.0], 1), request(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2.0; 6], 2));
        assert!(model.can_share(&one, &two));
        assert_eq!(model.padded_shapes(&[&one, &two]), [[3, 3], [3, 3]]);
        assert_eq!((model.padded_elements(&[&one, &two]), model.row_elements(&[&one])), (18, 4));
        let answers = model.infer_batch(&[&one, &two]).expect("a padded batch of two");
        let got: Vec<(Vec<usize>, Vec<f32>)> = answers.iter().map(|a| (a[0].shape.clone(), fp32(&a[0].data).to_vec())).collect();
        assert_eq!(got, [(vec![1, 2], vec![3.0, 8.0]), (vec![2, 3], vec![2.0, 4.0, 6.0, 8.0, 10.0, 12.0])]);
        // Both inputs probed at each size, their elements counted together.
        let probe = model.probe_input(2, 32);
        assert_eq!(probe.tensors().iter().map(|t| t.shape.clone()).collect::<Vec<_>>(), [[2, 32], [2, 32]]);
        assert_eq!(model.probe_input_elements(2, 32), 128);
        // Mismatched requests are refused before libtorch, naming the inputs.
        let err = model.accept(vec![InputTensor::from_f32(vec![1, 2], &[1.0, 2.0])]).expect_err("one input short").to_string();
        assert_eq!(err, "model 'product' takes 2 inputs (a, b), got 1");
        let err = model
            .accept(vec![InputTensor::from_f32(vec![1, 2], &[1.0, 2.0]), InputTensor::from_f32(vec![2, 1], &[1.0, 2.0])])
            .expect_err("rows differ")
            .to_string();
        assert_eq!(err, "inputs 'a' and 'b' must have as many rows (dimension 0, the batch), got 1 and 2");
        let err = model
            .accept(vec![InputTensor::from_f32(vec![1, 2], &[1.0, 2.0]), InputTensor::from_f32(vec![1, 0], &[])])
            .expect_err("an empty b")
            .to_string();
        assert_eq!(err, "input 'b' must have shape [-1, -1] (-1: any size), got [1, 0]");
    }

    /// Triton's `max_batch_size = 0`: the model takes one whole tensor (here a signal `[n]`,
    /// answered with its running sum `[n]`); the worker adds the batch dimension to run it and
    /// takes it off the answer, metadata and messages show the declared shapes, and each
    /// request runs alone.
    #[test]
    fn a_model_without_a_batch_dimension_is_called_on_one_request_as_declared() {
        use super::testing::entry;
        let path = traced_fp32_model("running_sum", Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]), |x| x.cumsum(0, Kind::Float));
        let keys = |more: &str, output: &str| {
            format!("max_batch_size = 0\ninput = {{ name = \"signal\", shape = [-1]{more} }}\noutputs = [ {{ name = \"sum\", shape = {output} }} ]\n")
        };
        let model = load(entry(&path, "running_sum", &keys(", min_shape = [2]", "[-1]"))).expect("an unbatched model");
        assert!(!model.batched());
        assert_eq!((model.input_spec().shape.clone(), model.output_specs()[0].shape.clone()), (vec![-1], vec![-1]));
        let input = model.accept(vec![InputTensor::from_f32(vec![5], &[1.0, 2.0, 3.0, 4.0, 5.0])]).expect("a signal of five");
        assert_eq!(input.first().shape, [1, 5], "run as a batch of one");
        let answer = model.infer(&input).expect("an answer");
        assert_eq!((answer[0].shape.clone(), fp32(&answer[0].data).to_vec()), (vec![5], vec![1.0, 3.0, 6.0, 10.0, 15.0]));
        for (shape, want) in [
            (vec![1, 5], "input 'signal' must have shape [-1] (-1: any size), got [1, 5]"),
            (vec![1], "input 'signal' must have at least shape [2] (min_shape), got [1]"),
        ] {
            let n = shape.iter().product();
            let err = model.accept(vec![InputTensor::from_f32(shape, &vec![0.5; n])]).expect_err(want).to_string();
            assert_eq!(err, want);
        }
        let err = model.accept(vec![InputTensor::from_f32(vec![4], &[0.5; 3])]).expect_err("3 values for 4").to_string();
        assert_eq!(err, "input 'signal' of shape [4] holds 4 elements but 3 were sent");
        // Probed at batch 1 only, at three sizes; nothing to time for batch sizes.
        let shapes = |m: &Model| m.calibration_inputs().iter().map(|p| p.first().shape.clone()).collect::<Vec<_>>();
        assert_eq!(shapes(&model), [[1, 32], [1, 64], [1, 128]]);
        assert!(model.batching_probe_sizes().is_empty());
        let err = model.infer_batch(&[&input, &input]).expect_err("two requests in one call").to_string();
        assert_eq!(err, "model 'running_sum' takes no batch dimension: one request per call, got 2");
        let one_size = load(entry(&path, "running_sum", &format!("{}probe_sizes = [100]\n", keys("", "[-1]")))).expect("loads");
        assert_eq!(shapes(&one_size), [[1, 100], [1, 200], [1, 400]], "the largest size doubled until three");
        // A model that does not answer its declaration stops the load, in declared shapes.
        let err = load(entry(&path, "running_sum", &keys("", "[-1, 2]"))).err().expect("rank 1 returned").to_string();
        assert!(err.contains("returned output 'sum' of shape [32], declared [-1, 2] (-1: any size): its rank differs"), "{err}");

        // A fixed shape: three probes of that one shape, and a fixed output dimension checked.
        let path = traced_fp32_model("row_sums", Tensor::ones([2, 3], (Kind::Float, Device::Cpu)), |x| x.sum_dim_intlist(1, false, Kind::Float));
        let fixed = |output: &str| {
            format!("max_batch_size = 0\ninput = {{ name = \"m\", shape = [2, 3] }}\noutputs = [ {{ name = \"sums\", shape = {output} }} ]\n")
        };
        let model = load(entry(&path, "row_sums", &fixed("[2]"))).expect("a fixed-shape unbatched model");
        assert_eq!(shapes(&model), [[1, 2, 3], [1, 2, 3], [1, 2, 3]]);
        let input = model.accept(vec![InputTensor::from_f32(vec![2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])]).expect("a 2 × 3 matrix");
        let answer = model.infer(&input).expect("an answer");
        assert_eq!((answer[0].shape.clone(), fp32(&answer[0].data).to_vec()), (vec![2], vec![6.0, 15.0]));
        let err = model.accept(vec![InputTensor::from_f32(vec![3, 3], &[0.0; 9])]).expect_err("3 rows").to_string();
        assert_eq!(err, "input 'm' must have shape [2, 3] (-1: any size), got [3, 3]");
        let err = load(entry(&path, "row_sums", &fixed("[3]"))).err().expect("2 returned").to_string();
        assert!(err.contains("returned output 'sums' of shape [2], declared [3] (-1: any size): a fixed dimension differs"), "{err}");
    }

    #[test]
    fn a_declared_model_takes_and_gives_other_datatypes() {
        use super::testing::{bright_model, entry, row_sum_model, DECLARED_BRIGHT};
        let bright = load(entry(bright_model(), "bright", DECLARED_BRIGHT)).expect("UINT8 in, BOOL out");
        assert_eq!((bright.input_spec().datatype, bright.output_specs()[0].datatype), (DataType::Uint8, DataType::Bool));
        let probe = bright.probe_input(2, 4).first().clone();
        assert_eq!((probe.datatype(), probe.shape.clone(), probe.le_bytes()), (DataType::Uint8, vec![2, 4], &[0, 1, 0, 1, 0, 1, 0, 1][..]));
        let (a, b) = (
            InputTensor::from_data(vec![1, 3], &TensorData::Uint8(vec![0, 128, 255])),
            InputTensor::from_le_bytes(vec![2, 3], DataType::Uint8, Bytes::from_static(&[127, 1, 2, 200, 3, 4])).expect("6 bytes"),
        );
        let values = |answers: Vec<Vec<OutputTensor>>| -> Vec<(Vec<usize>, TensorData)> {
            answers.into_iter().flatten().map(|o| (o.shape, o.data)).collect()
        };
        assert_eq!(values(bright.infer_batch_one(&[&a, &b]).expect("a batch of two")), [
            (vec![1, 3], TensorData::Bool(vec![false, true, true])),
            (vec![2, 3], TensorData::Bool(vec![false, false, false, true, false, false])),
        ]);
        let err = bright.validate_one(&InputTensor::from_f32(vec![1, 3], &[0.0; 3])).expect_err("FP32 sent");
        assert_eq!(err.to_string(), "input 'pixels' must be UINT8, got FP32");

        let sum_keys = DECLARED_BRIGHT.replace("\"bright\", shape = [-1, -1], datatype = \"BOOL\"", "\"total\", shape = [-1, 1], datatype = \"INT64\"");
        let sum = load(entry(row_sum_model(), "sum", &sum_keys)).expect("UINT8 in, INT64 out");
        assert_eq!(values(sum.infer_batch_one(&[&a, &b]).expect("a batch of two")), [
            (vec![1, 1], TensorData::Int64(vec![383])),
            (vec![2, 1], TensorData::Int64(vec![130, 207])),
        ]);

        // An output whose kind widens exactly into the declared datatype is converted (BOOL
        // answered as UINT8, as FP32); a narrower declaration is refused at load.
        for (datatype, want) in [("UINT8", TensorData::Uint8(vec![0, 1, 1])), ("FP32", TensorData::Fp32(vec![0.0, 1.0, 1.0]))] {
            let keys = DECLARED_BRIGHT.replace("\"BOOL\"", &format!("\"{datatype}\""));
            let widened = load(entry(bright_model(), "bright", &keys)).expect(datatype);
            assert_eq!(widened.infer_one(&a).expect("an answer")[0].data, want);
        }
        let err = load(entry(row_sum_model(), "sum", &sum_keys.replace("INT64", "INT32"))).err().expect("INT64 as INT32");
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
