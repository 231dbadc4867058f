//! How many requests one batch may hold: chosen per model, on the worker's one device, and per
//! input size, from measured throughput. A configured size is at most an upper bound (for
//! latency); it is never a target that would lower throughput.
//!
//! **Why measure.** Whether batching pays depends on the model, the device and the input size.
//! Measured on this 2-core CPU with one torch thread (plain libtorch loop, items per second):
//! Silero VAD (silero-vad 6.2) on 1 s clips runs 160/s alone, 105/s in batches of 2, 190/s in
//! batches of 4 and 324/s in batches of 8 (its recurrent steps are tiny ops whose fixed cost a
//! batch shares, past a dip at 2); MTCNN P-Net on 64² images gains about 35% at batch 4, is
//! flat at 160², and at 320² is slower per image in any batch (its activations outgrow the
//! caches; docs/performance-notes.md). On a GPU a batch of small images is usually
//! nearly as fast as one image, until the card is full. A fixed `max_batch_size = 8` was right
//! for one of these and wrong for the others.
//!
//! **The rule.** Inputs are grouped into size classes by their elements per item (one row of
//! the padded batch), by power of two. For each class the sizer keeps the throughput measured
//! at each batch size it has run (items per second, a moving average over batches). The
//! class's **limit** is the batch size with the best throughput, where a larger size must beat
//! the best smaller one by [`GAIN`] (10%) to be preferred: batching that does not pay is not
//! worth its latency, and a smaller gain is within the noise of a shared machine. A batch is formed up to the limit (and never past what its members were
//! granted in memory, nor past the capacity learned from OOMs: `engine.rs`).
//!
//! * **At start-up** each model is timed on a few sizes (`Model::batching_probe_sizes`) at
//!   batch 1, 2, 4, … — doubling until two sizes in a row measured slower than the best so
//!   far, up to [`CALIBRATION_MAX`] rows and within [`CALIBRATION_BUDGET`] per model — so the
//!   first requests already get a measured limit. One size that measures slower, or a gain
//!   too small to choose, does not end the search: Silero on 4 s clips runs 42/s alone, 28/s
//!   at 2, 49/s at 4 and 87/s at 8. A class not calibrated takes the limit of the nearest
//!   class that was.
//! * **Online** every batch's duration updates its class's figures. One batch in
//!   [`EXPLORE_EVERY`] of a class may hold more than the limit (when that many requests are
//!   waiting): twice it, and every other time four times it, so that a size that pays more
//!   than measured so far — a less loaded machine, a GPU with room — is found past a dip of
//!   one size, and the limit grows; a larger size measured worse is not chosen.
//!   Each exploration that ran and left the limit where it was doubles the wait before the
//!   next, after the first pair (2× and 4×), up to [`EXPLORE_BACKOFF_MAX`] doublings (one
//!   batch in 1,024); a change of the limit, up or down, brings the wait back to
//!   [`EXPLORE_EVERY`]. An exploration costs where it does not pay: P-Net at 480×640 on
//!   this CPU is slower per image in batches of two or four, and such a batch holds a tensor
//!   past glibc's 32 MiB mmap threshold (page faults on every one).
//!   While the queue stays full every batch holds the limit, so the figure of a smaller size
//!   would never be measured again: one taken at start-up, beside other models' warm-ups, may
//!   hold the limit where it no longer pays (P-Net at 320² on this CPU, 2026-12-01: limit 2 from
//!   start-up, batches of two at 0.83–0.86 of a plain loop's images a second at batch 1). So
//!   one batch in [`REFRESH_EVERY`] of a class whose limit is above 1 holds half the limit, and
//!   a size's average gives its newest batches a weight of at least 1/(batches so far + 1),
//!   so that the first figure measured online counts as much as the start-up one.
//!   On a GPU, where throughput keeps rising with the batch until the card is busy, the limit
//!   keeps doubling and memory is what bounds the batch: the members' grants of the admission
//!   budget and the learned capacity.
//! * The limit never passes `batching.max_batch_size` (per model: `max_batch_size`) when one is
//!   configured, nor [`SEARCH_MAX`]. With `batching.calibrate = false` nothing is timed at
//!   start-up and classes start from `batching.initial_batch_size` (default 1), a prior the
//!   first figures replace.
//!
//! The limits are exposed as `vramgate_worker_batch_size_limit{model, item_elements}` (the
//! class's lowest elements per item).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::model::Model;

