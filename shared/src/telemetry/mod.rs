//! Logs and traces, set up the same way in both services.
//!
//! Logs go to stderr through `tracing`; `RUST_LOG` filters them (default `info`), and
//! `VRAMGATE_LOG_FORMAT=json` switches to one JSON object per line for log shippers, each line
//! inside a span carrying that span's `trace_id` and `span_id`. Colours only when stderr is a
//! terminal, so log files carry no escape codes. A log line carries the fields of the request's
//! outer span only (the service's [`Service::log_spans`], e.g. the gateway's `process`), less
//! the `otel.*` fields meant for the exporter: the fields of every span are formatted when it
//! is made, whether a line is ever logged in it or not, and for the nested spans of every
//! record that was a tenth of the gateway's CPU. While nothing exports, those nested spans are
//! not made at all.
//!
//! Traces: `tracing` spans are exported over OTLP (HTTP/protobuf) when an endpoint is
//! configured, through the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT`,
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER`/`_ARG`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_SDK_DISABLED`) or the `[telemetry]` table of the service's
//! config file; the variables win. Export never holds a service up: see [`export`].
//! [`context`] carries W3C trace context through Kafka and HTTP headers.

pub mod context;
pub mod export;

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use serde::{Deserialize, Serialize};
use tracing::dispatcher::WeakDispatch;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime as Clock};
use tracing_subscriber::fmt::{self, FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::filter::{FilterExt as _, LevelFilter};
use tracing_subscriber::{EnvFilter, Layer};

/// The `[telemetry]` table of a service's config. The `OTEL_*` variables override it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// OTLP/HTTP base URL of the collector (e.g. `http://127.0.0.1:4318`; `/v1/traces` is
    /// added). Unset (and no `OTEL_EXPORTER_OTLP_*ENDPOINT`): no export.
    pub otlp_endpoint: Option<String>,
    /// Share of new traces sampled, 0..=1; a continued trace follows its parent's decision.
    pub sample_ratio: f64,
    /// Ended spans queued for export; past it, new spans are dropped and counted.
    pub max_queued_spans: usize,
    /// Spans per OTLP request.
    pub max_export_batch: usize,
    /// Longest a span waits for its batch to fill, ms.
    pub export_delay_ms: u64,
    /// Deadline of one OTLP request, ms.
    pub export_timeout_ms: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            sample_ratio: 1.0,
            max_queued_spans: 8192,
            max_export_batch: 512,
            export_delay_ms: 1000,
            export_timeout_ms: 5000,
        }
    }
}

/// Largest `max_queued_spans` accepted (a span is about 1 KB queued).
pub const MAX_QUEUED_SPANS: usize = 1_000_000;

impl TelemetryConfig {
    /// Checks the bounds; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(format!("telemetry.sample_ratio is {}; it must be between 0 and 1", self.sample_ratio));
        }
        if self.max_queued_spans == 0 || self.max_queued_spans > MAX_QUEUED_SPANS {
            return Err(format!("telemetry.max_queued_spans must be 1..={MAX_QUEUED_SPANS}"));
        }
        if self.max_export_batch == 0 || self.max_export_batch > self.max_queued_spans {
            return Err("telemetry.max_export_batch must be 1..=max_queued_spans".into());
        }
        if !(1..=60_000).contains(&self.export_delay_ms) || !(1..=60_000).contains(&self.export_timeout_ms) {
            return Err("telemetry.export_delay_ms and export_timeout_ms must be 1..=60000".into());
        }
        Ok(())
    }
}

/// What [`init`] set up; [`Telemetry::shutdown`] flushes the spans still queued.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Sends what is queued (bounded by the export timeout) and stops exporting.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider {
            let _ = provider.force_flush();
            let _ = provider.shutdown_with_timeout(Duration::from_secs(5));
        }
    }
}

/// The service's identity in traces, and the spans its log lines name.
pub struct Service<'a> {
    pub name: &'a str,
    pub version: &'a str,
    /// Names of the spans whose fields log lines carry: where a request's work begins. The
    /// spans nested in them are exported as traces but left out of logs.
    pub log_spans: &'static [&'static str],
}

