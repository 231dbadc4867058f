//! One record's life, from fetched to finished: parse, read the input, convert it on the
//! task's CPU pool, call the worker under the task's GPU permits (retrying what is worth it),
//! and write exactly one result or dead letter. Only then is the record finished, so only then
//! can its offset be committed.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use rdkafka::message::{Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::FutureProducer;
use tracing::Instrument;
use vramgate_shared::telemetry::context::{self, Carried};
use vramgate_shared::events::{
    DeadLetterEvent, ErrorInfo, ErrorKind, RequestEvent, ResultEvent, Stage, TimingsMs,
    SCHEMA_VERSION,
};
use vramgate_shared::telemetry::{self, bounded, LogLimit, LOG_FIELD_MAX_BYTES};

use crate::budget::{ByteBudget, Held};
use crate::failure::Failure;
use crate::input::InputSource;
use crate::metrics::Metrics;
use crate::consume::offsets::{SharedOffsets, Ticket};
use crate::consume::client::KafkaEvents;
use crate::produce::{self, Outgoing};
use crate::task::Task;
use crate::tasks::Converted;
use crate::call::{self, client::InferCall};

/// Log lines a second, per kind of line; the rest are counted in `log_lines_suppressed_total`.
static RESULT_LOG: LogLimit = LogLimit::new(20);
static DEAD_LETTER_LOG: LogLimit = LogLimit::new(20);

/// Charged per record on top of its key and value: the message struct, its task and tracking.
pub const RECORD_OVERHEAD_BYTES: u64 = 2048;

/// What every record task shares.
pub struct Shared {
    pub producer: FutureProducer<KafkaEvents>,
    pub offsets: Arc<SharedOffsets>,
    pub input: InputSource,
    pub budget: Arc<ByteBudget>,
    pub metrics: Arc<Metrics>,
    /// Records fetched and not yet finished (or dropped as stale), all tasks.
    pub in_flight: AtomicUsize,
    /// The consumer group, for the spans.
    pub group_id: String,
}

/// Counts a record in flight until it is dropped, whatever path the record takes.
struct InFlight<'a> {
    shared: &'a Shared,
    task: &'a Task,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.task.hot.in_flight.dec();
    }
}

/// Called by the fetch loop for each record, before it spawns [`handle`]: counts and charges it.
pub fn admit(shared: &Shared, task: &Task, message: &OwnedMessage) -> (Ticket, Held) {
    task.hot.consumed.inc();
    task.hot.in_flight.inc();
    shared.in_flight.fetch_add(1, Ordering::SeqCst);
    let raw = message.payload().map_or(0, <[u8]>::len) + message.key().map_or(0, <[u8]>::len);
    let held = shared.budget.hold(raw as u64 + RECORD_OVERHEAD_BYTES);
    let ticket = shared.offsets.lock().begin((message.topic().to_string(), message.partition()), message.offset());
    (ticket, held)
}

/// Processes one record to its end: a produced result or dead letter, then finishes its ticket.
/// All of it runs in a CONSUMER span `process <topic>`, which continues the trace the record's
/// headers carry (or starts one, noting a refused `traceparent`). While nothing exports, the
/// span carries only what its log lines show (task, topic, partition, offset, event id): its
/// other fields would be visited for every record and never read.
pub async fn handle(shared: Arc<Shared>, task: Arc<Task>, message: OwnedMessage, ticket: Ticket, held: Held) {
    let span = if telemetry::exports_spans() {
        tracing::info_span!(
            "process",
            otel.name = task.hot.process_span.as_str(),
            otel.kind = "consumer",
            messaging.system = "kafka",
            messaging.operation.type = "process",
            messaging.destination.name = message.topic(),
            messaging.destination.partition.id = message.partition(),
            messaging.kafka.offset = message.offset(),
            messaging.consumer.group.name = shared.group_id.as_str(),
            messaging.message.id = tracing::field::Empty,
            task = %task.name,
            event_id = tracing::field::Empty,
            vramgate.outcome = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
            error.type = tracing::field::Empty,
        )
    } else {
        tracing::info_span!(
            "process",
            messaging.destination.name = message.topic(),
            messaging.destination.partition.id = message.partition(),
            messaging.kafka.offset = message.offset(),
            task = %task.name,
            event_id = tracing::field::Empty,
        )
    };
    // Read once: the span continues it, and with tracing off the outputs carry it.
    let carried = Carried::from_headers(produce::kafka_headers(&message));
    carried.adopt(&span);
    handle_in_span(shared, task, message, carried, ticket, held).instrument(span).await
}

