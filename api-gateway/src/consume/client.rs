//! What librdkafka tells the gateway about itself: its log lines and its client errors, for
//! the consumer and the producer alike. Both are rate-limited (a broker that is down makes
//! librdkafka repeat itself many times a second; debug lines, asked for with librdkafka's
//! `debug` property, get a larger share) and counted, and an authentication failure
//! marks the gateway not ready with the broker's reason ([`crate::health`]).

use std::sync::Arc;

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::ClientContext;
use vramgate_shared::telemetry::{bounded, LogLimit, LOG_FIELD_MAX_BYTES};

use crate::health::Health;
use crate::metrics::Metrics;

/// The client context of the gateway's Kafka producer, and the part of the consumer's that
/// is not about rebalancing.
pub struct KafkaEvents {
    pub health: Arc<Health>,
    pub metrics: Arc<Metrics>,
    logs: LogLimit,
    errors: LogLimit,
}

/// librdkafka's log lines a second, per client.
const LOG_LINES_PER_SECOND: u32 = 2;
/// The same with librdkafka's `debug` property set: the operator asked for its debug lines,
/// and two a second would keep almost none of them.
const DEBUG_LOG_LINES_PER_SECOND: u32 = 500;

impl KafkaEvents {
    /// `debugging`: librdkafka's `debug` property is set ([`DEBUG_LOG_LINES_PER_SECOND`]).
    pub fn new(health: Arc<Health>, metrics: Arc<Metrics>, debugging: bool) -> Self {
        let lines = if debugging { DEBUG_LOG_LINES_PER_SECOND } else { LOG_LINES_PER_SECOND };
        KafkaEvents { health, metrics, logs: LogLimit::new(lines), errors: LogLimit::new(1) }
    }
}

/// Whether a client error means the credentials or the TLS set-up are wrong: retrying will not
/// fix it, and the operator has to.
pub fn is_auth_error(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::Authentication
                | RDKafkaErrorCode::SaslAuthenticationFailed
                | RDKafkaErrorCode::SSL
                | RDKafkaErrorCode::ClusterAuthorizationFailed
                | RDKafkaErrorCode::GroupAuthorizationFailed
                | RDKafkaErrorCode::TopicAuthorizationFailed
        )
    )
}

/// The gateway's reader of its own outputs ([`super::verify`]) has no group to rebalance.
impl rdkafka::consumer::ConsumerContext for KafkaEvents {}

impl ClientContext for KafkaEvents {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        if !self.logs.allow() {
            self.metrics.log_suppressed.with_label_values(&["kafka_client"]).inc();
            return;
        }
        let message = bounded(message, LOG_FIELD_MAX_BYTES);
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error => {
                tracing::error!(target: "librdkafka", facility, message)
            }
            RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", facility, message),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => tracing::info!(target: "librdkafka", facility, message),
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", facility, message),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        // The end of a partition, for the reader of committed outputs (`enable.partition.eof`):
        // news, not an error.
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::PartitionEOF) {
            return;
        }
        let auth = is_auth_error(&error);
        let kind = if auth { "authentication" } else { "other" };
        self.metrics.kafka_errors.with_label_values(&[kind]).inc();
        let reason = bounded(reason, LOG_FIELD_MAX_BYTES);
        if auth {
            self.health.set_kafka_auth_error(format!("{error}: {reason}"));
        }
        if self.errors.allow() {
            if auth {
                tracing::error!(error = %error, reason, "kafka authentication failed: check the credentials and TLS settings in [kafka.properties]");
            } else {
                tracing::warn!(error = %error, reason, "kafka client error");
            }
        } else {
            self.metrics.log_suppressed.with_label_values(&["kafka_client"]).inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authentication_errors_are_told_apart() {
        assert!(!is_auth_error(&KafkaError::ClientCreation("x".into())));
        assert!(is_auth_error(&KafkaError::Global(RDKafkaErrorCode::SaslAuthenticationFailed)));
        assert!(is_auth_error(&KafkaError::Global(RDKafkaErrorCode::Authentication)));
        assert!(!is_auth_error(&KafkaError::Global(RDKafkaErrorCode::AllBrokersDown)));
    }

    #[test]
    fn debug_lines_get_a_larger_share_only_when_asked_for() {
        let lines_let_through = |debugging: bool| {
            let events = KafkaEvents::new(Arc::new(Health::default()), Metrics::new(), debugging);
            // 600 tries within well under a second (the limit is per second of the clock:
            // straddling a second boundary could let at most one second's share more through).
            (0..600).filter(|_| events.logs.allow()).count() as u32
        };
        let quiet = lines_let_through(false);
        assert!((LOG_LINES_PER_SECOND..=2 * LOG_LINES_PER_SECOND).contains(&quiet), "{quiet}");
        let debugging = lines_let_through(true);
        assert!((DEBUG_LOG_LINES_PER_SECOND..=600).contains(&debugging), "{debugging}");
    }
}
