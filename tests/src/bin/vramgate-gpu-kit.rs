//! The GPU kit's driver: `vramgate-gpu-kit [options] CHECK…` runs the named checks against
//! the kit's worker on the device; `vramgate-gpu-kit --work W --out O report` assembles the
//! report. `run.sh` (written by `scripts/gpu-kit`) calls it; `docs/gpu-kit.md` says how.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use vramgate_tests::gpu_kit::{checks, report, Device, Kit};

const USAGE: &str = "usage: vramgate-gpu-kit --kit DIR --work DIR --out DIR [--device cuda|cpu] [--quick] \
[--seconds N] [--python PATH] CHECK… (preflight budget p1 p3 oom batching cards) | report";

fn main() -> anyhow::Result<()> {
    let mut kit_dir = None;
    let mut work = None;
    let mut out = None;
    let mut device = Device::Cpu;
    let mut quick = false;
    let mut seconds = 600.0;
    let mut python = "python3".to_string();
    let mut commands = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().with_context(|| format!("{arg} needs a value; {USAGE}"));
        match arg.as_str() {
            "--kit" => kit_dir = Some(PathBuf::from(value()?)),
            "--work" => work = Some(PathBuf::from(value()?)),
            "--out" => out = Some(PathBuf::from(value()?)),
            "--device" => {
                device = match value()?.as_str() {
                    "cuda" => Device::Cuda,
                    "cpu" => Device::Cpu,
                    other => bail!("--device {other}: cuda or cpu"),
                }
            }
            "--quick" => quick = true,
            "--seconds" => seconds = value()?.parse().context("--seconds")?,
            "--python" => python = value()?,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other if other.starts_with('-') => bail!("unknown option {other}; {USAGE}"),
            other => commands.push(other.to_string()),
        }
    }
    let (Some(work), Some(out)) = (work, out) else { bail!("--work and --out are needed; {USAGE}") };
    if commands.is_empty() {
        bail!("no check named; {USAGE}");
    }
    let kit_dir = kit_dir.unwrap_or_else(|| PathBuf::from("."));
    if commands == ["report"] {
        return report::assemble(&work, &out, &kit_dir.join("fonts/DejaVuSans.ttf"));
    }
    // On a CPU the card-sized workloads would only measure how slow a CPU is: always small.
    let quick = quick || device == Device::Cpu;
    let baseline = std::env::var_os("VRAMGATE_KIT_BASELINE_WORKER").map(PathBuf::from).filter(|p| p.is_file());
    let kit = Kit { dir: kit_dir, work, device, quick, deadline: Instant::now() + Duration::from_secs_f64(seconds), python, baseline };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    let mut failed = Vec::new();
    for name in &commands {
        match runtime.block_on(checks::run(&kit, name)) {
            Ok("ok" | "skipped") => {}
            Ok(status) => failed.push(format!("{name} ({status})")),
            Err(e) => {
                eprintln!("gpu-kit: check {name} could not run to the end: {e:#}");
                failed.push(format!("{name} (error)"));
            }
        }
    }
    if !failed.is_empty() {
        bail!("checks that failed or did not finish: {}", failed.join(", "));
    }
    Ok(())
}
