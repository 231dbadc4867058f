//! Helpers for the end-to-end tests in `tests/`: a real Kafka broker (started through
//! `scripts/broker` unless `VRAMGATE_TEST_BROKERS` names one), the real `ai-worker` and
//! `api-gateway` binaries as child processes, and WAV inputs made from real speech.
//!
//! Every test creates its own topics and consumer group (names with a random suffix), so tests
//! can run side by side on one broker without seeing each other's records.

pub mod agree;
pub mod bench;
pub mod ceiling;
pub mod chaos;
pub mod chaos_soak;
pub mod dns;
pub mod fleet;
pub mod gpu_kit;
pub mod images;
pub mod jaeger;
pub mod metrics;
pub mod mtcnn;
pub mod object_store;
pub mod oip_client;
pub mod scale;
pub mod tls;
pub mod contract;
pub mod wav;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use base64::Engine as _;
use futures::{StreamExt, TryStreamExt};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
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
/// Runs `scripts/<name> <args>`; its standard output, or an error with its standard error.
pub fn run_script(name: &str, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(repo_root().join("scripts").join(name))
        .args(args)
        .output()
        .with_context(|| format!("running scripts/{name} {}", args.join(" ")))?;
    if !output.status.success() {
        anyhow::bail!("scripts/{name} {} failed: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

pub fn venv_python() -> PathBuf {
    let venv = std::env::var_os("VRAMGATE_VENV").map(PathBuf::from).unwrap_or_else(|| repo_root().join(".venv"));
    venv.join("bin").join("python")
}

/// Runs `tests/python/<script>` with `args` in the venv, asserts it succeeded (else panics with
/// its output and `log`, the log of the service it called), and returns its stdout.
pub fn python_check<I, S>(script: &str, args: I, log: impl FnOnce() -> String) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let path = repo_root().join("tests/python").join(script);
    let output = std::process::Command::new(venv_python()).arg(&path).args(args).output().expect("runs python");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{script} failed:\n{stdout}\n{}\nservice log:\n{}",
        String::from_utf8_lossy(&output.stderr),
        log()
    );
    stdout
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

/// The test broker's port (what `scripts/broker` names it by): the last part of [`brokers`].
fn broker_port() -> String {
    brokers().rsplit(':').next().unwrap_or_default().to_string()
}

/// The last `max` lines of the file at `path` that `keep` keeps (none if it cannot be read).
fn last_lines(path: &Path, keep: impl Fn(&str) -> bool, max: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| keep(l)).collect();
    lines[lines.len().saturating_sub(max)..].join("\n")
}

/// Restarts the test broker (SIGTERM, then started again on its port with its TLS listeners,
/// its data kept), waiting until it is usable; returns how long it was away. Every client of
/// every test running meanwhile loses it, so only a test alone in its test binary (cargo runs
/// the binaries one at a time) may call it.
pub fn restart_broker() -> anyhow::Result<Duration> {
    let port = broker_port();
    let script = repo_root().join("scripts/broker");
    let started = Instant::now();
    for args in [vec!["stop", "--port", &port], vec!["start", "--port", &port, "--tls"]] {
        let status = Command::new(&script).args(&args).status().context("running scripts/broker")?;
        anyhow::ensure!(status.success(), "scripts/broker {} failed: {status}", args.join(" "));
    }
    Ok(started.elapsed())
}

/// The last `max` lines of the test broker's log since it last started that hold one of
/// `needles`, each cut to 250 characters: for a failing test's report.
pub fn broker_log_matching(needles: &[&str], max: usize) -> String {
    let log = repo_root().join(format!(".local/kafka/run-{}/broker.log", broker_port()));
    let lines = last_lines(&log, |l| needles.iter().any(|n| l.contains(n)), max);
    lines.lines().map(|l| l.chars().take(250).collect::<String>()).collect::<Vec<_>>().join("\n")
}

/// Kafka's transactions tool (`scripts/broker transactions`) against the test broker, with
/// `args` after its `--`: its output and errors, for a failing test's report.
pub fn broker_transactions(args: &[&str]) -> String {
    let script = repo_root().join("scripts/broker");
    match Command::new(&script).args(["transactions", "--port", &broker_port(), "--"]).args(args).output() {
        Ok(out) => format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        Err(e) => format!("running scripts/broker transactions: {e}"),
    }
}

/// Each partition's low and high watermark as a reader at `isolation` sees them: the high one
/// is the last stable offset for `ReadCommitted`, the log end for `ReadUncommitted`.
pub fn watermarks(topic: &str, partitions: i32, isolation: Isolation) -> anyhow::Result<Vec<(i32, i64, i64)>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("isolation.level", isolation.name())
        .create()?;
    // A broker just restarted may still be electing its partitions' leaders (NotLeaderForPartition,
    // UnknownPartition): each query is tried again for up to a minute before it counts.
    let deadline = Instant::now() + Duration::from_secs(60);
    (0..partitions)
        .map(|p| loop {
            match consumer.fetch_watermarks(topic, p, Duration::from_secs(10)) {
                Ok((low, high)) => return Ok((p, low, high)),
                Err(e) if Instant::now() < deadline => {
                    eprintln!("watermarks of {topic} [{p}]: {e}; trying again");
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => return Err(e.into()),
            }
        })
        .collect()
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

/// Where the broker stored a record: partition and offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub partition: i32,
    pub offset: i64,
}

/// Sends one record and waits for the broker's acknowledgement.
pub async fn send(producer: &FutureProducer, topic: &str, key: &str, value: &[u8]) -> anyhow::Result<Position> {
    send_with_headers(producer, topic, key, value, &[]).await
}

/// Sends one record with headers and waits for the broker's acknowledgement.
pub async fn send_with_headers(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    value: &[u8],
    headers: &[(&str, &[u8])],
) -> anyhow::Result<Position> {
    let mut owned = OwnedHeaders::new();
    for (k, v) in headers {
        owned = owned.insert(Header { key: k, value: Some(*v) });
    }
    let delivery = producer
        .send(FutureRecord::to(topic).key(key).payload(value).headers(owned), Duration::from_secs(30))
        .await
        .map_err(|(e, _)| anyhow::anyhow!("producing to {topic}: {e}"))?;
    Ok(Position { partition: delivery.partition, offset: delivery.offset })
}

/// Sends `(key, value)` records with up to `concurrency` awaiting acknowledgement at once, and
/// waits for all of them.
pub async fn send_all(
    producer: &FutureProducer,
    topic: &str,
    records: &[(String, Vec<u8>)],
    concurrency: usize,
) -> anyhow::Result<()> {
    futures::stream::iter(records)
        .map(|(key, value)| send(producer, topic, key, value))
        .buffer_unordered(concurrency.max(1))
        .try_for_each(|_| async { Ok(()) })
        .await
}

/// A request event whose input is a file under the gateway's input root.
pub fn request_file(id: &str, task: &str, path: &Path) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "id": id, "task": task, "input": {"uri": format!("file://{}", path.display())}
    }))
    .expect("json serialises")
}

