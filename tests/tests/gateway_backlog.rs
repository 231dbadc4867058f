//! A backlog far larger than memory, in front of a slow worker: the gateway's memory stays
//! within its byte budget plus librdkafka's prefetch, because it pauses its partitions
//! (permits, in-flight records, held bytes) and resumes them as work drains; a SIGTERM still
//! ends it cleanly.

use std::time::{Duration, Instant};

use vramgate_tests::wav::{noise, write_wav, SampleFormat};
use vramgate_tests::{
    gateway_base_env,
    delete_topics, producer, request_inline, uncommitted_records, rss_bytes, scratch_dir, send_all, start_gateway, start_worker, unique,
    voice_task_env, worker_config, TaskTopics, VAD_MODEL,
};

const EVENTS: usize = 20_000;
const MIB: u64 = 1 << 20;
const MAX_HELD_BYTES: u64 = 16 * MIB;
const QUEUE_MAX_KBYTES: u64 = 4096;
/// Room for what is not a record's bytes and not librdkafka's queue: allocator slack,
/// thread stacks, HTTP and Kafka buffers.
const SLACK_BYTES: u64 = 48 * MIB;
const SAMPLE_FOR: Duration = Duration::from_secs(30);

/// 0.25 s of 16 kHz mono 16-bit noise as a WAV file's bytes (about 8 KB; 11 KB as base64 in
/// json).
fn clip(seed: u64) -> Vec<u8> {
    let path = std::env::temp_dir().join(format!("{}.wav", unique("backlog-clip")));
    write_wav(&path, &noise(4_000, 0.05, seed), 16_000, 1, SampleFormat::I16).expect("write wav");
    let bytes = std::fs::read(&path).expect("read wav");
    let _ = std::fs::remove_file(&path);
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_backlog_keeps_the_gateway_within_its_memory_bounds() {
    let topics = TaskTopics::create("backlog", 4).await.expect("topics");
    // A slow worker: one request at a time, no batching.
    let extra = "[admission]\nmode = \"count\"\nmax_concurrent = 1\n[batching]\nmax_batch_size = 1\n";
    let worker = start_worker(&worker_config(extra, &[VAD_MODEL])).await.expect("worker starts");

    // The whole backlog is in the topic before the gateway starts.
    let clips: Vec<Vec<u8>> = (0..8).map(clip).collect();
    let producer = producer();
    let started = Instant::now();
    let mut backlog_bytes = 0u64;
    for chunk in 0..EVENTS / 1000 {
        let records: Vec<(String, Vec<u8>)> = (chunk * 1000..(chunk + 1) * 1000)
            .map(|i| {
                let id = unique(&format!("b{i}"));
                let value = request_inline(&id, "voice", &clips[i % clips.len()]);
                (id, value)
            })
            .collect();
        backlog_bytes += records.iter().map(|(_, v)| v.len() as u64).sum::<u64>();
        send_all(&producer, &topics.requests, &records, 1000).await.expect("send");
    }
    eprintln!("backlog: {EVENTS} events, {} MiB, produced in {:?}", backlog_bytes / MIB, started.elapsed());
    assert!(backlog_bytes > 200 * MIB, "the backlog is only {backlog_bytes} bytes");

    let group = unique("gw");
    let mut env = gateway_base_env(&group, &worker.url, &scratch_dir("backlog"));
    env.extend([
        ("MAX_HELD_BYTES", MAX_HELD_BYTES.to_string()),
        ("MAX_IN_FLIGHT", "256".into()),
        ("KAFKA__QUEUE_MAX_KBYTES", QUEUE_MAX_KBYTES.to_string()),
        ("SHUTDOWN_TIMEOUT_SECONDS", "20".into()),
        ("TASKS__VOICE__GPU_PERMITS__INITIAL", "2".into()),
        ("TASKS__VOICE__GPU_PERMITS__MAX", "2".into()),
        ("TASKS__VOICE__PERMIT_WAIT_MS", "200".into()),
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
        ("TASKS__IMAGE__ENABLED", "false".into()),
    ]);
    env.extend(voice_task_env(&topics));
    let mut gateway = start_gateway(&env).await.expect("gateway starts");
    // Measured when the gateway reports its metrics address: before it has joined the group,
    // so before any record has arrived.
    let base_rss = rss_bytes(gateway.pid());
    let bound = base_rss + MAX_HELD_BYTES + 2 * QUEUE_MAX_KBYTES * 1024 + SLACK_BYTES;

    let name = |n: &str| format!("vramgate_gateway_{n}");
    let (mut max_rss, mut max_held, mut max_in_flight, mut max_paused) = (0u64, 0f64, 0f64, 0f64);
    let (mut pauses, mut resumes, mut first_produced, mut produced) = (0f64, 0f64, None, 0f64);
    let mut pauses_by_reason = Vec::new();
    let sampling = Instant::now();
    let mut next_print = Instant::now();
    while sampling.elapsed() < SAMPLE_FOR {
        assert!(gateway.service.is_running(), "the gateway exited; log:\n{}", gateway.log_tail());
        let rss = rss_bytes(gateway.pid());
        max_rss = max_rss.max(rss);
        let m = gateway.metrics().await.expect("metrics");
        let held = m.sum(&name("held_bytes"), &[]);
        let in_flight = m.sum(&name("records_in_flight"), &[]);
        let paused = m.sum(&name("paused_partitions"), &[]);
        max_held = max_held.max(held);
        max_in_flight = max_in_flight.max(in_flight);
        max_paused = max_paused.max(paused);
        pauses = m.sum(&name("partition_pauses_total"), &[]);
        resumes = m.sum(&name("partition_resumes_total"), &[]);
        produced = m.sum(&name("records_produced_total"), &[]);
        if produced > 0.0 && first_produced.is_none() {
            first_produced = Some(produced);
        }
        pauses_by_reason = ["permits", "budget", "in_flight"]
            .map(|r| (r, m.sum(&name("partition_pauses_total"), &[("reason", r)])))
            .to_vec();
        let limit = m.sum(&name("held_bytes_limit"), &[]);
        assert_eq!(limit, MAX_HELD_BYTES as f64, "held_bytes_limit is not MAX_HELD_BYTES:\n{}", m.text);
        if Instant::now() >= next_print {
            next_print += Duration::from_secs(1);
            eprintln!(
                "t={:>4.1}s rss {:>4} MiB, held {:>5.1} MiB, in flight {in_flight}, paused partitions {paused}, \
                 pauses {pauses} resumes {resumes}, produced {produced}",
                sampling.elapsed().as_secs_f64(),
                rss / MIB,
                held / MIB as f64,
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!(
        "backlog of {EVENTS} events ({} MiB): max RSS {} MiB (base {} MiB, bound {} MiB), max held {:.1} MiB, \
         max in flight {max_in_flight}, max paused partitions {max_paused}, pauses {pauses} {pauses_by_reason:?}, \
         resumes {resumes}, produced {produced} in {SAMPLE_FOR:?}",
        backlog_bytes / MIB,
        max_rss / MIB,
        base_rss / MIB,
        bound / MIB,
        max_held / MIB as f64
    );
    assert!(
        max_rss <= bound,
        "the gateway's RSS reached {max_rss} bytes, over {bound} (base {base_rss} + held {MAX_HELD_BYTES} + \
         2 x queue {} + slack {SLACK_BYTES}); log:\n{}",
        QUEUE_MAX_KBYTES * 1024,
        gateway.log_tail()
    );
    assert!(pauses > 0.0, "partitions were never paused with a backlog behind a slow worker");
    assert!(resumes > 0.0, "paused partitions were never resumed");
    assert!(
        first_produced.is_some_and(|first| produced > first),
        "records_produced_total did not grow: first {first_produced:?}, last {produced}; log:\n{}",
        gateway.log_tail()
    );

    // The lag gauge (librdkafka's statistics, at most 5 s old) has a series per partition, and
    // since the backlog only shrinks, it is never below the lag the broker reports now.
    let m = gateway.metrics().await.expect("metrics");
    let lag_name = name("consumer_lag_records");
    let lag = m.sum(&lag_name, &[]);
    let series = (0..4)
        .filter(|p| m.text.lines().any(|l| l.starts_with(&lag_name) && l.contains(&format!("partition=\"{p}\""))))
        .count();
    let behind = uncommitted_records(&group, &topics.requests).expect("committed offsets");
    eprintln!("consumer lag gauge {lag}, the group's lag now {behind}, {series} partitions with a series");
    assert_eq!(series, 4, "not every assigned partition has a lag series:\n{}", m.text);
    assert!(
        lag >= behind as f64 && lag <= EVENTS as f64,
        "consumer_lag_records {lag} is not between the group's lag now ({behind}) and the backlog ({EVENTS})"
    );

    // SIGTERM with hundreds of records held: they finish (or are left uncommitted) within the
    // shutdown timeout, and the exit is clean.
    let stopping = Instant::now();
    let status = gateway.service.terminate(Duration::from_secs(20 + 10)).await.expect("gateway stops");
    eprintln!("gateway stopped in {:?} with {status}", stopping.elapsed());
    assert!(status.success(), "gateway exited with {status}; log:\n{}", gateway.log_tail());
    drop(worker);
    if let Err(e) = delete_topics(&[&topics.requests, &topics.results, &topics.dlq]).await {
        eprintln!("could not delete the backlog's topics: {e:#}");
    }
}
