//! Calls the ai-worker over the Open Inference Protocol v2, with tensors in the binary
//! extension (raw little-endian values after the JSON header), and classifies each failure as
//! worth retrying or not; reads a model's metadata (`GET /v2/models/{name}`) for the start-up
//! check of the task rows (`crate::tasks::fit`).
//!
//! With `worker.protocol = "grpc"` the same calls go through the worker's gRPC door
//! (`GRPCInferenceService`, [`grpc`]): the request carries raw contents, the answer's raw
//! contents are decoded by the HTTP path's own decoder, and a status code is read as the HTTP
//! status it stands for, so that both doors classify alike.

use std::borrow::Cow;
use std::time::Duration;

use reqwest::StatusCode;
use tracing::Instrument;
use vramgate_shared::telemetry::{bounded, context};
use vramgate_shared::worker_state::{self, WorkerState};
use vramgate_shared::config::Secret;
use vramgate_shared::events::{ErrorKind, Stage};
use vramgate_shared::oip::{self, DataType, Tensor, TensorData};

use crate::failure::Failure;

/// The worker door the gateway calls (`worker.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// OIP over HTTP with the binary extension (the workers' `listen`).
    #[default]
    Http,
    /// OIP's `GRPCInferenceService` (the workers' `grpc_listen`).
    Grpc,
}

/// The code `tonic-prost-build` generated from the worker's `proto/inference.proto`.
#[allow(clippy::all, missing_docs)]
pub mod grpc {
    tonic::include_proto!("inference");
}

/// Largest gRPC answer read (a tensor answer as large as the worker's largest request).
const MAX_GRPC_ANSWER_BYTES: usize = 256 * 1024 * 1024;

/// Largest model metadata read (a model declares at most a few dozen tensors).
const MAX_METADATA_BYTES: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The worker said the request itself is wrong (4xx other than 408/429, or 507 "does not
    /// fit even alone"): don't retry.
    #[error("worker rejected the request with {status}: {message}")]
    Rejected { status: u16, message: String },
    /// The model itself raised an error on this input, run alone (a 400 marked
    /// `x-vramgate-error-kind: model_error`): it would raise again anywhere, so don't retry.
    /// `message` is the worker's, bounded by [`MODEL_MESSAGE_MAX_BYTES`].
    #[error("{message}")]
    ModelFailed { message: String },
    /// Healthy but full (503, 429): come back after `retry_after` when it gave one.
    #[error("worker busy ({status}): {message}")]
    Throttled { status: u16, message: String, retry_after: Option<Duration> },
    /// The call ran past its deadline (client timeout, 408, 504).
    #[error("worker call timed out: {message}")]
    TimedOut { message: String },
    /// Failing (other 5xx, a connection lost mid-call): worth a later try.
    #[error("worker unavailable: {message}")]
    Failed { message: String },
    /// No connection could be made (refused, no route, DNS): the worker is down or gone.
    #[error("worker unreachable: {message}")]
    Unreachable { message: String },
    /// The worker answered 200 but with something we can't use: a bug on one side.
    #[error("worker answer unusable: {0}")]
    BadResponse(String),
}

impl CallError {
    /// A short name of the kind of failure: the client span's `error.type`.
    pub fn kind(&self) -> &'static str {
        match self {
            CallError::Rejected { .. } => "rejected",
            CallError::ModelFailed { .. } => "model_error",
            CallError::Throttled { .. } => "throttled",
            CallError::TimedOut { .. } => "timeout",
            CallError::Failed { .. } => "unavailable",
            CallError::Unreachable { .. } => "unreachable",
            CallError::BadResponse(_) => "bad_response",
        }
    }

    /// [`CallError::ModelFailed`] with the worker's `message`, bounded.
    fn model_failed(message: &str) -> CallError {
        CallError::ModelFailed { message: bounded(message, MODEL_MESSAGE_MAX_BYTES).to_string() }
    }

    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            CallError::Throttled { .. } | CallError::TimedOut { .. } | CallError::Failed { .. } | CallError::Unreachable { .. }
        )
    }

    /// Whether the answer says the worker has more work than it can take: the signal that
    /// lowers the task's permit limit.
    pub fn is_overload(&self) -> bool {
        matches!(self, CallError::Throttled { .. } | CallError::TimedOut { .. })
    }
}

