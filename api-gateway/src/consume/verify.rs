//! Exactly-once outputs read back after their commit (`kafka.verify_outputs`, on by default).
//!
//! librdkafka reporting a transaction committed is not the same as a `read_committed` reader
//! seeing its outputs. Twice in CI a broker restart left outputs of transactions reported
//! committed invisible to such readers while a `read_uncommitted` one saw them all
//! (`docs/status.md`); Kafka's first transaction protocol, the only one librdkafka 2.12 speaks,
//! has known ways to get there (KAFKA-17754: a late produce landing outside its transaction),
//! and an operator's `kafka-transactions.sh abort` does it on purpose. So every committed
//! output stays in the [`Ledger`], with its bytes still charged to `max_held_bytes`, keyed by
//! the partition and offset the broker acknowledged, until a reader of its own ([`run`], with
//! `isolation.level = read_committed`) has read past it:
//!
//! - it waits for the partition's last stable offset (a `read_committed` watermark query) to
//!   pass the outputs, then reads the partition from the oldest one up to that offset;
//! - an output it read is verified and let go;
//! - one it read past without seeing was aborted (librdkafka drops aborted records for such a
//!   reader) and goes back to the transactional producer, which writes it again in its next
//!   transaction ([`Ledger::take_aborted`]): the record is still known, so nothing is lost, and
//!   the aborted copy is invisible, so nothing is doubled;
//! - a partition whose last stable offset stays behind outputs for longer than the
//!   transaction timeout and [`HANGING_MARGIN`] is held by a hanging transaction (one the
//!   broker keeps open with no coordinator to end it, KIP-664): the `hanging_transactions`
//!   gauge counts it and a log line names the partition and the offset to give
//!   `kafka-transactions.sh abort` (`docs/operations.md`). Its outputs wait, still charged to
//!   `max_held_bytes`; once it is aborted they are read back, and any it took down is redone.
//!
//! The read back is whole, not sampled: the markers that commit or abort are per partition and
//! transaction, but a late produce (the case above) can split one transaction's outputs, so
//! only reading every offset tells. Its cost, measured by `scripts/bench delivery`, is in
//! `docs/performance.md`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use vramgate_shared::telemetry::LogLimit;

use super::lock;
use super::offsets::TopicPartition;
use crate::metrics::Metrics;
use crate::produce::Written;

/// Past the transaction timeout, how long a partition's last stable offset may stay behind
/// committed outputs before it counts as hanging. The broker looks for timed-out transactions
/// every 10 s (`transaction.abort.timed.out.transaction.cleanup.interval.ms`).
pub const HANGING_MARGIN: Duration = Duration::from_secs(10);
/// How often the reader looks at the partitions with outputs to read back: each look is a
/// watermark query per partition and one read per topic, so not more often than this.
const TICK: Duration = Duration::from_millis(100);
/// After a failed read back the next waits twice as long as the last, up to this: a broker
/// that is restarting or fenced is not asked ten times a second.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How long one watermark query or one topic's read back may take before it is tried again at
/// the next tick.
const QUERY_TIMEOUT: Duration = Duration::from_secs(5);
const READ_TIMEOUT: Duration = Duration::from_secs(10);

static VERIFY_LOG: LogLimit = LogLimit::new(5);

/// What the ledger keeps of a committed output: enough to write it again
/// ([`super::transaction::Pending`]).
pub trait Output: Send {
    /// The topic it was written to.
    fn topic(&self) -> &str;
    /// Marked as written again after its first copy was found aborted.
    fn redone(self) -> Self;
}

struct Kept<T> {
    pending: T,
    since: Instant,
}

struct Inner<T> {
    /// Committed outputs not yet read back, by the partition and offset they were written at.
    unverified: HashMap<TopicPartition, BTreeMap<i64, Kept<T>>>,
    /// Found aborted, for the next transaction to write again.
    aborted: Vec<T>,
    /// Partitions counted as hanging, with the offset they hang at.
    hanging: HashMap<TopicPartition, i64>,
}

impl<T> Default for Inner<T> {
    fn default() -> Self {
        Inner { unverified: HashMap::new(), aborted: Vec::new(), hanging: HashMap::new() }
    }
}