async fn handle_in_span(
    shared: Arc<Shared>,
    task: Arc<Task>,
    message: OwnedMessage,
    carried: Carried,
    ticket: Ticket,
    mut held: Held,
) {
    let _in_flight = InFlight { shared: &shared, task: &task };
    if !shared.offsets.is_current(&ticket) {
        // Revoked before it started: the partition's new owner reads it from the last commit.
        shared.metrics.stale.inc();
        return;
    }
    let started = Instant::now();
    let outcome = AssertUnwindSafe(process(&shared, &task, &message, &mut held, started))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| {
            Err(Rejection::anonymous(Failure::new(
                ErrorKind::Internal,
                Stage::Postprocess,
                "the gateway panicked while processing this record; see its log",
            )))
        });
    if !shared.offsets.is_current(&ticket) {
        // Revoked while it ran and the drain gave up on it: the new owner redoes it, so writing
        // this output too would only make a duplicate.
        shared.metrics.stale.inc();
        return;
    }
    // What was written is kept (not copied out of): a refused output is trimmed from it.
    let (out, written) = match outcome {
        Ok(result) => {
            tracing::Span::current().record("vramgate.outcome", "result");
            if RESULT_LOG.allow() {
                tracing::info!(total_ms = result.timings_ms.total, attempts = result.attempts, "result ready");
            } else {
                shared.metrics.log_suppressed.with_label_values(&["result"]).inc();
            }
            let payload = serde_json::to_vec(&result).expect("result events always serialise");
            let out = Outgoing {
                topic: task.results_topic.as_str(),
                span_name: task.hot.send_result_span.as_str(),
                payload,
                headers: OwnedHeaders::new_with_capacity(2),
            };
            (out, Written::Result(result))
        }
        Err(rejection) => {
            let kind = rejection.failure.kind;
            let span = tracing::Span::current();
            span.record("vramgate.outcome", "dead_letter");
            span.record("otel.status_code", "ERROR");
            span.record("error.type", kind.as_str());
            span.record("otel.status_description", bounded(&rejection.failure.message, LOG_FIELD_MAX_BYTES));
            if DEAD_LETTER_LOG.allow() {
                let error = bounded(&rejection.failure.message, LOG_FIELD_MAX_BYTES);
                tracing::warn!(kind = kind.as_str(), error, "dead-lettering record");
            } else {
                shared.metrics.log_suppressed.with_label_values(&["dead_letter"]).inc();
            }
            shared.metrics.dead_letters.with_label_values(&[&task.name, kind.as_str()]).inc();
            let headers = produce::dead_letter_headers(&message, &rejection.failure);
            let letter = dead_letter(&message, rejection);
            // Sized up front: growing from serde_json's default capacity copied the source
            // record's base64 a few times over.
            let source = &letter.source;
            let size = 512
                + letter.error.message.len()
                + source.value_b64.as_ref().map_or(0, String::len)
                + source.key_b64.as_ref().map_or(0, String::len);
            let mut payload = Vec::with_capacity(size);
            serde_json::to_writer(&mut payload, &letter).expect("dead letters always serialise");
            let out = Outgoing {
                topic: task.dlq_topic.as_str(),
                span_name: task.hot.send_dead_letter_span.as_str(),
                payload,
                headers,
            };
            (out, Written::DeadLetter(letter))
        }
    };
    let (out_topic, out_bytes) = (out.topic, out.payload.len());
    match produce::deliver(&shared.producer, &shared.metrics, &message, &carried, out).await {
        Ok(()) => match written {
            Written::Result(_) => task.hot.produced_result.inc(),
            Written::DeadLetter(_) => task.hot.produced_dead_letter.inc(),
        },
        Err(error) => {
            // Retrying cannot help (a record larger than the broker takes, a topic missing or
            // not ours): a trimmed dead letter stands in for the output, so the partition
            // goes on and the producer learns why.
            let (id, task_name, refused) = match &written {
                Written::Result(r) => (Some(r.id.as_str()), Some(r.task.as_str()), produce::Refused::Result),
                Written::DeadLetter(l) => (
                    l.id.as_deref(),
                    l.task.as_deref(),
                    produce::Refused::DeadLetter { kind: l.error.kind, stage: l.error.stage, message: &l.error.message },
                ),
            };
            let trimmed = produce::trimmed_dead_letter(
                &task.dlq_topic,
                &task.hot.send_dead_letter_span,
                &message,
                id,
                task_name,
                refused,
                out_topic,
                out_bytes,
                &error,
            );
            tracing::error!(error = %error, topic = out_topic, bytes = out_bytes, "output refused by the broker; writing a trimmed dead letter");
            let trimmed_topic = trimmed.topic;
            match produce::deliver(&shared.producer, &shared.metrics, &message, &carried, trimmed).await {
                Ok(()) => {
                    shared.metrics.outputs_rejected.with_label_values(&[&task.name, "trimmed"]).inc();
                    if matches!(written, Written::Result(_)) {
                        shared.metrics.dead_letters.with_label_values(&[&task.name, "output_rejected"]).inc();
                    }
                    task.hot.produced_dead_letter.inc();
                }
                Err(error) => {
                    shared.metrics.outputs_rejected.with_label_values(&[&task.name, "lost"]).inc();
                    tracing::error!(
                        error = %error,
                        topic = trimmed_topic,
                        partition = message.partition(),
                        offset = message.offset(),
                        "the trimmed dead letter was refused too; committing past this record"
                    );
                }
            }
        }
    }
    shared.offsets.finish_traced(&ticket, context::sampled_context(&tracing::Span::current()));
}

