//! The gateway's configuration tree. Read from a TOML file and `VRAMGATE_GATEWAY_*` environment
//! variables (`__` between levels, e.g. `VRAMGATE_GATEWAY_KAFKA__BROKERS`,
//! `VRAMGATE_GATEWAY_TASKS__VOICE__GPU_PERMITS__MAX`).
//!
//! Two bounds keep the gateway's memory flat whatever the backlog: `max_in_flight` records and
//! `max_held_bytes` of payload (raw, decoded, in flight). Past either, it pauses its partitions
//! instead of fetching more. Per task type, `gpu_permits` bounds concurrent worker calls and
//! adapts between its `min` and `max` to what the worker answers.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Most seconds `worker.model_check_wait_seconds` may say (`crate::model_check` waits that long).
pub const MAX_MODEL_CHECK_WAIT_SECONDS: f64 = 600.0;

use serde::{Deserialize, Serialize};

use vramgate_shared::config::Secret;

use vramgate_shared::kafka::{Connection, Properties};

pub use crate::tasks::audio::AudioOptions;
pub use crate::tasks::image::ImageOptions;
pub use crate::tasks::outputs::OutputRule;
pub use crate::tasks::tensor::TensorOptions;
pub use crate::tasks::voice::{SegmentConfig, WavOptions};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    pub kafka: KafkaConfig,
    /// Defaults for every task's worker calls.
    pub worker: WorkerEndpoint,
    pub input: InputConfig,
    /// The S3-compatible object store: the buckets events may name as inputs, and the
    /// server that `[[outputs]]` rows with `store` write to.
    pub s3: S3Config,
    /// The task table, by task type (the `task` field of a request). Built in: `voice` and
    /// `image`; either can be switched off with `enabled = false`.
    pub tasks: BTreeMap<String, TaskConfig>,
    /// Records fetched past the last commit, all tasks together (so: records held, plus
    /// finished ones whose offset is not committed yet). Past it, fetching pauses. It bounds
    /// the duplicates a crash can cause, and how far a partition runs ahead of a record that
    /// waits to retry.
    pub max_in_flight: usize,
    /// Bytes of payload held at once: raw records, files read, decoded inputs, request bodies.
    /// Charged before decoding; past it, fetching pauses and conversions wait.
    pub max_held_bytes: u64,
    /// Fetching resumes once held bytes and records fall below this fraction of their bounds
    /// (hysteresis: librdkafka drops a paused partition's prefetched data, so pausing and
    /// resuming on every record would fetch the same data over and over).
    pub resume_fraction: f64,
    /// How often finished offsets are committed (in exactly-once delivery: how often a
    /// transaction commits the outputs and offsets of the records finished since).
    pub commit_interval_ms: u64,
    /// What a consumer of the output topics may count on: `at-least-once` (outputs produced as
    /// records finish; a crash repeats the records past the last commit) or `exactly-once`
    /// (outputs and offsets written in one Kafka transaction at a time: a `read_committed`
    /// consumer sees one output per request, whatever is killed when). `docs/gateway.md`,
    /// "Delivery", has the design and its cost.
    pub delivery: Delivery,
    /// When partitions are revoked, how long their in-flight records may take to finish before
    /// the rebalance goes on without them. Keep it below the session timeout.
    pub drain_timeout_seconds: f64,
    /// On SIGTERM/SIGINT, how long in-flight records may take to finish before the gateway
    /// exits anyway (their offsets are then not committed, so they are redelivered).
    pub shutdown_timeout_seconds: f64,
    /// Address of the Prometheus `/metrics` endpoint; port 0 picks a free one. The bound
    /// address is printed on stdout as `metrics on <addr>`. Loopback by default: exposing it
    /// (`0.0.0.0:9464` in a container) is a choice made in configuration.
    pub metrics_listen: String,
    /// Trace export (OTLP); the `OTEL_*` variables override it.
    pub telemetry: vramgate_shared::telemetry::TelemetryConfig,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        let mut tasks = BTreeMap::new();
        tasks.insert("voice".to_string(), TaskConfig::default());
        tasks.insert(
            "image".to_string(),
            TaskConfig { converter: Converter::Image, model: "mtcnn_pnet".into(), ..TaskConfig::default() },
        );
        GatewayConfig {
            kafka: KafkaConfig::default(),
            worker: WorkerEndpoint::default(),
            input: InputConfig::default(),
            s3: S3Config::default(),
            tasks,
            max_in_flight: 1024,
            max_held_bytes: 256 * 1024 * 1024,
            resume_fraction: 0.5,
            commit_interval_ms: 200,
            delivery: Delivery::AtLeastOnce,
            drain_timeout_seconds: 10.0,
            shutdown_timeout_seconds: 20.0,
            metrics_listen: "127.0.0.1:9464".into(),
            telemetry: Default::default(),
        }
    }
}

impl GatewayConfig {
    pub fn shutdown_timeout(&self) -> Duration {
        seconds(self.shutdown_timeout_seconds)
    }

    pub fn drain_timeout(&self) -> Duration {
        seconds(self.drain_timeout_seconds)
    }

    /// The enabled tasks, by name.
    pub fn enabled_tasks(&self) -> impl Iterator<Item = (&String, &TaskConfig)> {
        self.tasks.iter().filter(|(_, t)| t.enabled)
    }

