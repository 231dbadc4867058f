//! One record's life, from fetched to finished: parse, read the input, convert it on the
//! task's CPU pool, call the worker under the task's GPU permits (retrying what is worth it),
//! and write exactly one result or dead letter. Only then is the record finished, so only then
//! can its offset be committed.
//!
//! A record starts synchronously, in its poll round's task ([`start`]): it is parsed, checked
//! and its input opened at once. One refused there (bad JSON, an unknown task, a missing
//! input: no worker call) never becomes a task: its dead letter is produced on the spot and its
//! acknowledgement, on the producer's polling thread, finishes it. Only a record that goes on to
//! convert and call a worker is spawned as a task of its own. Both ends are the same: one output
//! acknowledged, then the ticket finished; the same retries and trimmed dead letter when the
//! broker refuses the output (`docs/performance-notes.md`, gateway cause 11).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use rdkafka::error::KafkaError;
use rdkafka::message::{Message, OwnedHeaders, OwnedMessage};
use tracing::Instrument;
use vramgate_shared::telemetry::context::{self, Carried};
use vramgate_shared::events::{
    DeadLetterEvent, ErrorInfo, ErrorKind, FrameRef, InputRef, RequestEvent, ResultEvent, Stage, TimingsMs,
    SCHEMA_VERSION,
};
use vramgate_shared::telemetry::{self, bounded, LogLimit, LOG_FIELD_MAX_BYTES};

use crate::budget::{ByteBudget, Held};
use crate::failure::Failure;
use crate::input::{InputSource, Opened};
use crate::storage::buckets::Buckets;
use crate::metrics::Metrics;
use crate::consume::offsets::{SharedOffsets, Ticket};
use crate::consume::transaction::{Outbox, Pending};
use crate::produce::{self, Outgoing, Producer};
use crate::answer::{answer, Answered, Named, Services};
use crate::config::Converter;
use crate::frames;
use crate::task::Task;
use crate::tasks::Plan;
use crate::call;
use crate::video;

/// Log lines a second, per kind of line; the rest are counted in `log_lines_suppressed_total`.
static RESULT_LOG: LogLimit = LogLimit::new(20);
static DEAD_LETTER_LOG: LogLimit = LogLimit::new(20);

/// Charged per record on top of its key and value: the message struct, its task and tracking.
pub const RECORD_OVERHEAD_BYTES: u64 = 2048;

/// Where a finished record's output goes.
pub enum Output {
    /// At-least-once delivery: produced at once; its acknowledgement finishes the record.
    Direct(Producer),
    /// Exactly-once delivery: into the outbox, which finishes the record; the commit thread's
    /// transaction writes it with the record's offset.
    Transactional(Arc<Outbox>),
}

/// What every record shares.
pub struct Shared {
    pub output: Output,
    pub offsets: Arc<SharedOffsets>,
    pub input: InputSource,
    /// The object store's clients, by bucket: inputs' and stored outputs'.
    pub buckets: Arc<Buckets>,
    pub budget: Arc<ByteBudget>,
    pub metrics: Arc<Metrics>,
    /// Records fetched and not yet finished (or dropped as stale), all tasks.
    pub in_flight: AtomicUsize,
    /// The consumer group, for the spans.
    pub group_id: String,
    /// Where a record whose output the broker refused goes on retrying: an acknowledgement
    /// arrives on the producer's thread, outside the runtime.
    pub runtime: tokio::runtime::Handle,
}

/// A record between fetched and finished, with what it holds: its ticket, its bytes and its
/// place in the in-flight count (given back when it is dropped, whatever path it took).
struct Record {
    shared: Arc<Shared>,
    task: Arc<Task>,
    message: OwnedMessage,
    ticket: Ticket,
    held: Held,
    /// When it was fetched: its time in the in-flight window is measured from here.
    fetched: Instant,
}

impl Drop for Record {
    fn drop(&mut self) {
        self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.task.hot.in_flight.dec();
    }
}

impl Record {
    /// Its output is acknowledged: the offset may be committed. A sampled record gets its
    /// `commit` span when a confirmed commit covers it.
    /// Its `process` span while nothing exports, with the event id when it has one: what its
    /// log lines carry.
    fn log_span(&self, id: Option<&str>) -> tracing::Span {
        let span = process_span(&self.shared, &self.task, &self.message);
        if let Some(id) = id {
            span.record("event_id", id);
        }
        span
    }

