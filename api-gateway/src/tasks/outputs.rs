//! A configured task's result: the model's output tensors, each through the post-processors its
//! `[[tasks.<name>.outputs]]` row names (softmax, sigmoid, argmax, top-k with labels,
//! threshold), into the result's `outputs` object. The generic converters (`image` in `tensor`
//! mode, `audio`, `tensor`) all finish here, so a model needs no Rust of its own.
//!
//! Every post-processor works along the tensor's last dimension, one row at a time (a `[1, 1000]`
//! classifier output is one row; a `[frames]` pitch track is one row of `frames`; a `[n, 5]`
//! output is `n` rows). What each gives, under `outputs.<name>`:
//! - nothing, `softmax`, `sigmoid`: `{"shape": [...], "data": [...]}`, the values row-major;
//! - `threshold` (last): `{"shape": [...], "data": [true, false, ...]}`, value ≥ `threshold`;
//! - `argmax` (last): `{"shape": [rows...], "index": [...], "label": [...]}` (labels when a
//!   labels file is named; an index past its end has `null`);
//! - `top_k` (last): `{"shape": [rows...], "top_k": [[{"index", "label", "score"}, ...], ...]}`,
//!   highest first, ties by the lower index;
//! - `speech_segments` (alone; the `audio` converter, whole signal): a voice-activity model's
//!   per-window probabilities → `{"segments": [{"start_seconds", "end_seconds"}, ...]}`, by
//!   Silero's `get_speech_timestamps` hysteresis (`crate::audio::segments`), with `segments`
//!   (threshold, min_speech_ms, min_silence_ms, speech_pad_ms) and `window_samples`: what the
//!   `wav` converter's voice task answers, on the configured path;
//! - `face_boxes` (alone; `image` tensor mode): an MTCNN P-Net-style detector's maps (this row's
//!   output the `[1, 2, h, w]` no-face/face probabilities, the output `boxes` names the
//!   `[1, 4, h, w]` regressions; one 12-pixel window every 2 pixels) → `{"faces": [{"x1", "y1",
//!   "x2", "y2", "score"}, ...]}` in the input image's pixels, through `threshold`, `nms_iou` and
//!   `max_faces`: what the image task's `proposals` mode answers, on the configured path;
//! - `yolo_boxes` (alone; `image` tensor mode): an anchor-grid detector's raw heads (the row's
//!   output and the others its `yolo.heads` name) → `{"boxes": [{"x1", "y1", "x2", "y2",
//!   "score", "class", "label"}, ...], "cut": bool}` in the image's pixels, through `threshold`,
//!   per-class `nms_iou` and `max_boxes` ([`super::yolo`]).
//!
//! Datatypes ([`READ`]: every one the worker serves): raw values go out as they are, integers as
//! exact JSON integers (an INT64 is never rounded through a float), BOOL as booleans, FP16
//! widened to FP32 exactly. A step takes the datatypes it makes sense for ([`PostOp::fits`]):
//! softmax, sigmoid, speech segments and face boxes floating point; argmax and top-k any (BOOL
//! as `false < true`); threshold any number (an integer compared exactly). The start-up check
//! ([`super::fit`]) refuses a row whose output's datatype its steps do not take; an answer that
//! still comes in such a datatype fails its event (`internal`), never guessed at.
//!
//! Bounds: at most [`MAX_OUTPUT_RULES`] rows; a model output holding more than the task's
//! `max_output_elements` values is a dead letter (`output_rejected`) naming the output and the
//! limit, before any post-processing; `top_k` at most [`MAX_TOP_K`]; a labels file at most
//! [`MAX_LABELS_BYTES`] and [`MAX_LABELS`] lines, each label cut to [`MAX_LABEL_BYTES`].

use std::cmp::Ordering;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use vramgate_shared::events::{ErrorKind, Stage};

use super::image::{faces, ImageOptions, Placement};
use super::yolo::YoloConfig;
use crate::storage::{StoreTarget, StoredOutput};
use super::voice::SegmentConfig;
use vramgate_shared::oip::{DataType, Tensor, TensorData};

use super::fit::{Asked, ModelUse, Sent, Takes};
use super::{mask, npy};
use super::{only_answer, Converted, Converter, Finish, Plan, Step};
use crate::audio::segments::{speech_segments, SegmentParams};
use crate::call::client::OutputTensor;
use crate::failure::Failure;

/// At most this many `[[tasks.<name>.outputs]]` rows per task.
pub const MAX_OUTPUT_RULES: usize = 16;
/// Largest `top_k`.
pub const MAX_TOP_K: usize = 1000;
/// Largest labels file read.
pub const MAX_LABELS_BYTES: u64 = 4 * 1024 * 1024;
/// Most labels (lines) in one file.
pub const MAX_LABELS: usize = 100_000;
/// A longer label is cut (at a character boundary) to this many bytes.
pub const MAX_LABEL_BYTES: usize = 256;
/// Default and largest `max_output_elements`.
pub const DEFAULT_MAX_OUTPUT_ELEMENTS: usize = 65_536;
pub const MAX_OUTPUT_ELEMENTS: usize = 4_194_304;
/// Most labels a `yolo_boxes` row's `keep` names.
pub const MAX_KEEP: usize = 1000;

/// One post-processing step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PostOp {
    /// `exp(x - max) / sum` along the last dimension.
    Softmax,
    /// `1 / (1 + exp(-x))`, each value.
    Sigmoid,
    /// The index of the largest value of each row (the first of equals). Last.
    Argmax,
    /// The `top_k` largest values of each row, with their indices and labels. Last.
    TopK,
    /// Each value ≥ `threshold`, as booleans. Last.
    Threshold,
    /// Per-window speech probabilities → speech segments in seconds. Alone; the `audio`
    /// converter only, without `length` or `frames`.
    SpeechSegments,
    /// P-Net-style face maps → boxes in image pixels. Alone; `image` tensor mode only.
    FaceBoxes,
    /// An anchor-grid detector's heads (YOLO) → class-aware boxes in image pixels. Alone;
    /// `image` tensor mode only.
    YoloBoxes,
    /// A `[h, w]` map (`[1, h, w]`, `[1, 1, h, w]`) → a PNG the input image's size, mapped
    /// back through the image's placement: probabilities (after any `sigmoid`/`softmax`)
    /// thresholded at `threshold` to 0/255, integer class labels as the indices of a
    /// palette image. Last; needs `store`.
    MaskPng,
}

impl PostOp {
    fn is_terminal(self) -> bool {
        matches!(
            self,
            PostOp::Argmax
                | PostOp::TopK
                | PostOp::Threshold
                | PostOp::SpeechSegments
                | PostOp::FaceBoxes
                | PostOp::YoloBoxes
                | PostOp::MaskPng
        )
    }

    /// Its name in a row's `post`.
    pub fn as_str(self) -> &'static str {
        match self {
            PostOp::Softmax => "softmax",
            PostOp::Sigmoid => "sigmoid",
            PostOp::Argmax => "argmax",
            PostOp::TopK => "top_k",
            PostOp::Threshold => "threshold",
            PostOp::SpeechSegments => "speech_segments",
            PostOp::FaceBoxes => "face_boxes",
            PostOp::YoloBoxes => "yolo_boxes",
            PostOp::MaskPng => "mask_png",
        }
    }

    /// Whether this step takes an output of `datatype` (one the gateway reads, [`READ`]); why
    /// not when it does not. Arithmetic on probabilities and coordinates needs floating point;
    /// ranking and comparing take integers too; ranking takes booleans (`false < true`), whose
    /// threshold is already decided.
    pub fn fits(self, datatype: DataType) -> Result<(), String> {
        let floating = matches!(datatype, DataType::Fp16 | DataType::Fp32);
        let integer = matches!(datatype, DataType::Uint8 | DataType::Int32 | DataType::Int64);
        let (fits, needs) = match self {
            PostOp::Softmax | PostOp::Sigmoid | PostOp::SpeechSegments | PostOp::FaceBoxes | PostOp::YoloBoxes => {
                (floating, "a floating-point output (FP16, FP32)")
            }
            PostOp::Argmax | PostOp::TopK => (floating || integer || datatype == DataType::Bool, "a numeric or BOOL output"),
            PostOp::Threshold => (floating || integer, "a numeric output (a BOOL output is already decided)"),
            PostOp::MaskPng => (floating || integer || datatype == DataType::Bool, "a numeric or BOOL map"),
        };
        if fits {
            Ok(())
        } else {
            Err(format!("{} needs {needs}", self.as_str()))
        }
    }
}

/// The output datatypes the gateway reads: every one the worker serves.
pub const READ: [DataType; 6] = [DataType::Bool, DataType::Uint8, DataType::Int32, DataType::Int64, DataType::Fp16, DataType::Fp32];

