//! The worker's HTTP surface: the KServe Open Inference Protocol v2 (health, metadata, infer),
//! with Triton's binary tensor data extension, so standard clients such as `tritonclient[http]`
//! can call it.
//!
//! Every error leaves through [`ApiError`], whose `IntoResponse` picks the status code and the
//! OIP error body; the logging middleware writes each failed request to the log once.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use tokio::net::TcpListener;
use vramgate_shared::oip::{self, DataType, Tensor, TensorData};

use crate::config::{AdmissionMode, WorkerConfig};
use crate::engine::{Engine, InferError, Served};
use crate::estimate::{MemoryEstimate, Probe};
use crate::memory::{Budget, MemoryMonitor};
use crate::metrics::Metrics;
use crate::model::{self, InputTensor, Model, ModelError, TensorSpec};

/// Shared by all handlers. `engine` is empty until start-up (loading, warming and memory
/// calibration) finishes; readiness follows it.
struct AppState {
    engine: OnceLock<Arc<Engine>>,
    configured: Vec<String>,
    metrics: Arc<Metrics>,
}

/// Binds nothing itself: takes a bound listener (port 0 in tests), serves until `shutdown`
/// resolves, and fails if a configured model cannot be loaded.
pub async fn run(
    config: WorkerConfig,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    let metrics = Arc::new(Metrics::new());
    let state = Arc::new(AppState {
        engine: OnceLock::new(),
        configured: config.models.iter().map(|m| m.name.clone()).collect(),
        metrics: metrics.clone(),
    });
    let app = router(state.clone(), config.max_request_bytes);
    tracing::info!(%addr, "ai-worker listening; loading models");

    let loader = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || start_engine(&config, metrics))
    };
    let mut server = tokio::spawn(async move { axum::serve(listener, app).with_graceful_shutdown(shutdown).await });
    tokio::select! {
        loaded = loader => {
            let (engine, budget) = loaded.map_err(|e| anyhow::anyhow!("model loader panicked: {e}"))??;
            let engine = Arc::new(engine);
            let _ = state.engine.set(engine.clone());
            tokio::spawn(resample_memory(engine, budget, Duration::from_millis(config.memory_resample_ms.max(10))));
            tracing::info!(models = ?state.configured, "ai-worker ready");
            server.await??;
        }
        served = &mut server => served??,
    }
    Ok(())
}

/// Loads and warms every model, measures its memory estimate, starts the batch threads,
/// sets up the budget and applies the memory cap (in that order: the cap is relative to the
/// footprint after start-up, and on CPU threads must exist before it).
fn start_engine(config: &WorkerConfig, metrics: Arc<Metrics>) -> anyhow::Result<(Engine, Budget)> {
    let device = model::init_torch(config.device, config.torch_threads)?;
    tracing::info!(device = %model::device_name(device), "libtorch initialised");
    let monitor = Arc::new(MemoryMonitor::new(device));
    let mut models = Vec::new();
    for mc in &config.models {
        let m = Arc::new(Model::load(mc.clone(), device)?);
        let estimate = Arc::new(calibrate(&m, &monitor)?);
        models.push((m, estimate));
    }
    monitor.empty_cache();
    let snap = monitor.snapshot();
    let budget = Budget::new(
        snap,
        config.memory_limit_bytes,
        config.memory_budget_bytes,
        config.memory_reserve_fraction,
        config.memory_reserve_bytes,
    );
    let capacity = match config.admission.mode {
        AdmissionMode::Bytes => budget.available(snap),
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
    Ok((engine, budget))
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
            let scope = monitor.peak_scope();
            model.infer(&input).map_err(|e| anyhow::anyhow!("calibrating '{}': {e}", model.name()))?;
            scope.finish()
        };
        let Some(bytes) = peak else { continue };
        probes.push(Probe { batch: input.shape[0], elements: input.elements(), bytes });
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

/// Re-reads free memory, resizes the admission budget, and refreshes the memory gauges.
async fn resample_memory(engine: Arc<Engine>, budget: Budget, every: Duration) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let snap = engine.monitor.snapshot();
        let available = budget.available(snap);
        if engine.mode == AdmissionMode::Bytes && available != engine.pool.capacity() {
            engine.pool.set_capacity(available);
        }
        let m = &engine.metrics;
        m.memory_used.set(snap.ours as i64);
        m.memory_available.set(snap.free as i64);
    }
}

fn router(state: Arc<AppState>, max_request_bytes: usize) -> Router {
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(server_ready))
        .route("/v2/models/{name}", get(model_metadata))
        .route("/v2/models/{name}/versions/{version}", get(model_metadata_versioned))
        .route("/v2/models/{name}/ready", get(model_ready))
        .route("/v2/models/{name}/versions/{version}/ready", get(model_ready_versioned))
        .route("/v2/models/{name}/infer", post(infer))
        .route("/metrics", get(metrics))
        .route("/v2/models/{name}/versions/{version}/infer", post(infer_versioned))
        .layer(DefaultBodyLimit::max(max_request_bytes))
        .layer(middleware::from_fn(log_failures))
        .with_state(state)
}

/// An error answer: status code plus the OIP error body `{"error": "..."}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    retry_after_seconds: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), retry_after_seconds: None }
    }
}

/// The message of a failed request, handed from the response to the logging middleware.
#[derive(Clone)]
struct ErrorMessage(String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = oip::ErrorBody { error: self.message.clone() };
        let mut response = (self.status, Json(body)).into_response();
        if let Some(seconds) = self.retry_after_seconds {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response.extensions_mut().insert(ErrorMessage(self.message));
        response
    }
}

