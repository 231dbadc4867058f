//! The GPU side of vramgate: loads TorchScript models with libtorch and serves them over the
//! Open Inference Protocol v2.
//!
//! `main.rs` only parses arguments and calls [`server::run`]; tests start the same function on
//! port 0.

pub mod batching;
pub mod config;
pub mod cuda_memory;
pub mod engine;
pub mod estimate;
pub mod finite;
pub mod limits;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod server;

pub use config::WorkerConfig;
