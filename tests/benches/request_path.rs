//! The worker's request path against a bare HTTP server and a plain libtorch loop, on a null
//! model of P-Net's shapes (`vramgate_tests::bench::request_path` says what each side is).
//! Figures only; nothing is asserted about speed.
//!
//! ```text
//! scripts/bench request-path
//! ```
//!
//! Knobs (environment): `VRAMGATE_BENCH_CONCURRENCY` (default `1,4,16,64`),
//! `VRAMGATE_BENCH_SECONDS` (per figure, default 4), `VRAMGATE_BENCH_ROUNDS` (default 2, each
//! side's best counts).

use vramgate_tests::bench::request_path::{print, run, Options};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let options = Options::from_env();
    println!(
        "request path: null model of P-Net's 480² shapes; worker vs bare axum server, in flight {:?}, {} s a figure, best of {} rounds",
        options.concurrency, options.seconds, options.rounds
    );
    let (raw, rows) = run(&options).await?;
    print(raw, &rows);
    Ok(())
}
