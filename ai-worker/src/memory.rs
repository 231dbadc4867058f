//! What the worker knows about its device memory: how much there is, how much it uses, the
//! peak of one batch, and the cap it must stay under. Beside them, from the same NVML handle,
//! how busy the device is.
//!
//! | | CUDA | CPU |
//! |---|---|---|
//! | free / total | NVML (`nvml-wrapper`) for the device | `/proc/meminfo` `MemAvailable` / `MemTotal` |
//! | ours, now | caching allocator's reserved bytes (the C++ shim) | resident set (`VmRSS`) |
//! | peak of a batch | allocator's peak allocated, after a reset | `VmHWM`, after `malloc_trim(0)` and writing `5` to `/proc/self/clear_refs` |
//! | cap (`memory_limit_bytes`) | allocator's per-process memory fraction | `RLIMIT_AS` |
//! | give cache back | `emptyCache()` | `malloc_trim(0)` (also before each measured batch) |
//! | utilisation (share of time a kernel ran) | NVML | none |
//!
//! A peak is a process-wide quantity, so a batch's peak is attributable to it only when no
//! other batch ran at any moment during it; [`PeakScope`] knows whether that was so.
//!
//! **Measuring costs, so only some batches are measured** (`MemoryEstimate::wants_peak`
//! decides which). On CPU glibc keeps freed tensors in its heap and hands them to the next
//! batch, already paged in; that reuse is most of what makes a plain libtorch loop fast
//! ([`tune_allocator`]). A measured batch runs as every batch once did: the mmap threshold
//! drops to 256 KiB for it (every tensor its own mapping, so the peak is exact and does not
//! depend on what the heap held before: measured in the heap instead, P-Net's start-up fit
//! moved between 33 and 54 B per element from run to run), the free heap is given back
//! (`malloc_trim(0)`), and the batch pays the page faults of touching its memory afresh (on
//! P-Net 320² about 2–3× the batch's time); the serving threshold comes back when it ends.
//! On CUDA a measurement is a reset of the allocator's peak counter and a read of its
//! statistics.
//!
//! The budget admission hands out is recomputed every `memory_resample_ms`:
//! `min(cap, free now + what we hold above our start-up footprint) − reserve`. Memory another
//! process takes shrinks it; it grows back when that memory is freed.

use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};

use crate::cuda_memory;
use crate::model::ComputeDevice;

/// A reading of the device's memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub total: u64,
    /// Free on the device (CUDA) or available to new allocations (CPU).
    pub free: u64,
    /// Held by this process: allocator reserved (CUDA) or resident set (CPU).
    pub ours: u64,
}

pub struct MemoryMonitor {
    backend: Backend,
    running: AtomicUsize,
    starts: AtomicU64,
}

enum Backend {
    Cpu { clear_refs_works: bool },
    Cuda { index: i32, nvml: Option<Box<nvml_wrapper::Nvml>> },
}

