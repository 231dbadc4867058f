//! The worker's configuration as it starts: every input is read twice through
//! `WorkerConfig::load`, the function `main` calls, once as the worker's config file and once
//! as a model folder's `config.toml` in a model repository (`config/repository.rs`: the folder
//! is the model's name, beside a model file), so both TOML parsers, the layering, and every
//! check of a model's inputs, outputs, batching, arguments and probe sizes see it. The files
//! are written to a folder of this process's own ([`vramgate_fuzz::scratch_dir`]); libtorch is
//! linked (the crate's only library) but never called.
//!
//! Checked: what loads, validates again (`WorkerConfig::validate`), and a model from the
//! repository keeps its folder's name.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vramgate_worker::WorkerConfig;

/// The model folder's name in the repository.
const MODEL: &str = "fuzzed";

struct Files {
    /// Where the input goes as the worker's config file.
    worker: PathBuf,
    /// Where the input goes as the model folder's `config.toml`.
    model: PathBuf,
    /// A worker config naming the repository.
    with_repository: PathBuf,
}

fn files() -> &'static Files {
    static FILES: OnceLock<Files> = OnceLock::new();
    FILES.get_or_init(|| {
        let dir = vramgate_fuzz::scratch_dir("worker-config");
        let folder = dir.join("repository").join(MODEL);
        std::fs::create_dir_all(&folder).expect("the model folder can be made");
        std::fs::write(folder.join("model.pt"), b"").expect("the model file can be written");
        let with_repository = dir.join("with-repository.toml");
        let repository = dir.join("repository");
        std::fs::write(&with_repository, format!("model_repository = {:?}\n", repository.display().to_string()))
            .expect("the worker config can be written");
        Files { worker: dir.join("worker.toml"), model: folder.join("config.toml"), with_repository }
    })
}

fuzz_target!(|data: &[u8]| {
    let files = files();
    std::fs::write(&files.worker, data).expect("the fuzzed worker config can be written");
    if let Ok(config) = WorkerConfig::load(Some(&files.worker)) {
        config.validate().expect("a loaded config validates");
    }
    std::fs::write(&files.model, data).expect("the fuzzed model config can be written");
    if let Ok(config) = WorkerConfig::load(Some(&files.with_repository)) {
        config.validate().expect("a loaded config validates");
        let model = config.models.last().expect("the repository's one model is loaded");
        assert_eq!(model.name, MODEL);
    }
});
