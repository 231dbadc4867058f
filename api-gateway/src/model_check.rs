//! The start-up check of the task table against the models the workers serve: for each model a
//! task calls, its workers are asked for the model's metadata (`GET /v2/models/{name}`, with
//! the task's token and TLS) and the task's use of it is compared with what the model declares
//! ([`crate::tasks::fit`]). A task that does not fit stops the gateway, with every misfit named.
//!
//! The pipeline waits for the answers before it consumes, at most `worker.model_check_wait_seconds`
//! ([`at_start`]). A model no worker has answered for by then (none reachable, none known yet in
//! DNS, all still loading) is logged loudly and its task consumes unchecked; its workers are asked
//! again every [`LATER_INTERVAL`] until one answers ([`later`]), and a misfit found then stops the
//! gateway as at start-up (in-flight records finish and are committed first). Until then a row
//! that does not fit fails each of its events (`internal`, naming the output and the step).
//!
//! After start-up the models are watched ([`watch`]): every [`LATER_INTERVAL`] the workers are
//! asked again, and when what one declares changes (a new version rolled out), the task is
//! judged again. A task that no longer fits is paused (its partitions; nothing is lost: what it
//! has not fetched waits in Kafka) with an error naming each row and the metric
//! `vramgate_gateway_task_misfit{task}` at 1, and resumes once it fits again. Events it had
//! fetched before the pause, at most one interval's worth, meet the changed model and may end
//! as dead letters; a task pinned to a version (`model_version`) is not moved by a rollout.
//!
//! A worker that answers that it does not serve the model (404), or refuses the question (another
//! 4xx: a wrong token), settles nothing: it is logged, and the task runs as it would without the
//! check (its calls get the same answer, and dead-letter as `worker_rejected`). Every worker
//! that answers with metadata is compared, so two workers serving different versions of a model
//! are both judged; workers found in DNS later are not asked.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vramgate_shared::oip::ModelMetadata;

use crate::call::client::CallError;
use crate::call::workers::WorkerSet;
use crate::task::Task;
use crate::tasks::fit::{self, ModelUse};

/// Limit of one metadata request.
pub const METADATA_TIMEOUT: Duration = Duration::from_secs(5);
/// Between two rounds of questions while the start-up waits.
pub const START_INTERVAL: Duration = Duration::from_millis(250);
/// Between two rounds once the gateway consumes without an answer.
pub const LATER_INTERVAL: Duration = Duration::from_secs(2);

/// One model of one task, not yet checked.
pub struct Pending {
    task: String,
    owner: Arc<Task>,
    set: Arc<WorkerSet>,
    used: ModelUse,
    /// Why the last round settled nothing.
    waiting: String,
}

/// What one round of questions about a model found.
enum Round {
    /// Workers answered with the model's metadata: the misfits and warnings, each worker's
    /// named.
    Answered(fit::Verdict),
    /// Every worker known answered, none with metadata: why.
    Refused(String),
    /// No answer yet: why.
    Waiting(String),
}

/// Every model of every task whose converter says what it sends and asks ([`crate::tasks::Converter::uses`]).
pub fn pending(tasks: &[Arc<Task>]) -> Vec<Pending> {
    let mut pending = Vec::new();
    for task in tasks {
        for (used, set) in task.converter.uses().into_iter().zip(&task.stages) {
            pending.push(Pending {
                task: task.name.clone(),
                owner: task.clone(),
                set: set.clone(),
                used,
                waiting: "not asked yet".into(),
            });
        }
    }
    pending
}

/// Checks `pending` for up to `wait`: `Err` with every misfit found (one per line), or the
/// checks no worker has answered yet.
pub async fn at_start(mut pending: Vec<Pending>, wait: Duration) -> Result<Vec<Pending>, String> {
    let deadline = Instant::now() + wait;
    let mut misfits = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if pending.is_empty() || left.is_zero() {
            break;
        }
        let rounds = futures::future::join_all(pending.iter().map(ask));
        let Ok(rounds) = tokio::time::timeout(left, rounds).await else { break };
        pending = sift(pending, rounds, &mut misfits);
        if pending.is_empty() || !misfits.is_empty() {
            break;
        }
        tokio::time::sleep(START_INTERVAL.min(deadline.saturating_duration_since(Instant::now()))).await;
    }
    if !misfits.is_empty() {
        return Err(misfits.join("\n"));
    }
    for check in &pending {
        tracing::warn!(
            task = %check.task,
            model = %check.set.model,
            wait_seconds = wait.as_secs_f64(),
            reason = %check.waiting,
            "NO WORKER ANSWERED for the model's metadata: the task consumes UNCHECKED against its model; \
             its workers are asked again every {LATER_INTERVAL:?}, and a task that does not fit then stops the gateway"
        );
    }
    Ok(pending)
}

