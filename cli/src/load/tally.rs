//! The load generator's accounting: which ids were sent, which came back (as a result or a
//! dead letter, how many times), and from that per task: throughput, end-to-end latency
//! percentiles, dead letters by kind, lost and duplicates. Pure bookkeeping, no Kafka.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

/// What one output record was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    Result,
    /// A dead letter, with its error kind.
    DeadLetter(String),
}

/// What an output meant for the accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// The first output for a sent id: it is accounted for.
    First,
    /// Another output for an id already accounted for (a crash made the gateway redo it).
    Duplicate,
    /// An id this run did not send (another run's, or one still being sent); ignored.
    Unknown,
}

#[derive(Debug, Default)]
struct TaskTally {
    /// id → the request's timestamp (ms since the epoch).
    sent: HashMap<String, i64>,
    /// id → outputs seen for it.
    outputs: HashMap<String, u32>,
    results: u64,
    dead_by_kind: BTreeMap<String, u64>,
    duplicates: u64,
    latencies_ms: Vec<i64>,
    first_sent_ms: Option<i64>,
    last_output_ms: Option<i64>,
}

/// The accounting of one run, for every task it sends to.
#[derive(Debug, Default)]
pub struct Tally {
    tasks: BTreeMap<String, TaskTally>,
}

/// The final figures of one task.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TaskSummary {
    pub task: String,
    pub sent: u64,
    pub results: u64,
    pub dead_letters: u64,
    pub dead_letters_by_kind: BTreeMap<String, u64>,
    /// Sent and never seen on the results or dead-letter topic.
    pub lost: u64,
    /// Outputs beyond the first for an id, as read (with `read_committed` by default: only
    /// outputs of committed transactions count; see the summary's `isolation_level`).
    pub duplicates: u64,
    /// Ids accounted for per second, from the first request's timestamp to the last output's.
    pub throughput_per_s: f64,
    /// From the request's timestamp to its first output's, in ms (nearest rank).
    pub latency_ms: Percentiles,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Default)]
pub struct Percentiles {
    pub p50: Option<i64>,
    pub p95: Option<i64>,
    pub p99: Option<i64>,
    pub max: Option<i64>,
}

impl Tally {
    pub fn new(tasks: &[String]) -> Self {
        Tally { tasks: tasks.iter().map(|t| (t.clone(), TaskTally::default())).collect() }
    }

    /// Records a request about to be sent, stamped `timestamp_ms`.
    pub fn sent(&mut self, task: &str, id: &str, timestamp_ms: i64) {
        let t = self.tasks.entry(task.to_string()).or_default();
        t.sent.insert(id.to_string(), timestamp_ms);
        t.first_sent_ms = Some(t.first_sent_ms.map_or(timestamp_ms, |f| f.min(timestamp_ms)));
    }

    /// Forgets a request whose send failed (the broker never took it: it cannot be lost).
    pub fn unsent(&mut self, task: &str, id: &str) {
        if let Some(t) = self.tasks.get_mut(task) {
            t.sent.remove(id);
        }
    }

    /// Records an output for `id` read from `task`'s results or dead-letter topic, stamped
    /// `timestamp_ms`.
    pub fn output(&mut self, task: &str, id: &str, output: Output, timestamp_ms: i64) -> Seen {
        let Some(t) = self.tasks.get_mut(task) else { return Seen::Unknown };
        let Some(&sent_ms) = t.sent.get(id) else { return Seen::Unknown };
        let count = t.outputs.entry(id.to_string()).or_default();
        *count += 1;
        if *count > 1 {
            t.duplicates += 1;
            return Seen::Duplicate;
        }
        match output {
            Output::Result => t.results += 1,
            Output::DeadLetter(kind) => *t.dead_by_kind.entry(kind).or_default() += 1,
        }
        t.latencies_ms.push((timestamp_ms - sent_ms).max(0));
        t.last_output_ms = Some(t.last_output_ms.map_or(timestamp_ms, |l| l.max(timestamp_ms)));
        Seen::First
    }

    /// Sent ids not yet accounted for, all tasks together.
    pub fn outstanding(&self) -> u64 {
        self.tasks.values().map(|t| (t.sent.len() - t.outputs.len()) as u64).sum()
    }

    /// (sent, results, dead letters) over all tasks, for progress.
    pub fn totals(&self) -> (u64, u64, u64) {
        self.tasks.values().fold((0, 0, 0), |(s, r, d), t| {
            (s + t.sent.len() as u64, r + t.results, d + t.dead_by_kind.values().sum::<u64>())
        })
    }

