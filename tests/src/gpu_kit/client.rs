//! The kit's client: calls a worker over OIP HTTP as the gateway does (binary tensors, every
//! output asked for as binary, a bounded number of requests in flight, `Retry-After` honoured),
//! either as a burst of given requests or as a saturating loop for a fixed time; and the
//! worker's own figures (`/metrics`, `/vramgate/state`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use serde_json::Value;
use tokio::sync::Semaphore;

use super::KitModel;
use crate::oip_client::{encode, infer_body};

/// A request encoded once: its body, the JSON header's length and the items it counts for.
#[derive(Clone)]
pub struct Encoded {
    pub body: Arc<Vec<u8>>,
    pub header_len: Option<usize>,
    pub items: usize,
    /// What the worker prices it by: its input's elements.
    pub elements: u64,
}

impl Encoded {
    pub fn new(model: KitModel, size: usize, seed: usize) -> Self {
        let (tensor, items) = model.request(size, seed);
        let (body, header_len) = encode(&[tensor]);
        Encoded { body: Arc::new(body), header_len, items, elements: model.elements(size) }
    }
}

/// How the requests of a run ended.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    pub seconds: f64,
    pub ok: u64,
    pub items: u64,
    /// Final answers other than 200, by status.
    pub statuses: BTreeMap<u16, u64>,
    /// Requests that got no answer at all (the connection failed twice).
    pub transport: u64,
    /// 503s waited out and sent again.
    pub throttled: u64,
    /// One message of each kind of failure, for the report.
    pub examples: Vec<String>,
}

impl Tally {
    pub fn failed(&self) -> u64 {
        self.statuses.values().sum::<u64>() + self.transport
    }

    pub fn per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.items as f64 / self.seconds
        } else {
            0.0
        }
    }

    fn add(&mut self, other: Tally) {
        self.ok += other.ok;
        self.items += other.items;
        self.transport += other.transport;
        self.throttled += other.throttled;
        for (status, n) in other.statuses {
            *self.statuses.entry(status).or_default() += n;
        }
        for e in other.examples {
            if self.examples.len() < 4 && !self.examples.iter().any(|x| x.get(..40) == e.get(..40)) {
                self.examples.push(e);
            }
        }
    }

    pub fn json(&self) -> Value {
        serde_json::json!({
            "seconds": self.seconds, "ok": self.ok, "items": self.items, "items_per_s": self.per_s(),
            "failed": self.failed(), "statuses": self.statuses, "transport_errors": self.transport,
            "throttled": self.throttled, "examples": self.examples,
        })
    }
}

/// One request to the end: sent again after a 503 (its `Retry-After`, at most `max_wait`)
/// and once after a dropped connection.
async fn call(http: &reqwest::Client, url: &str, model: &str, request: &Encoded, max_wait: Duration) -> Tally {
    let mut tally = Tally::default();
    let mut transport = 0;
    loop {
        match infer_body(http, url, model, request.body.to_vec(), request.header_len, None).await {
            Ok(a) if a.status == 200 => {
                tally.ok = 1;
                tally.items = request.items as u64;
                return tally;
            }
            Ok(a) if a.status == 503 => {
                tally.throttled += 1;
                let wait = Duration::from_secs(a.retry_after.unwrap_or(1)).min(max_wait);
                tokio::time::sleep(wait).await;
            }
            Ok(a) => {
                tally.statuses.insert(a.status, 1);
                let message = a.error.unwrap_or_default();
                tally.examples.push(format!("{}: {}", a.status, message.chars().take(300).collect::<String>()));
                return tally;
            }
            // A connection dropped under us: sent once more, as the gateway would.
            Err(_) if transport == 0 => {
                transport += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => {
                tally.transport = 1;
                tally.examples.push(format!("transport: {}", e.to_string().chars().take(300).collect::<String>()));
                return tally;
            }
        }
    }
}

/// A pooled HTTP client for many requests in flight.
pub fn http() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(1024).build().expect("building an HTTP client")
}

/// Sends every request of `requests` to `model`, at most `in_flight` at once.
pub async fn burst(url: &str, model: KitModel, requests: &[Encoded], in_flight: usize) -> Tally {
    let http = http();
    let gate = Arc::new(Semaphore::new(in_flight.max(1)));
    let started = Instant::now();
    let calls = requests.iter().map(|r| {
        let (http, gate) = (http.clone(), gate.clone());
        async move {
            let _permit = gate.acquire().await.expect("the semaphore is never closed");
            call(&http, url, model.name(), r, Duration::from_secs(1)).await
        }
    });
    let results = join_all(calls).await;
    let mut tally = Tally { seconds: started.elapsed().as_secs_f64(), ..Tally::default() };
    results.into_iter().for_each(|t| tally.add(t));
    tally
}

