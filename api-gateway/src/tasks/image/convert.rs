//! Image bytes → the model's input tensor: the header probe (an oversized image is refused
//! before a pixel is decoded), the peak memory of a conversion, the decode under limits (PNG,
//! JPEG, WebP, and binary PPM: the frames the video decoder writes) with decoder panics caught, the EXIF orientation, and the fit (stretch or
//! letterbox), resize and normalisation into the CHW tensor. [`Placement`] records how the
//! model input was made, for the sibling `faces` module to map boxes back.
//!
//! Coordinates are 0-based pixel edges, as the [module doc](super) sets out.

use std::io::Cursor;
use std::panic::{self, AssertUnwindSafe};

use ::image::codecs::jpeg::JpegDecoder;
use ::image::codecs::png::PngDecoder;
use ::image::codecs::pnm::PnmDecoder;
use ::image::codecs::webp::WebPDecoder;
use ::image::imageops::FilterType;
use ::image::metadata::Orientation;
use ::image::{DynamicImage, ImageDecoder, ImageError, ImageFormat, Limits, RgbImage};

use vramgate_shared::events::{ErrorKind, Stage};

use super::{ImageOptions, ResizeMode};
use crate::failure::Failure;

/// PNG text, ICC and Exif chunks may be compressed; this bounds what a small file can make the
/// PNG decoder inflate (image data is not counted against it).
const PNG_METADATA_BYTES: u64 = 16 * 1024 * 1024;

