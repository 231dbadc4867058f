//! The worker's configuration tree: where it listens, which device it uses, which models it
//! serves. Read from a TOML file and `VRAMGATE_WORKER_*` environment variables.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Address the HTTP server binds; port 0 picks a free one (the bound address is logged).
    pub listen: SocketAddr,
    /// Which device runs the models.
    pub device: DeviceChoice,
    /// libtorch intra-op threads; 0 keeps libtorch's default (one per core). Defaults to 1:
    /// small recurrent models such as Silero VAD run a long chain of tiny ops, where the
    /// intra-op pool only spins (measured on 2 cores, 10 s clip: median 78 ms with 1 thread,
    /// 463 ms with 2).
    pub torch_threads: usize,
    /// Largest request body accepted, in bytes; larger bodies get 413 before they are read.
    pub max_request_bytes: usize,
    /// A hard cap on the memory this worker may take beyond its start-up footprint (models
    /// loaded and warmed). CUDA: the caching allocator's per-process memory fraction, so an
    /// allocation past it fails with a CUDA OOM as on a smaller card. CPU: the process's
    /// address-space limit (`RLIMIT_AS`), set to the address space in use after start-up plus
    /// this many bytes, so libtorch's allocations past it fail with `can't allocate memory`.
    /// Also caps the admission budget. Unset: no cap.
    pub memory_limit_bytes: Option<u64>,
    /// CPU only: room the address-space limit leaves on top of `memory_limit_bytes` for what
    /// would be host memory next to a GPU (request bodies, decoded inputs waiting for
    /// admission, HTTP buffers, thread stacks, allocator arenas). Without it a burst of
    /// large request bodies would meet the cap in Rust code, where a failed allocation
    /// aborts the process instead of raising an OOM libtorch can recover from. A request
    /// holds up to about 3× its body at once while it is read and decoded, so size it as
    /// 3 × (requests in flight) × (largest body).
    pub memory_host_allowance_bytes: u64,
    /// CPU only: the memory admission may hand out. Unset: what the kernel reports available
    /// (`MemAvailable`) after start-up. Either way capped by `memory_limit_bytes`.
    pub memory_budget_bytes: Option<u64>,
    /// Kept out of the budget as a margin against estimates that are a little low and memory
    /// that is not any request's (allocator slack, threads, HTTP buffers): the larger of
    /// `memory_reserve_fraction` of the initial headroom and `memory_reserve_bytes`.
    /// Measured estimates and OOM recovery make a small reserve safe; TGI and vLLM keep 8–10%.
    pub memory_reserve_fraction: f64,
    pub memory_reserve_bytes: u64,
    /// How often free memory is re-sampled: when another process takes memory the budget
    /// shrinks, and it grows back when that memory is freed.
    pub memory_resample_ms: u64,
    /// How requests are admitted.
    pub admission: AdmissionConfig,
    /// How requests for one model are merged into batches.
    pub batching: BatchingConfig,
    /// Deadline of a request that names none (`x-vramgate-timeout-ms` header, or Triton's
    /// `parameters.timeout` in microseconds).
    pub default_timeout_ms: u64,
    /// Return cached, unused allocator memory to the device every this many batches (0: never).
    /// CUDA only; on CPU freed tensors go back to the OS at once.
    pub cleanup_every_batches: u64,
    /// Return cached memory when the allocator holds more than this many bytes it is not
    /// using (reserved − allocated). CUDA only. Unset: never.
    pub cleanup_slack_bytes: Option<u64>,
    /// The models to load at start-up.
    pub models: Vec<ModelConfig>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// `bytes`: a request waits until its estimated memory fits in the budget (the product).
    /// `count`: at most `max_concurrent` requests at once, whatever their size, as a
    /// hand-set semaphore would; kept for comparison (the admission benchmark uses it).
    pub mode: AdmissionMode,
    /// For `count`: requests admitted at once.
    pub max_concurrent: u64,
    /// Longest a request waits for admission before 503 + `Retry-After`.
    pub max_queue_wait_ms: u64,
    /// Requests allowed to wait at once; one more gets 503 + `Retry-After` at once.
    pub max_queued_requests: usize,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig { mode: AdmissionMode::Bytes, max_concurrent: 4, max_queue_wait_ms: 30_000, max_queued_requests: 256 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionMode {
    Bytes,
    Count,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BatchingConfig {
    /// After the first request of a batch arrives, wait this long for more.
    pub window_ms: f64,
    /// Most requests merged into one batch (a model's own `max_batch_size` wins).
    pub max_batch_size: usize,
}

impl Default for BatchingConfig {
    fn default() -> Self {
        BatchingConfig { window_ms: 2.0, max_batch_size: 8 }
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8081)),
            device: DeviceChoice::Auto,
            torch_threads: 1,
            max_request_bytes: 256 * 1024 * 1024,
            memory_limit_bytes: None,
            memory_host_allowance_bytes: 512 * 1024 * 1024,
            memory_budget_bytes: None,
            memory_reserve_fraction: 0.05,
            memory_reserve_bytes: 32 * 1024 * 1024,
            memory_resample_ms: 1000,
            admission: AdmissionConfig::default(),
            batching: BatchingConfig::default(),
            default_timeout_ms: 60_000,
            cleanup_every_batches: 0,
            cleanup_slack_bytes: None,
            models: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceChoice {
    /// CUDA device 0 when libtorch sees one, else the CPU.
    Auto,
    Cpu,
    /// CUDA device 0; start-up fails when there is none.
    Cuda,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients use in `/v2/models/{name}`.
    pub name: String,
    /// Path of the TorchScript file; relative paths are resolved from the working directory.
    pub path: PathBuf,
    /// How the model is called and what its tensors mean.
    pub kind: ModelKind,
    /// For `voice_activity`: the sample rate the model expects (the gateway converts to it).
    #[serde(default = "default_sample_rate")]
    pub sample_rate_hz: u32,
    /// For `voice_activity`: samples per output window.
    #[serde(default = "default_window")]
    pub window_samples: u32,
    /// Largest number of input elements (e.g. audio samples × batch) one request may carry.
    #[serde(default = "default_max_input_elements")]
    pub max_input_elements: usize,
    /// Copies of the model loaded, each with its own batch thread: how many batches of this
    /// model may run at once (Triton's instance count). Memory admission decides whether
    /// they fit; this only bounds the parallelism.
    #[serde(default = "default_instances")]
    pub instances: usize,
    /// Overrides `batching.max_batch_size` for this model.
    #[serde(default)]
    pub max_batch_size: Option<usize>,
    /// Overrides the memory estimate measured at start-up (it is still corrected upwards
    /// from what batches are seen to use).
    #[serde(default)]
    pub estimate: Option<EstimateConfig>,
}

/// A request's memory ≈ `base_bytes + bytes_per_element × input elements`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EstimateConfig {
    pub base_bytes: f64,
    pub bytes_per_element: f64,
}

fn default_instances() -> usize {
    1
}

fn default_max_input_elements() -> usize {
    // 10 minutes of 16 kHz audio.
    16_000 * 600
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// A Silero-style voice-activity model: `audio_forward(audio[batch, samples], sample_rate)`
    /// returns one speech probability per window of `window_samples`.
    VoiceActivity,
    /// An MTCNN P-Net-style face detector: `forward(image[batch, 3, H, W])` returns box
    /// offsets `[batch, 4, h, w]` and probabilities `[batch, 2, h, w]`, one cell per 12×12
    /// window at stride 2. The worker answers `face_prob` `[batch, h, w]` and `box_offsets`.
    FaceDetection,
}

fn default_sample_rate() -> u32 {
    16_000
}

fn default_window() -> u32 {
    512
}
