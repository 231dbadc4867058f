//! Exactly-once outputs read back after their commit (`kafka.verify_outputs`): the broker made
//! to misbehave on purpose, with Kafka's own transactions tool, in the two ways that can hide
//! committed outputs from `read_committed` readers.
//!
//! - Aborted after the commit was reported: the gateway is stopped (SIGSTOP) while a
//!   transaction of its has outputs in a results partition, the tool writes an abort marker
//!   for that transaction on that partition, and the gateway, let go, commits it. librdkafka
//!   reports the commit; the outputs on that partition are aborted all the same. The gateway's
//!   reader finds them missing and writes them again: every id once for `read_committed`.
//! - Held by a hanging transaction: another producer leaves a transaction open on a results
//!   partition, so its last stable offset stops there and the gateway's committed outputs
//!   behind it are invisible. The gateway reports the partition hanging (gauge, log line with
//!   the offset to abort at); the tool aborts the other transaction, and they all come through.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::process::Command;
use std::time::{Duration, Instant};

use rdkafka::producer::{FutureRecord, BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::ClientConfig;
use vramgate_tests::chaos::tally;
use vramgate_tests::fleet::voice_event;
use vramgate_tests::{
    broker_transactions, brokers, gateway_base_env, producer, scratch_dir, send_all, start_gateway_with, start_worker, unique,
    voice_task_env, watermarks, worker_config, ById, Collector, Isolation, TaskTopics, VAD_MODEL,
};

const PARTITIONS: i32 = 2;

fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill").args([sig, &pid.to_string()]).status().expect("kill runs");
    assert!(status.success(), "kill {sig} {pid}");
}

fn events(root: &std::path::Path, n: usize) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let id = unique(&format!("v{i}"));
            let event = voice_event(root, &id, i, 1.0);
            (id, event)
        })
        .collect()
}

