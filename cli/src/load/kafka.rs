//! The load generator's Kafka side: sending request events (stamped with their send time),
//! following the output topics from where they ended when the run began, and the gateway
//! group's lag (request topics' ends minus its committed offsets).
//!
//! Every consumer here reads with `isolation.level=read_committed` unless the properties say
//! otherwise ([`crate::outputs`]): the follower sees only committed outputs (so in exactly-once
//! delivery an aborted transaction's outputs are neither results nor duplicates), and a
//! partition's end is its last stable offset, which a `read_committed` reader can reach.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use vramgate_shared::events::{InputRef, RequestEvent, SCHEMA_VERSION};

use super::tally::{Output, Tally};
use vramgate_shared::kafka::Connection;

/// Most sends awaiting the broker's acknowledgement at once.
pub const MAX_SENDS_IN_FLIGHT: usize = 1024;
/// How long one metadata, watermark or offset request may take.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one send may wait for its acknowledgement (librdkafka retries within it).
const SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// Milliseconds since the epoch (Kafka's timestamps).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// A task's three topics.
#[derive(Debug, Clone)]
pub struct TaskTopics {
    pub requests: String,
    pub results: String,
    pub dlq: String,
}

impl TaskTopics {
    pub fn new(base: &str) -> Self {
        TaskTopics { requests: format!("{base}.requests"), results: format!("{base}.results"), dlq: format!("{base}.dlq") }
    }
}

type Partition = (String, i32);

/// A consumer in `group` that commits nothing and reads `read_committed` (over which the
/// connection's properties are laid).
fn consumer<C: rdkafka::config::FromClientConfig>(kafka: &Connection, group: &str) -> anyhow::Result<C> {
    kafka.create(crate::outputs::reader_defaults(group), "a kafka consumer")
}

/// The partitions of `topics`, failing with the name of one that does not exist.
fn partitions(consumer: &BaseConsumer, topics: &[String]) -> anyhow::Result<Vec<Partition>> {
    let mut out = Vec::new();
    for topic in topics {
        let metadata = consumer.fetch_metadata(Some(topic), KAFKA_TIMEOUT).with_context(|| format!("reading metadata of {topic}"))?;
        let found = metadata.topics().first().filter(|t| t.error().is_none() && !t.partitions().is_empty());
        let Some(found) = found else {
            bail!("topic {topic} does not exist: create it (scripts/broker create-topics) or name the task's topics with --topic-base");
        };
        out.extend(found.partitions().iter().map(|p| (topic.clone(), p.id())));
    }
    Ok(out)
}

/// Where each partition ends now: its high watermark, or for a `read_committed` consumer its
/// last stable offset (librdkafka asks the broker with the consumer's isolation level).
fn ends(consumer: &BaseConsumer, partitions: &[Partition]) -> anyhow::Result<HashMap<Partition, i64>> {
    partitions
        .iter()
        .map(|(topic, p)| {
            let (_, high) = consumer.fetch_watermarks(topic, *p, KAFKA_TIMEOUT).with_context(|| format!("watermarks of {topic}/{p}"))?;
            Ok(((topic.clone(), *p), high))
        })
        .collect()
}

fn output_topics(topics: &[(String, TaskTopics)]) -> Vec<String> {
    topics.iter().flat_map(|(_, t)| [t.results.clone(), t.dlq.clone()]).collect()
}

/// Where every output partition of `topics` ends now.
pub async fn output_ends(kafka: &Connection, topics: &[(String, TaskTopics)]) -> anyhow::Result<HashMap<Partition, i64>> {
    let consumer: BaseConsumer = consumer(kafka, "vramgate-load-watermarks")?;
    let names = output_topics(topics);
    tokio::task::spawn_blocking(move || ends(&consumer, &partitions(&consumer, &names)?)).await?
}

/// Sends request events.
pub struct Sender {
    producer: FutureProducer,
}

impl Sender {
    pub fn new(kafka: &Connection) -> anyhow::Result<Self> {
        let mut defaults = ClientConfig::new();
        defaults.set("enable.idempotence", "true").set("linger.ms", "5");
        let producer = kafka.create(defaults, "the kafka producer")?;
        Ok(Sender { producer })
    }

