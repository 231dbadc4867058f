//! The `audio` converter: WAV, FLAC, Ogg Vorbis or MP3 → mono (the channels' mean) →
//! resampled to the model's rate → the model's input, one of:
//! - the whole signal, `[1, samples]` (neither `length` nor `frames` set);
//! - exactly `length` samples, `[1, length]`: longer audio trimmed at the end, shorter padded
//!   with zeros;
//! - fixed windows, `[n, size]`: window `i` starts at `i · hop`; with `center`, the signal is
//!   first padded with `size / 2` zeros at each end and `n = 1 + samples / hop` (so window `i`
//!   is centred on sample `i · hop`, as torchcrepe and librosa frame); without, `n = 1 + (samples
//!   − size) / hop`, and audio shorter than one window is padded to one.
//!
//! FP32, or FP16 (`datatype`). The outputs go through the task's `[[outputs]]` rows; the
//! result's `input` says what was decoded (`format`, `duration_seconds`, the input's rate and
//! channels, `samples` and `sample_rate_hz` after resampling, `frames` and `hop_seconds` when
//! framed). A voice-activity model's outputs may become speech segments (`post =
//! ["speech_segments"]`), when the model takes the whole signal.
//!
//! Bounds: `max_audio_seconds` (from the header when the container states the length, else
//! while decoding), and `max_elements` of the model input (checked from the header's length
//! before decoding when it is known; small hops multiply the samples).

use serde::{Deserialize, Serialize};
use serde_json::json;
use vramgate_shared::events::{ErrorKind, Stage};
use vramgate_shared::oip::{DataType, Tensor, TensorData, F16};

use super::fit::{Dim, Sent, SentTensor};
use super::outputs::{InputConverter, ModelInput};
use crate::audio::decode::{self, DecodeError, Header};
use crate::audio::resample;
use crate::audio::wav::{MAX_SAMPLE_RATE_HZ, MIN_SAMPLE_RATE_HZ};
use crate::failure::Failure;

/// Largest `frames.size` and `length`, in samples.
pub const MAX_WINDOW: usize = 1 << 22;
/// Largest `max_elements`.
pub const MAX_AUDIO_ELEMENTS: usize = 1 << 28;

/// Options of the `audio` converter (`[tasks.<name>.audio]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AudioOptions {
    /// The model input's name.
    pub input: String,
    /// The model's sample rate.
    pub sample_rate_hz: u32,
    /// Longer audio is dead-lettered (`input_too_large`).
    pub max_audio_seconds: f64,
    /// FP32 or FP16.
    pub datatype: DataType,
    /// Pad or trim to exactly this many samples.
    pub length: Option<usize>,
    /// Cut into fixed windows.
    pub frames: Option<FrameOptions>,
    /// Whether the model input has a batch dimension: `false` for a model that takes none
    /// (the worker's `max_batch_size = 0`), sent `[samples]` (or `[length]`) instead of
    /// `[1, samples]`. Frames are `[n, size]` either way.
    pub batch: bool,
    /// Most elements of the model input.
    pub max_elements: usize,
}

/// `[tasks.<name>.audio.frames]`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrameOptions {
    pub size: usize,
    pub hop: usize,
    #[serde(default)]
    pub center: bool,
}

impl Default for AudioOptions {
    fn default() -> Self {
        AudioOptions {
            input: "audio".into(),
            sample_rate_hz: 16_000,
            max_audio_seconds: 600.0,
            datatype: DataType::Fp32,
            length: None,
            frames: None,
            batch: true,
            max_elements: 1 << 24,
        }
    }
}

impl AudioOptions {
    pub fn validate(&self) -> Result<(), String> {
        if self.input.is_empty() || self.input.len() > 128 {
            return Err("audio.input must be 1 to 128 bytes".into());
        }
        if !(MIN_SAMPLE_RATE_HZ..=MAX_SAMPLE_RATE_HZ).contains(&self.sample_rate_hz) {
            return Err(format!(
                "audio.sample_rate_hz must be {MIN_SAMPLE_RATE_HZ} to {MAX_SAMPLE_RATE_HZ}, got {}",
                self.sample_rate_hz
            ));
        }
        if !(self.max_audio_seconds > 0.0 && self.max_audio_seconds <= 86_400.0) {
            return Err(format!("audio.max_audio_seconds must be above 0 and at most 86400, got {}", self.max_audio_seconds));
        }
        if !matches!(self.datatype, DataType::Fp32 | DataType::Fp16) {
            return Err(format!("audio.datatype must be FP32 or FP16, got {}", self.datatype.as_str()));
        }
        if self.length.is_some() && self.frames.is_some() {
            return Err("audio.length and audio.frames are both set; keep one".into());
        }
        if let Some(length) = self.length {
            if !(1..=MAX_WINDOW).contains(&length) {
                return Err(format!("audio.length must be 1 to {MAX_WINDOW}, got {length}"));
            }
        }
        if let Some(f) = self.frames {
            if !(1..=MAX_WINDOW).contains(&f.size) || !(1..=f.size.max(1) * 16).contains(&f.hop) {
                return Err(format!(
                    "audio.frames needs size 1 to {MAX_WINDOW} and hop 1 to 16 × size, got size {} hop {}",
                    f.size, f.hop
                ));
            }
        }
        if !(1..=MAX_AUDIO_ELEMENTS).contains(&self.max_elements) {
            return Err(format!("audio.max_elements must be 1 to {MAX_AUDIO_ELEMENTS}, got {}", self.max_elements));
        }
        Ok(())
    }

