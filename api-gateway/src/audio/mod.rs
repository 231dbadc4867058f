//! Audio preprocessing for the voice-activity path.
//!
//! Owns the journey from uploaded WAV bytes to what the VAD model consumes and
//! back: [`wav`] decodes untrusted RIFF/WAVE bytes, [`resample`] converts to
//! the model's 16 kHz, and [`segments`] turns the model's per-window speech
//! probabilities into time ranges. `vramgate_shared::wav` writes WAV, for the load
//! generator's clips and the tests' inputs; the request path never writes WAV.
//!
//! The WAV parser is our own and the resampler is `rubato`'s; each module's doc
//! gives the measurements that decided it (`docs/gateway.md` sums them up).

pub mod decode;
pub mod resample;
pub mod segments;
pub mod wav;

/// Sample rate the VAD model expects.
pub const VAD_SAMPLE_RATE: u32 = 16_000;

/// Down-mixes to mono and resamples to [`VAD_SAMPLE_RATE`].
///
/// The output length scales with `duration_seconds()`, not with the input
/// size, so callers should bound the decoded duration before calling this.
pub fn to_16k_mono(audio: &wav::Audio) -> Result<Vec<f32>, resample::ResampleError> {
    resample::resample(&audio.to_mono(), audio.sample_rate, VAD_SAMPLE_RATE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stereo_48k_becomes_16k_mono() {
        let frames = 4_800;
        // Left and right carry different DC levels; the mix is their mean.
        let samples = (0..frames).flat_map(|_| [0.6f32, 0.2]).collect();
        let audio = wav::Audio {
            sample_rate: 48_000,
            channels: 2,
            samples,
        };
        let mono = to_16k_mono(&audio).expect("resamples");
        assert_eq!(mono.len(), 1_600);
        // Away from the edges, where the filter sees zero padding.
        assert!(mono[100..1_500].iter().all(|v| (v - 0.4).abs() < 1e-4));
    }

    #[test]
    fn mono_16k_passes_through_unchanged() {
        let audio = wav::Audio {
            sample_rate: 16_000,
            channels: 1,
            samples: vec![0.1, -0.2, 0.3],
        };
        assert_eq!(to_16k_mono(&audio).expect("copies"), audio.samples);
    }
}
