//! The Kafka side of vramgate: consumes request events, converts inputs on per-task CPU pools,
//! calls the ai-worker over HTTP under per-task GPU permits, and writes results or dead letters.
//!
//! This is the only crate that knows Kafka; it reaches the worker only over HTTP.

pub mod answer;
pub mod audio;
pub mod budget;
pub mod call;
pub mod config;
pub mod consume;
pub mod endpoint;
pub mod failure;
pub mod frames;
pub mod health;
pub mod input;
pub mod memory;
pub mod metrics;
pub mod model_check;
pub mod pipeline;
pub mod produce;
pub mod record;
pub mod storage;
pub mod task;
pub mod tasks;
pub mod video;

pub use config::GatewayConfig;
