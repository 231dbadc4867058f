//! Calls the ai-worker over the Open Inference Protocol v2, with tensors in the binary
//! extension (raw little-endian f32 after the JSON header), and classifies each failure as
//! worth retrying or not.

use std::time::Duration;

use reqwest::StatusCode;
use vramgate_shared::oip::{self, Tensor, TensorData};

use crate::config::WorkerEndpoint;

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The worker said the request itself is wrong (4xx other than 408/429): don't retry.
    #[error("worker rejected the request with {status}: {message}")]
    Rejected { status: u16, message: String },
    /// Busy, overloaded or down: worth another try, after `retry_after` when it gave one.
    #[error("worker unavailable: {message}")]
    Unavailable { message: String, retry_after: Option<Duration> },
    /// The worker answered 200 but with something we can't use: a bug on one side.
    #[error("worker answer unusable: {0}")]
    BadResponse(String),
}

impl CallError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, CallError::Unavailable { .. })
    }
}

/// A model's output as the gateway needs it.
#[derive(Debug, Clone)]
pub struct ModelOutput {
    pub model: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// One inference request, encoded once so that retries re-send it without re-encoding.
pub struct InferCall {
    body: bytes::Bytes,
    header_len: Option<usize>,
    output_name: String,
}

impl InferCall {
    /// Encodes `input` with its tensor data in the binary extension, asking for `output_name`
    /// in binary too.
    pub fn new(request_id: &str, input: &Tensor, output_name: &str) -> Self {
        let outputs = [oip::RequestOutputSpec { name: output_name.to_string(), binary: true }];
        let (body, header_len) =
            oip::encode_request(Some(request_id), std::slice::from_ref(input), true, &outputs);
        InferCall { body: body.into(), header_len, output_name: output_name.to_string() }
    }
}

#[derive(Clone)]
pub struct WorkerClient {
    http: reqwest::Client,
    base: String,
    /// Sent as the worker's deadline header, so the worker neither starts nor keeps waiting
    /// for work this client has stopped waiting for.
    timeout_ms: u64,
}

impl WorkerClient {
    pub fn new(endpoint: &WorkerEndpoint) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs_f64(endpoint.request_timeout_seconds.max(0.001)))
            .connect_timeout(Duration::from_secs(5))
            .pool_max_idle_per_host(64)
            .build()?;
        let timeout_ms = (endpoint.request_timeout_seconds.max(0.001) * 1000.0).ceil() as u64;
        Ok(WorkerClient { http, base: endpoint.url.trim_end_matches('/').to_string(), timeout_ms })
    }

    /// Sends a prepared request to `model` and returns its output tensor.
    pub async fn infer(&self, model: &str, call: &InferCall) -> Result<ModelOutput, CallError> {
        let output_name = call.output_name.as_str();
        let url = format!("{}/v2/models/{model}/infer", self.base);
        let mut request = self
            .http
            .post(&url)
            .header("content-type", "application/octet-stream")
            .header("x-vramgate-timeout-ms", self.timeout_ms);
        if let Some(len) = call.header_len {
            request = request.header(oip::INFERENCE_HEADER_CONTENT_LENGTH, len);
        }
        // `Bytes` clones share the buffer: a retry re-sends the same body without copying it.
        let response = request.body(call.body.clone()).send().await.map_err(|e| CallError::Unavailable {
            message: format!("calling {url}: {}", error_chain(&e)),
            retry_after: None,
        })?;
        let status = response.status();
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
        let body = response.bytes().await.map_err(|e| CallError::Unavailable {
            message: format!("reading the answer from {url}: {}", error_chain(&e)),
            retry_after: None,
        })?;
        if !status.is_success() {
            let message = serde_json::from_slice::<oip::ErrorBody>(&body)
                .map(|b| b.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned());
            return Err(classify(status, message, retry_after));
        }
        let (header, tensors) =
            oip::decode_response(&body, header_len).map_err(|e| CallError::BadResponse(e.to_string()))?;
        let tensor = tensors
            .into_iter()
            .find(|t| t.name == output_name)
            .ok_or_else(|| CallError::BadResponse(format!("no output named '{output_name}'")))?;
        match tensor.data {
            TensorData::Fp32(data) => {
                Ok(ModelOutput { model: header.model_name, shape: tensor.shape, data })
            }
            other => Err(CallError::BadResponse(format!(
                "output '{output_name}' is {}, expected FP32",
                other.datatype().as_str()
            ))),
        }
    }
}

fn classify(status: StatusCode, message: String, retry_after: Option<Duration>) -> CallError {
    // 507 is the worker's "this input alone does not fit in GPU memory": retrying can't help.
    let retryable = (status.is_server_error() && status != StatusCode::INSUFFICIENT_STORAGE)
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS;
    if retryable {
        CallError::Unavailable { message: format!("{status}: {message}"), retry_after }
    } else {
        CallError::Rejected { status: status.as_u16(), message }
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
        check(507, false);
    }
}
