//! Worker vs its ceiling: the same TorchScript file, input and torch thread count, run (1) in a
//! plain libtorch loop (`ai-worker/examples/raw_loop.rs`, a separate process, nothing of
//! vramgate around it) and (2) through a real `ai-worker` called directly over OIP (binary
//! tensors), at several client concurrencies. Figures only: nothing here asserts on time.
//!
//! [`worker_vs_raw`] runs every case of [`CeilingOptions`] and returns one [`CeilingRow`] per
//! case; [`print_table`] prints them. `tests/benches/ceiling.rs` is the command-line front;
//! other benchmarks (the whole-pipeline one) can call the same functions and reuse the rows.
//!
//! Both sides are timed the same way: after a warm-up, calls are counted for a fixed time and
//! the rate is items (images or clips) per second. Raw and worker figures of a case are taken
//! in turn, several rounds, and each side's best round counts (other load on a shared machine
//! only ever slows a figure down). The worker is one process serving both
//! models with one instance each and `torch_threads = 1` (the raw loop's thread count); its
//! batching is its own default. The client calls it as the gateway does (binary input, every
//! output asked for as a binary tensor) and pre-encodes each request body once, so its own
//! work per call is HTTP alone (the body is shared `Bytes`, not copied), not an encode.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use vramgate_shared::oip::{self, RequestOutputSpec, Tensor};

use crate::oip_client::{test_audio, test_image};
use crate::{cpu_seconds, repo_root, start_worker, worker_config, Worker, PNET_KEYS, VAD_KEYS};

/// Which of the worker's models a case runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CeilingModel {
    /// MTCNN P-Net (`models/mtcnn_pnet.jit`), one image `[1, 3, H, W]` per request.
    Pnet,
    /// Silero VAD (`models/silero_vad.jit`), one clip `[1, samples]` at 16 kHz per request.
    SileroVad,
    /// torchvision's MobileNetV2 of the model repository (`models/repository/mobilenet_v2`),
    /// one 224×224 RGB crop as bytes, `[1, 224, 224, 3]` UINT8, per request.
    MobileNetV2,
}

/// The worker's MobileNetV2, as its repository's `config.toml` declares it.
const MOBILENET_KEYS: &str = "input = { name = \"image\", datatype = \"UINT8\", shape = [-1, 224, 224, 3] }\n\
    outputs = [{ name = \"logits\", shape = [-1, 1000] }]";

impl CeilingModel {
    /// The model's name in the worker config and in the table.
    pub fn name(self) -> &'static str {
        match self {
            CeilingModel::Pnet => "mtcnn_pnet",
            CeilingModel::SileroVad => "silero_vad",
            CeilingModel::MobileNetV2 => "mobilenet_v2",
        }
    }

    /// Under `models/`.
    fn file(self) -> &'static str {
        match self {
            CeilingModel::Pnet => "mtcnn_pnet.jit",
            CeilingModel::SileroVad => "silero_vad.jit",
            CeilingModel::MobileNetV2 => "repository/mobilenet_v2/model.pt",
        }
    }

    /// Whether it takes bytes (UINT8), not FP32.
    pub fn takes_bytes(self) -> bool {
        self == CeilingModel::MobileNetV2
    }

    /// The `raw_loop` arguments that call it as its declared keys say.
    fn raw_loop_call(self) -> &'static [&'static str] {
        match self {
            CeilingModel::Pnet => &["--method", "forward"],
            CeilingModel::SileroVad => &["--method", "audio_forward", "--args", "16000"],
            CeilingModel::MobileNetV2 => &["--method", "forward", "--dtype", "u8"],
        }
    }

    /// Its declared keys, as config/worker.toml declares it.
    fn keys(self) -> &'static str {
        match self {
            CeilingModel::Pnet => PNET_KEYS,
            CeilingModel::SileroVad => VAD_KEYS,
            CeilingModel::MobileNetV2 => MOBILENET_KEYS,
        }
    }

    fn input(self) -> &'static str {
        match self {
            CeilingModel::Pnet | CeilingModel::MobileNetV2 => "image",
            CeilingModel::SileroVad => "audio",
        }
    }

    /// The model's outputs, all asked for as binary tensors (as the gateway asks).
    fn outputs(self) -> &'static [&'static str] {
        match self {
            CeilingModel::Pnet => &["face_prob", "box_offsets"],
            CeilingModel::SileroVad => &["speech_prob"],
            CeilingModel::MobileNetV2 => &["logits"],
        }
    }

    /// What one item is called in the table.
    pub fn unit(self) -> &'static str {
        match self {
            CeilingModel::Pnet | CeilingModel::MobileNetV2 => "images/s",
            CeilingModel::SileroVad => "clips/s",
        }
    }
}

