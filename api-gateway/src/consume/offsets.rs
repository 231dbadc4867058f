//! Which offsets are safe to commit when records finish out of order.
//!
//! Per partition we keep the offsets that started and have not finished. The committable
//! position (Kafka's "next offset to read") is the lowest unfinished offset, or one past the
//! highest offset seen when nothing is unfinished. So a commit never passes a record whose
//! result or dead letter is not yet acknowledged: after a crash it is read again, never lost.
//!
//! Every assignment of a partition starts a new epoch. Work started under an older epoch
//! (before a revoke) cannot move the position of the current one.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::KeyValue;
use vramgate_shared::telemetry::context::PastSpan;

/// A Kafka partition: topic and partition number.
pub type TopicPartition = (String, i32);

/// Proof that a record was started; hand it back to [`OffsetTracker::finish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    pub partition: TopicPartition,
    pub offset: i64,
    epoch: u64,
}

impl Ticket {
    /// The assignment of its partition it was started under.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

#[derive(Debug, Default)]
struct PartitionState {
    epoch: u64,
    unfinished: BTreeSet<i64>,
    /// One past the highest offset started in this epoch.
    next: Option<i64>,
    /// The last position handed out for committing, to commit only advances.
    committed: Option<i64>,
    /// The last position the broker acknowledged as committed: what a crash now would resume
    /// from. The duplicate bound is counted from here, not from a commit still on its way.
    confirmed: Option<i64>,
    /// The first offset started in this epoch: where the group's commit stood when it began.
    start: Option<i64>,
}

impl PartitionState {
    fn position(&self) -> Option<i64> {
        self.unfinished.first().copied().or(self.next)
    }
}

#[derive(Debug, Default)]
pub struct OffsetTracker {
    partitions: HashMap<TopicPartition, PartitionState>,
    epochs: u64,
}

impl OffsetTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// The partitions were (re)assigned to this consumer: forget what an earlier assignment
    /// left behind and start a new epoch for each.
    pub fn assign(&mut self, partitions: impl IntoIterator<Item = TopicPartition>) {
        for tp in partitions {
            self.epochs += 1;
            self.partitions.insert(tp, PartitionState { epoch: self.epochs, ..Default::default() });
        }
    }