    /// Checks what the types cannot: bounds that contradict each other, topics used twice.
    pub fn validate(&self) -> Result<(), String> {
        self.telemetry.validate()?;
        self.s3.validate()?;
        self.input.validate()?;
        if self.enabled_tasks().next().is_none() {
            return Err("no task is enabled; enable at least one under [tasks]".into());
        }
        if self.worker.dns.is_some() && !self.worker.urls.is_empty() {
            return Err("worker.dns and worker.urls are both set; keep one".into());
        }
        let max_wait = MAX_MODEL_CHECK_WAIT_SECONDS;
        if !(0.0..=max_wait).contains(&self.worker.model_check_wait_seconds) {
            return Err(format!(
                "worker.model_check_wait_seconds must be 0 to {max_wait}, got {}",
                self.worker.model_check_wait_seconds
            ));
        }
        if self.delivery == Delivery::ExactlyOnce {
            let id = self.kafka.transactional_id();
            if id.is_empty() || id.len() > MAX_TRANSACTIONAL_ID_BYTES {
                return Err(format!(
                    "kafka.transactional_id must be 1 to {MAX_TRANSACTIONAL_ID_BYTES} bytes, got {} bytes",
                    id.len()
                ));
            }
            if !(1_000..=900_000).contains(&self.kafka.transaction_timeout_ms) {
                return Err(format!(
                    "kafka.transaction_timeout_ms must be in [1000, 900000] (the broker's default \
                     transaction.max.timeout.ms), got {}",
                    self.kafka.transaction_timeout_ms
                ));
            }
            if self.kafka.properties.get("enable.idempotence").is_some_and(|v| v != "true") {
                return Err("delivery = \"exactly-once\" needs the idempotent producer; remove \
                            enable.idempotence from [kafka.properties]"
                    .into());
            }
        }
        if !(0.0..1.0).contains(&self.resume_fraction) {
            return Err(format!("resume_fraction must be in [0, 1), got {}", self.resume_fraction));
        }
        let mut topics = BTreeMap::new();
        for (name, task) in self.enabled_tasks() {
            let p = &task.gpu_permits;
            if p.min == 0 || p.min > p.max || !(p.min..=p.max).contains(&p.initial) {
                return Err(format!(
                    "tasks.{name}.gpu_permits must satisfy 1 <= min <= initial <= max, got min {} initial {} max {}",
                    p.min, p.initial, p.max
                ));
            }
            match task.converter {
                Converter::Image => {
                    task.image.validate().map_err(|e| format!("tasks.{name}.{e}"))?;
                    task.video.validate().map_err(|e| format!("tasks.{name}.{e}"))?;
                }
                Converter::Audio => task.audio.validate().map_err(|e| format!("tasks.{name}.{e}"))?,
                Converter::Tensor => task.tensor.validate().map_err(|e| format!("tasks.{name}.{e}"))?,
                Converter::Wav => {}
            }
            if !task.stages.is_empty() {
                if task.converter != Converter::Image {
                    return Err(format!("tasks.{name}.stages are for converter \"image\", not \"{}\"", task.converter.as_str()));
                }
                if !task.outputs.is_empty() {
                    return Err(format!("tasks.{name}: a task with stages gives their rows (stages.outputs), not its own outputs"));
                }
                if task.model_version.is_some() {
                    return Err(format!("tasks.{name}.model_version pins the task's model; a task with stages runs the newest version of each stage's model"));
                }
                crate::tasks::stages::validate(&task.stages, task.max_output_elements).map_err(|e| format!("tasks.{name}.{e}"))?;
            } else if task.configured_outputs() {
                crate::tasks::outputs::validate(&task.outputs, task.max_output_elements)
                    .map_err(|e| format!("tasks.{name}.{e}"))?;
                let whole_audio =
                    task.converter == Converter::Audio && task.audio.frames.is_none() && task.audio.length.is_none();
                let image_tensor = task.converter == Converter::Image;
                if let Some(op) = crate::tasks::outputs::Outputs::wants_placement(&task.outputs).filter(|_| !image_tensor) {
                    return Err(format!(
                        "tasks.{name}.outputs: {} needs converter \"image\" (mode \"tensor\"), whose placement maps \
                         the boxes back to the image",
                        op.as_str()
                    ));
                }
                if crate::tasks::outputs::Outputs::wants_speech_segments(&task.outputs) && !whole_audio {
                    return Err(format!(
                        "tasks.{name}.outputs: speech_segments needs converter \"audio\" without audio.length or \
                         audio.frames (the probabilities of the whole signal, window by window)"
                    ));
                }
            } else if !task.outputs.is_empty() {
                return Err(format!(
                    "tasks.{name}.outputs is for the audio and tensor converters and image mode \"tensor\"; \
                     converter \"{}\" makes its own result",
                    task.converter.as_str()
                ));
            }
            if !(0.0..=1.0).contains(&task.retry.jitter) {
                return Err(format!("tasks.{name}.retry.jitter must be in [0, 1], got {}", task.retry.jitter));
            }
            if task.worker_dns.is_some() && task.worker_urls.is_some() {
                return Err(format!("tasks.{name} names both worker_dns and worker_urls; keep one"));
            }
            match task.workers(&self.worker) {
                WorkerSource::Static(urls) => validate_urls(&urls, &format!("tasks.{name}'s workers"))?,
                WorkerSource::Dns(dns) => dns.validate(&format!("tasks.{name}'s worker dns"))?,
            }
            let topic = task.requests_topic(name);
            if let Some(other) = topics.insert(topic.clone(), name) {
                return Err(format!("tasks {other} and {name} both read {topic}"));
            }
        }
        Ok(())
    }
}

fn optional_url_list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    Ok(Option::<Urls>::deserialize(d)?.map(Urls::into_list))
}

/// What a consumer of the output topics may count on (`delivery`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Delivery {
    /// Outputs produced as records finish, offsets committed behind them: nothing lost, and a
    /// crash repeats the records past the last commit (at most `max_in_flight`).
    AtLeastOnce,
    /// Outputs and offsets in one transaction at a time: one output per request for a
    /// `read_committed` consumer.
    ExactlyOnce,
}

/// How the gateways of one group share the request partitions (`kafka.group_protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GroupProtocol {
    /// Kafka's original protocol, with librdkafka's cooperative-sticky assignor: the members
    /// agree on the assignment among themselves, in rounds the coordinator leads.
    Classic,
    /// KIP-848's protocol (Kafka 4.0 on): the broker computes the assignment and hands
    /// partitions over one member at a time, with no group-wide round. The session timeout is
    /// then the broker's (`group.consumer.session.timeout.ms`), not `kafka.session_timeout_ms`.
    Consumer,
}

/// Longest transactional id taken (the broker's own limit is far larger; an id is a name).
pub const MAX_TRANSACTIONAL_ID_BYTES: usize = 249;

/// This machine's host name (a pod's name, a container's id), or `gateway` when it has none.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that much.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match std::str::from_utf8(&buf[..end]) {
        Ok(name) if rc == 0 && !name.is_empty() => name.to_string(),
        _ => "gateway".into(),
    }
}

fn seconds(s: f64) -> Duration {
    Duration::from_secs_f64(if s.is_finite() { s.max(0.0) } else { 0.0 })
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// Bootstrap servers, comma-separated (librdkafka's `bootstrap.servers`).
    pub brokers: String,
    /// Consumer group of all gateway replicas.
    pub group_id: String,
    /// librdkafka's prefetch queue bound, in KiB, for all partitions together
    /// (`queued.max.messages.kbytes`).
    pub queue_max_kbytes: u64,
    /// Largest fetch response (`fetch.max.bytes`) and per partition (`max.partition.fetch.bytes`).
    pub fetch_max_bytes: u64,
    pub partition_fetch_max_bytes: u64,
    /// Group session timeout; the drain timeout must stay below it. With `group_protocol =
    /// "consumer"` the broker sets it (`group.consumer.session.timeout.ms`, 45 s by default)
    /// and this is only what the drain timeout is checked against: keep the two equal.
    pub session_timeout_ms: u64,
    /// `classic` (the default) or `consumer` (KIP-848): how the group's gateways share the
    /// request partitions ([`GroupProtocol`]).
    pub group_protocol: GroupProtocol,
    /// The transactional id of this gateway's producer in exactly-once delivery: one per
    /// gateway instance, the same across its restarts (a restarted instance then aborts what
    /// its predecessor left open at once, instead of readers waiting out the transaction
    /// timeout). Unset: `<group_id>-<host name>-<process id>`: distinct for two gateways on one
    /// host, and the same across a container's restarts (a pod's or container's host name, the
    /// gateway as its process 1); a gateway restarted on a bare host gets a new one, and its
    /// predecessor's open transaction is aborted by the broker after `transaction_timeout_ms`.
    /// Two live gateways must never share one: each would fence the other.
    pub transactional_id: Option<String>,
    /// In exactly-once delivery, how long a transaction may stay open before the broker aborts
    /// it (`transaction.timeout.ms`): how long a crashed gateway's open transaction can hold
    /// back `read_committed` readers of its output partitions when it does not come back.
    pub transaction_timeout_ms: u64,
    /// In exactly-once delivery, read every committed output back as a `read_committed`
    /// reader, write again any found aborted, and report results partitions held by a hanging
    /// transaction (`consume::verify`). Committed outputs stay charged to `max_held_bytes`
    /// until read back.
    pub verify_outputs: bool,
    /// Extra librdkafka properties, by their librdkafka names, applied to the consumer and the
    /// producer (e.g. `"security.protocol" = "SASL_SSL"`). They override vramgate's defaults.
    /// Numbers and booleans are taken as their text (a numeric `sasl.password` is a password).
    /// In the environment a name's dots are underscores:
    /// `VRAMGATE_GATEWAY_KAFKA__PROPERTIES__SASL_PASSWORD` sets `sasl.password`. Secret values
    /// are never printed (see [`vramgate_shared::kafka`]).
    pub properties: Properties,
}