    /// The model input's shape for `samples` samples at the model's rate.
    pub fn shape(&self, samples: usize) -> [usize; 2] {
        match (self.length, self.frames) {
            (Some(length), _) => [1, length],
            (None, Some(f)) if f.center => [1 + samples / f.hop, f.size],
            (None, Some(f)) => [1 + samples.saturating_sub(f.size) / f.hop, f.size],
            (None, None) => [1, samples.max(1)],
        }
    }

    /// Dimensions of [`shape`](Self::shape) not sent: the leading 1 for a model without a
    /// batch dimension (frames keep theirs: it is the frame count).
    fn unbatched(&self) -> usize {
        usize::from(!self.batch && self.frames.is_none())
    }

    /// The model input's shape as far as the settings fix it (the samples or frames vary).
    fn sent_shape(&self) -> Vec<Dim> {
        let shape = match (self.length, self.frames) {
            (Some(length), _) => [Dim::Fixed(1), Dim::Fixed(length)],
            (None, Some(f)) => [Dim::Any, Dim::Fixed(f.size)],
            (None, None) => [Dim::Fixed(1), Dim::Any],
        };
        shape[self.unbatched()..].to_vec()
    }

    /// Samples at the model's rate for `frames` frames at `rate`.
    fn resampled_len(&self, frames: u64, rate: u32) -> u64 {
        (u128::from(frames) * u128::from(self.sample_rate_hz)).div_ceil(u128::from(rate.max(1))).min(u128::from(u64::MAX)) as u64
    }
}

/// The input side of the `audio` converter (a [`super::outputs::ConfiguredTask`]).
pub struct AudioInput {
    pub options: AudioOptions,
}

fn audio_failure(e: DecodeError) -> Failure {
    match e {
        DecodeError::Unknown(_) => Failure::new(ErrorKind::UnsupportedInput, Stage::Convert, e.to_string()),
        DecodeError::TooLong { .. } => Failure::new(ErrorKind::InputTooLarge, Stage::Convert, e.to_string()),
        _ => Failure::new(ErrorKind::InvalidAudio, Stage::Convert, e.to_string()),
    }
}

impl AudioInput {
    fn max_frames(&self, header: &Header) -> u64 {
        (self.options.max_audio_seconds * f64::from(header.sample_rate)).floor() as u64
    }

    /// The header, checked against the duration and element limits where it states a length.
    fn checked_header(&self, bytes: &[u8]) -> Result<Header, Failure> {
        let header = decode::probe(bytes).map_err(audio_failure)?;
        if let Some(seconds) = header.duration_seconds() {
            if seconds > self.options.max_audio_seconds {
                return Err(Failure::new(
                    ErrorKind::InputTooLarge,
                    Stage::Convert,
                    format!("audio is {seconds:.1} s long, more than audio.max_audio_seconds {}", self.options.max_audio_seconds),
                ));
            }
        }
        let frames = header.frames.unwrap_or_else(|| self.max_frames(&header));
        let samples = self.options.resampled_len(frames, header.sample_rate);
        self.check_elements(usize::try_from(samples).unwrap_or(usize::MAX))?;
        Ok(header)
    }

    fn check_elements(&self, samples: usize) -> Result<(), Failure> {
        let [rows, cols] = self.options.shape(samples);
        let elements = rows.saturating_mul(cols);
        if elements > self.options.max_elements {
            return Err(Failure::new(
                ErrorKind::InputTooLarge,
                Stage::Convert,
                format!("audio makes a model input of {rows} × {cols} values, more than audio.max_elements {}", self.options.max_elements),
            ));
        }
        Ok(())
    }
}

