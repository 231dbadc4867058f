//! What the checks measured, kept as they go: each check's figures in
//! `<work>/checks/<name>.json`, written after every step, and the report assembled from them
//! (`report.md`, `report.json`, `report.png` in the output folder), so that a run cut short
//! still returns everything it measured.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde_json::{json, Map, Value};
use vramgate_cli::load::{write_panels, Panel, Series};

use super::Kit;

/// The checks in the order they run and appear in the report.
pub const ORDER: [(&str, &str); 7] = [
    ("preflight", "Preflight"),
    ("budget", "NVML budget: another process takes memory"),
    ("p1", "P1 on the card: admission by bytes vs static counts"),
    ("p3", "P3: the worker saturated vs a plain libtorch loop"),
    ("oom", "OOM recovery under a budget above the card"),
    ("batching", "Batching on the device"),
    ("cards", "Card sizes: 8, 16 and 24 GB emulated"),
];

/// One check's figures as they accumulate.
pub struct Check {
    path: PathBuf,
    pub name: String,
    /// `running`, then `ok`, `failed` (a goal missed or a step failed), `skipped`, `partial`.
    pub status: String,
    /// Markdown lines for the report.
    pub lines: Vec<String>,
    pub figures: Map<String, Value>,
    /// Time series for the plot: name → `(seconds, value)` points.
    pub series: Map<String, Value>,
}

impl Check {
    pub fn new(kit: &Kit, name: &str) -> anyhow::Result<Check> {
        let dir = kit.work.join("checks");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let check = Check {
            path: dir.join(format!("{name}.json")),
            name: name.to_string(),
            status: "running".into(),
            lines: Vec::new(),
            figures: Map::new(),
            series: Map::new(),
        };
        check.save();
        Ok(check)
    }

    /// Adds a line to the report (and prints it, so the run's log shows progress).
    pub fn line(&mut self, line: impl Into<String>) {
        let line = line.into();
        println!("[{}] {line}", self.name);
        self.lines.push(line);
        self.save();
    }

    pub fn figure(&mut self, key: &str, value: Value) {
        self.figures.insert(key.to_string(), value);
        self.save();
    }

    pub fn series(&mut self, key: &str, points: &[(f64, f64)]) {
        self.series.insert(key.to_string(), json!(points));
        self.save();
    }

    pub fn finish(&mut self, status: &str) {
        self.status = status.to_string();
        self.save();
    }

    /// Writes the check's file; a failure to write is printed, never fatal (the figures are in
    /// the log too).
    pub fn save(&self) {
        let value = json!({"name": self.name, "status": self.status, "lines": self.lines, "figures": self.figures, "series": self.series});
        let tmp = self.path.with_extension("json.tmp");
        let written = std::fs::write(&tmp, serde_json::to_vec_pretty(&value).unwrap_or_default())
            .and_then(|()| std::fs::rename(&tmp, &self.path));
        if let Err(e) = written {
            eprintln!("gpu-kit: writing {}: {e}", self.path.display());
        }
    }
}

fn read_check(work: &Path, name: &str) -> Option<Value> {
    let text = std::fs::read(work.join("checks").join(format!("{name}.json"))).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Writes `report.md`, `report.json` and `report.png` into `out` from the checks in `work`,
/// headed by `work/notes.md`: run.sh's lines on the machine, what it found, checks it cut.
pub fn assemble(work: &Path, out: &Path, font: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let notes = std::fs::read_to_string(work.join("notes.md")).unwrap_or_default();
    let mut md = String::from("# vramgate GPU kit report\n\n");
    md.push_str(&notes);
    md.push('\n');
    let mut checks = Map::new();
    let mut series = Vec::new();
    for (name, title) in ORDER {
        md.push_str(&format!("## {title}\n\n"));
        let Some(check) = read_check(work, name) else {
            md.push_str("not run (cut short before it started, or not asked for)\n\n");
            continue;
        };
        let status = check["status"].as_str().unwrap_or("unknown");
        let status_line = match status {
            "running" => "status: **cut short** (its time limit ended it; the figures below are what it measured)".to_string(),
            other => format!("status: **{other}**"),
        };
        md.push_str(&status_line);
        md.push_str("\n\n");
        for line in check["lines"].as_array().into_iter().flatten() {
            md.push_str(line.as_str().unwrap_or_default());
            md.push('\n');
        }
        md.push('\n');
        if let Some(s) = check["series"].as_object() {
            for (key, points) in s {
                series.push((format!("{name}_{key}"), points.clone()));
            }
        }
        checks.insert(name.to_string(), check);
    }
    std::fs::write(out.join("report.md"), md).context("writing report.md")?;
    let report = json!({"notes": notes, "checks": checks});
    std::fs::write(out.join("report.json"), serde_json::to_vec_pretty(&report)?).context("writing report.json")?;
    plot(&series, &out.join("report.png"), font)
}

/// The plot: the budget check's memory timeline, and GPU utilisation through the P3 runs.
fn plot(series: &[(String, Value)], out: &Path, font: &Path) -> anyhow::Result<()> {
    let mut columns = vec!["t_s".to_string()];
    let mut rows: Vec<Vec<Option<f64>>> = Vec::new();
    for (i, (name, points)) in series.iter().enumerate() {
        columns.push(name.clone());
        for p in points.as_array().into_iter().flatten() {
            let (Some(t), Some(v)) = (p[0].as_f64(), p[1].as_f64()) else { continue };
            let mut row = vec![None; series.len() + 1];
            row[0] = Some(t);
            row[i + 1] = Some(v);
            rows.push(row);
        }
    }
    let pick = |prefix: &str| columns.iter().filter(|c| c.starts_with(prefix)).cloned().collect::<Vec<_>>();
    let panels = vec![
        Panel {
            title: "Budget check (MiB): worker budget and admitted bytes, device free memory, the other process's hold".into(),
            divisor: 1048576.0,
            columns: pick("budget_"),
        },
        Panel { title: "P3 (%): GPU utilisation while each model saturates the worker, then the raw loop".into(), divisor: 1.0, columns: pick("p3_") },
    ];
    write_panels(&Series { columns, rows }, &panels, out, font)
}
