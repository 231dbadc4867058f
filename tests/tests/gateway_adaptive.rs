//! Adaptive GPU permits: two gateways in one group share a worker. While the worker is small
//! and answers 503 + Retry-After, each gateway's permit limit falls and throttled records are
//! retried; once the worker is restarted large on the same address, the limits grow back. No
//! event is lost or dead-lettered either way.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use vramgate_tests::wav::{compose, write_wav, SampleFormat};
use vramgate_tests::{
    gateway_base_env,
    producer, request_file, scratch_dir, send_all, start_gateway, start_worker, start_worker_on, unique,
    voice_task_env, wait_group_balanced, worker_config, Collector, Gateway, TaskTopics, VAD_MODEL,
};

const PERMITS_MAX: f64 = 8.0;
const PHASE_1_EVENTS: usize = 300;
const PHASE_2_EVENTS: usize = 600;

/// One admitted at a time, one waiting, 200 ms of waiting at most: two gateways with 8 permits
/// each are answered 503 + Retry-After most of the time.
const SMALL: &str =
    "[admission]\nmode = \"count\"\nmax_concurrent = 1\nmax_queued_requests = 1\nmax_queue_wait_ms = 200\n";
/// Room for everything both gateways may send.
const LARGE: &str =
    "[admission]\nmode = \"count\"\nmax_concurrent = 16\nmax_queued_requests = 256\nmax_queue_wait_ms = 30000\n";

fn events(root: &Path, phase: usize, count: usize) -> Vec<(String, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let id = unique(&format!("p{phase}-{i}"));
            let seconds = 0.5 + 0.5 * (i % 3) as f64;
            let clip = compose(None, seconds / 2.0, seconds / 2.0, 16_000, 1, (phase * 10_000 + i) as u64);
            let path = root.join(format!("p{phase}-{i}.wav"));
            write_wav(&path, &clip.samples, 16_000, 1, SampleFormat::I16).expect("write wav");
            let value = request_file(&id, "voice", &path);
            (id, value)
        })
        .collect()
}

/// Each gateway's `gpu_permit_limit{task="voice"}` over time, and its lowest and highest value.
struct Limits {
    seen: Vec<Vec<(f64, f64)>>,
    min: Vec<f64>,
    max: Vec<f64>,
}

impl Limits {
    fn new(gateways: usize) -> Self {
        Limits { seen: vec![Vec::new(); gateways], min: vec![f64::INFINITY; gateways], max: vec![0.0; gateways] }
    }

    async fn sample(&mut self, gateways: &[&Gateway], since: Instant) {
        for (i, gateway) in gateways.iter().enumerate() {
            let Ok(m) = gateway.metrics().await else { continue };
            if !m.has("vramgate_gateway_gpu_permit_limit") {
                continue;
            }
            let limit = m.sum("vramgate_gateway_gpu_permit_limit", &[("task", "voice")]);
            self.min[i] = self.min[i].min(limit);
            self.max[i] = self.max[i].max(limit);
            if self.seen[i].last().is_none_or(|(_, last)| *last != limit) {
                self.seen[i].push((since.elapsed().as_secs_f64(), limit));
            }
        }
    }

    fn print(&self, phase: &str) {
        for (i, seen) in self.seen.iter().enumerate() {
            let changes: Vec<String> = seen.iter().map(|(t, l)| format!("{t:.1}s:{l}")).collect();
            eprintln!(
                "{phase}, gateway {i}: limit min {} max {}; changes {}",
                self.min[i],
                self.max[i],
                changes.join(" ")
            );
        }
    }
}

