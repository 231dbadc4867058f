//! Readiness: whether this gateway can do its job now. `GET /healthz` says the process is alive;
//! `GET /readyz` answers 200 only when the broker is reachable with the configured credentials,
//! every topic of every enabled task exists, and every task has at least one worker that says it
//! is ready, and 503 with the failing checks otherwise (JSON: `{"ready": false, "checks":
//! {"kafka": "…", "worker http://…": "…", …}}`; each worker is listed, a task with none ready
//! adds `"workers <task>"`).
//!
//! The checks run in the background every [`CHECK_INTERVAL`] (a metadata request and one
//! `GET /v2/health/ready` per worker), so a probe never waits on the broker. An authentication
//! failure reported by librdkafka ([`crate::consume::client`]) makes the gateway not ready at
//! once, with the broker's reason, until a later metadata request succeeds.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};

use crate::call::workers::{Endpoint, WorkerSet};

/// How often readiness is re-checked.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// How long one broker or worker check may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, Default)]
pub struct Health {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// `None` until the first check ran; then `Ok(())` or the reason.
    kafka: Option<Result<(), String>>,
    kafka_auth: Option<String>,
    workers: BTreeMap<String, Result<(), String>>,
    /// Each task's worker URLs at the last check.
    tasks: BTreeMap<String, Vec<String>>,
}

impl Health {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// librdkafka reported an authentication failure.
    pub fn set_kafka_auth_error(&self, reason: String) {
        self.state().kafka_auth = Some(reason);
    }

    /// Whether the gateway is ready, and each check's outcome.
    pub fn report(&self) -> (bool, serde_json::Value) {
        let state = self.state();
        let mut checks = serde_json::Map::new();
        let kafka = match (&state.kafka_auth, &state.kafka) {
            (Some(auth), _) => Err(format!("authentication failed: {auth}")),
            (None, None) => Err("not checked yet".to_string()),
            (None, Some(result)) => result.clone(),
        };
        let text = |result: &Result<(), String>| match result {
            Ok(()) => "ok".to_string(),
            Err(reason) => reason.clone(),
        };
        let mut ready = kafka.is_ok();
        checks.insert("kafka".into(), text(&kafka).into());
        // A worker down is reported; it makes the gateway unready only when its task has no
        // other worker ready.
        for (url, result) in &state.workers {
            checks.insert(format!("worker {url}"), text(result).into());
        }
        for (task, urls) in &state.tasks {
            let up = urls.iter().filter(|u| state.workers.get(*u).is_some_and(|r| r.is_ok())).count();
            if up == 0 {
                ready = false;
                let reason = if urls.is_empty() {
                    "no worker known (none listed, or none found in DNS)".to_string()
                } else {
                    format!("none of its {} workers is ready", urls.len())
                };
                checks.insert(format!("workers {task}"), reason.into());
            }
        }
        (ready, serde_json::json!({"ready": ready, "checks": checks}))
    }
}

/// Checks the broker, the topics and the workers every [`CHECK_INTERVAL`] for as long as the
/// gateway runs.
pub async fn run_checks<C: ConsumerContext + 'static>(
    health: Arc<Health>,
    consumer: Arc<BaseConsumer<C>>,
    topics: Vec<String>,
    sets: Vec<Arc<WorkerSet>>,
) {
    let http = match reqwest::Client::builder().timeout(CHECK_TIMEOUT).build() {
        Ok(http) => http,
        Err(e) => {
            tracing::error!(error = %e, "readiness checks cannot start");
            return;
        }
    };
    loop {
        let consumer = consumer.clone();
        let metadata = tokio::task::spawn_blocking(move || consumer.fetch_metadata(None, CHECK_TIMEOUT)).await;
        let kafka = match metadata {
            Ok(Ok(metadata)) => {
                let missing: Vec<&str> = topics
                    .iter()
                    .filter(|name| {
                        !metadata
                            .topics()
                            .iter()
                            .any(|t| t.name() == name.as_str() && t.error().is_none() && !t.partitions().is_empty())
                    })
                    .map(String::as_str)
                    .collect();
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(format!("topics missing on the broker: {}", missing.join(", ")))
                }
            }
            Ok(Err(e)) => Err(format!("broker unreachable: {e}")),
            Err(e) => Err(format!("metadata request failed: {e}")),
        };
        let mut results = BTreeMap::new();
        let tasks: BTreeMap<String, Vec<String>> = sets.iter().map(|s| (s.task.clone(), s.urls())).collect();
        // Each worker once, whatever tasks share it, through the door the gateway calls it by.
        let mut endpoints: BTreeMap<String, Arc<Endpoint>> = BTreeMap::new();
        for set in sets.iter() {
            for endpoint in set.endpoints() {
                endpoints.entry(endpoint.url.clone()).or_insert(endpoint);
            }
        }
        for (url, endpoint) in endpoints {
            results.insert(url, endpoint.client.ready(&http, CHECK_TIMEOUT).await);
        }
        {
            let mut state = health.state();
            if kafka.is_ok() {
                state.kafka_auth = None;
            }
            state.kafka = Some(kafka);
            state.workers = results;
            state.tasks = tasks;
        }
        tokio::time::sleep(CHECK_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_check_passed() {
        let health = Health::default();
        let (ready, report) = health.report();
        assert!(!ready, "not ready before the first check: {report}");
        health.state().kafka = Some(Ok(()));
        health.state().workers.insert("http://w".into(), Ok(()));
        health.state().tasks.insert("voice".into(), vec!["http://w".into(), "http://v".into()]);
        health.state().workers.insert("http://v".into(), Err("down".into()));
        let (ready, report) = health.report();
        assert!(ready, "one worker of the task is enough: {report}");
        assert_eq!(report["checks"]["worker http://v"], "down");
        health.set_kafka_auth_error("SASL authentication error".into());
        let (ready, report) = health.report();
        assert!(!ready);
        assert!(report["checks"]["kafka"].as_str().is_some_and(|s| s.contains("authentication failed")), "{report}");
        health.state().kafka_auth = None;
        health.state().workers.insert("http://w".into(), Err("down".into()));
        let (ready, report) = health.report();
        assert!(!ready);
        assert!(report["checks"]["workers voice"].as_str().is_some_and(|s| s.contains("none of its 2")), "{report}");
        health.state().tasks.insert("voice".into(), vec![]);
        assert!(!health.report().0, "a task without workers is not ready");
    }
}
