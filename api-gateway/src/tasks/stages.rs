//! Pipelines by configuration: a task of the `image` converter may list `[[tasks.<name>.stages]]`
//! instead of one model. Each stage names a model, the picture it takes, and its own
//! `[[...stages.outputs]]` rows (the same post steps as a one-model task); the result holds
//! every stage's outputs, each under `<stage>.<output>`.
//!
//! A stage's `input` is either
//! - `"image"`: the event's picture, fitted to the stage's model input by its own `image`
//!   keys (size, resize, layout, datatype, normalisation: the `tensor` mode's), or
//! - `"<stage>.<output>"`: one crop per box that an earlier stage's `yolo_boxes` or
//!   `face_boxes` row found (a *map* stage). Each box, grown by `crop_margin` of its size on
//!   every side and rounded outwards to whole pixels, is cut from the decoded picture and
//!   fitted like a picture; the crops go `crops_per_call` to one call when the model takes a
//!   batch, one a call when it does not.
//!
//! The picture is decoded once. Stages that take the picture run at once (fan-out: their calls
//! go out together, each admitted by its own model's permits and by the worker's byte
//! admission); a map stage runs when the stage it crops from has answered. A map stage's
//! `mask_png` rows composite: every crop's mask, mapped back through its crop, is pasted into
//! one picture-sized mask (a pixel is foreground when any crop says so), stored as one PNG; its
//! other rows give `{"items": [...]}`, one value per crop in box order, and store nothing
//! (`store` on them is refused). A picture with no boxes gives an empty composite and no items.
//! The result also says, per map stage, how many crops it made and whether boxes were left
//! out (`crops.<stage> = {"count", "cut"}`).
//!
//! Each step's calls of one stage are a `stage` span named after it; a failure of a call or of
//! a stage's post-processing names the stage (`stage people (yolov4_tiny): ...`).
//!
//! Bounds: at most [`MAX_STAGES`] stages; a map stage makes at most `max_crops` crops (at most
//! [`MAX_CROPS`]; the best-scoring boxes first, the rest left out and `cut` set), at most
//! `crops_per_call` (at most [`MAX_CROPS_PER_CALL`]) in one call; a map stage crops only from a
//! stage that takes the picture (one level of maps).

use std::sync::Arc;

use ::image::{imageops, RgbImage};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use vramgate_shared::events::{ErrorKind, Stage};
use vramgate_shared::oip::{DataType, Tensor, TensorData};

use super::fit::{Dim, ModelUse, Sent, SentTensor};
use super::image::{decode_bytes, decode_rgb, probe, tensor, ImageMode, ImageOptions, Placement};
use super::mask::Canvas;
use super::outputs::{asked, mask_map, OutputRule, Outputs, PostOp};
use super::{Converted, Converter, Finish, ModelCall, Plan, Step};
use crate::call::client::OutputTensor;
use crate::failure::Failure;
use crate::storage::StoredOutput;

/// Most stages of one task.
pub const MAX_STAGES: usize = 8;
/// Most crops one map stage makes of one picture.
pub const MAX_CROPS: usize = 256;
/// Most crops in one call.
pub const MAX_CROPS_PER_CALL: usize = 64;

/// One `[[tasks.<name>.stages]]` row.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageConfig {
    /// Its name: the prefix of its outputs in the result, its span's and its failures' name.
    pub name: String,
    /// The worker's model.
    pub model: String,
    /// `"image"`, or `"<stage>.<output>"`: a crop per box of that earlier stage's row.
    #[serde(default = "picture")]
    pub input: String,
    /// The model input, as the `image` converter's `tensor` mode configures it (`mode` is not
    /// read: a stage is always a tensor).
    #[serde(default)]
    pub image: ImageOptions,
    /// Map stages: each box grows by this share of its width and height on every side.
    #[serde(default)]
    pub crop_margin: f32,
    /// Map stages: at most this many crops (the best boxes first).
    #[serde(default = "default_max_crops")]
    pub max_crops: usize,
    /// Map stages: crops per call, for a model with a batch dimension.
    #[serde(default = "default_crops_per_call")]
    pub crops_per_call: usize,
    pub outputs: Vec<OutputRule>,
}

fn picture() -> String {
    "image".into()
}

fn default_max_crops() -> usize {
    32
}

fn default_crops_per_call() -> usize {
    16
}

const PICTURE: &str = "image";

