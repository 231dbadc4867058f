//! Speech segments from per-window voice-activity probabilities.
//!
//! This module owns the post-processing that turns the VAD model's output (one
//! speech probability per fixed-size window) into time ranges, following the
//! hysteresis of Silero VAD's `get_speech_timestamps`: speech starts at a
//! window scoring at least `threshold`, and ends only after the score has
//! dropped below a lower `neg_threshold` and stayed out of speech for
//! `min_silence_ms`. Short segments are dropped, the rest padded and merged.
//! All arithmetic is done in whole samples so window boundaries are exact.

/// Tuning for [`speech_segments`]; the defaults are Silero VAD's.
#[derive(Debug, Clone, PartialEq)]
pub struct SegmentParams {
    /// A window with probability at or above this starts (or continues) speech.
    pub threshold: f32,
    /// Below this a window counts as silence; `None` means `threshold - 0.15`.
    /// Values above `threshold` are lowered to it, since the band between the
    /// two is what keeps a segment from flickering on and off.
    pub neg_threshold: Option<f32>,
    /// Segments shorter than this (before padding) are dropped.
    pub min_speech_ms: u32,
    /// Silence must last this long to end a segment.
    pub min_silence_ms: u32,
    /// Added before and after each segment, clamped to the audio.
    pub speech_pad_ms: u32,
    /// Samples per probability window.
    pub window_samples: u32,
    /// Sample rate the windows were cut at.
    pub sample_rate: u32,
}

impl Default for SegmentParams {
    fn default() -> Self {
        SegmentParams {
            threshold: 0.5,
            neg_threshold: None,
            min_speech_ms: 250,
            min_silence_ms: 100,
            speech_pad_ms: 30,
            window_samples: 512,
            sample_rate: 16_000,
        }
    }
}

/// A span of speech, in seconds from the start of the audio.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Segment {
    pub start_seconds: f64,
    pub end_seconds: f64,
}

/// Finds speech segments in `probs`, where `probs[i]` scores samples
/// `[i * window_samples, (i + 1) * window_samples)` of audio `total_samples` long.
///
/// NaN probabilities count as 0 (silence): a model glitch must not invent speech.
/// Speech still running at the last window ends where the trailing silence began,
/// or where the probabilities (or the audio, if shorter) end. A zero
/// `window_samples` or `sample_rate` yields no segments, as no time can be computed.
pub fn speech_segments(
    probs: &[f32],
    total_samples: usize,
    params: &SegmentParams,
) -> Vec<Segment> {
    let rate = f64::from(params.sample_rate);
    sample_ranges(probs, total_samples as u64, params)
        .into_iter()
        .map(|(start, end)| Segment {
            start_seconds: start as f64 / rate,
            end_seconds: end as f64 / rate,
        })
        .collect()
}

fn ms_to_samples(ms: u32, sample_rate: u32) -> u64 {
    u64::from(ms) * u64::from(sample_rate) / 1000
}

