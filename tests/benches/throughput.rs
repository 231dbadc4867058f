//! Throughput benchmark: P4 (the gateway vs a raw librdkafka consumer on 100k tiny events) and
//! P2 (raw libtorch loop → worker → whole pipeline), measured side by side in one run; what
//! each measures is in `vramgate_tests::bench::throughput`. Prints figures and ratios; asserts
//! nothing about speed.
//!
//! Run with `scripts/bench throughput` (or `cargo bench -p vramgate-tests --bench throughput`;
//! the P2 part needs `cargo build --release --examples` for the raw loop). Set
//! `VRAMGATE_BENCH_PARTS=p4` or `p2` to run one part.

use vramgate_tests::bench::throughput::{p2, p4, print_p2, print_p4};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let parts = std::env::var("VRAMGATE_BENCH_PARTS").unwrap_or_else(|_| "p2,p4".into());
    if parts.contains("p4") {
        print_p4(&p4().await?);
    }
    if parts.contains("p2") {
        print_p2(&p2().await?);
    }
    Ok(())
}