/// The output a record's outcome became, as written.
enum Written {
    Result(ResultEvent),
    DeadLetter(DeadLetterEvent),
}

/// A failure plus what was known about the request when it happened.
struct Rejection {
    failure: Failure,
    id: Option<String>,
    task: Option<String>,
}

impl Rejection {
    fn anonymous(failure: Failure) -> Self {
        Rejection { failure, id: None, task: None }
    }
}

async fn process(
    shared: &Shared,
    task: &Task,
    message: &OwnedMessage,
    held: &mut Held,
    started: Instant,
) -> Result<ResultEvent, Rejection> {
    let value = message.payload().ok_or_else(|| {
        Rejection::anonymous(Failure::new(
            ErrorKind::InvalidRequest,
            Stage::Parse,
            "record has no value (a tombstone); expected a json request",
        ))
    })?;
    let request = parse_request(value)?;
    check_id(&request.id)?;
    let span = tracing::Span::current();
    span.record("event_id", request.id.as_str());
    span.record("messaging.message.id", request.id.as_str());
    let reject = |failure: Failure| Rejection {
        failure,
        id: Some(request.id.clone()),
        task: Some(request.task.clone()),
    };
    if request.version > SCHEMA_VERSION {
        return Err(reject(Failure::new(
            ErrorKind::InvalidRequest,
            Stage::Parse,
            format!("request version {} is newer than this gateway reads ({SCHEMA_VERSION})", request.version),
        )));
    }
    if request.task != task.name {
        return Err(reject(Failure::new(
            ErrorKind::UnknownTask,
            Stage::Parse,
            format!(
                "request task '{}' does not match topic {}, which carries '{}' requests",
                request.task,
                message.topic(),
                task.name
            ),
        )));
    }
    let plan = task.converter.plan(request.options.as_ref()).map_err(reject)?;

    // Read the input, its bytes reserved from the budget first.
    let convert_started = Instant::now();
    let record_bytes = held.bytes();
    let fetch_failed = |e: crate::input::FetchError| reject(Failure::new(e.kind(), Stage::Fetch, e.to_string()));
    let opened = shared.input.open(&request.input).await.map_err(fetch_failed)?;
    held.grow(opened.size()).await;
    let bytes = shared.input.read(opened).await.map_err(fetch_failed)?;

    // Check the header (limits, format) and reserve what decoding will hold, before decoding.
    held.grow(plan.probe(&bytes).map_err(reject)?).await;
    let queue = shared.metrics.cpu_queue.with_label_values(&[&task.name]);
    queue.inc();
    let job = plan.clone();
    let input_bytes = bytes.len();
    let format = task.config.converter.as_str();
    let result = on_pool(&task.pool, task.pool.current_num_threads(), move || {
        let span = tracing::info_span!("convert", input.format = format, input.bytes = input_bytes, output.elements = tracing::field::Empty);
        let _entered = span.enter();
        let converted = job.convert(&bytes);
        if let Ok(c) = &converted {
            span.record("output.elements", c.tensor.shape.iter().product::<usize>());
        }
        converted
    })
    .await;
    queue.dec();
    let Converted { tensor, outputs, finish } = result.and_then(|r| r).map_err(reject)?;
    let convert_ms = call::ms(convert_started.elapsed());

    // One encoded body that every attempt re-sends; the input and tensor are gone after it.
    let infer_call = InferCall::new(&request.id, &tensor, outputs);
    drop(tensor);
    held.shrink_to(record_bytes + infer_call.body_len() as u64);

    let call = call::call_worker(task, &infer_call, &shared.metrics).await.map_err(reject)?;
    drop(infer_call);
    let output = finish.output(&call.output.tensors).map_err(reject)?;
    Ok(ResultEvent {
        version: SCHEMA_VERSION,
        id: request.id.clone(),
        task: request.task.clone(),
        status: "ok".into(),
        model: call.output.model,
        output,
        timings_ms: TimingsMs {
            convert: convert_ms,
            gpu_wait: call.wait_ms,
            inference: call.inference_ms,
            total: call::ms(started.elapsed()),
        },
        attempts: call.attempts,
    })
}

