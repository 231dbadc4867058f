//! Writing a record's one output, a result or a dead letter, until the broker acknowledges it.
//!
//! Transient produce errors (a broker away, a leader moving, a full queue) are retried with
//! backoff for as long as it takes: giving up would mean losing the record or committing past
//! it. Permanent ones (the record is larger than the broker takes, the topic is not there or
//! not ours to write) cannot succeed by retrying, and retrying them would wedge the partition
//! behind the record. [`deliver`] returns those, and the caller writes a trimmed dead letter
//! instead ([`trimmed_dead_letter`]: the id cut short, the value left out, the sizes in
//! headers); if even that is refused, the record is logged, counted and committed past.
//!
//! An output's acknowledgement reaches what waits for it in one of two ways ([`Delivery`]): an
//! awaiting task is woken ([`deliver`]), or a function runs on the producer's polling thread
//! ([`send_then`]). The second is how a record refused before any worker call finishes: its
//! dead letter's acknowledgement finishes it there, with no task, future or wake-up of its own
//! (`docs/performance-notes.md`, gateway cause 11). Whatever goes wrong on that first attempt goes
//! back to [`deliver`]'s retries on the runtime.
//!
//! Each output carries the W3C trace context of its `send` span, so a downstream consumer
//! continues the event's trace. With tracing off, the request's own context is copied when it
//! is valid (`vramgate_shared::telemetry::context`): a `traceparent` that is malformed, longer
//! than 512 bytes or repeated is dropped, and its `tracestate` with it.

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{BaseRecord, DeliveryResult, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;
use tokio::sync::oneshot;
use tracing::Instrument;
use vramgate_shared::events::{DeadLetterEvent, ErrorInfo, ErrorKind, SourceRecord, Stage, SCHEMA_VERSION};
use vramgate_shared::telemetry::context::{self, Carried};
use vramgate_shared::telemetry::{bounded, LogLimit};

use crate::consume::client::KafkaEvents;
use crate::metrics::Metrics;

/// The gateway's producer of results and dead letters.
pub type Producer = ThreadedProducer<Outputs>;

/// How long an output waits for room in librdkafka's queue before that counts as a failed
/// attempt (and is retried with backoff).
const QUEUE_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest event id a trimmed dead letter carries.
pub const TRIMMED_ID_BYTES: usize = 256;
/// Longest message a trimmed dead letter carries.
const TRIMMED_MESSAGE_BYTES: usize = 1024;

static RETRY_LOG: LogLimit = LogLimit::new(5);

/// An output ready to produce.
pub struct Outgoing<'a> {
    pub topic: &'a str,
    /// Its PRODUCER span's name, `send <topic>` (made once per task, not per record).
    pub span_name: &'a str,
    pub payload: Vec<u8>,
    /// Built once, in librdkafka's own form: the first attempt hands them over as they are,
    /// and only a retry copies them back out of the refused message.
    pub headers: OwnedHeaders,
}

/// Whether retrying cannot help: the record or the topic is wrong, not the moment.
pub fn is_permanent(error: &KafkaError) -> bool {
    let code = match error {
        KafkaError::MessageProduction(code) => *code,
        _ => return false,
    };
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::MessageBatchTooLarge
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::InvalidTopic
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            // Local: the broker's metadata says the topic does not exist (not a topic still
            // being created, which the broker reports as UnknownTopicOrPartition and retries).
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidArgument
    )
}

/// The producer's context: librdkafka's logs and errors as [`KafkaEvents`] tells them, and each
/// output's acknowledgement handed to what waits for it.
pub struct Outputs(pub KafkaEvents);

impl ClientContext for Outputs {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, facility: &str, message: &str) {
        self.0.log(level, facility, message)
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.0.error(error, reason)
    }
}

/// An output's outcome: acknowledged, or refused with why (and its headers, for the next
/// attempt).
pub type Acked = Result<Written, Refusal>;

/// Where the broker wrote an acknowledged output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    pub partition: i32,
    pub offset: i64,
}

/// A refused output.
pub struct Refusal {
    pub error: KafkaError,
    pub headers: Option<OwnedHeaders>,
}

