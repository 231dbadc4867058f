//! Calling workers, as layers around one HTTP call: the choice of a worker among the task's
//! ([`workers`], by the policy in [`route`]; the set kept current by [`discovery`]), that
//! worker's adaptive GPU permits ([`permits`]) around the OIP client ([`client`]), and the
//! retry policy ([`retry`]) around all of it. [`call_worker`] composes them; each layer is
//! tested on its own.
//!
//! The permit is held only during a call, never while backing off, and each answer adjusts the
//! permit limit of the worker that gave it (+1 after a steady full round, ×0.9 on an overload
//! answer). A call that fails on one worker is retried on another at once when another is in
//! service (the failed one is avoided, and ejected after a streak); the record still gets one
//! answer, so one result, whichever worker gives it.

pub mod client;
pub mod discovery;
pub mod permits;
pub mod retry;
pub mod route;
pub mod workers;

use std::time::{Duration, Instant};

use tracing::Instrument;
use vramgate_shared::telemetry::{bounded, LogLimit, LOG_FIELD_MAX_BYTES};

use client::{CallError, InferCall, ModelOutput};
use retry::{Decision, RetryPolicy};

use crate::failure::Failure;
use vramgate_shared::events::{ErrorKind, Stage};
use crate::metrics::Metrics;
use crate::task::Task;
use workers::WorkerSet;

static RETRY_LOG: LogLimit = LogLimit::new(20);

/// A successful call and what it cost.
pub struct WorkerCall {
    pub output: ModelOutput,
    pub attempts: u32,
    /// Time spent waiting for a GPU permit, all attempts, ms.
    pub wait_ms: f64,
    /// Time spent in worker calls, all attempts, ms.
    pub inference_ms: f64,
}

/// Calls a worker of the task's stage `stage` (0: the task's `model`; see
/// [`crate::tasks::Converter::stage_models`]) with `call` until it answers, or the retry policy
/// gives up. `since`: when the record's first call began; the time 503s may keep it waiting
/// (`max_retry_seconds`) counts from there, over all its calls and stages.
pub async fn call_worker(task: &Task, stage: usize, call: &InferCall, metrics: &Metrics, since: Instant) -> Result<WorkerCall, Failure> {
    let Some(set) = task.stages.get(stage) else {
        let message = format!("task {} has {} models; a call asked for stage {stage}", task.name, task.stages.len());
        return Err(Failure::new(ErrorKind::Internal, Stage::Infer, message));
    };
    let mut policy = RetryPolicy::new(&task.config.retry, since);
    let mut calls = 0u32;
    let mut wait_ms = 0.0;
    let mut inference_ms = 0.0;
    let mut failed_on: Option<String> = None;
    loop {
        calls += 1;
        let (result, waited, took, worker) = permitted_call(task, set, call, calls, failed_on.as_deref(), metrics).await;
        wait_ms += ms(waited);
        inference_ms += ms(took);
        let error = match result {
            Ok(output) => return Ok(WorkerCall { output, attempts: calls, wait_ms, inference_ms }),
            Err(error) => error,
        };
        let shown = error.to_string();
        let retry_after = match &error {
            CallError::Throttled { retry_after, .. } => *retry_after,
            _ => None,
        };
        // A worker that failed (not one that is merely busy) is no reason to wait when another
        // can take the call now.
        let elsewhere = matches!(error, CallError::Failed { .. } | CallError::TimedOut { .. } | CallError::Unreachable { .. })
            && worker.as_deref().is_some_and(|url| set.another_in_service(url));
        failed_on = worker;
        match policy.next(error, calls, Instant::now()) {
            Decision::GiveUp(failure) => return Err(failure),
            Decision::Retry { delay, reason } => {
                let delay = if elsewhere { Duration::ZERO } else { delay };
                metrics.retries.with_label_values(&[&task.name, reason]).inc();
                if RETRY_LOG.allow() {
                    let error = bounded(&shown, LOG_FIELD_MAX_BYTES);
                    tracing::warn!(attempt = calls, error, retry_in_ms = delay.as_millis() as u64, "worker call failed; retrying");
                } else {
                    metrics.log_suppressed.with_label_values(&["worker_retry"]).inc();
                }
                let backoff = tracing::info_span!(
                    "backoff",
                    attempt = calls,
                    reason,
                    delay_ms = delay.as_millis() as u64,
                    retry_after_ms = tracing::field::Empty,
                );
                if let Some(after) = retry_after {
                    backoff.record("retry_after_ms", after.as_millis() as u64);
                }
                tokio::time::sleep(delay).instrument(backoff).await;
            }
        }
    }
}

/// The worker and permit layer: chooses a worker (avoiding `avoid`, the one that failed the
/// previous attempt), makes one call under one of its permits, and lets the answer adapt that
/// worker's limit, state and health. Returns the answer, the time waited for the permit, the
/// time the call took and the worker's URL.
async fn permitted_call(
    task: &Task,
    set: &WorkerSet,
    call: &InferCall,
    attempt: u32,
    avoid: Option<&str>,
    metrics: &Metrics,
) -> (Result<ModelOutput, CallError>, Duration, Duration, Option<String>) {
    let permit_wait = Duration::from_millis(task.config.permit_wait_ms);
    let mut waited = Duration::ZERO;
    let mut choices = 0;
    loop {
        let Some(endpoint) = set.choose(call.elements(), avoid) else {
            let message = format!("no worker known for task {} (none listed, or none found in DNS)", task.name);
            return (Err(CallError::Unreachable { message }), waited, Duration::ZERO, None);
        };
        let waiting = tracing::info_span!(
            "gpu_permit_wait",
            task = %task.name,
            model = %set.model,
            worker = %endpoint.url,
            permit.limit = endpoint.permits.limit(),
            permit.waiting = endpoint.permits.waiting(),
        );
        let (permit, wait) = endpoint.permits.acquire_within(permit_wait, || task.mark_congested()).instrument(waiting).await;
        waited += wait;
        choices += 1;
        // A worker ejected while this call waited for its permit is left for another in
        // service (chosen again, at most once per worker).
        if endpoint.is_ejected() && set.another_in_service(&endpoint.url) && choices <= set.count() {
            continue;
        }
        let (result, took) = call_on(task, set, call, &endpoint, permit, attempt, metrics).await;
        return (result, waited, took, Some(endpoint.url.clone()));
    }
}

/// One call on `endpoint` under its `permit`; its answer adapts that worker's limit, state and
/// health. Returns the answer and the time the call took.
async fn call_on(
    task: &Task,
    set: &WorkerSet,
    call: &InferCall,
    endpoint: &workers::Endpoint,
    permit: permits::Permit<'_>,
    attempt: u32,
    metrics: &Metrics,
) -> (Result<ModelOutput, CallError>, Duration) {
    let in_flight = metrics.worker_calls.with_label_values(&[&task.name]);
    in_flight.inc();
    let sent = endpoint.send(call.elements());
    let started = Instant::now();
    let result = endpoint.client.infer(&set.model, set.version, call, attempt, |headers| endpoint.observe(headers)).await;
    let took = started.elapsed();
    in_flight.dec();
    let outcome = result.as_ref().map(|_| ());
    let ejected = endpoint.finish(sent, outcome);
    set.record(endpoint, outcome, ejected);
    match &result {
        Ok(_) => endpoint.permits.succeeded(&permit, took),
        Err(error) if error.is_overload() => endpoint.permits.overloaded(),
        Err(_) => {}
    }
    (result, took)
}

/// A duration in milliseconds, to the microsecond: how every timing of a result is reported.
pub fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}
