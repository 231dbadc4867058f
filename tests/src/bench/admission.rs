//! P1 of the pipeline benchmark, as functions that return their figures (the `admission` and
//! `pipeline` benches print them): the same burst of variable-size inputs through the real worker
//! under (a) a static count limit safe for the largest input, (b) every static count from 1 to
//! `VRAMGATE_BENCH_MAX_COUNT`, the best of which is reported, and (c) admission by bytes.
//!
//! The model is MTCNN's P-Net, whose activations grow with the image (about 39 bytes per
//! input element measured on CPU), on images from 160² to 1200² pixels. Every worker runs under
//! the same hard memory cap (`memory_limit_bytes`: on CPU an address-space limit), so a static
//! count that lets too many large images run at once meets real allocation failures. The
//! client behaves like the gateway: a bounded number of requests in flight, `Retry-After`
//! honoured on 503.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use tokio::sync::Semaphore;
use crate::oip_client::{infer, metric, metrics_text, test_image};
use crate::{env_or, proc_status_kib, start_worker, worker_config, PNET_KEYS};

struct Setup {
    sides: Vec<usize>,
    /// Generated before any run, so the client's own work stays out of the timings.
    images: Vec<Arc<[f32]>>,
    limit: u64,
    host_allowance: u64,
    instances: usize,
    in_flight: usize,
}

/// One run of the burst under one admission setting.
#[derive(Debug)]
pub struct Run {
    pub label: String,
    pub seconds: f64,
    pub ok: usize,
    pub failed: usize,
    pub ooms: f64,
    pub peak_mib: f64,
    pub crashed: bool,
}

impl Run {
    pub fn throughput(&self) -> f64 {
        self.ok as f64 / self.seconds
    }
}