/// What an output's acknowledgement goes to.
pub enum Delivery {
    /// A task awaiting it ([`deliver`]).
    Wake(oneshot::Sender<Acked>),
    /// A function, run on the producer's polling thread ([`send_then`]).
    Then(Box<dyn FnOnce(Acked) + Send + Sync>),
}

impl ProducerContext for Outputs {
    type DeliveryOpaque = Box<Delivery>;

    fn delivery(&self, result: &DeliveryResult<'_>, delivery: Box<Delivery>) {
        let acked = match result {
            Ok(m) => Ok(Written { partition: m.partition(), offset: m.offset() }),
            Err((error, message)) => Err(refusal(error.clone(), message)),
        };
        match *delivery {
            Delivery::Wake(tx) => {
                let _ = tx.send(acked);
            }
            // A panic must not unwind into librdkafka; the record's guards still run as the
            // closure unwinds, and the log says which.
            Delivery::Then(then) => {
                if std::panic::catch_unwind(AssertUnwindSafe(|| then(acked))).is_err() {
                    tracing::error!("a record's acknowledgement handler panicked; see the log above");
                }
            }
        }
    }
}

fn refusal(error: KafkaError, message: &BorrowedMessage<'_>) -> Refusal {
    Refusal { error, headers: message.headers().map(|h| h.detach()) }
}

