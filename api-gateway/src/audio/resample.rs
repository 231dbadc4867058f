//! Sample-rate conversion for mono `f32` signals, on top of [`rubato`].
//!
//! # Hand-written or library: the decision, measured
//!
//! Until issue 13 this module held its own Kaiser-windowed polyphase sinc resampler (478
//! lines). `api-gateway/examples/audio_libs.rs` measured it against `rubato` 5.0.1 (release
//! build, 2 shared cores, mono, best of 3; `cargo run --release -p vramgate-gateway --example
//! audio_libs resample`; the hand-written column is the resampler of commit 1a0adfc):
//!
//! | measure                                            | hand-written | rubato `Fft` | rubato sinc (256 taps) |
//! |----------------------------------------------------|-------------:|-------------:|-----------------------:|
//! | speed 44.1 kHz → 16 kHz (input samples/s)          |     48–75 M  |   115–210 M  |               26–28 M |
//! | speed 48 kHz → 16 kHz                              |     60–86 M  |   124–157 M  |               29–37 M |
//! | speed 8 kHz → 16 kHz                               |        39 M  |   104–116 M  |                 6–7 M |
//! | speed 383,987 Hz → 16 kHz (10 s, setup included)   |     220 ms   |  175–205 ms  |            17–21 ms   |
//! | 1 kHz residual after a sine fit, 44.1k → 16k (dB)  |      -137    |      -140    |                -142   |
//! | 1 kHz residual after a sine fit, 8k → 16k (dB)     |      -122    |      -144    |                -141   |
//! | level of 7.5 kHz, 44.1k → 16k (dB)                 |      -2.4    |       0.0    |                -4.3   |
//! | alias of 8.1 kHz (lands at 7.9 kHz) (dB)           |      -77     |      -199    |                 -33   |
//! | alias of 8.5 kHz (lands at 7.5 kHz) (dB)           |      -83     |      -177    |                 -81   |
//! | alias of 15 kHz (lands at 1 kHz) (dB)              |     -108     |      -169    |                -166   |
//! | image of 3.5 kHz at 4.5 kHz, 8k → 16k (dB)         |      -87     |      -148    |                -145   |
//! | output delay at 44.1k → 16k (output samples)       |       0      |     -0.18    |                -0.56  |
//!
//! (Speeds vary by about 1.5× between runs on the shared machine.) rubato's synchronous FFT
//! resampler is 2–3× faster than the hand-written one, keeps the
//! passband flatter and rejects aliases and images by 60–120 dB more, and it is maintained and used by
//! many. No measured reason kept ours, so the conversion now runs on `rubato::Fft`. Its one
//! difference, a constant sub-sample delay (0.18 of a 16 kHz sample, 11 µs, at 44.1 kHz), is
//! far below the VAD's 32 ms window. This module is the thin wrapper that keeps the gateway's
//! contract: the output length is `round(len · to / from)`, equal rates copy, empty input or a
//! zero rate gives nothing, and no untrusted rate can size a buffer out of proportion.
//!
//! The FFT resampler works on blocks of `from / gcd` input and `to / gcd` output frames, so a
//! rate pair whose reduced fraction is huge (e.g. a 4,294,967,291 Hz header against 16 kHz)
//! would ask it for gigabyte-sized transforms. Every rate the WAV decoder takes (1 kHz–384 kHz)
//! against 16 kHz stays within [`MAX_FFT_BLOCK`]; past it this module uses rubato's
//! asynchronous sinc resampler instead (default 256-tap parameters, the right-hand column
//! above), whose memory does not grow with the fraction. After the move the example measures
//! this wrapper at the same speed and quality as bare `rubato::Fft`, with the rounded length.

use rubato::audioadapter_buffers::direct::InterleavedSlice;
use rubato::{Async, Fft, FixedAsync, FixedSync, Resampler, SincInterpolationParameters};
use thiserror::Error;

