//! Kafka event schemas: what producers write to `<task>.requests`, and what the gateway writes
//! to `<task>.results` and `<task>.dlq`.
//!
//! These types are the contract users depend on, so they are versioned: every record carries
//! `"version"`. Requests may omit it (it defaults to [`SCHEMA_VERSION`]); a request from a newer
//! producer than this build understands is rejected with a clear error instead of being half-read.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The schema version this build writes and the highest it reads.
pub const SCHEMA_VERSION: u32 = 1;

fn default_version() -> u32 {
    SCHEMA_VERSION
}

/// A request, as a producer writes it to `<task>.requests`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RequestEvent {
    #[serde(default = "default_version")]
    pub version: u32,
    /// The producer's id for this request; results and dead letters carry it back.
    pub id: String,
    /// The task type, e.g. `voice`; must match the topic the record was read from.
    pub task: String,
    pub input: InputRef,
    /// Task-specific options, a JSON object: the voice task's are `VoiceRequestOptions`, the
    /// image task's (faces and proposals modes) `ImageRequestOptions` (both under `$defs` in
    /// the published schema); the configured tasks take none. Unknown keys are an error for the
    /// task that reads them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<serde_json::Value>,
}

/// The voice task's `options`: this request's speech-segment parameters, each in place of the
/// task's own (`[tasks.voice.segments]`). Unknown keys are refused.
///
/// Numbers are read as JSON Schema reads them, so that whatever validates against the published
/// schema is accepted: a probability is checked as the double it was written as (1.00000001 is
/// above 1, though it rounds to 1 as a float), and a whole number written with a fraction of
/// zero (`250.0`, what Python writes for a float) is an integer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VoiceRequestOptions {
    /// The speech probability from which a 32 ms window counts as speech.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub threshold: Option<f64>,
    /// Speech shorter than this, in ms, is not a segment.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "whole::option_u32")]
    #[schemars(range(max = u32::MAX))]
    pub min_speech_ms: Option<u32>,
    /// Silence at least this long, in ms, ends a segment.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "whole::option_u32")]
    #[schemars(range(max = u32::MAX))]
    pub min_silence_ms: Option<u32>,
    /// Each segment is widened by this many ms on both sides.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "whole::option_u32")]
    #[schemars(range(max = u32::MAX))]
    pub speech_pad_ms: Option<u32>,
}

/// The image task's `options` (its `faces` and `proposals` modes): this request's detection
/// parameters, each in place of the task's own (`[tasks.image.image]`). Unknown keys are
/// refused; numbers are read as the voice task's options read them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ImageRequestOptions {
    /// `proposals`: the face probability a box must reach.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub threshold: Option<f64>,
    /// Boxes overlapping a better one by more than this intersection over union are dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub nms_iou: Option<f64>,
    /// At most this many faces are reported, the highest-scored ones.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "whole::option_u32")]
    #[schemars(range(min = 1, max = u32::MAX))]
    pub max_faces: Option<u32>,
    /// `faces`: the smallest face looked for, in pixels.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "whole::option_u32")]
    #[schemars(range(min = 12, max = 100_000))]
    pub min_face_size: Option<u32>,
    /// `faces`: the face probability P-Net (at least), R-Net and O-Net (more than) must see.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(inner(range(min = 0.0, max = 1.0)))]
    pub thresholds: Option<[f64; 3]>,
}

/// Whole numbers as JSON Schema counts them: `250` and `250.0` alike.
mod whole {
    use serde::de::{Deserialize, Deserializer, Error, Unexpected};

    pub fn option_u32<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u32>, D::Error> {
        let Some(number) = Option::<serde_json::Number>::deserialize(deserializer)? else { return Ok(None) };
        let expected = "a whole number from 0 to 4294967295";
        if let Some(n) = number.as_u64() {
            return u32::try_from(n).map(Some).map_err(|_| D::Error::invalid_value(Unexpected::Unsigned(n), &expected));
        }
        if let Some(n) = number.as_i64() {
            return Err(D::Error::invalid_value(Unexpected::Signed(n), &expected));
        }
        match number.as_f64() {
            Some(f) if f.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&f) => Ok(Some(f as u32)),
            Some(f) => Err(D::Error::invalid_value(Unexpected::Float(f), &expected)),
            None => Err(D::Error::custom(format!("{number} is not a number this build reads"))),
        }
    }
}

