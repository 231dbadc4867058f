//! The `compressed_audio` target. Its body, and what it checks, is
//! `vramgate_fuzz::targets::compressed_audio`, which the services' test suite also runs on every
//! committed seed (`tests/tests/fuzz_seeds.rs`).

#![no_main]

libfuzzer_sys::fuzz_target!(init: vramgate_fuzz::let_symphonia_panics_reach_the_guard(), |data: &[u8]| vramgate_fuzz::targets::compressed_audio::run(data));