impl StageConfig {
    /// The stage and row it crops from, for a map stage.
    fn source(&self) -> Option<(&str, &str)> {
        (self.input != PICTURE).then(|| self.input.split_once('.').unwrap_or((self.input.as_str(), "")))
    }

    /// Its model input options, in `tensor` mode.
    fn tensor_options(&self) -> ImageOptions {
        ImageOptions { mode: ImageMode::Tensor, ..self.image.clone() }
    }
}

/// Checks a task's stages (the caller prefixes `tasks.<name>.`).
pub fn validate(stages: &[StageConfig], max_output_elements: usize) -> Result<(), String> {
    if stages.len() > MAX_STAGES {
        return Err(format!("stages lists {} stages; at most {MAX_STAGES}", stages.len()));
    }
    for (i, stage) in stages.iter().enumerate() {
        let at = format!("stages[{i}]");
        let name_ok = (1..=64).contains(&stage.name.len())
            && stage.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !name_ok {
            return Err(format!("{at}.name must be 1 to 64 of A-Z, a-z, 0-9, '_' and '-'"));
        }
        if stage.name == PICTURE {
            return Err(format!("{at}.name: \"{PICTURE}\" names the event's picture; call the stage something else"));
        }
        if stages[..i].iter().any(|s| s.name == stage.name) {
            return Err(format!("{at}.name '{}' is used twice", stage.name));
        }
        if stage.model.is_empty() || stage.model.len() > 128 {
            return Err(format!("{at}.model must name a model (1 to 128 bytes)"));
        }
        stage.tensor_options().validate().map_err(|e| format!("{at}.{e}"))?;
        super::outputs::validate(&stage.outputs, max_output_elements).map_err(|e| format!("{at}.{e}"))?;
        if Outputs::wants_speech_segments(&stage.outputs) {
            return Err(format!("{at}.outputs: speech_segments is for the audio converter, not a picture's stage"));
        }
        if !(0.0..=1.0).contains(&stage.crop_margin) {
            return Err(format!("{at}.crop_margin must be 0 to 1, got {}", stage.crop_margin));
        }
        if !(1..=MAX_CROPS).contains(&stage.max_crops) {
            return Err(format!("{at}.max_crops must be 1 to {MAX_CROPS}, got {}", stage.max_crops));
        }
        if !(1..=MAX_CROPS_PER_CALL).contains(&stage.crops_per_call) {
            return Err(format!("{at}.crops_per_call must be 1 to {MAX_CROPS_PER_CALL}, got {}", stage.crops_per_call));
        }
        let Some((from, row)) = stage.source() else { continue };
        let Some(source) = stages[..i].iter().find(|s| s.name == from) else {
            return Err(format!(
                "{at}.input must be \"{PICTURE}\" or \"<stage>.<output>\" naming an earlier stage's boxes, got '{}'",
                stage.input
            ));
        };
        if source.source().is_some() {
            return Err(format!("{at}.input: stage '{from}' is itself a map stage; crops are cut from stages that take the picture"));
        }
        let boxes = source.outputs.iter().find(|r| r.name == row);
        if !boxes.is_some_and(|r| matches!(r.post.first(), Some(PostOp::YoloBoxes | PostOp::FaceBoxes)) && r.store.is_none()) {
            return Err(format!("{at}.input: stage '{from}' has no row '{row}' giving boxes (post = [\"yolo_boxes\"] or [\"face_boxes\"], not stored)"));
        }
        for (j, rule) in stage.outputs.iter().enumerate() {
            if rule.store.is_some() && rule.post.last() != Some(&PostOp::MaskPng) {
                return Err(format!("{at}.outputs[{j}]: a map stage stores only mask_png rows (one mask of all its crops)"));
            }
        }
    }
    Ok(())
}

/// One stage, its rows loaded.
struct StageRun {
    name: &'static str,
    /// Its model's place in the task's models ([`Converter::stage_models`]).
    model: usize,
    options: ImageOptions,
    /// For a map stage: the stage (its index) and row it crops from.
    source: Option<(usize, String)>,
    /// Every row (a picture stage renders them all).
    outputs: Arc<Outputs>,
    /// A map stage's rows but its `mask_png` ones (rendered per crop), if any.
    per_crop: Option<Arc<Outputs>>,
    /// A map stage's `mask_png` rows (composited).
    masks: Vec<OutputRule>,
    crop_margin: f32,
    max_crops: usize,
    crops_per_call: usize,
}

