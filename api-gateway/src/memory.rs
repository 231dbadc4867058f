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

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How often each thread named above collects its heap.
pub const COLLECT_EVERY: Duration = Duration::from_secs(2);

/// Collects the calling thread's heap (see the module doc).
pub fn collect_this_thread() {
    // SAFETY: mi_collect takes no pointer and only touches the calling thread's heap and the
    // allocator's own arenas, under their locks.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// For the async runtime's threads, each time one goes idle: collects its heap if
/// [`COLLECT_EVERY`] has passed since that thread last did (or first parked). The tokio
/// workers drop most of what the other threads made (tensors once the worker has answered,
/// records once their output is acknowledged) and take the HTTP answers in; a chaos soak
/// (2026-11-30) saw mimalloc's committed memory, not glibc's, hold a gateway's resident memory
/// at twice its steady level after a backlog, with the CPU pools and the fetch thread already
/// collecting. A worker busy all the time collects nothing here, and needs not: its own
/// allocations take its remote frees in.
pub fn collect_on_park() {
    thread_local! {
        // Starts at the thread's first park: a new thread has little to collect.
        static EVERY: std::cell::RefCell<Every> = std::cell::RefCell::new(Every::default());
    }
    if EVERY.with_borrow_mut(Every::due) {
        collect_this_thread();
    }
}

/// Asks every thread of `pool` to collect its heap, without waiting for them: a thread busy
/// with a conversion does it after.
pub fn collect_pool(pool: &rayon::ThreadPool) {
    pool.spawn_broadcast(|_| collect_this_thread());
}

/// mimalloc's `purge_delay` option: its place in v3's `mi_option_t` (`mimalloc.h`), for which
/// `libmimalloc-sys` 0.1.49 names no constant. The purge delay is the milliseconds mimalloc
/// waits before it gives freed pages back to the kernel (v3's default 1,000; v2's was 10).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// The purge delay the gateway runs with, in milliseconds (see [`purge_promptly`]).
pub const PURGE_DELAY_MS: i64 = 0;

/// Has mimalloc give freed pages back to the kernel after [`PURGE_DELAY_MS`] instead of its
/// default 1,000 ms: call first thing in `main`. After a backlog the pages a gateway had
/// used stayed resident for want of a purge that came only when the allocator ran again, and a
/// 7-minute chaos run with the delay at 0 ended at about half the anonymous memory
/// (`docs/hardening.md`). `MIMALLOC_PURGE_DELAY` in the environment, read by mimalloc itself,
/// wins. Returns the delay it set, or `None` where it left mimalloc's own: a delay given in the
/// environment, or a mimalloc other than v3 (whose options are numbered otherwise).
pub fn purge_promptly() -> Option<i64> {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return None;
    }
    if !is_mimalloc_v3() {
        return None;
    }
    // SAFETY: mi_option_set takes integers only; the option is v3's purge_delay (checked above
    // that this is v3), which mimalloc reads at each purge.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS as std::os::raw::c_long) };
    Some(PURGE_DELAY_MS)
}

/// Whether the linked mimalloc is a v3 (`mi_version` is major × 10,000 + minor × 100 + patch:
/// 30302 for 3.3.2).
fn is_mimalloc_v3() -> bool {
    // SAFETY: mi_version takes nothing and returns a constant.
    (30_000..40_000).contains(&unsafe { libmimalloc_sys::mi_version() })
}

