//! Several workers behind one gateway, for the multi-worker tests (`tests/gateway_workers.rs`)
//! and the routing benchmark (`benches/workers.rs`): workers sized like cards of 1×, 2×, 4× one
//! memory budget, a mixed load of voice clips and images, and one run of that load through a
//! gateway with a given routing policy, reported per worker.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::images::{self, crowd, jpeg, picture, png};
use crate::wav::{compose, write_wav, SampleFormat};
use crate::{
    gateway_base_env, image_task_env, producer, request_file, request_inline, send_all, start_gateway, start_worker_on,
    unique, voice_task_env, worker_config, Collector, Gateway, TaskTopics, Worker, PNET_KEYS, VAD_KEYS,
};

/// One budget unit: a 1× card. A 320×320 image costs P-Net about 17 MB and a clip Silero 1–2
/// MB, so a 1× card admits one image and a few clips at once.
pub const UNIT_BUDGET: u64 = 40 * 1024 * 1024;

/// The worker config of a card of `scale` budget units: the budget is also its hard cap (on CPU
/// an address-space limit), each model has `scale` instances (a bigger card also computes
/// more), and the admission queue is short, so that a card sent more than it holds answers 503.
pub fn card_config(scale: u64) -> String {
    let budget = UNIT_BUDGET * scale;
    let extra = format!(
        "memory_budget_bytes = {budget}\nmemory_limit_bytes = {budget}\nmemory_reserve_bytes = 0\n\
         memory_reserve_fraction = 0.0\n[admission]\nmax_queued_requests = 2\nmax_queue_wait_ms = 250\n"
    );
    let instances = format!("instances = {}", scale.min(4));
    let vad = ("silero_vad", "silero_vad.jit", VAD_KEYS, instances.as_str());
    let pnet = ("mtcnn_pnet", "mtcnn_pnet.jit", PNET_KEYS, instances.as_str());
    worker_config(&extra, &[vad, pnet])
}

/// Starts one card per scale, each on its own loopback port.
pub async fn start_cards(scales: &[u64]) -> anyhow::Result<Vec<Worker>> {
    let mut workers = Vec::new();
    for &scale in scales {
        workers.push(start_worker_on(&card_config(scale), "127.0.0.1:0").await?);
    }
    Ok(workers)
}

/// A voice clip of 0.5 s to `longest` s of low noise (no espeak: many clips, made fast), at
/// one of a few rates, written under `root`.
pub fn voice_event(root: &Path, id: &str, i: usize, longest: f64) -> Vec<u8> {
    let seconds = 0.5 + (longest - 0.5).max(0.0) * ((i * 37) % 100) as f64 / 100.0;
    let rate = [16_000, 8_000, 22_050, 16_000][i % 4];
    let clip = compose(None, seconds / 2.0, seconds / 2.0, rate, 1, i as u64);
    let path = root.join(format!("clip-{i}.wav"));
    write_wav(&path, &clip.samples, rate, 1, SampleFormat::I16).expect("write wav");
    request_file(id, "voice", &path)
}

/// A small image, 64–240 px a side, PNG or JPEG, inline or as a file under `root`.
pub fn image_event(root: &Path, id: &str, i: usize) -> Vec<u8> {
    let w = 64 + ((i * 53) % 177) as u32;
    let h = 64 + ((i * 91) % 177) as u32;
    let img = if i % 3 == 0 { picture(w, h, i as u64) } else { crowd(w, h, 16.0 * w.max(h) as f32 / 320.0, i as u64) };
    let (bytes, ext) = if i % 2 == 0 { (png(&img), "png") } else { (jpeg(&img, 85), "jpg") };
    if i % 4 < 2 {
        request_inline(id, "image", &bytes)
    } else {
        request_file(id, "image", &images::write(root, &format!("img-{i}.{ext}"), &bytes))
    }
}

/// `count` voice and `count` image events; returns (voice, image) records.
pub fn mixed_events(root: &Path, count: usize) -> (Vec<(String, Vec<u8>)>, Vec<(String, Vec<u8>)>) {
    let mut voice = Vec::new();
    let mut image = Vec::new();
    for i in 0..count {
        let id = unique(&format!("v{i}"));
        voice.push((id.clone(), voice_event(root, &id, i, 8.0)));
        let id = unique(&format!("i{i}"));
        image.push((id.clone(), image_event(root, &id, i)));
    }
    (voice, image)
}

/// Gateway overrides for a voice and an image task on `topics`, calling `workers` with
/// `routing`, one CPU thread per task.
pub fn fleet_env(group: &str, workers: &[&Worker], routing: &str, root: &Path, voice: &TaskTopics, image: &TaskTopics) -> Vec<(&'static str, String)> {
    let urls: Vec<&str> = workers.iter().map(|w| w.url.as_str()).collect();
    let mut env = gateway_base_env(group, urls[0], root);
    env.extend([
        ("WORKER__URLS", urls.join(",")),
        ("WORKER__ROUTING", routing.to_string()),
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
        ("TASKS__IMAGE__CPU_THREADS", "1".into()),
    ]);
    env.extend(voice_task_env(voice));
    env.extend(image_task_env(image));
    env
}

/// What one worker did in a run, as the gateway counted it.
#[derive(Debug, Clone, Default)]
pub struct WorkerShare {
    pub url: String,
    pub calls: f64,
    pub throttled: f64,
    pub failed: f64,
    pub ejections: f64,
}

impl WorkerShare {
    /// Calls it answered with a result.
    pub fn completed(&self) -> f64 {
        self.calls - self.throttled - self.failed
    }
}