impl MemoryMonitor {
    pub fn new(device: ComputeDevice) -> Self {
        let backend = match device {
            ComputeDevice::Cuda(index) => {
                let nvml = match nvml_wrapper::Nvml::init() {
                    Ok(nvml) => Some(Box::new(nvml)),
                    Err(e) => {
                        tracing::warn!(error = %e, "NVML unavailable; free memory comes from the allocator's cap only");
                        None
                    }
                };
                if !cuda_memory::BUILT {
                    tracing::warn!("built without the CUDA allocator shim: peaks and the memory cap are unavailable");
                }
                Backend::Cuda { index: index as i32, nvml }
            }
            ComputeDevice::Cpu => {
                let clear_refs_works = std::fs::write("/proc/self/clear_refs", "5").is_ok();
                if !clear_refs_works {
                    tracing::warn!("cannot write /proc/self/clear_refs: batch peaks cannot be measured");
                }
                Backend::Cpu { clear_refs_works }
            }
        };
        MemoryMonitor { backend, running: AtomicUsize::new(0), starts: AtomicU64::new(0) }
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self.backend, Backend::Cuda { .. })
    }

    /// The least time between two batches measured only because their turn came
    /// ([`crate::estimate::MemoryEstimate::set_measure_every`]). On the CPU a measurement hands
    /// the whole free heap back first, so every batch after it pays its page faults again:
    /// [`crate::estimate::PERIODIC_MIN_GAP`]. On CUDA it resets and reads the caching
    /// allocator's counters, frees nothing and faults no page in (not yet timed on a card):
    /// no gap, one batch in `every`.
    pub fn periodic_measure_gap(&self) -> std::time::Duration {
        periodic_measure_gap(self.is_cuda())
    }

    /// Whether peaks can be measured at all (decides whether start-up probing is possible).
    pub fn can_measure_peaks(&self) -> bool {
        match &self.backend {
            Backend::Cpu { clear_refs_works } => *clear_refs_works,
            Backend::Cuda { .. } => cuda_memory::BUILT,
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        match &self.backend {
            Backend::Cpu { .. } => {
                let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
                Snapshot {
                    total: kib_field(&meminfo, "MemTotal:").unwrap_or(0),
                    free: kib_field(&meminfo, "MemAvailable:").unwrap_or(0),
                    ours: proc_status("VmRSS:").unwrap_or(0),
                }
            }
            Backend::Cuda { index, nvml } => {
                let ours = cuda_memory::stats(*index).map(|s| s.reserved).unwrap_or(0);
                let info = nvml
                    .as_ref()
                    .and_then(|n| n.device_by_index(*index as u32).ok())
                    .and_then(|d| d.memory_info().ok());
                match info {
                    Some(info) => Snapshot { total: info.total, free: info.free, ours },
                    None => Snapshot { total: 0, free: 0, ours },
                }
            }
        }
    }

    /// The share of NVML's last sample period (1/6 s to 1 s, by product) in which a kernel ran
    /// on the device, 0 to 1. `None` without a reading: on CPU, without NVML, or where NVML
    /// does not give one (a MIG instance, a device lost), so that no gauge shows a made-up
    /// figure.
    pub fn gpu_utilization(&self) -> Option<f64> {
        match &self.backend {
            Backend::Cpu { .. } => None,
            Backend::Cuda { index, nvml } => {
                let rates = nvml.as_ref()?.device_by_index(*index as u32).ok()?.utilization_rates().ok()?;
                Some((f64::from(rates.gpu) / 100.0).clamp(0.0, 1.0))
            }
        }
    }

    /// CUDA: the bytes the caching allocator has handed to tensors now, of what it has
    /// reserved from the device (the snapshot's `ours`); the difference is its cache. `None` on
    /// CPU or without the allocator shim.
    pub fn allocated(&self) -> Option<u64> {
        match &self.backend {
            Backend::Cpu { .. } => None,
            Backend::Cuda { index, .. } => cuda_memory::stats(*index).ok().map(|s| s.allocated),
        }
    }

    /// Starts a batch. Hold the scope across the batch, then [`PeakScope::finish`]. Every batch
    /// takes a scope (two atomic operations), so that a measured batch knows whether another ran
    /// beside it; only when `measure` is set, and the batch starts alone, is its peak measured.
    pub fn peak_scope(&self, measure: bool) -> PeakScope<'_> {
        let was_running = self.running.fetch_add(1, Ordering::SeqCst);
        let starts = self.starts.fetch_add(1, Ordering::SeqCst) + 1;
        let alone = was_running == 0 && measure && self.can_measure_peaks();
        // Resetting the peak while another batch runs would spoil that batch's measurement, so
        // only a batch that starts alone resets it (and only such a batch can be measured).
        let base = if alone { self.reset_peak() } else { None };
        PeakScope { monitor: self, starts, base, finished: false }
    }

    /// Resets the peak counter; returns the current usage it is measured from.
    fn reset_peak(&self) -> Option<u64> {
        match &self.backend {
            Backend::Cpu { .. } => {
                // Free heap memory stays resident for reuse; a batch reusing it would add
                // nothing to VmHWM, and what it reuses depends on the heap's history. For the
                // measured batch every allocation over 256 KiB is its own mmap again (exact
                // and repeatable, as every batch was before), and the free heap goes back
                // first; `finish` restores the serving threshold.
                // SAFETY: mallopt and malloc_trim only set allocator parameters and release
                // free memory of the allocator's own arenas.
                unsafe {
                    libc::mallopt(libc::M_MMAP_THRESHOLD, MEASURE_MMAP_THRESHOLD);
                    libc::malloc_trim(0);
                }
                std::fs::write("/proc/self/clear_refs", "5").ok()?;
                proc_status("VmRSS:")
            }
            Backend::Cuda { index, .. } => {
                cuda_memory::reset_peak(*index).ok()?;
                cuda_memory::stats(*index).ok().map(|s| s.allocated)
            }
        }
    }

    fn peak(&self) -> Option<u64> {
        match &self.backend {
            Backend::Cpu { .. } => proc_status("VmHWM:"),
            Backend::Cuda { index, .. } => cuda_memory::stats(*index).ok().map(|s| s.peak_allocated),
        }
    }

    /// Gives cached, unused memory back to the device (CUDA: the caching allocator's; CPU:
    /// glibc's free heap pages).
    pub fn empty_cache(&self) {
        match &self.backend {
            Backend::Cuda { .. } => {
                if let Err(e) = cuda_memory::empty_cache() {
                    tracing::debug!(error = %e, "empty_cache unavailable");
                }
            }
            // SAFETY: malloc_trim only releases free memory of the allocator's own arenas.
            Backend::Cpu { .. } => unsafe {
                libc::malloc_trim(0);
            },
        }
    }

    /// Bytes the allocator holds but does not use (CUDA), for the optional cleanup.
    pub fn cache_slack(&self) -> Option<u64> {
        match &self.backend {
            Backend::Cuda { index, .. } => {
                cuda_memory::stats(*index).ok().map(|s| s.reserved.saturating_sub(s.allocated))
            }
            Backend::Cpu { .. } => None,
        }
    }

    /// Applies `memory_limit_bytes`: from now on the process may take at most `limit` bytes
    /// beyond what it holds now (on CUDA, once the allocator's cache is returned). Call once, after models are loaded and every long-lived
    /// thread has started (on CPU a thread's stack counts against the address-space limit).
    /// On CPU `host_allowance` is added to the address-space limit: see
    /// `WorkerConfig::memory_host_allowance_bytes`.
    pub fn apply_limit(&self, limit: u64, host_allowance: u64) -> anyhow::Result<()> {
        match &self.backend {
            Backend::Cpu { .. } => {
                let vm_size = proc_status("VmSize:")
                    .ok_or_else(|| anyhow::anyhow!("cannot read VmSize from /proc/self/status"))?;
                let cap = vm_size.saturating_add(limit).saturating_add(host_allowance);
                let rlimit = libc::rlimit { rlim_cur: cap as libc::rlim_t, rlim_max: libc::RLIM_INFINITY };
                // SAFETY: setrlimit reads the struct we pass and touches no other memory.
                let rc = unsafe { libc::setrlimit(libc::RLIMIT_AS, &rlimit) };
                anyhow::ensure!(rc == 0, "setrlimit(RLIMIT_AS): {}", std::io::Error::last_os_error());
                // The cap counts address space, and heap address space never shrinks: with
                // tensors up to 32 MiB kept in the heap for speed, the heap's high-water mark
                // and its fragmentation would use up the cap until even one request no longer
                // fits (and a Rust allocation failing then aborts the process). Under the cap
                // every tensor over 256 KiB is its own mapping again, returned when freed:
                // slower on CPU, but the cap then bounds what requests hold, as it emulates.
                SERVE_MMAP_THRESHOLD.store(MEASURE_MMAP_THRESHOLD, Ordering::Relaxed);
                serving_mmap_threshold();
                tracing::info!(
                    address_space_bytes = vm_size, limit_bytes = limit, host_allowance_bytes = host_allowance,
                    "memory cap applied (RLIMIT_AS)"
                );
            }
            Backend::Cuda { index, .. } => {
                // What the process holds now must be what it keeps (its weights), not also the
                // blocks its batch threads' warm-ups left cached on their streams: those serve
                // any later batch, so counted here they would be allowed on top of the limit
                // (on an H200, 4.5 GiB of them kept a 1 GiB cap from ever being reached).
                self.empty_cache();
                let snap = self.snapshot();
                anyhow::ensure!(snap.total > 0, "memory_limit_bytes on CUDA needs NVML for the device's total");
                let fraction = ((snap.ours + limit) as f64 / snap.total as f64).min(1.0);
                cuda_memory::set_memory_fraction(fraction, *index).map_err(|e| anyhow::anyhow!(e))?;
                tracing::info!(fraction, limit_bytes = limit, "memory cap applied (allocator memory fraction)");
            }
        }
        Ok(())
    }
}

