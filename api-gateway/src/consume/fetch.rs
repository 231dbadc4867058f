//! The fetch thread: it owns the consumer's poll, hands each poll round's records to a tokio
//! task that starts them ([`crate::record`]), and decides what to pause. Commits are the commit thread's
//! ([`super::commit`]).
//!
//! Flow control has two speeds. At a bound (`max_in_flight` records past the last confirmed
//! commit, or `max_held_bytes` of payload), the thread first stops taking records *without*
//! pausing: a commit round trip or a burst of records finishing frees room within
//! milliseconds, and librdkafka keeps its prefetch (bounded by `queue_max_kbytes`) meanwhile.
//! Only a stall longer than [`HOLD_BEFORE_PAUSE`] pauses the partitions (librdkafka drops a
//! paused partition's prefetch, so pausing costs a refetch) and goes back to polling, which
//! serves rebalances and keeps the consumer in its group. A task whose records wait past its
//! `permit_wait_ms` for a GPU permit has its own partitions paused.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};

use super::lock;
use super::offsets::{Ticket, TopicPartition};
use super::flow::{Flow, PauseReason};
use super::rebalance::RebalanceContext;
use crate::budget::Held;
use crate::config::GatewayConfig;
use crate::record::{self, Shared};
use crate::task::Task;

/// How long the fetch thread holds off at a bound before it pauses partitions. Short enough
/// that a rebalance waits at most this long for the thread's next poll.
pub const HOLD_BEFORE_PAUSE: Duration = Duration::from_millis(500);

/// Records taken from the consumer in one round before the bounds are looked at again.
const ROUND: usize = 256;
/// At shutdown, how long the last transactions' outputs may take to be read back (and any found
/// aborted to be written again) before the gateway leaves its group regardless.
const VERIFY_AT_EXIT: Duration = Duration::from_secs(15);

/// A record taken and admitted, not yet handed to the runtime.
struct Admitted {
    task: Arc<Task>,
    message: OwnedMessage,
    ticket: Ticket,
    held: Held,
    fetched: Instant,
}

/// Records handed to the runtime together, in one task that starts them in turn. Small
/// enough that a round's records start on both runtime threads at once, and the first of
/// them while the fetch thread still polls the rest; large enough that the hand-off (a spawn
/// through the runtime's shared queue, perhaps a wake-up) is paid once per many records.
const CHUNK: usize = 32;

/// The fetch thread's state.
pub struct Fetch {
    pub consumer: Arc<BaseConsumer<RebalanceContext>>,
    pub shared: Arc<Shared>,
    pub by_topic: HashMap<String, Arc<Task>>,
    pub flow: Arc<Mutex<Flow>>,
    pub runtime: tokio::runtime::Handle,
    pub config: GatewayConfig,
    pub tasks: Vec<Arc<Task>>,
}

