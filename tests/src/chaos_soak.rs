//! The chaos soak (`scripts/bench chaos`, and three minutes of it in CI,
//! `tests/tests/gateway_chaos_soak.rs`): two gateways in exactly-once delivery, mixed voice and
//! image events with 5% hostile ones (inputs that do not exist: dead letters on purpose), sent
//! and counted by `vramgate-cli load` (outputs read `read_committed`), while a gateway, the
//! worker or the broker is SIGKILLed (the broker restarted) at random intervals. The report
//! says what `vramgate-cli load` counted (sent, results, dead letters, lost, duplicates), the
//! outputs the gateways redid after a `read_committed` reader could not see them and the most
//! partitions they ever reported hanging, every fault with its time, and each service's
//! resident memory at its start, at the end of the first steady minute, at its peak and at
//! the end.

use std::time::{Duration, Instant};

use crate::metrics::Scrape;
use crate::{
    binary, brokers, gateway_base_env, image_task_env, restart_broker, rss_bytes, scratch_dir, start_gateway, start_worker_on, unique,
    voice_task_env, worker_config, Gateway, TaskTopics, PNET_MODEL, VAD_MODEL,
};

/// How long, how fast, how often a fault, and which faults.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// How long events are sent (faults only in this time; the drain after it is clean).
    pub seconds: u64,
    /// Events a second, voice and image together.
    pub rate: f64,
    /// Mean seconds between faults (each gap drawn from [S/2, 3S/2]).
    pub fault_every: f64,
    /// The last this many seconds of sending have no fault, so that each service's end figure
    /// is read from a process that has served that long since its last restart (0: faults
    /// until the sending stops). Without it, "end against the first steady minute" compared a
    /// process seconds old, still catching up on its kill's backlog, with a steady one.
    pub quiet_seconds: u64,
    /// The faults' draw: the same seed, the same faults at the same times.
    pub seed: u64,
    /// The gateways' consumer group protocol (`kafka.group_protocol`): `classic`
    /// (cooperative-sticky) or `consumer` (KIP-848).
    pub group_protocol: &'static str,
}

const MIB: f64 = (1u64 << 20) as f64;

/// The faults' draw (xorshift64*): the same seed, the same faults at the same times.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn next_f64(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Resident memory of one service over the run.
#[derive(Default, Clone, Copy)]
pub struct Memory {
    pub start: u64,
    pub steady: u64,
    pub peak: u64,
    pub end: u64,
    /// The peak last printed as a new high (the timeline on stderr).
    shown: u64,
}

impl Memory {
    /// Records one reading; true when it is a new high worth a line on stderr (64 MiB past
    /// the last one shown, and past 256 MiB): where the peaks come from.
    fn sample(&mut self, rss: u64, elapsed: Duration) -> bool {
        if rss == 0 {
            return false; // the process is down (a fault) or gone
        }
        if self.start == 0 {
            self.start = rss;
        }
        if self.steady == 0 && elapsed >= Duration::from_secs(60) {
            self.steady = rss;
        }
        self.peak = self.peak.max(rss);
        self.end = rss;
        let high = rss >= 256 << 20 && rss >= self.shown + (64 << 20);
        if high {
            self.shown = rss;
        }
        high
    }

    fn line(&self, name: &str) -> String {
        let change = if self.steady > 0 { format!("{:+.1}%", (self.end as f64 / self.steady as f64 - 1.0) * 100.0) } else { "-".into() };
        format!(
            "  {name:<10} RSS start {:>5.0} MiB, first steady minute {:>5.0}, peak {:>5.0}, end {:>5.0} MiB (end vs steady {change})",
            self.start as f64 / MIB,
            self.steady as f64 / MIB,
            self.peak as f64 / MIB,
            self.end as f64 / MIB
        )
    }
}

/// What the gateways said of their read back, added up over every instance (a killed one's
/// counters as last scraped).
#[derive(Default)]
pub struct Verified {
    pub redone: f64,
    pub hanging_max: f64,
}

impl Verified {
    fn add(&mut self, scrape: &Scrape, last: &mut f64) {
        let redone = scrape.sum("vramgate_gateway_outputs_redone_total", &[]);
        self.redone += (redone - *last).max(0.0);
        *last = redone;
        self.hanging_max = self.hanging_max.max(scrape.sum("vramgate_gateway_hanging_transactions", &[]));
    }
}

/// One task's line of `vramgate-cli load`'s summary.
#[derive(Debug, Clone)]
pub struct TaskCount {
    pub task: String,
    pub sent: u64,
    pub results: u64,
    pub dead_letters: u64,
    pub lost: u64,
    pub duplicates: u64,
    /// The dead letters by kind, as JSON.
    pub dead_by_kind: String,
}

/// What a soak counted and measured.
pub struct Report {
    pub settings: Settings,
    /// `vramgate-cli load --json`'s summary (null if it printed none).
    pub summary: serde_json::Value,
    pub verified: Verified,
    /// Each fault, with the second it came at.
    pub faults: Vec<String>,
    /// Gateway 0, gateway 1, the worker.
    pub memory: [Memory; 3],
    pub elapsed: Duration,
}