/// Committed outputs until a `read_committed` reader has seen them.
pub struct Ledger<T> {
    inner: Mutex<Inner<T>>,
    metrics: Arc<Metrics>,
    /// Past this, a partition's last stable offset behind outputs is a hanging transaction.
    hanging_after: Duration,
}

/// A partition with outputs to read back: the oldest and newest offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Due {
    pub partition: TopicPartition,
    pub first: i64,
    pub last: i64,
}

impl<T: Output> Ledger<T> {
    /// `transaction_timeout`: the gateway's own (`kafka.transaction_timeout_ms`).
    pub fn new(metrics: Arc<Metrics>, transaction_timeout: Duration) -> Self {
        Ledger { inner: Mutex::default(), metrics, hanging_after: transaction_timeout + HANGING_MARGIN }
    }

    /// Keeps the outputs of a transaction that committed, each where the broker wrote it.
    pub fn keep(&self, outputs: impl IntoIterator<Item = (T, Written)>) {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        for (pending, written) in outputs {
            let tp = (pending.topic().to_string(), written.partition);
            inner.unverified.entry(tp).or_default().insert(written.offset, Kept { pending, since: now });
        }
        self.publish(&inner);
    }

    /// The outputs found aborted since the last call, for the next transaction.
    pub fn take_aborted(&self) -> Vec<T> {
        std::mem::take(&mut lock(&self.inner).aborted)
    }

    /// A transaction that was to write these again did not commit: the next one does.
    pub fn put_aborted(&self, outputs: Vec<T>) {
        lock(&self.inner).aborted.extend(outputs);
    }

    /// Outputs waiting to be written again.
    pub fn aborted(&self) -> usize {
        lock(&self.inner).aborted.len()
    }

    /// Outputs not yet read back.
    pub fn unverified(&self) -> usize {
        lock(&self.inner).unverified.values().map(BTreeMap::len).sum()
    }

    /// Partitions with outputs to read back.
    pub fn due(&self) -> Vec<Due> {
        let inner = lock(&self.inner);
        inner
            .unverified
            .iter()
            .filter_map(|(tp, kept)| {
                Some(Due { partition: tp.clone(), first: *kept.keys().next()?, last: *kept.keys().next_back()? })
            })
            .collect()
    }

    /// A read of `tp` from `from` up to `reached` (exclusive) saw the offsets in `seen`: those
    /// outputs are verified, the others in the range were aborted. Returns (verified, aborted).
    pub fn settle(&self, tp: &TopicPartition, from: i64, reached: i64, seen: &HashSet<i64>) -> (usize, usize) {
        let mut inner = lock(&self.inner);
        let Some(kept) = inner.unverified.get_mut(tp) else { return (0, 0) };
        let mut above = kept.split_off(&reached);
        let read = std::mem::take(kept);
        let mut aborted = Vec::new();
        let mut verified = 0;
        for (offset, k) in read {
            if offset < from {
                above.insert(offset, k);
            } else if seen.contains(&offset) {
                verified += 1;
            } else {
                aborted.push((offset, k.pending));
            }
        }
        *kept = above;
        if kept.is_empty() {
            inner.unverified.remove(tp);
        }
        let found = aborted.len();
        if found > 0 {
            tracing::error!(
                topic = %tp.0,
                partition = tp.1,
                outputs = found,
                first_offset = aborted[0].0,
                "committed outputs are not visible to read_committed readers (aborted after the commit was reported); \
                 writing them again in a new transaction"
            );
        }
        inner.aborted.extend(aborted.into_iter().map(|(_, p)| p.redone()));
        self.metrics.outputs_verified.inc_by(verified as u64);
        self.publish(&inner);
        (verified, found)
    }

