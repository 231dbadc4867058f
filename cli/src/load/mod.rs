//! `vramgate-cli load`: a load generator for the whole pipeline. It sends request events to
//! the tasks' request topics at a target rate or as a burst (a count or a duration), from a
//! folder of inputs or generated ones with a size mix; tags every id with a run id; follows the
//! results and dead-letter topics until every sent event is accounted for (or a bounded
//! timeout passes); samples both services' `/metrics` into a CSV time series and a PNG plot;
//! and prints a table per task (throughput, end-to-end latency, dead letters by kind, lost,
//! duplicates), or JSON. Outputs are read with `isolation.level=read_committed` unless the Kafka
//! properties say otherwise ([`crate::outputs`]), so in exactly-once delivery the counts are of
//! committed outputs.
//!
//! Parts: `inputs` (what is sent), `kafka` (sending, following, lag), `tally` (the
//! accounting), `sample` (the time series), `plot` (the PNG), `report` (table and JSON).

mod inputs;
mod kafka;
mod plot;
mod report;
mod sample;
mod tally;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use inputs::{InputKind, Range};
use kafka::{Follower, Sender, TaskTopics};
use sample::Sampler;
use tally::Tally;

pub use kafka::Lag;
pub use plot::{write_panels, Panel, DEFAULT_FONT};
pub use sample::Series;

/// Most events one run may send.
pub const MAX_EVENTS: u64 = 1_000_000;
/// Longest a run may send for, and longest it may wait for outputs after its last send.
pub const MAX_SECONDS: f64 = 3600.0;
/// Highest target rate, events a second.
pub const MAX_RATE: f64 = 100_000.0;
/// Sampling interval bounds, ms.
pub const SAMPLE_MS_BOUNDS: (u64, u64) = (100, 60_000);
/// Most tasks one run may load.
const MAX_TASKS: usize = 16;
/// How long the end of a run waits for the gateway's group to commit what it read.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    /// A task to load (repeat, or comma-separate): `voice`, `image`, or NAME=wav|image for a task
    /// of the gateway's task table with that converter.
    #[arg(long = "task", value_delimiter = ',', default_value = "voice")]
    tasks: Vec<String>,
    /// TASK=BASE: the task's topics are BASE.requests, BASE.results, BASE.dlq (default: the
    /// task's name).
    #[arg(long = "topic-base")]
    topic_bases: Vec<String>,
    /// Events to send, all tasks together, round-robin over the tasks (≤ 1,000,000).
    #[arg(long, conflicts_with = "duration_seconds")]
    count: Option<u64>,
    /// Send for this many seconds instead of a count (≤ 3600).
    #[arg(long)]
    duration_seconds: Option<f64>,
    /// Events a second, all tasks together (≤ 100,000); without it, a burst: as fast as the
    /// broker acknowledges them.
    #[arg(long)]
    rate: Option<f64>,
    /// A folder of inputs to send (.wav for wav tasks; .png/.jpg/.jpeg/.webp for image tasks),
    /// each under the gateway's input.file_root; instead of generated inputs.
    #[arg(long)]
    inputs: Option<PathBuf>,
    /// Where generated inputs are written; it must be under the gateway's input.file_root.
    #[arg(long, default_value = "load-inputs")]
    generate_into: PathBuf,
    /// Distinct generated inputs per task (events reuse them), sizes spread over the ranges.
    #[arg(long, default_value_t = 16)]
    distinct: usize,
    /// Length range of generated clips, seconds: A-B.
    #[arg(long, default_value = "1-30")]
    voice_seconds: String,
    /// Range of the longer side of generated images, pixels: A-B.
    #[arg(long, default_value = "64-2048")]
    image_sides: String,
    /// Fraction of events that name an input file that does not exist (dead letters on purpose).
    #[arg(long, default_value_t = 0.0)]
    missing_fraction: f64,
    /// Stop waiting for outputs this many seconds after the last send (≤ 3600).
    #[arg(long, default_value_t = 300.0)]
    timeout_seconds: f64,
    /// The gateway's consumer group: its lag is sampled, and at the end the run waits (≤ 60 s)
    /// until the group has committed every request, so late duplicates are counted too.
    #[arg(long, default_value = "vramgate-gateway")]
    group: String,
    /// The gateway's metrics URL ("" to sample none).
    #[arg(long, default_value = "http://127.0.0.1:9464/metrics")]
    gateway_metrics: String,
    /// The worker's metrics URL ("" to sample none).
    #[arg(long, default_value = "http://127.0.0.1:8081/metrics")]
    worker_metrics: String,
    /// How often the services' metrics are sampled, ms (100–60,000).
    #[arg(long, default_value_t = 1000)]
    sample_ms: u64,
    /// Folder for the run's files: RUN.csv (time series), RUN.png (plot), RUN.json (summary).
    #[arg(long, default_value = "load-report")]
    out: PathBuf,
    /// TrueType font for the plot's text.
    #[arg(long, default_value = DEFAULT_FONT)]
    font: PathBuf,
    /// Print the summary as JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
    /// The run id every event id starts with (letters, digits, '-', '_'; ≤ 64); random by default.
    #[arg(long)]
    run_id: Option<String>,
}

