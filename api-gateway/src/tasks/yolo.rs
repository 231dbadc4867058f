//! `yolo_boxes`: an anchor-grid detector's raw heads (the YOLO family's, as Darknet writes them)
//! → boxes in the input image's pixels, class-aware.
//!
//! Each head is a model output `[1, A·(5 + C), H, W]` at a stride (model-input pixels per cell)
//! with its `A` anchors (`[w, h]` in model-input pixels). Per cell `(i, j)` and anchor `a` the
//! `5 + C` channels are `tx, ty, tw, th, objectness` and `C` class logits, decoded as Darknet and
//! OpenCV's Darknet reader decode them (`s` is `scale_x_y`, 1 unless the cfg says otherwise):
//!
//! ```text
//! cx = (j + σ(tx)·s − (s − 1)/2) · stride      w = e^tw · anchor_w
//! cy = (i + σ(ty)·s − (s − 1)/2) · stride      h = e^th · anchor_h
//! score of class k = σ(objectness) · σ(class_k)
//! ```
//!
//! A box's class is its best-scoring one; it is a candidate when that score is above
//! `threshold`. Suppression is greedy and per class (a box is dropped when it overlaps a
//! higher-scoring box of its class by an IoU above `nms_iou`), in model-input pixels, as
//! Darknet's demo and `cv2.dnn.NMSBoxesBatched` do; the survivors, best first, are cut to
//! `max_boxes` (`cut` says whether any was left out), then mapped back through the image
//! converter's placement into the image's pixels and clipped to the image.
//!
//! Bounds: at most [`MAX_HEADS`] heads of at most [`MAX_ANCHORS`] anchors, at most
//! [`MAX_CLASSES`] classes, `max_boxes` at most [`MAX_BOXES`]; a head whose shape does not
//! match its anchors and classes fails its event (`internal`), naming the head.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::image::nms::{keep, Overlap, Scored};
use super::image::Placement;

pub const MAX_HEADS: usize = 8;
pub const MAX_ANCHORS: usize = 16;
pub const MAX_CLASSES: usize = 10_000;
pub const MAX_BOXES: usize = 10_000;

/// One head: the model output holding it, its stride and its anchors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Head {
    pub output: String,
    pub stride: f32,
    pub anchors: Vec<[f32; 2]>,
}

/// A `yolo_boxes` row's `[tasks.<t>.outputs.yolo]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct YoloConfig {
    /// The heads, the row's own output first.
    pub heads: Vec<Head>,
    /// Classes per anchor (COCO: 80).
    pub classes: usize,
    /// Darknet's `scale_x_y` (YOLOv4: 1.05 or more; 1 is the plain sigmoid).
    #[serde(default = "one")]
    pub scale_x_y: f32,
}

fn one() -> f32 {
    1.0
}

impl YoloConfig {
    /// Checks what the types cannot; `at` is the table's key, `row` the row's output name.
    pub fn validate(&self, at: &str, row: &str) -> Result<(), String> {
        if self.heads.is_empty() || self.heads.len() > MAX_HEADS {
            return Err(format!("{at}.heads must list 1 to {MAX_HEADS} heads"));
        }
        if self.heads[0].output != row {
            return Err(format!("{at}.heads[0].output must be the row's own output '{row}'"));
        }
        for (i, head) in self.heads.iter().enumerate() {
            if head.output.is_empty() || head.output.len() > 128 {
                return Err(format!("{at}.heads[{i}].output must be 1 to 128 bytes"));
            }
            if self.heads[..i].iter().any(|h| h.output == head.output) {
                return Err(format!("{at}.heads[{i}].output '{}' is listed twice", head.output));
            }
            if !(head.stride.is_finite() && head.stride > 0.0 && head.stride <= 4096.0) {
                return Err(format!("{at}.heads[{i}].stride must be above 0 and at most 4096"));
            }
            if head.anchors.is_empty() || head.anchors.len() > MAX_ANCHORS {
                return Err(format!("{at}.heads[{i}].anchors must list 1 to {MAX_ANCHORS} [w, h] pairs"));
            }
            if head.anchors.iter().flatten().any(|v| !(v.is_finite() && *v > 0.0 && *v <= 65_536.0)) {
                return Err(format!("{at}.heads[{i}].anchors must be above 0 and at most 65536 pixels"));
            }
        }
        if !(1..=MAX_CLASSES).contains(&self.classes) {
            return Err(format!("{at}.classes must be 1 to {MAX_CLASSES}, got {}", self.classes));
        }
        if !(1.0..=4.0).contains(&self.scale_x_y) {
            return Err(format!("{at}.scale_x_y must be 1 to 4, got {}", self.scale_x_y));
        }
        Ok(())
    }
}

/// A decoded box in model-input pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Found {
    pub corners: [f32; 4],
    pub score: f32,
    pub class: usize,
}