/// One input the model is measured on.
#[derive(Debug, Clone)]
pub struct CeilingCase {
    pub model: CeilingModel,
    /// For the table: `320x320`, `5 s`.
    pub label: String,
    /// One request's input shape (batch dimension 1).
    pub shape: Vec<usize>,
}

impl CeilingCase {
    /// A P-Net image of `height` × `width` pixels.
    pub fn image(height: usize, width: usize) -> Self {
        CeilingCase { model: CeilingModel::Pnet, label: format!("{height}x{width}"), shape: vec![1, 3, height, width] }
    }

    /// A Silero clip of `seconds` at 16 kHz.
    pub fn clip(seconds: usize) -> Self {
        CeilingCase { model: CeilingModel::SileroVad, label: format!("{seconds} s"), shape: vec![1, seconds * 16_000] }
    }

    /// A MobileNetV2 crop: 224×224 RGB bytes, NHWC.
    pub fn crop() -> Self {
        CeilingCase { model: CeilingModel::MobileNetV2, label: "224x224 u8".into(), shape: vec![1, 224, 224, 3] }
    }

    /// The deterministic input data, the same the tests use ([`test_image`], [`test_audio`]);
    /// for a model that takes bytes, values in [-0.5, 0.5] that [`as_byte`] maps to 0..=255
    /// (as `raw_loop --dtype u8` does).
    pub fn data(&self) -> Vec<f32> {
        match self.model {
            CeilingModel::Pnet => test_image(self.shape[2], self.shape[3], 1),
            CeilingModel::SileroVad => test_audio(self.shape[1], 1),
            CeilingModel::MobileNetV2 => (0..self.shape.iter().product::<usize>()).map(|i| ((i % 997) as f32 / 997.0) - 0.5).collect(),
        }
    }
}

/// What [`worker_vs_raw`] measures.
#[derive(Debug, Clone)]
pub struct CeilingOptions {
    pub cases: Vec<CeilingCase>,
    /// Client concurrencies the worker is measured at (requests in flight).
    pub concurrency: Vec<usize>,
    /// Seconds each figure is timed for (after a warm-up).
    pub seconds: f64,
    /// libtorch threads, for the raw loop and the worker alike.
    pub torch_threads: usize,
    /// Extra top-level TOML for the worker config (e.g. a `[batching]` table); empty: defaults.
    pub worker_extra: String,
    /// Each figure is measured this many times, alternating raw and worker; the best counts.
    pub rounds: usize,
    /// Also time the raw loop with one more CPU kept busy ([`CeilingRow::raw_busy_per_s`]).
    pub busy_raw: bool,
}

