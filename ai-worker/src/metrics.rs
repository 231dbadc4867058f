//! The worker's Prometheus metrics, served as text at `GET /metrics`.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    /// Memory held by this process: allocator reserved (CUDA) or resident set (CPU).
    pub memory_used: IntGauge,
    /// Free on the device (CUDA) or available to new allocations (CPU).
    pub memory_available: IntGauge,
    pub memory_budget: IntGauge,
    pub memory_admitted: IntGauge,
    pub memory_admitted_peak: IntGauge,
    pub oom_errors: IntCounterVec,
    /// Requests the model itself raised on, run alone, by model: answered 400 as the input's
    /// fault.
    pub model_errors: IntCounterVec,
    pub retry_attempts: IntCounterVec,
    pub inference_duration: HistogramVec,
    pub inference_phases: HistogramVec,
    pub request_phases: HistogramVec,
    pub concurrent_tasks: IntGauge,
    pub admission_wait: Histogram,
    pub admission_rejections: IntCounterVec,
    pub batch_size: HistogramVec,
    pub estimate_ratio: prometheus::GaugeVec,
    pub queued_requests: IntGauge,
    /// The batch size the worker chose by measurement, by model and size class.
    pub batch_size_limit: IntGaugeVec,
    /// NVML's utilisation of the device, 0 to 1: a family without labels whose one series exists
    /// only while there is a reading (see [`Metrics::set_gpu_utilization`]).
    gpu_utilization: GaugeVec,
    /// CUDA: the caching allocator's bytes in tensors, beside `memory_used` (reserved); absent
    /// on CPU, where the resident set has no such split.
    memory_allocated: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        vramgate_shared::telemetry::export::register_span_metrics(&registry).expect("unique metric");
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let histogram = |name: &str, help: &str, labels: &[&str], buckets: Vec<f64>| {
            let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels).expect("valid metric");
            registry.register(Box::new(h.clone())).expect("unique metric");
            h
        };
        let seconds = vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
        let estimate_ratio = prometheus::GaugeVec::new(
            Opts::new("memory_estimate_ratio", "Last measured batch peak over its estimate, by model"),
            &["model"],
        )
        .expect("valid metric");
        registry.register(Box::new(estimate_ratio.clone())).expect("unique metric");
        let admission_wait = Histogram::with_opts(
            HistogramOpts::new("admission_wait_seconds", "Time requests waited for memory before they were admitted")
                .buckets(seconds.clone()),
        )
        .expect("valid metric");
        registry.register(Box::new(admission_wait.clone())).expect("unique metric");
        let batch_size_limit = IntGaugeVec::new(
            Opts::new(
                "vramgate_worker_batch_size_limit",
                "Most items one batch may hold, chosen from measured throughput, by model and size class \
                 (item_elements: the class's lowest elements per item; the class spans up to twice that)",
            ),
            &["model", "item_elements"],
        )
        .expect("valid metric");
        registry.register(Box::new(batch_size_limit.clone())).expect("unique metric");
        let gpu_utilization = GaugeVec::new(
            Opts::new(
                "vramgate_worker_gpu_utilization_ratio",
                "Share of NVML's last sample period in which a kernel ran on the device, 0 to 1 \
                 (CUDA with NVML only: absent on CPU and where NVML gives no reading)",
            ),
            &[],
        )
        .expect("valid metric");
        registry.register(Box::new(gpu_utilization.clone())).expect("unique metric");
        let memory_allocated = IntGaugeVec::new(
            Opts::new(
                "gpu_memory_allocated_bytes",
                "CUDA only: bytes the caching allocator has handed to tensors, of gpu_memory_used_bytes reserved \
                 (the rest is its cache)",
            ),
            &[],
        )
        .expect("valid metric");
        registry.register(Box::new(memory_allocated.clone())).expect("unique metric");
        Metrics {
            memory_used: gauge("gpu_memory_used_bytes", "Device memory held by this worker (CUDA: allocator reserved; CPU: resident set)"),
            memory_available: gauge("gpu_memory_available_bytes", "Device memory free (CUDA: NVML; CPU: MemAvailable)"),
            memory_budget: gauge("gpu_memory_budget_bytes", "Bytes admission may hand out now"),
            memory_admitted: gauge("gpu_memory_admitted_bytes", "Estimated bytes of the requests admitted now"),
            memory_admitted_peak: gauge(
                "gpu_memory_admitted_peak_bytes",
                "Most estimated bytes ever admitted at once (high-water mark)",
            ),
            oom_errors: counter("inference_oom_errors_total", "Allocation failures while running a batch", &["model"]),
            model_errors: counter(
                "inference_model_errors_total",
                "Requests the model raised an error on when run alone (not an OOM, not a device fault), \
                 answered 400 as the input's fault",
                &["model"],
            ),
            retry_attempts: counter(
                "inference_retry_attempts_total",
                "Batches run again after an OOM (halved, or alone in the serial lane)",
                &["model"],
            ),
            inference_duration: histogram(
                "inference_duration_seconds",
                "Time one batch took in the model",
                &["model"],
                seconds.clone(),
            ),
            inference_phases: histogram(
                "inference_phase_seconds",
                "Time one batch took in each phase of its model call: inputs (the batch tensors built on \
                 the host; on CUDA in pinned memory), to_device (the copy queued; on CUDA non-blocking), \
                 model (the call; on CUDA until its stream is done), outputs (brought back and split per \
                 request)",
                &["model", "phase"],
                seconds.clone(),
            ),
            request_phases: histogram(
                "request_phase_seconds",
                "Time one inference request took in each phase of its handler: body (read from the \
                 connection), decode (the request parsed and its inputs checked and taken), infer \
                 (admission, the batch queue and its batch: see inference_phase_seconds), encode (the \
                 answer built); writing the answer to the socket comes after and is not counted",
                &["model", "phase"],
                seconds.clone(),
            ),
            concurrent_tasks: gauge("concurrent_inference_tasks", "Batches running now"),
            admission_wait,
            admission_rejections: counter(
                "admission_rejections_total",
                "Requests not admitted, by reason (too_large, queue_full, timeout, deadline)",
                &["reason"],
            ),
            batch_size: histogram(
                "inference_batch_size",
                "Requests per batch",
                &["model"],
                vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0],
            ),
            estimate_ratio,
            queued_requests: gauge("admission_queued_requests", "Requests waiting for memory now"),
            batch_size_limit,
            gpu_utilization,
            memory_allocated,
            registry,
        }
    }

    /// Sets the device's utilisation, or removes the gauge when there is no reading: a plain
    /// gauge would show 0 on CPU, which an alert or a dashboard would read as an idle card.
    pub fn set_gpu_utilization(&self, ratio: Option<f64>) {
        match ratio {
            Some(ratio) => self.gpu_utilization.with_label_values::<&str>(&[]).set(ratio),
            None => self.gpu_utilization.reset(),
        }
    }

    /// Sets the allocator's allocated bytes, or removes the gauge where there is no allocator
    /// (CPU), as [`Metrics::set_gpu_utilization`] does.
    pub fn set_memory_allocated(&self, bytes: Option<u64>) {
        match bytes {
            Some(bytes) => self.memory_allocated.with_label_values::<&str>(&[]).set(bytes as i64),
            None => self.memory_allocated.reset(),
        }
    }

    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut out).expect("text encoding into a Vec");
        String::from_utf8(out).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_names_operators_query() {
        let m = Metrics::new();
        m.oom_errors.with_label_values(&["m"]).inc();
        m.model_errors.with_label_values(&["m"]).inc();
        m.batch_size.with_label_values(&["m"]).observe(3.0);
        m.inference_duration.with_label_values(&["m"]).observe(0.01);
        m.inference_phases.with_label_values(&["m", "model"]).observe(0.01);
        m.admission_rejections.with_label_values(&["queue_full"]).inc();
        m.retry_attempts.with_label_values(&["m"]).inc();
        m.estimate_ratio.with_label_values(&["m"]).set(0.9);
        m.batch_size_limit.with_label_values(&["m", "16384"]).set(8);
        m.set_gpu_utilization(Some(0.75));
        let text = m.render();
        for name in [
            "gpu_memory_used_bytes",
            "gpu_memory_available_bytes",
            "gpu_memory_budget_bytes",
            "gpu_memory_admitted_bytes",
            "inference_oom_errors_total{model=\"m\"} 1",
            "inference_model_errors_total{model=\"m\"} 1",
            "inference_retry_attempts_total",
            "inference_duration_seconds_bucket",
            "inference_phase_seconds_bucket{model=\"m\",phase=\"model\"",
            "concurrent_inference_tasks",
            "admission_wait_seconds",
            "admission_rejections_total{reason=\"queue_full\"} 1",
            "inference_batch_size_bucket",
            "memory_estimate_ratio{model=\"m\"} 0.9",
            "vramgate_worker_batch_size_limit{item_elements=\"16384\",model=\"m\"} 8",
            "vramgate_worker_gpu_utilization_ratio 0.75",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
    }

    #[test]
    fn gpu_utilization_is_absent_without_a_reading() {
        let m = Metrics::new();
        // CPU, or CUDA without NVML: never set, so never rendered (not a 0 that looks idle).
        assert!(!m.render().contains("vramgate_worker_gpu_utilization_ratio"));
        m.set_gpu_utilization(Some(1.0));
        assert!(m.render().contains("vramgate_worker_gpu_utilization_ratio 1\n"));
        // A reading that stops (a MIG instance, a lost device) takes the series away again.
        m.set_gpu_utilization(None);
        assert!(!m.render().contains("vramgate_worker_gpu_utilization_ratio"));
    }
}
