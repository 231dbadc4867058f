//! What both vramgate services share: the Kafka event schemas, the Open Inference Protocol
//! wire format, config layering and logging set-up.
//!
//! This crate deliberately knows no Kafka client, no libtorch and no HTTP server: it is types
//! and pure functions, so either service (and users' own producers) can depend on it cheaply.

pub mod config;
pub mod events;
pub mod oip;
pub mod telemetry;
