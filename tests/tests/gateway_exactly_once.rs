//! Exactly-once delivery (`delivery = "exactly-once"`) on a real broker: gateways SIGKILLed
//! mid-stream and a zombie gateway (SIGSTOPped past its session, then let go on) leave one
//! output per request for a `read_committed` consumer, where at-least-once delivery repeats the
//! records past the last commit. A `read_uncommitted` consumer may see the aborted
//! transactions' outputs too; the tests count them and print them.
//!
//! The broker restarted mid-run is `gateway_exactly_once_broker.rs` (alone in its binary, as it
//! takes the shared broker away from every test running beside it).

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use vramgate_tests::chaos::{seen, tally, terminate_and_check_commits, wait_for};
use vramgate_tests::fleet::{image_event, voice_event};
use vramgate_tests::{
    gateway_base_env, image_task_env, producer, request_file, scratch_dir, send_all, start_gateway, start_worker,
    unique, voice_task_env, worker_config, Collector, Gateway, Isolation, TaskTopics, PNET_MODEL, VAD_MODEL,
};

/// A few hundred milliseconds, different on every run: where between two outputs a kill lands.
fn jitter_ms(max: u64) -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    u64::from(nanos) % max.max(1)
}

/// The gateway settings every exactly-once gateway here shares: a short session, so the group
/// moves a dead member's partitions on within seconds, and its own transactional id.
fn exactly_once_env(base: &[(&'static str, String)], transactional_id: &str) -> Vec<(&'static str, String)> {
    let mut env = base.to_vec();
    env.extend([
        ("DELIVERY", "exactly-once".to_string()),
        ("KAFKA__TRANSACTIONAL_ID", transactional_id.to_string()),
        ("KAFKA__SESSION_TIMEOUT_MS", "6000".into()),
        ("KAFKA__TRANSACTION_TIMEOUT_MS", "10000".into()),
        ("DRAIN_TIMEOUT_SECONDS", "2".into()),
    ]);
    env
}

fn signal(gateway: &Gateway, sig: &str) {
    let status = Command::new("kill").args([sig, &gateway.pid().to_string()]).status().expect("kill runs");
    assert!(status.success(), "kill {sig} failed");
}

/// Poison records among the good ones: each must come out as exactly one dead letter.
fn poison_events(root: &std::path::Path, count: usize) -> Vec<(String, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let id = unique(&format!("poison{i}"));
            let value = match i % 3 {
                0 => request_file(&id, "voice", &root.join("no-such-file.wav")),
                1 => serde_json::to_vec(&serde_json::json!({"id": id, "task": "translate", "input": {"data_b64": "AA=="}}))
                    .expect("json"),
                _ => {
                    let corrupt = root.join(format!("corrupt-{i}.wav"));
                    std::fs::write(&corrupt, b"RIFF\x10\x00\x00\x00WAVEfmt \x02\x00\x00\x00\x01").expect("write");
                    request_file(&id, "voice", &corrupt)
                }
            };
            (id, value)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_killed_three_times_leave_one_output_per_event_for_read_committed_readers() {
    const EACH: usize = 990;
    const POISON: usize = 20;
    let voice = TaskTopics::create("eos-voice", 4).await.expect("topics");
    let image = TaskTopics::create("eos-image", 4).await.expect("topics");
    let root = scratch_dir("eos-chaos");
    let worker = start_worker(&worker_config("", &[VAD_MODEL, PNET_MODEL])).await.expect("worker starts");
    let group = unique("gw");
    let mut base = gateway_base_env(&group, &worker.url, &root);
    base.extend([
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
        ("TASKS__IMAGE__CPU_THREADS", "1".into()),
        ("MAX_IN_FLIGHT", "128".into()),
        ("COMMIT_INTERVAL_MS", "100".into()),
    ]);
    base.extend(voice_task_env(&voice));
    base.extend(image_task_env(&image));
    let (id_a, id_b) = (unique("eos-a"), unique("eos-b"));
    let env_a = exactly_once_env(&base, &id_a);
    let env_b = exactly_once_env(&base, &id_b);

    let (mut voice_records, mut image_records, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..EACH {
        let id = unique(&format!("v{i}"));
        voice_records.push((id.clone(), voice_event(&root, &id, i, 1.0)));
        ids.push(id);
        let id = unique(&format!("i{i}"));
        image_records.push((id.clone(), image_event(&root, &id, i)));
        ids.push(id);
    }
    // The poison records spread through the voice stream.
    let poison = poison_events(&root, POISON);
    for (n, p) in poison.iter().enumerate() {
        voice_records.insert((n * 47) % voice_records.len(), p.clone());
        ids.push(p.0.clone());
    }
    let producer = producer();
    let (v, i) = tokio::join!(
        send_all(&producer, &voice.requests, &voice_records, 256),
        send_all(&producer, &image.requests, &image_records, 256)
    );
    v.expect("send voice");
    i.expect("send images");

    let topics = [voice.results.as_str(), voice.dlq.as_str(), image.results.as_str(), image.dlq.as_str()];
    let committed = Collector::start_with(&topics, Isolation::ReadCommitted).expect("collector");
    let uncommitted = Collector::start_with(&topics, Isolation::ReadUncommitted).expect("collector");
    let started = Instant::now();
    let mut a = start_gateway(&env_a).await.expect("gateway a starts");
    let mut b = start_gateway(&env_b).await.expect("gateway b starts");

    // Gateway a SIGKILLed three times and restarted under its transactional id each time, at
    // random moments in the stream; b runs throughout and takes a's partitions meanwhile.
    let wanted: HashSet<String> = ids.iter().cloned().collect();
    let mut kills = Vec::new();
    for fraction in [0.2, 0.45, 0.7] {
        let at = (ids.len() as f64 * fraction) as usize;
        let reached = wait_for(&committed, &wanted, at, Duration::from_secs(300)).await;
        assert!(reached, "only {:?} (records, ids) after 300 s; gateway a:\n{}\nb:\n{}", committed.counts(), a.log_tail(), b.log_tail());
        tokio::time::sleep(Duration::from_millis(jitter_ms(400))).await;
        let transactions = a.metrics().await.map(|m| m.sum("vramgate_gateway_transactions_total", &[("outcome", "committed")])).unwrap_or(f64::NAN);
        let status = a.service.kill().expect("SIGKILL gateway a");
        kills.push((started.elapsed(), seen(&committed, &wanted), transactions));
        eprintln!("gateway a killed ({status}) at {:?} with {} ids out, after {transactions} transactions of its own", started.elapsed(), seen(&committed, &wanted));
        a = start_gateway(&env_a).await.expect("gateway a restarts");
    }

    let all = wait_for(&committed, &wanted, ids.len(), Duration::from_secs(400)).await;
    let elapsed = started.elapsed();
    // Late duplicates, were there any, would come within the next commits: wait a few.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let dlqs = [voice.dlq.as_str(), image.dlq.as_str()];
    let t = tally(&ids, &committed.snapshot(), &dlqs);
    let u = tally(&ids, &uncommitted.snapshot(), &dlqs);
    eprintln!(
        "{} events ({POISON} poison), gateway a killed at {kills:?} (time, ids out, its transactions): \
         read_committed: {} results, lost {}, {} ids duplicated, dead letters {:?}; read_uncommitted: {} ids \
         duplicated ({} extra records from aborted transactions); wall time {elapsed:?}",
        ids.len(),
        t.results,
        t.lost.len(),
        t.duplicated.len(),
        t.dead_by_kind,
        u.duplicated.len(),
        u.extra_records,
    );
    assert!(all && t.lost.is_empty(), "{} events lost (e.g. {:?}); a:\n{}\nb:\n{}", t.lost.len(), &t.lost[..t.lost.len().min(5)], a.log_tail(), b.log_tail());
    assert!(t.duplicated.is_empty(), "{} ids with more than one output for read_committed (e.g. {:?})", t.duplicated.len(), &t.duplicated[..t.duplicated.len().min(5)]);
    assert_eq!(t.dead_by_kind.values().sum::<usize>(), POISON, "one dead letter per poison record: {:?}", t.dead_by_kind);
    assert!(committed.error().is_none(), "{:?}", committed.error());
    for gateway in [&a, &b] {
        let m = gateway.metrics().await.expect("metrics");
        assert!(m.sum("vramgate_gateway_transactions_total", &[("outcome", "committed")]) > 0.0, "no transaction committed:\n{}", m.text);
    }
    terminate_and_check_commits(&mut a, &group, &[]).await;
    terminate_and_check_commits(&mut b, &group, &[&voice.requests, &image.requests]).await;
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_gateway_cannot_commit_outputs_for_partitions_it_lost() {
    const EVENTS: usize = 300;
    let voice = TaskTopics::create("eos-zombie", 4).await.expect("topics");
    let root = scratch_dir("eos-zombie");
    let worker = start_worker(&worker_config("", &[VAD_MODEL])).await.expect("worker starts");
    let group = unique("gw");
    let mut base = gateway_base_env(&group, &worker.url, &root);
    base.extend([
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
        ("TASKS__IMAGE__ENABLED", "false".into()),
        ("MAX_IN_FLIGHT", "1024".into()),
    ]);
    base.extend(voice_task_env(&voice));
    // The zombie commits rarely, so it holds finished outputs when it is stopped.
    let mut env_zombie = exactly_once_env(&base, &unique("eos-zombie"));
    env_zombie.push(("COMMIT_INTERVAL_MS", "3000".into()));
    let env_heir = exactly_once_env(&base, &unique("eos-heir"));

    let records: Vec<(String, Vec<u8>)> = (0..EVENTS)
        .map(|i| {
            let id = unique(&format!("z{i}"));
            let event = voice_event(&root, &id, i, 1.0);
            (id, event)
        })
        .collect();
    let ids: Vec<String> = records.iter().map(|(id, _)| id.clone()).collect();
    let wanted: HashSet<String> = ids.iter().cloned().collect();
    let topics = [voice.results.as_str(), voice.dlq.as_str()];
    let committed = Collector::start_with(&topics, Isolation::ReadCommitted).expect("collector");
    let uncommitted = Collector::start_with(&topics, Isolation::ReadUncommitted).expect("collector");
    let zombie = start_gateway(&env_zombie).await.expect("zombie starts");
    send_all(&producer(), &voice.requests, &records, 256).await.expect("send");

    // Stopped while it holds outputs: finished records it has not committed yet.
    let holding = zombie
        .metrics_when(Duration::from_secs(120), |m| m.sum("vramgate_gateway_outputs_awaiting_transaction", &[]) >= 20.0)
        .await
        .expect("metrics");
    let held = holding.sum("vramgate_gateway_outputs_awaiting_transaction", &[]);
    signal(&zombie, "-STOP");
    eprintln!("zombie stopped holding {held} outputs, {} ids out", seen(&committed, &wanted));

    // Its heir takes every partition once the zombie's session has expired, and finishes.
    let mut heir = start_gateway(&env_heir).await.expect("heir starts");
    let all = wait_for(&committed, &wanted, EVENTS, Duration::from_secs(300)).await;
    assert!(all, "only {:?} (records, ids) with the zombie stopped; heir:\n{}", committed.counts(), heir.log_tail());

    // Let go on: it finds itself out of the group, and whatever it tries to commit is refused.
    signal(&zombie, "-CONT");
    let after = zombie
        .metrics_when(Duration::from_secs(60), |m| {
            m.sum("vramgate_gateway_outputs_awaiting_transaction", &[]) == 0.0
        })
        .await
        .expect("metrics");
    // Its rejoin moves partitions back and forth once more; give the commits after it time.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let aborted = ["aborted", "fenced"].iter().map(|o| after.sum("vramgate_gateway_transactions_total", &[("outcome", o)])).sum::<f64>();
    let t = tally(&ids, &committed.snapshot(), &[&voice.dlq]);
    let u = tally(&ids, &uncommitted.snapshot(), &[&voice.dlq]);
    eprintln!(
        "zombie back: {aborted} of its transactions aborted or fenced, {} outputs left waiting; read_committed: {} results, \
         lost {}, {} duplicated; read_uncommitted: {} duplicated ({} extra records)",
        after.sum("vramgate_gateway_outputs_awaiting_transaction", &[]),
        t.results,
        t.lost.len(),
        t.duplicated.len(),
        u.duplicated.len(),
        u.extra_records
    );
    assert!(t.lost.is_empty(), "lost {:?}", &t.lost[..t.lost.len().min(5)]);
    assert!(
        t.duplicated.is_empty(),
        "the zombie's outputs reached read_committed readers: {} ids twice (e.g. {:?}); zombie:\n{}",
        t.duplicated.len(),
        &t.duplicated[..t.duplicated.len().min(5)],
        zombie.log_tail()
    );
    assert!(t.dead_by_kind.is_empty(), "dead letters from valid inputs: {:?}", t.dead_by_kind);
    let mut zombie = zombie;
    terminate_and_check_commits(&mut zombie, &group, &[]).await;
    terminate_and_check_commits(&mut heir, &group, &[&voice.requests]).await;
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}
