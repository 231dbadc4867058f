//! The `image` task: PNG/JPEG/WebP bytes → oriented RGB (CPU, on the task's rayon pool) →
//! MTCNN's three networks on the worker, in turn → faces with their landmarks, in the input
//! image's pixels, as facenet-pytorch's `MTCNN.detect` finds them (`mode = "faces"`, the
//! default). `mode = "proposals"` runs P-Net alone, once, on the image fitted to a fixed size:
//! raw proposals, for load tests and benches. `mode = "tensor"` is any image model's input by
//! configuration (resize, layout, channel order, normalisation, datatype), its outputs through
//! the task's `[[outputs]]` rows (`tensor`).
//!
//! This module owns the CPU side of that task: reading the header (so an oversized image is
//! refused before a pixel is decoded), sizing the conversion for the memory budget, building the
//! models' tensors, and turning the models' answers into faces.
//!
//! The work is split along those lines:
//! - `convert`: image bytes → pixels: the header probe, the decode under limits (PNG, JPEG,
//!   WebP), the EXIF orientation ([`probe`], [`decode_rgb`]), and for proposals the fit to the
//!   model's input ([`conversion_bytes`], [`convert()`], [`Placement`], [`Prepared`]);
//! - `mtcnn`: the cascade's arithmetic between the networks (pyramid, area resampling, crops,
//!   regression, suppression), as the reference computes it, in the reference's coordinates;
//! - `cascade`: the cascade as a chain of worker calls (each stage's calls, and what the next
//!   stage needs of the image), on the task traits;
//! - `nms`: greedy non-maximum suppression by IoU or by the smaller box, which both use;
//! - `faces`: proposals: P-Net's maps at one scale → boxes in 0-based pixel edges, with
//!   non-maximum suppression ([`faces()`], [`output`]);
//! - this file: the task's options ([`ImageOptions`], [`ImageMode`], [`ResizeMode`],
//!   [`image_options`]) and the glue that plugs them into the task traits ([`ImageTask`]).

mod cascade;
mod convert;
mod faces;
mod mtcnn;
pub(crate) mod nms;
pub mod tensor;
#[cfg(test)]
mod test_util;

pub use self::convert::{conversion_bytes, convert, decode_bytes, decode_rgb, probe, ImageHeader, Placement, Prepared};
pub use self::faces::{faces, output};

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vramgate_shared::events::{ErrorKind, ImageRequestOptions, Stage};
use vramgate_shared::oip::{DataType, Tensor, TensorData};

use self::mtcnn::{ONET_SIDE, RNET_SIDE};
use self::tensor::{ChannelOrder, Layout};
use super::fit::ModelUse;
use super::{only_answer, Converted, Converter, Finish, Plan, Step};
use crate::failure::Failure;
use crate::call::client::OutputTensor;

/// The worker's input tensor: `[1, 3, H, W]` f32, RGB planes scaled as `(pixel - 127.5) / 128`.
pub const MODEL_INPUT: &str = "image";
/// The worker's output: `[1, 2, h, w]`, the softmax over (no face, face) of each cell; channel 1 is read.
pub const PROB_OUTPUT: &str = "face_prob";
/// The worker's output: `[1, 4, h, w]`, each cell's box regression `(dx1, dy1, dx2, dy2)`.
pub const BOX_OUTPUT: &str = "box_offsets";

/// The model input's bounds: below 12 pixels P-Net has no window at all; above 8192 its first
/// layer alone needs gigabytes of GPU memory per image, which is a config mistake, not a choice.
const MIN_MODEL_SIDE: u32 = 12;
const MAX_MODEL_SIDE: u32 = 8192;