impl KafkaConfig {
    /// The exactly-once producer's transactional id: the configured one, or
    /// `<group_id>-<host name>-<process id>`.
    pub fn transactional_id(&self) -> String {
        match &self.transactional_id {
            Some(id) => id.clone(),
            None => format!("{}-{}-{}", self.group_id, host_name(), std::process::id()),
        }
    }

    /// Where the gateway's clients connect, with which properties.
    pub fn connection(&self) -> Connection {
        Connection { brokers: self.brokers.clone(), properties: self.properties.clone() }
    }
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            group_id: "vramgate-gateway".into(),
            queue_max_kbytes: 16 * 1024,
            fetch_max_bytes: 16 * 1024 * 1024,
            partition_fetch_max_bytes: 1024 * 1024,
            session_timeout_ms: 45_000,
            group_protocol: GroupProtocol::Classic,
            transactional_id: None,
            transaction_timeout_ms: 10_000,
            verify_outputs: true,
            properties: Properties::default(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerEndpoint {
    /// Base URL of the ai-worker, e.g. `http://127.0.0.1:8081`: a set of one, unless `urls` or
    /// `dns` name more.
    pub url: String,
    /// Several workers (one per GPU), in place of `url`: a list, or in the environment one
    /// comma-separated string (`VRAMGATE_GATEWAY_WORKER__URLS=http://a:8081,http://b:8081`).
    #[serde(deserialize_with = "url_list")]
    pub urls: Vec<String>,
    /// Workers found in DNS (e.g. a Kubernetes headless Service), in place of `url` and `urls`.
    pub dns: Option<DnsConfig>,
    /// How each request picks its worker among several.
    pub routing: Routing,
    /// Limit for one worker call, connection included; also sent to the worker as its deadline.
    pub request_timeout_seconds: f64,
    /// Bearer token sent to workers that require one (`Authorization: Bearer …`; the worker's
    /// `auth_token`). Never printed. Env: `VRAMGATE_GATEWAY_WORKER__AUTH_TOKEN`.
    pub auth_token: Option<Secret>,
    /// At start-up, how long the gateway waits for a worker of each model a task calls to
    /// answer with the model's metadata before it consumes (0 to 600). A task whose converter or
    /// `[[outputs]]` rows do not fit its model stops the gateway. Past the wait the gateway
    /// consumes without the check, says so in a warning, and checks at the first answer (a
    /// misfit then stops it too); 0: no wait, the check only in the background
    /// (`crate::model_check`).
    pub model_check_wait_seconds: f64,
    /// How the gateway calls its workers: `http` (OIP over HTTP with the binary extension, the
    /// workers' `listen`) or `grpc` (OIP's `GRPCInferenceService`, the workers' `grpc_listen`:
    /// the URLs then name that port, e.g. `http://worker:8001`). Readiness and the probe of a
    /// worker taken out of service go through the same door.
    pub protocol: crate::call::client::Protocol,
}

impl WorkerEndpoint {
    pub fn model_check_wait(&self) -> Duration {
        seconds(self.model_check_wait_seconds)
    }
}

impl Default for WorkerEndpoint {
    fn default() -> Self {
        WorkerEndpoint {
            url: "http://127.0.0.1:8081".into(),
            urls: Vec::new(),
            dns: None,
            routing: Routing::Memory,
            request_timeout_seconds: 60.0,
            auth_token: None,
            model_check_wait_seconds: 30.0,
            protocol: crate::call::client::Protocol::Http,
        }
    }
}

/// Most workers one task calls: URLs listed, or addresses taken from one DNS answer.
pub const MAX_WORKER_ENDPOINTS: usize = 64;

/// How a request picks its worker among the task's workers (all of them: per-worker adaptive
/// permits, ejection of failing workers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// The most free admission memory for the request's estimated size, from what each worker
    /// last reported less what this gateway sent it since (see `call::route`).
    Memory,
    /// In turn, whatever their memory (for comparison).
    RoundRobin,
    /// The fewest of this gateway's calls in progress (for comparison).
    LeastInFlight,
}

/// Workers found in DNS: every address (A and AAAA) `name` resolves to, on `port`, or with
/// `srv` every address of every SRV target on its record's port; re-resolved every
/// `refresh_seconds` (`call::discovery`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DnsConfig {
    /// The name to resolve, e.g. `ai-worker.vramgate.svc.cluster.local` (a headless Service
    /// answers with one address per ready pod), or with `srv` an SRV name,
    /// `_http._tcp.ai-worker.vramgate.svc.cluster.local`.
    pub name: String,
    /// The workers' port (not used with `srv`: each record names its own).
    pub port: u16,
    /// `name` is an SRV name (`_service._proto.name`): the workers are its targets' addresses,
    /// each on its record's port.
    pub srv: bool,
    /// `http` or `https`.
    pub scheme: String,
    /// How often the name is resolved again (0.5 s to 1 h).
    pub refresh_seconds: f64,
    /// A DNS server (`ip:port`) asked directly (UDP, TCP for truncated answers), and no other;
    /// unset: the system resolver (`/etc/hosts`, `resolv.conf` and its search domains, as a
    /// pod's own lookups).
    pub nameserver: Option<String>,
    /// Most workers taken from one answer (at most 64); the rest are ignored, with a warning.
    pub max_endpoints: usize,
}

impl Default for DnsConfig {
    fn default() -> Self {
        DnsConfig {
            name: String::new(),
            port: 8081,
            srv: false,
            scheme: "http".into(),
            refresh_seconds: 5.0,
            nameserver: None,
            max_endpoints: MAX_WORKER_ENDPOINTS,
        }
    }
}

impl DnsConfig {
    pub fn refresh(&self) -> Duration {
        seconds(self.refresh_seconds.clamp(0.5, 3600.0))
    }