/// Where the input bytes of a request are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged, deny_unknown_fields)]
pub enum InputRef {
    /// A `file://` URI, resolved under the gateway's configured input root, or an
    /// `s3://bucket/key` object in one of the buckets the gateway reads (`s3.buckets`).
    Uri { uri: String },
    /// The bytes themselves, standard base64.
    Inline { data_b64: String },
    /// Several pictures for a task that takes pictures (the frames an upstream step extracted
    /// from a video, say): each is converted, admitted and answered on its own, and the result
    /// has one entry per frame, in this order ([`FramesOutput`]). Bounded by the task's
    /// `video.max_batch_frames` and `video.max_batch_bytes`.
    Frames { frames: Vec<FrameRef> },
}

/// One picture of an [`InputRef::Frames`] batch: a URI or the bytes themselves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged, deny_unknown_fields)]
pub enum FrameRef {
    Uri { uri: String },
    Inline { data_b64: String },
}

impl From<FrameRef> for InputRef {
    fn from(frame: FrameRef) -> Self {
        match frame {
            FrameRef::Uri { uri } => InputRef::Uri { uri },
            FrameRef::Inline { data_b64 } => InputRef::Inline { data_b64 },
        }
    }
}

/// Time spent in each stage of one request, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TimingsMs {
    /// Reading and converting the input on the CPU pool.
    pub convert: f64,
    /// Waiting for permission to call the worker.
    pub gpu_wait: f64,
    /// The worker call, network included.
    pub inference: f64,
    /// From the record's arrival in the gateway to its result being ready to produce.
    pub total: f64,
}

/// A successful result, written to `<task>.results`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ResultEvent {
    pub version: u32,
    pub id: String,
    pub task: String,
    /// Always `"ok"`; failures go to the dead-letter topic instead.
    pub status: String,
    /// The model that produced the output, as the worker names it; for a task that calls
    /// several models in turn, those it called, in order, joined by commas (an image too small
    /// for P-Net's window calls none: empty).
    pub model: String,
    /// The version of each model in `model`, in the same order and joined the same way, as
    /// the worker named it in its answer (`"2"`, or `"1,1,1"` for the face cascade). A model
    /// that answered in two versions within one event (a rollout between its calls) is in
    /// `model` twice, once with each. Empty where `model` is.
    #[serde(default)]
    pub model_version: String,
    /// Task-specific output, e.g. [`VoiceOutput`].
    pub output: serde_json::Value,
    pub timings_ms: TimingsMs,
    /// How many worker calls this result took (1 when nothing was retried).
    pub attempts: u32,
}

/// The output of the `voice` task: where speech is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct VoiceOutput {
    pub segments: Vec<SpeechSegment>,
    /// Duration of the input audio.
    pub duration_seconds: f64,
    /// The input's own sample rate and channel count, before conversion to 16 kHz mono.
    pub input_sample_rate_hz: u32,
    pub input_channels: u16,
}

/// One stretch of speech, in seconds from the start of the input.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SpeechSegment {
    pub start_seconds: f64,
    pub end_seconds: f64,
}

/// The output of the `image` task: faces found by the detector, in the pixel coordinates of
/// the input image as it is meant to be viewed (after its EXIF orientation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ImageOutput {
    pub faces: Vec<FaceBox>,
    /// Size of the input image after its EXIF orientation.
    pub width: u32,
    pub height: u32,
    /// The decoded format: `png`, `jpeg` or `webp`; `ppm` for a video's frame.
    pub format: String,
}

/// The output of a picture task for a batch of frames or a video: one entry per frame, in
/// frame order. Each entry holds the task's usual output for that frame, or why that frame
/// failed while the others were answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FramesOutput {
    pub frames: Vec<FrameEntry>,
    /// What the gateway read of the video, for an event that named one; absent for a batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub video: Option<VideoInfo>,
}

/// One frame's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FrameEntry {
    /// The frame's place: in the batch, or among the frames the video's policy chose (from 0).
    pub index: u32,
    /// The frame's presentation time in the video, in seconds, as the container states it
    /// (`ffprobe`'s `pts_time`); absent for a batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pts_seconds: Option<f64>,
    /// The task's output for this frame, as it is for one picture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<serde_json::Value>,
    /// Why this frame has no output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
}

