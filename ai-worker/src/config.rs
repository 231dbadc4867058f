//! The worker's configuration tree: where it listens, which device it uses, which models it
//! serves. Read from a TOML file and `VRAMGATE_WORKER_*` environment variables
//! ([`WorkerConfig::load`]).
//!
//! Secrets (`auth_token`, and any key [`vramgate_shared::config::is_secret_key`] names one)
//! never reach a log line or an error message: [`Secret`]'s `Debug` is redacted, and a config
//! error about such a key names the key but not its value, whatever the value's type (the
//! shared [`vramgate_shared::config::ConfigError`] does the redaction).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::Figment;
use serde::{Deserialize, Serialize};
pub use vramgate_shared::config::Secret;
pub use repository::{model_names as repository_model_names, read_folder as repository_read_folder};
pub use repository::{MAX_MODEL_CONFIG_BYTES, MAX_MODEL_FOLDERS, MAX_VERSION_FOLDERS, MODEL_CONFIG_FILE};
use vramgate_shared::oip::DataType;

mod repository;

/// Prefix of the environment variables that override the config (`__` between levels).
pub const ENV_PREFIX: &str = "VRAMGATE_WORKER_";

/// Most streams a gRPC connection may be allowed at once (`grpc_max_concurrent_streams`).
pub const MAX_GRPC_STREAMS: u32 = 1024;

/// Why the worker's configuration was refused. Never carries a secret's value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file or an environment variable could not be read into the config tree.
    #[error(transparent)]
    Invalid(#[from] vramgate_shared::config::ConfigError),
    /// `model_repository` or one of its model folders could not be read or is invalid; the
    /// message names the folder or file.
    #[error("{0}")]
    Repository(String),
    /// Each value is valid on its own, but together they cannot work.
    #[error("inconsistent configuration: {0}")]
    Inconsistent(String),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Address the HTTP server binds; port 0 picks a free one (the bound address is logged).
    pub listen: SocketAddr,
    /// Address the gRPC server (the protocol's `GRPCInferenceService`) binds, e.g.
    /// `127.0.0.1:8001` (Triton's gRPC port); unset: no gRPC server. Port 0 picks a free one.
    /// It shares the engine, the bearer token and the request limits with HTTP:
    /// `max_request_bytes` per message, `max_body_bytes_in_flight` across both doors,
    /// `body_read_timeout_ms` per message.
    pub grpc_listen: Option<SocketAddr>,
    /// Streams (calls) one gRPC connection may have open at once (HTTP/2's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`); more wait for the client's own flow control.
    pub grpc_max_concurrent_streams: u32,
    /// Trace export (OTLP); the `OTEL_*` variables override it.
    pub telemetry: vramgate_shared::telemetry::TelemetryConfig,
    /// Which device runs the models.
    pub device: DeviceChoice,
    /// libtorch intra-op threads; 0 keeps libtorch's default (one per core). Defaults to 1:
    /// small recurrent models such as Silero VAD run a long chain of tiny ops, where the
    /// intra-op pool only spins (measured on 2 cores, 10 s clip: median 78 ms with 1 thread,
    /// 463 ms with 2).
    pub torch_threads: usize,
    /// Runs every model call under libtorch's `InferenceMode` (no autograd state at all,
    /// cheaper than `no_grad`; Triton's PyTorch backend's `INFERENCE_MODE`). Needs the C++ shim
    /// (built with the CUDA headers); without it, and with `false`, calls run under `no_grad`.
    pub inference_mode: bool,
    /// TorchScript's graph-executor optimisation (its passes and fusion before a plan runs),
    /// set on every thread that calls a model, since libtorch keeps it per thread. On, as
    /// libtorch's default; the GPU kit measures both.
    pub jit_optimize: bool,
    /// cuDNN's autotuner (`torch.backends.cudnn.benchmark`): on the first call at each shape
    /// cuDNN times its convolution algorithms and keeps the fastest. Off by default: the time
    /// it takes is paid per new shape, and the worker warms every batch bucket at load anyway,
    /// so the kit measures whether it pays. CUDA only.
    pub cudnn_benchmark: bool,
    /// Largest request body accepted, in bytes; larger bodies get 413 before they are read
    /// (from `Content-Length`; chunked bodies as soon as they pass it).
    pub max_request_bytes: usize,
    /// Bytes of request bodies being read and decoded at once, all connections together.
    /// A body is charged before it is read: its `Content-Length`, or, for a chunked body, as
    /// its chunks arrive (up to `max_request_bytes`); the charge is held until the body is
    /// decoded into tensors and dropped. A body that does not fit gets 503 + `Retry-After`
    /// at once instead of being read. Must be at least `max_request_bytes`. Host memory
    /// for the bodies is about twice this (a body and its decoded tensors); see
    /// `memory_host_allowance_bytes`.
    pub max_body_bytes_in_flight: u64,
    /// Longest a connection may take to send a request's headers, counted from its first
    /// byte (or from the connection's opening); past it the connection is closed.
    pub header_read_timeout_ms: u64,
    /// Longest a request's body may take to arrive, counted from when the worker starts
    /// reading it; past it the request gets 408 and the connection is closed. At the default
    /// (60 s) a 256 MiB body needs about 4.5 MB/s.
    pub body_read_timeout_ms: u64,
    /// Longest a keep-alive connection may stay idle (no request in progress and no byte of
    /// the next one) before the worker closes it. Also bounds writing a response to a
    /// client that stopped reading. On the gRPC door: longest a connection may go without a
    /// call in progress (HTTP/2 pings do not count) before it is closed.
    pub idle_timeout_ms: u64,
    /// Bearer token the inference endpoints require (`Authorization: Bearer <token>`):
    /// `POST /v2/models/{name}[/versions/{v}]/infer` and `GET /v2/models/{name}[/versions/{v}]`.
    /// Health (`/v2/health/*`, `/v2/models/{name}/ready`), `/v2` and `/metrics` stay open.
    /// Compared in constant time. Unset: no authentication. Best set through the environment
    /// variable `VRAMGATE_WORKER_AUTH_TOKEN`, read verbatim (a token such as `0123` or `12e4`
    /// is not taken for a number); in the TOML file a string (or a bare integer). Never logged
    /// or echoed.
    pub auth_token: Option<Secret>,
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
    /// 3 × (requests in flight) × (largest body). Bodies being read are bounded by
    /// `max_body_bytes_in_flight`, so at least 2 × `max_body_bytes_in_flight` (the defaults:
    /// 2 × 256 MiB = 512 MiB) plus room for decoded inputs waiting for admission; start-up
    /// warns when it is less.
    pub memory_host_allowance_bytes: u64,
    /// CPU only: the memory admission may hand out. Unset: what the kernel reports available
    /// (`MemAvailable`) after start-up. Either way capped by `memory_limit_bytes`.
    pub memory_budget_bytes: Option<u64>,
    /// For testing recovery only, never in service: admission hands out exactly this many
    /// bytes, whatever the device has free and whatever `memory_limit_bytes` says, and no
    /// reserve is kept. Set above what the card (or the cap) can hold, it lets more work run
    /// at once than fits, so that real out-of-memory errors happen and the worker's recovery
    /// (empty the cache, halve the batch, serialise, answer 507) is what keeps requests
    /// answered. The GPU kit's OOM check sets it; start-up logs a warning when it is set.
    pub memory_budget_override_bytes: Option<u64>,
    /// Kept out of the budget as a margin against estimates that are a little low and memory
    /// that is not any request's (allocator slack, threads, HTTP buffers): the larger of
    /// `memory_reserve_fraction` of the initial headroom and `memory_reserve_bytes`.
    /// Measured estimates and OOM recovery make a small reserve safe; TGI and vLLM keep 8–10%.
    pub memory_reserve_fraction: f64,
    pub memory_reserve_bytes: u64,
    /// How often free memory is re-sampled: when another process takes memory the budget
    /// shrinks, and it grows back when that memory is freed.
    pub memory_resample_ms: u64,
    /// Besides the batches whose memory peak says something new (a new size class, a batch
    /// larger than any measured, the batches after an OOM), measure the peak of one batch in
    /// this many, to catch a slow drift of the estimate (0: only the new ones; 1: every batch),
    /// on the CPU at most once every 5 s (`estimate::PERIODIC_MIN_GAP`). A measurement costs a
    /// CPU batch its page faults again (about twice its time), and the batches after it too,
    /// so measuring every batch costs most of the throughput (see `estimate.rs`); on CUDA it
    /// only resets and reads the caching allocator's counters (nothing is freed).
    pub memory_measure_every_batches: u64,
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
    /// The models to load at start-up. After [`WorkerConfig::load`], the models of
    /// `model_repository` follow these.
    pub models: Vec<ModelConfig>,
    /// A folder of models read at start-up (Triton's model repository), one sub-folder per
    /// model: `<folder>/<name>/config.toml` holds the keys of a `models` entry but `name` (the
    /// folder's name) and with `path` optional (default: the folder's one `*.pt` or `*.jit`
    /// file; a relative path is resolved from the model's folder). Merged with `models`; a
    /// name defined twice is an error. Hidden folders are ignored and folders without
    /// `config.toml` skipped (with a warning). Relative to the working directory. Unset: none.
    pub model_repository: Option<PathBuf>,
    /// The folders of `model_repository` skipped for having no `config.toml`: found by
    /// [`WorkerConfig::load`], logged when the server starts (the log is not set up while the
    /// config is read).
    #[serde(skip)]
    pub skipped_model_folders: Vec<String>,
    /// Whether the models of `model_repository` may change while the worker runs (Triton's
    /// model control mode): `none`, the repository is read at start-up only; `explicit`, the
    /// repository API (`POST /v2/repository/models/{name}/load` and `/unload`) loads and
    /// unloads them; `poll`, the folder is re-read every `repository_poll_seconds` and what
    /// changed is loaded or unloaded. The index (`POST /v2/repository/index`) answers in every
    /// mode.
    pub model_control: ModelControl,
    /// How often `poll` mode re-reads the repository, in seconds (0.1 to 3600).
    pub repository_poll_seconds: f64,
    /// Longest a run-time load waits for its bytes of the admission budget (in-flight work to
    /// drain) before it is refused with 503.
    pub load_wait_ms: u64,
    /// What a run-time load is priced at before it is measured, in bytes on top of twice the
    /// model file's size (the weights, and their copy while libtorch reads them): its warm-up
    /// and calibration. Admitted like a request, so a load never takes memory in-flight work
    /// holds.
    pub load_warmup_bytes: u64,
}

/// How the models of the repository may change at run time: see [`WorkerConfig::model_control`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelControl {
    #[default]
    None,
    Explicit,
    Poll,
}

impl ModelControl {
    pub fn as_str(self) -> &'static str {
        match self {
            ModelControl::None => "none",
            ModelControl::Explicit => "explicit",
            ModelControl::Poll => "poll",
        }
    }
}

/// Bounds of `repository_poll_seconds`.
pub const REPOSITORY_POLL_SECONDS: (f64, f64) = (0.1, 3600.0);
/// Most a run-time load may wait for its bytes (`load_wait_ms`).
pub const MAX_LOAD_WAIT_MS: u64 = 600_000;

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

/// How batches are formed. Their size is not configured: the worker measures, per model and
/// input size, which batch size gives the most throughput (`batching.rs`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BatchingConfig {
    /// Longest a batch waits for more requests to join. What is already queued joins at once;
    /// the batch waits only when batching pays for its input size and requests for the model
    /// are on their way or have lately overlapped, so a lone client never pays the window.
    pub window_ms: f64,
    /// An upper bound on the items (rows) of one batch, for latency; a model's own
    /// `max_batch_size` wins. Unset: only measured throughput and memory bound it. Never a
    /// target: below it the worker uses the batch size that measured fastest.
    pub max_batch_size: Option<usize>,
    /// Time batch sizes at start-up (a few seconds per model on CPU), so that the first
    /// requests already batch where it pays. Off: every size class starts at
    /// `initial_batch_size` and is measured online only.
    pub calibrate: bool,
    /// The batch size of a size class with no figures of its own nor a measured neighbour: a
    /// prior that online measurement replaces (`batching.rs`).
    pub initial_batch_size: usize,
}

