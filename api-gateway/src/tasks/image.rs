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

use std::io::Cursor;
use std::panic::{self, AssertUnwindSafe};

use ::image::codecs::jpeg::JpegDecoder;
use ::image::codecs::png::PngDecoder;
use ::image::codecs::webp::WebPDecoder;
use ::image::imageops::FilterType;
use ::image::metadata::Orientation;
use ::image::{DynamicImage, ImageDecoder, ImageError, ImageFormat, Limits};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vramgate_shared::events::{ErrorKind, FaceBox, ImageOutput, Stage};
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

/// P-Net looks at 12 × 12 windows, one per output cell, two input pixels apart.
const CELL_SIZE: f32 = 12.0;
const CELL_STRIDE: f32 = 2.0;

/// The model input's bounds: below 12 pixels P-Net has no window at all; above 8192 its first
/// layer alone needs gigabytes of GPU memory per image, which is a config mistake, not a choice.
const MIN_MODEL_SIDE: u32 = 12;
const MAX_MODEL_SIDE: u32 = 8192;

/// PNG text, ICC and Exif chunks may be compressed; this bounds what a small file can make the
/// PNG decoder inflate (image data is not counted against it).
const PNG_METADATA_BYTES: u64 = 16 * 1024 * 1024;

/// Working memory of the decoders beyond their output buffer, per pixel. A progressive JPEG keeps
/// every DCT coefficient (i16, up to three full-resolution components) until its last scan; the
/// header does not say whether a JPEG is progressive, so every JPEG is counted as if it were.
/// The WebP decoder keeps a YUV frame (lossy) or an ARGB frame (lossless) beside its output.
const JPEG_WORKING_BYTES_PER_PIXEL: u64 = 6;
const WEBP_WORKING_BYTES_PER_PIXEL: u64 = 4;

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

/// What the header says, read without decoding pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHeader {
    /// Size as stored, before the EXIF orientation is applied.
    pub width: u32,
    pub height: u32,
    /// `png`, `jpeg` or `webp`.
    pub format: &'static str,
    /// Bytes per pixel of the decoder's output (3 for 8-bit RGB, up to 8 for 16-bit RGBA PNG).
    pub bytes_per_pixel: u8,
    /// Length of the encoded input; the JPEG decoder keeps its own copy while it works.
    pub encoded_bytes: u64,
}

impl ImageHeader {
    fn pixels(&self) -> u64 {
        u64::from(self.width) * u64::from(self.height)
    }
}

/// Reads only the header, and refuses an image with more than `max_pixels` pixels.
///
/// Bytes that start like an image format without a decoder here (GIF, BMP, TIFF, …, as the
/// image crate's magic-byte table knows them) are `unsupported_input`; anything else that is not
/// a readable PNG, JPEG or WebP header is `invalid_image`.
pub fn probe(bytes: &[u8], max_pixels: u64) -> Result<ImageHeader, Failure> {
    open(bytes, max_pixels).map(|opened| opened.header)
}

/// Bytes the conversion of this image holds at its peak, for the caller to reserve from its
/// memory budget before [`convert`] decodes anything.
///
/// The conversion goes through three phases, and this is the largest of them:
/// - decoding: the decoded buffer, plus the decoder's own working memory (a JPEG decoder's copy
///   of the input and its coefficients, a WebP decoder's frame);
/// - resizing: the decoded buffer, the image crate's f32 RGBA intermediate (stored width × target
///   height), and the resized image;
/// - finishing: the resized image, its oriented copy or RGB copy, and the CHW f32 tensor.
///
/// The target height in the stored frame depends on the EXIF orientation, which the header does
/// not carry, so the larger model side stands in for it.
pub fn conversion_bytes(header: &ImageHeader, options: &ImageOptions) -> u64 {
    let pixels = header.pixels();
    let decoded = pixels.saturating_mul(u64::from(header.bytes_per_pixel));
    let decoder_working = match header.format {
        "jpeg" => header.encoded_bytes.saturating_add(pixels.saturating_mul(JPEG_WORKING_BYTES_PER_PIXEL)),
        "webp" => pixels.saturating_mul(WEBP_WORKING_BYTES_PER_PIXEL),
        _ => 0,
    };
    let model_pixels = u64::from(options.width) * u64::from(options.height);
    let intermediate =
        u64::from(header.width).saturating_mul(u64::from(options.width.max(options.height))).saturating_mul(16);
    let resized = model_pixels.saturating_mul(u64::from(header.bytes_per_pixel.max(3)));
    let tensor = model_pixels.saturating_mul(3 * 4);

    let decoding = decoded.saturating_add(decoder_working);
    let resizing = decoded.saturating_add(intermediate).saturating_add(resized);
    let finishing = resized.saturating_mul(2).saturating_add(tensor);
    decoding.max(resizing).max(finishing)
}

/// How the model input was made from the (oriented) input image, to map model coordinates back:
/// `image = (model - pad) / scale`, per axis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placement {
    pub scale_x: f32,
    pub scale_y: f32,
    pub pad_x: f32,
    pub pad_y: f32,
    /// Size of the input image after its EXIF orientation.
    pub width: u32,
    pub height: u32,
}

/// The model's input for one image.
#[derive(Debug)]
pub struct Prepared {
    /// `3 · height · width` values: the R, G and B planes, row-major, `(pixel - 127.5) / 128`.
    pub chw: Vec<f32>,
    /// Size of the tensor (the configured model input size).
    pub width: u32,
    pub height: u32,
    pub placement: Placement,
    /// `png`, `jpeg` or `webp`.
    pub format: &'static str,
}

