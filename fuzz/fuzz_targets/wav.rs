//! The `voice` task's input, as the gateway converts it: the WAV header probe
//! (`audio::wav::probe_wav`, the duration limit), the decode (`decode_wav_limited`), the mix
//! to mono and the resampling to 16 kHz (`rubato`), through the task's own plan
//! (`tasks::voice`).
//!
//! Checked: a header that probes decodes, to exactly the frames, rate and channels the probe
//! said, every sample finite and in [-1, 1]; the 16 kHz signal has `round(frames · 16000 /
//! rate)` samples (the resampler's contract), padded to one model window, all finite; the
//! tensor reaches the worker as it left ([`vramgate_fuzz::check_calls`]).

#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use vramgate_gateway::audio::wav::{decode_wav, probe_wav};
use vramgate_gateway::tasks::voice::{VoiceTask, WavOptions, MODEL_SAMPLE_RATE, MODEL_WINDOW};
use vramgate_gateway::tasks::{Converter, Plan};

fn plan() -> &'static Arc<dyn Plan> {
    static PLAN: OnceLock<Arc<dyn Plan>> = OnceLock::new();
    PLAN.get_or_init(|| {
        let wav = WavOptions { max_audio_seconds: vramgate_fuzz::MAX_AUDIO_SECONDS, ..WavOptions::default() };
        VoiceTask::new(wav).plan(None).expect("the voice task plans a request without options")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some(converted) = vramgate_fuzz::probe_then_convert(&**plan(), data) else { return };
    vramgate_fuzz::check_finite(&converted);
    let info = probe_wav(data).expect("the plan's probe passed");
    let audio = decode_wav(data).expect("a wav that probes decodes");
    assert_eq!((audio.frames() as u64, audio.sample_rate, audio.channels), (info.frames, info.sample_rate, info.channels));
    assert!(audio.samples.iter().all(|s| (-1.0..=1.0).contains(s)), "a sample outside [-1, 1]");
    let rate = u64::from(info.sample_rate);
    let resampled = (info.frames * u64::from(MODEL_SAMPLE_RATE) + rate / 2) / rate;
    let shape = &converted.calls[0].inputs[0].shape;
    assert_eq!(shape, &[1, resampled.max(u64::from(MODEL_WINDOW)) as usize], "{} frames at {rate} Hz", info.frames);
});