static DISPATCH: OnceLock<WeakDispatch> = OnceLock::new();

/// Set by [`init`] when spans are exported; see [`exports_spans`].
static EXPORTS_SPANS: AtomicBool = AtomicBool::new(false);

/// Whether this process exports spans. A hot path that makes one span per request for its log
/// lines and its trace can then make only the log's fields while nothing exports: every field
/// of a span is visited (and formatted, for the log) when it is made.
pub fn exports_spans() -> bool {
    EXPORTS_SPANS.load(Ordering::Relaxed)
}

/// Installs the global subscriber: logs, and trace export when configured. A second call only
/// returns (tests start library code that calls it too).
pub fn init(service: Service<'_>, config: &TelemetryConfig) -> Telemetry {
    let env_filter = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("VRAMGATE_LOG_FORMAT").is_ok_and(|v| v == "json");
    let ansi = std::io::stderr().is_terminal();
    let provider = tracer_provider(&service, config);
    let logged = log_filter(service.log_spans, env_filter());
    let logs = if json {
        fmt::layer().with_writer(std::io::stderr).fmt_fields(LogFields).event_format(JsonLines).with_filter(logged).boxed()
    } else {
        fmt::layer().with_writer(std::io::stderr).fmt_fields(LogFields).with_ansi(ansi).with_filter(logged).boxed()
    };
    // Each layer filters for itself, and the exporter is in the list only when it exports: a
    // span no layer wants (every nested span while nothing exports) is then never made, at
    // the cost of one check of its call site. (A global filter, or an empty `Option` layer,
    // makes every span that passes the level.)
    let mut layers: Vec<Box<dyn Layer<tracing_subscriber::Registry> + Send + Sync>> = vec![logs];
    if let Some(provider) = &provider {
        let otel = tracing_opentelemetry::layer().with_tracer(provider.tracer("vramgate")).with_filter(env_filter());
        layers.push(otel.boxed());
    }
    let installed = tracing_subscriber::registry().with(layers).try_init();
    if installed.is_err() {
        return Telemetry { provider: None };
    }
    let _ = DISPATCH.set(tracing::dispatcher::get_default(|d| d.downgrade()));
    if let Some(provider) = &provider {
        EXPORTS_SPANS.store(true, Ordering::Relaxed);
        opentelemetry::global::set_tracer_provider(provider.clone());
        tracing::info!(service = service.name, "exporting traces over OTLP");
    }
    Telemetry { provider }
}

/// What the log layer writes: events that pass `levels`, and of spans only those named in
/// `log_spans`. The span test is a closure, which knows no level, so it is given `levels`' own
/// bound as its hint: without one the subscriber's bound is `TRACE`, `LogTracer` (installed by
/// `try_init`) takes that as the `log` crate's maximum, and every trace and debug line that
/// rdkafka writes through `log` on the message path is then handed to the subscriber to be
/// refused, one by one (1.6% of the gateway's CPU on its fast lane).
fn log_filter<S>(log_spans: &'static [&'static str], levels: EnvFilter) -> impl tracing_subscriber::layer::Filter<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let bound = levels.max_level_hint().unwrap_or(LevelFilter::TRACE);
    tracing_subscriber::filter::filter_fn(move |meta| !meta.is_span() || log_spans.contains(&meta.name()))
        .with_max_level_hint(bound)
        .and(levels)
}

/// A standard variable's value, when set and not blank.
fn env_value(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.trim().is_empty())
}

/// Whether an `OTEL_EXPORTER_OTLP_*ENDPOINT` variable names the collector (it then wins over
/// the config file's `otlp_endpoint`).
fn env_names_endpoint() -> bool {
    env_value("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() || env_value("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
}

/// Whether the environment or `config` asks for export.
fn export_wanted(config: &TelemetryConfig) -> bool {
    if env_value("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return false;
    }
    if env_value("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none")) {
        return false;
    }
    env_names_endpoint() || config.otlp_endpoint.is_some()
}

