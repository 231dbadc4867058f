//! Exactly-once delivery (`delivery = "exactly-once"`): a record's output and its offset reach
//! Kafka in the same transaction, so a `read_committed` consumer of the output topics sees one
//! output per request whatever is killed when.
//!
//! Records still finish out of order. A finished record's output is not produced at once: it
//! waits in the [`Outbox`], keyed by its partition, offset and assignment (epoch), and its
//! ticket is finished only once it is there. Each commit ([`Transactional::commit`]) takes the
//! watermarks that advanced, takes from the outbox exactly the outputs *below* them, and
//! writes those outputs and those positions in one transaction. So a transaction never holds
//! an output of a record past the offsets it commits: were it to, a crash after it would make
//! the group read that record again and write its output a second time. Outputs of records
//! that finished past their partition's watermark wait for the watermark to pass them; they
//! are bounded like every record past the last commit (`max_in_flight`), and their bytes are
//! charged to `max_held_bytes` while they wait.
//!
//! Fencing: the transaction's offsets are sent with the consumer's group metadata (KIP-447),
//! so a gateway that lost its partitions (paused past its session, cut off by a network split)
//! cannot commit for them: the broker refuses the offsets, the transaction aborts, and its
//! outputs stay invisible to `read_committed` readers. The transactional id is one per
//! gateway instance (`kafka.transactional_id`); a restarted instance aborts what its
//! predecessor left open when it starts. A producer fenced or failed for good is replaced by a
//! new one under the same id, and the outputs it had not committed are offered again.
//!
//! A transaction that fails aborts, and everything it took goes back to the outbox and the
//! watermarks back to the tracker: the next commit redoes it. An output the broker refuses for
//! good (too large, topic missing or forbidden) is replaced by its trimmed dead letter
//! ([`crate::produce::trimmed_dead_letter`]), as in at-least-once delivery; if that is refused
//! too, the record is committed past with no output, counted and logged.
//!
//! librdkafka's transactional calls take a timeout but do not always keep it: with the group
//! coordinator gone and back (a broker restart), `send_offsets_to_transaction` can wait for a
//! coordinator request that is never sent again (librdkafka issues 5456 and 5511), and the
//! whole gateway's commits with it. Each call that cannot commit a transaction
//! (`init_transactions`, `send_offsets_to_transaction`, `abort_transaction`) runs on a thread
//! of its own ([`bounded`]); one that has not returned [`STUCK_GRACE`] past its timeout is
//! abandoned with its producer, which is treated as failed for good: a new producer under the
//! same id fences it, and the transaction is redone. The abandoned producer can commit nothing
//! (only `commit_transaction` commits, and it is never called on it again); its thread keeps
//! it until librdkafka returns. `commit_transaction` itself is never abandoned: left running,
//! it could still commit after the redone transaction, and write its outputs twice.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, ConsumerGroupMetadata};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{BaseRecord, Producer as _};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::oneshot;
use vramgate_shared::telemetry::LogLimit;

use super::lock;
use super::offsets::{SharedOffsets, Ticket, TopicPartition};
use crate::budget::Held;
use crate::metrics::Metrics;
use super::verify::{self, Ledger};
use crate::produce::{self, Acked, Delivery, Producer, Standin, Written};
use crate::task::Task;

/// How long an output waits for room in librdkafka's queue before the transaction gives up
/// (and is redone).
const QUEUE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an aborted transaction's outputs may take to report back (librdkafka purges them).
const PURGE_WAIT: Duration = Duration::from_secs(2);
/// `commit_transaction` attempts when the broker answers with a retriable error.
const COMMIT_ATTEMPTS: u32 = 3;
/// How long past its own timeout a transactional call of librdkafka may run before it is
/// abandoned with its producer ([`bounded`]).
const STUCK_GRACE: Duration = if cfg!(test) { Duration::from_millis(100) } else { Duration::from_secs(5) };
/// Abandoned calls still running (each holds its producer): past this, the next one is waited
/// for instead, so stuck producers never pile up.
const MAX_ABANDONED: usize = 4;
static ABANDONED: AtomicUsize = AtomicUsize::new(0);
/// At start-up, how long the gateway keeps trying to initialise its transactions while the
/// broker cannot yet (restarting, or its transaction coordinator still loading: `Not
/// coordinator`), before it gives up and exits. A gateway restarted beside a restarting broker
/// waits for it instead of exiting (found by the chaos soak under load).
pub const START_DEADLINE: Duration = Duration::from_secs(300);
/// The first pause between start-up attempts; it doubles up to [`START_PAUSE_MAX`].
const START_PAUSE: Duration = Duration::from_millis(500);
const START_PAUSE_MAX: Duration = Duration::from_secs(5);

static TRANSACTION_LOG: LogLimit = LogLimit::new(5);

/// Which output an entry now carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// The record's result or dead letter.
    Original,
    /// The broker refused the original for good: its trimmed dead letter stands in.
    Trimmed,
    /// The trimmed dead letter was refused too: the record is committed past with no output.
    Dropped,
}

