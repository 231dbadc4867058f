//! Admission control by GPU memory: a byte-weighted, FIFO-fair async semaphore.
//!
//! The ai-worker must never have more requests in flight than fit in its GPU memory budget.
//! [`BytePool`] owns that budget: a capacity in bytes, the bytes currently granted
//! (`in_use`) and the queue of requests waiting for bytes. A request estimates how many bytes
//! it will need, calls [`BytePool::acquire`] (or [`BytePool::acquire_timeout`]) and holds the
//! returned [`ByteGuard`] for as long as it occupies GPU memory.
//!
//! # The FIFO rule
//!
//! Waiters are granted strictly in arrival order: a waiter is granted only when it is at the
//! head of the queue *and* its bytes fit. A later, smaller request that would fit right now is
//! still made to queue behind a big one. Without this rule a steady stream of small requests
//! could keep the pool just full enough that a big request never fits: the big one would
//! starve. The price is that some memory may sit idle while the head waits for enough to be
//! released; that is the deliberate trade. A request for more than the whole budget could
//! never be granted and would block everyone behind it, so it is refused at once with
//! [`AdmitError::TooLarge`] (and so are queued waiters left too large by
//! [`BytePool::set_capacity`] shrinking the budget). Requests for zero bytes are granted at
//! once; they occupy nothing, so they cannot starve anyone.
//!
//! # What a guard guarantees
//!
//! * While a [`ByteGuard`] lives its bytes are counted in `in_use`; the pool never grants a
//!   new request that would take `in_use` above the capacity in force at that moment.
//! * Dropping the guard gives the bytes back and wakes the waiters that now fit, head first.
//!   Drop runs on every path out of the holder: normal return, `?`, a panic unwinding, or the
//!   holder's future being cancelled. [`ByteGuard::shrink_to`] gives part back early.
//! * A waiter whose future is dropped while queued (cancelled, e.g. by `select!` or an outer
//!   timeout) is removed from the queue; if it was granted in the very instant it was dropped,
//!   the granted bytes are given straight back. Nothing leaks either way.
//!
//! [`BytePool`] is a handle: it holds an `Arc` inside, so clone it freely (each clone is the
//! same pool). Guards hold their own reference, so they may outlive every pool handle.
//!
//! The state sits behind a `std::sync::Mutex` that is never held across an `.await`; every
//! critical section is a few arithmetic operations and queue edits.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The request is larger than the whole budget, so it could never be granted.
    #[error("request needs {needed} bytes but the whole budget is {capacity} bytes")]
    TooLarge {
        /// Bytes the request asked for.
        needed: u64,
        /// The capacity at the moment it was refused.
        capacity: u64,
    },
    /// The queue already held the maximum number of waiters the caller allowed.
    #[error("admission queue is full: {queued} requests already waiting for gpu memory")]
    QueueFull {
        /// Waiters in the queue when the request was refused.
        queued: usize,
    },
    /// The request was not granted within the caller's deadline; it has left the queue.
    #[error("no gpu memory was granted within {} ms", .waited.as_millis())]
    Timeout {
        /// How long the request waited before giving up.
        waited: Duration,
    },
}

/// What a queued waiter is told: granted, or refused (only ever `TooLarge`, after a shrink).
type Outcome = Result<(), AdmitError>;

struct Waiter {
    id: u64,
    bytes: u64,
    tx: oneshot::Sender<Outcome>,
}

struct State {
    capacity: u64,
    in_use: u64,
    high_water: u64,
    next_id: u64,
    waiters: VecDeque<Waiter>,
}

impl State {
    fn fits(&self, bytes: u64) -> bool {
        self.in_use
            .checked_add(bytes)
            .is_some_and(|total| total <= self.capacity)
    }

    fn take(&mut self, bytes: u64) {
        self.in_use = self.in_use.saturating_add(bytes);
        self.high_water = self.high_water.max(self.in_use);
    }

    fn give_back(&mut self, bytes: u64) {
        debug_assert!(
            bytes <= self.in_use,
            "invariant: a guard never gives back more than is in use ({bytes} > {})",
            self.in_use
        );
        self.in_use = self.in_use.saturating_sub(bytes);
        self.grant_from_head();
    }

    /// Grants waiters from the head for as long as the head fits.
    ///
    /// The outcome is sent while the lock is held, in the same critical section that pops the
    /// waiter and counts its bytes: [`Pending::withdraw`] relies on that (a waiter that is no
    /// longer queued always has its outcome waiting in its receiver).
    fn grant_from_head(&mut self) {
        while self
            .waiters
            .front()
            .is_some_and(|head| self.fits(head.bytes))
        {
            let Some(waiter) = self.waiters.pop_front() else {
                break;
            };
            self.take(waiter.bytes);
            // The receiver outlives the waiter's place in the queue (Pending withdraws before
            // dropping it), so this cannot fail; if it ever did, Pending's drop would still
            // find the grant and give the bytes back.
            let _ = waiter.tx.send(Ok(()));
        }
    }
}