    fn validate(&self, at: &str) -> Result<(), String> {
        if self.name.trim().is_empty() {
            return Err(format!("{at}.name is empty: name the DNS name whose addresses are the workers"));
        }
        if let Err(e) = hickory_resolver::proto::rr::Name::from_ascii(self.name.trim()) {
            return Err(format!("{at}.name '{}' is not a DNS name: {e}", self.name));
        }
        // `_service._proto.name` (RFC 2782): an SRV name asked for addresses, or a host name
        // asked for SRV records, finds nothing and would empty the worker set.
        let labels: Vec<&str> = self.name.trim().split('.').collect();
        let srv_name = labels.len() > 2 && labels[0].starts_with('_') && labels[1].starts_with('_');
        if self.srv && !srv_name {
            return Err(format!("{at}.srv is set but name '{}' is not an SRV name (_service._proto.name)", self.name));
        }
        if !self.srv && srv_name {
            return Err(format!("{at}.name '{}' is an SRV name: set srv = true", self.name));
        }
        if !matches!(self.scheme.as_str(), "http" | "https") {
            return Err(format!("{at}.scheme must be http or https, got '{}'", self.scheme));
        }
        if !(1..=MAX_WORKER_ENDPOINTS).contains(&self.max_endpoints) {
            return Err(format!("{at}.max_endpoints must be 1 to {MAX_WORKER_ENDPOINTS}, got {}", self.max_endpoints));
        }
        if let Some(ns) = &self.nameserver {
            ns.parse::<std::net::SocketAddr>()
                .map_err(|_| format!("{at}.nameserver must be ip:port (e.g. 10.96.0.10:53), got '{ns}'"))?;
        }
        Ok(())
    }
}

/// Where a task's workers come from.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerSource {
    Static(Vec<String>),
    Dns(DnsConfig),
}

/// A list of URLs, or one comma-separated string (the environment's form).
#[derive(Deserialize)]
#[serde(untagged)]
enum Urls {
    List(Vec<String>),
    Text(String),
}

impl Urls {
    fn into_list(self) -> Vec<String> {
        let urls = match self {
            Urls::List(list) => list,
            Urls::Text(text) => text.split(',').map(str::to_string).collect(),
        };
        urls.into_iter().map(|u| u.trim().to_string()).filter(|u| !u.is_empty()).collect()
    }
}

fn url_list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(Urls::deserialize(d)?.into_list())
}

fn validate_urls(urls: &[String], at: &str) -> Result<(), String> {
    if urls.len() > MAX_WORKER_ENDPOINTS {
        return Err(format!("{at} names {} workers; at most {MAX_WORKER_ENDPOINTS}", urls.len()));
    }
    for url in urls {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(format!("{at}: '{url}' must start with http:// or https://"));
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InputConfig {
    /// `file://` URIs must name a path under this folder (as configured or its canonical
    /// form), and must stay under it when symlinks are followed (checked by the kernel while
    /// opening: `openat2` with `RESOLVE_BENEATH`). Only regular files are read.
    pub file_root: PathBuf,
    /// Largest input, in bytes, read from a file or decoded from base64 (enforced while
    /// reading, not only from the file's reported size).
    pub max_input_bytes: u64,
    /// How long reading one input file may take before the record is dead-lettered
    /// (`fetch_failed`): a file on a hung network mount must not hold a record for ever.
    pub read_timeout_seconds: f64,
    /// `https://` inputs from the hosts listed.
    pub http: HttpInputConfig,
}

impl Default for InputConfig {
    fn default() -> Self {
        InputConfig {
            file_root: PathBuf::from("."),
            max_input_bytes: 64 * 1024 * 1024,
            read_timeout_seconds: 30.0,
            http: HttpInputConfig::default(),
        }
    }
}

impl InputConfig {
    pub fn read_timeout(&self) -> Duration {
        seconds(self.read_timeout_seconds)
    }

    fn validate(&self) -> Result<(), String> {
        self.http.validate()
    }
}

/// Most hosts `input.http.hosts` may list.
pub const MAX_HTTP_HOSTS: usize = 64;

/// `https://host/path` inputs: only from the hosts the operator listed, so that an event cannot
/// make the gateway fetch an internal address. Redirects are never followed (a listed host
/// could otherwise send the fetch anywhere), and URLs with a query string are refused.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpInputConfig {
    /// `host` or `host:port` (the URL's own port, or 443 / 80 by default), exactly as events
    /// name them, compared without case. A list, or one comma-separated string (the
    /// environment's form). Empty: no `https://` inputs.
    #[serde(deserialize_with = "url_list")]
    pub hosts: Vec<String>,
    /// Plain `http://` URLs too, to the same hosts (a server on a private network).
    pub allow_http: bool,
    /// One request (a HEAD, or a GET with its whole body) longer than this is cut off.
    pub request_timeout_seconds: f64,
    pub connect_timeout_seconds: f64,
    /// Retries of a request that failed for a reason worth retrying (5xx, 429, 408, a refused
    /// or reset connection, a timeout), with backoff, none started past `retry_timeout_seconds`.
    pub max_retries: usize,
    pub retry_timeout_seconds: f64,
}

impl Default for HttpInputConfig {
    fn default() -> Self {
        HttpInputConfig {
            hosts: Vec::new(),
            allow_http: false,
            request_timeout_seconds: 30.0,
            connect_timeout_seconds: 5.0,
            max_retries: 10,
            retry_timeout_seconds: 30.0,
        }
    }
}

impl HttpInputConfig {
    pub fn timeouts(&self) -> Timeouts {
        Timeouts::new(self.request_timeout_seconds, self.connect_timeout_seconds, self.retry_timeout_seconds)
    }

    fn validate(&self) -> Result<(), String> {
        if self.hosts.len() > MAX_HTTP_HOSTS {
            return Err(format!("input.http.hosts lists {} hosts; at most {MAX_HTTP_HOSTS}", self.hosts.len()));
        }
        for host in &self.hosts {
            let (name, port) = match host.rsplit_once(':') {
                Some((name, port)) => (name, Some(port)),
                None => (host.as_str(), None),
            };
            let name_ok = !name.is_empty()
                && name.len() <= 253
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-');
            let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0));
            if !name_ok || !port_ok {
                return Err(format!("input.http.hosts: '{host}' is not host or host:port (no scheme, no path)"));
            }
        }
        self.timeouts().validate("input.http", self.max_retries)
    }
}

/// The waits of a client of remote inputs or outputs (`[s3]`, `[input.http]`).
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// One request: a HEAD, or a GET or PUT with its whole body.
    pub request: Duration,
    pub connect: Duration,
    /// No retry starts after this long since the first try.
    pub retry: Duration,
    seconds: [f64; 3],
}

impl Timeouts {
    fn new(request: f64, connect: f64, retry: f64) -> Self {
        Timeouts { request: seconds(request), connect: seconds(connect), retry: seconds(retry), seconds: [request, connect, retry] }
    }

    /// One whole read or write, every retry included: the backstop past the client's own
    /// per-request timeout and retry budget.
    pub fn deadline(&self) -> Duration {
        self.retry + self.request * 2
    }

    /// Each wait within its range, and `max_retries` too; `at` is the section (`s3`).
    fn validate(&self, at: &str, max_retries: usize) -> Result<(), String> {
        let names = ["request_timeout_seconds", "connect_timeout_seconds", "retry_timeout_seconds"];
        for ((key, value), max) in names.iter().zip(self.seconds).zip([3600.0, 600.0, MAX_S3_RETRY_SECONDS]) {
            if !(value > 0.0 && value <= max) {
                return Err(format!("{at}.{key} must be in (0, {max}], got {value}"));
            }
        }
        if max_retries > MAX_S3_RETRIES {
            return Err(format!("{at}.max_retries must be at most {MAX_S3_RETRIES}, got {max_retries}"));
        }
        Ok(())
    }
}

