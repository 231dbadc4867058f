//! WAV (RIFF/WAVE) decoding into interleaved `f32` samples.
//!
//! This module owns everything between the raw bytes of an uploaded `.wav`
//! file and an [`Audio`] value: the RIFF chunk walk, `fmt ` validation
//! (plain and `WAVE_FORMAT_EXTENSIBLE`), and sample conversion for 8/16/24/32-bit
//! integer PCM and 32/64-bit IEEE float. The bytes come from Kafka and are
//! untrusted, so every malformed input maps to a [`WavError`] instead of a panic,
//! and [`probe_wav`] / [`decode_wav_limited`] let callers refuse oversized audio from
//! the header, before any sample buffer is allocated.
//!
//! # Hand-written or library: the decision, measured
//!
//! Issue 13 asked to replace this parser with `hound` or `symphonia` unless a measured
//! reason says otherwise. `api-gateway/examples/audio_libs.rs` compared the three (hound
//! 3.5.1; symphonia 0.6.1 with only its `wav` and `pcm` features; release build, best of 5,
//! 2 shared cores; `cargo run --release -p vramgate-gateway --example audio_libs`).
//!
//! Decode time of a 60 s file:
//!
//! | file                    | wav.rs | hound  | symphonia |
//! |-------------------------|-------:|-------:|----------:|
//! | 16-bit mono 16 kHz      | 0.2 ms | 14 ms  |   2–6 ms  |
//! | 16-bit stereo 44.1 kHz  | 1.6 ms | 86–99 ms | 23–31 ms |
//! | 24-bit stereo 48 kHz    | 3–4 ms | 96–100 ms | 16–22 ms |
//! | float32 mono 48 kHz     | 2–4 ms | 15–28 ms |  6–9 ms  |
//!
//! Where all three decode a file they agree exactly (max difference 0), except hound on
//! `WAVE_FORMAT_EXTENSIBLE` 32-bit containers with 24 valid bits (off by up to 1.4: it scales
//! by the valid bits). What each takes:
//!
//! | file                                                   | wav.rs | hound   | symphonia |
//! |--------------------------------------------------------|--------|---------|-----------|
//! | PCM u8/i16/i24/i32, float32, plain and EXTENSIBLE      | yes    | yes     | yes       |
//! | float64                                                | yes    | refused | yes       |
//! | EXTENSIBLE, 20 valid bits in a 24-bit container        | yes    | refused | yes       |
//! | odd-sized unknown chunk before `fmt ` or `data`        | yes    | refused | yes       |
//! | `LIST` whose size leaves out its last pad byte         | yes    | refused | refused   |
//! | data/RIFF size `0xFFFFFFFF` (ffmpeg to a pipe)         | yes    | refused | refused   |
//! | data size `0x7FFFF000` (real `espeak-ng --stdout` file)| yes    | refused | refused   |
//! | upload cut mid-frame (sizes promise more)              | yes, whole frames | refused | refused |
//! | real `espeak-ng -w` file                               | yes    | yes     | yes       |
//! | 1 Hz sample rate, 32,767 channels                      | refused (limits) | 1 Hz taken | 1 Hz taken |
//!
//! Decision: **this parser stays**. Speed alone would not decide it (each of the three
//! decodes a minute of audio in at most 0.1 s), but correctness on real files does: files whose header carries a
//! streaming writer's placeholder size, and uploads cut short, are ordinary inputs for a
//! service fed by pipes and recorders. hound refuses them; symphonia reads the header size
//! as the truth, fails with "unexpected end of file" on the last packet (a wrapper that
//! swallowed that error would still drop up to 1,151 trailing frames), and reports the
//! placeholder as the track length (`0x7FFFF000` bytes is 13.5 hours at 22.05 kHz), so the
//! header-first duration limit would refuse the file unless the wrapper re-walked the chunks
//! itself to count the bytes really present, which is this module again. The price of
//! keeping it is that it is ours to fuzz: the proptest properties at the end of this file
//! run arbitrary bytes and mutated valid files through [`probe_wav`] and [`decode_wav`]
//! (never a panic, probe and decode agree), and check it sample-for-sample against
//! symphonia, maintained and fuzzed by many, on generated well-formed files of every
//! supported encoding and chunk layout.

use thiserror::Error;
pub use vramgate_shared::wav::SampleFormat;
use vramgate_shared::wav::{FORMAT_EXTENSIBLE, FORMAT_IEEE_FLOAT, FORMAT_PCM, KSDATAFORMAT_GUID_TAIL};

/// Size of the classic `fmt ` body (`WAVEFORMAT` + `wBitsPerSample`).
const FMT_MIN_LEN: usize = 16;
/// Size of the `fmt ` body of `WAVE_FORMAT_EXTENSIBLE` (18 + 22 extension bytes).
const FMT_EXTENSIBLE_LEN: usize = 40;

/// Decoded audio: interleaved samples normalised to `[-1, 1]`.
/// Lowest sample rate taken: below it a header is garbage, not audio (telephony is 8 kHz).
pub const MIN_SAMPLE_RATE_HZ: u32 = 1_000;
/// Highest sample rate taken (studio recordings go to 384 kHz).
pub const MAX_SAMPLE_RATE_HZ: u32 = 384_000;
/// Most channels taken (WAVE_FORMAT_EXTENSIBLE names 18 speaker positions; ambisonic files
/// use more, but not thousands).
pub const MAX_CHANNELS: u16 = 64;

