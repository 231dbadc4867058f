//! Delivery modes: what exactly-once delivery costs against at-least-once on the P2 pipeline
//! (requests naming a PNG or WAV file, through Kafka, the gateway with its defaults and the real
//! worker, results back to Kafka; `vramgate_tests::bench::throughput`, P2). Each round runs the
//! same work once per mode, each in a fresh gateway on fresh topics: at-least-once (the
//! default), then exactly-once with `commit_interval_ms` 50, 200 (the default) and 1000; odd
//! rounds run them in the reverse order, so drift on a shared machine falls on every mode
//! alike. Figures only; nothing is asserted about speed.
//!
//! Each run has two phases in one gateway process:
//!
//! - **Throughput**: a backlog of events is in the requests topic before the gateway starts.
//!   Two rates, both from the gateway's first consumed record: `done/s` to the moment every
//!   record is finished (the count of `vramgate_gateway_record_seconds`: output acknowledged in
//!   at-least-once, output in the outbox in exactly-once), the rate the gateway sustains; and
//!   `read/s` to the last output read by a `read_committed` consumer (what the gateway's users
//!   read), which in exactly-once delivery also holds the last transaction's wait, up to one
//!   commit interval plus a commit, once per backlog. Over the `read/s` span, from the
//!   gateway's metrics: commits a second (committed transactions,
//!   `vramgate_gateway_transactions_total{outcome="committed"}`, in exactly-once delivery;
//!   offset commits in at-least-once), a commit's mean time (`offset_commit_seconds`, which
//!   times a whole transaction in exactly-once delivery) and outputs per transaction.
//! - **Latency**: events sent one by one at a steady rate below capacity; each one's end-to-end
//!   latency is from its send to its output read (`read_committed`), by the same process's
//!   clock; p50 and p99 of the run. The first [`SETTLE`] events are sent and read but left
//!   out: in at-least-once delivery the first event after the backlog took 0.2–0.8 s where
//!   the others took tens of ms, a transient of the backlog's end rather than the steady state
//!   (stderr shows it as `first`). The rate is the same for every mode of a case: a fraction
//!   of the `done/s` of an untimed at-least-once run made first (which also warms the broker,
//!   the worker and the page cache up).
//!
//! Printed: a line per run on stderr while it runs, then one table of the medians over the
//! rounds, with each throughput's ratio to the at-least-once one of the same round (the median
//! over rounds, and each round's for `done/s`).
//!
//! Knobs (environment):
//! - `VRAMGATE_BENCH_P2_INPUTS` (default `320x320,5s`: P-Net on a 320×320 image and Silero VAD
//!   on a 5 s clip, as P2; `5s` for the voice model alone).
//! - `VRAMGATE_BENCH_DELIVERY_EVENTS` (default 300): the backlog of each run.
//! - `VRAMGATE_BENCH_DELIVERY_LATENCY_EVENTS` (default 100): events sent at the steady rate.
//! - `VRAMGATE_BENCH_DELIVERY_LOAD` (default 0.5): that rate, as a fraction of the warm-up
//!   run's throughput; `VRAMGATE_BENCH_DELIVERY_RATE` (events/s) sets it outright.
//! - `VRAMGATE_BENCH_DELIVERY_INTERVALS` (default `50,200,200-unverified,1000`): the
//!   exactly-once commit intervals, in ms; `-unverified` runs that interval with
//!   `kafka.verify_outputs = false`, so its ratio to the same interval verified is what reading
//!   every committed output back costs (`api-gateway/src/consume/verify.rs`).
//! - `VRAMGATE_BENCH_ROUNDS` (default 2).
//!
//! The defaults take about 5 minutes on 2 CPU cores. Run with `scripts/bench delivery`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use vramgate_tests::bench::median;
use vramgate_tests::bench::throughput::{p2_cases, p2_gateway_env, p2_input, start_p2_gateway, PARTITIONS};
use vramgate_tests::ceiling::{self, CeilingCase};
use vramgate_tests::metrics::Scrape;
use vramgate_tests::{
    brokers, delete_topics, env_or, producer, request_file, scratch_dir, send_all, unique, TaskTopics,
};

/// How the gateway delivers.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    AtLeastOnce,
    /// With this `commit_interval_ms`.
    /// With this `commit_interval_ms`, and whether committed outputs are read back.
    ExactlyOnce(u64, bool),
}

impl Mode {
    fn label(self) -> String {
        match self {
            Mode::AtLeastOnce => "at-least-once".into(),
            Mode::ExactlyOnce(ms, true) => format!("exactly-once, {ms} ms"),
            Mode::ExactlyOnce(ms, false) => format!("exactly-once, {ms} ms, unverified"),
        }
    }