fn tracer_provider(service: &Service<'_>, config: &TelemetryConfig) -> Option<SdkTracerProvider> {
    if !export_wanted(config) {
        return None;
    }
    let endpoint = (!env_names_endpoint())
        .then(|| config.otlp_endpoint.as_ref().map(|e| format!("{}/v1/traces", e.trim_end_matches('/'))))
        .flatten();
    let timeout = Duration::from_millis(config.export_timeout_ms);
    let make_exporter = move || {
        let mut builder = opentelemetry_otlp::SpanExporter::builder().with_http().with_timeout(timeout);
        if let Some(endpoint) = endpoint {
            builder = builder.with_endpoint(endpoint);
        }
        match builder.build() {
            Ok(exporter) => Some(exporter),
            Err(error) => {
                let error = error.to_string();
                tracing::error!(error = bounded(&error, LOG_FIELD_MAX_BYTES), "cannot export traces; spans are dropped");
                None
            }
        }
    };
    // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (read by the builder) win over these.
    let mut resource = Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() && !resource_env_sets("service.name") {
        resource = resource.with_service_name(service.name.to_string());
    }
    for (key, value) in [("service.version", service.version.to_string()), ("service.instance.id", uuid::Uuid::new_v4().to_string())] {
        if !resource_env_sets(key) {
            resource = resource.with_attribute(KeyValue::new(key, value));
        }
    }
    let resource = resource.build();
    let bounds = export::QueueBounds {
        max_queued: config.max_queued_spans,
        max_batch: config.max_export_batch,
        delay: Duration::from_millis(config.export_delay_ms),
    };
    let processor = match export::QueueProcessor::start(make_exporter, resource.clone(), bounds) {
        Ok(p) => p,
        Err(error) => {
            tracing::error!(error = %error, "cannot start the span export thread; not exporting");
            return None;
        }
    };
    let mut builder = SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource);
    if std::env::var("OTEL_TRACES_SAMPLER").is_err() {
        builder = builder.with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(config.sample_ratio))));
    }
    Some(builder.build())
}

/// Whether `OTEL_RESOURCE_ATTRIBUTES` sets `key`.
fn resource_env_sets(key: &str) -> bool {
    std::env::var("OTEL_RESOURCE_ATTRIBUTES")
        .is_ok_and(|v| v.split(',').any(|kv| kv.split_once('=').is_some_and(|(k, _)| k.trim() == key)))
}

/// One JSON object per line: time, level, target, the message and fields, the current span's
/// name and fields, and its `trace_id`/`span_id` when it has a trace.
struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        let mut time = String::new();
        Clock.format_time(&mut Writer::new(&mut time))?;
        let mut fields = serde_json::Map::new();
        event.record(&mut JsonFields(&mut fields));
        let meta = event.metadata();
        let mut line = serde_json::Map::new();
        line.insert("timestamp".into(), time.into());
        line.insert("level".into(), meta.level().as_str().into());
        line.insert("target".into(), meta.target().into());
        line.insert("fields".into(), fields.into());
        if let Some(span) = ctx.lookup_current() {
            line.insert("span".into(), span.name().into());
            if let Some(formatted) = span.extensions().get::<FormattedFields<N>>() {
                line.insert("span_fields".into(), bounded(formatted, 4 * LOG_FIELD_MAX_BYTES).into());
            }
            let dispatch = DISPATCH.get().and_then(WeakDispatch::upgrade);
            if let Some(cx) = dispatch.and_then(|d| tracing_opentelemetry::get_otel_context(&span.id(), &d)) {
                let sc = cx.span().span_context().clone();
                if sc.is_valid() {
                    line.insert("trace_id".into(), sc.trace_id().to_string().into());
                    line.insert("span_id".into(), sc.span_id().to_string().into());
                }
            }
        }
        let text = serde_json::to_string(&line).map_err(|_| std::fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// Span (and text-format event) fields as `name=value`, leaving out the `otel.*` fields, which
/// only steer the exporter (span name, kind, status) and repeat what the line says.
struct LogFields;

impl<'w> FormatFields<'w> for LogFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(&self, writer: Writer<'w>, fields: R) -> std::fmt::Result {
        let mut visitor = LogFieldVisitor { writer, first: true, result: Ok(()) };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct LogFieldVisitor<'w> {
    writer: Writer<'w>,
    first: bool,
    result: std::fmt::Result,
}

impl Visit for LogFieldVisitor<'_> {
    /// Plain text (no space, quote, backslash or control byte) is written as it is: a str's
    /// `Debug` escapes it char by char, which is most of what formatting a span costs.
    fn record_str(&mut self, field: &Field, value: &str) {
        let plain = !value.is_empty() && !value.bytes().any(|b| b <= b' ' || b == b'"' || b == b'\\' || b == 0x7f);
        if !plain || field.name() == "message" {
            return self.record_debug(field, &value);
        }
        if self.result.is_err() || field.name().starts_with("otel.") {
            return;
        }
        let separator = if std::mem::take(&mut self.first) { "" } else { " " };
        self.result = write!(self.writer, "{separator}{}={value}", field.name());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let name = field.name();
        if self.result.is_err() || name.starts_with("otel.") {
            return;
        }
        let separator = if std::mem::take(&mut self.first) { "" } else { " " };
        self.result = if name == "message" {
            write!(self.writer, "{separator}{value:?}")
        } else {
            write!(self.writer, "{separator}{name}={value:?}")
        };
    }
}

