//! The `voice` task: WAV bytes → 16 kHz mono f32 (CPU, on the task's rayon pool) → the
//! worker's voice-activity model → speech segments.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vramgate_shared::events::{ErrorKind, SpeechSegment, Stage, VoiceOutput, VoiceRequestOptions};
use vramgate_shared::oip::{Tensor, TensorData};

use super::fit::{Dim, ModelUse};
use super::{only_answer, Converted as ModelInput, Converter, Finish, Plan, Step};
use crate::audio::wav::{self, WavInfo};
use crate::audio::{self, segments::SegmentParams};
use crate::failure::Failure;
use crate::call::client::OutputTensor;

/// Options of the `wav` converter.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WavOptions {
    /// Longer audio is dead-lettered as `input_too_large` before its samples are decoded.
    pub max_audio_seconds: f64,
    pub segments: SegmentConfig,
}

impl Default for WavOptions {
    fn default() -> Self {
        WavOptions { max_audio_seconds: 600.0, segments: SegmentConfig::default() }
    }
}

/// How speech probabilities become segments.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SegmentConfig {
    /// A window is speech when its probability reaches this.
    pub threshold: f32,
    /// Speech shorter than this is dropped.
    pub min_speech_ms: u32,
    /// Silence shorter than this does not end a segment.
    pub min_silence_ms: u32,
    /// Added to both ends of each segment.
    pub speech_pad_ms: u32,
}

impl Default for SegmentConfig {
    fn default() -> Self {
        SegmentConfig { threshold: 0.5, min_speech_ms: 250, min_silence_ms: 100, speech_pad_ms: 30 }
    }
}


/// The rate and window of the Silero-style model the worker serves for this task.
pub const MODEL_SAMPLE_RATE: u32 = audio::VAD_SAMPLE_RATE;
pub const MODEL_WINDOW: u32 = 512;
pub const MODEL_INPUT: &str = "audio";
pub const MODEL_OUTPUT: &str = "speech_prob";

/// Per-request overrides of the segment parameters: a request's `options`, as the published
/// contract types them ([`VoiceRequestOptions`], `schemas/v1/request.json`).
#[derive(Debug)]
pub struct VoiceOptions(pub VoiceRequestOptions);

impl VoiceOptions {
    pub fn parse(options: Option<&serde_json::Value>) -> Result<Self, Failure> {
        let Some(value) = options.filter(|v| !v.is_null()) else {
            return Ok(VoiceOptions(VoiceRequestOptions::default()));
        };
        // An object only: serde would also read a struct from an array of its fields in order.
        if !value.is_object() {
            return Err(Failure::new(ErrorKind::InvalidRequest, Stage::Parse, "invalid voice options: not a JSON object"));
        }
        let parsed: VoiceRequestOptions = serde_json::from_value(value.clone()).map_err(|e| {
            Failure::new(ErrorKind::InvalidRequest, Stage::Parse, format!("invalid voice options: {e}"))
        })?;
        if let Some(t) = parsed.threshold {
            if !(0.0..=1.0).contains(&t) {
                return Err(Failure::new(
                    ErrorKind::InvalidRequest,
                    Stage::Parse,
                    format!("voice option threshold must be between 0 and 1, got {t}"),
                ));
            }
        }
        Ok(VoiceOptions(parsed))
    }

    pub fn params(&self, config: &SegmentConfig) -> SegmentParams {
        let VoiceOptions(options) = self;
        SegmentParams {
            threshold: options.threshold.map_or(config.threshold, |t| t as f32),
            min_speech_ms: options.min_speech_ms.unwrap_or(config.min_speech_ms),
            min_silence_ms: options.min_silence_ms.unwrap_or(config.min_silence_ms),
            speech_pad_ms: options.speech_pad_ms.unwrap_or(config.speech_pad_ms),
            window_samples: MODEL_WINDOW,
            sample_rate: MODEL_SAMPLE_RATE,
            ..SegmentParams::default()
        }
    }
}

