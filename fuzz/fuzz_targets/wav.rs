//! The `wav` target. Its body, and what it checks, is
//! `vramgate_fuzz::targets::wav`, which the services' test suite also runs on every
//! committed seed (`tests/tests/fuzz_seeds.rs`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vramgate_fuzz::targets::wav::run(data));