/// What the task answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageMode {
    /// MTCNN's whole cascade (P-Net over a pyramid, then R-Net, then O-Net): the faces, with
    /// landmarks, that facenet-pytorch's `MTCNN.detect` finds.
    Faces,
    /// P-Net alone at one scale, on the image fitted to `width × height`: raw proposals, not
    /// faces. One worker call per image of a fixed size, which is what the load tests and
    /// benches want; no user should act on its boxes.
    Proposals,
    /// Any image model: the image as its input says (`input`, `width`, `height`, `resize`,
    /// `layout`, `channel_order`, `datatype`, `scale`, `mean`, `std`, `fill`), one call, the
    /// outputs through the task's `[[outputs]]` rows.
    Tensor,
}

/// How the image is fitted to the model's input size (`proposals` and `tensor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResizeMode {
    /// Keep the aspect ratio, scale (up or down) to fit and centre; the rest is padded with the value that
    /// normalises to 0.0, so padding looks like neither black nor white to the model.
    Letterbox,
    /// Scale each axis on its own to fill the input; faces come out squashed.
    Stretch,
    /// `tensor` only: scale so the shorter side is `shorter_side`, then cut out the centre
    /// (torchvision's `Resize(shorter_side)` + `CenterCrop((height, width))`).
    ShorterSideCrop,
}

/// Options of the `image` converter (`[tasks.<name>.image]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImageOptions {
    pub mode: ImageMode,
    /// Images whose header declares more pixels than this are dead-lettered as
    /// `input_too_large` before their pixels are decoded.
    pub max_pixels: u64,
    /// At most this many faces are reported, the highest-scored ones.
    pub max_faces: usize,
    /// `faces`: the smallest face looked for, in pixels (the pyramid's first level scales it
    /// to P-Net's 12-pixel window). At least 12, so no level is larger than the image.
    pub min_face_size: u32,
    /// `faces`: the face probability each network must see: P-Net (at least), R-Net and O-Net
    /// (more than).
    pub thresholds: [f32; 3],
    /// `faces`: each pyramid level is this much smaller than the last.
    pub factor: f64,
    /// `faces`: the models of the second and third stages (the first is the task's `model`).
    pub refine_model: String,
    pub output_model: String,
    /// `faces`: candidates one stage may pass to the next; an image that gives more is
    /// dead-lettered (`input_too_large`), naming the stage.
    pub max_candidates: usize,
    /// `faces`: rows of one R-Net or O-Net call; a stage's candidates go as several calls at
    /// once when there are more (facenet-pytorch runs them 512 at a time too).
    pub max_batch_rows: usize,
    /// `proposals` and `tensor`: the model input size in pixels.
    pub width: u32,
    pub height: u32,
    pub resize: ResizeMode,
    /// `proposals`: a cell is a candidate when its probability reaches this.
    pub threshold: f32,
    /// `proposals`: of two boxes overlapping by more than this intersection-over-union, the
    /// lower-scored one is dropped.
    pub nms_iou: f32,
    /// `tensor`: the model input's name.
    pub input: String,
    /// `tensor`, `resize = "shorter_side_crop"`: the shorter side's size before the crop.
    pub shorter_side: Option<u32>,
    /// `tensor`: the value of padded pixels (letterbox, or a crop larger than the image).
    pub fill: u8,
    pub channel_order: ChannelOrder,
    pub layout: Layout,
    /// `tensor`: whether the model input has a batch dimension: `false` for a model that
    /// takes none (the worker's `max_batch_size = 0`), sent `[3, h, w]` or `[h, w, 3]`.
    pub batch: bool,
    /// `tensor`: FP32, FP16 or UINT8.
    pub datatype: DataType,
    /// `tensor`, FP32/FP16: `(pixel · scale − mean[c]) / std[c]`; default 1/255, 0 and 1.
    pub scale: Option<f32>,
    pub mean: Option<[f32; 3]>,
    pub std: Option<[f32; 3]>,
}

