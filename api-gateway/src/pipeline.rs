//! The gateway's run loop. One thread owns the Kafka consumer and only fetches, decides what to
//! pause, and commits; every record is processed concurrently on tokio (see [`crate::record`]).
//!
//! Invariants:
//! - A record's offset is committed only once it and every record before it in its partition
//!   ended in an acknowledged result or dead letter (the watermark of [`OffsetTracker`]), so a
//!   crash loses nothing; it may redo what was in flight.
//! - Work started under an earlier assignment of a partition never moves its commit (epochs);
//!   on revoke, the partition's records get `drain_timeout` to finish before its last commit.
//! - Memory is bounded: past `max_in_flight` records or `max_held_bytes`, or while a task's
//!   records wait past `permit_wait_ms` for a GPU permit, the partitions concerned are paused
//!   (with hysteresis) and the thread keeps polling, so the consumer stays in its group.
//! - CPU-bound conversion runs on each task's rayon pool, never on tokio's threads.
//!
//! [`OffsetTracker`]: crate::offsets::OffsetTracker

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};

use crate::budget::ByteBudget;
use crate::config::GatewayConfig;
use crate::input::InputSource;
use crate::metrics::Metrics;
use crate::offsets::{SharedOffsets, TopicPartition};
use crate::record::{self, Shared};
use crate::task::Task;

/// Why partitions are paused, for the pause metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PauseReason {
    Permits,
    Budget,
    InFlight,
    Shutdown,
}

impl PauseReason {
    fn as_str(self) -> &'static str {
        match self {
            PauseReason::Permits => "permits",
            PauseReason::Budget => "budget",
            PauseReason::InFlight => "in_flight",
            PauseReason::Shutdown => "shutdown",
        }
    }
}

/// Assignment and pause state; touched by the fetch loop and its rebalance callbacks, both on
/// the fetch thread.
#[derive(Debug, Default)]
struct Flow {
    assigned: HashSet<TopicPartition>,
    paused: HashSet<TopicPartition>,
    /// A gateway-wide pause (budget or record count), held until both fall below the resume
    /// fraction of their bounds.
    global: Option<PauseReason>,
}

/// Keeps offsets and flow state in step with partition assignment; drains and commits
/// revoked partitions before they go.
struct RebalanceContext {
    offsets: Arc<SharedOffsets>,
    flow: Arc<Mutex<Flow>>,
    metrics: Arc<Metrics>,
    drain_timeout: Duration,
    /// Set when the gateway leaves for good after its own drain: no second wait on revoke.
    closing: AtomicBool,
}

impl ClientContext for RebalanceContext {}

impl ConsumerContext for RebalanceContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Revoke(tpl) = rebalance else { return };
        let revoked = partitions(tpl);
        let timeout = if self.closing.load(Ordering::SeqCst) { Duration::ZERO } else { self.drain_timeout };
        let left = self.offsets.wait_drained(&revoked, timeout);
        // Commit what finished, then forget the partitions: whatever is still running belongs
        // to the next owner, which reads it again from here.
        let mut commit = TopicPartitionList::new();
        {
            let tracker = self.offsets.lock();
            for tp in &revoked {
                if let Some(position) = tracker.position(tp) {
                    let _ = commit.add_partition_offset(&tp.0, tp.1, Offset::Offset(position));
                }
            }
        }
        if commit.count() > 0 {
            let result = consumer.commit(&commit, CommitMode::Sync);
            self.count_commit(&result);
            if let Err(e) = result {
                tracing::warn!(error = %e, "commit of revoked partitions failed; their new owner may redo some records");
            }
        }
        self.offsets.lock().revoke(revoked.iter());
        let mut flow = lock(&self.flow);
        for tp in &revoked {
            flow.assigned.remove(tp);
            flow.paused.remove(tp);
            let _ = self.metrics.pending.remove_label_values(&[&tp.0, &tp.1.to_string()]);
        }
        tracing::info!(partitions = ?revoked, abandoned = left, "partitions revoked");
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Assign(tpl) = rebalance else { return };
        let assigned = partitions(tpl);
        tracing::info!(partitions = ?assigned, "partitions assigned");
        self.offsets.lock().assign(assigned.iter().cloned());
        lock(&self.flow).assigned.extend(assigned);
    }
}

