//! MTCNN's three stages between the worker calls, as facenet-pytorch's `detect_face` computes
//! them, step for step and in the same float precision, so that the faces agree with the
//! package's own (`tests/tests/faces_agreement.rs` checks that on real photographs):
//!
//! 1. **Pyramid.** The image is scaled so that the smallest face asked for (`min_face_size`)
//!    becomes P-Net's 12-pixel window, then again by `factor` until the shorter side falls
//!    under 12 pixels ([`scales`], [`level_size`]). Each level is area-resampled ([`resample`])
//!    and goes to P-Net; each map cell over `thresholds[0]` is a candidate window
//!    ([`proposals`]), suppressed per level (IoU 0.5) and then over all levels (IoU 0.7), moved
//!    by its regression and squared ([`refine_proposals`]).
//! 2. **R-Net.** Each candidate's square, cut from the image ([`Crop`], clipped to it) and
//!    resampled to 24 × 24, is one row of one batched request; candidates over
//!    `thresholds[1]` are suppressed (IoU 0.7), moved by R-Net's regression and squared
//!    ([`refine`]).
//! 3. **O-Net.** The same at 48 × 48; candidates over `thresholds[2]` get their five landmarks,
//!    are moved by O-Net's regression and suppressed by the intersection over the *smaller* box
//!    (0.7) ([`finish`]).
//!
//! Boxes are in the coordinates facenet-pytorch reports: `x1, y1` the first pixel's index,
//! `x2, y2` the window's end as MTCNN's reference code computes it (`floor((2·cell + 12) /
//! scale)`); a box may reach past the image, as the package's do. Nothing here allocates more
//! than its inputs and outputs, and nothing panics on any model output: a map or an answer of
//! the wrong size is an `internal` failure.

use ::image::RgbImage;
use vramgate_shared::events::{ErrorKind, Stage};

use super::nms::{self, Overlap, Scored};
use crate::failure::Failure;

/// P-Net's window and stride, in level pixels.
const CELL: f32 = 12.0;
const STRIDE: f32 = 2.0;
/// The IoU over which a candidate is dropped: within one pyramid level, then across levels and
/// after R-Net; the intersection over the smaller box after O-Net.
const LEVEL_NMS: f32 = 0.5;
const STAGE_NMS: f32 = 0.7;
const FINAL_NMS_MIN: f32 = 0.7;
/// R-Net's and O-Net's input sides.
pub const RNET_SIDE: usize = 24;
pub const ONET_SIDE: usize = 48;

/// A candidate face: its box, its score, and the regression the last network gave it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub x1: f32,
    pub y1: f32,
    pub x2: f32,
    pub y2: f32,
    pub score: f32,
    pub reg: [f32; 4],
}

impl Scored for Candidate {
    fn corners(&self) -> [f32; 4] {
        [self.x1, self.y1, self.x2, self.y2]
    }
    fn score(&self) -> f32 {
        self.score
    }
}

/// A face the cascade found: its box, probability and five landmarks `(x, y)` (eyes, nose,
/// mouth corners), in input pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Face {
    pub x1: f32,
    pub y1: f32,
    pub x2: f32,
    pub y2: f32,
    pub score: f32,
    pub landmarks: [[f32; 2]; 5],
}

/// The pyramid's scales: `12 / min_face_size`, times `factor` per level, while the shorter side
/// scaled is at least 12 pixels. Computed in f64, as Python does.
pub fn scales(width: u32, height: u32, min_face_size: u32, factor: f64) -> Vec<f64> {
    let m = 12.0 / f64::from(min_face_size.max(1));
    let mut minl = f64::from(width.min(height)) * m;
    let mut scale = m;
    let mut scales = Vec::new();
    // `factor` < 1 is checked by the options; the bound keeps a bad one from looping.
    while minl >= 12.0 && scales.len() < 64 {
        scales.push(scale);
        scale *= factor;
        minl *= factor;
    }
    scales
}

/// A level's size, `(width, height)`: `int(side · scale + 1)`, as facenet-pytorch sizes it.
pub fn level_size(width: u32, height: u32, scale: f64) -> (usize, usize) {
    ((f64::from(width) * scale + 1.0) as usize, (f64::from(height) * scale + 1.0) as usize)
}

