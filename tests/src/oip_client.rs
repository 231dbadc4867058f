//! A small OIP v2 client for the worker tests: binary requests, decoded answers, and the
//! worker's Prometheus metrics.

use std::time::Duration;

use vramgate_shared::oip::{self, Tensor, TensorData};

/// One inference answer: the status, the `Retry-After` header, and either the outputs or
/// the error message.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub retry_after: Option<u64>,
    pub outputs: Vec<Tensor>,
    pub error: Option<String>,
}

impl Answer {
    pub fn output(&self, name: &str) -> &Tensor {
        self.outputs.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no output {name} in {:?}", self))
    }

    pub fn fp32(&self, name: &str) -> &[f32] {
        match &self.output(name).data {
            TensorData::Fp32(v) => v,
            other => panic!("output {name} is {:?}, not FP32", other.datatype()),
        }
    }
}

/// Sends one FP32 input as a binary OIP request.
pub async fn infer(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    input: &str,
    shape: Vec<usize>,
    data: Vec<f32>,
    timeout_ms: Option<u64>,
) -> anyhow::Result<Answer> {
    let (body, header_len) = encode(&[Tensor::new(input, shape, data)]);
    infer_body(http, url, model, body, header_len, timeout_ms).await
}

/// A binary OIP request body of `inputs` and its JSON header's length, asking for every output
/// as a binary tensor (the request-level `binary_data_output`; the gateway names each output
/// instead). Without it the worker answers in JSON, and
/// a client timing a model with large outputs (P-Net's 1.3 MB) times JSON instead.
pub fn encode(inputs: &[Tensor]) -> (Vec<u8>, Option<usize>) {
    oip::encode_request_binary_outputs(None, inputs, true)
}

/// Sends a request body made by [`encode`] (any datatype, several inputs) to `model`.
pub async fn infer_body(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    body: Vec<u8>,
    header_len: Option<usize>,
    timeout_ms: Option<u64>,
) -> anyhow::Result<Answer> {
    let mut request = http.post(format!("{url}/v2/models/{model}/infer")).body(body).timeout(Duration::from_secs(300));
    if let Some(len) = header_len {
        request = request.header(oip::INFERENCE_HEADER_CONTENT_LENGTH, len.to_string());
    }
    if let Some(ms) = timeout_ms {
        request = request.header("x-vramgate-timeout-ms", ms.to_string());
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let header_len = response
        .headers()
        .get(oip::INFERENCE_HEADER_CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let bytes = response.bytes().await?;
    if status != 200 {
        let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        let error = body["error"].as_str().map(str::to_string).or_else(|| Some(String::from_utf8_lossy(&bytes).into()));
        return Ok(Answer { status, retry_after, outputs: Vec::new(), error });
    }
    let (_, outputs) = oip::decode_response(&bytes, header_len)?;
    Ok(Answer { status, retry_after, outputs, error: None })
}

/// The worker's metrics as text.
pub async fn metrics_text(http: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    Ok(http.get(format!("{url}/metrics")).send().await?.error_for_status()?.text().await?)
}

/// The value of one sample (`name` with its labels exactly as rendered, e.g.
/// `inference_oom_errors_total{model="x"}`); absent samples read as 0.
pub fn metric(text: &str, sample: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(sample).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A deterministic test image: smooth gradients with a bright disc, values in about [-1, 1].
pub fn test_image(height: usize, width: usize, seed: usize) -> Vec<f32> {
    let mut data = Vec::with_capacity(3 * height * width);
    for c in 0..3 {
        for y in 0..height {
            for x in 0..width {
                let (cy, cx) = ((height / 2) as f32, ((width / 3) + seed % 7) as f32);
                let r = ((y as f32 - cy).powi(2) + (x as f32 - cx).powi(2)).sqrt();
                let disc = if r < (height.min(width) as f32 / 5.0) { 0.6 } else { -0.4 };
                let gradient = ((x + y * (c + 1) + seed * 13) % 97) as f32 / 97.0 - 0.5;
                data.push(disc + 0.3 * gradient);
            }
        }
    }
    data
}

/// A deterministic test clip in [-0.5, 0.5].
pub fn test_audio(samples: usize, seed: usize) -> Vec<f32> {
    (0..samples).map(|i| 0.5 * (((i * (seed + 3)) as f32) * 0.013).sin() * (((i / 800 + seed) % 5) as f32 / 5.0)).collect()
}
