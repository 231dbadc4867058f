//! P-Net's output maps → face boxes in the input image's pixels: each candidate cell's
//! window, moved by its regression, mapped back through the [`Placement`], clipped and
//! rounded, then greedy non-maximum suppression by IoU; and the task's output record.
//!
//! Coordinates are 0-based pixel edges, as the [module doc](super) sets out.

use vramgate_shared::events::{ErrorKind, FaceBox, ImageOutput, Stage};

use super::nms::{self, Overlap, Scored};
use super::{ImageOptions, Placement, BOX_OUTPUT, PROB_OUTPUT};
use crate::failure::Failure;

/// P-Net looks at 12 × 12 windows, one per output cell, two input pixels apart.
const CELL_SIZE: f32 = 12.0;
const CELL_STRIDE: f32 = 2.0;

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
/// `prob_shape` is `[1, 2, h, w]` or, from a model without a batch dimension, `[2, h, w]` (P-Net's softmax over no-face, face: channel 1 is the face
/// probability) and `box_offsets` holds `[1, 4, h, w]` row-major; anything else is a
/// worker/gateway mismatch and is reported as `internal`, never a panic.
pub fn faces(
    prob: &[f32],
    prob_shape: &[usize],
    box_offsets: &[f32],
    placement: &Placement,
    options: &ImageOptions,
) -> Result<Vec<FaceBox>, Failure> {
    let (cols, prob) = face_map(prob, prob_shape, box_offsets)?;
    let cells = prob.len();
    let offset = |channel: usize, cell: usize| box_offsets.get(channel * cells + cell).copied().unwrap_or(f32::NAN);

    let candidates: Vec<FaceBox> = prob
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
                landmarks: None,
            };
            to_image(&model, placement)
        })
        .collect();
    // Equal scores keep the map's row-major order, so results are reproducible.
    Ok(nms::suppress(&candidates, options.nms_iou, Overlap::Union, options.max_faces))
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

/// Columns of the maps and the face probability's map (channel 1), or why the maps do not fit
/// together.
fn face_map<'a>(prob: &'a [f32], prob_shape: &[usize], box_offsets: &[f32]) -> Result<(usize, &'a [f32]), Failure> {
    let expected = match *prob_shape {
        // A detector without a batch dimension answers `[2, h, w]`.
        [1, 2, rows, cols] | [2, rows, cols] => rows.checked_mul(cols).and_then(|cells| Some((cols, cells, cells.checked_mul(4)?))),
        _ => None,
    };
    match expected {
        Some((cols, cells, offsets)) if prob.len() == 2 * cells && box_offsets.len() == offsets => Ok((cols, &prob[cells..])),
        _ => Err(Failure::new(
            ErrorKind::Internal,
            Stage::Postprocess,
            format!(
                "model maps do not fit together: {PROB_OUTPUT} has shape {prob_shape:?} and {} values, \
                 {BOX_OUTPUT} has {} values; expected shape [1, 2, h, w] (or [2, h, w]) with 2·h·w values and 4·h·w offsets",
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
    let image = FaceBox { x1: x(model.x1), y1: y(model.y1), x2: x(model.x2), y2: y(model.y2), score: model.score, landmarks: None };
    (image.x2 > image.x1 && image.y2 > image.y1).then_some(image)
}

impl Scored for FaceBox {
    fn corners(&self) -> [f32; 4] {
        [self.x1, self.y1, self.x2, self.y2]
    }
    fn score(&self) -> f32 {
        self.score
    }
}

fn round_to(value: f32, per_unit: f32) -> f32 {
    (value * per_unit).round() / per_unit
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::test_util::check_failure;
    use super::*;

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
            faces(&both_channels(&self.prob), &[1, 2, self.rows, self.cols], &self.offsets, placement, options).expect("maps fit")
        }
    }

    /// P-Net's `face_prob` for the face probabilities `prob`: channel 0 no-face (`1 - p`),
    /// channel 1 face.
    fn both_channels(prob: &[f32]) -> Vec<f32> {
        prob.iter().map(|p| 1.0 - p).chain(prob.iter().copied()).collect()
    }

    #[test]
    fn only_the_face_channel_is_read() {
        // Every cell sure there is no face (channel 0 at 0.99) but one.
        let (rows, cols) = (4, 5);
        let mut prob = vec![0.99; rows * cols];
        prob.extend(vec![0.0; rows * cols]);
        prob[rows * cols + 7] = 0.9;
        let found = faces(&prob, &[1, 2, rows, cols], &vec![0.0; 4 * rows * cols], &identity(40, 40), &ImageOptions::default());
        assert_eq!(found.expect("maps fit"), [face(4.0, 2.0, 16.0, 14.0, 0.9)]);
        // A detector without a batch dimension: the same maps as [2, h, w].
        let found = faces(&prob, &[2, rows, cols], &vec![0.0; 4 * rows * cols], &identity(40, 40), &ImageOptions::default());
        assert_eq!(found.expect("maps fit"), [face(4.0, 2.0, 16.0, 14.0, 0.9)]);
    }

    fn face(x1: f32, y1: f32, x2: f32, y2: f32, score: f32) -> FaceBox {
        FaceBox { x1, y1, x2, y2, score, landmarks: None }
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
        let cases: [(&[usize], usize, usize); 7] = [
            (&[1, 2, 2, 3], 12, 23),
            (&[1, 2, 2, 3], 11, 24),
            (&[1, 2, 3], 6, 24),
            (&[1, 1, 2, 3], 6, 24),
            (&[2, 2, 2, 3], 24, 48),
            (&[1, 2, usize::MAX, 2], 0, 0),
            (&[], 0, 0),
        ];
        for (shape, values, offsets) in cases {
            let result =
                faces(&vec![0.9; values], shape, &vec![0.0; offsets], &identity(10, 10), &ImageOptions::default());
            let failure = check_failure(result, ErrorKind::Internal, Stage::Postprocess);
            assert!(failure.message.contains(&format!("shape {shape:?} and {values} values")), "{}", failure.message);
        }
        let empty = faces(&[], &[1, 2, 0, 5], &[], &identity(10, 10), &ImageOptions::default());
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
            let found = faces(&both_channels(&prob), &[1, 2, rows, cols], &offsets, &placement, &options).expect("maps fit");
            prop_assert!(found.len() <= max_faces);
            for pair in found.windows(2) {
                prop_assert!(pair[0].score >= pair[1].score);
            }
            for (k, f) in found.iter().enumerate() {
                prop_assert!(f.score >= threshold - 1e-4);
                prop_assert!(0.0 <= f.x1 && f.x1 < f.x2 && f.x2 <= placement.width as f32, "{f:?}");
                prop_assert!(0.0 <= f.y1 && f.y1 < f.y2 && f.y2 <= placement.height as f32, "{f:?}");
                for other in &found[..k] {
                    prop_assert!(Overlap::Union.of(other.corners(), f.corners()) <= nms_iou, "{other:?} and {f:?}");
                }
            }
        }
    }
}