/// One `[[tasks.<name>.outputs]]` row: a model output to ask for and what to do with it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputRule {
    /// The model output's name.
    pub name: String,
    /// Applied in order; `argmax`, `top_k` and `threshold` only last.
    #[serde(default)]
    pub post: Vec<PostOp>,
    /// For `top_k`.
    #[serde(default = "default_top_k")]
    pub top_k: usize,
    /// For `threshold`.
    #[serde(default = "default_threshold")]
    pub threshold: f32,
    /// For `argmax` and `top_k`: a text file, one label per line, line `i` naming index `i`.
    /// Relative to the gateway's working directory.
    #[serde(default)]
    pub labels: Option<PathBuf>,
    /// For `speech_segments`: the hysteresis and lengths (Silero's defaults).
    #[serde(default)]
    pub segments: SegmentConfig,
    /// For `speech_segments`: samples per probability (Silero VAD: 512 at 16 kHz).
    #[serde(default = "default_window_samples")]
    pub window_samples: u32,
    /// For `face_boxes`: the model output holding the box regressions (also asked for).
    #[serde(default)]
    pub boxes: Option<String>,
    /// For `face_boxes`: of two boxes overlapping by more than this IoU the lower is dropped.
    #[serde(default = "default_nms_iou")]
    pub nms_iou: f32,
    /// For `face_boxes`: the most boxes reported, best first.
    #[serde(default = "default_max_faces")]
    pub max_faces: usize,
    /// For `yolo_boxes`: the heads, their strides and anchors, the classes.
    #[serde(default)]
    pub yolo: Option<YoloConfig>,
    /// For `yolo_boxes`: the most boxes reported, best first (the result says when more
    /// were found).
    #[serde(default = "default_max_faces")]
    pub max_boxes: usize,
    /// For `yolo_boxes`: only boxes of these labels (of the row's `labels` file), e.g.
    /// `["person"]`; empty: every class. At most [`MAX_KEEP`].
    #[serde(default)]
    pub keep: Vec<String>,
    /// `s3://bucket/prefix/`: the output is written to `<prefix><task>/<id>/<name>.<ext>`
    /// (`.npy` for values, `.png` for `mask_png`, `.json` for what `argmax`, `top_k`,
    /// `threshold`, `speech_segments` or `face_boxes` give) before the result is produced, and
    /// the result carries `{"uri", "bytes", "sha256", "shape", "datatype"}` instead of the
    /// values; `max_output_elements` does not bound it.
    #[serde(default)]
    pub store: Option<StoreTarget>,
}

fn default_nms_iou() -> f32 {
    0.5
}

fn default_max_faces() -> usize {
    100
}

fn default_window_samples() -> u32 {
    512
}

fn default_top_k() -> usize {
    5
}

fn default_threshold() -> f32 {
    0.5
}

impl OutputRule {
    /// The row as its TOML says it, for messages: `name = "length", post = ["softmax"]`.
    pub fn describe(&self) -> String {
        let mut text = format!("name = {:?}", self.name);
        if !self.post.is_empty() {
            let post: Vec<String> = self.post.iter().map(|op| format!("{:?}", op.as_str())).collect();
            text.push_str(&format!(", post = [{}]", post.join(", ")));
        }
        if let Some(boxes) = &self.boxes {
            text.push_str(&format!(", boxes = {boxes:?}"));
        }
        if let Some(store) = &self.store {
            text.push_str(&format!(", store = {:?}", String::from(store.clone())));
        }
        text
    }

    /// Checks what the types cannot; `at` is the row's key (`outputs[0]`).
    fn validate(&self, at: &str) -> Result<(), String> {
        if self.name.is_empty() || self.name.len() > 128 {
            return Err(format!("{at}.name must be 1 to 128 bytes"));
        }
        for (i, op) in self.post.iter().enumerate() {
            if op.is_terminal() && i + 1 != self.post.len() {
                return Err(format!("{at}.post: {op:?} must be the last step").to_lowercase());
            }
        }
        if self.post.len() > 4 {
            return Err(format!("{at}.post has {} steps; at most 4", self.post.len()));
        }
        if !(1..=MAX_TOP_K).contains(&self.top_k) {
            return Err(format!("{at}.top_k must be 1 to {MAX_TOP_K}, got {}", self.top_k));
        }
        if !self.threshold.is_finite() {
            return Err(format!("{at}.threshold must be a finite number"));
        }
        if self.labels.is_some() && !matches!(self.post.last(), Some(PostOp::Argmax | PostOp::TopK | PostOp::YoloBoxes)) {
            return Err(format!("{at}.labels is only read by post = [..., \"argmax\"], [..., \"top_k\"] or [\"yolo_boxes\"]"));
        }
        if self.post.contains(&PostOp::YoloBoxes) {
            if self.post.len() != 1 {
                return Err(format!("{at}.post: yolo_boxes takes the model's heads as they are, alone"));
            }
            let Some(yolo) = &self.yolo else {
                return Err(format!("{at}.yolo must give the heads (output, stride, anchors) and classes"));
            };
            yolo.validate(&format!("{at}.yolo"), &self.name)?;
            if !(0.0..=1.0).contains(&self.nms_iou) || !(0.0..=1.0).contains(&self.threshold) {
                return Err(format!("{at}.threshold and {at}.nms_iou must be between 0 and 1"));
            }
            if !(1..=super::yolo::MAX_BOXES).contains(&self.max_boxes) {
                return Err(format!("{at}.max_boxes must be 1 to {}, got {}", super::yolo::MAX_BOXES, self.max_boxes));
            }
            if self.keep.len() > MAX_KEEP {
                return Err(format!("{at}.keep names {} labels; at most {MAX_KEEP}", self.keep.len()));
            }
            if !self.keep.is_empty() && self.labels.is_none() {
                return Err(format!("{at}.keep names labels: set {at}.labels to the file that names the classes"));
            }
        } else if self.yolo.is_some() {
            return Err(format!("{at}.yolo is only read by post = [\"yolo_boxes\"]"));
        } else if !self.keep.is_empty() {
            return Err(format!("{at}.keep is only read by post = [\"yolo_boxes\"]"));
        }
        if self.post.contains(&PostOp::SpeechSegments) && self.post.len() != 1 {
            return Err(format!("{at}.post: speech_segments takes the model's probabilities as they are, alone"));
        }
        if self.post.contains(&PostOp::FaceBoxes) {
            if self.post.len() != 1 {
                return Err(format!("{at}.post: face_boxes takes the model's maps as they are, alone"));
            }
            match &self.boxes {
                Some(b) if !b.is_empty() && b.len() <= 128 && *b != self.name => {}
                _ => return Err(format!("{at}.boxes must name the model output of the box regressions (not {})", self.name)),
            }
            if !(0.0..=1.0).contains(&self.nms_iou) || !(0.0..=1.0).contains(&self.threshold) {
                return Err(format!("{at}.threshold and {at}.nms_iou must be between 0 and 1"));
            }
            if !(1..=10_000).contains(&self.max_faces) {
                return Err(format!("{at}.max_faces must be 1 to 10000, got {}", self.max_faces));
            }
        } else if self.boxes.is_some() {
            return Err(format!("{at}.boxes is only read by post = [\"face_boxes\"]"));
        }
        if self.post.contains(&PostOp::MaskPng) && self.store.is_none() {
            return Err(format!("{at}.post: mask_png writes a PNG, which goes to object storage: set {at}.store = \"s3://bucket/prefix/\""));
        }
        if !(1..=1 << 20).contains(&self.window_samples) {
            return Err(format!("{at}.window_samples must be 1 to {}, got {}", 1 << 20, self.window_samples));
        }
        if !(0.0..=1.0).contains(&self.segments.threshold) {
            return Err(format!("{at}.segments.threshold must be between 0 and 1, got {}", self.segments.threshold));
        }
        Ok(())
    }
}

/// The outputs a task's `[[outputs]]` rows ask for (`super::fit` compares them with the
/// model's declaration): each row's, and the box regressions a `face_boxes` row reads.
pub fn asked<'a>(rules: impl IntoIterator<Item = &'a OutputRule>) -> Vec<Asked> {
    let mut all = Vec::new();
    for (i, rule) in rules.into_iter().enumerate() {
        let by = format!("[[outputs]] row {} ({})", i + 1, rule.describe());
        let takes = Takes::Steps(DataType::ALL.iter().map(|&d| (d, post_fits(&rule.post, d))).collect());
        if let Some(boxes) = &rule.boxes {
            all.push(Asked { by: by.clone(), name: boxes.clone(), takes: takes.clone() });
        }
        for head in rule.yolo.iter().flat_map(|y| y.heads.iter().skip(1)) {
            all.push(Asked { by: by.clone(), name: head.output.clone(), takes: takes.clone() });
        }
        all.push(Asked { by, name: rule.name.clone(), takes });
    }
    all
}