impl Report {
    /// Whether `vramgate-cli load` saw every event settle (a result or a dead letter each, or
    /// gave up at its timeout).
    pub fn settled(&self) -> bool {
        self.summary["settled"].as_bool() == Some(true)
    }

    /// What `vramgate-cli load` counted, per task.
    pub fn tasks(&self) -> Vec<TaskCount> {
        let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
        self.summary["tasks"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| TaskCount {
                task: t["task"].as_str().unwrap_or("?").to_string(),
                sent: n(&t["sent"]),
                results: n(&t["results"]),
                dead_letters: n(&t["dead_letters"]),
                lost: n(&t["lost"]),
                duplicates: n(&t["duplicates"]),
                dead_by_kind: t["dead_letters_by_kind"].to_string(),
            })
            .collect()
    }

    /// The report as `scripts/bench chaos` prints it.
    pub fn text(&self) -> String {
        let Settings { seconds, rate, fault_every, quiet_seconds, group_protocol, .. } = self.settings;
        let mut out = format!(
            "chaos soak: {seconds} s at {rate} events/s, 2 gateways (exactly-once, group protocol {group_protocol}), 5% hostile \
             events, a fault every ~{fault_every:.0} s, none in the last {quiet_seconds} s of sending; {:.0} s in all\n",
            self.elapsed.as_secs_f64()
        );
        out += &format!("  {:<8} {:>8} {:>8} {:>6} {:>5} {:>5}  dead letters by kind\n", "task", "sent", "results", "dead", "lost", "dups");
        for t in self.tasks() {
            out += &format!(
                "  {:<8} {:>8} {:>8} {:>6} {:>5} {:>5}  {}\n",
                t.task, t.sent, t.results, t.dead_letters, t.lost, t.duplicates, t.dead_by_kind
            );
        }
        out += &format!(
            "  read {}; {}\n",
            self.summary["isolation_level"].as_str().unwrap_or("?"),
            if self.settled() { "settled" } else { "NOT settled (or vramgate-cli load failed: see above)" }
        );
        out += &format!("  outputs redone {:.0}, most partitions hanging at once {:.0}\n", self.verified.redone, self.verified.hanging_max);
        out += &format!("  faults ({}): {}\n", self.faults.len(), self.faults.join("; "));
        for (name, m) in ["gateway 0", "gateway 1", "worker"].iter().zip(self.memory) {
            out += &m.line(name);
            out += "\n";
        }
        out
    }
}

