//! Safe concurrency per card size, measured on CPU: for each model and each emulated card
//! (8, 16, 24, 32 GB), the real worker runs under a memory cap standing for the card, the real
//! gateway feeds it, and `vramgate-cli load` sends a burst with its size mix (clips 1–30 s,
//! images 64–2048 px). Printed per card and model: the worker's budget, the most bytes
//! admission granted at once, the most worker calls in flight and queued at the worker, the
//! largest mean batch size in a sampling interval, throughput, OOMs, dead letters and lost.
//!
//! **How a card is emulated.** `memory_limit_bytes` caps the worker: on CPU an address-space
//! limit (`RLIMIT_AS`) on top of the start-up footprint, so allocations past it fail as CUDA
//! allocations fail past a card's memory, and the admission budget is capped by it too. The
//! cap is the card's bytes divided by `VRAMGATE_BENCH_CARD_SCALE` (default 32: 8 GB → 256 MiB),
//! because this machine cannot give a worker 32 GB and because the requests' bytes stay real:
//! a row therefore measures a card whose memory is `scale ×` the cap serving requests `scale ×`
//! larger than these (the ratio of memory to request size is what sets concurrency). Bytes per
//! element are the CPU's, measured by the worker's estimator; on CUDA they are measured on the
//! card and differ. The gateway's permit ceiling is raised (`gpu_permits.max` 256) so the
//! worker's admission, not the gateway, is what bounds concurrency.
//!
//! Knobs: `VRAMGATE_BENCH_CARD_SCALE`, `VRAMGATE_BENCH_CARD_EVENTS` (per run, default 160),
//! `VRAMGATE_BENCH_CARDS_GB` (default `8,16,24,32`), `VRAMGATE_BENCH_MODELS` (default `vad,pnet`).

use std::process::Command;

use anyhow::{ensure, Context};
use vramgate_tests::{
    binary, brokers, delete_topics, repo_root, env_or, gateway_base_env, image_task_env, scratch_dir, start_gateway, start_worker,
    unique, voice_task_env, worker_config, TaskTopics, PNET_MODEL, VAD_MODEL,
};

const GIB: u64 = 1 << 30;
const MIB: f64 = (1u64 << 20) as f64;

/// The largest value of `column` in a CSV time series, if it has one.
fn max_of(csv: &str, column: &str) -> Option<f64> {
    let mut lines = csv.lines();
    let at = lines.next()?.split(',').position(|c| c == column)?;
    lines.filter_map(|l| l.split(',').nth(at)?.parse::<f64>().ok()).reduce(f64::max)
}

async fn one(task: &str, card_gb: u64, scale: u64, events: u64) -> anyhow::Result<String> {
    let cap = card_gb * GIB / scale;
    let (model, other) = if task == "voice" { (VAD_MODEL, "TASKS__IMAGE__ENABLED") } else { (PNET_MODEL, "TASKS__VOICE__ENABLED") };
    let extra = format!("memory_limit_bytes = {cap}\nmemory_host_allowance_bytes = {}\n", 768u64 << 20);
    let worker = start_worker(&worker_config(&extra, &[model])).await?;
    let topics = TaskTopics::create(&format!("cards-{task}"), 3).await?;
    let root = scratch_dir("cards");
    let group = unique("cards");
    let mut env = gateway_base_env(&group, &worker.url, &root);
    env.extend(if task == "voice" { voice_task_env(&topics) } else { image_task_env(&topics) });
    env.push((other, "false".into()));
    let permits_max: &'static str = if task == "voice" { "TASKS__VOICE__GPU_PERMITS__MAX" } else { "TASKS__IMAGE__GPU_PERMITS__MAX" };
    env.push((permits_max, "256".into()));
    let gateway = start_gateway(&env).await?;
    let run = unique(&format!("cards-{task}-{card_gb}"));
    // Kept: each run's CSV, plot and summary, for the docs.
    let out = repo_root().join(".local/bench-cards");
    let base = topics.requests.strip_suffix(".requests").context("topics named BASE.requests")?;
    let output = Command::new(binary("vramgate-cli"))
        .args(["--brokers", &brokers(), "load", "--task", task, "--topic-base", &format!("{task}={base}")])
        .args(["--count", &events.to_string(), "--distinct", "12", "--voice-seconds", "1-30", "--image-sides", "64-2048"])
        .arg("--generate-into")
        .arg(root.join("inputs"))
        .args(["--group", &group, "--gateway-metrics", &gateway.metrics_url])
        .args(["--worker-metrics", &format!("{}/metrics", worker.url), "--sample-ms", "250"])
        .args(["--timeout-seconds", "900", "--run-id", &run, "--json"])
        .arg("--out")
        .arg(&out)
        .output()?;
    ensure!(
        output.status.success(),
        "load for {task} on {card_gb} GB failed: {}\n{}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&output.stdout)
    );
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let t = &summary["tasks"][0];
    let csv = std::fs::read_to_string(out.join(format!("{run}.csv")))?;
    let max = |c: &str| max_of(&csv, c).unwrap_or(f64::NAN);
    let _ = delete_topics(&[&topics.requests, &topics.results, &topics.dlq]).await;
    drop(gateway);
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
    Ok(format!(
        "{:<11} {:>5} GB {:>9.0} {:>9.0} {:>9.0} {:>8.0} {:>8.0} {:>8.1} {:>9.1} {:>5.0} {:>5} {:>5}",
        model.0,
        card_gb,
        cap as f64 / MIB,
        max("worker_budget_bytes") / MIB,
        max("worker_admitted_bytes") / MIB,
        max(&format!("gateway_worker_calls_{task}")),
        max("worker_queued_requests"),
        max("worker_batch_size_mean"),
        t["throughput_per_s"].as_f64().unwrap_or(f64::NAN),
        max("worker_oom_total"),
        t["dead_letters"],
        t["lost"],
    ))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let scale: u64 = env_or("VRAMGATE_BENCH_CARD_SCALE", 32);
    let events: u64 = env_or("VRAMGATE_BENCH_CARD_EVENTS", 160);
    let cards: Vec<u64> = std::env::var("VRAMGATE_BENCH_CARDS_GB")
        .unwrap_or_else(|_| "8,16,24,32".into())
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    let models = std::env::var("VRAMGATE_BENCH_MODELS").unwrap_or_else(|_| "vad,pnet".into());
    println!("Safe concurrency per card size on CPU: cap = card / {scale}, a burst of {events} events per run");
    println!("(each run's CSV, plot and summary: .local/bench-cards/)");
    println!(
        "{:<11} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>5} {:>5} {:>5}",
        "model", "card", "cap MiB", "budget", "admitted", "calls", "queued", "batch", "per s", "OOMs", "dead", "lost"
    );
    for (task, key) in [("voice", "vad"), ("image", "pnet")] {
        if !models.contains(key) {
            continue;
        }
        for &card in &cards {
            println!("{}", one(task, card, scale, events).await?);
        }
    }
    Ok(())
}
