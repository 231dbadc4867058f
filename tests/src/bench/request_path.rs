//! The worker's request path against its bounds (`scripts/bench request-path`): where a
//! request's time goes when the model costs almost nothing.
//!
//! A *null model* has P-Net's shapes at 480² (`[1, 3, 480, 480]` FP32 in; `[1, 4, 235, 235]`
//! and `[1, 2, 235, 235]` out: 2.7 MB in, 1.3 MB out) and does no arithmetic: its outputs are
//! slices of its input, copied. Three servers answer the same request body from the same
//! client (a task per request in flight, every body encoded once):
//!
//! 1. the real `ai-worker` serving the null model (one instance, one torch thread, its own
//!    batching), as the gateway calls it: binary input, binary outputs;
//! 2. a bare axum server (`tests/src/bin/bare-oip-server.rs`) that reads each body whole and
//!    answers the bytes of one answer the worker gave, with the same headers: what any server
//!    in the worker's place must do, and the client's ceiling;
//! 3. the null model in the plain libtorch loop (`raw_loop`, batch 1), for scale.
//!
//! At each number of requests in flight (1, 4, 16, 64; `VRAMGATE_BENCH_CONCURRENCY`) the bare
//! server and the worker are timed in turn, `VRAMGATE_BENCH_ROUNDS` rounds (default 2; each
//! side's best round counts) of `VRAMGATE_BENCH_SECONDS` (default 4). Printed per row:
//! requests a second, the worker ÷ bare ratio, the CPU milliseconds each server spent per
//! request (and per MB in), the client's, and the worker's time per request in each phase of
//! its handler (`request_phase_seconds`: body, decode, infer, encode) and per batch in each
//! phase of the model call (`inference_phase_seconds`: inputs, to_device, model, outputs).
//! A last row sends the same picture as UINT8 bytes (0.7 MB) to a model folder that declares
//! `from_uint8`, normalised in the worker after the copy. Figures only: nothing is asserted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use vramgate_shared::oip::{self, RequestOutputSpec, Tensor};
use vramgate_shared::prom_text;

use crate::ceiling::{raw_loop_binary, saturate, RawInput};
use crate::oip_client::test_image;
use crate::{binary, cpu_seconds, scratch_dir, start_worker, venv_python, Service, Worker};

/// The null model's input side.
pub const SIDE: usize = 480;
/// Its outputs' side (P-Net's map of a 480² picture).
pub const MAP: usize = 235;

/// What a run measures: requests in flight, seconds per figure, rounds.
#[derive(Debug, Clone)]
pub struct Options {
    pub concurrency: Vec<usize>,
    pub seconds: f64,
    pub rounds: usize,
}

impl Options {
    pub fn from_env() -> Options {
        let var = |k: &str| std::env::var(k).ok();
        let concurrency = var("VRAMGATE_BENCH_CONCURRENCY")
            .map(|v| v.split(',').filter_map(|c| c.trim().parse().ok()).collect())
            .unwrap_or_else(|| vec![1, 4, 16, 64]);
        let seconds = var("VRAMGATE_BENCH_SECONDS").and_then(|v| v.parse().ok()).unwrap_or(4.0);
        let rounds = var("VRAMGATE_BENCH_ROUNDS").and_then(|v| v.parse().ok()).unwrap_or(2);
        Options { concurrency, seconds, rounds }
    }
}

/// One server's figures at one concurrency.
#[derive(Debug, Clone, Copy, Default)]
pub struct Side {
    pub per_s: f64,
    /// The server's CPU milliseconds per request.
    pub server_cpu_ms: f64,
    /// The client's (this process's) CPU milliseconds per request.
    pub client_cpu_ms: f64,
    pub failed: u64,
}

/// The worker's mean milliseconds per request in each handler phase and per batch in each
/// model phase, and its mean batch (requests), over one timed run.
#[derive(Debug, Clone, Default)]
pub struct Phases {
    pub request_ms: Vec<(String, f64)>,
    pub batch_ms: Vec<(String, f64)>,
    pub mean_batch: f64,
}

/// One row: a concurrency (and what was sent), both servers, the worker's phases.
#[derive(Debug, Clone)]
pub struct Row {
    pub what: &'static str,
    pub concurrency: usize,
    pub bare: Side,
    pub worker: Side,
    pub phases: Phases,
}

const HANDLER_PHASES: [&str; 4] = ["body", "decode", "infer", "encode"];
const BATCH_PHASES: [&str; 4] = ["inputs", "to_device", "model", "outputs"];

