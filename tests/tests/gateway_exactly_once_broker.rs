//! Exactly-once delivery with the broker restarted mid-run: the transactions open when it goes
//! abort, are redone once it is back, and a `read_committed` consumer sees one output per
//! request. Alone in its test binary: restarting the shared broker takes it away from every
//! client of the binary (cargo runs test binaries one at a time, so no other test's).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use vramgate_tests::chaos::tally;
use vramgate_tests::fleet::voice_event;
use vramgate_tests::{
    broker_log_matching, broker_transactions, collect, gateway_base_env, producer, restart_broker, scratch_dir, send_all, start_gateway_with,
    start_worker, uncommitted_records, unique, voice_task_env, watermarks, worker_config, ById, Collector, Isolation,
    TaskTopics, VAD_MODEL,
};

const PARTITIONS: i32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_restarted_mid_run_leaves_no_output_lost_or_doubled() {
    const EVENTS: usize = 400;
    let voice = TaskTopics::create("eos-restart", PARTITIONS).await.expect("topics");
    let root = scratch_dir("eos-restart");
    let worker = start_worker(&worker_config("", &[VAD_MODEL])).await.expect("worker starts");
    let group = unique("gw");
    let mut env = gateway_base_env(&group, &worker.url, &root);
    let transactional_id = unique("eos-restart");
    env.extend([
        ("DELIVERY", "exactly-once".to_string()),
        ("KAFKA__TRANSACTIONAL_ID", transactional_id.clone()),
        // librdkafka's transaction and idempotence lines, for the report of a failure.
        ("KAFKA__PROPERTIES__DEBUG", "eos".into()),
        ("COMMIT_INTERVAL_MS", "100".into()),
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
        ("TASKS__IMAGE__ENABLED", "false".into()),
    ]);
    env.extend(voice_task_env(&voice));
    let records: Vec<(String, Vec<u8>)> = (0..EVENTS)
        .map(|i| {
            let id = unique(&format!("r{i}"));
            let event = voice_event(&root, &id, i, 1.0);
            (id, event)
        })
        .collect();
    let ids: Vec<String> = records.iter().map(|(id, _)| id.clone()).collect();
    let wanted: HashSet<String> = ids.iter().cloned().collect();
    send_all(&producer(), &voice.requests, &records, 256).await.expect("send");

    let topics = [voice.results.as_str(), voice.dlq.as_str()];
    let committed = Collector::start_with(&topics, Isolation::ReadCommitted).expect("collector");
    let uncommitted = Collector::start_with(&topics, Isolation::ReadUncommitted).expect("collector");
    let mut gateway = start_gateway_with(&env, &[("RUST_LOG", "info,librdkafka=debug")]).await.expect("gateway starts");
    let started = Instant::now();
    // Ids of this test read so far (`wait_until` hands the records in: the collector is locked).
    let count = |got: &ById| got.keys().filter(|id| wanted.contains(*id)).count();
    let out = |c: &Collector| c.with(count);
    assert!(
        committed.wait_until(Duration::from_secs(240), |got| count(got) >= EVENTS * 3 / 10).await,
        "only {:?} after 240 s; gateway:\n{}",
        committed.counts(),
        gateway.log_tail()
    );
    let before = out(&committed);
    let away = tokio::task::spawn_blocking(restart_broker).await.expect("joins").expect("broker restarts");
    eprintln!("broker restarted at {:?} with {before} of {EVENTS} ids out; away for {away:?}", started.elapsed());

    let all = committed.wait_until(Duration::from_secs(180), |got| count(got) >= EVENTS).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut t = tally(&ids, &committed.snapshot(), &[&voice.dlq]);
    if !all || !t.lost.is_empty() {
        // The collector has read since before the restart. A reader of its own that did not
        // live through the restart tells a stalled reader (librdkafka's, not the gateway's) from
        // outputs that are really missing: this one's tally is the one asserted on.
        let fresh = collect(&topics, Duration::from_secs(60), |got| count(got) >= EVENTS).await.expect("fresh read");
        let f = tally(&ids, &fresh, &[&voice.dlq]);
        eprintln!(
            "the collector that lived through the restart misses {} ids; a fresh read_committed reader misses {} \
             (doubled {})",
            t.lost.len(),
            f.lost.len(),
            f.duplicated.len()
        );
        t.lost = f.lost;
        t.duplicated.extend(f.duplicated);
    }
    let u = tally(&ids, &uncommitted.snapshot(), &[&voice.dlq]);
    let metrics = gateway.metrics().await.expect("metrics");
    let outcome = |o: &str| metrics.sum("vramgate_gateway_transactions_total", &[("outcome", o)]);
    let gauge = |name: &str| metrics.sum(&format!("vramgate_gateway_{name}"), &[]);
    let by_partition = |name: &str| -> Vec<(Option<String>, f64)> {
        metrics.family(&format!("vramgate_gateway_{name}")).into_iter().map(|(l, v)| (l.get("partition").cloned(), v)).collect()
    };
    // Where any missing record stands: never fetched (pending 0, lag > 0), unfinished (pending),
    // finished and waiting for its transaction (outbox), or written but not visible to
    // read_committed readers (seen read_uncommitted).
    eprintln!(
        "after the restart: read_committed lost {}, doubled {}, dead letters {:?}; read_uncommitted lost {}, {} extra \
         records; records the readers read again after starting over {} and {}; transactions committed {}, aborted {}, fenced {}, failed {}; offset commits ok {}, error {}; records \
         in flight {}, uncommitted {}, pending per partition {:?}, outputs awaiting a transaction {}, paused \
         partitions {}, consumer lag {:?}; wall time {:?}",
        t.lost.len(),
        t.duplicated.len(),
        t.dead_by_kind,
        u.lost.len(),
        u.extra_records,
        committed.reread(),
        uncommitted.reread(),
        outcome("committed"),
        outcome("aborted"),
        outcome("fenced"),
        outcome("failed"),
        metrics.sum("vramgate_gateway_offset_commits_total", &[("result", "ok")]),
        metrics.sum("vramgate_gateway_offset_commits_total", &[("result", "error")]),
        gauge("records_in_flight"),
        gauge("records_uncommitted"),
        by_partition("partition_pending_records"),
        gauge("outputs_awaiting_transaction"),
        gauge("paused_partitions"),
        by_partition("consumer_lag_records"),
        started.elapsed()
    );
    if !t.lost.is_empty() {
        // Most telling first: CI keeps the head and the tail of a failure's output.
        eprintln!("{}", broker_report(&t.lost, &uncommitted.snapshot(), &voice.results, &transactional_id));
        eprintln!("librdkafka's transaction lines from the restart on:\n{}", transaction_lines(&gateway.service.log, 80));
    }
    assert!(
        t.lost.is_empty(),
        "lost {} (e.g. {:?}); gateway's warnings, errors and rebalances:\n{}\n\ngateway's last lines:\n{}",
        t.lost.len(),
        &t.lost[..t.lost.len().min(5)],
        gateway.service.log_matching(&[" WARN ", " ERROR ", "partitions revoked", "partitions assigned"], 30),
        gateway.service.log_last(10)
    );
    assert!(t.duplicated.is_empty(), "{} ids doubled for read_committed (e.g. {:?})", t.duplicated.len(), &t.duplicated[..t.duplicated.len().min(5)]);
    // Valid inputs: a broker away for seconds is waited out, never a dead letter.
    assert!(t.dead_by_kind.is_empty(), "dead letters from valid inputs: {:?}", t.dead_by_kind);
    // The gateway's own read back of its committed outputs gets over the restart too: every
    // output read back, none left charged to `max_held_bytes`. It once took one of the errors
    // librdkafka queued during the outage every 5 s, and lagged minutes behind.
    let unverified = |m: &vramgate_tests::metrics::Scrape| m.sum("vramgate_gateway_outputs_unverified", &[]);
    let read_back = gateway.metrics_when(Duration::from_secs(60), |m| unverified(m) == 0.0).await.expect("metrics");
    assert_eq!(
        unverified(&read_back),
        0.0,
        "committed outputs still not read back 60 s after all were seen; the read back's lines:\n{}",
        gateway.service.log_matching(&["consume::verify"], 10)
    );
    let status = gateway.service.terminate(Duration::from_secs(40)).await.expect("gateway stops");
    assert!(status.success(), "gateway exited with {status}; log:\n{}", gateway.log_tail());
    // What the failure report and the runbook (docs/operations.md) rest on. librdkafka's debug
    // lines reach the log when asked for (`debug`, and their larger share of the log limit).
    assert!(!gateway.service.log_matching(&["facility=TXNSTATE"], 1).is_empty(), "no librdkafka transaction lines in the log");
    // Every transaction closed: each results partition's last stable offset is its log end,
    // and Kafka's tool (`scripts/broker transactions`) finds the gateway's transaction closed.
    let stable = watermarks(&voice.results, PARTITIONS, Isolation::ReadCommitted).expect("watermarks");
    let ends = watermarks(&voice.results, PARTITIONS, Isolation::ReadUncommitted).expect("watermarks");
    assert_eq!(stable, ends, "last stable offsets behind the log ends: a transaction left open");
    let described = broker_transactions(&["describe", "--transactional-id", &transactional_id]);
    assert!(
        described.contains(&transactional_id) && !described.contains("Ongoing") && !described.contains("Prepare"),
        "the gateway's transaction is not closed:\n{described}"
    );
    assert_eq!(uncommitted_records(&group, &voice.requests).expect("offsets"), 0, "records left uncommitted");
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}