/// A region of the image, in pixel indices: columns `x0..x1`, rows `y0..y1` (ends exclusive),
/// inside the image and not empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crop {
    pub x0: usize,
    pub y0: usize,
    pub x1: usize,
    pub y1: usize,
}

impl Crop {
    /// The whole image.
    pub fn whole(image: &RgbImage) -> Crop {
        Crop { x0: 0, y0: 0, x1: image.width() as usize, y1: image.height() as usize }
    }

    /// The pixels a candidate's box covers, as facenet-pytorch's `pad` and slice cut them: the
    /// box truncated to integers, its start clipped to 1 and its end to the image's side, then
    /// `[start - 1, end)`. `None` when nothing is left (the box lies outside the image).
    pub fn of(c: &Candidate, width: u32, height: u32) -> Option<Crop> {
        let trunc = |v: f32| if v.is_finite() { v.trunc().clamp(i32::MIN as f32, i32::MAX as f32) as i64 } else { 0 };
        let x = trunc(c.x1).max(1);
        let y = trunc(c.y1).max(1);
        let ex = trunc(c.x2).min(i64::from(width));
        let ey = trunc(c.y2).min(i64::from(height));
        (ex > x - 1 && ey > y - 1).then(|| Crop { x0: (x - 1) as usize, y0: (y - 1) as usize, x1: ex as usize, y1: ey as usize })
    }
}

/// Area-resamples `crop` of `image` to `out_w × out_h` and normalises it as MTCNN's networks
/// take it, `(v - 127.5) · 0.0078125`, appending the R, G and B planes to `out` (CHW).
///
/// Area resampling is torch's `interpolate(mode="area")`, i.e. adaptive average pooling: output
/// row `i` averages input rows `floor(i·h/out_h)` to `ceil((i+1)·h/out_h)` (exclusive), and
/// likewise for columns; the sum of whole pixel values is exact in f32, then divided by the
/// window's height and then its width, as torch does.
pub fn resample(image: &RgbImage, crop: Crop, out_w: usize, out_h: usize, out: &mut Vec<f32>) {
    let (in_w, in_h) = (crop.x1 - crop.x0, crop.y1 - crop.y0);
    let raw = image.as_raw();
    let stride = image.width() as usize * 3;
    let windows = |n_in: usize, n_out: usize| -> Vec<(usize, usize)> {
        (0..n_out).map(|i| ((i * n_in) / n_out, ((i + 1) * n_in).div_ceil(n_out))).collect()
    };
    let rows = windows(in_h, out_h);
    let cols = windows(in_w, out_w);
    let start = out.len();
    out.resize(start + 3 * out_w * out_h, 0.0);
    let plane = out_w * out_h;
    for (i, &(r0, r1)) in rows.iter().enumerate() {
        for (j, &(c0, c1)) in cols.iter().enumerate() {
            let mut sum = [0f32; 3];
            for r in r0..r1 {
                let row = (crop.y0 + r) * stride;
                for c in c0..c1 {
                    let p = row + (crop.x0 + c) * 3;
                    sum[0] += f32::from(raw[p]);
                    sum[1] += f32::from(raw[p + 1]);
                    sum[2] += f32::from(raw[p + 2]);
                }
            }
            let (kh, kw) = ((r1 - r0) as f32, (c1 - c0) as f32);
            for (ch, s) in sum.iter().enumerate() {
                out[start + ch * plane + i * out_w + j] = (s / kh / kw - 127.5) * 0.0078125;
            }
        }
    }
}

