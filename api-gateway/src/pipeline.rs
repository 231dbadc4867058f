//! The gateway's start-up and shutdown: builds the tasks, the Kafka clients and the metrics
//! endpoint, starts the fetch thread and the commit thread ([`crate::consume`]), and on
//! SIGTERM lets in-flight records finish before the last commit. Every record is processed
//! concurrently on tokio (see [`crate::record`]); CPU-bound conversion runs on each task's
//! rayon pool, never on tokio's threads.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use vramgate_shared::telemetry::bounded;

use crate::consume::client::KafkaEvents;
use crate::health::{self, Health};
use rdkafka::ClientConfig;

use crate::budget::ByteBudget;
use crate::config::{Delivery, GatewayConfig, GroupProtocol};
use crate::consume::commit::{self, Commits, Writer};
use crate::consume::transaction::{MakeProducer, Outbox, Transactional};
use crate::consume::verify::{self, Ledger};
use crate::consume::fetch::Fetch;
use crate::consume::offsets::SharedOffsets;
use crate::consume::flow::Flow;
use crate::consume::rebalance::RebalanceContext;
use crate::input::objects::ObjectInputs;
use crate::storage::buckets::Buckets;
use crate::input::InputSource;
use crate::produce::{Outputs, Producer};
use crate::metrics::Metrics;
use crate::model_check;
use crate::record::{Output, Shared};
use crate::task::Task;

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
        tasks.push(Arc::new(Task::new(name, task_config, &config.worker, metrics.clone())?));
    }
    let by_topic: HashMap<String, Arc<Task>> =
        tasks.iter().map(|t| (t.requests_topic.clone(), t.clone())).collect();

    let health = Arc::new(Health::default());
    let offsets = Arc::new(SharedOffsets::default());
    let flow = Arc::new(Mutex::new(Flow::default()));
    let connection = config.kafka.connection();
    let debugging = config.kafka.properties.get("debug").is_some();
    // Exactly-once: the outputs wait in the outbox for the commit thread's transactions, and
    // the producer is transactional and the commit thread's alone.
    let verifier_stop = Arc::new(AtomicBool::new(false));
    let mut verifier: Option<std::thread::JoinHandle<()>> = None;
    let (writer, output) = match config.delivery {
        Delivery::AtLeastOnce => {
            let producer: Producer = connection.create_with_context(
                client_defaults(&config, Client::Producer),
                Outputs(KafkaEvents::new(health.clone(), metrics.clone(), debugging)),
                "the kafka producer",
            )?;
            (Writer::Offsets, Output::Direct(producer))
        }
        Delivery::ExactlyOnce => {
            let outbox = Arc::new(Outbox::default());
            let make: MakeProducer = {
                let (connection, health, metrics) = (connection.clone(), health.clone(), metrics.clone());
                let defaults = client_defaults(&config, Client::TransactionalProducer);
                Box::new(move || {
                    connection
                        .create_with_context(
                            defaults.clone(),
                            Outputs(KafkaEvents::new(health.clone(), metrics.clone(), debugging)),
                            "the transactional kafka producer",
                        )
                        .map_err(|e| {
                            tracing::error!(error = %e, "making the transactional producer");
                            KafkaError::ClientCreation(bounded(&e.to_string(), 512).to_string())
                        })
                })
            };
            let timeout = Duration::from_millis(config.kafka.transaction_timeout_ms);
            let ledger = if config.kafka.verify_outputs {
                let reader: BaseConsumer<KafkaEvents> = connection.create_with_context(
                    verifier_defaults(&config),
                    KafkaEvents::new(health.clone(), metrics.clone(), debugging),
                    "the kafka reader of committed outputs",
                )?;
                let ledger = Arc::new(Ledger::new(metrics.clone(), timeout));
                let (l, stop) = (ledger.clone(), verifier_stop.clone());
                verifier = Some(
                    std::thread::Builder::new()
                        .name("kafka-verify".into())
                        .spawn(move || verify::run(l, reader, stop))
                        .context("starting the thread that reads back committed outputs")?,
                );
                Some(ledger)
            } else {
                None
            };
            let transactional = Transactional::start(make, outbox.clone(), metrics.clone(), timeout, ledger).with_context(|| {
                format!("initialising transactions as {:?}", config.kafka.transactional_id())
            })?;
            tracing::info!(transactional_id = %config.kafka.transactional_id(), "exactly-once delivery");
            (Writer::Transactions(Box::new(transactional)), Output::Transactional(outbox))
        }
    };
    let commits = Arc::new(Commits::new(offsets.clone(), metrics.clone(), writer));
    let consumer: BaseConsumer<RebalanceContext> = connection.create_with_context(
        client_defaults(&config, Client::Consumer),
        RebalanceContext {
            events: KafkaEvents::new(health.clone(), metrics.clone(), debugging),
            commits: commits.clone(),
            flow: flow.clone(),
            metrics: metrics.clone(),
            drain_timeout: config.drain_timeout(),
            closing: AtomicBool::new(false),
        },
        "the kafka consumer",
    )?;
    // A client per bucket: those events may name, and those [[outputs]] rows store to.
    let store_buckets = config.enabled_tasks().flat_map(|(_, task)| task.output_rules().filter_map(|rule| rule.store.as_ref().map(|t| t.bucket.clone()))).collect::<Vec<_>>();
    let buckets = Arc::new(Buckets::new(&config.s3, store_buckets)?);
    let input = InputSource::new(&config.input.file_root, config.input.max_input_bytes, config.input.read_timeout())
        .with_context(|| format!("input root {}", config.input.file_root.display()))?
        .with_objects(ObjectInputs::new(&config.s3, &config.input.http, &buckets)?);
    let shared = Arc::new(Shared {
        output,
        offsets,
        input,
        buckets,
        budget: ByteBudget::new(config.max_held_bytes),
        metrics: metrics.clone(),
        in_flight: Default::default(),
        group_id: config.kafka.group_id.clone(),
        runtime: tokio::runtime::Handle::current(),
    });

    let topics: Vec<&str> = tasks.iter().map(|t| t.requests_topic.as_str()).collect();
    consumer.subscribe(&topics).context("subscribing to the request topics")?;

    let addr = {
        let shared = shared.clone();
        let tasks = tasks.clone();
        let health = health.clone();
        crate::endpoint::serve(&config.metrics_listen, metrics.clone(), health, move || refresh_gauges(&shared, &tasks))
            .await?
    };
    // The one line on stdout: how a supervisor or test finds the metrics port when it was 0.
    println!("metrics on {addr}");
    let _ = std::io::stdout().flush();
    let consumer = Arc::new(consumer);
    let checks = {
        let mut topics: Vec<String> = Vec::new();
        for task in &tasks {
            topics.extend([task.requests_topic.clone(), task.results_topic.clone(), task.dlq_topic.clone()]);
        }
        let workers = tasks.iter().flat_map(|t| t.stages.iter().cloned()).collect();
        tokio::spawn(health::run_checks(health.clone(), consumer.clone(), topics, workers))
    };
    let discovery: Vec<_> = tasks
        .iter()
        .map(|t| tokio::spawn(crate::call::discovery::maintain(t.stages.clone(), t.worker_source.clone())))
        .collect();
    // Nothing is consumed before the tasks are checked against their models (or the wait for
    // the workers' answers is over): a task that does not fit stops the gateway here.
    tokio::pin!(shutdown);
    let unchecked = tokio::select! {
        checked = model_check::at_start(model_check::pending(&tasks), config.worker.model_check_wait()) => checked,
        () = &mut shutdown => {
            checks.abort();
            discovery.iter().for_each(|d| d.abort());
            return Ok(());
        }
    };
    let unchecked = match unchecked {
        Ok(unchecked) => unchecked,
        Err(misfits) => {
            tracing::error!(misfits = %misfits, "tasks do not fit their models; stopping");
            anyhow::bail!("tasks do not fit their models:\n{misfits}");
        }
    };
    let (misfit_found, mut misfit) = tokio::sync::oneshot::channel();
    let later_checks = tokio::spawn(model_check::later(unchecked, misfit_found));
    let watch = tokio::spawn(model_check::watch(model_check::pending(&tasks)));
    // The CPU pools' threads make the buffers other threads drop (`crate::memory`).
    let collector = {
        let (tasks, metrics) = (tasks.clone(), metrics.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(crate::memory::COLLECT_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                tasks.iter().for_each(|t| crate::memory::collect_pool(&t.pool));
                metrics.set_allocator_bytes(crate::memory::allocator_bytes());
            }
        })
    };
    tracing::info!(
        topics = ?topics,
        group = %config.kafka.group_id,
        input_root = %shared.input.root().display(),
        metrics = %addr,
        "api-gateway consuming"
    );
    let stop = Arc::new(AtomicBool::new(false));
    let stop_commits = Arc::new(AtomicBool::new(false));
    let committer = {
        let consumer = consumer.clone();
        let stop = stop_commits.clone();
        let policy = commit::Policy::new(config.commit_interval_ms, config.max_in_flight);
        std::thread::Builder::new()
            .name("kafka-commit".into())
            .spawn(move || commit::run(&*consumer, &commits, policy, &stop))
            .context("starting the commit thread")?
    };
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
    // A task checked late (no worker answered at start-up) that does not fit stops the
    // gateway like a signal, then fails it.
    let misfits = tokio::select! {
        () = &mut shutdown => None,
        Ok(misfits) = &mut misfit => {
            tracing::error!(misfits = %misfits, "tasks do not fit their models; stopping");
            Some(misfits)
        }
    };
    later_checks.abort();
    watch.abort();
    collector.abort();
    tracing::info!("shutting down: fetching stops, in-flight records finish");
    stop.store(true, Ordering::SeqCst);
    tokio::task::spawn_blocking(move || fetcher.join())
        .await
        .context("joining the fetch thread")?
        .map_err(|_| anyhow::anyhow!("the fetch thread panicked"))?;
    checks.abort();
    discovery.iter().for_each(|d| d.abort());
    stop_commits.store(true, Ordering::SeqCst);
    tokio::task::spawn_blocking(move || committer.join())
        .await
        .context("joining the commit thread")?
        .map_err(|_| anyhow::anyhow!("the commit thread panicked"))?;
    // The fetch thread waited for its last transaction's outputs to be read back.
    verifier_stop.store(true, Ordering::SeqCst);
    if let Some(verifier) = verifier {
        tokio::task::spawn_blocking(move || verifier.join())
            .await
            .context("joining the thread that reads back committed outputs")?
            .map_err(|_| anyhow::anyhow!("the thread that reads back committed outputs panicked"))?;
    }
    match misfits {
        Some(misfits) => anyhow::bail!("tasks do not fit their models:\n{misfits}"),
        None => Ok(()),
    }
}