/// Decodes, orients, resizes and normalises. CPU-bound: runs on the image pool, never on a
/// tokio thread.
///
/// The header is checked against `options.max_pixels` first, so an over-limit image is never
/// decoded. The EXIF orientation is applied for all three formats (JPEG APP1, PNG `eXIf`, WebP
/// `EXIF`); metadata that cannot be read counts as "no orientation" rather than failing an image
/// whose pixels are fine. Alpha is dropped, as PIL's `convert("RGB")` does in facenet-pytorch.
///
/// The image is resized with a triangle filter, whose support the image crate widens by the
/// downscale factor: every source pixel under an output pixel is averaged, which is close to the
/// area interpolation MTCNN was used with (OpenCV's `INTER_AREA`; `F.interpolate(mode="area")`
/// in facenet-pytorch). Catmull-Rom would sharpen and ring for no gain at 12-pixel windows, at
/// twice the taps. Resizing happens before orienting (in the stored frame, to the swapped size
/// for a quarter turn), so the orientation copies a model-sized image, not a full-sized one.
///
/// Never panics on any input: a decoder panic is caught and reported as `invalid_image`, since a
/// panic on the image pool would take the process down with it.
pub fn convert(bytes: &[u8], options: &ImageOptions) -> Result<Prepared, Failure> {
    options.validate().map_err(|e| {
        Failure::new(
            ErrorKind::Internal,
            Stage::Convert,
            format!("image options passed validation but are invalid: {e}"),
        )
    })?;
    let Opened { mut decoder, header } = open(bytes, options.max_pixels)?;
    let format = header.format;
    // Decoders read Exif lazily; a failure here is not worth failing the image for.
    let orientation = guarded(format, || Ok(decoder.orientation().unwrap_or(Orientation::NoTransforms)))?;
    let quarter_turn = matches!(
        orientation,
        Orientation::Rotate90 | Orientation::Rotate270 | Orientation::Rotate90FlipH | Orientation::Rotate270FlipH
    );
    let (oriented_width, oriented_height) =
        if quarter_turn { (header.height, header.width) } else { (header.width, header.height) };
    let fit = Fit::new(oriented_width, oriented_height, options);
    let (stored_width, stored_height) = if quarter_turn { (fit.height, fit.width) } else { (fit.width, fit.height) };

    let mut resized = guarded(format, || {
        let decoded = DynamicImage::from_decoder(decoder).map_err(|e| image_failure(format, &e))?;
        Ok(decoded.resize_exact(stored_width, stored_height, FilterType::Triangle))
    })?;
    resized.apply_orientation(orientation);
    let rgb = resized.into_rgb8();

    Ok(Prepared {
        chw: fit.tensor(rgb.as_raw(), options),
        width: options.width,
        height: options.height,
        placement: fit.placement(oriented_width, oriented_height),
        format,
    })
}

/// Turns P-Net's maps into faces in input-image pixels, highest score first.
///
/// Cell `(i, j)` (row, column) stands for the 12 × 12 window from `(2j, 2i)` to
/// `(2j + 12, 2i + 12)` in model-input pixel edges. That is facenet-pytorch's
/// `generateBoundingBox` window, `stride·cell + 1` to `stride·cell + cellsize` in 1-based
/// inclusive pixels, said in edges. The window is moved by the cell's regression,
/// `x1 += dx1·12, y1 += dy1·12, x2 += dx2·12, y2 += dy2·12`: 12 is the window's width in edges
/// (facenet-pytorch's stage 1 uses `x2 - x1` of its inclusive coordinates, 11, which
/// understates it by a pixel).
///
/// Each box is then mapped back through the placement, clipped to the image and rounded (0.1
/// pixel, score to 1e-4); boxes left empty, such as those wholly in the letterbox padding, are
/// dropped *before* non-maximum suppression, so a box that is never reported cannot suppress one
/// that would be. Suppression by IoU is invariant under the per-axis scale and shift of the
/// mapping, so
/// apart from the clipping, suppressing in image pixels is the same as in model pixels.
///
/// `prob_shape` is `[1, h, w]` and `box_offsets` holds `[1, 4, h, w]` row-major; anything else
/// is a worker/gateway mismatch and is reported as `internal`, never a panic.
pub fn faces(
    prob: &[f32],
    prob_shape: &[usize],
    box_offsets: &[f32],
    placement: &Placement,
    options: &ImageOptions,
) -> Result<Vec<FaceBox>, Failure> {
    let cols = map_columns(prob, prob_shape, box_offsets)?;
    let cells = prob.len();
    let offset = |channel: usize, cell: usize| box_offsets.get(channel * cells + cell).copied().unwrap_or(f32::NAN);

    let mut candidates: Vec<FaceBox> = prob
        .iter()
        .enumerate()
        .filter(|&(_, &p)| p >= options.threshold)
        .filter_map(|(cell, &p)| {
            let (row, col) = (cell / cols, cell % cols);
            let x1 = CELL_STRIDE * col as f32;
            let y1 = CELL_STRIDE * row as f32;
            let model = FaceBox {
                x1: x1 + offset(0, cell) * CELL_SIZE,
                y1: y1 + offset(1, cell) * CELL_SIZE,
                x2: x1 + CELL_SIZE + offset(2, cell) * CELL_SIZE,
                y2: y1 + CELL_SIZE + offset(3, cell) * CELL_SIZE,
                score: round_to(p, 1e4),
            };
            to_image(&model, placement)
        })
        .collect();
    // Stable, so equal scores keep the map's row-major order and results are reproducible.
    candidates.sort_by(|a, b| b.score.total_cmp(&a.score));
    Ok(suppress(candidates, options.nms_iou, options.max_faces))
}

/// The task's output record: the faces, and the oriented image's size and format.
pub fn output(faces: Vec<FaceBox>, prepared_placement: &Placement, format: &str) -> ImageOutput {
    ImageOutput {
        faces,
        width: prepared_placement.width,
        height: prepared_placement.height,
        format: format.to_string(),
    }
}