/// Longest event id accepted. Ids travel into every output record, log line and span; a
/// longer one is refused (`invalid_request`) and echoed cut to this length.
pub const MAX_ID_BYTES: usize = 256;

fn check_id(id: &str) -> Result<(), Rejection> {
    let failure = |message: String| Failure::new(ErrorKind::InvalidRequest, Stage::Parse, message);
    if id.is_empty() {
        return Err(Rejection::anonymous(failure("request id is empty; give each request a unique id".into())));
    }
    if id.len() > MAX_ID_BYTES {
        return Err(Rejection {
            failure: failure(format!("request id is {} bytes; the limit is {MAX_ID_BYTES} bytes", id.len())),
            id: Some(bounded(id, MAX_ID_BYTES).to_string()),
            task: None,
        });
    }
    Ok(())
}

/// Reads a request in one pass. Only a record that fails is read again, as loose JSON, to
/// tell "not JSON" from "not a request" and to recover its id and task for the dead letter.
fn parse_request(value: &[u8]) -> Result<RequestEvent, Rejection> {
    let error = match serde_json::from_slice::<RequestEvent>(value) {
        Ok(request) => return Ok(request),
        Err(e) => e,
    };
    let json: serde_json::Value = serde_json::from_slice(value).map_err(|e| {
        Rejection::anonymous(Failure::new(
            ErrorKind::InvalidJson,
            Stage::Parse,
            format!("record value is not json: {}", bounded(&e.to_string(), LOG_FIELD_MAX_BYTES)),
        ))
    })?;
    if !json.is_object() {
        let what = match json {
            serde_json::Value::Array(_) => "an array",
            serde_json::Value::String(_) => "a string",
            serde_json::Value::Number(_) => "a number",
            serde_json::Value::Bool(_) => "a boolean",
            _ => "null",
        };
        return Err(Rejection::anonymous(Failure::new(
            ErrorKind::InvalidRequest,
            Stage::Parse,
            format!("record value is {what}; expected a json object with id, task and input"),
        )));
    }
    let hint = |key: &str| json.get(key).and_then(|v| v.as_str()).map(|v| bounded(v, MAX_ID_BYTES).to_string());
    let message = match json.get("input") {
        Some(input) if !input.is_object() || (input.get("uri").is_none() && input.get("data_b64").is_none()) => {
            "record is not a valid request: input must be {\"uri\": \"file:///…\"} or {\"data_b64\": \"…\"}".to_string()
        }
        Some(input) if input.get("uri").is_some() && input.get("data_b64").is_some() => {
            "record is not a valid request: input has both uri and data_b64; give one".to_string()
        }
        Some(input) if input.as_object().is_some_and(|o| o.len() > 1) => {
            "record is not a valid request: input has fields other than uri or data_b64".to_string()
        }
        _ => format!("record is not a valid request: {}", bounded(&error.to_string(), LOG_FIELD_MAX_BYTES)),
    };
    Err(Rejection {
        failure: Failure::new(ErrorKind::InvalidRequest, Stage::Parse, message),
        id: hint("id"),
        task: hint("task"),
    })
}

/// Runs CPU-bound work on a rayon pool and awaits it without blocking a tokio thread. The
/// caller's span goes along, so the pool's logs carry the record's fields.
/// Runs `work` on `pool`; the time it waits for a thread is a `cpu_queue_wait` span.
async fn on_pool<T: Send + 'static>(
    pool: &rayon::ThreadPool,
    threads: usize,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Failure> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let span = tracing::Span::current();
    let waiting = tracing::info_span!("cpu_queue_wait", pool.threads = threads);
    pool.spawn(move || {
        drop(waiting);
        let _entered = span.enter();
        let _ = tx.send(std::panic::catch_unwind(AssertUnwindSafe(work)));
    });
    match rx.await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(_)) => Err(Failure::new(
            ErrorKind::Internal,
            Stage::Convert,
            "conversion panicked on this input; see the gateway log",
        )),
        Err(_) => Err(Failure::new(ErrorKind::Internal, Stage::Convert, "cpu pool dropped the job")),
    }
}


