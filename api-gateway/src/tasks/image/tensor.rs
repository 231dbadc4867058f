//! `mode = "tensor"`: an image as any image model takes it, by configuration. The image is
//! decoded and oriented (the same limits and EXIF handling as the face modes), fitted to
//! `width × height`, and written in the model's layout, channel order and datatype; the
//! outputs go through the task's `[[outputs]]` rows.
//!
//! Fitting (`resize`):
//! - `stretch`: each axis scaled on its own;
//! - `letterbox`: scaled to fit, centred, the rest `fill`;
//! - `shorter_side_crop`: scaled so the shorter side is `shorter_side` (the longer one
//!   `floor(shorter_side · long / short)`), then the centre `width × height` cut out, its offset
//!   `(resized − crop) / 2` rounded half to even, as torchvision's `Resize(s)` + `CenterCrop`
//!   compute them (a crop larger than the image is padded with `fill`).
//!
//! Resampling is the image crate's triangle filter, widened by the downscale factor, which is
//! what PIL's antialiased bilinear resize computes up to rounding (so a torchvision pipeline's
//! pixels are matched to within a level or two, not bit for bit).
//!
//! Values: `UINT8` takes the pixels as they are; `FP32` and `FP16` take `(pixel · scale −
//! mean[c]) / std[c]` per channel (defaults: `scale` 1/255, `mean` 0, `std` 1).

use ::image::imageops::{self, FilterType};
use ::image::RgbImage;
use serde::{Deserialize, Serialize};
use serde_json::json;
use vramgate_shared::events::{ErrorKind, Stage};
use vramgate_shared::oip::{DataType, Tensor, TensorData, F16};

use super::convert::{decode_bytes, decode_rgb, probe, ImageHeader};
use super::{ImageOptions, Placement, ResizeMode};
use crate::failure::Failure;

/// The order of the colour channels in the model input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChannelOrder {
    Rgb,
    Bgr,
}

/// Where the channel dimension is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// `[1, 3, height, width]`.
    Nchw,
    /// `[1, height, width, 3]`.
    Nhwc,
}

/// Checks the `tensor` mode's keys (the caller prefixes `tasks.<name>.`).
pub fn validate(options: &ImageOptions) -> Result<(), String> {
    if options.input.is_empty() || options.input.len() > 128 {
        return Err("image.input must be 1 to 128 bytes".into());
    }
    if !matches!(options.datatype, DataType::Fp32 | DataType::Fp16 | DataType::Uint8) {
        return Err(format!("image.datatype must be FP32, FP16 or UINT8, got {}", options.datatype.as_str()));
    }
    let normalising = options.scale.is_some() || options.mean.is_some() || options.std.is_some();
    if options.datatype == DataType::Uint8 && normalising {
        return Err("image.scale, image.mean and image.std are for FP32 or FP16; UINT8 takes the pixels as they are".into());
    }
    if let Some(scale) = options.scale {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(format!("image.scale must be a positive number, got {scale}"));
        }
    }
    if options.mean.is_some_and(|m| m.iter().any(|v| !v.is_finite())) {
        return Err("image.mean must be three finite numbers".into());
    }
    if options.std.is_some_and(|s| s.iter().any(|v| !(v.is_finite() && *v > 0.0))) {
        return Err("image.std must be three positive numbers".into());
    }
    if let Some(side) = options.shorter_side {
        if !(1..=super::MAX_MODEL_SIDE).contains(&side) {
            return Err(format!("image.shorter_side must be 1 to {}, got {side}", super::MAX_MODEL_SIDE));
        }
    }
    if options.resize == ResizeMode::ShorterSideCrop && options.shorter_side.is_none() {
        return Err("image.resize = \"shorter_side_crop\" needs image.shorter_side (torchvision's Resize size)".into());
    }
    Ok(())
}

/// Bytes [`convert`] holds at its peak: the decode, then the decoded image beside its resized
/// copy, the fitted image and the tensor with its encoded request.
pub fn conversion_bytes(header: &ImageHeader, options: &ImageOptions) -> u64 {
    let (rw, rh) = resized_size(header.width, header.height, options);
    let resized = u64::from(rw) * u64::from(rh) * 3;
    let fitted = u64::from(options.width) * u64::from(options.height) * 3;
    let element = match options.datatype {
        DataType::Uint8 => 1,
        DataType::Fp16 => 2,
        _ => 4,
    };
    let decoded = header.pixels().saturating_mul(3);
    decode_bytes(header).max(decoded.saturating_add(resized)).saturating_add(fitted).saturating_add(2 * fitted * element)
}