/// Whether an output of `datatype` may go through `post`: a datatype the gateway reads
/// ([`READ`]), and one each step takes; why not when it may not.
pub fn post_fits(post: &[PostOp], datatype: DataType) -> Result<(), String> {
    if !READ.contains(&datatype) {
        let read: Vec<&str> = READ.iter().map(|d| d.as_str()).collect();
        return Err(format!("{} is a datatype the gateway does not read ({})", datatype.as_str(), read.join(", ")));
    }
    post.iter().try_for_each(|op| op.fits(datatype))
}

/// Checks a task's output rows (`tasks.<name>.` is prefixed by the caller).
pub fn validate(rules: &[OutputRule], max_output_elements: usize) -> Result<(), String> {
    if rules.is_empty() {
        return Err("outputs needs at least one [[tasks.<name>.outputs]] row (name = \"<model output>\")".into());
    }
    if rules.len() > MAX_OUTPUT_RULES {
        return Err(format!("outputs has {} rows; at most {MAX_OUTPUT_RULES}", rules.len()));
    }
    for (i, rule) in rules.iter().enumerate() {
        rule.validate(&format!("outputs[{i}]"))?;
        if rules[..i].iter().any(|r| r.name == rule.name) {
            return Err(format!("outputs[{i}].name '{}' is listed twice", rule.name));
        }
    }
    if !(1..=MAX_OUTPUT_ELEMENTS).contains(&max_output_elements) {
        return Err(format!("max_output_elements must be 1 to {MAX_OUTPUT_ELEMENTS}, got {max_output_elements}"));
    }
    Ok(())
}

/// A task's output rows, their labels read, ready to finish requests.
#[derive(Debug)]
pub struct Outputs {
    rules: Vec<(OutputRule, Option<Vec<String>>)>,
    /// The names asked of the worker. Leaked once per task (the task table is read once per
    /// process) so that calls borrow them like the built-in tasks' constant names.
    names: &'static [&'static str],
    max_output_elements: usize,
}

impl Outputs {
    /// Reads the labels files; an unreadable or oversized one is an error naming it.
    pub fn load(rules: &[OutputRule], max_output_elements: usize) -> Result<Arc<Outputs>, String> {
        validate(rules, max_output_elements)?;
        let mut loaded = Vec::with_capacity(rules.len());
        for (i, rule) in rules.iter().enumerate() {
            let labels = match &rule.labels {
                Some(path) => Some(read_labels(path).map_err(|e| format!("outputs[{i}].labels: {e}"))?),
                None => None,
            };
            let missing = labels.as_ref().and_then(|names| rule.keep.iter().find(|k| !names.contains(k)));
            if let Some(missing) = missing {
                return Err(format!("outputs[{i}].keep: '{}' is not a label of {}", cut(missing, MAX_LABEL_BYTES), rule.labels.as_ref().map(|p| p.display().to_string()).unwrap_or_default()));
            }
            loaded.push((rule.clone(), labels));
        }
        // The rows' outputs, then the regressions a `face_boxes` row reads and the other heads
        // a `yolo_boxes` row reads, each once.
        let mut wanted: Vec<&str> = rules.iter().map(|r| r.name.as_str()).collect();
        let heads = rules.iter().flat_map(|r| r.yolo.iter().flat_map(|y| y.heads.iter().map(|h| h.output.as_str())));
        for boxes in rules.iter().filter_map(|r| r.boxes.as_deref()).chain(heads) {
            if !wanted.contains(&boxes) {
                wanted.push(boxes);
            }
        }
        let names: Vec<&'static str> = wanted.into_iter().map(|n| &*Box::leak(n.to_string().into_boxed_str())).collect();
        Ok(Arc::new(Outputs { rules: loaded, names: Box::leak(names.into_boxed_slice()), max_output_elements }))
    }

    pub fn names(&self) -> &'static [&'static str] {
        self.names
    }

    /// Whether a row stores its output in object storage.
    pub fn stores(&self) -> bool {
        self.rules.iter().any(|(rule, _)| rule.store.is_some())
    }

    /// The rows, in order.
    pub fn rules(&self) -> impl Iterator<Item = &OutputRule> {
        self.rules.iter().map(|(rule, _)| rule)
    }

    /// Whether a row turns probabilities into speech segments (which needs the audio's
    /// length and rate from an `audio` converter of the whole signal).
    pub fn wants_speech_segments(rules: &[OutputRule]) -> bool {
        rules.iter().any(|r| r.post.contains(&PostOp::SpeechSegments))
    }

    /// The step of a row that reports boxes in image pixels (which needs the image's
    /// placement), if any.
    pub fn wants_placement(rules: &[OutputRule]) -> Option<PostOp> {
        rules.iter().flat_map(|r| r.post.iter()).copied().find(|op| matches!(op, PostOp::FaceBoxes | PostOp::YoloBoxes))
    }

    /// The result's `outputs` object from one call's answer; `input` is what the converter
    /// said about the input (`speech_segments` reads its `samples` and `sample_rate_hz`).
    /// `placement` is where the image sits in the model input (`face_boxes` maps through it).
    pub fn render(&self, tensors: &[OutputTensor], input: &Value, placement: Option<&Placement>) -> Result<Value, Failure> {
        self.render_all(tensors, input, placement.map(|p| (p, (0, 0)))).map(|(value, _)| value)
    }

    /// [`render`](Self::render), and the outputs its rows store (`store`), which are not in
    /// the value: the caller writes them and puts their references there. `frame` is where
    /// an image sits in the model input, and the model input's width and height (`mask_png`
    /// maps through it).
    pub fn render_all(
        &self,
        tensors: &[OutputTensor],
        input: &Value,
        frame: Option<(&Placement, (u32, u32))>,
    ) -> Result<(Value, Vec<StoredOutput>), Failure> {
        let placement = frame.map(|(p, _)| p);
        let mut out = serde_json::Map::new();
        let mut stored = Vec::new();
        for (rule, labels) in &self.rules {
            let Some(tensor) = tensors.iter().find(|t| t.name == rule.name) else {
                return Err(Failure::new(
                    ErrorKind::Internal,
                    Stage::Postprocess,
                    format!("the worker's answer has no output '{}'", rule.name),
                ));
            };
            if let Some(target) = &rule.store {
                stored.push(store(rule, labels.as_deref(), tensor, tensors, input, frame, target)?);
                continue;
            }
            if tensor.data.len() > self.max_output_elements {
                return Err(Failure::new(
                    ErrorKind::OutputRejected,
                    Stage::Postprocess,
                    format!(
                        "output '{}' has {} values (shape {:?}), more than max_output_elements {}",
                        rule.name,
                        tensor.data.len(),
                        tensor.shape,
                        self.max_output_elements
                    ),
                ));
            }
            let value = match rule.post.first() {
                Some(PostOp::FaceBoxes) => face_boxes(rule, tensor, tensors, placement)?,
                Some(PostOp::YoloBoxes) => yolo_boxes(rule, labels.as_deref(), tensors, placement)?,
                _ => apply(rule, labels.as_deref(), tensor, input)?,
            };
            out.insert(rule.name.clone(), value);
        }
        Ok((Value::Object(out), stored))
    }
}

fn read_labels(path: &Path) -> Result<Vec<String>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if meta.len() > MAX_LABELS_BYTES {
        return Err(format!("{} is {} bytes, more than {MAX_LABELS_BYTES}", path.display(), meta.len()));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {} as UTF-8: {e}", path.display()))?;
    let labels: Vec<String> = text.lines().map(|l| cut(l.trim_end_matches('\r'), MAX_LABEL_BYTES).to_string()).collect();
    if labels.len() > MAX_LABELS {
        return Err(format!("{} has {} lines, more than {MAX_LABELS}", path.display(), labels.len()));
    }
    Ok(labels)
}

fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A stored row's output as the object it writes: a mask as PNG, what a last step gives as
/// JSON, values (after `softmax` / `sigmoid`) as `.npy`.
fn store(
    rule: &OutputRule,
    labels: Option<&[String]>,
    tensor: &OutputTensor,
    tensors: &[OutputTensor],
    input: &Value,
    frame: Option<(&Placement, (u32, u32))>,
    target: &StoreTarget,
) -> Result<StoredOutput, Failure> {
    let datatype = tensor.datatype().as_str();
    let failed = |why: String| Failure::new(ErrorKind::Internal, Stage::Postprocess, format!("output '{}' ({datatype}): {why}", rule.name));
    if tensor.shape.iter().product::<usize>() != tensor.data.len() {
        return Err(failed(format!("shape {:?} but {} values", tensor.shape, tensor.data.len())));
    }
    post_fits(&rule.post, tensor.datatype()).map_err(failed)?;
    match rule.post.last() {
        Some(PostOp::MaskPng) => {
            let (png, width, height) = mask_png(rule, tensor, frame).map_err(failed)?;
            Ok(StoredOutput::new(&rule.name, target, "png", png, &[height as usize, width as usize], "UINT8"))
        }
        Some(op) if op.is_terminal() => {
            let value = match op {
                PostOp::FaceBoxes => face_boxes(rule, tensor, tensors, frame.map(|(p, _)| p))?,
                PostOp::YoloBoxes => yolo_boxes(rule, labels, tensors, frame.map(|(p, _)| p))?,
                _ => apply(rule, labels, tensor, input)?,
            };
            let bytes = serde_json::to_vec(&value).map_err(|e| failed(e.to_string()))?;
            Ok(StoredOutput::new(&rule.name, target, "json", bytes, &tensor.shape, datatype))
        }
        _ if rule.post.is_empty() => {
            let bytes = npy::encode(&tensor.shape, &tensor.data).map_err(failed)?;
            Ok(StoredOutput::new(&rule.name, target, "npy", bytes, &tensor.shape, datatype))
        }
        _ => {
            let values = transformed(rule, &tensor.shape, tensor.floats().map_err(|f| failed(f.message))?.into_owned());
            let bytes = npy::encode(&tensor.shape, &TensorData::Fp32(values)).map_err(failed)?;
            Ok(StoredOutput::new(&rule.name, target, "npy", bytes, &tensor.shape, "FP32"))
        }
    }
}

/// A row's map as a PNG ([`mask`]), with its width and height.
fn mask_png(rule: &OutputRule, tensor: &OutputTensor, frame: Option<(&Placement, (u32, u32))>) -> Result<(Vec<u8>, u32, u32), String> {
    mask::render(&mask_map(rule, &tensor.data, &tensor.shape)?, &tensor.shape, frame)
}

/// A `mask_png` row's map of `data` (of `shape`): probabilities through the row's transforms
/// thresholded to yes/no, BOOL as it is, integers as class labels.
pub fn mask_map(rule: &OutputRule, data: &TensorData, shape: &[usize]) -> Result<mask::Map, String> {
    let labels = |values: Vec<i64>| -> Result<mask::Map, String> {
        values
            .into_iter()
            .map(|v| u8::try_from(v).map_err(|_| format!("class label {v} is not one of a palette's 0 to 255")))
            .collect::<Result<Vec<u8>, String>>()
            .map(mask::Map::Labels)
    };
    Ok(match data {
        TensorData::Fp32(v) => mask::Map::Binary(transformed(rule, shape, v.clone()).iter().map(|&v| v >= rule.threshold).collect()),
        TensorData::Fp16(v) => {
            let values = transformed(rule, shape, v.iter().map(|x| x.to_f32()).collect());
            mask::Map::Binary(values.iter().map(|&v| v >= rule.threshold).collect())
        }
        TensorData::Bool(v) => mask::Map::Binary(v.clone()),
        TensorData::Uint8(v) => mask::Map::Labels(v.clone()),
        TensorData::Int32(v) => labels(v.iter().map(|&x| i64::from(x)).collect())?,
        TensorData::Int64(v) => labels(v.clone())?,
        other => return Err(format!("mask_png does not read {}", other.datatype().as_str())),
    })
}

/// The values through the row's `softmax` / `sigmoid` steps (softmax along the last
/// dimension, as the inline rendering does).
fn transformed(rule: &OutputRule, shape: &[usize], mut values: Vec<f32>) -> Vec<f32> {
    let row_len = row_len(shape);
    for op in &rule.post {
        match op {
            PostOp::Softmax => values.chunks_mut(row_len).for_each(softmax),
            PostOp::Sigmoid => values.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp())),
            _ => {}
        }
    }
    values
}

/// One output through its rule.
fn apply(rule: &OutputRule, labels: Option<&[String]>, tensor: &OutputTensor, input: &Value) -> Result<Value, Failure> {
    let shape = &tensor.shape;
    let expected: usize = shape.iter().product();
    if expected != tensor.data.len() {
        return Err(Failure::new(
            ErrorKind::Internal,
            Stage::Postprocess,
            format!("output '{}' has shape {shape:?} but {} values", rule.name, tensor.data.len()),
        ));
    }
    let datatype = tensor.datatype().as_str();
    let refused = |why: String| Failure::new(ErrorKind::Internal, Stage::Postprocess, format!("output '{}' ({datatype}): {why}", rule.name));
    post_fits(&rule.post, tensor.datatype()).map_err(refused)?;
    match &tensor.data {
        TensorData::Fp32(values) => floats(rule, labels, shape, values.clone(), input),
        TensorData::Fp16(values) => floats(rule, labels, shape, values.iter().map(|v| v.to_f32()).collect(), input),
        TensorData::Int64(values) => Ok(last_step(rule, labels, shape, values)),
        TensorData::Int32(values) => Ok(last_step(rule, labels, shape, values)),
        TensorData::Uint8(values) => Ok(last_step(rule, labels, shape, values)),
        TensorData::Bool(values) => Ok(last_step(rule, labels, shape, values)),
        _ => Err(refused("a datatype the gateway does not read".into())),
    }
}

/// A floating-point output (FP16 widened) through its rule: the transforms, then the last step.
fn floats(rule: &OutputRule, labels: Option<&[String]>, shape: &[usize], values: Vec<f32>, input: &Value) -> Result<Value, Failure> {
    // speech_segments is a row's only step (`OutputRule::validate`).
    if rule.post.contains(&PostOp::SpeechSegments) {
        return segments(rule, &values, input);
    }
    Ok(last_step(rule, labels, shape, &transformed(rule, shape, values)))
}

/// The values of a row's length: the last dimension's (a scalar or empty-row output has no last
/// dimension to work along: one row of its values).
fn row_len(shape: &[usize]) -> usize {
    shape.last().copied().unwrap_or(1).max(1)
}

/// The rule's last step (`threshold`, `argmax`, `top_k`) on the values of any datatype, or the
/// values as they are.
fn last_step<T: Element>(rule: &OutputRule, labels: Option<&[String]>, shape: &[usize], values: &[T]) -> Value {
    let row_len = row_len(shape);
    let row_shape = &shape[..shape.len().saturating_sub(1)];
    match rule.post.last() {
        Some(PostOp::Threshold) => {
            let above: Vec<bool> = values.iter().map(|v| v.at_least(rule.threshold)).collect();
            json!({ "shape": shape, "data": above })
        }
        Some(PostOp::Argmax) => {
            let index: Vec<usize> = values.chunks(row_len).map(argmax).collect();
            let mut out = json!({ "shape": row_shape, "index": index });
            if let Some(labels) = labels {
                out["label"] = index.iter().map(|&i| label(labels, i)).collect();
            }
            out
        }
        Some(PostOp::TopK) => {
            let rows: Vec<Value> = values
                .chunks(row_len)
                .map(|row| {
                    top_k(row, rule.top_k)
                        .into_iter()
                        .map(|(index, score)| {
                            let mut entry = json!({ "index": index, "score": score.json() });
                            if let Some(labels) = labels {
                                entry["label"] = label(labels, index);
                            }
                            entry
                        })
                        .collect()
                })
                .collect();
            json!({ "shape": row_shape, "top_k": rows })
        }
        _ => json!({ "shape": shape, "data": values.iter().map(|v| v.json()).collect::<Vec<Value>>() }),
    }
}

/// Speech segments from the probabilities of the audio `input` describes.
fn segments(rule: &OutputRule, probs: &[f32], input: &Value) -> Result<Value, Failure> {
    let (Some(samples), Some(rate)) = (input["samples"].as_u64(), input["sample_rate_hz"].as_u64()) else {
        return Err(Failure::new(
            ErrorKind::Internal,
            Stage::Postprocess,
            format!("output '{}': speech_segments needs the audio's samples and rate, got {input}", rule.name),
        ));
    };
    let c = &rule.segments;
    let params = SegmentParams {
        threshold: c.threshold,
        min_speech_ms: c.min_speech_ms,
        min_silence_ms: c.min_silence_ms,
        speech_pad_ms: c.speech_pad_ms,
        window_samples: rule.window_samples,
        sample_rate: u32::try_from(rate).unwrap_or(u32::MAX),
        ..SegmentParams::default()
    };
    let round = |s: f64| (s * 1000.0).round() / 1000.0;
    let found: Vec<Value> = speech_segments(probs, samples as usize, &params)
        .into_iter()
        .map(|s| json!({ "start_seconds": round(s.start_seconds), "end_seconds": round(s.end_seconds) }))
        .collect();
    Ok(json!({ "segments": found }))
}