    fn finish(self, span: &tracing::Span) {
        self.shared.offsets.finish_traced(&self.ticket, context::sampled_context(span));
        self.task.hot.record_seconds.observe(self.fetched.elapsed().as_secs_f64());
    }

    /// Revoked since it was fetched: the partition's new owner reads it again from the last
    /// commit, so writing its output here would only make a duplicate.
    fn stale(&self) -> bool {
        if self.shared.offsets.is_current(&self.ticket) {
            return false;
        }
        self.shared.metrics.stale.inc();
        true
    }
}

/// Called by the fetch loop for each record, before [`start`]: counts and charges it.
pub fn admit(shared: &Shared, task: &Task, message: &OwnedMessage) -> (Ticket, Held) {
    task.hot.consumed.inc();
    task.hot.in_flight.inc();
    shared.in_flight.fetch_add(1, Ordering::SeqCst);
    let raw = message.payload().map_or(0, <[u8]>::len) + message.key().map_or(0, <[u8]>::len);
    let held = shared.budget.hold(raw as u64 + RECORD_OVERHEAD_BYTES);
    let ticket = shared.offsets.lock().begin((message.topic().to_string(), message.partition()), message.offset());
    (ticket, held)
}

/// A CONSUMER span `process <topic>` for the record, which continues the trace its headers
/// carry (or starts one, noting a refused `traceparent`). While nothing exports, the span
/// carries only what its log lines show (task, topic, partition, offset, event id): its other
/// fields would be visited for every record and never read.
fn process_span(shared: &Shared, task: &Task, message: &OwnedMessage) -> tracing::Span {
    if telemetry::exports_spans() {
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
    }
}

/// Starts a record, in its poll round's task: parses and checks it and opens its input, all
/// in its `process` span. A record refused there has its dead letter produced at once and is
/// finished by its acknowledgement; one that goes on becomes a task ([`go_on`]).
///
/// While nothing exports spans, a record refused here gets no span at all unless a log line
/// is written for it (rate-limited; [`refused`] and [`write_now`] make the span then): making
/// and closing two spans (`process`, `send`) per record was 7% of the gateway's CPU on this
/// path, for fields no one read (gateway cause 14).
pub fn start(shared: &Arc<Shared>, task: Arc<Task>, message: OwnedMessage, ticket: Ticket, held: Held, fetched: Instant) {
    let exporting = telemetry::exports_spans();
    let span = if exporting { process_span(shared, &task, &message) } else { tracing::Span::none() };
    // Read once: the span continues it, and with tracing off the outputs carry it.
    let carried = Carried::from_headers(produce::kafka_headers(&message));
    carried.adopt(&span);
    let record = Record { shared: shared.clone(), task, message, ticket, held, fetched };
    if record.stale() {
        return;
    }
    let started = Instant::now();
    let checked = {
        let _entered = span.enter();
        std::panic::catch_unwind(AssertUnwindSafe(|| check(&record.shared, &record.task, &record.message)))
            .unwrap_or_else(|_| Err(Rejection::anonymous(panicked(Stage::Parse))))
    };
    match checked {
        Ok(checked) => {
            let span = if exporting { span } else { record.log_span(Some(&checked.id)) };
            tokio::spawn(go_on(record, carried, checked, started).instrument(span));
        }
        Err(rejection) => {
            let letter = refused(&span, &record, rejection);
            match &record.shared.output {
                Output::Direct(_) => write_now(record, carried, span, Written::DeadLetter(letter)),
                Output::Transactional(_) => hand_over(record, &carried, &span, Written::DeadLetter(letter)),
            }
        }
    }
}

fn panicked(stage: Stage) -> Failure {
    Failure::new(ErrorKind::Internal, stage, "the gateway panicked while processing this record; see its log")
}