    /// The gateway overrides that select the mode (at-least-once: none, the defaults).
    fn env(self) -> Vec<(&'static str, String)> {
        match self {
            Mode::AtLeastOnce => Vec::new(),
            Mode::ExactlyOnce(ms, verify) => vec![
                ("DELIVERY", "exactly-once".into()),
                // One per gateway process: two live gateways with one id would fence each other.
                ("KAFKA__TRANSACTIONAL_ID", unique("bench-tx")),
                ("COMMIT_INTERVAL_MS", ms.to_string()),
                ("KAFKA__VERIFY_OUTPUTS", verify.to_string()),
            ],
        }
    }
}

/// One run's figures.
#[derive(Debug, Clone, Copy)]
struct Run {
    /// Events a second under the backlog: to the last record finished, and to the last output
    /// read.
    done: f64,
    throughput: f64,
    /// Commits a second under the backlog (transactions, or offset commits), a commit's mean
    /// ms, and outputs per committed transaction (exactly-once only, else NaN).
    commits_per_s: f64,
    commit_ms: f64,
    outputs_per_tx: f64,
    /// End-to-end latency at the steady rate, in ms: p50, p99, the first event's and the
    /// largest (NaN when no latency phase ran).
    p50_ms: f64,
    p99_ms: f64,
    first_ms: f64,
    max_ms: f64,
    /// Outputs read twice, dead letters read, transactions not committed (aborted, fenced,
    /// failed).
    duplicates: usize,
    dead_letters: usize,
    not_committed: f64,
}

/// Steady-rate events sent first and left out of the latency figures.
const SETTLE: usize = 10;

/// By output id: when it was first read, and how often.
type Seen = Arc<Mutex<HashMap<String, (Instant, usize)>>>;

/// A `read_committed` consumer of a run's results and dead-letter topics, on its own thread:
/// when each output id was first read, and how often.
struct Reader {
    seen: Seen,
    dead_letters: Arc<Mutex<usize>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
}