fn gateway_env(group: &str, worker_url: &str, root: &std::path::Path, topics: &TaskTopics, transactional_id: &str, timeout_ms: u64) -> Vec<(&'static str, String)> {
    let mut env = gateway_base_env(group, worker_url, root);
    env.extend([
        ("DELIVERY", "exactly-once".to_string()),
        ("KAFKA__TRANSACTIONAL_ID", transactional_id.to_string()),
        ("KAFKA__TRANSACTION_TIMEOUT_MS", timeout_ms.to_string()),
        ("COMMIT_INTERVAL_MS", "100".into()),
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
        ("TASKS__IMAGE__ENABLED", "false".into()),
    ]);
    env.extend(voice_task_env(topics));
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_aborted_after_a_reported_commit_are_written_again_once() {
    const EVENTS: usize = 300;
    let voice = TaskTopics::create("verify-abort", PARTITIONS).await.expect("topics");
    let root = scratch_dir("verify-abort");
    let worker = start_worker(&worker_config("", &[VAD_MODEL])).await.expect("worker starts");
    let group = unique("gw");
    let transactional_id = unique("verify-abort");
    // A transaction timeout well past the seconds the gateway is stopped for: the broker must
    // not end the transaction itself.
    let env = gateway_env(&group, &worker.url, &root, &voice, &transactional_id, 60_000);
    let records = events(&root, EVENTS);
    let ids: Vec<String> = records.iter().map(|(id, _)| id.clone()).collect();
    let wanted: HashSet<String> = ids.iter().cloned().collect();
    let topics = [voice.results.as_str(), voice.dlq.as_str()];
    let committed = Collector::start_with(&topics, Isolation::ReadCommitted).expect("collector");
    let uncommitted = Collector::start_with(&topics, Isolation::ReadUncommitted).expect("collector");
    let mut gateway = start_gateway_with(&env, &[]).await.expect("gateway starts");
    // Events trickle in (one every 40 ms, at most 12 s in all), so the gateway commits a
    // transaction every few of them while the test tries to catch one open. They stop once one
    // was aborted: the aborted outputs are then likely the last of their partition, which only
    // the reader's position past the abort marker tells apart from outputs not yet read.
    let (sent, stop_sending) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
    let sender = {
        let requests = voice.requests.clone();
        let (sent, stop_sending) = (sent.clone(), stop_sending.clone());
        tokio::spawn(async move {
            let producer = producer();
            for (id, event) in &records {
                if stop_sending.load(Ordering::SeqCst) {
                    break;
                }
                let record = FutureRecord::to(&requests).key(id.as_str()).payload(event.as_slice());
                producer.send(record, Duration::from_secs(30)).await.map_err(|(e, _)| e).expect("send");
                sent.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
        })
    };
    let count = |got: &ById| got.keys().filter(|id| wanted.contains(*id)).count();
    assert!(
        committed.wait_until(Duration::from_secs(180), |got| count(got) >= 10).await,
        "only {:?}; gateway:\n{}",
        committed.counts(),
        gateway.log_tail()
    );

    // Stop the gateway until one of its transactions is caught open with outputs in a results
    // partition (that partition's log end past its last stable offset), and abort it there.
    let pid = gateway.pid();
    let mut aborted = None;
    for attempt in 0..300 {
        signal(pid, "-STOP");
        let stable = watermarks(&voice.results, PARTITIONS, Isolation::ReadCommitted).expect("watermarks");
        let ends = watermarks(&voice.results, PARTITIONS, Isolation::ReadUncommitted).expect("watermarks");
        let open = stable.iter().zip(&ends).find(|((_, _, lso), (_, _, end))| end > lso).map(|((p, _, lso), (_, _, end))| (*p, *lso, *end));
        if let Some((partition, lso, end)) = open {
            let said = broker_transactions(&[
                "abort",
                "--topic",
                &voice.results,
                "--partition",
                &partition.to_string(),
                "--start-offset",
                &lso.to_string(),
            ]);
            eprintln!("attempt {attempt}: partition {partition} open from {lso} to {end}; the tool said:\n{said}");
            let after = watermarks(&voice.results, PARTITIONS, Isolation::ReadCommitted).expect("watermarks");
            // The stable offset also moves when the gateway's commit reached the broker before
            // the stop and the transaction ended while the tool looked: then the tool finds no
            // open transaction there, nothing was aborted, and the test tries again.
            let missed = said.contains("Could not find any open transactions");
            if !missed && after.iter().any(|(p, _, s)| *p == partition && *s > lso) {
                aborted = Some((partition, lso, end));
                stop_sending.store(true, Ordering::SeqCst);
            }
        }
        signal(pid, "-CONT");
        if aborted.is_some() {
            break;
        }
        if sender.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5 + 7 * attempt % 30)).await;
    }
    let (partition, from, to) = aborted.expect("no transaction of the gateway was caught open with outputs while events came in");
    sender.await.expect("sender");
    let events = sent.load(Ordering::SeqCst);
    let ids = &ids[..events];
    eprintln!("aborted the gateway's transaction on partition {partition}, offsets {from}..{to}; {events} events sent");

    let all = committed.wait_until(Duration::from_secs(240), |got| count(got) >= events).await;
    let metrics = gateway.metrics_when(Duration::from_secs(30), |m| m.sum("vramgate_gateway_outputs_unverified", &[]) == 0.0).await.expect("metrics");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t = tally(ids, &committed.snapshot(), &[&voice.dlq]);
    let u = tally(ids, &uncommitted.snapshot(), &[&voice.dlq]);
    let redone = metrics.sum("vramgate_gateway_outputs_redone_total", &[]);
    let verified = metrics.sum("vramgate_gateway_outputs_verified_total", &[]);
    eprintln!(
        "read_committed: lost {}, doubled {}; read_uncommitted: {} extra records; redone {redone}, verified {verified}",
        t.lost.len(),
        t.duplicated.len(),
        u.extra_records
    );
    assert!(all && t.lost.is_empty(), "lost {} for read_committed (e.g. {:?}); gateway:\n{}", t.lost.len(), &t.lost[..t.lost.len().min(5)], gateway.log_tail());
    assert!(t.duplicated.is_empty(), "{} ids doubled for read_committed", t.duplicated.len());
    assert!(t.dead_by_kind.is_empty(), "dead letters from valid inputs: {:?}", t.dead_by_kind);
    // The abort took outputs down, and they were written again: the aborted copies are still
    // in the log for a read_uncommitted reader.
    assert!(redone >= 1.0, "no output was redone, though the tool aborted offsets {from}..{to}; gateway:\n{}", gateway.log_tail());
    assert!(u.extra_records as f64 >= redone, "{} extra records for read_uncommitted, {redone} redone", u.extra_records);
    assert!(verified >= events as f64, "{verified} outputs verified of {events}");
    assert!(
        !gateway.service.log_matching(&["not visible to read_committed readers"], 1).is_empty(),
        "no log line names the aborted outputs"
    );
    let status = gateway.service.terminate(Duration::from_secs(40)).await.expect("gateway stops");
    assert!(status.success(), "gateway exited with {status}; log:\n{}", gateway.log_tail());
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_transaction_is_reported_and_aborting_it_lets_every_output_through() {
    const EVENTS: usize = 60;
    let voice = TaskTopics::create("verify-hang", PARTITIONS).await.expect("topics");
    let root = scratch_dir("verify-hang");
    let worker = start_worker(&worker_config("", &[VAD_MODEL])).await.expect("worker starts");

    // Another producer's transaction, left open on results partition 0 for longer than the test.
    let other: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", unique("other"))
        .set("transaction.timeout.ms", "600000")
        .create()
        .expect("producer");
    other.init_transactions(Duration::from_secs(30)).expect("init");
    other.begin_transaction().expect("begin");
    other.send(BaseRecord::<(), _>::to(&voice.results).partition(0).payload("open")).map_err(|(e, _)| e).expect("send");
    other.flush(Duration::from_secs(10)).expect("flush");
    let stable = watermarks(&voice.results, PARTITIONS, Isolation::ReadCommitted).expect("watermarks");
    let held_at = stable.iter().find(|(p, _, _)| *p == 0).map(|(_, _, s)| *s).expect("partition 0");
    assert_eq!(held_at, 0, "the open transaction holds partition 0 at its start");

    let group = unique("gw");
    let transactional_id = unique("verify-hang");
    // A short transaction timeout: a partition held for 2 s and the 10 s margin hangs.
    let env = gateway_env(&group, &worker.url, &root, &voice, &transactional_id, 2_000);
    let records = events(&root, EVENTS);
    let ids: Vec<String> = records.iter().map(|(id, _)| id.clone()).collect();
    let wanted: HashSet<String> = ids.iter().cloned().collect();
    send_all(&producer(), &voice.requests, &records, 256).await.expect("send");
    let topics = [voice.results.as_str(), voice.dlq.as_str()];
    let committed = Collector::start_with(&topics, Isolation::ReadCommitted).expect("collector");
    let mut gateway = start_gateway_with(&env, &[]).await.expect("gateway starts");
    let started = Instant::now();
    let metrics = gateway
        .metrics_when(Duration::from_secs(120), |m| m.sum("vramgate_gateway_hanging_transactions", &[]) == 1.0)
        .await
        .expect("metrics");
    let waited = started.elapsed();
    assert_eq!(metrics.sum("vramgate_gateway_hanging_transactions", &[]), 1.0, "no hanging transaction reported; gateway:\n{}", gateway.log_tail());
    assert!(waited >= Duration::from_secs(12), "reported hanging after {waited:?}, before the timeout and margin");
    let line = gateway.service.log_matching(&["a hanging transaction holds"], 1);
    assert!(line.contains(&voice.results) && line.contains("last_stable_offset=0"), "the log line names neither the partition nor the offset:\n{line}");
    let count = |got: &ById| got.keys().filter(|id| wanted.contains(*id)).count();
    let visible = committed.with(count);
    assert!(visible < EVENTS, "all {visible} outputs visible behind the open transaction");
    let unverified = metrics.sum("vramgate_gateway_outputs_unverified", &[]);
    assert!(unverified >= 1.0, "no output waits to be read back");

    // The runbook's step: abort it where the log line says.
    let said = broker_transactions(&["abort", "--topic", &voice.results, "--partition", "0", "--start-offset", "0"]);
    eprintln!("the tool said:\n{said}");
    assert!(committed.wait_until(Duration::from_secs(120), |got| count(got) >= EVENTS).await, "only {:?} after the abort", committed.counts());
    let metrics = gateway
        .metrics_when(Duration::from_secs(30), |m| {
            m.sum("vramgate_gateway_hanging_transactions", &[]) == 0.0 && m.sum("vramgate_gateway_outputs_unverified", &[]) == 0.0
        })
        .await
        .expect("metrics");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t = tally(&ids, &committed.snapshot(), &[&voice.dlq]);
    assert!(t.lost.is_empty() && t.duplicated.is_empty(), "lost {}, doubled {}", t.lost.len(), t.duplicated.len());
    assert_eq!(metrics.sum("vramgate_gateway_hanging_transactions", &[]), 0.0);
    assert_eq!(metrics.sum("vramgate_gateway_outputs_unverified", &[]), 0.0);
    assert_eq!(metrics.sum("vramgate_gateway_outputs_redone_total", &[]), 0.0, "nothing of the gateway's was aborted");
    assert!(metrics.sum("vramgate_gateway_outputs_verified_total", &[]) >= EVENTS as f64);
    assert!(!gateway.service.log_matching(&["the hanging transaction is over"], 1).is_empty());
    let status = gateway.service.terminate(Duration::from_secs(40)).await.expect("gateway stops");
    assert!(status.success(), "gateway exited with {status}");
    drop(other);
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}
