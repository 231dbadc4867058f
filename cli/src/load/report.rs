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
    /// How the output topics were read (their consumer's `isolation.level`): `read_committed`
    /// unless the Kafka properties set it. Results, dead letters and duplicates count the
    /// outputs read so: with `read_committed`, only those of committed transactions.
    pub isolation_level: String,
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
        "outputs read with isolation.level={}: dups are outputs beyond the first per id{}",
        summary.isolation_level,
        if summary.isolation_level == "read_committed" { ", of committed transactions only" } else { ", aborted transactions' included" }
    );
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::tally::{Output, Tally};

    fn summary(isolation_level: &str) -> Summary {
        let mut tally = Tally::new(&["voice".into()]);
        tally.sent("voice", "a", 1_000);
        tally.output("voice", "a", Output::Result, 1_100);
        tally.output("voice", "a", Output::Result, 1_200);
        Summary {
            run_id: "r".into(),
            sending_seconds: 1.0,
            elapsed_seconds: 2.0,
            send_failures: 0,
            settled: true,
            isolation_level: isolation_level.into(),
            samples: 3,
            csv: "r.csv".into(),
            png: None,
            tasks: tally.summaries(),
        }
    }

    #[test]
    fn duplicates_are_reported_with_how_the_outputs_were_read() {
        let committed = summary("read_committed");
        let text = table(&committed);
        let header = text.lines().next().expect("a header");
        let row = text.lines().nth(1).expect("a row");
        let dups_column = header.split_whitespace().position(|c| c == "dups").expect("a dups column");
        assert_eq!(row.split_whitespace().nth(dups_column), Some("1"), "{text}");
        assert!(text.contains("isolation.level=read_committed") && text.contains("committed transactions only"), "{text}");
        let json = serde_json::to_value(&committed).expect("serialises");
        assert_eq!(json["isolation_level"], "read_committed");
        assert_eq!(json["tasks"][0]["duplicates"], 1);

        let text = table(&summary("read_uncommitted"));
        assert!(text.contains("isolation.level=read_uncommitted") && text.contains("aborted transactions' included"), "{text}");
    }
}