impl CeilingOptions {
    /// P-Net at 160×160, 320×320 and 480×640; Silero on clips of 1, 5 and 30 s; concurrency 1
    /// and 8; 4 s per figure, best of 2 rounds; one torch thread. Environment overrides:
    /// `VRAMGATE_BENCH_SECONDS`, `VRAMGATE_BENCH_CONCURRENCY` (comma-separated),
    /// `VRAMGATE_BENCH_MODELS` (`pnet`, `vad`, `mobilenet`, comma-separated; default `pnet,vad`),
    /// `VRAMGATE_BENCH_PNET_SIZES` (P-Net's `HxW` sizes, comma-separated),
    /// `VRAMGATE_BENCH_WORKER_EXTRA` (lines for the worker's configuration; `\n` between
    /// them), `VRAMGATE_BENCH_ROUNDS`
    /// (default 2), `VRAMGATE_BENCH_BUSY_RAW` (`0` leaves out the raw loop with one more CPU
    /// kept busy; default on).
    pub fn from_env() -> Self {
        let seconds = std::env::var("VRAMGATE_BENCH_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(4.0);
        let rounds = std::env::var("VRAMGATE_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
        let concurrency = std::env::var("VRAMGATE_BENCH_CONCURRENCY")
            .ok()
            .map(|v| v.split(',').filter_map(|c| c.trim().parse().ok()).collect::<Vec<usize>>())
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| vec![1, 8]);
        let models = std::env::var("VRAMGATE_BENCH_MODELS").unwrap_or_else(|_| "pnet,vad".into());
        let mut cases = Vec::new();
        if models.contains("pnet") {
            cases.extend(pnet_sizes(std::env::var("VRAMGATE_BENCH_PNET_SIZES").ok().as_deref()));
        }
        if models.contains("vad") {
            cases.extend([CeilingCase::clip(1), CeilingCase::clip(5), CeilingCase::clip(30)]);
        }
        if models.contains("mobilenet") {
            cases.push(CeilingCase::crop());
        }
        let busy_raw = std::env::var("VRAMGATE_BENCH_BUSY_RAW").map_or(true, |v| v != "0");
        // Lines appended to the worker's configuration, for a diagnostic run (e.g.
        // `memory_measure_every_batches = 0`).
        let worker_extra = std::env::var("VRAMGATE_BENCH_WORKER_EXTRA").unwrap_or_default().replace("\\n", "\n");
        CeilingOptions { cases, concurrency, seconds, torch_threads: 1, worker_extra, rounds, busy_raw }
    }
}

/// P-Net's cases: `HxW` sizes, comma-separated (`VRAMGATE_BENCH_PNET_SIZES`); unset, empty or
/// without one valid size, 160×160, 320×320 and 480×640. A size outside 12..=2048 a side is
/// left out (P-Net needs 12 pixels; the worker's input bound is 20 M values).
fn pnet_sizes(list: Option<&str>) -> Vec<CeilingCase> {
    let parsed: Vec<CeilingCase> = list
        .unwrap_or_default()
        .split(',')
        .filter_map(|s| {
            let (h, w) = s.trim().split_once('x')?;
            let (h, w) = (h.parse::<usize>().ok()?, w.parse::<usize>().ok()?);
            ((12..=2048).contains(&h) && (12..=2048).contains(&w)).then(|| CeilingCase::image(h, w))
        })
        .collect();
    if parsed.is_empty() {
        vec![CeilingCase::image(160, 160), CeilingCase::image(320, 320), CeilingCase::image(480, 640)]
    } else {
        parsed
    }
}

/// One case's figures: the raw loop's rate and the worker's at each concurrency.
#[derive(Debug, Clone)]
pub struct CeilingRow {
    pub case: CeilingCase,
    /// Items per second of the plain libtorch loop (batch 1), best round.
    pub raw_per_s: f64,
    /// The same loop while one more thread spins on another CPU (`raw_loop --busy-cpus 1`),
    /// best round; `None` when not measured. Not the target's baseline: it shows what work on
    /// another CPU (the worker's request path, the client) costs the model on this machine.
    pub raw_busy_per_s: Option<f64>,
    /// `(concurrency, items per second)` of the worker over OIP, best round.
    pub worker_per_s: Vec<(usize, f64)>,
    /// Requests that did not answer 200 during the worker runs (must be 0).
    pub failed: u64,
}

impl CeilingRow {
    /// Worker over raw at `concurrency`, if it was measured.
    pub fn ratio(&self, concurrency: usize) -> Option<f64> {
        self.worker_per_s.iter().find(|(c, _)| *c == concurrency).map(|(_, r)| r / self.raw_per_s)
    }

