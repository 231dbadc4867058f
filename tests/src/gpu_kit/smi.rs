//! The card's own figures, read with `nvidia-smi` (NVML underneath) every 100 ms while a step
//! runs: utilisation and memory, independent of anything the worker reports about itself.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One reading.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Seconds since the sampler started.
    pub t: f64,
    /// GPU utilisation, percent of the last sample period with a kernel running.
    pub util: f64,
    pub used_mib: f64,
    pub free_mib: f64,
    pub total_mib: f64,
}

/// Parses one line of `--query-gpu=utilization.gpu,memory.used,memory.free,memory.total
/// --format=csv,noheader,nounits`.
pub fn parse(line: &str, t: f64) -> Option<Sample> {
    let mut fields = line.split(',').map(|f| f.trim().parse::<f64>().ok());
    Some(Sample { t, util: fields.next()??, used_mib: fields.next()??, free_mib: fields.next()??, total_mib: fields.next()?? })
}

/// A running `nvidia-smi -lms 100`; [`Sampler::stop`] ends it and returns its readings.
pub struct Sampler {
    child: Child,
    samples: Arc<Mutex<Vec<Sample>>>,
}

impl Sampler {
    /// Starts sampling device 0, or `None` where `nvidia-smi` cannot run.
    pub fn start() -> Option<Sampler> {
        let mut child = Command::new("nvidia-smi")
            .args([
                "--query-gpu=utilization.gpu,memory.used,memory.free,memory.total",
                "--format=csv,noheader,nounits",
                "-i",
                "0",
                "-lms",
                "100",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let stdout = child.stdout.take()?;
        let samples = Arc::new(Mutex::new(Vec::new()));
        let into = samples.clone();
        let started = Instant::now();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(s) = parse(&line, started.elapsed().as_secs_f64()) {
                    let mut v = into.lock().expect("no sampler thread panics holding the lock");
                    // Bounded: 10 a second for at most an hour.
                    if v.len() < 36_000 {
                        v.push(s);
                    }
                }
            }
        });
        Some(Sampler { child, samples })
    }

    /// Stops sampling; the readings so far.
    pub fn stop(mut self) -> Vec<Sample> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.samples.lock().expect("no sampler thread panics holding the lock").clone()
    }
}

/// One reading now (a single `nvidia-smi` call), or `None` without one.
pub fn once() -> Option<Sample> {
    let output = Command::new("nvidia-smi")
        .args(["--query-gpu=utilization.gpu,memory.used,memory.free,memory.total", "--format=csv,noheader,nounits", "-i", "0"])
        .output()
        .ok()?;
    parse(String::from_utf8_lossy(&output.stdout).lines().next()?, 0.0)
}

/// Mean utilisation and peak memory used over `samples` (percent, MiB).
pub fn summary(samples: &[Sample]) -> Option<(f64, f64)> {
    if samples.is_empty() {
        return None;
    }
    let util = samples.iter().map(|s| s.util).sum::<f64>() / samples.len() as f64;
    let used = samples.iter().map(|s| s.used_mib).fold(0.0, f64::max);
    Some((util, used))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nvidia_smi_csv() {
        let s = parse("97, 10240, 71319, 81559", 1.5).expect("a sample");
        assert_eq!((s.t, s.util, s.used_mib, s.free_mib, s.total_mib), (1.5, 97.0, 10240.0, 71319.0, 81559.0));
        assert!(parse("[N/A], 1, 2, 3", 0.0).is_none());
        assert!(parse("", 0.0).is_none());
        assert_eq!(summary(&[s, Sample { util: 3.0, used_mib: 5.0, ..s }]), Some((50.0, 10240.0)));
    }
}
