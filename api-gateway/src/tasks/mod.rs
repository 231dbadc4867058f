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
//! 3. [`Plan::convert`] (CPU-bound, on the task's rayon pool): the worker calls to make (each a
//!    model's input tensor and the outputs to ask for), and a [`Finish`] that turns their
//!    answers into the result, or into further calls: a task may run several models in turn
//!    (the image task runs MTCNN's three networks), each call admitted by its own model's
//!    workers and permits ([`Converter::stage_models`]).

pub mod audio;
pub mod fit;
pub mod image;
pub mod image_model;
pub mod mask;
pub mod npy;
pub mod outputs;
pub mod stages;
pub mod tensor;
pub mod voice;
pub mod yolo;

use std::sync::Arc;

use vramgate_shared::oip::Tensor;

use crate::failure::Failure;
use crate::call::client::OutputTensor;

/// A task type's conversion, built once from its configuration.
pub trait Converter: Send + Sync {
    /// The plan for one request: its options checked and merged over the task's.
    fn plan(&self, options: Option<&serde_json::Value>) -> Result<Arc<dyn Plan>, Failure>;

    /// The models its later calls go to, by name: stage 0 is the task's `model`, stage `i` is
    /// this list's `i - 1`th. Each gets its own workers and GPU permits.
    fn stage_models(&self) -> Vec<String> {
        Vec::new()
    }

    /// Stage 0's model when the converter names it (a pipeline's first stage); `None`: the
    /// task row's `model`.
    fn first_model(&self) -> Option<String> {
        None
    }

    /// What it sends each of its models and asks of them, by stage (as
    /// [`stage_models`](Self::stage_models) counts them), for the start-up check against the
    /// models' metadata ([`fit`]); empty: nothing to check.
    fn uses(&self) -> Vec<fit::ModelUse> {
        Vec::new()
    }
}

/// One request's conversion, options settled.
pub trait Plan: Send + Sync {
    /// Checks the input's header against the limits, without decoding; returns the bytes
    /// [`convert`](Self::convert) will hold at its peak.
    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure>;

    /// Decodes and converts. CPU-bound: runs on the task's rayon pool, never on tokio's threads.
    fn convert(&self, bytes: &[u8]) -> Result<Converted, Failure>;
}

/// The worker calls to make next, all at once, and how to read their answers.
pub struct Converted {
    pub calls: Vec<ModelCall>,
    pub finish: Box<dyn Finish>,
}

impl Converted {
    /// One call to the task's own model (stage 0), of one input.
    pub fn one(tensor: Tensor, outputs: &'static [&'static str], finish: Box<dyn Finish>) -> Self {
        Self::call(vec![tensor], outputs, finish)
    }

    /// One call to the task's own model (stage 0), of its `inputs`, in the model's order.
    pub fn call(inputs: Vec<Tensor>, outputs: &'static [&'static str], finish: Box<dyn Finish>) -> Self {
        Converted { calls: vec![ModelCall { stage: 0, inputs, outputs, name: None }], finish }
    }
}

/// One worker call: a model's input, and the outputs to ask for.
pub struct ModelCall {
    /// Which of the task's models (see [`Converter::stage_models`]).
    pub stage: usize,
    /// The model's input tensors, in the order it declares them (most models take one).
    pub inputs: Vec<Tensor>,
    /// The model outputs to ask for, in the order [`Finish::output`] reads them.
    pub outputs: &'static [&'static str],
    /// A pipeline stage's name (its span's and its failures'); `None`: by its number.
    pub name: Option<&'static str>,
}

/// What a request needs, after the worker answered, to go on: to its result's `output`, or to
/// further calls.
pub trait Finish: Send {
    /// `answers[i]` holds the outputs of call `i`, in the order that call asked for them.
    fn output(self: Box<Self>, answers: Vec<Vec<OutputTensor>>) -> Result<Step, Failure>;

    /// Whether [`output`](Self::output) is CPU-bound work for the task's rayon pool (crops and
    /// resampling between stages) rather than a few microseconds on the caller's thread.
    fn cpu_bound(&self) -> bool {
        false
    }

    /// Bytes this keeps until its calls are answered (say, the image the next stage crops).
    fn held_bytes(&self) -> u64 {
        0
    }
}

/// Where a request stands after an answer.
pub enum Step {
    /// The result's `output`.
    Done(serde_json::Value),
    /// The result's `output`, once `stored` are written to object storage and their
    /// references put under `output.outputs.<name>` ([`crate::storage`]).
    Store { output: serde_json::Value, stored: Vec<crate::storage::StoredOutput> },
    /// More calls.
    Next(Converted),
}

/// Refuses request options for a task that takes none (the configured converters: their
/// settings are the task row's).
pub fn no_options(options: Option<&serde_json::Value>) -> Result<(), Failure> {
    match options {
        Some(v) if !v.is_null() => Err(Failure::new(
            vramgate_shared::events::ErrorKind::InvalidRequest,
            vramgate_shared::events::Stage::Parse,
            "this task takes no options",
        )),
        _ => Ok(()),
    }
}

/// The one answer of a one-call step: its outputs, or why there is not exactly one.
pub fn only_answer(answers: Vec<Vec<OutputTensor>>) -> Result<Vec<OutputTensor>, Failure> {
    let n = answers.len();
    let mut answers = answers.into_iter();
    match (answers.next(), answers.next()) {
        (Some(one), None) => Ok(one),
        _ => Err(Failure::new(
            vramgate_shared::events::ErrorKind::Internal,
            vramgate_shared::events::Stage::Postprocess,
            format!("{n} answers for one call"),
        )),
    }
}