/// P-Net's candidates at one level: every cell whose face probability reaches `threshold`, as
/// the window it stands for mapped back to the image (`floor((2·cell + 1) / scale)` to
/// `floor((2·cell + 12) / scale)`), with the cell's regression; then suppressed at IoU 0.5.
/// `prob` is `[1, 2, h, w]` (softmax over no-face, face: channel 1 is read), `offsets`
/// `[1, 4, h, w]`, row-major.
pub fn proposals(prob: &[f32], prob_shape: &[usize], offsets: &[f32], scale: f64, threshold: f32) -> Result<Vec<Candidate>, Failure> {
    let (rows, cols) = match *prob_shape {
        [1, 2, rows, cols] if rows.checked_mul(cols).is_some_and(|n| 2 * n == prob.len() && offsets.len() == 4 * n) => (rows, cols),
        _ => {
            return Err(internal(format!(
                "P-Net's maps do not fit together: face_prob has shape {prob_shape:?} and {} values, box_offsets {} values; \
                 expected [1, 2, h, w] with 2·h·w values and 4·h·w offsets",
                prob.len(),
                offsets.len()
            )))
        }
    };
    let cells = rows * cols;
    let scale = scale as f32;
    let mut found = Vec::new();
    for (cell, &p) in prob[cells..].iter().enumerate() {
        // NaN is never a candidate.
        if p.partial_cmp(&threshold).is_none_or(|o| o.is_lt()) {
            continue;
        }
        let (y, x) = ((cell / cols) as f32, (cell % cols) as f32);
        found.push(Candidate {
            x1: ((STRIDE * x + 1.0) / scale).floor(),
            y1: ((STRIDE * y + 1.0) / scale).floor(),
            x2: ((STRIDE * x + CELL) / scale).floor(),
            y2: ((STRIDE * y + CELL) / scale).floor(),
            score: p,
            reg: [0, 1, 2, 3].map(|k| offsets[k * cells + cell]),
        });
    }
    Ok(nms::suppress(&found, LEVEL_NMS, Overlap::Union, usize::MAX))
}

/// After every level's proposals: suppression across levels (IoU 0.7), each box moved by its
/// P-Net regression (in units of its width `x2 - x1`, as stage 1 of the reference does) and
/// squared.
pub fn refine_proposals(levels: Vec<Candidate>) -> Vec<Candidate> {
    nms::suppress(&levels, STAGE_NMS, Overlap::Union, usize::MAX)
        .into_iter()
        .map(|c| {
            let (w, h) = (c.x2 - c.x1, c.y2 - c.y1);
            square(Candidate {
                x1: c.x1 + c.reg[0] * w,
                y1: c.y1 + c.reg[1] * h,
                x2: c.x2 + c.reg[2] * w,
                y2: c.y2 + c.reg[3] * h,
                score: c.score,
                reg: [0.0; 4],
            })
        })
        .collect()
}

/// The rows of one stage's batched answer that belong to each candidate: `probs` `[n, 2]`,
/// `offsets` `[n, 4]`, checked against `n` candidates.
pub struct StageAnswer<'a> {
    pub probs: &'a [f32],
    pub offsets: &'a [f32],
    /// O-Net only: `[n, 10]`, x of the five points then y, relative to the box.
    pub landmarks: Option<&'a [f32]>,
}

impl StageAnswer<'_> {
    fn check(&self, n: usize, stage: &str) -> Result<(), Failure> {
        let landmarks_ok = self.landmarks.is_none_or(|l| l.len() == 10 * n);
        if self.probs.len() != 2 * n || self.offsets.len() != 4 * n || !landmarks_ok {
            return Err(internal(format!(
                "{stage} answered {} probabilities, {} offsets{} for {n} candidates",
                self.probs.len(),
                self.offsets.len(),
                self.landmarks.map(|l| format!(", {} landmark values", l.len())).unwrap_or_default()
            )));
        }
        Ok(())
    }
}

/// R-Net's verdict on `candidates`: those whose face probability exceeds `threshold`, with
/// their new score, suppressed at IoU 0.7, moved by R-Net's regression (in units of `x2 - x1
/// + 1`) and squared.
pub fn refine(candidates: &[Candidate], answer: &StageAnswer<'_>, threshold: f32) -> Result<Vec<Candidate>, Failure> {
    answer.check(candidates.len(), "R-Net")?;
    let passed: Vec<Candidate> = candidates
        .iter()
        .enumerate()
        .filter(|&(i, _)| answer.probs[2 * i + 1] > threshold)
        .map(|(i, c)| Candidate {
            score: answer.probs[2 * i + 1],
            reg: [0, 1, 2, 3].map(|k| answer.offsets[4 * i + k]),
            ..*c
        })
        .collect();
    Ok(nms::suppress(&passed, STAGE_NMS, Overlap::Union, usize::MAX).into_iter().map(|c| square(regress(c))).collect())
}