struct Shared {
    stages: Vec<StageRun>,
    /// The distinct models, in the order the stages first name them.
    models: Vec<String>,
    /// The strictest of the stages' `image.max_pixels`.
    max_pixels: u64,
}

/// A task of stages (the `image` converter with `[[stages]]`).
pub struct Pipeline {
    shared: Arc<Shared>,
}

impl Pipeline {
    /// Loads the stages' rows (labels files); an unreadable one is an error naming it.
    pub fn new(configs: &[StageConfig], max_output_elements: usize) -> Result<Self, String> {
        validate(configs, max_output_elements)?;
        let mut models: Vec<String> = Vec::new();
        let mut stages = Vec::new();
        for (i, c) in configs.iter().enumerate() {
            let model = match models.iter().position(|m| *m == c.model) {
                Some(at) => at,
                None => {
                    models.push(c.model.clone());
                    models.len() - 1
                }
            };
            let at = |e: String| format!("stages[{i}].{e}");
            let outputs = Outputs::load(&c.outputs, max_output_elements).map_err(at)?;
            let source = c.source().map(|(from, row)| (configs.iter().position(|s| s.name == from).unwrap_or(0), row.to_string()));
            let (masks, others): (Vec<OutputRule>, Vec<OutputRule>) =
                c.outputs.iter().cloned().partition(|r| source.is_some() && r.post.last() == Some(&PostOp::MaskPng));
            let per_crop = match (&source, others.is_empty()) {
                (Some(_), false) => Some(Outputs::load(&others, max_output_elements).map_err(at)?),
                _ => None,
            };
            stages.push(StageRun {
                // Leaked once per task (the table is read once per process), as calls borrow names.
                name: Box::leak(c.name.clone().into_boxed_str()),
                model,
                options: c.tensor_options(),
                source,
                outputs,
                per_crop,
                masks,
                crop_margin: c.crop_margin,
                max_crops: c.max_crops,
                crops_per_call: c.crops_per_call,
            });
        }
        let max_pixels = configs.iter().map(|c| c.image.max_pixels).min().unwrap_or(ImageOptions::default().max_pixels);
        Ok(Pipeline { shared: Arc::new(Shared { stages, models, max_pixels }) })
    }
}

impl Converter for Pipeline {
    fn plan(&self, options: Option<&Value>) -> Result<Arc<dyn Plan>, Failure> {
        super::no_options(options)?;
        Ok(Arc::new(PipelinePlan { shared: self.shared.clone() }))
    }

    fn stage_models(&self) -> Vec<String> {
        self.shared.models[1..].to_vec()
    }

    fn first_model(&self) -> Option<String> {
        Some(self.shared.models[0].clone())
    }

    fn uses(&self) -> Vec<ModelUse> {
        // One use per model: what its first stage sends, and every row of every stage on it.
        (0..self.shared.models.len())
            .map(|m| {
                let on: Vec<(usize, &StageRun)> = self.shared.stages.iter().enumerate().filter(|(_, s)| s.model == m).collect();
                let (i, first) = on[0];
                let options = &first.options;
                let mut shape: Vec<Dim> = tensor::shape(options).into_iter().map(Dim::Fixed).collect();
                if first.source.is_some() && options.batch {
                    shape[0] = Dim::Any;
                }
                let key = format!("stages[{i}].image.input");
                let inputs = Sent::One(SentTensor::new(&key, &options.input, Some(options.datatype), Some(shape)));
                let outputs = on.iter().flat_map(|(_, s)| asked(s.outputs.rules())).collect();
                ModelUse { inputs, outputs }
            })
            .collect()
    }
}

struct PipelinePlan {
    shared: Arc<Shared>,
}

impl Plan for PipelinePlan {
    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure> {
        let header = probe(bytes, self.shared.max_pixels)?;
        // The decode, then the picture kept for crops beside each picture stage's fit.
        let fits: u64 = self.shared.stages.iter().filter(|s| s.source.is_none()).map(|s| tensor::conversion_bytes(&header, &s.options)).sum();
        Ok(decode_bytes(&header).max(header.pixels().saturating_mul(3)).saturating_add(fits))
    }