fn lock(shared: &Mutex<State>) -> MutexGuard<'_, State> {
    // Critical sections only do arithmetic and queue edits, so a panic elsewhere while the
    // lock was held cannot have left the state half-updated: recover it.
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A GPU memory budget, admitting requests by estimated bytes, first come first served.
///
/// Cheap to clone: every clone is a handle on the same pool. See the module docs for the
/// FIFO rule and what guards guarantee.
#[derive(Clone)]
pub struct BytePool {
    shared: Arc<Mutex<State>>,
}

enum Admission {
    Granted(ByteGuard),
    Queued(Pending),
}

impl BytePool {
    /// A pool with `capacity_bytes` to grant and nothing in use.
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            shared: Arc::new(Mutex::new(State {
                capacity: capacity_bytes,
                in_use: 0,
                high_water: 0,
                next_id: 0,
                waiters: VecDeque::new(),
            })),
        }
    }

    /// Waits until `bytes` can be granted, in FIFO order, and returns the guard holding them.
    ///
    /// Fails at once with [`AdmitError::TooLarge`] when `bytes` exceeds the capacity; while
    /// queued it fails the same way if [`set_capacity`](Self::set_capacity) shrinks the budget
    /// below `bytes`. `bytes == 0` is granted at once. Dropping the returned future while it
    /// waits withdraws the request without leaking anything.
    pub async fn acquire(&self, bytes: u64) -> Result<ByteGuard, AdmitError> {
        match self.enqueue(bytes, None)? {
            Admission::Granted(guard) => Ok(guard),
            Admission::Queued(mut pending) => {
                let received = (&mut pending.rx).await;
                pending.finish(received)
            }
        }
    }

    /// Like [`acquire`](Self::acquire), but bounded: fails at once with
    /// [`AdmitError::QueueFull`] when the request would have to queue and `max_queued`
    /// waiters are already queued, and with [`AdmitError::Timeout`] when not granted within
    /// `max_wait` (the request then leaves the queue, so the next waiter may proceed). A
    /// request that fits immediately, with nobody queued, is granted even if `max_queued` is 0.
    /// A grant that races the deadline wins: the caller gets the guard, not a timeout.
    pub async fn acquire_timeout(
        &self,
        bytes: u64,
        max_wait: Duration,
        max_queued: usize,
    ) -> Result<ByteGuard, AdmitError> {
        let started = Instant::now();
        match self.enqueue(bytes, Some(max_queued))? {
            Admission::Granted(guard) => Ok(guard),
            Admission::Queued(mut pending) => {
                match tokio::time::timeout(max_wait, &mut pending.rx).await {
                    Ok(received) => pending.finish(received),
                    Err(_elapsed) => match pending.withdraw() {
                        Some(outcome) => pending.settle(outcome),
                        None => Err(AdmitError::Timeout {
                            waited: started.elapsed(),
                        }),
                    },
                }
            }
        }
    }

    /// Grants at once if possible, otherwise puts the request at the back of the queue.
    fn enqueue(&self, bytes: u64, max_queued: Option<usize>) -> Result<Admission, AdmitError> {
        if bytes == 0 {
            return Ok(Admission::Granted(self.guard(0)));
        }
        let mut state = lock(&self.shared);
        if bytes > state.capacity {
            return Err(AdmitError::TooLarge {
                needed: bytes,
                capacity: state.capacity,
            });
        }
        if state.waiters.is_empty() && state.fits(bytes) {
            state.take(bytes);
            drop(state);
            return Ok(Admission::Granted(self.guard(bytes)));
        }
        if let Some(max) = max_queued {
            if state.waiters.len() >= max {
                return Err(AdmitError::QueueFull {
                    queued: state.waiters.len(),
                });
            }
        }
        let id = state.next_id;
        state.next_id = state.next_id.wrapping_add(1);
        let (tx, rx) = oneshot::channel();
        state.waiters.push_back(Waiter { id, bytes, tx });
        drop(state);
        Ok(Admission::Queued(Pending {
            shared: Arc::clone(&self.shared),
            id,
            bytes,
            rx,
            settled: false,
        }))
    }

    fn guard(&self, bytes: u64) -> ByteGuard {
        ByteGuard {
            shared: Arc::clone(&self.shared),
            bytes,
        }
    }

    /// Changes the budget. Shrinking below what is held revokes nothing: it only stops new
    /// grants until enough is released. Queued waiters that need more than the new capacity
    /// could never be granted and would block everyone behind them, so they fail with
    /// [`AdmitError::TooLarge`]. Growing wakes the waiters that now fit, head first.
    pub fn set_capacity(&self, new_capacity: u64) {
        let mut state = lock(&self.shared);
        state.capacity = new_capacity;
        if state.waiters.iter().any(|w| w.bytes > new_capacity) {
            let queue = std::mem::take(&mut state.waiters);
            for waiter in queue {
                if waiter.bytes > new_capacity {
                    // Sent under the lock, like grants (see `grant_from_head`).
                    let _ = waiter.tx.send(Err(AdmitError::TooLarge {
                        needed: waiter.bytes,
                        capacity: new_capacity,
                    }));
                } else {
                    state.waiters.push_back(waiter);
                }
            }
        }
        state.grant_from_head();
    }

    /// The budget in bytes.
    pub fn capacity(&self) -> u64 {
        lock(&self.shared).capacity
    }

    /// Bytes held by live guards. May exceed [`capacity`](Self::capacity) only after the
    /// capacity was shrunk below what was already held.
    pub fn in_use(&self) -> u64 {
        lock(&self.shared).in_use
    }

    /// Requests waiting in the queue.
    pub fn queued(&self) -> usize {
        lock(&self.shared).waiters.len()
    }

    /// Total bytes asked for by the requests waiting in the queue.
    pub fn queued_bytes(&self) -> u64 {
        lock(&self.shared)
            .waiters
            .iter()
            .fold(0u64, |sum, w| sum.saturating_add(w.bytes))
    }

    /// Capacity, bytes in use, requests queued and bytes they ask for, read at one moment.
    pub fn figures(&self) -> (u64, u64, usize, u64) {
        let state = lock(&self.shared);
        let queued_bytes = state.waiters.iter().fold(0u64, |sum, w| sum.saturating_add(w.bytes));
        (state.capacity, state.in_use, state.waiters.len(), queued_bytes)
    }

    /// The largest `in_use` seen since the pool was made or the mark was last reset.
    pub fn high_water_mark(&self) -> u64 {
        lock(&self.shared).high_water
    }

    /// Restarts the high-water mark from the current `in_use`.
    pub fn reset_high_water_mark(&self) {
        let mut state = lock(&self.shared);
        state.high_water = state.in_use;
    }
}