/// A batch's peak measurement in progress.
pub struct PeakScope<'a> {
    monitor: &'a MemoryMonitor,
    starts: u64,
    base: Option<u64>,
    finished: bool,
}

impl PeakScope<'_> {
    /// Whether this batch's peak is being measured (it asked, and started alone).
    pub fn measuring(&self) -> bool {
        self.base.is_some()
    }

    /// The batch's peak above the usage when it started, when it was measured and ran alone
    /// from start to end (else `None`: unmeasured, or the peak would include someone else's
    /// memory).
    pub fn finish(mut self) -> Option<u64> {
        self.finished = true;
        let alone = self.monitor.starts.load(Ordering::SeqCst) == self.starts;
        // An unmeasured batch reads nothing: no /proc read, no allocator call.
        let peak = match self.base {
            Some(base) if alone => self.monitor.peak().map(|peak| peak.saturating_sub(base)),
            _ => None,
        };
        self.end();
        peak
    }

    /// Restores the serving allocator mode after a measured batch, and counts the batch out.
    fn end(&self) {
        if self.base.is_some() && !self.monitor.is_cuda() {
            serving_mmap_threshold();
        }
        self.monitor.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for PeakScope<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.end();
        }
    }
}

/// The admission budget: the cap on what requests may hold, as memory comes and goes.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// The most requests may ever hold: `memory_limit_bytes` / `memory_budget_bytes` /
    /// the free memory at start-up.
    pub cap: u64,
    pub reserve: u64,
    /// What this process held when the budget was set up (models loaded and warmed).
    pub baseline_ours: u64,
    /// `memory_budget_override_bytes`: handed out whatever memory says (recovery tests only).
    pub fixed: Option<u64>,
}

