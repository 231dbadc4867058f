//! Keeping offsets and flow state in step with partition assignment (cooperative-sticky): a
//! revoked partition gets `drain_timeout` for its records to finish, its watermark is committed,
//! and then it is forgotten, so work that finishes later never moves its commit (epochs).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::statistics::Statistics;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::{ClientContext, TopicPartitionList};

use super::client::KafkaEvents;
use super::commit::{Commits, Writer};
use super::flow::Flow;
use super::offsets::TopicPartition;
use super::lock;
use crate::metrics::Metrics;

pub struct RebalanceContext {
    pub events: KafkaEvents,
    pub commits: Arc<Commits>,
    pub flow: Arc<Mutex<Flow>>,
    pub metrics: Arc<Metrics>,
    pub drain_timeout: Duration,
    /// Set when the gateway leaves for good after its own drain: no second wait on revoke.
    pub closing: AtomicBool,
}

impl ClientContext for RebalanceContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        self.events.log(level, facility, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.events.error(error, reason);
    }

    /// librdkafka's statistics, every [`LAG_INTERVAL_MS`]: the lag of each assigned partition
    /// (its high watermark less the group's committed offset) becomes
    /// `consumer_lag_records`; a partition no longer assigned loses its series.
    fn stats(&self, statistics: Statistics) {
        let gauge = &self.metrics.consumer_lag;
        for (topic, t) in &statistics.topics {
            for (partition, p) in &t.partitions {
                if *partition < 0 {
                    continue; // librdkafka's internal "unassigned" partition
                }
                let label = partition.to_string();
                if p.desired && p.consumer_lag >= 0 {
                    gauge.with_label_values(&[topic.as_str(), label.as_str()]).set(p.consumer_lag);
                } else if !p.desired {
                    let _ = gauge.remove_label_values(&[topic.as_str(), label.as_str()]);
                }
            }
        }
    }
}

/// How often librdkafka reports the consumer's statistics, and so the lag gauge's age at most.
pub const LAG_INTERVAL_MS: u64 = 5000;

impl ConsumerContext for RebalanceContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Revoke(tpl) = rebalance else { return };
        let revoked = partitions(tpl);
        let timeout = if self.closing.load(Ordering::SeqCst) { Duration::ZERO } else { self.drain_timeout };
        let offsets = &self.commits.offsets;
        let left = offsets.wait_drained(&revoked, timeout);
        // Commit what finished (in exactly-once delivery: with its outputs, in one
        // transaction), then forget the partitions: whatever is still running belongs to the
        // next owner, which reads it again from here. The gate keeps the commit thread from
        // sending a position of these partitions after this. A lost assignment (this member
        // was dropped from the group) commits nothing: the broker would refuse it, and the
        // partitions may already be someone else's.
        let mut gate = self.commits.gate();
        let lost = consumer.assignment_lost();
        let positions: Vec<(TopicPartition, i64)> = {
            let tracker = offsets.lock();
            revoked.iter().filter_map(|tp| Some((tp.clone(), tracker.position(tp)?))).collect()
        };
        if !positions.is_empty() && !lost {
            if let Err(e) = self.commits.send(&mut gate, consumer, &positions) {
                tracing::warn!(error = %e, "commit of revoked partitions failed; their new owner may redo some records");
            }
        }
        offsets.lock().revoke(revoked.iter());
        if let Writer::Transactions(transactional) = &*gate {
            // After the offsets: an output put in before this revoke is forgotten here, one
            // put in after finds its ticket stale (`transaction::Outbox::put`).
            transactional.outbox.forget(&revoked);
        }
        drop(gate);
        let mut flow = lock(&self.flow);
        for tp in &revoked {
            flow.assigned.remove(tp);
            flow.paused.remove(tp);
            let _ = self.metrics.pending.remove_label_values(&[&tp.0, &tp.1.to_string()]);
        }
        tracing::info!(partitions = ?revoked, abandoned = left, lost, "partitions revoked");
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Assign(tpl) = rebalance else { return };
        let assigned = partitions(tpl);
        tracing::info!(partitions = ?assigned, "partitions assigned");
        self.commits.offsets.lock().assign(assigned.iter().cloned());
        lock(&self.flow).assigned.extend(assigned);
    }
}

fn partitions(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements().iter().map(|e| (e.topic().to_string(), e.partition())).collect()
}