impl RebalanceContext {
    fn count_commit(&self, result: &Result<(), KafkaError>) {
        let label = if result.is_ok() { "ok" } else { "error" };
        self.metrics.commits.with_label_values(&[label]).inc();
    }
}

fn partitions(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements().iter().map(|e| (e.topic().to_string(), e.partition())).collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs the gateway until `shutdown` resolves, then stops fetching, lets in-flight records
/// finish (up to the shutdown timeout), commits what finished and leaves the group.
pub async fn run(
    config: GatewayConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    config.validate().map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))?;
    let metrics = Metrics::new();
    metrics.held_bytes_limit.set(i64::try_from(config.max_held_bytes).unwrap_or(i64::MAX));

    let mut tasks = Vec::new();
    for (name, task_config) in config.enabled_tasks() {
        tasks.push(Arc::new(Task::new(name, task_config, &config.worker)?));
    }
    let by_topic: HashMap<String, Arc<Task>> =
        tasks.iter().map(|t| (t.requests_topic.clone(), t.clone())).collect();

    let offsets = Arc::new(SharedOffsets::default());
    let flow = Arc::new(Mutex::new(Flow::default()));
    let consumer: BaseConsumer<RebalanceContext> = client_config(&config, true)
        .create_with_context(RebalanceContext {
            offsets: offsets.clone(),
            flow: flow.clone(),
            metrics: metrics.clone(),
            drain_timeout: config.drain_timeout(),
            closing: AtomicBool::new(false),
        })
        .context("creating the kafka consumer")?;
    let producer: FutureProducer = client_config(&config, false).create().context("creating the kafka producer")?;
    let input = InputSource::new(&config.input.file_root, config.input.max_input_bytes)
        .with_context(|| format!("input root {}", config.input.file_root.display()))?;
    let shared = Arc::new(Shared {
        producer,
        offsets,
        input,
        budget: ByteBudget::new(config.max_held_bytes),
        metrics: metrics.clone(),
        in_flight: Default::default(),
    });

    let topics: Vec<&str> = tasks.iter().map(|t| t.requests_topic.as_str()).collect();
    consumer.subscribe(&topics).context("subscribing to the request topics")?;

    let addr = {
        let shared = shared.clone();
        let tasks = tasks.clone();
        crate::metrics::serve(&config.metrics_listen, metrics.clone(), move || refresh_gauges(&shared, &tasks)).await?
    };
    // The one line on stdout: how a supervisor or test finds the metrics port when it was 0.
    println!("metrics on {addr}");
    let _ = std::io::stdout().flush();
    tracing::info!(
        topics = ?topics,
        group = %config.kafka.group_id,
        input_root = %shared.input.root().display(),
        metrics = %addr,
        "api-gateway consuming"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let fetcher = {
        let stop = stop.clone();
        let runtime = tokio::runtime::Handle::current();
        std::thread::Builder::new()
            .name("kafka-fetch".into())
            .spawn(move || {
                let mut fetch = Fetch { consumer, shared, by_topic, flow, runtime, config, tasks };
                fetch.run(&stop);
            })
            .context("starting the fetch thread")?
    };
    shutdown.await;
    tracing::info!("shutting down: fetching stops, in-flight records finish");
    stop.store(true, Ordering::SeqCst);
    tokio::task::spawn_blocking(move || fetcher.join())
        .await
        .context("joining the fetch thread")?
        .map_err(|_| anyhow::anyhow!("the fetch thread panicked"))?;
    Ok(())
}

fn refresh_gauges(shared: &Shared, tasks: &[Arc<Task>]) {
    let m = &shared.metrics;
    m.held_bytes.set(i64::try_from(shared.budget.used()).unwrap_or(i64::MAX));
    for task in tasks {
        m.permit_limit.with_label_values(&[&task.name]).set(task.permits.limit() as i64);
    }
}