/// One task of the run: its name, what it reads, its topics and its inputs.
struct TaskPlan {
    name: String,
    topics: TaskTopics,
    files: Vec<PathBuf>,
    /// A path in the inputs' folder that does not exist, for injected dead letters.
    missing: PathBuf,
}

fn check_args(args: &LoadArgs) -> anyhow::Result<()> {
    ensure!(args.count.is_some() || args.duration_seconds.is_some(), "say how much to send: --count N or --duration-seconds S");
    if let Some(count) = args.count {
        ensure!((1..=MAX_EVENTS).contains(&count), "--count must be 1–{MAX_EVENTS}");
    }
    if let Some(d) = args.duration_seconds {
        ensure!(d > 0.0 && d <= MAX_SECONDS, "--duration-seconds must be in (0, {MAX_SECONDS}]");
    }
    if let Some(rate) = args.rate {
        ensure!(rate > 0.0 && rate <= MAX_RATE, "--rate must be in (0, {MAX_RATE}]");
    }
    ensure!(args.timeout_seconds > 0.0 && args.timeout_seconds <= MAX_SECONDS, "--timeout-seconds must be in (0, {MAX_SECONDS}]");
    ensure!((0.0..=1.0).contains(&args.missing_fraction), "--missing-fraction must be in [0, 1]");
    ensure!(
        (SAMPLE_MS_BOUNDS.0..=SAMPLE_MS_BOUNDS.1).contains(&args.sample_ms),
        "--sample-ms must be {}–{}",
        SAMPLE_MS_BOUNDS.0,
        SAMPLE_MS_BOUNDS.1
    );
    ensure!((1..=MAX_TASKS).contains(&args.tasks.len()), "name 1–{MAX_TASKS} tasks");
    Ok(())
}

