//! Test images: synthetic pictures with face-like shapes (deterministic by seed), encoded as
//! PNG or JPEG, and broken ones for the dead-letter paths: a truncated PNG, a PNG whose header
//! declares a huge size, a JPEG carrying an EXIF orientation.

use std::io::Cursor;
use std::path::{Path, PathBuf};

use image::codecs::jpeg::JpegEncoder;
use image::codecs::png::PngEncoder;
use image::{ExtendedColorType, ImageEncoder, Rgb, RgbImage};

/// A deterministic linear congruential generator (no rand crate), values in [0, 1).
struct Lcg(u64);

impl Lcg {
    fn new(seed: u64) -> Self {
        Lcg(seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407))
    }

    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// A `width` × `height` picture: a smooth two-colour gradient with one to three cartoon faces
/// (a skin-toned oval, dark eyes, a mouth, hair above), the same for the same seed.
pub fn picture(width: u32, height: u32, seed: u64) -> RgbImage {
    let mut rng = Lcg::new(seed);
    let mut img = picture_background(width, height, &mut rng);
    let side = width.min(height) as f32;
    for _ in 0..1 + seed % 3 {
        let ry = side * (0.15 + 0.15 * rng.next());
        let rx = ry * 0.78;
        let cx = rx + rng.next() * (width as f32 - 2.0 * rx).max(0.0);
        let cy = ry + rng.next() * (height as f32 - 2.0 * ry).max(0.0);
        face(&mut img, (cx, cy), ry, &mut rng);
    }
    img
}

/// A `width` × `height` picture of a crowd: rows of cartoon faces about `face_height` pixels
/// tall on a gradient, the same for the same seed. Face detectors that look at small windows
/// (P-Net's is 12 × 12) find these where they miss the large faces of [`picture`].
pub fn crowd(width: u32, height: u32, face_height: f32, seed: u64) -> RgbImage {
    let mut rng = Lcg::new(seed);
    let mut img = picture_background(width, height, &mut rng);
    let step_y = face_height * 1.6;
    let step_x = face_height * 1.3;
    let mut row = 0;
    let mut cy = face_height * 0.8;
    while cy + face_height * 0.5 < height as f32 {
        let mut cx = face_height * (0.6 + 0.6 * (row % 2) as f32);
        while cx + face_height * 0.4 < width as f32 {
            face(&mut img, (cx, cy), face_height / 2.0, &mut rng);
            cx += step_x;
        }
        cy += step_y;
        row += 1;
    }
    img
}

fn picture_background(width: u32, height: u32, rng: &mut Lcg) -> RgbImage {
    let from = [rng.next() * 255.0, rng.next() * 255.0, rng.next() * 255.0];
    let to = [rng.next() * 255.0, rng.next() * 255.0, rng.next() * 255.0];
    RgbImage::from_fn(width, height, |x, y| {
        let t = (x as f32 / width.max(1) as f32 + y as f32 / height.max(1) as f32) / 2.0;
        let ripple = ((x as f32 * 0.05).sin() * (y as f32 * 0.07).cos()) * 12.0;
        Rgb(std::array::from_fn(|c| (from[c] + (to[c] - from[c]) * t + ripple).clamp(0.0, 255.0) as u8))
    })
}

