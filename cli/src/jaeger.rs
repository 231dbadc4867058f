//! Reading a trace back from Jaeger's HTTP API (`/api/traces`) and printing it as a tree of
//! spans with their waits: what `vramgate-cli trace` shows when the Jaeger UI is not at hand.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Deserialize;

/// Longest answer read from Jaeger: a trace of one event is a few dozen spans.
pub const MAX_TRACE_RESPONSE_BYTES: usize = 16 * 1024 * 1024;

#[derive(Debug, Deserialize)]
struct Response {
    #[serde(default)]
    data: Vec<Trace>,
}

/// One trace as Jaeger's API gives it.
#[derive(Debug, Clone, Deserialize)]
pub struct Trace {
    #[serde(rename = "traceID")]
    pub trace_id: String,
    pub spans: Vec<Span>,
    pub processes: HashMap<String, Process>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Span {
    #[serde(rename = "spanID")]
    pub span_id: String,
    #[serde(rename = "operationName")]
    pub operation: String,
    #[serde(default)]
    pub references: Vec<Reference>,
    /// Microseconds since the epoch.
    #[serde(rename = "startTime")]
    pub start_us: u64,
    #[serde(rename = "duration")]
    pub duration_us: u64,
    #[serde(default)]
    pub tags: Vec<Tag>,
    #[serde(default)]
    pub logs: Vec<Log>,
    #[serde(rename = "processID")]
    pub process_id: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Reference {
    #[serde(rename = "refType")]
    pub kind: String,
    #[serde(rename = "spanID")]
    pub span_id: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Tag {
    pub key: String,
    pub value: serde_json::Value,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Log {
    #[serde(default)]
    pub fields: Vec<Tag>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Process {
    #[serde(rename = "serviceName")]
    pub service: String,
}

impl Span {
    pub fn tag(&self, key: &str) -> Option<&serde_json::Value> {
        self.tags.iter().find(|t| t.key == key).map(|t| &t.value)
    }

    /// The span this one is a child of.
    pub fn parent(&self) -> Option<&str> {
        self.references.iter().find(|r| r.kind == "CHILD_OF").map(|r| r.span_id.as_str())
    }
}

impl Trace {
    pub fn service_of(&self, span: &Span) -> &str {
        self.processes.get(&span.process_id).map_or("?", |p| p.service.as_str())
    }

    pub fn span(&self, operation: &str) -> Option<&Span> {
        self.spans.iter().find(|s| s.operation == operation)
    }

    pub fn spans_named<'a>(&'a self, operation: &'a str) -> impl Iterator<Item = &'a Span> + 'a {
        self.spans.iter().filter(move |s| s.operation == operation)
    }
}

/// A client of one Jaeger query service.
pub struct Jaeger {
    http: reqwest::Client,
    base: String,
}

impl Jaeger {
    pub fn new(base: &str) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
        Ok(Jaeger { http, base: base.trim_end_matches('/').to_string() })
    }

    /// The trace with this id (32 hex digits), if Jaeger has it.
    pub async fn trace(&self, trace_id: &str) -> anyhow::Result<Option<Trace>> {
        if trace_id.len() != 32 || !trace_id.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!("'{trace_id}' is not a trace id (32 hex digits)");
        }
        let url = format!("{}/api/traces/{trace_id}", self.base);
        let response = self.http.get(&url).send().await.with_context(|| format!("asking Jaeger at {url}"))?;
        if response.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        Ok(self.read(response, &url).await?.data.into_iter().next())
    }

    /// The latest traces of `service` whose spans carry the tag `key` = `value`.
    pub async fn find(&self, service: &str, key: &str, value: &str, limit: usize) -> anyhow::Result<Vec<Trace>> {
        let tags = serde_json::json!({ key: value }).to_string();
        let url = format!("{}/api/traces", self.base);
        let limit = limit.clamp(1, 100).to_string();
        let request = self.http.get(&url).query(&[("service", service), ("tags", &tags), ("limit", &limit), ("lookback", "2d")]);
        let response = request.send().await.with_context(|| format!("asking Jaeger at {url}"))?;
        Ok(self.read(response, &url).await?.data)
    }

    async fn read(&self, response: reqwest::Response, url: &str) -> anyhow::Result<Response> {
        let status = response.status();
        if response.content_length().is_some_and(|n| n > MAX_TRACE_RESPONSE_BYTES as u64) {
            bail!("Jaeger's answer from {url} is larger than {MAX_TRACE_RESPONSE_BYTES} bytes");
        }
        let body = response.bytes().await.with_context(|| format!("reading Jaeger's answer from {url}"))?;
        if !status.is_success() {
            bail!("Jaeger answered {status} from {url}: {}", String::from_utf8_lossy(&body[..body.len().min(300)]));
        }
        serde_json::from_slice(&body).with_context(|| format!("Jaeger's answer from {url} is not a trace list"))
    }
}

/// Tags worth showing beside a span in the tree: the ones that say why it waited or failed.
const SHOWN_TAGS: &[&str] = &[
    "messaging.destination.name",
    "messaging.kafka.offset",
    "messaging.message.id",
    "vramgate.trace.parent_refused",
    "vramgate.outcome",
    "input.format",
    "input.bytes",
    "output.elements",
    "pool.threads",
    "permit.limit",
    "permit.waiting",
    "http.response.status_code",
    "http.request.resend_count",
    "attempt",
    "reason",
    "delay_ms",
    "retry_after_ms",
    "admission.estimated_bytes",
    "admission.queued_bytes_ahead",
    "admission.budget_bytes",
    "batch.size",
    "batch.estimated_bytes",
    "model",
    "device",
    "error.type",
];

/// The span tree, one line per span: offset from the trace's start, duration, service,
/// operation and the tags that explain it; events (an OOM) below their span.
pub fn render(trace: &Trace) -> String {
    let start = trace.spans.iter().map(|s| s.start_us).min().unwrap_or(0);
    let ids: std::collections::HashSet<&str> = trace.spans.iter().map(|s| s.span_id.as_str()).collect();
    let mut children: HashMap<Option<&str>, Vec<&Span>> = HashMap::new();
    for span in &trace.spans {
        // A parent outside this trace's spans (not exported, or sampled out) makes a root.
        let parent = span.parent().filter(|p| ids.contains(p));
        children.entry(parent).or_default().push(span);
    }
    for list in children.values_mut() {
        list.sort_by_key(|s| (s.start_us, s.span_id.clone()));
    }
    let mut out = String::new();
    let _ = writeln!(out, "trace {}  ({} spans)", trace.trace_id, trace.spans.len());
    let mut stack: Vec<(&Span, usize)> = children.get(&None).into_iter().flatten().rev().map(|s| (*s, 0)).collect();
    while let Some((span, depth)) = stack.pop() {
        let offset_ms = (span.start_us - start) as f64 / 1000.0;
        let took_ms = span.duration_us as f64 / 1000.0;
        let tags: Vec<String> = SHOWN_TAGS
            .iter()
            .filter_map(|k| span.tag(k).map(|v| format!("{k}={}", plain(v))))
            .collect();
        let _ = writeln!(
            out,
            "{:>9.3} ms {:>9.3} ms  {}{} [{}]{}{}",
            offset_ms,
            took_ms,
            "  ".repeat(depth),
            span.operation,
            trace.service_of(span),
            if tags.is_empty() { "" } else { "  " },
            tags.join(" ")
        );
        for log in &span.logs {
            let fields: Vec<String> = log.fields.iter().map(|f| format!("{}={}", f.key, plain(&f.value))).collect();
            let _ = writeln!(out, "{:>24}  {}  event: {}", "", "  ".repeat(depth + 1), fields.join(" "));
        }
        if let Some(kids) = children.get(&Some(span.span_id.as_str())) {
            stack.extend(kids.iter().rev().map(|s| (*s, depth + 1)));
        }
    }
    out
}

fn plain(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => cut(s, 80).to_string(),
        other => other.to_string(),
    }
}

fn cut(s: &str, max: usize) -> &str {
    vramgate_shared::telemetry::bounded(s, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_tree_in_start_order_with_the_waits() {
        let json = serde_json::json!({"data": [{
            "traceID": "4bf92f3577b34da6a3ce929d0e0e4736",
            "processes": {"p1": {"serviceName": "api-gateway"}, "p2": {"serviceName": "ai-worker"}},
            "spans": [
                {"spanID": "b", "operationName": "gpu_permit_wait", "references": [{"refType": "CHILD_OF", "spanID": "a"}],
                 "startTime": 1_000_100, "duration": 50, "processID": "p1", "tags": [{"key": "permit.limit", "value": 4}]},
                {"spanID": "a", "operationName": "process voice.requests", "references": [],
                 "startTime": 1_000_000, "duration": 5000, "processID": "p1", "tags": []},
                {"spanID": "c", "operationName": "inference", "references": [{"refType": "CHILD_OF", "spanID": "b"}],
                 "startTime": 1_000_200, "duration": 3000, "processID": "p2",
                 "tags": [{"key": "batch.size", "value": 2}],
                 "logs": [{"fields": [{"key": "event", "value": "oom"}, {"key": "batch.size.after", "value": 1}]}]},
                {"spanID": "d", "operationName": "orphan", "references": [{"refType": "CHILD_OF", "spanID": "zz"}],
                 "startTime": 1_000_300, "duration": 1, "processID": "p2", "tags": []}
            ]
        }]});
        let response: Response = serde_json::from_value(json).expect("parses");
        let text = render(&response.data[0]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].contains("4 spans"), "{text}");
        assert!(lines[1].contains("process voice.requests [api-gateway]"), "{text}");
        assert!(lines[2].contains("  gpu_permit_wait [api-gateway]  permit.limit=4"), "{text}");
        assert!(lines[3].contains("    inference [ai-worker]  batch.size=2"), "{text}");
        assert!(lines[4].contains("event: event=oom batch.size.after=1"), "{text}");
        assert!(lines[5].contains("orphan [ai-worker]"), "an unknown parent makes a root: {text}");
        assert!(lines[2].trim_start().starts_with("0.100 ms"), "{text}");
    }
}
