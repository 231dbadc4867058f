//! The event contract as JSON Schema (draft 2020-12), generated from the wire types in
//! [`crate::events`] with `schemars`, and committed under `schemas/v<SCHEMA_VERSION>/` for
//! producers and consumers in other languages. A test here fails when the types and the
//! committed files drift apart; `VRAMGATE_WRITE_SCHEMAS=1 cargo test -p vramgate-shared schema`
//! writes them anew.
//!
//! A result's `output` is task-specific: the schema gives the built-in tasks' outputs
//! ([`VoiceOutput`], [`ImageOutput`]) as files of their own; a configured task's outputs
//! (`docs/models.md`) are not described yet, so `output` itself is any JSON object.

use schemars::{schema_for, Schema};

use crate::events::{DeadLetterEvent, ImageOutput, RequestEvent, ResultEvent, VoiceOutput, SCHEMA_VERSION};

/// Every schema of the contract: its file name under `schemas/v<version>/` and the schema.
pub fn schemas() -> Vec<(&'static str, Schema)> {
    let mut all = vec![
        ("request.json", schema_for!(RequestEvent)),
        ("result.json", schema_for!(ResultEvent)),
        ("dead-letter.json", schema_for!(DeadLetterEvent)),
        ("voice-output.json", schema_for!(VoiceOutput)),
        ("image-output.json", schema_for!(ImageOutput)),
    ];
    for (file, schema) in &mut all {
        schema.insert("$id".into(), format!("https://vramgate.invalid/schemas/v{SCHEMA_VERSION}/{file}").into());
    }
    all
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
    }
}
