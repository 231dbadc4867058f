//! The pipeline benchmark's parts as library functions that return figures: P1 (admission by
//! bytes vs static limits), P2 and P4 (each stage beside its ceiling). The benches in
//! `tests/benches/` print them: `admission` and `throughput` one part each, `pipeline` all of
//! them side by side in one run with one table of ratios.

pub mod admission;
pub mod throughput;
