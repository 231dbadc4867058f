//! The event contract as JSON Schema (draft 2020-12), generated from the wire types in
//! [`crate::events`] with `schemars`, and committed under `schemas/v<SCHEMA_VERSION>/` for
//! producers and consumers in other languages. A test here fails when the types and the
//! committed files drift apart; `VRAMGATE_WRITE_SCHEMAS=1 cargo test -p vramgate-shared schema`
//! writes them anew.
//!
//! A request's `options` are task-specific: `request.json` holds the built-in tasks' kinds
//! ([`VoiceRequestOptions`], [`ImageRequestOptions`]) under `$defs`, and applies each to a
//! request whose `task` is that task's name (`voice`, `image`). A deployment that names those
//! tasks otherwise finds the same definitions there; a configured task takes no options.
//!
//! A result's `output` is task-specific: the schema gives the built-in tasks' outputs
//! ([`VoiceOutput`], [`ImageOutput`]) as files of their own; a configured task's outputs
//! (`docs/models.md`) are not described yet, so `output` itself is any JSON object.

use schemars::{schema_for, Schema};
use serde_json::json;

use crate::events::{
    DeadLetterEvent, FramesOutput, ImageOutput, ImageRequestOptions, RequestEvent, ResultEvent, VoiceOutput, VoiceRequestOptions,
    SCHEMA_VERSION,
};

/// Every schema of the contract: its file name under `schemas/v<version>/` and the schema.
pub fn schemas() -> Vec<(&'static str, Schema)> {
    let mut all = vec![
        ("request.json", with_task_options(schema_for!(RequestEvent))),
        ("result.json", schema_for!(ResultEvent)),
        ("dead-letter.json", schema_for!(DeadLetterEvent)),
        ("voice-output.json", schema_for!(VoiceOutput)),
        ("image-output.json", schema_for!(ImageOutput)),
        ("frames-output.json", schema_for!(FramesOutput)),
    ];
    for (file, schema) in &mut all {
        schema.insert("$id".into(), format!("https://vramgate.invalid/schemas/v{SCHEMA_VERSION}/{file}").into());
    }
    all
}

/// The request's schema with each built-in task's options under `$defs`, applied to the
/// requests of that task by `if`/`then` (null stays allowed: the gateway reads it as none).
fn with_task_options(mut request: Schema) -> Schema {
    let mut rules = Vec::new();
    for (task, name, mut options) in [
        ("voice", "VoiceRequestOptions", schema_for!(VoiceRequestOptions)),
        ("image", "ImageRequestOptions", schema_for!(ImageRequestOptions)),
    ] {
        options.remove("$schema");
        let defs = request.ensure_object().entry("$defs").or_insert_with(|| json!({}));
        defs[name] = options.to_value();
        rules.push(json!({
            "if": { "properties": { "task": { "const": task } }, "required": ["task"] },
            "then": { "properties": { "options": { "anyOf": [{ "$ref": format!("#/$defs/{name}") }, { "type": "null" }] } } }
        }));
    }
    request.insert("allOf".into(), rules.into());
    request
}

/// A schema as committed: pretty JSON with a final newline.
pub fn render(schema: &Schema) -> String {
    let mut text = serde_json::to_string_pretty(schema).expect("a schema serialises");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn folder() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../schemas/v{SCHEMA_VERSION}"))
    }

    #[test]
    fn committed_schemas_match_the_types() {
        let write = std::env::var_os("VRAMGATE_WRITE_SCHEMAS").is_some();
        let mut drifted = Vec::new();
        for (file, schema) in schemas() {
            let path = folder().join(file);
            let text = render(&schema);
            if write {
                std::fs::create_dir_all(folder()).expect("creating schemas/");
                std::fs::write(&path, &text).expect("writing a schema");
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                drifted.push(path.display().to_string());
            }
        }
        assert!(
            drifted.is_empty(),
            "the event types and the committed schemas differ: {drifted:?}; if the change is meant, run \
             VRAMGATE_WRITE_SCHEMAS=1 cargo test -p vramgate-shared schema, and bump SCHEMA_VERSION when it is not \
             backward compatible"
        );
    }

    #[test]
    fn the_readme_examples_fit_their_kinds() {
        // The README's request and dead letter, read back through the types the schemas come from.
        let request: RequestEvent = serde_json::from_str(
            r#"{"id": "call-17", "task": "voice", "input": {"uri": "file:///data/call-17.wav"}, "options": {"threshold": 0.6}}"#,
        )
        .expect("the README's request parses");
        assert_eq!(request.version, SCHEMA_VERSION);
        let request_schema = serde_json::to_value(schema_for!(RequestEvent)).expect("serialises");
        assert_eq!(request_schema["required"], serde_json::json!(["id", "task", "input"]));
        assert_eq!(request_schema["additionalProperties"], serde_json::json!(false));
        // Its batch of frames, and a video's result.
        let batch: RequestEvent = serde_json::from_str(
            r#"{"id": "cam-7-0412", "task": "image", "input": {"frames": [
                {"uri": "file:///data/cam-7/0412-000.jpg"}, {"uri": "s3://frames/cam-7/0412-001.jpg"}]}}"#,
        )
        .expect("the README's batch parses");
        assert!(matches!(batch.input, crate::events::InputRef::Frames { frames } if frames.len() == 2));
        let video: FramesOutput = serde_json::from_str(
            r#"{"frames": [{"index": 0, "pts_seconds": 0.0, "output": {"faces": [], "width": 400, "height": 300, "format": "ppm"}},
                {"index": 1, "pts_seconds": 10.0, "error": {"kind": "worker_unavailable", "stage": "infer", "message": "m"}}],
               "video": {"container": "mov,mp4,m4a,3gp,3g2,mj2", "codec": "h264", "width": 400, "height": 300,
                         "duration_seconds": 53.48, "policy": "intra", "truncated": false}}"#,
        )
        .expect("the README's video result parses");
        assert_eq!((video.frames.len(), video.video.map(|v| v.codec)), (2, Some("h264".to_string())));
    }
}