/// Chunk size asked of rubato: input frames per FFT block, rounded up to whole blocks of the
/// reduced rate fraction (rubato's own starting suggestion).
const CHUNK: usize = 1024;

/// Largest FFT block (input or output frames) the FFT path may build. A 384 kHz input against
/// 16 kHz needs 384,000; past `2^19` the asynchronous sinc resampler takes over.
pub const MAX_FFT_BLOCK: u64 = 1 << 19;

/// Why rubato refused a conversion. The wrapper only calls it with non-zero rates and
/// consistent buffers, so seeing one of these is a bug.
#[derive(Debug, Error)]
pub enum ResampleError {
    #[error("could not build the {from_hz} Hz -> {to_hz} Hz resampler: {source}")]
    Construction {
        from_hz: u32,
        to_hz: u32,
        source: rubato::ResamplerConstructionError,
    },
    #[error("could not wrap {frames} frames for the resampler: {source}")]
    Input {
        frames: usize,
        source: rubato::audioadapter_buffers::SizeError,
    },
    #[error("resampling {from_hz} Hz -> {to_hz} Hz failed: {source}")]
    Process {
        from_hz: u32,
        to_hz: u32,
        source: rubato::ResampleError,
    },
}

/// Which rubato resampler a rate pair gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// Synchronous FFT resampler: fixed ratio, best quality, fastest.
    Fft,
    /// Asynchronous sinc resampler: any ratio in bounded memory.
    Sinc,
}

/// Resamples a mono signal from `from_hz` to `to_hz`.
///
/// The output has `round(input.len() * to_hz / from_hz)` samples; output sample `k` sits at
/// input time `k * from_hz / to_hz` (rubato's start-up delay is trimmed), so the first samples
/// line up. Equal rates return a copy of the input. A zero rate or empty input yields an empty
/// output, since there is no meaningful signal to produce.
///
/// Memory and time grow with the output length: callers handling untrusted headers must bound
/// the duration (and therefore `len * to_hz / from_hz`) first.
pub fn resample(input: &[f32], from_hz: u32, to_hz: u32) -> Result<Vec<f32>, ResampleError> {
    if input.is_empty() || from_hz == 0 || to_hz == 0 {
        return Ok(Vec::new());
    }
    if from_hz == to_hz {
        return Ok(input.to_vec());
    }
    match output_len(input.len(), from_hz, to_hz) {
        0 => Ok(Vec::new()),
        out_len => run(engine(from_hz, to_hz), input, from_hz, to_hz, out_len),
    }
}