/// Turns transparent huge pages off for this process: call first thing in `main`.
///
/// mimalloc asks for huge pages on the memory it commits (`MADV_HUGEPAGE`, its `allow_thp`
/// default), so the kernel backs its segments with 2 MiB pages, and khugepaged fills a
/// 2 MiB range back in when a few of its 4 KiB pages are still in use. What mimalloc purges
/// after a backlog comes back as whole huge pages, and resident memory stays at the
/// backlog's level: in a chaos soak (2026-11-30) 207 of a gateway's 322 MiB resident were
/// huge pages, and after the drain mimalloc held the memory with nothing in flight. The
/// gateway's hot paths are decoding and copying, not page-table walks: huge pages buy it
/// little. `PR_SET_THP_DISABLE` overrides every mapping's advice, mimalloc's and any
/// library's; a process forked from the gateway inherits it (the gateway forks none).
/// Returns whether the kernel took it.
pub fn no_transparent_huge_pages() -> bool {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // SAFETY: prctl with PR_SET_THP_DISABLE takes integers only and changes only this
        // process's flag.
        unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0 }
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        false
    }
}

/// What each allocator holds, in bytes: where a gateway's resident memory is, when it is more
/// than its records explain. The Rust code allocates through mimalloc; librdkafka, its TLS
/// and compression libraries allocate through glibc's malloc.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorBytes {
    /// Memory mimalloc has committed from the system (its own count, all threads).
    pub mimalloc_committed: u64,
    /// Bytes the gateway's Rust code holds in live allocations ([`Counted`]'s count; 0 where
    /// the global allocator is not [`Counted`], as in the library's tests). Committed memory
    /// well above it is the allocator's keeping, not the gateway's data.
    pub rust_in_use: u64,
    /// Bytes in blocks glibc's malloc has handed out and not had back (all arenas, mmapped
    /// blocks included). Zero where the C library is not glibc.
    pub glibc_in_use: u64,
    /// Bytes glibc's malloc holds free in its arenas: taken from the system, not returned
    /// (resident once touched, until trimmed).
    pub glibc_free: u64,
}

