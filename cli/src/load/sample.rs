//! Sampling both services' `/metrics` (and the gateway group's consumer lag) during a load run
//! into a time series with a fixed set of columns, written as CSV.

use std::fmt::Write as _;
use std::time::Duration;

use vramgate_shared::prom_text::{self, Sample};

/// Most rows one run's series keeps (a 1 s interval over the longest run fits); past it
/// sampling stops and the run says so.
pub const MAX_ROWS: usize = 20_000;
/// How long one scrape may take before its row's cells stay empty.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// A time series: named columns, one row per sample; `None` where a source did not answer
/// (a service restarting).
#[derive(Debug, Clone, Default)]
pub struct Series {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Option<f64>>>,
}

impl Series {
    /// The series as CSV: a header, then one line per row, empty cells for missing values.
    pub fn to_csv(&self) -> String {
        let mut out = self.columns.join(",");
        out.push('\n');
        for row in &self.rows {
            let cells: Vec<String> = row.iter().map(|v| v.map(|v| format!("{v}")).unwrap_or_default()).collect();
            let _ = writeln!(out, "{}", cells.join(","));
        }
        out
    }

    /// `(t_s, value)` of column `name` where both are present.
    pub fn points(&self, name: &str) -> Vec<(f64, f64)> {
        let Some(at) = self.columns.iter().position(|c| c == name) else { return Vec::new() };
        self.rows.iter().filter_map(|r| Some((r[0]?, r[at]?))).collect()
    }
}

/// What the load run itself knows at a sample: (sent, results, dead letters) so far.
pub type Totals = (u64, u64, u64);

/// Scrapes the services and builds rows; keeps what interval figures need from the last one.
pub struct Sampler {
    http: reqwest::Client,
    gateway_url: Option<String>,
    worker_url: Option<String>,
    tasks: Vec<String>,
    pub series: Series,
    last: Option<Last>,
}

struct Last {
    t_s: f64,
    done: u64,
    batch_sum: Option<f64>,
    batch_count: Option<f64>,
}

impl Sampler {
    pub fn new(gateway_url: Option<String>, worker_url: Option<String>, tasks: &[String]) -> Self {
        let mut columns: Vec<String> = [
            "t_s",
            "sent",
            "results",
            "dead_letters",
            "done_per_s",
            "worker_budget_bytes",
            "worker_admitted_bytes",
            "worker_used_bytes",
            "worker_queued_requests",
            "worker_batches_running",
            "worker_batch_size_mean",
            "worker_batch_size_limit_max",
            "worker_oom_total",
            "gateway_held_bytes",
            "gateway_uncommitted",
            "gateway_paused_partitions",
            "consumer_lag",
        ]
        .map(String::from)
        .into();
        for task in tasks {
            for what in ["in_flight", "worker_calls", "permit_limit"] {
                columns.push(format!("gateway_{what}_{task}"));
            }
        }
        Sampler {
            http: reqwest::Client::new(),
            gateway_url,
            worker_url,
            tasks: tasks.to_vec(),
            series: Series { columns, rows: Vec::new() },
            last: None,
        }
    }

    async fn scrape(&self, url: Option<&str>) -> Option<Vec<Sample>> {
        let response = self.http.get(url?).timeout(SCRAPE_TIMEOUT).send().await.ok()?.error_for_status().ok()?;
        Some(prom_text::parse(&response.text().await.ok()?))
    }

    /// Takes one sample at `t_s` seconds into the run; returns false once the series is full.
    pub async fn sample(&mut self, t_s: f64, totals: Totals, lag: Option<i64>) -> bool {
        if self.series.rows.len() >= MAX_ROWS {
            return false;
        }
        let (gateway, worker) =
            tokio::join!(self.scrape(self.gateway_url.as_deref()), self.scrape(self.worker_url.as_deref()));
        let row = self.row(t_s, totals, lag, gateway.as_deref(), worker.as_deref());
        self.series.rows.push(row);
        true
    }

