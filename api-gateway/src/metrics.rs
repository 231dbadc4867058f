//! The gateway's Prometheus metrics: a plain registry that the other modules write into and
//! [`crate::endpoint`] serves as text at `GET /metrics`. It knows none of its writers. Every
//! name starts with `vramgate_gateway_`.

use std::sync::Arc;

use prometheus::{Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};

pub struct Metrics {
    registry: Registry,
    pub consumed: IntCounterVec,
    pub produced: IntCounterVec,
    pub dead_letters: IntCounterVec,
    pub retries: IntCounterVec,
    pub in_flight: IntGaugeVec,
    pub worker_calls: IntGaugeVec,
    pub permit_limit: IntGaugeVec,
    pub cpu_queue: IntGaugeVec,
    pub paused: IntGaugeVec,
    pub pauses: IntCounterVec,
    /// 1 while a task does not fit a model that changed at run time (its partitions paused).
    pub task_misfit: IntGaugeVec,
    pub resumes: IntCounterVec,
    pub pending: IntGaugeVec,
    pub consumer_lag: IntGaugeVec,
    pub held_bytes: IntGauge,
    pub held_bytes_limit: IntGauge,
    pub stale: prometheus::IntCounter,
    pub uncommitted: IntGauge,
    pub commits: IntCounterVec,
    /// Seconds from a record's fetch to its one output acknowledged, per task.
    pub record_seconds: HistogramVec,
    /// Seconds an offset commit took, sent to answered.
    pub commit_seconds: Histogram,
    /// Exactly-once delivery: transactions by outcome, their seconds, the outputs they wrote,
    /// and the outputs waiting for one.
    pub transactions: IntCounterVec,
    pub transaction_seconds: Histogram,
    pub transaction_outputs: prometheus::IntCounter,
    pub outbox: IntGauge,
    /// Exactly-once delivery, outputs read back after their commit ([`crate::consume::verify`]):
    /// found by a `read_committed` reader, written again after one was found aborted, waiting
    /// to be read back, and results partitions whose last stable offset has stayed behind them
    /// past the transaction timeout and a margin (a hanging transaction).
    pub outputs_verified: prometheus::IntCounter,
    pub outputs_redone: prometheus::IntCounter,
    pub outputs_unverified: IntGauge,
    pub hanging_transactions: IntGauge,
    pub log_suppressed: IntCounterVec,
    pub kafka_errors: IntCounterVec,
    pub produce_retries: prometheus::IntCounter,
    pub produce_retry_seconds: prometheus::Counter,
    pub outputs_rejected: IntCounterVec,
    pub workers: IntGaugeVec,
    pub worker_requests: IntCounterVec,
    pub worker_throttled: IntCounterVec,
    pub worker_failures: IntCounterVec,
    pub worker_ejections: IntCounterVec,
    pub worker_free: IntGaugeVec,
    pub worker_permits: IntGaugeVec,
    pub worker_ejected: IntGaugeVec,
    pub allocator_bytes: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let registry = Registry::new_custom(Some("vramgate_gateway".into()), None).expect("valid prefix");
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        vramgate_shared::telemetry::export::register_span_metrics(&registry).expect("unique metric");
        let held_bytes = IntGauge::new("held_bytes", "Payload bytes held: raw records, inputs read, decoded, in flight")
            .expect("valid metric");
        registry.register(Box::new(held_bytes.clone())).expect("unique metric");
        let held_bytes_limit =
            IntGauge::new("held_bytes_limit", "max_held_bytes: past it fetching pauses").expect("valid metric");
        registry.register(Box::new(held_bytes_limit.clone())).expect("unique metric");
        let stale = prometheus::IntCounter::new(
            "stale_records_total",
            "Records dropped unfinished because their partition was revoked (its new owner reads them)",
        )
        .expect("valid metric");
        registry.register(Box::new(stale.clone())).expect("unique metric");
        let uncommitted = IntGauge::new(
            "records_uncommitted",
            "Records fetched past the last commit (bounded by max_in_flight): what a crash would redo",
        )
        .expect("valid metric");
        registry.register(Box::new(uncommitted.clone())).expect("unique metric");
        let produce_retries = prometheus::IntCounter::new(
            "produce_retries_total",
            "Output records whose produce failed transiently and was tried again",
        )
        .expect("valid metric");
        registry.register(Box::new(produce_retries.clone())).expect("unique metric");
        let produce_retry_seconds = prometheus::Counter::new(
            "produce_retry_wait_seconds_total",
            "Time spent waiting between produce attempts (a broker away shows here)",
        )
        .expect("valid metric");
        registry.register(Box::new(produce_retry_seconds.clone())).expect("unique metric");
        let record_seconds = HistogramVec::new(
            HistogramOpts::new(
                "record_seconds",
                "Seconds from a record's fetch to its one output (result or dead letter) acknowledged: with the commit round trip, how long it holds its place in the in-flight window",
            )
            .buckets(vec![0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0]),
            &["task"],
        )
        .expect("valid metric");
        registry.register(Box::new(record_seconds.clone())).expect("unique metric");
        let commit_seconds = Histogram::with_opts(
            HistogramOpts::new("offset_commit_seconds", "Seconds from an offset commit sent to the broker's answer")
                .buckets(vec![0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0]),
        )
        .expect("valid metric");
        registry.register(Box::new(commit_seconds.clone())).expect("unique metric");
        let transaction_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "transaction_seconds",
                "Exactly-once delivery: seconds from a transaction's begin to its commit (or abort), its outputs' produce included",
            )
            .buckets(vec![0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0, 30.0]),
        )
        .expect("valid metric");
        registry.register(Box::new(transaction_seconds.clone())).expect("unique metric");
        // Label-less counters and gauges, registered as made.
        let single = |name: &str, help: &str| {
            let c = prometheus::IntCounter::new(name, help).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let level = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let transaction_outputs =
            single("transaction_outputs_total", "Exactly-once delivery: outputs written by committed transactions");
        let outbox = level(
            "outputs_awaiting_transaction",
            "Exactly-once delivery: finished records' outputs waiting for the transaction that commits their offsets",
        );
        let outputs_verified =
            single("outputs_verified_total", "Exactly-once delivery: committed outputs read back by a read_committed reader");
        let outputs_redone = single(
            "outputs_redone_total",
            "Exactly-once delivery: committed outputs a read_committed reader could not see (aborted after a reported commit), written again in a new transaction",
        );
        let outputs_unverified =
            level("outputs_unverified", "Exactly-once delivery: committed outputs not yet read back by a read_committed reader");
        let hanging_transactions = level(
            "hanging_transactions",
            "Exactly-once delivery: output partitions whose last stable offset has stayed behind committed outputs for longer than the transaction timeout and a margin",
        );
        let per_worker = ["task", "worker"];
        Arc::new(Metrics {
            record_seconds,
            commit_seconds,
            transactions: counter(
                "transactions_total",
                "Exactly-once delivery: transactions by outcome (committed; aborted, redone by the next; fenced, the producer replaced; failed, no producer could be made)",
                &["outcome"],
            ),
            transaction_seconds,
            transaction_outputs,
            outbox,
            outputs_verified,
            outputs_redone,
            outputs_unverified,
            hanging_transactions,
            workers: gauge("workers", "Workers the task knows (listed, or found in DNS)", &["task"]),
            worker_requests: counter("worker_requests_total", "Calls made to each worker", &per_worker),
            worker_throttled: counter("worker_throttled_total", "503/429 answers of each worker", &per_worker),
            worker_failures: counter(
                "worker_failures_total",
                "Failed calls of each worker: 5xx, timeouts, connections refused or lost",
                &per_worker,
            ),
            worker_ejections: counter(
                "worker_ejections_total",
                "Times each worker was taken out of service after failing",
                &per_worker,
            ),
            worker_free: gauge(
                "worker_free_estimate",
                "Admission room this gateway expects at each worker (bytes, or requests in count admission): its last report less the calls sent since",
                &per_worker,
            ),
            worker_permits: gauge("worker_permit_limit", "Adaptive limit of concurrent calls to each worker", &per_worker),
            worker_ejected: gauge("worker_ejected", "1 while a worker is out of service", &per_worker),
            produce_retries,
            produce_retry_seconds,
            outputs_rejected: counter(
                "outputs_rejected_total",
                "Outputs the broker refused for good: replaced by a trimmed dead letter (trimmed), or, if that was refused too, committed past (lost)",
                &["task", "outcome"],
            ),
            consumed: counter("records_consumed_total", "Records fetched from the request topics", &["task"]),
            produced: counter(
                "records_produced_total",
                "Records written and acknowledged, by outcome (result or dead_letter)",
                &["task", "outcome"],
            ),
            dead_letters: counter("dead_letters_total", "Dead letters written, by error kind", &["task", "kind"]),
            retries: counter(
                "retries_total",
                "Worker calls retried: throttled (503/429, after Retry-After) or error (5xx, timeout, connection)",
                &["task", "reason"],
            ),
            in_flight: gauge("records_in_flight", "Records held, from fetch to acknowledged output", &["task"]),
            worker_calls: gauge("worker_calls_in_flight", "Worker calls in progress (permits in use)", &["task"]),
            permit_limit: gauge("gpu_permit_limit", "Current adaptive limit of concurrent worker calls", &["task"]),
            cpu_queue: gauge("cpu_queue_depth", "Conversions submitted to the task's CPU pool and not finished", &["task"]),
            paused: gauge("paused_partitions", "Partitions paused by backpressure", &["task"]),
            pauses: counter(
                "partition_pauses_total",
                "Partitions paused, by reason (misfit, permits, budget, in_flight, shutdown)",
                &["task", "reason"],
            ),
            task_misfit: gauge(
                "task_misfit",
                "1 while the task does not fit a model that changed at run time: its partitions are paused",
                &["task"],
            ),
            resumes: counter("partition_resumes_total", "Partitions resumed after a pause", &["task"]),
            pending: gauge(
                "partition_pending_records",
                "Records fetched and not yet finished, per partition (what holds its commit back)",
                &["topic", "partition"],
            ),
            held_bytes,
            held_bytes_limit,
            stale,
            uncommitted,
            commits: counter("offset_commits_total", "Offset commits, by result (ok or error)", &["result"]),
            consumer_lag: gauge(
                "consumer_lag_records",
                "Records in an assigned partition past the group's committed offset, from librdkafka's statistics (every 5 s)",
                &["topic", "partition"],
            ),
            kafka_errors: counter(
                "kafka_client_errors_total",
                "Errors librdkafka reported (broker down, authentication failed), by kind",
                &["kind"],
            ),
            log_suppressed: counter(
                "log_lines_suppressed_total",
                "Log lines not written because their kind passed its rate limit (lines a second)",
                &["kind"],
            ),
            allocator_bytes: gauge(
                "allocator_bytes",
                "Memory each allocator holds, every 2 s: mimalloc committed and rust in_use (the gateway's own code: what mimalloc took from the system, what the code holds live in it), glibc in_use and free (librdkafka and the C libraries)",
                &["allocator", "state"],
            ),
            registry,
        })
    }

    /// Sets `allocator_bytes` from `bytes`.
    pub fn set_allocator_bytes(&self, bytes: crate::memory::AllocatorBytes) {
        let set = |allocator: &str, state: &str, value: u64| {
            self.allocator_bytes.with_label_values(&[allocator, state]).set(i64::try_from(value).unwrap_or(i64::MAX));
        };
        set("mimalloc", "committed", bytes.mimalloc_committed);
        set("rust", "in_use", bytes.rust_in_use);
        set("glibc", "in_use", bytes.glibc_in_use);
        set("glibc", "free", bytes.glibc_free);
    }

    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buffer).expect("text encoding cannot fail");
        String::from_utf8(buffer).expect("prometheus text is utf-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_allocator_figure_is_its_own_series() {
        let metrics = Metrics::new();
        metrics.set_allocator_bytes(crate::memory::AllocatorBytes {
            mimalloc_committed: 700,
            rust_in_use: 3,
            glibc_in_use: 20,
            glibc_free: 10,
        });
        let text = metrics.render();
        for series in [
            r#"vramgate_gateway_allocator_bytes{allocator="mimalloc",state="committed"} 700"#,
            r#"vramgate_gateway_allocator_bytes{allocator="rust",state="in_use"} 3"#,
            r#"vramgate_gateway_allocator_bytes{allocator="glibc",state="in_use"} 20"#,
            r#"vramgate_gateway_allocator_bytes{allocator="glibc",state="free"} 10"#,
        ] {
            assert!(text.contains(series), "{series} not in:\n{text}");
        }
    }
}