/// Boxes from a P-Net-style pair of maps, in the image's pixels.
fn face_boxes(rule: &OutputRule, prob: &OutputTensor, tensors: &[OutputTensor], placement: Option<&Placement>) -> Result<Value, Failure> {
    let internal = |message: String| Failure::new(ErrorKind::Internal, Stage::Postprocess, message);
    let boxes_name = rule.boxes.as_deref().unwrap_or_default();
    let boxes = tensors
        .iter()
        .find(|t| t.name == boxes_name)
        .ok_or_else(|| internal(format!("the worker's answer has no output '{boxes_name}'")))?;
    let placement = placement.ok_or_else(|| internal(format!("output '{}': face_boxes needs an image's placement", rule.name)))?;
    let options =
        ImageOptions { threshold: rule.threshold, nms_iou: rule.nms_iou, max_faces: rule.max_faces, ..ImageOptions::default() };
    let found = faces(&prob.floats()?, &prob.shape, &boxes.floats()?, placement, &options)?;
    Ok(json!({ "faces": found }))
}

/// Class-aware boxes from an anchor-grid detector's heads, in the image's pixels.
fn yolo_boxes(rule: &OutputRule, labels: Option<&[String]>, tensors: &[OutputTensor], placement: Option<&Placement>) -> Result<Value, Failure> {
    let internal = |message: String| Failure::new(ErrorKind::Internal, Stage::Postprocess, message);
    let yolo = rule.yolo.as_ref().ok_or_else(|| internal(format!("output '{}': yolo_boxes without its heads", rule.name)))?;
    let placement = placement.ok_or_else(|| internal(format!("output '{}': yolo_boxes needs an image's placement", rule.name)))?;
    let mut found = Vec::new();
    for head in &yolo.heads {
        let tensor = tensors
            .iter()
            .find(|t| t.name == head.output)
            .ok_or_else(|| internal(format!("the worker's answer has no output '{}'", head.output)))?;
        found.extend(super::yolo::decode(head, &tensor.shape, &tensor.floats()?, yolo, rule.threshold).map_err(internal)?);
    }
    if !rule.keep.is_empty() {
        // Per-class suppression does not mix classes, so leaving the others out first keeps
        // exactly the boxes of these classes that suppressing them all would have kept.
        let labels = labels.unwrap_or_default();
        found.retain(|f| labels.get(f.class).is_some_and(|l| rule.keep.contains(l)));
    }
    let (kept, cut) = super::yolo::suppress_per_class(&found, rule.nms_iou, rule.max_boxes);
    Ok(super::yolo::render(&kept, cut, placement, labels))
}

/// An output value as the last steps read it: the worker's datatypes but FP16 (widened to
/// `f32` first). Integers go out as exact JSON integers, booleans as booleans, floats as
/// numbers (NaN and infinity as `null`: JSON has neither).
trait Element: Copy {
    fn json(self) -> Value;
    /// A total order for `argmax` and `top_k`: NaN below everything (it never wins), equal
    /// values equal (the lower index wins a tie).
    fn order(self, other: Self) -> Ordering;
    /// `value ≥ threshold`, exactly (an `i64` is not rounded to a float to compare).
    fn at_least(self, threshold: f32) -> bool;
}

impl Element for f32 {
    fn json(self) -> Value {
        if self.is_finite() {
            json!(self)
        } else {
            Value::Null
        }
    }

    fn order(self, other: Self) -> Ordering {
        match (self.is_nan(), other.is_nan()) {
            (true, true) => Ordering::Equal,
            (true, false) => Ordering::Less,
            (false, true) => Ordering::Greater,
            (false, false) => self.partial_cmp(&other).unwrap_or(Ordering::Equal),
        }
    }

    fn at_least(self, threshold: f32) -> bool {
        self >= threshold
    }
}

/// `v ≥ threshold` for an integer `v`: `v ≥ ⌈threshold⌉`, in integers.
fn int_at_least(v: i64, threshold: f32) -> bool {
    let ceiling = f64::from(threshold).ceil();
    // 2^63: the first value past i64::MAX (and -2^63 is i64::MIN, exactly).
    const TWO_63: f64 = 9_223_372_036_854_775_808.0;
    if ceiling.is_nan() || ceiling >= TWO_63 {
        false
    } else if ceiling < -TWO_63 {
        true
    } else {
        v >= ceiling as i64
    }
}

macro_rules! integer_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            fn json(self) -> Value {
                json!(self)
            }

            fn order(self, other: Self) -> Ordering {
                self.cmp(&other)
            }

            fn at_least(self, threshold: f32) -> bool {
                int_at_least(i64::from(self), threshold)
            }
        }
    )*};
}

integer_element!(i64, i32, u8);

/// `false < true`, as numpy orders booleans (`threshold` refuses them: they are decided).
impl Element for bool {
    fn json(self) -> Value {
        Value::Bool(self)
    }

    fn order(self, other: Self) -> Ordering {
        self.cmp(&other)
    }

    fn at_least(self, threshold: f32) -> bool {
        f32::from(u8::from(self)) >= threshold
    }
}

fn label(labels: &[String], index: usize) -> Value {
    labels.get(index).map_or(Value::Null, |l| Value::String(l.clone()))
}

fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += f64::from(*v);
    }
    for v in row.iter_mut() {
        *v = (f64::from(*v) / sum) as f32;
    }
}

/// The first index of the largest value (NaN never wins).
fn argmax<T: Element>(row: &[T]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v.order(row[best]) == Ordering::Greater {
            best = i;
        }
    }
    best
}

/// The `k` largest of a row, highest first, ties by the lower index; NaN last.
fn top_k<T: Element>(row: &[T], k: usize) -> Vec<(usize, T)> {
    let mut indexed: Vec<(usize, T)> = row.iter().copied().enumerate().collect();
    let order = |a: &(usize, T), b: &(usize, T)| b.1.order(a.1).then(a.0.cmp(&b.0));
    let k = k.min(indexed.len());
    if k < indexed.len() && k > 0 {
        indexed.select_nth_unstable_by(k - 1, order);
        indexed.truncate(k);
    }
    indexed.sort_by(order);
    indexed.truncate(k);
    indexed
}

/// What a configured converter makes of an event's bytes.
pub struct ModelInput {
    /// The model's input tensors, in the order it declares them (one but for the `tensor`
    /// converter's `inputs`).
    pub tensors: Vec<Tensor>,
    /// What the converter says about the input (`format`, sizes, duration), under `input`.
    pub input: Value,
    /// Where an image sits in the model input, and the model input's width and height (the
    /// `image` converter's).
    pub placement: Option<(Placement, (u32, u32))>,
}

/// The input side of a configured converter (`audio`, `tensor`, `image` in tensor mode): its
/// settings are the task row's, never the request's.
pub trait InputConverter: Send + Sync {
    /// Bytes converting `bytes` may hold at its peak (see [`Plan::probe`]).
    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure>;

    fn convert(&self, bytes: &[u8]) -> Result<ModelInput, Failure>;

    /// The tensors it sends, as far as its settings fix them (checked against the model's
    /// metadata at start-up, [`super::fit`]).
    fn sends(&self) -> Sent;
}

/// A configured task: its converter's input side, one call, then the task's `[[outputs]]`
/// rows. It takes no request options, so every event shares its one plan.
pub struct ConfiguredTask {
    plan: Arc<ConfiguredPlan>,
}

impl ConfiguredTask {
    pub fn new(input: impl InputConverter + 'static, outputs: Arc<Outputs>) -> Self {
        ConfiguredTask { plan: Arc::new(ConfiguredPlan { input: Box::new(input), outputs }) }
    }
}

impl Converter for ConfiguredTask {
    fn plan(&self, options: Option<&Value>) -> Result<Arc<dyn Plan>, Failure> {
        super::no_options(options)?;
        Ok(self.plan.clone())
    }

    fn uses(&self) -> Vec<ModelUse> {
        vec![ModelUse { inputs: self.plan.input.sends(), outputs: asked(self.plan.outputs.rules()) }]
    }
}

struct ConfiguredPlan {
    input: Box<dyn InputConverter>,
    outputs: Arc<Outputs>,
}

impl Plan for ConfiguredPlan {
    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure> {
        self.input.probe(bytes)
    }

    fn convert(&self, bytes: &[u8]) -> Result<Converted, Failure> {
        let ModelInput { tensors, input, placement } = self.input.convert(bytes)?;
        let finish = OutputsFinish { outputs: self.outputs.clone(), input, placement };
        Ok(Converted::call(tensors, self.outputs.names(), Box::new(finish)))
    }
}

