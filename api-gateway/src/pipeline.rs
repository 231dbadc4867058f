//! The gateway's run loop: consume request records, process each one concurrently (fetch,
//! convert on the task's CPU pool, call the worker under the task's GPU permits), write a
//! result or a dead letter, and only then let its offset be committed.
//!
//! Invariants:
//! - Every record that is fetched ends in exactly one produced record (result or dead letter)
//!   before its offset can be stored; a record whose produce never succeeds is never committed,
//!   so a restart reads it again (duplicates are possible, losses are not).
//! - CPU-bound conversion runs on rayon pools, never on tokio's threads.
//! - At most `max_in_flight` records are held at once.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::{instrument, Instrument};
use vramgate_shared::events::{
    DeadLetterEvent, ErrorInfo, ErrorKind, RequestEvent, ResultEvent, SourceRecord, Stage, TimingsMs,
    SCHEMA_VERSION,
};
use vramgate_shared::oip::{Tensor, TensorData};

use crate::config::{GatewayConfig, VoiceTaskConfig, WorkerEndpoint};
use crate::failure::Failure;
use crate::input::InputSource;
use crate::offsets::{OffsetTracker, Ticket, TopicPartition};
use crate::voice::{self, VoiceOptions};
use crate::worker_client::{CallError, InferCall, WorkerClient};

const VOICE: &str = "voice";

/// Keeps the offset tracker in step with partition assignment.
struct RebalanceContext {
    tracker: Arc<Mutex<OffsetTracker>>,
}

impl ClientContext for RebalanceContext {}

impl ConsumerContext for RebalanceContext {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let revoked = partitions(tpl);
            tracing::info!(partitions = ?revoked, "partitions revoked");
            lock(&self.tracker).revoke(revoked.iter());
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let assigned = partitions(tpl);
            tracing::info!(partitions = ?assigned, "partitions assigned");
            lock(&self.tracker).assign(assigned);
        }
    }
}

fn partitions(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements().iter().map(|e| (e.topic().to_string(), e.partition())).collect()
}

/// A poisoned tracker mutex means a panic while holding it; the data is a plain set of
/// offsets that stays consistent, so keep using it rather than taking the gateway down.
fn lock(tracker: &Mutex<OffsetTracker>) -> std::sync::MutexGuard<'_, OffsetTracker> {
    tracker.lock().unwrap_or_else(|p| p.into_inner())
}

/// What one task type needs at run time: its config, CPU pool and GPU permits.
struct VoiceTask {
    config: VoiceTaskConfig,
    pool: rayon::ThreadPool,
    permits: Semaphore,
}

struct Shared {
    consumer: StreamConsumer<RebalanceContext>,
    producer: FutureProducer,
    tracker: Arc<Mutex<OffsetTracker>>,
    voice: VoiceTask,
    input: InputSource,
    worker: WorkerClient,
    worker_config: WorkerEndpoint,
}

/// Runs the gateway until `shutdown` resolves, then finishes in-flight records (up to the
/// shutdown timeout) and commits what is finished.
pub async fn run(
    config: GatewayConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    use anyhow::Context;

    let tracker = Arc::new(Mutex::new(OffsetTracker::new()));
    let consumer: StreamConsumer<RebalanceContext> = client_config(&config, true)
        .create_with_context(RebalanceContext { tracker: tracker.clone() })
        .context("creating the kafka consumer")?;
    let producer: FutureProducer =
        client_config(&config, false).create().context("creating the kafka producer")?;
    let cpu_threads = match config.voice.cpu_threads {
        0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
        n => n,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(cpu_threads)
        .thread_name(|i| format!("voice-cpu-{i}"))
        .build()
        .context("starting the voice cpu pool")?;
    let input = InputSource::new(&config.input.file_root, config.input.max_input_bytes)
        .with_context(|| format!("input root {}", config.input.file_root.display()))?;
    let shared = Arc::new(Shared {
        consumer,
        producer,
        tracker,
        voice: VoiceTask {
            permits: Semaphore::new(config.voice.gpu_permits.max(1)),
            config: config.voice.clone(),
            pool,
        },
        input,
        worker: WorkerClient::new(&config.worker)?,
        worker_config: config.worker.clone(),
    });
    shared
        .consumer
        .subscribe(&[config.voice.requests_topic.as_str()])
        .context("subscribing to the request topics")?;
    tracing::info!(
        topics = ?[&config.voice.requests_topic],
        group = %config.kafka.group_id,
        input_root = %shared.input.root().display(),
        "api-gateway consuming"
    );

    let in_flight = Arc::new(Semaphore::new(config.max_in_flight.max(1)));
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        // Take the in-flight slot before fetching, so a full gateway stops pulling records.
        let slot = tokio::select! {
            _ = &mut shutdown => break,
            slot = in_flight.clone().acquire_owned() => slot.context("in-flight semaphore closed")?,
        };
        let message = tokio::select! {
            _ = &mut shutdown => break,
            m = shared.consumer.recv() => m,
        };
        let message = match message {
            Ok(m) => m.detach(),
            Err(e) => {
                tracing::warn!(error = %e, "kafka consumer error");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let ticket =
            lock(&shared.tracker).begin((message.topic().to_string(), message.partition()), message.offset());
        let shared = shared.clone();
        tasks.spawn(async move {
            handle_record(&shared, message, ticket).await;
            drop(slot);
        });
        while let Some(done) = tasks.try_join_next() {
            if let Err(e) = done {
                tracing::error!(error = %e, "record task failed");
            }
        }
    }

    tracing::info!(in_flight = tasks.len(), "shutting down: fetching stopped, finishing in-flight records");
    let drained = tokio::time::timeout(config.shutdown_timeout(), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            abandoned = tasks.len(),
            "shutdown timeout reached; unfinished records will be redelivered"
        );
        tasks.abort_all();
    }
    match shared.consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(()) => tracing::info!("offsets committed; bye"),
        // Nothing stored since the last auto-commit is not a failure.
        Err(e) => tracing::info!(error = %e, "final commit skipped"),
    }
    Ok(())
}

