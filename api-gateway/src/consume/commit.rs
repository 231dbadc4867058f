//! Offset commits. A thread of its own commits the finished watermark of every partition
//! ([`OffsetTracker`](super::offsets::OffsetTracker)) synchronously, so each commit's real
//! outcome is known: a position counts as committed only once the broker acknowledged it, a
//! failed commit is counted and its positions are offered again to the next one.
//!
//! It looks at the watermarks every millisecond while any record is in the window (every
//! 10 ms while none is), and commits every `commit_interval_ms`, and at once when the records
//! waiting for a commit reach a quarter of `max_in_flight`: the in-flight window is counted
//! from the last *confirmed* commit, so waiting for the timer with a full window would stall
//! fetching. One
//! commit at a time, each covering every partition that advanced; the fetch thread goes on
//! fetching meanwhile.
//!
//! Commits and revokes exclude each other ([`Commits::gate`]): a commit taken before a revoke
//! must not reach the broker after the partition's new owner committed.
//!
//! What a commit writes depends on the delivery mode ([`Writer`]): in at-least-once delivery,
//! the offsets (the outputs went out as their records finished); in exactly-once delivery, one
//! transaction with the outputs below the watermarks and the watermarks themselves
//! ([`super::transaction`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};

use super::offsets::{SharedOffsets, TopicPartition};
use super::transaction::Transactional;
use crate::metrics::Metrics;

/// How often the commit thread looks at the watermarks while records are finishing, and while
/// nothing is waiting for a commit (an idle gateway should not spin).
const TICK: Duration = Duration::from_millis(1);
const IDLE_TICK: Duration = Duration::from_millis(10);

/// What commits share: the offsets, the gate against revokes (which holds what writes a
/// commit), and the metrics.
pub struct Commits {
    pub offsets: Arc<SharedOffsets>,
    gate: Mutex<Writer>,
    metrics: Arc<Metrics>,
}

/// What writes a commit.
pub enum Writer {
    /// At-least-once delivery: the consumer commits the offsets.
    Offsets,
    /// Exactly-once delivery: a transaction writes the outputs and the offsets.
    Transactions(Box<Transactional>),
}

/// What one commit did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// No partition advanced since the last commit.
    Nothing,
    Committed,
    Failed,
}

impl Commits {
    pub fn new(offsets: Arc<SharedOffsets>, metrics: Arc<Metrics>, writer: Writer) -> Self {
        Commits { offsets, gate: Mutex::new(writer), metrics }
    }

    /// Held by a revoke while it commits and forgets its partitions.
    pub fn gate(&self) -> MutexGuard<'_, Writer> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Exactly-once delivery: committed outputs not yet read back, or waiting to be written
    /// again.
    pub fn unverified(&self) -> usize {
        match &*self.gate() {
            Writer::Transactions(t) => t.unverified(),
            Writer::Offsets => 0,
        }
    }

    /// Whether outputs found aborted after their commit wait to be written again.
    pub fn has_redo(&self) -> bool {
        matches!(&*self.gate(), Writer::Transactions(t) if t.has_redo())
    }

    /// Commits, synchronously, every partition whose watermark advanced; confirms the positions
    /// the broker acknowledged, offers the others again.
    pub fn commit<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>) -> Outcome {
        let mut gate = self.gate();
        let advanced = self.offsets.lock().take_advanced();
        let redo = matches!(&*gate, Writer::Transactions(t) if t.has_redo());
        if advanced.is_empty() && !redo {
            return Outcome::Nothing;
        }
        match self.send(&mut gate, consumer, &advanced) {
            Ok(()) => {
                self.offsets.confirm(&advanced);
                Outcome::Committed
            }
            Err(e) => {
                tracing::warn!(error = %e, "offset commit failed; the next commit covers these records");
                self.offsets.lock().untake(&advanced);
                Outcome::Failed
            }
        }
    }

    /// Commits `positions` synchronously (with their outputs, in exactly-once delivery) and
    /// counts the outcome. `writer`: the gate, held by the caller.
    pub fn send<C: ConsumerContext>(
        &self,
        writer: &mut Writer,
        consumer: &BaseConsumer<C>,
        positions: &[(TopicPartition, i64)],
    ) -> Result<(), KafkaError> {
        let sent = Instant::now();
        let result = match writer {
            Writer::Offsets => {
                let mut tpl = TopicPartitionList::new();
                for (tp, position) in positions {
                    let _ = tpl.add_partition_offset(&tp.0, tp.1, Offset::Offset(*position));
                }
                consumer.commit(&tpl, CommitMode::Sync)
            }
            Writer::Transactions(transactional) => {
                // Each position with the assignment it belongs to: outputs of an earlier one
                // are never written.
                let with_epochs: Vec<_> = {
                    let tracker = self.offsets.lock();
                    positions.iter().filter_map(|(tp, p)| Some((tp.clone(), *p, tracker.epoch(tp)?))).collect()
                };
                let epoch_of = |tp: &TopicPartition| self.offsets.lock().epoch(tp);
                let result = transactional.commit(consumer, &with_epochs, &epoch_of);
                self.metrics.outbox.set(transactional.outbox.waiting() as i64);
                result
            }
        };
        self.metrics.commit_seconds.observe(sent.elapsed().as_secs_f64());
        let label = if result.is_ok() { "ok" } else { "error" };
        self.metrics.commits.with_label_values(&[label]).inc();
        result
    }
}