/// The segments as `(start, end)` sample positions, after filtering, padding and merging.
fn sample_ranges(probs: &[f32], total: u64, params: &SegmentParams) -> Vec<(u64, u64)> {
    if params.window_samples == 0 || params.sample_rate == 0 {
        return Vec::new();
    }
    let window = u64::from(params.window_samples);
    let threshold = params.threshold;
    let neg_threshold = params
        .neg_threshold
        .unwrap_or(threshold - 0.15)
        .min(threshold);
    let min_speech = ms_to_samples(params.min_speech_ms, params.sample_rate);
    let min_silence = ms_to_samples(params.min_silence_ms, params.sample_rate);
    let pad = ms_to_samples(params.speech_pad_ms, params.sample_rate);
    let end_of_probs = (probs.len() as u64).saturating_mul(window).min(total);

    let mut raw = Vec::new();
    let mut speech_start: Option<u64> = None;
    // Where the current run of silence began, while inside speech.
    let mut silence_start: Option<u64> = None;
    for (i, &p) in probs.iter().enumerate() {
        let p = if p.is_nan() { 0.0 } else { p };
        let at = (i as u64).saturating_mul(window);
        match speech_start {
            None if p >= threshold => speech_start = Some(at),
            None => {}
            Some(_) if p >= threshold => silence_start = None,
            // Windows between the thresholds neither start nor cancel a pending
            // silence: that band is the hysteresis.
            Some(start) if p < neg_threshold => {
                let since = *silence_start.get_or_insert(at);
                if at.saturating_add(window) - since >= min_silence {
                    raw.push((start, since));
                    speech_start = None;
                    silence_start = None;
                }
            }
            Some(_) => {}
        }
    }
    if let Some(start) = speech_start {
        raw.push((start, silence_start.unwrap_or(end_of_probs)));
    }

    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(raw.len());
    for (start, end) in raw {
        let (start, end) = (start.min(total), end.min(total));
        if end <= start || end - start < min_speech {
            continue;
        }
        let (start, end) = (
            start.saturating_sub(pad),
            end.saturating_add(pad).min(total),
        );
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expands run-length `(probability, windows)` pairs into per-window probabilities.
    fn probs(runs: &[(f32, usize)]) -> Vec<f32> {
        runs.iter()
            .flat_map(|&(p, n)| std::iter::repeat_n(p, n))
            .collect()
    }

    const W: u64 = 512;

    /// Expected `(start, end)` sample positions.
    type Spans = Vec<(u64, u64)>;

    /// Compares against expected `(start, end)` sample positions; with all
    /// times derived from whole samples, equality is exact.
    fn check(probs: &[f32], total: usize, params: &SegmentParams, expected: &[(u64, u64)]) {
        let rate = f64::from(params.sample_rate);
        let want: Vec<Segment> = expected
            .iter()
            .map(|&(s, e)| Segment {
                start_seconds: s as f64 / rate,
                end_seconds: e as f64 / rate,
            })
            .collect();
        assert_eq!(speech_segments(probs, total, params), want);
    }

    fn with(change: impl FnOnce(&mut SegmentParams)) -> SegmentParams {
        let mut p = SegmentParams::default();
        change(&mut p);
        p
    }

    fn total_of(p: &[f32]) -> usize {
        p.len() * W as usize
    }

    const PAD: u64 = 480; // 30 ms at 16 kHz

    #[test]
    fn default_params_match_silero() {
        let d = SegmentParams::default();
        assert_eq!(
            (
                d.threshold,
                d.neg_threshold,
                d.min_speech_ms,
                d.min_silence_ms,
                d.speech_pad_ms,
                d.window_samples,
                d.sample_rate
            ),
            (0.5, None, 250, 100, 30, 512, 16_000)
        );
    }

    #[test]
    fn silence_and_degenerate_inputs_give_no_segments() {
        let cases: Vec<(Vec<f32>, SegmentParams)> = vec![
            (probs(&[(0.1, 100)]), SegmentParams::default()),
            (probs(&[(0.49, 100)]), SegmentParams::default()),
            (vec![], SegmentParams::default()),
            (vec![f32::NAN; 100], SegmentParams::default()),
            (probs(&[(0.9, 100)]), with(|p| p.window_samples = 0)),
            (probs(&[(0.9, 100)]), with(|p| p.sample_rate = 0)),
        ];
        for (p, params) in cases {
            check(&p, total_of(&p), &params, &[]);
        }
        // Audio of zero length leaves nothing to report, whatever the model said.
        check(&probs(&[(0.9, 100)]), 0, &SegmentParams::default(), &[]);
    }

    #[test]
    fn segments_land_on_exact_window_boundaries() {
        let no_pad = with(|p| p.speech_pad_ms = 0);
        let cases: Vec<(Vec<f32>, SegmentParams, Spans)> = vec![
            // One block: windows 20..50 are speech.
            (
                probs(&[(0.05, 20), (0.9, 30), (0.05, 30)]),
                no_pad.clone(),
                vec![(20 * W, 50 * W)],
            ),
            (
                probs(&[(0.05, 20), (0.9, 30), (0.05, 30)]),
                SegmentParams::default(),
                vec![(20 * W - PAD, 50 * W + PAD)],
            ),
            // Exactly at threshold counts as speech.
            (
                probs(&[(0.0, 3), (0.5, 10), (0.0, 10)]),
                no_pad.clone(),
                vec![(3 * W, 13 * W)],
            ),
            // Two blocks separated by more than min_silence.
            (
                probs(&[(0.9, 10), (0.0, 10), (0.9, 10), (0.0, 10)]),
                no_pad.clone(),
                vec![(0, 10 * W), (20 * W, 30 * W)],
            ),
        ];
        for (p, params, expected) in cases {
            check(&p, total_of(&p), &params, &expected);
        }
    }

    #[test]
    fn segments_shorter_than_min_speech_are_dropped() {
        // 256 ms = 4096 samples = exactly 8 windows.
        let params = with(|p| {
            p.min_speech_ms = 256;
            p.speech_pad_ms = 0;
        });
        let cases: [(usize, Spans); 3] = [(7, vec![]), (8, vec![(10 * W, 18 * W)]), (1, vec![])];
        for (speech_windows, expected) in cases {
            let p = probs(&[(0.0, 10), (0.95, speech_windows), (0.0, 20)]);
            check(&p, total_of(&p), &params, &expected);
        }
        // The default 250 ms drops a 5-window (160 ms) blip.
        let p = probs(&[(0.0, 20), (0.95, 5), (0.0, 30)]);
        check(&p, total_of(&p), &SegmentParams::default(), &[]);
    }

    #[test]
    fn dips_shorter_than_min_silence_do_not_split() {
        // min_silence 100 ms = 1600 samples: 3 windows (1536) keep one segment,
        // 4 windows (2048) end it at the first silent window.
        let no_pad = with(|p| p.speech_pad_ms = 0);
        let cases: [(usize, Spans); 3] = [
            (3, vec![(10 * W, 43 * W)]),
            (4, vec![(10 * W, 30 * W), (34 * W, 44 * W)]),
            (1, vec![(10 * W, 41 * W)]),
        ];
        for (dip, expected) in cases {
            let p = probs(&[(0.0, 10), (0.9, 20), (0.1, dip), (0.9, 10), (0.0, 20)]);
            check(&p, total_of(&p), &no_pad, &expected);
        }
    }

    #[test]
    fn probabilities_between_thresholds_are_hysteresis() {
        let no_pad = with(|p| p.speech_pad_ms = 0);
        // 0.4 is above the default neg_threshold (0.35): it neither starts speech
        // nor counts as silence, so the segment runs through it.
        let p = probs(&[(0.4, 10), (0.9, 10), (0.4, 30), (0.0, 20)]);
        check(&p, total_of(&p), &no_pad, &[(10 * W, 50 * W)]);
        // A pending silence is not cancelled by an in-between window: 2 silent
        // windows, one at 0.4, then one more silent one make 4 windows >= 100 ms.
        let p = probs(&[
            (0.9, 10),
            (0.0, 2),
            (0.4, 1),
            (0.0, 1),
            (0.9, 10),
            (0.0, 10),
        ]);
        check(&p, total_of(&p), &no_pad, &[(0, 10 * W), (14 * W, 24 * W)]);
        // Raising neg_threshold above 0.4 turns the same plateau into silence.
        let strict = with(|q| {
            q.speech_pad_ms = 0;
            q.neg_threshold = Some(0.45);
        });
        let p = probs(&[(0.4, 10), (0.9, 10), (0.4, 30), (0.0, 20)]);
        check(&p, total_of(&p), &strict, &[(10 * W, 20 * W)]);
        // A neg_threshold above threshold is lowered to it rather than inverting the logic.
        let inverted = with(|q| {
            q.speech_pad_ms = 0;
            q.neg_threshold = Some(0.9);
        });
        let p = probs(&[(0.0, 5), (0.6, 10), (0.0, 10)]);
        check(&p, total_of(&p), &inverted, &[(5 * W, 15 * W)]);
    }

    #[test]
    fn padding_clamps_to_the_audio_and_merges_neighbours() {
        let cases: Vec<(Vec<f32>, usize, SegmentParams, Spans)> = vec![
            // Speech from the first to the last window: padding clamps at both ends.
            (
                probs(&[(0.9, 40)]),
                40 * 512,
                SegmentParams::default(),
                vec![(0, 40 * W)],
            ),
            // The last window is partial: the segment ends at the audio's end.
            (
                probs(&[(0.9, 40)]),
                40 * 512 - 100,
                SegmentParams::default(),
                vec![(0, 40 * W - 100)],
            ),
            // Start one window in: the 480-sample pad fits, the end clamps.
            (
                probs(&[(0.0, 1), (0.9, 39)]),
                40 * 512,
                SegmentParams::default(),
                vec![(W - PAD, 40 * W)],
            ),
            // Trailing silence too short to end the segment still marks its end.
            (
                probs(&[(0.0, 10), (0.9, 20), (0.0, 2)]),
                32 * 512,
                SegmentParams::default(),
                vec![(10 * W - PAD, 30 * W + PAD)],
            ),
            // A 4-window gap (2048 samples) splits, but 70 ms pads (1120 each) overlap and merge.
            (
                probs(&[(0.0, 10), (0.9, 10), (0.0, 4), (0.9, 10), (0.0, 10)]),
                44 * 512,
                with(|p| p.speech_pad_ms = 70),
                vec![(10 * W - 1120, 34 * W + 1120)],
            ),
            // With the default 30 ms pad the same gap stays open.
            (
                probs(&[(0.0, 10), (0.9, 10), (0.0, 4), (0.9, 10), (0.0, 10)]),
                44 * 512,
                SegmentParams::default(),
                vec![(10 * W - PAD, 20 * W + PAD), (24 * W - PAD, 34 * W + PAD)],
            ),
        ];
        for (p, total, params, expected) in cases {
            check(&p, total, &params, &expected);
        }
    }

    #[test]
    fn nan_probabilities_count_as_silence() {
        let no_pad = with(|p| p.speech_pad_ms = 0);
        let cases: [(Vec<f32>, Spans); 3] = [
            (probs(&[(0.0, 5), (f32::NAN, 20), (0.0, 5)]), vec![]),
            (
                probs(&[(0.9, 10), (f32::NAN, 10), (0.9, 10)]),
                vec![(0, 10 * W), (20 * W, 30 * W)],
            ),
            (
                probs(&[(0.9, 10), (f32::NAN, 2), (0.9, 10), (0.0, 5)]),
                vec![(0, 22 * W)],
            ),
        ];
        for (p, expected) in cases {
            check(&p, total_of(&p), &no_pad, &expected);
        }
    }
}
