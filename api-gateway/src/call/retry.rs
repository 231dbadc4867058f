//! The retry layer of a worker call: given each failed answer, retry (after how long) or give
//! up (with which dead-letter kind). Pure: no clock but the one passed in, no I/O, so every
//! branch is unit-tested.
//!
//! - 503/429 (throttled): after the worker's `Retry-After` (or the backoff), without using up
//!   attempts, for up to `max_retry_seconds` in all;
//! - 5xx, timeouts, connection errors: exponential backoff with jitter, `max_attempts` calls;
//! - anything else (4xx, the model's own error on the input, 507, an unusable answer): not at
//!   all.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vramgate_shared::events::{ErrorKind, Stage};

use super::client::CallError;
use crate::config::RetryConfig;
use crate::failure::Failure;

/// What to do after a failed call.
#[derive(Debug)]
pub enum Decision {
    /// Call again after `delay`; `reason` labels the retry metric (`throttled` or `error`).
    Retry { delay: Duration, reason: &'static str },
    GiveUp(Failure),
}

/// One request's retry state.
pub struct RetryPolicy<'a> {
    config: &'a RetryConfig,
    throttle_deadline: Instant,
    failures: u32,
    throttled: u32,
}

impl<'a> RetryPolicy<'a> {
    pub fn new(config: &'a RetryConfig, now: Instant) -> Self {
        let throttle_deadline = now + Duration::from_secs_f64(config.max_retry_seconds.max(0.0));
        RetryPolicy { config, throttle_deadline, failures: 0, throttled: 0 }
    }

    /// The decision after `error`, the `calls`-th call, at `now`.
    pub fn next(&mut self, error: CallError, calls: u32, now: Instant) -> Decision {
        if !error.is_retryable() {
            return Decision::GiveUp(call_failure(error).with_attempts(calls));
        }
        match &error {
            CallError::Throttled { retry_after, .. } => {
                self.throttled += 1;
                let delay = retry_after.unwrap_or_else(|| backoff(self.config, self.throttled));
                if now + delay > self.throttle_deadline {
                    return Decision::GiveUp(
                        Failure::new(
                            ErrorKind::WorkerUnavailable,
                            Stage::Infer,
                            format!("worker still busy after {} s of retries: {error}", self.config.max_retry_seconds),
                        )
                        .with_attempts(calls),
                    );
                }
                Decision::Retry { delay, reason: "throttled" }
            }
            _ => {
                self.failures += 1;
                if self.failures >= self.config.max_attempts.max(1) {
                    return Decision::GiveUp(call_failure(error).with_attempts(calls));
                }
                Decision::Retry { delay: backoff(self.config, self.failures), reason: "error" }
            }
        }
    }
}

/// The dead-letter kind of a worker error that is not retried (any more).
pub fn call_failure(error: CallError) -> Failure {
    let kind = match &error {
        CallError::Rejected { status: 413 | 507, .. } => ErrorKind::InputTooLarge,
        CallError::Rejected { .. } => ErrorKind::WorkerRejected,
        CallError::ModelFailed { .. } => ErrorKind::ModelError,
        CallError::TimedOut { .. } => ErrorKind::Timeout,
        CallError::Throttled { .. } | CallError::Failed { .. } | CallError::Unreachable { .. } => {
            ErrorKind::WorkerUnavailable
        }
        CallError::BadResponse(_) => ErrorKind::Internal,
    };
    Failure::new(kind, Stage::Infer, error.to_string())
}

/// Exponential backoff: base·2^(n-1) capped at the maximum, less a random share of up to
/// `jitter` of it, so a crowd of retries after a worker restart spreads out.
pub fn backoff(retry: &RetryConfig, attempt: u32) -> Duration {
    let exp = retry.backoff_base_ms as f64 * 2f64.powi(attempt.saturating_sub(1).min(30) as i32);
    let capped = exp.min(retry.backoff_max_ms as f64).max(0.0);
    let jitter = retry.jitter.clamp(0.0, 1.0);
    Duration::from_secs_f64(capped * (1.0 - jitter * random_unit()) / 1000.0)
}