fn refresh_gauges(shared: &Shared, tasks: &[Arc<Task>]) {
    let m = &shared.metrics;
    m.held_bytes.set(i64::try_from(shared.budget.used()).unwrap_or(i64::MAX));
    if let Output::Transactional(outbox) = &shared.output {
        m.outbox.set(outbox.waiting() as i64);
    }
    for task in tasks {
        m.permit_limit.with_label_values(&[&task.name]).set(task.workers().permit_limit() as i64);
        task.stages.iter().for_each(|set| set.publish());
    }
    for (tp, n) in shared.offsets.lock().pending() {
        m.pending.with_label_values(&[&tp.0, &tp.1.to_string()]).set(n as i64);
    }
}

/// The reader of committed outputs (exactly-once delivery, `kafka.verify_outputs`): only what a
/// `read_committed` reader is handed, the end of a partition reported, and a small prefetch (it
/// reads one partition at a time, from a known offset). It assigns partitions itself and never
/// joins or commits to its group, but librdkafka takes no assignment without a `group.id`.
fn verifier_defaults(config: &GatewayConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("group.id", format!("{}.verify", config.kafka.group_id))
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .set("fetch.wait.max.ms", "50")
        .set("queued.max.messages.kbytes", config.kafka.queue_max_kbytes.clamp(1, 16 * 1024).to_string())
        .set("fetch.max.bytes", config.kafka.fetch_max_bytes.max(1024).to_string())
        .set("max.partition.fetch.bytes", config.kafka.partition_fetch_max_bytes.max(1024).to_string());
    c
}