/// A request event carrying its input inline (`data_b64`).
pub fn request_inline(id: &str, task: &str, data: &[u8]) -> Vec<u8> {
    let b64 = base64::engine::general_purpose::STANDARD.encode(data);
    serde_json::to_vec(&serde_json::json!({"id": id, "task": task, "input": {"data_b64": b64}}))
        .expect("json serialises")
}

/// A record read back from a result or dead-letter topic.
#[derive(Debug, Clone)]
pub struct Received {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub value: serde_json::Value,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Received {
    /// The value of header `key`, if the record has it.
    pub fn header(&self, key: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_slice())
    }

    /// The record's `id` field, or the empty string (dead letters of unparsable requests).
    pub fn id(&self) -> &str {
        self.value.get("id").and_then(|v| v.as_str()).unwrap_or("")
    }

    fn from_message(message: &BorrowedMessage<'_>) -> anyhow::Result<Self> {
        let value: serde_json::Value = serde_json::from_slice(message.payload().unwrap_or(b"null"))
            .with_context(|| format!("a record of {} is not json", message.topic()))?;
        let headers = message
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_string(), h.value.unwrap_or_default().to_vec())).collect())
            .unwrap_or_default();
        Ok(Received {
            topic: message.topic().to_string(),
            partition: message.partition(),
            offset: message.offset(),
            value,
            headers,
        })
    }
}

fn collector_consumer(topics: &[&str]) -> anyhow::Result<StreamConsumer> {
    collector_consumer_with(topics, Isolation::ReadCommitted)
}

/// What a collector reads of transactional outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// Committed transactions only (and every non-transactional record): what the gateway's
    /// users read. librdkafka's default, set here explicitly.
    ReadCommitted,
    /// Aborted transactions' records too.
    ReadUncommitted,
}

impl Isolation {
    /// librdkafka's name for it (`isolation.level`).
    pub fn name(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "read_committed",
            Isolation::ReadUncommitted => "read_uncommitted",
        }
    }
}

fn collector_consumer_with(topics: &[&str], isolation: Isolation) -> anyhow::Result<StreamConsumer> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("collector"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", isolation.name())
        .create()?;
    consumer.subscribe(topics)?;
    Ok(consumer)
}