/// A number in [0, 1) from the standard library's randomly keyed hasher: enough to spread
/// retries, without a dependency for it.
fn random_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_jittered_within_bounds() {
        let retry = RetryConfig { backoff_base_ms: 100, backoff_max_ms: 1000, jitter: 0.5, ..Default::default() };
        for attempt in 1..12 {
            let d = backoff(&retry, attempt).as_secs_f64();
            let ceiling = (0.1 * 2f64.powi(attempt as i32 - 1)).min(1.0);
            assert!(d <= ceiling + 1e-9 && d >= ceiling / 2.0 - 1e-9, "attempt {attempt}: {d}");
        }
        let none = RetryConfig { jitter: 0.0, ..retry };
        assert_eq!(backoff(&none, 2), Duration::from_millis(200));
    }

    #[test]
    fn random_unit_is_in_range_and_varies() {
        let draws: Vec<f64> = (0..100).map(|_| random_unit()).collect();
        assert!(draws.iter().all(|d| (0.0..1.0).contains(d)));
        assert!(draws.windows(2).any(|w| w[0] != w[1]));
    }

    #[test]
    fn worker_errors_map_to_dead_letter_kinds() {
        let check = |e: CallError, kind: ErrorKind| assert_eq!(call_failure(e).kind, kind);
        check(CallError::Rejected { status: 400, message: "m".into() }, ErrorKind::WorkerRejected);
        check(CallError::ModelFailed { message: "m".into() }, ErrorKind::ModelError);
        check(CallError::Rejected { status: 413, message: "m".into() }, ErrorKind::InputTooLarge);
        check(CallError::Failed { message: "m".into() }, ErrorKind::WorkerUnavailable);
        check(CallError::TimedOut { message: "m".into() }, ErrorKind::Timeout);
        check(CallError::BadResponse("m".into()), ErrorKind::Internal);
    }

    #[test]
    fn errors_use_up_attempts_throttling_uses_up_time() {
        let config = RetryConfig { max_attempts: 3, max_retry_seconds: 10.0, jitter: 0.0, ..Default::default() };
        let t0 = Instant::now();
        let mut policy = RetryPolicy::new(&config, t0);
        let failed = || CallError::Failed { message: "refused".into() };
        let busy = |s| CallError::Throttled { status: 503, message: "busy".into(), retry_after: Some(Duration::from_secs(s)) };
        assert!(matches!(policy.next(failed(), 1, t0), Decision::Retry { reason: "error", .. }));
        // Throttling does not use up attempts.
        for call in 2..6 {
            assert!(matches!(policy.next(busy(1), call, t0), Decision::Retry { reason: "throttled", .. }));
        }
        assert!(matches!(policy.next(failed(), 6, t0), Decision::Retry { .. }));
        match policy.next(failed(), 7, t0) {
            Decision::GiveUp(f) => assert_eq!((f.kind, f.attempts), (ErrorKind::WorkerUnavailable, 7)),
            d => panic!("third error must give up: {d:?}"),
        }
        // A Retry-After that would pass max_retry_seconds gives up at once.
        let mut policy = RetryPolicy::new(&config, t0);
        match policy.next(busy(11), 1, t0) {
            Decision::GiveUp(f) => assert!(f.message.contains("still busy"), "{}", f.message),
            d => panic!("{d:?}"),
        }
        // A 4xx is never retried; nor is the model's own error on the input, which is
        // dead-lettered after its one call with the model's message.
        let mut policy = RetryPolicy::new(&config, t0);
        let rejected = CallError::Rejected { status: 400, message: "bad".into() };
        assert!(matches!(policy.next(rejected, 1, t0), Decision::GiveUp(_)));
        let raised = "model 'm' raised an error on this input: method 'forward': RuntimeError: index out of range in self";
        match policy.next(CallError::ModelFailed { message: raised.into() }, 1, t0) {
            Decision::GiveUp(f) => assert_eq!((f.kind, f.attempts, f.message.as_str()), (ErrorKind::ModelError, 1, raised)),
            d => panic!("{d:?}"),
        }
    }
}
