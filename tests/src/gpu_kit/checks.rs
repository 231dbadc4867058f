//! The kit's checks. Each takes its figures beside its baseline in the same run, writes them
//! as it goes ([`Check`]), and stops starting new steps when its deadline nears.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use super::client::{self, budget, burst, metric_samples, metric_sum, metrics, price, saturate, saturate_named, state, Encoded, Tally};
use super::report::Check;
use super::smi;
use super::{Device, Kit, KitModel};

const GIB: u64 = 1 << 30;
const MIB: f64 = 1048576.0;

/// Runs check `name`; its file says how it ended even when it fails. Returns its status:
/// `ok`, `failed` (a goal missed), `partial` (its time ran out) or `skipped`.
pub async fn run(kit: &Kit, name: &str) -> anyhow::Result<&'static str> {
    let mut check = Check::new(kit, name)?;
    let result = match name {
        "preflight" => preflight(kit, &mut check).await,
        "budget" => budget_check(kit, &mut check).await,
        "p1" => p1(kit, &mut check).await,
        "p3" => p3(kit, &mut check).await,
        "oom" => oom(kit, &mut check).await,
        "batching" => batching(kit, &mut check).await,
        "cards" => cards(kit, &mut check).await,
        other => bail!("no check named {other}"),
    };
    match result {
        Ok(status) => {
            check.finish(status);
            Ok(status)
        }
        Err(e) => {
            check.line(format!("failed: {}", format!("{e:#}").chars().take(4000).collect::<String>()));
            check.finish("failed");
            Err(e)
        }
    }
}

fn skip_without_cuda(kit: &Kit, check: &mut Check) -> bool {
    if kit.device == Device::Cuda {
        return false;
    }
    check.line("skipped: no CUDA device");
    true
}

fn mib(bytes: f64) -> String {
    format!("{:.0} MiB", bytes / MIB)
}

/// The statuses of a tally in a few words: `0 failed` or `2 failed (507: 2)`, and the 503s
/// waited out and sent again, when there were any (`0 failed, 94 sent again after 503`).
fn failures(t: &Tally) -> String {
    let again = if t.throttled > 0 { format!(", {} sent again after 503", t.throttled) } else { String::new() };
    if t.failed() == 0 {
        return format!("0 failed{again}");
    }
    let mut by: Vec<String> = t.statuses.iter().map(|(s, n)| format!("{s}: {n}")).collect();
    if t.transport > 0 {
        by.push(format!("no answer: {}", t.transport));
    }
    format!("{} failed ({}){again}", t.failed(), by.join(", "))
}

/// Preflight: a worker with every model of the kit starts on the device, answers metadata and
/// one inference per model.
async fn preflight(kit: &Kit, check: &mut Check) -> anyhow::Result<&'static str> {
    let started = Instant::now();
    let worker = kit.worker("preflight", "", &KitModel::ALL).await?;
    let seconds = started.elapsed().as_secs_f64();
    check.line(format!("- the worker started on `{}` with {} models in {seconds:.1} s (loaded, probed, calibrated)", kit.device.name(), KitModel::ALL.len()));
    let st = state(&worker.url).await;
    check.line(format!("- admission budget {}; `/vramgate/state`: `{}`", mib(budget(&st) as f64), st["admission"]));
    check.figure("startup_seconds", json!(seconds));
    check.figure("state", st);
    for model in KitModel::ALL {
        let (size, label) = match model {
            KitModel::Pnet => (320, "320x320"),
            KitModel::Silero => (5, "5 s"),
            KitModel::MobileNet => (4, "4 images"),
            KitModel::Crepe => (100, "100 frames"),
        };
        let t = burst(&worker.url, model, &[Encoded::new(model, size, 1)], 1).await;
        check.line(format!("- {} ({label}): {} in {:.1} ms", model.name(), if t.ok == 1 { "answered" } else { "FAILED" }, t.seconds * 1e3));
        if t.ok != 1 {
            bail!("{} did not answer: {:?}; worker log:\n{}", model.name(), t.examples, worker.service.log_tail());
        }
    }
    if let Some(s) = smi::once() {
        check.line(format!("- nvidia-smi with the worker up: {:.0} MiB used of {:.0} MiB", s.used_mib, s.total_mib));
    }
    Ok("ok")
}

/// Another process that holds `bytes` of device (CUDA) or host (CPU) memory until dropped.
struct Hog {
    child: Child,
}

