//! P4 and P2 of the pipeline benchmark, as functions that return their figures (the
//! `throughput` and `pipeline` benches print them). Figures only; nothing is asserted about speed.
//!
//! **P4, gateway vs raw consume.** `VRAMGATE_BENCH_EVENTS` (default 100,000) tiny voice
//! requests whose input file does not exist, in a topic of 3 partitions. Each takes the
//! gateway's whole record path except the worker call: consume → parse → input check → dead
//! letter produced and acknowledged → offset committed. The ceiling is a plain librdkafka
//! consumer (rdkafka `BaseConsumer`, no group) reading the same records. Between the two, a
//! raw relay ([`raw_relay`]) does only the work the path requires, on one plain thread and on a
//! thread per partition: it
//! tells how much of the gap is the path's own (a produce and a commit per record that the
//! raw consumer never makes, on the same two cores as the broker) and how much is the
//! gateway's. The gateway runs with
//! `config/gateway.toml` unchanged (only the broker, group, topics and input root are set). Its
//! rate is timed from its first consumed record to the moment every offset is committed, so
//! process start-up and the group join are outside both figures. Also printed: the gateway's
//! CPU seconds per 1,000 records, its peak RSS under the whole backlog against its byte bounds
//! (`max_held_bytes` + librdkafka's `queued.max.messages.kbytes`), and how many records ended
//! in the dead-letter topic (must be all of them: lost = 0). All of it runs
//! `VRAMGATE_BENCH_P4_ROUNDS` times (default 3) on fresh topics; every round's ratio is
//! printed, and the median round in full. Untimed rounds of the same work come first, for
//! `VRAMGATE_BENCH_P4_WARMUP_SECONDS` (default 90), so that a broker just started is warm
//! (see [`p4`]).
//!
//! **P2, raw loop → worker → whole pipeline.** For P-Net on a 320×320 image, Silero VAD on a
//! 5 s clip and MobileNetV2 on a photograph (a 224×224 crop as bytes): the plain libtorch loop (`ai-worker/examples/raw_loop.rs`, batch 1, one torch
//! thread), the worker called directly over OIP with 8 requests in flight (the same tensor the
//! gateway sends), and the whole pipeline: `VRAMGATE_BENCH_PIPELINE_EVENTS` (default 400)
//! requests naming a PNG or WAV file, through Kafka, the gateway (defaults; for MobileNetV2 a
//! `classify` task as the README's, softmax and top 5 with labels) and the same worker, timed
//! from the first consumed record to the last result, once with the gateway calling the worker
//! over HTTP and once over gRPC (`VRAMGATE_BENCH_P2_INPUTS` picks other sizes; the gateway is
//! configured to make the model input of the case's size).
//! On this CPU-only machine
//! the gateway's conversion shares the cores with the model; on a GPU host it would not.
//!
//! The P2 part needs the raw loop example (`cargo build --release --examples`).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use crate::ceiling;
use crate::images::{crowd, png, write};
use crate::wav::{noise, write_wav, SampleFormat};
use crate::{
    brokers, cpu_seconds, delete_topics, env_or, gateway_base_env, image_task_env, photo, proc_status_kib, producer,
    repo_root, request_file, scratch_dir, send_all, start_gateway, start_gateway_config, unique, CommitProbe, Gateway,
    voice_task_env, TaskTopics,
};

/// Partitions of every topic P2 and P4 create.
pub const PARTITIONS: i32 = 3;
const MIB: f64 = (1u64 << 20) as f64;

/// Pids of local Kafka brokers (`kafka.Kafka` in their command line), to count their CPU.
fn broker_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.windows(b"kafka.Kafka".len()).any(|w| w == b"kafka.Kafka"))
        })
        .collect()
}

fn broker_cpu() -> f64 {
    broker_pids().into_iter().map(cpu_seconds).sum()
}

/// Writes `count` tiny voice requests whose input is missing under `root`, as fast as the
/// producer goes.
fn produce_backlog(topic: &str, root: &Path, count: usize) -> anyhow::Result<()> {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "1000000")
        .create()?;
    for i in 0..count {
        let id = format!("e{i}");
        let value = format!(
            r#"{{"id":"{id}","task":"voice","input":{{"uri":"file://{}/missing-{i}.wav"}}}}"#,
            root.display()
        );
        let mut record = BaseRecord::to(topic).key(&id).payload(&value);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((rdkafka::error::KafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    producer.poll(Duration::from_millis(10));
                }
                Err((e, _)) => anyhow::bail!("producing the backlog: {e}"),
            }
        }
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(60))?;
    Ok(())
}