/// How much better (items per second) a larger batch size must measure to be preferred: 10%,
/// above the run-to-run noise of a shared CPU, and worth a batch's added latency.
pub const GAIN: f64 = 1.10;
/// One batch in this many (per size class) may explore twice the limit.
pub const EXPLORE_EVERY: u64 = 32;
/// At most this many doublings of the wait between explorations that do not pay: one batch in
/// `EXPLORE_EVERY << EXPLORE_BACKOFF_MAX` (1,024).
pub const EXPLORE_BACKOFF_MAX: u32 = 5;
/// One batch in this many (per size class, limit above 1) holds half the limit, so that the
/// smaller size's figure stays current. Offset from the explorations' turns: at the batch
/// counts [`REFRESH_AT`] modulo this.
pub const REFRESH_EVERY: u64 = 64;
const REFRESH_AT: u64 = 48;
/// The largest batch size the sizer ever chooses, whatever it measures.
pub const SEARCH_MAX: usize = 1024;
/// The largest batch size timed at start-up (online exploration may go further).
pub const CALIBRATION_MAX: usize = 16;
/// Start-up timing per model stops once this much time is spent.
pub const CALIBRATION_BUDGET: Duration = Duration::from_secs(3);
/// Weight of the newest batch in a batch size's moving average.
const SMOOTHING: f64 = 0.2;

/// A size class: `floor(log2(elements per item))`.
pub type SizeClass = u32;

/// The size class of items of `item_elements` elements.
pub fn size_class(item_elements: u64) -> SizeClass {
    63 - item_elements.max(1).leading_zeros()
}

/// Items per second at one batch size, averaged over the batches run at it.
#[derive(Debug, Clone, Copy)]
struct Rate {
    items_per_s: f64,
    samples: u64,
}

#[derive(Debug, Default)]
struct Class {
    /// By batch size (rows).
    rates: BTreeMap<usize, Rate>,
    /// Batches formed for this class (for exploration).
    batches: u64,
    /// Explorations allowed so far (odd: twice the limit, even: four times it).
    explorations: u64,
    /// The batch count at which the next exploration may come (0: at [`EXPLORE_EVERY`]).
    next_explore: u64,
    /// The limit when the last exploration was allowed.
    explored_from: Option<usize>,
    /// Whether a batch past `explored_from` has run since (a short queue may not fill one).
    explored_ran: bool,
    /// Explorations in a row that ran and left the limit where it was.
    losing: u32,
}

impl Class {
    /// The best measured batch size: ascending, a larger size replaces the best so far only
    /// when it measured at least [`GAIN`] times its throughput. `None` before any figure.
    fn best(&self, bound: usize) -> Option<usize> {
        let mut best: Option<(usize, f64)> = None;
        for (&rows, rate) in self.rates.range(..=bound) {
            match best {
                Some((_, r)) if rate.items_per_s < r * GAIN => {}
                _ => best = Some((rows, rate.items_per_s)),
            }
        }
        best.map(|(rows, _)| rows)
    }

    /// Whether a size larger than `rows` was measured (and so found not to pay).
    fn measured_above(&self, rows: usize, bound: usize) -> bool {
        rows < bound && self.rates.range(rows + 1..=bound).next().is_some()
    }
}

/// The batch sizes of one model: see the module doc.
#[derive(Debug)]
pub struct BatchSizer {
    classes: Mutex<BTreeMap<SizeClass, Class>>,
    /// `max_batch_size` if configured, else [`SEARCH_MAX`].
    bound: usize,
    /// The limit where nothing is measured (`batching.initial_batch_size`).
    initial: usize,
}

impl BatchSizer {
    /// `configured_max`: `max_batch_size`, an upper bound; `initial`: the limit of a size
    /// class before anything about it or a neighbour is measured.
    pub fn new(configured_max: Option<usize>, initial: usize) -> Self {
        let bound = configured_max.unwrap_or(SEARCH_MAX).clamp(1, SEARCH_MAX);
        BatchSizer { classes: Mutex::new(BTreeMap::new()), bound, initial: initial.clamp(1, bound) }
    }