#[derive(Debug, Clone, PartialEq)]
pub struct Audio {
    pub sample_rate: u32,
    pub channels: u16,
    /// Interleaved frame by frame, each value in `[-1, 1]`.
    pub samples: Vec<f32>,
}

impl Audio {
    /// Number of whole frames (one sample per channel).
    pub fn frames(&self) -> usize {
        match self.channels {
            0 => 0,
            channels => self.samples.len() / usize::from(channels),
        }
    }

    /// Length in seconds; 0 for a zero sample rate rather than infinity, since
    /// the fields are public and may be built by hand.
    pub fn duration_seconds(&self) -> f64 {
        if self.sample_rate == 0 {
            return 0.0;
        }
        self.frames() as f64 / f64::from(self.sample_rate)
    }

    /// Down-mixes to one channel by averaging each frame's channels.
    ///
    /// A trailing partial frame (only possible in a hand-built `Audio`) is dropped.
    pub fn to_mono(&self) -> Vec<f32> {
        match self.channels {
            0 => Vec::new(),
            1 => self.samples.clone(),
            channels => {
                let scale = 1.0 / f32::from(channels);
                self.samples
                    .chunks_exact(usize::from(channels))
                    .map(|frame| frame.iter().sum::<f32>() * scale)
                    .collect()
            }
        }
    }
}

/// Why a byte string could not be decoded as WAV audio.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WavError {
    #[error("not a riff/wave file: expected \"RIFF\" and \"WAVE\" magic, found \"{found}\"")]
    NotRiffWave { found: String },

    #[error("truncated wav header: {what} needs {needed} bytes, only {available} present")]
    TruncatedHeader {
        what: String,
        needed: u64,
        available: u64,
    },

    #[error("missing fmt chunk: no \"fmt \" chunk before the data chunk or end of file")]
    MissingFmtChunk,

    #[error("missing data chunk: no \"data\" chunk after the fmt chunk")]
    MissingDataChunk,

    #[error("unsupported wav format tag: 0x{tag:04x} ({name})")]
    UnsupportedFormatTag { tag: u16, name: &'static str },

    #[error("unsupported wav extensible sub-format: {guid}")]
    UnsupportedSubFormat { guid: String },

    #[error("unsupported wav sample format: {bits}-bit {kind}")]
    UnsupportedBitsPerSample { bits: u16, kind: &'static str },

    #[error("invalid wav valid-bits-per-sample: {valid_bits} exceeds the {container_bits}-bit container")]
    InvalidValidBits {
        valid_bits: u16,
        container_bits: u16,
    },

    #[error("invalid wav fmt chunk: channel count is 0")]
    ZeroChannels,

    #[error("invalid wav fmt chunk: sample rate is 0")]
    ZeroSampleRate,

    #[error("wav sample rate {rate} Hz is outside the supported {MIN_SAMPLE_RATE_HZ}–{MAX_SAMPLE_RATE_HZ} Hz")]
    SampleRateOutOfRange { rate: u32 },

    #[error("wav has {channels} channels; at most {MAX_CHANNELS} are supported")]
    TooManyChannels { channels: u16 },

    #[error("wav block align mismatch: header says {block_align} bytes per frame, {channels} channels of {bits}-bit samples need {expected}")]
    BlockAlignMismatch {
        block_align: u16,
        channels: u16,
        bits: u16,
        expected: u32,
    },

    #[error("empty wav audio: data chunk holds {data_bytes} bytes, less than one {block_align}-byte frame")]
    EmptyAudio { data_bytes: u64, block_align: u16 },

    #[error("wav audio too long: {frames} frames exceeds the limit of {max}")]
    TooLong { frames: u64, max: u64 },
}

/// Converts one stored sample; `raw.len()` is always `format.bytes()`.
fn decode_sample(format: SampleFormat, raw: &[u8]) -> f32 {
    match *raw {
        [b] if format == SampleFormat::U8 => (f32::from(b) - 128.0) / 128.0,
        [a, b] => f32::from(i16::from_le_bytes([a, b])) / 32_768.0,
        // Shifting into the top of an i32 and back sign-extends the 24-bit value.
        [a, b, c] => (i32::from_le_bytes([0, a, b, c]) >> 8) as f32 / 8_388_608.0,
        [a, b, c, d] if format == SampleFormat::I32 => {
            (f64::from(i32::from_le_bytes([a, b, c, d])) / 2_147_483_648.0) as f32
        }
        [a, b, c, d] => sanitize_float(f32::from_le_bytes([a, b, c, d])),
        [a, b, c, d, e, f, g, h] => {
            sanitize_float(f64::from_le_bytes([a, b, c, d, e, f, g, h]) as f32)
        }
        // Unreachable by construction; silence is the safe answer for untrusted input.
        _ => 0.0,
    }
}

/// Float WAVs may hold overs (> 1.0), infinities or NaN; downstream resampling and
/// the VAD model expect bounded finite input, so clamp and map NaN to silence.
fn sanitize_float(x: f32) -> f32 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(-1.0, 1.0)
    }
}

/// The validated contents of a `fmt ` chunk.
#[derive(Debug, Clone, Copy)]
struct Format {
    sample_rate: u32,
    channels: u16,
    block_align: u16,
    sample: SampleFormat,
}

/// Decodes a complete WAV file with no length limit; see [`decode_wav_limited`].
pub fn decode_wav(bytes: &[u8]) -> Result<Audio, WavError> {
    decode_wav_limited(bytes, u64::MAX)
}

