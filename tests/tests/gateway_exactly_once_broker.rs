//! Exactly-once delivery with the broker restarted mid-run: the transactions open when it goes
//! abort, are redone once it is back, and a `read_committed` consumer sees one output per
//! request. Alone in its test binary: restarting the shared broker takes it away from every
//! client of the binary (cargo runs test binaries one at a time, so no other test's).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use vramgate_tests::chaos::tally;
use vramgate_tests::fleet::voice_event;
use vramgate_tests::{
    collect, gateway_base_env, producer, restart_broker, scratch_dir, send_all, start_gateway, start_worker, uncommitted_records,
    unique, voice_task_env, worker_config, ById, Collector, Isolation, TaskTopics, VAD_MODEL,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_restarted_mid_run_leaves_no_output_lost_or_doubled() {
    const EVENTS: usize = 400;
    let voice = TaskTopics::create("eos-restart", 4).await.expect("topics");
    let root = scratch_dir("eos-restart");
    let worker = start_worker(&worker_config("", &[VAD_MODEL])).await.expect("worker starts");
    let group = unique("gw");
    let mut env = gateway_base_env(&group, &worker.url, &root);
    env.extend([
        ("DELIVERY", "exactly-once".to_string()),
        ("KAFKA__TRANSACTIONAL_ID", unique("eos-restart")),
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
    let mut gateway = start_gateway(&env).await.expect("gateway starts");
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
         records; transactions committed {}, aborted {}, fenced {}, failed {}; offset commits ok {}, error {}; records \
         in flight {}, uncommitted {}, pending per partition {:?}, outputs awaiting a transaction {}, paused \
         partitions {}, consumer lag {:?}; wall time {:?}",
        t.lost.len(),
        t.duplicated.len(),
        t.dead_by_kind,
        u.lost.len(),
        u.extra_records,
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
    assert!(
        t.lost.is_empty(),
        "lost {} (e.g. {:?}); gateway's warnings, errors and rebalances:\n{}\n\ngateway's last lines:\n{}",
        t.lost.len(),
        &t.lost[..t.lost.len().min(5)],
        gateway.service.log_matching(&[" WARN ", " ERROR ", "partitions revoked", "partitions assigned"], 60),
        gateway.log_tail()
    );
    assert!(t.duplicated.is_empty(), "{} ids doubled for read_committed (e.g. {:?})", t.duplicated.len(), &t.duplicated[..t.duplicated.len().min(5)]);
    // Valid inputs: a broker away for seconds is waited out, never a dead letter.
    assert!(t.dead_by_kind.is_empty(), "dead letters from valid inputs: {:?}", t.dead_by_kind);
    let status = gateway.service.terminate(Duration::from_secs(40)).await.expect("gateway stops");
    assert!(status.success(), "gateway exited with {status}; log:\n{}", gateway.log_tail());
    assert_eq!(uncommitted_records(&group, &voice.requests).expect("offsets"), 0, "records left uncommitted");
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}