    /// The partition's last stable offset is `stable`: it hangs when outputs at or past it have
    /// waited longer than the transaction timeout and the margin. Logs when that changes.
    pub fn check_hanging(&self, tp: &TopicPartition, stable: i64) -> bool {
        let mut inner = lock(&self.inner);
        let oldest_behind = inner
            .unverified
            .get(tp)
            .and_then(|kept| kept.range(stable..).map(|(_, k)| k.since).min());
        let hanging = oldest_behind.is_some_and(|since| since.elapsed() > self.hanging_after);
        let was = inner.hanging.get(tp).copied();
        match (was, hanging) {
            (None, true) => {
                inner.hanging.insert(tp.clone(), stable);
                tracing::error!(
                    topic = %tp.0,
                    partition = tp.1,
                    last_stable_offset = stable,
                    waited_s = self.hanging_after.as_secs(),
                    "a hanging transaction holds this partition's committed outputs from read_committed readers: its \
                     last stable offset has not passed them for longer than the transaction timeout. Find its \
                     producer with `kafka-transactions.sh describe-producers` and end it with \
                     `kafka-transactions.sh abort --topic <topic> --partition <partition> --start-offset \
                     <last_stable_offset>` (docs/operations.md); outputs of this gateway it takes down are written again"
                );
            }
            (Some(_), false) => {
                inner.hanging.remove(tp);
                tracing::info!(topic = %tp.0, partition = tp.1, last_stable_offset = stable, "the hanging transaction is over");
            }
            _ => {}
        }
        self.publish(&inner);
        hanging
    }

    fn publish(&self, inner: &Inner<T>) {
        self.metrics.outputs_unverified.set(inner.unverified.values().map(BTreeMap::len).sum::<usize>() as i64);
        self.metrics.hanging_transactions.set(inner.hanging.len() as i64);
    }
}

/// Reads back what the ledger holds until `stop` is set. The fetch thread has by then waited
/// for the last transactions to be read back, and logged what was not. `consumer`:
/// `isolation.level = read_committed`, no group joined.
pub fn run<C: ConsumerContext, T: Output>(ledger: Arc<Ledger<T>>, consumer: BaseConsumer<C>, stop: Arc<AtomicBool>) {
    let mut wait = TICK;
    while !stop.load(Ordering::SeqCst) {
        let mut by_topic: BTreeMap<String, Vec<Due>> = BTreeMap::new();
        for due in ledger.due() {
            by_topic.entry(due.partition.0.clone()).or_default().push(due);
        }
        let mut failed = false;
        for (topic, dues) in by_topic {
            if let Err(e) = verify(&ledger, &consumer, &topic, &dues) {
                failed = true;
                if VERIFY_LOG.allow() {
                    tracing::warn!(error = %e, topic = %topic, retry_in_ms = (wait * 2).min(BACKOFF_MAX).as_millis() as u64, "reading back committed outputs failed; trying again");
                }
            }
        }
        wait = next_wait(wait, failed);
        sleep_unless_stopped(wait, &stop);
    }
}

/// The pause before the next look: [`TICK`] after a clean one, doubling up to [`BACKOFF_MAX`]
/// while looks fail.
fn next_wait(last: Duration, failed: bool) -> Duration {
    if failed {
        (last * 2).min(BACKOFF_MAX)
    } else {
        TICK
    }
}

/// Sleeps `wait` in [`TICK`] steps, returning early once `stop` is set.
fn sleep_unless_stopped(wait: Duration, stop: &AtomicBool) {
    let until = std::time::Instant::now() + wait;
    while !stop.load(Ordering::SeqCst) {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            break;
        }
        std::thread::sleep(left.min(TICK));
    }
}

/// One topic's partitions with outputs to read back: each one's last stable offset, then one
/// read of all of them from their oldest output up to it, then whether any hangs.
fn verify<C: ConsumerContext, T: Output>(ledger: &Ledger<T>, consumer: &BaseConsumer<C>, topic: &str, dues: &[Due]) -> Result<(), KafkaError> {
    // (partition, from, up to): for a read_committed client the high watermark is the last
    // stable offset; what is below it is committed or aborted for good.
    let mut reads = Vec::with_capacity(dues.len());
    for due in dues {
        let (_, stable) = consumer.fetch_watermarks(topic, due.partition.1, QUERY_TIMEOUT)?;
        if stable > due.first {
            reads.push((due.partition.1, due.first, stable.min(due.last + 1)));
        }
        ledger.check_hanging(&due.partition, stable);
    }
    if reads.is_empty() {
        return Ok(());
    }
    for (partition, (from, reached, seen)) in read_back(consumer, topic, &reads)? {
        ledger.settle(&(topic.to_string(), partition), from, reached, &seen);
    }
    Ok(())
}

/// One partition's read back: where it started, how far it got, the offsets it was handed.
type Progress = (i64, i64, HashSet<i64>);