impl Fetch {
    /// Fetches until `stop` is set, then lets in-flight records finish (up to the shutdown
    /// timeout), commits what finished and leaves the group.
    pub fn run(&mut self, stop: &AtomicBool) {
        let mut stopping_since: Option<Instant> = None;
        let mut last_error: Option<Instant> = None;
        let mut bound_since: Option<Instant> = None;
        // This thread copies the records the record tasks drop (`crate::memory`).
        let mut collect = crate::memory::Every::default();
        loop {
            if collect.due() {
                crate::memory::collect_this_thread();
            }
            if stopping_since.is_none() && stop.load(Ordering::SeqCst) {
                stopping_since = Some(Instant::now());
            }
            if let Some(since) = stopping_since {
                let left = self.shared.in_flight.load(Ordering::SeqCst);
                if left == 0 {
                    break;
                }
                if since.elapsed() > self.config.shutdown_timeout() {
                    tracing::warn!(abandoned = left, "shutdown timeout reached; unfinished records will be redelivered");
                    break;
                }
            }
            let at_bound = self.at_bound();
            let stalled = match at_bound {
                Some(reason) => {
                    let since = *bound_since.get_or_insert_with(Instant::now);
                    let paused = lock(&self.flow).global.is_some();
                    if !paused && stopping_since.is_none() && since.elapsed() < HOLD_BEFORE_PAUSE {
                        // Room comes back when a commit is confirmed (records) or records
                        // finish (bytes: looked at again every 2 ms).
                        self.shared.offsets.wait_committed(Duration::from_millis(2));
                        continue;
                    }
                    Some(reason)
                }
                None => {
                    bound_since = None;
                    None
                }
            };
            self.poll_round(&mut last_error);
            self.update_flow(stopping_since.is_some(), stalled);
        }
        let commits = self.consumer.context().commits.clone();
        commits.commit(&*self.consumer);
        // Exactly-once: what was committed is read back before the group is left, so an output
        // found aborted is still written again, with its offsets (`consume::verify`).
        let deadline = Instant::now() + VERIFY_AT_EXIT;
        while commits.unverified() > 0 && Instant::now() < deadline {
            if commits.has_redo() {
                commits.commit(&*self.consumer);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if commits.unverified() > 0 {
            tracing::warn!(outputs = commits.unverified(), "leaving with committed outputs not read back by a read_committed reader");
        }
        self.consumer.context().closing.store(true, Ordering::SeqCst);
        self.consumer.unsubscribe();
        // Serve the revoke that unsubscribing triggers, so the group rebalances now rather
        // than after the session timeout.
        let deadline = Instant::now() + Duration::from_secs(2);
        while !lock(&self.flow).assigned.is_empty() && Instant::now() < deadline {
            let _ = self.consumer.poll(Duration::from_millis(50));
        }
        tracing::info!("offsets committed; bye");
    }

    /// Takes up to a round of records, waiting up to 50 ms for the first. The round is cut to
    /// the room left in the in-flight window, counted once, so the bounds are not recomputed
    /// (and the offsets not locked again) for every record; the byte budget, which a single
    /// record can exhaust, is still looked at after each one.
    ///
    /// Each record is admitted (counted, charged, given its ticket) as it is taken, and every
    /// [`CHUNK`] records are handed to the runtime together, in one task that starts each
    /// ([`record::start`]: checked at once, a task of its own only if it goes on to a worker).
    /// Spawned from this thread one by one, every record went through the runtime's shared
    /// injection queue and could wake a parked worker thread: a lock and often a futex call
    /// per record. A whole round in one task started its records one after another on one
    /// thread, the last of 1,024 about 7 ms after the first (gateway cause 12).
    fn poll_round(&self, last_error: &mut Option<Instant>) {
        let room = self.config.max_in_flight.saturating_sub(self.window()).clamp(1, ROUND);
        let mut chunk = Vec::with_capacity(CHUNK);
        let mut timeout = Duration::from_millis(50);
        for _ in 0..room {
            match self.consumer.poll(timeout) {
                None => break,
                Some(Ok(message)) => chunk.extend(self.admit(message.detach())),
                // Broker hiccups repeat every poll; say it once a second.
                Some(Err(e)) => {
                    if last_error.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
                        tracing::warn!(error = %e, "kafka consumer error");
                        *last_error = Some(Instant::now());
                    }
                    break;
                }
            }
            timeout = Duration::ZERO;
            if chunk.len() == CHUNK {
                self.hand_over(std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK)));
            }
            if self.budget_full() {
                break;
            }
        }
        if !chunk.is_empty() {
            self.hand_over(chunk);
        }
    }

    /// Starts admitted records, in turn, in one runtime task ([`record::start`]).
    fn hand_over(&self, chunk: Vec<Admitted>) {
        let shared = self.shared.clone();
        self.runtime.spawn(async move {
            for Admitted { task, message, ticket, held, fetched } in chunk {
                // A panic in one record's start must not drop the rest of the chunk unstarted.
                let start = || record::start(&shared, task, message, ticket, held, fetched);
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(start)).is_err() {
                    tracing::error!("starting a record panicked; see the log above");
                }
            }
        });
    }

    /// Counts and charges a record, and gives it its ticket; `None` for a record from a topic
    /// no task reads.
    fn admit(&self, message: OwnedMessage) -> Option<Admitted> {
        let Some(task) = self.by_topic.get(message.topic()) else {
            tracing::error!(topic = message.topic(), "record from a topic no task reads; skipped");
            return None;
        };
        let fetched = Instant::now();
        let (ticket, held) = record::admit(&self.shared, task, &message);
        Some(Admitted { task: task.clone(), message, ticket, held, fetched })
    }

    /// Records past the last confirmed commit (or, if more, records unfinished): what bounds
    /// the duplicates after a crash, and what lets a record waiting to retry hold its
    /// partition back by at most this window.
    fn window(&self) -> usize {
        self.shared.offsets.lock().uncommitted().max(self.shared.in_flight.load(Ordering::SeqCst))
    }

    /// Held bytes at `max_held_bytes`, or someone waiting for bytes.
    fn budget_full(&self) -> bool {
        let budget = &self.shared.budget;
        budget.used() >= budget.limit() || budget.contended()
    }

    /// The gateway-wide bound reached, if any.
    fn at_bound(&self) -> Option<PauseReason> {
        if self.budget_full() {
            Some(PauseReason::Budget)
        } else if self.window() >= self.config.max_in_flight {
            Some(PauseReason::InFlight)
        } else {
            None
        }
    }

    /// Pauses and resumes partitions: all of them while a bound has been held past
    /// [`HOLD_BEFORE_PAUSE`] (`stalled`), until held bytes and records fall below the resume
    /// fraction of their bounds; a task's while its permits are congested; all on shutdown.
    fn update_flow(&self, stopping: bool, stalled: Option<PauseReason>) {
        let config = &self.config;
        let budget = &self.shared.budget;
        let used = budget.used();
        let window = self.window();
        self.shared.metrics.uncommitted.set(window as i64);
        let rf = config.resume_fraction;
        let mut flow = lock(&self.flow);
        flow.global = match flow.global {
            Some(reason) => {
                let calm = used as f64 <= budget.limit() as f64 * rf
                    && !budget.contended()
                    && window as f64 <= config.max_in_flight as f64 * rf;
                (!calm).then_some(reason)
            }
            None => stalled,
        };
        let congested: HashSet<&str> =
            self.tasks.iter().filter(|t| t.congested(rf)).map(|t| t.requests_topic.as_str()).collect();
        let misfit: HashSet<&str> = self.tasks.iter().filter(|t| t.misfit()).map(|t| t.requests_topic.as_str()).collect();
        let reason_for = |tp: &TopicPartition| {
            if stopping {
                Some(PauseReason::Shutdown)
            } else if let Some(global) = flow.global {
                Some(global)
            } else if misfit.contains(tp.0.as_str()) {
                Some(PauseReason::Misfit)
            } else {
                congested.contains(tp.0.as_str()).then_some(PauseReason::Permits)
            }
        };
        let mut pause = TopicPartitionList::new();
        let mut resume = TopicPartitionList::new();
        let mut newly_paused = Vec::new();
        let mut resumed = Vec::new();
        for tp in &flow.assigned {
            match (reason_for(tp), flow.paused.contains(tp)) {
                (Some(reason), false) => {
                    let _ = pause.add_partition_offset(&tp.0, tp.1, Offset::Invalid);
                    newly_paused.push((tp.clone(), reason));
                }
                (None, true) => {
                    let _ = resume.add_partition_offset(&tp.0, tp.1, Offset::Invalid);
                    resumed.push(tp.clone());
                }
                _ => {}
            }
        }
        if newly_paused.is_empty() && resumed.is_empty() {
            return;
        }
        if pause.count() > 0 {
            if let Err(e) = self.consumer.pause(&pause) {
                tracing::warn!(error = %e, "pausing partitions failed");
            }
        }
        if resume.count() > 0 {
            if let Err(e) = self.consumer.resume(&resume) {
                tracing::warn!(error = %e, "resuming partitions failed");
            }
        }
        let metrics = &self.shared.metrics;
        for (tp, reason) in newly_paused {
            let task = self.task_name(&tp.0);
            metrics.pauses.with_label_values(&[task, reason.as_str()]).inc();
            tracing::debug!(topic = %tp.0, partition = tp.1, reason = reason.as_str(), "partition paused");
            flow.paused.insert(tp);
        }
        for tp in resumed {
            metrics.resumes.with_label_values(&[self.task_name(&tp.0)]).inc();
            tracing::debug!(topic = %tp.0, partition = tp.1, "partition resumed");
            flow.paused.remove(&tp);
        }
        for task in &self.tasks {
            let paused = flow.paused.iter().filter(|tp| tp.0 == task.requests_topic).count();
            metrics.paused.with_label_values(&[&task.name]).set(paused as i64);
        }
    }

    fn task_name(&self, topic: &str) -> &str {
        self.by_topic.get(topic).map_or("unknown", |t| t.name.as_str())
    }
}