/// Samples the limits every 100 ms until every id in `ids` has a record, or `timeout` passes
/// after `since`.
async fn run_phase(
    collector: &Collector,
    ids: &[String],
    gateways: &[&Gateway],
    limits: &mut Limits,
    since: Instant,
    timeout: Duration,
) -> bool {
    let wanted: HashSet<&String> = ids.iter().collect();
    loop {
        limits.sample(gateways, since).await;
        if collector.with(|got| wanted.iter().all(|id| got.contains_key(*id))) {
            return true;
        }
        if since.elapsed() > timeout {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn throttled(text: &str) -> f64 {
    vramgate_tests::metrics::sum(text, "vramgate_gateway_retries_total", &[("task", "voice"), ("reason", "throttled")])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_limits_fall_on_503s_and_grow_back_when_the_worker_has_room() {
    let topics = TaskTopics::create("adaptive", 4).await.expect("topics");
    let root = scratch_dir("adaptive");
    let small = worker_config(SMALL, &[VAD_MODEL]);
    let mut worker = start_worker(&small).await.expect("worker starts");
    let addr = worker.addr().to_string();
    let group = unique("gw");
    let mut env = gateway_base_env(&group, &worker.url, &root);
    env.extend([
        ("TASKS__VOICE__GPU_PERMITS__INITIAL", "8".into()),
        ("TASKS__VOICE__GPU_PERMITS__MIN", "1".into()),
        ("TASKS__VOICE__GPU_PERMITS__MAX", "8".into()),
        ("TASKS__VOICE__PERMIT_WAIT_MS", "500".into()),
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
        ("TASKS__IMAGE__ENABLED", "false".into()),
    ]);
    env.extend(voice_task_env(&topics));
    let a = start_gateway(&env).await.expect("gateway a starts");
    let b = start_gateway(&env).await.expect("gateway b starts");
    let balanced = wait_group_balanced(&group, 2, Duration::from_secs(90)).await;
    let balanced = balanced.unwrap_or_else(|e| panic!("{e:#}\nlog a:\n{}\nlog b:\n{}", a.log_tail(), b.log_tail()));
    eprintln!("group {group}: {:?}", balanced.members);
    let collector = Collector::start(&[&topics.results, &topics.dlq]).expect("collector");
    let producer = producer();
    let gateways = [&a, &b];

    // Phase 1: the small worker.
    let phase_1 = events(&root, 1, PHASE_1_EVENTS);
    let ids_1: Vec<String> = phase_1.iter().map(|(id, _)| id.clone()).collect();
    let started = Instant::now();
    let mut limits_1 = Limits::new(2);
    limits_1.sample(&gateways, started).await;
    send_all(&producer, &topics.requests, &phase_1, 256).await.expect("send");
    let done = run_phase(&collector, &ids_1, &gateways, &mut limits_1, started, Duration::from_secs(240)).await;
    limits_1.print("phase 1 (small worker)");
    let mut throttled_1 = Vec::new();
    for g in gateways {
        throttled_1.push(g.metrics().await.map(|m| throttled(&m.text)).unwrap_or(f64::NAN));
    }
    eprintln!(
        "phase 1: {PHASE_1_EVENTS} events in {:?}, throttled retries per gateway {throttled_1:?}",
        started.elapsed()
    );
    assert!(
        done,
        "phase 1 unfinished: {:?} (records, ids); log a:\n{}\nlog b:\n{}",
        collector.counts(),
        a.log_tail(),
        b.log_tail()
    );
    for (i, min) in limits_1.min.iter().enumerate() {
        assert!(
            *min < PERMITS_MAX,
            "gateway {i}'s permit limit never fell below {PERMITS_MAX} against a worker answering 503"
        );
    }
    assert!(throttled_1.iter().sum::<f64>() > 0.0, "no retries_total{{reason=\"throttled\"}} against a full worker");

    // Phase 2: the same address, a large worker.
    worker.service.kill().expect("stop the small worker");
    worker = start_worker_on(&worker_config(LARGE, &[VAD_MODEL]), &addr).await.expect("large worker starts");
    let phase_2 = events(&root, 2, PHASE_2_EVENTS);
    let ids_2: Vec<String> = phase_2.iter().map(|(id, _)| id.clone()).collect();
    let started = Instant::now();
    let mut limits_2 = Limits::new(2);
    limits_2.sample(&gateways, started).await;
    send_all(&producer, &topics.requests, &phase_2, 256).await.expect("send");
    let done = run_phase(&collector, &ids_2, &gateways, &mut limits_2, started, Duration::from_secs(240)).await;
    limits_2.print("phase 2 (large worker)");
    eprintln!("phase 2: {PHASE_2_EVENTS} events in {:?}", started.elapsed());
    assert!(
        done,
        "phase 2 unfinished: {:?} (records, ids); log a:\n{}\nlog b:\n{}",
        collector.counts(),
        a.log_tail(),
        b.log_tail()
    );
    for i in 0..2 {
        assert!(
            limits_2.max[i] > limits_1.min[i],
            "gateway {i}'s permit limit did not grow back: phase 1 minimum {}, phase 2 maximum {}",
            limits_1.min[i],
            limits_2.max[i]
        );
    }

    // Every event of both phases has a result; dead letters are printed, and fail the test.
    let records = collector.snapshot();
    let mut dead = Vec::new();
    for id in ids_1.iter().chain(&ids_2) {
        for r in records.get(id).into_iter().flatten() {
            if r.topic == topics.dlq {
                dead.push(format!(
                    "{id}: {} after {} attempts: {}",
                    r.value["error"]["kind"], r.value["attempts"], r.value["error"]["message"]
                ));
            }
        }
    }
    for line in &dead {
        eprintln!("dead letter {line}");
    }
    let without_result: Vec<&String> = ids_1
        .iter()
        .chain(&ids_2)
        .filter(|id| !records.get(*id).is_some_and(|rs| rs.iter().any(|r| r.topic == topics.results)))
        .collect();
    assert!(
        without_result.is_empty(),
        "{} events without a result ({} dead letters)",
        without_result.len(),
        dead.len()
    );
    drop(worker);
    // Kept when the test fails, for diagnosis.
    let _ = std::fs::remove_dir_all(&root);
}