    fn classes(&self) -> std::sync::MutexGuard<'_, BTreeMap<SizeClass, Class>> {
        self.classes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The most rows a batch of items of `item_elements` may hold now. Call once per batch
    /// formed: every [`EXPLORE_EVERY`]th batch of a class may hold twice the limit.
    pub fn allowed(&self, item_elements: u64) -> usize {
        let class = size_class(item_elements);
        let mut classes = self.classes();
        let limit = limit_of(&classes, class, self.bound, self.initial);
        let entry = classes.entry(class).or_default();
        entry.batches += 1;
        if entry.batches < entry.next_explore.max(EXPLORE_EVERY) {
            if limit > 1 && entry.batches % REFRESH_EVERY == REFRESH_AT {
                return (limit / 2).min(self.bound);
            }
            return limit.min(self.bound);
        }
        if let Some(from) = entry.explored_from.take() {
            if limit != from {
                entry.losing = 0;
            } else if entry.explored_ran {
                entry.losing += 1;
            }
        }
        entry.explored_from = Some(limit);
        entry.explored_ran = false;
        entry.explorations += 1;
        // The first pair of losses waits the plain interval: 4× must get its turn after 2×.
        let backoff = entry.losing.saturating_sub(1).min(EXPLORE_BACKOFF_MAX);
        entry.next_explore = entry.batches + (EXPLORE_EVERY << backoff);
        // Twice the limit, and every other exploration four times it: one size that does not
        // pay (Silero at 2) must not hide a larger one that does.
        let factor = if entry.explorations % 2 == 1 { 2 } else { 4 };
        (limit * factor).min(self.bound)
    }

    /// The chosen batch size for items of `item_elements`, without exploring.
    pub fn limit(&self, item_elements: u64) -> usize {
        limit_of(&self.classes(), size_class(item_elements), self.bound, self.initial)
    }

    /// A batch of `rows` items of `item_elements` each took `seconds`.
    pub fn record(&self, item_elements: u64, rows: usize, seconds: f64) {
        if rows == 0 || seconds <= 0.0 {
            return;
        }
        let items_per_s = rows as f64 / seconds;
        let mut classes = self.classes();
        let class = classes.entry(size_class(item_elements)).or_default();
        if class.explored_from.is_some_and(|from| rows > from) {
            class.explored_ran = true;
        }
        class
            .rates
            .entry(rows)
            .and_modify(|r| {
                // A plain mean over the first few batches, then the moving average.
                let weight = SMOOTHING.max(1.0 / (r.samples + 1) as f64);
                r.items_per_s += weight * (items_per_s - r.items_per_s);
                r.samples += 1;
            })
            .or_insert(Rate { items_per_s, samples: 1 });
    }

    /// Every size class with figures and its limit, for the metrics and the logs.
    pub fn limits(&self) -> Vec<(SizeClass, usize)> {
        let classes = self.classes();
        classes.iter().filter(|(_, c)| !c.rates.is_empty()).map(|(&k, _)| (k, limit_of(&classes, k, self.bound, self.initial))).collect()
    }

