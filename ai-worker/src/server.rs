//! The worker's HTTP surface: the KServe Open Inference Protocol v2 (health, metadata, infer),
//! with Triton's binary tensor data extension, so standard clients such as `tritonclient[http]`
//! can call it.
//!
//! Every error leaves through [`ApiError`], whose `IntoResponse` picks the status code and the
//! OIP error body `{"error": …}`; the logging middleware writes each failed request to the log
//! once, and turns axum's own rejections (unknown route, wrong method) into the same body.
//!
//! Bodies are read under the limits of [`crate::limits`] (size, bytes in flight, time), and
//! connections are served by [`limits::serve`] (header and idle timeouts). With `auth_token`
//! set, inference and model metadata need `Authorization: Bearer <token>` ([`require_token`]);
//! health, readiness, `/v2` and `/metrics` stay open.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tracing::Instrument;
use bytes::Bytes;
use vramgate_shared::oip::{self, DataType, RawData, Tensor, F16};
use vramgate_shared::telemetry::context::Carried;
use vramgate_shared::telemetry::{bounded, LOG_FIELD_MAX_BYTES};
use vramgate_shared::worker_state;

use crate::config::{AdmissionMode, Secret, WorkerConfig};
use crate::batching::BatchSizer;
use crate::engine::{Calibrated, Engine, InferError, Served};
use crate::finite;
use crate::estimate::{MemoryEstimate, Probe};
use crate::limits::{self, BodyError, BodyLimits, ConnTimeouts};
use crate::memory::{Budget, MemoryMonitor};
use crate::metrics::Metrics;
use crate::model::{self, ComputeDevice, InputTensor, Model, ModelError, TensorSpec};

mod grpc;
mod report;
mod repository;

/// The name both doors give the server in its metadata.
const SERVER_NAME: &str = "vramgate-ai-worker";

/// Shared by all handlers. `engine` is empty until start-up (loading, warming and memory
/// calibration) finishes; readiness follows it.
struct AppState {
    engine: OnceLock<Arc<Engine>>,
    configured: Vec<String>,
    metrics: Arc<Metrics>,
    /// How request bodies are read (size, bytes in flight, time).
    body_limits: BodyLimits,
    /// The bearer token of the inference endpoints; `None`: open.
    auth_token: Option<Secret>,
    /// The model repository's run-time side (index, load, unload, poll); set with `engine`.
    repository: OnceLock<Arc<repository::Repository>>,
}

/// Model folders without a config the start-up warning names; the rest are counted.
const SKIPPED_FOLDERS_NAMED: usize = 16;

/// Binds nothing itself: takes a bound listener (port 0 in tests), serves until `shutdown`
/// resolves, and fails if a configured model cannot be loaded.
pub async fn run(
    config: WorkerConfig,
    listener: TcpListener,
    grpc_listener: Option<TcpListener>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    let metrics = Arc::new(Metrics::new());
    let state = Arc::new(AppState {
        engine: OnceLock::new(),
        configured: config.models.iter().map(|m| m.name.clone()).collect(),
        metrics: metrics.clone(),
        body_limits: BodyLimits::new(
            config.max_request_bytes as u64,
            config.max_body_bytes_in_flight,
            Duration::from_millis(config.body_read_timeout_ms),
        ),
        auth_token: config.auth_token.clone(),
        repository: OnceLock::new(),
    });
    let app = router(state.clone());
    let timeouts = ConnTimeouts {
        header_read: Duration::from_millis(config.header_read_timeout_ms),
        idle: Duration::from_millis(config.idle_timeout_ms),
    };
    tracing::info!(
        %addr, authentication = config.auth_token.is_some(), max_request_bytes = config.max_request_bytes,
        max_body_bytes_in_flight = config.max_body_bytes_in_flight, "ai-worker listening; loading models"
    );
    if !config.skipped_model_folders.is_empty() {
        // Bounded: a repository holds at most `MAX_MODEL_FOLDERS` folders; a few are named.
        let named: Vec<&str> = config.skipped_model_folders.iter().take(SKIPPED_FOLDERS_NAMED).map(String::as_str).collect();
        tracing::warn!(
            repository = ?config.model_repository, count = config.skipped_model_folders.len(), folders = ?named,
            "model folders without config.toml skipped"
        );
    }
    if config.memory_limit_bytes.is_some() && config.memory_host_allowance_bytes < 2 * config.max_body_bytes_in_flight {
        tracing::warn!(
            memory_host_allowance_bytes = config.memory_host_allowance_bytes,
            max_body_bytes_in_flight = config.max_body_bytes_in_flight,
            "on CPU the memory cap leaves less host memory than 2 × the request bodies read at once \
             (a body and its decoded tensors); a burst of large bodies may abort the worker"
        );
    }

    let loader = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || start_engine(&config, metrics))
    };
    // One shutdown signal, both doors.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    let http = tokio::spawn(limits::serve(listener, app, timeouts, stopped()));
    let grpc = match grpc_listener {
        Some(listener) => {
            tracing::info!(addr = %listener.local_addr()?, "ai-worker gRPC listening");
            let (state, config, stop) = (state.clone(), config.clone(), stopped());
            tokio::spawn(async move { grpc::serve(state, listener, &config, stop).await })
        }
        None => tokio::spawn(async { std::future::pending::<anyhow::Result<()>>().await }),
    };
    let mut server = tokio::spawn(async move {
        // Either door failing stops the worker; on shutdown both end.
        tokio::select! {
            served = http => served.map_err(anyhow::Error::from)?.map_err(anyhow::Error::from),
            served = grpc => served.map_err(anyhow::Error::from)?,
        }
    });
    tokio::select! {
        loaded = loader => {
            let (engine, budget, device) = loaded.map_err(|e| anyhow::anyhow!("model loader panicked: {e}"))??;
            let engine = Arc::new(engine);
            let repository = Arc::new(repository::Repository::new(&config, device, engine.clone()));
            let _ = state.repository.set(repository.clone());
            let _ = state.engine.set(engine.clone());
            if config.model_control == crate::config::ModelControl::Poll {
                tokio::spawn(repository.poll());
            }
            tokio::spawn(resample_memory(engine, budget, Duration::from_millis(config.memory_resample_ms.max(10))));
            tracing::info!(models = ?state.configured, "ai-worker ready");
            server.await??;
        }
        served = &mut server => served??,
    }
    Ok(())
}