    pub fn summaries(&self) -> Vec<TaskSummary> {
        self.tasks
            .iter()
            .map(|(task, t)| {
                let done = t.outputs.len() as u64;
                let span_ms = match (t.first_sent_ms, t.last_output_ms) {
                    (Some(first), Some(last)) if last > first => (last - first) as f64,
                    _ => 0.0,
                };
                TaskSummary {
                    task: task.clone(),
                    sent: t.sent.len() as u64,
                    results: t.results,
                    dead_letters: t.dead_by_kind.values().sum(),
                    dead_letters_by_kind: t.dead_by_kind.clone(),
                    lost: t.sent.len() as u64 - done,
                    duplicates: t.duplicates,
                    throughput_per_s: if span_ms > 0.0 { done as f64 * 1000.0 / span_ms } else { 0.0 },
                    latency_ms: percentiles(&t.latencies_ms),
                }
            })
            .collect()
    }
}

/// p50, p95, p99 and max by nearest rank (the smallest value with at least p% of the values at
/// or below it); all `None` for no values.
pub fn percentiles(values: &[i64]) -> Percentiles {
    if values.is_empty() {
        return Percentiles::default();
    }
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let rank = |p: f64| {
        let at = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
        Some(sorted[at.clamp(1, sorted.len()) - 1])
    };
    Percentiles { p50: rank(50.0), p95: rank(95.0), p99: rank(99.0), max: sorted.last().copied() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(values: &[i64], expected: (i64, i64, i64, i64)) {
        let p = percentiles(values);
        assert_eq!((p.p50, p.p95, p.p99, p.max), (Some(expected.0), Some(expected.1), Some(expected.2), Some(expected.3)));
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        check(&[7], (7, 7, 7, 7));
        check(&[3, 1, 2], (2, 3, 3, 3));
        check(&[1, 2, 3, 4], (2, 4, 4, 4));
        let hundred: Vec<i64> = (1..=100).rev().collect();
        check(&hundred, (50, 95, 99, 100));
        let thousand: Vec<i64> = (1..=1000).collect();
        check(&thousand, (500, 950, 990, 1000));
        assert_eq!(percentiles(&[]), Percentiles::default());
    }

    #[test]
    fn accounts_results_dead_letters_duplicates_and_losses() {
        let mut tally = Tally::new(&["voice".into(), "image".into()]);
        for (i, id) in ["a", "b", "c", "d"].iter().enumerate() {
            tally.sent("voice", id, 1_000 + i as i64);
        }
        tally.sent("image", "x", 1_000);
        tally.sent("image", "y", 1_000);
        tally.unsent("image", "y");
        assert_eq!(tally.outstanding(), 5);

        assert_eq!(tally.output("voice", "a", Output::Result, 1_100), Seen::First);
        assert_eq!(tally.output("voice", "b", Output::DeadLetter("input_not_found".into()), 1_051), Seen::First);
        assert_eq!(tally.output("voice", "a", Output::Result, 1_900), Seen::Duplicate);
        assert_eq!(tally.output("voice", "a", Output::DeadLetter("timeout".into()), 1_950), Seen::Duplicate);
        assert_eq!(tally.output("voice", "c", Output::Result, 2_002), Seen::First);
        assert_eq!(tally.output("voice", "other-run", Output::Result, 2_000), Seen::Unknown);
        assert_eq!(tally.output("image", "a", Output::Result, 2_000), Seen::Unknown, "ids are per task");
        assert_eq!(tally.output("audio", "a", Output::Result, 2_000), Seen::Unknown);
        assert_eq!(tally.output("image", "x", Output::Result, 500), Seen::First, "clock skew clamps to 0");
        assert_eq!(tally.outstanding(), 1);
        assert_eq!(tally.totals(), (5, 3, 1));

        let summaries = tally.summaries();
        let image = &summaries[0];
        assert_eq!((image.task.as_str(), image.sent, image.lost, image.latency_ms.max), ("image", 1, 0, Some(0)));
        let voice = &summaries[1];
        assert_eq!(voice.sent, 4);
        assert_eq!(voice.results, 2);
        assert_eq!(voice.dead_letters, 1);
        assert_eq!(voice.dead_letters_by_kind.get("input_not_found"), Some(&1));
        assert_eq!(voice.lost, 1, "d never came back");
        assert_eq!(voice.duplicates, 2, "two extra outputs for a");
        assert_eq!(voice.latency_ms.p50, Some(100), "latencies 50, 100, 1000 (first outputs only)");
        assert_eq!(voice.latency_ms.max, Some(1000));
        // 3 ids over 1000 → 2002 ms.
        assert!((voice.throughput_per_s - 3.0 * 1000.0 / 1002.0).abs() < 1e-9);
    }
}