impl Scored for Found {
    fn corners(&self) -> [f32; 4] {
        self.corners
    }
    fn score(&self) -> f32 {
        self.score
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The candidates of one head (`values` row-major `[1, A·(5 + C), h, w]`) scoring above
/// `threshold`.
pub fn decode(head: &Head, shape: &[usize], values: &[f32], config: &YoloConfig, threshold: f32) -> Result<Vec<Found>, String> {
    let per = 5 + config.classes;
    let anchors = head.anchors.len();
    let (h, w) = match shape {
        [1, c, h, w] if *c == anchors * per => (*h, *w),
        _ => {
            return Err(format!(
                "head '{}' has shape {shape:?}, not [1, {} ({anchors} anchors of 5 + {} classes), h, w]",
                head.output,
                anchors * per,
                config.classes
            ))
        }
    };
    if values.len() != anchors * per * h * w {
        return Err(format!("head '{}' has {} values for shape {shape:?}", head.output, values.len()));
    }
    let s = config.scale_x_y;
    let at = |a: usize, k: usize, i: usize, j: usize| values[((a * per + k) * h + i) * w + j];
    let mut found = Vec::new();
    for a in 0..anchors {
        for i in 0..h {
            for j in 0..w {
                let objectness = sigmoid(at(a, 4, i, j));
                // Every class score is objectness × σ(logit) ≤ objectness: skip the cell early.
                if !(objectness > threshold) {
                    continue;
                }
                let (mut class, mut best) = (0, f32::NEG_INFINITY);
                for k in 0..config.classes {
                    let logit = at(a, 5 + k, i, j);
                    if logit > best {
                        (class, best) = (k, logit);
                    }
                }
                let score = objectness * sigmoid(best);
                if !(score > threshold) {
                    continue;
                }
                let cx = (j as f32 + sigmoid(at(a, 0, i, j)) * s - (s - 1.0) / 2.0) * head.stride;
                let cy = (i as f32 + sigmoid(at(a, 1, i, j)) * s - (s - 1.0) / 2.0) * head.stride;
                let bw = at(a, 2, i, j).exp() * head.anchors[a][0];
                let bh = at(a, 3, i, j).exp() * head.anchors[a][1];
                found.push(Found { corners: [cx - bw / 2.0, cy - bh / 2.0, cx + bw / 2.0, cy + bh / 2.0], score, class });
            }
        }
    }
    Ok(found)
}

/// Greedy suppression per class, then the best `max_boxes` of all classes: the survivors, best
/// first (ties in the order found), and whether more survived than were kept.
pub fn suppress_per_class(found: &[Found], nms_iou: f32, max_boxes: usize) -> (Vec<Found>, bool) {
    let mut by_class: std::collections::BTreeMap<usize, Vec<Found>> = Default::default();
    for f in found {
        by_class.entry(f.class).or_default().push(*f);
    }
    let mut kept: Vec<Found> = Vec::new();
    for boxes in by_class.values() {
        // Per class at most max_boxes + 1 survive into the merge: enough to know whether the
        // whole list was cut.
        kept.extend(keep(boxes, nms_iou, Overlap::Union, max_boxes + 1).into_iter().map(|i| boxes[i]));
    }
    kept.sort_by(|a, b| b.score.total_cmp(&a.score));
    let cut = kept.len() > max_boxes;
    kept.truncate(max_boxes);
    (kept, cut)
}

/// The row's value: `{"boxes": [{"x1", "y1", "x2", "y2", "score", "class", "label"}, ...],
/// "cut": bool}`, in the image's pixels (`placement`), clipped to the image.
pub fn render(kept: &[Found], cut: bool, placement: &Placement, labels: Option<&[String]>) -> Value {
    let (w, h) = (placement.width as f32, placement.height as f32);
    let x = |v: f32| ((v - placement.pad_x) / placement.scale_x).clamp(0.0, w);
    let y = |v: f32| ((v - placement.pad_y) / placement.scale_y).clamp(0.0, h);
    let boxes: Vec<Value> = kept
        .iter()
        .map(|f| {
            let label = labels.and_then(|l| l.get(f.class)).map(|s| Value::String(s.clone())).unwrap_or(Value::Null);
            json!({
                "x1": x(f.corners[0]), "y1": y(f.corners[1]), "x2": x(f.corners[2]), "y2": y(f.corners[3]),
                "score": f.score, "class": f.class, "label": label,
            })
        })
        .collect();
    json!({ "boxes": boxes, "cut": cut })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(classes: usize, scale_x_y: f32) -> YoloConfig {
        YoloConfig { heads: vec![Head { output: "p".into(), stride: 32.0, anchors: vec![[10.0, 20.0], [40.0, 30.0]] }], classes, scale_x_y }
    }

    /// A `[1, 2·(5 + classes), h, w]` head of zeros but `logit` where `set` says.
    fn head(classes: usize, h: usize, w: usize, set: &[(usize, usize, usize, usize, f32)]) -> Vec<f32> {
        let per = 5 + classes;
        // Objectness far below any threshold everywhere first.
        let mut v = vec![0.0; 2 * per * h * w];
        for a in 0..2 {
            for c in 0..h * w {
                v[(a * per + 4) * h * w + c] = -20.0;
            }
        }
        for &(a, k, i, j, value) in set {
            v[((a * per + k) * h + i) * w + j] = value;
        }
        v
    }

    #[test]
    fn a_cell_decodes_as_darknet_does() {
        let c = config(3, 1.05);
        // Anchor 1 at cell (i 1, j 2): tx = 0 (σ 0.5), ty = 0, tw = ln 2, th = 0, objectness
        // logit 3, class 2 logit 2.
        let v = head(3, 2, 3, &[(1, 0, 1, 2, 0.0), (1, 2, 1, 2, 2f32.ln()), (1, 4, 1, 2, 3.0), (1, 7, 1, 2, 2.0)]);
        let found = decode(&c.heads[0], &[1, 16, 2, 3], &v, &c, 0.25).unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        let f = found[0];
        let s = 1.05f32;
        let cx = (2.0 + 0.5 * s - (s - 1.0) / 2.0) * 32.0;
        let cy = (1.0 + 0.5 * s - (s - 1.0) / 2.0) * 32.0;
        let want = [cx - 40.0, cy - 15.0, cx + 40.0, cy + 15.0];
        for (g, w) in f.corners.iter().zip(want) {
            assert!((g - w).abs() < 1e-4, "{:?} vs {want:?}", f.corners);
        }
        assert_eq!(f.class, 2);
        assert!((f.score - sigmoid(3.0) * sigmoid(2.0)).abs() < 1e-6);
    }

    #[test]
    fn only_scores_above_the_threshold_are_candidates() {
        let c = config(2, 1.0);
        // σ(0) · σ(0) = 0.25: not above 0.25; σ(3) · σ(0) ≈ 0.476: above.
        let v = head(2, 1, 2, &[(0, 4, 0, 0, 0.0), (0, 4, 0, 1, 3.0)]);
        let found = decode(&c.heads[0], &[1, 14, 1, 2], &v, &c, 0.25).unwrap();
        assert_eq!(found.len(), 1);
        assert!((found[0].corners[0] + found[0].corners[2]) / 2.0 > 32.0, "the second cell's box");
    }

    #[test]
    fn a_head_of_the_wrong_shape_is_named() {
        let c = config(80, 1.0);
        let err = decode(&c.heads[0], &[1, 255, 13, 13], &vec![0.0; 255 * 169], &c, 0.25).unwrap_err();
        assert!(err.contains("head 'p'") && err.contains("[1, 170"), "{err}");
    }

    #[test]
    fn suppression_is_per_class_and_the_cut_is_said() {
        let b = |x: f32, score: f32, class: usize| Found { corners: [x, 0.0, x + 10.0, 10.0], score, class };
        // Two overlapping boxes of class 0 (one survives), one of class 1 on the same place
        // (survives: another class), one far away of class 0.
        let found = [b(0.0, 0.9, 0), b(1.0, 0.8, 0), b(1.0, 0.7, 1), b(50.0, 0.6, 0)];
        let (kept, cut) = suppress_per_class(&found, 0.45, 10);
        assert_eq!(kept.iter().map(|f| f.score).collect::<Vec<_>>(), [0.9, 0.7, 0.6]);
        assert!(!cut);
        let (kept, cut) = suppress_per_class(&found, 0.45, 2);
        assert_eq!(kept.len(), 2);
        assert!(cut, "a third survivor was left out");
    }

    #[test]
    fn boxes_map_back_through_the_placement_and_are_clipped() {
        // A 832 x 416 image stretched to 416 x 416: x halves, y stays.
        let placement = Placement { scale_x: 0.5, scale_y: 1.0, pad_x: 0.0, pad_y: 0.0, width: 832, height: 416 };
        let kept = [Found { corners: [-10.0, 10.0, 100.0, 500.0], score: 0.5, class: 1 }];
        let labels = vec!["a".to_string(), "b".to_string()];
        let v = render(&kept, false, &placement, Some(&labels));
        assert_eq!(v["boxes"][0]["x1"], 0.0);
        assert_eq!(v["boxes"][0]["x2"], 200.0);
        assert_eq!(v["boxes"][0]["y2"], 416.0);
        assert_eq!(v["boxes"][0]["label"], "b");
        assert_eq!(v["cut"], false);
    }

    #[test]
    fn bad_tables_are_refused_with_their_key() {
        let mut c = config(80, 1.05);
        assert!(c.validate("outputs[0].yolo", "p").is_ok());
        assert!(c.validate("outputs[0].yolo", "q").unwrap_err().contains("heads[0].output must be the row's own output 'q'"));
        c.classes = 0;
        assert!(c.validate("outputs[0].yolo", "p").unwrap_err().contains("classes must be 1 to"));
        c.classes = 80;
        c.heads[0].anchors.clear();
        assert!(c.validate("outputs[0].yolo", "p").unwrap_err().contains("anchors must list"));
    }
}