/// Loads and warms every model, measures its memory estimate and its batch sizes, starts the
/// batch threads, sets up the budget and applies the memory cap (in that order: the cap is
/// relative to the footprint after start-up, and on CPU threads must exist before it).
fn start_engine(config: &WorkerConfig, metrics: Arc<Metrics>) -> anyhow::Result<(Engine, Budget, ComputeDevice)> {
    let settings = model::TorchSettings {
        inference_mode: config.inference_mode,
        jit_optimize: config.jit_optimize,
        cudnn_benchmark: config.cudnn_benchmark,
    };
    let device = model::init_torch(config.device, config.torch_threads, settings)?;
    tracing::info!(%device, "libtorch initialised");
    let monitor = Arc::new(MemoryMonitor::new(device));
    let mut models = Vec::new();
    for mc in &config.models {
        models.push((mc.version, prepare(config, mc, device, &monitor, None, None)?));
    }
    monitor.empty_cache();
    let snap = monitor.snapshot();
    let budget = Budget::new(
        snap,
        config.memory_limit_bytes,
        config.memory_budget_bytes,
        config.memory_reserve_fraction,
        config.memory_reserve_bytes,
    )
    .overridden(config.memory_budget_override_bytes);
    if let Some(bytes) = config.memory_budget_override_bytes {
        tracing::warn!(
            budget_bytes = bytes,
            free_bytes = snap.free,
            "memory_budget_override_bytes is set: admission ignores free memory (out-of-memory recovery tests only)"
        );
    }
    let capacity = match config.admission.mode {
        AdmissionMode::Bytes => budget.available(snap, 0),
        AdmissionMode::Count => config.admission.max_concurrent,
    };
    let engine = Engine::start(config, models, monitor.clone(), metrics, capacity)?;
    if let Some(limit) = config.memory_limit_bytes {
        monitor.apply_limit(limit, config.memory_host_allowance_bytes)?;
    }
    tracing::info!(
        mode = ?config.admission.mode, capacity, cap_bytes = budget.cap, reserve_bytes = budget.reserve,
        free_bytes = snap.free, ours_bytes = snap.ours, "admission ready"
    );
    Ok((engine, budget, device))
}

/// Loads and warms one model version, measures its memory estimate, and times its batch sizes:
/// what start-up does for every model and a run-time load for one. Batch sizes are timed only
/// where their memory surely fits: a quarter of what is free once the model is loaded, and at
/// most `timing_cap` bytes (a run-time load's grant: in-flight work holds the rest). At run
/// time (`serving`) the memory peaks are measured in the engine's serial lane, so that no batch
/// runs beside them: serving pauses for the probes, not for the file's reading.
fn prepare(
    config: &WorkerConfig,
    mc: &crate::config::ModelConfig,
    device: ComputeDevice,
    monitor: &MemoryMonitor,
    timing_cap: Option<u64>,
    serving: Option<&Engine>,
) -> anyhow::Result<Calibrated> {
    let m = Arc::new(Model::load(mc.clone(), device)?);
    let estimate = Arc::new(match serving {
        Some(engine) => engine.alone(|| calibrate(&m, monitor))?,
        None => calibrate(&m, monitor)?,
    });
    let free = monitor.snapshot().free;
    let timing_bytes = match timing_cap {
        Some(cap) => (free / 4).min(cap).max(1),
        None => free / 4,
    };
    let affordable = |elements: u64| estimate.fits(elements, timing_bytes);
    // Every batch bucket at every timed size, before the batch sizes are timed: the timings
    // (and the first requests) then never include a first call's set-up. The memory estimate
    // above was measured on peaks, which a first call does not change.
    let warm_started = Instant::now();
    let warmed = match serving {
        Some(engine) => engine.alone(|| m.warm_up(affordable)),
        None => m.warm_up(affordable),
    }
    .map_err(|e| anyhow::anyhow!("warming '{}' up: {e}", m.name()))?;
    tracing::info!(
        model = %m.name(), buckets = ?m.row_buckets(), shapes = warmed.warmed, skipped = warmed.skipped,
        elapsed_ms = warm_started.elapsed().as_millis() as u64, "batch shapes warmed"
    );
    let bound = m.batch_bound(mc.max_batch_size.or(config.batching.max_batch_size));
    let sizer = Arc::new(BatchSizer::new(bound, config.batching.initial_batch_size));
    if config.batching.calibrate {
        sizer.calibrate(&m, affordable);
    }
    Ok(Calibrated { model: m, estimate, sizer, warm_up_bytes: timing_bytes })
}

/// Fits the model's memory estimate to peaks measured on probe inputs, unless the config
/// sets it.
fn calibrate(model: &Model, monitor: &MemoryMonitor) -> anyhow::Result<MemoryEstimate> {
    if let Some(configured) = model.config().estimate {
        tracing::info!(model = %model.name(), ?configured, "memory estimate from config");
        return Ok(MemoryEstimate::configured(configured));
    }
    anyhow::ensure!(
        monitor.can_measure_peaks(),
        "model '{}': cannot measure memory peaks here (see the log above); set [models.estimate] in the config",
        model.name()
    );
    let mut probes = Vec::new();
    for input in model.calibration_inputs() {
        let peak = {
            let scope = monitor.peak_scope(true);
            model.infer(&input).map_err(|e| anyhow::anyhow!("calibrating '{}': {e}", model.name()))?;
            scope.finish()
        };
        let Some(bytes) = peak else { continue };
        probes.push(Probe { batch: input.rows(), elements: input.elements(), bytes });
    }
    anyhow::ensure!(probes.len() >= 3, "model '{}': only {} calibration peaks could be measured", model.name(), probes.len());
    let estimate = MemoryEstimate::fitted(probes);
    let view = estimate.view();
    tracing::info!(
        model = %model.name(), base_bytes = view.base_bytes as u64, bytes_per_element = view.bytes_per_element,
        probes = ?view.probes.iter().map(|p| (p.batch, p.elements, p.bytes)).collect::<Vec<_>>(),
        "memory estimate measured: bytes ≈ base + per_element × elements"
    );
    Ok(estimate)
}