fn run_id(args: &LoadArgs) -> anyhow::Result<String> {
    let id = args.run_id.clone().unwrap_or_else(|| format!("load-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]));
    ensure!(
        !id.is_empty() && id.len() <= 64 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
        "--run-id {id:?}: use 1–64 letters, digits, '-' or '_'"
    );
    Ok(id)
}

fn plan_tasks(args: &LoadArgs, run: &str) -> anyhow::Result<Vec<TaskPlan>> {
    let mut plans = Vec::new();
    for spec in &args.tasks {
        let (name, kind) = match spec.split_once('=') {
            Some((name, kind)) => (name.to_string(), InputKind::parse(kind)?),
            None => match spec.as_str() {
                "voice" => (spec.clone(), InputKind::Wav),
                "image" => (spec.clone(), InputKind::Image),
                other => bail!("task {other:?}: say what it reads, as {other}=wav or {other}=image"),
            },
        };
        ensure!(plans.iter().all(|p: &TaskPlan| p.name != name), "task {name} named twice");
        let base = args
            .topic_bases
            .iter()
            .find_map(|b| b.strip_prefix(&format!("{name}=")))
            .map_or_else(|| name.clone(), str::to_string);
        let (files, folder) = match &args.inputs {
            Some(folder) => (inputs::from_folder(folder, kind)?, folder.clone()),
            None => {
                let (range, what, bounds) = match kind {
                    InputKind::Wav => (&args.voice_seconds, "--voice-seconds", inputs::VOICE_SECONDS_BOUNDS),
                    InputKind::Image => (&args.image_sides, "--image-sides", inputs::IMAGE_SIDE_BOUNDS),
                };
                let range = Range::parse(range, bounds, what)?;
                let folder = args.generate_into.join(&name);
                (inputs::generate(kind, &folder, args.distinct, range)?, folder)
            }
        };
        let missing = folder.canonicalize()?.join(format!("missing-{run}.{}", if kind == InputKind::Wav { "wav" } else { "jpg" }));
        plans.push(TaskPlan { name, topics: TaskTopics::new(&base), files, missing });
    }
    let names: Vec<&str> = args.topic_bases.iter().filter_map(|b| b.split_once('=').map(|(t, _)| t)).collect();
    for name in names {
        ensure!(plans.iter().any(|p| p.name == name), "--topic-base names task {name}, which is not loaded");
    }
    Ok(plans)
}

/// Runs a load against the brokers `connection` names; the summary goes to stdout, progress to stderr.
pub async fn run(connection: &vramgate_shared::kafka::Connection, args: LoadArgs) -> anyhow::Result<()> {
    check_args(&args)?;
    let run = run_id(&args)?;
    let plans = plan_tasks(&args, &run)?;
    let names: Vec<String> = plans.iter().map(|p| p.name.clone()).collect();
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;

    let tally = Arc::new(Mutex::new(Tally::new(&names)));
    let topics: Vec<(String, TaskTopics)> = plans.iter().map(|p| (p.name.clone(), p.topics.clone())).collect();
    let follower = Follower::start(connection, &topics, tally.clone()).await?;
    let sender = Sender::new(connection)?;

    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let url = |u: &str| (!u.is_empty()).then(|| u.to_string());
    let sampler = Sampler::new(url(&args.gateway_metrics), url(&args.worker_metrics), &names);
    let lag = Arc::new(kafka::Lag::new(connection, &args.group, topics.iter().map(|(_, t)| t.requests.clone()).collect())?);
    let sampling = tokio::spawn(sample_loop(sampler, lag.clone(), tally.clone(), stop.clone(), started, args.sample_ms));
    let expected = match (args.count, args.duration_seconds, args.rate) {
        (Some(count), _, _) => Some(count),
        (None, Some(d), Some(rate)) => Some((d * rate).ceil() as u64),
        _ => None,
    };
    let progress = tokio::spawn(progress_loop(tally.clone(), stop.clone(), expected));

    let mut send_failures = 0u64;
    let mut sent = 0u64;
    let limit = args.count.unwrap_or(MAX_EVENTS);
    let until = args.duration_seconds.map(|d| started + Duration::from_secs_f64(d));
    let mut pending = futures::stream::FuturesUnordered::new();
    use futures::StreamExt as _;
    while sent < limit && until.is_none_or(|u| Instant::now() < u) {
        if let Some(rate) = args.rate {
            let at = started + Duration::from_secs_f64(sent as f64 / rate);
            // An event due at the end of the duration or later is not sent: S s at R/s is S × R events.
            if until.is_some_and(|u| at >= u) {
                break;
            }
            tokio::time::sleep_until(at.into()).await;
        }
        if pending.len() >= kafka::MAX_SENDS_IN_FLIGHT {
            if let Some(done) = pending.next().await {
                send_failures += u64::from(!matches!(done, Ok(Ok(()))));
            }
        }
        let plan = &plans[(sent % plans.len() as u64) as usize];
        let i = sent / plans.len() as u64;
        let id = format!("{run}-{}-{i}", plan.name);
        let path = if mix(sent, 1) < args.missing_fraction {
            &plan.missing
        } else {
            &plan.files[(mix(sent, 2) * plan.files.len() as f64) as usize % plan.files.len()]
        };
        let now_ms = kafka::now_ms();
        tally.lock().unwrap_or_else(|p| p.into_inner()).sent(&plan.name, &id, now_ms);
        // Spawned, so that the event goes to the broker now: a future left in `pending` would run
        // only when the loop next polls it, which with a rate is after the last event.
        pending.push(tokio::spawn(sender.send(plan.topics.requests.clone(), plan.name.clone(), id, path.clone(), now_ms, tally.clone())));
        sent += 1;
    }
    while let Some(done) = pending.next().await {
        send_failures += u64::from(!matches!(done, Ok(Ok(()))));
    }
    let sending_took = started.elapsed();

    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout_seconds);
    while tally.lock().unwrap_or_else(|p| p.into_inner()).outstanding() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let all_back = tally.lock().unwrap_or_else(|p| p.into_inner()).outstanding() == 0;
    // Outputs a crashed gateway's successor writes again can come after every id was seen once:
    // wait until the group committed every request (so every output it will write is written),
    // then read the output topics to their ends.
    let settled = all_back && settle(&lag, &follower, &topics, connection).await?;
    stop.store(true, Ordering::Relaxed);
    let sampler = sampling.await.context("the sampling task failed")?;
    let _ = progress.await;
    follower.stop();

    let summaries = tally.lock().unwrap_or_else(|p| p.into_inner()).summaries();
    let files = report::Files::new(&args.out, &run);
    std::fs::write(&files.csv, sampler.series.to_csv()).with_context(|| format!("writing {}", files.csv.display()))?;
    let plotted = plot::write_png(&sampler.series, &files.png, &args.font);
    let summary = report::Summary {
        run_id: run.clone(),
        sending_seconds: sending_took.as_secs_f64(),
        elapsed_seconds: started.elapsed().as_secs_f64(),
        send_failures,
        settled,
        isolation_level: crate::outputs::effective_isolation(connection),
        samples: sampler.series.rows.len(),
        csv: files.csv.display().to_string(),
        png: plotted.as_ref().ok().map(|_| files.png.display().to_string()),
        tasks: summaries,
    };
    std::fs::write(&files.json, serde_json::to_vec_pretty(&summary)?)
        .with_context(|| format!("writing {}", files.json.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{}", report::table(&summary));
    }
    plotted.context("the plot was not written")?;
    let lost: u64 = summary.tasks.iter().map(|t| t.lost).sum();
    ensure!(lost == 0, "{lost} events sent and never accounted for within {} s", args.timeout_seconds);
    Ok(())
}

/// Waits (≤ [`SETTLE_TIMEOUT`]) until the gateway's group has committed every request, then
/// until the follower has read the output topics to where they end now. False if either did
/// not happen in time (a group that is not the gateway's never commits).
async fn settle(lag: &kafka::Lag, follower: &Follower, topics: &[(String, TaskTopics)], connection: &vramgate_shared::kafka::Connection) -> anyhow::Result<bool> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        let total = lag.blocking_total().await;
        if matches!(total, Ok(0)) {
            break;
        }
        if Instant::now() > deadline {
            // Which of the two did not come: said, so that a run that did not settle tells why.
            let total = match total {
                Ok(n) => n.to_string(),
                Err(e) => format!("unknown (the query failed: {e:#})"),
            };
            eprintln!("load: not settled: the group's committed offsets still {total} records behind the requests after {SETTLE_TIMEOUT:?}");
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let ends = kafka::output_ends(connection, topics).await?;
    while !follower.reached(&ends) {
        if Instant::now() > deadline {
            eprintln!("load: not settled: the outputs not read to their ends ({} partitions) after {SETTLE_TIMEOUT:?}", ends.len());
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(true)
}

/// A number in [0, 1) from an event's sequence number and a stream: which input it takes and
/// whether it is an injected dead letter (a hash, so the mix does not follow the task order).
fn mix(n: u64, stream: u64) -> f64 {
    let mut x = n.wrapping_add(stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

async fn sample_loop(
    mut sampler: Sampler,
    lag: Arc<kafka::Lag>,
    tally: Arc<Mutex<Tally>>,
    stop: Arc<AtomicBool>,
    started: Instant,
    every_ms: u64,
) -> Sampler {
    let mut tick = tokio::time::interval(Duration::from_millis(every_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let last = stop.load(Ordering::Relaxed);
        let lag = lag.blocking_total().await.ok();
        let totals = tally.lock().unwrap_or_else(|p| p.into_inner()).totals();
        if !sampler.sample(started.elapsed().as_secs_f64(), totals, lag).await {
            eprintln!("load: the time series reached {} rows; sampling stopped", sample::MAX_ROWS);
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            return sampler;
        }
        if last {
            return sampler;
        }
    }
}

async fn progress_loop(tally: Arc<Mutex<Tally>>, stop: Arc<AtomicBool>, expected: Option<u64>) {
    let target = if std::io::stderr().is_terminal() { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
    let bars = MultiProgress::with_draw_target(target);
    let style = ProgressStyle::with_template("{prefix:>14} [{bar:40}] {pos:>8}/{len:8} {msg:>10} eta {eta}")
        .expect("a valid progress template")
        .progress_chars("=> ");
    let bar = |name: &str| {
        let b = bars.add(ProgressBar::new(expected.unwrap_or(0)));
        b.set_style(style.clone());
        b.set_prefix(name.to_string());
        b
    };
    let (sent_bar, done_bar, dead_bar) = (bar("sent"), bar("done"), bar("dead-lettered"));
    let started = Instant::now();
    loop {
        let (sent, results, dead) = tally.lock().unwrap_or_else(|p| p.into_inner()).totals();
        let total = expected.unwrap_or(0).max(sent);
        let seconds = started.elapsed().as_secs_f64().max(1e-3);
        for (b, at) in [(&sent_bar, sent), (&done_bar, results + dead), (&dead_bar, dead)] {
            b.set_length(total);
            b.set_position(at);
            b.set_message(format!("{:.1}/s", at as f64 / seconds));
        }
        if stop.load(Ordering::Relaxed) {
            // `abandon`, not `finish`: finishing would draw every bar as complete.
            for b in [&sent_bar, &done_bar, &dead_bar] {
                b.abandon();
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_is_uniform_enough_to_inject_a_fraction() {
        let n = 100_000;
        let below = (0..n).filter(|&i| mix(i, 1) < 0.1).count();
        assert!((9_000..11_000).contains(&below), "{below} of {n} below 0.1");
        let streams_differ = (0..1000).filter(|&i| (mix(i, 1) < 0.5) != (mix(i, 2) < 0.5)).count();
        assert!(streams_differ > 400, "the two streams are independent: {streams_differ}");
    }
}