/// A video as the gateway read it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct VideoInfo {
    /// The demuxer's name for the container, e.g. `mov,mp4,m4a,3gp,3g2,mj2` or `matroska,webm`.
    pub container: String,
    /// The video stream's codec, e.g. `h264`, `vp8`.
    pub codec: String,
    pub width: u32,
    pub height: u32,
    /// The container's duration, when it states one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_seconds: Option<f64>,
    /// How the frames were chosen: `intra`, `every_seconds=S` or `scene_change=T`.
    pub policy: String,
    /// Whether the policy chose more frames than the task's `video.max_frames`, of which only
    /// the first were answered.
    pub truncated: bool,
    /// Why decoding stopped before the end (a frame the decoder could not read, its time
    /// bound), when it did; the frames before were answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<ErrorInfo>,
}

/// One detected face: a box in input pixels and the model's face probability; with MTCNN's
/// whole cascade, also its five landmarks.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FaceBox {
    pub x1: f32,
    pub y1: f32,
    pub x2: f32,
    pub y2: f32,
    pub score: f32,
    /// `[x, y]` of the left eye, right eye, nose, left and right mouth corner (as the image is
    /// viewed); absent from P-Net's proposals (`mode = "proposals"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub landmarks: Option<[[f32; 2]; 5]>,
}

/// Why a record went to the dead-letter topic. A small fixed set, so consumers can route on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The record's value is not JSON.
    InvalidJson,
    /// The value is JSON but not a valid request (missing field, wrong type, newer version).
    InvalidRequest,
    /// The request names a task this gateway does not serve on that topic.
    UnknownTask,
    /// The input is in a form this task does not take (a URI scheme the gateway does not read,
    /// a bucket it was not given, an image format without a decoder here).
    UnsupportedInput,
    /// The input is a WAV file that cannot be decoded (corrupt, truncated, an unknown encoding).
    InvalidAudio,
    /// The input is an image that cannot be decoded (corrupt or truncated PNG/JPEG/WebP).
    InvalidImage,
    /// The input is a video that cannot be demuxed or decoded (corrupt, truncated, a stream
    /// the decoder refuses, a decoder that crashed on it), or that gave no frame.
    InvalidVideo,
    /// The input is larger than the configured limits (bytes, seconds of audio, pixels).
    InputTooLarge,
    /// The input file named by the request does not exist.
    InputNotFound,
    /// No longer written: a file outside the root is reported as `input_not_found`, so dead
    /// letters do not tell which paths exist. Kept so older dead letters still parse.
    InputOutsideRoot,
    /// The input could not be read for another reason (an IO error, bad base64).
    FetchFailed,
    /// The worker refused the request as invalid (HTTP 4xx).
    WorkerRejected,
    /// The model itself raised an error on this input, run alone on the worker (a token id
    /// past an embedding's size, a value out of the model's range): not retried, as it would
    /// raise again. The message is the model's.
    ModelError,
    /// The worker could not be reached or kept failing after all retries.
    WorkerUnavailable,
    /// The request did not finish within its deadline.
    Timeout,
    /// The record's result or dead letter was refused by the broker for good (larger than
    /// the topic takes, the topic missing or not writable); this trimmed dead letter stands
    /// in for it.
    OutputRejected,
    /// An output its `[[outputs]]` row stores in object storage could not be written there
    /// after the retries `[s3]` allows; the message names the object.
    StoreFailed,
    /// A bug in vramgate; the message says where.
    Internal,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidJson => "invalid_json",
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::UnknownTask => "unknown_task",
            ErrorKind::UnsupportedInput => "unsupported_input",
            ErrorKind::InvalidAudio => "invalid_audio",
            ErrorKind::InvalidImage => "invalid_image",
            ErrorKind::InvalidVideo => "invalid_video",
            ErrorKind::InputTooLarge => "input_too_large",
            ErrorKind::InputNotFound => "input_not_found",
            ErrorKind::InputOutsideRoot => "input_outside_root",
            ErrorKind::FetchFailed => "fetch_failed",
            ErrorKind::WorkerRejected => "worker_rejected",
            ErrorKind::ModelError => "model_error",
            ErrorKind::WorkerUnavailable => "worker_unavailable",
            ErrorKind::Timeout => "timeout",
            ErrorKind::OutputRejected => "output_rejected",
            ErrorKind::StoreFailed => "store_failed",
            ErrorKind::Internal => "internal",
        }
    }
}

