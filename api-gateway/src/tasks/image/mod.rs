//! The `image` task: PNG/JPEG/WebP bytes → oriented, resized, normalised RGB (CPU, on the
//! task's rayon pool) → the worker's MTCNN P-Net → face boxes in the input image's pixels.
//!
//! This module owns the CPU side of that task: reading the header (so an oversized image is
//! refused before a pixel is decoded), sizing the conversion for the memory budget, building the
//! model's tensor, and turning the model's maps back into boxes.
//!
//! Coordinates are 0-based pixel *edges* throughout: pixel `(x, y)` covers `[x, x + 1) ×
//! [y, y + 1)`, so a box `(0, 0, width, height)` is the whole image. That is the one convention in
//! which "scale by s" and "move by p" map boxes exactly, with no ±1 corrections.
//!
//! The work is split along those lines:
//! - `convert`: image bytes → the model's tensor: the header probe, the decode under limits
//!   (PNG, JPEG, WebP), the EXIF orientation and the fit to the model's input ([`probe`],
//!   [`conversion_bytes`], [`convert()`], [`Placement`], [`Prepared`]);
//! - `faces`: P-Net's output maps → face boxes in the input image's pixels, with non-maximum
//!   suppression ([`faces()`], [`output`]);
//! - this file: the task's options ([`ImageOptions`], [`ResizeMode`], [`image_options`]) and the
//!   glue that plugs the two into the task traits ([`ImageTask`]).

mod convert;
mod faces;
#[cfg(test)]
mod test_util;

pub use self::convert::{conversion_bytes, convert, probe, ImageHeader, Placement, Prepared};
pub use self::faces::{faces, output};

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vramgate_shared::events::{ErrorKind, Stage};
use vramgate_shared::oip::{Tensor, TensorData};

use super::{Converted, Converter, Finish, Plan};
use crate::failure::Failure;
use crate::call::client::OutputTensor;

/// The worker's input tensor: `[1, 3, H, W]` f32, RGB planes scaled as `(pixel - 127.5) / 128`.
pub const MODEL_INPUT: &str = "image";
/// The worker's output: `[1, h, w]`, the face probability of each cell.
pub const PROB_OUTPUT: &str = "face_prob";
/// The worker's output: `[1, 4, h, w]`, each cell's box regression `(dx1, dy1, dx2, dy2)`.
pub const BOX_OUTPUT: &str = "box_offsets";

/// The model input's bounds: below 12 pixels P-Net has no window at all; above 8192 its first
/// layer alone needs gigabytes of GPU memory per image, which is a config mistake, not a choice.
const MIN_MODEL_SIDE: u32 = 12;
const MAX_MODEL_SIDE: u32 = 8192;

/// How the image is fitted to the model's input size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResizeMode {
    /// Keep the aspect ratio, scale (up or down) to fit and centre; the rest is padded with the value that
    /// normalises to 0.0, so padding looks like neither black nor white to the model.
    Letterbox,
    /// Scale each axis on its own to fill the input; faces come out squashed.
    Stretch,
}

/// Options of the `image` converter (`[tasks.<name>.image]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImageOptions {
    /// Model input width in pixels.
    pub width: u32,
    /// Model input height in pixels.
    pub height: u32,
    pub resize: ResizeMode,
    /// Images whose header declares more pixels than this are dead-lettered as
    /// `input_too_large` before their pixels are decoded.
    pub max_pixels: u64,
    /// A cell is a face candidate when its probability reaches this.
    pub threshold: f32,
    /// Of two boxes overlapping by more than this intersection-over-union, the lower-scored one
    /// is dropped.
    pub nms_iou: f32,
    /// At most this many faces are reported, the highest-scored ones.
    pub max_faces: usize,
}

impl Default for ImageOptions {
    fn default() -> Self {
        ImageOptions {
            width: 320,
            height: 320,
            resize: ResizeMode::Letterbox,
            max_pixels: 40_000_000,
            threshold: 0.7,
            nms_iou: 0.5,
            max_faces: 100,
        }
    }
}

impl ImageOptions {
    /// Checks what the types cannot. Messages name the key relative to the task
    /// (`image.width`), for the config's validation to prefix with `tasks.<name>.`.
    pub fn validate(&self) -> Result<(), String> {
        for (key, side) in [("width", self.width), ("height", self.height)] {
            if !(MIN_MODEL_SIDE..=MAX_MODEL_SIDE).contains(&side) {
                return Err(format!("image.{key} must be between {MIN_MODEL_SIDE} and {MAX_MODEL_SIDE}, got {side}"));
            }
        }
        if self.max_pixels == 0 {
            return Err("image.max_pixels must be at least 1".into());
        }
        for (key, value) in [("threshold", self.threshold), ("nms_iou", self.nms_iou)] {
            if !(0.0..=1.0).contains(&value) {
                return Err(format!("image.{key} must be between 0 and 1, got {value}"));
            }
        }
        if self.max_faces == 0 {
            return Err("image.max_faces must be at least 1".into());
        }
        Ok(())
    }
}

/// The `image` converter of the task table.
pub struct ImageTask {
    options: ImageOptions,
}

impl ImageTask {
    pub fn new(options: ImageOptions) -> Self {
        ImageTask { options }
    }
}

/// Per-request overrides of the image task's detection parameters.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ImageRequestOptions {
    threshold: Option<f32>,
    nms_iou: Option<f32>,
    max_faces: Option<usize>,
}

pub fn image_options(config: &ImageOptions, options: Option<&serde_json::Value>) -> Result<ImageOptions, Failure> {
    let mut merged = config.clone();
    let Some(value) = options.filter(|v| !v.is_null()) else { return Ok(merged) };
    let parsed: ImageRequestOptions = serde_json::from_value(value.clone())
        .map_err(|e| Failure::new(ErrorKind::InvalidRequest, Stage::Parse, format!("invalid image options: {e}")))?;
    for (name, v) in [("threshold", parsed.threshold), ("nms_iou", parsed.nms_iou)] {
        if v.is_some_and(|v| !(0.0..=1.0).contains(&v)) {
            return Err(Failure::new(
                ErrorKind::InvalidRequest,
                Stage::Parse,
                format!("image option {name} must be between 0 and 1, got {}", v.unwrap_or_default()),
            ));
        }
    }
    merged.threshold = parsed.threshold.unwrap_or(merged.threshold);
    merged.nms_iou = parsed.nms_iou.unwrap_or(merged.nms_iou);
    merged.max_faces = parsed.max_faces.unwrap_or(merged.max_faces);
    Ok(merged)
}

impl Converter for ImageTask {
    fn plan(&self, options: Option<&serde_json::Value>) -> Result<Arc<dyn Plan>, Failure> {
        Ok(Arc::new(ImagePlan { options: image_options(&self.options, options)? }))
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
        Ok(Converted { tensor, outputs: &[PROB_OUTPUT, BOX_OUTPUT], finish: Box::new(finish) })
    }
}

struct ImageFinish {
    placement: Placement,
    format: &'static str,
    options: ImageOptions,
}

impl Finish for ImageFinish {
    fn output(self: Box<Self>, tensors: &[OutputTensor]) -> Result<serde_json::Value, Failure> {
        let [prob, boxes] = tensors else {
            return Err(Failure::new(
                ErrorKind::Internal,
                Stage::Postprocess,
                format!("the worker answered {} outputs; P-Net gives two", tensors.len()),
            ));
        };
        let faces = faces(&prob.data, &prob.shape, &boxes.data, &self.placement, &self.options)?;
        Ok(serde_json::to_value(output(faces, &self.placement, self.format)).expect("image outputs always serialise"))
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