impl Default for BatchingConfig {
    fn default() -> Self {
        BatchingConfig { window_ms: 2.0, max_batch_size: None, calibrate: true, initial_batch_size: 1 }
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8081)),
            grpc_listen: None,
            grpc_max_concurrent_streams: 128,
            telemetry: Default::default(),
            device: DeviceChoice::Auto,
            torch_threads: 1,
            inference_mode: true,
            jit_optimize: true,
            cudnn_benchmark: false,
            max_request_bytes: 256 * 1024 * 1024,
            max_body_bytes_in_flight: 256 * 1024 * 1024,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 60_000,
            idle_timeout_ms: 60_000,
            auth_token: None,
            memory_limit_bytes: None,
            memory_host_allowance_bytes: 512 * 1024 * 1024,
            memory_budget_bytes: None,
            memory_budget_override_bytes: None,
            memory_reserve_fraction: 0.05,
            memory_reserve_bytes: 32 * 1024 * 1024,
            memory_resample_ms: 1000,
            memory_measure_every_batches: 100,
            admission: AdmissionConfig::default(),
            batching: BatchingConfig::default(),
            default_timeout_ms: 60_000,
            cleanup_every_batches: 0,
            cleanup_slack_bytes: None,
            models: Vec::new(),
            model_repository: None,
            skipped_model_folders: Vec::new(),
            model_control: ModelControl::None,
            repository_poll_seconds: 5.0,
            load_wait_ms: 30_000,
            load_warmup_bytes: 256 * 1024 * 1024,
        }
    }
}

impl WorkerConfig {
    /// Reads the config: defaults, then `file` (if given; a named file that is missing is an
    /// error), then `VRAMGATE_WORKER_*` variables (`__` between levels), then checks that the
    /// values work together ([`WorkerConfig::validate`]). Errors never carry a secret.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::extract(vramgate_shared::config::layered::<WorkerConfig>(file, ENV_PREFIX)?)
    }

    /// The config a layered figment holds, redacted on error and validated, with the models
    /// of its `model_repository` appended to `models`.
    fn extract(figment: Figment) -> Result<Self, ConfigError> {
        let mut config: WorkerConfig = figment.extract().map_err(|e| ConfigError::from(vramgate_shared::config::ConfigError::from(Box::new(e))))?;
        config.validate()?;
        if let Some(folder) = &config.model_repository {
            let scanned = repository::scan(folder).map_err(ConfigError::Repository)?;
            let from_file = config.models.len();
            for (model, file) in scanned.models {
                if let Some(i) = config.models[..from_file].iter().position(|m| m.name == model.name) {
                    return Err(ConfigError::Repository(format!(
                        "model '{}' is defined twice: models[{i}] in the config file and {file} in model repository {}",
                        model.name,
                        repository::shown(folder)
                    )));
                }
                config.models.push(model);
            }
            config.skipped_model_folders = scanned.skipped;
        }
        Ok(config)
    }

    /// Checks what serde cannot: values that are each valid but do not work together.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |message: String| Err(ConfigError::Inconsistent(message));
        self.telemetry.validate().map_err(ConfigError::Inconsistent)?;
        if (self.max_request_bytes as u64) > self.max_body_bytes_in_flight {
            return fail(format!(
                "max_request_bytes ({}) is larger than max_body_bytes_in_flight ({}): such a body could never be read",
                self.max_request_bytes, self.max_body_bytes_in_flight
            ));
        }
        if !(1..=MAX_GRPC_STREAMS).contains(&self.grpc_max_concurrent_streams) {
            return fail(format!(
                "grpc_max_concurrent_streams must be 1..={MAX_GRPC_STREAMS}, got {}",
                self.grpc_max_concurrent_streams
            ));
        }
        if self.grpc_listen.is_some_and(|g| g.port() != 0 && g == self.listen) {
            return fail(format!("grpc_listen ({}) is the HTTP listen address: give gRPC a port of its own", self.listen));
        }
        for (key, ms) in [
            ("header_read_timeout_ms", self.header_read_timeout_ms),
            ("body_read_timeout_ms", self.body_read_timeout_ms),
            ("idle_timeout_ms", self.idle_timeout_ms),
        ] {
            if ms == 0 {
                return fail(format!("{key} must be at least 1 ms"));
            }
        }
        if self.batching.max_batch_size == Some(0) {
            return fail(
                "batching.max_batch_size must be at least 1 (max_batch_size = 0 is a model's own key: that model takes no \
                 batch dimension)"
                    .into(),
            );
        }
        if self.model_control != ModelControl::None && self.model_repository.is_none() {
            return fail(format!("model_control = \"{}\" needs a model_repository to load from", self.model_control.as_str()));
        }
        let (low, high) = REPOSITORY_POLL_SECONDS;
        if !(low..=high).contains(&self.repository_poll_seconds) {
            return fail(format!("repository_poll_seconds must be {low} to {high}, got {}", self.repository_poll_seconds));
        }
        if self.load_wait_ms > MAX_LOAD_WAIT_MS {
            return fail(format!("load_wait_ms must be at most {MAX_LOAD_WAIT_MS}, got {}", self.load_wait_ms));
        }
        for (i, model) in self.models.iter().enumerate() {
            model.validate(&format!("models[{i}].")).map_err(ConfigError::Inconsistent)?;
            if let Some(j) = self.models[..i].iter().position(|m| m.name == model.name && m.version == model.version) {
                return fail(format!("models[{j}] and models[{i}] are both named '{}'", model.name));
            }
        }
        if let Some(token) = &self.auth_token {
            if token.expose().is_empty() {
                return fail("auth_token is empty: unset it to turn authentication off".into());
            }
            // It travels in an HTTP header: visible ASCII only (RFC 6750's b64token and more).
            if !token.expose().bytes().all(|b| b.is_ascii_graphic()) {
                return fail("auth_token must be visible ASCII characters without spaces (value not shown)".into());
            }
        }
        Ok(())
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
    /// The name clients use in `/v2/models/{name}`: see [`check_model_name`].
    pub name: String,
    /// Path of the TorchScript file; relative paths are resolved from the working directory
    /// (in a model repository, from the model's folder).
    pub path: PathBuf,
    /// How the model is called: `declared` (the default and the only kind), its tensors and
    /// calls stated by the keys below.
    #[serde(default)]
    pub kind: ModelKind,
    /// Largest number of input elements (e.g. audio samples × batch) one request may carry.
    #[serde(default = "default_max_input_elements")]
    pub max_input_elements: usize,
    /// Copies of the model loaded, each with its own batch thread: how many batches of this
    /// model may run at once (Triton's instance count). Memory admission decides whether
    /// they fit; this only bounds the parallelism.
    #[serde(default = "default_instances")]
    pub instances: usize,
    /// Overrides `batching.max_batch_size` (an upper bound, never a target) for this model.
    /// `0` is Triton's convention for a model that takes no batch dimension: its declared
    /// shapes are the whole tensors (dimension 0 is not the batch), each request runs alone,
    /// and the worker adds and strips the batch dimension itself (see [`ModelConfig::batched`]).
    #[serde(default)]
    pub max_batch_size: Option<usize>,
    /// The batch sizes (rows) a batch is run at: a batch of fewer rows is padded up to the
    /// next one (TensorRT's optimisation profiles, Triton's preferred batch sizes), so the model
    /// meets a small set of shapes, each warmed at load before the model is ready. Ascending,
    /// each 1..=1024, at most 16. Unset: on CUDA 1, 2, 4, …, 64 (up to `max_batch_size`), where
    /// a new shape costs the device its first-call set-up; on the CPU none (`[]`), where padding
    /// rows costs their arithmetic and a new shape costs nothing. A batch above the largest
    /// runs as it is.
    #[serde(default)]
    pub batch_buckets: Option<Vec<usize>>,
    /// Overrides the memory estimate measured at start-up (it is still corrected upwards
    /// from what batches are seen to use).
    #[serde(default)]
    pub estimate: Option<EstimateConfig>,
    /// The TorchScript method called with the input tensors (then
    /// `args`). Unset: `forward`.
    #[serde(default)]
    pub method: Option<String>,
    /// Constant arguments passed after the input tensor, in order, on
    /// every call: integers as `int`, floats as `float`, booleans as `bool` (Silero VAD's
    /// `audio_forward(x, 16000)` takes `[16000]`). At most [`MAX_ARGS`]. Unset: none.
    #[serde(default)]
    pub args: Option<Vec<ConstArg>>,
    /// The model's one input; or, for a model of several, `inputs`. One of them is required.
    #[serde(default)]
    pub input: Option<DeclaredTensor>,
    /// A model's several inputs, passed to its method in this order (before `args`); at most
    /// [`MAX_INPUTS`], each named once. Instead of `input`.
    #[serde(default)]
    pub inputs: Option<Vec<DeclaredTensor>>,
    /// At least one required: what the method returns, in order:
    /// one tensor when one output is declared, else a tuple or list of tensors, one per output;
    /// or a dict of tensors, whose keys are the outputs' names (undeclared keys are dropped).
    #[serde(default)]
    pub outputs: Option<Vec<DeclaredTensor>>,
    /// The sizes the start-up memory calibration gives each variable
    /// (`-1`) non-batch input dimension, each rounded up to the input's `bucket` (so the fit
    /// sees shapes the model is really called with). Unset: [`DEFAULT_PROBE_SIZES`].
    #[serde(default)]
    pub probe_sizes: Option<Vec<usize>>,
    /// The sizes the start-up throughput calibration (batch sizes) times
    /// the variable dimensions at, each one size class (rounded up to the input's `bucket`).
    /// Unset: `probe_sizes`.
    #[serde(default)]
    pub batch_probe_sizes: Option<Vec<usize>>,
    /// Which numbered version folders of a repository model are served (Triton's version
    /// policy): `{ latest = N }` (the default, N = 1), `"all"`, or `{ specific = [..] }`.
    /// A model without version folders is version 1 whatever this says.
    #[serde(default)]
    pub version_policy: Option<VersionPolicy>,
    /// The version this entry loads: its folder's number in a repository, else 1. Not a key.
    #[serde(skip, default = "first_version")]
    pub version: u64,
}

fn first_version() -> u64 {
    1
}

/// Which of a model's numbered version folders are served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum VersionPolicy {
    /// The N highest-numbered versions.
    Latest(usize),
    /// Every version.
    All,
    /// These versions; each must have its folder.
    Specific(Vec<u64>),
}

impl VersionPolicy {
    /// The versions served out of `found` (ascending), or why none can be.
    pub fn select(&self, found: &[u64]) -> Result<Vec<u64>, String> {
        let listed = || found.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
        match self {
            VersionPolicy::Latest(0) => Err("version_policy latest must be at least 1".into()),
            VersionPolicy::Latest(n) => Ok(found[found.len().saturating_sub(*n)..].to_vec()),
            VersionPolicy::All => Ok(found.to_vec()),
            VersionPolicy::Specific(wanted) if wanted.is_empty() => Err("version_policy specific names no version".into()),
            VersionPolicy::Specific(wanted) => {
                let mut chosen = Vec::new();
                for v in wanted {
                    if !found.contains(v) {
                        return Err(format!("version_policy names version {v}, which has no folder (found: {})", listed()));
                    }
                    if !chosen.contains(v) {
                        chosen.push(*v);
                    }
                }
                chosen.sort_unstable();
                Ok(chosen)
            }
        }
    }
}

