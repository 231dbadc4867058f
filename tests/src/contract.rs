//! The published event contract (`schemas/v1/`, issue 43) held against what the services
//! write: every result and dead letter the integration tests read through [`crate::collect`]
//! or [`crate::Collector`] is validated against its committed JSON Schema, so an event whose
//! fields drift from the contract fails the test that read it, whatever that test checks.
//!
//! A record of a `*.results` topic is a result (`result.json`), and its `output` is held to
//! the schema of its kind: the `voice` task's to `voice-output.json`; the `image` task's to
//! `image-output.json`, or in `tensor` mode (an output of `input` and `outputs`) to
//! `task-output.json`, as every other task's (the configured tasks' `[[outputs]]` rows). A
//! result of a video or a batch of frames (`output.frames`) is held to `frames-output.json`,
//! and each frame's `output` to its kind as above. A record of a `*.dlq` topic is a dead letter (`dead-letter.json`). Other topics (requests, the
//! tests' own) are not checked.

use std::sync::OnceLock;

use serde_json::Value;

use crate::repo_root;

/// Longest account of a violation kept for a failure message.
const MAX_REPORT_CHARS: usize = 2000;

fn validator(name: &str) -> &'static jsonschema::Validator {
    static SCHEMAS: OnceLock<Vec<(String, jsonschema::Validator)>> = OnceLock::new();
    let all = SCHEMAS.get_or_init(|| {
        ["result", "dead-letter", "voice-output", "image-output", "task-output", "frames-output"]
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
    validator(name).iter_errors(value).map(|e| format!("{} at '{}'", e, e.instance_path())).collect()
}

/// Checks a record of `topic` against the contract (see the module doc); `Err` says which
/// schema it breaks and how.
pub fn check_record(topic: &str, value: &Value) -> Result<(), String> {
    let mut broken = Vec::new();
    if topic.ends_with(".results") {
        broken.extend(violations("result", value).into_iter().map(|v| format!("result.json: {v}")));
        let output = value.get("output").unwrap_or(&Value::Null);
        let kind_of = |output: &Value| match value.get("task").and_then(Value::as_str) {
            Some("voice") => "voice-output",
            Some("image") if output.get("outputs").is_none() => "image-output",
            _ => "task-output",
        };
        match output.get("frames") {
            // A video's or a batch's: the entries' shape, then each frame's output as its kind.
            Some(frames) => {
                broken.extend(violations("frames-output", output).into_iter().map(|v| format!("frames-output.json: {v}")));
                for (i, frame) in frames.as_array().into_iter().flatten().enumerate() {
                    if let Some(one) = frame.get("output") {
                        let kind = kind_of(one);
                        broken.extend(violations(kind, one).into_iter().map(|v| format!("{kind}.json (frame {i}): {v}")));
                    }
                }
            }
            None => {
                let kind = kind_of(output);
                broken.extend(violations(kind, output).into_iter().map(|v| format!("{kind}.json: {v}")));
            }
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
        let mut configured = result.clone();
        configured["task"] = json!("classify");
        configured["output"] = json!({"input": {"width": 2}, "outputs": {
            "logits": {"shape": [1], "top_k": [[{"index": 3, "score": 0.9, "label": "cat"}]]},
            "p": {"shape": [2], "data": [true, false]},
            "speech_prob": {"segments": [{"start_seconds": 0.1, "end_seconds": 0.5}]}}});
        let checked = check_record("x.results", &configured);
        assert!(checked.is_ok(), "{checked:?}");
        configured["output"]["outputs"]["logits"]["top_k"][0][0]["extra"] = json!(1);
        assert!(check_record("x.results", &configured).expect_err("unknown key").contains("task-output.json"));
        assert!(check_record("x.requests", &json!("anything")).is_ok(), "requests are not checked here");
    }

    /// The request schema's typed `options` and the gateway's own reading of them agree, value
    /// by value: a producer that validates against `request.json` is not refused for its
    /// options, and the gateway refuses every options object the schema refuses.
    #[test]
    fn the_request_schema_and_the_gateway_agree_on_each_tasks_options() {
        use vramgate_gateway::tasks::image::{image_options, ImageOptions};
        use vramgate_gateway::tasks::voice::VoiceOptions;
        let path = repo_root().join("schemas/v1/request.json");
        let schema: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("request.json")).expect("JSON");
        let request = jsonschema::validator_for(&schema).expect("a schema");
        let event = |task: &str, options: &Value| json!({"id": "o", "task": task, "input": {"uri": "file:///x.wav"}, "options": options});
        let voice = [
            json!(null),
            json!({}),
            json!({"threshold": 0.6}),
            json!({"threshold": 0}),
            json!({"threshold": 1}),
            json!({"threshold": 1.5}),
            json!({"threshold": -0.1}),
            json!({"threshold": "high"}),
            json!({"threshold": null}),
            json!({"min_speech_ms": 250, "min_silence_ms": 100, "speech_pad_ms": 30}),
            json!({"min_speech_ms": -1}),
            json!({"min_silence_ms": 4_294_967_295u64}),
            json!({"min_silence_ms": 4_294_967_296u64}),
            json!({"speech_pad_ms": 1.5}),
            json!({"speech_pad_ms": 30.0}),
            json!({"min_speech_ms": -250.0}),
            json!({"min_silence_ms": 4_294_967_296.0}),
            json!({"threshold": 1.000_000_01}),
            json!({"threshold": 1e-50}),
            json!({"threshhold": 0.5}),
            json!([0.5]),
            json!("fast"),
        ];
        let image = [
            json!(null),
            json!({"threshold": 0.9, "nms_iou": 0.3}),
            json!({"nms_iou": 1.01}),
            json!({"max_faces": 1}),
            json!({"max_faces": 0}),
            json!({"max_faces": 5.0}),
            json!({"max_faces": 0.0}),
            json!({"min_face_size": 12.5}),
            json!({"nms_iou": 1.000_000_01}),
            json!({"min_face_size": 12}),
            json!({"min_face_size": 11}),
            json!({"min_face_size": 100_000}),
            json!({"min_face_size": 100_001}),
            json!({"thresholds": [0.6, 0.7, 0.7]}),
            json!({"thresholds": [0.6, 0.7]}),
            json!({"thresholds": [0.6, 0.7, 1.2]}),
            json!({"thresholds": [0.6, 0.7, 0.7, 0.7]}),
            json!({"faces": 3}),
            json!([0.9]),
        ];
        let base = ImageOptions::default();
        let mut refused = 0;
        for (task, options, by_gateway) in voice
            .iter()
            .map(|o| ("voice", o, VoiceOptions::parse(Some(o)).is_ok()))
            .chain(image.iter().map(|o| ("image", o, image_options(&base, Some(o)).is_ok())))
        {
            let by_schema = request.is_valid(&event(task, options));
            assert_eq!(by_schema, by_gateway, "{task} options {options}: the schema says valid {by_schema}, the gateway {by_gateway}");
            refused += usize::from(!by_schema);
        }
        assert!(refused >= 20, "the cases include refusals of every kind: {refused}");
        // A configured task's options are the gateway's to refuse (it takes none); the schema
        // types only the built-in tasks'.
        assert!(request.is_valid(&event("classify", &json!({"threshold": 7}))));
    }
}
