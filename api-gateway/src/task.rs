//! One row of the task table at run time: its topics, CPU pool and workers (each with its own
//! GPU permits).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;

use prometheus::{IntCounter, IntGauge};

use crate::call::workers::WorkerSet;
use crate::config::{self, TaskConfig, WorkerEndpoint, WorkerSource};
use crate::metrics::Metrics;
use crate::tasks::audio::AudioInput;
use crate::tasks::image::ImageTask;
use crate::tasks::image_model::ImageInput;
use crate::tasks::outputs::{ConfiguredTask, Outputs};
use crate::tasks::stages::Pipeline;
use crate::tasks::tensor::TensorInput;
use crate::tasks::voice::VoiceTask;
use crate::tasks::Converter;

pub struct Task {
    pub name: String,
    pub config: TaskConfig,
    pub requests_topic: String,
    pub results_topic: String,
    pub dlq_topic: String,
    /// This task's own CPU pool: a burst of one type never queues behind another's conversions.
    pub pool: rayon::ThreadPool,
    /// Set when a record waited past `permit_wait_ms` for a permit: the fetch loop pauses this
    /// task's partitions until the waiters are served.
    congested: AtomicBool,
    /// A model of the task changed at run time so that the task no longer fits it
    /// ([`crate::model_check::watch`]): its partitions stay paused until it fits again.
    misfit: AtomicBool,
    /// The task's workers, one set per model it calls (`stages[0]`: the task's `model`; then its
    /// converter's `stage_models`), all from `worker_source` (kept current by
    /// `call::discovery`), each with its own GPU permits. Never empty.
    pub stages: Vec<Arc<WorkerSet>>,
    pub worker_source: WorkerSource,
    /// What this task does to a request before and after the worker call.
    pub converter: Box<dyn Converter>,
    /// Made once here rather than for every record on the hot path.
    pub hot: Hot,
}

/// What every record of a task names or counts, resolved once: span names (`process <topic>`,
/// `send <topic>`) and the task's metric children (a labelled lookup hashes its labels and
/// takes a lock on every call).
pub struct Hot {
    pub process_span: String,
    pub send_result_span: String,
    pub send_dead_letter_span: String,
    pub consumed: IntCounter,
    pub in_flight: IntGauge,
    pub produced_result: IntCounter,
    pub produced_dead_letter: IntCounter,
    pub record_seconds: prometheus::Histogram,
    pub misfit: IntGauge,
}

impl Hot {
    fn new(name: &str, requests: &str, results: &str, dlq: &str, metrics: &Metrics) -> Self {
        Hot {
            process_span: format!("process {requests}"),
            send_result_span: format!("send {results}"),
            send_dead_letter_span: format!("send {dlq}"),
            consumed: metrics.consumed.with_label_values(&[name]),
            in_flight: metrics.in_flight.with_label_values(&[name]),
            produced_result: metrics.produced.with_label_values(&[name, "result"]),
            produced_dead_letter: metrics.produced.with_label_values(&[name, "dead_letter"]),
            record_seconds: metrics.record_seconds.with_label_values(&[name]),
            misfit: metrics.task_misfit.with_label_values(&[name]),
        }
    }
}