/// Writes the null model (TorchScript, by the venv's torch) into `dir`.
fn null_model(dir: &Path) -> anyhow::Result<PathBuf> {
    let path = dir.join("null.pt");
    let script = format!(
        "import sys, torch\n\
         class Null(torch.nn.Module):\n\
         \x20   def forward(self, x):\n\
         \x20       y = x[:, :1, :{MAP}, :{MAP}]\n\
         \x20       return y.expand(-1, 4, -1, -1).contiguous(), y.expand(-1, 2, -1, -1).contiguous()\n\
         torch.jit.script(Null()).save(sys.argv[1])\n"
    );
    // TorchScript compiles from source: the script must be a file.
    let source = dir.join("null_model.py");
    std::fs::write(&source, script)?;
    let out = std::process::Command::new(venv_python()).arg(&source).arg(&path).output().context("running python")?;
    if !out.status.success() {
        bail!("writing the null model failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(path)
}

/// The worker's config: the null model twice, as FP32 and as a folder that takes bytes.
fn null_worker_config(model: &Path) -> String {
    let outputs = format!(
        "outputs = [ {{ name = \"box_offsets\", shape = [-1, 4, {MAP}, {MAP}] }}, {{ name = \"probs\", shape = [-1, 2, {MAP}, {MAP}] }} ]"
    );
    let mut config = String::from("listen = \"127.0.0.1:0\"\ndevice = \"cpu\"\ntorch_threads = 1\n");
    for (name, from) in [("null", ""), ("null_bytes", ", from_uint8 = { scale = 0.0078125, offset = -0.99609375 }")] {
        config.push_str(&format!(
            "\n[[models]]\nname = \"{name}\"\npath = \"{}\"\nmax_input_elements = 50000000\n\
             input = {{ name = \"image\", shape = [-1, 3, {SIDE}, {SIDE}]{from} }}\n{outputs}\n",
            model.display()
        ));
    }
    config
}

/// A request body of the picture (FP32, or bytes) asking for every output as binary.
fn request(values: &[f32], bytes: bool) -> (Vec<u8>, Option<usize>) {
    let shape = vec![1, 3, SIDE, SIDE];
    let tensor = if bytes {
        Tensor::new("image", shape, values.iter().map(|&v| crate::ceiling::as_byte(v)).collect::<Vec<u8>>())
    } else {
        Tensor::new("image", shape, values.to_vec())
    };
    let outputs = [RequestOutputSpec::binary("box_offsets"), RequestOutputSpec::binary("probs")];
    oip::encode_request(None, &[tensor], true, &outputs)
}

/// Starts the bare server on the worker's answer to `body`.
async fn start_bare(worker: &Worker, body: &[u8], header_len: Option<usize>, dir: &Path) -> anyhow::Result<(Service, String)> {
    let http = reqwest::Client::new();
    let mut call = http.post(format!("{}/v2/models/null/infer", worker.url)).body(body.to_vec());
    if let Some(len) = header_len {
        call = call.header(oip::INFERENCE_HEADER_CONTENT_LENGTH, len.to_string());
    }
    let answer = call.send().await?;
    if !answer.status().is_success() {
        bail!("the worker answered {} to the null model's request", answer.status());
    }
    let answer_len = answer
        .headers()
        .get(oip::INFERENCE_HEADER_CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .context("a binary answer")?;
    let file = dir.join("answer.bin");
    std::fs::write(&file, answer.bytes().await?)?;
    let log = dir.join("bare.log");
    let mut child = std::process::Command::new(binary("bare-oip-server"))
        .arg(&file)
        .arg(&answer_len)
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .context("starting bare-oip-server (cargo build --release -p vramgate-tests --bins)")?;
    let stdout = child.stdout.take().context("its stdout")?;
    let service = Service { name: "bare-oip-server", child, log };
    let first = crate::first_line(stdout, Duration::from_secs(30)).await.unwrap_or_default();
    let addr = first.trim().strip_prefix("listening on ").context("the bare server's address")?.to_string();
    Ok((service, format!("http://{addr}")))
}

/// Times one server at `concurrency`, with its and this process's CPU.
async fn timed(url: &str, model: &str, pid: u32, body: &bytes::Bytes, header_len: Option<usize>, concurrency: usize, seconds: f64) -> anyhow::Result<Side> {
    let endpoint = format!("{url}/v2/models/{model}/infer");
    let own = std::process::id();
    let (server_before, client_before) = (cpu_seconds(pid), cpu_seconds(own));
    let (per_s, failed) = saturate(&endpoint, body.clone(), header_len, concurrency, seconds, model).await?;
    // The warm-up's calls are in the CPU figures too: count them (two a client) with the rest.
    let requests = per_s * seconds + 2.0 * concurrency as f64;
    let per_request = |cpu: f64| 1000.0 * cpu / requests.max(1.0);
    Ok(Side {
        per_s,
        server_cpu_ms: per_request(cpu_seconds(pid) - server_before),
        client_cpu_ms: per_request(cpu_seconds(own) - client_before),
        failed,
    })
}

/// The worker's phases between two scrapes of its metrics.
fn phases(before: &str, after: &str, model: &str) -> Phases {
    let (b, a) = (prom_text::parse(before), prom_text::parse(after));
    let mean = |family: &str, phase: &str| {
        let labels = [("model", model), ("phase", phase)];
        let delta = |name: &str| prom_text::sum(&a, name, &labels) - prom_text::sum(&b, name, &labels);
        let count = delta(&format!("{family}_count"));
        if count > 0.0 { 1000.0 * delta(&format!("{family}_sum")) / count } else { f64::NAN }
    };
    let requests = |s: &[prom_text::Sample]| prom_text::sum(s, "request_phase_seconds_count", &[("model", model), ("phase", "infer")]);
    let batches = |s: &[prom_text::Sample]| prom_text::sum(s, "inference_phase_seconds_count", &[("model", model), ("phase", "model")]);
    let (r, n) = (requests(&a) - requests(&b), batches(&a) - batches(&b));
    Phases {
        request_ms: HANDLER_PHASES.iter().map(|p| (p.to_string(), mean("request_phase_seconds", p))).collect(),
        batch_ms: BATCH_PHASES.iter().map(|p| (p.to_string(), mean("inference_phase_seconds", p))).collect(),
        mean_batch: if n > 0.0 { r / n } else { f64::NAN },
    }
}

async fn scrape(url: &str) -> String {
    let http = reqwest::Client::new();
    match http.get(format!("{url}/metrics")).timeout(Duration::from_secs(10)).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Runs the bench: the raw loop's images a second at batch 1, and a row per concurrency (then
/// the UINT8 row at the highest).
pub async fn run(options: &Options) -> anyhow::Result<(f64, Vec<Row>)> {
    let dir = scratch_dir("request-path");
    let model = null_model(&dir)?;
    let worker = start_worker(&null_worker_config(&model)).await?;
    let values = test_image(SIDE, SIDE, 1);
    let (body, header_len) = request(&values, false);
    let (bytes_body, bytes_header_len) = request(&values, true);
    let (bare, bare_url) = start_bare(&worker, &body, header_len, &dir).await?;
    let (body, bytes_body) = (bytes::Bytes::from(body), bytes::Bytes::from(bytes_body));

    let input = RawInput::write(&values)?;
    let raw = std::process::Command::new(raw_loop_binary()?)
        .arg("--model")
        .arg(&model)
        .args(["--shape", &format!("1,3,{SIDE},{SIDE}"), "--json", "--no-profiling", "--seconds", &options.seconds.to_string()])
        .arg("--input")
        .arg(input.path())
        .output()
        .context("running raw_loop")?;
    let raw_per_s = serde_json::from_slice::<serde_json::Value>(&raw.stdout)
        .ok()
        .and_then(|v| v["items_per_s"].as_f64())
        .unwrap_or(f64::NAN);

    let mut rows = Vec::new();
    let top = options.concurrency.iter().copied().max().unwrap_or(64);
    let cases: Vec<(&'static str, usize)> =
        options.concurrency.iter().map(|&c| ("FP32 2.7 MB", c)).chain(std::iter::once(("UINT8 0.7 MB", top))).collect();
    for (what, concurrency) in cases {
        let (model_name, body, header_len) =
            if what.starts_with("UINT8") { ("null_bytes", &bytes_body, bytes_header_len) } else { ("null", &body, header_len) };
        let mut row = Row { what, concurrency, bare: Side::default(), worker: Side::default(), phases: Phases::default() };
        for _ in 0..options.rounds.max(1) {
            let b = timed(&bare_url, model_name, bare.pid(), body, header_len, concurrency, options.seconds).await?;
            if b.per_s > row.bare.per_s {
                row.bare = b;
            }
            let before = scrape(&worker.url).await;
            let w = timed(&worker.url, model_name, worker.service.pid(), body, header_len, concurrency, options.seconds).await?;
            let after = scrape(&worker.url).await;
            if w.per_s > row.worker.per_s {
                row.worker = w;
                row.phases = phases(&before, &after, model_name);
            }
        }
        rows.push(row);
    }
    drop(bare);
    drop(input);
    let _ = std::fs::remove_dir_all(&dir);
    Ok((raw_per_s, rows))
}

/// Prints the table of [`run`]'s figures.
pub fn print(raw_per_s: f64, rows: &[Row]) {
    println!("null model in the plain libtorch loop, batch 1: {raw_per_s:.0} images/s");
    println!(
        "\n| request | in flight | bare server /s | worker /s | worker ÷ bare | CPU ms a request: bare / worker / client | worker CPU ms per MB in | worker ms a request: {} | ms a batch: {} | mean batch | failed |",
        HANDLER_PHASES.join(" / "),
        BATCH_PHASES.join(" / ")
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let mb_in = if r.what.starts_with("UINT8") { 0.69 } else { 2.76 };
        let ms = |v: &[(String, f64)]| v.iter().map(|(_, ms)| format!("{ms:.2}")).collect::<Vec<_>>().join(" / ");
        println!(
            "| {} | {} | {:.0} | {:.0} | **{:.2}** | {:.2} / {:.2} / {:.2} | {:.2} | {} | {} | {:.1} | {} |",
            r.what,
            r.concurrency,
            r.bare.per_s,
            r.worker.per_s,
            r.worker.per_s / r.bare.per_s,
            r.bare.server_cpu_ms,
            r.worker.server_cpu_ms,
            r.worker.client_cpu_ms,
            r.worker.server_cpu_ms / mb_in,
            ms(&r.phases.request_ms),
            ms(&r.phases.batch_ms),
            r.phases.mean_batch,
            r.bare.failed + r.worker.failed
        );
    }
}