struct JsonFields<'a>(&'a mut serde_json::Map<String, serde_json::Value>);

impl Visit for JsonFields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), bounded(value, LOG_FIELD_MAX_BYTES).into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let text = format!("{value:?}");
        self.0.insert(field.name().into(), bounded(&text, 4 * LOG_FIELD_MAX_BYTES).into());
    }
}

/// At most `per_second` log lines a second from one place; the rest are counted, not written,
/// so a flood of bad input or a broker outage cannot flood the log (or slow the service down
/// writing it). Lock-free: one atomic word holds the current second and the lines let through.
#[derive(Debug)]
pub struct LogLimit {
    per_second: u32,
    /// Upper 40 bits: the second (since the epoch); lower 24: lines allowed in it.
    state: AtomicU64,
    suppressed: AtomicU64,
}

impl LogLimit {
    pub const fn new(per_second: u32) -> Self {
        LogLimit { per_second, state: AtomicU64::new(0), suppressed: AtomicU64::new(0) }
    }

    /// Whether one more line may be written now.
    pub fn allow(&self) -> bool {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.allow_at(now)
    }

    fn allow_at(&self, second: u64) -> bool {
        let mut current = self.state.load(Ordering::Relaxed);
        loop {
            let (at, count) = (current >> 24, current & 0xFF_FFFF);
            let next = if at == second & 0xFF_FFFF_FFFF {
                if count >= u64::from(self.per_second) {
                    self.suppressed.fetch_add(1, Ordering::Relaxed);
                    return false;
                }
                current + 1
            } else {
                ((second & 0xFF_FFFF_FFFF) << 24) | 1
            };
            match self.state.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(seen) => current = seen,
            }
        }
    }

    /// Lines suppressed so far.
    pub fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }
}

/// Longest string a log field carries: ids, messages and header values are cut to it.
pub const LOG_FIELD_MAX_BYTES: usize = 256;

