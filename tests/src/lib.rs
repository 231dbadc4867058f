//! Helpers for the end-to-end tests in `tests/`: a real Kafka broker (started through
//! `scripts/broker` unless `VRAMGATE_TEST_BROKERS` names one), the real `ai-worker` and
//! `api-gateway` binaries as child processes, and WAV inputs made from real speech.
//!
//! Every test creates its own topics and consumer group (names with a random suffix), so tests
//! can run side by side on one broker without seeing each other's records.

pub mod oip_client;
pub mod wav;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// A release or debug binary of this workspace, next to the running test executable.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>-<hash>
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps layout");
    let path = profile_dir.join(name);
    assert!(
        path.is_file(),
        "{} is not built; run scripts/test, which builds the binaries before the tests",
        path.display()
    );
    path
}

/// The Python of the project's venv (tritonclient lives there).
pub fn venv_python() -> PathBuf {
    let venv = std::env::var_os("VRAMGATE_VENV").map(PathBuf::from).unwrap_or_else(|| repo_root().join(".venv"));
    venv.join("bin").join("python")
}

/// Bootstrap servers of the test broker; starts one through `scripts/broker` if needed.
pub fn brokers() -> String {
    static BROKERS: OnceLock<String> = OnceLock::new();
    BROKERS
        .get_or_init(|| {
            if let Ok(b) = std::env::var("VRAMGATE_TEST_BROKERS") {
                return b;
            }
            let port = std::env::var("VRAMGATE_TEST_KAFKA_PORT").unwrap_or_else(|_| "19092".into());
            let status = Command::new(repo_root().join("scripts/broker"))
                .args(["start", "--port", &port])
                .status()
                .expect("running scripts/broker");
            assert!(status.success(), "scripts/broker start failed");
            format!("127.0.0.1:{port}")
        })
        .clone()
}

/// A name no other test uses.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

/// Creates topics with `partitions` partitions each and waits until they exist.
pub async fn create_topics(names: &[&str], partitions: i32) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers()).create()?;
    let topics: Vec<NewTopic<'_>> =
        names.iter().map(|n| NewTopic::new(n, partitions, TopicReplication::Fixed(1))).collect();
    for result in admin.create_topics(&topics, &AdminOptions::new()).await? {
        if let Err((topic, code)) = result {
            bail!("creating topic {topic}: {code}");
        }
    }
    Ok(())
}

/// The three topics of one task type, uniquely named for one test.
pub struct TaskTopics {
    pub requests: String,
    pub results: String,
    pub dlq: String,
}

impl TaskTopics {
    pub async fn create(prefix: &str, partitions: i32) -> anyhow::Result<Self> {
        let base = unique(prefix);
        let t = TaskTopics {
            requests: format!("{base}.requests"),
            results: format!("{base}.results"),
            dlq: format!("{base}.dlq"),
        };
        create_topics(&[&t.requests, &t.results, &t.dlq], partitions).await?;
        Ok(t)
    }
}

pub fn producer() -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("enable.idempotence", "true")
        .create()
        .expect("creating a kafka producer")
}

/// Sends one record and waits for the broker's acknowledgement.
pub async fn send(producer: &FutureProducer, topic: &str, key: &str, value: &[u8]) -> anyhow::Result<()> {
    send_with_headers(producer, topic, key, value, &[]).await
}

/// Sends one record with headers and waits for the broker's acknowledgement.
pub async fn send_with_headers(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    value: &[u8],
    headers: &[(&str, &[u8])],
) -> anyhow::Result<()> {
    let mut owned = OwnedHeaders::new();
    for (k, v) in headers {
        owned = owned.insert(Header { key: k, value: Some(*v) });
    }
    producer
        .send(FutureRecord::to(topic).key(key).payload(value).headers(owned), Duration::from_secs(30))
        .await
        .map_err(|(e, _)| anyhow::anyhow!("producing to {topic}: {e}"))?;
    Ok(())
}

/// A record read back from a result or dead-letter topic.
#[derive(Debug, Clone)]
pub struct Received {
    pub topic: String,
    pub value: serde_json::Value,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Received {
    /// The value of header `key`, if the record has it.
    pub fn header(&self, key: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_slice())
    }
}

/// Reads `topics` from the beginning until `done` says the collected records suffice, or the
/// deadline passes. Returns records by the `id` field of their value (records without one
/// are kept under the empty id).
pub async fn collect(
    topics: &[&str],
    timeout: Duration,
    done: impl Fn(&HashMap<String, Vec<Received>>) -> bool,
) -> anyhow::Result<HashMap<String, Vec<Received>>> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("collector"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(topics)?;
    let deadline = Instant::now() + timeout;
    let mut by_id: HashMap<String, Vec<Received>> = HashMap::new();
    while !done(&by_id) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let Ok(message) = tokio::time::timeout(left, consumer.recv()).await else { break };
        let message = message?;
        let value: serde_json::Value = serde_json::from_slice(message.payload().unwrap_or(b"null"))
            .context("result and dead-letter values are json")?;
        let id = value.get("id").and_then(|v| v.as_str()).unwrap_or("").to_string();
        let headers = message
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_string(), h.value.unwrap_or_default().to_vec())).collect())
            .unwrap_or_default();
        by_id.entry(id).or_default().push(Received { topic: message.topic().to_string(), value, headers });
    }
    Ok(by_id)
}

