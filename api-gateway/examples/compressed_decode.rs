//! Measures how fast the gateway decodes real compressed speech (the FLAC, Ogg Vorbis and MP3
//! clips committed as fuzzing seeds), through `audio::decode`, as a record's conversion does.
//! Built twice, it prices the overflow checks the release profile keeps on for symphonia's
//! crates (`Cargo.toml`; `docs/hardening.md`, "Fuzzing"):
//!
//! ```sh
//! source scripts/env.sh
//! cargo run --release -p vramgate-gateway --example compressed_decode
//! cargo run --release -p vramgate-gateway --example compressed_decode \
//!   --config 'profile.release.package.symphonia-bundle-flac.overflow-checks=false' \
//!   --config 'profile.release.package.symphonia-bundle-mp3.overflow-checks=false' \
//!   --config 'profile.release.package.symphonia-codec-vorbis.overflow-checks=false' \
//!   --config 'profile.release.package.symphonia-format-ogg.overflow-checks=false' \
//!   --config 'profile.release.package.symphonia-core.overflow-checks=false'
//! ```
//!
//! Each clip is decoded for at least `SECONDS` of wall time, after one decode to warm up; the
//! figure is seconds of audio decoded per second, the median of `ROUNDS` rounds.

use std::path::Path;
use std::time::{Duration, Instant};

use vramgate_gateway::audio::decode;

const CLIPS: [&str; 6] = [
    "espeak-one.flac",
    "espeak-one-48k-24bit.flac",
    "espeak-one.ogg",
    "espeak-one-8k.ogg",
    "espeak-one.mp3",
    "espeak-one-stereo-44k.mp3",
];
const SECONDS: f64 = 1.0;
const ROUNDS: usize = 5;
/// Far above any clip here: the limit is not what is measured.
const MAX_FRAMES: u64 = 1 << 24;

fn main() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/compressed_audio");
    let checks = if cfg!(debug_assertions) { "a debug build: the figures mean nothing" } else { "release" };
    println!("compressed_decode ({checks}); audio seconds decoded per wall second, median of {ROUNDS} rounds of {SECONDS} s");
    println!("{:<28} {:>8} {:>10} {:>14}", "clip", "bytes", "audio s", "audio s / s");
    for name in CLIPS {
        let bytes = std::fs::read(corpus.join(name)).unwrap_or_else(|e| panic!("reading {name}: {e}"));
        let audio = decode::decode(&bytes, MAX_FRAMES).unwrap_or_else(|e| panic!("decoding {name}: {e}"));
        let length = audio.samples.len() as f64 / f64::from(audio.channels) / f64::from(audio.sample_rate);
        let mut rates: Vec<f64> = (0..ROUNDS)
            .map(|_| {
                let started = Instant::now();
                let mut decoded = 0u32;
                while started.elapsed() < Duration::from_secs_f64(SECONDS) {
                    let audio = decode::decode(&bytes, MAX_FRAMES).expect("decoded once already");
                    std::hint::black_box(&audio.samples);
                    decoded += 1;
                }
                f64::from(decoded) * length / started.elapsed().as_secs_f64()
            })
            .collect();
        rates.sort_by(f64::total_cmp);
        println!("{name:<28} {:>8} {length:>10.2} {:>14.0}", bytes.len(), rates[ROUNDS / 2]);
    }
}