fn client_config(config: &GatewayConfig, consumer: bool) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &config.kafka.brokers);
    if consumer {
        c.set("group.id", &config.kafka.group_id)
            .set("enable.auto.commit", "true")
            .set("auto.commit.interval.ms", "1000")
            // Offsets are stored by us, only once a record's output is acknowledged.
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            // Bound librdkafka's prefetch in bytes, not only in messages.
            .set("queued.max.messages.kbytes", "16384");
    } else {
        c.set("enable.idempotence", "true").set("acks", "all").set("linger.ms", "5");
    }
    for (k, v) in &config.kafka.properties {
        c.set(k, v);
    }
    c
}

/// Processes one record to its end: a produced result or dead letter, then its offset.
#[instrument(skip_all, fields(task = VOICE, partition = message.partition(), offset = message.offset(), event_id))]
async fn handle_record(shared: &Shared, message: OwnedMessage, ticket: Ticket) {
    let started = Instant::now();
    let outcome = AssertUnwindSafe(process(shared, &message, started))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| {
            Err(Rejection::anonymous(Failure::new(
                ErrorKind::Internal,
                Stage::Postprocess,
                "the gateway panicked while processing this record; see its log",
            )))
        });
    let (topic, payload, extra_headers) = match outcome {
        Ok(result) => {
            tracing::info!(total_ms = result.timings_ms.total, "result ready");
            let payload = serde_json::to_vec(&result).expect("result events always serialise");
            (shared.voice.config.results_topic.as_str(), payload, Vec::new())
        }
        Err(rejection) => {
            tracing::warn!(kind = rejection.failure.kind.as_str(), error = %rejection.failure.message, "dead-lettering record");
            let headers = dead_letter_headers(&message, &rejection.failure);
            let letter = dead_letter(&message, rejection);
            let payload = serde_json::to_vec(&letter).expect("dead letters always serialise");
            (shared.voice.config.dlq_topic.as_str(), payload, headers)
        }
    };
    deliver(shared, topic, &message, &payload, extra_headers).await;
    let position = lock(&shared.tracker).finish(&ticket);
    if let Some(position) = position {
        let mut tpl = TopicPartitionList::new();
        let stored = tpl
            .add_partition_offset(&ticket.partition.0, ticket.partition.1, Offset::Offset(position))
            .and_then(|()| shared.consumer.store_offsets(&tpl));
        if let Err(e) = stored {
            // Typically the partition was revoked meanwhile; its new owner re-reads the record.
            tracing::info!(error = %e, position, "offset not stored");
        }
    }
}