/// Re-reads free memory, resizes the admission budget, and refreshes the memory gauges and the
/// device's utilisation (NVML; absent where there is no reading).
async fn resample_memory(engine: Arc<Engine>, budget: Budget, every: Duration) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let snap = engine.monitor.snapshot();
        let available = budget.available(snap, engine.models_since_start());
        if engine.mode == AdmissionMode::Bytes && available != engine.pool.capacity() {
            engine.pool.set_capacity(available);
        }
        let m = &engine.metrics;
        m.memory_used.set(snap.ours as i64);
        m.memory_available.set(snap.free as i64);
        m.set_gpu_utilization(engine.monitor.gpu_utilization());
        m.set_memory_allocated(engine.monitor.allocated());
    }
}

fn router(state: Arc<AppState>) -> Router {
    // Inference and model metadata: behind the bearer token when one is configured.
    let guarded = Router::new()
        .route("/v2/models/{name}", get(model_metadata))
        .route("/v2/models/{name}/versions/{version}", get(model_metadata_versioned))
        .route("/v2/models/{name}/infer", post(infer))
        .route("/v2/models/{name}/versions/{version}/infer", post(infer_versioned))
        .route("/v2/repository/index", post(repository::index))
        .route("/v2/repository/models/{name}/load", post(repository::load))
        .route("/v2/repository/models/{name}/unload", post(repository::unload))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(server_ready))
        .route("/v2/models/{name}/ready", get(model_ready))
        .route("/v2/models/{name}/versions/{version}/ready", get(model_ready_versioned))
        .route("/metrics", get(metrics))
        .route(vramgate_shared::worker_state::STATE_PATH, get(report::state))
        .merge(guarded)
        .layer(middleware::from_fn_with_state(state.clone(), report::stamp))
        .layer(middleware::from_fn(log_failures))
        .with_state(state)
}

/// With `auth_token` set, lets a request through only with `Authorization: Bearer <token>`
/// (scheme case-insensitive), compared in constant time; else 401 with `WWW-Authenticate`.
/// Runs before the body is read.
async fn require_token(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(token) = &state.auth_token else {
        return next.run(request).await;
    };
    let Some(message) = bearer_refusal(token, request.headers().get(header::AUTHORIZATION)) else {
        return next.run(request).await;
    };
    ApiError::new(StatusCode::UNAUTHORIZED, message)
        .with_header(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"vramgate-worker\""))
        .into_response()
}

/// Why `authorization` (the header's value, or gRPC's metadata of that name) does not carry
/// `token` as a bearer token (scheme case-insensitive, compared in constant time); `None`
/// when it does.
fn bearer_refusal(token: &Secret, authorization: Option<&HeaderValue>) -> Option<&'static str> {
    // `None`: no header; `Some(None)`: another scheme; `Some(Some(token))`, maybe empty.
    let presented = authorization.map(|v| {
        let v = v.as_bytes();
        let (scheme, rest) = match v.iter().position(|&b| b == b' ') {
            Some(i) => (&v[..i], &v[i + 1..]),
            None => (v, &b""[..]),
        };
        scheme.eq_ignore_ascii_case(b"bearer").then(|| rest.trim_ascii())
    });
    match presented {
        None => Some("this endpoint needs a bearer token: send the header 'Authorization: Bearer <auth_token>'"),
        Some(None) => Some("the Authorization header must use the Bearer scheme: 'Authorization: Bearer <auth_token>'"),
        Some(Some(p)) if bool::from(p.ct_eq(token.expose().as_bytes())) => None,
        Some(Some(_)) => Some("the bearer token does not match the worker's auth_token"),
    }
}

/// An error answer: status code plus the OIP error body `{"error": "..."}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    retry_after_seconds: Option<u64>,
    /// Further headers of the answer (`WWW-Authenticate`, `Connection: close`).
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), retry_after_seconds: None, headers: Vec::new() }
    }

    fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }

    /// Asks the client to close the connection: its request body was not (fully) read.
    fn closing(self) -> Self {
        self.with_header(header::CONNECTION, HeaderValue::from_static("close"))
    }
}

/// The message of a failed request, handed from the response to the logging middleware.
#[derive(Clone)]
struct ErrorMessage(String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = oip::ErrorBody { error: self.message.clone() };
        let mut response = (self.status, Json(body)).into_response();
        for (name, value) in self.headers {
            response.headers_mut().append(name, value);
        }
        if let Some(seconds) = self.retry_after_seconds {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response.extensions_mut().insert(ErrorMessage(self.message));
        response
    }
}

impl From<ModelError> for ApiError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::BadInput(_) => ApiError::new(StatusCode::BAD_REQUEST, e.to_string()),
            // Over `max_input_elements`: refused by size, as admission refuses an input over
            // the whole budget, so a caller sees one kind (too large) whichever limit it met.
            ModelError::TooLarge(_) => ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, e.to_string()),
            // The model refused this input (as Triton and KServe answer it): 400, marked so
            // that a caller can tell it from a malformed request and need not retry it.
            ModelError::Raised { .. } => ApiError::new(StatusCode::BAD_REQUEST, e.to_string()).with_header(
                HeaderName::from_static(worker_state::HEADER_ERROR_KIND),
                HeaderValue::from_static(worker_state::ERROR_KIND_MODEL),
            ),
            _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }
}

impl From<InferError> for ApiError {
    fn from(e: InferError) -> Self {
        match e {
            InferError::Model(e) => e.into(),
            InferError::OutOfMemory { message } => ApiError::new(StatusCode::INSUFFICIENT_STORAGE, message),
            InferError::TooLarge(message) => ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, message),
            InferError::Busy { message, retry_after_seconds } => ApiError {
                retry_after_seconds: Some(retry_after_seconds),
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
            },
            InferError::Deadline(message) => ApiError::new(StatusCode::GATEWAY_TIMEOUT, message),
        }
    }
}