/// Decodes a WAV file, refusing more than `max_frames` frames before allocating.
///
/// The RIFF size field and a data chunk size that runs past the end of the
/// input are tolerated (streaming writers leave them as 0 or `0xFFFFFFFF`):
/// the samples actually present are used, truncated to whole frames. Chunks
/// after the data chunk are ignored.
pub fn decode_wav_limited(bytes: &[u8], max_frames: u64) -> Result<Audio, WavError> {
    let (format, data) = locate(bytes)?;
    decode_samples(data, format, max_frames)
}

/// What a WAV file holds, read from its header without decoding samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WavInfo {
    pub sample_rate: u32,
    pub channels: u16,
    /// Whole frames present in the data chunk.
    pub frames: u64,
}

impl WavInfo {
    pub fn duration_seconds(&self) -> f64 {
        self.frames as f64 / f64::from(self.sample_rate)
    }
}

/// Reads the header and checks it as [`decode_wav`] would, without decoding any sample, so a
/// caller can size or refuse the work first.
pub fn probe_wav(bytes: &[u8]) -> Result<WavInfo, WavError> {
    let (format, data) = locate(bytes)?;
    let frames = (data.len() / usize::from(format.block_align)) as u64;
    if frames == 0 {
        return Err(WavError::EmptyAudio { data_bytes: data.len() as u64, block_align: format.block_align });
    }
    Ok(WavInfo { sample_rate: format.sample_rate, channels: format.channels, frames })
}

/// Walks the chunks to the format and the data chunk's bytes.
fn locate(bytes: &[u8]) -> Result<(Format, &[u8]), WavError> {
    check_riff_header(bytes)?;
    let mut format: Option<Format> = None;
    let mut pos: usize = 12;
    loop {
        let rest = bytes.get(pos..).unwrap_or_default();
        let (Some(id), Some(size)) = (rest.get(0..4), read_u32(rest, 4)) else {
            // Fewer than 8 bytes left: no room for another chunk header.
            return Err(match format {
                None => WavError::MissingFmtChunk,
                Some(_) => WavError::MissingDataChunk,
            });
        };
        let body = rest.get(8..).unwrap_or_default();
        let declared = usize::try_from(size).unwrap_or(usize::MAX);

        if id == b"data" {
            let format = format.ok_or(WavError::MissingFmtChunk)?;
            // Deliberately no truncation error here: streaming writers leave the size unknown.
            let data = body.get(..declared).unwrap_or(body);
            return Ok((format, data));
        }

        let Some(chunk_body) = body.get(..declared) else {
            return Err(WavError::TruncatedHeader {
                what: format!("\"{}\" chunk", id.escape_ascii()),
                needed: u64::from(size),
                available: body.len() as u64,
            });
        };
        if id == b"fmt " {
            format = Some(parse_fmt(chunk_body)?);
        }
        // RIFF pads odd-sized chunks to an even length; a missing final pad byte is harmless.
        let padded = declared.saturating_add(declared & 1);
        pos = pos.saturating_add(8).saturating_add(padded);
    }
}

fn check_riff_header(bytes: &[u8]) -> Result<(), WavError> {
    let riff = bytes.get(0..4);
    let wave = bytes.get(8..12);
    match (riff, wave) {
        (Some(b"RIFF"), Some(b"WAVE")) => Ok(()),
        (Some(b"RIFF"), None) => Err(WavError::TruncatedHeader {
            what: "riff header".to_owned(),
            needed: 12,
            available: bytes.len() as u64,
        }),
        (None, _) if b"RIFF".starts_with(bytes) => Err(WavError::TruncatedHeader {
            what: "riff header".to_owned(),
            needed: 12,
            available: bytes.len() as u64,
        }),
        _ => Err(WavError::NotRiffWave {
            found: bytes.get(..12).unwrap_or(bytes).escape_ascii().to_string(),
        }),
    }
}

fn read_u16(bytes: &[u8], at: usize) -> Option<u16> {
    let raw = bytes.get(at..at.checked_add(2)?)?;
    raw.try_into().ok().map(u16::from_le_bytes)
}

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let raw = bytes.get(at..at.checked_add(4)?)?;
    raw.try_into().ok().map(u32::from_le_bytes)
}

fn truncated_fmt(needed: usize, body: &[u8]) -> WavError {
    WavError::TruncatedHeader {
        what: "fmt chunk".to_owned(),
        needed: needed as u64,
        available: body.len() as u64,
    }
}

fn format_tag_name(tag: u16) -> &'static str {
    match tag {
        0x0002 => "microsoft adpcm",
        0x0006 => "a-law",
        0x0007 => "mu-law",
        0x0011 => "ima adpcm",
        0x0031 => "gsm 6.10",
        0x0050 => "mpeg",
        0x0055 => "mpeg layer 3",
        0x00FF => "aac",
        _ => "unknown",
    }
}

