//! GPU permits of one task type: a FIFO semaphore whose size adapts to what the worker says.
//!
//! The limit rises by one when it was reached and a full round of calls came back with steady
//! latency and no overload answer (additive increase), and falls to 0.9× on every 503, 429 or
//! timeout (multiplicative decrease), always within `[min, max]`. Several gateway replicas in
//! front of one worker thus settle where the worker stops pushing back, instead of each
//! multiplying its own fixed count.
//!
//! The limit is kept as a fraction so that repeated small decreases add up; the number of
//! permits is its floor. Shrinking while permits are out cannot take them back, so the excess is
//! recorded as a debt and paid by forgetting permits as they are returned.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, SemaphorePermit};

/// A call's latency counts as steady when it is at most this multiple of the running average.
const STEADY_LATENCY_RATIO: f64 = 1.5;
/// Weight of the newest latency in the running average.
const LATENCY_EWMA_WEIGHT: f64 = 0.2;
const DECREASE_FACTOR: f64 = 0.9;

#[derive(Debug)]
struct State {
    limit: f64,
    /// Permits that exist: handed out plus available, once the debt is paid.
    capacity: usize,
    /// Permits to forget as they come back, because the capacity was cut while they were out.
    debt: usize,
    in_use: usize,
    waiting: usize,
    /// Successful calls, since the last change, that were made with every permit in use.
    saturated_successes: usize,
    latency_avg: Option<f64>,
}

#[derive(Debug)]
pub struct AdaptivePermits {
    semaphore: Semaphore,
    state: Mutex<State>,
    min: usize,
    max: usize,
}

/// One permit; returned on drop. Report the call's outcome through [`AdaptivePermits`].
#[derive(Debug)]
pub struct Permit<'a> {
    permit: Option<SemaphorePermit<'a>>,
    owner: &'a AdaptivePermits,
    /// Whether every permit was in use when this one was granted: only then does a success say
    /// anything about whether the limit could be higher.
    saturated: bool,
}

impl Permit<'_> {
    pub fn saturated(&self) -> bool {
        self.saturated
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else { return };
        let mut state = self.owner.lock();
        state.in_use -= 1;
        if state.debt > 0 {
            state.debt -= 1;
            permit.forget();
        }
    }
}

/// Counts a waiter for as long as it waits, also when its future is dropped.
struct Waiting<'a>(&'a AdaptivePermits);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.lock().waiting -= 1;
    }
}

impl AdaptivePermits {
    pub fn new(initial: usize, min: usize, max: usize) -> Self {
        let min = min.max(1);
        let max = max.max(min);
        let initial = initial.clamp(min, max);
        AdaptivePermits {
            semaphore: Semaphore::new(initial),
            state: Mutex::new(State {
                limit: initial as f64,
                capacity: initial,
                debt: 0,
                in_use: 0,
                waiting: 0,
                saturated_successes: 0,
                latency_avg: None,
            }),
            min,
            max,
        }
    }

