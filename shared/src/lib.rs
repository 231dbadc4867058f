//! What both vramgate services share: the Kafka event schemas, the Open Inference Protocol
//! wire format, the admission primitive (a byte-weighted async semaphore), config layering
//! and logging set-up.
//!
//! This crate deliberately knows no libtorch and no HTTP server, and no Kafka client unless its
//! `kafka` feature is on (the connection settings the gateway and the CLI share): it is types,
//! pure functions, tokio synchronisation and signal handling, so either service (and users' own
//! producers) can depend on it cheaply.

pub mod admission;
pub mod config;
pub mod events;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod oip;
pub mod prom_text;
pub mod schema;
pub mod shutdown;
pub mod telemetry;
pub mod wav;
pub mod worker_state;
#[cfg(test)]
mod test_rng;