/// Reads `topics` from the beginning until `done` says the collected records suffice, or the
/// deadline passes. Returns records by the `id` field of their value (records without one
/// are kept under the empty id).
pub async fn collect(
    topics: &[&str],
    timeout: Duration,
    done: impl Fn(&HashMap<String, Vec<Received>>) -> bool,
) -> anyhow::Result<HashMap<String, Vec<Received>>> {
    let consumer = collector_consumer(topics)?;
    let deadline = Instant::now() + timeout;
    let mut by_id: HashMap<String, Vec<Received>> = HashMap::new();
    let mut read = HashSet::new();
    while !done(&by_id) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let Ok(message) = tokio::time::timeout(left, consumer.recv()).await else { break };
        // A consumer error (the broker away or restarting) is librdkafka's news, not the end
        // of the read: it goes on retrying until the deadline.
        let Ok(message) = message else { continue };
        let received = Received::from_message(&message)?;
        // Every result and dead letter a test reads is held to the published schemas.
        contract::check_record(&received.topic, &received.value).map_err(|e| anyhow::anyhow!("offset {}: {e}", received.offset))?;
        keep(&mut by_id, &mut read, received);
    }
    Ok(by_id)
}

/// Records by `id`, as [`collect`] returns them.
pub type ById = HashMap<String, Vec<Received>>;

/// Where a record lies: topic, partition, offset.
type RecordAt = (String, i32, i64);

/// Files `received` under its id unless a record at its position was read before, and says
/// whether it was new. A reader's group here commits nothing, so one that loses its
/// assignment (its session timed out while the broker was away) starts its partitions again
/// from the beginning: what it reads twice is one record, not a duplicate output. A
/// duplicate is the same id at two positions.
fn keep(by_id: &mut ById, read: &mut HashSet<RecordAt>, received: Received) -> bool {
    if !read.insert((received.topic.clone(), received.partition, received.offset)) {
        return false;
    }
    by_id.entry(received.id().to_string()).or_default().push(received);
    true
}

/// Reads `topics` from the beginning in a background task for as long as it lives, so a test
/// can watch progress (and act on it) while the services run.
pub struct Collector {
    state: Arc<Mutex<CollectorState>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct CollectorState {
    by_id: ById,
    /// Positions read, so a record read again is not counted twice ([`keep`]).
    read: HashSet<RecordAt>,
    records: usize,
    /// Records read again after the reader started its partitions over.
    reread: usize,
    error: Option<String>,
    /// The first record that broke the published contract ([`contract::check_record`]).
    broken: Option<String>,
}

impl Collector {
    /// Starts reading (committed records only); must be called inside a tokio runtime.
    pub fn start(topics: &[&str]) -> anyhow::Result<Self> {
        Self::start_with(topics, Isolation::ReadCommitted)
    }