/// A record that passed its checks: converts, calls the worker, writes its result (or its dead
/// letter), then finishes.
async fn go_on(mut record: Record, carried: Carried, checked: Checked, started: Instant) {
    let outcome = AssertUnwindSafe(convert_and_call(&record.shared, &record.task, &mut record.held, checked, started))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| Err(Rejection::anonymous(panicked(Stage::Postprocess))));
    if record.stale() {
        return;
    }
    let span = tracing::Span::current();
    let written = match outcome {
        Ok(result) => {
            span.record("vramgate.outcome", "result");
            if RESULT_LOG.allow() {
                tracing::info!(total_ms = result.timings_ms.total, attempts = result.attempts, "result ready");
            } else {
                record.shared.metrics.log_suppressed.with_label_values(&["result"]).inc();
            }
            Written::Result(result)
        }
        Err(rejection) => Written::DeadLetter(refused(&span, &record, rejection)),
    };
    match &record.shared.output {
        Output::Direct(_) => write(record, carried, written, None).await,
        Output::Transactional(_) => hand_over(record, &carried, &span, written),
    }
    drop(span);
}

/// A rejection made a dead letter: noted on the span, logged (within the rate limit), counted.
/// The log line goes under `span`, or, when the record has none (nothing exports), under a
/// `process` span made for it.
fn refused(span: &tracing::Span, record: &Record, rejection: Rejection) -> DeadLetterEvent {
    let Record { shared, task, message, .. } = record;
    let metrics = &shared.metrics;
    let kind = rejection.failure.kind;
    span.record("vramgate.outcome", "dead_letter");
    span.record("otel.status_code", "ERROR");
    span.record("error.type", kind.as_str());
    span.record("otel.status_description", bounded(&rejection.failure.message, LOG_FIELD_MAX_BYTES));
    if DEAD_LETTER_LOG.allow() {
        let made;
        let span = if span.is_none() {
            made = record.log_span(rejection.id.as_deref());
            &made
        } else {
            span
        };
        let _entered = span.enter();
        let error = bounded(&rejection.failure.message, LOG_FIELD_MAX_BYTES);
        tracing::warn!(kind = kind.as_str(), error, "dead-lettering record");
    } else {
        metrics.log_suppressed.with_label_values(&["dead_letter"]).inc();
    }
    metrics.dead_letters.with_label_values(&[&task.name, kind.as_str()]).inc();
    dead_letter(message, rejection)
}

/// The output a record's outcome became, as written.
enum Written {
    Result(ResultEvent),
    DeadLetter(DeadLetterEvent),
}

impl Written {
    /// The record to produce: its topic, payload and headers.
    fn outgoing<'a>(&self, task: &'a Task, message: &OwnedMessage) -> Outgoing<'a> {
        match self {
            Written::Result(result) => Outgoing {
                topic: task.results_topic.as_str(),
                span_name: task.hot.send_result_span.as_str(),
                payload: serde_json::to_vec(result).expect("result events always serialise"),
                headers: OwnedHeaders::new_with_capacity(2),
            },
            Written::DeadLetter(letter) => {
                // Sized up front: growing from serde_json's default capacity copied the source
                // record's base64 a few times over.
                let source = &letter.source;
                let size = 512
                    + letter.error.message.len()
                    + source.value_b64.as_ref().map_or(0, String::len)
                    + source.key_b64.as_ref().map_or(0, String::len);
                let mut payload = Vec::with_capacity(size);
                serde_json::to_writer(&mut payload, letter).expect("dead letters always serialise");
                Outgoing {
                    topic: task.dlq_topic.as_str(),
                    span_name: task.hot.send_dead_letter_span.as_str(),
                    payload,
                    headers: produce::dead_letter_headers(message, &letter.error),
                }
            }
        }
    }

    /// The request's id, when it had a readable one.
    fn id(&self) -> Option<&str> {
        match self {
            Written::Result(result) => Some(result.id.as_str()),
            Written::DeadLetter(letter) => letter.id.as_deref(),
        }
    }

    /// What its trimmed dead letter would say, should the broker refuse it for good.
    fn standin(&self, message: &OwnedMessage) -> produce::Standin {
        let (id, task, refused) = match self {
            Written::Result(r) => (Some(r.id.as_str()), Some(r.task.as_str()), produce::Refused::Result),
            Written::DeadLetter(l) => (
                l.id.as_deref(),
                l.task.as_deref(),
                produce::Refused::DeadLetter { kind: l.error.kind, stage: l.error.stage, message: l.error.message.clone() },
            ),
        };
        produce::Standin::new(message, id, task, refused)
    }

    fn acknowledged(&self, task: &Task) {
        match self {
            Written::Result(_) => task.hot.produced_result.inc(),
            Written::DeadLetter(_) => task.hot.produced_dead_letter.inc(),
        }
    }
}