/// The finish of a configured task: one call, its outputs rendered by the rules, next to what
/// the converter reports about the input.
struct OutputsFinish {
    outputs: Arc<Outputs>,
    input: Value,
    placement: Option<(Placement, (u32, u32))>,
}

impl Finish for OutputsFinish {
    fn output(self: Box<Self>, answers: Vec<Vec<OutputTensor>>) -> Result<Step, Failure> {
        let tensors = only_answer(answers)?;
        let frame = self.placement.as_ref().map(|(p, size)| (p, *size));
        let (outputs, stored) = self.outputs.render_all(&tensors, &self.input, frame)?;
        let output = json!({ "input": self.input, "outputs": outputs });
        Ok(match stored.is_empty() {
            true => Step::Done(output),
            false => Step::Store { output, stored },
        })
    }

    fn cpu_bound(&self) -> bool {
        // Encoding a stored output (a PNG the image's size, a large .npy, its SHA-256) is
        // work for the task's pool.
        self.outputs.stores()
    }
}

#[cfg(test)]
mod tests {
    use vramgate_shared::oip::F16;

    use super::*;

    fn rule(json_text: &str) -> OutputRule {
        serde_json::from_str(json_text).expect("rule parses")
    }

    fn tensor(name: &str, shape: Vec<usize>, data: Vec<f32>) -> OutputTensor {
        typed(name, shape, data)
    }

    fn typed(name: &str, shape: Vec<usize>, data: impl Into<TensorData>) -> OutputTensor {
        OutputTensor { name: name.into(), shape, data: data.into() }
    }