/// A tensor of a `declared` model, as its config entry states it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeclaredTensor {
    /// The tensor's name in OIP requests, responses and metadata.
    pub name: String,
    /// Its dimensions: the first is the batch (rows) and must be `-1` (unless the model takes
    /// no batch dimension: `max_batch_size = 0`); each other is a fixed size, or `-1` for any
    /// size.
    pub shape: Vec<i64>,
    /// Its element type, spelled as in OIP: one of [`DECLARED_DATATYPES`]. An input is taken
    /// only in it; an output is answered in it. Unset: `FP32`.
    #[serde(default = "default_datatype")]
    pub datatype: DataType,
    /// Input only: how requests that differ in a variable dimension share a batch. Unset:
    /// [`Batching::Equal`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batching: Option<Batching>,
    /// Input only, with `batching = "pad"`: the value padding is filled with. Unset: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_value: Option<f64>,
    /// Input only, with `batching = "pad"`: every variable (`-1`) dimension after the batch of
    /// every batch (a batch of one request too) is padded up to the next multiple of this
    /// step, after taking the largest among the batch's members, so that the model sees sizes
    /// from a small set (compiled kernels, CUDA graphs). A request is admitted at its bucketed
    /// size; its outputs are still cut back to its own (`follows`). 1..=[`MAX_BUCKET`].
    /// Unset: no bucketing (1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket: Option<usize>,
    /// Input only, of datatype FP32 or FP16: requests may send this input as UINT8 instead (a
    /// picture's bytes: a quarter of FP32's on the wire and over PCIe), converted on the device
    /// after the copy to the declared datatype as `x × scale + offset`. P-Net's `(x − 127.5) /
    /// 128` is `{ scale = 0.0078125, offset = -0.99609375 }`. Unset: only the declared datatype.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_uint8: Option<Affine>,
    /// Input only: the smallest size of each dimension a request may have (rank of `shape`;
    /// the first, the rows, 1, unless the model takes no batch dimension); a smaller request
    /// gets 400. Unset: 1 everywhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_shape: Option<Vec<i64>>,
    /// Output only, with a padded input: how the size of each variable dimension follows from
    /// the request's own input, so that a padded batch's outputs are cut back per request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follows: Option<Vec<Follows>>,
}

/// How requests of different sizes in an input's variable dimensions batch together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Batching {
    /// Only requests of one shape but rows share a batch (always right, whatever the model).
    #[default]
    Equal,
    /// Requests of different sizes share a batch, each padded at the end of every variable
    /// dimension with `pad_value` to the largest member's size (rounded up to a multiple of
    /// `bucket`, when set); each output is cut back to
    /// the request's own size (`follows`). Right only for a model whose outputs for the
    /// unpadded region do not see the padding.
    Pad,
}

/// A variable output dimension's size for one request: `ceil(input's size in input_dim /
/// divisor)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Follows {
    /// The input it follows, by name, for a model of several `inputs`. Unset: the first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// The output's dimension (declared `-1`; 1 or more when dimension 0 is the batch).
    pub dim: usize,
    /// The input's dimension it follows (declared `-1`; 1 or more when dimension 0 is the
    /// batch).
    pub input_dim: usize,
    /// Input elements per output element along it. Unset: 1.
    #[serde(default = "default_divisor")]
    pub divisor: u64,
}

fn default_divisor() -> u64 {
    1
}

impl DeclaredTensor {
    /// A tensor of `name`, `shape` and `datatype`, with none of the input's or outputs' own keys.
    pub fn new(name: &str, shape: &[i64], datatype: DataType) -> DeclaredTensor {
        DeclaredTensor {
            name: name.into(),
            shape: shape.to_vec(),
            datatype,
            batching: None,
            pad_value: None,
            bucket: None,
            from_uint8: None,
            min_shape: None,
            follows: None,
        }
    }

    /// How an input batches requests of different sizes.
    pub fn batching(&self) -> Batching {
        self.batching.unwrap_or_default()
    }

    /// The value a padded input is filled with.
    pub fn pad_value(&self) -> f64 {
        self.pad_value.unwrap_or(0.0)
    }

    /// The step a padded input's variable dimensions are rounded up to (1: none).
    pub fn bucket(&self) -> usize {
        self.bucket.unwrap_or(1)
    }

    /// The rules of an output's variable dimensions.
    pub fn follows(&self) -> &[Follows] {
        self.follows.as_deref().unwrap_or_default()
    }
}

fn default_datatype() -> DataType {
    DataType::Fp32
}

/// A constant argument of a `declared` model's method, as its entry's `args` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ConstArg {
    /// A TOML integer: TorchScript `int`.
    Int(i64),
    /// A TOML float: TorchScript `float`.
    Float(f64),
    /// A TOML boolean: TorchScript `bool`.
    Bool(bool),
}

