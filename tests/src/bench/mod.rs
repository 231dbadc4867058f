//! The pipeline benchmark's parts as library functions that return figures: P1 (admission by
//! bytes vs static limits), P2 and P4 (each stage beside its ceiling). The benches in
//! `tests/benches/` print them: `admission` and `throughput` one part each, `pipeline` all of
//! them side by side in one run with one table of ratios.

pub mod admission;
pub mod request_path;
pub mod throughput;

/// The median of the figures that are numbers (the mean of the middle two for an even count);
/// NaN when there are none.
pub fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}
