//! The tasks a gateway serves, one module each behind one trait: what a task does to a request
//! between reading its input and calling the worker, and between the worker's answer and the
//! result. [`crate::record`] drives every task through [`Converter`] the same way; adding a task
//! is a file here, a [`crate::config::Converter`] variant and a line in [`converter`].
//!
//! A request goes through three steps, each of which may refuse it with a [`Failure`]:
//! 1. [`Converter::plan`]: the request's options merged over the task's configuration, checked
//!    before any input is read;
//! 2. [`Plan::probe`]: the input's header, checked against the limits, and the bytes its
//!    conversion will hold at its peak (reserved before decoding);
//! 3. [`Plan::convert`] (CPU-bound, on the task's rayon pool): the model's input tensor, the
//!    outputs to ask for, and a [`Finish`] that turns the model's outputs into the result.

pub mod image;
pub mod voice;

use std::sync::Arc;

use vramgate_shared::oip::Tensor;

use crate::failure::Failure;
use crate::call::client::OutputTensor;

/// A task type's conversion, built once from its configuration.
pub trait Converter: Send + Sync {
    /// The plan for one request: its options checked and merged over the task's.
    fn plan(&self, options: Option<&serde_json::Value>) -> Result<Arc<dyn Plan>, Failure>;
}

/// One request's conversion, options settled.
pub trait Plan: Send + Sync {
    /// Checks the input's header against the limits, without decoding; returns the bytes
    /// [`convert`](Self::convert) will hold at its peak.
    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure>;

    /// Decodes and converts. CPU-bound: runs on the task's rayon pool, never on tokio's threads.
    fn convert(&self, bytes: &[u8]) -> Result<Converted, Failure>;
}

/// The model's input and how to read its answer.
pub struct Converted {
    pub tensor: Tensor,
    /// The model outputs to ask for, in the order [`Finish::output`] reads them.
    pub outputs: &'static [&'static str],
    pub finish: Box<dyn Finish>,
}

/// What a request needs, after the worker answered, to build its result's `output`.
pub trait Finish: Send {
    /// `tensors` are the outputs asked for, in order.
    fn output(self: Box<Self>, tensors: &[OutputTensor]) -> Result<serde_json::Value, Failure>;
}