    /// [`start`](Self::start), reading with `isolation`.
    pub fn start_with(topics: &[&str], isolation: Isolation) -> anyhow::Result<Self> {
        let consumer = collector_consumer_with(topics, isolation)?;
        let state = Arc::new(Mutex::new(CollectorState::default()));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let received = match consumer.recv().await {
                    Ok(message) => Received::from_message(&message),
                    Err(e) => Err(anyhow::anyhow!("collector: {e}")),
                };
                let mut state = shared.lock().unwrap_or_else(|p| p.into_inner());
                match received {
                    Ok(r) => {
                        if let Err(e) = contract::check_record(&r.topic, &r.value) {
                            state.broken.get_or_insert(format!("offset {}: {e}", r.offset));
                        }
                        let CollectorState { by_id, read, .. } = &mut *state;
                        if keep(by_id, read, r) {
                            state.records += 1;
                        } else {
                            state.reread += 1;
                        }
                    }
                    Err(e) => state.error = Some(format!("{e:#}")),
                }
            }
        });
        Ok(Collector { state, task })
    }

    /// Runs `f` on the records read so far. Panics once a record broke the published
    /// contract (`schemas/v1`), naming it: every test that reads records fails on it.
    pub fn with<R>(&self, f: impl FnOnce(&ById) -> R) -> R {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(broken) = &state.broken {
            panic!("{broken}");
        }
        f(&state.by_id)
    }

    /// A copy of the records read so far.
    pub fn snapshot(&self) -> ById {
        self.with(Clone::clone)
    }

    /// How many records were read, and how many distinct ids they carry.
    pub fn counts(&self) -> (usize, usize) {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        (state.records, state.by_id.len())
    }

    /// Records read a second time at a position already read (the reader started over after
    /// losing its assignment); not counted as records or outputs.
    pub fn reread(&self) -> usize {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).reread
    }

    /// The last error met (a record that is not json, a consumer error), if any.
    pub fn error(&self) -> Option<String> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).error.clone()
    }

    /// Waits until `done` holds for the records read, or `timeout` passes; returns whether it held.
    pub async fn wait_until(&self, timeout: Duration, done: impl Fn(&ById) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.with(&done) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
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
        self.log_last(40)
    }

    /// The last `max` lines of the service's log.
    pub fn log_last(&self, max: usize) -> String {
        self.last_log_lines(|_| true, max)
    }

    /// The last `max` lines of the service's log that hold one of `needles` (its warnings and
    /// errors, say), for assertion messages about what happened well before the tail.
    pub fn log_matching(&self, needles: &[&str], max: usize) -> String {
        self.last_log_lines(|line| needles.iter().any(|n| line.contains(n)), max)
    }

    /// The last `max` lines of the service's log that `keep` keeps.
    fn last_log_lines(&self, keep: impl Fn(&str) -> bool, max: usize) -> String {
        last_lines(&self.log, keep, max)
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL, as a crash would, and waits for the process to be gone.
    pub fn kill(&mut self) -> std::io::Result<ExitStatus> {
        self.child.kill()?;
        self.child.wait()
    }

    /// Sends SIGTERM and waits up to `timeout` for the process to exit; returns its status.
    pub async fn terminate(&mut self, timeout: Duration) -> anyhow::Result<std::process::ExitStatus> {
        let sent = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status()?;
        anyhow::ensure!(sent.success(), "kill -TERM {} failed", self.pid());
        self.wait_exit(timeout).await.with_context(|| "after SIGTERM")
    }

    /// Waits up to `timeout` for the process to exit of itself; returns its status.
    pub async fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("{} still running after {timeout:?}; log:\n{}", self.name, self.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The whole log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// The resident memory of process `pid` (`VmRSS` in `/proc/<pid>/status`), in bytes; 0 when the
/// process is gone.
pub fn rss_bytes(pid: u32) -> u64 {
    proc_status_kib(pid, "VmRSS:").map_or(0, |kib| kib * 1024)
}

/// A KiB field of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:`), or `None` when the process or
/// the field is not there.
pub fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix(field))?.trim().trim_end_matches("kB").trim().parse().ok()
}

/// A process's `utime + stime` in seconds, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of stat; 12 and 13 after "pid (comm)".
    (ticks(11) + ticks(12)) / clock_ticks()
}

/// `sysconf(_SC_CLK_TCK)`, read once through `getconf` (100 on every Linux this runs on).
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// The environment variable `name` parsed as a `T`, or `default` (benchmark knobs).
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Deletes topics (best effort: tests that write hundreds of megabytes clean up after
/// themselves).
pub async fn delete_topics(names: &[&str]) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers()).create()?;
    for result in admin.delete_topics(names, &AdminOptions::new()).await? {
        if let Err((topic, code)) = result {
            bail!("deleting topic {topic}: {code}");
        }
    }
    Ok(())
}

/// A consumer group as the broker's coordinator sees it.
#[derive(Debug, Clone)]
pub struct GroupState {
    /// `Stable`, `PreparingRebalance`, `CompletingRebalance`, `Empty`, `Dead`.
    pub state: String,
    /// Each member's client id and the number of partitions assigned to it.
    pub members: Vec<(String, usize)>,
}

/// The state of consumer group `group` and its members' assignments.
pub fn group_state(group: &str) -> anyhow::Result<GroupState> {
    let consumer: BaseConsumer = ClientConfig::new().set("bootstrap.servers", brokers()).create()?;
    let list = consumer.fetch_group_list(Some(group), Duration::from_secs(10))?;
    let Some(info) = list.groups().iter().find(|g| g.name() == group) else {
        return Ok(GroupState { state: "Dead".into(), members: Vec::new() });
    };
    let members = info
        .members()
        .iter()
        .map(|m| (m.client_id().to_string(), m.assignment().map_or(0, assigned_partitions)))
        .collect();
    Ok(GroupState { state: info.state().to_string(), members })
}