impl From<BodyError> for ApiError {
    fn from(e: BodyError) -> Self {
        let status = match &e {
            BodyError::DeclaredTooLarge { .. } | BodyError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            BodyError::Timeout { .. } => StatusCode::REQUEST_TIMEOUT,
            BodyError::Read(_) => StatusCode::BAD_REQUEST,
        };
        let retry_after_seconds = matches!(e, BodyError::Busy { .. }).then_some(1);
        // The rest of the body is left unread: the connection cannot carry another request.
        ApiError { retry_after_seconds, ..ApiError::new(status, e.to_string()) }.closing()
    }
}

/// Longest stretch of a request's path that goes into an error message or a log line.
const MAX_PATH_CHARS: usize = 200;

async fn log_failures(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path: String = request.uri().path().chars().take(MAX_PATH_CHARS).collect();
    let response = next.run(request).await;
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let response = match response.extensions().get::<ErrorMessage>() {
        Some(_) => response,
        None => as_json_error(response, &format!("{method} {path}")).await,
    };
    let message = response.extensions().get::<ErrorMessage>().map(|m| m.0.as_str()).unwrap_or("");
    if status.is_server_error() {
        tracing::warn!(%method, %path, status = status.as_u16(), message, "request failed");
    } else {
        tracing::info!(%method, %path, status = status.as_u16(), message, "request rejected");
    }
    response
}

/// An error answer axum made itself (no route, wrong method, a path it could not parse),
/// rebuilt as `{"error": …}` saying which request it was; its headers (e.g. `Allow`) are kept.
async fn as_json_error(response: Response, request: &str) -> Response {
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 4096).await.map(|b| String::from_utf8_lossy(&b).trim().to_string()).unwrap_or_default();
    let what = match parts.status {
        StatusCode::NOT_FOUND => "no such endpoint".to_string(),
        StatusCode::METHOD_NOT_ALLOWED => {
            let allowed = parts.headers.get(header::ALLOW).and_then(|v| v.to_str().ok()).unwrap_or("");
            format!("method not allowed here (allowed: {allowed})")
        }
        other => other.canonical_reason().unwrap_or("error").to_lowercase(),
    };
    let message = if text.is_empty() { format!("{request}: {what}") } else { format!("{request}: {what}: {text}") };
    let mut error = ApiError::new(parts.status, message);
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            error.headers.push((name.clone(), value.clone()));
        }
    }
    error.into_response()
}

impl AppState {
    /// The engine and the newest version of the named model, or 503 while loading / 404.
    fn served(&self, name: &str) -> Result<(Arc<Engine>, Arc<Served>), ApiError> {
        self.served_at(name, None)
    }

    /// The engine and `version` of the named model (as a path or a gRPC request gives it;
    /// `None` or empty: the newest version served), or why not: 400 for a version that is not
    /// a number, 503 while the worker starts, 404 for a model or version not served.
    fn served_at(&self, name: &str, version: Option<&str>) -> Result<(Arc<Engine>, Arc<Served>), ApiError> {
        let version = match version.filter(|v| !v.is_empty()) {
            None => None,
            Some(v) => Some(v.parse::<u64>().ok().filter(|&v| v > 0).ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!("model version '{}' is not a version number (1, 2, ...)", bounded(v, LOG_FIELD_MAX_BYTES)),
                )
            })?),
        };
        let Some(engine) = self.engine.get() else {
            if self.configured.iter().any(|c| c == name) {
                return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("model '{name}' is still loading")));
            }
            return Err(ApiError::new(StatusCode::NOT_FOUND, format!("unknown model '{name}'")));
        };
        let found = match version {
            None => engine.served(name),
            Some(v) => engine.served_version(name, v),
        };
        if let Some(served) = found {
            return Ok((engine.clone(), served));
        }
        let ready = engine.versions(name);
        let name = bounded(name, LOG_FIELD_MAX_BYTES);
        Err(match (version, ready.is_empty()) {
            (Some(v), false) => ApiError::new(
                StatusCode::NOT_FOUND,
                format!("model '{name}' has no version {v} ready (ready: {})", versions_text(&ready)),
            ),
            _ if self.repository.get().is_some_and(|r| r.is_loading(name)) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("model '{name}' is loading"))
            }
            _ if self.repository.get().is_some_and(|r| r.knows(name)) || self.configured.iter().any(|c| c == name) => {
                ApiError::new(StatusCode::NOT_FOUND, format!("model '{name}' is not loaded (unloaded, or its last load failed)"))
            }
            _ => ApiError::new(StatusCode::NOT_FOUND, format!("unknown model '{name}'")),
        })
    }
}

/// Versions as a list for a message: `1, 2`.
fn versions_text(versions: &[u64]) -> String {
    versions.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
}

async fn server_metadata() -> Json<oip::ServerMetadata> {
    Json(oip::ServerMetadata {
        name: SERVER_NAME.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        extensions: vec!["binary_tensor_data".into()],
    })
}

async fn server_ready(State(state): State<Arc<AppState>>) -> Result<StatusCode, ApiError> {
    if state.engine.get().is_some() {
        Ok(StatusCode::OK)
    } else {
        Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "models are still loading"))
    }
}

