//! The end of a load run: its summary (printed as a table per task, or as JSON) and the files
//! it writes.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::tally::TaskSummary;

/// The run's files: `RUN.csv`, `RUN.png`, `RUN.json` in the output folder.
pub struct Files {
    pub csv: PathBuf,
    pub png: PathBuf,
    pub json: PathBuf,
}

impl Files {
    pub fn new(folder: &Path, run: &str) -> Self {
        Files {
            csv: folder.join(format!("{run}.csv")),
            png: folder.join(format!("{run}.png")),
            json: folder.join(format!("{run}.json")),
        }
    }
}

/// What `--json` prints and `RUN.json` holds.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub run_id: String,
    pub sending_seconds: f64,
    pub elapsed_seconds: f64,
    /// Events the broker never acknowledged (not counted as sent).
    pub send_failures: u64,
    /// Whether the gateway's group committed every request and the outputs were read to their
    /// end before the run stopped, so the duplicate counts are final.
    pub settled: bool,
    pub samples: usize,
    pub csv: String,
    /// `None` when the plot could not be drawn (the error follows the summary).
    pub png: Option<String>,
    pub tasks: Vec<TaskSummary>,
}

fn ms(v: Option<i64>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

/// The summary as a table, one row per task, then the files.
pub fn table(summary: &Summary) -> String {
    let mut out = format!(
        "{:<10} {:>8} {:>8} {:>6} {:>5} {:>5} {:>9} {:>8} {:>8} {:>8}  dead letters by kind\n",
        "task", "sent", "results", "dead", "lost", "dups", "per s", "p50 ms", "p95 ms", "p99 ms"
    );
    for t in &summary.tasks {
        let kinds: Vec<String> = t.dead_letters_by_kind.iter().map(|(k, n)| format!("{k} {n}")).collect();
        let _ = writeln!(
            out,
            "{:<10} {:>8} {:>8} {:>6} {:>5} {:>5} {:>9.1} {:>8} {:>8} {:>8}  {}",
            t.task,
            t.sent,
            t.results,
            t.dead_letters,
            t.lost,
            t.duplicates,
            t.throughput_per_s,
            ms(t.latency_ms.p50),
            ms(t.latency_ms.p95),
            ms(t.latency_ms.p99),
            if kinds.is_empty() { "-".into() } else { kinds.join(", ") }
        );
    }
    let _ = writeln!(
        out,
        "run {}: sent for {:.1} s, {:.1} s in all, {} send failures, {}; {} samples in {}{}",
        summary.run_id,
        summary.sending_seconds,
        summary.elapsed_seconds,
        summary.send_failures,
        if summary.settled { "settled (every request committed, outputs read to their end)" } else { "not settled: late duplicates may be missing" },
        summary.samples,
        summary.csv,
        summary.png.as_ref().map(|p| format!(", plot {p}")).unwrap_or_default()
    );
    out
}
