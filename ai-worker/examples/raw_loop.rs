//! The ceiling the worker is measured against: a plain libtorch loop over the same TorchScript
//! file, with nothing of vramgate around it. It loads the model with tch, sets the torch thread
//! count, builds the input tensor once, and calls the model under `no_grad` in a loop, exactly
//! as a user who knows libtorch would (the profiling executor left at its default, the C
//! allocator left at glibc's defaults). It prints items per second: images for P-Net, clips
//! for Silero VAD.
//!
//! ```text
//! cargo run --release -p vramgate-worker --example raw_loop -- \
//!     --model models/mtcnn_pnet.jit --shape 1,3,320,320
//! cargo run --release -p vramgate-worker --example raw_loop -- \
//!     --method audio_forward --args 16000 --model models/silero_vad.jit --shape 1,80000
//! ```
//!
//! Arguments: `--model PATH`, `--shape D,D,…` (the batch dimension first), `--method NAME`
//! (the TorchScript method, default `forward`), `--args N,N,…` (integer constant arguments
//! after the input, as a declared model's `args`), `--input PATH` (raw little-endian f32 of
//! one item, repeated over the batch; without it a deterministic tone for a `[batch, samples]`
//! input, else a gradient), `--threads N` (default 1), `--seconds S` (how long to time,
//! default 5), `--warmup N` (calls before timing, default 5), `--json` (one JSON object instead of text),
//! `--no-profiling` (turn TorchScript's profiling executor off, as the worker does),
//! `--device cpu|cuda` (default cpu; on CUDA each call copies its input from host memory to
//! the card and its outputs back, as a loop serving requests must, so the rate counts the
//! same transfers the worker makes), `--dtype f32|u8` (the input's element type, default f32;
//! u8 for a model that takes bytes, as MobileNetV2 in the model repository does),
//! `--busy-cpus N` (default 0: N more threads spin on one counter each, nothing beyond L1,
//! from before the warm-up to the end, standing for a server's request path on the other
//! CPUs; where CPUs share a physical core or a clock, as the vCPUs of the project's machine
//! do, it shows what the loop loses when they are not idle).
//!
//! Besides the rate it prints the loop thread's time on a CPU and waiting for one (from
//! `/proc/thread-self/schedstat`) per item: on a shared machine the second says how much of a
//! figure is other load.
//!
//! The input is fed as the worker feeds a declared FP32 model (`model.rs`): the method called
//! with the float tensor and then the constant arguments (P-Net `forward(image)`, Silero
//! `audio_forward(audio, 16000)`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tch::{CModule, Device, IValue, Kind, Tensor};

struct Args {
    method: String,
    call_args: Vec<i64>,
    model: String,
    shape: Vec<i64>,
    input: Option<String>,
    threads: i32,
    seconds: f64,
    warmup: usize,
    json: bool,
    profiling: bool,
    busy_cpus: usize,
    device: Device,
    bytes: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        method: "forward".into(),
        call_args: Vec::new(),
        model: String::new(),
        shape: Vec::new(),
        input: None,
        threads: 1,
        seconds: 5.0,
        warmup: 5,
        json: false,
        profiling: true,
        busy_cpus: 0,
        device: Device::Cpu,
        bytes: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--method" => args.method = value()?,
            "--args" => {
                args.call_args = value()?.split(',').map(|d| d.trim().parse::<i64>()).collect::<Result<_, _>>()?;
            }
            "--model" => args.model = value()?,
            "--shape" => {
                args.shape = value()?.split(',').map(|d| d.trim().parse::<i64>()).collect::<Result<_, _>>()?;
            }
            "--input" => args.input = Some(value()?),
            "--threads" => args.threads = value()?.parse()?,
            "--seconds" => args.seconds = value()?.parse()?,
            "--warmup" => args.warmup = value()?.parse()?,
            "--json" => args.json = true,
            "--no-profiling" => args.profiling = false,
            "--busy-cpus" => args.busy_cpus = value()?.parse()?,
            "--device" => {
                args.device = match value()?.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda(0),
                    other => bail!("--device {other}: cpu or cuda"),
                }
            }
            "--dtype" => {
                args.bytes = match value()?.as_str() {
                    "f32" => false,
                    "u8" => true,
                    other => bail!("--dtype {other}: f32 or u8"),
                }
            }
            other => bail!("unknown argument {other}"),
        }
    }
    if args.model.is_empty() || args.shape.len() < 2 {
        bail!("usage: raw_loop --model PATH [--method NAME] [--args N,…] --shape B,… [--input F32FILE] [--threads N] [--seconds S] [--json]");
    }
    Ok(args)
}

