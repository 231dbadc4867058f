//! Helpers shared by the image task's unit tests: encoding test images (with EXIF in each
//! format), deterministic noise, and checking a refusal's kind and stage.

use ::image::codecs::jpeg::JpegEncoder;
use ::image::codecs::png::PngEncoder;
use ::image::codecs::webp::WebPEncoder;
use ::image::{ExtendedColorType, ImageEncoder, ImageFormat, Rgb, RgbImage};
use vramgate_shared::events::{ErrorKind, Stage};

use crate::failure::Failure;

/// Encodes 8-bit RGB; `exif` (a bare TIFF structure) goes into PNG `eXIf` and WebP `EXIF`
/// through the encoders, and into a hand-written APP1 segment for JPEG.
pub(super) fn encode_rgb(image: &RgbImage, format: ImageFormat, exif: Option<Vec<u8>>) -> Vec<u8> {
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

/// Deterministic noise, so PNGs compress poorly and a cut lands inside the image data.
pub(super) fn noise(width: u32, height: u32) -> RgbImage {
    let mut state = 0x2545_F491_u32;
    RgbImage::from_fn(width, height, |_, _| {
        let mut next = || {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            (state >> 16) as u8
        };
        Rgb([next(), next(), next()])
    })
}

pub(super) fn check_failure(result: Result<impl std::fmt::Debug, Failure>, kind: ErrorKind, stage: Stage) -> Failure {
    let failure = result.expect_err("fails");
    assert_eq!((failure.kind, failure.stage), (kind, stage), "{}", failure.message);
    failure
}