/// Produces until the broker acknowledges. Retrying forever is deliberate: giving up would
/// mean either losing the record or committing past it.
async fn deliver(
    shared: &Shared,
    topic: &str,
    source: &OwnedMessage,
    payload: &[u8],
    extra_headers: Vec<(String, Vec<u8>)>,
) {
    let mut headers = OwnedHeaders::new();
    if let Some(h) = source.headers() {
        for header in h.iter() {
            if header.key == "traceparent" || header.key == "tracestate" {
                headers = headers.insert(Header { key: header.key, value: header.value });
            }
        }
    }
    for (key, value) in &extra_headers {
        headers = headers.insert(Header { key, value: Some(value) });
    }
    let mut delay = Duration::from_millis(200);
    loop {
        let mut record = FutureRecord::to(topic).payload(payload).headers(headers.clone());
        if let Some(key) = source.key() {
            record = record.key(key);
        }
        match shared.producer.send(record, Duration::from_secs(30)).await {
            Ok(_) => return,
            Err((e, _)) => {
                tracing::warn!(error = %e, topic, retry_in_ms = delay.as_millis() as u64, "produce failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(10));
            }
        }
    }
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

async fn process(shared: &Shared, message: &OwnedMessage, started: Instant) -> Result<ResultEvent, Rejection> {
    let value = message.payload().ok_or_else(|| {
        Rejection::anonymous(Failure::new(
            ErrorKind::InvalidJson,
            Stage::Parse,
            "record has no value; expected a json request",
        ))
    })?;
    let request = parse_request(value)?;
    tracing::Span::current().record("event_id", request.id.as_str());
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
    if request.task != VOICE {
        return Err(reject(Failure::new(
            ErrorKind::UnknownTask,
            Stage::Parse,
            format!(
                "request task '{}' does not match topic {}, which carries '{VOICE}' requests",
                request.task,
                message.topic()
            ),
        )));
    }
    let options = VoiceOptions::parse(request.options.as_ref()).map_err(reject)?;
    let task = &shared.voice;

    let convert_started = Instant::now();
    let bytes = shared
        .input
        .fetch(&request.input)
        .await
        .map_err(|e| reject(Failure::new(e.kind(), Stage::Fetch, e.to_string())))?;
    let max_seconds = task.config.max_audio_seconds;
    let mut converted = on_pool(&task.pool, move || voice::convert(&bytes, max_seconds))
        .await
        .and_then(|r| r)
        .map_err(reject)?;
    let convert_ms = ms(convert_started.elapsed());

    // The samples move into the tensor, and the tensor into one encoded body that all attempts
    // share: the audio is held once, not once per copy or per retry.
    let samples = std::mem::take(&mut converted.samples);
    let input = Tensor { name: voice::MODEL_INPUT.into(), shape: vec![1, samples.len()], data: TensorData::Fp32(samples) };
    let infer_call = InferCall::new(&request.id, &input, voice::MODEL_OUTPUT);
    drop(input);
    let call = call_worker(shared, &task.permits, &task.config.model, &infer_call).await.map_err(reject)?;
    let output = voice::output(&call.output.data, &converted, &options.params(&task.config.segments));
    Ok(ResultEvent {
        version: SCHEMA_VERSION,
        id: request.id.clone(),
        task: request.task.clone(),
        status: "ok".into(),
        model: call.output.model,
        output: serde_json::to_value(&output).expect("voice output always serialises"),
        timings_ms: TimingsMs {
            convert: convert_ms,
            gpu_wait: call.wait_ms,
            inference: call.inference_ms,
            total: ms(started.elapsed()),
        },
        attempts: call.attempts,
    })
}

/// Reads a request in one pass. Only a record that fails is read again, as loose JSON, to
/// tell "not JSON" from "not a request" and to recover its id and task for the dead letter.
fn parse_request(value: &[u8]) -> Result<RequestEvent, Rejection> {
    let error = match serde_json::from_slice::<RequestEvent>(value) {
        Ok(request) => return Ok(request),
        Err(e) => e,
    };
    let json: serde_json::Value = serde_json::from_slice(value).map_err(|e| {
        Rejection::anonymous(Failure::new(ErrorKind::InvalidJson, Stage::Parse, format!("record value is not json: {e}")))
    })?;
    let hint = |key: &str| json.get(key).and_then(|v| v.as_str()).map(str::to_string);
    Err(Rejection {
        failure: Failure::new(ErrorKind::InvalidRequest, Stage::Parse, format!("record is not a valid request: {error}")),
        id: hint("id"),
        task: hint("task"),
    })
}

/// Runs CPU-bound work on a rayon pool and awaits it without blocking a tokio thread. The
/// caller's span goes along, so the pool's logs carry the record's fields.
async fn on_pool<T: Send + 'static>(
    pool: &rayon::ThreadPool,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Failure> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let span = tracing::Span::current();
    pool.spawn(move || {
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

struct WorkerCall {
    output: crate::worker_client::ModelOutput,
    attempts: u32,
    wait_ms: f64,
    inference_ms: f64,
}

/// Calls the worker under the task's GPU permits, retrying what is worth retrying. The permit
/// is held only during a call, not while backing off.
async fn call_worker(
    shared: &Shared,
    permits: &Semaphore,
    model: &str,
    infer_call: &InferCall,
) -> Result<WorkerCall, Failure> {
    let cfg = &shared.worker_config;
    let max_attempts = cfg.max_attempts.max(1);
    let mut wait_ms = 0.0;
    let mut inference_ms = 0.0;
    for attempt in 1..=max_attempts {
        let wait_started = Instant::now();
        let permit = permits.acquire().await.map_err(|_| {
            Failure::new(ErrorKind::Internal, Stage::Infer, "gpu permits closed").with_attempts(attempt - 1)
        })?;
        wait_ms += ms(wait_started.elapsed());
        let call_started = Instant::now();
        let result = shared
            .worker
            .infer(model, infer_call)
            .instrument(tracing::info_span!("worker_call", attempt))
            .await;
        drop(permit);
        inference_ms += ms(call_started.elapsed());
        let error = match result {
            Ok(output) => return Ok(WorkerCall { output, attempts: attempt, wait_ms, inference_ms }),
            Err(e) => e,
        };
        if !error.is_retryable() || attempt == max_attempts {
            return Err(call_failure(error).with_attempts(attempt));
        }
        let delay = match &error {
            CallError::Unavailable { retry_after: Some(after), .. } => *after,
            _ => backoff(cfg, attempt),
        };
        tracing::warn!(attempt, error = %error, retry_in_ms = delay.as_millis() as u64, "worker call failed; retrying");
        tokio::time::sleep(delay).await;
    }
    unreachable!("the loop returns on its last attempt")
}

fn call_failure(error: CallError) -> Failure {
    let kind = match &error {
        CallError::Rejected { status: 413 | 507, .. } => ErrorKind::InputTooLarge,
        CallError::Rejected { .. } => ErrorKind::WorkerRejected,
        CallError::Unavailable { .. } => ErrorKind::WorkerUnavailable,
        CallError::BadResponse(_) => ErrorKind::Internal,
    };
    Failure::new(kind, Stage::Infer, error.to_string())
}

/// Exponential backoff with "full jitter": a uniform delay in [base·2^(n-1) / 2, base·2^(n-1)],
/// capped, so a crowd of retries after a worker restart spreads out.
fn backoff(cfg: &WorkerEndpoint, attempt: u32) -> Duration {
    let exp = cfg.backoff_base_seconds * 2f64.powi(attempt.saturating_sub(1).min(30) as i32);
    let capped = exp.min(cfg.backoff_max_seconds).max(0.0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let jitter = 0.5 + 0.5 * (f64::from(nanos % 1000) / 1000.0);
    Duration::from_secs_f64(capped * jitter)
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn dead_letter(message: &OwnedMessage, rejection: Rejection) -> DeadLetterEvent {
    use base64::Engine;
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
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
        source: SourceRecord {
            topic: message.topic().to_string(),
            partition: message.partition(),
            offset: message.offset(),
            key_b64: message.key().map(b64),
            value_b64: message.payload().map(b64),
        },
    }
}

/// The headers Spring Kafka's dead-letter publisher writes, so existing tooling reads ours.
fn dead_letter_headers(message: &OwnedMessage, failure: &Failure) -> Vec<(String, Vec<u8>)> {
    vec![
        ("kafka_dlt-original-topic".into(), message.topic().as_bytes().to_vec()),
        ("kafka_dlt-original-partition".into(), message.partition().to_be_bytes().to_vec()),
        ("kafka_dlt-original-offset".into(), message.offset().to_be_bytes().to_vec()),
        ("kafka_dlt-exception-fqcn".into(), failure.kind.as_str().as_bytes().to_vec()),
        ("kafka_dlt-exception-message".into(), failure.message.as_bytes().to_vec()),
        ("vramgate-error-kind".into(), failure.kind.as_str().as_bytes().to_vec()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let cfg = WorkerEndpoint { backoff_base_seconds: 0.1, backoff_max_seconds: 1.0, ..Default::default() };
        for attempt in 1..12 {
            let d = backoff(&cfg, attempt).as_secs_f64();
            let ceiling = (0.1 * 2f64.powi(attempt as i32 - 1)).min(1.0);
            assert!(d <= ceiling + 1e-9 && d >= ceiling / 2.0 - 1e-9, "attempt {attempt}: {d}");
        }
    }

    #[test]
    fn worker_errors_map_to_dead_letter_kinds() {
        let check = |e: CallError, kind: ErrorKind| assert_eq!(call_failure(e).kind, kind);
        check(CallError::Rejected { status: 400, message: "m".into() }, ErrorKind::WorkerRejected);
        check(CallError::Rejected { status: 413, message: "m".into() }, ErrorKind::InputTooLarge);
        check(CallError::Unavailable { message: "m".into(), retry_after: None }, ErrorKind::WorkerUnavailable);
        check(CallError::BadResponse("m".into()), ErrorKind::Internal);
    }
}
