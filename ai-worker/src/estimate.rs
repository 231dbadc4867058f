//! What one request of a model will need in memory, as a line in its input size:
//! `bytes ≈ base + per_element × elements`, where `elements` counts the (padded) input
//! tensor's elements.
//!
//! The line is fitted at start-up to peaks measured on probe inputs (see `memory.rs` for how a
//! peak is measured), then shifted up so that it covers every probe: an estimate that is a
//! little high wastes a little budget, one that is low causes an OOM. Online, every batch
//! whose peak could be measured is compared with its estimate; when the batch used more, the
//! per-element cost is raised to match (never lowered: one batch that used less says little).
//! An OOM also leaves its mark: the model's learned capacity, the most elements it will put
//! in one batch, drops to half of what failed.
//!
//! **Which batches are measured.** A measurement is not free on CPU (`memory.rs`: the batch
//! pays its page faults afresh), so [`MemoryEstimate::wants_peak`] picks the batches whose
//! peak says something new, and a sample of the rest:
//!
//! * the first batch of each size class (padded input elements, by power of two);
//! * any batch larger than every batch measured so far (the estimate's extrapolation is
//!   where it is least sure);
//! * every batch after an OOM of this model, until one has been measured;
//! * otherwise one batch in `memory_measure_every_batches` (default 100), on the CPU at most
//!   one such batch every [`PERIODIC_MIN_GAP`], so that a slow drift (a libtorch path that
//!   allocates more for some inputs) is still caught. The gap applies on the CPU only
//!   (`MemoryMonitor::periodic_measure_gap`), where a measured batch gives the whole free
//!   heap back first, so every batch after it, not only the measured one, pays for touching
//!   its memory afresh. At 500 small batches a second, one in 100 was five trims a second,
//!   and the worker spent 0.4 ms of CPU more per request (`scripts/bench request-path`,
//!   2026-11-30: 2.2–2.5 ms against 1.8–2.0 without them). On CUDA a measurement resets and
//!   reads the caching allocator's counters and frees nothing, so the batches after it lose
//!   nothing (not yet timed on a card).
//!
//! Accuracy is kept because an unmeasured batch can only be of a size class already measured
//! and no larger than the largest batch measured, where the line has been checked (and raised
//! if it was low); the start-up fit covers every probe, the reserve absorbs what is left, and
//! an OOM is recovered from and then measured. Only a batch that ran alone can be measured; one
//! that wanted a measurement but overlapped another batch leaves the wish standing for the next.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::config::EstimateConfig;

/// One measured probe: a batch of `elements` input elements peaked at `bytes` above the
/// memory in use before it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Probe {
    pub batch: usize,
    pub elements: u64,
    pub bytes: u64,
}

/// Where an estimate came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Fitted to peaks measured at start-up.
    Measured,
    /// Set in the config.
    Configured,
}

#[derive(Debug, Clone, Serialize)]
pub struct EstimateView {
    pub source: Source,
    pub base_bytes: f64,
    pub bytes_per_element: f64,
    pub probes: Vec<Probe>,
    /// Corrections made online (the estimate was raised after a batch used more).
    pub corrections: u64,
    /// Batches whose peak was measured online (a sample: see the module doc).
    pub measured_batches: u64,
    /// The most input elements one batch may hold after an OOM; absent until one happens.
    pub learned_max_batch_elements: Option<u64>,
    /// The last batch's measured peak over its estimate.
    pub last_ratio: Option<f64>,
}

struct Line {
    base: f64,
    per_element: f64,
    corrections: u64,
    last_ratio: Option<f64>,
    sampling: Sampling,
}

/// The least time between two batches measured because their turn came (see the module doc).
pub const PERIODIC_MIN_GAP: Duration = Duration::from_secs(5);

