//! Handing freed memory back to the system after a burst.
//!
//! The gateway's allocator is mimalloc (`main.rs`). A block freed by a thread other than the
//! one that allocated it goes on that thread's list of remote frees, and its page is given
//! back only when the owning thread next allocates from the same size class or collects. The
//! big buffers here are made on one thread and dropped on another: a task's CPU pool decodes
//! an input and builds its tensor, a tokio worker drops it once the worker has answered; the
//! fetch thread copies records that the record tasks drop. After a backlog (a gateway's start,
//! a broker's restart) had filled `max_held_bytes`, a quiet pool thread kept those pages, and
//! resident memory stayed at about twice its steady level long after the drain (a chaos soak,
//! 2026-11-29, `docs/hardening.md`). So every [`COLLECT_EVERY`] each CPU pool thread, and the
//! fetch thread in its loop, collect their own heaps: remote frees taken in, empty pages
//! returned, and purged at once.
//!
//! A collection visits the pages of one thread's heap: microseconds for the few hundred a
//! gateway's thread holds. With another global allocator linked in (the library's own tests),
//! it collects mimalloc's empty heap and does nothing.

use std::time::{Duration, Instant};

/// How often each thread named above collects its heap.
pub const COLLECT_EVERY: Duration = Duration::from_secs(2);

/// Collects the calling thread's heap (see the module doc).
pub fn collect_this_thread() {
    // SAFETY: mi_collect takes no pointer and only touches the calling thread's heap and the
    // allocator's own arenas, under their locks.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// Asks every thread of `pool` to collect its heap, without waiting for them: a thread busy
/// with a conversion does it after.
pub fn collect_pool(pool: &rayon::ThreadPool) {
    pool.spawn_broadcast(|_| collect_this_thread());
}

/// For a thread's own loop: true once [`COLLECT_EVERY`] has passed since the last `true`.
#[derive(Debug)]
pub struct Every {
    last: Instant,
}

impl Default for Every {
    fn default() -> Self {
        Every { last: Instant::now() }
    }
}

impl Every {
    pub fn due(&mut self) -> bool {
        if self.last.elapsed() < COLLECT_EVERY {
            return false;
        }
        self.last = Instant::now();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_collection_is_due_once_per_interval() {
        let mut every = Every::default();
        assert!(!every.due(), "not right after the start");
        every.last -= COLLECT_EVERY;
        assert!(every.due());
        assert!(!every.due(), "not twice in one interval");
    }

    #[test]
    fn collecting_a_pool_and_a_thread_is_harmless_under_any_allocator() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
        let kept: Vec<Vec<u8>> = pool.install(|| (0..64).map(|i| vec![i as u8; 100_000]).collect());
        drop(kept);
        collect_pool(&pool);
        collect_this_thread();
        // The pool still works after its threads collected.
        assert_eq!(pool.install(|| vec![7u8; 1 << 20].iter().map(|&b| b as u64).sum::<u64>()), 7 << 20);
    }
}