/// Most buckets one gateway reads from (one S3 client each).
pub const MAX_S3_BUCKETS: usize = 64;
/// Most retries of one S3 request (on 5xx, throttling, timeouts and refused connections).
pub const MAX_S3_RETRIES: usize = 100;
/// Longest time one S3 request, its retries included, may take.
pub const MAX_S3_RETRY_SECONDS: f64 = 600.0;

/// An S3-compatible object store (AWS S3, SeaweedFS, MinIO, Ceph). Credentials come from the
/// AWS chain (`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, web identity
/// through `AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN`, ECS and EC2 instance metadata)
/// unless both keys are set here; they are never printed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct S3Config {
    /// The buckets events may name as inputs (`s3://bucket/key`). Any other bucket is refused
    /// before a request is made, so an event cannot reach a bucket the operator did not list.
    /// Empty: no `s3://` inputs. A list, or one
    /// comma-separated string (the environment's form).
    #[serde(deserialize_with = "url_list")]
    pub buckets: Vec<String>,
    /// The endpoint of an S3-compatible server (`http://127.0.0.1:8333`); empty for AWS S3 in
    /// `region`. When empty, `AWS_ENDPOINT` or `AWS_ENDPOINT_URL_S3` from the environment is used.
    pub endpoint: String,
    pub region: String,
    /// Plain `http://` to the endpoint (a server on loopback or a private network).
    pub allow_http: bool,
    /// Path-style requests (`endpoint/bucket/key`), which S3-compatible servers expect;
    /// `false` uses virtual-hosted style (`bucket.endpoint/key`).
    pub path_style: bool,
    pub access_key_id: Option<Secret>,
    pub secret_access_key: Option<Secret>,
    /// One request (a HEAD, or a GET with its whole body) longer than this is cut off and,
    /// being idempotent, retried.
    pub request_timeout_seconds: f64,
    pub connect_timeout_seconds: f64,
    /// Retries of one request that failed for a reason worth retrying (5xx, 429 throttling,
    /// 408, a refused or reset connection, a timeout), with exponential backoff.
    pub max_retries: usize,
    /// No retry starts after this long since the request's first try.
    pub retry_timeout_seconds: f64,
}

impl Default for S3Config {
    fn default() -> Self {
        S3Config {
            buckets: Vec::new(),
            endpoint: String::new(),
            region: "us-east-1".into(),
            allow_http: false,
            path_style: true,
            access_key_id: None,
            secret_access_key: None,
            request_timeout_seconds: 30.0,
            connect_timeout_seconds: 5.0,
            // Enough that the backoff (0.1 s doubling to 5 s, jittered) spans retry_timeout:
            // a server restarting for some seconds costs waiting, not records.
            max_retries: 30,
            retry_timeout_seconds: 60.0,
        }
    }
}

impl S3Config {
    pub fn timeouts(&self) -> Timeouts {
        Timeouts::new(self.request_timeout_seconds, self.connect_timeout_seconds, self.retry_timeout_seconds)
    }

    fn validate(&self) -> Result<(), String> {
        if self.buckets.len() > MAX_S3_BUCKETS {
            return Err(format!("s3.buckets lists {} buckets; at most {MAX_S3_BUCKETS}", self.buckets.len()));
        }
        for bucket in &self.buckets {
            if !crate::storage::valid_bucket(bucket) {
                return Err(format!("s3.buckets: '{bucket}' is not a valid bucket name (3-63 of a-z, 0-9, '.', '-')"));
            }
        }
        if !self.endpoint.is_empty() && !(self.endpoint.starts_with("http://") || self.endpoint.starts_with("https://")) {
            return Err(format!("s3.endpoint must start with http:// or https://, got '{}'", self.endpoint));
        }
        if self.endpoint.starts_with("http://") && !self.allow_http {
            return Err("s3.endpoint is plain http://: set s3.allow_http = true to allow it".into());
        }
        if self.access_key_id.is_some() != self.secret_access_key.is_some() {
            return Err("s3: set both access_key_id and secret_access_key, or neither (the AWS chain)".into());
        }
        self.timeouts().validate("s3", self.max_retries)
    }
}

/// How a task turns input bytes into the model's tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Converter {
    /// WAV → 16 kHz mono f32 → a voice-activity model → speech segments.
    Wav,
    /// PNG/JPEG/WebP → oriented, resized, normalised RGB → a face detector → boxes
    /// (`image.mode` faces or proposals), or any image model's input (`image.mode = "tensor"`).
    Image,
    /// WAV/FLAC/Ogg Vorbis/MP3 → mono at the model's rate → the whole signal, a fixed length or
    /// fixed windows → any audio model.
    Audio,
    /// The model's input tensor, in the event (OIP JSON form, or raw bytes in base64).
    Tensor,
}

impl Converter {
    pub fn as_str(self) -> &'static str {
        match self {
            Converter::Wav => "wav",
            Converter::Image => "image",
            Converter::Audio => "audio",
            Converter::Tensor => "tensor",
        }
    }
}

/// One row of the task table.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TaskConfig {
    pub enabled: bool,
    /// Topics; default `<task>.requests`, `<task>.results`, `<task>.dlq`.
    pub requests_topic: Option<String>,
    pub results_topic: Option<String>,
    pub dlq_topic: Option<String>,
    pub converter: Converter,
    /// The worker's model for this task.
    pub model: String,
    /// Pins `model` to this version (`/v2/models/<model>/versions/<n>/...`); unset: the newest
    /// version the worker serves, which a rollout changes (`docs/models.md`, "Updating a
    /// model"). The other models of a cascade are not pinned.
    pub model_version: Option<u64>,
    /// The worker for this task; default `worker.url`.
    pub worker_url: Option<String>,
    /// Several workers for this task (like `worker.urls`); default the `[worker]` table's.
    #[serde(deserialize_with = "optional_url_list")]
    pub worker_urls: Option<Vec<String>>,
    /// Workers found in DNS for this task (like `worker.dns`).
    pub worker_dns: Option<DnsConfig>,
    /// How this task picks a worker; default `worker.routing`.
    pub routing: Option<Routing>,
    /// The bearer token for this task's worker; default `worker.auth_token`.
    pub worker_auth_token: Option<Secret>,
    /// Threads of this task's CPU pool (decode, resample, resize); 0 = one per core. Each task
    /// has its own pool, so a burst of one type never queues behind the other.
    pub cpu_threads: usize,
    pub gpu_permits: PermitConfig,
    /// A record that waits longer than this for a GPU permit pauses this task's partitions
    /// until the permits catch up (it keeps waiting; nothing is dropped).
    pub permit_wait_ms: u64,
    /// Limit of one worker call; default `worker.request_timeout_seconds`.
    pub request_timeout_seconds: Option<f64>,
    pub retry: RetryConfig,
    /// Options of the `wav` converter.
    pub wav: WavOptions,
    /// Options of the `image` converter.
    pub image: ImageOptions,
    /// Options of the `audio` converter.
    pub audio: AudioOptions,
    /// Options of the `tensor` converter.
    pub tensor: TensorOptions,
    /// The configured converters' results (`audio`, `tensor`, `image` in `tensor` mode): the
    /// model outputs to ask for and their post-processing, one `[[tasks.<name>.outputs]]` row
    /// each.
    pub outputs: Vec<OutputRule>,
    /// A model output with more values is a dead letter (`output_rejected`).
    pub max_output_elements: usize,
    /// A pipeline (`image` converter only): stages, each a model with its own input and rows,
    /// instead of `model`, `image` and `outputs` (`crate::tasks::stages`).
    pub stages: Vec<crate::tasks::stages::StageConfig>,
    /// Videos and frame batches (`image` converter only; `crate::video`).
    pub video: crate::video::VideoOptions,
}