    /// The smallest worker/raw ratio of the row.
    pub fn worst_ratio(&self) -> f64 {
        self.worker_per_s.iter().map(|(_, r)| r / self.raw_per_s).fold(f64::INFINITY, f64::min)
    }
}

/// The raw loop binary, built by `cargo build --release -p vramgate-worker --examples`.
pub fn raw_loop_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    // target/<profile>/deps/<bench>-<hash>
    let profile_dir = exe.parent().and_then(|p| p.parent()).context("target/<profile>/deps layout")?;
    let path = profile_dir.join("examples").join("raw_loop");
    if !path.is_file() {
        bail!(
            "{} is not built; run `cargo build --release -p vramgate-worker --bins --examples` first",
            path.display()
        );
    }
    Ok(path)
}

/// What one run of the raw loop measured.
#[derive(Debug, Clone, Copy)]
pub struct RawFigures {
    pub items_per_s: f64,
    /// The loop thread's time on a CPU per item, ms.
    pub on_cpu_ms_per_item: f64,
    /// The loop thread's time waiting for a CPU (runqueue) per item, ms: other load.
    pub runqueue_ms_per_item: f64,
}

/// A case's input as the raw loop reads it (little-endian `f32` in a scratch file, so both
/// sides get the same numbers), written once per case; the folder goes when it drops.
pub struct RawInput {
    dir: PathBuf,
    path: PathBuf,
}

impl RawInput {
    /// The file `raw_loop --input` reads.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    pub fn write(data: &[f32]) -> anyhow::Result<Self> {
        let dir = crate::scratch_dir("ceiling");
        let path = dir.join("input.f32");
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&path, bytes)?;
        Ok(RawInput { dir, path })
    }
}