/// The pipeline stage in which a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Parse,
    Fetch,
    Convert,
    Infer,
    Postprocess,
    /// Writing outputs to object storage (`[[outputs]]` rows with `store`).
    Store,
    /// Writing the output record.
    Produce,
}

impl Stage {
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Parse => "parse",
            Stage::Fetch => "fetch",
            Stage::Convert => "convert",
            Stage::Infer => "infer",
            Stage::Postprocess => "postprocess",
            Stage::Store => "store",
            Stage::Produce => "produce",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorInfo {
    pub kind: ErrorKind,
    /// A sentence a person can act on.
    pub message: String,
    pub stage: Stage,
}

/// Where the failed record came from, and its bytes, so it can be replayed as it was.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SourceRecord {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// The record's key, standard base64; absent when the record had none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_b64: Option<String>,
    /// The record's value, standard base64; absent when the record had none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_b64: Option<String>,
}

/// A request that could not be served, written to `<task>.dlq`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeadLetterEvent {
    pub version: u32,
    /// The request's id, when the record was readable enough to have one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    pub error: ErrorInfo,
    pub attempts: u32,
    pub source: SourceRecord,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::de::DeserializeOwned;

    /// Serialises `value`, checks the JSON matches `expected`, and reads it back unchanged.
    fn check_round_trip<T>(value: &T, expected: serde_json::Value)
    where
        T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug,
    {
        let json = serde_json::to_value(value).expect("event types always serialise");
        assert_eq!(json, expected);
        let back: T = serde_json::from_value(json).expect("what we write we can read");
        assert_eq!(&back, value);
    }

    #[test]
    fn request_round_trips_both_input_forms() {
        let by_uri = RequestEvent {
            version: 1,
            id: "a-1".into(),
            task: "voice".into(),
            input: InputRef::Uri { uri: "file:///data/a.wav".into() },
            options: None,
        };
        check_round_trip(
            &by_uri,
            serde_json::json!({"version": 1, "id": "a-1", "task": "voice",
                               "input": {"uri": "file:///data/a.wav"}}),
        );
        let inline = RequestEvent {
            input: InputRef::Inline { data_b64: "UklGRg==".into() },
            options: Some(serde_json::json!({"threshold": 0.6})),
            ..by_uri
        };
        check_round_trip(
            &inline,
            serde_json::json!({"version": 1, "id": "a-1", "task": "voice",
                               "input": {"data_b64": "UklGRg=="}, "options": {"threshold": 0.6}}),
        );
    }

    /// JSON numbers are read correctly rounded (serde_json's `float_roundtrip`, turned on in the
    /// workspace's `Cargo.toml`), so what is written reads back as it was: without it, serde_json
    /// reads a number of more than 19 digits, or one of a large or small exponent, one unit in
    /// the last place off (about a third of all f64 bit patterns, from their own shortest form).
    /// The fuzz target `event_json` found it with the first of these options.
    #[test]
    fn numbers_read_back_as_they_were_written() {
        let options = [("min_silence_ms", "10088888888888888888888888888888888888"), ("a", "-1.81996730402717e-179"), ("b", "-1.603964615428183e143")];
        let fields: Vec<String> = options.iter().map(|(key, number)| format!("\"{key}\":{number}")).collect();
        let text = format!(r#"{{"id":"i","task":"voice","input":{{"data_b64":"AA=="}},"options":{{{}}}}}"#, fields.join(","));
        let request: RequestEvent = serde_json::from_str(&text).expect("the request parses");
        let read = request.options.as_ref().expect("options");
        for (key, number) in options {
            let want: f64 = number.parse().expect("a float");
            assert_eq!(read[key].as_f64().map(f64::to_bits), Some(want.to_bits()), "{key}: {number} read as {}", read[key]);
        }
        let again: RequestEvent = serde_json::from_slice(&serde_json::to_vec(&request).expect("serialises")).expect("reads back");
        assert_eq!(again, request);
    }

    #[test]
    fn request_version_defaults_when_omitted() {
        let req: RequestEvent = serde_json::from_str(
            r#"{"id":"x","task":"voice","input":{"uri":"file:///a.wav"}}"#,
        )
        .expect("minimal request parses");
        assert_eq!(req.version, SCHEMA_VERSION);
    }

    #[test]
    fn request_rejects_unknown_fields_and_ambiguous_input() {
        for bad in [
            r#"{"id":"x","task":"voice","input":{"uri":"file:///a"},"extra":1}"#,
            r#"{"id":"x","task":"voice","input":{"uri":"file:///a","data_b64":"AA=="}}"#,
            r#"{"id":"x","task":"voice","input":{}}"#,
            r#"{"task":"voice","input":{"uri":"file:///a"}}"#,
        ] {
            assert!(serde_json::from_str::<RequestEvent>(bad).is_err(), "accepted {bad}");
        }
    }

    #[test]
    fn result_round_trips() {
        let output = VoiceOutput {
            segments: vec![SpeechSegment { start_seconds: 0.5, end_seconds: 1.25 }],
            duration_seconds: 2.0,
            input_sample_rate_hz: 44_100,
            input_channels: 2,
        };
        let result = ResultEvent {
            version: 1,
            id: "a-1".into(),
            task: "voice".into(),
            status: "ok".into(),
            model: "silero_vad".into(),
            model_version: "2".into(),
            output: serde_json::to_value(&output).expect("voice output serialises"),
            timings_ms: TimingsMs { convert: 1.5, gpu_wait: 0.0, inference: 12.0, total: 14.0 },
            attempts: 1,
        };
        check_round_trip(
            &result,
            serde_json::json!({
                "version": 1, "id": "a-1", "task": "voice", "status": "ok", "model": "silero_vad",
                "model_version": "2",
                "output": {"segments": [{"start_seconds": 0.5, "end_seconds": 1.25}],
                           "duration_seconds": 2.0, "input_sample_rate_hz": 44100,
                           "input_channels": 2},
                "timings_ms": {"convert": 1.5, "gpu_wait": 0.0, "inference": 12.0, "total": 14.0},
                "attempts": 1
            }),
        );
    }

    #[test]
    fn dead_letter_round_trips_with_and_without_id() {
        let with_id = DeadLetterEvent {
            version: 1,
            id: Some("a-1".into()),
            task: Some("voice".into()),
            error: ErrorInfo {
                kind: ErrorKind::FetchFailed,
                message: "file /data/a.wav does not exist".into(),
                stage: Stage::Fetch,
            },
            attempts: 0,
            source: SourceRecord {
                topic: "voice.requests".into(),
                partition: 2,
                offset: 17,
                key_b64: None,
                value_b64: Some("e30=".into()),
            },
        };
        check_round_trip(
            &with_id,
            serde_json::json!({
                "version": 1, "id": "a-1", "task": "voice",
                "error": {"kind": "fetch_failed", "message": "file /data/a.wav does not exist",
                          "stage": "fetch"},
                "attempts": 0,
                "source": {"topic": "voice.requests", "partition": 2, "offset": 17,
                           "value_b64": "e30="}
            }),
        );
        let without_id = DeadLetterEvent {
            id: None,
            task: None,
            error: ErrorInfo {
                kind: ErrorKind::InvalidJson,
                message: "expected value at line 1 column 1".into(),
                stage: Stage::Parse,
            },
            ..with_id
        };
        let json = serde_json::to_value(&without_id).expect("serialises");
        assert!(json.get("id").is_none());
        assert_eq!(json["error"]["kind"], "invalid_json");
    }

    #[test]
    fn error_kind_names_match_serde() {
        for kind in [
            ErrorKind::InvalidJson,
            ErrorKind::InvalidRequest,
            ErrorKind::UnknownTask,
            ErrorKind::UnsupportedInput,
            ErrorKind::InvalidAudio,
            ErrorKind::InvalidImage,
            ErrorKind::InvalidVideo,
            ErrorKind::InputTooLarge,
            ErrorKind::InputNotFound,
            ErrorKind::InputOutsideRoot,
            ErrorKind::FetchFailed,
            ErrorKind::WorkerRejected,
            ErrorKind::ModelError,
            ErrorKind::WorkerUnavailable,
            ErrorKind::Timeout,
            ErrorKind::OutputRejected,
            ErrorKind::StoreFailed,
            ErrorKind::Internal,
        ] {
            assert_eq!(serde_json::to_value(kind).expect("serialises"), kind.as_str());
        }
    }
}
