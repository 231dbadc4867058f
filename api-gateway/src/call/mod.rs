//! Calling workers, as layers around one HTTP call: the task's adaptive GPU permits
//! ([`permits`]) around the OIP client ([`client`]), and the retry policy ([`retry`]) around
//! both. [`call_worker`] composes them; each layer is tested on its own.
//!
//! The permit is held only during a call, never while backing off, and each answer adjusts the
//! task's permit limit (+1 after a steady full round, ×0.9 on an overload answer).

pub mod client;
pub mod permits;
pub mod retry;

use std::time::{Duration, Instant};

use tracing::Instrument;
use vramgate_shared::telemetry::{bounded, LogLimit, LOG_FIELD_MAX_BYTES};

use client::{CallError, InferCall, ModelOutput};
use retry::{Decision, RetryPolicy};

use crate::failure::Failure;
use crate::metrics::Metrics;
use crate::task::Task;

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

/// Calls the task's worker with `call` until it answers, or the retry policy gives up.
pub async fn call_worker(task: &Task, call: &InferCall, metrics: &Metrics) -> Result<WorkerCall, Failure> {
    let mut policy = RetryPolicy::new(&task.config.retry, Instant::now());
    let mut calls = 0u32;
    let mut wait_ms = 0.0;
    let mut inference_ms = 0.0;
    loop {
        calls += 1;
        let (result, waited, took) = permitted_call(task, call, calls, metrics).await;
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
        match policy.next(error, calls, Instant::now()) {
            Decision::GiveUp(failure) => return Err(failure),
            Decision::Retry { delay, reason } => {
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

/// The permit layer: one call under one of the task's permits, whose answer adapts the limit.
/// Returns the answer, the time waited for the permit and the time the call took.
async fn permitted_call(
    task: &Task,
    call: &InferCall,
    attempt: u32,
    metrics: &Metrics,
) -> (Result<ModelOutput, CallError>, Duration, Duration) {
    let permit_wait = Duration::from_millis(task.config.permit_wait_ms);
    let waiting = tracing::info_span!(
        "gpu_permit_wait",
        task = %task.name,
        permit.limit = task.permits.limit(),
        permit.waiting = task.permits.waiting(),
    );
    let (permit, waited) = task.permits.acquire_within(permit_wait, || task.mark_congested()).instrument(waiting).await;
    let in_flight = metrics.worker_calls.with_label_values(&[&task.name]);
    in_flight.inc();
    let started = Instant::now();
    let result = task.worker.infer(&task.config.model, call, attempt).await;
    let took = started.elapsed();
    in_flight.dec();
    match &result {
        Ok(_) => task.permits.succeeded(&permit, took),
        Err(error) if error.is_overload() => task.permits.overloaded(),
        Err(_) => {}
    }
    (result, waited, took)
}

/// A duration in milliseconds, to the microsecond: how every timing of a result is reported.
pub fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}