impl Default for TaskConfig {
    fn default() -> Self {
        TaskConfig {
            enabled: true,
            requests_topic: None,
            results_topic: None,
            dlq_topic: None,
            converter: Converter::Wav,
            model: "silero_vad".into(),
            model_version: None,
            worker_url: None,
            worker_urls: None,
            worker_dns: None,
            routing: None,
            worker_auth_token: None,
            cpu_threads: 0,
            gpu_permits: PermitConfig::default(),
            permit_wait_ms: 1000,
            request_timeout_seconds: None,
            retry: RetryConfig::default(),
            wav: WavOptions::default(),
            image: ImageOptions::default(),
            audio: AudioOptions::default(),
            tensor: TensorOptions::default(),
            outputs: Vec::new(),
            max_output_elements: crate::tasks::outputs::DEFAULT_MAX_OUTPUT_ELEMENTS,
            stages: Vec::new(),
            video: crate::video::VideoOptions::default(),
        }
    }
}

impl TaskConfig {
    /// Whether the result is the model's outputs through `[[outputs]]` rows (the configured
    /// converters) rather than a result the converter makes itself (voice segments, faces).
    pub fn configured_outputs(&self) -> bool {
        match self.converter {
            Converter::Audio | Converter::Tensor => true,
            Converter::Image => self.image.mode == crate::tasks::image::ImageMode::Tensor,
            Converter::Wav => false,
        }
    }

    /// Every `[[outputs]]` row of the task: its own, or its stages'.
    pub fn output_rules(&self) -> impl Iterator<Item = &OutputRule> {
        self.outputs.iter().chain(self.stages.iter().flat_map(|s| s.outputs.iter()))
    }

    pub fn requests_topic(&self, name: &str) -> String {
        self.requests_topic.clone().unwrap_or_else(|| format!("{name}.requests"))
    }

    pub fn results_topic(&self, name: &str) -> String {
        self.results_topic.clone().unwrap_or_else(|| format!("{name}.results"))
    }

    pub fn dlq_topic(&self, name: &str) -> String {
        self.dlq_topic.clone().unwrap_or_else(|| format!("{name}.dlq"))
    }

    /// This task's workers: its own `worker_dns`, `worker_urls` or `worker_url` if it names
    /// any (in that order), else the `[worker]` table's `dns`, `urls` or `url`.
    pub fn workers(&self, defaults: &WorkerEndpoint) -> WorkerSource {
        if let Some(dns) = &self.worker_dns {
            return WorkerSource::Dns(dns.clone());
        }
        if let Some(urls) = self.worker_urls.as_ref().filter(|u| !u.is_empty()) {
            return WorkerSource::Static(urls.clone());
        }
        if let Some(url) = &self.worker_url {
            return WorkerSource::Static(vec![url.clone()]);
        }
        if let Some(dns) = &defaults.dns {
            return WorkerSource::Dns(dns.clone());
        }
        if !defaults.urls.is_empty() {
            return WorkerSource::Static(defaults.urls.clone());
        }
        WorkerSource::Static(vec![defaults.url.clone()])
    }

    pub fn cpu_threads(&self) -> usize {
        match self.cpu_threads {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
            n => n,
        }
    }
}

/// Concurrent worker calls of one task: starts at `initial`, adapts between `min` and `max`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PermitConfig {
    pub initial: usize,
    pub min: usize,
    pub max: usize,
}

impl Default for PermitConfig {
    fn default() -> Self {
        PermitConfig { initial: 4, min: 1, max: 16 }
    }
}

/// When and how often a failed worker call is tried again.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Calls per record that fail with 5xx, a timeout or a connection error before the record
    /// is dead-lettered as `worker_unavailable`.
    pub max_attempts: u32,
    /// Backoff before retry n is base·2^(n-1), capped at max, less a random part of up to
    /// `jitter` of it (0 = none, 1 = "full jitter").
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    pub jitter: f64,
    /// 503/429 answers ("busy, come back after Retry-After") do not use up attempts, since the
    /// worker is healthy; this bounds how long a record may keep being told to wait.
    pub max_retry_seconds: f64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig { max_attempts: 8, backoff_base_ms: 250, backoff_max_ms: 5000, jitter: 0.5, max_retry_seconds: 300.0 }
    }
}