/// `round(len * to / from)`, computed in 128 bits so no input length overflows.
fn output_len(len: usize, from_hz: u32, to_hz: u32) -> usize {
    let (from, to) = (u128::from(from_hz), u128::from(to_hz));
    let rounded = (len as u128 * to + from / 2) / from;
    usize::try_from(rounded).unwrap_or(usize::MAX)
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The FFT path when its blocks, sized as `rubato::Fft::new` sizes them for [`CHUNK`], stay
/// within [`MAX_FFT_BLOCK`]; the sinc path otherwise.
fn engine(from_hz: u32, to_hz: u32) -> Engine {
    let (from, to) = (u64::from(from_hz), u64::from(to_hz));
    let g = gcd(from, to).max(1);
    let (min_in, min_out) = (from / g, to / g);
    let blocks = (CHUNK as u64).div_ceil(min_in).max(1);
    let fits = |min: u64| {
        min.checked_mul(blocks)
            .is_some_and(|size| size <= MAX_FFT_BLOCK)
    };
    if fits(min_in) && fits(min_out) {
        Engine::Fft
    } else {
        Engine::Sinc
    }
}

fn run(
    engine: Engine,
    input: &[f32],
    from_hz: u32,
    to_hz: u32,
    out_len: usize,
) -> Result<Vec<f32>, ResampleError> {
    let construction = |source| ResampleError::Construction {
        from_hz,
        to_hz,
        source,
    };
    let mut resampler: Box<dyn Resampler<f32>> = match engine {
        Engine::Fft => Box::new(
            Fft::<f32>::new(from_hz as usize, to_hz as usize, CHUNK, 1, FixedSync::Both)
                .map_err(construction)?,
        ),
        Engine::Sinc => Box::new(
            Async::<f32>::new_sinc(
                f64::from(to_hz) / f64::from(from_hz),
                1.0,
                &SincInterpolationParameters::default(),
                CHUNK,
                1,
                FixedAsync::Input,
            )
            .map_err(construction)?,
        ),
    };
    let process = |source| ResampleError::Process {
        from_hz,
        to_hz,
        source,
    };
    let adapter =
        InterleavedSlice::new(input, 1, input.len()).map_err(|source| ResampleError::Input {
            frames: input.len(),
            source,
        })?;
    let mut out = resampler
        .process_all(&adapter, input.len(), None)
        .map_err(process)?
        .take_data();
    // rubato rounds the length up; the gateway's contract rounds to nearest.
    out.resize(out_len, 0.0);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audio::wav;

    fn rs(input: &[f32], from: u32, to: u32) -> Vec<f32> {
        resample(input, from, to).unwrap_or_else(|e| panic!("{from}->{to}: {e}"))
    }

    fn sine(freq: f64, rate: u32, seconds: f64, amp: f64) -> Vec<f32> {
        let n = (seconds * f64::from(rate)) as usize;
        let w = 2.0 * std::f64::consts::PI * freq / f64::from(rate);
        (0..n)
            .map(|i| (amp * (w * i as f64).sin()) as f32)
            .collect()
    }

    /// Drops `margin` seconds at each end, where the zero padding of the
    /// filter makes the signal ramp in and out.
    fn middle(x: &[f32], rate: u32, margin: f64) -> &[f32] {
        let m = (margin * f64::from(rate)) as usize;
        x.get(m..x.len().saturating_sub(m)).unwrap_or_default()
    }

    fn rms(x: &[f32]) -> f64 {
        (x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / x.len().max(1) as f64).sqrt()
    }

    /// Frequency from rising zero crossings, each located by linear
    /// interpolation; accurate to far below 1 Hz over a second of signal.
    fn frequency(x: &[f32], rate: u32) -> f64 {
        let crossings: Vec<f64> = x
            .windows(2)
            .enumerate()
            .filter(|(_, w)| w[0] < 0.0 && w[1] >= 0.0)
            .map(|(i, w)| i as f64 + f64::from(w[0] / (w[0] - w[1])))
            .collect();
        let (first, last) = (crossings[0], crossings[crossings.len() - 1]);
        (crossings.len() - 1) as f64 * f64::from(rate) / (last - first)
    }

    /// Tolerances: frequency within 1 Hz, RMS within 1% of amp/sqrt(2), over the
    /// middle of a 1 s tone (0.1 s trimmed at each end).
    fn check_tone(from: u32, to: u32, freq: f64) {
        let amp = 0.5;
        let out = rs(&sine(freq, from, 1.0, amp), from, to);
        let mid = middle(&out, to, 0.1);
        let got_freq = frequency(mid, to);
        assert!(
            (got_freq - freq).abs() < 1.0,
            "{from}->{to} Hz, {freq} Hz tone: measured {got_freq} Hz"
        );
        let want_rms = amp / 2f64.sqrt();
        let got_rms = rms(mid);
        assert!(
            (got_rms / want_rms - 1.0).abs() < 0.01,
            "{from}->{to} Hz, {freq} Hz tone: rms {got_rms}, want {want_rms}"
        );
    }

    #[test]
    fn tones_keep_frequency_within_1hz_and_rms_within_1pct_into_16k() {
        for from in [8_000, 11_025, 16_000, 22_050, 44_100, 48_000, 96_000] {
            for freq in [440.0, 3_000.0] {
                check_tone(from, 16_000, freq);
            }
        }
    }

    #[test]
    fn tones_keep_frequency_within_1hz_and_rms_within_1pct_other_ratios() {
        // 47_999 -> 16_000 and 8_000 -> 44_101 reduce to huge fractions and take
        // the interpolated-table path; the rest are upsampling with exact tables.
        for (from, to) in [
            (47_999, 16_000),
            (8_000, 44_101),
            (16_000, 48_000),
            (16_000, 44_100),
            (11_025, 22_050),
        ] {
            for freq in [440.0, 3_000.0] {
                check_tone(from, to, freq);
            }
        }
    }

    /// Attenuation in dB of a full-length tone, measured away from the edges.
    fn attenuation_db(from: u32, to: u32, freq: f64) -> f64 {
        let input = sine(freq, from, 1.0, 0.5);
        let out = rs(&input, from, to);
        20.0 * (rms(middle(&input, from, 0.1)) / rms(middle(&out, to, 0.1))).log10()
    }

    #[test]
    fn tone_above_target_nyquist_is_attenuated_at_least_40db() {
        let db = attenuation_db(48_000, 16_000, 10_000.0);
        assert!(db >= 40.0, "10 kHz from 48 kHz: only {db:.1} dB");
    }

    #[test]
    fn stopband_is_at_least_60db_from_target_nyquist_plus_1khz() {
        for (from, freq) in [
            (48_000, 9_000.0),
            (48_000, 12_000.0),
            (48_000, 20_000.0),
            (44_100, 9_000.0),
            (96_000, 30_000.0),
            (22_050, 10_000.0),
            (47_999, 9_000.0),
        ] {
            let db = attenuation_db(from, 16_000, freq);
            assert!(db >= 60.0, "{freq} Hz from {from} Hz: only {db:.1} dB");
        }
    }

    #[test]
    fn output_length_is_rounded_ratio() {
        let cases = [
            (1, 48_000, 16_000, 0),
            (2, 48_000, 16_000, 1),
            (3, 48_000, 16_000, 1),
            (1, 8_000, 16_000, 2),
            (5, 22_050, 16_000, 4),
            (7, 11_025, 16_000, 10),
            (441, 44_100, 16_000, 160),
            (1_000, 44_100, 16_000, 363),
            (480_000, 48_000, 16_000, 160_000),
            (100, 16_000, 16_000, 100),
            (10, 16_000, 44_101, 28),
        ];
        for (len, from, to, want) in cases {
            assert_eq!(
                rs(&vec![0.1; len], from, to).len(),
                want,
                "{len} samples {from}->{to}"
            );
        }
    }

    #[test]
    fn degenerate_inputs_give_empty_or_identity() {
        let x = [0.1f32, -0.2, 0.3];
        let cases: [(&[f32], u32, u32, Vec<f32>); 5] = [
            (&[], 48_000, 16_000, vec![]),
            (&[], 16_000, 16_000, vec![]),
            (&x, 0, 16_000, vec![]),
            (&x, 16_000, 0, vec![]),
            (&x, 22_050, 22_050, x.to_vec()),
        ];
        for (input, from, to, want) in cases {
            assert_eq!(rs(input, from, to), want, "{from}->{to}");
        }
    }

    /// "Away from edges" is 40 ms: the step from silence to DC at each end rings above 1e-4
    /// for up to 31 ms (47,999 Hz, whose FFT block is a second long), 22 ms (8 kHz) and under
    /// 6 ms (44.1 and 48 kHz) with rubato's FFT filter.
    #[test]
    fn dc_level_is_preserved_within_1e4_away_from_edges() {
        for (from, to) in [
            (48_000, 16_000),
            (44_100, 16_000),
            (8_000, 16_000),
            (47_999, 16_000),
        ] {
            let out = rs(&vec![0.5; from as usize], from, to);
            for (i, v) in middle(&out, to, 0.04).iter().enumerate() {
                assert!((v - 0.5).abs() < 1e-4, "{from}->{to}: sample {i} = {v}");
            }
        }
    }

    #[test]
    fn every_rate_the_decoder_takes_gets_the_fft_path_into_16k() {
        let sinc: Vec<u32> = (wav::MIN_SAMPLE_RATE_HZ..=wav::MAX_SAMPLE_RATE_HZ)
            .filter(|&from| engine(from, 16_000) != Engine::Fft)
            .collect();
        assert!(
            sinc.is_empty(),
            "sinc path for {} rates, first {:?}",
            sinc.len(),
            sinc.first()
        );
        assert_eq!(engine(4_294_967_291, 16_000), Engine::Sinc);
        assert_eq!(engine(16_000, 4_294_967_291), Engine::Sinc);
        assert_eq!(engine(1, 1 << 20), Engine::Sinc);
    }

    #[test]
    fn sinc_fallback_keeps_tones_and_rejects_aliases() {
        for (from, to) in [(44_100, 16_000), (47_999, 16_000), (8_000, 16_000)] {
            for freq in [440.0, 3_000.0] {
                let input = sine(freq, from, 1.0, 0.5);
                let len = output_len(input.len(), from, to);
                let out = run(Engine::Sinc, &input, from, to, len).expect("sinc resamples");
                assert_eq!(out.len(), len);
                let mid = middle(&out, to, 0.1);
                let got = frequency(mid, to);
                assert!(
                    (got - freq).abs() < 1.0,
                    "{from}->{to}, {freq} Hz: measured {got} Hz"
                );
                let ratio = rms(mid) / (0.5 / 2f64.sqrt());
                assert!(
                    (ratio - 1.0).abs() < 0.01,
                    "{from}->{to}, {freq} Hz: rms ratio {ratio}"
                );
            }
        }
        let input = sine(9_000.0, 48_000, 1.0, 0.5);
        let out = run(Engine::Sinc, &input, 48_000, 16_000, 16_000).expect("sinc resamples");
        let db = 20.0 * (rms(middle(&input, 48_000, 0.1)) / rms(middle(&out, 16_000, 0.1))).log10();
        assert!(
            db >= 60.0,
            "9 kHz from 48 kHz on the sinc path: only {db:.1} dB"
        );
    }

    #[test]
    fn extreme_ratios_do_not_blow_up_the_buffers() {
        let out = rs(&vec![0.25; 10_000], u32::MAX, 1);
        assert!(out.is_empty());
        // A prime rate against 16 kHz: the FFT blocks would be 4.3e9 frames; the sinc path is bounded.
        let out = rs(&vec![0.25; 1_000_000], 4_294_967_291, 16_000);
        assert_eq!(out.len(), 4);
        assert!(out.iter().all(|v| v.is_finite() && v.abs() <= 1.0));
        let out = rs(&vec![0.25; 200_000], 4_000_000, 16_000);
        assert_eq!(out.len(), 800);
        assert!(middle(&out, 16_000, 0.005)
            .iter()
            .all(|v| (v - 0.25).abs() < 1e-3));
    }

    /// Budget from the brief: a 60 s 48 kHz clip in well under a second (release).
    #[test]
    #[cfg_attr(
        debug_assertions,
        ignore = "timing is only meaningful in release builds"
    )]
    fn sixty_seconds_at_48k_resamples_in_under_a_second() {
        for from in [48_000, 44_100] {
            let input = sine(440.0, from, 60.0, 0.5);
            let start = std::time::Instant::now();
            let out = rs(&input, from, 16_000);
            let elapsed = start.elapsed();
            assert_eq!(out.len(), 960_000);
            assert!(elapsed.as_secs_f64() < 1.0, "{from} Hz took {elapsed:?}");
        }
    }
}