/// `s` cut to at most `max` bytes, at a character boundary: for log fields that come from
/// outside (an event id, an error message quoting input), which must not make a log line huge.
pub fn bounded(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    &s[..cut]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_filter_bounds_the_level_so_log_records_below_it_are_never_dispatched() {
        use tracing_subscriber::layer::Filter;
        let logged = log_filter::<tracing_subscriber::Registry>(&["process"], EnvFilter::new("info"));
        assert_eq!(logged.max_level_hint(), Some(LevelFilter::INFO));
        let logged = log_filter::<tracing_subscriber::Registry>(&["process"], EnvFilter::new("warn,vramgate=debug"));
        assert_eq!(logged.max_level_hint(), Some(LevelFilter::DEBUG));
        let logs = fmt::layer().with_writer(std::io::sink).with_filter(log_filter(&["process"], EnvFilter::new("info")));
        tracing::subscriber::with_default(tracing_subscriber::registry().with(logs), || {
            assert_eq!(LevelFilter::current(), LevelFilter::INFO, "the subscriber's bound, which LogTracer copies");
        });
    }

    #[test]
    fn without_an_exporter_only_the_logged_spans_are_made() {
        let logged = log_filter(&["process"], EnvFilter::new("info"));
        let logs = fmt::layer().with_writer(std::io::sink).fmt_fields(LogFields).with_filter(logged).boxed();
        let layers: Vec<Box<dyn Layer<tracing_subscriber::Registry> + Send + Sync>> = vec![logs];
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layers), || {
            let process = tracing::info_span!("process", task = "voice");
            let _entered = process.enter();
            let send = tracing::info_span!("send", topic = "t");
            assert!(!process.is_disabled(), "the logged span is made");
            assert!(send.is_disabled(), "a nested span nothing wants is not made");
            assert_eq!(tracing::Span::current().id(), process.id(), "inside it, the current span is the logged one");
        });
    }

    #[test]
    fn log_fields_leave_out_otel_fields_and_quote_only_what_needs_it() {
        use tracing_subscriber::layer::SubscriberExt as _;
        let written = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let sink = written.clone();
        let make = move || Sink(sink.clone());
        let layer = fmt::layer().with_writer(make).with_ansi(false).without_time().fmt_fields(LogFields);
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("process", otel.name = "process t", task = "voice", offset = 42_i64, note = "two words");
            let _entered = span.enter();
            tracing::info!(kind = "x\"y", "dead-lettering record");
        });
        let text = String::from_utf8(written.lock().expect("lock").clone()).expect("utf-8");
        assert!(text.contains("process{task=voice offset=42 note=\"two words\"}"), "{text}");
        assert!(!text.contains("otel.name"), "{text}");
        assert!(text.contains("dead-lettering record kind=\"x\\\"y\""), "{text}");
    }

    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The only test in this crate that touches the `OTEL_*` variables (they are process-wide).
    #[test]
    fn export_follows_the_standard_variables_then_the_config() {
        let vars = ["OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"];
        for v in vars {
            std::env::remove_var(v);
        }
        let mut config = TelemetryConfig::default();
        assert!(!export_wanted(&config), "off without an endpoint");
        config.otlp_endpoint = Some("http://127.0.0.1:4318".into());
        assert!(export_wanted(&config) && !env_names_endpoint(), "the config file's endpoint");
        std::env::set_var("OTEL_SDK_DISABLED", "true");
        assert!(!export_wanted(&config), "OTEL_SDK_DISABLED wins");
        std::env::remove_var("OTEL_SDK_DISABLED");
        std::env::set_var("OTEL_TRACES_EXPORTER", "none");
        assert!(!export_wanted(&config), "OTEL_TRACES_EXPORTER=none wins");
        std::env::remove_var("OTEL_TRACES_EXPORTER");
        config.otlp_endpoint = None;
        std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", "  ");
        assert!(!export_wanted(&config), "a blank variable is unset");
        std::env::set_var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces");
        assert!(export_wanted(&config) && env_names_endpoint(), "a variable's endpoint, over the file's");
        for v in vars {
            std::env::remove_var(v);
        }
    }

    #[test]
    fn lets_through_the_rate_then_counts_the_rest() {
        let limit = LogLimit::new(3);
        let allowed = (0..10).filter(|_| limit.allow_at(100)).count();
        assert_eq!(allowed, 3);
        assert_eq!(limit.suppressed(), 7);
        assert!(limit.allow_at(101), "a new second starts afresh");
        let shared = std::sync::Arc::new(LogLimit::new(50));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let limit = shared.clone();
                std::thread::spawn(move || (0..1000).filter(|_| limit.allow_at(7)).count())
            })
            .collect();
        let allowed: usize = threads.into_iter().map(|t| t.join().expect("thread")).sum();
        assert_eq!(allowed, 50, "the rate holds across threads");
    }

    #[test]
    fn bounded_cuts_at_a_character_boundary() {
        assert_eq!(bounded("hello", 10), "hello");
        assert_eq!(bounded("hello", 3), "hel");
        assert_eq!(bounded("héllo", 2), "h", "never inside a character");
        assert_eq!(bounded("", 0), "");
    }
}