    fn convert(&self, bytes: &[u8]) -> Result<Converted, Failure> {
        let (rgb, format) = decode_rgb(bytes, self.shared.max_pixels)?;
        let (width, height) = rgb.dimensions();
        let mut finish = PipelineFinish {
            shared: self.shared.clone(),
            input: json!({ "format": format, "width": width, "height": height }),
            rgb,
            pending: Vec::new(),
            rendered: vec![None; self.shared.stages.len()],
            outputs: serde_json::Map::new(),
            stored: Vec::new(),
            maps: Vec::new(),
            done: false,
        };
        let mut calls = Vec::new();
        for (i, stage) in self.shared.stages.iter().enumerate().filter(|(_, s)| s.source.is_none()) {
            let (data, placement) = tensor::values(&finish.rgb, &stage.options);
            let tensor = Tensor { name: stage.options.input.clone(), shape: tensor::shape(&stage.options), data };
            calls.push(ModelCall { stage: stage.model, inputs: vec![tensor], outputs: stage.outputs.names(), name: Some(stage.name) });
            finish.pending.push(Pending { stage: i, frames: vec![Frame::whole(placement, &stage.options)] });
        }
        Ok(Converted { calls, finish: Box::new(finish) })
    }
}

/// Where one item of a call sits: its placement from the picture into the model input (a
/// crop's composed with its offset), and the picture rectangle it covers.
struct Frame {
    placement: Placement,
    model_size: (u32, u32),
    rect: [u32; 4],
}

impl Frame {
    fn whole(placement: Placement, options: &ImageOptions) -> Frame {
        let rect = [0, 0, placement.width, placement.height];
        Frame { placement, model_size: (options.width, options.height), rect }
    }
}

/// One call made: the stage, and one frame per batch item.
struct Pending {
    stage: usize,
    frames: Vec<Frame>,
}

/// A map stage's state while its crops are answered.
struct MapState {
    stage: usize,
    count: usize,
    cut: bool,
    canvases: Vec<Canvas>,
    items: Vec<Vec<Value>>,
}

struct PipelineFinish {
    shared: Arc<Shared>,
    input: Value,
    rgb: RgbImage,
    pending: Vec<Pending>,
    /// Each picture stage's rendered rows, once answered (map stages read their boxes).
    rendered: Vec<Option<Value>>,
    outputs: serde_json::Map<String, Value>,
    stored: Vec<StoredOutput>,
    maps: Vec<MapState>,
    /// Whether the map stages' calls were made (there is one level of them).
    done: bool,
}

/// A failure of a stage's post-processing, naming the stage.
fn named(stage: &StageRun, mut failure: Failure) -> Failure {
    failure.message = format!("stage {}: {}", stage.name, failure.message);
    failure
}

impl Finish for PipelineFinish {
    fn output(mut self: Box<Self>, answers: Vec<Vec<OutputTensor>>) -> Result<Step, Failure> {
        let pending = std::mem::take(&mut self.pending);
        if pending.len() != answers.len() {
            return Err(Failure::new(ErrorKind::Internal, Stage::Postprocess, format!("{} answers for {} calls", answers.len(), pending.len())));
        }
        let shared = self.shared.clone();
        for (call, tensors) in pending.into_iter().zip(answers) {
            let stage = &shared.stages[call.stage];
            if stage.source.is_none() {
                let frame = &call.frames[0];
                let (value, stored) =
                    stage.outputs.render_all(&tensors, &self.input, Some((&frame.placement, frame.model_size))).map_err(|f| named(stage, f))?;
                self.keep(stage, &value, stored);
                self.rendered[call.stage] = Some(value);
            } else {
                self.answer_crops(call, &tensors).map_err(|f| named(stage, f))?;
            }
        }
        if !self.done {
            self.done = true;
            let calls = self.crop_calls()?;
            if !calls.is_empty() {
                return Ok(Step::Next(Converted { calls, finish: self }));
            }
        }
        self.finish()
    }

    fn cpu_bound(&self) -> bool {
        // Crops, their fits and the composited PNGs are work for the task's pool.
        true
    }

    fn held_bytes(&self) -> u64 {
        let canvases: u64 = self.maps.iter().map(|m| m.canvases.len() as u64).sum::<u64>() * u64::from(self.rgb.width()) * u64::from(self.rgb.height());
        self.rgb.as_raw().len() as u64 + canvases
    }
}

impl PipelineFinish {
    /// A picture stage's rows into the result, under `<stage>.<row>`.
    fn keep(&mut self, stage: &StageRun, value: &Value, stored: Vec<StoredOutput>) {
        if let Value::Object(rows) = value {
            for (row, v) in rows {
                self.outputs.insert(format!("{}.{row}", stage.name), v.clone());
            }
        }
        for mut object in stored {
            object.output = format!("{}.{}", stage.name, object.output);
            self.stored.push(object);
        }
    }