/// The size the whole image is resampled to before it is cropped or padded.
fn resized_size(width: u32, height: u32, options: &ImageOptions) -> (u32, u32) {
    let (w, h) = (u64::from(width.max(1)), u64::from(height.max(1)));
    let (tw, th) = (u64::from(options.width), u64::from(options.height));
    let (rw, rh) = match options.resize {
        ResizeMode::Stretch => (tw, th),
        ResizeMode::Letterbox => {
            // The smaller scale, each side rounded and at least 1.
            if tw * h <= th * w {
                (tw, ((h * tw) as f64 / w as f64).round().max(1.0) as u64)
            } else {
                (((w * th) as f64 / h as f64).round().max(1.0) as u64, th)
            }
        }
        ResizeMode::ShorterSideCrop => {
            let s = u64::from(options.shorter_side.unwrap_or(options.width.min(options.height)));
            if w <= h {
                (s, (s * h / w).max(1))
            } else {
                ((s * w / h).max(1), s)
            }
        }
    };
    (rw.min(u64::from(super::MAX_MODEL_SIDE) * 4) as u32, rh.min(u64::from(super::MAX_MODEL_SIDE) * 4) as u32)
}

/// Python's `round` (half to even) of `x / 2` for an integer `x`, as torchvision's centre crop
/// computes its offsets; negative when the crop is larger than the image.
fn centre_offset(resized: u32, crop: u32) -> i64 {
    let diff = i64::from(resized) - i64::from(crop);
    let half = diff.div_euclid(2);
    if diff.rem_euclid(2) == 1 && half.rem_euclid(2) == 1 {
        half + 1
    } else {
        half
    }
}

/// Where the resized image's top-left pixel is read from for the model input's: model pixel
/// `(x, y)` is resized pixel `(x + left, y + top)`.
fn offsets(rw: u32, rh: u32, options: &ImageOptions) -> (i64, i64) {
    match options.resize {
        ResizeMode::ShorterSideCrop => (centre_offset(rw, options.width), centre_offset(rh, options.height)),
        // Stretch: none; letterbox: the image centred in the canvas (minus the canvas's offset).
        _ => (-((i64::from(options.width) - i64::from(rw)) / 2), -((i64::from(options.height) - i64::from(rh)) / 2)),
    }
}

/// How model-input coordinates map back to the (oriented) image's, for post-processors that
/// report positions (`face_boxes`): `image = (model − pad) / scale` per axis.
pub fn placement(width: u32, height: u32, options: &ImageOptions) -> Placement {
    let (rw, rh) = resized_size(width, height, options);
    let (left, top) = offsets(rw, rh, options);
    Placement {
        scale_x: rw as f32 / width.max(1) as f32,
        scale_y: rh as f32 / height.max(1) as f32,
        pad_x: -left as f32,
        pad_y: -top as f32,
        width,
        height,
    }
}

/// The image fitted to `width × height`: resampled, then cropped or padded around its centre.
fn fit(rgb: &RgbImage, options: &ImageOptions) -> RgbImage {
    let (rw, rh) = resized_size(rgb.width(), rgb.height(), options);
    let resized = if (rw, rh) == rgb.dimensions() { rgb.clone() } else { imageops::resize(rgb, rw, rh, FilterType::Triangle) };
    if (rw, rh) == (options.width, options.height) {
        return resized;
    }
    let (left, top) = offsets(rw, rh, options);
    let fill = ::image::Rgb([options.fill; 3]);
    RgbImage::from_fn(options.width, options.height, |x, y| {
        let (sx, sy) = (i64::from(x) + left, i64::from(y) + top);
        if sx >= 0 && sy >= 0 && sx < i64::from(rw) && sy < i64::from(rh) {
            *resized.get_pixel(sx as u32, sy as u32)
        } else {
            fill
        }
    })
}