impl Budget {
    /// Sets up the budget from the first reading after start-up.
    pub fn new(snap: Snapshot, limit: Option<u64>, configured: Option<u64>, reserve_fraction: f64, reserve_bytes: u64) -> Self {
        let mut cap = snap.free;
        if let Some(limit) = limit {
            cap = if snap.free == 0 { limit } else { cap.min(limit) };
        }
        if let Some(configured) = configured {
            cap = cap.min(configured);
        }
        let reserve = ((cap as f64 * reserve_fraction.clamp(0.0, 1.0)) as u64).max(reserve_bytes).min(cap);
        Budget { cap, reserve, baseline_ours: snap.ours, fixed: None }
    }

    /// The same budget, except that it always hands out `bytes` (`memory_budget_override_bytes`):
    /// free memory, the cap and the reserve no longer bound it.
    pub fn overridden(self, bytes: Option<u64>) -> Self {
        match bytes {
            Some(bytes) => Budget { cap: bytes, reserve: 0, fixed: Some(bytes), ..self },
            None => self,
        }
    }

    /// The bytes admission may hand out now. `models_since_start`: the bytes of the model
    /// versions loaded since start-up less those freed since (negative once more was freed than
    /// loaded): they are not the requests' to use, though they sit in this process's memory
    /// like the requests' own.
    pub fn available(&self, snap: Snapshot, models_since_start: i64) -> u64 {
        if let Some(fixed) = self.fixed {
            return fixed;
        }
        // Signed: a model freed since start-up takes this process below its baseline, and
        // what it freed shows as free memory instead; the sum stays put.
        let ours = i128::from(snap.ours) - i128::from(self.baseline_ours);
        let cap = i128::from(self.cap);
        // Without a reading of free memory (no NVML) the cap is all we know.
        let room = if snap.free == 0 && snap.total == 0 { cap } else { cap.min(i128::from(snap.free) + ours).max(0) };
        let room = room - i128::from(models_since_start) - i128::from(self.reserve);
        room.clamp(0, i128::from(u64::MAX)) as u64
    }
}

fn proc_status(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    kib_field(&status, field)
}