/// The allocators' figures now. Walks glibc's arenas under their locks (`mallinfo2`): for a
/// periodic gauge, not a hot path.
pub fn allocator_bytes() -> AllocatorBytes {
    let (mut elapsed, mut user, mut system, mut rss, mut peak_rss, mut commit, mut peak_commit, mut faults) =
        (0usize, 0usize, 0usize, 0usize, 0usize, 0usize, 0usize, 0usize);
    // SAFETY: every pointer is to a live local of the type the function writes.
    unsafe {
        libmimalloc_sys::mi_process_info(
            &mut elapsed,
            &mut user,
            &mut system,
            &mut rss,
            &mut peak_rss,
            &mut commit,
            &mut peak_commit,
            &mut faults,
        )
    };
    let (glibc_in_use, glibc_free) = glibc_bytes();
    AllocatorBytes {
        mimalloc_committed: commit as u64,
        rust_in_use: RUST_IN_USE.load(Ordering::Relaxed) as u64,
        glibc_in_use,
        glibc_free,
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn glibc_bytes() -> (u64, u64) {
    // SAFETY: mallinfo2 takes nothing and returns a plain struct (glibc 2.33 and later).
    let info = unsafe { libc::mallinfo2() };
    ((info.uordblks + info.hblkhd) as u64, info.fordblks as u64)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn glibc_bytes() -> (u64, u64) {
    (0, 0)
}

/// Bytes in live allocations made through [`Counted`] (the gateway's global allocator).
pub static RUST_IN_USE: AtomicUsize = AtomicUsize::new(0);

/// A global allocator that counts the bytes live in it, then hands every call to `inner`:
/// with the allocator's own committed figure, it tells memory the gateway holds (a map grown
/// in a backlog and never shrunk) from memory the allocator keeps for it (pages not given
/// back). One relaxed atomic add a call: a few nanoseconds beside the call itself.
pub struct Counted<A> {
    inner: A,
    in_use: &'static AtomicUsize,
}

impl<A> Counted<A> {
    /// Counts into [`RUST_IN_USE`].
    pub const fn new(inner: A) -> Self {
        Counted { inner, in_use: &RUST_IN_USE }
    }

    /// Counts a block of `size` bytes made at `p` (nothing when the allocation failed).
    fn made(&self, p: *mut u8, size: usize) -> *mut u8 {
        if !p.is_null() {
            self.in_use.fetch_add(size, Ordering::Relaxed);
        }
        p
    }
}

// SAFETY: every call goes to `inner` unchanged, with the caller's layout and pointer; the
// count is a side effect that allocates nothing.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counted<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        self.made(unsafe { self.inner.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        self.made(unsafe { self.inner.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.dealloc(ptr, layout) };
        self.in_use.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // The old block is gone and the new one live; on failure the old one stays.
            self.in_use.fetch_add(new_size, Ordering::Relaxed);
            self.in_use.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
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

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_s_figures_see_a_block_handed_out_and_given_back() {
        // Other tests allocate through glibc beside this one (the library's tests do not use
        // mimalloc): a block far larger than what they hold, and a margin. Untouched, it costs
        // address space only.
        let size = 256 << 20;
        let margin = 64 << 20;
        let before = allocator_bytes();
        // SAFETY: a plain malloc of a size that fits, freed once below.
        // black_box: an allocation never used may be left out by the compiler.
        let block = std::hint::black_box(unsafe { libc::malloc(size) });
        assert!(!block.is_null());
        let during = allocator_bytes();
        assert!(during.glibc_in_use + margin >= before.glibc_in_use + size as u64, "{before:?} {during:?}");
        // SAFETY: `block` came from malloc above and is freed once.
        unsafe { libc::free(block) };
        let after = allocator_bytes();
        assert!(after.glibc_in_use + size as u64 <= during.glibc_in_use + margin, "{during:?} {after:?}");
    }

    #[test]
    fn the_purge_delay_is_v3_s_option_and_is_set_to_the_gateway_s() {
        // SAFETY: mi_version takes nothing and returns a constant.
        assert!(is_mimalloc_v3(), "mimalloc v3 is what the gateway links, not {}", unsafe { libmimalloc_sys::mi_version() });
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            assert_eq!(purge_promptly(), None, "the environment's delay wins");
            return;
        }
        // Unless already set, the option holds v3's documented default for purge_delay (1,000).
        // SAFETY: mi_option_get takes an integer and reads the option table.
        let get = |option| unsafe { libmimalloc_sys::mi_option_get(option) } as i64;
        if get(MI_OPTION_PURGE_DELAY) != PURGE_DELAY_MS {
            assert_eq!(get(MI_OPTION_PURGE_DELAY), 1000, "v3's default purge delay");
        }
        assert_eq!(purge_promptly(), Some(PURGE_DELAY_MS));
        assert_eq!(get(MI_OPTION_PURGE_DELAY), PURGE_DELAY_MS);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn huge_pages_are_off_once_asked() {
        // The flag is per process: this test binary keeps it, which harms no other test.
        assert!(no_transparent_huge_pages());
        // SAFETY: PR_GET_THP_DISABLE takes integers only and reads this process's flag.
        assert_eq!(unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) }, 1);
    }

    #[test]
    fn counted_follows_each_block_through_alloc_realloc_and_dealloc() {
        static IN_USE: AtomicUsize = AtomicUsize::new(0);
        let counted = Counted { inner: std::alloc::System, in_use: &IN_USE };
        let layout = Layout::from_size_align(1000, 8).expect("layout");
        // SAFETY: each block is used with the layout it was made with and freed once.
        unsafe {
            let a = counted.alloc(layout);
            let b = counted.alloc_zeroed(layout);
            assert!(!a.is_null() && !b.is_null());
            assert_eq!(*b, 0);
            assert_eq!(IN_USE.load(Ordering::Relaxed), 2000);
            let a = counted.realloc(a, layout, 5000);
            assert!(!a.is_null());
            assert_eq!(IN_USE.load(Ordering::Relaxed), 6000);
            counted.dealloc(a, Layout::from_size_align(5000, 8).expect("layout"));
            counted.dealloc(b, layout);
        }
        assert_eq!(IN_USE.load(Ordering::Relaxed), 0);
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