impl fmt::Debug for BytePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = lock(&self.shared);
        f.debug_struct("BytePool")
            .field("capacity", &state.capacity)
            .field("in_use", &state.in_use)
            .field("queued", &state.waiters.len())
            .field("high_water_mark", &state.high_water)
            .finish()
    }
}

/// A request's place in the queue. Dropping it unsettled (the acquiring future was dropped)
/// withdraws the request, giving back the bytes if it had just been granted.
struct Pending {
    shared: Arc<Mutex<State>>,
    id: u64,
    bytes: u64,
    rx: oneshot::Receiver<Outcome>,
    settled: bool,
}

impl Pending {
    /// Turns what the receiver delivered into the caller's result.
    fn finish(
        &mut self,
        received: Result<Outcome, oneshot::error::RecvError>,
    ) -> Result<ByteGuard, AdmitError> {
        self.settled = true;
        let outcome = received.expect(
            "invariant: the pool sends a dequeued waiter its outcome before dropping its sender",
        );
        self.settle(outcome)
    }

    fn settle(&mut self, outcome: Outcome) -> Result<ByteGuard, AdmitError> {
        self.settled = true;
        outcome.map(|()| ByteGuard {
            shared: Arc::clone(&self.shared),
            bytes: self.bytes,
        })
    }