/// Keeps `in_flight` requests (the same one) in flight to `model` for `seconds`, after a
/// warm-up of a second's calls; counts what finished within the timed window.
pub async fn saturate(url: &str, model: KitModel, request: &Encoded, in_flight: usize, seconds: f64) -> Tally {
    saturate_named(url, model.name(), request, in_flight, seconds).await
}

/// [`saturate`] of the model served under `name` (another entry of the same file).
pub async fn saturate_named(url: &str, name: &str, request: &Encoded, in_flight: usize, seconds: f64) -> Tally {
    let http = http();
    let warm = Instant::now() + Duration::from_secs_f64((seconds / 4.0).clamp(0.5, 2.0));
    let end = warm + Duration::from_secs_f64(seconds);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let lanes = (0..in_flight.max(1)).map(|_| {
        let (http, stop, done) = (http.clone(), stop.clone(), done.clone());
        async move {
            let mut tally = Tally::default();
            while !stop.load(Ordering::Relaxed) {
                let t = call(&http, url, name, request, Duration::from_millis(200)).await;
                let finished = Instant::now();
                if finished > warm && finished <= end {
                    done.fetch_add(1, Ordering::Relaxed);
                    tally.add(t);
                } else if t.failed() > 0 {
                    tally.add(Tally { ok: 0, items: 0, ..t });
                }
                if finished > end {
                    break;
                }
            }
            tally
        }
    });
    let results = join_all(lanes).await;
    stop.store(true, Ordering::Relaxed);
    let mut tally = Tally { seconds, ..Tally::default() };
    results.into_iter().for_each(|t| tally.add(t));
    tally
}

/// The worker's Prometheus text.
pub async fn metrics(url: &str) -> String {
    let http = http();
    match http.get(format!("{url}/metrics")).timeout(Duration::from_secs(5)).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The sum of every sample of metric `name` (any labels), 0 when absent.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = if let Some(labelled) = rest.strip_prefix('{') { labelled.split_once("} ")?.1 } else { rest.strip_prefix(' ')? };
            value.trim().parse::<f64>().ok()
        })
        .sum::<f64>()
        + 0.0 // an empty sum is -0.0, which prints as "-0"
}

/// Every sample of metric `name` as `(labels, value)`.
pub fn metric_samples(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix('{')?;
            let (labels, value) = rest.split_once("} ")?;
            Some((labels.to_string(), value.trim().parse::<f64>().ok()?))
        })
        .collect()
}

/// `GET /vramgate/state`: the admission figures (`admission.budget`, `.admitted`, …) and
/// every model's estimate.
pub async fn state(url: &str) -> Value {
    let http = http();
    match http.get(format!("{url}/vramgate/state")).timeout(Duration::from_secs(5)).send().await {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

/// `GET /v2/models/{model}`: its metadata, with the memory estimate under
/// `parameters.memory_estimate`.
pub async fn model_metadata(url: &str, model: KitModel) -> Value {
    let http = http();
    match http.get(format!("{url}/v2/models/{}", model.name())).timeout(Duration::from_secs(5)).send().await {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

/// The price byte admission puts on a request of `elements`, from the model's estimate in
/// `/vramgate/state`.
pub fn price(state: &Value, model: KitModel, elements: u64) -> u64 {
    let estimate = &state["models"][model.name()];
    let base = estimate["base_bytes"].as_f64().unwrap_or(0.0);
    let per = estimate["bytes_per_element"].as_f64().unwrap_or(0.0);
    (base + per * elements as f64).max(1.0) as u64
}

/// The worker's admission budget now, in bytes (0 when it did not answer).
pub fn budget(state: &Value) -> u64 {
    state["admission"]["budget"].as_u64().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sums_read_labelled_and_bare_samples() {
        let text = "# HELP x\nx_total{model=\"a\"} 2\nx_total{model=\"b\"} 3.5\nx_total_other 9\ny 1\n";
        assert_eq!(metric_sum(text, "x_total"), 5.5);
        assert_eq!(metric_sum(text, "y"), 1.0);
        assert_eq!(metric_sum(text, "z"), 0.0);
        assert_eq!(metric_samples(text, "x_total"), vec![("model=\"a\"".to_string(), 2.0), ("model=\"b\"".to_string(), 3.5)]);
    }
}
