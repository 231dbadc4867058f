//! One picture (or one voice clip, one tensor) answered: its header probed and its conversion
//! reserved from the byte budget, converted on the task's CPU pool, its worker calls made step
//! by step (each under its model's permits and the worker's byte admission), its outputs
//! stored, until the task's [`Step::Done`]. [`crate::record`] runs this once for an event of
//! one input, and [`crate::frames`] once per frame of a video or a batch.

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use tracing::Instrument;
use vramgate_shared::events::{ErrorKind, Stage};

use crate::budget::Held;
use crate::call::{self, client::InferCall};
use crate::failure::Failure;
use crate::metrics::Metrics;
use crate::storage::buckets::Buckets;
use crate::task::Task;
use crate::tasks::{Converted, Plan, Step};

/// What answering needs of the gateway's shared state.
#[derive(Clone, Copy)]
pub struct Services<'a> {
    pub metrics: &'a Metrics,
    pub buckets: &'a Buckets,
}

/// One input's answer, and what it cost.
pub struct Answered {
    pub output: serde_json::Value,
    /// Each model that answered with its version, once, in the order they answered.
    pub models: Vec<(String, String)>,
    pub convert_ms: f64,
    pub wait_ms: f64,
    pub inference_ms: f64,
    pub attempts: u32,
}

/// Where an input's answer goes and what its charge keeps: `id` names the worker calls,
/// `store_id` the stored outputs' folder; `keep` is what the charge holds besides the input
/// (the record itself), to which it shrinks once the input is converted.
pub struct Named<'a> {
    pub id: &'a str,
    pub store_id: &'a str,
    pub keep: u64,
}

/// Answers one input's `bytes` through `plan`. `held` is the input's charge in the byte
/// budget (its bytes already counted, and `named.keep`); it grows by what the conversion holds,
/// and holds no more than `keep` and what is still needed once the input is converted.
/// Conversion time counts from `started`.
pub async fn answer(
    services: Services<'_>,
    task: &Task,
    held: &mut Held,
    named: Named<'_>,
    plan: &std::sync::Arc<dyn Plan>,
    bytes: Vec<u8>,
    started: Instant,
) -> Result<Answered, Failure> {
    let Named { id, store_id, keep: record_bytes } = named;
    // Check the header (limits, format) and reserve what decoding will hold, before decoding.
    held.grow(plan.probe(&bytes)?).await;
    let queue = services.metrics.cpu_queue.with_label_values(&[&task.name]);
    queue.inc();
    let input_bytes = bytes.len();
    let format = task.config.converter.as_str();
    let converting = plan.clone();
    let result = on_pool(&task.pool, task.pool.current_num_threads(), move || {
        let span = tracing::info_span!("convert", input.format = format, input.bytes = input_bytes, output.elements = tracing::field::Empty);
        let _entered = span.enter();
        let converted = converting.convert(&bytes);
        if let Ok(c) = &converted {
            span.record("output.elements", c.calls.iter().flat_map(|call| &call.inputs).map(|t| t.shape.iter().product::<usize>()).sum::<usize>());
        }
        converted
    })
    .await;
    queue.dec();
    let mut converted = result.and_then(|r| r)?;
    let mut convert_ms = call::ms(started.elapsed());

    // The calls, step by step: a task with one model makes one call; a cascade makes each
    // stage's calls together, and its CPU work between stages runs on the task's pool.
    let chain_started = Instant::now();
    let (mut wait_ms, mut inference_ms, mut attempts) = (0.0, 0.0, 0u32);
    let mut models: Vec<(String, String)> = Vec::new();
    let output = loop {
        let Converted { calls, finish } = converted;
        // One encoded body per call, which every attempt re-sends; the tensors are gone after.
        let bodies: Vec<StageCall> = calls
            .into_iter()
            .map(|c| StageCall { stage: c.stage, name: c.name, body: InferCall::new(id, &c.inputs, c.outputs, stage_protocol(task, c.stage)) })
            .collect();
        let holding = record_bytes + finish.held_bytes() + bodies.iter().map(|c| c.body.body_len() as u64).sum::<u64>();
        if holding > held.bytes() {
            held.grow(holding - held.bytes()).await;
        } else {
            held.shrink_to(holding);
        }
        let answers = call_stage(task, &bodies, services.metrics, chain_started).await?;
        drop(bodies);
        let (mut step_wait, mut step_inference) = (0.0f64, 0.0f64);
        let mut tensors = Vec::with_capacity(answers.len());
        for answer in answers {
            // Calls made together overlap: a step costs its slowest call.
            step_wait = step_wait.max(answer.wait_ms);
            step_inference = step_inference.max(answer.inference_ms);
            attempts += answer.attempts;
            let answered = (answer.output.model.clone(), answer.output.version.clone());
            if !models.contains(&answered) {
                models.push(answered);
            }
            tensors.push(answer.output.tensors);
        }
        (wait_ms, inference_ms) = (wait_ms + step_wait, inference_ms + step_inference);
        let step = if finish.cpu_bound() {
            let between = Instant::now();
            let step = on_pool(&task.pool, task.pool.current_num_threads(), move || finish.output(tensors)).await;
            convert_ms += call::ms(between.elapsed());
            step.and_then(|r| r)
        } else {
            finish.output(tensors)
        };
        match step? {
            Step::Done(output) => break output,
            Step::Store { mut output, stored } => {
                // The claim check: each stored output written, then its reference in the result.
                let store_started = Instant::now();
                // Encoded already: counted now, so the budget sees them while they upload.
                held.grow(stored.iter().map(|s| s.bytes.len() as u64).sum()).await;
                for object in stored {
                    let name = object.output.clone();
                    let reference = services
                        .buckets
                        .put(&task.name, store_id, object)
                        .await
                        .map_err(|message| Failure::new(ErrorKind::StoreFailed, Stage::Store, message))?;
                    output["outputs"][name.as_str()] = reference;
                }
                convert_ms += call::ms(store_started.elapsed());
                break output;
            }
            Step::Next(next) => converted = next,
        }
    };
    Ok(Answered { output, models, convert_ms, wait_ms, inference_ms, attempts })
}