    /// Sends one event for `path` to `topic`, stamped `timestamp_ms`; on failure the event is
    /// taken back out of `tally` (the broker never had it).
    pub fn send(
        &self,
        topic: String,
        task: String,
        id: String,
        path: PathBuf,
        timestamp_ms: i64,
        tally: Arc<Mutex<Tally>>,
    ) -> impl std::future::Future<Output = anyhow::Result<()>> {
        let producer = self.producer.clone();
        async move {
            let event = RequestEvent {
                version: SCHEMA_VERSION,
                id: id.clone(),
                task: task.clone(),
                input: InputRef::Uri { uri: format!("file://{}", path.display()) },
                options: None,
            };
            let payload = serde_json::to_vec(&event)?;
            let record = FutureRecord::to(&topic).key(&id).payload(&payload).timestamp(timestamp_ms);
            if let Err((e, _)) = producer.send(record, SEND_TIMEOUT).await {
                tally.lock().unwrap_or_else(|p| p.into_inner()).unsent(&task, &id);
                return Err(anyhow!("producing to {topic}: {e}"));
            }
            Ok(())
        }
    }
}

/// Reads the output topics from where they ended at start, into the tally.
pub struct Follower {
    /// The offset after the last record read, per output partition, and where reading began.
    positions: Arc<Mutex<HashMap<Partition, i64>>>,
    started_at: HashMap<Partition, i64>,
    /// The consumer, for its positions: past the transaction markers, which no record shows.
    stream: Arc<StreamConsumer>,
    task: tokio::task::JoinHandle<()>,
}