/// A `Name:   123 kB` line of a `/proc` file, in bytes.
fn kib_field(text: &str, field: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line[field.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// Makes the C allocator fast and bounded. Call first thing in `main`, before any other
/// thread starts.
///
/// * A fixed mmap threshold of 32 MiB (glibc's largest) and trim threshold of 64 MiB: what
///   glibc's own adaptive thresholds settle at in a long-running libtorch loop, fixed from the
///   first call. Tensors under 32 MiB come from the heap and their memory is reused, already
///   paged in, by the next batch. An earlier version fixed the threshold at 256 KiB so that
///   every freed tensor went back to the OS and every batch's peak showed in `VmHWM`; each
///   batch then spent more than half its time in page faults and `munmap` (P-Net 320² on CPU:
///   0.24× a plain libtorch loop; see docs/performance-notes.md). Peaks are now measured on the
///   batches that are sampled, after a `malloc_trim` ([`MemoryMonitor::peak_scope`]).
/// * Two malloc arenas: each arena reserves 64 MiB of address space, which under the CPU
///   memory cap (`RLIMIT_AS`) would be charged to nobody's estimate.
pub fn tune_allocator() {
    serving_mmap_threshold();
    // SAFETY: mallopt only sets allocator parameters; called before other threads exist.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 * 1024 * 1024);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// The mmap threshold while serving: glibc's largest (see [`tune_allocator`]); under the CPU
/// memory cap, [`MEASURE_MMAP_THRESHOLD`] instead (see [`MemoryMonitor::apply_limit`]).
static SERVE_MMAP_THRESHOLD: AtomicI32 = AtomicI32::new(32 * 1024 * 1024);
/// The mmap threshold during a measured batch: every tensor its own mapping, so the batch's
/// peak is exact and does not depend on the heap's history.
const MEASURE_MMAP_THRESHOLD: i32 = 256 * 1024;

fn periodic_measure_gap(cuda: bool) -> std::time::Duration {
    if cuda {
        std::time::Duration::ZERO
    } else {
        crate::estimate::PERIODIC_MIN_GAP
    }
}

fn serving_mmap_threshold() {
    // SAFETY: mallopt only sets an allocator parameter (under glibc's own lock).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD.load(Ordering::Relaxed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_cpu_spaces_its_periodic_measurements() {
        assert_eq!(periodic_measure_gap(false), crate::estimate::PERIODIC_MIN_GAP);
        assert_eq!(periodic_measure_gap(true), std::time::Duration::ZERO);
        assert_eq!(MemoryMonitor::new(ComputeDevice::Cpu).periodic_measure_gap(), crate::estimate::PERIODIC_MIN_GAP);
    }

    #[test]
    fn kib_fields_parse() {
        let text = "Name:\tai-worker\nVmHWM:\t  123456 kB\nVmRSS:\t    1024 kB\n";
        assert_eq!(kib_field(text, "VmHWM:"), Some(123456 * 1024));
        assert_eq!(kib_field(text, "VmRSS:"), Some(1024 * 1024));
        assert_eq!(kib_field(text, "VmSize:"), None);
    }

    #[test]
    fn budget_follows_free_memory_and_our_own_use() {
        let start = Snapshot { total: 100_000, free: 60_000, ours: 10_000 };
        let budget = Budget::new(start, Some(40_000), None, 0.05, 1_000);
        assert_eq!(budget.cap, 40_000);
        assert_eq!(budget.reserve, 2_000);
        assert_eq!(budget.available(start, 0), 38_000);
        // Another process takes 50k: only 10k free, nothing of ours in use.
        let squeezed = Snapshot { free: 10_000, ..start };
        assert_eq!(budget.available(squeezed, 0), 8_000);
        // We hold 20k above our baseline and 25k are free: 45k is ours to use, capped at 40k.
        let busy = Snapshot { free: 25_000, ours: 30_000, ..start };
        assert_eq!(budget.available(busy, 0), 38_000);
        // A model of 5k loaded at run time: not the requests' to use.
        let loaded = Snapshot { free: 25_000, ours: 15_000, ..start };
        assert_eq!(budget.available(loaded, 5_000), 23_000);
        // A start-up model of 4k freed: we are 4k below the baseline, 4k more is free, and
        // the requests get it; past the cap, which was set with that model in memory.
        let freed = Snapshot { free: 64_000, ours: 6_000, ..start };
        assert_eq!(budget.available(freed, -4_000), 42_000);
    }

    #[test]
    fn configured_budget_and_reserve_floor() {
        let start = Snapshot { total: 100_000, free: 60_000, ours: 0 };
        let budget = Budget::new(start, None, Some(20_000), 0.0, 3_000);
        assert_eq!(budget.cap, 20_000);
        assert_eq!(budget.available(start, 0), 17_000);
        let forced = budget.overridden(Some(1_000_000));
        assert_eq!((forced.cap, forced.reserve), (1_000_000, 0));
        assert_eq!(forced.available(Snapshot { total: 100_000, free: 0, ours: 90_000 }, 5_000), 1_000_000);
        assert_eq!(budget.overridden(None).available(start, 0), 17_000);
    }

    #[test]
    fn cpu_peak_scope_sees_an_allocation() {
        let monitor = MemoryMonitor::new(ComputeDevice::Cpu);
        if !monitor.can_measure_peaks() {
            return; // a sandbox without clear_refs: nothing to measure here
        }
        let scope = monitor.peak_scope(true);
        let block = vec![1u8; 64 << 20];
        std::hint::black_box(&block);
        drop(block);
        // Other tests run in parallel threads of this process, so the peak is only a lower
        // bound check: our 64 MiB must show (when no other scope was open).
        if let Some(peak) = scope.finish() {
            assert!(peak >= 60 << 20, "peak {peak} misses a 64 MiB allocation");
        }
    }

    #[test]
    fn cpu_has_no_gpu_utilization() {
        // No reading, so the gauge stays absent rather than showing an idle card.
        assert_eq!(MemoryMonitor::new(ComputeDevice::Cpu).gpu_utilization(), None);
    }
}
