//! Why a record could not be served: the kind, stage and message that go into its dead letter.

use vramgate_shared::events::{ErrorKind, Stage};

#[derive(Debug, Clone)]
pub struct Failure {
    pub kind: ErrorKind,
    pub stage: Stage,
    pub message: String,
    /// Worker calls made before giving up.
    pub attempts: u32,
}

impl Failure {
    pub fn new(kind: ErrorKind, stage: Stage, message: impl Into<String>) -> Self {
        Failure { kind, stage, message: message.into(), attempts: 0 }
    }

    pub fn with_attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts;
        self
    }
}