/// Reads each (partition, from, upper) of `topic` at once as a `read_committed` reader, from
/// `from` towards `upper` (at most the partition's last stable offset): per partition, where
/// it started, how far it got and the offsets it was handed. Every offset below how far it got
/// and not handed was aborted (or is a control record).
fn read_back<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    reads: &[(i32, i64, i64)],
) -> Result<HashMap<i32, Progress>, KafkaError> {
    let mut assignment = TopicPartitionList::with_capacity(reads.len());
    let mut progress: HashMap<i32, Progress> = HashMap::with_capacity(reads.len());
    let mut upper: HashMap<i32, i64> = HashMap::with_capacity(reads.len());
    for &(partition, from, up_to) in reads {
        assignment.add_partition_offset(topic, partition, Offset::Offset(from))?;
        progress.insert(partition, (from, from, HashSet::new()));
        upper.insert(partition, up_to);
    }
    consumer.assign(&assignment)?;
    let deadline = Instant::now() + READ_TIMEOUT;
    let mut open = reads.len();
    // How far the reader got in one partition, by a message handed over or by its position.
    let advance = |progress: &mut HashMap<i32, Progress>, partition: i32, to: i64| -> bool {
        let (Some((_, reached, _)), Some(&up_to)) = (progress.get_mut(&partition), upper.get(&partition)) else { return false };
        let was_open = *reached < up_to;
        *reached = (*reached).max(to.min(up_to));
        was_open && *reached >= up_to
    };
    while open > 0 && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(50)) {
            Some(Ok(m)) if m.topic() == topic => {
                let (partition, offset) = (m.partition(), m.offset());
                if let Some((from, _, seen)) = progress.get_mut(&partition) {
                    if offset >= *from {
                        seen.insert(offset);
                    }
                }
                open -= usize::from(advance(&mut progress, partition, offset + 1));
            }
            Some(Ok(_)) => {}
            // The end for a read_committed reader is the last stable offset, which no upper
            // bound is past: everything below it was handed over or skipped.
            Some(Err(KafkaError::PartitionEOF(p))) => open -= usize::from(advance(&mut progress, p, i64::MAX)),
            // The state of a connection, queued when it changed: librdkafka reconnects by
            // itself, and a broker's outage leaves dozens of these in the queue. Ending the read
            // on each (and backing off) took one from the queue every 5 s, so the read back
            // lagged for minutes after the broker was back, and the outputs it holds filled
            // `max_held_bytes` and paused fetching (a chaos soak, 2026-11-29).
            Some(Err(e)) if connection_event(&e) => {
                if VERIFY_LOG.allow() {
                    tracing::debug!(error = %e, topic = %topic, "read back: a connection event; reading on");
                }
            }
            Some(Err(e)) => {
                let _ = consumer.unassign();
                return Err(e);
            }
            // Nothing more handed over for now: the reader's position also moves past what it
            // skips (aborted records and the markers that end transactions), so a tail of
            // aborted outputs is read past too.
            None => {
                for e in consumer.position()?.elements_for_topic(topic) {
                    if let Offset::Offset(position) = e.offset() {
                        open -= usize::from(advance(&mut progress, e.partition(), position));
                    }
                }
            }
        }
    }
    let _ = consumer.unassign();
    Ok(progress)
}

/// Whether `error` is a connection's state reported through the consumer's queue rather than
/// a failure of this read: the client recovers from it by itself.
fn connection_event(error: &KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    matches!(error, KafkaError::MessageConsumption(_) | KafkaError::Global(_))
        && matches!(
            error.rdkafka_error_code(),
            Some(Code::AllBrokersDown | Code::BrokerTransportFailure | Code::Resolve | Code::BrokerNotAvailable)
        )
}