fn parse_fmt(body: &[u8]) -> Result<Format, WavError> {
    let field16 = |at| read_u16(body, at).ok_or_else(|| truncated_fmt(FMT_MIN_LEN, body));
    let field32 = |at| read_u32(body, at).ok_or_else(|| truncated_fmt(FMT_MIN_LEN, body));
    let tag = field16(0)?;
    let channels = field16(2)?;
    let sample_rate = field32(4)?;
    let block_align = field16(12)?;
    let bits = field16(14)?;

    // For extensible files the sub-format decides the encoding; valid bits below
    // the container size are left-justified, so decoding by container size is exact.
    let (encoding, container_bits) = if tag == FORMAT_EXTENSIBLE {
        let ext16 = |at| read_u16(body, at).ok_or_else(|| truncated_fmt(FMT_EXTENSIBLE_LEN, body));
        let valid_bits = ext16(18)?;
        let guid: &[u8; 16] = body
            .get(24..FMT_EXTENSIBLE_LEN)
            .and_then(|g| g.try_into().ok())
            .ok_or_else(|| truncated_fmt(FMT_EXTENSIBLE_LEN, body))?;
        if valid_bits > bits {
            return Err(WavError::InvalidValidBits {
                valid_bits,
                container_bits: bits,
            });
        }
        let [lo, hi, tail @ ..] = *guid;
        let sub_tag = u16::from_le_bytes([lo, hi]);
        if tail != KSDATAFORMAT_GUID_TAIL
            || !(sub_tag == FORMAT_PCM || sub_tag == FORMAT_IEEE_FLOAT)
        {
            return Err(WavError::UnsupportedSubFormat {
                guid: format_guid(guid),
            });
        }
        (sub_tag, bits)
    } else {
        (tag, bits)
    };

    if encoding != FORMAT_PCM && encoding != FORMAT_IEEE_FLOAT {
        return Err(WavError::UnsupportedFormatTag {
            tag,
            name: format_tag_name(tag),
        });
    }
    if channels == 0 {
        return Err(WavError::ZeroChannels);
    }
    if sample_rate == 0 {
        return Err(WavError::ZeroSampleRate);
    }
    if !(MIN_SAMPLE_RATE_HZ..=MAX_SAMPLE_RATE_HZ).contains(&sample_rate) {
        return Err(WavError::SampleRateOutOfRange { rate: sample_rate });
    }
    if channels > MAX_CHANNELS {
        return Err(WavError::TooManyChannels { channels });
    }

    let sample = match (encoding, container_bits) {
        (FORMAT_PCM, 8) => SampleFormat::U8,
        (FORMAT_PCM, 16) => SampleFormat::I16,
        (FORMAT_PCM, 24) => SampleFormat::I24,
        (FORMAT_PCM, 32) => SampleFormat::I32,
        (FORMAT_IEEE_FLOAT, 32) => SampleFormat::F32,
        (FORMAT_IEEE_FLOAT, 64) => SampleFormat::F64,
        (FORMAT_PCM, bits) => {
            return Err(WavError::UnsupportedBitsPerSample {
                bits,
                kind: "integer",
            })
        }
        (_, bits) => {
            return Err(WavError::UnsupportedBitsPerSample {
                bits,
                kind: "float",
            })
        }
    };

    let expected = u32::from(channels) * u32::from(sample.bytes());
    if u32::from(block_align) != expected {
        return Err(WavError::BlockAlignMismatch {
            block_align,
            channels,
            bits: container_bits,
            expected,
        });
    }

    Ok(Format {
        sample_rate,
        channels,
        block_align,
        sample,
    })
}

