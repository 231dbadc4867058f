//! Admission benchmark (P1): byte admission vs static count limits on a variable-size burst;
//! what it measures is in `vramgate_tests::bench::admission`. Prints throughput, OOMs,
//! failures and peak memory per run, then the ratios; asserts nothing about speed.
//!
//! Run with `scripts/bench admission` (or `cargo bench -p vramgate-tests --bench admission`).

use vramgate_tests::bench::admission::{p1, print_p1};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    print_p1(&p1().await?);
    Ok(())
}