/// A process's resident memory in transparent huge pages (`AnonHugePages` of its
/// `smaps_rollup`); 0 where that cannot be read.
fn huge_page_bytes(pid: u32) -> u64 {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    rollup
        .lines()
        .find_map(|l| l.strip_prefix("AnonHugePages:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib << 10)
}

/// What a gateway held when its memory reached a new high (its own gauges).
fn bookkeeping(scrape: &Scrape) -> String {
    let mut out = String::new();
    for name in ["held_bytes", "records_in_flight", "worker_calls_in_flight", "cpu_queue_depth", "paused_partitions", "outputs_unverified", "outputs_awaiting_transaction"] {
        out += &format!("{name} {:.0}, ", scrape.sum(&format!("vramgate_gateway_{name}"), &[]));
    }
    let mib = |allocator: &str, state: &str| {
        scrape.sum("vramgate_gateway_allocator_bytes", &[("allocator", allocator), ("state", state)]) / MIB
    };
    out += &format!(
        "allocators (MiB): mimalloc committed {:.0}, Rust's live blocks in it {:.0}, glibc in use {:.0}, glibc free {:.0}",
        mib("mimalloc", "committed"),
        mib("rust", "in_use"),
        mib("glibc", "in_use"),
        mib("glibc", "free")
    );
    out
}

/// Runs a soak on the test broker (`brokers()`), which it restarts: alone in its test binary.
pub async fn run(settings: Settings) -> anyhow::Result<Report> {
    let Settings { seconds, rate, fault_every, quiet_seconds, seed, group_protocol } = settings;
    let mut rng = Rng::new(seed);
    let voice = TaskTopics::create("chaos-voice", 4).await?;
    let image = TaskTopics::create("chaos-image", 4).await?;
    let root = scratch_dir("chaos-soak");
    let config = worker_config("", &[VAD_MODEL, PNET_MODEL]);
    let mut worker = start_worker_on(&config, "127.0.0.1:0").await?;
    let worker_addr = worker.addr().to_string();
    let group = unique("chaos");
    let mut env = gateway_base_env(&group, &worker.url, &root);
    env.extend(voice_task_env(&voice));
    env.extend(image_task_env(&image));
    env.extend([
        ("DELIVERY", "exactly-once".to_string()),
        ("KAFKA__GROUP_PROTOCOL", group_protocol.to_string()),
        ("TASKS__VOICE__RETRY__MAX_ATTEMPTS", "50".into()),
        ("TASKS__VOICE__RETRY__BACKOFF_MAX_MS", "2000".into()),
        ("TASKS__IMAGE__RETRY__MAX_ATTEMPTS", "50".into()),
        ("TASKS__IMAGE__RETRY__BACKOFF_MAX_MS", "2000".into()),
    ]);
    // Each gateway keeps its transactional id across its restarts: the new instance fences
    // the killed one and aborts what it left open.
    let envs: Vec<Vec<(&str, String)>> = (0..2)
        .map(|i| {
            let mut e = env.clone();
            e.push(("KAFKA__TRANSACTIONAL_ID", unique(&format!("chaos-{i}"))));
            e
        })
        .collect();
    let mut gateways: Vec<Gateway> = Vec::new();
    for e in &envs {
        gateways.push(start_gateway(e).await?);
    }

    let base = |t: &TaskTopics| t.requests.trim_end_matches(".requests").to_string();
    let out = root.join("load-report");
    let mut load = tokio::process::Command::new(binary("vramgate-cli"));
    load.args(["load", "--brokers", &brokers(), "--task", "voice,image"])
        .args(["--topic-base", &format!("voice={}", base(&voice)), "--topic-base", &format!("image={}", base(&image))])
        .args(["--duration-seconds", &seconds.to_string(), "--rate", &rate.to_string()])
        .args(["--missing-fraction", "0.05", "--voice-seconds", "1-4", "--image-sides", "64-480", "--distinct", "8"])
        .args(["--generate-into", &root.join("load-inputs").display().to_string()])
        .args(["--group", &group, "--gateway-metrics", "", "--worker-metrics", "", "--timeout-seconds", "600", "--json"])
        .args(["--out", &out.display().to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true);
    let load = load.spawn()?;
    let started = Instant::now();

    let mut memory = [Memory::default(); 3];
    let mut verified = Verified::default();
    let mut last_redone = [0.0f64; 2];
    let mut faults: Vec<String> = Vec::new();
    let draw = |rng: &mut Rng| Duration::from_secs_f64(fault_every * (0.5 + rng.next_f64()));
    let mut next_fault = started + draw(&mut rng);
    let load_done = tokio::spawn(async move { load.wait_with_output().await });
    while !load_done.is_finished() {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let elapsed = started.elapsed();
        for (i, g) in gateways.iter().enumerate() {
            let rss = rss_bytes(g.pid());
            let high = memory[i].sample(rss, elapsed);
            if let Ok(scrape) = g.metrics().await {
                verified.add(&scrape, &mut last_redone[i]);
                if high {
                    let threads = std::fs::read_dir(format!("/proc/{}/task", g.pid())).map(|d| d.count()).unwrap_or(0);
                    eprintln!(
                        "{:>6.0} s: gateway {i} RSS {:.0} MiB, a new high; {threads} threads, {}",
                        elapsed.as_secs_f64(),
                        rss as f64 / MIB,
                        bookkeeping(&scrape)
                    );
                }
            }
        }
        if memory[2].sample(rss_bytes(worker.service.pid()), elapsed) {
            eprintln!("{:>6.0} s: worker RSS {:.0} MiB, a new high", elapsed.as_secs_f64(), memory[2].peak as f64 / MIB);
        }
        // Faults only while events are still being sent and the quiet stretch before the end
        // has not begun, so the drain and the end figures are clean.
        if Instant::now() < next_fault || elapsed >= Duration::from_secs(seconds.saturating_sub(quiet_seconds)) {
            continue;
        }
        next_fault = Instant::now() + draw(&mut rng);
        let what = match rng.below(4) {
            i @ (0 | 1) => {
                let i = i as usize;
                gateways[i].service.kill()?;
                last_redone[i] = 0.0;
                gateways[i] = start_gateway(&envs[i]).await?;
                format!("gateway {i} SIGKILLed and started again")
            }
            2 => {
                worker.service.kill()?;
                worker = start_worker_on(&config, &worker_addr).await?;
                "worker SIGKILLed and started again on its address".to_string()
            }
            _ => {
                let away = tokio::task::spawn_blocking(restart_broker).await??;
                format!("broker restarted (away {:.1} s)", away.as_secs_f64())
            }
        };
        eprintln!("{:>6.0} s: {what}", elapsed.as_secs_f64());
        faults.push(format!("{:.0} s {what}", elapsed.as_secs_f64()));
    }
    let output = load_done.await??;
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap_or(serde_json::Value::Null);
    for (i, g) in gateways.iter().enumerate() {
        if let Ok(scrape) = g.metrics().await {
            verified.add(&scrape, &mut last_redone[i]);
            let kib = |field| crate::proc_status_kib(g.pid(), field).unwrap_or(0) as f64 / 1024.0;
            eprintln!(
                "at the end: gateway {i} RSS {:.0} MiB ({:.0} anonymous, {:.0} file-backed; {:.0} in transparent huge pages); {}",
                rss_bytes(g.pid()) as f64 / MIB,
                kib("RssAnon:"),
                kib("RssFile:"),
                huge_page_bytes(g.pid()) as f64 / MIB,
                bookkeeping(&scrape)
            );
        }
    }

    for mut g in gateways {
        let _ = g.service.terminate(Duration::from_secs(40)).await;
    }
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
    Ok(Report { settings, summary, verified, faults, memory, elapsed: started.elapsed() })
}