fn topic_records(topic: &str) -> anyhow::Result<i64> {
    let consumer: BaseConsumer = ClientConfig::new().set("bootstrap.servers", brokers()).create()?;
    let mut total = 0;
    for p in 0..PARTITIONS {
        let (low, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10))?;
        total += high - low;
    }
    Ok(total)
}

/// A plain librdkafka consumer reading `count` records of `topic` from the beginning. Returns
/// records per second timed from `assign` to the last record (as `kcat -C` would be timed,
/// without its process start) and from the first record to the last (librdkafka's in-memory
/// delivery rate once its prefetch is full), its CPU seconds and the broker's meanwhile.
fn raw_consume(topic: &str, count: usize) -> anyhow::Result<(f64, f64, f64, f64)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("raw"))
        .set("enable.auto.commit", "false")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    let assigned = Instant::now();
    consumer.assign(&tpl)?;
    let cpu_before = cpu_seconds(std::process::id());
    let broker_before = broker_cpu();
    let mut first = None;
    let mut seen = 0usize;
    let deadline = Instant::now() + Duration::from_secs(300);
    while seen < count && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(_)) => {
                first.get_or_insert_with(Instant::now);
                seen += 1;
            }
            Some(Err(e)) => anyhow::bail!("raw consumer: {e}"),
            None => {}
        }
    }
    let from_first = first.map_or(f64::NAN, |t| t.elapsed().as_secs_f64());
    let from_assign = assigned.elapsed().as_secs_f64();
    anyhow::ensure!(seen == count, "raw consumer read {seen} of {count} records");
    let cpu = cpu_seconds(std::process::id()) - cpu_before;
    let broker = broker_cpu() - broker_before;
    Ok((seen as f64 / from_assign, seen as f64 / from_first, cpu, broker))
}

/// The least any gateway must do per record on this path, written as plainly as librdkafka
/// allows: a thread polls a `BaseConsumer`, parses the request, opens its input under the root
/// (missing), and hands the same dead letter the gateway writes (JSON with the source record in
/// base64, the same seven headers) to a `BaseProducer` with the gateway's output settings
/// (`acks=all`, `linger.ms=2`, 5 requests in flight); it commits its consumer's position
/// asynchronously every 200 ms, as auto-commit does, and once more, synchronously, at its end.
/// One thread reads every partition, or (`per_partition`) one thread per partition, each with
/// its own consumer, sharing the producer. No task, span, window or byte budget: what it leaves
/// out is what a gateway adds. Returns records per second (start to the last acknowledgement
/// and commit), its CPU seconds and the broker's meanwhile.
fn raw_relay(topic: &str, out_topic: &str, root: &Path, per_partition: bool) -> anyhow::Result<(f64, f64, f64)> {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("acks", "all")
        .set("linger.ms", "2")
        .set("max.in.flight.requests.per.connection", "5")
        .create()?;
    let group = unique("relay");
    let lanes: Vec<Vec<i32>> =
        if per_partition { (0..PARTITIONS).map(|p| vec![p]).collect() } else { vec![(0..PARTITIONS).collect()] };
    let outputs_before = topic_records(out_topic)?;
    let started = Instant::now();
    let cpu_before = cpu_seconds(std::process::id());
    let broker_before = broker_cpu();
    let relayed: usize = std::thread::scope(|scope| {
        let lanes: Vec<_> = lanes
            .iter()
            .map(|partitions| scope.spawn(|| relay_lane(topic, out_topic, root, &group, partitions, &producer)))
            .collect();
        lanes.into_iter().map(|lane| lane.join().expect("relay lane panicked")).sum::<anyhow::Result<usize>>()
    })?;
    // Each lane flushed the producer before its last commit.
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(std::process::id()) - cpu_before;
    let broker = broker_cpu() - broker_before;
    let written = topic_records(out_topic)? - outputs_before;
    anyhow::ensure!(written == relayed as i64, "the relay read {relayed} records and wrote {written} outputs");
    Ok((relayed as f64 / elapsed, cpu, broker))
}