impl InputConverter for AudioInput {
    fn sends(&self) -> Sent {
        let o = &self.options;
        Sent::One(SentTensor::new("audio.input", &o.input, Some(o.datatype), Some(o.sent_shape())))
    }

    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure> {
        let header = self.checked_header(bytes)?;
        // A length the container does not state is counted at the limit.
        let frames = header.frames.unwrap_or_else(|| self.max_frames(&header)).min(self.max_frames(&header));
        let interleaved = frames.saturating_mul(u64::from(header.channels)).saturating_mul(4);
        let mono = frames.saturating_mul(4);
        let samples = self.options.resampled_len(frames, header.sample_rate);
        let [rows, cols] = self.options.shape(usize::try_from(samples).unwrap_or(usize::MAX));
        let input = (rows as u64).saturating_mul(cols as u64).saturating_mul(4);
        // The decoded audio with its mix, then the resampled signal with the tensor and its
        // encoded copy.
        Ok(interleaved.saturating_add(mono).max(mono.saturating_add(samples.saturating_mul(4))).saturating_add(input.saturating_mul(2)))
    }

    fn convert(&self, bytes: &[u8]) -> Result<ModelInput, Failure> {
        let header = self.checked_header(bytes)?;
        let decoded = decode::decode(bytes, self.max_frames(&header)).map_err(audio_failure)?;
        let duration_seconds = decoded.duration_seconds();
        let mono = decoded.to_mono();
        drop(decoded);
        if mono.is_empty() {
            return Err(Failure::new(ErrorKind::InvalidAudio, Stage::Convert, "audio holds no samples"));
        }
        let samples = resample::resample(&mono, header.sample_rate, self.options.sample_rate_hz)
            .map_err(|e| Failure::new(ErrorKind::Internal, Stage::Convert, format!("audio::resample: {e}")))?;
        drop(mono);
        self.check_elements(samples.len())?;
        let shape = self.options.shape(samples.len());
        let values = shape_values(&samples, &self.options, shape);
        let data = match self.options.datatype {
            DataType::Fp16 => TensorData::Fp16(values.iter().map(|&v| F16::from_f64(f64::from(v)).unwrap_or_default()).collect()),
            _ => TensorData::Fp32(values),
        };
        let tensor = Tensor { name: self.options.input.clone(), shape: shape[self.options.unbatched()..].to_vec(), data };
        let mut input = json!({
            "format": header.container.as_str(),
            "duration_seconds": (duration_seconds * 1000.0).round() / 1000.0,
            "input_sample_rate_hz": header.sample_rate,
            "input_channels": header.channels,
            "samples": samples.len(),
            "sample_rate_hz": self.options.sample_rate_hz,
        });
        if let Some(f) = self.options.frames {
            input["frames"] = json!(shape[0]);
            input["hop_seconds"] = json!(f.hop as f64 / f64::from(self.options.sample_rate_hz));
        }
        Ok(ModelInput { tensors: vec![tensor], input, placement: None })
    }
}