    /// Times `model` at start-up: for each probe size, batch 1, 2, 4, … until two sizes in a
    /// row measured slower than the best so far ([`Doubling`]; a gain can show only at 4 or 8
    /// after none, or a loss, at 2: P-Net on 64² images, Silero), up to [`CALIBRATION_MAX`] and
    /// within [`CALIBRATION_BUDGET`]. Each size and batch is run once untimed (libtorch
    /// prepares kernels per shape), then three times timed; the fastest counts. An error (an
    /// OOM on a small device) ends that size's doubling.
    /// `affordable(elements)` says whether a probe of that many input elements may run.
    pub fn calibrate(&self, model: &Model, affordable: impl Fn(u64) -> bool) {
        let started = Instant::now();
        for size in model.batching_probe_sizes() {
            let item_elements = model.probe_input_elements(1, size) as u64;
            let mut doubling = Doubling::default();
            let mut rows = 1;
            while rows <= CALIBRATION_MAX.min(self.bound) && started.elapsed() < CALIBRATION_BUDGET {
                let elements = model.probe_input_elements(rows, size);
                if elements > model.config().max_input_elements || !affordable(elements as u64) {
                    break;
                }
                let input = model.probe_input(rows, size);
                let mut fastest = f64::INFINITY;
                for run in 0..4 {
                    let t = Instant::now();
                    if model.infer(&input).is_err() {
                        fastest = f64::INFINITY;
                        break;
                    }
                    if run > 0 {
                        fastest = fastest.min(t.elapsed().as_secs_f64());
                    }
                }
                if !fastest.is_finite() {
                    break;
                }
                self.record(item_elements, rows, fastest);
                if !doubling.go_on(rows as f64 / fastest) {
                    break;
                }
                rows *= 2;
            }
        }
        tracing::info!(
            model = %model.name(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            limits = ?self.limits().iter().map(|(k, l)| (1u64 << k, *l)).collect::<Vec<_>>(),
            "batch sizes calibrated: (elements per item from, batch size limit)"
        );
    }
}

/// The start-up search's stopping rule: go on doubling the batch until two sizes in a row
/// measured slower than the best so far (the fastest size that beat the one before it by
/// [`GAIN`]). A size that is no slower, though too little faster to be chosen, goes on: the
/// gain may come at the next doubling. [`CALIBRATION_BUDGET`] bounds a curve that stays flat.
#[derive(Debug, Default)]
struct Doubling {
    best: f64,
    slower: u32,
}

impl Doubling {
    /// The rate (items per second) of the size just timed; whether to time twice that size.
    fn go_on(&mut self, rate: f64) -> bool {
        if rate < self.best {
            self.slower += 1;
        } else {
            self.slower = 0;
            if rate >= self.best * GAIN {
                self.best = rate;
            }
        }
        self.slower < 2
    }
}

/// The limit of `class`: its best measured size; where nothing larger than that was measured
/// in this class, the best size of the nearest other class with figures (the smaller class on
/// a tie), or `initial` when no class has any, may stand in for the sizes not yet tried.
fn limit_of(classes: &BTreeMap<SizeClass, Class>, class: SizeClass, bound: usize, initial: usize) -> usize {
    let prior = || {
        classes
            .iter()
            .filter(|(&k, _)| k != class)
            .filter_map(|(&k, c)| c.best(bound).map(|best| (k, best)))
            .min_by_key(|&(k, _)| (k.abs_diff(class), k))
            .map_or(initial, |(_, best)| best)
    };
    let own = classes.get(&class).and_then(|c| c.best(bound).map(|best| (c, best)));
    let limit = match own {
        Some((c, best)) if c.measured_above(best, bound) => best,
        Some((_, best)) => best.max(prior()),
        None => prior(),
    };
    limit.clamp(1, bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records `rate` items/s at `rows` for items of `elements`.
    fn feed(sizer: &BatchSizer, elements: u64, rows: usize, rate: f64) {
        sizer.record(elements, rows, rows as f64 / rate);
    }

    #[test]
    fn the_limit_is_the_fastest_size_that_pays() {
        let sizer = BatchSizer::new(None, 1);
        assert_eq!(sizer.limit(1000), 1, "nothing measured: no batching");
        feed(&sizer, 1000, 1, 100.0);
        feed(&sizer, 1000, 2, 108.0);
        assert_eq!(sizer.limit(1000), 1, "8% is not worth the latency");
        feed(&sizer, 1000, 4, 150.0);
        assert_eq!(sizer.limit(1000), 4);
        feed(&sizer, 1000, 8, 140.0);
        assert_eq!(sizer.limit(1000), 4, "a larger batch that measured slower is not chosen");
    }

    #[test]
    fn batching_that_costs_throughput_is_not_chosen() {
        let sizer = BatchSizer::new(Some(8), 1);
        feed(&sizer, 300_000, 1, 110.0);
        feed(&sizer, 300_000, 2, 95.0);
        feed(&sizer, 300_000, 8, 60.0);
        assert_eq!(sizer.limit(300_000), 1);
    }

    #[test]
    fn classes_are_separate_and_unknown_sizes_take_the_nearest() {
        let sizer = BatchSizer::new(None, 1);
        feed(&sizer, 12_000, 1, 2000.0);
        feed(&sizer, 12_000, 4, 3000.0);
        feed(&sizer, 300_000, 1, 100.0);
        feed(&sizer, 300_000, 2, 80.0);
        assert_eq!(sizer.limit(12_000), 4);
        assert_eq!(sizer.limit(300_000), 1);
        assert_eq!(sizer.limit(10_000), 4, "nearest class below");
        assert_eq!(sizer.limit(900_000), 1, "nearest class above");
        let limits = sizer.limits();
        assert_eq!(limits, vec![(size_class(12_000), 4), (size_class(300_000), 1)]);
    }

    #[test]
    fn exploration_doubles_the_limit_now_and_then_and_a_configured_bound_holds() {
        let sizer = BatchSizer::new(Some(6), 1);
        feed(&sizer, 1000, 1, 100.0);
        feed(&sizer, 1000, 4, 200.0);
        let allowed: Vec<usize> = (0..EXPLORE_EVERY).map(|_| sizer.allowed(1000)).collect();
        assert_eq!(allowed.iter().filter(|&&a| a == 4).count() as u64, EXPLORE_EVERY - 1);
        assert_eq!(allowed.last(), Some(&6), "twice the limit, within the configured bound");
        // The explored size measured better: it becomes the limit (bounded by the config).
        feed(&sizer, 1000, 6, 300.0);
        assert_eq!(sizer.limit(1000), 6);
    }

    #[test]
    fn exploration_looks_past_one_size_that_does_not_pay() {
        // Silero on 1 s clips (silero-vad 6.2, one torch thread): slower per clip at 2.
        let sizer = BatchSizer::new(None, 1);
        feed(&sizer, 16_000, 1, 160.0);
        feed(&sizer, 16_000, 2, 105.0);
        assert_eq!(sizer.limit(16_000), 1);
        let explored: Vec<usize> =
            (0..4 * EXPLORE_EVERY).map(|_| sizer.allowed(16_000)).filter(|&a| a != 1).collect();
        assert_eq!(explored, vec![2, 4, 2, 4], "twice the limit, then four times it, in turn");
        feed(&sizer, 16_000, 4, 190.0);
        assert_eq!(sizer.limit(16_000), 4, "found past the dip");
        feed(&sizer, 16_000, 8, 324.0);
        assert_eq!(sizer.limit(16_000), 8);
    }

    #[test]
    fn explorations_that_keep_losing_come_ever_more_rarely_until_the_limit_moves() {
        // P-Net at 480x640 on this CPU: slower per image in any batch.
        let sizer = BatchSizer::new(None, 1);
        feed(&sizer, 921_600, 1, 10.0);
        // Every exploration runs (the queue is full) and measures slower: where they come.
        let explore_at = |sizer: &BatchSizer, batches: u64| -> Vec<u64> {
            (1..=batches)
                .filter(|_| {
                    let rows = sizer.allowed(921_600);
                    if rows > 1 {
                        feed(sizer, 921_600, rows, 7.0);
                    }
                    rows > 1
                })
                .collect()
        };
        let at = explore_at(&sizer, 3000);
        let gaps: Vec<u64> = at.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(gaps[..7], [32, 32, 64, 128, 256, 512, 1024], "2x, 4x, then waits doubling: {at:?}");
        assert_eq!(sizer.limit(921_600), 1);
        // The machine frees up and batches of 2 now pay: the limit moves, and the next
        // exploration comes after the plain interval again.
        for _ in 0..10 {
            feed(&sizer, 921_600, 2, 30.0);
        }
        assert_eq!(sizer.limit(921_600), 2);
        let next: Vec<usize> = (0..3000).map(|_| sizer.allowed(921_600)).collect();
        let first = next.iter().position(|&r| r > 2).expect("an exploration");
        let second = first + 1 + next[first + 1..].iter().position(|&r| r > 2).expect("another");
        assert!(first < 1024, "the pending wait ends as it was set: {first}");
        assert_eq!(second - first, 32, "the limit moved: explorations every 32 batches again");
    }

    #[test]
    fn a_full_queue_still_measures_half_the_limit_and_a_stale_figure_gives_way() {
        // P-Net at 320² (2026-12-01): start-up timed batch 1 slowly beside other warm-ups and
        // chose 2; served with a full queue, batches of 2 run at 72 images/s and single
        // images would at 84.
        let sizer = BatchSizer::new(None, 1);
        feed(&sizer, 307_200, 1, 60.0);
        feed(&sizer, 307_200, 2, 80.0);
        assert_eq!(sizer.limit(307_200), 2);
        let true_rate = |rows: usize| if rows == 1 { 84.0 } else { 72.0 };
        let rows: Vec<usize> = (0..300)
            .map(|_| {
                let rows = sizer.allowed(307_200);
                feed(&sizer, 307_200, rows, true_rate(rows));
                rows
            })
            .collect();
        let first_half = rows.iter().position(|&r| r == 1).map(|i| i as u64 + 1);
        assert_eq!(first_half, Some(REFRESH_AT), "the first batch of half the limit: {rows:?}");
        assert_eq!(sizer.limit(307_200), 1, "the fresh figure of batch 1 wins: {rows:?}");
        let batched = rows[REFRESH_AT as usize..].iter().filter(|&&r| r > 1).count() as u64;
        assert!(batched <= 300 / EXPLORE_EVERY, "from then on single images but for explorations: {rows:?}");
        // Where the smaller size measures worse (a GPU with room), the limit stays.
        let sizer = BatchSizer::new(None, 1);
        feed(&sizer, 1000, 4, 400.0);
        feed(&sizer, 1000, 8, 800.0);
        for _ in 0..300 {
            let rows = sizer.allowed(1000);
            feed(&sizer, 1000, rows, 100.0 * rows as f64);
        }
        assert!(sizer.limit(1000) >= 8, "{:?}", sizer.limits());
    }

    #[test]
    fn an_exploration_that_never_ran_does_not_count_as_a_loss() {
        // A short queue: the batch could hold twice the limit but never does.
        let sizer = BatchSizer::new(None, 1);
        feed(&sizer, 1000, 1, 100.0);
        let explored: Vec<u64> = (1..=8 * EXPLORE_EVERY).filter(|_| sizer.allowed(1000) > 1).collect();
        assert_eq!(explored, (1..=8).map(|k| k * EXPLORE_EVERY).collect::<Vec<_>>());
    }

    #[test]
    fn the_start_up_search_goes_on_past_one_size_that_does_not_pay() {
        // The rates of batch 1, 2, 4, 8, 16 in turn; the search times the next size while
        // `go_on` says so.
        let timed = |rates: &[f64]| {
            let mut doubling = Doubling::default();
            rates.iter().position(|&r| !doubling.go_on(r)).map_or(rates.len(), |last| last + 1)
        };
        // Silero on 1 s clips: a dip at 2, then a gain at 4 and 8: all five sizes timed.
        assert_eq!(timed(&[160.0, 105.0, 190.0, 324.0, 330.0]), 5);
        // Silero on 4 s clips: a dip at 2, too small a gain at 4, twice as fast at 8.
        assert_eq!(timed(&[42.3, 27.5, 45.0, 87.0, 90.0]), 5);
        // P-Net at 320²: slower in any batch; stops after two sizes slower than batch 1.
        assert_eq!(timed(&[100.0, 80.0, 70.0, 60.0, 50.0]), 3);
        // A gain only at 4 (P-Net on 64²), then two slower: stops after 16.
        assert_eq!(timed(&[400.0, 420.0, 540.0, 520.0, 500.0, 480.0]), 5);
    }

    #[test]
    fn a_class_seen_only_at_small_batches_keeps_its_neighbours_limit() {
        let sizer = BatchSizer::new(None, 1);
        feed(&sizer, 16_000, 1, 90.0);
        feed(&sizer, 16_000, 8, 340.0);
        // Longer clips, so far only ever alone (one client): no evidence against batching.
        feed(&sizer, 80_000, 1, 19.0);
        assert_eq!(sizer.limit(80_000), 8);
        // Measured in a batch of 8 and found slower: its own figures win.
        feed(&sizer, 80_000, 8, 15.0);
        assert_eq!(sizer.limit(80_000), 1);
    }

    #[test]
    fn without_figures_the_initial_size_is_a_prior_that_measurement_replaces() {
        let sizer = BatchSizer::new(Some(8), 8);
        assert_eq!(sizer.limit(3_000_000), 8);
        feed(&sizer, 3_000_000, 1, 10.0);
        assert_eq!(sizer.limit(3_000_000), 8, "nothing larger measured yet");
        feed(&sizer, 3_000_000, 4, 7.0);
        assert_eq!(sizer.limit(3_000_000), 1);
    }

    #[test]
    fn figures_follow_a_change_of_speed() {
        let sizer = BatchSizer::new(None, 1);
        feed(&sizer, 1000, 1, 100.0);
        feed(&sizer, 1000, 2, 150.0);
        assert_eq!(sizer.limit(1000), 2);
        // Batches of 2 became slow (another process took the cores' caches, say).
        for _ in 0..20 {
            feed(&sizer, 1000, 2, 60.0);
        }
        assert_eq!(sizer.limit(1000), 1);
    }
}