    /// The partitions were taken away: their unfinished work can no longer be committed here.
    pub fn revoke<'a>(&mut self, partitions: impl IntoIterator<Item = &'a TopicPartition>) {
        for tp in partitions {
            self.partitions.remove(tp);
        }
    }

    /// Records that `offset` started. A partition never assigned explicitly (e.g. a consumer
    /// that gets records before the rebalance callback ran) is assigned on first sight.
    pub fn begin(&mut self, partition: TopicPartition, offset: i64) -> Ticket {
        if !self.partitions.contains_key(&partition) {
            self.assign([partition.clone()]);
        }
        let state = self.partitions.get_mut(&partition).expect("assigned just above");
        state.unfinished.insert(offset);
        state.next = Some(state.next.map_or(offset + 1, |n| n.max(offset + 1)));
        state.start = Some(state.start.map_or(offset, |s| s.min(offset)));
        Ticket { partition, offset, epoch: state.epoch }
    }

    /// Whether the ticket's partition is still assigned in the epoch it was started in: work
    /// for a stale ticket belongs to the partition's new owner, which reads it again.
    pub fn is_current(&self, ticket: &Ticket) -> bool {
        self.partitions.get(&ticket.partition).is_some_and(|s| s.epoch == ticket.epoch)
    }

    /// Records that the ticket's record is finished (its output acknowledged). Returns false
    /// for a stale ticket or one finished before.
    pub fn finish(&mut self, ticket: &Ticket) -> bool {
        match self.partitions.get_mut(&ticket.partition) {
            Some(state) if state.epoch == ticket.epoch => state.unfinished.remove(&ticket.offset),
            _ => false,
        }
    }

    /// The partition's current assignment (epoch), if it is assigned.
    pub fn epoch(&self, partition: &TopicPartition) -> Option<u64> {
        self.partitions.get(partition).map(|s| s.epoch)
    }

    /// The committable position of a partition (Kafka's "next offset to read"): the lowest
    /// unfinished offset, or one past the highest started when nothing is unfinished.
    pub fn position(&self, partition: &TopicPartition) -> Option<i64> {
        self.partitions.get(partition).and_then(PartitionState::position)
    }

    /// Positions that advanced since they were last taken, marked as taken.
    pub fn take_advanced(&mut self) -> Vec<(TopicPartition, i64)> {
        let mut advanced = Vec::new();
        for (tp, state) in &mut self.partitions {
            if let Some(position) = state.position() {
                if state.committed.is_none_or(|c| c < position) {
                    state.committed = Some(position);
                    advanced.push((tp.clone(), position));
                }
            }
        }
        advanced
    }

    /// Takes back positions handed out by [`take_advanced`](Self::take_advanced) whose commit
    /// failed, so the next round offers them again.
    pub fn untake(&mut self, positions: &[(TopicPartition, i64)]) {
        for (tp, position) in positions {
            if let Some(state) = self.partitions.get_mut(tp) {
                if state.committed == Some(*position) {
                    state.committed = None;
                }
            }
        }
    }

    /// The broker acknowledged these positions (handed out by
    /// [`take_advanced`](Self::take_advanced)) as committed. Positions of a partition that was
    /// revoked or reassigned since are ignored.
    pub fn confirm(&mut self, positions: &[(TopicPartition, i64)]) {
        for (tp, position) in positions {
            // Only a position this epoch handed out: a new epoch has not taken it.
            match self.partitions.get_mut(tp) {
                Some(state) if state.committed.is_some_and(|c| c >= *position) => {
                    state.confirmed = Some(state.confirmed.map_or(*position, |c| c.max(*position)));
                }
                _ => {}
            }
        }
    }

    /// Unfinished records of these partitions.
    pub fn unfinished_in(&self, partitions: &[TopicPartition]) -> usize {
        partitions.iter().filter_map(|tp| self.partitions.get(tp)).map(|s| s.unfinished.len()).sum()
    }

    /// Unfinished records per partition.
    pub fn pending(&self) -> impl Iterator<Item = (&TopicPartition, usize)> {
        self.partitions.iter().map(|(tp, s)| (tp, s.unfinished.len()))
    }

    /// Records fetched past the last *confirmed* commit, all partitions: what a crash now
    /// would make the group read again. Bounding it bounds the duplicates, finished records
    /// whose commit is not acknowledged yet (behind a slow one, or a commit in flight) included.
    pub fn uncommitted(&self) -> usize {
        self.partitions
            .values()
            .filter_map(|s| Some((s.next? - s.confirmed.or(s.start)?).max(0) as usize))
            .sum()
    }

    /// Records finished past the last position handed out for committing: what the next
    /// commit would cover beyond the last one.
    pub fn committable(&self) -> usize {
        self.partitions
            .values()
            .filter_map(|s| Some((s.position()? - s.committed.or(s.start)?).max(0) as usize))
            .sum()
    }

    /// Total records in flight.
    pub fn in_flight(&self) -> usize {
        self.partitions.values().map(|s| s.unfinished.len()).sum()
    }
}

/// The tracker shared between the fetch loop, its rebalance callbacks and the record tasks,
/// with a condition variable so a revoke can wait for its partitions' records to finish.
#[derive(Debug, Default)]
pub struct SharedOffsets {
    tracker: Mutex<OffsetTracker>,
    /// A record finished: what a revoke's drain waits for.
    changed: Condvar,
    /// A commit was confirmed: what frees room in the in-flight window.
    committed: Condvar,
    /// Finished records whose trace is sampled, waiting for the commit that covers them: it
    /// is recorded in their trace as a `commit` span (from finished to confirmed).
    awaiting_commit: Mutex<VecDeque<AwaitingCommit>>,
}

/// Most finished records kept for their `commit` span; past it the oldest get none. The
/// in-flight window (`max_in_flight`) normally bounds them well below this.
pub const MAX_AWAITING_COMMIT_SPANS: usize = 65_536;

#[derive(Debug)]
struct AwaitingCommit {
    partition: TopicPartition,
    offset: i64,
    trace: opentelemetry::Context,
    finished: SystemTime,
}

impl SharedOffsets {
    /// A poisoned lock means a panic while holding it; the tracker is a plain set of offsets
    /// that stays consistent, so keep using it rather than taking the gateway down.
    pub fn lock(&self) -> MutexGuard<'_, OffsetTracker> {
        self.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn finish(&self, ticket: &Ticket) -> bool {
        let finished = self.lock().finish(ticket);
        self.changed.notify_all();
        finished
    }