/// The model input's values, row-major, for `shape` (from [`AudioOptions::shape`]).
fn shape_values(samples: &[f32], options: &AudioOptions, shape: [usize; 2]) -> Vec<f32> {
    let [rows, cols] = shape;
    let mut out = vec![0.0f32; rows * cols];
    match options.frames {
        None => {
            let n = samples.len().min(cols);
            out[..n].copy_from_slice(&samples[..n]);
        }
        Some(f) => {
            // Window i covers signal positions [i·hop − pad, i·hop − pad + size); outside the
            // signal is zero.
            let pad = if f.center { (f.size / 2) as isize } else { 0 };
            for (i, row) in out.chunks_mut(cols).enumerate() {
                let start = (i * f.hop) as isize - pad;
                let from = start.max(0) as usize;
                let to = ((start + cols as isize).max(0) as usize).min(samples.len());
                if from < to {
                    let at = (from as isize - start) as usize;
                    row[at..at + (to - from)].copy_from_slice(&samples[from..to]);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use vramgate_shared::wav::{wav_bytes, SampleFormat};

    use super::*;
    use crate::tasks::outputs::{ConfiguredTask, OutputRule, Outputs};
    use crate::tasks::{Converter, Plan};
    use std::sync::Arc;

    fn options(keys: serde_json::Value) -> AudioOptions {
        let options: AudioOptions = serde_json::from_value(keys).expect("options parse");
        options.validate().expect("options validate");
        options
    }

    fn plan(options: AudioOptions) -> Arc<dyn Plan> {
        let rule: OutputRule = serde_json::from_str(r#"{"name": "y"}"#).expect("rule");
        ConfiguredTask::new(AudioInput { options }, Outputs::load(&[rule], 100).expect("outputs")).plan(None).expect("plan")
    }

    fn ramp(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32 / n as f32).collect()
    }

    #[test]
    fn centred_frames_match_torchcrepe_framing() {
        let o = options(json!({"frames": {"size": 8, "hop": 3, "center": true}}));
        let samples: Vec<f32> = (1..=10).map(|i| i as f32).collect();
        let shape = o.shape(samples.len());
        assert_eq!(shape, [1 + 10 / 3, 8]);
        let values = shape_values(&samples, &o, shape);
        // Padded by 4 zeros at each end; window i starts at 3i in the padded signal.
        let padded: Vec<f32> = [vec![0.0; 4], samples.clone(), vec![0.0; 4]].concat();
        for (i, row) in values.chunks(8).enumerate() {
            assert_eq!(row, &padded[3 * i..3 * i + 8], "window {i}");
        }
        let plain = options(json!({"frames": {"size": 4, "hop": 4}}));
        assert_eq!(plain.shape(10), [2, 4]);
        assert_eq!(plain.shape(2), [1, 4], "shorter than a window: one padded window");
        assert_eq!(shape_values(&samples[..2], &plain, [1, 4]), vec![1.0, 2.0, 0.0, 0.0]);
        let fixed = options(json!({"length": 4}));
        assert_eq!(shape_values(&samples, &fixed, fixed.shape(10)), vec![1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn a_wav_becomes_the_configured_tensor() {
        let wav = wav_bytes(SampleFormat::F32, 1, 48_000, &ramp(48_000));
        let p = plan(options(json!({"input": "frames", "frames": {"size": 1024, "hop": 160, "center": true}, "datatype": "FP16"})));
        let converted = p.convert(&wav).expect("converts");
        let tensor = &converted.calls[0].inputs[0];
        assert_eq!((tensor.name.as_str(), tensor.shape.clone()), ("frames", vec![1 + 16_000 / 160, 1024]));
        assert_eq!(tensor.datatype(), DataType::Fp16);
        assert!(p.probe(&wav).expect("probe") > 48_000 * 4);
        // A model without a batch dimension takes the signal alone; frames stay [n, size].
        let shape = |keys: serde_json::Value| plan(options(keys)).convert(&wav).expect("converts").calls[0].inputs[0].shape.clone();
        assert_eq!(shape(json!({})), [1, 16_000]);
        assert_eq!(shape(json!({"batch": false})), [16_000]);
        assert_eq!(shape(json!({"batch": false, "length": 400})), [400]);
        assert_eq!(shape(json!({"batch": false, "frames": {"size": 1024, "hop": 160, "center": true}})), [1 + 16_000 / 160, 1024]);
    }

    #[test]
    fn limits_are_checked_from_the_header() {
        let wav = wav_bytes(SampleFormat::I16, 1, 16_000, &ramp(16_000 * 3));
        let short = plan(options(json!({"max_audio_seconds": 2.0})));
        let err = short.probe(&wav).expect_err("too long");
        assert_eq!(err.kind, ErrorKind::InputTooLarge);
        assert!(err.message.contains("more than audio.max_audio_seconds 2"), "{}", err.message);
        let dense = plan(options(json!({"frames": {"size": 1024, "hop": 1}, "max_elements": 1000000})));
        let err = dense.probe(&wav).expect_err("too many elements");
        assert!(err.message.contains("more than audio.max_elements 1000000"), "{}", err.message);
        let p = plan(AudioOptions::default());
        assert_eq!(p.probe(b"\x89PNG\r\n\x1a\n").expect_err("png").kind, ErrorKind::UnsupportedInput);
        let Err(err) = p.convert(b"fLaC\0\0\0\x22") else { panic!("a truncated flac converted") };
        assert_eq!(err.kind, ErrorKind::InvalidAudio);
    }

    #[test]
    fn bad_options_are_named() {
        for (keys, want) in [
            (json!({"datatype": "INT8"}), "audio.datatype must be FP32 or FP16"),
            (json!({"length": 10, "frames": {"size": 4, "hop": 2}}), "both set"),
            (json!({"frames": {"size": 4, "hop": 0}}), "audio.frames needs"),
            (json!({"sample_rate_hz": 10}), "audio.sample_rate_hz"),
            (json!({"max_audio_seconds": 0.0}), "audio.max_audio_seconds"),
        ] {
            let o: AudioOptions = serde_json::from_value(keys).expect("parses");
            assert!(o.validate().expect_err(want).contains(want));
        }
    }
}