/// The PRODUCER span `send <topic>` of an output (a child of the current span), and its
/// headers with the trace context added: the span's, or with tracing off the context `carried`
/// brought in, when it was valid.
pub fn sending(span_name: &str, topic: &str, body_len: usize, headers: OwnedHeaders, carried: &Carried) -> (tracing::Span, OwnedHeaders) {
    let span = tracing::info_span!(
        "send",
        otel.name = span_name,
        otel.kind = "producer",
        messaging.system = "kafka",
        messaging.operation.type = "send",
        messaging.destination.name = topic,
        messaging.message.body.size = body_len,
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    let headers = with_trace_context(headers, &span, carried);
    (span, headers)
}

/// `headers` with the trace context added: `span`'s, or with tracing off the context `carried`
/// brought in, when it was valid. For a first attempt made without a `send` span (nothing
/// exports), `span` is the record's, perhaps none.
pub fn with_trace_context(mut headers: OwnedHeaders, span: &tracing::Span, carried: &Carried) -> OwnedHeaders {
    let trace = context::headers_of(span).or_else(|| match carried {
        Carried::Parent(parent) => Some(context::to_headers(parent)),
        _ => None,
    });
    if let Some((parent, state)) = &trace {
        headers = headers.insert(Header { key: "traceparent", value: Some(parent.as_bytes()) });
        if let Some(state) = state {
            headers = headers.insert(Header { key: "tracestate", value: Some(state.as_bytes()) });
        }
    }
    headers
}

/// Produces an output once, without waiting: `then` runs with its outcome on the producer's
/// polling thread when the broker answers, or at once, on this thread, when librdkafka refuses
/// it (a full queue included). `send` (from [`sending`]) ends when `then` runs.
pub fn send_then(
    producer: &Producer,
    topic: &str,
    key: Option<&[u8]>,
    payload: &[u8],
    headers: OwnedHeaders,
    send: tracing::Span,
    then: impl FnOnce(Acked) + Send + Sync + 'static,
) {
    let then = move |acked: Acked| {
        if let Err(refused) = &acked {
            mark_refused(&send, &refused.error);
        }
        drop(send);
        then(acked)
    };
    let mut record = BaseRecord::with_opaque_to(topic, Box::new(Delivery::Then(Box::new(then)))).payload(payload).headers(headers);
    if let Some(key) = key {
        record = record.key(key);
    }
    if let Err((error, record)) = producer.send(record) {
        if let Delivery::Then(then) = *record.delivery_opaque {
            then(Err(Refusal { error, headers: record.headers }));
        }
    }
}

fn mark_refused(span: &tracing::Span, error: &KafkaError) {
    span.record("otel.status_code", "ERROR");
    span.record("error.type", "output_rejected");
    span.record("otel.status_description", bounded(&error.to_string(), 256));
}

/// Produces `out` keyed like `source`, under a PRODUCER span `send <topic>` whose trace
/// context it carries (with tracing off: the context `source` carried, when it was valid),
/// retrying transient errors with backoff until the broker acknowledges. Returns a permanent
/// error. `refused`: a first attempt already made and refused ([`send_then`]); the backoff
/// goes on from it rather than starting over.
pub async fn deliver(
    producer: &Producer,
    metrics: &Metrics,
    source: &OwnedMessage,
    carried: &Carried,
    out: Outgoing<'_>,
    refused: Option<KafkaError>,
) -> Result<(), KafkaError> {
    let Outgoing { topic, span_name, payload, headers } = out;
    let (span, headers) = sending(span_name, topic, payload.len(), headers, carried);
    let result = send_until_acknowledged(producer, metrics, source, topic, &payload, headers, refused)
        .instrument(span.clone())
        .await;
    if let Err(error) = &result {
        mark_refused(&span, error);
    }
    result
}

/// A record's headers as (name, value) pairs; a header without a value reads as empty.
pub fn kafka_headers(message: &OwnedMessage) -> impl Iterator<Item = (&str, &[u8])> {
    message.headers().into_iter().flat_map(|h| h.iter()).map(|h| (h.key, h.value.unwrap_or_default()))
}

/// One attempt: waits (up to [`QUEUE_TIMEOUT`]) for room in librdkafka's queue, then for the
/// broker's answer.
async fn send_once(producer: &Producer, topic: &str, key: Option<&[u8]>, payload: &[u8], headers: OwnedHeaders) -> Acked {
    let (tx, rx) = oneshot::channel();
    let mut record = BaseRecord::with_opaque_to(topic, Box::new(Delivery::Wake(tx))).payload(payload).headers(headers);
    if let Some(key) = key {
        record = record.key(key);
    }
    let deadline = Instant::now() + QUEUE_TIMEOUT;
    loop {
        match producer.send(record) {
            Ok(()) => break,
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) if Instant::now() < deadline => {
                record = back;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err((error, back)) => return Err(Refusal { error, headers: back.headers }),
        }
    }
    rx.await.unwrap_or(Err(Refusal { error: KafkaError::Canceled, headers: None }))
}

/// Whether a failed attempt is worth another; counts and logs the retry.
fn retrying(metrics: &Metrics, error: &KafkaError, topic: &str, delay: Duration) -> bool {
    if is_permanent(error) {
        return false;
    }
    metrics.produce_retries.inc();
    metrics.produce_retry_seconds.inc_by(delay.as_secs_f64());
    if RETRY_LOG.allow() {
        tracing::warn!(error = %error, topic, retry_in_ms = delay.as_millis() as u64, "produce failed; retrying");
    }
    true
}

async fn send_until_acknowledged(
    producer: &Producer,
    metrics: &Metrics,
    source: &OwnedMessage,
    topic: &str,
    payload: &[u8],
    headers: OwnedHeaders,
    refused: Option<KafkaError>,
) -> Result<(), KafkaError> {
    let mut delay = Duration::from_millis(200);
    let mut headers = headers;
    if let Some(error) = refused {
        if !retrying(metrics, &error, topic, delay) {
            return Err(error);
        }
        tokio::time::sleep(delay).await;
        delay *= 2;
    }
    loop {
        let refused = match send_once(producer, topic, source.key(), payload, headers).await {
            Ok(_) => return Ok(()),
            Err(refused) => refused,
        };
        if !retrying(metrics, &refused.error, topic, delay) {
            return Err(refused.error);
        }
        // The refused message carries the headers back: the next attempt takes them.
        headers = refused.headers.unwrap_or_else(|| OwnedHeaders::new_with_capacity(0));
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(10));
    }
}

/// The first headers of every dead letter, as Spring Kafka's dead-letter publisher writes them
/// (so existing tooling reads ours): the source record's topic, partition and offset, and the
/// failure's kind as the exception class. `capacity` leaves room for the caller's own and the
/// trace context [`deliver`] adds.
pub fn dead_letter_origin(source: &impl Message, kind: ErrorKind, capacity: usize) -> OwnedHeaders {
    origin_headers(source.topic(), source.partition(), source.offset(), kind, capacity)
}

