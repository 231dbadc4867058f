//! Worker vs raw libtorch: each model and input through a plain libtorch loop and through the
//! real worker over OIP at concurrency 1 and 8, printed as a table with the worker/raw ratios
//! (see `vramgate_tests::ceiling` for how each side is measured). Figures only; nothing is
//! asserted about speed.
//!
//! Needs the worker binary and the raw loop example:
//!
//! ```text
//! cargo build --release -p vramgate-worker --bins --examples
//! cargo bench -p vramgate-tests --bench ceiling
//! ```
//!
//! Knobs (environment): `VRAMGATE_BENCH_SECONDS` (per figure, default 4),
//! `VRAMGATE_BENCH_ROUNDS` (default 2, best counts), `VRAMGATE_BENCH_CONCURRENCY` (default
//! `1,8`), `VRAMGATE_BENCH_MODELS` (default `pnet,vad`), `VRAMGATE_BENCH_PNET_SIZES` (default
//! `160x160,320x320,480x640`), `VRAMGATE_BENCH_BUSY_RAW` (`0` leaves
//! out the raw loop timed again with one more CPU kept busy, a diagnostic of how much work
//! beside the model slows it on this machine; default on).

use vramgate_tests::ceiling::{print_table, worker_vs_raw, CeilingOptions};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let options = CeilingOptions::from_env();
    println!(
        "worker vs raw libtorch: {} cases, concurrency {:?}, {} s per figure, best of {} rounds, {} torch thread(s)",
        options.cases.len(),
        options.concurrency,
        options.seconds,
        options.rounds,
        options.torch_threads
    );
    let rows = worker_vs_raw(&options).await?;
    print_table(&rows);
    Ok(())
}