/// Exactly-once delivery: hands a record's output to the outbox, which finishes the record; the
/// next transaction writes it with the record's offset. Its `send` span ends here: the output
/// is on its way, and the record's `commit` span (finished to committed) shows the transaction
/// that wrote it. The output's bytes stay charged to `max_held_bytes` until then.
fn hand_over(record: Record, carried: &Carried, span: &tracing::Span, written: Written) {
    let Output::Transactional(outbox) = &record.shared.output else { unreachable!("hand_over is exactly-once delivery's") };
    let outbox = outbox.clone();
    let Outgoing { span_name, payload, headers, topic } = written.outgoing(&record.task, &record.message);
    let headers = if span.is_none() {
        produce::with_trace_context(headers, span, carried)
    } else {
        let _entered = span.enter();
        produce::sending(span_name, topic, payload.len(), headers, carried).1
    };
    let held = record.shared.budget.hold(payload.len() as u64);
    let pending = Pending::new(
        record.ticket.clone(),
        record.task.clone(),
        matches!(written, Written::Result(_)),
        record.message.key().map(<[u8]>::to_vec),
        payload,
        headers,
        written.standin(&record.message),
        held,
    );
    if outbox.put(&record.shared.offsets, pending, context::sampled_context(span)) {
        record.task.hot.record_seconds.observe(record.fetched.elapsed().as_secs_f64());
    } else {
        record.shared.metrics.stale.inc();
    }
}

/// Produces a record's output without a task: its acknowledgement, on the producer's polling
/// thread, finishes the record. A refused first attempt goes on as [`write`] does, on the
/// runtime.
fn write_now(record: Record, carried: Carried, span: tracing::Span, written: Written) {
    let task = record.task.clone();
    let shared = record.shared.clone();
    let Outgoing { topic, span_name, payload, headers } = written.outgoing(&task, &record.message);
    let (send, headers) = if span.is_none() {
        // Nothing exports and nothing logs under a first attempt that succeeds.
        (tracing::Span::none(), produce::with_trace_context(headers, &span, &carried))
    } else {
        let _entered = span.enter();
        produce::sending(span_name, topic, payload.len(), headers, &carried)
    };
    let key = record.message.key().map(<[u8]>::to_vec);
    let Output::Direct(producer) = &shared.output else { unreachable!("write_now is at-least-once delivery's") };
    produce::send_then(producer, topic, key.as_deref(), &payload, headers, send, move |acked| match acked {
        Ok(_) => {
            written.acknowledged(&record.task);
            record.finish(&span);
        }
        Err(refusal) => {
            // The retries log: under the record's span, made now if it has none.
            let span = if span.is_none() { record.log_span(written.id()) } else { span };
            let runtime = record.shared.runtime.clone();
            runtime.spawn(write(record, carried, written, Some(refusal.error)).instrument(span));
        }
    });
}