    /// The map stages' calls: each box of its source row cut out, fitted, batched.
    fn crop_calls(&mut self) -> Result<Vec<ModelCall>, Failure> {
        let shared = self.shared.clone();
        let (width, height) = self.rgb.dimensions();
        let mut calls = Vec::new();
        for (i, stage) in shared.stages.iter().enumerate() {
            let Some((from, row)) = &stage.source else { continue };
            let value = self.rendered[*from].as_ref().map(|v| &v[row.as_str()]).unwrap_or(&Value::Null);
            let boxes = value["boxes"].as_array().or_else(|| value["faces"].as_array()).map(Vec::as_slice).unwrap_or_default();
            let count = boxes.len().min(stage.max_crops);
            let cut = boxes.len() > stage.max_crops || value["cut"] == true;
            let mut crops = Vec::with_capacity(count);
            for found in &boxes[..count] {
                let corner = |k: &str| found[k].as_f64().unwrap_or(0.0);
                crops.push(crop_rect([corner("x1"), corner("y1"), corner("x2"), corner("y2")], stage.crop_margin, width, height));
            }
            let per_call = if stage.options.batch { stage.crops_per_call } else { 1 };
            for batch in crops.chunks(per_call) {
                let mut parts = Vec::with_capacity(batch.len());
                let mut frames = Vec::with_capacity(batch.len());
                for &rect in batch {
                    let [x0, y0, x1, y1] = rect;
                    let cropped = imageops::crop_imm(&self.rgb, x0, y0, x1 - x0, y1 - y0).to_image();
                    let (data, p) = tensor::values(&cropped, &stage.options);
                    parts.push(data);
                    // Picture → crop → model: model = (picture − offset) · scale + pad.
                    let placement = Placement {
                        pad_x: p.pad_x - x0 as f32 * p.scale_x,
                        pad_y: p.pad_y - y0 as f32 * p.scale_y,
                        width,
                        height,
                        ..p
                    };
                    frames.push(Frame { placement, model_size: (stage.options.width, stage.options.height), rect });
                }
                let mut shape = tensor::shape(&stage.options);
                if stage.options.batch {
                    shape[0] = batch.len();
                }
                let data = concat(parts).map_err(|m| named(stage, Failure::new(ErrorKind::Internal, Stage::Convert, m)))?;
                let tensor = Tensor { name: stage.options.input.clone(), shape, data };
                calls.push(ModelCall { stage: stage.model, inputs: vec![tensor], outputs: stage.outputs.names(), name: Some(stage.name) });
                self.pending.push(Pending { stage: i, frames });
            }
            self.maps.push(MapState {
                stage: i,
                count,
                cut,
                canvases: stage.masks.iter().map(|_| Canvas::new(width, height)).collect(),
                items: vec![Vec::new(); stage.per_crop.as_ref().map_or(0, |o| o.rules().count())],
            });
        }
        Ok(calls)
    }

    /// One call's answers for a map stage's crops: each mask pasted, each other row per crop.
    fn answer_crops(&mut self, call: Pending, tensors: &[OutputTensor]) -> Result<(), Failure> {
        let shared = self.shared.clone();
        let stage = &shared.stages[call.stage];
        let internal = |m: String| Failure::new(ErrorKind::Internal, Stage::Postprocess, m);
        let n = call.frames.len();
        let state = self.maps.iter_mut().find(|m| m.stage == call.stage).ok_or_else(|| internal("answers for a stage not started".into()))?;
        for (k, frame) in call.frames.iter().enumerate() {
            let item: Vec<OutputTensor> = tensors
                .iter()
                .map(|t| item_of(t, k, n, stage.options.batch))
                .collect::<Result<_, String>>()
                .map_err(internal)?;
            for (rule, canvas) in stage.masks.iter().zip(&mut state.canvases) {
                let tensor = item.iter().find(|t| t.name == rule.name).ok_or_else(|| internal(format!("the worker's answer has no output '{}'", rule.name)))?;
                let map = mask_map(rule, &tensor.data, &tensor.shape).map_err(|m| internal(format!("output '{}': {m}", rule.name)))?;
                canvas.paste(&map, &tensor.shape, &frame.placement, frame.model_size, frame.rect).map_err(|m| internal(format!("output '{}': {m}", rule.name)))?;
            }
            if let Some(per_crop) = &stage.per_crop {
                let (value, _) = per_crop.render_all(&item, &self.input, Some((&frame.placement, frame.model_size)))?;
                for (rule, items) in per_crop.rules().zip(&mut state.items) {
                    items.push(value[rule.name.as_str()].clone());
                }
            }
        }
        Ok(())
    }