/// A decoder that has read the header, and what the header said.
struct Opened<'a> {
    decoder: Box<dyn ImageDecoder + 'a>,
    header: ImageHeader,
}

fn open(bytes: &[u8], max_pixels: u64) -> Result<Opened<'_>, Failure> {
    let format = match ::image::guess_format(bytes) {
        Ok(ImageFormat::Png) => "png",
        Ok(ImageFormat::Jpeg) => "jpeg",
        Ok(ImageFormat::WebP) => "webp",
        Ok(other) => {
            let name = format!("{other:?}").to_lowercase();
            return Err(Failure::new(
                ErrorKind::UnsupportedInput,
                Stage::Convert,
                format!("input is a {name} image; this task takes png, jpeg or webp"),
            ));
        }
        Err(_) => {
            let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
            return Err(Failure::new(
                ErrorKind::InvalidImage,
                Stage::Convert,
                format!("input is not a png, jpeg or webp image (it starts with [{}])", head.join(" ")),
            ));
        }
    };
    let decoder = guarded(format, || {
        let cursor = Cursor::new(bytes);
        let fail = |e: ImageError| image_failure(format, &e);
        let decoder: Box<dyn ImageDecoder + '_> = match format {
            "png" => Box::new(PngDecoder::with_limits(cursor, png_limits()).map_err(fail)?),
            "jpeg" => Box::new(JpegDecoder::new(cursor).map_err(fail)?),
            _ => Box::new(WebPDecoder::new(cursor).map_err(fail)?),
        };
        Ok(decoder)
    })?;
    let (width, height) = decoder.dimensions();
    let header = ImageHeader {
        width,
        height,
        format,
        bytes_per_pixel: decoder.color_type().bytes_per_pixel(),
        encoded_bytes: bytes.len() as u64,
    };
    if width == 0 || height == 0 {
        return Err(Failure::new(
            ErrorKind::InvalidImage,
            Stage::Convert,
            format!("{format} image has no pixels: it is {width} × {height}"),
        ));
    }
    if header.pixels() > max_pixels {
        return Err(Failure::new(
            ErrorKind::InputTooLarge,
            Stage::Convert,
            format!("image is {width} × {height} = {} pixels, more than the limit of {max_pixels}", header.pixels()),
        ));
    }
    Ok(Opened { decoder, header })
}

fn png_limits() -> Limits {
    let mut limits = Limits::no_limits();
    limits.max_alloc = Some(PNG_METADATA_BYTES);
    limits
}

fn image_failure(format: &str, error: &ImageError) -> Failure {
    let kind = match error {
        ImageError::Limits(_) => ErrorKind::InputTooLarge,
        ImageError::Unsupported(_) => ErrorKind::UnsupportedInput,
        _ => ErrorKind::InvalidImage,
    };
    Failure::new(kind, Stage::Convert, format!("input is not a usable {format} image: {error}"))
}

/// Runs decoder code, turning a panic into an error: the decoders are fuzzed but third-party,
/// and a panic on a rayon pool thread aborts the whole gateway.
fn guarded<T>(format: &str, f: impl FnOnce() -> Result<T, Failure>) -> Result<T, Failure> {
    panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(Failure::new(
            ErrorKind::InvalidImage,
            Stage::Convert,
            format!("the {format} decoder panicked on this input"),
        ))
    })
}

/// Where the resized image goes in the model input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fit {
    /// Size of the resized image, at most the model input's.
    width: u32,
    height: u32,
    /// Its top-left corner in the model input.
    left: u32,
    top: u32,
}

impl Fit {
    /// `image_width` and `image_height` are non-zero (the header check refuses empty images).
    fn new(image_width: u32, image_height: u32, options: &ImageOptions) -> Self {
        match options.resize {
            ResizeMode::Stretch => Fit { width: options.width, height: options.height, left: 0, top: 0 },
            ResizeMode::Letterbox => {
                let scale = (f64::from(options.width) / f64::from(image_width))
                    .min(f64::from(options.height) / f64::from(image_height));
                let side = |image: u32, model: u32| ((f64::from(image) * scale).round() as u32).clamp(1, model);
                let width = side(image_width, options.width);
                let height = side(image_height, options.height);
                Fit { width, height, left: (options.width - width) / 2, top: (options.height - height) / 2 }
            }
        }
    }

    /// Scales from the rounded resized size, not the ideal one, so that mapping back is exact
    /// for the pixels the model actually saw.
    fn placement(&self, image_width: u32, image_height: u32) -> Placement {
        Placement {
            scale_x: self.width as f32 / image_width as f32,
            scale_y: self.height as f32 / image_height as f32,
            pad_x: self.left as f32,
            pad_y: self.top as f32,
            width: image_width,
            height: image_height,
        }
    }

    /// The CHW tensor: padding is 0.0 (pixel 127.5, which no u8 can say), the image is `rgb`,
    /// `self.width × self.height` packed RGB8, placed at `(left, top)`.
    fn tensor(&self, rgb: &[u8], options: &ImageOptions) -> Vec<f32> {
        let (model_width, plane) = (options.width as usize, options.width as usize * options.height as usize);
        let (width, left, top) = (self.width as usize, self.left as usize, self.top as usize);
        // (p - 127.5) / 128, as facenet-pytorch writes it: (p - 127.5) * 0.0078125.
        let normalised: [f32; 256] = std::array::from_fn(|p| (p as f32 - 127.5) / 128.0);
        debug_assert_eq!(rgb.len(), 3 * width * self.height as usize, "resized to the fit's size");
        let mut chw = vec![0.0; 3 * plane];
        for (y, row) in rgb.chunks_exact(3 * width).enumerate() {
            let start = (top + y) * model_width + left;
            for (c, channel) in chw.chunks_exact_mut(plane).enumerate() {
                let out = &mut channel[start..start + width];
                for (value, pixel) in out.iter_mut().zip(row.chunks_exact(3)) {
                    *value = normalised[usize::from(pixel[c])];
                }
            }
        }
        chw
    }
}