    /// [`finish`](Self::finish), and when `trace` is given (a sampled record), a `commit`
    /// span goes into that trace once a confirmed commit covers the record.
    pub fn finish_traced(&self, ticket: &Ticket, trace: Option<opentelemetry::Context>) -> bool {
        if let Some(trace) = trace {
            let mut waiting = self.awaiting_commit.lock().unwrap_or_else(|p| p.into_inner());
            if waiting.len() >= MAX_AWAITING_COMMIT_SPANS {
                waiting.pop_front();
            }
            waiting.push_back(AwaitingCommit {
                partition: ticket.partition.clone(),
                offset: ticket.offset,
                trace,
                finished: SystemTime::now(),
            });
        }
        self.finish(ticket)
    }

    /// Marks positions as acknowledged by the broker and wakes whoever waits for room.
    pub fn confirm(&self, positions: &[(TopicPartition, i64)]) {
        self.lock().confirm(positions);
        self.committed.notify_all();
        self.record_commit_spans(positions);
    }

    /// The `commit` spans of the traced records these positions cover.
    fn record_commit_spans(&self, positions: &[(TopicPartition, i64)]) {
        let covered: Vec<AwaitingCommit> = {
            let mut waiting = self.awaiting_commit.lock().unwrap_or_else(|p| p.into_inner());
            if waiting.is_empty() {
                return;
            }
            let (done, rest): (VecDeque<_>, VecDeque<_>) = waiting.drain(..).partition(|w| {
                positions.iter().any(|(tp, position)| *tp == w.partition && w.offset < *position)
            });
            *waiting = rest;
            done.into()
        };
        let now = SystemTime::now();
        for record in covered {
            let position = positions.iter().find(|(tp, _)| *tp == record.partition).map_or(0, |(_, p)| *p);
            let mut span = PastSpan::new("commit", record.finished, now);
            span.attributes = vec![
                KeyValue::new("messaging.system", "kafka"),
                KeyValue::new("messaging.operation.type", "settle"),
                KeyValue::new("messaging.destination.partition.id", record.partition.1.to_string()),
                KeyValue::new("messaging.kafka.offset", record.offset),
                KeyValue::new("vramgate.commit.position", position),
                KeyValue::new("vramgate.commit.partitions", positions.len() as i64),
            ];
            span.record(&record.trace);
        }
    }

    /// Waits until a commit is confirmed, or `timeout` passes. Records finishing do not wake
    /// it: the in-flight window is counted from the last confirmed commit, so only a
    /// confirmation frees room in it.
    pub fn wait_committed(&self, timeout: Duration) {
        let tracker = self.lock();
        let _ = self.committed.wait_timeout(tracker, timeout);
    }

    pub fn is_current(&self, ticket: &Ticket) -> bool {
        self.lock().is_current(ticket)
    }