impl<'de> Deserialize<'de> for ConstArg {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ConstArg;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an integer, a float or a boolean")
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<ConstArg, E> {
                Ok(ConstArg::Bool(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ConstArg, E> {
                Ok(ConstArg::Int(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ConstArg, E> {
                i64::try_from(v).map(ConstArg::Int).map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(v), &self))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<ConstArg, E> {
                Ok(ConstArg::Float(v))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// The method a `declared` model is called through when its entry names none.
pub const DEFAULT_METHOD: &str = "forward";
/// The sizes a `declared` model's variable dimensions take in calibration when its entry
/// names none.
pub const DEFAULT_PROBE_SIZES: [usize; 3] = [32, 64, 128];
/// Longest tensor name a `declared` model may give, in bytes.
pub const MAX_TENSOR_NAME_BYTES: usize = 64;
/// Most dimensions a declared tensor may have.
pub const MAX_DECLARED_RANK: usize = 8;
/// Largest fixed dimension a declared tensor may have.
pub const MAX_DECLARED_DIM: i64 = 1 << 31;
/// Largest probe size a `declared` model may name (16 s of 16 kHz audio is 256 000).
pub const MAX_PROBE_SIZE: usize = 1 << 20;
/// An affine map `x × scale + offset` (see [`DeclaredTensor::from_uint8`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Affine {
    pub scale: f64,
    pub offset: f64,
}

/// Most entries of a model's `batch_buckets`.
pub const MAX_BATCH_BUCKETS: usize = 16;
/// Largest value in a model's `batch_buckets`.
pub const MAX_BATCH_BUCKET: usize = 1024;

/// Largest `bucket` step a padded input may name.
pub const MAX_BUCKET: usize = 1 << 20;
/// Most constant arguments a `declared` model may take after its inputs.
pub const MAX_ARGS: usize = 8;
/// Most inputs a model may declare.
pub const MAX_INPUTS: usize = 8;
/// Longest model name, in bytes.
pub const MAX_MODEL_NAME_BYTES: usize = 64;
/// The datatypes a declared tensor may have (each has a libtorch kind of its own).
pub const DECLARED_DATATYPES: [DataType; 6] =
    [DataType::Bool, DataType::Uint8, DataType::Int32, DataType::Int64, DataType::Fp16, DataType::Fp32];

impl ModelConfig {
    /// The declared inputs, in the order the method takes them: `inputs`, or the one `input`
    /// (none when neither is set, which validation refuses).
    pub fn declared_inputs(&self) -> &[DeclaredTensor] {
        match (&self.inputs, &self.input) {
            (Some(inputs), _) => inputs,
            (None, Some(input)) => std::slice::from_ref(input),
            (None, None) => &[],
        }
    }

    /// The TorchScript method a `declared` model is called through.
    pub fn method(&self) -> &str {
        self.method.as_deref().unwrap_or(DEFAULT_METHOD)
    }

    /// The constant arguments a `declared` model's method takes after its input.
    pub fn args(&self) -> &[ConstArg] {
        self.args.as_deref().unwrap_or_default()
    }

    /// The memory-calibration probe sizes of a `declared` model's variable dimensions.
    pub fn probe_sizes(&self) -> &[usize] {
        self.probe_sizes.as_deref().unwrap_or(&DEFAULT_PROBE_SIZES)
    }

    /// The throughput-calibration probe sizes of a `declared` model's variable dimensions.
    pub fn batch_probe_sizes(&self) -> &[usize] {
        self.batch_probe_sizes.as_deref().unwrap_or(self.probe_sizes())
    }

    /// Whether dimension 0 of the declared tensors is the batch: false for a model that takes
    /// none (`max_batch_size = 0`, Triton's convention).
    pub fn batched(&self) -> bool {
        self.max_batch_size != Some(0)
    }

    /// The first dimension of a declared tensor that is not the batch: 1, or 0 for a model
    /// without a batch dimension.
    fn first_free_dim(&self) -> usize {
        usize::from(self.batched())
    }

    /// Checks the name and the declared tensors, calls and probe sizes; `at` names the entry,
    /// ending in its separator (`models[2].`). The model loader checks a config built in code
    /// with it too.
    pub(crate) fn validate(&self, at: &str) -> Result<(), String> {
        check_model_name(&self.name).map_err(|e| format!("{at}name {e}"))?;
        if self.method().is_empty() {
            return Err(format!("{at}method must not be empty"));
        }
        if self.args().len() > MAX_ARGS {
            return Err(format!("{at}args must have at most {MAX_ARGS} values, got {}", self.args().len()));
        }
        if let Some((k, x)) = self.args().iter().enumerate().find_map(|(k, a)| match a {
            ConstArg::Float(x) if !x.is_finite() => Some((k, x)),
            _ => None,
        }) {
            return Err(format!("{at}args[{k}] must be a finite float, got {x}"));
        }
        let inputs = self.declared_inputs();
        // Where each input's keys are, in errors: `input.` or `inputs[k].`.
        let input_at = |k: usize| if self.inputs.is_some() { format!("{at}inputs[{k}].") } else { format!("{at}input.") };
        match (&self.input, &self.inputs) {
            (Some(_), Some(_)) => return Err(format!("{at}input and inputs are both set: keep input for one, inputs for several")),
            (None, None) => {
                return Err(format!(
                    "{at}input is required: {{ name = \"…\", shape = [-1, …] }} (or inputs = [ … ] for a model of several)"
                ))
            }
            (None, Some(many)) if !(1..=MAX_INPUTS).contains(&many.len()) => {
                return Err(format!("{at}inputs must have 1 to {MAX_INPUTS} entries, got {}", many.len()))
            }
            _ => {}
        }
        let first = self.first_free_dim();
        for (k, input) in inputs.iter().enumerate() {
            input.validate(&input_at(k), first)?;
            input.validate_input(&input_at(k), first)?;
            if inputs[..k].iter().any(|i| i.name == input.name) {
                return Err(format!("{}name '{}' names an earlier input too", input_at(k), input.name));
            }
        }
        let outputs = self.outputs.as_deref().unwrap_or_default();
        if outputs.is_empty() {
            return Err(format!("{at}outputs needs at least one entry"));
        }
        for (j, output) in outputs.iter().enumerate() {
            let at = format!("{at}outputs[{j}].");
            output.validate(&at, first)?;
            output.validate_output(&at, inputs, first)?;
            if outputs[..j].iter().any(|o| o.name == output.name) {
                return Err(format!("{at}name '{}' names an earlier output too", output.name));
            }
        }
        if let Some(buckets) = &self.batch_buckets {
            if buckets.len() > MAX_BATCH_BUCKETS {
                return Err(format!("{at}batch_buckets must have at most {MAX_BATCH_BUCKETS} sizes, got {}", buckets.len()));
            }
            if let Some((k, b)) = buckets.iter().enumerate().find(|(_, &b)| !(1..=MAX_BATCH_BUCKET).contains(&b)) {
                return Err(format!("{at}batch_buckets[{k}] must be 1..={MAX_BATCH_BUCKET}, got {b}"));
            }
            if buckets.windows(2).any(|w| w[0] >= w[1]) {
                return Err(format!("{at}batch_buckets must be ascending without repeats, got {buckets:?}"));
            }
            if !self.batched() && !buckets.is_empty() {
                return Err(format!("{at}batch_buckets is only for a model with a batch dimension (this one has max_batch_size = 0)"));
            }
            if let (Some(max), Some(&largest)) = (self.max_batch_size, buckets.last()) {
                if largest > max {
                    return Err(format!("{at}batch_buckets goes up to {largest}, past max_batch_size = {max}"));
                }
            }
        }
        for (key, sizes) in [("probe_sizes", &self.probe_sizes), ("batch_probe_sizes", &self.batch_probe_sizes)] {
            let Some(sizes) = sizes else { continue };
            if sizes.is_empty() {
                return Err(format!("{at}{key} must not be empty (unset it for the default)"));
            }
            if let Some((k, size)) = sizes.iter().enumerate().find(|(_, &s)| !(1..=MAX_PROBE_SIZE).contains(&s)) {
                return Err(format!("{at}{key}[{k}] must be 1..={MAX_PROBE_SIZE}, got {size}"));
            }
        }
        // A probe gives every variable dimension of every input its size, so each size must be a
        // request the model takes (when some dimension is variable: else a size multiplies
        // rows, or, without a batch dimension, is not used).
        let min_variable = inputs
            .iter()
            .enumerate()
            .flat_map(|(k, input)| {
                input
                    .min_shape
                    .iter()
                    .flatten()
                    .zip(&input.shape)
                    .enumerate()
                    .skip(first)
                    .filter(|(_, (_, &d))| d == -1)
                    .map(move |(d, (&min, _))| (k, d, min))
            })
            .max_by_key(|&(_, _, min)| min);
        if let Some((i, d, min)) = min_variable {
            for (key, sizes) in [("probe_sizes", self.probe_sizes()), ("batch_probe_sizes", self.batch_probe_sizes())] {
                if let Some((k, size)) = sizes.iter().enumerate().find(|(_, &s)| (s as i64) < min) {
                    return Err(format!(
                        "{at}{key}[{k}] is {size}, below {}min_shape[{d}] = {min}: every probe size must be a size the model takes",
                        input_at(i).trim_start_matches(at)
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Checks a model's name, which is a segment of its URLs (`/v2/models/{name}/infer`) and, in
/// a model repository, a folder's name: 1 to [`MAX_MODEL_NAME_BYTES`] ASCII letters, digits,
/// `_`, `-` and `.`, not starting with `.`. The error says what a name must be.
pub fn check_model_name(name: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if name.is_empty() || name.len() > MAX_MODEL_NAME_BYTES || name.starts_with('.') || !name.chars().all(allowed) {
        return Err(format!(
            "must be 1 to {MAX_MODEL_NAME_BYTES} ASCII letters, digits, '_', '-' or '.', not starting with '.', got {name:?}"
        ));
    }
    Ok(())
}

impl DeclaredTensor {
    /// Checks the name and the shape; `at` names the entry, ending in its separator
    /// (`models[2].outputs[1].`); `first` is the first dimension after the batch (0: the model
    /// takes no batch dimension).
    fn validate(&self, at: &str, first: usize) -> Result<(), String> {
        if self.name.is_empty() {
            return Err(format!("{at}name must not be empty"));
        }
        if self.name.len() > MAX_TENSOR_NAME_BYTES {
            return Err(format!("{at}name must be at most {MAX_TENSOR_NAME_BYTES} bytes, got {}", self.name.len()));
        }
        let shape = &self.shape;
        if !(1..=MAX_DECLARED_RANK).contains(&shape.len()) {
            return Err(format!("{at}shape must have 1 to {MAX_DECLARED_RANK} dimensions, got {shape:?}"));
        }
        if first == 1 && shape[0] != -1 {
            return Err(format!(
                "{at}shape[0] must be -1 (the batch: any number of rows; a model that takes no batch dimension says \
                 max_batch_size = 0), got {}",
                shape[0]
            ));
        }
        if let Some((d, n)) = shape.iter().enumerate().skip(first).find(|(_, &n)| n != -1 && !(1..=MAX_DECLARED_DIM).contains(&n)) {
            return Err(format!("{at}shape[{d}] must be -1 (any size) or 1..={MAX_DECLARED_DIM}, got {n}"));
        }
        if !DECLARED_DATATYPES.contains(&self.datatype) {
            let allowed = DECLARED_DATATYPES.map(DataType::as_str).join(", ");
            return Err(format!("{at}datatype must be one of {allowed}, got {}", self.datatype));
        }
        Ok(())
    }
}

impl DeclaredTensor {
    /// Checks what only the input may say: its batching, pad value, bucket and minimum shape
    /// (`first` as for [`DeclaredTensor::validate`]).
    fn validate_input(&self, at: &str, first: usize) -> Result<(), String> {
        if self.follows.is_some() {
            return Err(format!("{at}follows is only for outputs"));
        }
        if let Some(value) = self.pad_value {
            if self.batching() != Batching::Pad {
                return Err(format!("{at}pad_value is only for batching = \"pad\""));
            }
            check_pad_value(value, self.datatype).map_err(|e| format!("{at}pad_value {e}"))?;
        }
        if let Some(step) = self.bucket {
            if self.batching() != Batching::Pad {
                return Err(format!("{at}bucket is only for batching = \"pad\" (bucketing pads every request up to a multiple)"));
            }
            if !(1..=MAX_BUCKET).contains(&step) {
                return Err(format!("{at}bucket must be 1..={MAX_BUCKET}, got {step}"));
            }
            if !self.shape.iter().skip(first).any(|&d| d == -1) {
                let which = if first == 1 { "after the batch " } else { "" };
                return Err(format!("{at}bucket needs a variable (-1) dimension {which}to round up, shape is {:?}", self.shape));
            }
        }
        if let Some(affine) = self.from_uint8 {
            if !matches!(self.datatype, DataType::Fp32 | DataType::Fp16) {
                return Err(format!("{at}from_uint8 is only for an input of datatype FP32 or FP16, got {}", self.datatype));
            }
            if !(affine.scale.is_finite() && affine.offset.is_finite()) || affine.scale == 0.0 {
                return Err(format!(
                    "{at}from_uint8 needs a finite, non-zero scale and a finite offset, got scale {} and offset {}",
                    affine.scale, affine.offset
                ));
            }
        }
        if let Some(min) = &self.min_shape {
            if min.len() != self.shape.len() {
                return Err(format!(
                    "{at}min_shape must have as many dimensions as shape {:?}, got {min:?}",
                    self.shape
                ));
            }
            if first == 1 && min[0] != 1 {
                return Err(format!("{at}min_shape[0] must be 1 (a request of one row is always taken), got {}", min[0]));
            }
            for (d, (&n, &declared)) in min.iter().zip(&self.shape).enumerate().skip(first) {
                if !(1..=MAX_DECLARED_DIM).contains(&n) {
                    return Err(format!("{at}min_shape[{d}] must be 1..={MAX_DECLARED_DIM}, got {n}"));
                }
                if declared > 0 && n > declared {
                    return Err(format!("{at}min_shape[{d}] is {n}, more than the fixed shape[{d}] = {declared}"));
                }
            }
        }
        Ok(())
    }

    /// Checks what only an output may say: how its variable dimensions follow from the
    /// `inputs`, which a padded input needs for every one of them (`first` as for
    /// [`DeclaredTensor::validate`]).
    fn validate_output(&self, at: &str, inputs: &[DeclaredTensor], first: usize) -> Result<(), String> {
        for (key, set) in [
            ("batching", self.batching.is_some()),
            ("pad_value", self.pad_value.is_some()),
            ("bucket", self.bucket.is_some()),
            ("from_uint8", self.from_uint8.is_some()),
            ("min_shape", self.min_shape.is_some()),
        ] {
            if set {
                return Err(format!("{at}{key} is only for the input"));
            }
        }
        let padded = inputs.iter().any(|i| i.batching() == Batching::Pad);
        if self.follows.is_some() && !padded {
            return Err(format!("{at}follows is only for a padded input (input.batching = \"pad\")"));
        }
        let after_batch = if first == 1 { " after the batch" } else { "" };
        for (k, rule) in self.follows().iter().enumerate() {
            let here = format!("{at}follows[{k}]");
            let input = match &rule.input {
                None => &inputs[0],
                Some(name) => inputs.iter().find(|i| &i.name == name).ok_or_else(|| {
                    let names: Vec<&str> = inputs.iter().map(|i| i.name.as_str()).collect();
                    format!("{here}.input '{name}' is not an input of the model ({})", names.join(", "))
                })?,
            };
            if rule.dim < first || self.shape.get(rule.dim) != Some(&-1) {
                return Err(format!("{here}.dim must name a variable (-1) dimension of shape {:?}{after_batch}, got {}", self.shape, rule.dim));
            }
            if self.follows()[..k].iter().any(|r| r.dim == rule.dim) {
                return Err(format!("{here}.dim {} has an earlier rule too", rule.dim));
            }
            if rule.input_dim < first || input.shape.get(rule.input_dim) != Some(&-1) {
                return Err(format!(
                    "{here}.input_dim must name a variable (-1) dimension of the input's shape {:?}{after_batch}, got {}",
                    input.shape, rule.input_dim
                ));
            }
            if !(1..=MAX_DECLARED_DIM as u64).contains(&rule.divisor) {
                return Err(format!("{here}.divisor must be 1..={MAX_DECLARED_DIM}, got {}", rule.divisor));
            }
        }
        if padded {
            if let Some(d) = (first..self.shape.len()).find(|&d| self.shape[d] == -1 && !self.follows().iter().any(|r| r.dim == d)) {
                return Err(format!(
                    "{at}follows has no rule for dimension {d} (shape[{d}] = -1): with input.batching = \"pad\" each variable \
                     dimension of an output must say how its size follows from the request's input, \
                     e.g. follows = [{{ dim = {d}, input_dim = {first}, divisor = 1 }}] (size = ceil(input size / divisor))"
                ));
            }
        }
        Ok(())
    }
}

/// Checks that padding an input of `datatype` with `value` pads with exactly `value`.
fn check_pad_value(value: f64, datatype: DataType) -> Result<(), String> {
    let integer = value.fract() == 0.0;
    let fits = match datatype {
        DataType::Bool => value == 0.0 || value == 1.0,
        DataType::Uint8 => integer && (0.0..=255.0).contains(&value),
        DataType::Int32 => integer && (f64::from(i32::MIN)..=f64::from(i32::MAX)).contains(&value),
        // Every integer up to 2^53 is a float exactly.
        DataType::Int64 => integer && value.abs() <= (1u64 << 53) as f64,
        DataType::Fp16 => value.is_finite() && value.abs() <= 65_504.0,
        _ => value.is_finite() && (value as f32).is_finite(),
    };
    if fits {
        return Ok(());
    }
    Err(format!("must be a value of the input's datatype {datatype}, got {value:?}"))
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

/// How a model is called. One kind: every model is declared by its entry, so that the worker
/// has no code of any model's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// Any TorchScript model of one input whose tensors the entry declares (`input`,
    /// `outputs`, each with its datatype, `method`, `args`, probe sizes): the method is called
    /// with the input and the constant `args`, and its tensors are answered in their declared
    /// datatypes, split per request along the batch dimension (and cut back to the request's
    /// own size when its input was padded).
    #[default]
    Declared,
}

/// The declared keys that serve Silero VAD as the former `voice_activity` kind did.
pub const VOICE_ACTIVITY_MIGRATION: &str = "method = \"audio_forward\", args = [16000], \
    input = { name = \"audio\", shape = [-1, -1], batching = \"pad\", pad_value = 0, min_shape = [1, 512] }, \
    outputs = [{ name = \"speech_prob\", shape = [-1, -1], follows = [{ dim = 1, input_dim = 1, divisor = 512 }] }], \
    probe_sizes = [16000, 64000, 256000], batch_probe_sizes = [16000, 64000]";
/// The declared keys that serve MTCNN's P-Net as the former `face_detection` kind did (its
/// `face_prob` is now both channels, `[n, 2, h, w]`: no-face, face).
pub const FACE_DETECTION_MIGRATION: &str = "input = { name = \"image\", shape = [-1, 3, -1, -1], min_shape = [1, 3, 12, 12] }, \
    outputs = [{ name = \"box_offsets\", shape = [-1, 4, -1, -1] }, { name = \"face_prob\", shape = [-1, 2, -1, -1] }], \
    probe_sizes = [128, 256, 512], batch_probe_sizes = [64, 128, 256, 512]";

impl<'de> Deserialize<'de> for ModelKind {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let name = String::deserialize(deserializer)?;
        let removed = |kind: &str, keys: &str| {
            D::Error::custom(format!(
                "kind \"{kind}\" is not built in any more: every model is declared; drop kind and write {keys} \
                 (see config/worker.toml)"
            ))
        };
        match name.as_str() {
            "declared" => Ok(ModelKind::Declared),
            "voice_activity" => Err(removed("voice_activity", VOICE_ACTIVITY_MIGRATION)),
            "face_detection" => Err(removed("face_detection", FACE_DETECTION_MIGRATION)),
            other => Err(D::Error::custom(format!("unknown kind \"{other}\": the one kind is \"declared\" (the default)"))),
        }
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use std::path::{Path, PathBuf};

    /// A folder under the temp folder, unique to this process and `tag`, removed when dropped.
    pub struct TempFolder(PathBuf);

    impl TempFolder {
        pub fn new(tag: &str) -> TempFolder {
            let path = std::env::temp_dir().join(format!("vramgate-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).expect("a temp folder");
            TempFolder(path)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }

        /// Writes `contents` to `file`, a path under the folder, creating its parent folders.
        pub fn write(&self, file: &str, contents: impl AsRef<[u8]>) -> PathBuf {
            let path = self.0.join(file);
            std::fs::create_dir_all(path.parent().expect("a file in a folder")).expect("the file's folder");
            std::fs::write(&path, contents).expect("a temp file");
            path
        }
    }

    impl Drop for TempFolder {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::TempFolder;
    use super::*;
    use crate::model::testing::model_file;
    use figment::providers::{Format, Serialized, Toml};

    fn from_toml(text: &str) -> Result<WorkerConfig, ConfigError> {
        WorkerConfig::extract(Figment::from(Serialized::defaults(WorkerConfig::default())).merge(Toml::string(text)))
    }

    /// An entry's smallest declaration: one input, one output.
    const MINIMAL: &str = "input = { name = \"x\", shape = [-1] }\noutputs = [ { name = \"y\", shape = [-1] } ]\n";

    /// The shipped config/worker.toml (which the k8s copy must equal) loads as the worker loads
    /// it, and its models are Silero VAD (padded), P-Net, R-Net and O-Net, as the tests' copies
    /// of their entries (`tests/src/lib.rs`) assume.
    #[test]
    fn the_shipped_config_loads_with_its_declared_models() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
        let text = std::fs::read(format!("{root}/config/worker.toml")).expect("config/worker.toml");
        assert_eq!(std::fs::read(format!("{root}/k8s/base/config/worker.toml")).expect("the k8s copy"), text);
        let config = WorkerConfig::load(Some(Path::new(&format!("{root}/config/worker.toml")))).expect("config/worker.toml loads");
        let models: Vec<(&str, usize, Batching)> = config
            .models
            .iter()
            .map(|m| (m.name.as_str(), m.outputs.as_ref().map_or(0, Vec::len), m.input.as_ref().map(|i| i.batching()).unwrap_or_default()))
            .collect();
        assert_eq!(models, vec![
            ("silero_vad", 1, Batching::Pad),
            ("mtcnn_pnet", 2, Batching::Equal),
            ("mtcnn_rnet", 2, Batching::Equal),
            ("mtcnn_onet", 3, Batching::Equal)
        ]);
        assert!(config.models.iter().all(|m| m.kind == ModelKind::Declared));
    }

    #[test]
    fn a_secret_is_never_printed_whatever_its_type() {
        let config = from_toml("auth_token = \"s3cr3t-value\"\n").expect("a string token");
        assert_eq!(config.auth_token.as_ref().map(Secret::expose), Some("s3cr3t-value"));
        assert!(!format!("{config:?}").contains("s3cr3t-value"));
        // figment takes an integer for a string: a token of digits may be written bare.
        let config = from_toml("auth_token = 918273645\n").expect("a token of digits");
        assert_eq!(config.auth_token.as_ref().map(Secret::expose), Some("918273645"));
        for bad in [
            "auth_token = 918273.645\n",
            "auth_token = [918273645]\n",
            "auth_token = { v = \"918273645\" }\n",
            "auth_token = \"has space 918273\"\n",
        ] {
            let err = from_toml(bad).expect_err("not a usable token").to_string();
            assert!(err.contains("auth_token") && !err.contains("918273"), "{err}");
        }
        let err = from_toml("[admission]\nmax_queued_requests = \"pw\"\n").expect_err("a string count").to_string();
        assert!(err.contains("\"pw\""), "values of other keys are shown: {err}");
    }

    #[test]
    fn limits_that_cannot_work_together_are_refused() {
        let err = from_toml("max_request_bytes = 1000\nmax_body_bytes_in_flight = 999\n").expect_err("too small");
        assert!(err.to_string().contains("max_body_bytes_in_flight"), "{err}");
        assert!(from_toml("idle_timeout_ms = 0\n").is_err());
        assert!(from_toml("auth_token = \"\"\n").is_err());
        let config = from_toml("").expect("defaults are valid");
        assert!(config.max_body_bytes_in_flight >= config.max_request_bytes as u64);
        assert!(config.memory_host_allowance_bytes >= 2 * config.max_body_bytes_in_flight);
        assert_eq!(config.grpc_listen, None, "no gRPC server unless asked for");
        let err = from_toml("grpc_max_concurrent_streams = 0\n").expect_err("no stream at all");
        assert!(err.to_string().contains("grpc_max_concurrent_streams"), "{err}");
        let err = from_toml("listen = \"127.0.0.1:8001\"\ngrpc_listen = \"127.0.0.1:8001\"\n").expect_err("one port for both");
        assert!(err.to_string().contains("grpc_listen"), "{err}");
        let both = from_toml("listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n").expect("two free ports");
        assert_eq!(both.grpc_listen.map(|g| g.port()), Some(0));
    }

    /// A config of a minimal entry (`models[0]`) and a `declared` one (`models[1]`) whose
    /// keys are `keys`.
    fn with_declared(keys: &str) -> String {
        format!(
            "[[models]]\nname = \"pnet\"\npath = \"p.jit\"\n{MINIMAL}\n\
             [[models]]\nname = \"rnet\"\npath = \"r.jit\"\nkind = \"declared\"\n{keys}\n"
        )
    }

    const RNET: &str = "input = { name = \"image\", shape = [-1, 3, 24, 24] }\n\
        outputs = [ { name = \"box_offsets\", shape = [-1, 4] }, { name = \"face_prob\", shape = [-1, 2] } ]\n";

    #[test]
    fn batch_buckets_and_bytes_for_a_float_input_are_checked_with_their_key() {
        let config = from_toml(&with_declared(&format!("batch_buckets = [1, 2, 4, 8]\n{RNET}"))).expect("buckets");
        assert_eq!(config.models[1].batch_buckets, Some(vec![1, 2, 4, 8]));
        assert_eq!(config.models[0].batch_buckets, None, "unset: the device's default");
        from_toml(&with_declared(&format!("batch_buckets = []\n{RNET}"))).expect("none");
        let bytes = RNET.replace("24] }", "24], from_uint8 = { scale = 0.0078125, offset = -0.99609375 } }");
        let config = from_toml(&with_declared(&bytes)).expect("from_uint8");
        let affine = config.models[1].input.as_ref().and_then(|i| i.from_uint8);
        assert_eq!(affine, Some(Affine { scale: 0.0078125, offset: -0.99609375 }));
        let check = |keys: String, want: &str| {
            let err = from_toml(&with_declared(&keys)).expect_err(want).to_string();
            assert!(err.contains(want), "{keys}\nwant: {want}\ngot:  {err}");
        };
        check(format!("batch_buckets = [1, 4, 2]\n{RNET}"), "models[1].batch_buckets must be ascending without repeats, got [1, 4, 2]");
        check(format!("batch_buckets = [0, 2]\n{RNET}"), "models[1].batch_buckets[0] must be 1..=1024, got 0");
        check(format!("batch_buckets = [1, 2048]\n{RNET}"), "models[1].batch_buckets[1] must be 1..=1024, got 2048");
        let many: Vec<String> = (1..=17).map(|b| b.to_string()).collect();
        check(format!("batch_buckets = [{}]\n{RNET}", many.join(", ")), "models[1].batch_buckets must have at most 16 sizes, got 17");
        check(format!("max_batch_size = 4\nbatch_buckets = [1, 8]\n{RNET}"), "models[1].batch_buckets goes up to 8, past max_batch_size = 4");
        check(
            "max_batch_size = 0\nbatch_buckets = [1]\ninput = { name = \"x\", shape = [3, 4] }\noutputs = [ { name = \"y\", shape = [4] } ]\n".into(),
            "models[1].batch_buckets is only for a model with a batch dimension",
        );
        check(
            RNET.replace("24] }", "24], datatype = \"INT32\", from_uint8 = { scale = 1.0, offset = 0.0 } }"),
            "models[1].input.from_uint8 is only for an input of datatype FP32 or FP16, got INT32",
        );
        check(
            RNET.replace("24] }", "24], from_uint8 = { scale = 0.0, offset = 0.0 } }"),
            "models[1].input.from_uint8 needs a finite, non-zero scale and a finite offset, got scale 0 and offset 0",
        );
        check(RNET.replace("24] }", "24], from_uint8 = { scale = 1.0 } }"), "offset");
        check(RNET.replace("[-1, 2] }", "[-1, 2], from_uint8 = { scale = 1.0, offset = 0.0 } }"), "models[1].outputs[1].from_uint8 is only for the input");
    }

    #[test]
    fn a_declared_model_reads_its_tensors_method_and_probe_sizes() {
        let config = from_toml(&with_declared(RNET)).expect("the R-Net entry");
        let rnet = &config.models[1];
        assert_eq!(rnet.kind, ModelKind::Declared);
        assert_eq!((rnet.method(), rnet.probe_sizes()), ("forward", &DEFAULT_PROBE_SIZES[..]));
        assert_eq!(rnet.input, Some(DeclaredTensor::new("image", &[-1, 3, 24, 24], DataType::Fp32)));
        assert!(rnet.args().is_empty());
        let outputs = rnet.outputs.as_deref().expect("outputs");
        assert_eq!(outputs.iter().map(|o| (o.name.as_str(), o.shape.as_slice())).collect::<Vec<_>>(), [
            ("box_offsets", &[-1i64, 4][..]),
            ("face_prob", &[-1, 2][..])
        ]);
        let config = from_toml(&with_declared(&format!("{RNET}method = \"detect\"\nprobe_sizes = [16]\n"))).expect("method and sizes");
        assert_eq!((config.models[1].method(), config.models[1].probe_sizes()), ("detect", &[16usize][..]));
        let widest = "input = { name = \"x\", shape = [-1, 2147483648, -1, 1, 1, 1, 1, 1] }\noutputs = [ { name = \"y\", shape = [-1] } ]\n";
        from_toml(&with_declared(&format!("{widest}probe_sizes = [1, 1048576]\n"))).expect("the limits themselves");
    }

    #[test]
    fn a_declared_model_reads_datatypes_and_constant_args() {
        let keys = "input = { name = \"tokens\", shape = [-1, -1], datatype = \"INT64\" }\n\
            outputs = [ { name = \"mask\", shape = [-1, -1], datatype = \"BOOL\" }, { name = \"score\", shape = [-1] } ]\n\
            args = [16000, 0.5, true, -3, 1e3, 8, 7, 6]\n";
        let config = from_toml(&with_declared(keys)).expect("datatypes and args");
        let m = &config.models[1];
        assert_eq!(m.input.as_ref().map(|t| t.datatype), Some(DataType::Int64));
        let datatypes: Vec<DataType> = m.outputs.iter().flatten().map(|o| o.datatype).collect();
        assert_eq!(datatypes, [DataType::Bool, DataType::Fp32], "FP32 unless declared");
        use ConstArg::{Bool, Float, Int};
        assert_eq!(m.args(), [Int(16000), Float(0.5), Bool(true), Int(-3), Float(1e3), Int(8), Int(7), Int(6)]);
        for datatype in DECLARED_DATATYPES {
            let keys = RNET.replace("24] }", &format!("24], datatype = \"{datatype}\" }}"));
            let config = from_toml(&with_declared(&keys)).unwrap_or_else(|e| panic!("{datatype}: {e}"));
            assert_eq!(config.models[1].input.as_ref().map(|t| t.datatype), Some(datatype));
        }
    }

    #[test]
    fn every_mistake_in_a_declared_model_is_named_by_its_key() {
        let output = "outputs = [ { name = \"y\", shape = [-1, 4] } ]\n";
        let input = "input = { name = \"x\", shape = [-1, 3, 24, 24] }\n";
        let check = |keys: String, want: &str| {
            let err = from_toml(&with_declared(&keys)).expect_err(want).to_string();
            assert!(err.contains(want), "{keys}\nwant: {want}\ngot:  {err}");
        };
        check(output.into(), "models[1].input is required");
        check(input.into(), "models[1].outputs needs at least one entry");
        check(format!("{input}outputs = []\n"), "models[1].outputs needs at least one entry");
        check(format!("{input}{output}method = \"\"\n"), "models[1].method must not be empty");
        check(format!("input = {{ name = \"\", shape = [-1] }}\n{output}"), "models[1].input.name must not be empty");
        let long = "n".repeat(65);
        check(format!("{input}outputs = [ {{ name = \"y\", shape = [-1] }}, {{ name = \"{long}\", shape = [-1] }} ]\n"),
            "models[1].outputs[1].name must be at most 64 bytes, got 65");
        check(format!("{input}outputs = [ {{ name = \"y\", shape = [-1] }}, {{ name = \"y\", shape = [-1, 2] }} ]\n"),
            "models[1].outputs[1].name 'y' names an earlier output too");
        check(format!("input = {{ name = \"x\", shape = [] }}\n{output}"), "models[1].input.shape must have 1 to 8 dimensions, got []");
        check(format!("input = {{ name = \"x\", shape = [-1, 1, 1, 1, 1, 1, 1, 1, 1] }}\n{output}"),
            "models[1].input.shape must have 1 to 8 dimensions");
        check(format!("input = {{ name = \"x\", shape = [1, 3] }}\n{output}"), "models[1].input.shape[0] must be -1 (the batch");
        check(format!("{input}outputs = [ {{ name = \"y\", shape = [-1] }}, {{ name = \"z\", shape = [-1, 4, 0] }} ]\n"),
            "models[1].outputs[1].shape[2] must be -1 (any size) or 1..=2147483648, got 0");
        check(format!("input = {{ name = \"x\", shape = [-1, -2] }}\n{output}"), "models[1].input.shape[1] must be -1 (any size) or 1..=2147483648, got -2");
        check(format!("input = {{ name = \"x\", shape = [-1, 2147483649] }}\n{output}"), "models[1].input.shape[1] must be -1");
        check(format!("{input}{output}probe_sizes = []\n"), "models[1].probe_sizes must not be empty");
        check(format!("{input}{output}probe_sizes = [8, 0]\n"), "models[1].probe_sizes[1] must be 1..=1048576, got 0");
        check(format!("{input}{output}probe_sizes = [1048577]\n"), "models[1].probe_sizes[0] must be 1..=1048576, got 1048577");
        check(format!("{input}{output}batch_probe_sizes = []\n"), "models[1].batch_probe_sizes must not be empty");
        check(format!("{input}{output}batch_probe_sizes = [4, 0]\n"), "models[1].batch_probe_sizes[1] must be 1..=1048576, got 0");
        check(format!("input = {{ name = \"x\", shape = [-1], datatype = \"FP64\" }}\n{output}"),
            "models[1].input.datatype must be one of BOOL, UINT8, INT32, INT64, FP16, FP32, got FP64");
        check(format!("{input}outputs = [ {{ name = \"y\", shape = [-1] }}, {{ name = \"z\", shape = [-1], datatype = \"BYTES\" }} ]\n"),
            "models[1].outputs[1].datatype must be one of BOOL, UINT8, INT32, INT64, FP16, FP32, got BYTES");
        check(format!("input = {{ name = \"x\", shape = [-1], datatype = \"fp32\" }}\n{output}"), "unknown datatype 'fp32'");
        check(format!("input = {{ name = \"x\", shape = [-1], datatype = \"fp32\" }}\n{output}"), "models.1.input.datatype");
        check(format!("{input}{output}args = [1, 2, 3, 4, 5, 6, 7, 8, 9]\n"), "models[1].args must have at most 8 values, got 9");
        check(format!("{input}{output}args = [1, nan]\n"), "models[1].args[1] must be a finite float, got NaN");
        check(format!("{input}{output}args = [1, \"sixteen\"]\n"), "expected an integer, a float or a boolean");
        check(format!("{input}{output}args = [[1]]\n"), "expected an integer, a float or a boolean");
        check(format!("{input}{output}args = 16000\n"), "args");
        // A key of its own kind's tensors, misspelled, is refused by serde.
        check(format!("{input}{output}outputs_ = 1\n"), "outputs_");
        check(format!("input = {{ name = \"x\", shape = [-1], dtype = \"FP32\" }}\n{output}"), "dtype");
    }

    #[test]
    fn the_removed_kinds_are_refused_with_their_migration() {
        for (kind, migration) in [("voice_activity", VOICE_ACTIVITY_MIGRATION), ("face_detection", FACE_DETECTION_MIGRATION)] {
            let err = from_toml(&format!("[[models]]\nname = \"m\"\npath = \"m.jit\"\nkind = \"{kind}\"\n")).expect_err(kind).to_string();
            assert!(err.contains(&format!("kind \"{kind}\" is not built in any more")) && err.contains(migration), "{err}");
            assert!(err.contains("models.0.kind"), "{err}");
            // The migration is a working entry.
            let migrated = migration
                .replace(", method", "\nmethod")
                .replace(", args", "\nargs")
                .replace("], input", "]\ninput")
                .replace(" }, outputs", " }\noutputs")
                .replace("], probe_sizes", "]\nprobe_sizes")
                .replace("], batch_probe_sizes", "]\nbatch_probe_sizes");
            from_toml(&format!("[[models]]\nname = \"m\"\npath = \"m.jit\"\n{migrated}\n")).unwrap_or_else(|e| panic!("{migrated}: {e}"));
        }
        let err = from_toml("[[models]]\nname = \"m\"\npath = \"m.jit\"\nkind = \"audio\"\n").expect_err("no such kind").to_string();
        assert!(err.contains("unknown kind \"audio\": the one kind is \"declared\" (the default)"), "{err}");
        for key in ["sample_rate_hz", "window_samples"] {
            let err = from_toml(&with_declared(&format!("{RNET}{key} = 512\n"))).expect_err(key).to_string();
            assert!(err.contains("unknown field") && err.contains(key), "{err}");
        }
    }

    #[test]
    fn a_model_of_several_inputs_declares_them_in_order_and_every_mistake_is_named() {
        let two = "inputs = [ { name = \"chunk\", shape = [-1, 576] }, { name = \"state\", shape = [-1, 2, 128] } ]\n\
                   outputs = [ { name = \"p\", shape = [-1] }, { name = \"next\", shape = [-1, 2, 128] } ]\n";
        let config = from_toml(&with_declared(two)).expect("two inputs");
        let names: Vec<&str> = config.models[1].declared_inputs().iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["chunk", "state"]);
        assert_eq!(config.models[0].declared_inputs().len(), 1, "input is one");
        let check = |keys: String, want: &str| {
            let err = from_toml(&with_declared(&keys)).expect_err(want).to_string();
            assert!(err.contains(want), "{keys}\nwant: {want}\ngot:  {err}");
        };
        check(format!("input = {{ name = \"x\", shape = [-1] }}\n{two}"), "models[1].input and inputs are both set");
        check(two.replace("inputs = [ { name = \"chunk\", shape = [-1, 576] }, { name = \"state\", shape = [-1, 2, 128] } ]", "inputs = []"),
              "models[1].inputs must have 1 to 8 entries, got 0");
        check(two.replace("\"state\"", "\"chunk\""), "models[1].inputs[1].name 'chunk' names an earlier input too");
        check(two.replace("{ name = \"state\", shape = [-1, 2, 128] }", "{ name = \"state\", shape = [1, 2, 128] }"),
              "models[1].inputs[1].shape[0] must be -1");
        let padded = "inputs = [ { name = \"a\", shape = [-1, -1], batching = \"pad\" }, { name = \"b\", shape = [-1, -1], min_shape = [1, 64] } ]\n\
                      outputs = [ { name = \"p\", shape = [-1, -1], follows = [{ input = \"b\", dim = 1, input_dim = 1 }] } ]\n\
                      probe_sizes = [64]\n";
        let config = from_toml(&with_declared(padded)).expect("a rule following the second input");
        assert_eq!(config.models[1].outputs.as_ref().expect("outputs")[0].follows()[0].input.as_deref(), Some("b"));
        check(padded.replace("input = \"b\"", "input = \"c\""), "models[1].outputs[0].follows[0].input 'c' is not an input of the model (a, b)");
        check(padded.replace("[64]", "[32]"), "models[1].probe_sizes[0] is 32, below inputs[1].min_shape[1] = 64");
    }

    #[test]
    fn a_model_without_a_batch_dimension_declares_whole_tensors() {
        // Triton's max_batch_size = 0: dimension 0 is the model's own, fixed or variable.
        let clip = "max_batch_size = 0\nprobe_sizes = [512, 4096]\n\
                    input = { name = \"audio\", shape = [-1], min_shape = [512] }\n\
                    outputs = [ { name = \"pitch\", shape = [-1] }, { name = \"stats\", shape = [2, 3] } ]\n";
        let config = from_toml(&with_declared(clip)).expect("an unbatched model");
        let model = &config.models[1];
        assert!(!model.batched() && config.models[0].batched());
        assert_eq!(model.input.as_ref().and_then(|i| i.min_shape.clone()), Some(vec![512]));
        from_toml(&with_declared("max_batch_size = 0\ninput = { name = \"x\", shape = [3, 4] }\noutputs = [ { name = \"y\", shape = [4] } ]\n"))
            .expect("a fixed shape");
        let padded_clip = "max_batch_size = 0\ninput = { name = \"audio\", shape = [-1], batching = \"pad\", bucket = 512 }\n\
                           outputs = [ { name = \"p\", shape = [-1], follows = [{ dim = 0, input_dim = 0, divisor = 512 }] } ]\n";
        let config = from_toml(&with_declared(padded_clip)).expect("a bucketed unbatched model");
        assert_eq!(config.models[1].outputs.as_ref().expect("outputs")[0].follows()[0], Follows { input: None, dim: 0, input_dim: 0, divisor: 512 });

        let check = |keys: &str, want: &str| {
            let err = from_toml(&with_declared(keys)).expect_err(want).to_string();
            assert!(err.contains(want), "{keys}\nwant: {want}\ngot:  {err}");
        };
        check(&clip.replace("[-1] }, {", "[0] }, {"), "models[1].outputs[0].shape[0] must be -1 (any size) or 1..=2147483648, got 0");
        check(&clip.replace("[512]", "[0]"), "models[1].input.min_shape[0] must be 1..=2147483648, got 0");
        check(&clip.replace("max_batch_size = 0\n", "").replace(", min_shape = [512]", ""), "models[1].outputs[1].shape[0] must be -1 (the batch: any number of rows; a model that takes no batch dimension says max_batch_size = 0), got 2");
        check(
            &padded_clip.replace("dim = 0, input_dim", "dim = 1, input_dim"),
            "models[1].outputs[0].follows[0].dim must name a variable (-1) dimension of shape [-1], got 1",
        );
        check(
            &padded_clip.replace(", follows = [{ dim = 0, input_dim = 0, divisor = 512 }]", ""),
            "follows = [{ dim = 0, input_dim = 0, divisor = 1 }]",
        );
        check(
            "max_batch_size = 0\ninput = { name = \"x\", shape = [3, 4], batching = \"pad\", bucket = 2 }\noutputs = [ { name = \"y\", shape = [4] } ]\n",
            "models[1].input.bucket needs a variable (-1) dimension to round up, shape is [3, 4]",
        );
        let err = from_toml("[batching]\nmax_batch_size = 0\n").expect_err("a global 0").to_string();
        assert!(err.contains("batching.max_batch_size must be at least 1 (max_batch_size = 0 is a model's own key"), "{err}");
    }

    /// A padded input `[-1, -1]` and an output following it, with `input_more` and
    /// `output_more` in their tables.
    fn padded(input_more: &str, output_more: &str) -> String {
        format!(
            "input = {{ name = \"audio\", shape = [-1, -1], batching = \"pad\"{input_more} }}\n\
             outputs = [ {{ name = \"p\", shape = [-1, -1], follows = [{{ dim = 1, input_dim = 1, divisor = 512 }}]{output_more} }} ]\n"
        )
    }

    #[test]
    fn batching_minimum_shapes_and_rules_read_and_every_mistake_names_its_key() {
        let keys = format!("{}probe_sizes = [512]\n", padded(", pad_value = -1.5, min_shape = [1, 512]", ""));
        let config = from_toml(&with_declared(&keys)).expect("padded");
        let input = config.models[1].input.as_ref().expect("an input");
        assert_eq!((input.batching(), input.pad_value(), input.min_shape.clone()), (Batching::Pad, -1.5, Some(vec![1, 512])));
        let output = &config.models[1].outputs.as_ref().expect("outputs")[0];
        assert_eq!(output.follows(), [Follows { input: None, dim: 1, input_dim: 1, divisor: 512 }]);
        let config = from_toml(&with_declared(RNET)).expect("R-Net");
        let rnet = &config.models[1];
        assert_eq!((rnet.input.as_ref().map(|i| i.batching()), rnet.batch_probe_sizes()), (Some(Batching::Equal), &DEFAULT_PROBE_SIZES[..]));
        let config = from_toml(&with_declared(&format!("{RNET}probe_sizes = [8]\n"))).expect("probe sizes");
        assert_eq!(config.models[1].batch_probe_sizes(), [8], "batch_probe_sizes defaults to probe_sizes");
        let follows_one = "follows = [{ dim = 1, input_dim = 1 }]";
        let config = from_toml(&with_declared(&padded("", "").replace("follows = [{ dim = 1, input_dim = 1, divisor = 512 }]", follows_one)))
            .expect("divisor 1 by default");
        assert_eq!(config.models[1].outputs.as_ref().expect("outputs")[0].follows()[0].divisor, 1);

        let check = |keys: String, want: &str| {
            let err = from_toml(&with_declared(&keys)).expect_err(want).to_string();
            assert!(err.contains(want), "{keys}\nwant: {want}\ngot:  {err}");
        };
        check(
            padded("", "").replace(", follows = [{ dim = 1, input_dim = 1, divisor = 512 }]", ""),
            "models[1].outputs[0].follows has no rule for dimension 1 (shape[1] = -1): with input.batching = \"pad\"",
        );
        check(RNET.replace("24] }", "24], pad_value = 1 }"), "models[1].input.pad_value is only for batching = \"pad\"");
        check(RNET.replace("[-1, 2] }", &format!("[-1, 2], {follows_one} }}")), "models[1].outputs[1].follows is only for a padded input");
        let config = from_toml(&with_declared(&format!("{}probe_sizes = [512]\n", padded(", bucket = 512, min_shape = [1, 512]", ""))))
            .expect("bucketed");
        assert_eq!(config.models[1].input.as_ref().map(DeclaredTensor::bucket), Some(512));
        assert_eq!(config.models[0].input.as_ref().map(DeclaredTensor::bucket), Some(1), "no bucketing unless set");
        from_toml(&with_declared(&padded(", bucket = 1048576", ""))).expect("the largest bucket");
        check(RNET.replace("[-1, 3, 24, 24] }", "[-1, 3, -1, -1], bucket = 8 }"), "models[1].input.bucket is only for batching = \"pad\"");
        check(
            RNET.replace("[-1, 3, 24, 24] }", "[-1, 3, -1, -1], batching = \"equal\", bucket = 8 }"),
            "models[1].input.bucket is only for batching = \"pad\"",
        );
        check(padded(", bucket = 0", ""), "models[1].input.bucket must be 1..=1048576, got 0");
        check(padded(", bucket = 1048577", ""), "models[1].input.bucket must be 1..=1048576, got 1048577");
        check(padded(", bucket = -8", ""), "bucket");
        check(padded(", bucket = 8.5", ""), "bucket");
        check(
            RNET.replace("24] }", "24], batching = \"pad\", bucket = 8 }"),
            "models[1].input.bucket needs a variable (-1) dimension after the batch to round up, shape is [-1, 3, 24, 24]",
        );
        check(padded("", ", bucket = 8"), "models[1].outputs[0].bucket is only for the input");
        check(padded("", "").replace("\"pad\"", "\"bucket\""), "unknown variant: found `bucket`, expected ``equal` or `pad``");
        check(padded(", pad_value = 1e39", ""), "models[1].input.pad_value must be a value of the input's datatype FP32, got 1e39");
        check(padded(", datatype = \"UINT8\", pad_value = 256", ""), "models[1].input.pad_value must be a value of the input's datatype UINT8, got 256.0");
        check(padded(", datatype = \"INT32\", pad_value = 0.5", ""), "models[1].input.pad_value must be a value of the input's datatype INT32, got 0.5");
        check(padded(", datatype = \"BOOL\", pad_value = 2", ""), "models[1].input.pad_value must be a value of the input's datatype BOOL, got 2.0");
        check(padded(&format!(", {follows_one}"), ""), "models[1].input.follows is only for outputs");
        check(padded("", ", batching = \"pad\""), "models[1].outputs[0].batching is only for the input");
        check(padded("", ", min_shape = [1, 1]"), "models[1].outputs[0].min_shape is only for the input");
        check(
            padded("", "").replace("divisor = 512 }]", "divisor = 512 }, { dim = 1, input_dim = 1 }]"),
            "models[1].outputs[0].follows[1].dim 1 has an earlier rule too",
        );
        check(
            padded("", "").replace("dim = 1, input_dim", "dim = 2, input_dim"),
            "models[1].outputs[0].follows[0].dim must name a variable (-1) dimension of shape [-1, -1] after the batch, got 2",
        );
        check(
            padded("", "").replace("input_dim = 1", "input_dim = 0"),
            "models[1].outputs[0].follows[0].input_dim must name a variable (-1) dimension of the input's shape [-1, -1] after the batch, got 0",
        );
        check(padded("", "").replace("divisor = 512", "divisor = 0"), "models[1].outputs[0].follows[0].divisor must be 1..=2147483648, got 0");
        check(padded("", "").replace("follows = [{", "follows = [{ stride = 2, "), "stride");
        check(padded(", min_shape = [1]", ""), "models[1].input.min_shape must have as many dimensions as shape [-1, -1], got [1]");
        check(padded(", min_shape = [2, 512]", ""), "models[1].input.min_shape[0] must be 1 (a request of one row is always taken), got 2");
        check(padded(", min_shape = [1, 0]", ""), "models[1].input.min_shape[1] must be 1..=2147483648, got 0");
        check(RNET.replace("24] }", "24], min_shape = [1, 3, 25, 24] }"), "models[1].input.min_shape[2] is 25, more than the fixed shape[2] = 24");
        check(
            padded(", min_shape = [1, 512]", ""),
            "models[1].probe_sizes[0] is 32, below input.min_shape[1] = 512: every probe size must be a size the model takes",
        );
        check(
            format!("{}probe_sizes = [512]\nbatch_probe_sizes = [1024, 256]\n", padded(", min_shape = [1, 512]", "")),
            "models[1].batch_probe_sizes[1] is 256, below input.min_shape[1] = 512",
        );
    }

    /// The config of `more` with `model_repository` set to `repo`.
    fn with_repository(repo: &TempFolder, more: &str) -> Result<WorkerConfig, ConfigError> {
        from_toml(&format!("model_repository = \"{}\"\n{more}", repo.path().display()))
    }

    /// What loading a config of `repo` answers: asserts it fails saying `want`.
    fn repository_error(repo: &TempFolder, want: &str) {
        let err = with_repository(repo, "").expect_err(want).to_string();
        assert!(err.contains(want), "want: {want}\ngot:  {err}");
    }

    const DECLARED: &str = "kind = \"declared\"\npath = \"r.jit\"\n\
        input = { name = \"image\", shape = [-1, 3, 24, 24], datatype = \"FP16\" }\n\
        outputs = [ { name = \"box_offsets\", shape = [-1, 4] }, { name = \"face_prob\", shape = [-1, 2], datatype = \"FP16\" } ]\n";

    #[test]
    fn version_folders_are_served_by_the_model_s_policy() {
        let versions = |policy: &str| -> Result<Vec<u64>, String> {
            let repo = TempFolder::new("repo-versions");
            let declared = DECLARED.replace("path = \"r.jit\"\n", "");
            repo.write("rnet/config.toml", format!("{policy}{declared}"));
            for v in ["1", "2", "10"] {
                repo.write(&format!("rnet/{v}/model.pt"), "");
            }
            repo.write("rnet/notes/readme.txt", "not a version");
            let config = with_repository(&repo, "").map_err(|e| e.to_string())?;
            for m in &config.models {
                assert!(m.path.ends_with(format!("rnet/{}/model.pt", m.version)), "{:?} for version {}", m.path, m.version);
            }
            Ok(config.models.iter().map(|m| m.version).collect())
        };
        assert_eq!(versions(""), Ok(vec![10]), "the newest by default, by number");
        assert_eq!(versions("version_policy = { latest = 2 }\n"), Ok(vec![2, 10]));
        assert_eq!(versions("version_policy = \"all\"\n"), Ok(vec![1, 2, 10]));
        assert_eq!(versions("version_policy = { specific = [2, 1] }\n"), Ok(vec![1, 2]));
        let err = versions("version_policy = { specific = [3] }\n").expect_err("no folder 3");
        assert!(err.contains("rnet/config.toml: version_policy names version 3, which has no folder (found: 1, 2, 10)"), "{err}");
        let err = versions("version_policy = { latest = 0 }\n").expect_err("latest 0");
        assert!(err.contains("version_policy latest must be at least 1"), "{err}");
        // A flat folder is version 1, as before versions existed.
        let repo = TempFolder::new("repo-flat");
        repo.write("rnet/config.toml", DECLARED);
        repo.write("rnet/r.jit", "");
        assert_eq!(with_repository(&repo, "").expect("flat").models[0].version, 1);
        // A version folder without its file names the version.
        let repo = TempFolder::new("repo-empty-version");
        repo.write("rnet/config.toml", DECLARED.replace("path = \"r.jit\"\n", ""));
        repo.write("rnet/3/readme.txt", "");
        repository_error(&repo, "rnet/config.toml: version 3: no path set and no *.pt or *.jit file in the folder");
        let repo = TempFolder::new("repo-zero");
        repo.write("rnet/config.toml", DECLARED);
        repo.write("rnet/01/r.jit", "");
        repository_error(&repo, "version folder '01' must be a number from 1, without leading zeros");
    }

    #[test]
    fn model_control_needs_a_repository_and_bounded_waits() {
        let err = from_toml("model_control = \"explicit\"\n").expect_err("no repository").to_string();
        assert!(err.contains("model_control = \"explicit\" needs a model_repository"), "{err}");
        let repo = TempFolder::new("repo-control");
        let err = with_repository(&repo, "model_control = \"poll\"\nrepository_poll_seconds = 0.0\n").expect_err("0 s").to_string();
        assert!(err.contains("repository_poll_seconds must be 0.1 to 3600, got 0"), "{err}");
        let err = with_repository(&repo, "model_control = \"explicit\"\nload_wait_ms = 600001\n").expect_err("long").to_string();
        assert!(err.contains("load_wait_ms must be at most 600000"), "{err}");
        let config = with_repository(&repo, "model_control = \"poll\"\n").expect("poll");
        assert_eq!((config.model_control, config.repository_poll_seconds), (ModelControl::Poll, 5.0));
    }

    #[test]
    fn a_model_repository_is_merged_with_the_models_entries() {
        let repo = TempFolder::new("repo-merge");
        repo.write("rnet/config.toml", DECLARED);
        repo.write("rnet/r.jit", "");
        let vad = model_file("silero_vad.jit");
        repo.write("vad/config.toml", format!("path = \"{}\"\n{}", vad.display(), padded("", "")));
        let config = with_repository(&repo, &format!("[[models]]\nname = \"pnet\"\npath = \"p.jit\"\n{MINIMAL}")).expect("merged");
        let names: Vec<&str> = config.models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["pnet", "rnet", "vad"], "the config file's entries, then the folders by name");
        let (rnet, vad_model) = (&config.models[1], &config.models[2]);
        assert_eq!(rnet.path, repo.path().join("rnet/r.jit"), "relative to the model's folder");
        assert_eq!(rnet.input.as_ref().map(|t| t.datatype), Some(DataType::Fp16));
        let datatypes: Vec<DataType> = rnet.outputs.iter().flatten().map(|o| o.datatype).collect();
        assert_eq!(datatypes, [DataType::Fp32, DataType::Fp16]);
        assert_eq!((vad_model.input.as_ref().map(|i| i.batching()), &vad_model.path), (Some(Batching::Pad), &vad));
        assert!(config.skipped_model_folders.is_empty());
        // Like any key, the repository is layered: a later provider (the environment) wins.
        let other = TempFolder::new("repo-merge-other");
        let figment = Figment::from(Serialized::defaults(WorkerConfig::default()))
            .merge(Toml::string(&format!("model_repository = \"{}\"\n", other.path().display())))
            .merge(Serialized::default("model_repository", repo.path()));
        assert_eq!(WorkerConfig::extract(figment).expect("overridden").models.len(), 2);
    }

    #[test]
    fn the_model_repository_is_read_from_the_environment() {
        let repo = TempFolder::new("repo-env");
        repo.write("vad/config.toml", MINIMAL);
        repo.write("vad/silero.jit", "");
        // A prefix of this test's own, so no other test's config sees the variable.
        let prefix = format!("VRAMGATE_REPO_TEST_{}_", std::process::id());
        std::env::set_var(format!("{prefix}MODEL_REPOSITORY"), repo.path());
        let figment = vramgate_shared::config::layered::<WorkerConfig>(None, &prefix);
        std::env::remove_var(format!("{prefix}MODEL_REPOSITORY"));
        let config = WorkerConfig::extract(figment.expect("layered")).expect("the repository from the environment");
        assert_eq!(config.model_repository.as_deref(), Some(repo.path()));
        assert_eq!(config.models.iter().map(|m| &m.path).collect::<Vec<_>>(), [&repo.path().join("vad/silero.jit")]);
    }

    #[test]
    fn a_name_defined_twice_names_both_places() {
        let repo = TempFolder::new("repo-twice");
        repo.write("vad/config.toml", MINIMAL);
        repo.write("vad/silero.jit", "");
        let err = with_repository(&repo, &format!("[[models]]\nname = \"x\"\npath = \"x.jit\"\n{MINIMAL}\n\
            [[models]]\nname = \"vad\"\npath = \"v.jit\"\n{MINIMAL}"))
        .expect_err("vad twice")
        .to_string();
        let repo_shown = format!("{}/", repo.path().display());
        assert_eq!(err, format!("model 'vad' is defined twice: models[1] in the config file and vad/config.toml in model repository {repo_shown}"));
        let twice = format!("[[models]]\nname = \"x\"\npath = \"x.jit\"\n{MINIMAL}");
        let err = from_toml(&format!("{twice}\n{twice}")).expect_err("x twice").to_string();
        assert!(err.contains("models[0] and models[1] are both named 'x'"), "{err}");
    }

    #[test]
    fn the_model_file_is_the_folders_one_model_file_unless_path_names_it() {
        let repo = TempFolder::new("repo-default-file");
        repo.write("onet/config.toml", MINIMAL);
        for other in ["README.md", "weights.bin", "jit", "model.jit.bak"] {
            repo.write(&format!("onet/{other}"), "");
        }
        repo.write("onet/onet.pt", "");
        let config = with_repository(&repo, "").expect("the one .pt file");
        assert_eq!(config.models[0].path, repo.path().join("onet/onet.pt"));
        repo.write("onet/second.jit", "");
        repository_error(&repo, "onet/config.toml: no path set and 2 model files in the folder (onet.pt, second.jit): set path to the one to load");
        repo.write("onet/config.toml", format!("{MINIMAL}path = \"second.jit\"\n"));
        assert_eq!(with_repository(&repo, "").expect("path chooses").models[0].path, repo.path().join("onet/second.jit"));
        repo.write("onet/config.toml", format!("{MINIMAL}path = \"gone.jit\"\n"));
        repository_error(&repo, &format!("onet/config.toml: model file {} not found", repo.path().join("onet/gone.jit").display()));
        for file in ["onet.pt", "second.jit"] {
            std::fs::remove_file(repo.path().join("onet").join(file)).expect("removed");
        }
        repo.write("onet/config.toml", MINIMAL);
        repository_error(&repo, "onet/config.toml: no path set and no *.pt or *.jit file in the folder");
    }

    #[test]
    fn mistakes_in_a_model_folder_are_named_by_file_and_key() {
        let repo = TempFolder::new("repo-mistakes");
        repo.write("rnet/r.jit", "");
        let at = format!("model repository {}/: rnet/config.toml: ", repo.path().display());
        let check = |config: String, want: &str| {
            repo.write("rnet/config.toml", &config);
            repository_error(&repo, &format!("{at}{want}"));
        };
        check(DECLARED.replace("[-1, 2]", "[4, 2]"), "outputs[1].shape[0] must be -1 (the batch: any number of rows; a model that takes no batch dimension says \
             max_batch_size = 0), got 4");
        check(DECLARED.replace("kind = \"declared\"", "kind = \"face_detection\""), "kind: kind \"face_detection\" is not built in any more");
        check(format!("{DECLARED}name = \"rnet\"\n"), "name must not be set: a model's name is its folder's");
        check(format!("{DECLARED}dtype = \"FP32\"\n"), "dtype: unknown field: found `dtype`");
        for (config, want) in [
            (format!("{DECLARED}instances = \"two\"\n"), "instances"),
            ("kind = \n".into(), "TOML"),
            (DECLARED.replace("path = \"r.jit\"", "path = 3"), "path"),
        ] {
            repo.write("rnet/config.toml", &config);
            let err = with_repository(&repo, "").expect_err(want).to_string();
            assert!(err.starts_with(&at) && err.contains(want), "{err}");
        }
        std::fs::remove_dir_all(repo.path().join("rnet")).expect("removed");
        repo.write("has space/config.toml", DECLARED);
        repository_error(&repo, "folder 'has space' is not a valid model name: it must be 1 to 64 ASCII letters, digits");
        let err = from_toml(&format!("[[models]]\nname = \"a/b\"\npath = \"x.jit\"\n{MINIMAL}")).expect_err("a slash").to_string();
        assert!(err.contains("models[0].name must be 1 to 64 ASCII letters, digits, '_', '-' or '.', not starting with '.', got \"a/b\""), "{err}");
    }

    #[test]
    fn hidden_folders_are_ignored_and_folders_without_a_config_skipped() {
        let repo = TempFolder::new("repo-hidden");
        repo.write(".git/config.toml", "not = [toml");
        repo.write(".cache/model/x.jit", "");
        repo.write("notes/README.md", "");
        repo.write("vad/config.toml", MINIMAL);
        repo.write("vad/silero.jit", "");
        repo.write("loose.toml", "not = [toml");
        let config = with_repository(&repo, "").expect("the one model");
        assert_eq!(config.models.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(), ["vad"]);
        assert_eq!(config.skipped_model_folders, ["notes"]);
        let empty = TempFolder::new("repo-empty");
        assert!(with_repository(&empty, "").expect("an empty repository").models.is_empty());
        let gone = empty.path().join("gone");
        let err = from_toml(&format!("model_repository = \"{}\"\n", gone.display())).expect_err("no folder").to_string();
        assert!(err.starts_with(&format!("model repository {}/: cannot read the folder", gone.display())), "{err}");
    }

    #[test]
    fn a_repository_is_refused_past_its_limits() {
        let repo = TempFolder::new("repo-limits");
        repo.write("vad/silero.jit", "");
        let config = MINIMAL;
        let padded = |bytes: u64| format!("{config}#{}\n", "x".repeat(bytes as usize - config.len() - 2));
        repo.write("vad/config.toml", padded(MAX_MODEL_CONFIG_BYTES));
        with_repository(&repo, "").expect("a config of the largest size");
        repo.write("vad/config.toml", padded(MAX_MODEL_CONFIG_BYTES + 1));
        repository_error(&repo, "vad/config.toml: larger than 65536 bytes");
        repo.write("vad/config.toml", config);
        for i in 1..MAX_MODEL_FOLDERS {
            std::fs::create_dir(repo.path().join(format!("m{i:03}"))).expect("a folder");
        }
        std::fs::create_dir(repo.path().join(".hidden")).expect("a hidden folder");
        let config = with_repository(&repo, "").expect("256 folders, the hidden one not counted");
        assert_eq!((config.models.len(), config.skipped_model_folders.len()), (1, MAX_MODEL_FOLDERS - 1));
        std::fs::create_dir(repo.path().join("m256")).expect("one folder more");
        repository_error(&repo, "more than 256 model folders");
    }
}
