//! `vramgate-cli`: the tools that talk to a running vramgate from outside, through its public
//! surfaces only (Kafka topics, the gateway's and worker's metrics, Jaeger's query API).
//!
//! Nothing here runs inside a service. [`load`] is the load generator (`vramgate-cli load`:
//! inputs, pacing, the tally of outputs, its plot and report); [`jaeger`] reads traces back from
//! Jaeger (`vramgate-cli trace`, and the trace tests); [`outputs`] is how every consumer of the
//! output topics is configured (`read_committed` by default). The binary (`main.rs`) adds
//! `produce` and `watch`.

pub mod jaeger;
pub mod load;
pub mod outputs;