/// One cartoon face centred on `center`, `ry` pixels from its centre to its chin.
fn face(img: &mut RgbImage, center: (f32, f32), ry: f32, rng: &mut Lcg) {
    let (cx, cy) = center;
    let rx = ry * 0.78;
    let skin = [200.0 + 40.0 * rng.next(), 150.0 + 30.0 * rng.next(), 110.0 + 30.0 * rng.next()];
    let hair = [40.0 * rng.next(), 25.0 * rng.next(), 15.0 * rng.next()];
    ellipse(img, (cx, cy - ry * 0.35), (rx * 1.05, ry * 0.75), hair);
    ellipse(img, (cx, cy), (rx, ry), skin);
    for side in [-1.0, 1.0] {
        ellipse(img, (cx + side * rx * 0.38, cy - ry * 0.15), (rx * 0.16, ry * 0.08), [255.0, 255.0, 255.0]);
        ellipse(img, (cx + side * rx * 0.38, cy - ry * 0.15), (rx * 0.08, ry * 0.07), [30.0, 20.0, 20.0]);
        ellipse(img, (cx + side * rx * 0.38, cy - ry * 0.32), (rx * 0.2, ry * 0.03), hair);
    }
    ellipse(img, (cx, cy + ry * 0.12), (rx * 0.08, ry * 0.15), [skin[0] - 30.0, skin[1] - 30.0, skin[2] - 30.0]);
    ellipse(img, (cx, cy + ry * 0.5), (rx * 0.35, ry * 0.07), [150.0, 40.0, 50.0]);
}

fn ellipse(img: &mut RgbImage, center: (f32, f32), radii: (f32, f32), colour: [f32; 3]) {
    let (cx, cy) = center;
    let (rx, ry) = (radii.0.max(0.5), radii.1.max(0.5));
    let x0 = (cx - rx).floor().max(0.0) as u32;
    let y0 = (cy - ry).floor().max(0.0) as u32;
    let x1 = ((cx + rx).ceil() as u32).min(img.width());
    let y1 = ((cy + ry).ceil() as u32).min(img.height());
    let pixel = Rgb(colour.map(|c| c.clamp(0.0, 255.0) as u8));
    for y in y0..y1 {
        for x in x0..x1 {
            let (dx, dy) = ((x as f32 + 0.5 - cx) / rx, (y as f32 + 0.5 - cy) / ry);
            if dx * dx + dy * dy <= 1.0 {
                img.put_pixel(x, y, pixel);
            }
        }
    }
}

/// `img` as a PNG file.
pub fn png(img: &RgbImage) -> Vec<u8> {
    let mut out = Vec::new();
    PngEncoder::new(&mut out)
        .write_image(img.as_raw(), img.width(), img.height(), ExtendedColorType::Rgb8)
        .expect("encoding a png in memory");
    out
}

/// `img` as a baseline JPEG file of `quality` (1–100).
pub fn jpeg(img: &RgbImage, quality: u8) -> Vec<u8> {
    let mut out = Vec::new();
    JpegEncoder::new_with_quality(&mut out, quality)
        .write_image(img.as_raw(), img.width(), img.height(), ExtendedColorType::Rgb8)
        .expect("encoding a jpeg in memory");
    out
}

/// `jpeg` with an EXIF APP1 segment right after its start-of-image marker, holding only the
/// orientation tag (0x0112) set to `orientation` (6: the stored picture must be turned 90°
/// clockwise to be viewed, so the viewed width is the stored height).
pub fn with_exif_orientation(jpeg: &[u8], orientation: u16) -> Vec<u8> {
    assert_eq!(&jpeg[..2], [0xFF, 0xD8], "not a jpeg");
    let mut tiff = Vec::new();
    tiff.extend_from_slice(b"MM\x00\x2A"); // big-endian TIFF header
    tiff.extend_from_slice(&8u32.to_be_bytes()); // IFD0 right after the header
    tiff.extend_from_slice(&1u16.to_be_bytes()); // one entry
    tiff.extend_from_slice(&0x0112u16.to_be_bytes()); // Orientation
    tiff.extend_from_slice(&3u16.to_be_bytes()); // SHORT
    tiff.extend_from_slice(&1u32.to_be_bytes()); // one value
    tiff.extend_from_slice(&orientation.to_be_bytes());
    tiff.extend_from_slice(&[0, 0]); // the value field is 4 bytes
    tiff.extend_from_slice(&0u32.to_be_bytes()); // no next IFD
    let mut segment = b"Exif\x00\x00".to_vec();
    segment.extend_from_slice(&tiff);
    let mut out = Vec::with_capacity(jpeg.len() + segment.len() + 4);
    out.extend_from_slice(&jpeg[..2]);
    out.extend_from_slice(&[0xFF, 0xE1]);
    out.extend_from_slice(&u16::try_from(segment.len() + 2).expect("a small segment").to_be_bytes());
    out.extend_from_slice(&segment);
    out.extend_from_slice(&jpeg[2..]);
    out
}

