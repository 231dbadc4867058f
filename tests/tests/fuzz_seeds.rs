//! Every fuzz target's committed seeds (`fuzz/corpus/<target>/`) run through the target's own
//! body and checks (`fuzz/src/targets.rs`), in this suite's release build: the same bytes and
//! assertions libFuzzer starts each run from, without the separate sanitizer build. A seed that
//! a change to a parser makes panic, or makes break a target's check, fails here and names the
//! file. Coverage-guided fuzzing itself (new inputs, AddressSanitizer) is `scripts/fuzz`'s
//! (docs/hardening.md, "Fuzzing").

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

#[allow(dead_code)]
#[path = "../../fuzz/src/lib.rs"]
mod vramgate_fuzz;

use vramgate_fuzz::targets;

/// The seeds of `target`, by name.
fn seeds(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a corpus entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} holds no seeds", dir.display());
    files
}

/// Runs `run` on each seed of `target`; fails naming every seed that panicked.
fn replay(target: &str, run: fn(&[u8])) {
    let files = seeds(target);
    let failed: Vec<String> = files
        .iter()
        .filter(|path| {
            let bytes = std::fs::read(path).expect("a seed reads");
            catch_unwind(AssertUnwindSafe(|| run(&bytes))).is_err()
        })
        .map(|path| path.file_name().expect("a file name").to_string_lossy().into_owned())
        .collect();
    assert!(failed.is_empty(), "{target}: {} of {} seeds failed the target's checks: {failed:?}", failed.len(), files.len());
}

/// Removes the folder a target made for its files (`vramgate_fuzz::scratch_dir`).
fn remove_scratch(name: &str) {
    let _ = std::fs::remove_dir_all(vramgate_fuzz::scratch_path(name));
}

#[test]
fn event_json_seeds_pass_the_target() {
    replay("event_json", targets::event_json::run);
    remove_scratch("input-root");
}

#[test]
fn wav_seeds_pass_the_target() {
    replay("wav", targets::wav::run);
}

#[test]
fn image_seeds_pass_the_target() {
    replay("image", targets::image::run);
}

#[test]
fn compressed_audio_seeds_pass_the_target() {
    replay("compressed_audio", targets::compressed_audio::run);
}

#[test]
fn tensor_task_seeds_pass_the_target() {
    replay("tensor_task", targets::tensor_task::run);
}

#[test]
fn oip_request_seeds_pass_the_target() {
    replay("oip_request", targets::oip_request::run);
}

#[test]
fn worker_config_seeds_pass_the_target() {
    replay("worker_config", targets::worker_config::run);
    remove_scratch("worker-config");
}

#[test]
fn video_seeds_pass_the_target() {
    replay("video", targets::video::run);
}

/// The seed test itself can fail: a body whose check breaks on an input is reported with the
/// seed's name (here a check that no input passes, on the smallest corpus).
#[test]
#[should_panic(expected = "seeds failed the target's checks")]
fn a_seed_that_breaks_a_check_fails_the_test() {
    replay("worker_config", |_| panic!("a check no seed passes"));
}