/// A finished record's output, waiting for the transaction that commits its offset.
pub struct Pending {
    ticket: Ticket,
    task: Arc<Task>,
    /// A result (else a dead letter): its topic, and which counter its commit moves.
    result: bool,
    form: Form,
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    headers: OwnedHeaders,
    standin: Standin,
    /// Written again after a `read_committed` reader found it aborted ([`super::verify`]).
    redone: bool,
    /// Its bytes, charged to `max_held_bytes` while it waits, and until it is read back.
    _held: Held,
}

impl Pending {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ticket: Ticket,
        task: Arc<Task>,
        result: bool,
        key: Option<Vec<u8>>,
        payload: Vec<u8>,
        headers: OwnedHeaders,
        standin: Standin,
        held: Held,
    ) -> Self {
        Pending { ticket, task, result, form: Form::Original, key, payload, headers, standin, redone: false, _held: held }
    }

    fn topic(&self) -> &str {
        match self.form {
            Form::Original if self.result => &self.task.results_topic,
            _ => &self.task.dlq_topic,
        }
    }

    /// The broker refused this output for good: the trimmed dead letter stands in for it, or,
    /// if that was what it refused, nothing does.
    fn refused(&mut self, error: &KafkaError, metrics: &Metrics) {
        match self.form {
            Form::Original => {
                let out = produce::trimmed_dead_letter(
                    &self.task.dlq_topic,
                    &self.task.hot.send_dead_letter_span,
                    &self.standin,
                    self.topic(),
                    self.payload.len(),
                    error,
                );
                tracing::error!(
                    error = %error,
                    topic = self.topic(),
                    bytes = self.payload.len(),
                    "output refused by the broker; its transaction aborts and a trimmed dead letter takes its place"
                );
                self.payload = out.payload;
                self.headers = out.headers;
                self.form = Form::Trimmed;
            }
            Form::Trimmed => {
                metrics.outputs_rejected.with_label_values(&[&self.task.name, "lost"]).inc();
                tracing::error!(
                    error = %error,
                    topic = self.topic(),
                    partition = self.ticket.partition.1,
                    offset = self.ticket.offset,
                    "the trimmed dead letter was refused too; committing past this record"
                );
                self.form = Form::Dropped;
            }
            Form::Dropped => {}
        }
    }

    /// Its transaction committed.
    fn committed(&self, metrics: &Metrics) {
        if self.redone {
            // Counted as produced when its first copy committed.
            metrics.outputs_redone.inc();
            return;
        }
        let hot = &self.task.hot;
        match self.form {
            Form::Original if self.result => hot.produced_result.inc(),
            Form::Original => hot.produced_dead_letter.inc(),
            Form::Trimmed => {
                metrics.outputs_rejected.with_label_values(&[&self.task.name, "trimmed"]).inc();
                if self.result {
                    metrics.dead_letters.with_label_values(&[&self.task.name, "output_rejected"]).inc();
                }
                hot.produced_dead_letter.inc();
            }
            Form::Dropped => {}
        }
    }
}

impl verify::Output for Pending {
    fn topic(&self) -> &str {
        Pending::topic(self)
    }

    /// To be written again: its first copy was found aborted.
    fn redone(mut self) -> Self {
        self.redone = true;
        self
    }
}

/// Finished records' outputs by partition and offset, waiting for their transaction.
#[derive(Default)]
pub struct Outbox {
    waiting: Mutex<HashMap<TopicPartition, BTreeMap<i64, Pending>>>,
}

impl Outbox {
    /// Puts a finished record's output in, unless its partition was revoked since it was
    /// fetched (its new owner redoes it), and only then finishes its ticket: a watermark can
    /// pass a record only once its output is here. Returns whether it was put in.
    ///
    /// Lock order: the outbox, then the offsets (a revoke revokes the offsets first and
    /// forgets here after, so an output put in before the revoke is forgotten by it).
    pub fn put(&self, offsets: &SharedOffsets, pending: Pending, trace: Option<opentelemetry::Context>) -> bool {
        let mut waiting = lock(&self.waiting);
        if !offsets.is_current(&pending.ticket) {
            return false;
        }
        let ticket = pending.ticket.clone();
        waiting.entry(ticket.partition.clone()).or_default().insert(ticket.offset, pending);
        drop(waiting);
        offsets.finish_traced(&ticket, trace)
    }

    /// Takes the outputs below each position that belong to its partition's current
    /// assignment; outputs of an earlier one are dropped.
    fn take(&self, positions: &[(TopicPartition, i64, u64)]) -> Vec<Pending> {
        let mut waiting = lock(&self.waiting);
        let mut taken = Vec::new();
        for (tp, position, epoch) in positions {
            let Some(outputs) = waiting.get_mut(tp) else { continue };
            let above = outputs.split_off(position);
            let below = std::mem::replace(outputs, above);
            taken.extend(below.into_values().filter(|p| p.ticket.epoch() == *epoch));
        }
        taken
    }