    /// Takes the request out of the queue. `None`: it was still queued and now is not (it
    /// holds nothing). `Some(outcome)`: it had already been granted or refused.
    fn withdraw(&mut self) -> Option<Outcome> {
        self.settled = true;
        let mut state = lock(&self.shared);
        if let Some(pos) = state.waiters.iter().position(|w| w.id == self.id) {
            state.waiters.remove(pos);
            // If it was the head, the next waiter may fit now.
            state.grant_from_head();
            return None;
        }
        // Not queued: it was popped, and the outcome was sent under this same lock.
        match self.rx.try_recv() {
            Ok(outcome) => Some(outcome),
            Err(_) => {
                debug_assert!(
                    false,
                    "invariant: a waiter leaves the queue only with its outcome sent"
                );
                // Assume nothing is held: a leaked grant wastes budget, an invented release
                // would oversubscribe the GPU.
                None
            }
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        if let Some(outcome) = self.withdraw() {
            // Granted just as it was abandoned: the guard made here gives the bytes back.
            drop(self.settle(outcome));
        }
    }
}

/// Bytes granted from a [`BytePool`]; they go back to the pool when the guard is dropped.
#[must_use = "dropping a ByteGuard releases its bytes at once"]
pub struct ByteGuard {
    shared: Arc<Mutex<State>>,
    bytes: u64,
}

impl ByteGuard {
    /// Bytes this guard currently holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Gives back everything above `new_bytes` now (e.g. once the real peak is measured),
    /// waking waiters that fit. Does nothing when `new_bytes >= self.bytes()`: a guard never
    /// grows, since growing would bypass the queue.
    pub fn shrink_to(&mut self, new_bytes: u64) {
        if new_bytes >= self.bytes {
            return;
        }
        let freed = self.bytes - new_bytes;
        self.bytes = new_bytes;
        lock(&self.shared).give_back(freed);
    }
}

impl Drop for ByteGuard {
    fn drop(&mut self) {
        if self.bytes > 0 {
            lock(&self.shared).give_back(self.bytes);
        }
    }
}

impl fmt::Debug for ByteGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ByteGuard")
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::task::{Context, Poll, Waker};

    type AcquireFuture = Pin<Box<dyn std::future::Future<Output = Result<ByteGuard, AdmitError>>>>;

    /// Lets other tasks on a current-thread runtime run until `cond` holds.
    async fn until(what: &str, mut cond: impl FnMut() -> bool) {
        for _ in 0..10_000 {
            if cond() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("timed out waiting until {what}");
    }

    async fn run_a_while() {
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
    }

    fn poll_once(fut: &mut AcquireFuture) -> Poll<Result<ByteGuard, AdmitError>> {
        fut.as_mut().poll(&mut Context::from_waker(Waker::noop()))
    }

    #[tokio::test]
    async fn grants_up_to_capacity_blocks_beyond_and_release_wakes_next() {
        let pool = BytePool::new(100);
        let a = pool.acquire(60).await.expect("60 of 100 fits");
        let b = pool.acquire(40).await.expect("40 more fits exactly");
        assert_eq!((pool.in_use(), pool.queued()), (100, 0));

        let p = pool.clone();
        let c = tokio::spawn(async move { p.acquire(30).await });
        until("c queues", || pool.queued() == 1).await;
        run_a_while().await;
        assert!(!c.is_finished(), "30 must wait while the pool is full");
        assert_eq!(pool.queued_bytes(), 30);

        drop(a);
        let c = c.await.expect("task ran").expect("granted after release");
        assert_eq!(c.bytes(), 30);
        assert_eq!(
            (pool.in_use(), pool.queued(), pool.queued_bytes()),
            (70, 0, 0)
        );
        drop((b, c));
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.high_water_mark(), 100);
    }

    #[tokio::test]
    async fn fifo_small_request_does_not_overtake_big_one() {
        let pool = BytePool::new(10);
        let held = pool.acquire(8).await.expect("8 of 10 fits");
        let order = Arc::new(Mutex::new(Vec::new()));

        let spawn = |name: &'static str, bytes: u64| {
            let (pool, order) = (pool.clone(), Arc::clone(&order));
            tokio::spawn(async move {
                let guard = pool.acquire(bytes).await;
                lock_vec(&order).push(name);
                guard
            })
        };
        let big = spawn("big", 9);
        until("big queues", || pool.queued() == 1).await;
        let small = spawn("small", 1);
        until("small queues", || pool.queued() == 2).await;
        run_a_while().await;
        assert_eq!(pool.in_use(), 8, "the 1 fits but must not barge past the 9");
        assert!(lock_vec(&order).is_empty());

        // Even a bounded request that fits is made to queue, and times out.
        let barger = pool.acquire_timeout(1, Duration::from_millis(20), 10).await;
        assert!(
            matches!(barger, Err(AdmitError::Timeout { .. })),
            "{barger:?}"
        );
        assert_eq!(pool.queued(), 2);