/// A PNG of a `width` × `height` picture cut off in the middle of its image data: the header
/// reads, the pixels do not.
pub fn truncated_png(width: u32, height: u32, seed: u64) -> Vec<u8> {
    let mut bytes = png(&picture(width, height, seed));
    bytes.truncate(bytes.len() * 6 / 10);
    bytes
}

/// A small PNG whose header declares `width` × `height` pixels (e.g. 50,000 × 50,000, 7.5 GB
/// of RGB once decoded) over a few bytes of image data: only a size check made on the header,
/// before decoding, turns it away cheaply.
pub fn png_declaring(width: u32, height: u32) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB, deflate, adaptive filter, no interlace
    chunk(&mut out, b"IHDR", &ihdr);
    // A complete zlib stream holding a single empty stored block.
    chunk(&mut out, b"IDAT", &[0x78, 0x01, 0x01, 0x00, 0x00, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x01]);
    chunk(&mut out, b"IEND", &[]);
    out
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&u32::try_from(data.len()).expect("a small chunk").to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// CRC-32 (IEEE 802.3, reflected, as PNG uses), bit by bit.
pub fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

/// Writes `bytes` to `dir/name` and returns the path.
pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    path
}

/// The size a decoder reports for `bytes` (before any EXIF orientation).
pub fn dimensions(bytes: &[u8]) -> anyhow::Result<(u32, u32)> {
    Ok(image::ImageReader::new(Cursor::new(bytes)).with_guessed_format()?.into_dimensions()?)
}

#[cfg(test)]
mod tests {
    use image::ImageDecoder;

    use super::*;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b"IEND"), 0xAE42_6082);
    }

    #[test]
    fn the_declared_size_is_read_from_the_header_and_the_pixels_are_absent() {
        let bytes = png_declaring(50_000, 50_000);
        assert_eq!(dimensions(&bytes).expect("header reads"), (50_000, 50_000));
        assert!(bytes.len() < 100);
        assert!(image::load_from_memory(&bytes).is_err());
    }

    #[test]
    fn a_truncated_png_has_a_header_but_does_not_decode() {
        let bytes = truncated_png(200, 150, 3);
        assert_eq!(dimensions(&bytes).expect("header reads"), (200, 150));
        assert!(image::load_from_memory(&bytes).is_err());
    }

    #[test]
    fn pictures_are_deterministic_and_encode_both_ways() {
        assert_eq!(picture(90, 60, 7), picture(90, 60, 7));
        assert_ne!(picture(90, 60, 7), picture(90, 60, 8));
        let img = picture(123, 45, 1);
        assert_eq!(image::load_from_memory(&png(&img)).expect("png decodes").to_rgb8(), img);
        let decoded = image::load_from_memory(&jpeg(&img, 90)).expect("jpeg decodes");
        assert_eq!((decoded.width(), decoded.height()), (123, 45));
    }

    #[test]
    fn the_exif_orientation_is_seen_by_a_decoder() {
        let bytes = with_exif_orientation(&jpeg(&picture(64, 40, 2), 90), 6);
        let mut decoder = image::codecs::jpeg::JpegDecoder::new(Cursor::new(&bytes)).expect("jpeg header");
        assert_eq!(decoder.dimensions(), (64, 40));
        assert_eq!(decoder.orientation().expect("orientation"), image::metadata::Orientation::Rotate90);
        let mut img = image::DynamicImage::from_decoder(decoder).expect("decodes");
        img.apply_orientation(image::metadata::Orientation::Rotate90);
        assert_eq!((img.width(), img.height()), (40, 64));
    }
}
