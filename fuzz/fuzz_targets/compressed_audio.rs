//! The `audio` task's input, as the gateway converts it: the container told by its magic, the
//! header probe with the duration and element limits (`audio::decode::probe`), symphonia's
//! FLAC, Ogg Vorbis and MP3 decoders (WAV through the gateway's own parser) stopped at the
//! frame limit (`audio::decode::decode`), the mix to mono, the resampling, and the model input
//! (the whole signal, or centred frames in FP16), through the task's own plans
//! ([`vramgate_fuzz::audio_converters`]).
//!
//! A panic inside symphonia is left to the gateway's guard, which refuses the input
//! ([`vramgate_fuzz::let_symphonia_panics_reach_the_guard`]); any other panic is a finding.
//!
//! Checked: no refusal is `internal`; every tensor holds what its shape says, only finite
//! values, and reaches the worker as it left ([`vramgate_fuzz::check_calls`]); whatever
//! converts had a header that probes, within the duration limit.

#![no_main]

use libfuzzer_sys::fuzz_target;
use vramgate_gateway::audio::decode;

fuzz_target!(init: vramgate_fuzz::let_symphonia_panics_reach_the_guard(), |data: &[u8]| {
    vramgate_fuzz::convert_with_every_row(vramgate_fuzz::audio_converters, data, |_, converted| {
        vramgate_fuzz::check_finite(converted);
        let header = decode::probe(data).expect("converted audio has a header that probes");
        assert!(header.duration_seconds().is_none_or(|s| s <= vramgate_fuzz::MAX_AUDIO_SECONDS), "{header:?}");
    });
});