impl Reader {
    fn start(topics: &TaskTopics) -> anyhow::Result<Self> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", unique("bench-delivery-reader"))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            // An idle fetch waits at most this long on the broker, so a read is timed to a
            // few ms whatever wakes the broker's fetch.
            .set("fetch.wait.max.ms", "10")
            .create()?;
        let mut tpl = TopicPartitionList::new();
        for topic in [&topics.results, &topics.dlq] {
            for p in 0..PARTITIONS {
                tpl.add_partition_offset(topic, p, Offset::Beginning)?;
            }
        }
        consumer.assign(&tpl)?;
        let seen: Seen = Arc::default();
        let (dead_letters, stop) = (Arc::new(Mutex::new(0)), Arc::new(AtomicBool::new(false)));
        let thread = {
            let (seen, dead_letters, stop) = (Arc::clone(&seen), Arc::clone(&dead_letters), Arc::clone(&stop));
            let dlq = topics.dlq.clone();
            std::thread::spawn(move || -> anyhow::Result<()> {
                while !stop.load(Ordering::Relaxed) {
                    let message = match consumer.poll(Duration::from_millis(50)) {
                        Some(Ok(message)) => message,
                        Some(Err(e)) => anyhow::bail!("reading the outputs: {e}"),
                        None => continue,
                    };
                    let at = Instant::now();
                    if message.topic() == dlq {
                        *dead_letters.lock().expect("reader lock") += 1;
                        continue;
                    }
                    let value: serde_json::Value = serde_json::from_slice(message.payload().unwrap_or(b"null"))
                        .context("a result is not json")?;
                    let id = value.get("id").and_then(|v| v.as_str()).unwrap_or_default().to_string();
                    seen.lock().expect("reader lock").entry(id).or_insert((at, 0)).1 += 1;
                }
                Ok(())
            })
        };
        Ok(Reader { seen, dead_letters, stop, thread: Some(thread) })
    }

    /// When each of `ids` was first read, once all of them have been; an error past `limit` or
    /// when the reader failed.
    async fn wait_for(&mut self, ids: &[String], limit: Duration) -> anyhow::Result<Vec<Instant>> {
        let deadline = Instant::now() + limit;
        loop {
            {
                let seen = self.seen.lock().expect("reader lock");
                let read: Option<Vec<Instant>> = ids.iter().map(|id| seen.get(id).map(|(at, _)| *at)).collect();
                if let Some(read) = read {
                    return Ok(read);
                }
                let missing = ids.iter().filter(|id| !seen.contains_key(*id)).count();
                anyhow::ensure!(Instant::now() < deadline, "{missing} of {} outputs not read after {limit:?}", ids.len());
            }
            if self.thread.as_ref().is_some_and(JoinHandle::is_finished) {
                let thread = self.thread.take().expect("checked above");
                thread.join().map_err(|_| anyhow::anyhow!("the reader panicked"))??;
                anyhow::bail!("the reader stopped");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn duplicates(&self) -> usize {
        self.seen.lock().expect("reader lock").values().map(|(_, n)| n.saturating_sub(1)).sum()
    }

    fn dead_letters(&self) -> usize {
        *self.dead_letters.lock().expect("reader lock")
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A case's input, written once.
struct Input {
    root: PathBuf,
    task: &'static str,
    file: PathBuf,
}

fn requests(input: &Input, prefix: &str, count: usize) -> Vec<(String, Vec<u8>)> {
    (0..count).map(|i| format!("{prefix}-{i}")).map(|id| (id.clone(), request_file(&id, input.task, &input.file))).collect()
}

fn committed(scrape: &Scrape, mode: Mode) -> f64 {
    match mode {
        Mode::AtLeastOnce => scrape.sum("vramgate_gateway_offset_commits_total", &[("result", "ok")]),
        Mode::ExactlyOnce(..) => scrape.sum("vramgate_gateway_transactions_total", &[("outcome", "committed")]),
    }
}

/// The `q` quantile of sorted `v` (nearest rank).
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = (q * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}


/// The producer of the steady-rate events, one for the whole bench: no idempotence (so no
/// producer id to fetch) and no linger, so that a send leaves at once.
fn steady_producer() -> anyhow::Result<FutureProducer> {
    Ok(ClientConfig::new().set("bootstrap.servers", brokers()).set("linger.ms", "0").create()?)
}

/// One run: a fresh gateway in `mode` on fresh topics; the backlog, then (`latency`: how many,
/// at what rate) the steady-rate events, sent by `sender`.
async fn run(
    case: &CeilingCase,
    input: &Input,
    worker_url: &str,
    mode: Mode,
    backlog: usize,
    latency: Option<(usize, f64)>,
    sender: &FutureProducer,
) -> anyhow::Result<Run> {
    let topics = TaskTopics::create("bench-delivery", PARTITIONS).await?;
    let queued = requests(input, "b", backlog);
    send_all(&producer(), &topics.requests, &queued, 500).await?;
    let mut reader = Reader::start(&topics)?;
    let mut env = p2_gateway_env(case, &topics, &unique("bench-delivery"), worker_url, &input.root);
    env.extend(mode.env());
    let gateway = start_p2_gateway(case, &env, &input.root).await?;

    // Throughput: from the first consumed record to the last output read.
    let limit = Duration::from_secs(600);
    let deadline = Instant::now() + limit;
    let (started, before) = loop {
        let scrape = gateway.metrics().await?;
        if scrape.sum("vramgate_gateway_records_consumed_total", &[]) > 0.0 {
            break (Instant::now(), scrape);
        }
        anyhow::ensure!(Instant::now() < deadline, "the gateway consumed nothing; log:\n{}", gateway.log_tail());
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let finished = loop {
        let scrape = gateway.metrics().await?;
        if scrape.sum("vramgate_gateway_record_seconds_count", &[]) >= backlog as f64 {
            break Instant::now();
        }
        anyhow::ensure!(Instant::now() < deadline, "the backlog did not finish; log:\n{}", gateway.log_tail());
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let ids: Vec<String> = queued.into_iter().map(|(id, _)| id).collect();
    let read = reader.wait_for(&ids, limit).await.with_context(|| format!("the backlog; log:\n{}", gateway.log_tail()))?;
    let last = read.into_iter().max().expect("a backlog of one event or more");
    let elapsed = last.saturating_duration_since(started).as_secs_f64();
    let after = gateway.metrics().await?;
    let commits = committed(&after, mode) - committed(&before, mode);
    let delta = |name: &str| after.sum(name, &[]) - before.sum(name, &[]);
    let commit_ms = delta("vramgate_gateway_offset_commit_seconds_sum")
        / delta("vramgate_gateway_offset_commit_seconds_count")
        * 1000.0;
    let tx_outputs = delta("vramgate_gateway_transaction_outputs_total");
    let outputs_per_tx = match mode {
        Mode::ExactlyOnce(..) if commits > 0.0 => tx_outputs / commits,
        _ => f64::NAN,
    };

    // Latency: events sent one at a time at `rate`, each timed from its send to its output read.
    let (mut p50_ms, mut p99_ms, mut first_ms, mut max_ms) = (f64::NAN, f64::NAN, f64::NAN, f64::NAN);
    if let Some((count, rate)) = latency {
        let steady = requests(input, "l", SETTLE + count);
        // The topic's partitions known before the first send, so that it does not wait for them.
        let (client, topic) = (sender.clone(), topics.requests.clone());
        tokio::task::spawn_blocking(move || client.client().fetch_metadata(Some(&topic), Duration::from_secs(10)))
            .await?
            .context("the requests topic's metadata")?;
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        let mut sent = Vec::with_capacity(count);
        let mut acks = Vec::with_capacity(count);
        for (id, value) in &steady {
            tick.tick().await;
            sent.push(Instant::now());
            let record = FutureRecord::to(&topics.requests).key(id).payload(value);
            acks.push(sender.send_result(record).map_err(|(e, _)| anyhow::anyhow!("sending {id}: {e}"))?);
        }
        for ack in acks {
            ack.await.context("the producer went away")?.map_err(|(e, _)| anyhow::anyhow!("sending an event: {e}"))?;
        }
        let ids: Vec<String> = steady.into_iter().map(|(id, _)| id).collect();
        let read = reader
            .wait_for(&ids, limit)
            .await
            .with_context(|| format!("the steady events; log:\n{}", gateway.log_tail()))?;
        let mut ms: Vec<f64> =
            read.iter().zip(&sent).map(|(r, s)| r.saturating_duration_since(*s).as_secs_f64() * 1000.0).collect();
        first_ms = ms[0];
        let mut ms = ms.split_off(SETTLE.min(ms.len()));
        ms.sort_by(f64::total_cmp);
        (p50_ms, p99_ms, max_ms) = (quantile(&ms, 0.5), quantile(&ms, 0.99), ms[ms.len() - 1]);
    }

    let end = gateway.metrics().await?;
    let not_committed = end.sum("vramgate_gateway_transactions_total", &[])
        - end.sum("vramgate_gateway_transactions_total", &[("outcome", "committed")]);
    let figures = Run {
        done: backlog as f64 / finished.saturating_duration_since(started).as_secs_f64(),
        throughput: backlog as f64 / elapsed,
        commits_per_s: commits / elapsed,
        commit_ms,
        outputs_per_tx,
        p50_ms,
        p99_ms,
        first_ms,
        max_ms,
        duplicates: reader.duplicates(),
        dead_letters: reader.dead_letters(),
        not_committed,
    };
    drop(gateway);
    drop(reader);
    let _ = delete_topics(&[&topics.requests, &topics.results, &topics.dlq]).await;
    Ok(figures)
}

/// One table line: case and mode, then the figures, right-aligned.
fn line(case: &str, mode: &str, figures: &[String], rounds: &str) {
    let widths = [7, 6, 7, 6, 7, 7, 9, 9, 10];
    let figures: Vec<String> = figures.iter().zip(widths).map(|(f, w)| format!("{f:>w$}")).collect();
    println!("{case:<20} {mode:<21} {}  {rounds}", figures.join(" "));
}

fn figure(x: f64, decimals: usize) -> String {
    if x.is_nan() { "-".into() } else { format!("{x:.decimals$}") }
}

/// A case's runs, by mode in the order of `modes`, one per round.
struct CaseResult {
    label: String,
    rate: f64,
    runs: Vec<Vec<Run>>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let backlog: usize = env_or("VRAMGATE_BENCH_DELIVERY_EVENTS", 300).max(1);
    let latency_events: usize = env_or("VRAMGATE_BENCH_DELIVERY_LATENCY_EVENTS", 100);
    let load: f64 = env_or("VRAMGATE_BENCH_DELIVERY_LOAD", 0.5);
    let fixed_rate: Option<f64> = std::env::var("VRAMGATE_BENCH_DELIVERY_RATE").ok().and_then(|v| v.parse().ok());
    let rounds: usize = env_or("VRAMGATE_BENCH_ROUNDS", 2).max(1);
    let intervals = std::env::var("VRAMGATE_BENCH_DELIVERY_INTERVALS").unwrap_or_else(|_| "50,200,200-unverified,1000".into());
    let mut modes = vec![Mode::AtLeastOnce];
    for ms in intervals.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (ms, verify) = match ms.strip_suffix("-unverified") {
            Some(ms) => (ms, false),
            None => (ms, true),
        };
        modes.push(Mode::ExactlyOnce(ms.parse().with_context(|| format!("commit interval '{ms}'"))?, verify));
    }

    let cases = p2_cases()?;
    let options = ceiling::CeilingOptions { cases: cases.clone(), ..ceiling::CeilingOptions::from_env() };
    let worker = ceiling::start_ceiling_worker(&options).await?;
    let producer = steady_producer()?;
    let mut results = Vec::new();
    for case in &cases {
        let label = format!("{} {}", case.model.name(), case.label);
        let root = scratch_dir("bench-delivery");
        let (task, file) = p2_input(case, &root)?;
        let input = Input { root: root.clone(), task, file };
        let warm = run(case, &input, &worker.url, Mode::AtLeastOnce, backlog, None, &producer).await?;
        let rate = fixed_rate.unwrap_or(warm.done * load).max(0.1);
        eprintln!("{label}: warm-up (untimed) {:.1} events/s done; latency measured at {rate:.1} events/s", warm.done);
        let mut runs: Vec<Vec<Run>> = vec![Vec::new(); modes.len()];
        for round in 0..rounds {
            let order: Vec<usize> =
                if round % 2 == 0 { (0..modes.len()).collect() } else { (0..modes.len()).rev().collect() };
            for i in order {
                let latency = (latency_events > 0).then_some((latency_events, rate));
                let r = run(case, &input, &worker.url, modes[i], backlog, latency, &producer).await?;
                eprintln!(
                    "{label} round {round}, {}: {:.1} events/s done, {:.1} read, p50 {:.0} ms, p99 {:.0} ms \
                     (first {:.0}, max {:.0}), \
                     {:.1} commits/s of {:.0} ms, {} duplicates, {} dead letters, {} transactions not committed",
                    modes[i].label(),
                    r.done,
                    r.throughput,
                    r.p50_ms,
                    r.p99_ms,
                    r.first_ms,
                    r.max_ms,
                    r.commits_per_s,
                    r.commit_ms,
                    r.duplicates,
                    r.dead_letters,
                    r.not_committed
                );
                runs[i].push(r);
            }
        }
        let _ = std::fs::remove_dir_all(&root);
        results.push(CaseResult { label, rate, runs });
    }

    println!();
    println!(
        "Delivery modes, the P2 pipeline through Kafka; medians of {rounds} rounds, {} CPU cores; {backlog} backlog events \
         a run, {latency_events} more at a steady rate for latency",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "events/s under the backlog: done/s to every record finished, read/s to every output read (read_committed); \
         / ALO: to at-least-once in the same round"
    );
    println!(
        "commits under the backlog: offset commits (at-least-once) or committed transactions (exactly-once), a second \
         and their mean ms; p50/p99: end to end, send to output read, at a steady rate"
    );
    let head = ["done/s", "/ ALO", "read/s", "/ ALO", "p50 ms", "p99 ms", "commits/s", "commit ms", "outputs/tx"];
    line("case", "mode", &head.map(String::from), "done/s / ALO by round");
    let (mut duplicates, mut dead_letters, mut not_committed) = (0, 0, 0.0);
    for case in &results {
        let baseline = &case.runs[0];
        for (mode, runs) in modes.iter().zip(&case.runs) {
            let of = |f: fn(&Run) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
            let ratio = |f: fn(&Run) -> f64| -> Vec<f64> { runs.iter().zip(baseline).map(|(r, b)| f(r) / f(b)).collect() };
            let done_ratios = ratio(|r| r.done);
            let by_round = done_ratios.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>().join(", ");
            let figures = [
                figure(of(|r| r.done), 1),
                figure(median(&done_ratios), 3),
                figure(of(|r| r.throughput), 1),
                figure(median(&ratio(|r| r.throughput)), 3),
                figure(of(|r| r.p50_ms), 0),
                figure(of(|r| r.p99_ms), 0),
                figure(of(|r| r.commits_per_s), 1),
                figure(of(|r| r.commit_ms), 0),
                figure(of(|r| r.outputs_per_tx), 1),
            ];
            line(&case.label, &mode.label(), &figures, &by_round);
            duplicates += runs.iter().map(|r| r.duplicates).sum::<usize>();
            dead_letters += runs.iter().map(|r| r.dead_letters).sum::<usize>();
            not_committed += runs.iter().map(|r| r.not_committed).sum::<f64>();
        }
        println!("{:<20} (latency at {:.1} events/s)", "", case.rate);
    }
    println!(
        "over all timed runs: {duplicates} outputs read twice, {dead_letters} dead letters, {not_committed:.0} transactions \
         aborted, fenced or failed"
    );
    drop(worker);
    Ok(())
}