impl Hog {
    /// Starts it and waits until it holds the memory.
    fn start(kit: &Kit, bytes: u64) -> anyhow::Result<Hog> {
        let code = match kit.device {
            Device::Cuda => {
                "import sys, torch\nx = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda')\nx.fill_(1)\n\
                 torch.cuda.synchronize()\nprint('held', flush=True)\nsys.stdin.read()\n"
            }
            Device::Cpu => "import sys\nx = b'\\x01' * int(sys.argv[1])\nprint('held', flush=True)\nsys.stdin.read()\n",
        };
        let python = if kit.device == Device::Cuda { kit.python.as_str() } else { "python3" };
        let mut child = Command::new(python)
            .args(["-c", code, &bytes.to_string(), "vramgate-kit-hog"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {python} to hold memory"))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).context("reading the holder's first line")?;
        if line.trim() != "held" {
            let _ = child.kill();
            bail!("the process that should hold {} did not (said {line:?})", mib(bytes as f64));
        }
        Ok(Hog { child })
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.child.stdin.take().map(|mut s| s.flush());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The budget follows free memory: another process takes memory while the worker serves, the
/// budget must drop by about as much within `memory_resample_ms` (and no request fail), and
/// come back when it is freed.
async fn budget_check(kit: &Kit, check: &mut Check) -> anyhow::Result<&'static str> {
    let hog_bytes = match (kit.device, kit.quick) {
        (Device::Cuda, _) => 20 * GIB,
        // Host memory on a shared machine moves by hundreds of MiB on its own: a hold of
        // 2 GiB stands well clear of that.
        (Device::Cpu, true) => 2 * GIB,
        (Device::Cpu, false) => 4 * GIB,
    };
    let resample_ms = 1000;
    let worker = kit.worker("budget", &format!("memory_resample_ms = {resample_ms}\n"), &[KitModel::Pnet]).await?;
    let t0 = Instant::now();
    let mut timeline: Vec<(f64, f64, f64, f64, f64)> = Vec::new(); // t, budget, admitted, free, held
    let sample = |held: f64| {
        let url = worker.url.clone();
        async move {
            let st = state(&url).await;
            let text = metrics(&url).await;
            let free = metric_sum(&text, "gpu_memory_available_bytes");
            (budget(&st) as f64, st["admission"]["admitted"].as_f64().unwrap_or(0.0), free, held)
        }
    };
    let idle_end = Instant::now() + Duration::from_secs(2);
    while Instant::now() < idle_end {
        let (b, a, f, h) = sample(0.0).await;
        timeline.push((t0.elapsed().as_secs_f64(), b, a, f, h));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let idle_budget = timeline.iter().map(|r| r.1).sum::<f64>() / timeline.len().max(1) as f64;
    let idle_free = timeline.iter().map(|r| r.3).sum::<f64>() / timeline.len().max(1) as f64;
    let smi_idle = smi::once();
    check.line(format!(
        "- idle: budget {}, free {} (the worker's reading: {}){}; kept out of the budget: {} ({:.1}% of the free memory)",
        mib(idle_budget),
        mib(idle_free),
        if kit.device == Device::Cuda { "NVML" } else { "MemAvailable, on the CPU" },
        smi_idle.map(|s| format!(", nvidia-smi free {:.0} MiB of {:.0} MiB", s.free_mib, s.total_mib)).unwrap_or_default(),
        mib(idle_free - idle_budget),
        100.0 * (idle_free - idle_budget) / idle_free.max(1.0)
    ));
    let hog_started = t0.elapsed().as_secs_f64();
    let hog = Hog::start(kit, hog_bytes)?;
    let held_at = t0.elapsed().as_secs_f64();
    check.line(format!("- another process took {} ({:.2} s to allocate)", mib(hog_bytes as f64), held_at - hog_started));
    // Load while the memory is held: P-Net images sent all along.
    let load = {
        let url = worker.url.clone();
        let requests: Vec<Encoded> = (0..kit.pick(64, 8)).map(|i| Encoded::new(KitModel::Pnet, 320 + (i % 4) * 160, i)).collect();
        tokio::spawn(async move { burst(&url, KitModel::Pnet, &requests, 8).await })
    };
    let hold_end = Instant::now() + Duration::from_secs(kit.pick(5, 3));
    let mut followed_at = None;
    while Instant::now() < hold_end {
        let (b, a, f, h) = sample(hog_bytes as f64).await;
        let t = t0.elapsed().as_secs_f64();
        timeline.push((t, b, a, f, h));
        if followed_at.is_none() && b <= idle_budget - 0.8 * hog_bytes as f64 {
            followed_at = Some(t);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let held_budget = timeline.last().map(|r| r.1).unwrap_or(0.0);
    drop(hog);
    let released_at = t0.elapsed().as_secs_f64();
    let back_end = Instant::now() + Duration::from_secs(3);
    let mut back_at = None;
    while Instant::now() < back_end {
        let (b, a, f, h) = sample(0.0).await;
        let t = t0.elapsed().as_secs_f64();
        timeline.push((t, b, a, f, h));
        // Back once at least half of what it lost has returned: host memory on a shared
        // machine (the self-test) moves by hundreds of MiB with other tenants' work.
        if back_at.is_none() && b >= held_budget + 0.5 * (idle_budget - held_budget) {
            back_at = Some(t);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let loaded = load.await.unwrap_or_default();
    let ooms = metric_sum(&metrics(&worker.url).await, "inference_oom_errors_total");
    let follow = followed_at.map(|t| t - held_at);
    let back = back_at.map(|t| t - released_at);
    check.line(format!(
        "- while held: budget {} (dropped by {}, {:.0}% of what was taken), followed within {} (memory_resample_ms = {resample_ms})",
        mib(held_budget),
        mib(idle_budget - held_budget),
        100.0 * (idle_budget - held_budget) / hog_bytes as f64,
        follow.map(|s| format!("{:.0} ms", s * 1e3)).unwrap_or_else(|| "— it did not drop by 80% of it".into())
    ));
    check.line(format!(
        "- released: budget back (half of the drop or more) within {}, at {} after 3 s; P-Net requests meanwhile: {} ok, {}; OOMs {ooms}",
        back.map(|s| format!("{:.0} ms", s * 1e3)).unwrap_or_else(|| "— not back within 3 s".into()),
        mib(timeline.last().map(|r| r.1).unwrap_or(0.0)),
        loaded.ok,
        failures(&loaded)
    ));
    check.figure(
        "budget",
        json!({"hog_bytes": hog_bytes, "idle_budget": idle_budget, "idle_free": idle_free, "held_budget": held_budget,
               "follow_seconds": follow, "back_seconds": back, "resample_ms": resample_ms, "load": loaded.json(), "ooms": ooms}),
    );
    for (i, key) in ["budget", "admitted", "free", "other_process"].iter().enumerate() {
        let points: Vec<(f64, f64)> = timeline.iter().map(|r| (r.0, [r.1, r.2, r.3, r.4][i])).collect();
        check.series(key, &points);
    }
    let good = follow.is_some_and(|s| s <= 2.0 * resample_ms as f64 / 1e3 + 0.5) && back.is_some() && loaded.failed() == 0 && ooms == 0.0;
    Ok(if good { "ok" } else { "failed" })
}

/// One run of a burst on a fresh worker: the tally, the OOMs it met, and the worker's budget.
struct Run {
    label: String,
    tally: Tally,
    ooms: f64,
    retries: f64,
    budget: u64,
    alive: bool,
}

impl Run {
    fn json(&self) -> Value {
        json!({"label": self.label, "tally": self.tally.json(), "ooms": self.ooms, "retries": self.retries, "budget": self.budget, "alive": self.alive})
    }

    fn row(&self, unit: &str) -> String {
        format!(
            "| {} | {:.2} | {:.1} {unit}/s | {} | {} | {} | {} |",
            self.label,
            self.tally.seconds,
            self.tally.per_s(),
            self.tally.ok,
            failures(&self.tally),
            self.ooms,
            if self.alive { "yes" } else { "**no**" }
        )
    }
}

async fn run_burst(kit: &Kit, label: &str, extra: &str, model: KitModel, requests: &[Encoded], in_flight: usize) -> anyhow::Result<(Run, Value)> {
    let mut worker = kit.worker(&format!("{}-{}", model.name(), label.replace([' ', '(', ')', '×'], "")), extra, &[model]).await?;
    let st = state(&worker.url).await;
    let tally = burst(&worker.url, model, requests, in_flight).await;
    let text = metrics(&worker.url).await;
    let alive = worker.service.is_running();
    let run = Run {
        label: label.to_string(),
        tally,
        ooms: metric_sum(&text, "inference_oom_errors_total"),
        retries: metric_sum(&text, "inference_retry_attempts_total"),
        budget: budget(&st),
        alive,
    };
    Ok((run, st))
}

/// A P1 workload: a model's requests of mixed sizes.
fn workload(kit: &Kit, model: KitModel) -> (Vec<Encoded>, String) {
    match model {
        KitModel::Pnet => {
            let (count, lo, span) = kit.pick((192, 160, 1041), (16, 160, 321));
            let requests = (0..count).map(|i| Encoded::new(model, lo + (i * 7919 + 13) % span, i)).collect();
            (requests, format!("{count} P-Net images, sides {lo}..{} px", lo + span - 1))
        }
        KitModel::MobileNet => {
            let (count, most) = kit.pick((128, 64), (12, 8));
            let requests = (0..count).map(|i| Encoded::new(model, 1 + (i * 7919 + 13) % most, i)).collect();
            (requests, format!("{count} MobileNetV2 requests of 1..{most} images each"))
        }
        KitModel::Silero => {
            let (count, most) = kit.pick((128, 30), (12, 8));
            let requests = (0..count).map(|i| Encoded::new(model, 1 + (i * 7919 + 13) % most, i)).collect();
            (requests, format!("{count} Silero clips of 1..{most} s"))
        }
        KitModel::Crepe => {
            let requests = (0..kit.pick(128, 12)).map(|i| Encoded::new(model, 100 * (1 + i % 10), i)).collect();
            (requests, "CREPE requests of 100..1000 frames".into())
        }
    }
}

/// P1: the same burst of mixed sizes under a cap that makes the card small, admitted by bytes,
/// by the static count safe for the largest request, and by larger static counts; real OOMs
/// counted for each.
async fn p1(kit: &Kit, check: &mut Check) -> anyhow::Result<&'static str> {
    let plan: Vec<(u64, KitModel, Vec<u64>)> = if kit.quick {
        vec![(340 << 20, KitModel::Pnet, vec![1, 2])]
    } else if kit.device == Device::Cuda {
        vec![(4 * GIB, KitModel::Pnet, vec![1, 2, 4, 8]), (4 * GIB, KitModel::MobileNet, vec![1, 4]), (16 * GIB, KitModel::Pnet, vec![1, 4])]
    } else {
        vec![(340 << 20, KitModel::Pnet, vec![1, 2, 4])]
    };
    let in_flight = kit.pick(128, 4);
    let host = if kit.device == Device::Cpu { "memory_host_allowance_bytes = 268435456\n" } else { "" };
    let mut all_good = true;
    let mut results = Vec::new();
    for (cap, model, multiples) in plan {
        let (requests, what) = workload(kit, model);
        let largest = requests.iter().map(|r| r.elements).max().unwrap_or(1);
        let base = format!("memory_limit_bytes = {cap}\n{host}");
        let queue = "max_queue_wait_ms = 600000\nmax_queued_requests = 4096\n";
        check.line(format!("\n### {what}, memory cap {} ({in_flight} requests in flight)\n", mib(cap as f64)));
        if !kit.fits(Duration::from_secs(20)) {
            check.line("- skipped: the check's time limit is near");
            return Ok("partial");
        }
        let (bytes, st) = run_burst(kit, "bytes", &format!("{base}[admission]\nmode = \"bytes\"\n{queue}"), model, &requests, in_flight).await?;
        let largest_price = price(&st, model, largest);
        let safe = (bytes.budget / largest_price.max(1)).max(1);
        check.line(format!(
            "- byte admission's budget {}; the largest request priced {}: the static count safe for it is {safe}",
            mib(bytes.budget as f64),
            mib(largest_price as f64)
        ));
        check.line(format!("\n| run | seconds | throughput | ok | failed | OOMs | worker alive |\n|---|---|---|---|---|---|---|\n{}", bytes.row(model.unit())));
        let mut runs = vec![bytes];
        for k in multiples {
            if !kit.fits(Duration::from_secs(15)) {
                check.line("- the remaining static counts skipped: the check's time limit is near");
                break;
            }
            let count = safe * k;
            let label = if k == 1 { format!("count {count} (safe)") } else { format!("count {count} ({k}× safe)") };
            let extra = format!("{base}[admission]\nmode = \"count\"\nmax_concurrent = {count}\n{queue}");
            // At least as many in flight as the count admits, or the client would be the limit.
            let (run, _) = run_burst(kit, &label, &extra, model, &requests, in_flight.max(count as usize).min(1024)).await?;
            check.line(run.row(model.unit()));
            runs.push(run);
        }
        let bytes = &runs[0];
        let safe_run = runs.iter().find(|r| r.label.ends_with("(safe)"));
        let best = runs[1..].iter().filter(|r| r.tally.failed() == 0 && r.alive).max_by(|a, b| a.tally.per_s().total_cmp(&b.tally.per_s()));
        let mut summary = format!("\nbytes: {}, {} OOMs", failures(&bytes.tally), bytes.ooms);
        if let Some(s) = safe_run {
            summary.push_str(&format!("; bytes / safe count = **{:.2}×** (goal ≥ 2)", bytes.tally.per_s() / s.tally.per_s().max(1e-9)));
        }
        match best {
            Some(b) => summary.push_str(&format!(
                "; bytes / best lossless count ({}) = **{:.2}×** (goal ≥ 1)",
                b.label,
                bytes.tally.per_s() / b.tally.per_s().max(1e-9)
            )),
            None => summary.push_str("; no static count ran without losing requests"),
        }
        let static_ooms: f64 = runs[1..].iter().map(|r| r.ooms).sum();
        summary.push_str(&format!("; OOMs under static counts: {static_ooms}"));
        check.line(summary);
        all_good &= bytes.tally.failed() == 0 && bytes.ooms == 0.0 && bytes.alive;
        results.push(json!({"cap": cap, "model": model.name(), "workload": what, "safe_count": safe, "largest_price": largest_price,
                            "runs": runs.iter().map(Run::json).collect::<Vec<_>>()}));
        check.figure("p1", json!(results));
    }
    Ok(if all_good { "ok" } else { "failed" })
}

/// `raw_loop` on the device for `seconds`: items per second, or the reason it failed.
fn raw_loop(kit: &Kit, model: KitModel, size: usize, rows: usize, seconds: f64) -> anyhow::Result<f64> {
    raw_loop_with(kit, model, size, rows, seconds, &[])
}

/// [`raw_loop`] with more of its flags (`--no-profiling`: TorchScript's executor as the
/// worker sets it).
fn raw_loop_with(kit: &Kit, model: KitModel, size: usize, rows: usize, seconds: f64, flags: &[&str]) -> anyhow::Result<f64> {
    let path = kit.dir.join(model.file());
    let mut command = Command::new(kit.bin("raw_loop"));
    command
        .args(["--model", &path.to_string_lossy(), "--device", kit.device.name(), "--seconds", &seconds.to_string(), "--json"])
        .args(model.raw_loop_args(size, rows))
        .args(["--threads", "1"])
        .args(flags);
    let output = command.output().context("running raw_loop")?;
    if !output.status.success() {
        bail!("raw_loop failed: {}", String::from_utf8_lossy(&output.stderr).chars().take(2000).collect::<String>());
    }
    let line = String::from_utf8_lossy(&output.stdout).lines().last().unwrap_or_default().to_string();
    let value: Value = serde_json::from_str(&line).with_context(|| format!("raw_loop printed {line:?}"))?;
    value["items_per_s"].as_f64().context("raw_loop gave no items_per_s")
}

/// The mean batch size between two scrapes of `inference_batch_size` (requests per batch).
fn mean_batch(before: &str, after: &str, model: KitModel) -> f64 {
    let sum = model_delta(before, after, "inference_batch_size_sum", model);
    let count = model_delta(before, after, "inference_batch_size_count", model);
    if count > 0.0 {
        sum / count
    } else {
        0.0
    }
}

/// The change of `metric{model=...}` (a counter or a histogram's `_sum`/`_count`) between two
/// scrapes.
fn model_delta(before: &str, after: &str, name: &str, model: KitModel) -> f64 {
    let label = format!("model=\"{}\"", model.name());
    let pick = |text: &str| metric_samples(text, name).into_iter().filter(|(l, _)| l.contains(&label)).map(|(_, v)| v).sum::<f64>();
    pick(after) - pick(before)
}

/// CPU seconds (user and system) process `pid` has used, from `/proc/<pid>/stat`; `None`
/// where there is no such file. Ticks are USER_HZ, 100 a second in Linux's x86-64 ABI.
fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (2nd field) may hold spaces: count fields after its closing ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    // utime and stime are the stat's 14th and 15th fields: 12th and 13th after the name.
    Some((ticks(11)? + ticks(12)?) / 100.0)
}

/// CPU seconds of each of process `pid`'s threads by thread id, with the group it belongs to:
/// `http` (tokio's threads, which read, decode and answer requests), `batch` (the model's batch
/// threads), `other` (libtorch's pools, the memory monitor, the allocator).
fn thread_cpu(pid: &str) -> std::collections::BTreeMap<String, (&'static str, f64)> {
    let mut threads = std::collections::BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return threads };
    for task in tasks.flatten() {
        let tid = task.file_name().to_string_lossy().to_string();
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let group = if comm.starts_with("tokio") {
            "http"
        } else if comm.starts_with("batch-") {
            "batch"
        } else {
            "other"
        };
        if let Some(cpu) = cpu_seconds(&format!("{pid}/task/{tid}")) {
            threads.insert(tid, (group, cpu));
        }
    }
    threads
}

/// CPU seconds each group of threads spent between two [`thread_cpu`] samples, thread by
/// thread: a thread that ended between them (tokio's blocking threads end after 10 s idle, the
/// one that loaded the models among them) takes its seconds out of neither sample, and one
/// born between them counts from zero.
fn thread_cpu_spent(before: &std::collections::BTreeMap<String, (&'static str, f64)>, after: &std::collections::BTreeMap<String, (&'static str, f64)>) -> std::collections::BTreeMap<&'static str, f64> {
    let mut groups = std::collections::BTreeMap::new();
    for (tid, &(group, cpu)) in after {
        let earlier = before.get(tid).map_or(0.0, |&(_, c)| c);
        *groups.entry(group).or_insert(0.0) += (cpu - earlier).max(0.0);
    }
    groups
}

/// Mean milliseconds a batch of `model` spent in each phase of its model call between two
/// scrapes (`inference_phase_seconds`: inputs, to_device, model, outputs).
fn phase_ms(before: &str, after: &str, model: KitModel) -> [f64; 4] {
    PHASES.map(|phase| {
        let pick = |text: &str, name: &str| {
            metric_samples(text, name)
                .into_iter()
                .filter(|(l, _)| l.contains(&format!("model=\"{}\"", model.name())) && l.contains(&format!("phase=\"{phase}\"")))
                .map(|(_, v)| v)
                .sum::<f64>()
        };
        let sum = pick(after, "inference_phase_seconds_sum") - pick(before, "inference_phase_seconds_sum");
        let count = pick(after, "inference_phase_seconds_count") - pick(before, "inference_phase_seconds_count");
        if count > 0.0 { 1000.0 * sum / count } else { f64::NAN }
    })
}

/// The phases of a batch the worker measures, in order.
const PHASES: [&str; 4] = ["inputs", "to_device", "model", "outputs"];

/// Where a saturated worker's time went, from two scrapes and the processes' CPU time: the
/// seconds batches spent in the model per second of wall time (above 1 where several
/// instances run at once), the mean milliseconds a batch took there,
/// and the CPU cores the worker and the kit's client used.
struct Spent {
    in_model: f64,
    ms_a_batch: f64,
    worker_cores: f64,
    client_cores: f64,
}

impl Spent {
    fn measure(before: &str, after: &str, model: KitModel, wall: f64, worker_cpu: f64, client_cpu: f64) -> Spent {
        let sum = model_delta(before, after, "inference_duration_seconds_sum", model);
        let count = model_delta(before, after, "inference_duration_seconds_count", model);
        Spent {
            in_model: if wall > 0.0 { sum / wall } else { f64::NAN },
            ms_a_batch: if count > 0.0 { 1000.0 * sum / count } else { f64::NAN },
            worker_cores: if wall > 0.0 { worker_cpu / wall } else { f64::NAN },
            client_cores: if wall > 0.0 { client_cpu / wall } else { f64::NAN },
        }
    }

    fn cells(&self) -> String {
        format!(
            "{:.2} | {:.2} | {:.1} / {:.1}",
            self.in_model,
            self.ms_a_batch,
            self.worker_cores,
            self.client_cores
        )
    }

    fn json(&self) -> Value {
        json!({"in_model_share": self.in_model, "ms_a_batch": self.ms_a_batch, "worker_cores": self.worker_cores, "client_cores": self.client_cores})
    }
}

/// The request each model is saturated with in P3 and in the batching check.
fn p3_size(model: KitModel) -> (usize, &'static str) {
    match model {
        KitModel::Pnet => (480, "480×480 image"),
        KitModel::Silero => (5, "5 s clip"),
        KitModel::MobileNet => (1, "1 image"),
        KitModel::Crepe => (100, "100 frames"),
    }
}

/// P3: each model saturates the worker (many requests in flight) while the card's utilisation
/// is sampled; then a plain libtorch loop on the same card at batch 1 and at the batch size
/// the worker reached.
async fn p3(kit: &Kit, check: &mut Check) -> anyhow::Result<&'static str> {
    let seconds = kit.pick(3.0, 1.0);
    let in_flight = kit.pick(64, 2);
    // P-Net a second time, taking the picture as bytes (normalised on the device).
    let worker = kit.worker("p3", &pnet_bytes_entry(kit)?, &KitModel::ALL).await?;
    check.line(format!("{in_flight} requests in flight, {seconds} s a figure; utilisation from nvidia-smi every 100 ms\n"));
    check.line("| model | request | worker | mean batch | raw loop, batch 1 | raw loop, worker's batch | worker / raw (batch 1) | worker / raw (same batch) | GPU util worker | GPU util raw | batch-seconds in the model a second | ms a batch | CPU cores worker / client | failed |");
    check.line("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut breakdown = Vec::new();
    let mut good = true;
    let mut offset = 0.0;
    for model in KitModel::ALL {
        if !kit.fits(Duration::from_secs_f64(5.0 * seconds + 10.0)) {
            check.line("- the remaining models skipped: the check's time limit is near");
            return Ok("partial");
        }
        let (size, what) = p3_size(model);
        let request = Encoded::new(model, size, 1);
        // A first window on a fresh model: what it costs the first time each batch size runs
        // (on a card, libtorch's and cuDNN's set-up for a new shape), measured apart from
        // the timed window after it.
        let first = saturate(&worker.url, model, &request, in_flight, seconds).await;
        let before = metrics(&worker.url).await;
        let pid = worker.service.pid().to_string();
        let cpu = || (cpu_seconds(&pid).unwrap_or(f64::NAN), cpu_seconds("self").unwrap_or(f64::NAN));
        let (worker_cpu, client_cpu) = cpu();
        let threads_before = thread_cpu(&pid);
        let sampler = smi::Sampler::start();
        let t = saturate(&worker.url, model, &request, in_flight, seconds).await;
        let worker_samples = sampler.map(smi::Sampler::stop).unwrap_or_default();
        let (worker_cpu_after, client_cpu_after) = cpu();
        let threads_after = thread_cpu(&pid);
        let after = metrics(&worker.url).await;
        let batch = mean_batch(&before, &after, model);
        let spent = Spent::measure(&before, &after, model, t.seconds, worker_cpu_after - worker_cpu, client_cpu_after - client_cpu);
        let rows_per_request = request.items;
        let raw1 = raw_loop(kit, model, size, 1, seconds);
        let same = (batch.round() as usize).max(1);
        let sampler = smi::Sampler::start();
        let raw_b = if same > 1 { raw_loop(kit, model, size, same, seconds) } else { raw1.as_ref().map(|r| *r).map_err(|e| anyhow::anyhow!("{e}")) };
        let raw_samples = sampler.map(smi::Sampler::stop).unwrap_or_default();
        // The same loop with TorchScript's executor as the worker sets it (profiling off).
        let raw_legacy = raw_loop_with(kit, model, size, same, seconds, &["--no-profiling"]);
        let phases = phase_ms(&before, &after, model);
        let spent_by_group = thread_cpu_spent(&threads_before, &threads_after);
        let per_thread: Vec<(&str, f64)> = ["http", "batch", "other"]
            .into_iter()
            .map(|g| (g, spent_by_group.get(g).copied().unwrap_or(0.0) / t.seconds))
            .collect();
        breakdown.push(format!(
            "| {} | {:.1} {}/s | {:.1} | {} | {:.2} / {:.2} / {:.2} / {:.2} | {} |",
            model.name(),
            first.per_s(),
            model.unit(),
            batch,
            raw_legacy.as_ref().map(|v| format!("{v:.1}")).unwrap_or_else(|e| format!("failed: {}", e.to_string().chars().take(80).collect::<String>())),
            phases[0],
            phases[1],
            phases[2],
            phases[3],
            per_thread.iter().map(|(g, c)| format!("{g} {c:.2}")).collect::<Vec<_>>().join(", ")
        ));
        let (util_w, used_w) = smi::summary(&worker_samples).unwrap_or((f64::NAN, f64::NAN));
        let (util_r, _) = smi::summary(&raw_samples).unwrap_or((f64::NAN, f64::NAN));
        let fmt = |r: &anyhow::Result<f64>| match r {
            Ok(v) => format!("{v:.1}"),
            Err(e) => format!("failed: {}", e.to_string().chars().take(120).collect::<String>()),
        };
        let ratio = |r: &anyhow::Result<f64>| r.as_ref().map(|v| format!("{:.2}", t.per_s() / v)).unwrap_or_else(|_| "—".into());
        check.line(format!(
            "| {} | {what} | {:.1} {}/s | {:.1} requests ({:.1} {}) | {} | {} | {} | **{}** | {} | {} | {} | {} |",
            model.name(),
            t.per_s(),
            model.unit(),
            batch,
            batch * rows_per_request as f64,
            model.unit(),
            fmt(&raw1),
            fmt(&raw_b),
            ratio(&raw1),
            ratio(&raw_b),
            if util_w.is_nan() { "—".into() } else { format!("{util_w:.0}%") },
            if util_r.is_nan() { "—".into() } else { format!("{util_r:.0}%") },
            spent.cells(),
            failures(&t)
        ));
        good &= t.failed() == 0;
        let worker_points: Vec<(f64, f64)> = worker_samples.iter().map(|s| (offset + s.t, s.util)).collect();
        let raw_points: Vec<(f64, f64)> = raw_samples.iter().map(|s| (offset + seconds + 2.0 + s.t, s.util)).collect();
        if !worker_points.is_empty() {
            check.series(&format!("{}_worker_util", model.name()), &worker_points);
            check.series(&format!("{}_raw_util", model.name()), &raw_points);
        }
        offset += 2.0 * seconds + 6.0;
        rows.push(json!({"model": model.name(), "request": what, "worker": t.json(), "mean_batch_requests": batch,
                          "raw_batch1_per_s": raw1.ok(), "raw_same_batch_per_s": raw_b.ok(), "raw_same_batch_rows": same,
                          "gpu_util_worker": util_w, "gpu_util_raw": util_r, "used_mib_worker": used_w, "spent": spent.json(),
                          "raw_same_batch_no_profiling_per_s": raw_legacy.as_ref().ok(), "first_window": first.json(), "phase_ms": PHASES.iter().zip(phases).map(|(p, ms)| (p.to_string(), json!(ms))).collect::<serde_json::Map<_, _>>(),
                          "worker_cores_by_thread": per_thread.iter().map(|(g, c)| (g.to_string(), json!(c))).collect::<serde_json::Map<_, _>>()}));
        check.figure("p3", json!(rows));
    }
    check.line(
        "\nWhere the worker's time went (means over each run above): the raw loop again at the worker's batch with \
         TorchScript's profiling executor off, as the worker runs it; a batch's milliseconds building its inputs on the host \
         (on a card: in the instance's pinned buffer), queuing their copy to the device (non-blocking on a card), in the model \
         (on a card: until the instance's stream is done, copy included), and bringing the outputs back; the worker's CPU \
         cores by thread.\n",
    );
    check.line("| model | worker's first window | mean batch | raw loop, worker's batch, profiling off | ms a batch: inputs / to device / model / outputs | worker CPU cores by thread |");
    check.line("|---|---|---|---|---|---|");
    for row in breakdown {
        check.line(row);
    }
    p3_bytes_and_baseline(kit, check, &worker, in_flight, seconds, &rows).await;
    let st = state(&worker.url).await;
    if let Some(s) = smi::once() {
        let free = s.free_mib * MIB;
        let reserve = free - budget(&st) as f64;
        check.line(format!(
            "\nmemory left idle as reserve after the runs: {} of the card's {:.0} MiB free, outside a budget of {} (**{:.1}% of the card**, goal ≤ 5%)",
            mib(reserve),
            s.free_mib,
            mib(budget(&st) as f64),
            100.0 * reserve / (s.total_mib * MIB)
        ));
        check.figure("reserve", json!({"free_bytes": free, "budget": budget(&st), "total_mib": s.total_mib}));
    }
    Ok(if good { "ok" } else { "failed" })
}

/// The kit's P-Net under another name, taking its picture as UINT8 bytes too (`from_uint8`,
/// MTCNN's `(x − 127.5) / 128` applied on the device): a `[[models]]` entry for P3's config.
fn pnet_bytes_entry(kit: &Kit) -> anyhow::Result<String> {
    let path = kit.dir.join(KitModel::Pnet.file());
    Ok(format!(
        "\n[[models]]\nname = \"{PNET_BYTES}\"\npath = \"{}\"\nmax_input_elements = 20000000\n\
         input = {{ name = \"image\", shape = [-1, 3, -1, -1], min_shape = [1, 3, 12, 12], from_uint8 = {{ scale = 0.0078125, offset = -0.99609375 }} }}\n\
         outputs = [{{ name = \"box_offsets\", shape = [-1, 4, -1, -1] }}, {{ name = \"face_prob\", shape = [-1, 2, -1, -1] }}]\n\
         probe_sizes = [128, 256, 512]\nbatch_probe_sizes = [480]\n",
        path.display()
    ))
}

const PNET_BYTES: &str = "mtcnn_pnet_bytes";

/// P3's last rows: P-Net's picture sent as bytes to the same worker, and, when the kit
/// carries an earlier worker (`Kit::baseline`), that worker saturated the same way, model by
/// model, beside this one's figures from `rows`: the gain as a ratio from one run.
async fn p3_bytes_and_baseline(kit: &Kit, check: &mut Check, worker: &super::Worker, in_flight: usize, seconds: f64, rows: &[Value]) {
    let (size, _) = p3_size(KitModel::Pnet);
    let (tensor, items) = KitModel::Pnet.request(size, 1);
    let values = match &tensor.data {
        vramgate_shared::oip::TensorData::Fp32(v) => v.clone(),
        _ => Vec::new(),
    };
    // The FP32 request's values are (x − 127.5) / 128 of the bytes that make it.
    let bytes: Vec<u8> = values.iter().map(|v| (v * 128.0 + 127.5).round().clamp(0.0, 255.0) as u8).collect();
    let bytes = vramgate_shared::oip::Tensor::new("image", vec![1, 3, size, size], bytes);
    let (body, header_len) = crate::oip_client::encode(&[bytes]);
    let request = Encoded { body: std::sync::Arc::new(body), header_len, items, elements: KitModel::Pnet.elements(size) };
    let per_s = |name: &str| rows.iter().find(|r| r["model"] == name).and_then(|r| r["worker"]["items_per_s"].as_f64());
    if kit.fits(Duration::from_secs_f64(3.0 * seconds + 5.0)) {
        let _first = saturate_named(&worker.url, PNET_BYTES, &request, in_flight, seconds).await;
        let t = saturate_named(&worker.url, PNET_BYTES, &request, in_flight, seconds).await;
        let fp32 = per_s(KitModel::Pnet.name()).unwrap_or(f64::NAN);
        check.line(format!(
            "\nP-Net {size}² sent as UINT8 bytes ({:.1} MB a request instead of {:.1}), normalised on the device: **{:.1} images/s** ({:.2}× the FP32 row), {}",
            request.body.len() as f64 / 1e6,
            4.0 * request.body.len() as f64 / 1e6,
            t.per_s(),
            t.per_s() / fp32,
            failures(&t)
        ));
        check.figure("p3_bytes", json!({"items_per_s": t.per_s(), "fp32_items_per_s": fp32, "worker": t.json()}));
    }
    let needs = Duration::from_secs_f64(KitModel::ALL.len() as f64 * (2.0 * seconds + 3.0) + 30.0);
    if kit.baseline.is_none() || !kit.fits(needs) {
        if kit.baseline.is_some() {
            check.line("- the baseline worker skipped: the check's time limit is near");
        }
        return;
    }
    let Some(started) = kit.baseline_worker("p3-baseline", "", &KitModel::ALL).await else { return };
    let baseline = match started {
        Ok(w) => w,
        Err(e) => {
            check.line(format!("- the baseline worker did not start: {}", e.to_string().chars().take(200).collect::<String>()));
            return;
        }
    };
    let version = std::fs::read_to_string(kit.dir.join("BASELINE")).unwrap_or_default();
    check.line(format!(
        "\nThe baseline worker (commit {}) saturated the same way, right after: this worker ÷ baseline is the gain.\n",
        version.trim()
    ));
    check.line("| model | this worker | baseline's first window | baseline | this ÷ baseline | GPU util baseline | failed |");
    check.line("|---|---|---|---|---|---|---|");
    let mut figures = Vec::new();
    for model in KitModel::ALL {
        let (size, _) = p3_size(model);
        let request = Encoded::new(model, size, 1);
        let first = saturate(&baseline.url, model, &request, in_flight, seconds).await;
        let sampler = smi::Sampler::start();
        let t = saturate(&baseline.url, model, &request, in_flight, seconds).await;
        let samples = sampler.map(smi::Sampler::stop).unwrap_or_default();
        let util = smi::summary(&samples).map(|(u, _)| u).unwrap_or(f64::NAN);
        let ours = per_s(model.name()).unwrap_or(f64::NAN);
        check.line(format!(
            "| {} | {ours:.1} | {:.1} | {:.1} | **{:.2}** | {} | {} |",
            model.name(),
            first.per_s(),
            t.per_s(),
            ours / t.per_s(),
            if util.is_nan() { "—".into() } else { format!("{util:.0}%") },
            failures(&t)
        ));
        figures.push(json!({"model": model.name(), "ours_per_s": ours, "baseline_per_s": t.per_s(), "baseline_first_window_per_s": first.per_s(), "gpu_util_baseline": util}));
    }
    check.figure("p3_baseline", json!({"commit": version.trim(), "rows": figures}));
}

/// OOM recovery: a budget far above the card (`memory_budget_override_bytes`) under a cap, so
/// that admission lets in more than fits and real CUDA OOMs happen; every request must still
/// be answered.
async fn oom(kit: &Kit, check: &mut Check) -> anyhow::Result<&'static str> {
    if skip_without_cuda(kit, check) {
        return Ok("skipped");
    }
    let card = smi::once().map(|s| (s.total_mib * MIB) as u64).unwrap_or(80 * GIB);
    // One instance runs one batch at a time, and the batch sizer keeps large P-Net batches
    // small, so on a large card one batch never filled a 2 GiB cap (the first H200 run): four
    // instances run four batches at once under 1 GiB, which the largest image fits alone.
    let cap = GIB;
    let instances = 4;
    // Every body in flight at once (64 of up to 31 MB): the default 256 MiB of bodies turned
    // most of them away with 503 (94 of 96 in the first run), and so did no batch pile up.
    let extra = format!(
        "memory_limit_bytes = {cap}\nmax_body_bytes_in_flight = {}\nmemory_budget_override_bytes = {}\n[admission]\nmax_queue_wait_ms = 600000\nmax_queued_requests = 4096\n",
        4 * GIB,
        4 * card
    );
    let mut worker = kit.worker_with("oom", &extra, &[KitModel::Pnet], &format!("instances = {instances}")).await?;
    let requests: Vec<Encoded> = (0..96).map(|i| Encoded::new(KitModel::Pnet, 900 + (i * 7919) % 700, i)).collect();
    check.line(format!(
        "96 P-Net images of 900..1599 px, 64 in flight, {instances} instances of the model, allocator capped at {} (its memory fraction) while admission hands out {} (4× the card)",
        mib(cap as f64),
        mib(4.0 * card as f64)
    ));
    let t = burst(&worker.url, KitModel::Pnet, &requests, 64).await;
    let text = metrics(&worker.url).await;
    let alive = worker.service.is_running();
    let ooms = metric_sum(&text, "inference_oom_errors_total");
    let retries = metric_sum(&text, "inference_retry_attempts_total");
    // The gauges are re-read every memory_resample_ms (1 s): wait for a reading after the burst.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let after = metrics(&worker.url).await;
    let (reserved, allocated) = (metric_sum(&after, "gpu_memory_used_bytes"), metric_sum(&after, "gpu_memory_allocated_bytes"));
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let later = metrics(&worker.url).await;
    let (reserved_later, allocated_later) = (metric_sum(&later, "gpu_memory_used_bytes"), metric_sum(&later, "gpu_memory_allocated_bytes"));
    let meta = client::model_metadata(&worker.url, KitModel::Pnet).await;
    check.line(format!(
        "- answered: {} ok, {} in {:.1} s; worker alive: {alive}; no answer at all: {}",
        t.ok,
        failures(&t),
        t.seconds,
        t.transport
    ));
    check.line(format!("- real OOMs caught: **{ooms}**, retries after them: {retries}"));
    check.line(format!(
        "- the allocator after the burst: {} reserved, {} allocated; 2 s later: {} reserved, {} allocated",
        mib(reserved),
        mib(allocated),
        mib(reserved_later),
        mib(allocated_later)
    ));
    check.line(format!("- P-Net's estimate after: `{}`", meta["parameters"]["memory_estimate"]));
    for e in &t.examples {
        check.line(format!("- e.g. `{e}`"));
    }
    check.figure("oom", json!({"tally": t.json(), "ooms": ooms, "retries": retries, "alive": alive, "reserved": reserved, "allocated": allocated, "reserved_later": reserved_later, "allocated_later": allocated_later, "estimate": meta["parameters"]["memory_estimate"]}));
    // Every request answered: a result or a clear 507, never a dropped connection or a crash.
    let answered = t.transport == 0 && t.statuses.keys().all(|s| *s == 507);
    Ok(if alive && answered && ooms > 0.0 {
        "ok"
    } else if ooms == 0.0 {
        check.line("- no OOM happened: the check proves nothing on this card (raise the load or lower the cap)");
        "failed"
    } else {
        "failed"
    })
}

/// Batching: the batch-size limits the worker measured per model and size class, and the
/// throughput of its choice against batch 1, side by side.
async fn batching(kit: &Kit, check: &mut Check) -> anyhow::Result<&'static str> {
    let models = [KitModel::Silero, KitModel::MobileNet, KitModel::Pnet];
    let seconds = kit.pick(3.0, 1.0);
    let in_flight = kit.pick(64, 4);
    let mut figures = Vec::new();
    let chosen = kit.worker("batching", "", &models).await?;
    let limits = metric_samples(&metrics(&chosen.url).await, "vramgate_worker_batch_size_limit");
    check.line("batch-size limits measured at start-up (`vramgate_worker_batch_size_limit`):\n");
    check.line("| model, size class | items a batch |\n|---|---|");
    for (labels, v) in &limits {
        check.line(format!("| {labels} | {v} |"));
    }
    let mut chosen_rates = Vec::new();
    for model in models {
        let (size, _) = p3_size(model);
        chosen_rates.push(saturate(&chosen.url, model, &Encoded::new(model, size, 1), in_flight, seconds).await);
    }
    drop(chosen);
    let one = kit.worker("batching-1", "[batching]\nmax_batch_size = 1\n", &models).await?;
    check.line(format!("\n{in_flight} requests in flight, {seconds} s each:\n\n| model | request | batch 1 | worker's choice | ratio |\n|---|---|---|---|---|"));
    for (model, chosen) in models.into_iter().zip(chosen_rates) {
        let (size, what) = p3_size(model);
        let single = saturate(&one.url, model, &Encoded::new(model, size, 1), in_flight, seconds).await;
        check.line(format!(
            "| {} | {what} | {:.1} {unit}/s | {:.1} {unit}/s | **{:.2}×** |",
            model.name(),
            single.per_s(),
            chosen.per_s(),
            chosen.per_s() / single.per_s().max(1e-9),
            unit = model.unit()
        ));
        figures.push(json!({"model": model.name(), "batch1": single.json(), "chosen": chosen.json()}));
        check.figure("throughput", json!(figures));
    }
    check.figure("limits", json!(limits));
    Ok("ok")
}

/// Card sizes: 8, 16 and 24 GB each emulated on the one card by `memory_limit_bytes`; per
/// model the safe static concurrency, throughput by bytes and OOMs.
async fn cards(kit: &Kit, check: &mut Check) -> anyhow::Result<&'static str> {
    if skip_without_cuda(kit, check) {
        check.line("(the CPU-emulated table is in docs/performance.md, from the `cards` bench)");
        return Ok("skipped");
    }
    let models = [KitModel::Pnet, KitModel::Silero, KitModel::MobileNet];
    check.line("A card of N GB: `memory_limit_bytes` = N × 10⁹ beyond the worker's start-up footprint. Byte admission, 128 requests in flight.\n");
    check.line("| card | model | workload | budget | largest request priced | safe static count | throughput | failed | OOMs |\n|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut good = true;
    for gb in [8u64, 16, 24] {
        if !kit.fits(Duration::from_secs(20)) {
            check.line("- the remaining cards skipped: the check's time limit is near");
            return Ok("partial");
        }
        let worker = kit.worker(&format!("card-{gb}"), &format!("memory_limit_bytes = {}\n", gb * 1_000_000_000), &models).await?;
        for model in models {
            let (requests, what) = workload(kit, model);
            let st = state(&worker.url).await;
            let largest = price(&st, model, requests.iter().map(|r| r.elements).max().unwrap_or(1));
            let before = metric_sum(&metrics(&worker.url).await, "inference_oom_errors_total");
            let t = burst(&worker.url, model, &requests, 128).await;
            let ooms = metric_sum(&metrics(&worker.url).await, "inference_oom_errors_total") - before;
            let safe = budget(&st) / largest.max(1);
            check.line(format!(
                "| {gb} GB | {} | {what} | {} | {} | {safe} | {:.1} {}/s | {} | {ooms} |",
                model.name(),
                mib(budget(&st) as f64),
                mib(largest as f64),
                t.per_s(),
                model.unit(),
                failures(&t)
            ));
            good &= t.failed() == 0 && ooms == 0.0;
            rows.push(json!({"card_gb": gb, "model": model.name(), "budget": budget(&st), "largest_price": largest, "safe_count": safe, "tally": t.json(), "ooms": ooms}));
            check.figure("cards", json!(rows));
        }
    }
    Ok(if good { "ok" } else { "failed" })
}

#[cfg(test)]
mod tests {
    use super::thread_cpu_spent;
    use std::collections::BTreeMap;

    #[test]
    fn cpu_by_thread_group_counts_each_thread_between_its_own_samples() {
        let sample = |threads: &[(&str, &'static str, f64)]| -> BTreeMap<String, (&'static str, f64)> {
            threads.iter().map(|&(tid, group, cpu)| (tid.to_string(), (group, cpu))).collect()
        };
        // Thread 1 ran 2 s more; 2 (a blocking thread with 21 s behind it) ended between the
        // samples; 3 was born between them and ran 0.5 s; 4 is a batch thread.
        let before = sample(&[("1", "http", 10.0), ("2", "http", 21.0), ("4", "batch", 5.0)]);
        let after = sample(&[("1", "http", 12.0), ("3", "http", 0.5), ("4", "batch", 8.0)]);
        let spent = thread_cpu_spent(&before, &after);
        assert_eq!(spent.get("http"), Some(&2.5), "the ended thread takes nothing away: {spent:?}");
        assert_eq!(spent.get("batch"), Some(&3.0));
        assert_eq!(spent.get("other"), None);
    }
}