impl Follower {
    /// Checks that every topic exists and starts reading the output topics at their ends.
    pub async fn start(kafka: &Connection, topics: &[(String, TaskTopics)], tally: Arc<Mutex<Tally>>) -> anyhow::Result<Self> {
        let names = output_topics(topics);
        let requests: Vec<String> = topics.iter().map(|(_, t)| t.requests.clone()).collect();
        let probe: BaseConsumer = consumer(kafka, "vramgate-load-watermarks")?;
        let started_at = tokio::task::spawn_blocking(move || {
            partitions(&probe, &requests)?;
            ends(&probe, &partitions(&probe, &names)?)
        })
        .await??;
        let stream: Arc<StreamConsumer> =
            Arc::new(consumer(kafka, &format!("vramgate-load-{}", uuid::Uuid::new_v4().simple()))?);
        let mut assignment = TopicPartitionList::new();
        for ((topic, p), end) in &started_at {
            assignment.add_partition_offset(topic, *p, Offset::Offset(*end))?;
        }
        stream.assign(&assignment).context("assigning the output partitions")?;
        let by_topic: HashMap<String, (String, bool)> = topics
            .iter()
            .flat_map(|(task, t)| [(t.results.clone(), (task.clone(), false)), (t.dlq.clone(), (task.clone(), true))])
            .collect();
        let positions = Arc::new(Mutex::new(HashMap::new()));
        let shared_positions = positions.clone();
        let reader = stream.clone();
        let task = tokio::spawn(async move {
            let stream = reader;
            let mut last_warning = None;
            loop {
                let message = match stream.recv().await {
                    Ok(m) => m,
                    Err(e) => {
                        // librdkafka retries by itself (a broker away, a leader moving); say so
                        // now and then, and keep reading.
                        if last_warning.is_none_or(|at: std::time::Instant| at.elapsed() > Duration::from_secs(5)) {
                            eprintln!("load: reading outputs: {e} (retrying)");
                            last_warning = Some(std::time::Instant::now());
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
                let Some((task, dead)) = by_topic.get(message.topic()) else { continue };
                let value: serde_json::Value =
                    message.payload().and_then(|p| serde_json::from_slice(p).ok()).unwrap_or_default();
                if let Some(id) = value.get("id").and_then(|i| i.as_str()) {
                    let output = if *dead {
                        Output::DeadLetter(value["error"]["kind"].as_str().unwrap_or("unknown").to_string())
                    } else {
                        Output::Result
                    };
                    let at = message.timestamp().to_millis().unwrap_or_else(now_ms);
                    tally.lock().unwrap_or_else(|p| p.into_inner()).output(task, id, output, at);
                }
                shared_positions
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert((message.topic().to_string(), message.partition()), message.offset() + 1);
            }
        });
        Ok(Follower { positions, started_at, stream, task })
    }

    /// Whether every partition has been read up to `ends`.
    pub fn reached(&self, ends: &HashMap<Partition, i64>) -> bool {
        // The consumer's position passes the commit and abort markers of transactions, which
        // take an offset each and are never handed out as records: after a partition's last
        // transaction, the offset after its last record is one short of its end.
        let consumer_positions: HashMap<Partition, i64> = match self.stream.position() {
            Ok(list) => list
                .elements()
                .iter()
                .filter_map(|e| match e.offset() {
                    Offset::Offset(o) => Some(((e.topic().to_string(), e.partition()), o)),
                    _ => None,
                })
                .collect(),
            Err(_) => HashMap::new(),
        };
        let read = self.positions.lock().unwrap_or_else(|p| p.into_inner());
        reached(ends, &self.started_at, |partition| {
            read.get(partition).copied().into_iter().chain(consumer_positions.get(partition).copied()).max()
        })
    }

    pub fn stop(self) {
        self.task.abort();
    }
}

/// Whether every partition of `ends` has been read to its end: it ends where reading began, or
/// `read_to` (the next offset to read, if any was read) is at or past its end.
fn reached(ends: &HashMap<Partition, i64>, started_at: &HashMap<Partition, i64>, read_to: impl Fn(&Partition) -> Option<i64>) -> bool {
    ends.iter().all(|(partition, end)| {
        let from = started_at.get(partition).copied().unwrap_or(0);
        *end <= from || read_to(partition).is_some_and(|at| at >= *end)
    })
}

/// The gateway group's lag on the request topics.
pub struct Lag {
    kafka: Connection,
    group: String,
    /// Made again after a failed query. Added when a client that had lived through a broker
    /// restart failed every query of a chaos soak's end check (2026-11-29); the likelier cause
    /// found since is the `require_stable` wait that `new` now avoids, so this may be removable.
    consumer: Mutex<Arc<BaseConsumer>>,
    topics: Vec<String>,
}

impl Lag {
    pub fn new(kafka: &Connection, group: &str, topics: Vec<String>) -> anyhow::Result<Self> {
        // `read_uncommitted` for this client alone. A `read_committed` client asks for the
        // group's offsets with KIP-447's `require_stable`, which the broker answers only when no
        // open transaction holds offsets of the group for those partitions
        // (`UNSTABLE_OFFSET_COMMIT`, retried by librdkafka up to the query's timeout), so one
        // transaction kept open, by a killed gateway or a broker that is still completing it,
        // fails every query meanwhile. Without the flag the broker answers at once with the
        // offsets of committed transactions, which is what the lag counts. The request topics
        // are this tool's own, written without transactions: their high watermark is their end
        // at either level.
        let kafka = crate::outputs::forcing(kafka, crate::outputs::Isolation::ReadUncommitted);
        Ok(Lag {
            consumer: Mutex::new(Arc::new(consumer(&kafka, group)?)),
            kafka,
            group: group.to_string(),
            topics,
        })
    }

    /// Records of the request topics past the group's committed offsets (a partition never
    /// committed counts from its start); an error when the broker did not answer, and then the
    /// client is made again for the next query.
    pub async fn blocking_total(&self) -> anyhow::Result<i64> {
        let consumer = self.consumer.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let topics = self.topics.clone();
        let answer = tokio::task::spawn_blocking(move || -> anyhow::Result<i64> {
            let partitions = partitions(&consumer, &topics)?;
            let mut list = TopicPartitionList::new();
            for (topic, p) in &partitions {
                list.add_partition(topic, *p);
            }
            let committed = consumer.committed_offsets(list, KAFKA_TIMEOUT).context("reading the group's committed offsets")?;
            let mut lag = 0;
            for (topic, p) in &partitions {
                let (low, high) = consumer.fetch_watermarks(topic, *p, KAFKA_TIMEOUT).with_context(|| format!("reading the watermarks of {topic} {p}"))?;
                let at = match committed.find_partition(topic, *p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => o,
                    _ => low,
                };
                lag += (high - at).max(0);
            }
            Ok(lag)
        })
        .await
        .map_err(anyhow::Error::from)
        .and_then(|r| r);
        if answer.is_err() {
            if let Ok(fresh) = self::consumer::<BaseConsumer>(&self.kafka, &self.group) {
                *self.consumer.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(fresh);
            }
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_is_read_to_its_end_past_a_trailing_transaction_marker() {
        let p = |n: i32| ("voice.results".to_string(), n);
        let started_at: HashMap<Partition, i64> = [(p(0), 10), (p(1), 5)].into();
        // Partition 0: a transaction wrote offsets 10 and 11, its commit marker took 12, so the
        // last stable offset is 13. Partition 1 has had nothing since the start.
        let ends: HashMap<Partition, i64> = [(p(0), 13), (p(1), 5)].into();
        let after_last_record = |q: &Partition| (q == &p(0)).then_some(12);
        assert!(!reached(&ends, &started_at, after_last_record), "the marker is not a record read");
        let consumer_position = |q: &Partition| (q == &p(0)).then_some(13);
        assert!(reached(&ends, &started_at, consumer_position), "the consumer's position passed the marker");
        assert!(!reached(&ends, &started_at, |_| None), "nothing read yet on partition 0");
        let unknown_start: HashMap<Partition, i64> = [(p(2), 1)].into();
        assert!(!reached(&unknown_start, &HashMap::new(), |_| None), "a partition not followed starts at 0");
        assert!(reached(&HashMap::new(), &started_at, |_| None));
    }
}