/// Renders a GUID the way Windows headers print it, e.g. `00000001-0000-0010-8000-00aa00389b71`.
fn format_guid(g: &[u8]) -> String {
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    // The first three GUID fields are stored little-endian.
    let hex_le = |bytes: &[u8]| {
        bytes
            .iter()
            .rev()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    match (
        g.get(0..4),
        g.get(4..6),
        g.get(6..8),
        g.get(8..10),
        g.get(10..16),
    ) {
        (Some(a), Some(b), Some(c), Some(d), Some(e)) => {
            format!(
                "{}-{}-{}-{}-{}",
                hex_le(a),
                hex_le(b),
                hex_le(c),
                hex(d),
                hex(e)
            )
        }
        _ => hex(g),
    }
}

fn decode_samples(data: &[u8], format: Format, max_frames: u64) -> Result<Audio, WavError> {
    let block_align = usize::from(format.block_align);
    let frames = data.len() / block_align;
    if frames == 0 {
        return Err(WavError::EmptyAudio {
            data_bytes: data.len() as u64,
            block_align: format.block_align,
        });
    }
    if frames as u64 > max_frames {
        return Err(WavError::TooLong {
            frames: frames as u64,
            max: max_frames,
        });
    }

    // Whole frames only: a partial trailing frame is what a cut-off stream leaves behind.
    let whole = data.get(..frames * block_align).unwrap_or_default();
    let samples = whole
        .chunks_exact(usize::from(format.sample.bytes()))
        .map(|raw| decode_sample(format.sample, raw))
        .collect();
    Ok(Audio {
        sample_rate: format.sample_rate,
        channels: format.channels,
        samples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use vramgate_shared::wav::{chunk, fmt_body, fmt_extensible, wav_bytes as plain_wav};
    use SampleFormat as Enc;

    /// A RIFF container whose size is the true one.
    fn riff(chunks: &[Vec<u8>]) -> Vec<u8> {
        vramgate_shared::wav::riff(chunks, None)
    }

    /// Largest decode error: half a quantisation step plus the asymmetric full-scale
    /// (encoding uses 2^(n-1) - 1, decoding divides by 2^(n-1)).
    fn tolerance(enc: Enc) -> f32 {
        match enc {
            Enc::F32 | Enc::F64 => 1e-7,
            _ => 2.0 / (1u64 << (enc.bits() - 1)) as f32,
        }
    }

    /// Interleaved test signal covering full scale, zero and odd values.
    fn signal(channels: u16, frames: usize) -> Vec<f32> {
        (0..frames * usize::from(channels))
            .map(|i| {
                let x = ((i as f32) * 0.37).sin() * 0.999;
                if i % 17 == 0 {
                    -1.0
                } else {
                    x
                }
            })
            .collect()
    }

    fn check_decode(bytes: &[u8], rate: u32, channels: u16, expected: &[f32], tol: f32) {
        let audio = decode_wav(bytes).unwrap_or_else(|e| panic!("decode failed: {e}"));
        assert_eq!(audio.sample_rate, rate);
        assert_eq!(audio.channels, channels);
        assert_eq!(audio.samples.len(), expected.len());
        for (i, (got, want)) in audio.samples.iter().zip(expected).enumerate() {
            assert!(
                (got - want).abs() <= tol,
                "sample {i}: got {got}, want {want}, tolerance {tol}"
            );
            assert!((-1.0..=1.0).contains(got), "sample {i} out of range: {got}");
        }
    }

    fn check_err(bytes: &[u8], expected: WavError) {
        assert_eq!(decode_wav(bytes), Err(expected));
    }

    #[test]
    fn every_plain_format_round_trips_within_quantisation_tolerance() {
        for enc in Enc::ALL {
            for (channels, rate) in [(1u16, 16_000u32), (2, 44_100), (6, 48_000), (1, 1_000)] {
                let samples = signal(channels, 50);
                let bytes = plain_wav(enc, channels, rate, &samples);
                check_decode(&bytes, rate, channels, &samples, tolerance(enc));
            }
        }
    }

    #[test]
    fn extensible_int_and_float_round_trip() {
        let cases = [
            (Enc::I16, 16, FORMAT_PCM),
            (Enc::I24, 20, FORMAT_PCM), // 20 valid bits in a 24-bit container
            (Enc::I24, 24, FORMAT_PCM),
            (Enc::I32, 24, FORMAT_PCM),
            (Enc::U8, 8, FORMAT_PCM),
            (Enc::F32, 32, FORMAT_IEEE_FLOAT),
            (Enc::F64, 64, FORMAT_IEEE_FLOAT),
            (Enc::I16, 0, FORMAT_PCM), // some writers leave valid bits at 0
        ];
        for (enc, valid, sub) in cases {
            let samples = signal(2, 40);
            let bytes = riff(&[
                chunk(
                    b"fmt ",
                    &fmt_extensible(2, 22_050, enc.bits(), valid, sub),
                    None,
                ),
                chunk(b"data", &enc.encode(&samples), None),
            ]);
            check_decode(&bytes, 22_050, 2, &samples, tolerance(enc));
        }
    }

    #[test]
    fn integer_extremes_map_to_unit_range() {
        let cases: [(Enc, Vec<u8>, Vec<f32>); 4] = [
            (Enc::U8, vec![0, 128, 255], vec![-1.0, 0.0, 127.0 / 128.0]),
            (
                Enc::I16,
                vec![0x00, 0x80, 0, 0, 0xFF, 0x7F],
                vec![-1.0, 0.0, 32_767.0 / 32_768.0],
            ),
            (
                Enc::I24,
                vec![0, 0, 0x80, 0xFF, 0xFF, 0xFF],
                vec![-1.0, -1.0 / 8_388_608.0],
            ),
            (
                Enc::I32,
                vec![0, 0, 0, 0x80, 0, 0, 0, 0x40],
                vec![-1.0, 0.5],
            ),
        ];
        for (enc, data, expected) in cases {
            let bytes = riff(&[
                chunk(b"fmt ", &fmt_body(enc.format_tag(), 1, 8_000, enc.bits()), None),
                chunk(b"data", &data, None),
            ]);
            check_decode(&bytes, 8_000, 1, &expected, 1e-9);
        }
    }

    #[test]
    fn float_overs_and_nan_are_clamped_to_unit_range() {
        let raw = [1.5f32, -3.0, f32::NAN, f32::INFINITY, 0.25];
        let bytes = plain_wav(Enc::F32, 1, 16_000, &raw);
        check_decode(&bytes, 16_000, 1, &[1.0, -1.0, 0.0, 1.0, 0.25], 0.0);
    }

    #[test]
    fn odd_sized_unknown_chunks_are_skipped_with_padding() {
        let samples = signal(1, 33); // 33 bytes of u8 data: odd data chunk too
        let fmt = chunk(b"fmt ", &fmt_body(FORMAT_PCM, 1, 8_000, 8), None);
        let data = chunk(b"data", &Enc::U8.encode(&samples), None);
        let junk = |id: &[u8; 4], len: usize| chunk(id, &vec![0xAB; len], None);
        let layouts = [
            vec![junk(b"JUNK", 3), fmt.clone(), data.clone()],
            vec![
                fmt.clone(),
                junk(b"LIST", 7),
                junk(b"fact", 4),
                data.clone(),
            ],
            vec![
                junk(b"bext", 1),
                fmt.clone(),
                junk(b"junk", 0),
                data.clone(),
            ],
            vec![fmt.clone(), data.clone(), junk(b"LIST", 5)],
        ];
        for layout in layouts {
            check_decode(&riff(&layout), 8_000, 1, &samples, tolerance(Enc::U8));
        }
    }

    #[test]
    fn oversized_data_size_uses_whole_frames_present() {
        let samples = signal(2, 10);
        let mut data = Enc::I16.encode(&samples);
        data.extend_from_slice(&[1, 2]); // partial trailing frame from a cut-off stream
        for declared in [u32::MAX, 0x7FFF_FFFF, 1_000] {
            let bytes = riff(&[
                chunk(b"fmt ", &fmt_body(FORMAT_PCM, 2, 16_000, 16), None),
                chunk(b"data", &data, Some(declared)),
            ]);
            check_decode(&bytes, 16_000, 2, &samples, tolerance(Enc::I16));
        }
    }

    #[test]
    fn declared_data_size_shorter_than_file_is_respected() {
        let samples = signal(1, 8);
        let mut data = Enc::I16.encode(&samples);
        data.extend_from_slice(&[0x11; 10]); // trailing bytes outside the declared chunk
        let bytes = riff(&[
            chunk(b"fmt ", &fmt_body(FORMAT_PCM, 1, 16_000, 16), None),
            chunk(b"data", &data, Some(16)),
        ]);
        check_decode(&bytes, 16_000, 1, &samples, tolerance(Enc::I16));
    }

    #[test]
    fn malformed_inputs_return_the_matching_error() {
        let fmt16 = chunk(b"fmt ", &fmt_body(FORMAT_PCM, 1, 16_000, 16), None);
        let data = chunk(b"data", &[0, 0, 0, 0], None);
        let with_fmt = |fmt: Vec<u8>| riff(&[chunk(b"fmt ", &fmt, None), data.clone()]);
        let mut bad_align = fmt_body(FORMAT_PCM, 2, 16_000, 16);
        bad_align[12] = 3;
        let mut bad_guid = fmt_extensible(1, 16_000, 16, 16, FORMAT_PCM);
        bad_guid[32] = 0x42; // first byte of the GUID's Data4 field
        let mut truncated_ext = fmt_extensible(1, 16_000, 16, 16, FORMAT_PCM);
        truncated_ext.truncate(30);

        let cases: Vec<(Vec<u8>, WavError)> = vec![
            (
                b"OggS\0\0\0\0WAVE".to_vec(),
                WavError::NotRiffWave {
                    found: "OggS\\x00\\x00\\x00\\x00WAVE".into(),
                },
            ),
            (
                b"RIFF\0\0\0\0AVI ".to_vec(),
                WavError::NotRiffWave {
                    found: "RIFF\\x00\\x00\\x00\\x00AVI ".into(),
                },
            ),
            (b"hi".to_vec(), WavError::NotRiffWave { found: "hi".into() }),
            (Vec::new(), trunc("riff header", 12, 0)),
            (b"RIF".to_vec(), trunc("riff header", 12, 3)),
            (b"RIFF\0\0\0\0WA".to_vec(), trunc("riff header", 12, 10)),
            (riff(&[]), WavError::MissingFmtChunk),
            (riff(std::slice::from_ref(&data)), WavError::MissingFmtChunk),
            (
                riff(&[data.clone(), fmt16.clone()]),
                WavError::MissingFmtChunk,
            ),
            (
                riff(std::slice::from_ref(&fmt16)),
                WavError::MissingDataChunk,
            ),
            (
                riff(&[fmt16.clone(), chunk(b"LIST", &[1, 2], None)]),
                WavError::MissingDataChunk,
            ),
            (
                riff(&[fmt16.clone(), chunk(b"LIST", &[1, 2], Some(100))]),
                trunc("\"LIST\" chunk", 100, 2),
            ),
            (
                with_fmt(fmt_body(0x0055, 1, 16_000, 16)),
                WavError::UnsupportedFormatTag {
                    tag: 0x55,
                    name: "mpeg layer 3",
                },
            ),
            (
                with_fmt(fmt_body(0x1234, 1, 16_000, 16)),
                WavError::UnsupportedFormatTag {
                    tag: 0x1234,
                    name: "unknown",
                },
            ),
            (
                with_fmt(fmt_body(FORMAT_PCM, 1, 16_000, 12)),
                WavError::UnsupportedBitsPerSample {
                    bits: 12,
                    kind: "integer",
                },
            ),
            (
                with_fmt(fmt_body(FORMAT_PCM, 1, 16_000, 0)),
                WavError::UnsupportedBitsPerSample {
                    bits: 0,
                    kind: "integer",
                },
            ),
            (
                with_fmt(fmt_body(FORMAT_IEEE_FLOAT, 1, 16_000, 16)),
                WavError::UnsupportedBitsPerSample {
                    bits: 16,
                    kind: "float",
                },
            ),
            (
                with_fmt(fmt_body(FORMAT_PCM, 0, 16_000, 16)),
                WavError::ZeroChannels,
            ),
            (
                with_fmt(fmt_body(FORMAT_PCM, 1, 0, 16)),
                WavError::ZeroSampleRate,
            ),
            (with_fmt(fmt_body(FORMAT_PCM, 1, 1, 16)), WavError::SampleRateOutOfRange { rate: 1 }),
            (
                with_fmt(fmt_body(FORMAT_PCM, 1, 4_294_967_295, 16)),
                WavError::SampleRateOutOfRange { rate: 4_294_967_295 },
            ),
            (with_fmt(fmt_body(FORMAT_PCM, 32_767, 16_000, 8)), WavError::TooManyChannels { channels: 32_767 }),
            (
                with_fmt(bad_align),
                WavError::BlockAlignMismatch {
                    block_align: 3,
                    channels: 2,
                    bits: 16,
                    expected: 4,
                },
            ),
            (
                with_fmt(fmt_body(FORMAT_PCM, 1, 16_000, 16)[..14].to_vec()),
                trunc("fmt chunk", 16, 14),
            ),
            (with_fmt(truncated_ext), trunc("fmt chunk", 40, 30)),
            (
                with_fmt(fmt_extensible(1, 16_000, 16, 20, FORMAT_PCM)),
                WavError::InvalidValidBits {
                    valid_bits: 20,
                    container_bits: 16,
                },
            ),
            (
                with_fmt(fmt_extensible(1, 16_000, 16, 16, 0x0002)),
                WavError::UnsupportedSubFormat {
                    guid: "00000002-0000-0010-8000-00aa00389b71".into(),
                },
            ),
            (
                with_fmt(bad_guid),
                WavError::UnsupportedSubFormat {
                    guid: "00000001-0000-0010-4200-00aa00389b71".into(),
                },
            ),
            (
                riff(&[fmt16.clone(), chunk(b"data", &[], None)]),
                WavError::EmptyAudio {
                    data_bytes: 0,
                    block_align: 2,
                },
            ),
            (
                riff(&[fmt16.clone(), chunk(b"data", &[7], None)]),
                WavError::EmptyAudio {
                    data_bytes: 1,
                    block_align: 2,
                },
            ),
        ];
        for (bytes, expected) in cases {
            check_err(&bytes, expected);
        }
    }

    fn trunc(what: &str, needed: u64, available: u64) -> WavError {
        WavError::TruncatedHeader {
            what: what.to_owned(),
            needed,
            available,
        }
    }

    #[test]
    fn error_messages_name_the_offending_value() {
        let cases = [
            (
                WavError::UnsupportedBitsPerSample {
                    bits: 12,
                    kind: "integer",
                },
                "unsupported wav sample format: 12-bit integer",
            ),
            (
                WavError::UnsupportedFormatTag {
                    tag: 0x55,
                    name: "mpeg layer 3",
                },
                "unsupported wav format tag: 0x0055 (mpeg layer 3)",
            ),
            (
                WavError::TooLong { frames: 10, max: 5 },
                "wav audio too long: 10 frames exceeds the limit of 5",
            ),
        ];
        for (err, message) in cases {
            assert_eq!(err.to_string(), message);
        }
    }

    #[test]
    fn frame_limit_is_enforced_before_decoding() {
        let bytes = plain_wav(Enc::I16, 2, 16_000, &signal(2, 100));
        let cases = [
            (100, Ok(100)),
            (1_000, Ok(100)),
            (
                99,
                Err(WavError::TooLong {
                    frames: 100,
                    max: 99,
                }),
            ),
        ];
        for (max, expected) in cases {
            let got = decode_wav_limited(&bytes, max).map(|a| a.frames());
            assert_eq!(got, expected, "limit {max}");
        }
    }

    #[test]
    fn every_truncation_of_a_valid_file_is_an_error_or_a_prefix() {
        let samples = signal(2, 20);
        let bytes = riff(&[
            chunk(b"LIST", &[1, 2, 3], None),
            chunk(
                b"fmt ",
                &fmt_extensible(2, 16_000, 24, 24, FORMAT_PCM),
                None,
            ),
            chunk(b"data", &Enc::I24.encode(&samples), None),
        ]);
        for len in 0..bytes.len() {
            match decode_wav(&bytes[..len]) {
                // A cut inside the data chunk keeps the whole frames that made it.
                Ok(audio) => {
                    assert!(audio.samples.len() < samples.len() && audio.samples.len() % 2 == 0)
                }
                Err(
                    WavError::TruncatedHeader { .. }
                    | WavError::MissingFmtChunk
                    | WavError::MissingDataChunk
                    | WavError::EmptyAudio { .. },
                ) => {}
                Err(other) => panic!("length {len}: unexpected error {other}"),
            }
        }
    }

    #[test]
    fn duration_and_mono_downmix() {
        let audio = Audio {
            sample_rate: 4,
            channels: 3,
            samples: vec![0.3, 0.6, 0.0, -1.0, -1.0, -1.0],
        };
        assert_eq!(audio.frames(), 2);
        assert!((audio.duration_seconds() - 0.5).abs() < 1e-12);
        let mono = audio.to_mono();
        assert_eq!(mono.len(), 2);
        assert!((mono[0] - 0.3).abs() < 1e-6 && (mono[1] + 1.0).abs() < 1e-6);

        // Hand-built degenerate values must not panic or divide by zero.
        let degenerate = Audio {
            sample_rate: 0,
            channels: 0,
            samples: vec![0.5],
        };
        assert_eq!(degenerate.duration_seconds(), 0.0);
        assert!(degenerate.to_mono().is_empty());
    }

    /// Decodes with symphonia (dev-dependency, `wav` + `pcm` only): the reference the
    /// differential property below checks this parser against.
    fn symphonia_decode(bytes: &[u8]) -> Result<(u32, u16, Vec<f32>), String> {
        use symphonia::core::codecs::audio::AudioDecoderOptions;
        use symphonia::core::formats::{FormatOptions, FormatReader, TrackType};
        use symphonia::core::io::MediaSourceStream;
        use symphonia::default::formats::WavReader;

        let source = Box::new(std::io::Cursor::new(bytes.to_vec()));
        let mss = MediaSourceStream::new(source, Default::default());
        let mut reader = WavReader::try_new(mss, FormatOptions::default()).map_err(|e| e.to_string())?;
        let track = reader.default_track(TrackType::Audio).ok_or("no audio track")?;
        let params = track.codec_params.as_ref().and_then(|p| p.audio()).ok_or("no audio params")?.clone();
        let rate = params.sample_rate.ok_or("no rate")?;
        let channels = params.channels.as_ref().map(|c| c.count()).ok_or("no channels")?;
        let mut decoder = symphonia::default::get_codecs()
            .make_audio_decoder(&params, &AudioDecoderOptions::default())
            .map_err(|e| e.to_string())?;
        let mut samples = Vec::new();
        while let Some(packet) = reader.next_packet().map_err(|e| e.to_string())? {
            let buf = decoder.decode(&packet).map_err(|e| e.to_string())?;
            let at = samples.len();
            samples.resize(at + buf.samples_interleaved(), 0.0f32);
            buf.copy_to_slice_interleaved(&mut samples[at..]);
        }
        Ok((rate, u16::try_from(channels).map_err(|e| e.to_string())?, samples))
    }

    fn any_encoding() -> impl Strategy<Value = Enc> {
        proptest::sample::select(Enc::ALL.to_vec())
    }

    /// Probe and decode read the same header: they fail alike, or agree on the shape.
    fn probe_agrees_with_decode(bytes: &[u8]) -> Result<(), TestCaseError> {
        match (probe_wav(bytes), decode_wav(bytes)) {
            (Ok(info), Ok(audio)) => {
                prop_assert_eq!(info.frames, audio.frames() as u64);
                prop_assert_eq!((info.sample_rate, info.channels), (audio.sample_rate, audio.channels));
                prop_assert!(audio.samples.iter().all(|x| (-1.0..=1.0).contains(x)));
                prop_assert!(audio.channels >= 1 && audio.sample_rate >= MIN_SAMPLE_RATE_HZ);
            }
            (Err(p), Err(d)) => prop_assert_eq!(p, d),
            (p, d) => prop_assert!(false, "probe {:?} but decode {:?}", p, d.map(|a| a.frames())),
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            probe_agrees_with_decode(&bytes)?;
        }

        #[test]
        fn arbitrary_bytes_behind_a_riff_header_never_panic(
            body in proptest::collection::vec(any::<u8>(), 0..256),
            fmt_first in any::<bool>(),
        ) {
            // Random bytes alone rarely get past the magic; start them inside a RIFF/WAVE file.
            let mut bytes = riff(&[]);
            if fmt_first {
                bytes.extend_from_slice(&chunk(b"fmt ", &fmt_body(FORMAT_PCM, 1, 16_000, 16), None));
            }
            bytes.extend_from_slice(&body);
            probe_agrees_with_decode(&bytes)?;
        }

        #[test]
        fn mutated_valid_files_never_panic(
            edits in proptest::collection::vec((0usize..120, any::<u8>()), 1..8),
            cut in 0usize..140,
        ) {
            let mut bytes = riff(&[
                chunk(b"fmt ", &fmt_extensible(2, 16_000, 32, 32, FORMAT_IEEE_FLOAT), None),
                chunk(b"data", &Enc::F32.encode(&signal(2, 8)), None),
            ]);
            for (at, value) in edits {
                if let Some(b) = bytes.get_mut(at) {
                    *b = value;
                }
            }
            bytes.truncate(cut);
            probe_agrees_with_decode(&bytes)?;
        }

        /// Differential check against symphonia on well-formed files: every encoding, plain or
        /// EXTENSIBLE, 1-6 channels, with odd-sized chunks before and after the data.
        #[test]
        fn well_formed_files_decode_exactly_as_symphonia_does(
            enc in any_encoding(),
            extensible in any::<bool>(),
            channels in 1u16..=6,
            rate in prop_oneof![Just(8_000u32), Just(16_000), Just(22_050), Just(44_100), Just(48_000), 1_000u32..=384_000],
            frames in 1usize..200,
            before in proptest::collection::vec((proptest::sample::select(vec![*b"JUNK", *b"bext", *b"afsp", *b"id3 "]), 0usize..9), 0..3),
            after_data in proptest::option::of(0usize..9),
        ) {
            let samples = signal(channels, frames);
            let fmt = if extensible {
                fmt_extensible(channels, rate, enc.bits(), enc.bits(), enc.format_tag())
            } else {
                fmt_body(enc.format_tag(), channels, rate, enc.bits())
            };
            let mut chunks: Vec<Vec<u8>> = before.iter().map(|(id, len)| chunk(id, &vec![0x5A; *len], None)).collect();
            chunks.push(chunk(b"fmt ", &fmt, None));
            chunks.push(chunk(b"data", &enc.encode(&samples), None));
            if let Some(len) = after_data {
                chunks.push(chunk(b"LIST", &vec![0x33; len], None));
            }
            let bytes = riff(&chunks);

            let ours = decode_wav(&bytes).map_err(|e| TestCaseError::fail(format!("wav.rs: {e}")))?;
            let (s_rate, s_channels, s_samples) = symphonia_decode(&bytes).map_err(|e| TestCaseError::fail(format!("symphonia: {e}")))?;
            prop_assert_eq!((ours.sample_rate, ours.channels), (s_rate, s_channels));
            prop_assert_eq!(ours.samples.len(), s_samples.len());
            for (i, (a, b)) in ours.samples.iter().zip(&s_samples).enumerate() {
                prop_assert!((a - b).abs() <= 1e-7, "sample {}: wav.rs {} symphonia {}", i, a, b);
            }
            prop_assert_eq!(probe_wav(&bytes).map(|i| i.frames), Ok(frames as u64));
        }
    }
}