impl Default for ImageOptions {
    fn default() -> Self {
        ImageOptions {
            mode: ImageMode::Faces,
            max_pixels: 40_000_000,
            max_faces: 100,
            min_face_size: 20,
            thresholds: [0.6, 0.7, 0.7],
            factor: 0.709,
            refine_model: "mtcnn_rnet".into(),
            output_model: "mtcnn_onet".into(),
            max_candidates: 5000,
            max_batch_rows: 512,
            width: 320,
            height: 320,
            resize: ResizeMode::Letterbox,
            threshold: 0.7,
            nms_iou: 0.5,
            input: MODEL_INPUT.into(),
            shorter_side: None,
            fill: 0,
            channel_order: ChannelOrder::Rgb,
            layout: Layout::Nchw,
            batch: true,
            datatype: DataType::Fp32,
            scale: None,
            mean: None,
            std: None,
        }
    }
}

/// The smallest `min_face_size`: below P-Net's window the first level would be larger than the
/// image, and its memory would grow with the square of the ratio.
pub const MIN_FACE_SIZE: u32 = 12;

impl ImageOptions {
    /// Checks what the types cannot. Messages name the key relative to the task
    /// (`image.width`), for the config's validation to prefix with `tasks.<name>.`.
    pub fn validate(&self) -> Result<(), String> {
        // P-Net needs its 12-pixel window; any other model takes what its input says.
        let min_side = if self.mode == ImageMode::Tensor { 1 } else { MIN_MODEL_SIDE };
        for (key, side) in [("width", self.width), ("height", self.height)] {
            if !(min_side..=MAX_MODEL_SIDE).contains(&side) {
                return Err(format!("image.{key} must be between {min_side} and {MAX_MODEL_SIDE}, got {side}"));
            }
        }
        if self.max_pixels == 0 {
            return Err("image.max_pixels must be at least 1".into());
        }
        for (key, value) in [
            ("threshold", self.threshold),
            ("nms_iou", self.nms_iou),
            ("thresholds[0]", self.thresholds[0]),
            ("thresholds[1]", self.thresholds[1]),
            ("thresholds[2]", self.thresholds[2]),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(format!("image.{key} must be between 0 and 1, got {value}"));
            }
        }
        if self.max_faces == 0 {
            return Err("image.max_faces must be at least 1".into());
        }
        check_face_size(self.min_face_size).map_err(|e| format!("image.{e}"))?;
        if !(self.factor > 0.1 && self.factor < 0.95) {
            return Err(format!("image.factor must be above 0.1 and below 0.95, got {}", self.factor));
        }
        for (key, model) in [("refine_model", &self.refine_model), ("output_model", &self.output_model)] {
            if model.is_empty() || model.len() > 128 {
                return Err(format!("image.{key} must name a model (1 to 128 bytes)"));
            }
        }
        for (key, n) in [("max_candidates", self.max_candidates), ("max_batch_rows", self.max_batch_rows)] {
            if !(1..=100_000).contains(&n) {
                return Err(format!("image.{key} must be between 1 and 100000, got {n}"));
            }
        }
        if !self.batch && self.mode != ImageMode::Tensor {
            return Err("image.batch = false is for mode = \"tensor\": MTCNN's networks take a batch".into());
        }
        match self.mode {
            ImageMode::Tensor => tensor::validate(self)?,
            _ if self.resize == ResizeMode::ShorterSideCrop => {
                return Err("image.resize = \"shorter_side_crop\" is for mode = \"tensor\"; proposals take letterbox or stretch".into())
            }
            _ => {}
        }
        Ok(())
    }
}

fn check_face_size(size: u32) -> Result<(), String> {
    if !(MIN_FACE_SIZE..=100_000).contains(&size) {
        return Err(format!("min_face_size must be between {MIN_FACE_SIZE} and 100000 pixels, got {size}"));
    }
    Ok(())
}

/// The `image` converter of the task table.
pub struct ImageTask {
    options: ImageOptions,
}

impl ImageTask {
    /// The faces and proposals modes; the tensor mode is `crate::tasks::image_model`'s.
    pub fn new(options: ImageOptions) -> Self {
        ImageTask { options }
    }
}