#[cfg(test)]#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_event_does_not_end_a_read_and_a_partition_error_does() {
        use rdkafka::types::RDKafkaErrorCode as Code;
        assert!(connection_event(&KafkaError::MessageConsumption(Code::AllBrokersDown)));
        assert!(connection_event(&KafkaError::MessageConsumption(Code::BrokerTransportFailure)));
        assert!(connection_event(&KafkaError::Global(Code::AllBrokersDown)));
        assert!(!connection_event(&KafkaError::MessageConsumption(Code::UnknownTopicOrPartition)));
        assert!(!connection_event(&KafkaError::MessageConsumption(Code::TopicAuthorizationFailed)));
        assert!(!connection_event(&KafkaError::PartitionEOF(0)));
    }

    #[test]
    fn failed_looks_back_off_to_the_bound_and_a_clean_one_resets() {
        let mut wait = TICK;
        let mut seen = Vec::new();
        for _ in 0..8 {
            wait = next_wait(wait, true);
            seen.push(wait.as_millis());
        }
        assert_eq!(seen, [200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        assert_eq!(next_wait(wait, false), TICK);
    }

    /// A stand-in for a committed output: its topic and whether it was redone.
    struct Out(bool);

    impl Output for Out {
        fn topic(&self) -> &str {
            "t.results"
        }

        fn redone(self) -> Self {
            Out(true)
        }
    }

    fn outputs(n: usize) -> Vec<Out> {
        (0..n).map(|_| Out(false)).collect()
    }

    // The ledger's bookkeeping alone; the read back against a broker is
    // tests/tests/gateway_verified_outputs.rs.
    #[test]
    fn outputs_read_are_verified_those_read_past_are_aborted_and_the_rest_wait() {
        let metrics = Metrics::new();
        let ledger = Ledger::new(metrics.clone(), Duration::from_secs(10));
        let outputs = outputs(5);
        let topic = outputs[0].topic().to_string();
        ledger.keep(outputs.into_iter().zip([10, 11, 12, 13, 14]).map(|(p, o)| (p, Written { partition: 2, offset: o })));
        let tp = (topic, 2);
        assert_eq!(ledger.due(), vec![Due { partition: tp.clone(), first: 10, last: 14 }]);
        // Read from 10 up to 13: 10 and 12 seen, 11 skipped (aborted); 13 and 14 not reached.
        let (verified, aborted) = ledger.settle(&tp, 10, 13, &HashSet::from([10, 12]));
        assert_eq!((verified, aborted), (2, 1));
        assert_eq!(ledger.unverified(), 2);
        assert_eq!(metrics.outputs_verified.get(), 2);
        assert_eq!(metrics.outputs_unverified.get(), 2);
        let redo = ledger.take_aborted();
        assert_eq!(redo.len(), 1);
        assert!(redo[0].0, "marked as redone");
        assert_eq!(ledger.aborted(), 0);
        // The rest read: the partition leaves the ledger.
        assert_eq!(ledger.settle(&tp, 13, 15, &HashSet::from([13, 14])), (2, 0));
        assert!(ledger.due().is_empty());
        assert_eq!(metrics.outputs_unverified.get(), 0);
    }

    #[test]
    fn a_read_that_started_past_an_output_does_not_call_it_aborted() {
        let ledger = Ledger::new(Metrics::new(), Duration::from_secs(10));
        let outputs = outputs(2);
        let topic = outputs[0].topic().to_string();
        ledger.keep(outputs.into_iter().zip([5, 9]).map(|(p, o)| (p, Written { partition: 0, offset: o })));
        let tp = (topic, 0);
        // A read from 8 to 10 saw 9: 5 was never read, so it is neither verified nor aborted.
        assert_eq!(ledger.settle(&tp, 8, 10, &HashSet::from([9])), (1, 0));
        assert_eq!(ledger.unverified(), 1);
    }

    #[test]
    fn a_partition_hangs_only_after_the_timeout_and_margin_and_recovers() {
        let metrics = Metrics::new();
        let mut ledger = Ledger::new(metrics.clone(), Duration::from_secs(10));
        ledger.hanging_after = Duration::from_millis(50);
        let outputs = outputs(2);
        let topic = outputs[0].topic().to_string();
        ledger.keep(outputs.into_iter().zip([3, 4]).map(|(p, o)| (p, Written { partition: 1, offset: o })));
        let tp = (topic, 1);
        // Last stable offset 3: both outputs behind it, but not for long yet.
        assert!(!ledger.check_hanging(&tp, 3));
        std::thread::sleep(Duration::from_millis(80));
        assert!(ledger.check_hanging(&tp, 3));
        assert_eq!(metrics.hanging_transactions.get(), 1);
        // The transaction ended: the offset passed them.
        assert!(!ledger.check_hanging(&tp, 5));
        assert_eq!(metrics.hanging_transactions.get(), 0);
    }
}