async fn model_ready(State(state): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    match state.served(&name) {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn model_ready_versioned(
    State(state): State<Arc<AppState>>,
    Path((name, version)): Path<(String, String)>,
) -> Response {
    match state.served_at(&name, Some(&version)) {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn model_metadata(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> Result<Json<oip::ModelMetadata>, ApiError> {
    metadata_of(&state, &name, None).map(Json)
}

/// A served model's metadata, as both doors give it: of `version` (`None` or empty: the newest
/// served), listing every version served.
fn metadata_of(state: &AppState, name: &str, version: Option<&str>) -> Result<oip::ModelMetadata, ApiError> {
    let (engine, served) = state.served_at(name, version)?;
    let model = &served.model;
    let (inputs, outputs) = tensor_metadata(model);
    let mut parameters = oip::Parameters::new();
    parameters.insert("memory_estimate".into(), serde_json::to_value(served.estimate.view()).unwrap_or_default());
    parameters.insert("version".into(), served.version.to_string().into());
    Ok(oip::ModelMetadata {
        name: model.name().into(),
        versions: Some(engine.versions(name).iter().map(u64::to_string).collect()),
        platform: "pytorch_libtorch".into(),
        inputs,
        outputs,
        parameters: Some(parameters),
    })
}

/// The model's input and outputs as OIP metadata: datatypes and shapes as the model states
/// them (FP32 for the built-in kinds, as declared for `declared`).
fn tensor_metadata(model: &Model) -> (Vec<oip::TensorMetadata>, Vec<oip::TensorMetadata>) {
    let tensor = |spec: &TensorSpec| oip::TensorMetadata {
        name: spec.name.to_string(),
        datatype: spec.datatype.as_str().into(),
        shape: spec.shape.clone(),
    };
    (model.input_specs().iter().map(tensor).collect(), model.output_specs().iter().map(tensor).collect())
}

async fn model_metadata_versioned(
    State(state): State<Arc<AppState>>,
    Path((name, version)): Path<(String, String)>,
) -> Result<Json<oip::ModelMetadata>, ApiError> {
    metadata_of(&state, &name, Some(&version)).map(Json)
}

async fn infer_versioned(
    state: State<Arc<AppState>>,
    Path((name, version)): Path<(String, String)>,
    request: Request,
) -> Result<Response, ApiError> {
    infer_at(state, name, Some(version), request).await
}


/// An inference request in a SERVER span that continues the caller's trace (its
/// `traceparent`, read strictly: a refused one starts a new trace that says why).
async fn infer(state: State<Arc<AppState>>, Path(name): Path<String>, request: Request) -> Result<Response, ApiError> {
    infer_at(state, name, None, request).await
}

/// An inference of `version` of the model (`None`: the newest served).
async fn infer_at(
    state: State<Arc<AppState>>,
    name: String,
    version: Option<String>,
    request: Request,
) -> Result<Response, ApiError> {
    let span = tracing::info_span!(
        "POST /v2/models/{model}/infer",
        otel.kind = "server",
        http.request.method = "POST",
        http.route = "/v2/models/{model}/infer",
        url.path = bounded(request.uri().path(), LOG_FIELD_MAX_BYTES),
        vramgate.model = bounded(&name, LOG_FIELD_MAX_BYTES),
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    Carried::from_headers(request.headers().iter().map(|(k, v)| (k.as_str(), v.as_bytes()))).adopt(&span);
    let result = infer_in_span(state, name, version, request).instrument(span.clone()).await;
    let status = match &result {
        Ok(response) => response.status(),
        Err(error) => error.status,
    };
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
        span.record("error.type", status.as_str());
    }
    result
}

async fn infer_in_span(
    State(state): State<Arc<AppState>>,
    name: String,
    version: Option<String>,
    request: Request,
) -> Result<Response, ApiError> {
    let (engine, served) = state.served_at(&name, version.as_deref())?;
    let (parts, body) = request.into_parts();
    let headers = parts.headers;
    // From here until its job is queued, the model's batch thread knows this request is coming;
    // until the answer is built, that it is in the worker.
    let mut arrival = served.arrive();
    let model = served.model.clone();
    let header_len = match headers.get(oip::INFERENCE_HEADER_CONTENT_LENGTH) {
        None => None,
        Some(v) => Some(v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok()).ok_or_else(
            || {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!("header {} must be a byte count", oip::INFERENCE_HEADER_CONTENT_LENGTH),
                )
            },
        )?),
    };
    // Everything that can be checked without the body has been: now read it, charged to
    // `max_body_bytes_in_flight`, within `max_request_bytes` and `body_read_timeout_ms`.
    let reading = Instant::now();
    // A binary body is scanned for non-finite FP32 values as it arrives (see `finite`).
    let (body, charge, scan) = limits::read_body_scanned(&state.body_limits, &headers, body, header_len.is_some()).await?;
    let read = Instant::now();
    let (request, tensors) = oip::decode_request_in_place(&body, header_len, &oip::DecodeLimits::default())
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.to_string()))?;
    // A binary input stays in the body's bytes until the batch copies it into its tensor: the
    // body is this request's only copy of its input (a JSON input is decoded and the body
    // freed). Its charge ends here, as it did when the body was decoded into a second copy.
    let inputs = take_inputs(&model, tensors, &body, scan.as_ref())?;
    drop(body);
    drop(charge);
    // As the worker runs them: a model without a batch dimension gets a batch of one.
    let input = model.accept(inputs)?;
    let timeout = request_timeout(&headers, &request, engine.default_timeout)?;
    let decoded = Instant::now();
    let outputs = engine.infer(&served, input, timeout, &mut arrival).await?;
    let inferred = Instant::now();

    let tensors: Vec<Tensor> =
        outputs.into_iter().map(|o| Tensor { name: o.name.to_string(), shape: o.shape, data: o.data }).collect();
    let tensors: Vec<Tensor> = match &request.outputs {
        Some(asked) if !asked.is_empty() => tensors.into_iter().filter(|t| asked.iter().any(|a| a.name == t.name)).collect(),
        _ => tensors,
    };
    let binary = |name: &str| oip::wants_binary_output(&request, name);
    let version = served.version.to_string();
    // The outputs' own memory goes out as parts of the body, written one after the other:
    // not copied into one buffer first.
    let (parts, header_len) = oip::encode_response_parts(model.name(), Some(&version), request.id.as_deref(), tensors, binary);
    let mut response = axum::body::Body::new(Parts::new(parts)).into_response();
    let content_type = if header_len.is_some() { "application/octet-stream" } else { "application/json" };
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Some(len) = header_len {
        response
            .headers_mut()
            .insert(oip::INFERENCE_HEADER_CONTENT_LENGTH, HeaderValue::from(len));
    }
    let phases = state.metrics.request_phases.clone();
    for (phase, from, to) in [("body", reading, read), ("decode", read, decoded), ("infer", decoded, inferred), ("encode", inferred, Instant::now())] {
        phases.with_label_values(&[model.name(), phase]).observe((to - from).as_secs_f64());
    }
    Ok(response)
}

/// A response body of several parts sent in order, of a known length (so it goes out with a
/// `Content-Length`, not chunked), each part written as it is: hyper writes them vectored.
struct Parts {
    parts: std::collections::VecDeque<Bytes>,
    remaining: u64,
}

impl Parts {
    fn new(parts: Vec<Bytes>) -> Parts {
        let remaining = parts.iter().map(|p| p.len() as u64).sum();
        Parts { parts: parts.into_iter().filter(|p| !p.is_empty()).collect(), remaining }
    }
}

impl hyper::body::Body for Parts {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        let next = self.parts.pop_front();
        if let Some(part) = &next {
            self.remaining -= part.len() as u64;
        }
        std::task::Poll::Ready(next.map(|part| Ok(hyper::body::Frame::data(part))))
    }

    fn is_end_stream(&self) -> bool {
        self.parts.is_empty()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.remaining)
    }
}

