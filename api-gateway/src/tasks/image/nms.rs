//! Greedy non-maximum suppression, the one the image task's two modes share: the cascade's
//! stages (`mtcnn`) and the proposals (`faces`).

/// A box with a score, as suppression sees it: `[x1, y1, x2, y2]`.
pub trait Scored {
    fn corners(&self) -> [f32; 4];
    fn score(&self) -> f32;
}

/// How two boxes' overlap is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    /// Intersection over union, areas `(x2 - x1)·(y2 - y1)` (torchvision's `nms`).
    Union,
    /// Intersection over the smaller area, with `+ 1` on each side (MTCNN's reference
    /// `nms_numpy(…, 'Min')`).
    Min,
}

impl Overlap {
    pub fn of(self, a: [f32; 4], b: [f32; 4]) -> f32 {
        let one = if self == Overlap::Min { 1.0 } else { 0.0 };
        let area = |r: [f32; 4]| (r[2] - r[0] + one) * (r[3] - r[1] + one);
        let w = (a[2].min(b[2]) - a[0].max(b[0]) + one).max(0.0);
        let h = (a[3].min(b[3]) - a[1].max(b[1]) + one).max(0.0);
        let inter = w * h;
        match self {
            Overlap::Union => inter / (area(a) + area(b) - inter),
            Overlap::Min => inter / area(a).min(area(b)),
        }
    }
}

/// The indices of the boxes kept, highest score first: boxes in order of score (stable, so
/// equal scores keep their order and results are reproducible), each kept when its overlap
/// with every box already kept is at most `threshold` (a NaN overlap is not), until `limit` are
/// kept. Each box is compared only with those kept, so a map full of candidates costs
/// `boxes × limit`, not `boxes²`.
pub fn keep<T: Scored>(boxes: &[T], threshold: f32, overlap: Overlap, limit: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..boxes.len()).collect();
    order.sort_by(|&a, &b| boxes[b].score().total_cmp(&boxes[a].score()));
    let mut kept: Vec<usize> = Vec::with_capacity(limit.min(boxes.len()));
    for i in order {
        if kept.len() >= limit {
            break;
        }
        let corners = boxes[i].corners();
        if kept.iter().all(|&k| overlap.of(boxes[k].corners(), corners) <= threshold) {
            kept.push(i);
        }
    }
    kept
}

/// [`keep`], returning the boxes themselves.
pub fn suppress<T: Scored + Copy>(boxes: &[T], threshold: f32, overlap: Overlap, limit: usize) -> Vec<T> {
    keep(boxes, threshold, overlap, limit).into_iter().map(|i| boxes[i]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq)]
    struct B([f32; 4], f32);

    impl Scored for B {
        fn corners(&self) -> [f32; 4] {
            self.0
        }
        fn score(&self) -> f32 {
            self.1
        }
    }

    #[test]
    fn by_union_and_by_the_smaller_box_highest_first_up_to_the_limit() {
        let a = B([0.0, 0.0, 10.0, 10.0], 0.9);
        let inner = B([2.0, 2.0, 7.0, 7.0], 0.8);
        let apart = B([20.0, 20.0, 30.0, 30.0], 0.7);
        // IoU of `inner` with `a` is 0.25: kept by union; by the smaller box it is 1: dropped.
        assert_eq!(suppress(&[inner, a, apart], 0.7, Overlap::Union, usize::MAX), vec![a, inner, apart]);
        assert_eq!(suppress(&[inner, a, apart], 0.7, Overlap::Min, usize::MAX), vec![a, apart]);
        assert_eq!(suppress(&[inner, a, apart], 0.7, Overlap::Union, 2), vec![a, inner]);
        assert!((Overlap::Union.of(a.0, inner.0) - 0.25).abs() < 1e-6);
        let nan = B([f32::NAN, 0.0, 1.0, 1.0], 0.5);
        assert_eq!(suppress(&[a, nan], 0.7, Overlap::Union, usize::MAX), vec![a]);
    }
}