    /// The result: every stage's rows, the composited masks stored.
    fn finish(mut self: Box<Self>) -> Result<Step, Failure> {
        let shared = self.shared.clone();
        let mut crops = serde_json::Map::new();
        for state in std::mem::take(&mut self.maps) {
            let stage = &shared.stages[state.stage];
            for (rule, canvas) in stage.masks.iter().zip(&state.canvases) {
                let (png, width, height) =
                    canvas.png().map_err(|m| named(stage, Failure::new(ErrorKind::Internal, Stage::Postprocess, m)))?;
                let target = rule.store.as_ref().expect("a mask_png row stores (validated)");
                let name = format!("{}.{}", stage.name, rule.name);
                self.stored.push(StoredOutput::new(&name, target, "png", png, &[height as usize, width as usize], DataType::Uint8.as_str()));
            }
            if let Some(per_crop) = &stage.per_crop {
                for (rule, items) in per_crop.rules().zip(state.items) {
                    self.outputs.insert(format!("{}.{}", stage.name, rule.name), json!({ "items": items }));
                }
            }
            crops.insert(stage.name.to_string(), json!({ "count": state.count, "cut": state.cut }));
        }
        let mut output = json!({ "input": self.input, "outputs": Value::Object(std::mem::take(&mut self.outputs)) });
        if !crops.is_empty() {
            output["crops"] = Value::Object(crops);
        }
        let stored = std::mem::take(&mut self.stored);
        Ok(match stored.is_empty() {
            true => Step::Done(output),
            false => Step::Store { output, stored },
        })
    }
}

/// A box in picture pixels, grown by `margin` of its size on every side, rounded outwards
/// and clipped to the picture: `[x0, y0, x1, y1)`, at least one pixel each way.
pub fn crop_rect(corners: [f64; 4], margin: f32, width: u32, height: u32) -> [u32; 4] {
    let [x1, y1, x2, y2] = corners.map(|v| if v.is_finite() { v } else { 0.0 });
    let (dx, dy) = ((x2 - x1).max(0.0) * f64::from(margin), (y2 - y1).max(0.0) * f64::from(margin));
    let side = |lo: f64, hi: f64, limit: u32| -> (u32, u32) {
        let limit = limit.max(1);
        let start = (lo.floor().max(0.0) as u64).min(u64::from(limit) - 1) as u32;
        let end = (hi.ceil().max(0.0) as u64).min(u64::from(limit)) as u32;
        (start, end.max(start + 1))
    };
    let (x0, x1) = side(x1 - dx, x2 + dx, width);
    let (y0, y1) = side(y1 - dy, y2 + dy, height);
    [x0, y0, x1, y1]
}

/// The crops' values one after another: one batched tensor's.
fn concat(parts: Vec<TensorData>) -> Result<TensorData, String> {
    macro_rules! join {
        ($($variant:ident),*) => {
            match parts.first() {
                $(Some(TensorData::$variant(_)) => {
                    let mut all = Vec::new();
                    for part in parts {
                        let TensorData::$variant(values) = part else { return Err("crops of different datatypes".into()) };
                        all.extend(values);
                    }
                    Ok(TensorData::$variant(all))
                })*
                Some(other) => Err(format!("crops of {} are not batched", other.datatype().as_str())),
                None => Err("no crops to batch".into()),
            }
        };
    }
    join!(Uint8, Fp16, Fp32)
}

