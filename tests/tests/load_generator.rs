//! `vramgate-cli load` accounts for every event: a run against the real broker, worker and
//! gateway, with dead letters injected (inputs that do not exist) and the gateway SIGKILLed
//! and replaced mid-run, reports lost = 0, the injected dead letters by kind, and exactly the
//! duplicates the output topics hold; its CSV time series and PNG plot are written with content.
//! And a run with a rate sends at that rate: its events reach the broker one by one while it
//! runs, not all together after the last one is due.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use vramgate_tests::{
    binary, brokers, gateway_base_env, image_task_env, scratch_dir, start_gateway, start_worker, unique, voice_task_env,
    worker_config, Collector, TaskTopics, PNET_MODEL, VAD_MODEL,
};

const EVENTS: u64 = 360;

/// Records ever written to `topics` (their partitions' high watermarks summed; the topics are
/// this test's own).
fn records_in(topics: &[&str]) -> i64 {
    let consumer: BaseConsumer = ClientConfig::new().set("bootstrap.servers", brokers()).create().expect("consumer");
    let timeout = Duration::from_secs(10);
    let mut total = 0;
    for topic in topics {
        let metadata = consumer.fetch_metadata(Some(topic), timeout).expect("metadata");
        for p in metadata.topics()[0].partitions() {
            total += consumer.fetch_watermarks(topic, p.id(), timeout).expect("watermarks").1;
        }
    }
    total
}