    /// A labels file holding `text` in a fresh temporary folder (the caller removes it).
    fn labels_file(tag: &str, text: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("vramgate-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let labels = dir.join("labels.txt");
        std::fs::write(&labels, text).expect("labels");
        (dir, labels)
    }

    #[test]
    fn softmax_then_top_k_names_labels_and_orders_ties_by_index() {
        let (dir, labels) = labels_file("labels", "cat\ndog\r\nbird\n");
        let r = rule(&json!({"name": "logits", "post": ["softmax", "top_k"], "top_k": 3, "labels": labels}).to_string());
        let outputs = Outputs::load(&[r], 100).expect("loads");
        assert_eq!(outputs.names(), &["logits"]);
        let value = outputs.render(&[tensor("logits", vec![1, 4], vec![1.0, 3.0, 3.0, 0.0])], &Value::Null, None).expect("renders");
        let top = &value["logits"]["top_k"][0];
        assert_eq!(value["logits"]["shape"], json!([1]));
        assert_eq!((top[0]["index"].clone(), top[0]["label"].clone()), (json!(1), json!("dog")));
        assert_eq!((top[1]["index"].clone(), top[1]["label"].clone()), (json!(2), json!("bird")));
        assert_eq!((top[2]["index"].clone(), top[2]["label"].clone()), (json!(0), json!("cat")));
        let e = |x: f64| x.exp();
        let want = e(3.0) / (e(1.0) + 2.0 * e(3.0) + 1.0);
        assert!((top[0]["score"].as_f64().expect("score") - want).abs() < 1e-6);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn argmax_threshold_and_raw_work_row_by_row() {
        let t = tensor("p", vec![2, 3], vec![0.1, 0.9, 0.2, 0.7, f32::NAN, 0.7]);
        let argmax = Outputs::load(&[rule(r#"{"name": "p", "post": ["argmax"]}"#)], 100).expect("argmax");
        assert_eq!(argmax.render(std::slice::from_ref(&t), &Value::Null, None).expect("renders")["p"], json!({"shape": [2], "index": [1, 0]}));
        let threshold = Outputs::load(&[rule(r#"{"name": "p", "post": ["threshold"], "threshold": 0.7}"#)], 100).expect("threshold");
        let above = threshold.render(std::slice::from_ref(&t), &Value::Null, None).expect("renders");
        assert_eq!(above["p"]["data"], json!([false, true, false, true, false, true]));
        let raw = Outputs::load(&[rule(r#"{"name": "p"}"#)], 100).expect("raw");
        let value = raw.render(std::slice::from_ref(&t), &Value::Null, None).expect("renders");
        assert_eq!(value["p"]["shape"], json!([2, 3]));
        assert_eq!(value["p"]["data"][4], Value::Null, "NaN is written as null");
        let sigmoid = Outputs::load(&[rule(r#"{"name": "p", "post": ["sigmoid"]}"#)], 100).expect("sigmoid");
        let s = sigmoid.render(&[tensor("p", vec![1], vec![0.0])], &Value::Null, None).expect("renders");
        assert_eq!(s["p"]["data"], json!([0.5]));
    }

    #[test]
    fn a_yolo_row_asks_for_every_head_and_renders_boxes_in_image_pixels() {
        let row = r#"{"name": "p5", "post": ["yolo_boxes"], "threshold": 0.25, "max_boxes": 5,
                      "yolo": {"classes": 1, "heads": [{"output": "p5", "stride": 32, "anchors": [[32, 32]]},
                                                       {"output": "p4", "stride": 16, "anchors": [[16, 16]]}]}}"#;
        let outputs = Outputs::load(&[rule(row)], 100).expect("loads");
        assert_eq!(outputs.names(), ["p5", "p4"]);
        assert_eq!(asked([&rule(row)]).iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["p4", "p5"]);
        // One confident cell in p5 (1 x 1 grid, logits 0 for x, y, w, h: a 32-pixel box at 16, 16);
        // p4 (1 x 1) has nothing.
        let p5 = tensor("p5", vec![1, 6, 1, 1], vec![0.0, 0.0, 0.0, 0.0, 5.0, 5.0]);
        let p4 = tensor("p4", vec![1, 6, 1, 1], vec![0.0, 0.0, 0.0, 0.0, -9.0, 0.0]);
        let placement = Placement { scale_x: 0.5, scale_y: 0.5, pad_x: 0.0, pad_y: 0.0, width: 100, height: 100 };
        let v = outputs.render(&[p5, p4], &Value::Null, Some(&placement)).expect("renders");
        assert_eq!(v["p5"]["boxes"].as_array().map(Vec::len), Some(1), "{v}");
        assert_eq!((v["p5"]["boxes"][0]["x1"].as_f64(), v["p5"]["boxes"][0]["x2"].as_f64()), (Some(0.0), Some(64.0)));
        assert_eq!(v["p5"]["cut"], false);
        for (bad, says) in [
            (r#"{"name": "p5", "post": ["yolo_boxes"]}"#, "outputs[0].yolo must give the heads"),
            (r#"{"name": "p5", "post": ["sigmoid"], "yolo": {"classes": 1, "heads": [{"output": "p5", "stride": 32, "anchors": [[1, 1]]}]}}"#,
             "yolo is only read by"),
            (r#"{"name": "p5", "post": ["yolo_boxes"], "max_boxes": 0, "yolo": {"classes": 1, "heads": [{"output": "p5", "stride": 32, "anchors": [[1, 1]]}]}}"#,
             "max_boxes must be 1 to 10000"),
        ] {
            let err = validate(&[rule(bad)], 100).expect_err(bad);
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn a_yolo_row_keeps_only_the_labels_it_names() {
        let (dir, labels) = labels_file("keep", "person\ncat\n");
        let row = |keep: &str| {
            rule(&format!(
                r#"{{"name": "p5", "post": ["yolo_boxes"], "threshold": 0.25, "labels": {labels:?}, "keep": {keep},
                    "yolo": {{"classes": 2, "heads": [{{"output": "p5", "stride": 32, "anchors": [[32, 32], [64, 64]]}}]}}}}"#
            ))
        };
        // Two confident anchors in one cell: a cat (anchor 0) and a person (anchor 1).
        let mut values = vec![0.0; 14];
        (values[4], values[6]) = (5.0, 5.0); // anchor 0: objectness, class 1 (cat)
        (values[11], values[12]) = (5.0, 5.0); // anchor 1: objectness, class 0 (person)
        let p5 = tensor("p5", vec![1, 14, 1, 1], values);
        let placement = Placement { scale_x: 1.0, scale_y: 1.0, pad_x: 0.0, pad_y: 0.0, width: 100, height: 100 };
        let all = Outputs::load(&[row("[]")], 100).expect("loads");
        let v = all.render(std::slice::from_ref(&p5), &Value::Null, Some(&placement)).expect("renders");
        assert_eq!(v["p5"]["boxes"].as_array().map(Vec::len), Some(2), "{v}");
        let people = Outputs::load(&[row(r#"["person"]"#)], 100).expect("loads");
        let v = people.render(std::slice::from_ref(&p5), &Value::Null, Some(&placement)).expect("renders");
        let boxes = v["p5"]["boxes"].as_array().expect("boxes");
        assert_eq!((boxes.len(), boxes[0]["label"].clone()), (1, json!("person")), "{v}");
        let unknown = Outputs::load(&[row(r#"["dog"]"#)], 100).expect_err("not a label");
        assert!(unknown.contains("keep: 'dog' is not a label"), "{unknown}");
        let no_labels = r#"{"name": "p5", "post": ["yolo_boxes"], "keep": ["person"], "yolo": {"classes": 1, "heads": [{"output": "p5", "stride": 32, "anchors": [[1, 1]]}]}}"#;
        assert!(validate(&[rule(no_labels)], 100).expect_err("needs labels").contains("set outputs[0].labels"));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn an_output_past_the_limit_is_refused_naming_it() {
        let outputs = Outputs::load(&[rule(r#"{"name": "big"}"#)], 4).expect("loads");
        let err = outputs.render(&[tensor("big", vec![5], vec![0.0; 5])], &Value::Null, None).expect_err("too large");
        assert_eq!((err.kind, err.stage), (ErrorKind::OutputRejected, Stage::Postprocess));
        assert!(err.message.contains("'big' has 5 values") && err.message.contains("max_output_elements 4"), "{}", err.message);
        let missing = outputs.render(&[tensor("other", vec![1], vec![0.0])], &Value::Null, None).expect_err("missing");
        assert!(missing.message.contains("no output 'big'"), "{}", missing.message);
    }

    #[test]
    fn bad_rules_are_named() {
        let check = |rules: Vec<OutputRule>, max: usize, want: &str| {
            let err = validate(&rules, max).expect_err(want);
            assert!(err.contains(want), "{err} should contain {want}");
        };
        check(vec![], 10, "at least one");
        check(vec![rule(r#"{"name": "x", "post": ["argmax", "softmax"]}"#)], 10, "outputs[0].post: argmax must be the last step");
        check(vec![rule(r#"{"name": "x", "post": ["top_k"], "top_k": 0}"#)], 10, "outputs[0].top_k must be 1 to 1000");
        check(vec![rule(r#"{"name": "x", "labels": "l.txt"}"#)], 10, "outputs[0].labels is only read by");
        check(vec![rule(r#"{"name": "x"}"#), rule(r#"{"name": "x"}"#)], 10, "outputs[1].name 'x' is listed twice");
        check(vec![rule(r#"{"name": "x"}"#)], 0, "max_output_elements must be 1 to");
        assert!(serde_json::from_str::<OutputRule>(r#"{"name": "x", "post": ["median"]}"#).is_err());
        let err = Outputs::load(&[rule(r#"{"name": "x", "post": ["argmax"], "labels": "/nonexistent/labels.txt"}"#)], 10)
            .expect_err("missing labels");
        assert!(err.starts_with("outputs[0].labels: cannot read /nonexistent/labels.txt"), "{err}");
    }

    #[test]
    fn speech_segments_read_the_audio_length_and_rate() {
        let r = rule(r#"{"name": "speech_prob", "post": ["speech_segments"], "segments": {"min_speech_ms": 0, "speech_pad_ms": 0}}"#);
        let outputs = Outputs::load(&[r], 100).expect("loads");
        // 512-sample windows at 16 kHz: windows 2 to 5 are speech.
        let probs = vec![0.0, 0.1, 0.9, 0.9, 0.9, 0.9, 0.0, 0.0, 0.0, 0.0];
        let input = json!({"samples": 5120, "sample_rate_hz": 16000});
        let value = outputs.render(&[tensor("speech_prob", vec![1, 10], probs)], &input, None).expect("renders");
        assert_eq!(value["speech_prob"], json!({"segments": [{"start_seconds": 0.064, "end_seconds": 0.192}]}));
        let err = outputs.render(&[tensor("speech_prob", vec![1, 1], vec![0.9])], &Value::Null, None).expect_err("no audio");
        assert!(err.message.contains("needs the audio's samples and rate"), "{}", err.message);
        let mixed = rule(r#"{"name": "p", "post": ["sigmoid", "speech_segments"]}"#);
        assert!(validate(&[mixed], 10).expect_err("alone").contains("speech_segments takes the model's probabilities"));
    }

    #[test]
    fn face_boxes_map_cells_through_the_placement_and_ask_for_the_regressions() {
        let r = rule(r#"{"name": "face_prob", "post": ["face_boxes"], "boxes": "box_offsets", "threshold": 0.7}"#);
        let outputs = Outputs::load(&[r], 100).expect("loads");
        assert_eq!(outputs.names(), &["face_prob", "box_offsets"]);
        // Two cells in a row: a face at (0, 0) and no face at (0, 1); the model input is the
        // image at half size, so boxes double.
        let prob = tensor("face_prob", vec![1, 2, 1, 2], vec![0.1, 0.8, 0.9, 0.2]);
        let boxes = tensor("box_offsets", vec![1, 4, 1, 2], vec![0.0; 8]);
        let placement = Placement { scale_x: 0.5, scale_y: 0.5, pad_x: 0.0, pad_y: 0.0, width: 100, height: 100 };
        let value = outputs.render(&[prob.clone(), boxes.clone()], &Value::Null, Some(&placement)).expect("renders");
        let found = value["face_prob"]["faces"].as_array().expect("faces").clone();
        assert_eq!(found.len(), 1, "{value}");
        let n = |k: &str| found[0][k].as_f64().expect("a number");
        assert_eq!((n("x1"), n("y1"), n("x2"), n("y2")), (0.0, 0.0, 24.0, 24.0));
        assert!((n("score") - 0.9).abs() < 1e-6);
        let err = outputs.render(&[prob, boxes], &Value::Null, None).expect_err("no placement");
        assert!(err.message.contains("needs an image's placement"), "{}", err.message);
        for (bad, want) in [
            (r#"{"name": "p", "post": ["face_boxes"]}"#, "outputs[0].boxes must name"),
            (r#"{"name": "p", "boxes": "b"}"#, "outputs[0].boxes is only read by"),
            (r#"{"name": "p", "post": ["face_boxes"], "boxes": "b", "max_faces": 0}"#, "max_faces must be 1 to 10000"),
        ] {
            assert!(validate(&[rule(bad)], 10).expect_err(want).contains(want));
        }
    }

    /// Renders `data` (shape `[2, 2]`) through the row `rule` (JSON without the name) and
    /// compares the JSON text, so that an integer written as a float would show.
    fn check(data: impl Into<TensorData>, rule_keys: &str, want: &str) {
        let keys = if rule_keys.is_empty() { String::new() } else { format!(", {rule_keys}") };
        let r = rule(&format!(r#"{{"name": "y"{keys}}}"#));
        let outputs = Outputs::load(&[r], 100).expect("loads");
        let value = outputs.render(&[typed("y", vec![2, 2], data)], &Value::Null, None).expect("renders");
        assert_eq!(value["y"].to_string(), want, "{rule_keys}");
    }

    #[test]
    fn every_datatype_the_worker_serves_renders_raw_as_json() {
        let big = (1i64 << 53) + 1;
        check(vec![big, -1, i64::MAX, i64::MIN], "", &format!(r#"{{"data":[{big},-1,{},{}],"shape":[2,2]}}"#, i64::MAX, i64::MIN));
        check(vec![i32::MAX, -7, 0, i32::MIN], "", &format!(r#"{{"data":[{},-7,0,{}],"shape":[2,2]}}"#, i32::MAX, i32::MIN));
        check(vec![0u8, 1, 128, 255], "", r#"{"data":[0,1,128,255],"shape":[2,2]}"#);
        check(vec![true, false, false, true], "", r#"{"data":[true,false,false,true],"shape":[2,2]}"#);
        let halves: Vec<F16> = [0.5, -2.0, 65504.0, 0.1].iter().map(|&v| F16::from_f64(v).expect("a half")).collect();
        // As FP32 values are: the exact value, widened to f64 by serde_json.
        check(halves, "", r#"{"data":[0.5,-2.0,65504.0,0.0999755859375],"shape":[2,2]}"#);
        check(vec![0.25f32, f32::NAN, f32::INFINITY, -1.5], "", r#"{"data":[0.25,null,null,-1.5],"shape":[2,2]}"#);
    }

    #[test]
    fn ranking_and_thresholds_take_integers_and_booleans_exactly() {
        let big = i64::MAX - 1;
        check(vec![3i64, big, 7, 7], r#""post": ["argmax"]"#, r#"{"index":[1,0],"shape":[2]}"#);
        check(vec![false, true, false, false], r#""post": ["argmax"]"#, r#"{"index":[1,0],"shape":[2]}"#);
        check(vec![5u8, 9, 9, 2], r#""post": ["top_k"], "top_k": 2"#, r#"{"shape":[2],"top_k":[[{"index":1,"score":9},{"index":0,"score":5}],[{"index":0,"score":9},{"index":1,"score":2}]]}"#);
        check(vec![big, i64::MAX, -4, 0], r#""post": ["top_k"], "top_k": 1"#, &format!(r#"{{"shape":[2],"top_k":[[{{"index":1,"score":{}}}],[{{"index":1,"score":0}}]]}}"#, i64::MAX));
        check(vec![false, true, true, true], r#""post": ["top_k"], "top_k": 1"#, r#"{"shape":[2],"top_k":[[{"index":1,"score":true}],[{"index":0,"score":true}]]}"#);
        check(vec![2i32, 3, -2, -1], r#""post": ["threshold"], "threshold": 2.5"#, r#"{"data":[false,true,false,false],"shape":[2,2]}"#);
        check(vec![2i32, 3, -2, -1], r#""post": ["threshold"], "threshold": -1.5"#, r#"{"data":[true,true,false,true],"shape":[2,2]}"#);
        let halves: Vec<F16> = [0.0, 0.0, 1.0, 3.0].iter().map(|&v| F16::from_f64(v).expect("a half")).collect();
        check(halves, r#""post": ["softmax", "argmax"]"#, r#"{"index":[0,1],"shape":[2]}"#);
    }

    #[test]
    fn integers_are_compared_with_a_threshold_without_rounding() {
        for (value, threshold, want) in [
            (2i64, 1.5f32, true),
            (1, 1.5, false),
            (-1, -1.5, true),
            (-2, -1.5, false),
            (3, 3.0, true),
            // 2^63 as an f32: above every i64; -2^63: i64::MIN itself.
            (i64::MAX, 9.223_372e18, false),
            (i64::MIN, -9.223_372e18, true),
            (i64::MIN, f32::MIN, true),
            ((1 << 53) + 1, 9.007_199e15, true),
        ] {
            assert_eq!(int_at_least(value, threshold), want, "{value} >= {threshold}");
        }
    }

    #[test]
    fn each_step_takes_the_datatypes_it_makes_sense_for() {
        use DataType::*;
        let check = |op: PostOp, takes: &[DataType]| {
            for datatype in DataType::ALL {
                let fits = post_fits(&[op], datatype);
                assert_eq!(fits.is_ok(), takes.contains(&datatype), "{} on {}: {fits:?}", op.as_str(), datatype.as_str());
            }
        };
        check(PostOp::Softmax, &[Fp16, Fp32]);
        check(PostOp::Sigmoid, &[Fp16, Fp32]);
        check(PostOp::SpeechSegments, &[Fp16, Fp32]);
        check(PostOp::FaceBoxes, &[Fp16, Fp32]);
        check(PostOp::Argmax, &[Bool, Uint8, Int32, Int64, Fp16, Fp32]);
        check(PostOp::TopK, &[Bool, Uint8, Int32, Int64, Fp16, Fp32]);
        check(PostOp::Threshold, &[Uint8, Int32, Int64, Fp16, Fp32]);
        assert_eq!(post_fits(&[], Uint64).expect_err("unread"), "UINT64 is a datatype the gateway does not read (BOOL, UINT8, INT32, INT64, FP16, FP32)");
        assert_eq!(post_fits(&[PostOp::Softmax], Int64).expect_err("no softmax"), "softmax needs a floating-point output (FP16, FP32)");
        // An output of a datatype its row does not take is refused, not guessed at, when the
        // start-up check could not run.
        let outputs = Outputs::load(&[rule(r#"{"name": "length", "post": ["softmax"]}"#)], 100).expect("loads");
        let err = outputs.render(&[typed("length", vec![2], vec![3i64, 4])], &Value::Null, None).expect_err("INT64 softmax");
        assert_eq!((err.kind, err.stage), (ErrorKind::Internal, Stage::Postprocess));
        assert_eq!(err.message, "output 'length' (INT64): softmax needs a floating-point output (FP16, FP32)");
        let boxes = Outputs::load(&[rule(r#"{"name": "p", "post": ["face_boxes"], "boxes": "b"}"#)], 100).expect("loads");
        let placement = Placement { scale_x: 1.0, scale_y: 1.0, pad_x: 0.0, pad_y: 0.0, width: 1, height: 1 };
        let err = boxes
            .render(&[tensor("p", vec![1, 2, 1, 1], vec![0.1, 0.9]), typed("b", vec![1, 4, 1, 1], vec![0i32; 4])], &Value::Null, Some(&placement))
            .expect_err("INT32 boxes");
        assert!(err.message.contains("output 'b' is INT32; this step needs a floating-point output"), "{}", err.message);
    }

    #[test]
    fn rows_describe_themselves_as_their_toml() {
        assert_eq!(rule(r#"{"name": "length"}"#).describe(), r#"name = "length""#);
        assert_eq!(rule(r#"{"name": "l", "post": ["softmax", "top_k"]}"#).describe(), r#"name = "l", post = ["softmax", "top_k"]"#);
        assert_eq!(rule(r#"{"name": "p", "post": ["face_boxes"], "boxes": "b"}"#).describe(), r#"name = "p", post = ["face_boxes"], boxes = "b""#);
    }

    #[test]
    fn top_k_keeps_the_largest_and_puts_nan_last() {
        assert_eq!(top_k(&[0.1, 0.5, 0.3, f32::NAN], 2), vec![(1, 0.5), (2, 0.3)]);
        assert_eq!(top_k(&[0.1], 5), vec![(0, 0.1)]);
        let all = top_k(&[f32::NAN, 0.2], 2);
        assert_eq!(all[0], (1, 0.2));
        assert!(all[1].1.is_nan());
    }

    #[test]
    fn stored_rows_leave_the_value_and_become_objects_of_any_size() {
        let rows = [
            rule(r#"{"name": "map", "store": "s3://outputs/run/"}"#),
            rule(r#"{"name": "mask", "post": ["sigmoid", "mask_png"], "threshold": 0.5, "store": "s3://outputs/run/"}"#),
            rule(r#"{"name": "class", "post": ["argmax"], "store": "s3://outputs/"}"#),
            rule(r#"{"name": "small"}"#),
        ];
        // max_output_elements 4 bounds the inline row only.
        let outputs = Outputs::load(&rows, 4).expect("loads");
        assert!(outputs.stores());
        assert_eq!(rows.iter().filter_map(|r| r.store.as_ref().map(|t| t.bucket.as_str())).collect::<Vec<_>>(), vec!["outputs"; 3]);
        let map = typed("map", vec![1, 2, 3], vec![0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let mask = typed("mask", vec![1, 2, 2], vec![-5.0f32, 5.0, 5.0, -5.0]);
        let class = typed("class", vec![1, 3], vec![0.1f32, 0.7, 0.2]);
        let small = typed("small", vec![2], vec![1.0f32, 2.0]);
        let (value, stored) = outputs.render_all(&[map, mask, class, small], &Value::Null, None).expect("renders");
        assert_eq!(value, json!({"small": {"shape": [2], "data": [1.0, 2.0]}}));
        let by: std::collections::HashMap<&str, &StoredOutput> = stored.iter().map(|s| (s.output.as_str(), s)).collect();
        assert_eq!((by["map"].ext, by["mask"].ext, by["class"].ext), ("npy", "png", "json"));
        assert_eq!(by["map"].bytes, npy::encode(&[1, 2, 3], &TensorData::Fp32(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0])).expect("npy"));
        assert_eq!(by["map"].reference["shape"], json!([1, 2, 3]));
        assert_eq!(by["map"].reference["datatype"], "FP32");
        assert_eq!(by["mask"].reference["shape"], json!([2, 2]), "the map's own size without an image");
        assert_eq!(serde_json::from_slice::<Value>(&by["class"].bytes).expect("json"), json!({"shape": [1], "index": [1]}));
        assert_eq!(by["class"].target.prefix, "");
        // mask_png needs a store; a map of the wrong rank is the event's failure, named.
        let err = Outputs::load(&[rule(r#"{"name": "m", "post": ["mask_png"]}"#)], 4).expect_err("no store");
        assert!(err.contains("store"), "{err}");
        let flat = Outputs::load(&[rule(r#"{"name": "m", "post": ["mask_png"], "store": "s3://outputs/"}"#)], 4).expect("loads");
        let err = flat.render_all(&[typed("m", vec![2, 2, 2], vec![0.0f32; 8])], &Value::Null, None).expect_err("rank 3");
        assert!(err.message.contains("[h, w]"), "{}", err.message);
    }
}