impl Drop for RawInput {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs the plain libtorch loop on `case`'s `input`, with `busy_cpus` more threads spinning
/// beside it (0: the loop alone).
pub fn raw_rate(case: &CeilingCase, input: &RawInput, seconds: f64, threads: usize, busy_cpus: usize) -> anyhow::Result<RawFigures> {
    let shape = case.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
    let output = std::process::Command::new(raw_loop_binary()?)
        .args(case.model.raw_loop_call())
        .args(["--shape", &shape, "--json"])
        .arg("--model")
        .arg(repo_root().join("models").join(case.model.file()))
        .arg("--input")
        .arg(&input.path)
        .args(["--threads", &threads.to_string(), "--seconds", &seconds.to_string()])
        .args(["--busy-cpus", &busy_cpus.to_string()])
        .output()
        .context("running raw_loop")?;
    if !output.status.success() {
        bail!("raw_loop failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    let line = String::from_utf8_lossy(&output.stdout);
    let json: serde_json::Value = serde_json::from_str(line.trim()).with_context(|| format!("raw_loop printed {line}"))?;
    Ok(RawFigures {
        items_per_s: json["items_per_s"].as_f64().context("raw_loop printed no items_per_s")?,
        on_cpu_ms_per_item: json["on_cpu_ms_per_item"].as_f64().unwrap_or(f64::NAN),
        runqueue_ms_per_item: json["runqueue_ms_per_item"].as_f64().unwrap_or(f64::NAN),
    })
}

/// Nanoseconds on a CPU and waiting on a runqueue, summed over the worker's batch threads of
/// `model` (`/proc/PID/task/*/schedstat`; thread names are cut to 15 bytes there).
fn batch_threads_schedstat(pid: u32, model: CeilingModel) -> (u64, u64) {
    let name = format!("batch-{}", model.name());
    let prefix = &name[..name.len().min(15)];
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return (0, 0) };
    let mut total = (0, 0);
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.trim_end().starts_with(prefix) {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        let mut fields = stat.split_whitespace().map(|f| f.parse::<u64>().unwrap_or(0));
        total.0 += fields.next().unwrap_or(0);
        total.1 += fields.next().unwrap_or(0);
    }
    total
}

/// Starts a worker serving both models the way the benchmark measures them.
pub async fn start_ceiling_worker(options: &CeilingOptions) -> anyhow::Result<Worker> {
    let models: Vec<(&str, &str, &str, &str)> = [CeilingModel::Pnet, CeilingModel::SileroVad, CeilingModel::MobileNetV2]
        .into_iter()
        .filter(|m| options.cases.iter().any(|c| c.model == *m))
        .map(|m| (m.name(), m.file(), m.keys(), "max_input_elements = 20000000"))
        .collect();
    // Its gRPC door too, for P2's pipeline over gRPC.
    let extra = format!("grpc_listen = \"127.0.0.1:0\"\n{}\n", options.worker_extra);
    let mut config = worker_config(&extra, &models);
    config = config.replacen("torch_threads = 1", &format!("torch_threads = {}", options.torch_threads), 1);
    start_worker(&config).await
}

/// A value of [`CeilingCase::data`] as the byte a model that takes bytes gets, the way
/// `raw_loop --dtype u8` makes it.
pub fn as_byte(v: f32) -> u8 {
    ((v + 0.5).clamp(0.0, 1.0) * 255.0) as u8
}

/// Calls the worker with `concurrency` requests in flight, each the same pre-encoded body, for
/// `seconds`; returns (answers per second, requests that did not answer 200).
pub async fn worker_rate(
    url: &str,
    case: &CeilingCase,
    data: &[f32],
    concurrency: usize,
    seconds: f64,
) -> anyhow::Result<(f64, u64)> {
    let tensor = if case.model.takes_bytes() {
        Tensor::new(case.model.input(), case.shape.clone(), data.iter().copied().map(as_byte).collect::<Vec<u8>>())
    } else {
        Tensor::new(case.model.input(), case.shape.clone(), data.to_vec())
    };
    let outputs: Vec<RequestOutputSpec> = case.model.outputs().iter().map(|&n| RequestOutputSpec::binary(n)).collect();
    let (body, header_len) = oip::encode_request(None, &[tensor], true, &outputs);
    let endpoint = format!("{url}/v2/models/{}/infer", case.model.name());
    let what = format!("{} {}", case.model.name(), case.label);
    saturate(&endpoint, bytes::Bytes::from(body), header_len, concurrency, seconds, &what).await
}

/// Keeps `concurrency` calls of `body` (a binary OIP request whose JSON header is `header_len`
/// bytes) to `endpoint` in flight for `seconds`, each client a task of its own, after a
/// warm-up; returns (answers per second, calls that did not answer 200). `what` names the
/// request in a warm-up's failure. Each call sends the same `Bytes` (shared, not copied), so
/// the client's work per call is HTTP's alone.
pub async fn saturate(
    endpoint: &str,
    body: bytes::Bytes,
    header_len: Option<usize>,
    concurrency: usize,
    seconds: f64,
    what: &str,
) -> anyhow::Result<(f64, u64)> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(concurrency.max(1) * 2).build()?;
    let call = {
        let (http, endpoint, body) = (http.clone(), endpoint.to_string(), body.clone());
        move || {
            let mut request = http.post(&endpoint).body(body.clone()).timeout(Duration::from_secs(300));
            if let Some(len) = header_len {
                request = request.header(oip::INFERENCE_HEADER_CONTENT_LENGTH, len.to_string());
            }
            async move {
                let response = request.send().await?;
                let ok = response.status().is_success();
                let _ = response.bytes().await?;
                anyhow::Ok(ok)
            }
        }
    };
    // Warm-up: every connection opened, every batch size the worker may choose seen once, at
    // the concurrency that is timed (`concurrency` clients, two calls each). More at once would
    // leave the worker expecting overlapping requests for its `OVERLAP_MEMORY` (1 s) into the
    // timed run, and a lone client's requests would wait the batching window meanwhile: a
    // state the warm-up made, not one a lone client's traffic brings.
    let chain = || {
        let call = call.clone();
        async move {
            for _ in 0..2 {
                if !call().await? {
                    bail!("the server refused a warm-up request for {what}");
                }
            }
            anyhow::Ok(())
        }
    };
    for warmed in futures::future::join_all((0..concurrency.max(1)).map(|_| chain())).await {
        warmed?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (done, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let started = Instant::now();
    let clients: Vec<_> = (0..concurrency.max(1))
        .map(|_| {
            let (stop, done, failed, call) = (stop.clone(), done.clone(), failed.clone(), call.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    match call().await {
                        Ok(true) => done.fetch_add(1, Ordering::Relaxed),
                        _ => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await?;
    }
    // Calls that finished after the stop flag count, and so does the time they took.
    let elapsed = started.elapsed().as_secs_f64();
    Ok((done.load(Ordering::Relaxed) as f64 / elapsed, failed.load(Ordering::Relaxed)))
}

/// Measures every case of `options`: per case, the raw loop and then the worker at each
/// concurrency, `rounds` times in turn, keeping each figure's best round. Measuring the two
/// sides next to each other, and more than once, keeps other load on a shared machine from
/// landing on one side only. The worker idles (one memory re-sample a second) while the raw
/// loop runs.
pub async fn worker_vs_raw(options: &CeilingOptions) -> anyhow::Result<Vec<CeilingRow>> {
    let worker = start_ceiling_worker(options).await?;
    let mut rows = Vec::new();
    for case in &options.cases {
        let data = case.data();
        let input = RawInput::write(&data)?;
        let mut row = CeilingRow {
            case: case.clone(),
            raw_per_s: 0.0,
            raw_busy_per_s: None,
            worker_per_s: options.concurrency.iter().map(|&c| (c, 0.0)).collect(),
            failed: 0,
        };
        for round in 1..=options.rounds.max(1) {
            let raw = raw_rate(case, &input, options.seconds, options.torch_threads, 0)?;
            row.raw_per_s = row.raw_per_s.max(raw.items_per_s);
            print_raw(round, case, "raw", &raw);
            if options.busy_raw {
                let busy = raw_rate(case, &input, options.seconds, options.torch_threads, 1)?;
                row.raw_busy_per_s = Some(row.raw_busy_per_s.unwrap_or(0.0).max(busy.items_per_s));
                print_raw(round, case, "raw busy", &busy);
            }
            for (c, best) in row.worker_per_s.iter_mut() {
                let before = model_time(&worker.url, case.model).await;
                let sched_before = batch_threads_schedstat(worker.service.pid(), case.model);
                let cpu_before = cpu_seconds(worker.service.pid());
                let (rate, failed) = worker_rate(&worker.url, case, &data, *c, options.seconds).await?;
                let cpu = cpu_seconds(worker.service.pid()) - cpu_before;
                let sched = batch_threads_schedstat(worker.service.pid(), case.model);
                let after = model_time(&worker.url, case.model).await;
                *best = best.max(rate);
                row.failed += failed;
                // The worker's own figures over the run (warm-up included): time inside the
                // model per item, items per batch, its batch thread's time on a CPU and waiting
                // for one, per item, and the whole worker's time on a CPU per item (the HTTP
                // threads' and the batch thread's together: what a change to the request path
                // costs or saves, wherever it moves the work).
                let (seconds, batches, items) = (after.0 - before.0, after.1 - before.1, after.2 - before.2);
                let per_item = |ns: u64| ns as f64 / 1e6 / items.max(1.0);
                eprintln!(
                    "  round {round} {:<10} {:<8} worker c={c:<2} {rate:>9.1} {} ({:.2}x this round's raw); \
                     in the model {:.2} ms per item, {:.1} items per batch; batch thread {:.2} ms on a CPU, \
                     {:.2} ms waiting for one per item; worker {:.2} ms on a CPU per item",
                    case.model.name(),
                    case.label,
                    case.model.unit(),
                    rate / raw.items_per_s,
                    1000.0 * seconds / items.max(1.0),
                    items / batches.max(1.0),
                    per_item(sched.0.saturating_sub(sched_before.0)),
                    per_item(sched.1.saturating_sub(sched_before.1)),
                    1000.0 * cpu / items.max(1.0),
                );
            }
        }
        rows.push(row);
    }
    if let Ok(text) = crate::oip_client::metrics_text(&reqwest::Client::new(), &worker.url).await {
        for line in text.lines().filter(|l| l.starts_with("vramgate_worker_batch_size_limit")) {
            eprintln!("  {line}");
        }
    }
    Ok(rows)
}

fn print_raw(round: usize, case: &CeilingCase, label: &str, raw: &RawFigures) {
    eprintln!(
        "  round {round} {:<10} {:<8} {label:<10} {:>9.1} {}; loop thread {:.2} ms on a CPU, {:.2} ms waiting for one per item",
        case.model.name(),
        case.label,
        raw.items_per_s,
        case.model.unit(),
        raw.on_cpu_ms_per_item,
        raw.runqueue_ms_per_item
    );
}

/// The worker's `inference_duration_seconds` sum and count and `inference_batch_size` sum for
/// `model` (zeros when the metrics cannot be read).
async fn model_time(url: &str, model: CeilingModel) -> (f64, f64, f64) {
    let Ok(text) = crate::oip_client::metrics_text(&reqwest::Client::new(), url).await else { return (0.0, 0.0, 0.0) };
    let name = model.name();
    (
        crate::oip_client::metric(&text, &format!("inference_duration_seconds_sum{{model=\"{name}\"}}")),
        crate::oip_client::metric(&text, &format!("inference_duration_seconds_count{{model=\"{name}\"}}")),
        crate::oip_client::metric(&text, &format!("inference_batch_size_sum{{model=\"{name}\"}}")),
    )
}

/// Prints the rows as a table: raw rate, worker rate per concurrency, and worker/raw.
pub fn print_table(rows: &[CeilingRow]) {
    let Some(first) = rows.first() else { return };
    let mut header = format!("{:<11} {:<9} {:>12}", "model", "input", "raw loop");
    for (c, _) in &first.worker_per_s {
        header.push_str(&format!(" {:>12} {:>7}", format!("worker c={c}"), "ratio"));
    }
    header.push_str(&format!(" {:>7}  unit", "failed"));
    println!("{header}");
    for row in rows {
        let mut line = format!("{:<11} {:<9} {:>12.1}", row.case.model.name(), row.case.label, row.raw_per_s);
        for (_, rate) in &row.worker_per_s {
            line.push_str(&format!(" {:>12.1} {:>6.2}x", rate, rate / row.raw_per_s));
        }
        line.push_str(&format!(" {:>7}  {}", row.failed, row.case.model.unit()));
        println!("{line}");
    }
    let worst = rows.iter().map(CeilingRow::worst_ratio).fold(f64::INFINITY, f64::min);
    println!("worst worker/raw ratio: {worst:.2} (target >= 0.9)");
    let busy: Vec<f64> = rows.iter().filter_map(|r| r.raw_busy_per_s.map(|b| b / r.raw_per_s)).collect();
    if !busy.is_empty() {
        let (low, high) = busy.iter().fold((f64::INFINITY, 0.0f64), |(l, h), &b| (l.min(b), h.max(b)));
        println!(
            "the raw loop with one more CPU kept busy ran at {low:.2}-{high:.2}x of its rate alone: what work beside the \
             model (the worker's request path, the client) can cost it on this machine"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pnet_sizes_come_from_the_list_or_default_to_three() {
        let labels = |list: Option<&str>| pnet_sizes(list).into_iter().map(|c| c.label).collect::<Vec<_>>();
        assert_eq!(labels(None), ["160x160", "320x320", "480x640"]);
        assert_eq!(labels(Some("")), ["160x160", "320x320", "480x640"]);
        assert_eq!(labels(Some("320x320")), ["320x320"]);
        assert_eq!(pnet_sizes(Some(" 240x320 "))[0].shape, [1, 3, 240, 320]);
        // Too small for P-Net, too large for the worker's bound, or not a size: left out.
        assert_eq!(labels(Some("10x10, 480x640, 5000x5000, big")), ["480x640"]);
        assert_eq!(labels(Some("nonsense")), ["160x160", "320x320", "480x640"]);
    }
}
