//! The worker's configuration tree: where it listens, which device it uses, which models it
//! serves. Read from a TOML file and `VRAMGATE_WORKER_*` environment variables.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Address the HTTP server binds; port 0 picks a free one (the bound address is logged).
    pub listen: SocketAddr,
    /// Which device runs the models.
    pub device: DeviceChoice,
    /// libtorch intra-op threads; 0 keeps libtorch's default (one per core). Defaults to 1:
    /// small recurrent models such as Silero VAD run a long chain of tiny ops, where the
    /// intra-op pool only spins (measured on 2 cores, 10 s clip: median 78 ms with 1 thread,
    /// 463 ms with 2).
    pub torch_threads: usize,
    /// Largest request body accepted, in bytes; larger bodies get 413 before they are read.
    pub max_request_bytes: usize,
    /// The models to load at start-up.
    pub models: Vec<ModelConfig>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8081)),
            device: DeviceChoice::Auto,
            torch_threads: 1,
            max_request_bytes: 256 * 1024 * 1024,
            models: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceChoice {
    /// CUDA device 0 when libtorch sees one, else the CPU.
    Auto,
    Cpu,
    /// CUDA device 0; start-up fails when there is none.
    Cuda,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients use in `/v2/models/{name}`.
    pub name: String,
    /// Path of the TorchScript file; relative paths are resolved from the working directory.
    pub path: PathBuf,
    /// How the model is called and what its tensors mean.
    pub kind: ModelKind,
    /// For `voice_activity`: the sample rate the model expects (the gateway converts to it).
    #[serde(default = "default_sample_rate")]
    pub sample_rate_hz: u32,
    /// For `voice_activity`: samples per output window.
    #[serde(default = "default_window")]
    pub window_samples: u32,
    /// Largest number of input elements (e.g. audio samples × batch) one request may carry.
    #[serde(default = "default_max_input_elements")]
    pub max_input_elements: usize,
}

fn default_max_input_elements() -> usize {
    // 10 minutes of 16 kHz audio.
    16_000 * 600
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// A Silero-style voice-activity model: `audio_forward(audio[batch, samples], sample_rate)`
    /// returns one speech probability per window of `window_samples`.
    VoiceActivity,
}

fn default_sample_rate() -> u32 {
    16_000
}

fn default_window() -> u32 {
    512
}