    fn row(
        &mut self,
        t_s: f64,
        (sent, results, dead): Totals,
        lag: Option<i64>,
        gateway: Option<&[Sample]>,
        worker: Option<&[Sample]>,
    ) -> Vec<Option<f64>> {
        let w = |name: &str| worker.map(|s| prom_text::sum(s, name, &[]));
        let g = |name: &str| gateway.map(|s| prom_text::sum(s, &format!("vramgate_gateway_{name}"), &[]));
        let batch_sum = w("inference_batch_size_sum");
        let batch_count = w("inference_batch_size_count");
        let done = results + dead;
        let (done_per_s, batch_mean) = match &self.last {
            Some(last) if t_s > last.t_s => {
                let rate = (done - last.done) as f64 / (t_s - last.t_s);
                let mean = match (batch_sum, batch_count, last.batch_sum, last.batch_count) {
                    (Some(s), Some(c), Some(ls), Some(lc)) if c > lc => Some((s - ls) / (c - lc)),
                    _ => None,
                };
                (Some(rate), mean)
            }
            _ => (None, None),
        };
        self.last = Some(Last { t_s, done, batch_sum, batch_count });
        let mut row = vec![
            Some(t_s),
            Some(sent as f64),
            Some(results as f64),
            Some(dead as f64),
            done_per_s,
            w("gpu_memory_budget_bytes"),
            w("gpu_memory_admitted_bytes"),
            w("gpu_memory_used_bytes"),
            w("admission_queued_requests"),
            w("concurrent_inference_tasks"),
            batch_mean,
            worker.and_then(|s| prom_text::max(s, "vramgate_worker_batch_size_limit")),
            w("inference_oom_errors_total"),
            g("held_bytes"),
            g("records_uncommitted"),
            g("paused_partitions"),
            lag.map(|l| l as f64),
        ];
        for task in &self.tasks {
            for name in ["records_in_flight", "worker_calls_in_flight", "gpu_permit_limit"] {
                let name = format!("vramgate_gateway_{name}");
                row.push(gateway.map(|s| prom_text::sum(s, &name, &[("task", task)])));
            }
        }
        row
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORKER: &str = "gpu_memory_budget_bytes 1000\ngpu_memory_admitted_bytes 400\n\
        inference_batch_size_sum{model=\"a\"} 10\ninference_batch_size_count{model=\"a\"} 5\n\
        vramgate_worker_batch_size_limit{model=\"a\",item_elements=\"1\"} 4\n\
        vramgate_worker_batch_size_limit{model=\"a\",item_elements=\"2\"} 8\n";
    const WORKER_LATER: &str = "gpu_memory_budget_bytes 1000\ninference_batch_size_sum{model=\"a\"} 40\n\
        inference_batch_size_count{model=\"a\"} 10\n";
    const GATEWAY: &str = "vramgate_gateway_records_in_flight{task=\"voice\"} 7\n\
        vramgate_gateway_gpu_permit_limit{task=\"voice\"} 4\nvramgate_gateway_gpu_permit_limit{task=\"image\"} 9\n";

    #[test]
    fn rows_follow_the_columns_with_interval_figures_and_gaps() {
        let mut sampler = Sampler::new(None, None, &["voice".into(), "image".into()]);
        let (worker, later, gateway) = (prom_text::parse(WORKER), prom_text::parse(WORKER_LATER), prom_text::parse(GATEWAY));
        let first = sampler.row(1.0, (10, 2, 1), Some(5), Some(&gateway), Some(&worker));
        sampler.series.rows.push(first);
        let second = sampler.row(3.0, (20, 8, 3), None, None, Some(&later));
        sampler.series.rows.push(second);
        let series = &sampler.series;
        assert!(series.rows.iter().all(|r| r.len() == series.columns.len()));
        let at = |row: usize, name: &str| series.rows[row][series.columns.iter().position(|c| c == name).expect(name)];
        assert_eq!(at(0, "worker_budget_bytes"), Some(1000.0));
        assert_eq!(at(0, "worker_batch_size_limit_max"), Some(8.0));
        assert_eq!(at(0, "done_per_s"), None, "no interval before the first sample");
        assert_eq!(at(1, "done_per_s"), Some(4.0), "8 more done in 2 s");
        assert_eq!(at(1, "worker_batch_size_mean"), Some(6.0), "30 items over 5 batches");
        assert_eq!(at(0, "gateway_in_flight_voice"), Some(7.0));
        assert_eq!(at(0, "gateway_permit_limit_image"), Some(9.0));
        assert_eq!(at(1, "gateway_permit_limit_image"), None, "the gateway did not answer");
        assert_eq!(at(0, "consumer_lag"), Some(5.0));
        let csv = series.to_csv();
        let lines: Vec<&str> = csv.lines().collect();
        assert!(lines[0].starts_with("t_s,sent,results,dead_letters,done_per_s,worker_budget_bytes"));
        assert!(lines[0].ends_with("gateway_in_flight_image,gateway_worker_calls_image,gateway_permit_limit_image"));
        assert!(lines[2].starts_with("3,20,8,3,4,1000,0,"), "{}", lines[2]);
        assert_eq!(series.points("worker_budget_bytes"), vec![(1.0, 1000.0), (3.0, 1000.0)]);
        assert_eq!(series.points("gateway_in_flight_voice"), vec![(1.0, 7.0)]);
    }
}
