//! Scale-out and back while events flow: gateways of one group added and removed one at a time
//! (1 → 2 → 3 → 2 → 1) while voice events arrive at a steady rate, with either consumer group
//! protocol (`kafka.group_protocol`: `classic` with cooperative-sticky, or KIP-848's
//! `consumer`) and either delivery mode. Run by `tests/tests/gateway_scale_out.rs` (which
//! asserts what may be lost or doubled) and `tests/benches/scale_out.rs` (which prints the
//! pauses).
//!
//! The events are sent at [`SEND_RATE`]; a step starts every [`STEP_EVERY`] from the first output
//! on, once the one before is complete: a gateway joins (complete when its log says it was
//! assigned request partitions) or the newest leaves (SIGTERM: it drains, commits and leaves
//! the group; complete when it has exited). The pause a step causes is the longest time, from
//! its start to the next step's, in which no new output was read (sampled every 20 ms). In
//! exactly-once delivery outputs become visible a transaction at a time, so no gap is shorter
//! than about a commit interval.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::producer::FutureRecord;

use crate::chaos::{tally, Tally};
use crate::fleet::voice_event;
use crate::{
    gateway_base_env, producer, request_file, scratch_dir, start_gateway, start_worker, unique, voice_task_env, worker_config,
    Collector, Gateway, Isolation, TaskTopics, VAD_MODEL,
};

/// Request partitions: room for three gateways to hold two each.
pub const PARTITIONS: i32 = 6;
/// Distinct clips the events name (written once; the events take turns).
const CLIPS: usize = 40;
/// Events a second sent.
pub const SEND_RATE: f64 = 500.0;
/// From the first output, a step every this long (once the one before is complete).
pub const STEP_EVERY: Duration = Duration::from_secs(7);
/// How long a joining gateway may take to be assigned partitions.
const JOIN_WAIT: Duration = Duration::from_secs(90);

/// What one run saw.
#[derive(Debug)]
pub struct ScaleRun {
    pub tally: Tally,
    /// Each step (what it did) and the longest gap in outputs read after it.
    pub pauses: Vec<(String, Duration)>,
    pub wall: Duration,
    /// The gateways' `max_in_flight`: at-least-once duplicates are bounded by it per gateway
    /// removed.
    pub max_in_flight: usize,
    pub removed: usize,
    /// The last gateway's state at the end: a few gauges and counters, and its last warnings.
    pub state: String,
}