/// One relay thread: `partitions` of `topic` from the beginning to their end.
fn relay_lane(
    topic: &str,
    out_topic: &str,
    root: &Path,
    group: &str,
    partitions: &[i32],
    producer: &BaseProducer,
) -> anyhow::Result<usize> {
    use rdkafka::consumer::CommitMode;
    use rdkafka::message::Message;
    use vramgate_gateway::produce::{dead_letter_headers, source_record};
    use vramgate_shared::events::{DeadLetterEvent, ErrorInfo, ErrorKind, RequestEvent, Stage, SCHEMA_VERSION};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    let mut count = 0;
    for &p in partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
        let (low, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10))?;
        count += usize::try_from(high - low)?;
    }
    consumer.assign(&tpl)?;
    let mut seen = 0usize;
    let mut last_commit = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(300);
    while seen < count && Instant::now() < deadline {
        let message = match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(message)) => message,
            Some(Err(e)) => anyhow::bail!("relay consumer: {e}"),
            None => continue,
        };
        seen += 1;
        let request: RequestEvent = serde_json::from_slice(message.payload().unwrap_or_default())?;
        let vramgate_shared::events::InputRef::Uri { uri } = &request.input else { anyhow::bail!("not a file input") };
        let path = root.join(uri.rsplit('/').next().unwrap_or_default());
        let error = std::fs::File::open(&path).expect_err("the bench's inputs are missing");
        let text = format!("input file {} was not found under the gateway's input root ({error})", path.display());
        let error = ErrorInfo { kind: ErrorKind::InputNotFound, message: text, stage: Stage::Fetch };
        let headers = dead_letter_headers(&message, &error);
        let letter = DeadLetterEvent {
            version: SCHEMA_VERSION,
            id: Some(request.id),
            task: Some(request.task),
            error,
            attempts: 0,
            source: source_record(&message),
        };
        let payload = serde_json::to_vec(&letter)?;
        let mut record = BaseRecord::to(out_topic).payload(&payload).headers(headers);
        if let Some(key) = message.key() {
            record = record.key(key);
        }
        while let Err((e, refused)) = producer.send(record) {
            anyhow::ensure!(
                e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::QueueFull),
                "relay producer: {e}"
            );
            record = refused;
            producer.poll(Duration::from_millis(1));
        }
        producer.poll(Duration::ZERO);
        if last_commit.elapsed() >= Duration::from_millis(200) {
            let _ = consumer.commit_consumer_state(CommitMode::Async);
            last_commit = Instant::now();
        }
    }
    anyhow::ensure!(seen == count, "relay read {seen} of {count} records");
    producer.flush(Duration::from_secs(60))?;
    // "No offset stored": the last asynchronous commit already covered every record.
    match consumer.commit_consumer_state(CommitMode::Sync) {
        Err(e) if e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::NoOffset) => {}
        other => other?,
    }
    Ok(seen)
}

/// The gateway's side of P4.
pub struct GatewayRun {
    pub rate: f64,
    pub cpu_per_1000: f64,
    pub broker_cpu_per_1000: f64,
    pub peak_rss: u64,
    pub base_rss: u64,
    pub bound: u64,
    pub dead_letters: i64,
    pub commits: f64,
    /// Mean seconds from fetch to output acknowledged, and per commit round trip (the
    /// gateway's own histograms).
    pub record_seconds: f64,
    pub commit_seconds: f64,
    pub max_in_flight: usize,
}