/// A model's output tensors as the gateway needs them, in the order they were asked for.
#[derive(Debug, Clone)]
pub struct ModelOutput {
    pub model: String,
    /// The version of the model that answered, as the worker names it (empty: it named none).
    pub version: String,
    pub tensors: Vec<OutputTensor>,
}

/// One output as the worker answered it: any datatype the worker serves (BOOL, UINT8, INT32,
/// INT64, FP16, FP32), as it came; what reads it says which it takes.
#[derive(Debug, Clone)]
pub struct OutputTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: TensorData,
}

impl OutputTensor {
    pub fn datatype(&self) -> DataType {
        self.data.datatype()
    }

    /// The values of a floating-point output as `f32` (FP16 widened, exactly), for the steps
    /// that compute with probabilities or coordinates; another datatype is a failure naming
    /// the output.
    pub fn floats(&self) -> Result<Cow<'_, [f32]>, Failure> {
        match &self.data {
            TensorData::Fp32(values) => Ok(Cow::Borrowed(values)),
            TensorData::Fp16(values) => Ok(Cow::Owned(values.iter().map(|v| v.to_f32()).collect())),
            other => Err(Failure::new(
                ErrorKind::Internal,
                Stage::Postprocess,
                format!("output '{}' is {}; this step needs a floating-point output (FP16, FP32)", self.name, other.datatype().as_str()),
            )),
        }
    }
}

/// One inference request, encoded once so that retries re-send it without re-encoding.
pub struct InferCall {
    wire: Wire,
    output_names: Vec<String>,
    /// Input elements: what a worker's memory estimate is a function of.
    elements: u64,
}

impl InferCall {
    /// Encodes `inputs` with their tensor data in the binary extension, asking for the named
    /// outputs in binary too.
    pub fn new(request_id: &str, inputs: &[Tensor], output_names: &[&str], protocol: Protocol) -> Self {
        let wire = match protocol {
            Protocol::Http => {
                let outputs: Vec<oip::RequestOutputSpec> = output_names
                    .iter()
                    .map(|name| oip::RequestOutputSpec { name: name.to_string(), binary: true })
                    .collect();
                let (body, header_len) = oip::encode_request(Some(request_id), inputs, true, &outputs);
                Wire::Http { body: body.into(), header_len }
            }
            Protocol::Grpc => Wire::Grpc(grpc_request(request_id, inputs, output_names)),
        };
        InferCall {
            wire,
            output_names: output_names.iter().map(|n| n.to_string()).collect(),
            elements: inputs.iter().map(|t| t.shape.iter().map(|&d| d as u64).product::<u64>()).sum(),
        }
    }

    /// Size of the encoded request (the HTTP body, or the gRPC message's tensor bytes).
    pub fn body_len(&self) -> usize {
        match &self.wire {
            Wire::Http { body, .. } => body.len(),
            Wire::Grpc(message) => message.raw_input_contents.iter().map(|c| c.len()).sum(),
        }
    }

    pub fn elements(&self) -> u64 {
        self.elements
    }
}

/// A call encoded for the door it goes through.
enum Wire {
    Http { body: bytes::Bytes, header_len: Option<usize> },
    Grpc(grpc::ModelInferRequest),
}

/// The `ModelInfer` message of `inputs`: each tensor's little-endian values as its raw
/// contents, the named outputs asked for.
fn grpc_request(request_id: &str, inputs: &[Tensor], output_names: &[&str]) -> grpc::ModelInferRequest {
    grpc::ModelInferRequest {
        id: request_id.to_string(),
        inputs: inputs
            .iter()
            .map(|t| grpc::model_infer_request::InferInputTensor {
                name: t.name.clone(),
                datatype: t.datatype().as_str().to_string(),
                shape: t.shape.iter().map(|&d| d as i64).collect(),
                ..Default::default()
            })
            .collect(),
        raw_input_contents: inputs
            .iter()
            .map(|t| {
                let mut raw = Vec::with_capacity(t.data.byte_len());
                t.data.write_le_bytes(&mut raw);
                bytes::Bytes::from(raw)
            })
            .collect(),
        outputs: output_names
            .iter()
            .map(|name| grpc::model_infer_request::InferRequestedOutputTensor { name: name.to_string(), ..Default::default() })
            .collect(),
        ..Default::default()
    }
}