#[cfg(test)]
// figment's `Jail` closures must return its large error type; that is its API, not ours.
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_name_both_tasks() {
        let config = GatewayConfig::default();
        config.validate().expect("defaults validate");
        let names: Vec<&String> = config.enabled_tasks().map(|(n, _)| n).collect();
        assert_eq!(names, ["image", "voice"]);
        assert_eq!(config.tasks["image"].requests_topic("image"), "image.requests");
        assert_eq!(config.tasks["voice"].dlq_topic("voice"), "voice.dlq");
    }

    #[test]
    fn the_shipped_config_file_loads_and_matches_the_defaults() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway.toml");
        let config: GatewayConfig = vramgate_shared::config::load(Some(&path), "VGGW_UNUSED_").expect("loads");
        config.validate().expect("validates");
        let defaults = GatewayConfig::default();
        assert_eq!(
            serde_json::to_value(&config).expect("serialises"),
            serde_json::to_value(&defaults).expect("serialises"),
            "config/gateway.toml documents the defaults; keep them in step"
        );
    }

    #[test]
    fn the_product_segmentor_is_a_valid_configuration_of_stages() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/products.toml");
        let config: GatewayConfig = vramgate_shared::config::load(Some(&path), "VGGW_UNUSED_").expect("loads");
        config.validate().expect("validates");
        let names: Vec<&String> = config.enabled_tasks().map(|(n, _)| n).collect();
        assert_eq!(names, ["products"]);
        let stages: Vec<(&str, &str, &str)> =
            config.tasks["products"].stages.iter().map(|s| (s.name.as_str(), s.model.as_str(), s.input.as_str())).collect();
        assert_eq!(stages, [("foreground", "u2netp", "image"), ("people", "yolov4_tiny", "image"), ("people_masks", "u2netp", "people.p5")]);
        assert_eq!(config.tasks["products"].output_rules().filter(|r| r.store.is_some()).count(), 2);
        // Stages are the image converter's, and replace the task's own rows.
        let mut wrong = config.clone();
        wrong.tasks.get_mut("products").expect("products").converter = Converter::Audio;
        assert!(wrong.validate().expect_err("audio stages").contains("stages are for converter \"image\""));
    }

    #[test]
    #[allow(clippy::result_large_err)]
    fn librdkafka_properties_take_numbers_as_text_and_never_echo_secrets() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("g.toml", "[kafka.properties]\n\"sasl.password\" = 123456789\n\"linger.ms\" = 7\n")?;
            let config: GatewayConfig = vramgate_shared::config::load(Some(std::path::Path::new("g.toml")), "VGGW_T_")
                .expect("numbers are text");
            assert_eq!(config.kafka.properties.get("sasl.password"), Some("123456789"));
            assert_eq!(config.kafka.properties.get("linger.ms"), Some("7"));
            assert!(!format!("{config:?}").contains("123456789"), "Debug hides the password");
            jail.create_file("h.toml", "[kafka.properties]\n\"sasl.password\" = [123456789]\n")?;
            let err = vramgate_shared::config::load::<GatewayConfig>(Some(std::path::Path::new("h.toml")), "VGGW_T_")
                .expect_err("a list is no password")
                .to_string();
            assert!(!err.contains("123456789"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn configured_tasks_are_checked_row_by_row() {
        let check = |toml: &str, want: &str| {
            figment::Jail::expect_with(|jail| {
                jail.create_file("g.toml", toml)?;
                let config: GatewayConfig =
                    vramgate_shared::config::load(Some(std::path::Path::new("g.toml")), "VGGW_C_").expect("parses");
                match (config.validate(), want) {
                    (Ok(()), "") => {}
                    (Ok(()), want) => panic!("accepted; expected an error with {want}"),
                    (Err(e), want) => assert!(!want.is_empty() && e.contains(want), "{e} should contain {want:?}"),
                }
                Ok(())
            });
        };
        let audio = "[tasks.s]\nconverter = \"audio\"\nmodel = \"silero_vad\"\n";
        check(&format!("{audio}[[tasks.s.outputs]]\nname = \"speech_prob\"\npost = [\"speech_segments\"]\n"), "");
        check(audio, "tasks.s.outputs needs at least one");
        check(
            &format!("{audio}[tasks.s.audio]\nframes = {{ size = 512, hop = 512 }}\n[[tasks.s.outputs]]\nname = \"p\"\npost = [\"speech_segments\"]\n"),
            "speech_segments needs converter \"audio\" without audio.length or audio.frames",
        );
        check("[[tasks.voice.outputs]]\nname = \"x\"\n", "tasks.voice.outputs is for the audio and tensor converters");
        check(
            "[tasks.t]\nconverter = \"tensor\"\nmodel = \"m\"\n[tasks.t.tensor]\nmax_elements = 0\n[[tasks.t.outputs]]\nname = \"y\"\n",
            "tasks.t.tensor.max_elements must be 1 to",
        );
        check(
            "[tasks.c]\nconverter = \"image\"\nmodel = \"m\"\n[tasks.c.image]\nmode = \"tensor\"\nwidth = 224\nheight = 224\n\
             [[tasks.c.outputs]]\nname = \"logits\"\npost = [\"softmax\", \"top_k\"]\n",
            "",
        );
    }

    /// Loads the config with `vars` set in the environment (prefix `VGGW_`) and hands it to
    /// `check`.
    fn with_env(vars: &[(&str, &str)], check: impl FnOnce(GatewayConfig)) {
        figment::Jail::expect_with(|jail| {
            for (name, value) in vars {
                jail.set_env(name, value);
            }
            check(vramgate_shared::config::load(None, "VGGW_").expect("loads"));
            Ok(())
        });
    }

    #[test]
    fn object_storage_keys_come_from_the_environment_and_the_secret_stays_hidden() {
        let vars = [
            ("VGGW_S3__BUCKETS", "media,raw-audio"),
            ("VGGW_S3__ACCESS_KEY_ID", "AKIAEXAMPLE"),
            ("VGGW_S3__SECRET_ACCESS_KEY", "0123s3cret"),
            ("VGGW_INPUT__HTTP__HOSTS", "media.example.com,127.0.0.1:8888"),
        ];
        with_env(&vars, |config| {
            assert_eq!(config.s3.buckets, ["media", "raw-audio"]);
            assert_eq!(config.s3.access_key_id.as_ref().map(Secret::expose), Some("AKIAEXAMPLE"));
            assert_eq!(config.s3.secret_access_key.as_ref().map(Secret::expose), Some("0123s3cret"), "taken verbatim");
            assert_eq!(config.input.http.hosts, ["media.example.com", "127.0.0.1:8888"]);
            assert!(config.validate().is_ok(), "{:?}", config.validate());
            assert!(!format!("{config:?}").contains("0123s3cret"), "the secret is printed");
        });
        // One key without the other, a bucket S3 would refuse, a host with a scheme.
        with_env(&[("VGGW_S3__ACCESS_KEY_ID", "AKIAEXAMPLE")], |config| {
            assert!(config.validate().expect_err("half a key pair").contains("both"));
        });
        with_env(&[("VGGW_S3__BUCKETS", "Media_Bucket")], |config| {
            assert!(config.validate().expect_err("bad bucket").contains("Media_Bucket"));
        });
        with_env(&[("VGGW_INPUT__HTTP__HOSTS", "https://media.example.com")], |config| {
            assert!(config.validate().expect_err("a scheme").contains("host:port"));
        });
    }

    #[test]
    fn librdkafka_properties_reach_their_names_from_the_environment_and_stay_hidden() {
        // The underscore form a shell can export, a secret of digits, and the dotted form
        // Kubernetes allows.
        let vars = [
            ("VGGW_KAFKA__PROPERTIES__SECURITY_PROTOCOL", "SASL_SSL"),
            ("VGGW_KAFKA__PROPERTIES__SASL_PASSWORD", "0123e4"),
            ("VGGW_KAFKA__PROPERTIES__ssl.key.password", "hunter2-key"),
            ("VGGW_KAFKA__PROPERTIES__SSL_CA_LOCATION", "/etc/kafka/ca.pem"),
        ];
        with_env(&vars, |config| {
            let p = &config.kafka.properties;
            assert_eq!(p.get("security.protocol"), Some("SASL_SSL"));
            assert_eq!(p.get("sasl.password"), Some("0123e4"), "a secret is taken verbatim");
            assert_eq!(p.get("ssl.key.password"), Some("hunter2-key"));
            assert_eq!(p.get("ssl.ca.location"), Some("/etc/kafka/ca.pem"));
            let shown = format!("{config:?}");
            assert!(!shown.contains("0123e4") && !shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("/etc/kafka/ca.pem"));
        });
    }

    #[test]
    fn contradictions_are_refused() {
        let mut config = GatewayConfig::default();
        config.tasks.get_mut("voice").expect("voice").gpu_permits = PermitConfig { initial: 9, min: 1, max: 8 };
        assert!(config.validate().expect_err("initial > max").contains("gpu_permits"));

        let mut config = GatewayConfig::default();
        config.tasks.get_mut("image").expect("image").requests_topic = Some("voice.requests".into());
        assert!(config.validate().expect_err("shared topic").contains("both read voice.requests"));

        let mut config = GatewayConfig::default();
        for task in config.tasks.values_mut() {
            task.enabled = false;
        }
        assert!(config.validate().is_err());

        for wait in [-1.0, 600.5, f64::NAN] {
            let mut config = GatewayConfig::default();
            config.worker.model_check_wait_seconds = wait;
            assert!(config.validate().expect_err("out of bounds").contains("worker.model_check_wait_seconds must be 0 to 600"), "{wait}");
        }
    }

    #[test]
    fn exactly_once_delivery_is_named_in_kebab_case_and_its_bounds_are_checked() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("VGGW_DELIVERY", "exactly-once");
            jail.set_env("VGGW_KAFKA__GROUP_ID", "g");
            let config: GatewayConfig = vramgate_shared::config::load(None, "VGGW_").expect("loads");
            config.validate().expect("validates");
            assert_eq!(config.delivery, Delivery::ExactlyOnce);
            // Per process by default: two gateways on one host never share an id.
            let id = config.kafka.transactional_id();
            assert!(id.starts_with("g-") && id.ends_with(&format!("-{}", std::process::id())), "{id}");
            jail.set_env("VGGW_DELIVERY", "exactly_once");
            assert!(vramgate_shared::config::load::<GatewayConfig>(None, "VGGW_").is_err(), "kebab-case only");
            Ok(())
        });
        let mut config = GatewayConfig { delivery: Delivery::ExactlyOnce, ..GatewayConfig::default() };
        config.kafka.transactional_id = Some("gw-0".into());
        assert_eq!(config.kafka.transactional_id(), "gw-0");
        config.kafka.transaction_timeout_ms = 500;
        assert!(config.validate().expect_err("too short").contains("transaction_timeout_ms"));
        config.kafka.transaction_timeout_ms = 10_000;
        config.kafka.transactional_id = Some("x".repeat(MAX_TRANSACTIONAL_ID_BYTES + 1));
        assert!(config.validate().expect_err("too long").contains("transactional_id"));
        config.kafka.transactional_id = Some(String::new());
        assert!(config.validate().is_err(), "empty");
        figment::Jail::expect_with(|jail| {
            jail.set_env("VGGW_DELIVERY", "exactly-once");
            jail.set_env("VGGW_KAFKA__PROPERTIES__ENABLE_IDEMPOTENCE", "false");
            let mut config: GatewayConfig = vramgate_shared::config::load(None, "VGGW_").expect("loads");
            assert!(config.validate().expect_err("not idempotent").contains("enable.idempotence"));
            config.delivery = Delivery::AtLeastOnce;
            config.validate().expect("at-least-once takes any producer properties");
            Ok(())
        });
    }

    #[test]
    fn workers_come_from_the_task_then_the_worker_table_and_lists_take_commas() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("VGGW_WORKER__URLS", "http://a:1, http://b:2,");
            jail.set_env("VGGW_TASKS__IMAGE__WORKER_DNS__NAME", "workers.local");
            let config: GatewayConfig = vramgate_shared::config::load(None, "VGGW_").expect("loads");
            config.validate().expect("validates");
            let urls = vec!["http://a:1".to_string(), "http://b:2".to_string()];
            assert_eq!(config.tasks["voice"].workers(&config.worker), WorkerSource::Static(urls));
            match config.tasks["image"].workers(&config.worker) {
                WorkerSource::Dns(dns) => assert_eq!((dns.name.as_str(), dns.port), ("workers.local", 8081)),
                other => panic!("{other:?}"),
            }
            Ok(())
        });
        let mut config = GatewayConfig::default();
        config.worker.urls = vec!["gpu0:8081".into()];
        assert!(config.validate().expect_err("no scheme").contains("http://"));
        config.worker.urls = (0..=MAX_WORKER_ENDPOINTS).map(|i| format!("http://w{i}")).collect();
        assert!(config.validate().expect_err("too many").contains("at most"));
        config.worker.urls.clear();
        config.worker.dns = Some(DnsConfig { name: "w".into(), nameserver: Some("10.0.0.1".into()), ..DnsConfig::default() });
        assert!(config.validate().expect_err("no port").contains("ip:port"));
        assert_eq!(GatewayConfig::default().tasks["voice"].workers(&WorkerEndpoint::default()), WorkerSource::Static(vec!["http://127.0.0.1:8081".into()]));
    }

    #[test]
    fn dns_names_and_srv_are_checked() {
        let check = |name: &str, srv: bool, error: Option<&str>| {
            let dns = DnsConfig { name: name.into(), srv, ..DnsConfig::default() };
            match (dns.validate("worker.dns"), error) {
                (Ok(()), None) => {}
                (Err(e), Some(part)) => assert!(e.contains(part), "{name} (srv {srv}): {e}"),
                (got, _) => panic!("{name} (srv {srv}): {got:?}, expected an error with {error:?}"),
            }
        };
        check("ai-worker.vramgate.svc.cluster.local", false, None);
        check("ai-worker", false, None);
        check("_http._tcp.ai-worker.vramgate.svc.cluster.local.", true, None);
        check("ai-worker.vramgate.svc.cluster.local", true, Some("not an SRV name"));
        check("_http._tcp.ai-worker", false, Some("set srv = true"));
        check("a..b", false, Some("not a DNS name"));
        check(&format!("{}.local", "x".repeat(64)), false, Some("not a DNS name"));
        check(" ", false, Some("is empty"));
        figment::Jail::expect_with(|jail| {
            jail.set_env("VGGW_WORKER__DNS__NAME", "_http._tcp.w.local");
            jail.set_env("VGGW_WORKER__DNS__SRV", "true");
            jail.set_env("VGGW_TASKS__IMAGE__WORKER_DNS__NAME", "w.local");
            let config: GatewayConfig = vramgate_shared::config::load(None, "VGGW_").expect("loads");
            config.validate().expect("validates");
            assert!(config.worker.dns.as_ref().is_some_and(|d| d.srv));
            assert!(config.tasks["image"].worker_dns.as_ref().is_some_and(|d| !d.srv));
            jail.set_env("VGGW_TASKS__IMAGE__WORKER_DNS__SRV", "true");
            let config: GatewayConfig = vramgate_shared::config::load(None, "VGGW_").expect("loads");
            assert!(config.validate().expect_err("a host name as SRV").contains("tasks.image"));
            Ok(())
        });
    }

    #[test]
    fn env_overrides_reach_nested_task_keys() {
        let vars = [
            ("VGGW_TASKS__VOICE__GPU_PERMITS__MAX", "7"),
            ("VGGW_TASKS__IMAGE__ENABLED", "false"),
            ("VGGW_TASKS__IMAGE__IMAGE__RESIZE", "stretch"),
        ];
        with_env(&vars, |config| {
            assert_eq!(config.tasks["voice"].gpu_permits.max, 7);
            assert_eq!(config.tasks["voice"].gpu_permits.min, 1, "siblings keep their defaults");
            assert!(!config.tasks["image"].enabled);
            assert_eq!(config.tasks["image"].model, "mtcnn_pnet");
            assert_eq!(config.tasks["image"].image.resize, crate::tasks::image::ResizeMode::Stretch);
        });
    }
}