/// What [`MemoryEstimate::wants_peak`] decides from.
#[derive(Default)]
struct Sampling {
    /// Measure one batch in this many (0: only the batches that say something new).
    every: u64,
    /// The least time between a measured batch and the next one measured only because its
    /// turn came (`every`).
    min_gap: Duration,
    /// When the last measured batch was observed.
    last_measured: Option<Instant>,
    /// Batches since the last measured one.
    since_measured: u64,
    /// Size classes (bit `k`: padded elements in `[2^k, 2^(k+1))`) measured online.
    classes: u64,
    /// The most elements of a measured batch.
    largest: u64,
    /// An OOM happened and no batch has been measured since.
    after_oom: bool,
    /// Batches measured online.
    measured: u64,
}

/// A model's memory estimate, shared by the request handlers (which price requests with it)
/// and the model's batch thread (which corrects it).
pub struct MemoryEstimate {
    source: Source,
    probes: Vec<Probe>,
    line: Mutex<Line>,
    /// `u64::MAX` while no OOM has taught a limit.
    learned_max_elements: AtomicU64,
}

impl MemoryEstimate {
    pub fn configured(config: EstimateConfig) -> Self {
        Self::new(Source::Configured, config.base_bytes, config.bytes_per_element, Vec::new())
    }

    /// Fits `bytes = a + b × elements` to the probes by least squares, keeps both terms
    /// non-negative, then raises `a` until no probe lies above the line.
    pub fn fitted(probes: Vec<Probe>) -> Self {
        let (a, b) = fit_covering(&probes);
        Self::new(Source::Measured, a, b, probes)
    }

    fn new(source: Source, base: f64, per_element: f64, probes: Vec<Probe>) -> Self {
        MemoryEstimate {
            source,
            probes,
            line: Mutex::new(Line {
                base: base.max(0.0),
                per_element: per_element.max(0.0),
                corrections: 0,
                last_ratio: None,
                sampling: Sampling { every: 100, min_gap: PERIODIC_MIN_GAP, ..Sampling::default() },
            }),
            learned_max_elements: AtomicU64::new(u64::MAX),
        }
    }

