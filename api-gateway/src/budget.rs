//! One byte budget for everything the gateway holds of its records: the raw records fetched,
//! the files read, the decoded inputs and the request bodies in flight.
//!
//! A record is charged its raw size when it is fetched ([`ByteBudget::hold`]; it is already in
//! memory, so that charge cannot wait), and grows its charge before each step that allocates
//! ([`Held::grow`]: reading a file, decoding). Growing waits, first come first served, until
//! the bytes fit. The fetch loop pauses the partitions while the budget is spent or anyone is
//! waiting, so the raw charges stop growing too.
//!
//! The budget never deadlocks on itself: when no record that holds a grant is making progress
//! (every holder is waiting to grow), the oldest waiter is let through even if that overshoots.
//! The overshoot is at most one record's step.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

#[derive(Debug, Default)]
struct State {
    used: u64,
    /// Records that have been granted a step and are not waiting for another: the ones that
    /// will release bytes without needing any.
    running: usize,
    waiters: VecDeque<(u64, oneshot::Sender<()>)>,
}

#[derive(Debug)]
pub struct ByteBudget {
    limit: u64,
    state: Mutex<State>,
}

impl ByteBudget {
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(ByteBudget { limit: limit.max(1), state: Mutex::new(State::default()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn used(&self) -> u64 {
        self.lock().used
    }

    /// Whether some record waits for bytes.
    pub fn contended(&self) -> bool {
        !self.lock().waiters.is_empty()
    }

    /// Charges bytes that are already in memory (a fetched record). Never waits.
    pub fn hold(self: &Arc<Self>, bytes: u64) -> Held {
        self.lock().used += bytes;
        Held { budget: self.clone(), bytes, running: false }
    }

    /// Hands bytes to waiters, oldest first, while they fit (or nobody else could free any).
    fn wake(&self, state: &mut State) {
        while let Some((bytes, _)) = state.waiters.front() {
            let bytes = *bytes;
            if state.used + bytes > self.limit && state.running > 0 {
                break;
            }
            let (_, tx) = state.waiters.pop_front().expect("front exists");
            if tx.send(()).is_ok() {
                state.used += bytes;
                state.running += 1;
            }
        }
    }

    fn release(&self, bytes: u64, was_running: bool) {
        let mut state = self.lock();
        state.used = state.used.saturating_sub(bytes);
        if was_running {
            state.running -= 1;
        }
        self.wake(&mut state);
    }
}

/// A record's charge; released when dropped.
#[derive(Debug)]
pub struct Held {
    budget: Arc<ByteBudget>,
    bytes: u64,
    /// Counted in the budget's `running`.
    running: bool,
}

/// A grow request that may be granted after its future was dropped: gives the grant back.
struct Pending {
    budget: Arc<ByteBudget>,
    bytes: u64,
    rx: Option<oneshot::Receiver<()>>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if rx.try_recv().is_ok() {
                self.budget.release(self.bytes, true);
            }
        }
    }
}

impl Held {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Adds `bytes` to this record's charge, waiting until they fit.
    pub async fn grow(&mut self, bytes: u64) {
        let rx = {
            let mut state = self.budget.lock();
            if self.running {
                state.running -= 1;
                self.running = false;
                // Stepping out of `running` may be what lets the head waiter through.
                self.budget.wake(&mut state);
            }
            let fits = state.used + bytes <= self.budget.limit || state.running == 0;
            if state.waiters.is_empty() && fits {
                state.used += bytes;
                state.running += 1;
                None
            } else {
                let (tx, rx) = oneshot::channel();
                state.waiters.push_back((bytes, tx));
                Some(rx)
            }
        };
        if let Some(rx) = rx {
            let mut pending = Pending { budget: self.budget.clone(), bytes, rx: Some(rx) };
            let granted = pending.rx.as_mut().expect("set above").await;
            pending.rx = None;
            debug_assert!(granted.is_ok(), "the budget never drops a waiter's sender unsent");
        }
        self.bytes += bytes;
        self.running = true;
    }

    /// Lowers this record's charge to `bytes` (what it still holds after a step freed memory).
    pub fn shrink_to(&mut self, bytes: u64) {
        if bytes < self.bytes {
            let freed = self.bytes - bytes;
            self.bytes = bytes;
            let mut state = self.budget.lock();
            state.used = state.used.saturating_sub(freed);
            self.budget.wake(&mut state);
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.release(self.bytes, self.running);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn blocked(fut: impl std::future::Future<Output = ()>) -> bool {
        tokio::time::timeout(Duration::from_millis(30), fut).await.is_err()
    }

    #[tokio::test]
    async fn grows_within_the_limit_and_waits_past_it() {
        let budget = ByteBudget::new(100);
        let mut a = budget.hold(10);
        a.grow(50).await;
        assert_eq!(budget.used(), 60);
        let mut b = budget.hold(10);
        assert!(blocked(b.grow(50)).await, "70 + 50 > 100 while a is running");
        assert_eq!(budget.used(), 70, "a dropped wait gives nothing back twice");
        drop(a);
        b.grow(50).await;
        assert_eq!(budget.used(), 60);
        drop(b);
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn never_deadlocks_when_every_holder_waits() {
        let budget = ByteBudget::new(100);
        let mut a = budget.hold(40);
        let mut b = budget.hold(40);
        a.grow(10).await;
        b.grow(10).await;
        // both running, both want more than fits: the second to ask is let through once the
        // first steps out of `running` to wait, since then nobody else could free bytes
        let (ra, rb) = tokio::join!(
            tokio::time::timeout(Duration::from_secs(1), a.grow(60)),
            tokio::time::timeout(Duration::from_secs(1), b.grow(60)),
        );
        assert!(ra.is_ok() || rb.is_ok(), "one of them must go on");
    }

    #[tokio::test]
    async fn waiters_are_served_in_order_and_shrink_wakes_them() {
        let budget = ByteBudget::new(100);
        let mut big = budget.hold(0);
        big.grow(90).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (i, size) in [(1, 30u64), (2, 5)] {
            let budget = budget.clone();
            let order = order.clone();
            tasks.push(tokio::spawn(async move {
                let mut h = budget.hold(0);
                h.grow(size).await;
                order.lock().expect("lock").push(i);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(budget.contended());
        // 5 bytes would fit now, but the 30-byte waiter came first
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(order.lock().expect("lock").is_empty());
        big.shrink_to(40);
        for t in tasks {
            t.await.expect("task");
        }
        assert_eq!(*order.lock().expect("lock"), vec![1, 2]);
        drop(big);
        assert_eq!(budget.used(), 0);
    }
}
