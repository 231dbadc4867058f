//! A record's value as the gateway reads it: `record::read_request` (JSON, the request's shape,
//! its id), then the request's `options` planned by every converter of the task table (each
//! task's own option checks), then its `input` opened as `record` opens it (`InputSource`:
//! the `file://` URI resolved beneath an empty root, inline base64 bounded and decoded).
//!
//! Checked: a rejection's message and echoed id stay bounded; an accepted request has an id of
//! 1 to 256 bytes and reads back from its own JSON unchanged (what producers and the
//! schema's round-trip tests rely on); a refused option is the request's fault
//! (`invalid_request`), never `internal`; inline input decodes to no more than the bytes
//! reserved for it before reading.

#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use vramgate_gateway::input::{FetchError, InputSource, Opened};
use vramgate_gateway::record::{read_request, MAX_ID_BYTES};
use vramgate_gateway::tasks::voice::{VoiceTask, WavOptions};
use vramgate_gateway::tasks::Converter;
use vramgate_shared::events::{ErrorKind, RequestEvent};
use vramgate_shared::telemetry::LOG_FIELD_MAX_BYTES;

/// The input limit of the gateway's default config (`input.max_input_bytes`).
const MAX_INPUT_BYTES: u64 = 64 << 20;

struct Gateway {
    converters: Vec<Box<dyn Converter>>,
    input: InputSource,
}

fn gateway() -> &'static Gateway {
    static GATEWAY: OnceLock<Gateway> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        let mut converters: Vec<Box<dyn Converter>> = vec![Box::new(VoiceTask::new(WavOptions::default()))];
        converters.extend(vramgate_fuzz::image_converters());
        converters.extend(vramgate_fuzz::audio_converters());
        converters.extend(vramgate_fuzz::tensor_converters());
        let root = vramgate_fuzz::scratch_dir("input-root");
        let input = InputSource::new(&root, MAX_INPUT_BYTES, Duration::from_secs(1)).expect("the empty input root opens");
        Gateway { converters, input }
    })
}

fuzz_target!(|data: &[u8]| {
    let gateway = gateway();
    let request = match read_request(data) {
        Ok(request) => request,
        Err(rejection) => {
            assert!(rejection.failure.message.len() <= 2 * LOG_FIELD_MAX_BYTES + 128, "{} bytes", rejection.failure.message.len());
            assert!(rejection.id.is_none_or(|id| id.len() <= MAX_ID_BYTES));
            assert!(rejection.task.is_none_or(|task| task.len() <= MAX_ID_BYTES));
            return;
        }
    };
    assert!(!request.id.is_empty() && request.id.len() <= MAX_ID_BYTES);
    let json = serde_json::to_vec(&request).expect("a request serialises");
    let again: RequestEvent = serde_json::from_slice(&json).expect("a request reads back from its own json");
    assert_eq!(again, request);

    for converter in &gateway.converters {
        if let Err(failure) = converter.plan(request.options.as_ref()) {
            assert_eq!(failure.kind, ErrorKind::InvalidRequest, "{}", failure.message);
        }
    }

    match gateway.input.open(request.input) {
        Ok(opened @ Opened::Inline(_)) => {
            let reserved = opened.size();
            if let Ok(bytes) = futures::executor::block_on(gateway.input.read(opened)) {
                assert!(bytes.len() as u64 <= reserved, "{} bytes read, {reserved} reserved", bytes.len());
            }
        }
        // Nothing is beneath the empty root to open.
        Ok(Opened::File { shown, .. }) => panic!("opened {shown} beneath an empty root"),
        // No bucket and no host is configured here: no URI may name an object.
        Ok(Opened::Named(named)) => panic!("named {} with no object storage configured", named.shown),
        Ok(Opened::Object(located)) => panic!("located {} with no object storage configured", located.shown),
        Err(FetchError::TooLarge { size, limit }) => assert!(size > limit),
        Err(_) => {}
    }
});