fn base(topics: &TaskTopics) -> &str {
    topics.requests.strip_suffix(".requests").expect("topics named BASE.requests")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_with_dead_letters_and_a_gateway_crash_is_accounted_for_exactly() {
    let voice = TaskTopics::create("load-voice", 3).await.expect("topics");
    let image = TaskTopics::create("load-image", 3).await.expect("topics");
    let root = scratch_dir("load");
    let worker = start_worker(&worker_config("", &[VAD_MODEL, PNET_MODEL])).await.expect("worker starts");
    let group = unique("gw");
    // A fixed metrics port, so the load generator samples the replacement gateway too.
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut env = gateway_base_env(&group, &worker.url, &root);
    env.extend([
        ("METRICS_LISTEN", metrics_addr.clone()),
        ("KAFKA__SESSION_TIMEOUT_MS", "6000".into()),
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
        ("TASKS__IMAGE__CPU_THREADS", "1".into()),
    ]);
    env.extend(voice_task_env(&voice));
    env.extend(image_task_env(&image));
    let mut gateway = start_gateway(&env).await.expect("gateway starts");
    let outputs = [voice.results.as_str(), voice.dlq.as_str(), image.results.as_str(), image.dlq.as_str()];
    let collector = Collector::start(&outputs).expect("collector");

    let run = unique("run");
    let out = root.join("report");
    let mut load = Command::new(binary("vramgate-cli"));
    load.args(["--brokers", &brokers(), "load", "--task", "voice,image"])
        .args(["--topic-base", &format!("voice={}", base(&voice)), "--topic-base", &format!("image={}", base(&image))])
        .args(["--count", &EVENTS.to_string(), "--rate", "40", "--distinct", "4"])
        .args(["--voice-seconds", "1-4", "--image-sides", "64-480", "--missing-fraction", "0.2"])
        .arg("--generate-into")
        .arg(root.join("inputs"))
        .args(["--group", &group, "--gateway-metrics", &format!("http://{metrics_addr}/metrics")])
        .args(["--worker-metrics", &format!("{}/metrics", worker.url), "--sample-ms", "250"])
        .args(["--timeout-seconds", "240", "--run-id", &run, "--json"])
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = load.spawn().expect("starting vramgate-cli load");
    let started = Instant::now();

    // Kill the gateway once a fifth of the events are out, and start its replacement.
    let reached = collector.wait_until(Duration::from_secs(120), |got| got.len() as u64 >= EVENTS / 5).await;
    assert!(reached, "only {:?} (records, ids) after 120 s; gateway log:\n{}", collector.counts(), gateway.log_tail());
    let status = gateway.service.kill().expect("SIGKILL the gateway");
    eprintln!("gateway killed ({status}) at {:?} with {:?} (records, ids) out", started.elapsed(), collector.counts());
    let second = start_gateway(&env).await.expect("the replacement gateway starts");

    let output = tokio::task::spawn_blocking(move || child.wait_with_output()).await.expect("join").expect("load runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "vramgate-cli load failed ({}): {stderr}\nstdout: {}\ngateway log:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        second.log_tail()
    );
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).expect("--json prints JSON");
    eprintln!("{}", serde_json::to_string_pretty(&summary).unwrap_or_default());
    assert_eq!(summary["settled"], true, "the run waited for the group's commits: {summary}");

    // What the topics hold, read independently: every output of the run, to the topics' ends.
    let written = records_in(&outputs);
    let read_all = collector.wait_until(Duration::from_secs(30), |got| got.values().map(Vec::len).sum::<usize>() as i64 >= written).await;
    assert!(read_all, "the collector read {:?} of {written} output records", collector.counts());
    let records = collector.snapshot();
    let requests = vramgate_tests::collect(&[&voice.requests, &image.requests], Duration::from_secs(30), |got| {
        got.values().map(Vec::len).sum::<usize>() as u64 >= EVENTS
    })
    .await
    .expect("requests read back");

    let mut by_task: HashMap<&str, (u64, u64, u64)> = HashMap::new(); // sent, injected, duplicates
    for (id, sent) in &requests {
        let task = sent[0].value["task"].as_str().expect("task");
        let injected = sent[0].value["input"]["uri"].as_str().is_some_and(|u| u.contains("/missing-"));
        let entry = by_task.entry(if task == "voice" { "voice" } else { "image" }).or_default();
        entry.0 += 1;
        entry.1 += u64::from(injected);
        let outputs = records.get(id).map_or(0, Vec::len) as u64;
        assert!(outputs >= 1, "{id} has no output in the topics");
        entry.2 += outputs - 1;
    }
    let tasks = summary["tasks"].as_array().expect("tasks");
    assert_eq!(tasks.len(), 2);
    for task in tasks {
        let name = task["task"].as_str().expect("task name");
        let (sent, injected, duplicates) = by_task[name];
        eprintln!("{name}: {sent} sent, {injected} injected dead letters, {duplicates} duplicates in the topics");
        assert_eq!(task["sent"], sent, "{name}");
        assert_eq!(task["lost"], 0, "{name}");
        assert!(injected > 0, "{name}: the run injected no dead letters");
        assert_eq!(task["dead_letters_by_kind"], serde_json::json!({"input_not_found": injected}), "{name}");
        assert_eq!(task["results"], sent - injected, "{name}");
        assert_eq!(task["duplicates"], duplicates, "{name}: the run's count against the topics'");
        assert!(task["latency_ms"]["p50"].as_i64().is_some_and(|p| p >= 0), "{name}: {task}");
        assert!(task["throughput_per_s"].as_f64().is_some_and(|t| t > 0.0), "{name}");
    }

    // The time series: every column, and series with values in them.
    let csv = std::fs::read_to_string(out.join(format!("{run}.csv"))).expect("the CSV is written");
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("a header").split(',').collect();
    for column in [
        "t_s",
        "done_per_s",
        "worker_budget_bytes",
        "worker_admitted_bytes",
        "worker_queued_requests",
        "worker_batch_size_mean",
        "worker_oom_total",
        "gateway_paused_partitions",
        "consumer_lag",
        "gateway_in_flight_voice",
        "gateway_permit_limit_image",
    ] {
        assert!(header.contains(&column), "no column {column} in {header:?}");
    }
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert!(rows.len() >= 8, "{} rows for a run of {:?}", rows.len(), started.elapsed());
    assert!(rows.iter().all(|r| r.len() == header.len()), "ragged CSV");
    let values = |column: &str| -> Vec<f64> {
        let at = header.iter().position(|c| *c == column).expect("column");
        rows.iter().filter_map(|r| r[at].parse().ok()).collect()
    };
    let max = |column: &str| values(column).into_iter().fold(f64::MIN, f64::max);
    assert!(max("worker_budget_bytes") > 0.0, "the worker's budget was never sampled");
    assert!(max("done_per_s") > 0.0, "no throughput in the series");
    assert!(max("worker_batch_size_mean") >= 1.0, "no batch sizes in the series");
    assert!(max("gateway_permit_limit_voice") >= 1.0, "no permit limit in the series");
    assert!(!values("consumer_lag").is_empty(), "the lag was never sampled");

    // The plot: the page, with lines drawn in it.
    let png = image::open(out.join(format!("{run}.png"))).expect("the PNG decodes").to_rgb8();
    assert_eq!(png.dimensions(), (1400, 1600));
    let blue = png.pixels().filter(|p| p.0 == [31, 119, 180]).count();
    let dark = png.pixels().filter(|p| p.0.iter().all(|c| *c < 80)).count();
    assert!(blue > 200, "the first series of the panels is not drawn ({blue} pixels)");
    assert!(dark > 5_000, "no axes or text drawn ({dark} dark pixels)");
    drop(second);
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}