/// Header naming a request's deadline in milliseconds from its arrival.
pub const TIMEOUT_HEADER: &str = "x-vramgate-timeout-ms";

/// The request's deadline: the `x-vramgate-timeout-ms` header, else Triton's
/// `parameters.timeout` (microseconds), else the configured default.
fn request_timeout(headers: &HeaderMap, request: &oip::InferRequest, default: Duration) -> Result<Duration, ApiError> {
    if let Some(v) = headers.get(TIMEOUT_HEADER) {
        let ms = v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()).filter(|&ms| ms > 0).ok_or_else(|| {
            ApiError::new(StatusCode::BAD_REQUEST, format!("header {TIMEOUT_HEADER} must be a positive number of milliseconds"))
        })?;
        return Ok(Duration::from_millis(ms));
    }
    if let Some(us) = request.parameters.as_ref().and_then(|p| p.get("timeout")).and_then(|v| v.as_u64()) {
        if us > 0 {
            return Ok(Duration::from_micros(us));
        }
    }
    Ok(default)
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    if let Some(engine) = state.engine.get() {
        engine.publish_admission();
    }
    let mut response = state.metrics.render().into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    response
}

/// Finds the model's inputs among the request's tensors, in the model's order, checks each
/// one's datatype and values, and takes binary data as a slice of `body` (no copy). A model of
/// one input takes a lone tensor whatever its name; a model of several takes each by name.
/// `scan`, the body's scan as it was read: a binary FP32 input it finds clean is not gone
/// through again (see [`finite`]).
fn take_inputs(
    model: &Model,
    tensors: Vec<oip::RawTensor>,
    body: &Bytes,
    scan: Option<&finite::Scan>,
) -> Result<Vec<InputTensor>, ApiError> {
    let specs = model.input_specs();
    let count = tensors.len();
    let names = || specs.iter().map(|s| format!("'{}'", s.name)).collect::<Vec<_>>().join(", ");
    let refused = |message: String| ApiError::new(StatusCode::BAD_REQUEST, message);
    let mut tensors: Vec<Option<oip::RawTensor>> = tensors.into_iter().map(Some).collect();
    let mut taken = Vec::with_capacity(specs.len());
    for spec in specs {
        let found = if specs.len() == 1 && count == 1 {
            tensors[0].take()
        } else {
            tensors.iter_mut().find(|t| t.as_ref().is_some_and(|t| *t.name == *spec.name)).and_then(Option::take)
        };
        let Some(tensor) = found else {
            return Err(refused(if specs.len() == 1 {
                format!("model '{}' takes one input named '{}', request had {count}", model.name(), spec.name)
            } else {
                format!("model '{}' takes the inputs {}; the request has no '{}'", model.name(), names(), spec.name)
            }));
        };
        // Named by what was sent: a lone input is taken whatever its name.
        spec.check_datatype(&tensor.name, tensor.datatype)?;
        let (input, scanned_clean) = match tensor.data {
            RawData::Binary(range) => {
                let clean = tensor.datatype == DataType::Fp32 && scan.is_some_and(|s| !s.may_hold_non_finite(range.clone()));
                (InputTensor::from_le_bytes(tensor.shape, tensor.datatype, body.slice(range))?, clean)
            }
            RawData::Json(values) => (InputTensor::from_data(tensor.shape, &values), false),
        };
        if scanned_clean {
            taken.push(input);
            continue;
        }
        if let Some((at, what, rule)) = first_invalid(input.datatype(), input.le_bytes()) {
            return Err(refused(format!("input '{}' holds {what} at element {at}: {rule}", tensor.name)));
        }
        taken.push(input);
    }
    if let Some(extra) = tensors.iter().flatten().next() {
        let name = bounded(&extra.name, LOG_FIELD_MAX_BYTES);
        return Err(refused(if specs.iter().any(|s| *s.name == *extra.name) {
            format!("the request has tensor '{name}' more than once")
        } else {
            format!("model '{}' takes {}; the request's tensor '{name}' is none of them", model.name(), names())
        }));
    }
    Ok(taken)
}