    fn line(&self) -> std::sync::MutexGuard<'_, Line> {
        self.line.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Estimated peak bytes of one batch holding `elements` input elements (at least 1 byte,
    /// so that every admitted request occupies some budget).
    pub fn bytes(&self, elements: u64) -> u64 {
        let line = self.line();
        let estimate = line.base + line.per_element * elements as f64;
        (estimate.ceil() as u64).max(1)
    }

    /// Whether `elements` are estimated to fit in `bytes` (0: any size fits): what the start-up
    /// timing and each warm-up may run.
    pub fn fits(&self, elements: u64, bytes: u64) -> bool {
        bytes == 0 || self.bytes(elements) <= bytes
    }

    /// Measure one batch in `every` besides those that say something new (0: only those), and
    /// such a batch only once `min_gap` has passed since the last measured one.
    pub fn set_measure_every(&self, every: u64, min_gap: Duration) {
        let mut line = self.line();
        line.sampling.every = every;
        line.sampling.min_gap = min_gap;
    }

    /// Whether the peak of the batch about to run, of `elements` padded input elements, should
    /// be measured (see the module doc). Called once per batch; counts it.
    pub fn wants_peak(&self, elements: u64) -> bool {
        let mut line = self.line();
        let s = &mut line.sampling;
        s.since_measured += 1;
        let turn = s.every > 0 && s.since_measured >= s.every && s.last_measured.is_none_or(|t| t.elapsed() >= s.min_gap);
        s.after_oom || s.classes & (1 << size_class(elements)) == 0 || elements > s.largest || turn
    }

    /// Compares a batch's measured peak with its estimate and raises the per-element cost
    /// when the batch used more. Returns measured / estimated.
    pub fn observe(&self, elements: u64, measured: u64) -> f64 {
        let mut line = self.line();
        let s = &mut line.sampling;
        s.since_measured = 0;
        s.last_measured = Some(Instant::now());
        s.classes |= 1 << size_class(elements);
        s.largest = s.largest.max(elements);
        s.after_oom = false;
        s.measured += 1;
        let estimate = (line.base + line.per_element * elements as f64).max(1.0);
        let ratio = measured as f64 / estimate;
        line.last_ratio = Some(ratio);
        if ratio > 1.0 && elements > 0 {
            let needed = (measured as f64 - line.base) / elements as f64;
            if needed > line.per_element {
                line.per_element = needed;
                line.corrections += 1;
            }
        }
        ratio
    }

    /// The most elements one batch may hold, if an OOM has taught a limit.
    pub fn max_batch_elements(&self) -> Option<u64> {
        match self.learned_max_elements.load(Ordering::Relaxed) {
            u64::MAX => None,
            n => Some(n),
        }
    }

    /// A batch of `elements` ran out of memory: allow at most half as much from now on.
    /// Returns the new limit.
    pub fn learn_from_oom(&self, elements: u64) -> u64 {
        let limit = (elements / 2).max(1);
        self.learned_max_elements.fetch_min(limit, Ordering::Relaxed);
        self.line().sampling.after_oom = true;
        self.learned_max_elements.load(Ordering::Relaxed)
    }

    /// The current line, `(base bytes, bytes per element)`: what callers are told with every
    /// answer, so it must stay cheap (no copy of the probes).
    pub fn terms(&self) -> (f64, f64) {
        let line = self.line();
        (line.base, line.per_element)
    }

    pub fn view(&self) -> EstimateView {
        let line = self.line();
        EstimateView {
            source: self.source,
            base_bytes: line.base,
            bytes_per_element: line.per_element,
            probes: self.probes.clone(),
            corrections: line.corrections,
            measured_batches: line.sampling.measured,
            learned_max_batch_elements: self.max_batch_elements(),
            last_ratio: line.last_ratio,
        }
    }
}

/// `floor(log2(elements))`: the size class of a batch (0 for an empty one).
fn size_class(elements: u64) -> u32 {
    63 - elements.max(1).leading_zeros()
}

/// Least squares through the probes, clamped to non-negative terms, then shifted up so that
/// every probe lies on or under the line.
fn fit_covering(probes: &[Probe]) -> (f64, f64) {
    if probes.is_empty() {
        return (0.0, 0.0);
    }
    let n = probes.len() as f64;
    let xs: Vec<f64> = probes.iter().map(|p| p.elements as f64).collect();
    let ys: Vec<f64> = probes.iter().map(|p| p.bytes as f64).collect();
    let mean_x = xs.iter().sum::<f64>() / n;
    let mean_y = ys.iter().sum::<f64>() / n;
    let sxx: f64 = xs.iter().map(|x| (x - mean_x).powi(2)).sum();
    let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mean_x) * (y - mean_y)).sum();
    let mut b = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
    let mut a = mean_y - b * mean_x;
    if a < 0.0 {
        // A negative intercept means the points bend up; a line through the origin is the
        // honest simpler model.
        a = 0.0;
        let sxx0: f64 = xs.iter().map(|x| x * x).sum();
        b = if sxx0 > 0.0 { xs.iter().zip(&ys).map(|(x, y)| x * y).sum::<f64>() / sxx0 } else { 0.0 };
    }
    let under = xs.iter().zip(&ys).map(|(x, y)| y - (a + b * x)).fold(0.0_f64, f64::max);
    (a + under, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(elements: u64, bytes: u64) -> Probe {
        Probe { batch: 1, elements, bytes }
    }

    #[test]
    fn fit_recovers_an_exact_line() {
        let est = MemoryEstimate::fitted(vec![probe(1000, 5000), probe(2000, 9000), probe(4000, 17000)]);
        let v = est.view();
        assert!((v.base_bytes - 1000.0).abs() < 1e-6, "{v:?}");
        assert!((v.bytes_per_element - 4.0).abs() < 1e-9, "{v:?}");
        assert_eq!(est.bytes(3000), 13000);
    }

    #[test]
    fn fit_covers_every_probe() {
        let probes = vec![probe(100, 900), probe(200, 1000), probe(400, 2500), probe(800, 3900)];
        let est = MemoryEstimate::fitted(probes.clone());
        for p in probes {
            assert!(est.bytes(p.elements) >= p.bytes, "{p:?} above the fit {:?}", est.view());
        }
    }

    #[test]
    fn negative_intercept_falls_back_to_a_line_through_the_origin() {
        let est = MemoryEstimate::fitted(vec![probe(100, 100), probe(200, 300), probe(300, 600)]);
        let v = est.view();
        assert!(v.base_bytes >= 0.0 && v.bytes_per_element > 0.0, "{v:?}");
        assert!(est.bytes(300) >= 600);
    }

    #[test]
    fn observe_raises_but_never_lowers() {
        let est = MemoryEstimate::configured(EstimateConfig { base_bytes: 100.0, bytes_per_element: 1.0 });
        assert_eq!(est.bytes(1000), 1100);
        let ratio = est.observe(1000, 550);
        assert!((ratio - 0.5).abs() < 1e-9);
        assert_eq!(est.bytes(1000), 1100, "a batch that used less does not lower the estimate");
        let ratio = est.observe(1000, 4100);
        assert!(ratio > 3.7);
        assert_eq!(est.bytes(1000), 4100);
        assert_eq!(est.view().corrections, 1);
    }

    #[test]
    fn oom_halves_the_learned_capacity_and_it_only_shrinks() {
        let est = MemoryEstimate::configured(EstimateConfig { base_bytes: 0.0, bytes_per_element: 1.0 });
        assert_eq!(est.max_batch_elements(), None);
        assert_eq!(est.learn_from_oom(8000), 4000);
        assert_eq!(est.learn_from_oom(20000), 4000);
        assert_eq!(est.learn_from_oom(4000), 2000);
        assert_eq!(est.max_batch_elements(), Some(2000));
    }

    #[test]
    fn peaks_are_measured_for_new_sizes_after_an_oom_and_one_batch_in_n() {
        let est = MemoryEstimate::configured(EstimateConfig { base_bytes: 0.0, bytes_per_element: 1.0 });
        est.set_measure_every(4, Duration::ZERO);
        assert!(est.wants_peak(1000), "the first batch of a size class is measured");
        est.observe(1000, 900);
        assert!(!est.wants_peak(1000));
        assert!(!est.wants_peak(600), "same class, smaller: already covered");
        assert!(est.wants_peak(1020), "larger than every measured batch");
        est.observe(1020, 900);
        assert!(est.wants_peak(5000), "a new size class");
        est.observe(5000, 4000);
        assert!(!est.wants_peak(800));
        assert!(!est.wants_peak(800));
        assert!(!est.wants_peak(800));
        assert!(est.wants_peak(800), "one batch in 4");
        est.observe(800, 700);
        est.learn_from_oom(4000);
        assert!(est.wants_peak(800), "measured after an OOM");
        assert!(est.wants_peak(800), "until a measurement arrives");
        est.observe(800, 700);
        assert!(!est.wants_peak(800));
        assert_eq!(est.view().measured_batches, 5);
    }

    #[test]
    fn a_batch_whose_turn_comes_waits_for_the_gap_but_a_new_size_does_not() {
        let est = MemoryEstimate::configured(EstimateConfig { base_bytes: 0.0, bytes_per_element: 1.0 });
        est.set_measure_every(2, Duration::from_millis(200));
        assert!(est.wants_peak(1000));
        est.observe(1000, 900);
        for _ in 0..10 {
            assert!(!est.wants_peak(1000), "its turn, but too soon after the last measurement");
        }
        assert!(est.wants_peak(5000), "a new size class is measured at once");
        est.observe(5000, 4000);
        std::thread::sleep(Duration::from_millis(250));
        assert!(!est.wants_peak(1000), "one batch since the last measurement");
        assert!(est.wants_peak(1000), "its turn, and the gap has passed");
    }
}