/// Item `k` of `n` of a batched output (`[n, ...]` → `[1, ...]`); a model without a batch
/// dimension answers one item a call, as it is.
fn item_of(tensor: &OutputTensor, k: usize, n: usize, batch: bool) -> Result<OutputTensor, String> {
    if !batch {
        return Ok(OutputTensor { name: tensor.name.clone(), shape: tensor.shape.clone(), data: tensor.data.clone() });
    }
    if tensor.shape.first() != Some(&n) || tensor.data.len() % n.max(1) != 0 {
        return Err(format!("output '{}' has shape {:?} for a batch of {n} crops", tensor.name, tensor.shape));
    }
    let per = tensor.data.len() / n;
    let range = k * per..(k + 1) * per;
    macro_rules! slice {
        ($($variant:ident),*) => {
            match &tensor.data {
                $(TensorData::$variant(v) => TensorData::$variant(v[range].to_vec()),)*
            }
        };
    }
    let data = slice!(Bool, Uint8, Uint16, Uint32, Uint64, Int8, Int16, Int32, Int64, Fp16, Fp32, Fp64);
    let mut shape = tensor.shape.clone();
    shape[0] = 1;
    Ok(OutputTensor { name: tensor.name.clone(), shape, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stages(toml_text: &str) -> Vec<StageConfig> {
        #[derive(Deserialize)]
        struct Table {
            stages: Vec<StageConfig>,
        }
        use figment::providers::Format;
        figment::Figment::from(figment::providers::Toml::string(toml_text)).extract::<Table>().expect("stages parse").stages
    }

    const DETECT_THEN_SEGMENT: &str = r#"
        [[stages]]
        name = "people"
        model = "detector"
        image = { width = 4, height = 4, resize = "stretch", datatype = "UINT8", layout = "nhwc" }
        [[stages.outputs]]
        name = "p5"
        post = ["face_boxes"]
        boxes = "b"
        [[stages]]
        name = "masks"
        model = "segmenter"
        input = "people.p5"
        crops_per_call = 2
        image = { width = 2, height = 2, resize = "stretch", datatype = "UINT8", layout = "nhwc" }
        [[stages.outputs]]
        name = "mask"
        post = ["mask_png"]
        store = "s3://outputs/x/"
    "#;

    #[test]
    fn stages_are_checked_and_name_what_is_wrong() {
        validate(&stages(DETECT_THEN_SEGMENT), 1000).expect("valid");
        for (change, want) in [
            (("name = \"masks\"", "name = \"people\""), "stages[1].name 'people' is used twice"),
            (("input = \"people.p5\"", "input = \"people.p4\""), "stage 'people' has no row 'p4' giving boxes"),
            (("input = \"people.p5\"", "input = \"later.p5\""), "naming an earlier stage's boxes"),
            (("crops_per_call = 2", "crops_per_call = 65"), "crops_per_call must be 1 to 64"),
            (("name = \"people\"", "name = \"image\""), "names the event's picture"),
            (("post = [\"mask_png\"]", "post = [\"sigmoid\"]"), "stores only mask_png rows"),
        ] {
            let text = DETECT_THEN_SEGMENT.replace(change.0, change.1);
            assert_ne!(text, DETECT_THEN_SEGMENT, "{change:?} changes nothing");
            let err = validate(&stages(&text), 1000).expect_err(want);
            assert!(err.contains(want), "{err} should say {want}");
        }
        let many = (0..9).map(|i| format!("[[stages]]\nname = \"s{i}\"\nmodel = \"m\"\n[[stages.outputs]]\nname = \"o\"\n")).collect::<String>();
        assert!(validate(&stages(&many), 1000).expect_err("too many").contains("at most 8"));
    }

    #[test]
    fn stages_on_one_model_share_it_and_the_first_is_stage_zero() {
        let text = DETECT_THEN_SEGMENT.replace("model = \"segmenter\"", "model = \"detector\"");
        let pipeline = Pipeline::new(&stages(&text), 1000).expect("loads");
        assert_eq!(pipeline.first_model().as_deref(), Some("detector"));
        assert!(pipeline.stage_models().is_empty());
        let two = Pipeline::new(&stages(DETECT_THEN_SEGMENT), 1000).expect("loads");
        assert_eq!(two.stage_models(), ["segmenter"]);
        let uses = two.uses();
        assert_eq!(uses.len(), 2);
        let Sent::One(sent) = &uses[1].inputs else { panic!("one tensor") };
        assert_eq!(sent.shape, Some(vec![Dim::Any, Dim::Fixed(2), Dim::Fixed(2), Dim::Fixed(3)]), "crops go batched");
    }

    #[test]
    fn crop_rects_grow_round_outwards_and_stay_in_the_picture() {
        assert_eq!(crop_rect([1.2, 2.5, 3.7, 4.0], 0.0, 10, 10), [1, 2, 4, 4]);
        // 10 wide, a quarter margin: 2.5 pixels each side, rounded outwards.
        assert_eq!(crop_rect([10.0, 10.0, 20.0, 20.0], 0.25, 100, 100), [7, 7, 23, 23]);
        assert_eq!(crop_rect([-5.0, -5.0, 500.0, 7.0], 0.0, 100, 50), [0, 0, 100, 7]);
        // Degenerate and non-finite boxes still cut one pixel inside the picture.
        assert_eq!(crop_rect([100.0, 50.0, 100.0, 50.0], 0.0, 100, 50), [99, 49, 100, 50]);
        assert_eq!(crop_rect([f64::NAN, 0.0, f64::INFINITY, 0.0], 0.5, 3, 3), [0, 0, 1, 1]);
    }

    #[test]
    fn batched_answers_split_per_crop_and_crops_join() {
        let t = OutputTensor { name: "m".into(), shape: vec![2, 1, 3], data: TensorData::Fp32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) };
        let second = item_of(&t, 1, 2, true).expect("an item");
        assert_eq!((second.shape, second.data), (vec![1, 1, 3], TensorData::Fp32(vec![4.0, 5.0, 6.0])));
        assert!(item_of(&t, 0, 3, true).expect_err("not a batch of 3").contains("batch of 3"));
        let joined = concat(vec![TensorData::Uint8(vec![1, 2]), TensorData::Uint8(vec![3])]).expect("joins");
        assert_eq!(joined, TensorData::Uint8(vec![1, 2, 3]));
        assert!(concat(vec![TensorData::Uint8(vec![1]), TensorData::Fp32(vec![1.0])]).is_err());
    }

    fn grey_png(width: u32, height: u32) -> Vec<u8> {
        let mut png = Vec::new();
        let picture = ::image::RgbImage::from_pixel(width, height, ::image::Rgb([9, 9, 9]));
        picture.write_to(&mut std::io::Cursor::new(&mut png), ::image::ImageFormat::Png).expect("png");
        png
    }

    #[test]
    fn a_picture_then_its_crops_composite_into_one_mask() {
        // A detector's face maps with one face (P-Net's 12-pixel window, which the 4x4 model
        // input maps past the 8x4 picture: the crop is the whole picture, clipped); the
        // segmenter says "all foreground" for it.
        let pipeline = Pipeline::new(&stages(DETECT_THEN_SEGMENT), 1000).expect("loads");
        let png = grey_png(8, 4);
        let plan = pipeline.plan(None).expect("a plan");
        assert!(plan.probe(&png).expect("probes") >= 8 * 4 * 3);
        let converted = plan.convert(&png).expect("converts");
        assert_eq!(converted.calls.len(), 1);
        assert_eq!(converted.calls[0].name, Some("people"));
        assert_eq!(converted.calls[0].inputs[0].shape, [1, 4, 4, 3]);
        let prob = OutputTensor { name: "p5".into(), shape: vec![1, 2, 1, 1], data: TensorData::Fp32(vec![0.0, 1.0]) };
        let regress = OutputTensor { name: "b".into(), shape: vec![1, 4, 1, 1], data: TensorData::Fp32(vec![0.0; 4]) };
        let step = converted.finish.output(vec![vec![prob, regress]]).expect("the picture stage");
        let Step::Next(crops) = step else { panic!("crop calls next") };
        assert_eq!(crops.calls.len(), 1);
        assert_eq!(crops.calls[0].name, Some("masks"));
        assert_eq!(crops.calls[0].inputs[0].shape, [1, 2, 2, 3]);
        let mask = OutputTensor { name: "mask".into(), shape: vec![1, 2, 2], data: TensorData::Fp32(vec![1.0; 4]) };
        let Step::Store { output, stored } = crops.finish.output(vec![vec![mask]]).expect("the map stage") else { panic!("a stored mask") };
        assert_eq!(output["crops"]["masks"], json!({"count": 1, "cut": false}));
        assert_eq!(output["outputs"]["people.p5"]["faces"].as_array().map(Vec::len), Some(1), "{output}");
        assert_eq!(stored.len(), 1);
        assert_eq!(stored[0].output, "masks.mask");
        assert_eq!(stored[0].reference["shape"], json!([4, 8]));
    }

    #[test]
    fn a_failing_stage_names_itself() {
        let pipeline = Pipeline::new(&stages(DETECT_THEN_SEGMENT), 1000).expect("loads");
        let png = grey_png(8, 4);
        let converted = pipeline.plan(None).expect("plan").convert(&png).expect("converts");
        let wrong = OutputTensor { name: "other".into(), shape: vec![1], data: TensorData::Fp32(vec![0.0]) };
        let Err(failure) = converted.finish.output(vec![vec![wrong]]) else { panic!("fails") };
        assert!(failure.message.starts_with("stage people: "), "{}", failure.message);
    }
}