/// A child process killed when dropped, with its stderr kept in a log file for diagnosis.
pub struct Service {
    pub name: &'static str,
    child: Child,
    pub log: PathBuf,
}

impl Service {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last lines of the service's log, for assertion messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends SIGTERM and waits up to `timeout` for the process to exit; returns its status.
    pub async fn terminate(&mut self, timeout: Duration) -> anyhow::Result<std::process::ExitStatus> {
        let sent = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status()?;
        anyhow::ensure!(sent.success(), "kill -TERM {} failed", self.pid());
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("{} still running {timeout:?} after SIGTERM; log:\n{}", self.name, self.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Records of `topic` not covered by `group`'s committed offsets, summed over partitions
/// (a partition with no commit counts all its records).
pub fn uncommitted_records(group: &str, topic: &str) -> anyhow::Result<i64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()?;
    let timeout = Duration::from_secs(10);
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    let partitions = metadata.topics().first().map_or(0, |t| t.partitions().len()) as i32;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let committed = consumer.committed_offsets(tpl, timeout)?;
    let mut behind = 0;
    for p in 0..partitions {
        let (low, high) = consumer.fetch_watermarks(topic, p, timeout)?;
        let at = match committed.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o,
            _ => low,
        };
        behind += high - at;
    }
    Ok(behind)
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn log_path(name: &str) -> PathBuf {
    let dir = repo_root().join(".local/test-logs");
    std::fs::create_dir_all(&dir).expect("creating .local/test-logs");
    dir.join(format!("{}.log", unique(name)))
}

/// A running ai-worker and its base URL.
pub struct Worker {
    pub service: Service,
    pub url: String,
}

/// Starts the ai-worker with `config` (TOML) on a free port and waits until it is ready.
pub async fn start_worker(config: &str) -> anyhow::Result<Worker> {
    let config_path = std::env::temp_dir().join(format!("{}.toml", unique("worker-config")));
    std::fs::write(&config_path, config)?;
    let log = log_path("worker");
    let mut child = Command::new(binary("ai-worker"))
        .arg("--config")
        .arg(&config_path)
        .env("VRAMGATE_WORKER_LISTEN", "127.0.0.1:0")
        .current_dir(repo_root())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .context("starting ai-worker")?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut first = String::new();
    BufReader::new(stdout).read_line(&mut first)?;
    let service = Service { name: "ai-worker", child, log };
    let Some(addr) = first.trim().strip_prefix("listening on ") else {
        bail!("ai-worker did not report its address (got {first:?}); log:\n{}", service.log_tail());
    };
    let url = format!("http://{addr}");
    let mut worker = Worker { service, url };
    wait_ready(&mut worker, Duration::from_secs(120)).await?;
    Ok(worker)
}

async fn wait_ready(worker: &mut Worker, timeout: Duration) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + timeout;
    loop {
        if !worker.service.is_running() {
            bail!("ai-worker exited during start-up; log:\n{}", worker.service.log_tail());
        }
        let ready = client.get(format!("{}/v2/health/ready", worker.url)).send().await;
        if ready.is_ok_and(|r| r.status().is_success()) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("ai-worker not ready after {timeout:?}; log:\n{}", worker.service.log_tail());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The worker config the tests use: the real Silero VAD model from `models/`.
pub fn silero_worker_config() -> String {
    let model = repo_root().join("models/silero_vad.jit");
    assert!(model.is_file(), "{} missing: run scripts/setup", model.display());
    format!(
        "listen = \"127.0.0.1:0\"\ndevice = \"cpu\"\ntorch_threads = 1\n\n[[models]]\nname = \"silero_vad\"\npath = \"{}\"\nkind = \"voice_activity\"\n",
        model.display()
    )
}

/// A worker config serving `models` (name, file under `models/`, kind, extra TOML lines),
/// on the CPU, with `extra` top-level TOML (budget, admission, batching) before them.
pub fn worker_config(extra: &str, models: &[(&str, &str, &str, &str)]) -> String {
    let mut config = format!("listen = \"127.0.0.1:0\"\ndevice = \"cpu\"\ntorch_threads = 1\n{extra}\n");
    for (name, file, kind, more) in models {
        let path = repo_root().join("models").join(file);
        assert!(path.is_file(), "{} missing: run scripts/setup", path.display());
        config.push_str(&format!(
            "\n[[models]]\nname = \"{name}\"\npath = \"{}\"\nkind = \"{kind}\"\n{more}\n",
            path.display()
        ));
    }
    config
}

/// Starts the api-gateway with environment overrides (`VRAMGATE_GATEWAY_*`) on top of the
/// defaults, e.g. `[("KAFKA__GROUP_ID", "g1")]`.
pub fn start_gateway(overrides: &[(&str, String)]) -> anyhow::Result<Service> {
    let log = log_path("gateway");
    let mut command = Command::new(binary("api-gateway"));
    command
        .env("VRAMGATE_GATEWAY_KAFKA__BROKERS", brokers())
        .current_dir(repo_root())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    for (key, value) in overrides {
        command.env(format!("VRAMGATE_GATEWAY_{key}"), value);
    }
    let child = command.spawn().context("starting api-gateway")?;
    Ok(Service { name: "api-gateway", child, log })
}

/// A fresh scratch folder under `.local/`, for test inputs the gateway may read.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = repo_root().join(".local/test-data").join(unique(name));
    std::fs::create_dir_all(&dir).expect("creating a scratch folder");
    dir
}
