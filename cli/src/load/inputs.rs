//! The inputs a load run sends: the files of a folder, or files generated with a size mix
//! (WAV clips of a range of lengths, JPEG images of a range of sides), written where the
//! gateway can read them (under its `input.file_root`).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context};
use image::codecs::jpeg::JpegEncoder;
use image::{ExtendedColorType, ImageEncoder};

use vramgate_shared::wav::{wav_bytes, SampleFormat};

/// Most input files one task's pool may hold (found or generated).
pub const MAX_POOL_FILES: usize = 10_000;
/// Most bytes one input file of a folder may have (the gateway's default `max_input_bytes`).
pub const MAX_FILE_BYTES: u64 = 64 << 20;
/// Bounds of the generated clip lengths, in seconds.
pub const VOICE_SECONDS_BOUNDS: (f64, f64) = (0.1, 600.0);
/// Bounds of the generated image sides, in pixels.
pub const IMAGE_SIDE_BOUNDS: (f64, f64) = (16.0, 4096.0);

/// What a task's converter reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputKind {
    Wav,
    Image,
}

impl InputKind {
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        match s {
            "wav" => Ok(InputKind::Wav),
            "image" => Ok(InputKind::Image),
            other => bail!("unknown input kind {other:?}: use wav or image"),
        }
    }

    fn extensions(self) -> &'static [&'static str] {
        match self {
            InputKind::Wav => &["wav"],
            InputKind::Image => &["png", "jpg", "jpeg", "webp"],
        }
    }
}

/// An inclusive range, `A-B` on the command line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Range {
    pub low: f64,
    pub high: f64,
}

impl Range {
    /// Parses `A-B` (or a single `A`) and checks it lies within `bounds`.
    pub fn parse(s: &str, bounds: (f64, f64), what: &str) -> anyhow::Result<Self> {
        let (low, high) = s.split_once('-').unwrap_or((s, s));
        let number = |v: &str| v.trim().parse::<f64>().with_context(|| format!("{what} {s:?}: {v:?} is not a number"));
        let range = Range { low: number(low)?, high: number(high)? };
        ensure!(
            range.low <= range.high && range.low >= bounds.0 && range.high <= bounds.1,
            "{what} {s:?} must be A-B with {} ≤ A ≤ B ≤ {}",
            bounds.0,
            bounds.1
        );
        Ok(range)
    }

    /// The `i`-th of `n` values spread geometrically over the range (small sizes are common,
    /// large ones rare but present).
    pub fn spread(&self, i: usize, n: usize) -> f64 {
        if n <= 1 {
            return self.low;
        }
        self.low * (self.high / self.low).powf(i as f64 / (n - 1) as f64)
    }
}

/// The input files of a folder (not recursive) whose extension suits `kind`, sorted.
pub fn from_folder(folder: &Path, kind: InputKind) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(folder).with_context(|| format!("reading folder {}", folder.display()))? {
        let path = entry?.path();
        let suits = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| kind.extensions().iter().any(|k| e.eq_ignore_ascii_case(k)));
        if !suits || !path.is_file() {
            continue;
        }
        let size = path.metadata()?.len();
        ensure!(size <= MAX_FILE_BYTES, "{} has {size} bytes, more than {MAX_FILE_BYTES}", path.display());
        ensure!(files.len() < MAX_POOL_FILES, "{} holds more than {MAX_POOL_FILES} inputs", folder.display());
        files.push(path.canonicalize()?);
    }
    files.sort();
    ensure!(!files.is_empty(), "no .{} files in {}", kind.extensions().join("/."), folder.display());
    Ok(files)
}

/// Writes `count` inputs of `kind` into `folder`, sizes spread over `sizes` (seconds for WAV,
/// the longer side in pixels for images); returns their absolute paths.
pub fn generate(kind: InputKind, folder: &Path, count: usize, sizes: Range) -> anyhow::Result<Vec<PathBuf>> {
    ensure!((1..=MAX_POOL_FILES).contains(&count), "the number of generated inputs must be 1–{MAX_POOL_FILES}");
    std::fs::create_dir_all(folder).with_context(|| format!("creating {}", folder.display()))?;
    let folder = folder.canonicalize()?;
    (0..count)
        .map(|i| {
            let size = sizes.spread(i, count);
            let (name, bytes) = match kind {
                InputKind::Wav => (format!("clip-{i:03}-{size:.1}s.wav"), wav(size, i as u64)),
                InputKind::Image => {
                    let long = size.round() as u32;
                    let (w, h) = if i % 2 == 0 { (long, long * 3 / 4) } else { (long * 3 / 4, long) };
                    (format!("image-{i:03}-{w}x{h}.jpg"), jpeg(w.max(1), h.max(1), i as u64)?)
                }
            };
            let path = folder.join(name);
            std::fs::File::create(&path)
                .and_then(|mut f| f.write_all(&bytes))
                .with_context(|| format!("writing {}", path.display()))?;
            Ok(path)
        })
        .collect()
}

