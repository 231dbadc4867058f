//! Test inputs: real speech from `espeak-ng`, placed at a known position in silence and noise,
//! written as WAV in the formats the gateway must read.

use std::path::Path;
use std::process::Command;

use vramgate_shared::wav::SampleFormat as Encoding;
use vramgate_shared::wav::{chunk, fmt_body, fmt_extensible, riff};

/// How samples are stored in the file: an encoding under a classic `fmt ` header, or 16-bit
/// PCM under a `WAVE_FORMAT_EXTENSIBLE` one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleFormat {
    Plain(Encoding),
    ExtensibleI16,
}

impl SampleFormat {
    pub const U8: Self = Self::Plain(Encoding::U8);
    pub const I16: Self = Self::Plain(Encoding::I16);
    pub const I24: Self = Self::Plain(Encoding::I24);
    pub const I32: Self = Self::Plain(Encoding::I32);
    pub const F32: Self = Self::Plain(Encoding::F32);
}

/// Speech synthesised by espeak-ng, mono f32 at its native rate.
pub struct Speech {
    pub sample_rate: u32,
    pub samples: Vec<f32>,
}

/// Synthesises `text`, trimmed to where the voice actually is (espeak pads with silence).
pub fn speak(text: &str) -> anyhow::Result<Speech> {
    let out = std::env::temp_dir().join(format!("{}.wav", crate::unique("espeak")));
    let status = Command::new("espeak-ng").args(["-s", "150", "-w"]).arg(&out).arg(text).status()?;
    anyhow::ensure!(status.success(), "espeak-ng failed for {text:?}");
    let bytes = std::fs::read(&out)?;
    let _ = std::fs::remove_file(&out);
    let (sample_rate, samples) = read_pcm16_mono(&bytes)?;
    let loud = |s: &f32| s.abs() > 0.02;
    let first = samples.iter().position(loud).unwrap_or(0);
    let last = samples.iter().rposition(loud).unwrap_or(samples.len());
    Ok(Speech { sample_rate, samples: samples[first..=last.min(samples.len() - 1)].to_vec() })
}

/// Minimal reader for espeak's own output (16-bit mono PCM, canonical header).
fn read_pcm16_mono(bytes: &[u8]) -> anyhow::Result<(u32, Vec<f32>)> {
    anyhow::ensure!(bytes.len() > 44 && &bytes[0..4] == b"RIFF", "espeak output is not a wav");
    let mut pos = 12;
    let mut rate = 0;
    while pos + 8 <= bytes.len() {
        let id = &bytes[pos..pos + 4];
        let size = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into()?) as usize;
        let body = pos + 8;
        if id == b"fmt " {
            rate = u32::from_le_bytes(bytes[body + 4..body + 8].try_into()?);
        } else if id == b"data" {
            let end = (body + size).min(bytes.len());
            let samples = bytes[body..end]
                .chunks_exact(2)
                .map(|c| f32::from(i16::from_le_bytes([c[0], c[1]])) / 32768.0)
                .collect();
            return Ok((rate, samples));
        }
        pos = body + size + (size & 1);
    }
    anyhow::bail!("espeak output has no data chunk")
}

/// Linear-interpolation rate change; good enough to make test inputs at other rates.
pub fn change_rate(samples: &[f32], from: u32, to: u32) -> Vec<f32> {
    if from == to || samples.is_empty() {
        return samples.to_vec();
    }
    let n = (samples.len() as u64 * u64::from(to) / u64::from(from)) as usize;
    (0..n)
        .map(|i| {
            let x = i as f64 * f64::from(from) / f64::from(to);
            let j = x.floor() as usize;
            let frac = (x - j as f64) as f32;
            let a = samples[j.min(samples.len() - 1)];
            let b = samples[(j + 1).min(samples.len() - 1)];
            a + (b - a) * frac
        })
        .collect()
}

/// Deterministic low-level white noise (a linear congruential generator; no rand crate).
pub fn noise(len: usize, amplitude: f32, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let unit = ((state >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0;
            unit * amplitude
        })
        .collect()
}

/// Writes interleaved samples (`channels` per frame) as a WAV file, with an extra `LIST`
/// chunk between `fmt ` and `data` that readers must skip.
pub fn write_wav(
    path: &Path,
    samples: &[f32],
    sample_rate: u32,
    channels: u16,
    format: SampleFormat,
) -> std::io::Result<()> {
    let encoding = match format {
        SampleFormat::Plain(encoding) => encoding,
        SampleFormat::ExtensibleI16 => Encoding::I16,
    };
    let bits = encoding.bits();
    let fmt = match format {
        SampleFormat::ExtensibleI16 => fmt_extensible(channels, sample_rate, bits, bits, encoding.format_tag()),
        _ => fmt_body(encoding.format_tag(), channels, sample_rate, bits),
    };
    let clamped: Vec<f32> = samples.iter().map(|s| s.clamp(-1.0, 1.0)).collect();
    let file = riff(
        &[chunk(b"fmt ", &fmt, None), chunk(b"LIST", b"INFO", None), chunk(b"data", &encoding.encode(&clamped), None)],
        None,
    );
    std::fs::write(path, file)
}

/// A test clip: where the speech is, in seconds, and the interleaved samples.
pub struct Clip {
    pub speech: Option<(f64, f64)>,
    pub samples: Vec<f32>,
}

/// `lead` seconds of noise, then `speech` (if any), then `tail` seconds of noise, at `rate`
/// with `channels` identical channels.
pub fn compose(speech: Option<&Speech>, lead: f64, tail: f64, rate: u32, channels: u16, seed: u64) -> Clip {
    let lead_n = (lead * f64::from(rate)) as usize;
    let tail_n = (tail * f64::from(rate)) as usize;
    let voiced = speech.map(|s| change_rate(&s.samples, s.sample_rate, rate)).unwrap_or_default();
    let total = lead_n + voiced.len() + tail_n;
    let mut mono = noise(total, 0.003, seed);
    for (i, v) in voiced.iter().enumerate() {
        mono[lead_n + i] += v;
    }
    let span = speech.map(|_| (lead, lead + voiced.len() as f64 / f64::from(rate)));
    let samples = mono.iter().flat_map(|&s| std::iter::repeat_n(s, usize::from(channels))).collect();
    Clip { speech: span, samples }
}