/// When the commit thread commits.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    pub interval: Duration,
    /// Records waiting for a commit that trigger one at once.
    pub eager_after: usize,
}

impl Policy {
    pub fn new(commit_interval_ms: u64, max_in_flight: usize) -> Self {
        Policy { interval: Duration::from_millis(commit_interval_ms.max(1)), eager_after: (max_in_flight / 4).max(1) }
    }

    fn due(&self, committable: usize, since_last: Duration) -> bool {
        committable > 0 && (committable >= self.eager_after || since_last >= self.interval)
    }
}

/// How long the commit thread sleeps before it looks again: a tick while any record is past the
/// last confirmed commit, the idle tick only while none is. Right after a commit nothing is
/// committable, yet the next records' outputs are on their way and finish within milliseconds;
/// sleeping the idle tick then held the whole window for up to 10 ms (gateway cause 15).
fn next_tick(in_window: usize) -> Duration {
    if in_window > 0 {
        TICK
    } else {
        IDLE_TICK
    }
}

/// Runs the commit loop until `stop` is set. The final commit is the caller's (after its
/// records drained).
pub fn run<C: ConsumerContext>(consumer: &BaseConsumer<C>, commits: &Commits, policy: Policy, stop: &AtomicBool) {
    let mut last = Instant::now();
    let mut failures = 0u32;
    let mut tick = TICK;
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(tick);
        let (committable, in_window) = {
            let offsets = commits.offsets.lock();
            (offsets.committable(), offsets.uncommitted())
        };
        tick = next_tick(in_window);
        if !policy.due(committable, last.elapsed()) && !commits.has_redo() {
            continue;
        }
        match commits.commit(consumer) {
            Outcome::Committed => failures = 0,
            Outcome::Failed => {
                // A broker that refuses commits (a rebalance in progress, the coordinator
                // moving) is not asked again at once.
                failures += 1;
                std::thread::sleep(Duration::from_millis(50 * u64::from(failures.min(20))));
            }
            Outcome::Nothing => {}
        }
        last = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_on_the_timer_or_at_once_under_pressure() {
        let policy = Policy::new(200, 256);
        assert_eq!(policy.eager_after, 64);
        let check = |committable, ms, due| {
            assert_eq!(policy.due(committable, Duration::from_millis(ms)), due, "{committable} after {ms} ms")
        };
        check(0, 10_000, false);
        check(1, 199, false);
        check(1, 200, true);
        check(64, 0, true);
        check(63, 0, false);
        assert_eq!(Policy::new(200, 1).eager_after, 1);
    }

    #[test]
    fn a_window_on_its_way_is_looked_at_every_tick_though_nothing_is_committable_yet() {
        // Right after a commit: records fetched, their outputs not yet acknowledged.
        use super::super::offsets::OffsetTracker;
        let mut t = OffsetTracker::new();
        let tickets: Vec<_> = (0..4).map(|o| t.begin(("t".to_string(), 0), o)).collect();
        assert_eq!(t.committable(), 0);
        assert_eq!(next_tick(t.uncommitted()), TICK);
        for ticket in &tickets {
            t.finish(ticket);
        }
        let taken = t.take_advanced();
        t.confirm(&taken);
        assert_eq!(next_tick(t.uncommitted()), IDLE_TICK, "an empty window may idle");
    }
}