impl Task {
    pub fn new(name: &str, config: &TaskConfig, worker: &WorkerEndpoint, metrics: Arc<Metrics>) -> anyhow::Result<Self> {
        let threads = config.cpu_threads();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name({
                let name = name.to_string();
                move |i| format!("{name}-cpu-{i}")
            })
            .build()
            .with_context(|| format!("starting the {name} cpu pool"))?;
        let timeout = config.request_timeout_seconds.unwrap_or(worker.request_timeout_seconds);
        let token = config.worker_auth_token.as_ref().or(worker.auth_token.as_ref()).cloned();
        let routing = config.routing.unwrap_or(worker.routing);
        let (requests_topic, results_topic, dlq_topic) =
            (config.requests_topic(name), config.results_topic(name), config.dlq_topic(name));
        let hot = Hot::new(name, &requests_topic, &results_topic, &dlq_topic, &metrics);
        let converter = converter(config).map_err(|e| anyhow::anyhow!("tasks.{name}.{e}"))?;
        let worker_source = config.workers(worker);
        // Stage 0 is labelled with the task's name, as it always was; a further stage with
        // `<task>/<model>`, so that its permits and workers show apart.
        let later = converter.stage_models();
        let labels = std::iter::once(name.to_string()).chain(later.iter().map(|m| format!("{name}/{m}")));
        let first = converter.first_model().unwrap_or_else(|| config.model.clone());
        let models = std::iter::once(first).chain(later.iter().cloned());
        let mut stages = Vec::new();
        for (stage, (label, model)) in labels.zip(models).enumerate() {
            let pin = if stage == 0 { config.model_version } else { None };
            let set = WorkerSet::new(&label, &model, routing, timeout, token.clone(), config.gpu_permits.clone(), metrics.clone())
                .speaking(worker.protocol)
                .pinned(pin);
            if let WorkerSource::Static(urls) = &worker_source {
                set.replace(urls)?;
            }
            stages.push(Arc::new(set));
        }
        Ok(Task {
            name: name.to_string(),
            requests_topic,
            results_topic,
            dlq_topic,
            config: config.clone(),
            pool,
            congested: AtomicBool::new(false),
            misfit: AtomicBool::new(false),
            converter,
            stages,
            worker_source,
            hot,
        })
    }

    /// The workers of the task's own `model` (stage 0): the set its permits and congestion
    /// are read from.
    pub fn workers(&self) -> &WorkerSet {
        &self.stages[0]
    }

    /// Marks the task as not fitting its models (its partitions pause) or as fitting again.
    pub fn set_misfit(&self, misfit: bool) {
        self.misfit.store(misfit, Ordering::Relaxed);
        self.hot.misfit.set(i64::from(misfit));
    }

    pub fn misfit(&self) -> bool {
        self.misfit.load(Ordering::Relaxed)
    }

    pub fn mark_congested(&self) {
        self.congested.store(true, Ordering::Relaxed);
    }

    /// Whether this task's partitions should stay paused for lack of permits. Clears the flag
    /// once the waiters fall to `resume_fraction` of the limit (hysteresis), so a short stall
    /// does not flap the partitions.
    pub fn congested(&self, resume_fraction: f64) -> bool {
        if !self.congested.load(Ordering::Relaxed) {
            return false;
        }
        let resume_at = (self.workers().permit_limit() as f64 * resume_fraction).floor() as usize;
        if self.workers().waiting() <= resume_at {
            self.congested.store(false, Ordering::Relaxed);
            return false;
        }
        true
    }
}

/// The converter of a task table row. Here, not in `tasks`: the configuration holds each
/// task's options (`tasks` owns their types), so the tasks know nothing of the table.
/// Fails when a labels file named by an `[[outputs]]` row cannot be read.
fn converter(config: &TaskConfig) -> Result<Box<dyn Converter>, String> {
    let outputs = match config.configured_outputs() {
        true => Some(Outputs::load(&config.outputs, config.max_output_elements)?),
        false => None,
    };
    if !config.stages.is_empty() {
        return Ok(Box::new(Pipeline::new(&config.stages, config.max_output_elements)?));
    }
    Ok(match (config.converter, outputs) {
        (config::Converter::Wav, _) => Box::new(VoiceTask::new(config.wav.clone())),
        (config::Converter::Image, Some(outputs)) => Box::new(ConfiguredTask::new(ImageInput { options: config.image.clone() }, outputs)),
        (config::Converter::Image, None) => Box::new(ImageTask::new(config.image.clone())),
        (config::Converter::Audio, Some(outputs)) => Box::new(ConfiguredTask::new(AudioInput { options: config.audio.clone() }, outputs)),
        (config::Converter::Tensor, Some(outputs)) => Box::new(ConfiguredTask::new(TensorInput { options: config.tensor.clone() }, outputs)),
        (converter, None) => return Err(format!("converter {} has no outputs", converter.as_str())),
    })
}
