//! The worker's HTTP surface: the KServe Open Inference Protocol v2 (health, metadata, infer),
//! with Triton's binary tensor data extension, so standard clients such as `tritonclient[http]`
//! can call it.
//!
//! Every error leaves through [`ApiError`], whose `IntoResponse` picks the status code and the
//! OIP error body; the logging middleware writes each failed request to the log once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use tokio::net::TcpListener;
use vramgate_shared::oip::{self, DataType, Tensor, TensorData};

use crate::config::WorkerConfig;
use crate::model::{self, InputTensor, Model, ModelError};

/// Shared by all handlers. `models` is empty until start-up loading finishes; readiness
/// follows it.
struct AppState {
    models: OnceLock<HashMap<String, Arc<Model>>>,
    configured: Vec<String>,
}

/// Binds nothing itself: takes a bound listener (port 0 in tests), serves until `shutdown`
/// resolves, and fails if a configured model cannot be loaded.
pub async fn run(
    config: WorkerConfig,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    let state = Arc::new(AppState {
        models: OnceLock::new(),
        configured: config.models.iter().map(|m| m.name.clone()).collect(),
    });
    let app = router(state.clone(), config.max_request_bytes);
    tracing::info!(%addr, "ai-worker listening; loading models");

    let loader = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || load_models(&config))
    };
    let mut server = tokio::spawn(async move { axum::serve(listener, app).with_graceful_shutdown(shutdown).await });
    tokio::select! {
        loaded = loader => {
            let models = loaded.map_err(|e| anyhow::anyhow!("model loader panicked: {e}"))??;
            let _ = state.models.set(models);
            tracing::info!(models = ?state.configured, "ai-worker ready");
            server.await??;
        }
        served = &mut server => served??,
    }
    Ok(())
}

fn load_models(config: &WorkerConfig) -> anyhow::Result<HashMap<String, Arc<Model>>> {
    let device = model::init_torch(config.device, config.torch_threads)?;
    tracing::info!(device = %model::device_name(device), "libtorch initialised");
    let mut models = HashMap::new();
    for mc in &config.models {
        let m = Model::load(mc.clone(), device)?;
        models.insert(mc.name.clone(), Arc::new(m));
    }
    Ok(models)
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
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into() }
    }
}

/// The message of a failed request, handed from the response to the logging middleware.
#[derive(Clone)]
struct ErrorMessage(String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = oip::ErrorBody { error: self.message.clone() };
        let mut response = (self.status, Json(body)).into_response();
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
    fn model(&self, name: &str) -> Result<Arc<Model>, ApiError> {
        if let Some(m) = self.models.get().and_then(|models| models.get(name)) {
            return Ok(m.clone());
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
    if state.models.get().is_some() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn model_ready(State(state): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    match state.model(&name) {
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
    let model = state.model(&name)?;
    let tensor = |name: &str| oip::TensorMetadata {
        name: name.into(),
        datatype: DataType::Fp32.as_str().into(),
        shape: vec![-1, -1],
    };
    Ok(Json(oip::ModelMetadata {
        name: model.name().into(),
        versions: Some(vec!["1".into()]),
        platform: "pytorch_libtorch".into(),
        inputs: vec![tensor(model.input_name())],
        outputs: vec![tensor(model.output_name())],
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
    let model = state.model(&name)?;
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
    let input = take_input(&model, tensors)?;

    let run = model.clone();
    let output = tokio::task::spawn_blocking(move || run.infer(&input))
        .await
        .map_err(|e| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("inference task failed: {e}"))
        })??;

    let output_name = model.output_name();
    let tensor = Tensor {
        name: output_name.into(),
        shape: output.shape,
        data: TensorData::Fp32(output.data),
    };
    let binary = oip::wants_binary_output(&request, output_name);
    let (body, header_len) =
        oip::encode_response(model.name(), Some("1"), request.id.as_deref(), &[tensor], |_| binary);
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

/// Finds the model's input among the request's tensors and checks its datatype.
fn take_input(model: &Model, tensors: Vec<Tensor>) -> Result<InputTensor, ApiError> {
    let wanted = model.input_name();
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