/// A 16 kHz mono 16-bit WAV of `seconds`: low noise with tone bursts (syllable-like energy).
fn wav(seconds: f64, seed: u64) -> Vec<u8> {
    const RATE: u32 = 16_000;
    let n = (seconds * f64::from(RATE)) as usize;
    let mut rng = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut noise = move || {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (rng >> 40) as f64 / (1u64 << 24) as f64 - 0.5
    };
    let samples: Vec<f32> = (0..n)
        .map(|i| {
            let t = i as f64 / f64::from(RATE);
            // Bursts of 0.4 s every 1.1 s, a tone with harmonics.
            let burst = if t % 1.1 < 0.4 { 0.3 * ((t * 220.0 * std::f64::consts::TAU).sin() + 0.5 * (t * 660.0 * std::f64::consts::TAU).sin()) } else { 0.0 };
            (burst + 0.02 * noise()) as f32
        })
        .collect();
    wav_bytes(SampleFormat::I16, 1, RATE, &samples)
}

/// A `width` × `height` JPEG: a gradient with a grid of blobs, so it does not compress to nothing.
fn jpeg(width: u32, height: u32, seed: u64) -> anyhow::Result<Vec<u8>> {
    let cell = (width.min(height) / 8).max(4);
    let mut pixels = Vec::with_capacity((width * height * 3) as usize);
    for y in 0..height {
        for x in 0..width {
            let (cx, cy) = (x % cell, y % cell);
            let d = (cx as i64 - i64::from(cell / 2)).pow(2) + (cy as i64 - i64::from(cell / 2)).pow(2);
            let blob = d < i64::from(cell * cell / 9);
            let shade = ((x * 255 / width.max(1)) as u64 + seed * 37) as u8;
            let (r, g, b) = if blob { (224, 172, 140) } else { (shade, (y * 255 / height.max(1)) as u8, 128) };
            pixels.extend_from_slice(&[r, g, b]);
        }
    }
    let mut out = Vec::new();
    JpegEncoder::new_with_quality(&mut out, 85)
        .write_image(&pixels, width, height, ExtendedColorType::Rgb8)
        .context("encoding a generated JPEG")?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_within_bounds_and_spread_geometrically() {
        let r = Range::parse("1-30", VOICE_SECONDS_BOUNDS, "--voice-seconds").expect("valid");
        assert_eq!((r.spread(0, 4), r.spread(3, 4)), (1.0, 30.0));
        assert!((r.spread(1, 3) - 30f64.sqrt()).abs() < 1e-9);
        assert_eq!(Range::parse("64", IMAGE_SIDE_BOUNDS, "x").expect("one value").spread(5, 9), 64.0);
        for bad in ["30-1", "0-5", "1-1000", "a-b", ""] {
            assert!(Range::parse(bad, VOICE_SECONDS_BOUNDS, "--voice-seconds").is_err(), "{bad}");
        }
    }

    #[test]
    fn generated_inputs_have_the_sizes_asked_for() {
        let dir = std::env::temp_dir().join(format!("load-inputs-{}", uuid::Uuid::new_v4().simple()));
        let clips = generate(InputKind::Wav, &dir, 2, Range { low: 1.0, high: 2.0 }).expect("wavs");
        let lengths: Vec<u64> = clips.iter().map(|p| p.metadata().expect("written").len()).collect();
        assert_eq!(lengths, vec![44 + 32_000, 44 + 64_000]);
        let images = generate(InputKind::Image, &dir, 2, Range { low: 64.0, high: 128.0 }).expect("images");
        let dims: Vec<(u32, u32)> = images.iter().map(|p| image::image_dimensions(p).expect("decodable")).collect();
        assert_eq!(dims, vec![(64, 48), (96, 128)]);
        assert_eq!(from_folder(&dir, InputKind::Wav).expect("found"), clips);
        assert_eq!(from_folder(&dir, InputKind::Image).expect("found").len(), 2);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
