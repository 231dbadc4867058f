//! Routing over several workers: the same three workers, sized 1×, 2× and 4× one memory budget
//! (`fleet::card_config`), the same mixed load of voice clips and images, through one gateway
//! per policy: `memory` (most free admission memory), `round_robin` and `least_in_flight`.
//! Prints, per policy and round: throughput (events a second from the gateway's start to the
//! last output, group join included), p50/p95 of the results' `timings_ms.total`, 503s met,
//! OOMs, completed calls per worker, results, dead letters, lost. Policies run in turn within
//! each round, so drift on a shared machine spreads over all of them. A benchmark that prints
//! figures: it asserts nothing.
//!
//! Knobs: `VRAMGATE_BENCH_WORKERS_EVENTS` (events per task per run, 200),
//! `VRAMGATE_BENCH_WORKERS_ROUNDS` (2). Run with `scripts/bench workers`.

use std::time::Duration;

use vramgate_tests::fleet::{run_load, start_cards};
use vramgate_tests::{env_or, scratch_dir};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let events: usize = env_or("VRAMGATE_BENCH_WORKERS_EVENTS", 200);
    let rounds: usize = env_or("VRAMGATE_BENCH_WORKERS_ROUNDS", 2);
    let root = scratch_dir("bench-workers");
    let cards = start_cards(&[1, 2, 4]).await?;
    let workers: Vec<_> = cards.iter().collect();
    eprintln!("workers 1x/2x/4x: {:?}", cards.iter().map(|w| w.url.as_str()).collect::<Vec<_>>());
    let mut table = Vec::new();
    for round in 1..=rounds {
        for routing in ["memory", "round_robin", "least_in_flight"] {
            let run = run_load(&workers, routing, events, &root, Duration::from_secs(900)).await?;
            run.print(&format!("round {round}"));
            table.push((round, run));
        }
    }
    println!(
        "\n{:>5} {:<16} {:>7} {:>9} {:>8} {:>8} {:>6} {:>5} {:>18} {:>7} {:>5} {:>4}",
        "round", "routing", "events", "events/s", "p50 ms", "p95 ms", "503s", "OOMs", "split 1x/2x/4x %", "results", "dead", "lost"
    );
    for (round, run) in &table {
        let split: Vec<String> = run.split().iter().map(|p| format!("{p:.0}")).collect();
        println!(
            "{:>5} {:<16} {:>7} {:>9.1} {:>8.0} {:>8.0} {:>6.0} {:>5.0} {:>18} {:>7} {:>5} {:>4}",
            round,
            run.routing,
            run.events,
            run.events as f64 / run.elapsed.as_secs_f64().max(1e-9),
            run.p50_ms,
            run.p95_ms,
            run.throttled(),
            run.ooms,
            split.join("/"),
            run.results,
            run.dead_letters.values().sum::<usize>(),
            run.lost
        );
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
