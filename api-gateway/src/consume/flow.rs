//! Which partitions the gateway holds and which of them are paused, and why: the state the
//! fetch thread ([`super::fetch`]) changes as its bounds fill and drain, and the rebalance
//! callbacks ([`super::rebalance`]) change as partitions come and go. Both run on the fetch
//! thread; this module depends on neither.

use std::collections::HashSet;

use super::offsets::TopicPartition;

/// Assignment and pause state; touched by the fetch loop and its rebalance callbacks, both on
/// the fetch thread.
#[derive(Debug, Default)]
pub struct Flow {
    pub assigned: HashSet<TopicPartition>,
    pub paused: HashSet<TopicPartition>,
    /// A gateway-wide pause (budget or record count), held until both fall below the resume
    /// fraction of their bounds.
    pub global: Option<PauseReason>,
}

/// Why partitions are paused, for the pause metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseReason {
    /// A model of the task changed so that the task no longer fits it.
    Misfit,
    Permits,
    Budget,
    InFlight,
    Shutdown,
}

impl PauseReason {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            PauseReason::Misfit => "misfit",
            PauseReason::Permits => "permits",
            PauseReason::Budget => "budget",
            PauseReason::InFlight => "in_flight",
            PauseReason::Shutdown => "shutdown",
        }
    }
}