async fn run_once(setup: &Setup, label: &str, admission: &str) -> anyhow::Result<Run> {
    let extra = format!(
        "memory_limit_bytes = {}\nmemory_host_allowance_bytes = {}\n[admission]\n{admission}\nmax_queue_wait_ms = 600000\nmax_queued_requests = 4096\n\
         [batching]\nwindow_ms = 2.0\nmax_batch_size = 8\n",
        setup.limit, setup.host_allowance
    );
    let model = format!("instances = {}\nmax_input_elements = 20000000", setup.instances);
    let config = worker_config(&extra, &[("pnet", "mtcnn_pnet.jit", PNET_KEYS, model.as_str())]);
    let mut worker = start_worker(&config).await?;
    let pid = worker.service.pid();
    let baseline_kib = proc_status_kib(pid, "VmRSS:").unwrap_or(0);
    let http = reqwest::Client::builder().pool_max_idle_per_host(256).build()?;
    let gate = Arc::new(Semaphore::new(setup.in_flight));
    let started = Instant::now();
    let calls = setup.sides.iter().zip(setup.images.iter()).map(|(&side, data)| {
        let (http, url, gate) = (http.clone(), worker.url.clone(), gate.clone());
        async move {
            let _permit = gate.acquire().await.expect("semaphore open");
            let mut transport_errors = 0;
            loop {
                match infer(&http, &url, "pnet", "image", vec![1, 3, side, side], data.to_vec(), None).await {
                    Ok(a) if a.status == 503 => {
                        tokio::time::sleep(Duration::from_secs(a.retry_after.unwrap_or(1).min(2))).await;
                    }
                    Ok(a) if a.status == 200 => return Ok(()),
                    Ok(a) => return Err(format!("{}: {}", a.status, a.error.unwrap_or_default())),
                    // A connection closed under us: retried like the gateway does, a few times.
                    Err(e) if transport_errors < 3 => {
                        transport_errors += 1;
                        eprintln!("  transport error, retrying: {e}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => return Err(format!("transport: {e}")),
                }
            }
        }
    });
    let results = join_all(calls).await;
    let seconds = started.elapsed().as_secs_f64();
    let crashed = !worker.service.is_running();
    let peak_kib = proc_status_kib(pid, "VmHWM:").unwrap_or(0);
    let ooms = match metrics_text(&http, &worker.url).await {
        Ok(text) => metric(&text, "inference_oom_errors_total{model=\"pnet\"}"),
        Err(_) => f64::NAN,
    };
    let ok = results.iter().filter(|r| r.is_ok()).count();
    let mut reasons: Vec<String> = results.iter().filter_map(|r| r.clone().err()).collect();
    reasons.sort();
    reasons.dedup();
    for reason in reasons.iter().take(3) {
        println!("  {label}: failure: {}", reason.chars().take(200).collect::<String>());
    }
    Ok(Run {
        label: label.into(),
        seconds,
        ok,
        failed: results.len() - ok,
        ooms,
        peak_mib: peak_kib.saturating_sub(baseline_kib) as f64 / 1024.0,
        crashed,
    })
}

/// The price byte admission puts on the largest image, and the budget, from a worker's
/// measured estimate: what a static count "safe for the largest input" must divide.
async fn safe_count(setup: &Setup) -> anyhow::Result<(u64, u64, u64)> {
    let extra = format!("memory_limit_bytes = {}\n", setup.limit);
    let config = worker_config(&extra, &[("pnet", "mtcnn_pnet.jit", PNET_KEYS, "max_input_elements = 20000000")]);
    let worker = start_worker(&config).await?;
    let http = reqwest::Client::new();
    let meta: serde_json::Value = http.get(format!("{}/v2/models/pnet", worker.url)).send().await?.json().await?;
    let est = &meta["parameters"]["memory_estimate"];
    let (a, b) = (est["base_bytes"].as_f64().unwrap_or(0.0), est["bytes_per_element"].as_f64().unwrap_or(0.0));
    tokio::time::sleep(Duration::from_millis(1200)).await; // one budget re-sample
    let budget = metric(&metrics_text(&http, &worker.url).await?, "gpu_memory_budget_bytes") as u64;
    let largest = *setup.sides.iter().max().unwrap_or(&0) as f64;
    let elements = 3.0 * largest * largest;
    let price = (a + b * elements) as u64;
    Ok(((budget / price.max(1)).max(1), price, budget))
}

/// P1's figures: the workload and the runs (a), (b) 1..=max, (c).
pub struct P1 {
    pub workload: String,
    pub safe: Run,
    pub statics: Vec<Run>,
    pub bytes: Run,
}

impl P1 {
    /// The best static count: the fastest run that lost nothing; `None` when every one lost
    /// requests (then no static count is safe for this burst).
    pub fn best_static(&self) -> Option<&Run> {
        self.statics
            .iter()
            .filter(|r| r.failed == 0 && !r.crashed)
            .max_by(|x, y| x.throughput().total_cmp(&y.throughput()))
    }
}

/// P1: `VRAMGATE_BENCH_REQUESTS` (default 96) P-Net images under each admission setting.
pub async fn p1() -> anyhow::Result<P1> {
    let count: usize = env_or("VRAMGATE_BENCH_REQUESTS", 96);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    // A fixed pseudo-random spread of sizes, the same for every run.
    let sides: Vec<usize> = (0..count).map(|i| 160 + (i * 7919 + 13) % 1041).collect();
    let images = sides.iter().enumerate().map(|(i, &side)| Arc::from(test_image(side, side, i))).collect();
    let setup = Setup {
        sides,
        images,
        limit: env_or("VRAMGATE_BENCH_LIMIT_BYTES", 340 << 20),
        host_allowance: env_or("VRAMGATE_BENCH_HOST_ALLOWANCE_BYTES", 256 << 20),
        instances: env_or("VRAMGATE_BENCH_INSTANCES", cores),
        in_flight: env_or("VRAMGATE_BENCH_IN_FLIGHT", 4),
    };
    let max_count: u64 = env_or("VRAMGATE_BENCH_MAX_COUNT", 6);
    let (safe, price, budget) = safe_count(&setup).await?;
    let workload = format!(
        "{count} P-Net images, sides 160..1200 px; memory cap {} MiB (budget {} MiB); largest image priced {} MiB; \
         {} model instances; {} requests in flight from the client",
        setup.limit >> 20,
        budget >> 20,
        price >> 20,
        setup.instances,
        setup.in_flight
    );
    eprintln!("P1 workload: {workload}");
    let a = run_once(&setup, &format!("(a) count {safe} (safe for largest)"), &format!("mode = \"count\"\nmax_concurrent = {safe}")).await?;
    let mut statics = Vec::new();
    for k in 1..=max_count {
        statics.push(run_once(&setup, &format!("(b) count {k}"), &format!("mode = \"count\"\nmax_concurrent = {k}")).await?);
    }
    let c = run_once(&setup, "(c) bytes", "mode = \"bytes\"").await?;
    Ok(P1 { workload, safe: a, statics, bytes: c })
}

/// Prints P1's runs and ratios.
pub fn print_p1(p1: &P1) {
    println!();
    println!("P1  byte admission vs static count limits: {}", p1.workload);
    println!("{:<34} {:>8} {:>9} {:>5} {:>7} {:>6} {:>10} {:>8}", "run", "seconds", "images/s", "ok", "failed", "OOMs", "peak MiB", "crashed");
    for r in std::iter::once(&p1.safe).chain(&p1.statics).chain([&p1.bytes]) {
        println!(
            "{:<34} {:>8.2} {:>9.2} {:>5} {:>7} {:>6} {:>10.0} {:>8}",
            r.label, r.seconds, r.throughput(), r.ok, r.failed, r.ooms, r.peak_mib, r.crashed
        );
    }
    let c = &p1.bytes;
    let lossless = |r: &Run| if r.failed == 0 && !r.crashed { "" } else { " (it lost requests)" };
    match p1.best_static() {
        Some(best) => println!("best static count: {}; c/b = {:.2} (target >= 0.9)", best.label, c.throughput() / best.throughput()),
        None => println!("best static count: none ran without losing requests"),
    }
    println!(
        "c/a = {:.2}{} (target >= 1.5); byte admission: {} failed, crashed {}, OOMs {}",
        c.throughput() / p1.safe.throughput(),
        lossless(&p1.safe),
        c.failed,
        c.crashed,
        c.ooms
    )
}
