//! The load generator's Kafka side: sending request events (stamped with their send time),
//! following the output topics from where they ended when the run began, and the gateway
//! group's lag (request topics' ends minus its committed offsets).

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

fn consumer<C: rdkafka::config::FromClientConfig>(kafka: &Connection, group: &str) -> anyhow::Result<C> {
    let mut defaults = ClientConfig::new();
    defaults.set("group.id", group).set("enable.auto.commit", "false");
    kafka.create(defaults, "a kafka consumer")
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

/// Where each partition ends now (its high watermark).
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
    /// The last offset read per output partition, and where reading began.
    positions: Arc<Mutex<HashMap<Partition, i64>>>,
    started_at: HashMap<Partition, i64>,
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
        let stream: StreamConsumer = consumer(kafka, &format!("vramgate-load-{}", uuid::Uuid::new_v4().simple()))?;
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
        let task = tokio::spawn(async move {
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
                    .insert((message.topic().to_string(), message.partition()), message.offset());
            }
        });
        Ok(Follower { positions, started_at, task })
    }

    /// Whether every partition has been read up to `ends`.
    pub fn reached(&self, ends: &HashMap<Partition, i64>) -> bool {
        let positions = self.positions.lock().unwrap_or_else(|p| p.into_inner());
        ends.iter().all(|(partition, end)| {
            let from = self.started_at.get(partition).copied().unwrap_or(0);
            *end <= from || positions.get(partition).is_some_and(|at| at + 1 >= *end)
        })
    }

    pub fn stop(self) {
        self.task.abort();
    }
}

/// The gateway group's lag on the request topics.
pub struct Lag {
    consumer: Arc<BaseConsumer>,
    topics: Vec<String>,
}

impl Lag {
    pub fn new(kafka: &Connection, group: &str, topics: Vec<String>) -> anyhow::Result<Self> {
        Ok(Lag { consumer: Arc::new(consumer(kafka, group)?), topics })
    }

    /// Records of the request topics past the group's committed offsets (a partition never
    /// committed counts from its start); `None` when the broker did not answer.
    pub async fn blocking_total(&self) -> Option<i64> {
        let (consumer, topics) = (self.consumer.clone(), self.topics.clone());
        tokio::task::spawn_blocking(move || -> anyhow::Result<i64> {
            let partitions = partitions(&consumer, &topics)?;
            let mut list = TopicPartitionList::new();
            for (topic, p) in &partitions {
                list.add_partition(topic, *p);
            }
            let committed = consumer.committed_offsets(list, KAFKA_TIMEOUT)?;
            let mut lag = 0;
            for (topic, p) in &partitions {
                let (low, high) = consumer.fetch_watermarks(topic, *p, KAFKA_TIMEOUT)?;
                let at = match committed.find_partition(topic, *p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => o,
                    _ => low,
                };
                lag += (high - at).max(0);
            }
            Ok(lag)
        })
        .await
        .ok()?
        .ok()
    }
}