    /// Puts back what an aborted transaction took.
    fn put_back(&self, pending: Vec<Pending>) {
        let mut waiting = lock(&self.waiting);
        for p in pending {
            waiting.entry(p.ticket.partition.clone()).or_default().insert(p.ticket.offset, p);
        }
    }

    /// Drops the outputs of revoked partitions: their records are read again by the new owner.
    pub fn forget(&self, partitions: &[TopicPartition]) {
        let mut waiting = lock(&self.waiting);
        for tp in partitions {
            waiting.remove(tp);
        }
    }

    /// Outputs waiting.
    pub fn waiting(&self) -> usize {
        lock(&self.waiting).values().map(BTreeMap::len).sum()
    }
}

/// Makes the transactional producer (and again after it failed for good).
pub type MakeProducer = Box<dyn Fn() -> Result<Producer, KafkaError> + Send>;

/// The transactional producer and the outbox it empties.
pub struct Transactional {
    /// None after a fatal error whose replacement failed: the next commit makes one.
    producer: Option<Arc<Producer>>,
    make: MakeProducer,
    pub outbox: Arc<Outbox>,
    metrics: Arc<Metrics>,
    /// For every transactional call: `kafka.transaction_timeout_ms`.
    timeout: Duration,
    /// Committed outputs until they are read back (`kafka.verify_outputs`).
    ledger: Option<Arc<Ledger<Pending>>>,
    /// The last position committed for each partition, with its assignment: a redone output's
    /// transaction commits it again, in case the transaction that was taken down carried it.
    sent: HashMap<TopicPartition, (i64, u64)>,
}

impl Transactional {
    /// Makes the producer and initialises its transactions, which fences any earlier producer
    /// under the same id and aborts what it left open.
    pub fn start(
        make: MakeProducer,
        outbox: Arc<Outbox>,
        metrics: Arc<Metrics>,
        timeout: Duration,
        ledger: Option<Arc<Ledger<Pending>>>,
    ) -> Result<Self, KafkaError> {
        let producer = Some(ready_at_start(&make, timeout, START_DEADLINE)?);
        Ok(Transactional { producer, make, outbox, metrics, timeout, ledger, sent: HashMap::new() })
    }

    /// Committed outputs not yet read back, and those waiting to be written again.
    pub fn unverified(&self) -> usize {
        self.ledger.as_ref().map_or(0, |l| l.unverified() + l.aborted())
    }

    /// Whether outputs found aborted wait to be written again: a commit is due even with no
    /// partition advanced.
    pub fn has_redo(&self) -> bool {
        self.ledger.as_ref().is_some_and(|l| l.aborted() > 0)
    }