/// Audio ready for the model, and what the result reports about the original.
#[derive(Debug)]
pub struct Converted {
    /// 16 kHz mono, at least one model window long (short clips are padded with silence).
    pub samples: Vec<f32>,
    /// Samples of real audio in `samples`, before padding.
    pub real_samples: usize,
    pub duration_seconds: f64,
    pub input_sample_rate_hz: u32,
    pub input_channels: u16,
}

/// Reads the WAV header and checks the duration limit without decoding a sample.
pub fn probe(bytes: &[u8], max_audio_seconds: f64) -> Result<WavInfo, Failure> {
    let info = wav::probe_wav(bytes).map_err(invalid_wav)?;
    let duration_seconds = info.duration_seconds();
    if duration_seconds > max_audio_seconds {
        return Err(Failure::new(
            ErrorKind::InputTooLarge,
            Stage::Convert,
            format!("audio is {duration_seconds:.1} s long, more than the limit of {max_audio_seconds} s"),
        ));
    }
    Ok(info)
}

/// Bytes [`convert`] holds at its peak for this input, and the request body after it: the
/// decoded interleaved samples, their mono mix, the 16 kHz samples and their encoded copy.
pub fn conversion_bytes(info: &WavInfo) -> u64 {
    let f32_bytes = 4u64;
    let interleaved = info.frames * u64::from(info.channels) * f32_bytes;
    let mono = info.frames * f32_bytes;
    let out_samples = (info.frames * u64::from(MODEL_SAMPLE_RATE)).div_ceil(u64::from(info.sample_rate.max(1)));
    let out = out_samples.max(u64::from(MODEL_WINDOW)) * f32_bytes;
    interleaved + mono + 2 * out
}

fn invalid_wav(e: wav::WavError) -> Failure {
    Failure::new(ErrorKind::InvalidAudio, Stage::Convert, format!("input is not a usable wav file: {e}"))
}

/// Decodes and converts. CPU-bound: runs on the voice pool, never on a tokio thread.
pub fn convert(bytes: &[u8], max_audio_seconds: f64) -> Result<Converted, Failure> {
    let info = probe(bytes, max_audio_seconds)?;
    let decoded = wav::decode_wav_limited(bytes, info.frames).map_err(invalid_wav)?;
    let duration_seconds = decoded.duration_seconds();
    let mut samples = audio::to_16k_mono(&decoded)
        .map_err(|e| Failure::new(ErrorKind::Internal, Stage::Convert, format!("audio::resample: {e}")))?;
    drop(decoded);
    let real_samples = samples.len();
    if samples.len() < MODEL_WINDOW as usize {
        samples.resize(MODEL_WINDOW as usize, 0.0);
    }
    Ok(Converted {
        samples,
        real_samples,
        duration_seconds,
        input_sample_rate_hz: info.sample_rate,
        input_channels: info.channels,
    })
}

/// Turns the model's per-window probabilities into the task's output.
pub fn output(probs: &[f32], converted: &Converted, params: &SegmentParams) -> VoiceOutput {
    let segments = audio::segments::speech_segments(probs, converted.real_samples, params)
        .into_iter()
        .map(|s| SpeechSegment { start_seconds: round_ms(s.start_seconds), end_seconds: round_ms(s.end_seconds) })
        .collect();
    VoiceOutput {
        segments,
        duration_seconds: round_ms(converted.duration_seconds),
        input_sample_rate_hz: converted.input_sample_rate_hz,
        input_channels: converted.input_channels,
    }
}

fn round_ms(seconds: f64) -> f64 {
    (seconds * 1000.0).round() / 1000.0
}

/// The `wav` converter of the task table.
pub struct VoiceTask {
    wav: WavOptions,
}

impl VoiceTask {
    pub fn new(wav: WavOptions) -> Self {
        VoiceTask { wav }
    }
}

impl Converter for VoiceTask {
    fn plan(&self, options: Option<&serde_json::Value>) -> Result<Arc<dyn Plan>, Failure> {
        let params = VoiceOptions::parse(options)?.params(&self.wav.segments);
        Ok(Arc::new(VoicePlan { params, max_audio_seconds: self.wav.max_audio_seconds }))
    }