/// The image task's configuration with a request's `options` over it, as the published
/// contract types them ([`ImageRequestOptions`], `schemas/v1/request.json`).
pub fn image_options(config: &ImageOptions, options: Option<&serde_json::Value>) -> Result<ImageOptions, Failure> {
    let mut merged = config.clone();
    let Some(value) = options.filter(|v| !v.is_null()) else { return Ok(merged) };
    let invalid = |message: String| Failure::new(ErrorKind::InvalidRequest, Stage::Parse, message);
    // An object only: serde would also read a struct from an array of its fields in order.
    if !value.is_object() {
        return Err(invalid("invalid image options: not a JSON object".into()));
    }
    let parsed: ImageRequestOptions =
        serde_json::from_value(value.clone()).map_err(|e| invalid(format!("invalid image options: {e}")))?;
    let thresholds = parsed.thresholds.unwrap_or_default();
    for (name, v) in [
        ("threshold", parsed.threshold),
        ("nms_iou", parsed.nms_iou),
        ("thresholds[0]", parsed.thresholds.map(|_| thresholds[0])),
        ("thresholds[1]", parsed.thresholds.map(|_| thresholds[1])),
        ("thresholds[2]", parsed.thresholds.map(|_| thresholds[2])),
    ] {
        if v.is_some_and(|v| !(0.0..=1.0).contains(&v)) {
            return Err(invalid(format!("image option {name} must be between 0 and 1, got {}", v.unwrap_or_default())));
        }
    }
    if let Some(size) = parsed.min_face_size {
        check_face_size(size).map_err(|e| invalid(format!("image option {e}")))?;
    }
    if parsed.max_faces == Some(0) {
        return Err(invalid("image option max_faces must be at least 1".into()));
    }
    // Checked above as the doubles they were written as; the detector works in f32.
    merged.threshold = parsed.threshold.map_or(merged.threshold, |t| t as f32);
    merged.nms_iou = parsed.nms_iou.map_or(merged.nms_iou, |t| t as f32);
    merged.max_faces = parsed.max_faces.map_or(merged.max_faces, |n| n as usize);
    merged.min_face_size = parsed.min_face_size.unwrap_or(merged.min_face_size);
    merged.thresholds = parsed.thresholds.map_or(merged.thresholds, |t| t.map(|t| t as f32));
    Ok(merged)
}

impl Converter for ImageTask {
    fn plan(&self, options: Option<&serde_json::Value>) -> Result<Arc<dyn Plan>, Failure> {
        if self.options.mode == ImageMode::Tensor {
            return Err(Failure::new(
                ErrorKind::Internal,
                Stage::Parse,
                "image mode \"tensor\" is served by the image model task, not this one",
            ));
        }
        let options = image_options(&self.options, options)?;
        Ok(match options.mode {
            ImageMode::Faces => Arc::new(cascade::CascadePlan::new(options)),
            ImageMode::Proposals | ImageMode::Tensor => Arc::new(ImagePlan { options }),
        })
    }

    fn stage_models(&self) -> Vec<String> {
        match self.options.mode {
            ImageMode::Faces => vec![self.options.refine_model.clone(), self.options.output_model.clone()],
            ImageMode::Proposals | ImageMode::Tensor => Vec::new(),
        }
    }

    fn uses(&self) -> Vec<ModelUse> {
        use crate::tasks::fit::Dim::{Any, Fixed};
        let pnet = ModelUse::built_in("image", MODEL_INPUT, vec![Fixed(1), Fixed(3), Any, Any], &[PROB_OUTPUT, BOX_OUTPUT]);
        match self.options.mode {
            ImageMode::Faces => vec![
                pnet,
                ModelUse::built_in("image", MODEL_INPUT, vec![Any, Fixed(3), Fixed(RNET_SIDE), Fixed(RNET_SIDE)], &[BOX_OUTPUT, PROB_OUTPUT]),
                ModelUse::built_in(
                    "image",
                    MODEL_INPUT,
                    vec![Any, Fixed(3), Fixed(ONET_SIDE), Fixed(ONET_SIDE)],
                    &[BOX_OUTPUT, cascade::LANDMARKS_OUTPUT, PROB_OUTPUT],
                ),
            ],
            ImageMode::Proposals => vec![pnet],
            ImageMode::Tensor => Vec::new(),
        }
    }
}

