//! W3C Trace Context across process boundaries: reading a `traceparent`/`tracestate` pair from
//! Kafka record headers or HTTP headers (strictly: anything malformed, oversized or repeated
//! is refused, with the reason), and writing the current span's context back out.
//!
//! Refusing is never an error for the event: it gets a new root span that records why
//! (`vramgate.trace.parent_refused`), and is processed as usual.

use std::str::FromStr;
use std::time::SystemTime;

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
};
use opentelemetry::{Context, KeyValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Longest `traceparent` or `tracestate` read or copied, in bytes.
pub const MAX_TRACE_HEADER_BYTES: usize = 512;
/// Most `tracestate` list members kept (the W3C limit).
pub const MAX_TRACESTATE_MEMBERS: usize = 32;

/// Why a carried trace context was not continued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// More than one `traceparent`.
    Repeated,
    /// Longer than [`MAX_TRACE_HEADER_BYTES`].
    Oversized,
    /// Not a valid W3C `traceparent`.
    Malformed,
}

impl Refused {
    pub fn as_str(self) -> &'static str {
        match self {
            Refused::Repeated => "repeated",
            Refused::Oversized => "oversized",
            Refused::Malformed => "malformed",
        }
    }
}

/// What the headers of one message carried.
#[derive(Debug, Clone, PartialEq)]
pub enum Carried {
    /// No `traceparent` at all: a new trace starts, nothing to note.
    Nothing,
    /// A valid remote parent.
    Parent(SpanContext),
    /// A `traceparent` that was refused: a new trace starts, and says why.
    Refused(Refused),
}

impl Carried {
    /// Reads the trace context among `headers` (name, value) pairs; names compare
    /// case-insensitively, as HTTP's do (Kafka's are lower-case by convention).
    pub fn from_headers<'a>(headers: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Carried {
        let mut parent: Option<&[u8]> = None;
        let mut parents = 0;
        let mut state: Option<&[u8]> = None;
        let mut states = 0;
        for (name, value) in headers {
            if name.eq_ignore_ascii_case("traceparent") {
                parents += 1;
                parent = Some(value);
            } else if name.eq_ignore_ascii_case("tracestate") {
                states += 1;
                state = Some(value);
            }
        }
        let Some(parent) = parent else { return Carried::Nothing };
        if parents > 1 {
            return Carried::Refused(Refused::Repeated);
        }
        match parse_traceparent(parent) {
            Ok((trace_id, span_id, flags)) => {
                // A bad or repeated tracestate is dropped on its own; the parent still holds.
                let state = (states == 1)
                    .then_some(state)
                    .flatten()
                    .filter(|s| valid_tracestate(s))
                    .and_then(|s| std::str::from_utf8(s).ok())
                    .and_then(|s| TraceState::from_str(s).ok())
                    .unwrap_or_default();
                Carried::Parent(SpanContext::new(trace_id, span_id, flags, true, state))
            }
            Err(refused) => Carried::Refused(refused),
        }
    }

    /// Makes `span` continue this context (or start a new trace that notes a refusal).
    /// Call before the span is first entered.
    pub fn adopt(&self, span: &tracing::Span) {
        match self {
            Carried::Nothing => {}
            Carried::Parent(parent) => {
                let _ = span.set_parent(Context::new().with_remote_span_context(parent.clone()));
            }
            Carried::Refused(why) => span.set_attribute("vramgate.trace.parent_refused", why.as_str()),
        }
    }
}

/// Parses a W3C Trace Context `traceparent`: `vv-<32 hex>-<16 hex>-ff`, lower-case hex, ids
/// not all zero, version not `ff`; a later version may append `-…` fields.
pub fn parse_traceparent(value: &[u8]) -> Result<(TraceId, SpanId, TraceFlags), Refused> {
    if value.len() > MAX_TRACE_HEADER_BYTES {
        return Err(Refused::Oversized);
    }
    if value.len() < 55 {
        return Err(Refused::Malformed);
    }
    let hex = |s: &[u8]| s.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
    let (version, trace_id, parent_id, flags) = (&value[0..2], &value[3..35], &value[36..52], &value[53..55]);
    let dashes = value[2] == b'-' && value[35] == b'-' && value[52] == b'-';
    let shape = dashes && hex(version) && hex(trace_id) && hex(parent_id) && hex(flags);
    let tail_ok = if version == b"00" { value.len() == 55 } else { value.len() == 55 || value[55] == b'-' };
    if !shape || version == b"ff" || !tail_ok {
        return Err(Refused::Malformed);
    }
    // Lower-case hex checked above, so these are ASCII and parse.
    fn text(s: &[u8]) -> Result<&str, Refused> {
        std::str::from_utf8(s).map_err(|_| Refused::Malformed)
    }
    let trace_id = TraceId::from_hex(text(trace_id)?).map_err(|_| Refused::Malformed)?;
    let span_id = SpanId::from_hex(text(parent_id)?).map_err(|_| Refused::Malformed)?;
    let flags = u8::from_str_radix(text(flags)?, 16).map_err(|_| Refused::Malformed)?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return Err(Refused::Malformed);
    }
    Ok((trace_id, span_id, TraceFlags::new(flags & TraceFlags::SAMPLED.to_u8())))
}