/// The events of a run with `--rate` reach the broker as they fall due. (They once waited,
/// unsent, until the last one was due, and then went together: a 40 s run at 3/s delivered all
/// 121 at 40 s.) Nothing serves the topic here, so the run ends with every event lost, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_load_reaches_the_broker_while_it_runs_and_counts_what_never_came_back() {
    const COUNT: i64 = 12;
    // One partition: events sent together would land in one batch, all visible at once.
    let topics = TaskTopics::create("load-paced", 1).await.expect("topics");
    let root = scratch_dir("load-paced");
    let mut load = Command::new(binary("vramgate-cli"));
    load.args(["--brokers", &brokers(), "load", "--task", "voice", "--topic-base", &format!("voice={}", base(&topics))])
        .args(["--count", &COUNT.to_string(), "--rate", "4", "--distinct", "1", "--voice-seconds", "0.1"])
        .args(["--gateway-metrics", "", "--worker-metrics", "", "--timeout-seconds", "1", "--json"])
        .arg("--generate-into")
        .arg(root.join("inputs"))
        .arg("--out")
        .arg(root.join("report"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = load.spawn().expect("starting vramgate-cli load");

    // Sending takes (COUNT - 1) / 4 s at the least; watch the topic fill meanwhile.
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let now = records_in(&[&topics.requests]);
        if seen.last() != Some(&now) {
            seen.push(now);
        }
        if now >= COUNT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(seen.last(), Some(&COUNT), "the request topic held {seen:?}");
    assert!(
        seen.iter().any(|&n| n > 0 && n < COUNT),
        "the events reached the broker all at once ({seen:?}), not one by one at the rate"
    );

    let output = tokio::task::spawn_blocking(move || {
        let status = child.wait().expect("load runs");
        let mut stdout = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().expect("stdout"), &mut stdout).expect("stdout read");
        (status, stdout)
    })
    .await
    .expect("join");
    assert!(!output.0.success(), "a run whose events never came back must fail");
    let summary: serde_json::Value = serde_json::from_str(&output.1).expect("--json prints JSON");
    assert_eq!(summary["tasks"][0]["sent"], COUNT, "{summary}");
    assert_eq!(summary["tasks"][0]["lost"], COUNT, "{summary}");
    assert_eq!(summary["send_failures"], 0, "{summary}");
    let _ = std::fs::remove_dir_all(&root);
}

/// The group-lag query that decides when a run has settled answers while a transaction of the
/// group holds uncommitted offsets, and counts from the committed ones. A `read_committed`
/// client's query (KIP-447's `require_stable`) does not answer meanwhile: a chaos run's end
/// check once failed every query for its whole 60 s after a broker restart with such a client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lag_query_answers_while_a_transaction_holds_offsets_of_the_group() {
    use rdkafka::consumer::CommitMode;
    use rdkafka::producer::{FutureProducer, Producer};
    use rdkafka::{Offset, TopicPartitionList};

    const RECORDS: i64 = 10;
    let topics = TaskTopics::create("load-lag", 1).await.expect("topics");
    let group = unique("load-lag");
    let producer = vramgate_tests::producer();
    for i in 0..RECORDS {
        vramgate_tests::send(&producer, &topics.requests, &format!("k{i}"), b"x").await.expect("sent");
    }
    let offsets = |at: i64| {
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(&topics.requests, 0, Offset::Offset(at)).expect("offset");
        list
    };
    let member: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    member.commit(&offsets(4), CommitMode::Sync).expect("the group commits offset 4");

    // A transaction that commits the group's offset 10 with the records it consumed, left open.
    let txn: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", unique("load-lag-txn"))
        .set("transaction.timeout.ms", "120000")
        .create()
        .expect("transactional producer");
    let timeout = Duration::from_secs(30);
    txn.init_transactions(timeout).expect("init");
    txn.begin_transaction().expect("begin");
    let metadata = member.group_metadata().expect("group metadata");
    txn.send_offsets_to_transaction(&offsets(RECORDS), &metadata, timeout).expect("offsets into the transaction");

    let connection = vramgate_shared::kafka::Connection { brokers: brokers(), properties: Default::default() };
    let lag = vramgate_cli::load::Lag::new(&connection, &group, vec![topics.requests.clone()]).expect("lag client");
    let started = Instant::now();
    let open = lag.blocking_total().await.expect("the lag query answers with a transaction open");
    assert_eq!(open, RECORDS - 4, "counted from the committed offset, not the open transaction's");
    let answered_in = started.elapsed();

    // What the query did before: the same question from a read_committed client is not answered.
    let stable: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", &group)
        .set("isolation.level", "read_committed")
        .create()
        .expect("read_committed client");
    let mut list = TopicPartitionList::new();
    list.add_partition(&topics.requests, 0);
    let refused = tokio::task::spawn_blocking(move || stable.committed_offsets(list, Duration::from_secs(5)))
        .await
        .expect("join");
    assert!(
        refused.as_ref().map_or(true, |l| l.find_partition(&topics.requests, 0).map(|e| e.offset()) != Some(Offset::Offset(4))),
        "a read_committed client read the committed offset 4 with a transaction open: {refused:?}; if the broker now \
         answers such queries, the load tool's choice of read_uncommitted is no longer needed"
    );

    txn.commit_transaction(timeout).expect("commit");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match lag.blocking_total().await {
            Ok(0) => break,
            other => assert!(Instant::now() < deadline, "after the commit the lag stays {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("lag query with a transaction open: {open} in {answered_in:?}; a read_committed client's: {refused:?}");
}
