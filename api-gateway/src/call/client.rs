//! Calls the ai-worker over the Open Inference Protocol v2, with tensors in the binary
//! extension (raw little-endian f32 after the JSON header), and classifies each failure as
//! worth retrying or not.

use std::time::Duration;

use reqwest::StatusCode;
use tracing::Instrument;
use vramgate_shared::telemetry::context;
use vramgate_shared::config::Secret;
use vramgate_shared::oip::{self, Tensor, TensorData};

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The worker said the request itself is wrong (4xx other than 408/429, or 507 "does not
    /// fit even alone"): don't retry.
    #[error("worker rejected the request with {status}: {message}")]
    Rejected { status: u16, message: String },
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
            CallError::Throttled { .. } => "throttled",
            CallError::TimedOut { .. } => "timeout",
            CallError::Failed { .. } => "unavailable",
            CallError::Unreachable { .. } => "unreachable",
            CallError::BadResponse(_) => "bad_response",
        }
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
    pub tensors: Vec<OutputTensor>,
}

#[derive(Debug, Clone)]
pub struct OutputTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// One inference request, encoded once so that retries re-send it without re-encoding.
pub struct InferCall {
    body: bytes::Bytes,
    header_len: Option<usize>,
    output_names: Vec<String>,
    /// Input elements: what a worker's memory estimate is a function of.
    elements: u64,
}

impl InferCall {
    /// Encodes `inputs` with their tensor data in the binary extension, asking for the named
    /// outputs in binary too.
    pub fn new(request_id: &str, inputs: &[Tensor], output_names: &[&str]) -> Self {
        let outputs: Vec<oip::RequestOutputSpec> = output_names
            .iter()
            .map(|name| oip::RequestOutputSpec { name: name.to_string(), binary: true })
            .collect();
        let (body, header_len) =
            oip::encode_request(Some(request_id), inputs, true, &outputs);
        InferCall {
            body: body.into(),
            header_len,
            output_names: output_names.iter().map(|n| n.to_string()).collect(),
            elements: inputs.iter().map(|t| t.shape.iter().map(|&d| d as u64).product::<u64>()).sum(),
        }
    }

    /// Size of the encoded request body.
    pub fn body_len(&self) -> usize {
        self.body.len()
    }

    pub fn elements(&self) -> u64 {
        self.elements
    }
}

#[derive(Clone)]
pub struct WorkerClient {
    http: reqwest::Client,
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
    pub fn new(url: &str, timeout_seconds: f64, token: Option<&Secret>) -> anyhow::Result<Self> {
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
        Ok(WorkerClient { http, base: url.trim_end_matches('/').to_string(), host, port, timeout_ms })
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    /// Sends a prepared request to `model` and returns its output tensors, in a CLIENT span
    /// whose trace context the request carries (`traceparent`), so the worker continues it;
    /// `observe` sees the answer's headers, whatever its status (the worker's admission state
    /// rides on them).
    pub async fn infer(
        &self,
        model: &str,
        call: &InferCall,
        attempt: u32,
        observe: impl FnOnce(&reqwest::header::HeaderMap),
    ) -> Result<ModelOutput, CallError> {
        let url = format!("{}/v2/models/{model}/infer", self.base);
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
        if let Some(len) = call.header_len {
            request = request.header(oip::INFERENCE_HEADER_CONTENT_LENGTH, len);
        }
        // `Bytes` clones share the buffer: a retry re-sends the same body without copying it.
        let response = request.body(call.body.clone()).send().await.map_err(|e| transport(url, "calling", &e))?;
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
        let header_len = response
            .headers()
            .get(oip::INFERENCE_HEADER_CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        let body = response.bytes().await.map_err(|e| transport(url, "reading the answer from", &e))?;
        if !status.is_success() {
            let message = serde_json::from_slice::<oip::ErrorBody>(&body)
                .map(|b| b.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned());
            return Err(classify(status, message, retry_after));
        }
        let (header, tensors) =
            oip::decode_response(&body, header_len).map_err(|e| CallError::BadResponse(e.to_string()))?;
        let mut tensors: Vec<Option<Tensor>> = tensors.into_iter().map(Some).collect();
        let mut outputs = Vec::with_capacity(call.output_names.len());
        for name in &call.output_names {
            let tensor = tensors
                .iter_mut()
                .find(|t| t.as_ref().is_some_and(|t| &t.name == name))
                .and_then(Option::take)
                .ok_or_else(|| CallError::BadResponse(format!("no output named '{name}'")))?;
            match tensor.data {
                TensorData::Fp32(data) => outputs.push(OutputTensor { name: tensor.name, shape: tensor.shape, data }),
                other => {
                    return Err(CallError::BadResponse(format!(
                        "output '{name}' is {}, expected FP32",
                        other.datatype().as_str()
                    )))
                }
            }
        }
        Ok(ModelOutput { model: header.model_name, tensors: outputs })
    }
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
}