        drop(held);
        let big = big.await.expect("task ran").expect("big granted");
        let small = small.await.expect("task ran").expect("small granted");
        assert_eq!(*lock_vec(&order), ["big", "small"]);
        assert_eq!((big.bytes(), small.bytes(), pool.in_use()), (9, 1, 10));
    }

    fn lock_vec<T>(m: &Mutex<Vec<T>>) -> MutexGuard<'_, Vec<T>> {
        m.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[tokio::test]
    async fn zero_bytes_granted_at_once_even_when_full_and_queued() {
        let pool = BytePool::new(4);
        let _full = pool.acquire(4).await.expect("fits");
        let p = pool.clone();
        let _waiter = tokio::spawn(async move { p.acquire(1).await });
        until("waiter queues", || pool.queued() == 1).await;
        let zero = pool
            .acquire_timeout(0, Duration::ZERO, 0)
            .await
            .expect("zero bytes never wait");
        assert_eq!(zero.bytes(), 0);
        drop(zero);
        assert_eq!(pool.in_use(), 4);
    }

    #[tokio::test]
    async fn too_large_is_refused_at_once() {
        let pool = BytePool::new(2_147_483_648);
        let err = pool.acquire(3_221_225_472).await.expect_err("over budget");
        assert_eq!(
            err,
            AdmitError::TooLarge {
                needed: 3_221_225_472,
                capacity: 2_147_483_648
            }
        );
        assert_eq!(
            err.to_string(),
            "request needs 3221225472 bytes but the whole budget is 2147483648 bytes"
        );
        let err = pool
            .acquire_timeout(u64::MAX, Duration::from_secs(60), 0)
            .await
            .expect_err("over budget");
        assert!(matches!(err, AdmitError::TooLarge { .. }));
        assert_eq!((pool.in_use(), pool.queued()), (0, 0));
    }

    #[tokio::test]
    async fn queue_full_is_refused_at_once() {
        let pool = BytePool::new(10);
        let full = pool.acquire(10).await.expect("fits");
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let p = pool.clone();
                tokio::spawn(async move { p.acquire(5).await })
            })
            .collect();
        until("both queue", || pool.queued() == 2).await;
        let err = pool
            .acquire_timeout(1, Duration::from_secs(60), 2)
            .await
            .expect_err("queue is full");
        assert_eq!(err, AdmitError::QueueFull { queued: 2 });
        assert_eq!(
            err.to_string(),
            "admission queue is full: 2 requests already waiting for gpu memory"
        );
        drop(full);
        for w in waiters {
            assert_eq!(w.await.expect("task ran").expect("granted").bytes(), 5);
        }
        // With nobody queued and room to spare, max_queued = 0 still admits.
        let g = pool
            .acquire_timeout(3, Duration::ZERO, 0)
            .await
            .expect("fits without queueing");
        assert_eq!(g.bytes(), 3);
    }

    #[tokio::test]
    async fn timeout_leaves_the_queue_and_the_next_proceeds() {
        let pool = BytePool::new(10);
        let _held = pool.acquire(8).await.expect("fits");
        let p = pool.clone();
        let big =
            tokio::spawn(async move { p.acquire_timeout(9, Duration::from_millis(30), 10).await });
        until("big queues", || pool.queued() == 1).await;
        let p = pool.clone();
        let small = tokio::spawn(async move { p.acquire(2).await });
        until("small queues", || pool.queued() == 2).await;

        let err = big.await.expect("task ran").expect_err("9 never fits");
        let AdmitError::Timeout { waited } = err else {
            panic!("expected a timeout, got {err:?}");
        };
        assert!(waited >= Duration::from_millis(30), "{waited:?}");
        assert!(err
            .to_string()
            .starts_with("no gpu memory was granted within "));

        let small = small.await.expect("task ran").expect("2 fits once 9 left");
        assert_eq!((small.bytes(), pool.in_use(), pool.queued()), (2, 10, 0));
    }

    #[tokio::test]
    async fn cancelled_waiter_is_removed_and_next_gets_the_bytes() {
        let pool = BytePool::new(10);
        let full = pool.acquire(10).await.expect("fits");
        let p = pool.clone();
        let first = tokio::spawn(async move { p.acquire(5).await });
        until("first queues", || pool.queued() == 1).await;
        let p = pool.clone();
        let second = tokio::spawn(async move { p.acquire(10).await });
        until("second queues", || pool.queued() == 2).await;

        first.abort();
        until("first leaves the queue", || pool.queued() == 1).await;
        assert_eq!(pool.queued_bytes(), 10);

        drop(full);
        let second = second.await.expect("task ran").expect("granted");
        assert_eq!(pool.in_use(), 10);
        drop(second);
        assert_eq!((pool.in_use(), pool.queued()), (0, 0));
    }

    #[test]
    fn waiter_granted_as_it_is_dropped_gives_the_bytes_back() {
        let pool = BytePool::new(10);
        let full = pool.enqueue(10, None);
        let Ok(Admission::Granted(full)) = full else {
            panic!("10 of 10 fits at once");
        };
        let mut first: AcquireFuture = Box::pin({
            let p = pool.clone();
            async move { p.acquire(6).await }
        });
        let mut second: AcquireFuture = Box::pin({
            let p = pool.clone();
            async move { p.acquire(4).await }
        });
        assert!(poll_once(&mut first).is_pending());
        assert!(poll_once(&mut second).is_pending());

        drop(full); // grants both inside the pool; neither future has seen it yet
        assert_eq!((pool.in_use(), pool.queued()), (10, 0));
        drop(first);
        assert_eq!(pool.in_use(), 4, "the abandoned grant came back");
        let Poll::Ready(Ok(second)) = poll_once(&mut second) else {
            panic!("second was granted");
        };
        drop(second);
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn unpolled_acquire_holds_nothing() {
        let pool = BytePool::new(10);
        let fut = pool.acquire(5);
        assert_eq!((pool.in_use(), pool.queued()), (0, 0));
        drop(fut);
        assert_eq!((pool.in_use(), pool.queued()), (0, 0));
    }

    #[tokio::test]
    async fn shrinking_blocks_new_grants_but_revokes_nothing() {
        let pool = BytePool::new(10);
        let held = pool.acquire(8).await.expect("fits");
        pool.set_capacity(4);
        assert_eq!((pool.capacity(), pool.in_use(), held.bytes()), (4, 8, 8));

        let blocked = pool.acquire_timeout(1, Duration::from_millis(10), 10).await;
        assert!(
            matches!(blocked, Err(AdmitError::Timeout { .. })),
            "{blocked:?}"
        );

        let p = pool.clone();
        let waiter = tokio::spawn(async move { p.acquire(3).await });
        until("waiter queues", || pool.queued() == 1).await;
        run_a_while().await;
        assert!(!waiter.is_finished());
        drop(held);
        let g = waiter
            .await
            .expect("task ran")
            .expect("3 fits in 4 once 8 is back");
        assert_eq!(pool.in_use(), 3);
        drop(g);
    }

    #[tokio::test]
    async fn shrinking_refuses_queued_waiters_that_can_never_fit() {
        let pool = BytePool::new(10);
        let held = pool.acquire(10).await.expect("fits");
        let p = pool.clone();
        let big = tokio::spawn(async move { p.acquire(8).await });
        until("big queues", || pool.queued() == 1).await;
        let p = pool.clone();
        let small = tokio::spawn(async move { p.acquire(2).await });
        until("small queues", || pool.queued() == 2).await;

        pool.set_capacity(6);
        let err = big.await.expect("task ran").expect_err("8 > 6");
        assert_eq!(
            err,
            AdmitError::TooLarge {
                needed: 8,
                capacity: 6
            }
        );
        assert_eq!(pool.queued(), 1);
        drop(held);
        let small = small.await.expect("task ran").expect("granted");
        assert_eq!((small.bytes(), pool.in_use()), (2, 2));
    }

    #[tokio::test]
    async fn growing_wakes_waiters_that_now_fit() {
        let pool = BytePool::new(10);
        let _held = pool.acquire(10).await.expect("fits");
        let waiters: Vec<_> = [5, 5, 1]
            .into_iter()
            .map(|bytes| {
                let p = pool.clone();
                tokio::spawn(async move { p.acquire(bytes).await })
            })
            .collect();
        until("all queue", || pool.queued() == 3).await;
        pool.set_capacity(15);
        until("the first fits", || pool.queued() == 2).await;
        assert_eq!(pool.in_use(), 15);
        pool.set_capacity(21);
        for w in waiters {
            let _ = w.await.expect("task ran").expect("granted");
        }
        assert_eq!(pool.high_water_mark(), 21);
    }

    #[tokio::test]
    async fn shrink_to_gives_back_early() {
        let pool = BytePool::new(10);
        let mut guard = pool.acquire(10).await.expect("fits");
        let p = pool.clone();
        let waiter = tokio::spawn(async move { p.acquire(4).await });
        until("waiter queues", || pool.queued() == 1).await;
        guard.shrink_to(6);
        assert_eq!(guard.bytes(), 6);
        let w = waiter.await.expect("task ran").expect("4 fits next to 6");
        assert_eq!(pool.in_use(), 10);
        guard.shrink_to(20);
        assert_eq!(guard.bytes(), 6, "a guard never grows");
        guard.shrink_to(0);
        assert_eq!(pool.in_use(), 4);
        drop((guard, w));
        assert_eq!(pool.in_use(), 0);
    }

    #[tokio::test]
    async fn panicking_holder_releases() {
        let pool = BytePool::new(10);
        let p = pool.clone();
        let task = tokio::spawn(async move {
            let _g = p.acquire(7).await;
            panic!("holder failed");
        });
        assert!(task.await.is_err());
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.acquire(10).await.expect("all free").bytes(), 10);
    }

    #[tokio::test]
    async fn high_water_mark_tracks_and_resets() {
        let pool = BytePool::new(10);
        let a = pool.acquire(7).await.expect("fits");
        let b = pool.acquire(2).await.expect("fits");
        drop(a);
        assert_eq!((pool.in_use(), pool.high_water_mark()), (2, 9));
        pool.reset_high_water_mark();
        assert_eq!(pool.high_water_mark(), 2);
        drop(b);
        assert_eq!(pool.high_water_mark(), 2);
        assert!(format!("{pool:?}").contains("capacity: 10"));
    }

    // ---- model-based property test: deterministic, futures polled by hand ----

    #[derive(Debug, Clone)]
    enum Op {
        Request(u64),
        Release(usize),
        Cancel(usize),
        /// Release then cancel before anyone is polled: hits "granted as it was dropped".
        ReleaseThenCancel(usize, usize),
        Shrink(usize, u64),
        SetCapacity(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (0u64..=20).prop_map(Op::Request),
            3 => any::<usize>().prop_map(Op::Release),
            1 => any::<usize>().prop_map(Op::Cancel),
            1 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Op::ReleaseThenCancel(a, b)),
            1 => (any::<usize>(), 0u64..=16).prop_map(|(i, b)| Op::Shrink(i, b)),
            1 => (1u64..=24).prop_map(Op::SetCapacity),
        ]
    }

    struct Model {
        pool: BytePool,
        next_seq: u64,
        pending: Vec<(u64, u64, AcquireFuture)>,
        held: Vec<ByteGuard>,
        max_granted_seq: Option<u64>,
    }

    impl Model {
        /// Polls every pending request in arrival order and checks the invariants.
        fn step(&mut self) -> Result<(), TestCaseError> {
            let in_use_before = self.pool.in_use();
            let mut still = Vec::new();
            let mut granted_any = false;
            for (seq, bytes, mut fut) in std::mem::take(&mut self.pending) {
                match poll_once(&mut fut) {
                    Poll::Pending => still.push((seq, bytes, fut)),
                    Poll::Ready(Ok(guard)) => {
                        prop_assert_eq!(guard.bytes(), bytes);
                        if bytes > 0 {
                            granted_any = true;
                            self.max_granted_seq = self.max_granted_seq.max(Some(seq));
                        }
                        self.held.push(guard);
                    }
                    Poll::Ready(Err(AdmitError::TooLarge { needed, capacity })) => {
                        prop_assert_eq!(needed, bytes);
                        prop_assert!(needed > capacity);
                        prop_assert_eq!(capacity, self.pool.capacity());
                    }
                    Poll::Ready(Err(e)) => prop_assert!(false, "unexpected {e:?}"),
                }
            }
            self.pending = still;

            let held: u64 = self.held.iter().map(ByteGuard::bytes).sum();
            let queued: u64 = self.pending.iter().map(|p| p.1).sum();
            prop_assert_eq!(self.pool.in_use(), held);
            prop_assert_eq!(self.pool.queued(), self.pending.len());
            prop_assert_eq!(self.pool.queued_bytes(), queued);
            if granted_any || self.pool.in_use() > in_use_before {
                prop_assert!(self.pool.in_use() <= self.pool.capacity());
            }
            if let Some(&(seq, bytes, _)) = self.pending.first() {
                // FIFO: nobody behind the head was granted, and the head does not fit.
                prop_assert!(self.max_granted_seq.is_none_or(|g| g < seq));
                prop_assert!(held + bytes > self.pool.capacity(), "head fits but waits");
            }
            Ok(())
        }

        fn release(&mut self, i: usize) {
            if !self.held.is_empty() {
                let n = self.held.len();
                drop(self.held.swap_remove(i % n));
            }
        }

        fn cancel(&mut self, i: usize) {
            if !self.pending.is_empty() {
                let n = self.pending.len();
                drop(self.pending.remove(i % n));
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn model_fifo_and_accounting(capacity in 1u64..=16, ops in prop::collection::vec(op(), 1..60)) {
            let pool = BytePool::new(capacity);
            let mut m = Model { pool: pool.clone(), next_seq: 0, pending: Vec::new(), held: Vec::new(), max_granted_seq: None };
            for op in ops {
                match op {
                    Op::Request(bytes) => {
                        let p = pool.clone();
                        m.pending.push((m.next_seq, bytes, Box::pin(async move { p.acquire(bytes).await })));
                        m.next_seq += 1;
                    }
                    Op::Release(i) => m.release(i),
                    Op::Cancel(i) => m.cancel(i),
                    Op::ReleaseThenCancel(i, j) => { m.release(i); m.cancel(j); }
                    Op::Shrink(i, to) => {
                        if !m.held.is_empty() {
                            let n = m.held.len();
                            m.held[i % n].shrink_to(to);
                        }
                    }
                    Op::SetCapacity(c) => pool.set_capacity(c),
                }
                m.step()?;
            }
            // Releasing everything drains the queue: the head always fits an empty pool.
            for _ in 0..=m.pending.len() {
                m.held.clear();
                m.step()?;
            }
            prop_assert!(m.pending.is_empty() && m.held.is_empty());
            prop_assert_eq!((pool.in_use(), pool.queued()), (0, 0));
            prop_assert!(pool.high_water_mark() <= 24);
        }
    }

    // ---- stress: many tasks on a multi-thread runtime ----

    use crate::test_rng::Rng;

    #[test]
    fn stress_many_tasks_never_oversubscribe() {
        const CAPACITY: u64 = 1_000;
        const TASKS: usize = 400;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_time()
            .build()
            .expect("runtime builds");
        for seed in [0x9E37_79B9_7F4A_7C15_u64, 42, 7_777_777] {
            let pool = BytePool::new(CAPACITY);
            let completed = Arc::new(AtomicUsize::new(0));
            let max_seen = Arc::new(AtomicU64::new(0));
            let gave_up = Arc::new(AtomicUsize::new(0));
            let mut rng = Rng(seed);
            let mut must_complete = 0;
            let run = async {
                let mut tasks = Vec::new();
                for _ in 0..TASKS {
                    // Mostly small requests, some near the whole budget.
                    let bytes = if rng.below(8) == 0 {
                        CAPACITY - rng.below(CAPACITY / 4)
                    } else {
                        1 + rng.below(CAPACITY / 5)
                    };
                    let kind = rng.below(4);
                    let hold_ms = rng.below(4);
                    let wait_ms = rng.below(6);
                    let shrink = rng.below(3) == 0;
                    if kind <= 1 {
                        must_complete += 1;
                    }
                    let (pool, completed, max_seen, gave_up) = (
                        pool.clone(),
                        Arc::clone(&completed),
                        Arc::clone(&max_seen),
                        Arc::clone(&gave_up),
                    );
                    tasks.push(tokio::spawn(async move {
                        let guard = match kind {
                            0 | 1 => Some(pool.acquire(bytes).await),
                            2 => Some(
                                pool.acquire_timeout(bytes, Duration::from_millis(wait_ms), 64)
                                    .await,
                            ),
                            // Cancelled from outside: the acquire future is dropped.
                            _ => tokio::time::timeout(
                                Duration::from_millis(wait_ms),
                                pool.acquire(bytes),
                            )
                            .await
                            .ok(),
                        };
                        let Some(result) = guard else {
                            gave_up.fetch_add(1, Ordering::Relaxed);
                            return;
                        };
                        let mut guard = match result {
                            Ok(g) => g,
                            Err(AdmitError::Timeout { .. } | AdmitError::QueueFull { .. })
                                if kind == 2 =>
                            {
                                gave_up.fetch_add(1, Ordering::Relaxed);
                                return;
                            }
                            Err(e) => panic!("unexpected {e:?}"),
                        };
                        let in_use = pool.in_use();
                        assert!(in_use <= CAPACITY, "oversubscribed: {in_use}");
                        max_seen.fetch_max(in_use, Ordering::Relaxed);
                        if hold_ms == 0 {
                            tokio::task::yield_now().await;
                        } else {
                            tokio::time::sleep(Duration::from_millis(hold_ms)).await;
                        }
                        if shrink {
                            guard.shrink_to(guard.bytes() / 2);
                            tokio::task::yield_now().await;
                        }
                        drop(guard);
                        if kind <= 1 {
                            completed.fetch_add(1, Ordering::Relaxed);
                        }
                    }));
                }
                for t in tasks {
                    t.await.expect("stress task did not panic");
                }
            };
            rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(60), run)
                    .await
                    .expect("stress run finished (no deadlock)");
            });
            assert_eq!(
                completed.load(Ordering::Relaxed),
                must_complete,
                "seed {seed}"
            );
            eprintln!(
                "seed {seed}: {must_complete} completed, {} timed out or cancelled, high water {}",
                gave_up.load(Ordering::Relaxed),
                pool.high_water_mark()
            );
            assert!(pool.high_water_mark() <= CAPACITY, "seed {seed}");
            assert!(pool.high_water_mark() >= max_seen.load(Ordering::Relaxed));
            assert_eq!((pool.in_use(), pool.queued()), (0, 0), "seed {seed}");
        }
    }
}