fn client_config(config: &GatewayConfig, consumer: bool) -> ClientConfig {
    let kafka = &config.kafka;
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &kafka.brokers);
    if consumer {
        c.set("group.id", &kafka.group_id)
            // Offsets are committed by the fetch loop, only up to the finished watermark.
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("partition.assignment.strategy", "cooperative-sticky")
            // With a small prefetch bound, librdkafka's default 1 s backoff once the queue is
            // full leaves the gateway idle between refills.
            .set("fetch.queue.backoff.ms", "20")
            .set("fetch.wait.max.ms", "100")
            .set("fetch.error.backoff.ms", "50")
            .set("session.timeout.ms", kafka.session_timeout_ms.to_string())
            // librdkafka's prefetch, bounded in bytes, not only in messages.
            .set("queued.max.messages.kbytes", kafka.queue_max_kbytes.max(1).to_string())
            .set("fetch.max.bytes", kafka.fetch_max_bytes.max(1024).to_string())
            .set("max.partition.fetch.bytes", kafka.partition_fetch_max_bytes.max(1024).to_string());
    } else {
        c.set("enable.idempotence", "true").set("acks", "all").set("linger.ms", "5");
    }
    for (k, v) in &kafka.properties {
        c.set(k, v);
    }
    c
}

/// The fetch thread's state.
struct Fetch {
    consumer: BaseConsumer<RebalanceContext>,
    shared: Arc<Shared>,
    by_topic: HashMap<String, Arc<Task>>,
    flow: Arc<Mutex<Flow>>,
    runtime: tokio::runtime::Handle,
    config: GatewayConfig,
    tasks: Vec<Arc<Task>>,
}

