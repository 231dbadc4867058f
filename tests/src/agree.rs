//! Comparing two results that should agree: the same structure, the same strings, booleans and
//! integers, and floating-point numbers within a tolerance.
//!
//! The worker batches requests as they come, so the same input can run alone in one request and
//! beside others in the next. On the CPU, libtorch picks its kernels by batch size and the sums in
//! a convolution add up in another order: a score of 0.0045837522 alone is 0.0045837569 in a batch
//! (seen in CI on 2026-12-01). Both are right; an exact comparison of two requests' floats tests
//! the batch they landed in, not the path their input took.

use serde_json::Value;

/// Absolute slack for floats, whatever their size.
pub const ABSOLUTE: f64 = 1e-6;
/// Slack relative to the larger of two floats.
pub const RELATIVE: f64 = 1e-4;

/// The first place where `left` and `right` disagree, by its JSON path, or `None` when they
/// agree: numbers that are both integers must be equal, other numbers within
/// [`ABSOLUTE`] + [`RELATIVE`] × the larger magnitude, everything else exactly.
pub fn difference(left: &Value, right: &Value) -> Option<String> {
    difference_within(left, right, ABSOLUTE, RELATIVE)
}

/// [`difference`] with the slack given: floats agree within `absolute` + `relative` × the larger
/// magnitude.
pub fn difference_within(left: &Value, right: &Value, absolute: f64, relative: f64) -> Option<String> {
    Walk { absolute, relative }.walk(left, right, "$")
}

struct Walk {
    absolute: f64,
    relative: f64,
}

impl Walk {
    fn walk(&self, left: &Value, right: &Value, path: &str) -> Option<String> {
        match (left, right) {
            (Value::Number(a), Value::Number(b)) => {
                if a.is_f64() || b.is_f64() {
                    let (x, y) = (a.as_f64()?, b.as_f64()?);
                    let slack = self.absolute + self.relative * x.abs().max(y.abs());
                    ((x - y).abs() > slack || x.is_nan() != y.is_nan()).then(|| format!("{path}: {x} against {y}"))
                } else {
                    (a != b).then(|| format!("{path}: {a} against {b}"))
                }
            }
            (Value::Array(a), Value::Array(b)) => {
                if a.len() != b.len() {
                    return Some(format!("{path}: {} items against {}", a.len(), b.len()));
                }
                a.iter()
                    .zip(b)
                    .enumerate()
                    .find_map(|(i, (x, y))| self.walk(x, y, &format!("{path}[{i}]")))
            }
            (Value::Object(a), Value::Object(b)) => {
                if let Some(key) = a.keys().chain(b.keys()).find(|key| !(a.contains_key(*key) && b.contains_key(*key))) {
                    return Some(format!("{path}.{key}: in one and not the other"));
                }
                a.iter().find_map(|(key, x)| self.walk(x, &b[key], &format!("{path}.{key}")))
            }
            _ => (left != right).then(|| format!("{path}: {left} against {right}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_ci_scores_of_one_photo_alone_and_in_a_batch_agree() {
        let alone = json!({"top_k": [[{"index": 925, "score": 0.0045837522484362125}]], "shape": [1]});
        let batched = json!({"top_k": [[{"index": 925, "score": 0.004583756905049086}]], "shape": [1]});
        assert_eq!(difference(&alone, &batched), None);
    }

    #[test]
    fn a_real_difference_is_named_by_its_path() {
        let a = json!({"top_k": [[{"index": 925, "score": 0.0046}]]});
        let score = json!({"top_k": [[{"index": 925, "score": 0.0047}]]});
        let index = json!({"top_k": [[{"index": 926, "score": 0.0046}]]});
        let extra = json!({"top_k": [[{"index": 925, "score": 0.0046}], []]});
        let text = json!({"top_k": "none"});
        assert_eq!(
            difference(&a, &score).as_deref(),
            Some("$.top_k[0][0].score: 0.0046 against 0.0047")
        );
        assert_eq!(difference(&a, &index).as_deref(), Some("$.top_k[0][0].index: 925 against 926"));
        assert_eq!(difference(&a, &extra).as_deref(), Some("$.top_k: 1 items against 2"));
        assert!(difference(&a, &text).is_some());
        assert_eq!(
            difference(&json!({"a": 1}), &json!({"b": 1})).as_deref(),
            Some("$.a: in one and not the other")
        );
    }

    #[test]
    fn integers_are_exact_and_large_floats_get_relative_slack() {
        assert!(difference(&json!(400), &json!(401)).is_some());
        assert_eq!(difference(&json!(1000.0), &json!(1000.05)), None);
        assert!(difference(&json!(1000.0), &json!(1000.2)).is_some());
    }
}
