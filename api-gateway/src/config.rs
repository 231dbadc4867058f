//! The gateway's configuration tree. Read from a TOML file and `VRAMGATE_GATEWAY_*` environment
//! variables (`__` between levels, e.g. `VRAMGATE_GATEWAY_KAFKA__BROKERS`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    pub kafka: KafkaConfig,
    pub worker: WorkerEndpoint,
    pub input: InputConfig,
    /// The `voice` task: WAV in, speech segments out.
    pub voice: VoiceTaskConfig,
    /// Records held by the gateway at once, from fetch to acknowledged result. Bounds memory
    /// and the number of duplicates after a crash.
    pub max_in_flight: usize,
    /// On SIGTERM/SIGINT, how long in-flight records may take to finish before the gateway
    /// exits anyway (their offsets are then not committed, so they are redelivered).
    pub shutdown_timeout_seconds: f64,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            kafka: KafkaConfig::default(),
            worker: WorkerEndpoint::default(),
            input: InputConfig::default(),
            voice: VoiceTaskConfig::default(),
            max_in_flight: 64,
            shutdown_timeout_seconds: 20.0,
        }
    }
}

impl GatewayConfig {
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.shutdown_timeout_seconds.max(0.0))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// Bootstrap servers, comma-separated (librdkafka's `bootstrap.servers`).
    pub brokers: String,
    /// Consumer group of all gateway replicas.
    pub group_id: String,
    /// Extra librdkafka properties, by their librdkafka names, applied to the consumer and the
    /// producer (e.g. `"security.protocol" = "SASL_SSL"`). They override vramgate's defaults.
    pub properties: BTreeMap<String, String>,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            group_id: "vramgate-gateway".into(),
            properties: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerEndpoint {
    /// Base URL of the ai-worker, e.g. `http://127.0.0.1:8081`.
    pub url: String,
    /// Limit for one worker call, connection included.
    pub request_timeout_seconds: f64,
    /// Worker calls per record before it is dead-lettered as `worker_unavailable`.
    pub max_attempts: u32,
    /// First retry delay; doubles per attempt up to `backoff_max_seconds`.
    pub backoff_base_seconds: f64,
    pub backoff_max_seconds: f64,
}

impl Default for WorkerEndpoint {
    fn default() -> Self {
        WorkerEndpoint {
            url: "http://127.0.0.1:8081".into(),
            request_timeout_seconds: 60.0,
            max_attempts: 8,
            backoff_base_seconds: 0.25,
            backoff_max_seconds: 5.0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InputConfig {
    /// `file://` URIs must resolve (symlinks followed) to a path under this folder.
    pub file_root: PathBuf,
    /// Largest input, in bytes, read from a file or decoded from base64.
    pub max_input_bytes: u64,
}

impl Default for InputConfig {
    fn default() -> Self {
        InputConfig { file_root: PathBuf::from("."), max_input_bytes: 64 * 1024 * 1024 }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VoiceTaskConfig {
    pub requests_topic: String,
    pub results_topic: String,
    pub dlq_topic: String,
    /// The worker's model for this task.
    pub model: String,
    /// Threads of this task's CPU pool (WAV decode and resampling); 0 = one per core.
    pub cpu_threads: usize,
    /// Concurrent worker calls for this task.
    pub gpu_permits: usize,
    /// Longer audio is dead-lettered as `input_too_large` before it is decoded.
    pub max_audio_seconds: f64,
    pub segments: SegmentConfig,
}

impl Default for VoiceTaskConfig {
    fn default() -> Self {
        VoiceTaskConfig {
            requests_topic: "voice.requests".into(),
            results_topic: "voice.results".into(),
            dlq_topic: "voice.dlq".into(),
            model: "silero_vad".into(),
            cpu_threads: 0,
            gpu_permits: 4,
            max_audio_seconds: 600.0,
            segments: SegmentConfig::default(),
        }
    }
}

/// How speech probabilities become segments.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SegmentConfig {
    /// A window is speech when its probability reaches this.
    pub threshold: f32,
    /// Speech shorter than this is dropped.
    pub min_speech_ms: u32,
    /// Silence shorter than this does not end a segment.
    pub min_silence_ms: u32,
    /// Added to both ends of each segment.
    pub speech_pad_ms: u32,
}

impl Default for SegmentConfig {
    fn default() -> Self {
        SegmentConfig { threshold: 0.5, min_speech_ms: 250, min_silence_ms: 100, speech_pad_ms: 30 }
    }
}