/// The first value among `le` (little-endian values of `datatype` at any alignment) that a
/// model must not see: its index, what it is and the rule it breaks. NaN and ±infinity
/// (FP32, FP16); a BOOL byte other than 0 and 1 (libtorch would take it for a bool that
/// cannot be).
fn first_invalid(datatype: DataType, le: &[u8]) -> Option<(usize, String, &'static str)> {
    const FINITE: &str = "NaN and ±infinity are refused";
    match datatype {
        DataType::Fp32 => finite::first_non_finite(le).map(|(at, x)| (at, format!("a non-finite value ({x})"), FINITE)),
        DataType::Fp16 => le
            .chunks_exact(2)
            .map(|b| F16::from_bits(u16::from_le_bytes([b[0], b[1]])))
            .enumerate()
            .find(|(_, x)| !x.is_finite())
            .map(|(at, x)| (at, format!("a non-finite value ({})", x.to_f32()), FINITE)),
        DataType::Bool => le.iter().position(|&b| b > 1).map(|at| (at, format!("the byte {}", le[at]), "BOOL is one byte, 0 or 1")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vramgate_shared::oip::TensorData;

    fn le(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn the_model_s_own_error_is_a_marked_400_and_a_device_fault_a_500() {
        let answer = |e: ModelError| {
            let response = ApiError::from(InferError::Model(e)).into_response();
            let kind = response.headers().get(worker_state::HEADER_ERROR_KIND).map(|v| v.to_str().expect("ascii").to_string());
            (response.status().as_u16(), kind)
        };
        let (name, message) = ("m".to_string(), "method 'forward': RuntimeError: index out of range in self".to_string());
        assert_eq!(answer(ModelError::Raised { name: name.clone(), message: message.clone() }), (400, Some("model_error".into())));
        assert_eq!(answer(ModelError::Runtime { name: name.clone(), message }), (500, None));
        assert_eq!(answer(ModelError::Panic { name, message: "boom".into() }), (500, None));
        assert_eq!(answer(ModelError::BadInput("input 'x' must be FP32".into())), (400, None));
        assert_eq!(answer(ModelError::TooLarge("input has 8640 elements, more than this model's limit of 6912".into())), (413, None));
    }

    #[test]
    fn non_finite_values_are_found_wherever_they_are() {
        let mut data = vec![0.5f32; 10_000];
        assert_eq!(finite::first_non_finite(&le(&data)), None);
        data[9] = -f32::MAX;
        assert_eq!(finite::first_non_finite(&le(&data)), None, "the largest finite values are finite");
        for (at, bad) in [(0, f32::NAN), (4095, f32::INFINITY), (4096, f32::NEG_INFINITY), (9999, -f32::NAN)] {
            let mut data = data.clone();
            data[at] = bad;
            let found = finite::first_non_finite(&le(&data));
            assert_eq!(found.map(|(i, _)| i), Some(at), "{bad} at {at}");
            assert_eq!(found.map(|(_, x)| x.to_bits()), Some(bad.to_bits()));
            // The binary section starts wherever the JSON header ends: any alignment.
            let mut shifted = vec![0u8; 3];
            shifted.extend(le(&data));
            assert_eq!(finite::first_non_finite(&shifted[3..]).map(|(i, _)| i), Some(at), "{bad} at {at}, misaligned");
        }
        assert_eq!(finite::first_non_finite(&[]), None);
    }

    #[test]
    fn a_declared_model_is_asked_for_and_answers_its_declared_tensors() {
        let keys = model::testing::DECLARED_PNET.replace("\"image\"", "\"picture\"");
        let model = model::testing::load(model::testing::pnet_entry("pnet", &keys)).expect("P-Net declared");
        let meta = |name: &str, shape: &[i64]| oip::TensorMetadata { name: name.into(), datatype: "FP32".into(), shape: shape.to_vec() };
        assert_eq!(
            tensor_metadata(&model),
            (vec![meta("picture", &[-1, 3, -1, -1])], vec![meta("box_offsets", &[-1, 4, -1, -1]), meta("probs", &[-1, 2, -1, -1])])
        );
        let raw = |name: &str, side: usize| oip::RawTensor {
            name: name.into(),
            shape: vec![1, 3, side, side],
            datatype: DataType::Fp32,
            data: RawData::Json(TensorData::Fp32(vec![0.5; 3 * side * side])),
        };
        let input = take_inputs(&model, vec![raw("picture", 16)], &Bytes::new(), None).expect("the declared input");
        assert_eq!(input[0].shape, [1, 3, 16, 16]);
        let lone = take_inputs(&model, vec![raw("image", 12)], &Bytes::new(), None).expect("a lone tensor, whatever its name");
        assert_eq!(lone[0].shape, [1, 3, 12, 12]);
        let err = take_inputs(&model, vec![raw("image", 12), raw("other", 16)], &Bytes::new(), None).expect_err("not the declared input");
        assert_eq!((err.status, err.message.as_str()), (StatusCode::BAD_REQUEST, "model 'pnet' takes one input named 'picture', request had 2"));
        // As Triton: a tensor the model does not take is refused, not dropped.
        let err = take_inputs(&model, vec![raw("image", 12), raw("picture", 16)], &Bytes::new(), None).expect_err("one tensor more");
        assert_eq!(err.message, "model 'pnet' takes 'picture'; the request's tensor 'image' is none of them");
        let err = take_inputs(&model, vec![raw("picture", 12), raw("picture", 16)], &Bytes::new(), None).expect_err("twice");
        assert_eq!(err.message, "the request has tensor 'picture' more than once");
        let wrong = InputTensor::from_f32(vec![1, 3, 16], &[0.5; 48]);
        let err = ApiError::from(model.accept(vec![wrong]).expect_err("a rank short"));
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert_eq!(err.message, "input 'picture' must have shape [-1, 3, -1, -1] (-1: any size), got [1, 3, 16]");
    }

    #[test]
    fn a_declared_model_takes_only_its_declared_datatype_and_answers_in_its_declared_ones() {
        let entry = model::testing::entry(model::testing::bright_model(), "bright", model::testing::DECLARED_BRIGHT);
        let model = model::testing::load(entry).expect("UINT8 in, BOOL out");
        let meta = |name: &str, datatype: &str, shape: &[i64]| oip::TensorMetadata {
            name: name.into(),
            datatype: datatype.into(),
            shape: shape.to_vec(),
        };
        assert_eq!(
            tensor_metadata(&model),
            (
                vec![meta("pixels", "UINT8", &[-1, -1])],
                vec![meta("bright", "BOOL", &[-1, -1])]
            )
        );
        let raw = |datatype: DataType, data: RawData| oip::RawTensor { name: "pixels".into(), shape: vec![1, 4], datatype, data };
        let body = Bytes::from_static(&[0, 0, 10, 200, 30, 255, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        for (sent, data) in [
            (DataType::Fp32, RawData::Json(TensorData::Fp32(vec![10.0, 200.0, 30.0, 255.0]))),
            (DataType::Int32, RawData::Binary(2..18)),
            (DataType::Int64, RawData::Json(TensorData::Int64(vec![10, 200, 30, 255]))),
        ] {
            let err = take_inputs(&model, vec![raw(sent, data)], &body, None).expect_err("another datatype");
            assert_eq!((err.status, err.message), (StatusCode::BAD_REQUEST, format!("input 'pixels' must be UINT8, got {sent}")));
        }
        // The declared datatype, binary or JSON: the same input.
        let binary = take_inputs(&model, vec![raw(DataType::Uint8, RawData::Binary(2..6))], &body, None).expect("binary UINT8");
        let json = take_inputs(&model, vec![raw(DataType::Uint8, RawData::Json(TensorData::Uint8(vec![10, 200, 30, 255])))], &body, None)
            .expect("JSON UINT8");
        assert_eq!((binary[0].datatype(), binary[0].le_bytes()), (json[0].datatype(), json[0].le_bytes()));
        let outputs = model.infer(&model.accept(binary).expect("valid")).expect("an answer");
        let tensors: Vec<Tensor> = outputs.into_iter().map(|o| Tensor { name: o.name.to_string(), shape: o.shape, data: o.data }).collect();
        let (body, _) = oip::encode_response("bright", None, None, &tensors, |_| false);
        assert_eq!(
            std::str::from_utf8(&body).expect("JSON"),
            r#"{"model_name":"bright","outputs":[{"name":"bright","datatype":"BOOL","shape":[1,4],"data":[false,true,false,true]}]}"#
        );
    }

    #[test]
    fn a_model_folder_of_the_repository_is_loaded_and_answers() {
        let repo = crate::config::testing::TempFolder::new("repo-start");
        // O-Net's folder: its config (no path: the folder's one model file) and a copy of it.
        let onet = std::fs::read(model::testing::model_file("mtcnn_onet.jit")).expect("O-Net");
        repo.write("repository/mtcnn_onet/onet.jit", onet);
        repo.write(
            "repository/mtcnn_onet/config.toml",
            "kind = \"declared\"\ninput = { name = \"image\", shape = [-1, 3, 48, 48] }\n\
             outputs = [ { name = \"box_offsets\", shape = [-1, 4] }, { name = \"landmarks\", shape = [-1, 10] }, \
             { name = \"face_prob\", shape = [-1, 2] } ]\n\
             estimate = { base_bytes = 1e6, bytes_per_element = 100.0 }\n",
        );
        let file = repo.write(
            "worker.toml",
            format!("device = \"cpu\"\nmodel_repository = \"{}\"\n[batching]\ncalibrate = false\n", repo.path().join("repository").display()),
        );
        // What `main` and `run` do: the config file read, then every model loaded and started.
        let config = WorkerConfig::load(Some(&file)).expect("the worker config");
        assert_eq!(config.models.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(), ["mtcnn_onet"]);
        let (engine, _, _) = start_engine(&config, Arc::new(Metrics::new())).expect("the engine started");
        let served = engine.served("mtcnn_onet").expect("O-Net served");
        let face: Vec<f32> = (0..3 * 48 * 48).map(|i| (i as f32 * 0.01).sin()).collect();
        let outputs = served.model.infer_one(&InputTensor::from_f32(vec![1, 3, 48, 48], &face)).expect("an answer");
        let shapes: Vec<(&str, &[usize])> = outputs.iter().map(|o| (&*o.name, o.shape.as_slice())).collect();
        assert_eq!(shapes, [("box_offsets", &[1, 4][..]), ("landmarks", &[1, 10][..]), ("face_prob", &[1, 2][..])]);
    }

    #[test]
    fn values_a_model_must_not_see_are_found_by_datatype() {
        let check = |datatype: DataType, le: &[u8], want: Option<(usize, &str, &str)>| {
            let got = first_invalid(datatype, le);
            assert_eq!(got.as_ref().map(|(at, what, rule)| (*at, what.as_str(), *rule)), want, "{datatype}");
        };
        check(DataType::Bool, &[0, 1, 1, 0], None);
        check(DataType::Bool, &[0, 1, 2, 255], Some((2, "the byte 2", "BOOL is one byte, 0 or 1")));
        check(DataType::Fp16, &[0xff, 0x7b, 0x00, 0x80], None);
        check(DataType::Fp16, &[0x00, 0x3c, 0x00, 0xfc], Some((1, "a non-finite value (-inf)", "NaN and ±infinity are refused")));
        check(DataType::Fp16, &[0x01, 0x7c], Some((0, "a non-finite value (NaN)", "NaN and ±infinity are refused")));
        check(DataType::Fp32, &le(&[1.0, f32::INFINITY]), Some((1, "a non-finite value (inf)", "NaN and ±infinity are refused")));
        check(DataType::Uint8, &[255, 0], None);
        check(DataType::Int64, &[0xff; 16], None);
    }

    fn request(parameters: serde_json::Value) -> oip::InferRequest {
        oip::InferRequest { parameters: parameters.as_object().cloned(), ..Default::default() }
    }

    #[test]
    fn deadline_comes_from_the_header_then_tritons_parameter_then_the_default() {
        let default = Duration::from_secs(60);
        let mut headers = HeaderMap::new();
        let triton = request(serde_json::json!({"timeout": 250_000}));
        assert_eq!(request_timeout(&headers, &request(serde_json::json!({})), default).expect("a deadline"), default);
        assert_eq!(request_timeout(&headers, &triton, default).expect("a deadline"), Duration::from_millis(250));
        headers.insert(TIMEOUT_HEADER, HeaderValue::from_static("40"));
        assert_eq!(request_timeout(&headers, &triton, default).expect("a deadline"), Duration::from_millis(40));
        headers.insert(TIMEOUT_HEADER, HeaderValue::from_static("soon"));
        let err = request_timeout(&headers, &triton, default).expect_err("not a number");
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.message.contains(TIMEOUT_HEADER));
    }
}