    /// The state is a handful of counters that stay consistent; a panic elsewhere while holding
    /// the lock is no reason to stop handing out permits.
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a permit, first come first served.
    pub async fn acquire(&self) -> Permit<'_> {
        self.lock().waiting += 1;
        let waiting = Waiting(self);
        let permit = self.semaphore.acquire().await.expect("the semaphore is never closed");
        drop(waiting);
        let mut state = self.lock();
        state.in_use += 1;
        let saturated = state.in_use >= state.capacity;
        Permit { permit: Some(permit), owner: self, saturated }
    }

    /// Like [`acquire`](Self::acquire), but also reports whether the wait passed `limit`
    /// (the caller's signal to stop fetching more of this work).
    pub async fn acquire_within(&self, limit: Duration, on_late: impl FnOnce()) -> (Permit<'_>, Duration) {
        let started = Instant::now();
        let acquire = self.acquire();
        tokio::pin!(acquire);
        let permit = match tokio::time::timeout(limit, &mut acquire).await {
            Ok(permit) => permit,
            Err(_) => {
                on_late();
                acquire.await
            }
        };
        (permit, started.elapsed())
    }

    /// The call made under `permit` succeeded after `latency`.
    pub fn succeeded(&self, permit: &Permit<'_>, latency: Duration) {
        let latency = latency.as_secs_f64();
        let mut state = self.lock();
        let steady = state.latency_avg.is_none_or(|avg| latency <= avg * STEADY_LATENCY_RATIO);
        state.latency_avg = Some(match state.latency_avg {
            Some(avg) => avg + LATENCY_EWMA_WEIGHT * (latency - avg),
            None => latency,
        });
        if !(permit.saturated && steady) {
            return;
        }
        state.saturated_successes += 1;
        if state.saturated_successes >= state.capacity {
            let raised = state.limit + 1.0;
            self.set_limit(&mut state, raised);
        }
    }

    /// The worker pushed back (503, 429) or a call timed out.
    pub fn overloaded(&self) {
        let mut state = self.lock();
        let lowered = state.limit * DECREASE_FACTOR;
        self.set_limit(&mut state, lowered);
    }

    fn set_limit(&self, state: &mut State, limit: f64) {
        state.limit = limit.clamp(self.min as f64, self.max as f64);
        state.saturated_successes = 0;
        let target = state.limit.floor() as usize;
        if target > state.capacity {
            let mut add = target - state.capacity;
            let forgiven = add.min(state.debt);
            state.debt -= forgiven;
            add -= forgiven;
            self.semaphore.add_permits(add);
        } else if target < state.capacity {
            let cut = state.capacity - target;
            let forgotten = self.semaphore.forget_permits(cut);
            state.debt += cut - forgotten;
        }
        state.capacity = target;
    }

    /// The current number of permits.
    pub fn limit(&self) -> usize {
        self.lock().capacity
    }

    /// Calls in progress.
    pub fn in_use(&self) -> usize {
        self.lock().in_use
    }

    /// Records waiting for a permit.
    pub fn waiting(&self) -> usize {
        self.lock().waiting
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAST: Duration = Duration::from_millis(10);

    #[tokio::test]
    async fn grows_by_one_per_saturated_round_and_stops_at_max() {
        let permits = AdaptivePermits::new(2, 1, 3);
        for _ in 0..2 {
            let a = permits.acquire().await;
            let b = permits.acquire().await;
            assert!(!a.saturated() && b.saturated());
            permits.succeeded(&b, FAST);
        }
        assert_eq!(permits.limit(), 3, "a full round of saturated successes adds one");
        for _ in 0..6 {
            let (_a, _b) = (permits.acquire().await, permits.acquire().await);
            let c = permits.acquire().await;
            assert!(c.saturated());
            permits.succeeded(&c, FAST);
        }
        assert_eq!(permits.limit(), 3, "never past max");
    }

    #[tokio::test]
    async fn unsaturated_or_slow_calls_do_not_grow_it() {
        let permits = AdaptivePermits::new(2, 1, 8);
        for _ in 0..10 {
            let a = permits.acquire().await;
            permits.succeeded(&a, FAST);
        }
        assert_eq!(permits.limit(), 2, "never saturated");
        for _ in 0..10 {
            let _a = permits.acquire().await;
            let b = permits.acquire().await;
            permits.succeeded(&b, FAST * 10);
            permits.succeeded(&b, FAST * 100);
        }
        // the first call set the average; each later one is > 1.5x it
        assert!(permits.limit() <= 3, "latency kept rising, limit {}", permits.limit());
    }

    #[tokio::test]
    async fn overload_shrinks_by_a_tenth_down_to_min() {
        let permits = AdaptivePermits::new(8, 2, 8);
        let limits: Vec<usize> = (0..30)
            .map(|_| {
                permits.overloaded();
                permits.limit()
            })
            .collect();
        assert_eq!(&limits[..4], &[7, 6, 5, 5]); // 7.2, 6.48, 5.83, 5.25
        assert_eq!(*limits.last().expect("30 values"), 2);
    }

    #[tokio::test]
    async fn shrinking_while_permits_are_out_takes_effect_as_they_return() {
        let permits = AdaptivePermits::new(4, 1, 4);
        let held: Vec<Permit<'_>> = futures::future::join_all((0..4).map(|_| permits.acquire())).await;
        for _ in 0..7 {
            permits.overloaded(); // 4 → 3.6 → ... → 1.9
        }
        assert_eq!(permits.limit(), 1);
        drop(held);
        assert_eq!(permits.in_use(), 0);
        let first = permits.acquire().await;
        let second = tokio::time::timeout(Duration::from_millis(50), permits.acquire()).await;
        assert!(second.is_err(), "only one permit may exist after shrinking to 1");
        drop(first);
        // growing again pays nothing back twice: exactly two permits exist at limit 2
        {
            let mut state = permits.lock();
            state.limit = 1.0;
            permits.set_limit(&mut state, 2.0);
        }
        let a = permits.acquire().await;
        let b = permits.acquire().await;
        assert!(tokio::time::timeout(Duration::from_millis(50), permits.acquire()).await.is_err());
        drop((a, b));
    }

    #[tokio::test]
    async fn late_waiters_are_reported_and_still_served() {
        let permits = AdaptivePermits::new(1, 1, 1);
        let held = permits.acquire().await;
        let late = std::sync::atomic::AtomicBool::new(false);
        let waiter = permits.acquire_within(Duration::from_millis(20), || {
            late.store(true, std::sync::atomic::Ordering::SeqCst)
        });
        let release = async {
            tokio::time::sleep(Duration::from_millis(60)).await;
            assert_eq!(permits.waiting(), 1);
            drop(held);
        };
        let ((permit, waited), ()) = tokio::join!(waiter, release);
        assert!(late.load(std::sync::atomic::Ordering::SeqCst));
        assert!(waited >= Duration::from_millis(50));
        drop(permit);
        assert_eq!(permits.waiting(), 0);
    }
}