    fn uses(&self) -> Vec<ModelUse> {
        vec![ModelUse::built_in("wav", MODEL_INPUT, vec![Dim::Fixed(1), Dim::Any], &[MODEL_OUTPUT])]
    }
}

struct VoicePlan {
    params: SegmentParams,
    max_audio_seconds: f64,
}

impl Plan for VoicePlan {
    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure> {
        Ok(conversion_bytes(&probe(bytes, self.max_audio_seconds)?))
    }

    fn convert(&self, bytes: &[u8]) -> Result<ModelInput, Failure> {
        let mut converted = convert(bytes, self.max_audio_seconds)?;
        let samples = std::mem::take(&mut converted.samples);
        let tensor = Tensor { name: MODEL_INPUT.into(), shape: vec![1, samples.len()], data: TensorData::Fp32(samples) };
        let finish = VoiceFinish { converted, params: self.params.clone() };
        Ok(ModelInput::one(tensor, &[MODEL_OUTPUT], Box::new(finish)))
    }
}

struct VoiceFinish {
    converted: Converted,
    params: SegmentParams,
}

impl Finish for VoiceFinish {
    fn output(self: Box<Self>, answers: Vec<Vec<OutputTensor>>) -> Result<Step, Failure> {
        let tensors = only_answer(answers)?;
        let probs = match tensors.first() {
            Some(tensor) => tensor.floats()?,
            None => Default::default(),
        };
        let output = serde_json::to_value(output(&probs, &self.converted, &self.params)).expect("voice outputs always serialise");
        Ok(Step::Done(output))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audio::wav::SampleFormat;
    use vramgate_shared::wav::wav_bytes;

    #[test]
    fn options_are_checked() {
        assert!(VoiceOptions::parse(None).is_ok());
        assert!(VoiceOptions::parse(Some(&serde_json::Value::Null)).is_ok());
        let ok = VoiceOptions::parse(Some(&serde_json::json!({"threshold": 0.7}))).expect("valid");
        assert_eq!(ok.params(&SegmentConfig::default()).threshold, 0.7);
        // A whole number may be written with a zero fraction, as JSON Schema allows.
        let whole = VoiceOptions::parse(Some(&serde_json::json!({"min_speech_ms": 250.0}))).expect("valid");
        assert_eq!(whole.params(&SegmentConfig::default()).min_speech_ms, 250);
        for bad in [
            serde_json::json!({"threshhold": 0.7}),
            serde_json::json!({"threshold": 2.0}),
            // Above 1 as written, though it rounds to 1.0 as an f32.
            serde_json::json!({"threshold": 1.000_000_01}),
            serde_json::json!({"min_speech_ms": 250.5}),
            serde_json::json!({"min_speech_ms": -250.0}),
            serde_json::json!([0.7]),
        ] {
            let err = VoiceOptions::parse(Some(&bad)).expect_err("invalid");
            assert_eq!(err.kind, ErrorKind::InvalidRequest);
        }
    }

    #[test]
    fn probe_refuses_long_audio_before_decoding_and_sizes_the_work() {
        // 16-bit mono 8 kHz, 2 s: 32000 bytes of data
        let wav = wav_bytes(SampleFormat::I16, 1, 8_000, &[0.0; 16_000]);
        let info = probe(&wav, 10.0).expect("valid header");
        assert_eq!((info.frames, info.sample_rate, info.channels), (16_000, 8_000, 1));
        // interleaved 64000 + mono 64000 + 2 × 32000 samples × 4 bytes
        assert_eq!(conversion_bytes(&info), 64_000 + 64_000 + 2 * 128_000);
        let err = probe(&wav, 1.5).expect_err("2 s > 1.5 s");
        assert_eq!(err.kind, ErrorKind::InputTooLarge);
        let converted = convert(&wav, 10.0).expect("converts");
        assert_eq!(converted.samples.len(), 32_000);
    }

    #[test]
    fn garbage_is_unsupported_input_not_a_panic() {
        let err = convert(b"definitely not audio", 600.0).expect_err("garbage");
        assert_eq!(err.kind, ErrorKind::InvalidAudio);
        assert_eq!(err.stage, Stage::Convert);
    }
}