    /// Waits until these partitions have no unfinished record, or `timeout` passes. Returns how
    /// many are still unfinished.
    pub fn wait_drained(&self, partitions: &[TopicPartition], timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut tracker = self.lock();
        loop {
            let left = tracker.unfinished_in(partitions);
            let now = Instant::now();
            if left == 0 || now >= deadline {
                return left;
            }
            tracker = self
                .changed
                .wait_timeout(tracker, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tp() -> TopicPartition {
        ("t".to_string(), 0)
    }

    #[test]
    fn out_of_order_completion_commits_only_below_the_gap() {
        let mut t = OffsetTracker::new();
        let tickets: Vec<Ticket> = (10..15).map(|o| t.begin(tp(), o)).collect();
        // finish 11, 12, 14: 10 is still open, so nothing is committable beyond 10
        for i in [1, 2, 4] {
            assert!(t.finish(&tickets[i]));
        }
        assert_eq!(t.take_advanced(), vec![(tp(), 10)]);
        assert_eq!(t.take_advanced(), vec![], "only advances are handed out");
        // finish 10: everything up to 13 (exclusive) is done
        assert!(t.finish(&tickets[0]));
        assert_eq!(t.position(&tp()), Some(13));
        assert_eq!(t.uncommitted(), 5, "finished but not yet committed still counts");
        assert_eq!(t.committable(), 3);
        assert!(t.finish(&tickets[3]));
        let taken = t.take_advanced();
        assert_eq!(taken, vec![(tp(), 15)]);
        assert_eq!(t.in_flight(), 0);
        assert_eq!(t.committable(), 0);
        assert_eq!(t.uncommitted(), 5, "a commit on its way does not count until the broker confirms it");
        t.confirm(&taken);
        assert_eq!(t.uncommitted(), 0);
    }

    #[test]
    fn stale_tickets_from_a_revoked_assignment_are_ignored() {
        let mut t = OffsetTracker::new();
        let old = t.begin(tp(), 5);
        assert!(t.is_current(&old));
        t.revoke([&tp()]);
        assert!(!t.is_current(&old));
        assert!(!t.finish(&old));
        t.assign([tp()]);
        let new = t.begin(tp(), 5);
        assert!(!t.finish(&old), "old epoch must not finish the new record");
        assert_eq!(t.unfinished_in(&[tp()]), 1);
        assert!(t.finish(&new));
        assert_eq!(t.position(&tp()), Some(6));
    }

    #[test]
    fn draining_waits_for_the_revoked_partitions_only() {
        let offsets = std::sync::Arc::new(SharedOffsets::default());
        let other = ("t".to_string(), 1);
        let a = offsets.lock().begin(tp(), 0);
        let _b = offsets.lock().begin(other.clone(), 0);
        let finisher = {
            let offsets = offsets.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                offsets.finish(&a);
            })
        };
        assert_eq!(offsets.wait_drained(&[tp()], Duration::from_secs(5)), 0);
        finisher.join().expect("thread");
        assert_eq!(offsets.wait_drained(&[other], Duration::from_millis(20)), 1, "times out");
    }

    #[test]
    fn a_confirmation_for_a_revoked_assignment_is_ignored() {
        let mut t = OffsetTracker::new();
        let a = t.begin(tp(), 0);
        t.finish(&a);
        let taken = t.take_advanced();
        t.revoke([&tp()]);
        t.assign([tp()]);
        t.begin(tp(), 7);
        t.confirm(&taken);
        assert_eq!(t.uncommitted(), 1, "counted from where the new epoch started");
    }

    #[test]
    fn finishing_twice_is_harmless() {
        let mut t = OffsetTracker::new();
        let a = t.begin(tp(), 0);
        assert!(t.finish(&a));
        assert!(!t.finish(&a));
        assert_eq!(t.position(&tp()), Some(1));
    }

    proptest! {
        /// Whatever order records finish in, the position never passes an unfinished record,
        /// the positions handed out only grow, and once all are finished the position is one
        /// past the highest offset.
        #[test]
        fn commit_never_passes_an_unfinished_record(
            count in 1usize..60,
            order in proptest::collection::vec(any::<u32>(), 60),
        ) {
            let mut t = OffsetTracker::new();
            let base = 100i64;
            let mut tickets: Vec<Ticket> = (0..count as i64).map(|i| t.begin(tp(), base + i)).collect();
            // a pseudo-random finishing order drawn from `order`
            let mut finished = vec![false; count];
            let mut last = None;
            while !tickets.is_empty() {
                let pick = order[tickets.len() % order.len()] as usize % tickets.len();
                let ticket = tickets.swap_remove(pick);
                finished[(ticket.offset - base) as usize] = true;
                prop_assert!(t.finish(&ticket));
                for (_, pos) in t.take_advanced() {
                    for (i, done) in finished.iter().enumerate() {
                        if (base + i as i64) < pos {
                            prop_assert!(*done, "position {} passes unfinished {}", pos, base + i as i64);
                        }
                    }
                    prop_assert!(last.is_none_or(|l| l < pos));
                    last = Some(pos);
                }
            }
            prop_assert_eq!(last, Some(base + count as i64));
        }

        /// Interleaved rebalances: a record finished under an older epoch never moves the
        /// position of the current one.
        #[test]
        fn revoked_work_never_commits(
            ops in proptest::collection::vec((0u8..4, 0i64..20), 1..80),
        ) {
            let mut t = OffsetTracker::new();
            t.assign([tp()]);
            let mut live: Vec<Ticket> = Vec::new();
            let mut stale: Vec<Ticket> = Vec::new();
            let mut next = 0i64;
            for (op, n) in ops {
                match op {
                    0 => { live.push(t.begin(tp(), next)); next += 1; }
                    1 if !live.is_empty() => { let k = n as usize % live.len(); let tk = live.swap_remove(k); prop_assert!(t.finish(&tk)); }
                    2 if !stale.is_empty() => {
                        let before = t.position(&tp());
                        let k = n as usize % stale.len();
                        prop_assert!(!t.finish(&stale[k]));
                        prop_assert_eq!(t.position(&tp()), before);
                    }
                    3 => {
                        // revoke and reassign: the new owner starts from the committed position
                        stale.append(&mut live);
                        t.revoke([&tp()]);
                        t.assign([tp()]);
                        next = n.min(next);
                    }
                    _ => {}
                }
                if let Some(low) = live.iter().map(|tk| tk.offset).min() {
                    prop_assert!(t.position(&tp()).is_some_and(|p| p <= low));
                }
            }
        }
    }
}
