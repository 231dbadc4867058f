//! Crashes mid-stream lose nothing: the worker SIGKILLed twice and restarted on its address
//! while 1,000 mixed events flow, and the gateway SIGKILLed and replaced by a new one in the
//! same group. Every id ends in a result or a dead letter; duplicates are counted, and after a
//! gateway crash bounded by the records it held.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use vramgate_tests::chaos::{tally, terminate_and_check_commits, wait_for};
use vramgate_tests::fleet::{image_event, voice_event};
use vramgate_tests::{
    gateway_base_env, image_task_env, producer, scratch_dir, send_all, start_gateway, start_worker, start_worker_on,
    unique, voice_task_env, worker_config, Collector, TaskTopics, PNET_MODEL, VAD_MODEL,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_killed_twice_mid_stream_loses_no_event() {
    let voice = TaskTopics::create("chaos-voice", 4).await.expect("topics");
    let image = TaskTopics::create("chaos-image", 4).await.expect("topics");
    let root = scratch_dir("chaos-worker");
    let config = worker_config("", &[VAD_MODEL, PNET_MODEL]);
    let mut worker = start_worker(&config).await.expect("worker starts");
    let addr = worker.addr().to_string();
    let group = unique("gw");
    let mut env = gateway_base_env(&group, &worker.url, &root);
    env.extend([
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
        ("TASKS__IMAGE__CPU_THREADS", "1".into()),
        ("TASKS__VOICE__RETRY__MAX_ATTEMPTS", "20".into()),
        ("TASKS__VOICE__RETRY__BACKOFF_MAX_MS", "2000".into()),
        ("TASKS__IMAGE__RETRY__MAX_ATTEMPTS", "20".into()),
        ("TASKS__IMAGE__RETRY__BACKOFF_MAX_MS", "2000".into()),
    ]);
    env.extend(voice_task_env(&voice));
    env.extend(image_task_env(&image));
    let mut gateway = start_gateway(&env).await.expect("gateway starts");
    let collector = Collector::start(&[&voice.results, &voice.dlq, &image.results, &image.dlq]).expect("collector");

    let (mut voice_records, mut image_records, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..500 {
        let id = unique(&format!("v{i}"));
        voice_records.push((id.clone(), voice_event(&root, &id, i, 2.0)));
        ids.push(id);
        let id = unique(&format!("i{i}"));
        image_records.push((id.clone(), image_event(&root, &id, i)));
        ids.push(id);
    }
    let bytes: usize = voice_records.iter().chain(&image_records).map(|(_, v)| v.len()).sum();
    let started = Instant::now();
    let producer = producer();
    let (sent_voice, sent_image) = tokio::join!(
        send_all(&producer, &voice.requests, &voice_records, 256),
        send_all(&producer, &image.requests, &image_records, 256)
    );
    sent_voice.expect("send voice");
    sent_image.expect("send images");
    eprintln!("sent {} events ({bytes} bytes) in {:?}", ids.len(), started.elapsed());

    let wanted: HashSet<String> = ids.iter().cloned().collect();
    let mut kills = Vec::new();
    for fraction in [0.25, 0.60] {
        let at = (ids.len() as f64 * fraction) as usize;
        let reached = wait_for(&collector, &wanted, at, Duration::from_secs(240)).await;
        assert!(
            reached,
            "only {:?} (records, ids) after 240 s; gateway log:\n{}",
            collector.counts(),
            gateway.log_tail()
        );
        let seen = collector.with(|got| got.keys().filter(|id| wanted.contains(*id)).count());
        let status = worker.service.kill().expect("SIGKILL the worker");
        let killed_at = started.elapsed();
        worker = start_worker_on(&config, &addr).await.expect("worker restarts on its address");
        eprintln!(
            "worker killed ({status}) at {killed_at:?} with {seen} of {} ids out; restarted on {addr} in {:?}",
            ids.len(),
            started.elapsed() - killed_at
        );
        kills.push(seen);
    }

    let all = wait_for(&collector, &wanted, ids.len(), Duration::from_secs(300)).await;
    let elapsed = started.elapsed();
    let records = collector.snapshot();
    let t = tally(&ids, &records, &[&voice.dlq, &image.dlq]);
    eprintln!(
        "{} events with the worker killed at {kills:?} ids out: {} results, lost {}, {} ids duplicated ({} extra records), \
         dead letters by kind {:?}, wall time {elapsed:?}",
        ids.len(),
        t.results,
        t.lost.len(),
        t.duplicated.len(),
        t.extra_records,
        t.dead_by_kind
    );
    assert!(
        all && t.lost.is_empty(),
        "{} events lost (e.g. {:?}); gateway log:\n{}",
        t.lost.len(),
        &t.lost[..t.lost.len().min(5)],
        gateway.log_tail()
    );
    assert!(collector.error().is_none(), "{:?}", collector.error());
    // The inputs are all valid: the only dead letters a worker crash may cause are retries that
    // ran out.
    let unexpected: Vec<_> =
        t.dead_by_kind.keys().filter(|k| !["worker_unavailable", "timeout"].contains(&k.as_str())).collect();
    assert!(unexpected.is_empty(), "dead letters of kinds {unexpected:?} from valid inputs");

    let metrics = gateway.metrics().await.expect("metrics");
    let retried = metrics.sum("vramgate_gateway_retries_total", &[("reason", "error")]);
    eprintln!("retries after errors: {retried}");
    assert!(retried > 0.0, "no retries_total{{reason=\"error\"}} after two worker crashes:\n{}", metrics.text);

    terminate_and_check_commits(&mut gateway, &group, &[&voice.requests, &image.requests]).await;
    drop(worker);
    // Kept when the test fails, for diagnosis.
    let _ = std::fs::remove_dir_all(&root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_killed_mid_stream_loses_no_event_and_repeats_at_most_what_it_held() {
    const MAX_IN_FLIGHT: usize = 32;
    const EVENTS: usize = 400;
    let voice = TaskTopics::create("chaos-gw", 4).await.expect("topics");
    let root = scratch_dir("chaos-gateway");
    let worker = start_worker(&worker_config("", &[VAD_MODEL])).await.expect("worker starts");
    let group = unique("gw");
    let mut env = gateway_base_env(&group, &worker.url, &root);
    env.extend([
        ("MAX_IN_FLIGHT", MAX_IN_FLIGHT.to_string()),
        ("COMMIT_INTERVAL_MS", "100".into()),
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
        ("TASKS__IMAGE__ENABLED", "false".into()),
    ]);
    env.extend(voice_task_env(&voice));

    let mut records = Vec::new();
    for i in 0..EVENTS {
        let id = unique(&format!("v{i}"));
        records.push((id.clone(), voice_event(&root, &id, i, 2.0)));
    }
    let ids: Vec<String> = records.iter().map(|(id, _)| id.clone()).collect();
    send_all(&producer(), &voice.requests, &records, 256).await.expect("send");

    let started = Instant::now();
    let collector = Collector::start(&[&voice.results, &voice.dlq]).expect("collector");
    let mut first = start_gateway(&env).await.expect("gateway starts");
    let wanted: HashSet<String> = ids.iter().cloned().collect();
    let reached = wait_for(&collector, &wanted, EVENTS * 4 / 10, Duration::from_secs(240)).await;
    assert!(reached, "only {:?} (records, ids) after 240 s; gateway log:\n{}", collector.counts(), first.log_tail());
    let in_flight = first.metrics().await.map(|m| m.sum("vramgate_gateway_records_in_flight", &[])).unwrap_or(f64::NAN);
    let status = first.service.kill().expect("SIGKILL the gateway");
    let seen = collector.with(|got| got.keys().filter(|id| wanted.contains(*id)).count());
    let killed_at = started.elapsed();
    eprintln!(
        "gateway killed ({status}) at {killed_at:?} with {seen} of {EVENTS} ids out, {in_flight} records in flight"
    );

    let mut second = start_gateway(&env).await.expect("second gateway starts");
    let all = wait_for(&collector, &wanted, EVENTS, Duration::from_secs(300)).await;
    let elapsed = started.elapsed();
    let t = tally(&ids, &collector.snapshot(), &[&voice.dlq]);
    eprintln!(
        "{EVENTS} events, gateway killed after {seen}: {} results, lost {}, {} ids duplicated ({} extra records), \
         dead letters by kind {:?}, wall time {elapsed:?} (the new member waits out the dead one's session)",
        t.results,
        t.lost.len(),
        t.duplicated.len(),
        t.extra_records,
        t.dead_by_kind
    );
    assert!(
        all && t.lost.is_empty(),
        "{} events lost (e.g. {:?}); second gateway log:\n{}",
        t.lost.len(),
        &t.lost[..t.lost.len().min(5)],
        second.log_tail()
    );
    assert!(t.dead_by_kind.is_empty(), "dead letters from valid inputs: {:?}", t.dead_by_kind);
    assert!(
        t.extra_records <= MAX_IN_FLIGHT,
        "{} records repeated after the crash, more than the {MAX_IN_FLIGHT} a gateway may hold",
        t.extra_records
    );
    terminate_and_check_commits(&mut second, &group, &[&voice.requests]).await;
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}