impl Fetch {
    fn run(&mut self, stop: &AtomicBool) {
        let commit_interval = Duration::from_millis(self.config.commit_interval_ms.max(1));
        let mut last_commit = Instant::now();
        let mut stopping_since: Option<Instant> = None;
        let mut last_error: Option<Instant> = None;
        loop {
            if stopping_since.is_none() && stop.load(Ordering::SeqCst) {
                stopping_since = Some(Instant::now());
            }
            if let Some(since) = stopping_since {
                let left = self.shared.in_flight.load(Ordering::SeqCst);
                if left == 0 {
                    break;
                }
                if since.elapsed() > self.config.shutdown_timeout() {
                    tracing::warn!(abandoned = left, "shutdown timeout reached; unfinished records will be redelivered");
                    break;
                }
            }
            match self.consumer.poll(Duration::from_millis(50)) {
                None => {}
                Some(Ok(message)) => self.dispatch(message.detach()),
                // Broker hiccups repeat every poll; say it once a second.
                Some(Err(e)) if last_error.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) => {
                    tracing::warn!(error = %e, "kafka consumer error");
                    last_error = Some(Instant::now());
                }
                Some(Err(_)) => {}
            }
            self.update_flow(stopping_since.is_some());
            if last_commit.elapsed() >= commit_interval {
                self.commit(CommitMode::Async);
                last_commit = Instant::now();
            }
        }
        self.commit(CommitMode::Sync);
        self.consumer.context().closing.store(true, Ordering::SeqCst);
        self.consumer.unsubscribe();
        // Serve the revoke that unsubscribing triggers, so the group rebalances now rather
        // than after the session timeout.
        let deadline = Instant::now() + Duration::from_secs(2);
        while !lock(&self.flow).assigned.is_empty() && Instant::now() < deadline {
            let _ = self.consumer.poll(Duration::from_millis(50));
        }
        tracing::info!("offsets committed; bye");
    }

    fn dispatch(&self, message: rdkafka::message::OwnedMessage) {
        let Some(task) = self.by_topic.get(message.topic()) else {
            tracing::error!(topic = message.topic(), "record from a topic no task reads; skipped");
            return;
        };
        let (ticket, held) = record::admit(&self.shared, task, &message);
        self.runtime.spawn(record::handle(self.shared.clone(), task.clone(), message, ticket, held));
    }

    /// Pauses and resumes partitions to match what the budget, record count and permits allow.
    fn update_flow(&self, stopping: bool) {
        let config = &self.config;
        let budget = &self.shared.budget;
        let used = budget.used();
        // Records past the last commit, not only those unfinished: that is what bounds the
        // duplicates after a crash, and what lets a record waiting to retry hold its partition
        // back by at most this window.
        let in_flight = self.shared.offsets.lock().uncommitted().max(self.shared.in_flight.load(Ordering::SeqCst));
        self.shared.metrics.uncommitted.set(in_flight as i64);
        let rf = config.resume_fraction;
        let mut flow = lock(&self.flow);
        flow.global = match flow.global {
            Some(reason) => {
                let calm = used as f64 <= budget.limit() as f64 * rf
                    && !budget.contended()
                    && in_flight as f64 <= config.max_in_flight as f64 * rf;
                (!calm).then_some(reason)
            }
            None if used >= budget.limit() || budget.contended() => Some(PauseReason::Budget),
            None if in_flight >= config.max_in_flight => Some(PauseReason::InFlight),
            None => None,
        };
        let congested: HashSet<&str> =
            self.tasks.iter().filter(|t| t.congested(rf)).map(|t| t.requests_topic.as_str()).collect();
        let reason_for = |tp: &TopicPartition| {
            if stopping {
                Some(PauseReason::Shutdown)
            } else if let Some(global) = flow.global {
                Some(global)
            } else {
                congested.contains(tp.0.as_str()).then_some(PauseReason::Permits)
            }
        };
        let mut pause = TopicPartitionList::new();
        let mut resume = TopicPartitionList::new();
        let mut newly_paused = Vec::new();
        let mut resumed = Vec::new();
        for tp in &flow.assigned {
            match (reason_for(tp), flow.paused.contains(tp)) {
                (Some(reason), false) => {
                    let _ = pause.add_partition_offset(&tp.0, tp.1, Offset::Invalid);
                    newly_paused.push((tp.clone(), reason));
                }
                (None, true) => {
                    let _ = resume.add_partition_offset(&tp.0, tp.1, Offset::Invalid);
                    resumed.push(tp.clone());
                }
                _ => {}
            }
        }
        if newly_paused.is_empty() && resumed.is_empty() {
            return;
        }
        if pause.count() > 0 {
            if let Err(e) = self.consumer.pause(&pause) {
                tracing::warn!(error = %e, "pausing partitions failed");
            }
        }
        if resume.count() > 0 {
            if let Err(e) = self.consumer.resume(&resume) {
                tracing::warn!(error = %e, "resuming partitions failed");
            }
        }
        let metrics = &self.shared.metrics;
        for (tp, reason) in newly_paused {
            let task = self.task_name(&tp.0);
            metrics.pauses.with_label_values(&[task, reason.as_str()]).inc();
            tracing::debug!(topic = %tp.0, partition = tp.1, reason = reason.as_str(), "partition paused");
            flow.paused.insert(tp);
        }
        for tp in resumed {
            metrics.resumes.with_label_values(&[self.task_name(&tp.0)]).inc();
            tracing::debug!(topic = %tp.0, partition = tp.1, "partition resumed");
            flow.paused.remove(&tp);
        }
        for task in &self.tasks {
            let paused = flow.paused.iter().filter(|tp| tp.0 == task.requests_topic).count();
            metrics.paused.with_label_values(&[&task.name]).set(paused as i64);
        }
    }

    fn task_name(&self, topic: &str) -> &str {
        self.by_topic.get(topic).map_or("unknown", |t| t.name.as_str())
    }

    /// Commits the partitions whose finished watermark advanced, and refreshes the per-partition
    /// pending gauge.
    fn commit(&self, mode: CommitMode) {
        let (advanced, pending) = {
            let mut tracker = self.shared.offsets.lock();
            let pending: Vec<(TopicPartition, usize)> = tracker.pending().map(|(tp, n)| (tp.clone(), n)).collect();
            (tracker.take_advanced(), pending)
        };
        for (tp, n) in pending {
            self.shared.metrics.pending.with_label_values(&[&tp.0, &tp.1.to_string()]).set(n as i64);
        }
        if advanced.is_empty() {
            return;
        }
        let mut tpl = TopicPartitionList::new();
        for (tp, position) in &advanced {
            let _ = tpl.add_partition_offset(&tp.0, tp.1, Offset::Offset(*position));
        }
        let result = self.consumer.commit(&tpl, mode);
        self.consumer.context().count_commit(&result);
        if let Err(e) = result {
            tracing::warn!(error = %e, "offset commit failed; it is tried again");
            self.shared.offsets.lock().untake(&advanced);
        }
    }
}