/// Partitions in a `ConsumerProtocolAssignment`: version (i16), then topics, each a name (i16
/// length + bytes) and partitions (i32 count + i32 each); user data follows and is ignored.
fn assigned_partitions(bytes: &[u8]) -> usize {
    fn int(bytes: &[u8], at: &mut usize, width: usize) -> Option<i64> {
        let slice = bytes.get(*at..*at + width)?;
        *at += width;
        Some(slice.iter().fold(0i64, |v, b| (v << 8) | i64::from(*b)))
    }
    fn count(bytes: &[u8]) -> Option<usize> {
        let mut at = 2;
        let mut partitions = 0;
        for _ in 0..int(bytes, &mut at, 4)? {
            at += usize::try_from(int(bytes, &mut at, 2)?).ok()?;
            let n = usize::try_from(int(bytes, &mut at, 4)?).ok()?;
            at += 4 * n;
            partitions += n;
        }
        Some(partitions)
    }
    count(bytes).unwrap_or(0)
}

/// Waits until `group` is `Stable` with `members` members that each own a partition.
pub async fn wait_group_balanced(group: &str, members: usize, timeout: Duration) -> anyhow::Result<GroupState> {
    let deadline = Instant::now() + timeout;
    loop {
        let state = group_state(group)?;
        if state.state == "Stable" && state.members.len() == members && state.members.iter().all(|(_, n)| *n > 0) {
            return Ok(state);
        }
        if Instant::now() > deadline {
            bail!("group {group} not balanced over {members} members after {timeout:?}: {state:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Records of `topic` not covered by `group`'s committed offsets, summed over partitions
/// (a partition with no commit counts all its records).
pub fn uncommitted_records(group: &str, topic: &str) -> anyhow::Result<i64> {
    CommitProbe::new(group, topic)?.uncommitted()
}

/// [`uncommitted_records`] asked again and again through one client: a benchmark that polls
/// every few milliseconds would otherwise start a librdkafka client (threads, connections,
/// metadata) each time, on the cores of the process it measures.
pub struct CommitProbe {
    consumer: BaseConsumer,
    topic: String,
    partitions: i32,
}

impl CommitProbe {
    pub fn new(group: &str, topic: &str) -> anyhow::Result<Self> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()?;
        let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
        let partitions = metadata.topics().first().map_or(0, |t| t.partitions().len()) as i32;
        Ok(CommitProbe { consumer, topic: topic.to_string(), partitions })
    }

    /// Records not covered by the group's committed offsets now.
    pub fn uncommitted(&self) -> anyhow::Result<i64> {
        let (consumer, topic) = (&self.consumer, self.topic.as_str());
        let timeout = Duration::from_secs(10);
        let mut tpl = TopicPartitionList::new();
        for p in 0..self.partitions {
            tpl.add_partition(topic, p);
        }
        let committed = consumer.committed_offsets(tpl, timeout)?;
        let mut behind = 0;
        for p in 0..self.partitions {
            let (low, high) = consumer.fetch_watermarks(topic, p, timeout)?;
            let at = match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => low,
            };
            behind += high - at;
        }
        Ok(behind)
    }
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
    /// `host:port` of its gRPC door, when its config has `grpc_listen`.
    pub grpc: Option<String>,
}

/// Longest a test waits for a worker's first line, and again for its readiness.
pub const WORKER_START_TIMEOUT: Duration = Duration::from_secs(300);

/// Starts the ai-worker with `config` (TOML) on a free port and waits until it is ready.
pub async fn start_worker(config: &str) -> anyhow::Result<Worker> {
    start_worker_on(config, "127.0.0.1:0").await
}

/// Starts the ai-worker with `config` (TOML) listening on `listen` (e.g. the address of a
/// worker that was killed, so that the gateway's URL reaches the new one) and waits until it
/// is ready.
pub async fn start_worker_on(config: &str, listen: &str) -> anyhow::Result<Worker> {
    let config_path = std::env::temp_dir().join(format!("{}.toml", unique("worker-config")));
    std::fs::write(&config_path, config)?;
    let launch = WorkerLaunch { binary: binary("ai-worker"), dir: repo_root(), log: log_path("worker") };
    // A worker of the whole model repository took 81 s to be ready when two started at once in
    // a CI=true run here (2026-12-02), and more with a second test binary beside it
    // (scripts/test-lanes): a bound for a hang, not for a slow machine.
    launch.start(&config_path, listen, WORKER_START_TIMEOUT).await
}

/// Where a worker process comes from: its binary, the folder it runs in and its log file.
/// The tests take the workspace's build; the GPU kit ([`gpu_kit`]) its own copy.
pub struct WorkerLaunch {
    pub binary: PathBuf,
    pub dir: PathBuf,
    pub log: PathBuf,
}

impl WorkerLaunch {
    /// Starts the worker on the config file at `config`, listening on `listen`, and waits until
    /// it is ready, at most `timeout` for each of its first line and its readiness.
    pub async fn start(self, config: &Path, listen: &str, timeout: Duration) -> anyhow::Result<Worker> {
        let mut child = Command::new(&self.binary)
            .arg("--config")
            .arg(config)
            .env("VRAMGATE_WORKER_LISTEN", listen)
            .current_dir(&self.dir)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&self.log).with_context(|| format!("creating {}", self.log.display()))?)
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let service = Service { name: "ai-worker", child, log: self.log };
        let first = first_line(stdout, timeout).await;
        // `listening on HTTP-ADDR`, then ` grpc GRPC-ADDR` when gRPC is on.
        let Some(addrs) = first.as_deref().and_then(|l| l.trim().strip_prefix("listening on ")) else {
            bail!("ai-worker did not report its address (got {first:?}); log:\n{}", service.log_tail());
        };
        let mut words = addrs.split_whitespace();
        let url = format!("http://{}", words.next().unwrap_or_default());
        let grpc = match (words.next(), words.next()) {
            (Some("grpc"), Some(addr)) => Some(addr.to_string()),
            _ => None,
        };
        let mut worker = Worker { service, url, grpc };
        wait_ready(&mut worker, timeout).await?;
        Ok(worker)
    }
}