/// Which of the gateway's Kafka clients.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Client {
    Consumer,
    Producer,
    TransactionalProducer,
}

/// The gateway's own defaults for its consumer or its producer; [`vramgate_shared::kafka::Connection`]
/// adds the brokers and `[kafka.properties]` over them.
fn client_defaults(config: &GatewayConfig, client: Client) -> ClientConfig {
    let kafka = &config.kafka;
    let mut c = ClientConfig::new();
    if client == Client::TransactionalProducer {
        // Idempotent and acks=all come with transactions. The linger is the transaction's
        // own: its outputs are produced together and flushed by its commit.
        // retry.backoff.ms 10, not librdkafka's 100: right after a commit the coordinator is
        // still writing its markers and answers the next transaction's offsets with
        // CONCURRENT_TRANSACTIONS, and each retry waits this long. At 100 ms a transaction
        // took 107 ms on a local broker, at 10 ms 18 ms (Kafka's Java client lowered its own
        // for the same reason, KAFKA-5477).
        c.set("transactional.id", kafka.transactional_id())
            .set("transaction.timeout.ms", kafka.transaction_timeout_ms.to_string())
            .set("acks", "all")
            .set("linger.ms", "2")
            .set("retry.backoff.ms", "10");
    } else if client == Client::Consumer {
        c.set("group.id", &kafka.group_id)
            // Offsets are committed by the fetch loop, only up to the finished watermark.
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            // With a small prefetch bound, librdkafka's default 1 s backoff once the queue is
            // full leaves the gateway idle between refills.
            .set("fetch.queue.backoff.ms", "20")
            .set("fetch.wait.max.ms", "100")
            .set("fetch.error.backoff.ms", "50")
            // librdkafka's prefetch, bounded in bytes, not only in messages.
            .set("queued.max.messages.kbytes", kafka.queue_max_kbytes.max(1).to_string())
            .set("fetch.max.bytes", kafka.fetch_max_bytes.max(1024).to_string())
            .set("max.partition.fetch.bytes", kafka.partition_fetch_max_bytes.max(1024).to_string())
            // Statistics feed the consumer-lag gauge (`consume::rebalance`, `stats`).
            .set("statistics.interval.ms", crate::consume::rebalance::LAG_INTERVAL_MS.to_string());
        match kafka.group_protocol {
            GroupProtocol::Classic => {
                c.set("group.protocol", "classic")
                    .set("partition.assignment.strategy", "cooperative-sticky")
                    .set("session.timeout.ms", kafka.session_timeout_ms.to_string());
            }
            // The assignor and the session are the broker's; librdkafka refuses a client that
            // sets either with this protocol. Partitions come and go one by one, as with
            // cooperative-sticky (`consume::rebalance` serves both alike).
            GroupProtocol::Consumer => {
                c.set("group.protocol", "consumer");
            }
        }
    } else {
        // acks=all: an output counts as written (and its record may be committed) only once
        // every in-sync replica has it. Not librdkafka's idempotent mode: up to 2.12 it lets a
        // partition have one produce request in flight and busy-polls while it waits
        // (docs/performance-notes.md, gateway cause 6), which cost a fifth of the gateway's CPU.
        // What it would add, no duplicate from librdkafka's own retries, is already outside
        // the at-least-once contract: a gateway restart redoes records too, and consumers
        // dedupe by event id. `enable.idempotence = true` in [kafka.properties] turns it on.
        // linger.ms 2: a record's commit waits for its output's acknowledgement, and the
        // in-flight window for that commit, so the linger is paid by every record of the window
        // (gateway cause 13); 2 ms moved more records a second than 5 in paired runs, at the
        // same CPU per record.
        c.set("acks", "all")
            .set("linger.ms", "2")
            .set("max.in.flight.requests.per.connection", "5");
    }
    c
}