impl From<ModelError> for ApiError {
    fn from(e: ModelError) -> Self {
        let status = match e {
            ModelError::BadInput(_) => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, e.to_string())
    }
}

impl From<InferError> for ApiError {
    fn from(e: InferError) -> Self {
        match e {
            InferError::Model(e) => e.into(),
            InferError::OutOfMemory { message } => ApiError::new(StatusCode::INSUFFICIENT_STORAGE, message),
            InferError::TooLarge(message) => ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, message),
            InferError::Busy { message, retry_after_seconds } => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message,
                retry_after_seconds: Some(retry_after_seconds),
            },
            InferError::Deadline(message) => ApiError::new(StatusCode::GATEWAY_TIMEOUT, message),
        }
    }
}

async fn log_failures(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let response = next.run(request).await;
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        let message = response
            .extensions()
            .get::<ErrorMessage>()
            .map(|m| m.0.as_str())
            .unwrap_or("");
        if status.is_server_error() {
            tracing::warn!(%method, %path, status = status.as_u16(), message, "request failed");
        } else {
            tracing::info!(%method, %path, status = status.as_u16(), message, "request rejected");
        }
    }
    response
}

impl AppState {
    /// The engine and the named model, or 503 while loading / 404 for an unknown name.
    fn served(&self, name: &str) -> Result<(Arc<Engine>, Arc<Served>), ApiError> {
        if let Some(engine) = self.engine.get() {
            if let Some(served) = engine.served(name) {
                return Ok((engine.clone(), served));
            }
        }
        if self.configured.iter().any(|c| c == name) {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("model '{name}' is still loading"),
            ));
        }
        Err(ApiError::new(StatusCode::NOT_FOUND, format!("unknown model '{name}'")))
    }
}

async fn server_metadata() -> Json<oip::ServerMetadata> {
    Json(oip::ServerMetadata {
        name: "vramgate-ai-worker".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        extensions: vec!["binary_tensor_data".into()],
    })
}

async fn server_ready(State(state): State<Arc<AppState>>) -> StatusCode {
    if state.engine.get().is_some() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn model_ready(State(state): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    match state.served(&name) {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn model_ready_versioned(
    state: State<Arc<AppState>>,
    Path((name, _version)): Path<(String, String)>,
) -> Response {
    model_ready(state, Path(name)).await
}

async fn model_metadata(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> Result<Json<oip::ModelMetadata>, ApiError> {
    let (_, served) = state.served(&name)?;
    let model = &served.model;
    let tensor = |spec: &TensorSpec| oip::TensorMetadata {
        name: spec.name.into(),
        datatype: DataType::Fp32.as_str().into(),
        shape: spec.shape.to_vec(),
    };
    let mut parameters = oip::Parameters::new();
    parameters.insert("memory_estimate".into(), serde_json::to_value(served.estimate.view()).unwrap_or_default());
    Ok(Json(oip::ModelMetadata {
        name: model.name().into(),
        versions: Some(vec!["1".into()]),
        platform: "pytorch_libtorch".into(),
        inputs: vec![tensor(&model.input_spec())],
        outputs: model.output_specs().iter().map(tensor).collect(),
        parameters: Some(parameters),
    }))
}

async fn model_metadata_versioned(
    state: State<Arc<AppState>>,
    Path((name, _version)): Path<(String, String)>,
) -> Result<Json<oip::ModelMetadata>, ApiError> {
    model_metadata(state, Path(name)).await
}

async fn infer_versioned(
    state: State<Arc<AppState>>,
    Path((name, _version)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    infer(state, Path(name), headers, body).await
}

async fn infer(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (engine, served) = state.served(&name)?;
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
    let (request, tensors) = oip::decode_request(&body, header_len)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.to_string()))?;
    // The body's bytes are now in `tensors`; free them before the request waits for memory.
    drop(body);
    let input = take_input(&model, tensors)?;
    model.validate(&input)?;
    let timeout = request_timeout(&headers, &request, engine.default_timeout)?;
    let outputs = engine.infer(&served, input, timeout).await?;

    let tensors: Vec<Tensor> = outputs
        .into_iter()
        .map(|o| Tensor { name: o.name.into(), shape: o.shape, data: TensorData::Fp32(o.data) })
        .collect();
    let tensors: Vec<Tensor> = match &request.outputs {
        Some(asked) if !asked.is_empty() => tensors.into_iter().filter(|t| asked.iter().any(|a| a.name == t.name)).collect(),
        _ => tensors,
    };
    let binary = |name: &str| oip::wants_binary_output(&request, name);
    let (body, header_len) = oip::encode_response(model.name(), Some("1"), request.id.as_deref(), &tensors, binary);
    let mut response = body.into_response();
    let content_type = if header_len.is_some() { "application/octet-stream" } else { "application/json" };
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Some(len) = header_len {
        response
            .headers_mut()
            .insert(oip::INFERENCE_HEADER_CONTENT_LENGTH, HeaderValue::from(len));
    }
    Ok(response)
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

/// Finds the model's input among the request's tensors and checks its datatype.
fn take_input(model: &Model, tensors: Vec<Tensor>) -> Result<InputTensor, ApiError> {
    let wanted = model.input_spec().name;
    let count = tensors.len();
    let tensor = if count == 1 {
        tensors.into_iter().next()
    } else {
        tensors.into_iter().find(|t| t.name == wanted)
    };
    let Some(tensor) = tensor else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("model '{}' takes one input named '{wanted}', request had {count}", model.name()),
        ));
    };
    match tensor.data {
        TensorData::Fp32(data) => Ok(InputTensor { shape: tensor.shape, data }),
        other => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "input '{}' must be FP32, got {}",
                tensor.name,
                other.datatype().as_str()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