/// One item's data: from `--input`, else a deterministic tone (`[batch, samples]`) or gradient.
fn item_data(args: &Args) -> anyhow::Result<Vec<f32>> {
    let per_item: usize = args.shape[1..].iter().map(|&d| d as usize).product();
    let data: Vec<f32> = match &args.input {
        Some(path) => {
            let bytes = std::fs::read(path).with_context(|| format!("reading {path}"))?;
            bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
        None if args.shape.len() == 2 => (0..per_item).map(|i| 0.3 * (i as f32 * 0.013).sin()).collect(),
        None => (0..per_item).map(|i| ((i % 997) as f32 / 997.0) - 0.5).collect(),
    };
    if data.len() != per_item {
        bail!("input has {} values, shape {:?} needs {per_item} per item", data.len(), args.shape);
    }
    Ok(data)
}

fn call(module: &CModule, args: &Args, x: &Tensor) -> anyhow::Result<()> {
    // On CUDA the input starts in host memory and the outputs end there, as a request's do.
    let x = if args.device == Device::Cpu { x.shallow_clone() } else { x.to_device(args.device) };
    let inputs: Vec<IValue> = std::iter::once(IValue::Tensor(x)).chain(args.call_args.iter().map(|&n| IValue::Int(n))).collect();
    let out = module.method_is(&args.method, &inputs)?;
    if args.device != Device::Cpu {
        to_host(&out);
    }
    std::hint::black_box(out);
    Ok(())
}

/// Copies every tensor of a method's answer (a tensor, or tuples, lists and dicts of them) to
/// host memory, which also waits for the card to finish computing them.
fn to_host(value: &IValue) {
    match value {
        IValue::Tensor(t) => {
            let _ = std::hint::black_box(t.to_device(Device::Cpu));
        }
        IValue::Tuple(items) | IValue::GenericList(items) => items.iter().for_each(to_host),
        IValue::TensorList(items) => items.iter().for_each(|t| {
            let _ = std::hint::black_box(t.to_device(Device::Cpu));
        }),
        IValue::GenericDict(pairs) => pairs.iter().for_each(|(_, v)| to_host(v)),
        _ => {}
    }
}

/// This thread's `/proc/thread-self/schedstat`: nanoseconds on a CPU and waiting on a runqueue
/// (zeros where it cannot be read).
fn schedstat() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().unwrap_or(0));
    (fields.next().unwrap_or(0), fields.next().unwrap_or(0))
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    tch::set_num_threads(args.threads);
    if !args.profiling {
        tch::jit::set_profiling_mode(false);
    }
    if args.device != Device::Cpu && !tch::Cuda::is_available() {
        bail!("--device cuda: libtorch sees no CUDA device");
    }
    let mut module = CModule::load_on_device(&args.model, args.device).with_context(|| format!("loading {}", args.model))?;
    module.set_eval();
    let item = item_data(&args)?;
    let batch = args.shape[0];
    let per_item = if args.bytes {
        // Bytes for a model that takes UINT8 (an image): the values scaled to 0..=255.
        let bytes: Vec<u8> = item.iter().map(|v| ((v + 0.5).clamp(0.0, 1.0) * 255.0) as u8).collect();
        Tensor::from_slice(&bytes).reshape(&args.shape[1..])
    } else {
        Tensor::from_slice(&item).reshape(&args.shape[1..])
    };
    let mut sched_before = (0, 0);
    let items: Vec<Tensor> = (0..batch).map(|_| per_item.shallow_clone()).collect();
    let kind = if args.bytes { Kind::Uint8 } else { Kind::Float };
    let x = Tensor::stack(&items, 0).to_kind(kind).contiguous();
    let stop = Arc::new(AtomicBool::new(false));
    let spinners: Vec<_> = (0..args.busy_cpus)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 1u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..10_000 {
                        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                    }
                }
            })
        })
        .collect();

    let timed = tch::no_grad(|| -> anyhow::Result<(usize, Duration)> {
        for _ in 0..args.warmup {
            call(&module, &args, &x)?;
        }
        let limit = Duration::from_secs_f64(args.seconds);
        sched_before = schedstat();
        let started = Instant::now();
        let mut calls = 0;
        while started.elapsed() < limit || calls < 3 {
            call(&module, &args, &x)?;
            calls += 1;
        }
        Ok((calls, started.elapsed()))
    })?;
    let sched = schedstat();
    stop.store(true, Ordering::Relaxed);
    spinners.into_iter().for_each(|s| s.join().expect("a spinner does not panic"));
    let (calls, elapsed) = timed;
    let items = calls as f64 * batch as f64;
    // This thread's time on a CPU and waiting for one (runqueue), per item, in ms.
    let on_cpu_ms = (sched.0 - sched_before.0) as f64 / 1e6 / items;
    let waiting_ms = (sched.1 - sched_before.1) as f64 / 1e6 / items;
    let items_per_s = (calls as f64 * batch as f64) / elapsed.as_secs_f64();
    let ms_per_call = elapsed.as_secs_f64() * 1000.0 / calls as f64;
    let shape = args.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x");
    if args.json {
        println!(
            "{{\"device\":\"{:?}\",\"method\":\"{}\",\"shape\":\"{shape}\",\"batch\":{batch},\"threads\":{},\"busy_cpus\":{},\"calls\":{calls},\"seconds\":{:.3},\"items_per_s\":{items_per_s:.3},\"ms_per_call\":{ms_per_call:.3},\"on_cpu_ms_per_item\":{on_cpu_ms:.3},\"runqueue_ms_per_item\":{waiting_ms:.3}}}",
            args.device,
            args.method,
            args.threads,
            args.busy_cpus,
            elapsed.as_secs_f64()
        );
    } else {
        println!(
            "{} {shape}: {items_per_s:.1} items/s ({ms_per_call:.2} ms per call of {batch}, {calls} calls, {} thread(s); \
             per item {on_cpu_ms:.2} ms on a CPU, {waiting_ms:.2} ms waiting for one; {} other CPU(s) kept busy)",
            args.method, args.threads, args.busy_cpus
        );
    }
    Ok(())
}