impl Worker {
    /// The `host:port` the worker listens on.
    pub fn addr(&self) -> &str {
        self.url.trim_start_matches("http://")
    }
}

/// The first line a child writes to stdout, or `None` when it closes stdout (exits) first or
/// `timeout` passes. The rest of its stdout is read and dropped on a thread, so the child never
/// blocks on (or dies of) a full or closed pipe.
async fn first_line(stdout: ChildStdout, timeout: Duration) -> Option<String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        let first = match reader.read_line(&mut line) {
            Ok(n) if n > 0 => Some(line.clone()),
            _ => None,
        };
        let open = first.is_some();
        let _ = tx.send(first);
        if open {
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
        }
    });
    tokio::time::timeout(timeout, rx).await.ok().and_then(Result::ok).flatten()
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
        "listen = \"127.0.0.1:0\"\ndevice = \"cpu\"\ntorch_threads = 1\n\n[[models]]\nname = \"silero_vad\"\npath = \"{}\"\n{VAD_KEYS}\n",
        model.display()
    )
}

/// A worker config serving `models` (name, file under `models/`, the declared keys, extra TOML
/// lines), on the CPU, with `extra` top-level TOML (budget, admission, batching) before them.
pub fn worker_config(extra: &str, models: &[(&str, &str, &str, &str)]) -> String {
    let mut config = format!("listen = \"127.0.0.1:0\"\ndevice = \"cpu\"\ntorch_threads = 1\n{extra}\n");
    for (name, file, keys, more) in models {
        let path = repo_root().join("models").join(file);
        assert!(path.is_file(), "{} missing: run scripts/setup", path.display());
        config.push_str(&format!("\n[[models]]\nname = \"{name}\"\npath = \"{}\"\n{keys}\n{more}\n", path.display()));
    }
    config
}

/// A running api-gateway and the URL of its Prometheus metrics.
pub struct Gateway {
    pub service: Service,
    /// `http://ADDR/metrics`.
    pub metrics_url: String,
    http: reqwest::Client,
}

impl Gateway {
    /// The gateway's metrics as Prometheus text.
    pub async fn metrics(&self) -> anyhow::Result<metrics::Scrape> {
        metrics::scrape(&self.http, &self.metrics_url).await
    }

