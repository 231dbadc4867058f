//! The published event contract (`schemas/v1/`, issue 43) held against what the services
//! write: every result and dead letter the integration tests read through [`crate::collect`]
//! or [`crate::Collector`] is validated against its committed JSON Schema, so an event whose
//! fields drift from the contract fails the test that read it, whatever that test checks.
//!
//! A record of a `*.results` topic is a result (`result.json`); the built-in tasks' outputs are
//! held to their own schemas too: `voice` to `voice-output.json`, `image` to
//! `image-output.json`. A record of a `*.dlq` topic is a dead letter (`dead-letter.json`).
//! Other topics (requests, the tests' own) are not checked. The outputs of configured tasks
//! (`[[outputs]]` rows) have no schema of their own yet: only their envelope is checked.

use std::sync::OnceLock;

use serde_json::Value;

use crate::repo_root;

/// Longest account of a violation kept for a failure message.
const MAX_REPORT_CHARS: usize = 2000;

fn validator(name: &str) -> &'static jsonschema::Validator {
    static SCHEMAS: OnceLock<Vec<(String, jsonschema::Validator)>> = OnceLock::new();
    let all = SCHEMAS.get_or_init(|| {
        ["result", "dead-letter", "voice-output", "image-output"]
            .into_iter()
            .map(|name| {
                let path = repo_root().join("schemas/v1").join(format!("{name}.json"));
                let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                let schema: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
                let compiled = jsonschema::validator_for(&schema).unwrap_or_else(|e| panic!("{} is not a schema: {e}", path.display()));
                (name.to_string(), compiled)
            })
            .collect()
    });
    &all.iter().find(|(n, _)| n == name).expect("a committed schema").1
}

/// Every way `value` breaks schema `name`, as one line each.
fn violations(name: &str, value: &Value) -> Vec<String> {
    validator(name).iter_errors(value).map(|e| format!("{} at '{}'", e, e.instance_path)).collect()
}

/// Checks a record of `topic` against the contract (see the module doc); `Err` says which
/// schema it breaks and how.
pub fn check_record(topic: &str, value: &Value) -> Result<(), String> {
    let mut broken = Vec::new();
    if topic.ends_with(".results") {
        broken.extend(violations("result", value).into_iter().map(|v| format!("result.json: {v}")));
        let output = value.get("output").unwrap_or(&Value::Null);
        match value.get("task").and_then(Value::as_str) {
            Some("voice") => broken.extend(violations("voice-output", output).into_iter().map(|v| format!("voice-output.json: {v}"))),
            Some("image") => broken.extend(violations("image-output", output).into_iter().map(|v| format!("image-output.json: {v}"))),
            _ => {}
        }
    } else if topic.ends_with(".dlq") {
        broken.extend(violations("dead-letter", value).into_iter().map(|v| format!("dead-letter.json: {v}")));
    }
    if broken.is_empty() {
        return Ok(());
    }
    let mut report = format!("a record of {topic} breaks the published contract (schemas/v1): {}", broken.join("; "));
    report.truncate(report.char_indices().nth(MAX_REPORT_CHARS).map_or(report.len(), |(i, _)| i));
    Err(report)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn results_and_dead_letters_are_held_to_their_schemas() {
        let result = json!({"version": 1, "id": "a", "task": "voice", "status": "ok", "model": "silero_vad", "attempts": 1,
            "timings_ms": {"convert": 2.0, "gpu_wait": 1.0, "inference": 3.0, "total": 6.0},
            "output": {"segments": [], "duration_seconds": 1.0, "input_sample_rate_hz": 16000, "input_channels": 1}});
        let checked = check_record("x.results", &result);
        assert!(checked.is_ok(), "{checked:?}");
        let mut no_id = result.clone();
        no_id.as_object_mut().expect("object").remove("id");
        assert!(check_record("x.results", &no_id).expect_err("no id").contains("result.json"));
        let mut bad_output = result.clone();
        bad_output["output"]["segments"] = json!("none");
        assert!(check_record("x.results", &bad_output).expect_err("segments").contains("voice-output.json"));
        assert!(check_record("x.dlq", &json!({"id": 3})).expect_err("not a dead letter").contains("dead-letter.json"));
        assert!(check_record("x.requests", &json!("anything")).is_ok(), "requests are not checked here");
    }
}
