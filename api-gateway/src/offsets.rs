//! Which offsets are safe to commit when records finish out of order.
//!
//! Per partition we keep the offsets that started and have not finished. The committable
//! position (Kafka's "next offset to read") is the lowest unfinished offset, or one past the
//! highest offset seen when nothing is unfinished. So a commit never passes a record whose
//! result or dead letter is not yet acknowledged: after a crash it is read again, never lost.
//!
//! Every assignment of a partition starts a new epoch. Work started under an older epoch
//! (before a revoke) cannot move the position of the current one.

use std::collections::{BTreeSet, HashMap};

/// A Kafka partition: topic and partition number.
pub type TopicPartition = (String, i32);

/// Proof that a record was started; hand it back to [`OffsetTracker::finish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    pub partition: TopicPartition,
    pub offset: i64,
    epoch: u64,
}

#[derive(Debug, Default)]
struct PartitionState {
    epoch: u64,
    unfinished: BTreeSet<i64>,
    /// One past the highest offset started in this epoch.
    next: Option<i64>,
    /// The last position returned to the caller, to report only advances.
    reported: Option<i64>,
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
        Ticket { partition, offset, epoch: state.epoch }
    }

    /// Records that the ticket's record is finished (its output acknowledged). Returns the new
    /// committable position when it advanced, `None` otherwise (also for a stale ticket).
    pub fn finish(&mut self, ticket: &Ticket) -> Option<i64> {
        let state = self.partitions.get_mut(&ticket.partition)?;
        if state.epoch != ticket.epoch || !state.unfinished.remove(&ticket.offset) {
            return None;
        }
        let position = state.position()?;
        if state.reported.is_some_and(|r| r >= position) {
            return None;
        }
        state.reported = Some(position);
        Some(position)
    }

    /// Total records in flight.
    pub fn in_flight(&self) -> usize {
        self.partitions.values().map(|s| s.unfinished.len()).sum()
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
        assert_eq!(t.finish(&tickets[1]), Some(10));
        assert_eq!(t.finish(&tickets[2]), None);
        assert_eq!(t.finish(&tickets[4]), None);
        // finish 10: everything up to 13 (exclusive) is done
        assert_eq!(t.finish(&tickets[0]), Some(13));
        assert_eq!(t.finish(&tickets[3]), Some(15));
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn stale_tickets_from_a_revoked_assignment_are_ignored() {
        let mut t = OffsetTracker::new();
        let old = t.begin(tp(), 5);
        t.revoke([&tp()]);
        assert_eq!(t.finish(&old), None);
        t.assign([tp()]);
        let new = t.begin(tp(), 5);
        assert_eq!(t.finish(&old), None, "old epoch must not finish the new record");
        assert_eq!(t.finish(&new), Some(6));
    }

    #[test]
    fn finishing_twice_is_harmless() {
        let mut t = OffsetTracker::new();
        let a = t.begin(tp(), 0);
        assert_eq!(t.finish(&a), Some(1));
        assert_eq!(t.finish(&a), None);
    }

    proptest! {
        /// Whatever order records finish in, a reported position never passes an unfinished
        /// record, positions only grow, and once all are finished the position is one past
        /// the highest offset.
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
                if let Some(pos) = t.finish(&ticket) {
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
    }
}
