//! Consuming and committing: the fetch thread ([`fetch`]), the commit thread ([`commit`]), the
//! rebalance callbacks ([`rebalance`]), the assignment and pause state those two change
//! ([`flow`]), the watermark of finished offsets they share ([`offsets`]), and, in exactly-once
//! delivery, the outputs waiting for the transaction that commits their offsets
//! ([`transaction`]).
//!
//! Invariants:
//! - A record's offset is committed only once it and every record before it in its partition
//!   ended in an acknowledged result or dead letter (the watermark of
//!   [`offsets::OffsetTracker`]), so a crash loses nothing; it may redo what was in flight.
//! - Records fetched past the last commit the broker *confirmed* never exceed
//!   `max_in_flight`: that bounds the duplicates after a crash.
//! - Work started under an earlier assignment of a partition never moves its commit (epochs);
//!   on revoke, the partition's records get `drain_timeout` to finish before its last commit,
//!   and no commit of the commit thread reaches the broker after it.
//! - In exactly-once delivery, a transaction writes only outputs of records below the offsets
//!   it commits, and only outputs of the partition's current assignment: no output is ever
//!   committed twice, and none is lost (`transaction`'s module doc has the argument).
//! - Memory is bounded: past `max_in_flight` records or `max_held_bytes`, the fetch thread
//!   takes no more records; past [`fetch::HOLD_BEFORE_PAUSE`] it pauses the partitions (with
//!   hysteresis) and keeps polling, so the consumer stays in its group.

pub mod client;
pub mod commit;
pub mod fetch;
pub mod flow;
pub mod offsets;
pub mod rebalance;
pub mod transaction;
pub mod verify;

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