/// O-Net's verdict: candidates whose probability exceeds `threshold` become faces, with their
/// landmarks placed in the box as it was sent (`x1 + (x2 - x1 + 1)·p - 1`), their box moved by
/// O-Net's regression, and suppressed by the intersection over the smaller box (0.7).
pub fn finish(candidates: &[Candidate], answer: &StageAnswer<'_>, threshold: f32) -> Result<Vec<Face>, Failure> {
    answer.check(candidates.len(), "O-Net")?;
    let Some(points) = answer.landmarks else {
        return Err(internal("O-Net answered no landmarks".into()));
    };
    let mut faces = Vec::new();
    let mut boxes = Vec::new();
    for (i, c) in candidates.iter().enumerate() {
        let score = answer.probs[2 * i + 1];
        if score.partial_cmp(&threshold) != Some(std::cmp::Ordering::Greater) {
            continue;
        }
        let (w, h) = (c.x2 - c.x1 + 1.0, c.y2 - c.y1 + 1.0);
        let p = &points[10 * i..10 * i + 10];
        let landmarks = [0, 1, 2, 3, 4].map(|k| [w * p[k] + c.x1 - 1.0, h * p[5 + k] + c.y1 - 1.0]);
        let moved = regress(Candidate { score, reg: [0, 1, 2, 3].map(|k| answer.offsets[4 * i + k]), ..*c });
        boxes.push(moved);
        faces.push(Face { x1: moved.x1, y1: moved.y1, x2: moved.x2, y2: moved.y2, score, landmarks });
    }
    let kept = nms::keep(&boxes, FINAL_NMS_MIN, Overlap::Min, usize::MAX);
    Ok(kept.into_iter().map(|i| faces[i]).collect())
}

/// `bbreg`: the box moved by its regression, in units of its inclusive width and height.
fn regress(c: Candidate) -> Candidate {
    let (w, h) = (c.x2 - c.x1 + 1.0, c.y2 - c.y1 + 1.0);
    Candidate {
        x1: c.x1 + c.reg[0] * w,
        y1: c.y1 + c.reg[1] * h,
        x2: c.x2 + c.reg[2] * w,
        y2: c.y2 + c.reg[3] * h,
        ..c
    }
}

/// `rerec`: the square on the box's longer side, centred on the box.
fn square(c: Candidate) -> Candidate {
    let (w, h) = (c.x2 - c.x1, c.y2 - c.y1);
    let l = w.max(h);
    let x1 = c.x1 + w * 0.5 - l * 0.5;
    let y1 = c.y1 + h * 0.5 - l * 0.5;
    Candidate { x1, y1, x2: x1 + l, y2: y1 + l, ..c }
}

