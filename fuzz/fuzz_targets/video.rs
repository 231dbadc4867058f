//! The `video` target. Its body, and what it checks, is
//! `vramgate_fuzz::targets::video`, which the services' test suite also runs on every
//! committed seed (`tests/tests/fuzz_seeds.rs`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vramgate_fuzz::targets::video::run(data));