    /// The outputs found aborted that this gateway may write again, and the positions their
    /// transaction commits with them. One whose record is still in the same assignment goes,
    /// with its partition's last committed position. One whose partition was revoked since goes
    /// only if the group's committed offset is past its record: else the partition's new
    /// owner reads that record again and writes its output itself.
    fn redo<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        epoch_of: &dyn Fn(&TopicPartition) -> Option<u64>,
        positions: &mut Vec<(TopicPartition, i64, u64)>,
    ) -> Vec<Pending> {
        let Some(ledger) = &self.ledger else { return Vec::new() };
        let aborted = ledger.take_aborted();
        let mut redo = Vec::with_capacity(aborted.len());
        let mut group_offsets: HashMap<TopicPartition, Option<i64>> = HashMap::new();
        for p in aborted {
            let tp = &p.ticket.partition;
            let epoch = p.ticket.epoch();
            if epoch_of(tp) == Some(epoch) {
                if !positions.iter().any(|(t, _, _)| t == tp) {
                    if let Some(&(position, e)) = self.sent.get(tp).filter(|(_, e)| *e == epoch) {
                        positions.push((tp.clone(), position, e));
                    }
                }
                redo.push(p);
                continue;
            }
            let committed = *group_offsets.entry(tp.clone()).or_insert_with(|| group_offset(consumer, tp, self.timeout));
            match committed {
                Some(offset) if offset > p.ticket.offset => redo.push(p),
                _ => tracing::warn!(
                    topic = %tp.0,
                    partition = tp.1,
                    offset = p.ticket.offset,
                    group_offset = committed,
                    "an aborted output's record is in a partition this gateway no longer owns, below the group's \
                     committed offset: its new owner reads it again and writes the output"
                ),
            }
        }
        redo
    }

    /// Writes the outputs below `positions` (partition, position, epoch) and commits the
    /// positions, in one transaction. On failure it is aborted and what it took is back in the
    /// outbox.
    /// `epoch_of`: a partition's current assignment, if it is assigned.
    pub fn commit<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
        positions: &[(TopicPartition, i64, u64)],
        epoch_of: &dyn Fn(&TopicPartition) -> Option<u64>,
    ) -> Result<(), KafkaError> {
        let producer = match self.producer.take() {
            Some(p) => p,
            None => ready(&self.make, self.timeout).inspect_err(|e| self.counted("failed", e))?,
        };
        let mut positions = positions.to_vec();
        let mut outputs = self.redo(consumer, epoch_of, &mut positions);
        let redone = outputs.len();
        outputs.extend(self.outbox.take(&positions));
        let started = Instant::now();
        let result = self.transaction(&producer, consumer, &positions, &mut outputs);
        self.metrics.transaction_seconds.observe(started.elapsed().as_secs_f64());
        match result {
            Ok(written) => {
                self.producer = Some(producer);
                self.metrics.transactions.with_label_values(&["committed"]).inc();
                self.metrics.transaction_outputs.inc_by(outputs.len() as u64);
                outputs.iter().for_each(|p| p.committed(&self.metrics));
                for (tp, position, epoch) in positions {
                    self.sent.insert(tp, (position, epoch));
                }
                if let Some(ledger) = &self.ledger {
                    let mut unplaced = 0;
                    ledger.keep(outputs.into_iter().zip(written).filter_map(|(p, w)| match w {
                        Some(w) => Some((p, w)),
                        None => {
                            unplaced += usize::from(p.form != Form::Dropped);
                            None
                        }
                    }));
                    if unplaced > 0 && TRANSACTION_LOG.allow() {
                        tracing::warn!(outputs = unplaced, "committed outputs whose acknowledgement never came back cannot be read back");
                    }
                }
                Ok(())
            }
            Err(error) => {
                // What was redone goes back to be redone again, the rest to the outbox.
                let mut outputs = outputs;
                let fresh = outputs.split_off(redone);
                if let Some(ledger) = &self.ledger {
                    ledger.put_aborted(outputs);
                }
                self.outbox.put_back(fresh);
                if is_fatal(&error) {
                    // Fenced (another producer took this id) or broken: a new producer under
                    // the same id fences whatever is left of this one. Made at the next commit.
                    self.counted("fenced", &error);
                } else {
                    self.counted("aborted", &error);
                    self.producer = Some(producer);
                }
                Err(error)
            }
        }
    }

    fn counted(&self, outcome: &str, error: &KafkaError) {
        self.metrics.transactions.with_label_values(&[outcome]).inc();
        if TRANSACTION_LOG.allow() {
            tracing::warn!(error = %error, outcome, "transaction not committed; its records are committed by the next one");
        }
    }

    /// Begins, produces, sends the offsets, commits; aborts on failure. Outputs the broker
    /// refused for good are marked for their stand-ins. Committed, it answers where each output
    /// was written (`None` for one with no output, or whose acknowledgement never came).
    fn transaction<C: ConsumerContext>(
        &self,
        producer: &Arc<Producer>,
        consumer: &BaseConsumer<C>,
        positions: &[(TopicPartition, i64, u64)],
        outputs: &mut [Pending],
    ) -> Result<Vec<Option<Written>>, KafkaError> {
        producer.begin_transaction()?;
        let mut acks: Vec<Option<oneshot::Receiver<Acked>>> = Vec::with_capacity(outputs.len());
        let mut acked: Vec<Option<Acked>> = Vec::with_capacity(outputs.len());
        let sent = (|| {
            for p in outputs.iter_mut() {
                acks.push(self.send(producer, p)?);
            }
            let mut offsets = TopicPartitionList::with_capacity(positions.len());
            for (tp, position, _) in positions {
                offsets.add_partition_offset(&tp.0, tp.1, Offset::Offset(*position))?;
            }
            let group = consumer
                .group_metadata()
                .ok_or(KafkaError::ConsumerCommit(RDKafkaErrorCode::UnknownMemberId))?;
            send_offsets(producer, offsets, group, self.timeout)?;
            // Every output acknowledged before the commit: rdkafka's `commit_transaction`
            // flushes first, and its flush, finding anything outstanding, waits on the event
            // queue for up to 100 ms, while the producer's own polling thread takes the events
            // it waits for. Left to it, every transaction took 100 ms more.
            let deadline = Instant::now() + self.timeout;
            settle(&mut acks, &mut acked, deadline);
            if let Some(Some(Err(refusal))) = acked.iter().find(|a| matches!(a, Some(Err(_)))) {
                return Err(refusal.error.clone());
            }
            while producer.in_flight_count() > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(200));
            }
            let mut attempt = 1;
            loop {
                // Never abandoned: a commit left running could still land after its
                // transaction was redone by the next producer, and write its outputs twice.
                match producer.commit_transaction(self.timeout) {
                    Err(KafkaError::Transaction(e)) if e.is_retriable() && attempt < COMMIT_ATTEMPTS => attempt += 1,
                    other => return other,
                }
            }
        })();
        let Err(error) = sent else {
            // Committed: the acknowledgements all came before the commit, or come now.
            settle(&mut acks, &mut acked, Instant::now() + PURGE_WAIT);
            return Ok(acked.into_iter().map(|a| a.and_then(Result::ok)).collect());
        };
        if !is_fatal(&error) {
            if let Err(abort) = bounded(producer, self.timeout, "abort_transaction", |p, t| p.abort_transaction(t)) {
                tracing::warn!(error = %abort, "aborting the transaction failed");
                // A producer that cannot abort cannot begin either: replaced.
                return Err(abort_as_fatal(abort));
            }
        }
        // Aborted (or fatal): every output reports back, purged or refused. Those refused for
        // good get their stand-ins before the transaction is redone.
        settle(&mut acks, &mut acked, Instant::now() + PURGE_WAIT);
        for (p, acked) in outputs.iter_mut().zip(acked) {
            if let Some(Err(refusal)) = acked {
                if produce::is_permanent(&refusal.error) {
                    p.refused(&refusal.error, &self.metrics);
                }
            }
        }
        Err(error)
    }

    /// Produces one output into the open transaction; `None` for a record that has none left.
    fn send(&self, producer: &Producer, p: &mut Pending) -> Result<Option<oneshot::Receiver<Acked>>, KafkaError> {
        let deadline = Instant::now() + QUEUE_TIMEOUT;
        loop {
            if p.form == Form::Dropped {
                return Ok(None);
            }
            let (tx, rx) = oneshot::channel();
            let mut record = BaseRecord::with_opaque_to(p.topic(), Box::new(Delivery::Wake(tx)))
                .payload(&p.payload)
                .headers(p.headers.clone());
            if let Some(key) = &p.key {
                record = record.key(key);
            }
            match producer.send(record) {
                Ok(()) => return Ok(Some(rx)),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                // Refused before it left (larger than the producer takes): the stand-in goes
                // in its place, in this same transaction.
                Err((error, _)) if produce::is_permanent(&error) => p.refused(&error, &self.metrics),
                Err((error, _)) => return Err(error),
            }
        }
    }
}