fn internal(message: String) -> Failure {
    Failure::new(ErrorKind::Internal, Stage::Postprocess, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(x1: f32, y1: f32, x2: f32, y2: f32, score: f32) -> Candidate {
        Candidate { x1, y1, x2, y2, score, reg: [0.0; 4] }
    }

    #[test]
    fn the_pyramid_is_facenet_pytorchs() {
        // 512 × 512 at min_face_size 20: m = 0.6, 307.2 · 0.709^k ≥ 12 for k = 0..=9.
        let s = scales(512, 512, 20, 0.709);
        assert_eq!(s.len(), 10);
        assert!((s[0] - 0.6).abs() < 1e-12 && (s[9] - 0.6 * 0.709f64.powi(9)).abs() < 1e-12);
        assert_eq!(level_size(512, 512, s[0]), (308, 308));
        assert_eq!(level_size(640, 480, 0.6 * 0.709), (273, 205));
        assert!(scales(20, 20, 20, 0.709).len() == 1 && scales(19, 400, 20, 0.709).is_empty());
    }

    #[test]
    fn area_resampling_averages_whole_windows_like_adaptive_pooling() {
        // 3 × 2 image, resampled to 2 × 1: columns [0, 2) and [1, 3) (ceil), one row [0, 2).
        let mut image = RgbImage::new(3, 2);
        for (i, p) in image.pixels_mut().enumerate() {
            *p = ::image::Rgb([10 * i as u8, 0, 255]);
        }
        let mut out = Vec::new();
        resample(&image, Crop::whole(&image), 2, 1, &mut out);
        let norm = |v: f32| (v - 127.5) * 0.0078125;
        // Red: pixels 0,10,20 / 30,40,50; window 1 = {0,10,30,40}, window 2 = {10,20,40,50}.
        assert_eq!(out, vec![norm(20.0), norm(30.0), norm(0.0), norm(0.0), norm(255.0), norm(255.0)]);
        // A crop: the right column only, to 1 × 1.
        out.clear();
        resample(&image, Crop { x0: 2, y0: 0, x1: 3, y1: 2 }, 1, 1, &mut out);
        assert_eq!(out[0], norm(35.0));
    }

    #[test]
    fn crops_are_cut_as_the_reference_pads_them() {
        let c = candidate(-3.7, 2.9, 30.2, 40.0, 1.0);
        assert_eq!(Crop::of(&c, 25, 50), Some(Crop { x0: 0, y0: 1, x1: 25, y1: 40 }));
        assert_eq!(Crop::of(&candidate(30.0, 2.0, 40.0, 9.0, 1.0), 25, 50), None);
        assert_eq!(Crop::of(&candidate(-9.0, -9.0, -1.0, 5.0, 1.0), 25, 50), None);
        // A box that is not a number covers nothing.
        assert_eq!(Crop::of(&candidate(f32::NAN, 0.0, f32::INFINITY, 5.0, 1.0), 25, 50), None);
    }

    #[test]
    fn proposals_map_cells_back_and_suppress_within_the_level() {
        // A 1 × 12 map at scale 0.5: cell 1 → x from floor(3 / 0.5) = 6 to floor(14 / 0.5) = 28.
        // Channel 0 (no face) is never read: it says 0.99 everywhere.
        let mut prob = [0.99; 24];
        prob[12..].fill(0.0);
        (prob[13], prob[14], prob[22]) = (0.9, 0.8, 0.95);
        let mut offsets = vec![0.0; 48];
        offsets[1] = 0.25; // dx1 of cell 1
        let found = proposals(&prob, &[1, 2, 1, 12], &offsets, 0.5, 0.6).expect("maps fit");
        // Cell 2 (10..32) overlaps cell 1 (6..28) at IoU 396 / 572 > 0.5: it goes.
        assert_eq!(found.len(), 2);
        assert_eq!((found[0].x1, found[0].y1, found[0].x2, found[0].y2, found[0].score), (42.0, 2.0, 64.0, 24.0, 0.95));
        assert_eq!((found[1].x1, found[1].x2, found[1].reg[0]), (6.0, 28.0, 0.25));
        for shape in [&[1, 2, 3, 3][..], &[1, 1, 12], &[1, 1, 2, 12]] {
            let err = proposals(&prob, shape, &offsets, 0.5, 0.6).expect_err("shape mismatch");
            assert_eq!(err.kind, ErrorKind::Internal);
        }
    }

    #[test]
    fn stages_regress_square_and_place_landmarks() {
        let c = [candidate(10.0, 20.0, 29.0, 59.0, 0.5)];
        let probs = [0.1, 0.9];
        let offsets = [0.1, 0.0, -0.1, 0.0];
        let refined = refine(&c, &StageAnswer { probs: &probs, offsets: &offsets, landmarks: None }, 0.7).expect("fits");
        // Width 20 (inclusive): x1 12, x2 27; then the square on the height (39), centred.
        assert_eq!(refined.len(), 1);
        let r = refined[0];
        assert_eq!((r.x1, r.x2, r.y1, r.y2, r.score), (0.0, 39.0, 20.0, 59.0, 0.9));
        assert!(refine(&c, &StageAnswer { probs: &[0.3, 0.7], offsets: &offsets, landmarks: None }, 0.7).expect("fits").is_empty());

        let points = [0.0, 1.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.5, 1.0, 1.0];
        let faces = finish(&c, &StageAnswer { probs: &probs, offsets: &[0.0; 4], landmarks: Some(&points) }, 0.7).expect("fits");
        assert_eq!(faces[0].landmarks[0], [9.0, 19.0]);
        assert_eq!(faces[0].landmarks[1], [29.0, 19.0]);
        assert_eq!(faces[0].landmarks[4], [19.0, 59.0]);
        let err = finish(&c, &StageAnswer { probs: &probs, offsets: &[0.0; 4], landmarks: Some(&points[..9]) }, 0.7);
        assert_eq!(err.expect_err("short landmarks").kind, ErrorKind::Internal);
    }
}