/// The door the workers of `stage` are called through.
fn stage_protocol(task: &Task, stage: usize) -> crate::call::client::Protocol {
    task.stages.get(stage).map_or_else(Default::default, |set| set.protocol())
}

/// One call of a step: which of the task's models, the pipeline stage's name if any, the body.
struct StageCall {
    stage: usize,
    name: Option<&'static str>,
    body: InferCall,
}

/// Makes one step's calls together and waits for all of them; the first that fails for good
/// fails the record (the others are dropped, which cancels them). With more than one model in
/// the task, or a pipeline's named stages, each stage's calls of the step are a `stage` span
/// and a failure names the stage and its model. The answers come in the calls' order.
async fn call_stage(
    task: &Task,
    calls: &[StageCall],
    metrics: &Metrics,
    chain_started: Instant,
) -> Result<Vec<call::WorkerCall>, Failure> {
    fn one<'a>(task: &'a Task, c: &'a StageCall, metrics: &'a Metrics, started: Instant) -> impl std::future::Future<Output = Result<call::WorkerCall, Failure>> + 'a {
        call::call_worker(task, c.stage, &c.body, metrics, started)
    }
    if task.stages.len() == 1 && calls.iter().all(|c| c.name.is_none()) {
        return futures::future::try_join_all(calls.iter().map(|c| one(task, c, metrics, chain_started))).await;
    }
    // The calls by stage, in the order each stage first appears.
    let mut groups: Vec<(usize, Option<&'static str>, Vec<usize>)> = Vec::new();
    for (i, c) in calls.iter().enumerate() {
        match groups.iter_mut().find(|(stage, name, _)| *stage == c.stage && *name == c.name) {
            Some((_, _, members)) => members.push(i),
            None => groups.push((c.stage, c.name, vec![i])),
        }
    }
    let stages = task.stages.len();
    let answered = futures::future::try_join_all(groups.into_iter().map(|(stage, name, members)| {
        let model = task.stages.get(stage).map(|s| s.model.as_str()).unwrap_or("?");
        let span = tracing::info_span!("stage", stage = stage + 1, name = name.unwrap_or(""), model, calls = members.len());
        let label = name.map_or_else(|| format!("{} of {stages}", stage + 1), str::to_string);
        let made = futures::future::try_join_all(members.iter().map(|&i| one(task, &calls[i], metrics, chain_started)));
        async move {
            let answers = made.instrument(span).await.map_err(|mut failure| {
                failure.message = format!("stage {label} ({model}): {}", failure.message);
                failure
            })?;
            Ok::<_, Failure>(members.into_iter().zip(answers).collect::<Vec<_>>())
        }
    }))
    .await?;
    let mut ordered: Vec<Option<call::WorkerCall>> = (0..calls.len()).map(|_| None).collect();
    for (i, answer) in answered.into_iter().flatten() {
        ordered[i] = Some(answer);
    }
    Ok(ordered.into_iter().flatten().collect())
}

/// Runs CPU-bound work on a rayon pool and awaits it without blocking a tokio thread. The
/// caller's span goes along, so the pool's logs carry the record's fields.
/// Runs `work` on `pool`; the time it waits for a thread is a `cpu_queue_wait` span.
pub(crate) async fn on_pool<T: Send + 'static>(
    pool: &rayon::ThreadPool,
    threads: usize,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Failure> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let span = tracing::Span::current();
    let waiting = tracing::info_span!("cpu_queue_wait", pool.threads = threads);
    pool.spawn(move || {
        drop(waiting);
        let _entered = span.enter();
        let _ = tx.send(std::panic::catch_unwind(AssertUnwindSafe(work)));
    });
    match rx.await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(_)) => Err(Failure::new(
            ErrorKind::Internal,
            Stage::Convert,
            "conversion panicked on this input; see the gateway log",
        )),
        Err(_) => Err(Failure::new(ErrorKind::Internal, Stage::Convert, "cpu pool dropped the job")),
    }
}