/// Waits until `deadline` for the acknowledgements in `acks` not yet in `acked` (which it
/// extends to the length of `acks`); one still missing then stays `None`. An output that had
/// no send (`None` in `acks`) has no acknowledgement.
fn settle(acks: &mut [Option<oneshot::Receiver<Acked>>], acked: &mut Vec<Option<Acked>>, deadline: Instant) {
    acked.resize_with(acks.len(), || None);
    for (ack, got) in acks.iter_mut().zip(acked.iter_mut()) {
        let Some(rx) = ack else { continue };
        if got.is_some() {
            continue;
        }
        *got = loop {
            match rx.try_recv() {
                Ok(a) => break Some(a),
                Err(oneshot::error::TryRecvError::Empty) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(200))
                }
                Err(_) => break None,
            }
        };
    }
}

/// A new transactional producer, its transactions initialised.
fn ready(make: &MakeProducer, timeout: Duration) -> Result<Arc<Producer>, KafkaError> {
    let producer = Arc::new(make()?);
    bounded(&producer, timeout, "init_transactions", |p, t| p.init_transactions(t))?;
    Ok(producer)
}

/// [`ready`], tried again while the broker cannot initialise transactions yet ([`passing`]),
/// until `deadline` from now; any other error at once.
fn ready_at_start(make: &MakeProducer, timeout: Duration, deadline: Duration) -> Result<Arc<Producer>, KafkaError> {
    let until = Instant::now() + deadline;
    let mut pause = START_PAUSE;
    loop {
        match ready(make, timeout) {
            Ok(producer) => return Ok(producer),
            Err(e) if passing(&e) && Instant::now() + pause < until => {
                tracing::warn!(
                    error = %e,
                    retry_in_ms = pause.as_millis() as u64,
                    "initialising transactions failed while the broker is not ready for them; trying again"
                );
                std::thread::sleep(pause);
                pause = (pause * 2).min(START_PAUSE_MAX);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Whether `init_transactions` failed for a broker that is not ready yet (away, restarting,
/// its coordinator moving or loading), as opposed to one that refuses (authorisation, a
/// misconfiguration), which no wait mends.
fn passing(error: &KafkaError) -> bool {
    let code = match error {
        KafkaError::Transaction(e) if e.is_retriable() => return true,
        KafkaError::Transaction(e) => e.code(),
        // A call abandoned past its timeout (bounded): a new producer is tried.
        KafkaError::MessageProduction(RDKafkaErrorCode::Fatal) => return true,
        other => match other.rdkafka_error_code() {
            Some(code) => code,
            None => return false,
        },
    };
    matches!(
        code,
        RDKafkaErrorCode::NotCoordinator
            | RDKafkaErrorCode::CoordinatorNotAvailable
            | RDKafkaErrorCode::CoordinatorLoadInProgress
            | RDKafkaErrorCode::OperationTimedOut
            | RDKafkaErrorCode::RequestTimedOut
            | RDKafkaErrorCode::AllBrokersDown
            | RDKafkaErrorCode::BrokerTransportFailure
            | RDKafkaErrorCode::BrokerNotAvailable
            | RDKafkaErrorCode::ConcurrentTransactions
    )
}

/// The group's committed offset of `tp` (what a new owner starts from), if it can be read.
fn group_offset<C: ConsumerContext>(consumer: &BaseConsumer<C>, tp: &TopicPartition, timeout: Duration) -> Option<i64> {
    let mut tpl = TopicPartitionList::with_capacity(1);
    tpl.add_partition(&tp.0, tp.1);
    let committed = consumer.committed_offsets(tpl, timeout).ok()?;
    match committed.find_partition(&tp.0, tp.1)?.offset() {
        Offset::Offset(o) => Some(o),
        _ => None,
    }
}

fn send_offsets(
    producer: &Arc<Producer>,
    offsets: TopicPartitionList,
    group: ConsumerGroupMetadata,
    timeout: Duration,
) -> Result<(), KafkaError> {
    bounded(producer, timeout, "send_offsets_to_transaction", move |p, t| p.send_offsets_to_transaction(&offsets, &group, t))
}

/// Runs `call(producer, timeout)`, a transactional call of librdkafka that cannot commit, on a
/// thread of its own
/// and waits for it up to `timeout` and [`STUCK_GRACE`]. One that has not returned by then is
/// abandoned (its thread keeps the producer until librdkafka returns) and answers a fatal
/// error, so the producer is replaced. With [`MAX_ABANDONED`] calls abandoned and still
/// running, it waits for this one however long it takes rather than leave another behind.
fn bounded<T: Send + 'static>(
    producer: &Arc<Producer>,
    timeout: Duration,
    name: &'static str,
    call: impl FnOnce(&Producer, Duration) -> Result<T, KafkaError> + Send + 'static,
) -> Result<T, KafkaError> {
    let (tx, rx) = mpsc::sync_channel(1);
    let own = Arc::clone(producer);
    let (abandoned_tx, abandoned_rx) = mpsc::sync_channel::<()>(1);
    let spawned = std::thread::Builder::new().name("kafka-txn".into()).spawn(move || {
        let _ = tx.send(call(&own, timeout));
        drop(own);
        // Told it was abandoned (the sender is dropped without a word otherwise): no longer.
        if abandoned_rx.recv().is_ok() {
            ABANDONED.fetch_sub(1, Ordering::SeqCst);
        }
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, call = name, "no thread for a transactional call");
        return Err(KafkaError::MessageProduction(RDKafkaErrorCode::Fatal));
    }
    match rx.recv_timeout(timeout + STUCK_GRACE) {
        Ok(result) => result,
        // The thread ended without an answer (a panic in librdkafka's binding): nothing runs.
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            tracing::error!(call = name, "a transactional call ended without an answer");
            Err(KafkaError::MessageProduction(RDKafkaErrorCode::Fatal))
        }
        Err(mpsc::RecvTimeoutError::Timeout) if ABANDONED.load(Ordering::SeqCst) >= MAX_ABANDONED => {
            tracing::error!(call = name, "a transactional call is past its timeout, and {MAX_ABANDONED} more are still running; waiting for this one");
            rx.recv().unwrap_or(Err(KafkaError::MessageProduction(RDKafkaErrorCode::Fatal)))
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            ABANDONED.fetch_add(1, Ordering::SeqCst);
            let _ = abandoned_tx.send(());
            tracing::error!(
                call = name,
                timeout_ms = timeout.as_millis() as u64,
                "a transactional call of librdkafka did not return within its timeout; its producer is abandoned and \
                 replaced under the same transactional id, and the transaction redone"
            );
            Err(KafkaError::MessageProduction(RDKafkaErrorCode::Fatal))
        }
    }
}

/// Whether the producer can go on after this error (else it is replaced).
fn is_fatal(error: &KafkaError) -> bool {
    match error {
        KafkaError::Transaction(e) => e.is_fatal(),
        KafkaError::MessageProduction(RDKafkaErrorCode::Fatal) => true,
        _ => false,
    }
}

fn abort_as_fatal(error: KafkaError) -> KafkaError {
    match error {
        KafkaError::Transaction(e) if e.is_fatal() => KafkaError::Transaction(e),
        _ => KafkaError::MessageProduction(RDKafkaErrorCode::Fatal),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::ByteBudget;
    use crate::produce::Refused;
    use rdkafka::message::OwnedMessage;

    fn task() -> Arc<Task> {
        let config = crate::config::GatewayConfig::default();
        let metrics = Metrics::new();
        Arc::new(Task::new("voice", &config.tasks["voice"], &config.worker, metrics).expect("task"))
    }

    fn pending(offsets: &SharedOffsets, task: &Arc<Task>, offset: i64) -> Pending {
        let ticket = offsets.lock().begin(("t".into(), 0), offset);
        let source = OwnedMessage::new(None, None, "t".into(), rdkafka::Timestamp::NotAvailable, 0, offset, None);
        let standin = Standin::new(&source, Some("id"), Some("voice"), Refused::Result);
        let held = ByteBudget::new(1 << 20).hold(3);
        Pending::new(ticket, task.clone(), true, None, b"out".to_vec(), OwnedHeaders::new(), standin, held)
    }

    #[test]
    fn a_transaction_takes_exactly_the_outputs_below_the_watermark() {
        let offsets = SharedOffsets::default();
        let task = task();
        let outbox = Outbox::default();
        let p: Vec<Pending> = (0..4).map(|o| pending(&offsets, &task, o)).collect();
        // Offsets 1 and 3 finish first: nothing is committable, both wait.
        let mut p: Vec<Option<Pending>> = p.into_iter().map(Some).collect();
        assert!(outbox.put(&offsets, p[1].take().expect("not taken yet"), None));
        assert!(outbox.put(&offsets, p[3].take().expect("not taken yet"), None));
        let tp = ("t".to_string(), 0);
        let epoch = offsets.lock().epoch(&tp).expect("assigned");
        assert_eq!(offsets.lock().position(&tp), Some(0));
        assert!(outbox.take(&[(tp.clone(), 0, epoch)]).is_empty());
        // Offset 0 finishes: the watermark is 2, and the outputs of 0 and 1 go, not 3's.
        assert!(outbox.put(&offsets, p[0].take().expect("not taken yet"), None));
        let position = offsets.lock().position(&tp).expect("assigned");
        assert_eq!(position, 2);
        let taken = outbox.take(&[(tp.clone(), position, epoch)]);
        assert_eq!(taken.iter().map(|p| p.ticket.offset).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(outbox.waiting(), 1, "offset 3 waits for the watermark");
        // Aborted: back in, taken again by the next transaction.
        outbox.put_back(taken);
        assert_eq!(outbox.take(&[(tp.clone(), position, epoch)]).len(), 2);
    }

    #[test]
    fn outputs_of_a_revoked_partition_are_never_committed_by_a_later_assignment() {
        let offsets = SharedOffsets::default();
        let task = task();
        let outbox = Outbox::default();
        let tp = ("t".to_string(), 0);
        let early = pending(&offsets, &task, 0);
        let late = pending(&offsets, &task, 1);
        let slipped = pending(&offsets, &task, 5);
        assert!(outbox.put(&offsets, early, None));
        // Revoked (offsets first, then the outbox), then assigned again: a new epoch.
        offsets.lock().revoke([&tp]);
        outbox.forget(std::slice::from_ref(&tp));
        offsets.lock().assign([tp.clone()]);
        assert!(!outbox.put(&offsets, late, None), "a record of the old assignment is not put in");
        assert_eq!(outbox.waiting(), 0);
        let fresh = pending(&offsets, &task, 0);
        let epoch = offsets.lock().epoch(&tp).expect("assigned");
        assert_eq!(fresh.ticket.epoch(), epoch);
        assert!(outbox.put(&offsets, fresh, None));
        // An output of the old epoch slipped in by hand is dropped at take, never committed.
        outbox.put_back(vec![slipped]);
        let taken = outbox.take(&[(tp.clone(), 10, epoch)]);
        assert_eq!(taken.iter().map(|p| p.ticket.offset).collect::<Vec<_>>(), vec![0]);
    }

    #[test]
    fn start_up_waits_for_a_broker_that_is_not_ready_and_not_for_one_that_refuses() {
        use std::sync::atomic::AtomicU32;
        // Not ready (all brokers down): tried again, with growing pauses, until the deadline.
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let make: MakeProducer = Box::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
            Err(KafkaError::MessageProduction(RDKafkaErrorCode::AllBrokersDown))
        });
        let started = Instant::now();
        let result = ready_at_start(&make, Duration::from_millis(100), Duration::from_secs(2));
        let waited = started.elapsed();
        assert!(matches!(result, Err(KafkaError::MessageProduction(RDKafkaErrorCode::AllBrokersDown))));
        // Attempts at 0, 0.5 and 1.5 s; the next pause (2 s) would pass the deadline. A thread
        // held off a CPU for over half a second (a loaded CI machine) can push the third past it.
        let made = calls.load(Ordering::SeqCst);
        assert!((2..=3).contains(&made), "{made} attempts");
        assert!(waited >= Duration::from_millis(1_500), "{waited:?}");
        // Refused (a client that cannot be made): at once.
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let make: MakeProducer = Box::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
            Err(KafkaError::ClientCreation("bad setting".into()))
        });
        assert!(ready_at_start(&make, Duration::from_millis(100), Duration::from_secs(2)).is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // What counts as not ready.
        assert!(passing(&KafkaError::MessageProduction(RDKafkaErrorCode::Fatal)), "an abandoned call: a new producer");
        assert!(passing(&KafkaError::MessageProduction(RDKafkaErrorCode::NotCoordinator)));
        assert!(!passing(&KafkaError::MessageProduction(RDKafkaErrorCode::TransactionalIdAuthorizationFailed)));
        assert!(!passing(&KafkaError::ClientCreation("x".into())));
    }

    #[test]
    fn a_transactional_call_past_its_timeout_is_abandoned_as_fatal_and_at_most_four_are_left_running() {
        use crate::consume::client::KafkaEvents;
        use crate::health::Health;
        use rdkafka::ClientConfig;
        // No broker: the client is made, never connected.
        let producer: Arc<Producer> = Arc::new(
            ClientConfig::new()
                .set("bootstrap.servers", "127.0.0.1:9")
                .create_with_context(produce::Outputs(KafkaEvents::new(Arc::new(Health::default()), Metrics::new(), false)))
                .expect("producer"),
        );
        let timeout = Duration::from_millis(200);
        // In time: its own answer, and nothing left running.
        let quick = bounded(&producer, timeout, "quick", |_, t| Ok(t));
        assert_eq!(quick.expect("answered"), timeout);
        assert_eq!(ABANDONED.load(Ordering::SeqCst), 0);
        // Stuck (librdkafka ignoring its timeout): abandoned after the timeout and the grace,
        // as a fatal error, so the producer is replaced; its thread holds the producer.
        let (release, held) = mpsc::channel::<()>();
        let started = Instant::now();
        let stuck = bounded(&producer, timeout, "stuck", move |_, _| {
            let _ = held.recv();
            Ok(())
        });
        let waited = started.elapsed();
        assert!(matches!(stuck, Err(KafkaError::MessageProduction(RDKafkaErrorCode::Fatal))), "{stuck:?}");
        assert!(is_fatal(&stuck.unwrap_err()));
        assert!(waited >= timeout + STUCK_GRACE, "gave up after {waited:?}");
        assert_eq!(ABANDONED.load(Ordering::SeqCst), 1);
        assert_eq!(Arc::strong_count(&producer), 2, "the abandoned call keeps its producer");
        // When librdkafka returns at last, the thread lets the producer go.
        release.send(()).expect("still waiting");
        let deadline = Instant::now() + Duration::from_secs(5);
        while (ABANDONED.load(Ordering::SeqCst) > 0 || Arc::strong_count(&producer) > 1) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!((ABANDONED.load(Ordering::SeqCst), Arc::strong_count(&producer)), (0, 1));

        // A call whose thread ends without an answer (a panic in the binding) is fatal at
        // once, and nothing is counted as left running.
        // (Not waited for: a call that had run past its timeout would be counted as abandoned.)
        let ended = bounded(&producer, timeout, "panics", |_, _| -> Result<(), KafkaError> { panic!("a panic in the binding") });
        assert!(matches!(ended, Err(KafkaError::MessageProduction(RDKafkaErrorCode::Fatal))), "{ended:?}");
        assert_eq!(ABANDONED.load(Ordering::SeqCst), 0);

        // With MAX_ABANDONED calls left running, the next stuck one is waited for, however long
        // it takes, and answers its own result: no more threads are left behind.
        let releases: Vec<_> = (0..MAX_ABANDONED)
            .map(|i| {
                let (release, held) = mpsc::channel::<()>();
                let stuck = bounded(&producer, timeout, "stuck", move |_, _| held.recv().map_err(|_| KafkaError::Canceled));
                assert!(matches!(stuck, Err(KafkaError::MessageProduction(RDKafkaErrorCode::Fatal))), "{i}: {stuck:?}");
                release
            })
            .collect();
        assert_eq!(ABANDONED.load(Ordering::SeqCst), MAX_ABANDONED);
        let (release, held) = mpsc::channel::<()>();
        // Timed from before the thread starts: the release below comes after the sleep, so the
        // call cannot answer sooner, however late the thread is scheduled.
        let started = Instant::now();
        let waiting = {
            let producer = Arc::clone(&producer);
            std::thread::spawn(move || {
                (bounded(&producer, timeout, "stuck", move |_, _| held.recv().map(|()| 7).map_err(|_| KafkaError::Canceled)), started.elapsed())
            })
        };
        std::thread::sleep((timeout + STUCK_GRACE) * 3);
        assert!(!waiting.is_finished(), "the fifth stuck call was abandoned too");
        assert_eq!(ABANDONED.load(Ordering::SeqCst), MAX_ABANDONED);
        release.send(()).expect("still waiting");
        let (answer, waited) = waiting.join().expect("no panic");
        assert_eq!(answer.expect("its own answer"), 7);
        assert!(waited >= (timeout + STUCK_GRACE) * 3, "{waited:?}");
        // The abandoned ones let go of their producer as librdkafka returns.
        for release in releases {
            release.send(()).expect("still waiting");
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while (ABANDONED.load(Ordering::SeqCst) > 0 || Arc::strong_count(&producer) > 1) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!((ABANDONED.load(Ordering::SeqCst), Arc::strong_count(&producer)), (0, 1));
    }

    #[test]
    fn a_refused_output_is_trimmed_once_then_dropped() {
        let offsets = SharedOffsets::default();
        let task = task();
        let metrics = Metrics::new();
        let mut p = pending(&offsets, &task, 0);
        p.payload = vec![b'x'; 100_000];
        let error = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        assert_eq!(p.topic(), task.results_topic);
        p.refused(&error, &metrics);
        assert_eq!((p.form, p.topic()), (Form::Trimmed, task.dlq_topic.as_str()));
        assert!(p.payload.len() < 4096);
        p.refused(&error, &metrics);
        assert_eq!(p.form, Form::Dropped);
    }
}