/// The gateway's per-worker counters, in the order of `urls`, summed over tasks.
pub async fn shares(gateway: &Gateway, urls: &[&str]) -> anyhow::Result<Vec<WorkerShare>> {
    let m = gateway.metrics().await?;
    Ok(urls
        .iter()
        .map(|url| {
            let at = [("worker", *url)];
            WorkerShare {
                url: url.to_string(),
                calls: m.sum("vramgate_gateway_worker_requests_total", &at),
                throttled: m.sum("vramgate_gateway_worker_throttled_total", &at),
                failed: m.sum("vramgate_gateway_worker_failures_total", &at),
                ejections: m.sum("vramgate_gateway_worker_ejections_total", &at),
            }
        })
        .collect())
}

/// OOM errors the workers counted.
pub async fn ooms(workers: &[&Worker]) -> f64 {
    let http = reqwest::Client::new();
    let mut total = 0.0;
    for w in workers {
        if let Ok(m) = crate::metrics::scrape(&http, &format!("{}/metrics", w.url)).await {
            total += m.sum("vramgate_worker_inference_oom_errors_total", &[]);
        }
    }
    total
}

/// The outcome of one run of a load through a gateway.
#[derive(Debug, Clone)]
pub struct Run {
    pub routing: String,
    pub events: usize,
    pub finished: bool,
    pub elapsed: Duration,
    pub results: usize,
    pub dead_letters: BTreeMap<String, usize>,
    pub lost: usize,
    pub shares: Vec<WorkerShare>,
    pub ooms: f64,
    /// p50 and p95 of the results' `timings_ms.total` (fetch to result), ms.
    pub p50_ms: f64,
    pub p95_ms: f64,
}

impl Run {
    pub fn throttled(&self) -> f64 {
        self.shares.iter().map(|s| s.throttled).sum()
    }

    /// Each worker's share of the completed calls, in percent.
    pub fn split(&self) -> Vec<f64> {
        let total: f64 = self.shares.iter().map(WorkerShare::completed).sum::<f64>().max(1.0);
        self.shares.iter().map(|s| 100.0 * s.completed() / total).collect()
    }

    pub fn print(&self, label: &str) {
        let split: Vec<String> = self.split().iter().map(|p| format!("{p:.0}%")).collect();
        let per: Vec<String> = self
            .shares
            .iter()
            .map(|s| format!("{:.0} ok / {:.0} throttled / {:.0} failed", s.completed(), s.throttled, s.failed))
            .collect();
        eprintln!(
            "{label}: routing {}: {} events in {:.1} s ({:.1}/s), results {}, dead letters {:?}, lost {}, \
             split {} ({}), 503s {:.0}, OOMs {:.0}, p50 {:.0} ms, p95 {:.0} ms",
            self.routing,
            self.events,
            self.elapsed.as_secs_f64(),
            self.events as f64 / self.elapsed.as_secs_f64().max(1e-9),
            self.results,
            self.dead_letters,
            self.lost,
            split.join(" / "),
            per.join("; "),
            self.throttled(),
            self.ooms,
            self.p50_ms,
            self.p95_ms
        );
    }
}

/// Sends `count` voice and `count` image events to fresh topics, runs one gateway with
/// `routing` over `workers` until every event has an output (or `timeout`), and reports.
pub async fn run_load(workers: &[&Worker], routing: &str, count: usize, root: &Path, timeout: Duration) -> anyhow::Result<Run> {
    let voice = TaskTopics::create(&format!("fleet-{routing}-v"), 4).await?;
    let image = TaskTopics::create(&format!("fleet-{routing}-i"), 4).await?;
    let (voice_records, image_records) = mixed_events(root, count);
    let ids: Vec<String> = voice_records.iter().chain(&image_records).map(|(id, _)| id.clone()).collect();
    let producer = producer();
    send_all(&producer, &voice.requests, &voice_records, 256).await?;
    send_all(&producer, &image.requests, &image_records, 256).await?;
    let collector = Collector::start(&[&voice.results, &voice.dlq, &image.results, &image.dlq])?;
    let ooms_before = ooms(workers).await;
    let env = fleet_env(&unique("gw"), workers, routing, root, &voice, &image);
    let mut gateway = start_gateway(&env).await?;
    let started = Instant::now();
    let wanted: HashSet<&String> = ids.iter().collect();
    let finished = collector
        .wait_until(timeout, |got| got.keys().filter(|id| wanted.contains(id)).count() >= ids.len())
        .await;
    let elapsed = started.elapsed();
    let urls: Vec<&str> = workers.iter().map(|w| w.url.as_str()).collect();
    let shares = shares(&gateway, &urls).await?;
    let ooms = ooms(workers).await - ooms_before;
    let records = collector.snapshot();
    let (mut results, mut dead_letters, mut lost, mut totals) = (0, BTreeMap::new(), 0, Vec::new());
    for id in &ids {
        let Some(got) = records.get(id) else {
            lost += 1;
            continue;
        };
        for r in got {
            if r.topic.ends_with(".dlq") {
                let kind = r.value["error"]["kind"].as_str().unwrap_or("?").to_string();
                *dead_letters.entry(kind).or_insert(0) += 1;
            } else {
                results += 1;
                totals.push(r.value["timings_ms"]["total"].as_f64().unwrap_or(f64::NAN));
            }
        }
    }
    totals.sort_by(f64::total_cmp);
    let at = |q: f64| totals.get(((totals.len() as f64 * q) as usize).min(totals.len().saturating_sub(1))).copied().unwrap_or(f64::NAN);
    let _ = gateway.service.terminate(Duration::from_secs(30)).await;
    Ok(Run {
        routing: routing.to_string(),
        events: ids.len(),
        finished,
        elapsed,
        results,
        dead_letters,
        lost,
        shares,
        ooms,
        p50_ms: at(0.5),
        p95_ms: at(0.95),
    })
}