/// A `tracestate` short enough, of printable ASCII, with at most 32 list members.
pub fn valid_tracestate(value: &[u8]) -> bool {
    value.len() <= MAX_TRACE_HEADER_BYTES
        && value.iter().all(|b| (0x20..0x7f).contains(b))
        && value.split(|b| *b == b',').count() <= MAX_TRACESTATE_MEMBERS
}

/// The `traceparent` and (when not empty) `tracestate` that carry `span` onward; `None` when
/// the span has no valid context (tracing is off).
pub fn headers_of(span: &tracing::Span) -> Option<(String, Option<String>)> {
    let cx = span.context();
    let span_ref = cx.span();
    let sc = span_ref.span_context();
    sc.is_valid().then(|| to_headers(sc))
}

/// `sc` as a `traceparent` and (when not empty) `tracestate`.
pub fn to_headers(sc: &SpanContext) -> (String, Option<String>) {
    let parent = format!("00-{}-{}-{:02x}", sc.trace_id(), sc.span_id(), sc.trace_flags().to_u8());
    let state = sc.trace_state().header();
    (parent, (!state.is_empty()).then_some(state))
}

/// The trace id of `span` as 32 hex digits, when it has one.
pub fn trace_id_of(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let span_ref = cx.span();
    let sc = span_ref.span_context();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// The OpenTelemetry context of `span`, to hand to a thread that records spans later (the
/// worker's batch thread, the gateway's commit thread). `None` when it is not sampled, so
/// nothing is kept for spans that would not be exported.
pub fn sampled_context(span: &tracing::Span) -> Option<Context> {
    // Nothing can be sampled while nothing exports; asking the span would look it up for every
    // record or request.
    if !super::exports_spans() {
        return None;
    }
    let cx = span.context();
    cx.span().span_context().is_sampled().then_some(cx)
}

/// A span measured after the fact (a batch that ran for many requests, a commit that
/// covered many records), recorded as a child of `parent` with its real start and end.
pub struct PastSpan<'a> {
    pub name: &'static str,
    pub kind: SpanKind,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<KeyValue>,
    /// Events at their times: name and attributes.
    pub events: Vec<(&'a str, SystemTime, Vec<KeyValue>)>,
    /// `Some(kind)` marks the span as failed, with that error kind.
    pub error: Option<String>,
}

impl PastSpan<'_> {
    pub fn new(name: &'static str, start: SystemTime, end: SystemTime) -> Self {
        PastSpan { name, kind: SpanKind::Internal, start, end, attributes: Vec::new(), events: Vec::new(), error: None }
    }

    /// Records it under `parent` with the global tracer (a no-op when tracing is off).
    pub fn record(self, parent: &Context) {
        use opentelemetry::trace::Span as _;
        let tracer = opentelemetry::global::tracer("vramgate");
        let mut attributes = self.attributes;
        if let Some(kind) = &self.error {
            attributes.push(KeyValue::new("error.type", kind.clone()));
        }
        let mut span = tracer
            .span_builder(self.name)
            .with_kind(self.kind)
            .with_start_time(self.start)
            .with_attributes(attributes)
            .start_with_context(&tracer, parent);
        for (name, at, attributes) in self.events {
            span.add_event_with_timestamp(name.to_string(), at, attributes);
        }
        if let Some(kind) = self.error {
            span.set_status(Status::error(kind));
        }
        span.end_with_timestamp(self.end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn traceparent_validation() {
        let (trace, span, flags) = parse_traceparent(GOOD).expect("valid");
        assert_eq!(trace.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(span.to_string(), "00f067aa0ba902b7");
        assert!(flags.is_sampled());
        let malformed = |v: &[u8]| assert_eq!(parse_traceparent(v), Err(Refused::Malformed), "{}", String::from_utf8_lossy(v));
        malformed(b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01");
        malformed(b"00-00000000000000000000000000000000-00f067aa0ba902b7-01");
        malformed(b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01");
        malformed(b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        malformed(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra");
        malformed(b"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        malformed(b"garbage");
        malformed(b"");
        assert!(parse_traceparent(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later").is_ok());
        assert_eq!(parse_traceparent(&[b'0'; 10_000]), Err(Refused::Oversized));
    }

    #[test]
    fn headers_are_read_strictly() {
        let one = Carried::from_headers([("traceparent", GOOD), ("tracestate", &b"a=1,b=2"[..])]);
        let Carried::Parent(sc) = one else { panic!("expected a parent, got {one:?}") };
        assert!(sc.is_remote());
        assert_eq!(sc.trace_state().header(), "a=1,b=2");
        assert_eq!(Carried::from_headers([("TraceParent", GOOD), ("traceparent", GOOD)]), Carried::Refused(Refused::Repeated));
        assert_eq!(Carried::from_headers([("other", GOOD)]), Carried::Nothing);
        let big = vec![b'a'; 10 * 1024];
        assert_eq!(Carried::from_headers([("traceparent", &big[..])]), Carried::Refused(Refused::Oversized));
        // A bad tracestate is dropped; the parent still holds.
        let Carried::Parent(sc) = Carried::from_headers([("traceparent", GOOD), ("tracestate", &big[..])]) else {
            panic!("the parent holds")
        };
        assert_eq!(sc.trace_state().header(), "");
    }
}