/// Where the outputs that `read_committed` readers miss stand in the results topic: their
/// partitions and offsets (from the `read_uncommitted` reader, which has them all), each
/// partition's log end and last stable offset, and what the broker says of the gateway's
/// transactions and of the producers with a transaction open on each partition. An output
/// past its partition's last stable offset sits behind a transaction the broker still holds
/// open; one below it was written in a transaction that was aborted.
fn broker_report(lost: &[String], uncommitted: &ById, results: &str, transactional_id: &str) -> String {
    let mut by_partition: std::collections::BTreeMap<i32, Vec<i64>> = Default::default();
    for id in lost {
        for r in uncommitted.get(id).into_iter().flatten().filter(|r| r.topic == results) {
            by_partition.entry(r.partition).or_default().push(r.offset);
        }
    }
    let mut report = String::from("lost outputs by results partition (count, first and last offset):");
    for (p, offsets) in &by_partition {
        let (first, last) = (offsets.iter().min().copied().unwrap_or(-1), offsets.iter().max().copied().unwrap_or(-1));
        report += &format!(" [{p}: {}, {first}..={last}]", offsets.len());
    }
    for isolation in [Isolation::ReadUncommitted, Isolation::ReadCommitted] {
        report += &format!("\n{} watermarks (partition, low, high): {:?}", isolation.name(), watermarks(results, PARTITIONS, isolation));
    }
    report += &format!("\n--- describe --transactional-id {transactional_id}\n");
    report += &broker_transactions(&["describe", "--transactional-id", transactional_id]);
    for p in 0..PARTITIONS {
        report += &format!("--- describe-producers --topic {results} --partition {p}\n");
        report += &broker_transactions(&["describe-producers", "--topic", results, "--partition", &p.to_string()]);
    }
    // Open ones of any age (the tool's default looks at those open for over 15 minutes).
    report += &format!("--- find-hanging --topic {results} --max-transaction-timeout 0\n");
    report += &broker_transactions(&["find-hanging", "--topic", results, "--max-transaction-timeout", "0"]);
    // The broker's own word since the restart: a transaction it rolled back for its timeout, or
    // markers it gave up writing, name the transactional id or the partition.
    report += "--- the broker's log since the restart: this transaction, the results topic, warnings and errors\n";
    report += &broker_log_matching(&[transactional_id, results, " WARN ", " ERROR "], 40);
    report
}

/// The gateway's librdkafka debug lines about its transactions (`debug = "eos"`) from the
/// broker's going away on, without the reconnection noise: at most `max`, each cut short.
fn transaction_lines(log: &std::path::Path, max: usize) -> String {
    const NOISE: [&str; 6] = ["REBOOTSTRAP", "Connect to ipv4", "PIDBROKER", "Unable to query", "Querying for", "APIRESULT"];
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let from = text.lines().position(|l| l.contains("Disconnected")).unwrap_or(0);
    let lines: Vec<String> = text
        .lines()
        .skip(from)
        .filter(|l| l.contains("librdkafka") && !NOISE.iter().any(|n| l.contains(n)))
        .take(max)
        .map(|l| {
            // The time of day and the message: the date and the level add nothing here.
            let l = l.get(11..).unwrap_or(l).replacen(" DEBUG librdkafka: ", " ", 1);
            l.chars().take(220).collect()
        })
        .collect();
    lines.join("\n")
}