/// The model input for one image, what the result says about it, and where the image sits in
/// the model input.
pub fn convert(bytes: &[u8], options: &ImageOptions) -> Result<(Tensor, serde_json::Value, Placement), Failure> {
    validate(options).map_err(|e| Failure::new(ErrorKind::Internal, Stage::Convert, format!("image options are invalid: {e}")))?;
    let (rgb, format) = decode_rgb(bytes, options.max_pixels)?;
    let (width, height) = rgb.dimensions();
    let (data, placement) = values(&rgb, options);
    drop(rgb);
    let input = json!({ "format": format, "width": width, "height": height });
    Ok((Tensor { name: options.input.clone(), shape: shape(options), data }, input, placement))
}

/// One decoded picture (or a crop of one) as the model input's values, without the batch
/// dimension's bookkeeping (`[3, h, w]` or `[h, w, 3]` worth), and where it sits in the model
/// input.
pub fn values(rgb: &RgbImage, options: &ImageOptions) -> (TensorData, Placement) {
    let (width, height) = rgb.dimensions();
    let fitted = fit(rgb, options);
    let (w, h) = (options.width as usize, options.height as usize);
    let order: [usize; 3] = match options.channel_order {
        ChannelOrder::Rgb => [0, 1, 2],
        ChannelOrder::Bgr => [2, 1, 0],
    };
    let raw = fitted.as_raw();
    // Element `k` of the tensor reads pixel `p`, channel `c` of the fitted image.
    let source = |k: usize| -> (usize, usize) {
        match options.layout {
            Layout::Nhwc => (k / 3, order[k % 3]),
            Layout::Nchw => (k % (w * h), order[k / (w * h)]),
        }
    };
    let n = w * h * 3;
    let scale = options.scale.unwrap_or(1.0 / 255.0);
    let mean = options.mean.unwrap_or([0.0; 3]);
    let std = options.std.unwrap_or([1.0; 3]);
    let value = |k: usize| -> f32 {
        let (p, c) = source(k);
        (f32::from(raw[p * 3 + c]) * scale - mean[c]) / std[c]
    };
    let data = match options.datatype {
        DataType::Uint8 => TensorData::Uint8((0..n).map(|k| {
            let (p, c) = source(k);
            raw[p * 3 + c]
        }).collect()),
        DataType::Fp16 => TensorData::Fp16((0..n).map(|k| F16::from_f64(f64::from(value(k))).unwrap_or_default()).collect()),
        _ => TensorData::Fp32((0..n).map(value).collect()),
    };
    (data, placement(width, height, options))
}

/// The model input's shape: `[1, 3, h, w]` or `[1, h, w, 3]`, without the leading 1 for a
/// model without a batch dimension.
pub fn shape(options: &ImageOptions) -> Vec<usize> {
    let (w, h) = (options.width as usize, options.height as usize);
    let mut shape = match options.layout {
        Layout::Nchw => vec![1, 3, h, w],
        Layout::Nhwc => vec![1, h, w, 3],
    };
    if !options.batch {
        shape.remove(0);
    }
    shape
}

/// The header check of [`convert`], with its peak bytes.
pub fn probe_bytes(bytes: &[u8], options: &ImageOptions) -> Result<u64, Failure> {
    Ok(conversion_bytes(&probe(bytes, options.max_pixels)?, options))
}

#[cfg(test)]
mod tests {
    use ::image::ImageFormat;

    use super::super::test_util::encode_rgb;
    use super::*;

    fn options(keys: serde_json::Value) -> ImageOptions {
        let mut base = serde_json::json!({"mode": "tensor"});
        base.as_object_mut().expect("object").extend(keys.as_object().expect("object").clone());
        let options: ImageOptions = serde_json::from_value(base).expect("parses");
        options.validate().expect("validates");
        options
    }

    #[test]
    fn centre_offsets_round_half_to_even_like_python() {
        // round(0.5) = 0, round(1.5) = 2, round(2.5) = 2, round(16) = 16.
        assert_eq!([centre_offset(225, 224), centre_offset(227, 224), centre_offset(229, 224)], [0, 2, 2]);
        assert_eq!(centre_offset(256, 224), 16);
        assert_eq!(centre_offset(200, 224), -12);
    }