/// Runs `events` through gateways added and removed one at a time; `protocol`: `classic` or
/// `consumer`; `delivery`: `at-least-once` or `exactly-once`.
///
/// A step's gap is measured from the moment it starts, so it holds the step's own time (a
/// joining gateway's start-up is not a pause: the others go on meanwhile, and a gap shows only
/// where they did stop).
pub async fn scale_out(protocol: &str, delivery: &str, events: usize) -> anyhow::Result<ScaleRun> {
    let voice = TaskTopics::create(&format!("scale-{protocol}"), PARTITIONS).await?;
    let root = scratch_dir("scale");
    let worker = start_worker(&worker_config("", &[VAD_MODEL])).await?;
    let group = unique("gw");
    let max_in_flight = 256;
    let mut env = gateway_base_env(&group, &worker.url, &root);
    env.extend(voice_task_env(&voice));
    env.extend([
        ("KAFKA__GROUP_PROTOCOL", protocol.to_string()),
        ("DELIVERY", delivery.to_string()),
        ("MAX_IN_FLIGHT", max_in_flight.to_string()),
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
        ("TASKS__IMAGE__ENABLED", "false".into()),
        ("COMMIT_INTERVAL_MS", "100".into()),
    ]);
    // Short clips (0.5 s), written once, so the gateways and Kafka, not the model, set the pace.
    for i in 0..CLIPS {
        voice_event(&root, "template", i, 0.5);
    }
    let records: Vec<(String, Vec<u8>)> = (0..events)
        .map(|i| {
            let id = unique(&format!("s{i}"));
            let event = request_file(&id, "voice", &root.join(format!("clip-{}.wav", i % CLIPS)));
            (id, event)
        })
        .collect();
    let ids: Vec<String> = records.iter().map(|(id, _)| id.clone()).collect();
    let wanted: HashSet<String> = ids.iter().cloned().collect();
    let isolation = if delivery == "exactly-once" { Isolation::ReadCommitted } else { Isolation::ReadUncommitted };
    let collector = Arc::new(Collector::start_with(&[&voice.results, &voice.dlq], isolation)?);
    // The ids read, sampled every 20 ms by a task of its own (the steps below wait on gateways
    // starting and stopping; sampling between them would count those waits as gaps). The
    // topics are this run's alone: every id read is one of its events.
    let samples: Arc<Mutex<Vec<(Instant, usize)>>> = Arc::default();
    let sampler = {
        let (collector, samples) = (collector.clone(), samples.clone());
        tokio::spawn(async move {
            loop {
                let count = collector.counts().1;
                {
                    let mut s = samples.lock().unwrap_or_else(|p| p.into_inner());
                    if s.last().is_none_or(|(_, last)| *last != count) {
                        s.push((Instant::now(), count));
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let seen = |c: &Collector| c.with(|got| got.keys().filter(|id| wanted.contains(*id)).count());

    let gateway_env = |i: usize| {
        let mut env = env.clone();
        if delivery == "exactly-once" {
            env.push(("KAFKA__TRANSACTIONAL_ID", unique(&format!("scale-{i}"))));
        }
        env
    };
    let started = Instant::now();
    let mut gateways: Vec<Gateway> = vec![start_gateway(&gateway_env(0)).await?];
    let sender = {
        let requests = voice.requests.clone();
        tokio::spawn(async move {
            let producer = producer();
            let chunk = 50;
            let flow = Duration::from_secs_f64(records.len() as f64 / SEND_RATE);
            let every = flow.div_f64((records.len() / chunk).max(1) as f64);
            let begun = Instant::now();
            for (i, part) in records.chunks(chunk).enumerate() {
                let mut sends = Vec::with_capacity(part.len());
                for (id, event) in part {
                    let record = FutureRecord::to(&requests).key(id.as_str()).payload(event.as_slice());
                    sends.push(producer.send(record, Duration::from_secs(30)));
                }
                for sent in sends {
                    sent.await.map_err(|(e, _)| anyhow::anyhow!("send: {e}"))?;
                }
                let due = begun + every * (i as u32 + 1);
                tokio::time::sleep_until(due.into()).await;
            }
            anyhow::Ok(())
        })
    };
    let steps = ["join", "join", "leave", "leave"];
    // Each step: what it did and when it began.
    let mut done_steps: Vec<(String, Instant)> = Vec::new();
    let mut removed = 0;
    let deadline = started + Duration::from_secs(900);
    loop {
        let count = seen(&collector);
        let now = Instant::now();
        if count >= events && done_steps.len() >= steps.len() {
            break;
        }
        anyhow::ensure!(now < deadline, "{count} of {events} outputs after {:?}", started.elapsed());
        let first_output = samples.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|(_, c)| *c > 0).map(|(t, _)| *t);
        let step = done_steps.len();
        let step_due = first_output.map(|f| f + STEP_EVERY * (step as u32 + 1));
        if step < steps.len() && step_due.is_some_and(|due| now >= due) {
            let begun = Instant::now();
            let label = match steps[step] {
                "join" => {
                    let mut joining = start_gateway(&gateway_env(gateways.len() + removed)).await?;
                    let assigned = wait_assigned(&mut joining, &voice.requests).await;
                    anyhow::ensure!(assigned, "a joining gateway was not assigned partitions in {JOIN_WAIT:?}:\n{}", joining.log_tail());
                    gateways.push(joining);
                    format!("{} → {} gateways", gateways.len() - 1, gateways.len())
                }
                _ => {
                    let mut leaving = gateways.pop().expect("a gateway to remove");
                    let status = leaving.service.terminate(Duration::from_secs(60)).await?;
                    anyhow::ensure!(status.success(), "a removed gateway exited with {status}:\n{}", leaving.log_tail());
                    removed += 1;
                    format!("{} → {} gateways", gateways.len() + 1, gateways.len())
                }
            };
            eprintln!("{protocol}, {delivery}: {label} in {:?}, at {count} of {events} outputs ({:?})", begun.elapsed(), started.elapsed());
            done_steps.push((label, begun));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sender.await??;
    sampler.abort();
    let pauses = gaps(&samples.lock().unwrap_or_else(|p| p.into_inner()), &done_steps);
    let wall = started.elapsed();
    // Late duplicates, if any, have a moment to show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t = tally(&ids, &collector.snapshot(), &[&voice.dlq]);
    let mut state = String::new();
    if let Some(g) = gateways.first() {
        if let Ok(m) = g.metrics().await {
            for name in ["outputs_unverified", "outputs_verified_total", "held_bytes", "paused_partitions", "transactions_total", "records_consumed_total"] {
                state += &format!("{name} {} ", m.sum(&format!("vramgate_gateway_{name}"), &[]));
            }
        }
        state += &g.service.log_matching(&[" WARN ", " ERROR "], 8);
    }
    for mut g in gateways {
        let _ = g.service.terminate(Duration::from_secs(60)).await;
    }
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
    Ok(ScaleRun { tally: t, pauses, wall, max_in_flight, removed, state })
}

/// Waits until `gateway`'s log says it was assigned partitions of `topic` (a cooperative
/// protocol's first answer to a new member may be an empty assignment).
async fn wait_assigned(gateway: &mut Gateway, topic: &str) -> bool {
    let deadline = Instant::now() + JOIN_WAIT;
    while Instant::now() < deadline {
        let lines = gateway.service.log_matching(&["partitions assigned"], 50);
        if lines.lines().any(|l| l.contains(topic)) {
            return true;
        }
        if !gateway.service.is_running() {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// For each step, the longest time from its start to the next step's start (the last step: to
/// the last sample) in which the count of ids read did not move; `samples` are the moments it
/// moved.
fn gaps(samples: &[(Instant, usize)], steps: &[(String, Instant)]) -> Vec<(String, Duration)> {
    let end = samples.last().map(|(t, _)| *t);
    steps
        .iter()
        .enumerate()
        .map(|(i, (label, begun))| {
            let until = steps.get(i + 1).map(|(_, t)| *t).or(end).unwrap_or(*begun);
            // The moves in the window, with the last move before it as the start.
            let before = samples.iter().rev().find(|(t, _)| t <= begun).map_or(*begun, |(t, _)| *t);
            let mut last = before;
            let mut longest = Duration::ZERO;
            for (t, _) in samples.iter().filter(|(t, _)| t > begun && *t <= until) {
                longest = longest.max(*t - last);
                last = *t;
            }
            (label.clone(), longest)
        })
        .collect()
}