async fn gateway_consume(topics: &TaskTopics, root: &Path, count: usize) -> anyhow::Result<GatewayRun> {
    let group = unique("bench-gw");
    let mut env = gateway_base_env(&group, "http://127.0.0.1:9", root);
    env.extend(voice_task_env(topics));
    env.push(("TASKS__IMAGE__ENABLED", "false".into()));
    let gateway = start_gateway(&env).await?;
    let pid = gateway.pid();
    let base_rss = proc_status_kib(pid, "VmRSS:").unwrap_or(0) * 1024;
    // What the gateway read: its defaults, under any VRAMGATE_GATEWAY_* this process passes on.
    let config: vramgate_gateway::config::GatewayConfig =
        vramgate_shared::config::load(None, "VRAMGATE_GATEWAY_").context("reading the gateway's settings")?;
    let bound = config.max_held_bytes + config.kafka.queue_max_kbytes * 1024;

    // Wait for the first consumed record, then for every offset to be committed.
    let deadline = Instant::now() + Duration::from_secs(900);
    let consumed = |s: &crate::metrics::Scrape| s.sum("vramgate_gateway_records_consumed_total", &[]);
    let (started, cpu_start, broker_start) = loop {
        let scrape = gateway.metrics().await?;
        if consumed(&scrape) > 0.0 {
            break (Instant::now(), cpu_seconds(pid), broker_cpu());
        }
        anyhow::ensure!(Instant::now() < deadline, "the gateway consumed nothing; log:\n{}", gateway.log_tail());
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let probe = CommitProbe::new(&group, &topics.requests)?;
    loop {
        if probe.uncommitted()? == 0 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the gateway did not finish; log:\n{}", gateway.log_tail());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid) - cpu_start;
    let broker = broker_cpu() - broker_start;
    let peak_rss = proc_status_kib(pid, "VmHWM:").unwrap_or(0) * 1024;
    let scrape = gateway.metrics().await?;
    let commits = scrape.sum("vramgate_gateway_offset_commits_total", &[("result", "ok")]);
    let mean = |name: &str| scrape.sum(&format!("{name}_sum"), &[]) / scrape.sum(&format!("{name}_count"), &[]).max(1.0);
    Ok(GatewayRun {
        rate: count as f64 / elapsed,
        cpu_per_1000: cpu / count as f64 * 1000.0,
        broker_cpu_per_1000: broker / count as f64 * 1000.0,
        peak_rss,
        base_rss,
        bound,
        dead_letters: topic_records(&topics.dlq)?,
        commits,
        record_seconds: mean("vramgate_gateway_record_seconds"),
        commit_seconds: mean("vramgate_gateway_offset_commit_seconds"),
        max_in_flight: config.max_in_flight,
    })
}

/// The whole pipeline's input for a P2 case: the same input as the worker-direct figure, as a
/// file under `root` that the gateway reads and converts to the same tensor shape. Returns the
/// task that names it and the file.
pub fn p2_input(case: &ceiling::CeilingCase, root: &Path) -> anyhow::Result<(&'static str, std::path::PathBuf)> {
    Ok(match case.model {
        ceiling::CeilingModel::Pnet => {
            let (h, w) = (case.shape[2] as u32, case.shape[3] as u32);
            ("image", write(root, "input.png", &png(&crowd(w, h, 16.0, 1))))
        }
        ceiling::CeilingModel::SileroVad => {
            let path = root.join("input.wav");
            write_wav(&path, &noise(case.shape[1], 0.05, 1), 16_000, 1, SampleFormat::I16)?;
            ("voice", path)
        }
        ceiling::CeilingModel::MobileNetV2 => {
            // A real photograph (451×300), resized and cropped by the gateway as torchvision does.
            let path = root.join("input.png");
            std::fs::copy(photo("chelsea.png"), &path)?;
            ("classify", path)
        }
    })
}

/// The `classify` task of a MobileNetV2 case: a gateway config with that task alone (its
/// topics are set by [`p2_gateway_env`]), as the README configures one.
fn classify_config(root: &Path) -> std::path::PathBuf {
    let labels = repo_root().join("models/repository/mobilenet_v2/labels.txt");
    let config = format!(
        "[tasks.classify]\nconverter = \"image\"\nmodel = \"mobilenet_v2\"\n\
         requests_topic = \"p2-classify.requests\"\nresults_topic = \"p2-classify.results\"\ndlq_topic = \"p2-classify.dlq\"\n\n\
         [tasks.classify.image]\nmode = \"tensor\"\nresize = \"shorter_side_crop\"\nshorter_side = 256\nwidth = 224\nheight = 224\n\
         layout = \"nhwc\"\ndatatype = \"UINT8\"\n\n\
         [[tasks.classify.outputs]]\nname = \"logits\"\npost = [\"softmax\", \"top_k\"]\ntop_k = 5\nlabels = \"{}\"\n",
        labels.display()
    );
    write(root, "classify.toml", config.as_bytes())
}

/// Starts the gateway of a P2 case with `env` ([`p2_gateway_env`] and the caller's own): the
/// defaults, or for MobileNetV2 the `classify` task's config beside its input in `root`.
pub async fn start_p2_gateway(case: &ceiling::CeilingCase, env: &[(&'static str, String)], root: &Path) -> anyhow::Result<Gateway> {
    match case.model {
        ceiling::CeilingModel::MobileNetV2 => start_gateway_config(&classify_config(root), env).await,
        _ => start_gateway(env).await,
    }
}

/// The overrides of a P2 gateway (defaults otherwise): its group, worker and input root, the
/// case's task on `topics`, the other task off, and for P-Net the model input of the case's
/// size. Callers add their own (a delivery mode) after these.
pub fn p2_gateway_env(
    case: &ceiling::CeilingCase,
    topics: &TaskTopics,
    group: &str,
    worker_url: &str,
    root: &Path,
) -> Vec<(&'static str, String)> {
    let mut env = gateway_base_env(group, worker_url, root);
    let image = case.model == ceiling::CeilingModel::Pnet;
    match case.model {
        ceiling::CeilingModel::Pnet => {
            env.extend(image_task_env(topics));
            env.push(("TASKS__VOICE__ENABLED", "false".into()));
        }
        ceiling::CeilingModel::SileroVad => {
            env.extend(voice_task_env(topics));
            env.push(("TASKS__IMAGE__ENABLED", "false".into()));
        }
        ceiling::CeilingModel::MobileNetV2 => env.extend([
            ("TASKS__CLASSIFY__REQUESTS_TOPIC", topics.requests.clone()),
            ("TASKS__CLASSIFY__RESULTS_TOPIC", topics.results.clone()),
            ("TASKS__CLASSIFY__DLQ_TOPIC", topics.dlq.clone()),
            ("TASKS__IMAGE__ENABLED", "false".into()),
            ("TASKS__VOICE__ENABLED", "false".into()),
        ]),
    }
    if image {
        // The model input the gateway makes, so the worker runs P-Net on the case's size.
        env.push(("TASKS__IMAGE__IMAGE__HEIGHT", case.shape[2].to_string()));
        env.push(("TASKS__IMAGE__IMAGE__WIDTH", case.shape[3].to_string()));
    }
    env
}

/// P2 for one case: raw loop, worker direct at 8 in flight, whole pipeline with the gateway
/// calling the worker over HTTP, then over gRPC (when the worker has its gRPC door). Returns
/// the four rates.
async fn pipeline_case(
    case: &ceiling::CeilingCase,
    worker: &crate::Worker,
    events: usize,
) -> anyhow::Result<(f64, f64, f64, Option<f64>)> {
    let data = case.data();
    let raw = ceiling::raw_rate(case, &ceiling::RawInput::write(&data)?, 4.0, 1, 0)?.items_per_s;
    let (direct, failed) = ceiling::worker_rate(&worker.url, case, &data, 8, 4.0).await?;
    anyhow::ensure!(failed == 0, "{failed} direct calls failed");
    let pipeline = pipeline_through(case, &worker.url, None, events).await?;
    let grpc = match &worker.grpc {
        Some(addr) => Some(pipeline_through(case, &format!("http://{addr}"), Some("grpc"), events).await?),
        None => None,
    };
    Ok((raw, direct, pipeline, grpc))
}

/// The whole pipeline's rate for `case`: `events` records through a fresh gateway calling the
/// worker at `worker_url` over `protocol` (`None`: the default, HTTP).
async fn pipeline_through(case: &ceiling::CeilingCase, worker_url: &str, protocol: Option<&str>, events: usize) -> anyhow::Result<f64> {
    let root = scratch_dir("bench-p2");
    let (task, file) = p2_input(case, &root)?;
    let topics = TaskTopics::create("bench-p2", PARTITIONS).await?;
    let requests: Vec<(String, Vec<u8>)> = (0..events)
        .map(|i| {
            let id = format!("p2-{i}");
            let value = request_file(&id, task, &file);
            (id, value)
        })
        .collect();
    send_all(&producer(), &topics.requests, &requests, 500).await?;
    let group = unique("bench-p2");
    let mut env = p2_gateway_env(case, &topics, &group, worker_url, &root);
    if let Some(protocol) = protocol {
        env.push(("WORKER__PROTOCOL", protocol.to_string()));
    }
    let gateway = start_p2_gateway(case, &env, &root).await?;
    let pipeline = rate_until_produced(&gateway, events, Duration::from_secs(600)).await?;
    let results = topic_records(&topics.results)?;
    anyhow::ensure!(results == events as i64, "{results} results of {events}; log:\n{}", gateway.log_tail());
    let _ = delete_topics(&[&topics.requests, &topics.results, &topics.dlq]).await;
    Ok(pipeline)
}

/// Records a second through a freshly started `gateway`, from its first consumed record until
/// it has produced `events` outputs; an error past `limit`.
pub async fn rate_until_produced(gateway: &crate::Gateway, events: usize, limit: Duration) -> anyhow::Result<f64> {
    let deadline = Instant::now() + limit;
    let started = loop {
        if gateway.metrics().await?.sum("vramgate_gateway_records_consumed_total", &[]) > 0.0 {
            break Instant::now();
        }
        anyhow::ensure!(Instant::now() < deadline, "the gateway consumed nothing; log:\n{}", gateway.log_tail());
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    loop {
        let done = gateway.metrics().await?.sum("vramgate_gateway_records_produced_total", &[]);
        if done >= events as f64 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the pipeline did not finish; log:\n{}", gateway.log_tail());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(events as f64 / started.elapsed().as_secs_f64())
}

/// One P2 row: a model and input through the raw loop, the worker direct, the whole pipeline.
pub struct P2Row {
    pub label: String,
    pub unit: &'static str,
    pub raw: f64,
    pub direct: f64,
    pub pipeline: f64,
    /// The pipeline with the gateway calling the worker over gRPC.
    pub pipeline_grpc: Option<f64>,
}

/// P2's inputs: `VRAMGATE_BENCH_P2_INPUTS`, comma-separated, `HxW` for a P-Net image, `Ns`
/// for a Silero clip of N seconds and `mobilenet` for MobileNetV2 on a photograph (default
/// `320x320,5s,mobilenet`). Small ones (`32x32,1s`) make a worker
/// that answers almost at once, so the pipeline's own cost per record shows.
pub fn p2_cases() -> anyhow::Result<Vec<ceiling::CeilingCase>> {
    let spec = std::env::var("VRAMGATE_BENCH_P2_INPUTS").unwrap_or_else(|_| "320x320,5s,mobilenet".into());
    spec.split(',')
        .map(str::trim)
        .map(|item| {
            if item == "mobilenet" {
                return Ok(ceiling::CeilingCase::crop());
            }
            if let Some(seconds) = item.strip_suffix('s') {
                return Ok(ceiling::CeilingCase::clip(seconds.parse()?));
            }
            let (h, w) = item.split_once('x').ok_or_else(|| anyhow::anyhow!("'{item}' is neither HxW nor Ns"))?;
            Ok(ceiling::CeilingCase::image(h.parse()?, w.parse()?))
        })
        .collect()
}

/// P2 for P-Net on a 320×320 image and Silero VAD on a 5 s clip (or [`p2_cases`]).
pub async fn p2() -> anyhow::Result<Vec<P2Row>> {
    let events: usize = env_or("VRAMGATE_BENCH_PIPELINE_EVENTS", 400);
    let cases = p2_cases()?;
    let options = ceiling::CeilingOptions { cases: cases.clone(), ..ceiling::CeilingOptions::from_env() };
    let worker = ceiling::start_ceiling_worker(&options).await?;
    let mut rows = Vec::new();
    for case in &cases {
        let (raw, direct, pipeline, pipeline_grpc) = pipeline_case(case, &worker, events).await?;
        let label = format!("{} {}", case.model.name(), case.label);
        rows.push(P2Row { label, unit: case.model.unit(), raw, direct, pipeline, pipeline_grpc });
    }
    Ok(rows)
}

/// Prints P2's rows.
pub fn print_p2(rows: &[P2Row]) {
    println!();
    println!("P2  raw libtorch loop → worker direct (8 in flight) → whole pipeline through Kafka (gateway → worker over HTTP, then gRPC)");
    println!(
        "    {:<24} {:>10} {:>10} {:>10} {:>10} {:>14} {:>16} {:>12}",
        "model, input", "raw", "worker", "pipeline", "pipe gRPC", "worker / raw", "pipeline / worker", "gRPC / HTTP"
    );
    for r in rows {
        let grpc = r.pipeline_grpc.map_or("—".to_string(), |g| format!("{g:.1}"));
        let ratio = r.pipeline_grpc.map_or("—".to_string(), |g| format!("{:.2}", g / r.pipeline));
        println!(
            "    {:<24} {:>10.1} {:>10.1} {:>10.1} {:>10} {:>14.2} {:>16.2} {:>12}   ({})",
            r.label,
            r.raw,
            r.direct,
            r.pipeline,
            grpc,
            r.direct / r.raw,
            r.pipeline / r.direct,
            ratio,
            r.unit
        );
    }
}

/// One P4 round's figures: the raw consumer's, the relays' and the gateway's, on the same
/// records.
pub struct P4Run {
    pub count: usize,
    /// Records/s from `assign` to the last record, and from the first record to the last.
    pub raw: f64,
    pub raw_streaming: f64,
    pub raw_cpu: f64,
    pub raw_broker: f64,
    /// [`raw_relay`] on one thread, and with a thread per partition: records/s, its CPU
    /// seconds and the broker's.
    pub relay: (f64, f64, f64),
    pub relay_parallel: (f64, f64, f64),
    pub gateway: GatewayRun,
}

impl P4Run {
    /// The figures every round is listed with.
    pub fn headline(&self) -> P4Round {
        P4Round { raw: self.raw, gateway: self.gateway.rate, lost: self.count as i64 - self.gateway.dead_letters }
    }
}

/// P4 over all its rounds.
pub struct P4 {
    /// The round whose gateway / raw ratio is the median, in full.
    pub median: P4Run,
    /// Every timed round, in the order run.
    pub rounds: Vec<P4Round>,
    /// The untimed rounds that warmed the broker up (their events count for `lost` too).
    pub warmup: Vec<P4Round>,
}

/// One P4 round's headline figures.
#[derive(Debug, Clone, Copy)]
pub struct P4Round {
    /// Records/s of the raw consumer and of the gateway.
    pub raw: f64,
    pub gateway: f64,
    /// Events sent and not found among the dead letters.
    pub lost: i64,
}

impl P4 {
    /// Events lost over every round, the warm-up's included.
    pub fn lost(&self) -> i64 {
        self.rounds.iter().chain(&self.warmup).map(|r| r.lost).sum()
    }
}

/// P4: `VRAMGATE_BENCH_EVENTS` (default 100,000) tiny events, the raw consumer, the relays,
/// then the gateway, on fresh topics each round; `VRAMGATE_BENCH_P4_ROUNDS` rounds (default
/// 3), because one run on two shared cores moves ±30% (every round is printed, and the
/// median one in full).
///
/// Before them, untimed rounds of the same work warm the broker up for
/// `VRAMGATE_BENCH_P4_WARMUP_SECONDS` (default 90; 0 for none). A broker just started (as
/// `scripts/bench` starts one) has not yet compiled its produce and commit paths: on two
/// cores its CPU per record on the gateway's path was 3–6× a warm one's for its first minute
/// or so of this traffic, and the gateway's ratio 0.34–0.47 against 0.52–0.64 after
/// (docs/performance-notes.md). A broker in service is warm; the ratio is meant to be the
/// gateway's, not the JVM's start-up. The warm-up rounds are printed too.
pub async fn p4() -> anyhow::Result<P4> {
    let count: usize = env_or("VRAMGATE_BENCH_EVENTS", 100_000);
    let rounds: usize = env_or("VRAMGATE_BENCH_P4_ROUNDS", 3);
    let warm_for = Duration::from_secs_f64(env_or("VRAMGATE_BENCH_P4_WARMUP_SECONDS", 90.0_f64).max(0.0));
    let started = Instant::now();
    let mut warmup = Vec::new();
    while started.elapsed() < warm_for {
        let run = p4_round(count).await?;
        let (done, of) = (started.elapsed().as_secs_f64(), warm_for.as_secs_f64());
        eprintln!("P4: warm-up round {} (untimed, {done:.0} s of {of:.0}): {}", warmup.len() + 1, round_line(&run));
        warmup.push(run.headline());
    }
    let mut runs = Vec::new();
    for round in 1..=rounds.max(1) {
        let run = p4_round(count).await?;
        eprintln!("P4: round {round}: {}", round_line(&run));
        runs.push(run);
    }
    let rounds: Vec<P4Round> = runs.iter().map(P4Run::headline).collect();
    runs.sort_by(|a, b| (a.gateway.rate / a.raw).total_cmp(&(b.gateway.rate / b.raw)));
    let median = runs.swap_remove(runs.len() / 2);
    Ok(P4 { median, rounds, warmup })
}

/// One round's headline, as printed while the bench runs.
fn round_line(run: &P4Run) -> String {
    format!(
        "gateway {:.0} records/s, raw {:.0}, ratio {:.3}, broker {:.3} CPU s / 1000 records on the gateway's path, lost {}",
        run.gateway.rate,
        run.raw,
        run.gateway.rate / run.raw,
        run.gateway.broker_cpu_per_1000,
        run.headline().lost
    )
}

async fn p4_round(count: usize) -> anyhow::Result<P4Run> {
    let topics = TaskTopics::create("bench-p4", PARTITIONS).await?;
    let root = scratch_dir("bench-p4");
    let started = Instant::now();
    produce_backlog(&topics.requests, &root, count)?;
    eprintln!("P4: {count} tiny events produced in {:.1} s", started.elapsed().as_secs_f64());

    let (raw, raw_streaming, raw_cpu, raw_broker) = raw_consume(&topics.requests, count)?;
    // The gateway's run writes dead letters only, so the results topic takes the relay's.
    let relay = raw_relay(&topics.requests, &topics.results, &root, false)?;
    let relay_parallel = raw_relay(&topics.requests, &topics.results, &root, true)?;
    let gateway = gateway_consume(&topics, &root, count).await?;
    let _ = delete_topics(&[&topics.requests, &topics.results, &topics.dlq]).await;
    Ok(P4Run { count, raw, raw_streaming, raw_cpu, raw_broker, relay, relay_parallel, gateway })
}

/// Prints P4's figures.
pub fn print_p4(p4: &P4) {
    let P4 { median, rounds, warmup } = p4;
    let P4Run { count, raw, raw_streaming, raw_cpu, raw_broker, relay, relay_parallel, gateway: gw } = median;
    let (count, raw, raw_streaming) = (*count, *raw, *raw_streaming);
    println!();
    println!("P4  gateway (consume → parse → input check → dead letter → commit) vs raw librdkafka consume");
    println!("    {count} tiny records, {PARTITIONS} partitions, one local broker, config/gateway.toml defaults");
    let each: Vec<String> =
        rounds.iter().map(|r| format!("{:.3} ({:.1}k / {:.1}k)", r.gateway / r.raw, r.gateway / 1000.0, r.raw / 1000.0)).collect();
    println!("    rounds, gateway / raw     {}", each.join(", "));
    println!("    the median round of {}:", rounds.len());
    let per_1000 = |cpu: f64| cpu / count as f64 * 1000.0;
    println!(
        "    raw consumer              {:>10.0} records/s   {:>6.3} CPU s / 1000 records (broker {:.3})",
        raw,
        per_1000(*raw_cpu),
        per_1000(*raw_broker)
    );
    println!("      (first record to last: {raw_streaming:.0} records/s, librdkafka's prefetch already full)");
    let relay_row = |label: &str, (rate, cpu, broker): (f64, f64, f64)| {
        println!("    {label}");
        println!(
            "                              {rate:>10.0} records/s   {:>6.3} CPU s / 1000 records (broker {:.3})",
            per_1000(cpu),
            per_1000(broker)
        );
    };
    relay_row("raw relay (one thread: consume → input check → dead letter → acks=all, commit)", *relay);
    relay_row("raw relay, a thread per partition", *relay_parallel);
    let relay_rate = relay.0;
    let parallel_rate = relay_parallel.0;
    println!(
        "    gateway                   {:>10.0} records/s   {:>6.3} CPU s / 1000 records (broker {:.3})",
        gw.rate, gw.cpu_per_1000, gw.broker_cpu_per_1000
    );
    println!(
        "    CPU at that rate          gateway {:.2} cores + broker {:.2} cores, of {} on this machine",
        gw.rate * gw.cpu_per_1000 / 1000.0,
        gw.rate * gw.broker_cpu_per_1000 / 1000.0,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("    ratio gateway / raw       {:>10.3}   (goal ≥ 0.5)", gw.rate / raw);
    println!("    ratio relay / raw         {:>10.3}   gateway / relay {:.3}", relay_rate / raw, gw.rate / relay_rate);
    println!("    ratio relay per partition / raw {:>4.3}", parallel_rate / raw);
    println!(
        "    gateway RSS               start {:.0} MiB, peak {:.0} MiB under the backlog; byte bounds {:.0} MiB",
        gw.base_rss as f64 / MIB,
        gw.peak_rss as f64 / MIB,
        gw.bound as f64 / MIB
    );
    println!("    commits                   {:.0}", gw.commits);
    // Little's law: at most max_in_flight records are past the last confirmed commit, so the
    // rate is at most max_in_flight ÷ the mean time a record holds its place.
    println!(
        "    time in the window        fetch → output acknowledged {:.1} ms + commit round trip {:.1} ms (means); \
         max_in_flight {} ÷ rate = {:.1} ms",
        gw.record_seconds * 1000.0,
        gw.commit_seconds * 1000.0,
        gw.max_in_flight,
        gw.max_in_flight as f64 / gw.rate * 1000.0
    );
    println!(
        "    dead letters              {} of {count}   lost {} (over all {} rounds and {} warm-up rounds: {})",
        gw.dead_letters,
        median.headline().lost,
        rounds.len(),
        warmup.len(),
        p4.lost()
    );
}