    #[test]
    fn shorter_side_crop_sizes_like_torchvision() {
        let o = options(json!({"resize": "shorter_side_crop", "shorter_side": 256, "width": 224, "height": 224}));
        assert_eq!(resized_size(512, 300, &o), (436, 256)); // int(256 * 512 / 300) = 436
        assert_eq!(resized_size(300, 512, &o), (256, 436));
        // Cropped: model x = resized x − 106, so image x = (model x + 106) / scale.
        let p = placement(512, 300, &o);
        assert_eq!((p.pad_x, p.pad_y), (-106.0, -16.0));
    }

    #[test]
    fn layouts_orders_and_datatypes_place_each_pixel() {
        // A 2×1 image: red then blue; no resampling at the model's own size.
        let mut img = RgbImage::new(2, 1);
        img.put_pixel(0, 0, ::image::Rgb([255, 0, 0]));
        img.put_pixel(1, 0, ::image::Rgb([0, 0, 255]));
        let png = encode_rgb(&img, ImageFormat::Png, None);
        let base = json!({"width": 2, "height": 1, "resize": "stretch"});
        let with = |extra: serde_json::Value| {
            let mut keys = base.clone();
            keys.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
            convert(&png, &options(keys)).expect("converts").0
        };
        let nhwc = with(json!({"layout": "nhwc", "datatype": "UINT8"}));
        assert_eq!((nhwc.shape.clone(), nhwc.data), (vec![1, 1, 2, 3], TensorData::Uint8(vec![255, 0, 0, 0, 0, 255])));
        let nchw_bgr = with(json!({"layout": "nchw", "channel_order": "bgr", "datatype": "UINT8"}));
        assert_eq!((nchw_bgr.shape.clone(), nchw_bgr.data), (vec![1, 3, 1, 2], TensorData::Uint8(vec![0, 255, 0, 0, 255, 0])));
        let unbatched = with(json!({"layout": "nhwc", "datatype": "UINT8", "batch": false}));
        assert_eq!((unbatched.shape.clone(), unbatched.data), (vec![1, 2, 3], TensorData::Uint8(vec![255, 0, 0, 0, 0, 255])));
        assert_eq!(with(json!({"batch": false})).shape, [3, 1, 2]);
        let normalised = with(json!({"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}));
        assert_eq!(normalised.data, TensorData::Fp32(vec![1.0, -1.0, -1.0, -1.0, -1.0, 1.0]));
    }

    #[test]
    fn letterbox_fills_around_the_centred_image() {
        let img = RgbImage::from_pixel(4, 2, ::image::Rgb([10, 20, 30]));
        let png = encode_rgb(&img, ImageFormat::Png, None);
        let o = options(json!({"width": 4, "height": 4, "resize": "letterbox", "fill": 7, "datatype": "UINT8", "layout": "nhwc"}));
        let (tensor, input, placement) = convert(&png, &o).expect("converts");
        // Centred 4×2 in 4×4: one row of fill above; model y = image y + 1.
        assert_eq!((placement.scale_x, placement.scale_y, placement.pad_x, placement.pad_y), (1.0, 1.0, 0.0, 1.0));
        assert_eq!(input, json!({"format": "png", "width": 4, "height": 2}));
        let TensorData::Uint8(values) = tensor.data else { panic!("uint8") };
        let rows: Vec<u8> = values.chunks(12).map(|row| row[0]).collect();
        assert_eq!(rows, vec![7, 10, 10, 7]);
    }

    #[test]
    fn bad_tensor_options_are_named() {
        for (keys, want) in [
            (json!({"mode": "tensor", "datatype": "UINT8", "mean": [0.5, 0.5, 0.5]}), "UINT8 takes the pixels as they are"),
            (json!({"mode": "tensor", "datatype": "INT64"}), "image.datatype must be FP32, FP16 or UINT8"),
            (json!({"mode": "tensor", "std": [1.0, 0.0, 1.0]}), "image.std must be three positive numbers"),
            (json!({"mode": "tensor", "resize": "shorter_side_crop"}), "needs image.shorter_side"),
            (json!({"mode": "proposals", "resize": "shorter_side_crop", "shorter_side": 10}), "image.resize"),
            (json!({"mode": "faces", "batch": false}), "image.batch = false is for mode = \"tensor\""),
        ] {
            let o: ImageOptions = serde_json::from_value(keys).expect("parses");
            let err = o.validate().expect_err(want);
            assert!(err.contains(want), "{err} should contain {want}");
        }
    }
}