    /// The gateway's metrics once `done` holds for them (scraped every 200 ms), or the last
    /// scrape when `timeout` passes first, for the caller's assertions to report. A test that
    /// has read every output record must still wait for the counters: the gateway counts an
    /// output when the broker's acknowledgement reaches it, which can be after a consumer has
    /// read the record.
    pub async fn metrics_when(&self, timeout: Duration, done: impl Fn(&metrics::Scrape) -> bool) -> anyhow::Result<metrics::Scrape> {
        let deadline = Instant::now() + timeout;
        loop {
            let scrape = self.metrics().await;
            if scrape.as_ref().is_ok_and(&done) || Instant::now() >= deadline {
                return scrape;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.service.pid()
    }

    pub fn log_tail(&self) -> String {
        self.service.log_tail()
    }

    /// `GET /readyz`: its status and JSON body.
    pub async fn readiness(&self) -> (u16, serde_json::Value) {
        let url = self.metrics_url.replace("/metrics", "/readyz");
        let response = self.http.get(&url).send().await.expect("readyz answers");
        let status = response.status().as_u16();
        (status, response.json().await.expect("readyz is json"))
    }

    /// Polls `/readyz` until `want(status, body)` holds; panics with the last answer after a
    /// minute.
    pub async fn wait_readiness(&self, want: impl Fn(u16, &serde_json::Value) -> bool) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (status, body) = self.readiness().await;
            if want(status, &body) {
                return body;
            }
            assert!(Instant::now() < deadline, "readiness stayed {status} {body}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// Silero VAD's declared keys, as config/worker.toml declares it: one speech probability per
/// started 512-sample window, requests of different lengths padded with silence.
pub const VAD_KEYS: &str = "method = \"audio_forward\"\nargs = [16000]\n\
    input = { name = \"audio\", shape = [-1, -1], batching = \"pad\", pad_value = 0, min_shape = [1, 512] }\n\
    outputs = [{ name = \"speech_prob\", shape = [-1, -1], follows = [{ dim = 1, input_dim = 1, divisor = 512 }] }]\n\
    probe_sizes = [16000, 64000, 256000]\nbatch_probe_sizes = [16000, 64000]";
/// MTCNN P-Net's declared keys, as config/worker.toml declares it: box regressions and
/// [no-face, face] probabilities per cell, equal shapes only.
pub const PNET_KEYS: &str = "input = { name = \"image\", shape = [-1, 3, -1, -1], min_shape = [1, 3, 12, 12] }\n\
    outputs = [{ name = \"box_offsets\", shape = [-1, 4, -1, -1] }, { name = \"face_prob\", shape = [-1, 2, -1, -1] }]\n\
    probe_sizes = [128, 256, 512]\nbatch_probe_sizes = [64, 128, 256, 512]";
/// The worker's Silero VAD model, as [`worker_config`] takes it; the name is the voice task's
/// default model.
pub const VAD_MODEL: (&str, &str, &str, &str) = ("silero_vad", "silero_vad.jit", VAD_KEYS, "");
/// The worker's MTCNN P-Net model, as [`worker_config`] takes it; the name is the image task's
/// default model.
pub const PNET_MODEL: (&str, &str, &str, &str) = ("mtcnn_pnet", "mtcnn_pnet.jit", PNET_KEYS, "");
/// MTCNN's R-Net and O-Net, declared as config/worker.toml declares them: the image task's
/// second and third stages.
pub const RNET_MODEL: (&str, &str, &str, &str) = (
    "mtcnn_rnet",
    "mtcnn_rnet.jit",
    "input = { name = \"image\", shape = [-1, 3, 24, 24] }\n\
     outputs = [{ name = \"box_offsets\", shape = [-1, 4] }, { name = \"face_prob\", shape = [-1, 2] }]",
    "",
);
pub const ONET_MODEL: (&str, &str, &str, &str) = (
    "mtcnn_onet",
    "mtcnn_onet.jit",
    "input = { name = \"image\", shape = [-1, 3, 48, 48] }\n\
     outputs = [{ name = \"box_offsets\", shape = [-1, 4] }, { name = \"landmarks\", shape = [-1, 10] }, \
     { name = \"face_prob\", shape = [-1, 2] }]",
    "",
);
/// The three models of the image task's cascade (`mode = "faces"`, its default).
pub const FACE_MODELS: [(&str, &str, &str, &str); 3] = [PNET_MODEL, RNET_MODEL, ONET_MODEL];

/// Gateway overrides that point the voice task at `topics`.
pub fn voice_task_env(topics: &TaskTopics) -> Vec<(&'static str, String)> {
    vec![
        ("TASKS__VOICE__REQUESTS_TOPIC", topics.requests.clone()),
        ("TASKS__VOICE__RESULTS_TOPIC", topics.results.clone()),
        ("TASKS__VOICE__DLQ_TOPIC", topics.dlq.clone()),
    ]
}

/// The overrides every gateway in a test starts from: its group, its worker and its input root.
pub fn gateway_base_env(group: &str, worker_url: &str, root: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("KAFKA__GROUP_ID", group.to_string()),
        ("WORKER__URL", worker_url.to_string()),
        ("INPUT__FILE_ROOT", root.display().to_string()),
    ]
}

/// Gateway overrides that point the image task at `topics`, running P-Net alone at one scale
/// (`mode = "proposals"`): one worker call per image, the fixed-cost image load the flow-control
/// tests and benches drive. [`faces_task_env`] runs the task as users get it.
pub fn image_task_env(topics: &TaskTopics) -> Vec<(&'static str, String)> {
    let mut env = faces_task_env(topics);
    env.push(("TASKS__IMAGE__IMAGE__MODE", "proposals".into()));
    env
}

/// Gateway overrides that point the image task at `topics`, as configured: MTCNN's whole
/// cascade, whose worker needs [`FACE_MODELS`].
pub fn faces_task_env(topics: &TaskTopics) -> Vec<(&'static str, String)> {
    vec![
        ("TASKS__IMAGE__REQUESTS_TOPIC", topics.requests.clone()),
        ("TASKS__IMAGE__RESULTS_TOPIC", topics.results.clone()),
        ("TASKS__IMAGE__DLQ_TOPIC", topics.dlq.clone()),
    ]
}

/// A photograph set-up extracted from a pinned package (`.local/photos/`, listed in
/// `tests/photos.md`).
pub fn photo(name: &str) -> PathBuf {
    let path = repo_root().join(".local/photos").join(name);
    assert!(path.is_file(), "{} missing: run scripts/setup", path.display());
    path
}

/// A video clip set-up extracted from a pinned package (`.local/clips/`, listed in
/// `tests/photos.md`, "Clips").
pub fn clip(name: &str) -> PathBuf {
    let path = repo_root().join(".local/clips").join(name);
    assert!(path.is_file(), "{} missing: run scripts/setup", path.display());
    path
}

/// Starts the api-gateway with environment overrides (`VRAMGATE_GATEWAY_*`) on top of the
/// defaults, e.g. `[("KAFKA__GROUP_ID", "g1")]`, its metrics on a free port, and waits for the
/// line that names that port.
pub async fn start_gateway(overrides: &[(&str, String)]) -> anyhow::Result<Gateway> {
    start_gateway_with(overrides, &[]).await
}

/// [`start_gateway`], with further environment variables set as given (e.g.
/// `VRAMGATE_LOG_FORMAT`).
pub async fn start_gateway_with(overrides: &[(&str, String)], env: &[(&str, &str)]) -> anyhow::Result<Gateway> {
    start_gateway_command(Command::new(binary("api-gateway")), overrides, env).await
}

/// [`start_gateway`] reading the TOML file `config` (a task table a test writes), with the
/// environment's overrides on top.
pub async fn start_gateway_config(config: &Path, overrides: &[(&str, String)]) -> anyhow::Result<Gateway> {
    start_gateway_config_with(config, overrides, &[]).await
}

/// [`start_gateway_config`], with further environment variables set as given (e.g. the AWS
/// chain's credentials).
pub async fn start_gateway_config_with(config: &Path, overrides: &[(&str, String)], env: &[(&str, &str)]) -> anyhow::Result<Gateway> {
    let mut command = Command::new(binary("api-gateway"));
    command.arg("--config").arg(config);
    start_gateway_command(command, overrides, env).await
}

async fn start_gateway_command(mut command: Command, overrides: &[(&str, String)], env: &[(&str, &str)]) -> anyhow::Result<Gateway> {
    let log = log_path("gateway");
    command.envs(env.iter().copied());
    command
        .env("VRAMGATE_GATEWAY_KAFKA__BROKERS", brokers())
        .env("VRAMGATE_GATEWAY_METRICS_LISTEN", "127.0.0.1:0")
        .current_dir(repo_root())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log)?);
    for (key, value) in overrides {
        command.env(format!("VRAMGATE_GATEWAY_{key}"), value);
    }
    let mut child = command.spawn().context("starting api-gateway")?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let service = Service { name: "api-gateway", child, log };
    let first = first_line(stdout, Duration::from_secs(60)).await;
    let Some(addr) = first.as_deref().and_then(|l| l.trim().strip_prefix("metrics on ")) else {
        bail!("api-gateway did not report its metrics address (got {first:?}); log:\n{}", service.log_tail());
    };
    let metrics_url = format!("http://{addr}/metrics");
    Ok(Gateway { service, metrics_url, http: reqwest::Client::new() })
}

/// A model repository under `root` holding `models` as scripts/setup exported them into
/// models/repository/ (each folder's model.pt and config.toml, the way docs/models.md has a user
/// write one): a worker given `model_repository = <it>` serves those and no others.
pub fn model_repository(root: &Path, models: &[&str]) -> PathBuf {
    let repository = root.join("repository");
    for model in models {
        let folder = repository.join(model);
        std::fs::create_dir_all(&folder).expect("model folder");
        let exported = repo_root().join("models/repository").join(model);
        assert!(exported.join("model.pt").is_file(), "{} missing: run scripts/setup", exported.join("model.pt").display());
        for file in ["model.pt", "config.toml"] {
            std::fs::copy(exported.join(file), folder.join(file)).expect("copying the model");
        }
    }
    repository
}

/// A fresh scratch folder under `.local/`, for test inputs the gateway may read.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = repo_root().join(".local/test-data").join(unique(name));
    std::fs::create_dir_all(&dir).expect("creating a scratch folder");
    dir
}