/// Columns of the maps, or why the maps do not fit together.
fn map_columns(prob: &[f32], prob_shape: &[usize], box_offsets: &[f32]) -> Result<usize, Failure> {
    let expected = match *prob_shape {
        [1, rows, cols] => rows.checked_mul(cols).and_then(|cells| Some((cols, cells, cells.checked_mul(4)?))),
        _ => None,
    };
    match expected {
        Some((cols, cells, offsets)) if prob.len() == cells && box_offsets.len() == offsets => Ok(cols),
        _ => Err(Failure::new(
            ErrorKind::Internal,
            Stage::Postprocess,
            format!(
                "model maps do not fit together: {PROB_OUTPUT} has shape {prob_shape:?} and {} values, \
                 {BOX_OUTPUT} has {} values; expected shape [1, h, w] with h·w values and 4·h·w offsets",
                prob.len(),
                box_offsets.len()
            ),
        )),
    }
}

/// Maps a box from model-input pixels to image pixels, clips and rounds it; `None` when nothing
/// of it is left (or the regression produced NaN).
fn to_image(model: &FaceBox, placement: &Placement) -> Option<FaceBox> {
    let (width, height) = (placement.width as f32, placement.height as f32);
    let x = |v: f32| round_to(((v - placement.pad_x) / placement.scale_x).clamp(0.0, width), 10.0);
    let y = |v: f32| round_to(((v - placement.pad_y) / placement.scale_y).clamp(0.0, height), 10.0);
    let image = FaceBox { x1: x(model.x1), y1: y(model.y1), x2: x(model.x2), y2: y(model.y2), score: model.score };
    (image.x2 > image.x1 && image.y2 > image.y1).then_some(image)
}

/// Greedy non-maximum suppression over boxes sorted by score, descending. Each box is compared
/// only with those already kept, and it stops at `max_faces`, so a map full of candidates costs
/// `candidates × max_faces`, not `candidates²`.
fn suppress(sorted: Vec<FaceBox>, max_iou: f32, max_faces: usize) -> Vec<FaceBox> {
    let mut kept: Vec<FaceBox> = Vec::with_capacity(max_faces.min(sorted.len()));
    for candidate in sorted {
        if kept.len() >= max_faces {
            break;
        }
        if kept.iter().all(|k| iou(k, &candidate) <= max_iou) {
            kept.push(candidate);
        }
    }
    kept
}

fn iou(a: &FaceBox, b: &FaceBox) -> f32 {
    let width = (a.x2.min(b.x2) - a.x1.max(b.x1)).max(0.0);
    let height = (a.y2.min(b.y2) - a.y1.max(b.y1)).max(0.0);
    let intersection = width * height;
    let area = |f: &FaceBox| (f.x2 - f.x1) * (f.y2 - f.y1);
    intersection / (area(a) + area(b) - intersection)
}