struct ImagePlan {
    options: ImageOptions,
}

impl Plan for ImagePlan {
    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure> {
        Ok(conversion_bytes(&probe(bytes, self.options.max_pixels)?, &self.options))
    }

    fn convert(&self, bytes: &[u8]) -> Result<Converted, Failure> {
        let prepared = convert(bytes, &self.options)?;
        let tensor = Tensor {
            name: MODEL_INPUT.into(),
            shape: vec![1, 3, prepared.height as usize, prepared.width as usize],
            data: TensorData::Fp32(prepared.chw),
        };
        let finish =
            ImageFinish { placement: prepared.placement, format: prepared.format, options: self.options.clone() };
        Ok(Converted::one(tensor, &[PROB_OUTPUT, BOX_OUTPUT], Box::new(finish)))
    }
}

struct ImageFinish {
    placement: Placement,
    format: &'static str,
    options: ImageOptions,
}

impl Finish for ImageFinish {
    fn output(self: Box<Self>, answers: Vec<Vec<OutputTensor>>) -> Result<Step, Failure> {
        let tensors = only_answer(answers)?;
        let [prob, boxes] = &tensors[..] else {
            return Err(Failure::new(
                ErrorKind::Internal,
                Stage::Postprocess,
                format!("the worker answered {} outputs; P-Net gives two", tensors.len()),
            ));
        };
        let faces = faces(&prob.floats()?, &prob.shape, &boxes.floats()?, &self.placement, &self.options)?;
        let output = serde_json::to_value(output(faces, &self.placement, self.format)).expect("image outputs always serialise");
        Ok(Step::Done(output))
    }
}

#[cfg(test)]
mod tests {
    use ::image::ImageFormat;

    use super::test_util::{check_failure, encode_rgb, noise};
    use super::*;

    #[test]
    fn image_options_are_checked_and_merged() {
        let base = ImageOptions::default();
        let merged = image_options(&base, Some(&serde_json::json!({"threshold": 0.9}))).expect("valid");
        assert_eq!(merged.threshold, 0.9);
        assert_eq!(merged.nms_iou, base.nms_iou);
        for bad in [serde_json::json!({"threshold": 1.5}), serde_json::json!({"thresh": 0.5})] {
            assert_eq!(image_options(&base, Some(&bad)).expect_err("invalid").kind, ErrorKind::InvalidRequest);
        }
    }

    #[test]
    fn options_have_defaults_and_are_checked() {
        let parsed: ImageOptions = serde_json::from_str(r#"{"resize": "stretch", "width": 640}"#).expect("parses");
        assert_eq!(
            (parsed.width, parsed.height, parsed.resize, parsed.max_faces),
            (640, 320, ResizeMode::Stretch, 100)
        );
        assert!(serde_json::from_str::<ImageOptions>(r#"{"widht": 640}"#).is_err());
        ImageOptions::default().validate().expect("defaults validate");
        for (bad, key) in [
            (ImageOptions { width: 11, ..ImageOptions::default() }, "image.width"),
            (ImageOptions { height: 10_000, ..ImageOptions::default() }, "image.height"),
            (ImageOptions { threshold: f32::NAN, ..ImageOptions::default() }, "image.threshold"),
            (ImageOptions { nms_iou: 1.5, ..ImageOptions::default() }, "image.nms_iou"),
            (ImageOptions { max_faces: 0, ..ImageOptions::default() }, "image.max_faces"),
            (ImageOptions { max_pixels: 0, ..ImageOptions::default() }, "image.max_pixels"),
        ] {
            assert!(bad.validate().expect_err(key).starts_with(key));
            let bytes = encode_rgb(&noise(12, 12), ImageFormat::Png, None);
            check_failure(convert(&bytes, &bad), ErrorKind::Internal, Stage::Convert);
        }
    }
}