fn origin_headers(topic: &str, partition: i32, offset: i64, kind: ErrorKind, capacity: usize) -> OwnedHeaders {
    OwnedHeaders::new_with_capacity(capacity)
        .insert(Header { key: "kafka_dlt-original-topic", value: Some(topic) })
        .insert(Header { key: "kafka_dlt-original-partition", value: Some(&partition.to_be_bytes()) })
        .insert(Header { key: "kafka_dlt-original-offset", value: Some(&offset.to_be_bytes()) })
        .insert(Header { key: "kafka_dlt-exception-fqcn", value: Some(kind.as_str()) })
}

/// A dead letter's headers: [`dead_letter_origin`], then the error's message and stage and
/// vramgate's own kind header (room left for the trace context [`sending`] adds).
pub fn dead_letter_headers(source: &impl Message, error: &ErrorInfo) -> OwnedHeaders {
    dead_letter_origin(source, error.kind, 9)
        .insert(Header { key: "kafka_dlt-exception-message", value: Some(error.message.as_str()) })
        .insert(Header { key: "kafka_dlt-exception-stage", value: Some(error.stage.as_str()) })
        .insert(Header { key: "vramgate-error-kind", value: Some(error.kind.as_str()) })
}

/// Where a dead letter's record came from, with its key and value in base64: everything
/// needed to replay it.
pub fn source_record(message: &impl Message) -> SourceRecord {
    use base64::Engine;
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    SourceRecord {
        topic: message.topic().to_string(),
        partition: message.partition(),
        offset: message.offset(),
        key_b64: message.key().map(b64),
        value_b64: message.payload().map(b64),
    }
}

/// What the refused output was: a result, or a dead letter with its own reason (which the
/// trimmed one keeps).
pub enum Refused {
    Result,
    DeadLetter { kind: ErrorKind, stage: Stage, message: String },
}

/// What a trimmed dead letter says of the output it stands in for: where the record came
/// from, its id and task, and what the refused output was. Small whatever the record (ids and
/// messages cut short, never the value), so an output waiting for its transaction carries one.
pub struct Standin {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// Bytes of the record's value, which the trimmed dead letter leaves out.
    pub value_bytes: usize,
    pub id: Option<String>,
    pub task: Option<String>,
    pub refused: Refused,
}

impl Standin {
    pub fn new(source: &impl Message, id: Option<&str>, task: Option<&str>, refused: Refused) -> Self {
        let refused = match refused {
            Refused::DeadLetter { kind, stage, message } => {
                Refused::DeadLetter { kind, stage, message: bounded(&message, TRIMMED_MESSAGE_BYTES / 2).to_string() }
            }
            r => r,
        };
        Standin {
            topic: source.topic().to_string(),
            partition: source.partition(),
            offset: source.offset(),
            value_bytes: source.payload().map_or(0, <[u8]>::len),
            id: id.map(|id| bounded(id, TRIMMED_ID_BYTES).to_string()),
            task: task.map(|t| bounded(t, TRIMMED_ID_BYTES).to_string()),
            refused,
        }
    }
}