fn round_to(value: f32, per_unit: f32) -> f32 {
    (value * per_unit).round() / per_unit
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
    use ::image::codecs::jpeg::JpegEncoder;
    use ::image::codecs::png::PngEncoder;
    use ::image::codecs::webp::WebPEncoder;
    use ::image::{ExtendedColorType, ImageEncoder, Rgb, RgbImage};
    use proptest::prelude::*;

    use super::*;

    fn options(width: u32, height: u32, resize: ResizeMode) -> ImageOptions {
        ImageOptions { width, height, resize, ..ImageOptions::default() }
    }

    fn norm(pixel: u8) -> f32 {
        (f32::from(pixel) - 127.5) / 128.0
    }

    /// The tensor value of channel `c` at model pixel `(x, y)`.
    fn at(prepared: &Prepared, c: usize, x: u32, y: u32) -> f32 {
        let (width, height) = (prepared.width as usize, prepared.height as usize);
        prepared.chw[c * width * height + y as usize * width + x as usize]
    }

    fn encode(image: &DynamicImage, format: ImageFormat) -> Vec<u8> {
        let mut out = Vec::new();
        image.write_to(&mut Cursor::new(&mut out), format).expect("encodes");
        out
    }

    /// Encodes 8-bit RGB; `exif` (a bare TIFF structure) goes into PNG `eXIf` and WebP `EXIF`
    /// through the encoders, and into a hand-written APP1 segment for JPEG.
    fn encode_rgb(image: &RgbImage, format: ImageFormat, exif: Option<Vec<u8>>) -> Vec<u8> {
        let (width, height) = image.dimensions();
        let mut out = Vec::new();
        match format {
            ImageFormat::Png => {
                let mut encoder = PngEncoder::new(&mut out);
                if let Some(exif) = exif {
                    encoder.set_exif_metadata(exif).expect("png takes exif");
                }
                encoder.write_image(image.as_raw(), width, height, ExtendedColorType::Rgb8).expect("encodes png");
            }
            ImageFormat::WebP => {
                let mut encoder = WebPEncoder::new_lossless(&mut out);
                if let Some(exif) = exif {
                    encoder.set_exif_metadata(exif).expect("webp takes exif");
                }
                encoder.write_image(image.as_raw(), width, height, ExtendedColorType::Rgb8).expect("encodes webp");
            }
            ImageFormat::Jpeg => {
                JpegEncoder::new_with_quality(&mut out, 100)
                    .write_image(image.as_raw(), width, height, ExtendedColorType::Rgb8)
                    .expect("encodes jpeg");
                if let Some(exif) = exif {
                    out = with_app1(&out, &exif);
                }
            }
            other => panic!("no encoder for {other:?} in these tests"),
        }
        out
    }

    /// Inserts an APP1 Exif segment right after the JPEG's SOI marker, where cameras put it.
    fn with_app1(jpeg: &[u8], tiff: &[u8]) -> Vec<u8> {
        assert_eq!(jpeg[..2], [0xFF, 0xD8], "starts with SOI");
        let length = u16::try_from(2 + 6 + tiff.len()).expect("segment fits");
        let mut out = vec![0xFF, 0xD8, 0xFF, 0xE1];
        out.extend(length.to_be_bytes());
        out.extend(b"Exif\0\0");
        out.extend(tiff);
        out.extend(&jpeg[2..]);
        out
    }

    /// A big-endian TIFF structure whose only IFD holds the orientation tag.
    fn tiff_orientation(value: u16) -> Vec<u8> {
        let mut tiff = b"MM\0\x2a".to_vec();
        tiff.extend(8u32.to_be_bytes()); // the IFD follows the header
        tiff.extend(1u16.to_be_bytes()); // one entry:
        tiff.extend(0x0112u16.to_be_bytes()); // Orientation,
        tiff.extend(3u16.to_be_bytes()); // SHORT,
        tiff.extend(1u32.to_be_bytes()); // one value,
        tiff.extend(value.to_be_bytes()); // left-justified in the 4-byte field
        tiff.extend([0, 0]);
        tiff.extend(0u32.to_be_bytes()); // no next IFD
        tiff
    }

    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &byte in bytes {
            crc ^= u32::from(byte);
            for _ in 0..8 {
                crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
            }
        }
        !crc
    }

    fn png_chunk(kind: &[u8; 4], data: &[u8]) -> Vec<u8> {
        let mut chunk = u32::try_from(data.len()).expect("small chunk").to_be_bytes().to_vec();
        chunk.extend(kind);
        chunk.extend(data);
        chunk.extend(crc32(&chunk[4..]).to_be_bytes());
        chunk
    }

    /// Deterministic noise, so PNGs compress poorly and a cut lands inside the image data.
    fn noise(width: u32, height: u32) -> RgbImage {
        let mut state = 0x2545_F491_u32;
        RgbImage::from_fn(width, height, |_, _| {
            let mut next = || {
                state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                (state >> 16) as u8
            };
            Rgb([next(), next(), next()])
        })
    }

    fn check_failure(result: Result<impl std::fmt::Debug, Failure>, kind: ErrorKind, stage: Stage) -> Failure {
        let failure = result.expect_err("fails");
        assert_eq!((failure.kind, failure.stage), (kind, stage), "{}", failure.message);
        failure
    }

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn round_trip_keeps_pixel_values() {
        let image = RgbImage::from_fn(16, 12, |x, y| Rgb([(x * 16) as u8, (y * 20) as u8, 255 - (x * 16) as u8]));
        // JPEG is lossy (and subsamples chroma): compare within a few levels.
        for (format, name, tolerance) in [
            (ImageFormat::Png, "png", 0.0),
            (ImageFormat::WebP, "webp", 0.0),
            (ImageFormat::Jpeg, "jpeg", 12.0 / 128.0),
        ] {
            let bytes = encode_rgb(&image, format, None);
            let header = probe(&bytes, 1000).expect("probes");
            assert_eq!((header.width, header.height, header.format), (16, 12, name));
            let prepared = convert(&bytes, &options(16, 12, ResizeMode::Stretch)).expect("converts");
            assert_eq!((prepared.width, prepared.height, prepared.format), (16, 12, name));
            assert_eq!(prepared.chw.len(), 3 * 16 * 12);
            let identity = Placement { scale_x: 1.0, scale_y: 1.0, pad_x: 0.0, pad_y: 0.0, width: 16, height: 12 };
            assert_eq!(prepared.placement, identity);
            for (x, y) in [(0, 0), (15, 0), (7, 5), (0, 11), (15, 11)] {
                for c in 0..3 {
                    let expected = norm(image.get_pixel(x, y)[c]);
                    let got = at(&prepared, c, x, y);
                    assert!((got - expected).abs() <= tolerance, "{name} ({x}, {y}) channel {c}: {got} vs {expected}");
                }
            }
        }
        // The normalisation itself, exactly.
        let bytes = encode_rgb(&RgbImage::from_pixel(12, 12, Rgb([0, 128, 255])), ImageFormat::Png, None);
        let prepared = convert(&bytes, &options(12, 12, ResizeMode::Stretch)).expect("converts");
        assert_eq!([0, 1, 2].map(|c| at(&prepared, c, 5, 5)), [-0.996_093_75, 0.003_906_25, 0.996_093_75]);
    }

    /// Converts a uniform `width × height` image into a 32 × 32 input and checks every value:
    /// `content` (left, top, width, height) holds the colour, the rest is 0.0.
    fn check_fit(width: u32, height: u32, resize: ResizeMode, content: (u32, u32, u32, u32), placement: Placement) {
        let colour = Rgb([200, 100, 50]);
        let bytes = encode_rgb(&RgbImage::from_pixel(width, height, colour), ImageFormat::Png, None);
        let prepared = convert(&bytes, &options(32, 32, resize)).expect("converts");
        assert_eq!(prepared.placement, placement, "{width} × {height} {resize:?}");
        let (left, top, content_width, content_height) = content;
        for y in 0..32 {
            for x in 0..32 {
                let inside = (left..left + content_width).contains(&x) && (top..top + content_height).contains(&y);
                for c in 0..3 {
                    let expected = if inside { norm(colour[c]) } else { 0.0 };
                    assert_eq!(at(&prepared, c, x, y), expected, "{width} × {height} {resize:?} at ({x}, {y})");
                }
            }
        }
    }

    #[test]
    fn letterbox_centres_the_image_and_pads_with_zero() {
        // 64 × 30 → 32 × 15: 8 rows of padding above, 9 below.
        let wide = Placement { scale_x: 0.5, scale_y: 0.5, pad_x: 0.0, pad_y: 8.0, width: 64, height: 30 };
        check_fit(64, 30, ResizeMode::Letterbox, (0, 8, 32, 15), wide);
        let tall = Placement { scale_x: 0.5, scale_y: 0.5, pad_x: 8.0, pad_y: 0.0, width: 30, height: 64 };
        check_fit(30, 64, ResizeMode::Letterbox, (8, 0, 15, 32), tall);
        // Smaller images are scaled up to fit.
        let small = Placement { scale_x: 2.0, scale_y: 2.0, pad_x: 0.0, pad_y: 6.0, width: 16, height: 10 };
        check_fit(16, 10, ResizeMode::Letterbox, (0, 6, 32, 20), small);
    }

    #[test]
    fn stretch_fills_the_whole_tensor() {
        let placement = Placement { scale_x: 0.5, scale_y: 32.0 / 30.0, pad_x: 0.0, pad_y: 0.0, width: 64, height: 30 };
        check_fit(64, 30, ResizeMode::Stretch, (0, 0, 32, 32), placement);
    }

    #[test]
    fn every_colour_type_becomes_rgb() {
        let cases: [(DynamicImage, [u8; 3]); 4] = [
            (DynamicImage::ImageLuma8(::image::GrayImage::from_pixel(24, 12, ::image::Luma([100]))), [100; 3]),
            (
                DynamicImage::ImageLumaA8(::image::GrayAlphaImage::from_pixel(24, 12, ::image::LumaA([100, 0]))),
                [100; 3],
            ),
            (
                DynamicImage::ImageRgba8(::image::RgbaImage::from_pixel(24, 12, ::image::Rgba([10, 20, 30, 0]))),
                [10, 20, 30],
            ),
            (
                DynamicImage::ImageRgb16(::image::ImageBuffer::from_pixel(24, 12, Rgb([0x8080_u16, 0, 0xFFFF]))),
                [128, 0, 255],
            ),
        ];
        for (image, rgb) in cases {
            let bytes = encode(&image, ImageFormat::Png);
            let header = probe(&bytes, 1000).expect("probes");
            assert_eq!(header.bytes_per_pixel, image.color().bytes_per_pixel());
            let prepared = convert(&bytes, &options(12, 12, ResizeMode::Letterbox)).expect("converts");
            // 24 × 12 → 12 × 6 at rows 3..9.
            assert_eq!([0, 1, 2].map(|c| at(&prepared, c, 6, 5)), rgb.map(norm), "{:?}", image.color());
            assert_eq!(at(&prepared, 0, 6, 1), 0.0);
        }
    }

    #[test]
    fn exif_orientation_is_applied_in_every_format() {
        // 32 × 16, black with a white 8 × 8 block in the top-left corner.
        let image = RgbImage::from_fn(32, 16, |x, y| if x < 8 && y < 8 { Rgb([255; 3]) } else { Rgb([0; 3]) });
        // (EXIF orientation, oriented size, the corner the block ends up in).
        let cases = [
            (None, (32, 16), "top-left"),
            (Some(1), (32, 16), "top-left"),
            (Some(6), (16, 32), "top-right"),    // rotate 90° clockwise
            (Some(8), (16, 32), "bottom-left"),  // rotate 90° anticlockwise
            (Some(3), (32, 16), "bottom-right"), // rotate 180°
        ];
        for format in [ImageFormat::Jpeg, ImageFormat::Png, ImageFormat::WebP] {
            for (orientation, (width, height), corner) in cases {
                let bytes = encode_rgb(&image, format, orientation.map(tiff_orientation));
                let prepared = convert(&bytes, &options(width, height, ResizeMode::Stretch)).expect("converts");
                let case = format!("{format:?} orientation {orientation:?}");
                assert_eq!((prepared.placement.width, prepared.placement.height), (width, height), "{case}");
                let corners = [
                    ("top-left", 3, 3),
                    ("top-right", width - 4, 3),
                    ("bottom-left", 3, height - 4),
                    ("bottom-right", width - 4, height - 4),
                ];
                for (name, x, y) in corners {
                    let expected = if name == corner { 1.0 } else { -1.0 };
                    let got = at(&prepared, 0, x, y);
                    assert!((got - expected).abs() < 0.1, "{case}: {name} corner is {got}");
                }
            }
        }
    }

    #[test]
    fn probe_refuses_huge_images_from_the_header_alone() {
        // A valid IHDR declaring 50000 × 50000 RGB8, then image data that is not even deflate:
        // decoding would fail as invalid_image (after allocating 7.5 GB), so only the header
        // check can say input_too_large.
        let mut ihdr = Vec::new();
        ihdr.extend(50_000u32.to_be_bytes());
        ihdr.extend(50_000u32.to_be_bytes());
        ihdr.extend([8, 2, 0, 0, 0]);
        let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
        png.extend(png_chunk(b"IHDR", &ihdr));
        png.extend(png_chunk(b"IDAT", b"not deflate"));
        png.extend(png_chunk(b"IEND", b""));

        let header = probe(&png, u64::MAX).expect("the header is valid");
        assert_eq!((header.width, header.height, header.format, header.bytes_per_pixel), (50_000, 50_000, "png", 3));
        let failure = check_failure(probe(&png, 40_000_000), ErrorKind::InputTooLarge, Stage::Convert);
        assert_eq!(failure.message, "image is 50000 × 50000 = 2500000000 pixels, more than the limit of 40000000");
        check_failure(convert(&png, &ImageOptions::default()), ErrorKind::InputTooLarge, Stage::Convert);
    }

    #[test]
    fn truncated_png_is_invalid_image() {
        let bytes = encode_rgb(&noise(64, 64), ImageFormat::Png, None);
        let truncated = &bytes[..bytes.len() / 2];
        probe(truncated, 1_000_000).expect("the header is intact");
        check_failure(convert(truncated, &ImageOptions::default()), ErrorKind::InvalidImage, Stage::Convert);
    }

    #[test]
    fn inputs_that_are_not_images_are_refused() {
        let random: Vec<u8> = noise(16, 16).into_raw();
        let cases: [(&[u8], ErrorKind); 6] = [
            (b"", ErrorKind::InvalidImage),
            (b"definitely not an image", ErrorKind::InvalidImage),
            (&random, ErrorKind::InvalidImage),
            (&[0xFF, 0xD8, 0xFF, 0x00, 0x13, 0x37], ErrorKind::InvalidImage),
            (b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", ErrorKind::UnsupportedInput),
            (b"BM\x3a\x00\x00\x00\x00\x00\x00\x00\x36\x00", ErrorKind::UnsupportedInput),
        ];
        for (bytes, kind) in cases {
            check_failure(probe(bytes, 1_000_000), kind, Stage::Convert);
            check_failure(convert(bytes, &ImageOptions::default()), kind, Stage::Convert);
        }
        let gif = probe(b"GIF89a\x01\x00", 1).expect_err("gif");
        assert_eq!(gif.message, "input is a gif image; this task takes png, jpeg or webp");
    }

    #[test]
    fn conversion_bytes_counts_the_largest_phase() {
        let png =
            ImageHeader { width: 4000, height: 3000, format: "png", bytes_per_pixel: 3, encoded_bytes: 20_000_000 };
        // Resizing: decoded 36 MB + f32 intermediate 4000 × 320 × 16 + resized 320 × 320 × 3.
        assert_eq!(conversion_bytes(&png, &ImageOptions::default()), 36_000_000 + 20_480_000 + 307_200);
        // Decoding a JPEG: decoded + the decoder's copy of the input + coefficients.
        let jpeg = ImageHeader { format: "jpeg", encoded_bytes: 2_000_000, ..png };
        assert_eq!(conversion_bytes(&jpeg, &ImageOptions::default()), 36_000_000 + 2_000_000 + 72_000_000);
        // A tiny image: the tensor dominates.
        let tiny = ImageHeader { width: 1, height: 1, ..png };
        assert!(conversion_bytes(&tiny, &ImageOptions::default()) >= 320 * 320 * 12);
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

    /// P-Net maps with every cell at probability 0 and offsets 0, to be filled in.
    struct Maps {
        rows: usize,
        cols: usize,
        prob: Vec<f32>,
        offsets: Vec<f32>,
    }

    impl Maps {
        fn new(rows: usize, cols: usize) -> Self {
            Maps { rows, cols, prob: vec![0.0; rows * cols], offsets: vec![0.0; 4 * rows * cols] }
        }

        fn cell(mut self, row: usize, col: usize, prob: f32, offsets: [f32; 4]) -> Self {
            let cell = row * self.cols + col;
            self.prob[cell] = prob;
            for (channel, offset) in offsets.into_iter().enumerate() {
                self.offsets[channel * self.rows * self.cols + cell] = offset;
            }
            self
        }

        fn faces(&self, placement: &Placement, options: &ImageOptions) -> Vec<FaceBox> {
            faces(&self.prob, &[1, self.rows, self.cols], &self.offsets, placement, options).expect("maps fit")
        }
    }

    fn face(x1: f32, y1: f32, x2: f32, y2: f32, score: f32) -> FaceBox {
        FaceBox { x1, y1, x2, y2, score }
    }

    fn identity(width: u32, height: u32) -> Placement {
        Placement { scale_x: 1.0, scale_y: 1.0, pad_x: 0.0, pad_y: 0.0, width, height }
    }

    #[test]
    fn overlapping_boxes_are_suppressed_and_the_threshold_filters() {
        let maps = Maps::new(40, 40)
            .cell(10, 10, 0.9, [0.0; 4])
            .cell(10, 11, 0.8, [0.0; 4]) // 2 px to the right: IoU 120 / 168 = 0.71
            .cell(10, 30, 0.75, [0.0; 4])
            .cell(30, 20, 0.6, [0.0; 4]);
        let placement = identity(100, 100);
        let best = face(20.0, 20.0, 32.0, 32.0, 0.9);
        let separate = face(60.0, 20.0, 72.0, 32.0, 0.75);
        let low = face(40.0, 60.0, 52.0, 72.0, 0.6);
        let check = |options: ImageOptions, expected: &[FaceBox]| {
            assert_eq!(maps.faces(&placement, &options), expected, "{options:?}");
        };
        check(ImageOptions::default(), &[best, separate]);
        check(ImageOptions { threshold: 0.85, ..ImageOptions::default() }, &[best]);
        check(ImageOptions { threshold: 0.5, ..ImageOptions::default() }, &[best, separate, low]);
        check(ImageOptions { threshold: 0.5, max_faces: 2, ..ImageOptions::default() }, &[best, separate]);
        let second = face(22.0, 20.0, 34.0, 32.0, 0.8);
        check(ImageOptions { nms_iou: 0.8, ..ImageOptions::default() }, &[best, second, separate]);
    }

    #[test]
    fn boxes_map_back_through_a_letterbox() {
        // A 128 × 64 image letterboxed into 64 × 64: scale 0.5, 16 rows of padding on top.
        let placement = Placement { scale_x: 0.5, scale_y: 0.5, pad_x: 0.0, pad_y: 16.0, width: 128, height: 64 };
        let maps = Maps::new(27, 27)
            // Window (10, 20)–(22, 32), moved to (13, 17)–(28, 38): image (26, 2)–(56, 44).
            .cell(10, 5, 0.9, [0.25, -0.25, 0.5, 0.5])
            // Window (40, 44)–(52, 56): image (80, 56)–(104, 80), clipped at the bottom edge.
            .cell(22, 20, 0.8, [0.0; 4]);
        let expected = [face(26.0, 2.0, 56.0, 44.0, 0.9), face(80.0, 56.0, 104.0, 64.0, 0.8)];
        assert_eq!(maps.faces(&placement, &ImageOptions::default()), expected);
    }

    #[test]
    fn boxes_in_the_padding_are_dropped_before_they_can_suppress() {
        let placement = Placement { scale_x: 0.5, scale_y: 0.5, pad_x: 0.0, pad_y: 16.0, width: 128, height: 64 };
        let maps = Maps::new(27, 27)
            .cell(0, 5, 0.99, [0.0; 4]) // rows 0–12: all padding
            .cell(2, 5, 0.95, [0.0; 4]) // rows 4–16: all padding, IoU 0.71 with the next
            .cell(3, 5, 0.9, [0.0; 4]); // rows 6–18: two rows of image
        assert_eq!(maps.faces(&placement, &ImageOptions::default()), [face(20.0, 0.0, 44.0, 4.0, 0.9)]);
    }

    #[test]
    fn nan_is_never_a_face() {
        let maps = Maps::new(4, 4).cell(0, 0, f32::NAN, [0.0; 4]).cell(2, 2, 0.9, [f32::NAN, 0.0, 0.0, 0.0]);
        assert_eq!(maps.faces(&identity(20, 20), &ImageOptions::default()), []);
    }

    #[test]
    fn maps_that_do_not_fit_are_an_internal_error() {
        let cases: [(&[usize], usize, usize); 6] = [
            (&[1, 2, 3], 6, 23),
            (&[1, 2, 3], 5, 24),
            (&[2, 3], 6, 24),
            (&[2, 2, 3], 12, 48),
            (&[1, usize::MAX, 2], 0, 0),
            (&[], 0, 0),
        ];
        for (shape, values, offsets) in cases {
            let result =
                faces(&vec![0.9; values], shape, &vec![0.0; offsets], &identity(10, 10), &ImageOptions::default());
            let failure = check_failure(result, ErrorKind::Internal, Stage::Postprocess);
            assert!(failure.message.contains(&format!("shape {shape:?} and {values} values")), "{}", failure.message);
        }
        let empty = faces(&[], &[1, 0, 5], &[], &identity(10, 10), &ImageOptions::default());
        assert_eq!(empty.expect("an empty map fits"), []);
    }

    fn placements() -> impl Strategy<Value = Placement> {
        (0.1f32..4.0, 0.1f32..4.0, 0.0f32..20.0, 0.0f32..20.0, 1u32..200, 1u32..200).prop_map(
            |(scale_x, scale_y, pad_x, pad_y, width, height)| Placement {
                scale_x,
                scale_y,
                pad_x,
                pad_y,
                width,
                height,
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn faces_are_sorted_inside_the_image_and_do_not_overlap(
            (rows, cols, prob, offsets) in (1usize..12, 1usize..12).prop_flat_map(|(rows, cols)| (
                Just(rows),
                Just(cols),
                prop::collection::vec(0.0f32..=1.0, rows * cols),
                prop::collection::vec(-1.0f32..1.0, 4 * rows * cols),
            )),
            placement in placements(),
            threshold in 0.0f32..=1.0,
            nms_iou in 0.1f32..0.9,
            max_faces in 1usize..10,
        ) {
            let options = ImageOptions { threshold, nms_iou, max_faces, ..ImageOptions::default() };
            let found = faces(&prob, &[1, rows, cols], &offsets, &placement, &options).expect("maps fit");
            prop_assert!(found.len() <= max_faces);
            for pair in found.windows(2) {
                prop_assert!(pair[0].score >= pair[1].score);
            }
            for (k, f) in found.iter().enumerate() {
                prop_assert!(f.score >= threshold - 1e-4);
                prop_assert!(0.0 <= f.x1 && f.x1 < f.x2 && f.x2 <= placement.width as f32, "{f:?}");
                prop_assert!(0.0 <= f.y1 && f.y1 < f.y2 && f.y2 <= placement.height as f32, "{f:?}");
                for other in &found[..k] {
                    prop_assert!(iou(other, f) <= nms_iou, "{other:?} and {f:?}");
                }
            }
        }

        #[test]
        fn convert_never_panics_on_damaged_images(
            format in prop::sample::select(vec![ImageFormat::Png, ImageFormat::Jpeg, ImageFormat::WebP]),
            damage in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
            keep in any::<prop::sample::Index>(),
            orientation in 0u16..10,
        ) {
            let mut bytes = encode_rgb(&noise(16, 12), format, Some(tiff_orientation(orientation)));
            for (index, value) in damage {
                let i = index.index(bytes.len());
                bytes[i] = value;
            }
            bytes.truncate(keep.index(bytes.len() + 1));
            // Small limits keep a header damaged into claiming a huge image from being decoded.
            let options = ImageOptions { width: 16, height: 16, max_pixels: 100_000, ..ImageOptions::default() };
            if let Ok(prepared) = convert(&bytes, &options) {
                prop_assert_eq!(prepared.chw.len(), 3 * 16 * 16);
            }
        }
    }
}