/// Asks again every [`LATER_INTERVAL`] until every check in `pending` has an answer; the first
/// misfits found are sent on `misfit` (and the asking ends).
pub async fn later(mut pending: Vec<Pending>, misfit: tokio::sync::oneshot::Sender<String>) {
    while !pending.is_empty() {
        tokio::time::sleep(LATER_INTERVAL).await;
        let rounds = futures::future::join_all(pending.iter().map(ask)).await;
        let mut misfits = Vec::new();
        pending = sift(pending, rounds, &mut misfits);
        if !misfits.is_empty() {
            let _ = misfit.send(misfits.join("\n"));
            return;
        }
    }
}

/// The checks a round of answers (`rounds[i]` for `pending[i]`) left waiting; the misfits
/// it found go to `misfits`.
fn sift(pending: Vec<Pending>, rounds: Vec<Round>, misfits: &mut Vec<String>) -> Vec<Pending> {
    let mut waiting = Vec::new();
    for (mut check, round) in pending.into_iter().zip(rounds) {
        match settle(&check, round) {
            Ok(found) => misfits.extend(found),
            Err(why) => {
                check.waiting = why;
                waiting.push(check);
            }
        }
    }
    waiting
}

/// Logs what a round settled: the misfits found, or why it settled nothing.
fn settle(check: &Pending, round: Round) -> Result<Vec<String>, String> {
    let (task, model) = (&check.task, &check.set.model);
    match round {
        Round::Answered(verdict) => {
            for warning in &verdict.warnings {
                tracing::warn!(task = %task, model = %model, "{warning}");
            }
            if verdict.misfits.is_empty() {
                tracing::info!(task = %task, model = %model, "the task fits its model's metadata");
            }
            Ok(verdict.misfits)
        }
        Round::Refused(why) => {
            tracing::warn!(task = %task, model = %model, reason = %why, "the model's metadata was refused: the task is not checked against it");
            Ok(Vec::new())
        }
        Round::Waiting(why) => {
            tracing::debug!(task = %task, model = %model, reason = %why, "no metadata yet");
            Err(why)
        }
    }
}

/// Asks every worker of the check's set, at once, for the model's metadata.
async fn ask(check: &Pending) -> Round {
    if check.set.endpoints().is_empty() {
        return Round::Waiting("no worker known yet".into());
    }
    judge(&check.task, &check.used, answers(check).await)
}

/// Each known worker's answer to the question for the check's model's metadata.
async fn answers(check: &Pending) -> Vec<(String, Result<ModelMetadata, CallError>)> {
    let endpoints = check.set.endpoints();
    let (model, version) = (&check.set.model, check.set.version);
    futures::future::join_all(
        endpoints.iter().map(|e| async { (e.url.clone(), e.client.metadata(model, version, METADATA_TIMEOUT).await) }),
    )
    .await
}

/// What the answers declare, to tell a change: each worker's versions and tensors (not its
/// parameters: the memory estimate moves as the worker learns).
fn declared(answers: &[(String, Result<ModelMetadata, CallError>)]) -> Option<String> {
    let mut found: Vec<String> = answers
        .iter()
        .filter_map(|(url, answer)| answer.as_ref().ok().map(|m| format!("{url} {:?} {:?} {:?}", m.versions, m.inputs, m.outputs)))
        .collect();
    found.sort();
    (!found.is_empty()).then(|| found.join("\n"))
}