/// Produces a record's output until the broker acknowledges it, then finishes the record. An
/// output refused for good is replaced by a trimmed dead letter, so the partition goes on and
/// the producer learns why. `refused`: a first attempt that already failed.
async fn write(record: Record, carried: Carried, written: Written, refused: Option<KafkaError>) {
    let Record { shared, task, message, .. } = &record;
    let Output::Direct(producer) = &shared.output else { unreachable!("write is at-least-once delivery's") };
    let out = written.outgoing(task, message);
    let (out_topic, out_bytes) = (out.topic, out.payload.len());
    match produce::deliver(producer, &shared.metrics, message, &carried, out, refused).await {
        Ok(()) => written.acknowledged(task),
        Err(error) => {
            // Retrying cannot help (a record larger than the broker takes, a topic missing or
            // not ours): a trimmed dead letter stands in for the output.
            let standin = written.standin(message);
            let trimmed = produce::trimmed_dead_letter(
                &task.dlq_topic,
                &task.hot.send_dead_letter_span,
                &standin,
                out_topic,
                out_bytes,
                &error,
            );
            tracing::error!(error = %error, topic = out_topic, bytes = out_bytes, "output refused by the broker; writing a trimmed dead letter");
            let trimmed_topic = trimmed.topic;
            match produce::deliver(producer, &shared.metrics, message, &carried, trimmed, None).await {
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
    record.finish(&tracing::Span::current());
}

/// A failure plus what was known about the request when it happened.
pub struct Rejection {
    pub failure: Failure,
    /// The request's id when it could be read, cut to [`MAX_ID_BYTES`].
    pub id: Option<String>,
    /// The request's task when it could be read, cut to [`MAX_ID_BYTES`].
    pub task: Option<String>,
}

impl Rejection {
    fn anonymous(failure: Failure) -> Self {
        Rejection { failure, id: None, task: None }
    }
}

/// A request that passed every check made before its input is read.
struct Checked {
    id: String,
    task: String,
    plan: Arc<dyn Plan>,
    input: Input,
}

/// What a request names: one input, or a batch of frames (each opened and checked).
enum Input {
    One(Opened),
    Frames(Vec<Opened>),
}

/// The checks made at once, in the record's poll round: the request parses, its id, version
/// and task are right, its options make a plan, and its input opens within the size limit.
fn check(shared: &Shared, task: &Task, message: &OwnedMessage) -> Result<Checked, Rejection> {
    let value = message.payload().ok_or_else(|| {
        Rejection::anonymous(Failure::new(
            ErrorKind::InvalidRequest,
            Stage::Parse,
            "record has no value (a tombstone); expected a json request",
        ))
    })?;
    let RequestEvent { version, id, task: task_name, input, options } = read_request(value)?;
    let span = tracing::Span::current();
    span.record("event_id", id.as_str());
    span.record("messaging.message.id", id.as_str());
    let reject = |failure: Failure| Rejection { failure, id: Some(id.clone()), task: Some(task_name.clone()) };
    if version > SCHEMA_VERSION {
        return Err(reject(Failure::new(
            ErrorKind::InvalidRequest,
            Stage::Parse,
            format!("request version {version} is newer than this gateway reads ({SCHEMA_VERSION})"),
        )));
    }
    if task_name != task.name {
        return Err(reject(Failure::new(
            ErrorKind::UnknownTask,
            Stage::Parse,
            format!(
                "request task '{task_name}' does not match topic {}, which carries '{}' requests",
                message.topic(),
                task.name
            ),
        )));
    }
    let plan = task.converter.plan(options.as_ref()).map_err(reject)?;
    let input = match input {
        InputRef::Frames { frames } => Input::Frames(open_frames(shared, task, frames).map_err(reject)?),
        one => Input::One(shared.input.open(one).map_err(|e| reject(Failure::new(e.kind(), Stage::Fetch, e.to_string())))?),
    };
    Ok(Checked { id, task: task_name, plan, input })
}

/// Opens a batch's frames: for a task that takes pictures, within `video.max_batch_frames`.
fn open_frames(shared: &Shared, task: &Task, frames: Vec<FrameRef>) -> Result<Vec<Opened>, Failure> {
    let invalid = |message: String| Failure::new(ErrorKind::InvalidRequest, Stage::Parse, message);
    if task.config.converter != Converter::Image {
        return Err(invalid(format!(
            "input.frames is for tasks that take pictures (converter \"image\"); task '{}' takes {} input",
            task.name,
            task.config.converter.as_str()
        )));
    }
    let limit = task.config.video.max_batch_frames as usize;
    if frames.is_empty() {
        return Err(invalid("input.frames is empty; give at least one frame".into()));
    }
    if frames.len() > limit {
        return Err(Failure::new(
            ErrorKind::InputTooLarge,
            Stage::Parse,
            format!("input.frames has {} frames, more than the limit of {limit} (video.max_batch_frames)", frames.len()),
        ));
    }
    frames
        .into_iter()
        .enumerate()
        .map(|(i, frame)| {
            shared.input.open(frame.into()).map_err(|e| Failure::new(e.kind(), Stage::Fetch, format!("frame {i}: {e}")))
        })
        .collect()
}

async fn convert_and_call(
    shared: &Shared,
    task: &Task,
    held: &mut Held,
    checked: Checked,
    started: Instant,
) -> Result<ResultEvent, Rejection> {
    let convert_started = Instant::now();
    let Checked { id, task: task_name, plan, input } = checked;
    let reject = |failure: Failure| Rejection { failure, id: Some(id.clone()), task: Some(task_name.clone()) };
    let fetch_failed = |e: crate::input::FetchError| reject(Failure::new(e.kind(), Stage::Fetch, e.to_string()));
    let services = Services { metrics: &shared.metrics, buckets: &shared.buckets };
    let answered = match input {
        Input::One(opened) => {
            // Read the input, its bytes reserved from the budget first (an object's size is
            // asked for, and checked against the limit, before its body is downloaded).
            let opened = shared.input.locate(opened).await.map_err(fetch_failed)?;
            let record_bytes = held.bytes();
            held.grow(opened.size()).await;
            let bytes = shared.input.read(opened).await.map_err(fetch_failed)?;
            match video::sniff(&bytes).filter(|_| task.config.converter == Converter::Image) {
                Some(container) => frames::video(services, &shared.budget, task, &id, &plan, bytes, container).await,
                None => {
                    let named = Named { id: &id, store_id: &id, keep: record_bytes };
                    answer(services, task, held, named, &plan, bytes, convert_started).await
                }
            }
        }
        Input::Frames(frames) => frames::batch(services, &shared.budget, &shared.input, task, &id, &plan, frames).await,
    }
    .map_err(reject)?;
    let Answered { output, models, convert_ms, wait_ms, inference_ms, attempts } = answered;
    Ok(ResultEvent {
        version: SCHEMA_VERSION,
        id,
        task: task_name,
        status: "ok".into(),
        model: models.iter().map(|(m, _)| m.as_str()).collect::<Vec<_>>().join(","),
        model_version: models.iter().map(|(_, v)| v.as_str()).collect::<Vec<_>>().join(","),
        output,
        timings_ms: TimingsMs {
            convert: convert_ms,
            gpu_wait: wait_ms,
            inference: inference_ms,
            total: call::ms(started.elapsed()),
        },
        attempts,
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

/// Reads a record's value into a request and checks what needs neither the task table nor
/// the input: the value is JSON, of a request's shape, with an id of 1 to [`MAX_ID_BYTES`]
/// bytes. Every rejection's message and echoed id are bounded, whatever the value.
pub fn read_request(value: &[u8]) -> Result<RequestEvent, Rejection> {
    let request = parse_request(value)?;
    check_id(&request.id)?;
    Ok(request)
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
    let frame_shape = "{\"uri\": \"…\"} or {\"data_b64\": \"…\"}";
    let message = match json.get("input") {
        Some(input) if input.get("frames").is_some() => match input.get("frames") {
            _ if input.as_object().is_some_and(|o| o.len() > 1) => {
                "record is not a valid request: input has frames and other fields; give frames alone".to_string()
            }
            Some(serde_json::Value::Array(frames)) => match frames.iter().position(|f| {
                let Some(f) = f.as_object() else { return true };
                f.len() != 1 || !(f.get("uri").is_some_and(|v| v.is_string()) || f.get("data_b64").is_some_and(|v| v.is_string()))
            }) {
                Some(i) => format!("record is not a valid request: input.frames[{i}] must be {frame_shape}"),
                None => format!("record is not a valid request: {}", bounded(&error.to_string(), LOG_FIELD_MAX_BYTES)),
            },
            _ => format!("record is not a valid request: input.frames must be a list of {frame_shape}"),
        },
        Some(input) if !input.is_object() || (input.get("uri").is_none() && input.get("data_b64").is_none()) => {
            "record is not a valid request: input must be {\"uri\": \"file:///…\"}, {\"data_b64\": \"…\"} or {\"frames\": [...]}".to_string()
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
            let Err(rejection) = read_request(value) else { panic!("accepted") };
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
        check(br#"{"id":"a","task":"image","input":{"frames":"a.png"}}"#, ErrorKind::InvalidRequest, "input.frames must be a list");
        check(br#"{"id":"a","task":"image","input":{"frames":[{"uri":"a"},{"url":"b"}]}}"#, ErrorKind::InvalidRequest, "input.frames[1] must be");
        check(br#"{"id":"a","task":"image","input":{"frames":[],"uri":"a"}}"#, ErrorKind::InvalidRequest, "frames alone");
        let batch = read_request(br#"{"id":"a","task":"image","input":{"frames":[{"uri":"file:///a.png"},{"data_b64":"AA=="}]}}"#);
        assert!(matches!(batch.map(|r| r.input), Ok(InputRef::Frames { frames }) if frames.len() == 2));
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
            match read_request(value) {
                Ok(request) => prop_assert!(!request.id.is_empty() && request.id.len() <= MAX_ID_BYTES),
                Err(rejection) => {
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