fn dead_letter(message: &OwnedMessage, rejection: Rejection) -> DeadLetterEvent {
    DeadLetterEvent {
        version: SCHEMA_VERSION,
        id: rejection.id,
        task: rejection.task,
        error: ErrorInfo {
            kind: rejection.failure.kind,
            message: rejection.failure.message,
            stage: rejection.failure.stage,
        },
        attempts: rejection.failure.attempts,
        source: produce::source_record(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_requests_get_precise_reasons() {
        let check = |value: &[u8], kind: ErrorKind, needle: &str| {
            let Err(rejection) = parse_request(value).and_then(|r| check_id(&r.id)) else { panic!("accepted") };
            assert_eq!(rejection.failure.kind, kind, "{}", String::from_utf8_lossy(value));
            assert!(rejection.failure.message.contains(needle), "{}", rejection.failure.message);
            rejection
        };
        check(b"not json", ErrorKind::InvalidJson, "not json");
        check(b"[1, 2]", ErrorKind::InvalidRequest, "is an array");
        check(b"\"x\"", ErrorKind::InvalidRequest, "is a string");
        check(br#"{"id":"","task":"voice","input":{"uri":"file:///a"}}"#, ErrorKind::InvalidRequest, "id is empty");
        check(br#"{"id":"a","task":"voice","input":{"url":"file:///a"}}"#, ErrorKind::InvalidRequest, "input must be");
        check(br#"{"id":"a","task":"voice","input":{"uri":"x","data_b64":"y"}}"#, ErrorKind::InvalidRequest, "both");
        let long = format!(r#"{{"id":"{}","task":"voice","input":{{"uri":"file:///a"}}}}"#, "x".repeat(5000));
        let rejection = check(long.as_bytes(), ErrorKind::InvalidRequest, "limit is 256 bytes");
        assert_eq!(rejection.id.map(|id| id.len()), Some(MAX_ID_BYTES), "echoed cut short");
        let huge = format!(r#"{{"id":1,"task":"{}"}}"#, "t".repeat(100_000));
        let rejection = check(huge.as_bytes(), ErrorKind::InvalidRequest, "not a valid request");
        assert!(rejection.failure.message.len() < 1024, "{} bytes", rejection.failure.message.len());
    }





    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        const VALID: &str = r#"{"version":1,"id":"abc","task":"voice","input":{"uri":"file:///a/b.wav"},"options":{"threshold":0.5}}"#;

        fn check(value: &[u8]) -> Result<(), TestCaseError> {
            match parse_request(value).map(|r| (check_id(&r.id), r)) {
                Ok((Ok(()), request)) => prop_assert!(!request.id.is_empty() && request.id.len() <= MAX_ID_BYTES),
                Ok((Err(rejection), _)) | Err(rejection) => {
                    prop_assert!(rejection.failure.message.len() <= 2 * LOG_FIELD_MAX_BYTES + 128);
                    prop_assert!(rejection.id.is_none_or(|id| id.len() <= MAX_ID_BYTES));
                }
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// Whatever a producer writes, parsing it never panics, and what it yields is bounded.
            #[test]
            fn arbitrary_values_never_panic(value in proptest::collection::vec(any::<u8>(), 0..512)) {
                check(&value)?;
            }

            #[test]
            fn mutated_requests_never_panic(
                edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
                cut in any::<prop::sample::Index>(),
            ) {
                let mut value = VALID.as_bytes().to_vec();
                for (at, b) in edits {
                    let at = at.index(value.len());
                    value[at] = b;
                }
                value.truncate(cut.index(value.len() + 1));
                check(&value)?;
            }

            #[test]
            fn any_json_shape_never_panics(id in ".{0,400}", task in ".{0,40}", extra in proptest::option::of(".{0,40}")) {
                let mut json = serde_json::json!({"id": id, "task": task, "input": {"data_b64": "AAAA"}});
                if let Some(extra) = extra {
                    json["input"]["uri"] = serde_json::Value::String(extra);
                }
                check(&serde_json::to_vec(&json).expect("json"))?;
            }
        }
    }
}