/// Watches `checks` (every model of every task) for as long as the gateway runs: see the
/// module's documentation.
pub async fn watch(checks: Vec<Pending>) {
    let mut seen: Vec<Option<String>> = vec![None; checks.len()];
    let mut misfits: Vec<Vec<String>> = vec![Vec::new(); checks.len()];
    loop {
        tokio::time::sleep(LATER_INTERVAL).await;
        let rounds = futures::future::join_all(checks.iter().map(answers)).await;
        let mut changed = false;
        for (i, (check, answers)) in checks.iter().zip(rounds).enumerate() {
            let Some(now) = declared(&answers) else { continue };
            if seen[i].as_ref() == Some(&now) {
                continue;
            }
            seen[i] = Some(now);
            misfits[i] = match judge(&check.task, &check.used, answers) {
                Round::Answered(verdict) => verdict.misfits,
                Round::Refused(_) | Round::Waiting(_) => Vec::new(),
            };
            changed = true;
        }
        if !changed {
            continue;
        }
        for (i, check) in checks.iter().enumerate() {
            // A task's first check speaks for all of its models.
            if checks[..i].iter().any(|c| Arc::ptr_eq(&c.owner, &check.owner)) {
                continue;
            }
            let found: Vec<&String> =
                checks.iter().zip(&misfits).filter(|(c, _)| Arc::ptr_eq(&c.owner, &check.owner)).flat_map(|(_, m)| m).collect();
            let task = &check.owner;
            match (task.misfit(), found.is_empty()) {
                (false, false) => {
                    let listed: Vec<&str> = found.iter().map(|m| m.as_str()).collect();
                    tracing::error!(
                        task = %task.name,
                        misfits = %listed.join("\n"),
                        "a model the task calls changed and the task no longer fits it: its partitions are PAUSED until it fits again"
                    );
                    task.set_misfit(true);
                }
                (true, true) => {
                    tracing::info!(task = %task.name, "the task fits its models again: its partitions resume");
                    task.set_misfit(false);
                }
                _ => {}
            }
        }
    }
}

/// A round from each worker's answer.
fn judge(task: &str, used: &ModelUse, answers: Vec<(String, Result<ModelMetadata, CallError>)>) -> Round {
    let mut verdict = fit::Verdict::default();
    let mut answered = false;
    let (mut refused, mut waiting) = (Vec::new(), Vec::new());
    for (url, answer) in answers {
        match answer {
            Ok(metadata) => {
                answered = true;
                let found = fit::check(task, used, &metadata);
                let of = |m: String| format!("{m} (metadata of {url})");
                verdict.misfits.extend(found.misfits.into_iter().map(of));
                verdict.warnings.extend(found.warnings.into_iter().map(of));
            }
            Err(e @ (CallError::Rejected { .. } | CallError::BadResponse(_))) => refused.push(format!("{url}: {e}")),
            Err(e) => waiting.push(format!("{url}: {e}")),
        }
    }
    if answered {
        Round::Answered(verdict)
    } else if waiting.is_empty() {
        Round::Refused(refused.join("; "))
    } else {
        Round::Waiting(waiting.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use vramgate_shared::oip::{DataType, TensorMetadata};

    use super::*;
    use crate::tasks::fit::{Sent, SentTensor};

    fn used() -> ModelUse {
        let rule = serde_json::from_str(r#"{"name": "length", "post": ["softmax"]}"#).expect("rule");
        ModelUse { inputs: Sent::One(SentTensor::new("tensor.input", "tokens", Some(DataType::Int64), None)), outputs: crate::tasks::outputs::asked([&rule]) }
    }

    fn metadata(length: &str) -> ModelMetadata {
        let tensor = |name: &str, datatype: &str| TensorMetadata { name: name.into(), datatype: datatype.into(), shape: vec![-1] };
        ModelMetadata { name: "m".into(), inputs: vec![tensor("tokens", "INT64")], outputs: vec![tensor("length", length)], ..Default::default() }
    }

    #[test]
    fn every_worker_with_metadata_is_judged_and_others_only_delay() {
        let refused = || Err(CallError::Rejected { status: 404, message: "unknown model 'm'".into() });
        let down = || Err(CallError::Unreachable { message: "connection refused".into() });
        let round = |answers: Vec<(&str, Result<ModelMetadata, CallError>)>| {
            judge("t", &used(), answers.into_iter().map(|(u, a)| (u.to_string(), a)).collect())
        };
        match round(vec![("http://a", Ok(metadata("FP32"))), ("http://b", Ok(metadata("INT64"))), ("http://c", down())]) {
            Round::Answered(verdict) => {
                assert_eq!(verdict.misfits.len(), 1, "{verdict:?}");
                assert!(verdict.misfits[0].contains("softmax needs a floating-point output") && verdict.misfits[0].ends_with("(metadata of http://b)"));
            }
            _ => panic!("answered"),
        }
        assert!(matches!(round(vec![("http://a", refused()), ("http://b", down())]), Round::Waiting(w) if w.contains("http://b")));
        assert!(matches!(round(vec![("http://a", refused())]), Round::Refused(r) if r.contains("unknown model 'm'")));
    }
}