/// Working memory of the decoders beyond their output buffer, per pixel. A progressive JPEG keeps
/// every DCT coefficient (i16, up to three full-resolution components) until its last scan; the
/// header does not say whether a JPEG is progressive, so every JPEG is counted as if it were.
/// The WebP decoder keeps a YUV frame (lossy) or an ARGB frame (lossless) beside its output.
const JPEG_WORKING_BYTES_PER_PIXEL: u64 = 6;
const WEBP_WORKING_BYTES_PER_PIXEL: u64 = 4;

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
    pub fn pixels(&self) -> u64 {
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
    let (decoded, decoder_working) = decoding(header);
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
    let orientation = orientation(&mut *decoder, format, bytes)?;
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

/// The whole image, decoded and turned as its EXIF orientation says, as 8-bit RGB (alpha
/// dropped, grey repeated, as PIL's `convert("RGB")` does): what MTCNN's cascade resamples its
/// pyramid and its crops from. The same limits, orientation and panic guard as [`convert`].
pub fn decode_rgb(bytes: &[u8], max_pixels: u64) -> Result<(RgbImage, &'static str), Failure> {
    let Opened { mut decoder, header } = open(bytes, max_pixels)?;
    let format = header.format;
    let orientation = orientation(&mut *decoder, format, bytes)?;
    let mut decoded = guarded(format, || DynamicImage::from_decoder(decoder).map_err(|e| image_failure(format, &e)))?;
    decoded.apply_orientation(orientation);
    Ok((decoded.into_rgb8(), format))
}

/// Bytes [`decode_rgb`] holds at its peak: the decoder's output and working memory, then that
/// output and its RGB copy (none when it is already 8-bit RGB, but the header does not promise
/// the orientation is a no-op, so one turned copy is counted).
pub fn decode_bytes(header: &ImageHeader) -> u64 {
    let (decoded, decoder_working) = decoding(header);
    let rgb = header.pixels().saturating_mul(3);
    decoded.saturating_add(decoder_working).max(decoded.saturating_add(rgb))
}

/// The decoder's output buffer, and its working memory beside it (a JPEG decoder's copy of the
/// input and its coefficients, a WebP decoder's frame).
fn decoding(header: &ImageHeader) -> (u64, u64) {
    let pixels = header.pixels();
    let decoded = pixels.saturating_mul(u64::from(header.bytes_per_pixel));
    let working = match header.format {
        "jpeg" => header.encoded_bytes.saturating_add(pixels.saturating_mul(JPEG_WORKING_BYTES_PER_PIXEL)),
        "webp" => pixels.saturating_mul(WEBP_WORKING_BYTES_PER_PIXEL),
        _ => 0,
    };
    (decoded, working)
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
        // Binary RGB only (`P6`): what the video decoder writes for each frame.
        Ok(ImageFormat::Pnm) if bytes.starts_with(b"P6") => "ppm",
        Ok(other) => {
            let name = format!("{other:?}").to_lowercase();
            return Err(Failure::new(
                ErrorKind::UnsupportedInput,
                Stage::Convert,
                format!("input is a {name} image; this task takes png, jpeg, webp or binary ppm"),
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
            "ppm" => Box::new(PnmDecoder::new(cursor).map_err(fail)?),
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

/// The EXIF orientation, read lazily by the decoders; metadata that cannot be read is no
/// orientation, not worth failing an image whose pixels are fine. A WebP's metadata is read only
/// when every chunk of its RIFF list ends within the input ([`riff_chunks_fit`]): the WebP
/// decoder allocates a metadata chunk at the size its header claims before reading it, so 786
/// bytes claiming a 3 GB EXIF chunk made it allocate 3 GB (found by the fuzz target `image`).
fn orientation(decoder: &mut (dyn ImageDecoder + '_), format: &str, bytes: &[u8]) -> Result<Orientation, Failure> {
    if format == "webp" && !riff_chunks_fit(bytes) {
        return Ok(Orientation::NoTransforms);
    }
    guarded(format, || Ok(decoder.orientation().unwrap_or(Orientation::NoTransforms)))
}

/// Whether every chunk of a RIFF file (`RIFF`, its size and form type, then chunks: a four-byte
/// name, a little-endian size, that many bytes and a pad byte to an even size) ends within
/// `bytes`. Fewer than 8 bytes after the last chunk are not a chunk.
fn riff_chunks_fit(bytes: &[u8]) -> bool {
    let mut at = 12;
    while let Some(&[_, _, _, _, a, b, c, d]) = bytes.get(at..at + 8) {
        let size = u32::from_le_bytes([a, b, c, d]) as usize;
        match (at + 8).checked_add(size) {
            Some(end) if end <= bytes.len() => at = end + (size & 1),
            _ => return false,
        }
    }
    true
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
            // `shorter_side_crop` is the tensor mode's; validation refuses it for proposals.
            ResizeMode::Stretch | ResizeMode::ShorterSideCrop => {
                Fit { width: options.width, height: options.height, left: 0, top: 0 }
            }
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

#[cfg(test)]
mod tests {
    use ::image::{Rgb, RgbImage};
    use proptest::prelude::*;

    use super::super::test_util::{check_failure, encode_rgb, noise};
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

    /// Caps this process's address space at what it maps now plus `headroom` bytes.
    fn cap_address_space(headroom: u64) {
        let status = std::fs::read_to_string("/proc/self/status").expect("procfs");
        let kib: u64 = status
            .lines()
            .find_map(|line| line.strip_prefix("VmSize:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmSize in /proc/self/status");
        let limit = (kib * 1024 + headroom) as libc::rlim_t;
        let rlimit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
        // SAFETY: setrlimit only reads the struct, which lives across the call.
        let rc = unsafe { libc::setrlimit(libc::RLIMIT_AS, &rlimit) };
        assert_eq!(rc, 0, "setrlimit(RLIMIT_AS): {}", std::io::Error::last_os_error());
    }

    /// A WebP whose EXIF chunk claims 3.75 GB more than the file holds converts (its pixels are
    /// fine, its orientation unread) without the decoder allocating the claim, as it did before
    /// `riff_chunks_fit` (the fuzz target `image` found 786 bytes allocating 3 GB). Checked in a
    /// child process whose address space is capped at 1 GiB over what it maps, where such an
    /// allocation aborts.
    #[test]
    fn a_webp_chunk_claiming_more_than_the_file_holds_is_not_allocated() {
        const CHILD: &str = "VRAMGATE_TEST_ADDRESS_SPACE_CAPPED";
        let mut bytes = encode_rgb(&noise(16, 12), ImageFormat::WebP, Some(tiff_orientation(6)));
        let exif = bytes.windows(4).position(|w| w == b"EXIF").expect("the encoder writes an EXIF chunk");
        bytes[exif + 4..exif + 8].copy_from_slice(&0xF000_0000u32.to_le_bytes());
        assert!(!riff_chunks_fit(&bytes));
        if std::env::var_os(CHILD).is_some() {
            cap_address_space(1 << 30);
            let prepared = convert(&bytes, &options(16, 12, ResizeMode::Stretch)).expect("the pixels are fine");
            assert_eq!((prepared.placement.width, prepared.placement.height), (16, 12), "no quarter turn read");
            decode_rgb(&bytes, 1000).expect("the pixels are fine");
            return;
        }
        let (_, path) = module_path!().split_once("::").expect("a module of the crate");
        let name = format!("{path}::a_webp_chunk_claiming_more_than_the_file_holds_is_not_allocated");
        let child = std::process::Command::new(std::env::current_exe().expect("the test binary"))
            .args([name.as_str(), "--exact", "--test-threads", "1"])
            .env(CHILD, "1")
            .output()
            .expect("the test binary runs");
        let stderr = String::from_utf8_lossy(&child.stderr);
        assert!(child.status.success(), "the capped child failed ({}): {stderr}", child.status);
        assert!(String::from_utf8_lossy(&child.stdout).contains("1 passed"), "the child ran the test");
    }

    #[test]
    fn honest_riff_chunks_fit_and_lying_ones_do_not() {
        let bytes = encode_rgb(&noise(16, 12), ImageFormat::WebP, Some(tiff_orientation(6)));
        assert!(riff_chunks_fit(&bytes));
        assert!(riff_chunks_fit(&[bytes.as_slice(), b"pad"].concat()), "fewer than 8 bytes after the last chunk");
        assert!(!riff_chunks_fit(&bytes[..bytes.len() - 1]), "the last chunk cut");
        let odd = b"RIFF\0\0\0\0WEBPABCD\x03\0\0\0xyz\0EFGH\x02\0\0\0ab";
        assert!(riff_chunks_fit(odd), "an odd chunk's pad byte is skipped");
        let mut huge = bytes.clone();
        huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(!riff_chunks_fit(&huge));
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
        assert_eq!(gif.message, "input is a gif image; this task takes png, jpeg, webp or binary ppm");
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

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

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