#[derive(Clone)]
pub struct WorkerClient {
    http: reqwest::Client,
    /// The gRPC door's client when `worker.protocol = "grpc"` (its channel connects lazily).
    grpc: Option<grpc::grpc_inference_service_client::GrpcInferenceServiceClient<tonic::transport::Channel>>,
    /// `Bearer <token>` for the gRPC calls' metadata (HTTP has it as a default header).
    bearer: Option<String>,
    base: String,
    /// Host and port of `base`, for the client spans.
    host: String,
    port: u16,
    /// Sent as the worker's deadline header, so the worker neither starts nor keeps waiting
    /// for work this client has stopped waiting for.
    timeout_ms: u64,
}

impl WorkerClient {
    /// A client of the worker at `url` whose calls time out after `timeout_seconds`, sending
    /// `token` as a bearer token when given.
    pub fn new(url: &str, timeout_seconds: f64, token: Option<&Secret>, protocol: Protocol) -> anyhow::Result<Self> {
        let timeout_seconds = if timeout_seconds.is_finite() { timeout_seconds.max(0.001) } else { 60.0 };
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(token) = token {
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {}", token.expose()))
                .map_err(|_| anyhow::anyhow!("worker auth_token holds characters an HTTP header cannot carry"))?;
            value.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .timeout(Duration::from_secs_f64(timeout_seconds))
            .connect_timeout(Duration::from_secs(5))
            .pool_max_idle_per_host(64)
            .build()?;
        let timeout_ms = (timeout_seconds * 1000.0).ceil() as u64;
        let parsed = reqwest::Url::parse(url).map_err(|e| anyhow::anyhow!("worker url '{url}' is not a URL: {e}"))?;
        let host = parsed.host_str().unwrap_or_default().to_string();
        let port = parsed.port_or_known_default().unwrap_or(80);
        let base = url.trim_end_matches('/').to_string();
        let grpc = match protocol {
            Protocol::Http => None,
            Protocol::Grpc => {
                let channel = tonic::transport::Endpoint::from_shared(base.clone())
                    .map_err(|e| anyhow::anyhow!("worker url '{url}' cannot be a gRPC endpoint: {e}"))?
                    .connect_timeout(Duration::from_secs(5))
                    .timeout(Duration::from_secs_f64(timeout_seconds))
                    .tcp_nodelay(true)
                    // As the worker's windows: a large answer need not wait for window updates.
                    .initial_stream_window_size(1 << 20)
                    .initial_connection_window_size(16 << 20)
                    .connect_lazy();
                Some(
                    grpc::grpc_inference_service_client::GrpcInferenceServiceClient::new(channel)
                        .max_decoding_message_size(MAX_GRPC_ANSWER_BYTES),
                )
            }
        };
        let bearer = token.map(|t| format!("Bearer {}", t.expose()));
        Ok(WorkerClient { http, grpc, bearer, base, host, port, timeout_ms })
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    /// Sends a prepared request to `model` and returns its output tensors, in a CLIENT span
    /// whose trace context the request carries (`traceparent`), so the worker continues it;
    /// `observe` sees the answer's headers, whatever its status (the worker's admission state
    /// rides on them).
    /// `version`: the model's version the task is pinned to (`model_version`); `None`, the
    /// newest the worker serves.
    pub async fn infer(
        &self,
        model: &str,
        version: Option<u64>,
        call: &InferCall,
        attempt: u32,
        observe: impl FnOnce(&reqwest::header::HeaderMap),
    ) -> Result<ModelOutput, CallError> {
        if let (Some(client), Wire::Grpc(message)) = (&self.grpc, &call.wire) {
            return self.infer_grpc(client, model, version, message, call, attempt, observe).await;
        }
        let url = format!("{}/v2/models/{model}{}/infer", self.base, versioned(version));
        let span = tracing::info_span!(
            "POST",
            otel.kind = "client",
            http.request.method = "POST",
            url.full = url.as_str(),
            server.address = self.host.as_str(),
            server.port = self.port,
            http.request.resend_count = attempt.saturating_sub(1),
            http.response.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let result = self.send(&url, call, context::headers_of(&span), observe).instrument(span.clone()).await;
        if let Err(error) = &result {
            span.record("otel.status_code", "ERROR");
            span.record("error.type", error.kind());
        }
        result
    }

    /// `GET /v2/models/{model}`: the model's declared inputs and outputs, within `timeout`,
    /// with this client's token and TLS. A 404 (a model the worker does not serve) is
    /// [`CallError::Rejected`]; a model still loading (503) or no answer is retryable.
    pub async fn metadata(&self, model: &str, version: Option<u64>, timeout: Duration) -> Result<oip::ModelMetadata, CallError> {
        if let Some(client) = &self.grpc {
            return self.metadata_grpc(client, model, version, timeout).await;
        }
        let url = format!("{}/v2/models/{model}{}", self.base, versioned(version));
        let response = self.http.get(&url).timeout(timeout).send().await.map_err(|e| transport(&url, "asking", &e))?;
        let status = response.status();
        if response.content_length().is_some_and(|n| n > MAX_METADATA_BYTES) {
            return Err(CallError::BadResponse(format!("{url}: metadata of more than {MAX_METADATA_BYTES} bytes")));
        }
        let body = response.bytes().await.map_err(|e| transport(&url, "reading the answer from", &e))?;
        if !status.is_success() {
            return Err(classify(status, error_message(&body), None));
        }
        serde_json::from_slice(&body).map_err(|e| CallError::BadResponse(format!("{url}: not OIP model metadata: {e}")))
    }

    async fn send(
        &self,
        url: &str,
        call: &InferCall,
        trace: Option<(String, Option<String>)>,
        observe: impl FnOnce(&reqwest::header::HeaderMap),
    ) -> Result<ModelOutput, CallError> {
        let mut request = self
            .http
            .post(url)
            .header("content-type", "application/octet-stream")
            .header("x-vramgate-timeout-ms", self.timeout_ms);
        if let Some((parent, state)) = trace {
            request = request.header("traceparent", parent);
            if let Some(state) = state {
                request = request.header("tracestate", state);
            }
        }
        let Wire::Http { body, header_len } = &call.wire else {
            return Err(CallError::BadResponse(format!("{url}: a call encoded for gRPC sent over HTTP (a bug)")));
        };
        if let Some(len) = header_len {
            request = request.header(oip::INFERENCE_HEADER_CONTENT_LENGTH, *len);
        }
        // `Bytes` clones share the buffer: a retry re-sends the same body without copying it.
        let response = request.body(body.clone()).send().await.map_err(|e| transport(url, "calling", &e))?;
        let status = response.status();
        tracing::Span::current().record("http.response.status_code", status.as_u16());
        observe(response.headers());
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64);
        let model_failed = is_model_error(status, response.headers());
        let header_len = response
            .headers()
            .get(oip::INFERENCE_HEADER_CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        let body = response.bytes().await.map_err(|e| transport(url, "reading the answer from", &e))?;
        if !status.is_success() {
            let message = error_message(&body);
            if model_failed {
                return Err(CallError::model_failed(&message));
            }
            return Err(classify(status, message, retry_after));
        }
        let (header, tensors) =
            oip::decode_response(&body, header_len).map_err(|e| CallError::BadResponse(e.to_string()))?;
        picked(header.model_name, header.model_version.unwrap_or_default(), tensors, &call.output_names)
    }
}

/// The path part that names a pinned version (`/versions/2`), or nothing.
fn versioned(version: Option<u64>) -> String {
    version.map(|v| format!("/versions/{v}")).unwrap_or_default()
}

/// The outputs named in `names`, in that order, out of an answer's decoded `tensors`.
fn picked(model: String, version: String, tensors: Vec<Tensor>, names: &[String]) -> Result<ModelOutput, CallError> {
    let mut tensors: Vec<Option<Tensor>> = tensors.into_iter().map(Some).collect();
    let mut outputs = Vec::with_capacity(names.len());
    for name in names {
        let tensor = tensors
            .iter_mut()
            .find(|t| t.as_ref().is_some_and(|t| &t.name == name))
            .and_then(Option::take)
            .ok_or_else(|| CallError::BadResponse(format!("no output named '{name}'")))?;
        outputs.push(OutputTensor { name: tensor.name, shape: tensor.shape, data: tensor.data });
    }
    Ok(ModelOutput { model, version, tensors: outputs })
}

impl WorkerClient {
    /// A gRPC request of `message` with this client's token, deadline and trace context.
    fn grpc_request<T>(&self, message: T, timeout: Duration, trace: Option<(String, Option<String>)>) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(timeout);
        let metadata = request.metadata_mut();
        if let Some(bearer) = &self.bearer {
            if let Ok(mut value) = tonic::metadata::MetadataValue::try_from(bearer.as_str()) {
                value.set_sensitive(true);
                metadata.insert("authorization", value);
            }
        }
        if let Some((parent, state)) = trace {
            if let Ok(value) = tonic::metadata::MetadataValue::try_from(parent.as_str()) {
                metadata.insert("traceparent", value);
            }
            if let Some(Ok(value)) = state.map(|s| tonic::metadata::MetadataValue::try_from(s.as_str())) {
                metadata.insert("tracestate", value);
            }
        }
        request
    }

    /// [`infer`](Self::infer) through the gRPC door, in a CLIENT span of its own.
    #[allow(clippy::too_many_arguments)]
    async fn infer_grpc(
        &self,
        client: &grpc::grpc_inference_service_client::GrpcInferenceServiceClient<tonic::transport::Channel>,
        model: &str,
        version: Option<u64>,
        message: &grpc::ModelInferRequest,
        call: &InferCall,
        attempt: u32,
        observe: impl FnOnce(&reqwest::header::HeaderMap),
    ) -> Result<ModelOutput, CallError> {
        let span = tracing::info_span!(
            "inference.GRPCInferenceService/ModelInfer",
            otel.kind = "client",
            rpc.system = "grpc",
            rpc.service = "inference.GRPCInferenceService",
            rpc.method = "ModelInfer",
            server.address = self.host.as_str(),
            server.port = self.port,
            vramgate.model = model,
            vramgate.attempt = attempt,
            rpc.grpc.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let mut message = message.clone();
        message.model_name = model.to_string();
        message.model_version = version.map(|v| v.to_string()).unwrap_or_default();
        let timeout = Duration::from_millis(self.timeout_ms);
        let request = self.grpc_request(message, timeout, context::headers_of(&span));
        let result = async {
            match client.clone().model_infer(request).await {
                Ok(response) => {
                    span.record("rpc.grpc.status_code", 0);
                    observe(&response.metadata().clone().into_headers());
                    grpc_outputs(response.into_inner(), &call.output_names)
                }
                Err(status) => {
                    span.record("rpc.grpc.status_code", status.code() as i32);
                    let headers = status.metadata().clone().into_headers();
                    observe(&headers);
                    Err(grpc_error(&self.base, &status, &headers))
                }
            }
        }
        .instrument(span.clone())
        .await;
        if let Err(error) = &result {
            span.record("otel.status_code", "ERROR");
            span.record("error.type", error.kind());
        }
        result
    }

    /// [`metadata`](Self::metadata) through the gRPC door.
    async fn metadata_grpc(
        &self,
        client: &grpc::grpc_inference_service_client::GrpcInferenceServiceClient<tonic::transport::Channel>,
        model: &str,
        version: Option<u64>,
        timeout: Duration,
    ) -> Result<oip::ModelMetadata, CallError> {
        let version = version.map(|v| v.to_string()).unwrap_or_default();
        let message = grpc::ModelMetadataRequest { name: model.to_string(), version };
        let answer = client.clone().model_metadata(self.grpc_request(message, timeout, None)).await.map_err(|status| {
            let headers = status.metadata().clone().into_headers();
            grpc_error(&self.base, &status, &headers)
        })?;
        let m = answer.into_inner();
        let tensor = |t: grpc::model_metadata_response::TensorMetadata| oip::TensorMetadata { name: t.name, datatype: t.datatype, shape: t.shape };
        Ok(oip::ModelMetadata {
            name: m.name,
            versions: Some(m.versions),
            platform: m.platform,
            inputs: m.inputs.into_iter().map(tensor).collect(),
            outputs: m.outputs.into_iter().map(tensor).collect(),
            parameters: None,
        })
    }

    /// The worker's admission state and `model`'s estimate, for the probe of a worker out of
    /// service: HTTP's `GET /vramgate/state` through `http`; over gRPC the stamps of a
    /// `ModelMetadata` answer (the worker stamps every answer of its gRPC door with them).
    pub async fn state(&self, http: &reqwest::Client, model: &str, timeout: Duration) -> Option<WorkerState> {
        let Some(client) = &self.grpc else {
            let answer = http.get(format!("{}{}", self.base, worker_state::STATE_PATH)).send().await;
            return match answer {
                Ok(r) if r.status().is_success() => r.json::<WorkerState>().await.ok(),
                _ => None,
            };
        };
        let message = grpc::ModelMetadataRequest { name: model.to_string(), version: String::new() };
        let answer = client.clone().model_metadata(self.grpc_request(message, timeout, None)).await.ok()?;
        let headers = answer.metadata().clone().into_headers();
        let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let admission = worker_state::Admission::from_headers(get)?;
        let models = get(worker_state::HEADER_ESTIMATE)
            .and_then(worker_state::parse_estimate_header)
            .map(|e| (model.to_string(), e))
            .into_iter()
            .collect();
        Some(WorkerState { admission, models })
    }

    /// Whether the worker is ready, for the gateway's `/readyz`: HTTP's
    /// `GET /v2/health/ready` through `http`, or gRPC's `ServerReady`; `Err` says why not.
    pub async fn ready(&self, http: &reqwest::Client, timeout: Duration) -> Result<(), String> {
        let Some(client) = &self.grpc else {
            let probe = format!("{}/v2/health/ready", self.base);
            return match http.get(&probe).send().await {
                Ok(r) if r.status().is_success() => Ok(()),
                Ok(r) => Err(format!("{probe} answered {}", r.status())),
                Err(e) => Err(format!("{probe} unreachable: {e}")),
            };
        };
        let request = self.grpc_request(grpc::ServerReadyRequest {}, timeout, None);
        match client.clone().server_ready(request).await {
            Ok(answer) if answer.get_ref().ready => Ok(()),
            Ok(_) => Err(format!("{} (gRPC ServerReady): not ready", self.base)),
            Err(status) => Err(format!("{} (gRPC ServerReady): {:?}: {}", self.base, status.code(), status.message())),
        }
    }
}

/// The outputs asked for of a `ModelInfer` answer, decoded by the HTTP path's decoder: the
/// answer as the binary-extension body it stands for (each output's raw contents its
/// `binary_data_size`), so that a size that does not fill the shape is refused alike.
fn grpc_outputs(answer: grpc::ModelInferResponse, names: &[String]) -> Result<ModelOutput, CallError> {
    let bad = |m: String| CallError::BadResponse(m);
    if answer.raw_output_contents.len() != answer.outputs.len() {
        return Err(bad(format!(
            "gRPC answer has {} raw contents for {} outputs",
            answer.raw_output_contents.len(),
            answer.outputs.len()
        )));
    }
    let header = oip::InferResponse {
        model_name: answer.model_name.clone(),
        model_version: Some(answer.model_version.clone()),
        id: Some(answer.id.clone()),
        parameters: None,
        outputs: answer
            .outputs
            .iter()
            .zip(&answer.raw_output_contents)
            .map(|(o, raw)| {
                let mut p = oip::Parameters::new();
                p.insert(oip::BINARY_DATA_SIZE.into(), raw.len().into());
                oip::ResponseOutput { name: o.name.clone(), shape: o.shape.clone(), datatype: o.datatype.clone(), parameters: Some(p), data: None }
            })
            .collect(),
    };
    let mut body = serde_json::to_vec(&header).map_err(|e| bad(format!("gRPC answer: {e}")))?;
    let header_len = body.len();
    for raw in &answer.raw_output_contents {
        body.extend_from_slice(raw);
    }
    let (header, tensors) = oip::decode_response(&body, Some(header_len)).map_err(|e| bad(e.to_string()))?;
    picked(header.model_name, header.model_version.unwrap_or_default(), tensors, names)
}

/// A gRPC status read as the HTTP status the worker's HTTP door answers for the same failure
/// (its gRPC door maps them the other way), then classified alike; a status the channel made
/// itself (no connection) is [`CallError::Unreachable`].
fn grpc_error(base: &str, status: &tonic::Status, headers: &reqwest::header::HeaderMap) -> CallError {
    use tonic::Code;
    let message = status.message().to_string();
    if status.code() == Code::Unavailable && std::error::Error::source(status).is_some() {
        return CallError::Unreachable { message: format!("calling {base} over gRPC: {message}") };
    }
    let retry_after = headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64);
    let http = match status.code() {
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::ResourceExhausted if retry_after.is_some() => StatusCode::SERVICE_UNAVAILABLE,
        Code::ResourceExhausted => StatusCode::PAYLOAD_TOO_LARGE,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    if is_model_error(http, headers) {
        return CallError::model_failed(&message);
    }
    classify(http, message, retry_after)
}

/// The `{"error": …}` of a failed answer, or the start of its body.
fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<oip::ErrorBody>(body)
        .map(|b| b.error)
        .unwrap_or_else(|_| String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned())
}

fn transport(url: &str, doing: &str, e: &reqwest::Error) -> CallError {
    let message = format!("{doing} {url}: {}", error_chain(e));
    if e.is_timeout() {
        CallError::TimedOut { message }
    } else if e.is_connect() {
        CallError::Unreachable { message }
    } else {
        CallError::Failed { message }
    }
}

fn classify(status: StatusCode, message: String, retry_after: Option<Duration>) -> CallError {
    let code = status.as_u16();
    match status {
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS => {
            CallError::Throttled { status: code, message, retry_after }
        }
        StatusCode::REQUEST_TIMEOUT | StatusCode::GATEWAY_TIMEOUT => {
            CallError::TimedOut { message: format!("{status}: {message}") }
        }
        // 507 is the worker's "this input alone does not fit in GPU memory": retrying can't help.
        StatusCode::INSUFFICIENT_STORAGE => CallError::Rejected { status: code, message },
        s if s.is_server_error() => CallError::Failed { message: format!("{status}: {message}") },
        _ => CallError::Rejected { status: code, message },
    }
}

/// Longest stretch of a model's error message that goes into a dead letter.
pub const MODEL_MESSAGE_MAX_BYTES: usize = 1024;

/// Whether an error answer is the worker's "the model itself raised on this input, run alone":
/// a 400 carrying [`worker_state::HEADER_ERROR_KIND`] `model_error` (any other 4xx stays a
/// plain rejection, any 5xx a failure worth retrying, whatever it carries).
fn is_model_error(status: StatusCode, headers: &reqwest::header::HeaderMap) -> bool {
    status == StatusCode::BAD_REQUEST
        && headers
            .get(worker_state::HEADER_ERROR_KIND)
            .is_some_and(|v| v.as_bytes() == worker_state::ERROR_KIND_MODEL.as_bytes())
}

/// reqwest's top-level message is often just "error sending request"; the cause is below it.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        parts.push(s.to_string());
        source = s.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_follows_status() {
        let check = |code: u16, retryable: bool| {
            let status = StatusCode::from_u16(code).expect("valid code");
            assert_eq!(classify(status, "m".into(), None).is_retryable(), retryable, "{code}");
        };
        check(400, false);
        check(404, false);
        check(413, false);
        check(408, true);
        check(429, true);
        check(500, true);
        check(503, true);
        check(504, true);
        check(507, false);
        let overload = |code: u16| classify(StatusCode::from_u16(code).expect("valid"), "m".into(), None).is_overload();
        assert!(overload(503) && overload(429) && overload(504));
        assert!(!overload(500) && !overload(400));
    }

    #[test]
    fn grpc_statuses_are_classified_as_the_http_answers_they_stand_for() {
        use tonic::{Code, Status};
        let classify = |code: Code, metadata: &[(&'static str, &'static str)]| {
            let mut status = Status::new(code, "why");
            for (k, v) in metadata {
                status.metadata_mut().insert(*k, v.parse().expect("ascii"));
            }
            let headers = status.metadata().clone().into_headers();
            grpc_error("http://w:8001", &status, &headers)
        };
        assert!(matches!(classify(Code::InvalidArgument, &[]), CallError::Rejected { status: 400, .. }));
        assert!(matches!(classify(Code::InvalidArgument, &[("x-vramgate-error-kind", "model_error")]), CallError::ModelFailed { .. }));
        assert!(matches!(classify(Code::NotFound, &[]), CallError::Rejected { status: 404, .. }));
        assert!(matches!(classify(Code::Unauthenticated, &[]), CallError::Rejected { status: 401, .. }));
        match classify(Code::ResourceExhausted, &[("retry-after", "3")]) {
            CallError::Throttled { retry_after, .. } => assert_eq!(retry_after, Some(Duration::from_secs(3))),
            other => panic!("busy with a hint is throttled: {other:?}"),
        }
        assert!(!classify(Code::ResourceExhausted, &[]).is_retryable(), "too large for the budget: not retried");
        assert!(matches!(classify(Code::Unavailable, &[]), CallError::Throttled { status: 503, .. }), "still loading");
        assert!(matches!(classify(Code::DeadlineExceeded, &[]), CallError::TimedOut { .. }));
        assert!(matches!(classify(Code::Internal, &[]), CallError::Failed { .. }));
        // The model's marker on anything but INVALID_ARGUMENT is no verdict on the input.
        assert!(classify(Code::Internal, &[("x-vramgate-error-kind", "model_error")]).is_retryable());
    }

    #[tokio::test]
    async fn a_grpc_worker_that_is_not_there_is_unreachable() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
        let client = WorkerClient::new(&format!("http://{closed}"), 2.0, None, Protocol::Grpc).expect("a client");
        let call = InferCall::new("r", &[Tensor::new("x", vec![1], vec![1.0f32])], &["y"], Protocol::Grpc);
        let err = client.infer("m", None, &call, 1, |_| {}).await.expect_err("nothing listens");
        assert!(matches!(err, CallError::Unreachable { .. }), "{err:?}");
        assert!(client.ready(&reqwest::Client::new(), Duration::from_secs(2)).await.is_err());
    }

    #[test]
    fn only_a_marked_400_is_the_model_s_error() {
        let check = |code: u16, kind: Option<&str>, want: bool| {
            let mut headers = reqwest::header::HeaderMap::new();
            if let Some(kind) = kind {
                headers.insert(worker_state::HEADER_ERROR_KIND, kind.parse().expect("a header value"));
            }
            let status = StatusCode::from_u16(code).expect("valid code");
            assert_eq!(is_model_error(status, &headers), want, "{code} {kind:?}");
        };
        check(400, Some("model_error"), true);
        check(400, None, false);
        check(400, Some("something_else"), false);
        // The marker on another status is no verdict on the input: a 5xx stays retryable.
        check(500, Some("model_error"), false);
        check(422, Some("model_error"), false);
        let failed = CallError::model_failed("model 'm' raised an error on this input: boom");
        assert!(!failed.is_retryable() && !failed.is_overload());
        assert_eq!((failed.kind(), failed.to_string().as_str()), ("model_error", "model 'm' raised an error on this input: boom"));
        let long = CallError::model_failed(&"é".repeat(MODEL_MESSAGE_MAX_BYTES));
        assert_eq!(long.to_string().len(), MODEL_MESSAGE_MAX_BYTES);
    }
}