/// The dead letter written when a record's output was refused for good: enough to find the
/// record again (topic, partition, offset, a trimmed id) and why it failed, never its value.
/// A refused dead letter keeps its kind and message; a refused result becomes
/// `output_rejected`.
pub fn trimmed_dead_letter<'a>(
    dlq_topic: &'a str,
    dlq_span: &'a str,
    standin: &Standin,
    refused_topic: &str,
    refused_bytes: usize,
    error: &KafkaError,
) -> Outgoing<'a> {
    let trimmed = format!(
        "its {refused_bytes}-byte output could not be written to {refused_topic} ({error}), so this dead letter \
         leaves the record's value out (read it at the source offset)"
    );
    let (kind, stage, message) = match &standin.refused {
        Refused::Result => (ErrorKind::OutputRejected, Stage::Produce, format!("the result is ready but {trimmed}")),
        Refused::DeadLetter { kind, stage, message } => (*kind, *stage, format!("{message}; {trimmed}")),
    };
    let letter = DeadLetterEvent {
        version: SCHEMA_VERSION,
        id: standin.id.clone(),
        task: standin.task.clone(),
        error: ErrorInfo { kind, message: bounded(&message, TRIMMED_MESSAGE_BYTES).to_string(), stage },
        attempts: 0,
        source: SourceRecord {
            topic: standin.topic.clone(),
            partition: standin.partition,
            offset: standin.offset,
            key_b64: None,
            value_b64: None,
        },
    };
    let headers = origin_headers(&standin.topic, standin.partition, standin.offset, kind, 10)
        .insert(Header { key: "vramgate-error-kind", value: Some(kind.as_str()) })
        .insert(Header { key: "vramgate-output-trimmed", value: Some("true") })
        .insert(Header { key: "vramgate-original-value-bytes", value: Some(&standin.value_bytes.to_string()) })
        .insert(Header { key: "vramgate-refused-output-bytes", value: Some(&refused_bytes.to_string()) });
    Outgoing {
        topic: dlq_topic,
        span_name: dlq_span,
        payload: serde_json::to_vec(&letter).expect("dead letters always serialise"),
        headers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permanent_errors_are_told_from_transient_ones() {
        let produce = |code| KafkaError::MessageProduction(code);
        assert!(is_permanent(&produce(RDKafkaErrorCode::MessageSizeTooLarge)));
        assert!(is_permanent(&produce(RDKafkaErrorCode::TopicAuthorizationFailed)));
        assert!(is_permanent(&produce(RDKafkaErrorCode::UnknownTopic)));
        assert!(!is_permanent(&produce(RDKafkaErrorCode::UnknownTopicOrPartition)), "may be a topic being created");
        assert!(!is_permanent(&produce(RDKafkaErrorCode::NotLeaderForPartition)));
        assert!(!is_permanent(&produce(RDKafkaErrorCode::QueueFull)));
        assert!(!is_permanent(&produce(RDKafkaErrorCode::MessageTimedOut)));
    }

    #[test]
    fn a_trimmed_dead_letter_is_small_whatever_the_record() {
        let value = vec![b'x'; 2_000_000];
        let id = "i".repeat(1_000_000);
        let source = OwnedMessage::new(
            Some(value),
            Some(vec![b'k'; 100_000]),
            "t.requests".into(),
            rdkafka::Timestamp::NotAvailable,
            3,
            42,
            None,
        );
        let error = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        let standin = Standin::new(&source, Some(&id), Some("voice"), Refused::Result);
        let out = trimmed_dead_letter("t.dlq", "send t.dlq", &standin, "t.dlq", 2_700_000, &error);
        assert!(out.payload.len() < 4096, "{} bytes", out.payload.len());
        let letter: DeadLetterEvent = serde_json::from_slice(&out.payload).expect("json");
        assert_eq!(letter.error.kind, ErrorKind::OutputRejected);
        assert_eq!(letter.id.as_deref().map(str::len), Some(TRIMMED_ID_BYTES));
        assert_eq!((letter.source.partition, letter.source.offset), (3, 42));
        assert!(letter.source.value_b64.is_none());
        let header = |k: &str| out.headers.iter().find(|h| h.key == k).and_then(|h| h.value.map(<[u8]>::to_vec));
        assert_eq!(header("vramgate-original-value-bytes"), Some(b"2000000".to_vec()));
        let reason = "x".repeat(100_000);
        let refused = Refused::DeadLetter { kind: ErrorKind::InvalidRequest, stage: Stage::Parse, message: reason };
        let standin = Standin::new(&source, None, None, refused);
        let out = trimmed_dead_letter("t.dlq", "send t.dlq", &standin, "t.dlq", 2_700_000, &error);
        let letter: DeadLetterEvent = serde_json::from_slice(&out.payload).expect("json");
        assert_eq!((letter.error.kind, letter.error.stage), (ErrorKind::InvalidRequest, Stage::Parse), "keeps its reason");
        assert!(out.payload.len() < 4096, "{} bytes", out.payload.len());
    }
}
