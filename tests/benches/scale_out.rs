//! Rebalance pauses per consumer group protocol: gateways added and removed one at a time
//! (1 → 2 → 3 → 2 → 1) over a backlog of voice events (`vramgate_tests::scale`), with
//! `kafka.group_protocol` `classic` (cooperative-sticky) and `consumer` (KIP-848), side by side
//! in each round (odd rounds in the reverse order). Printed: for each step, the longest time
//! no new output was read after it, the median over rounds, per protocol and delivery mode.
//! Figures only; nothing is asserted about speed.
//!
//! Knobs (environment): `VRAMGATE_BENCH_SCALE_EVENTS` (default 20,000),
//! `VRAMGATE_BENCH_SCALE_DELIVERY` (default `exactly-once,at-least-once`),
//! `VRAMGATE_BENCH_SCALE_PROTOCOLS` (default `classic,consumer`),
//! `VRAMGATE_BENCH_ROUNDS` (default 2). Run with `scripts/bench scale-out`.

use vramgate_tests::bench::median;
use vramgate_tests::scale::scale_out;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let events: usize = std::env::var("VRAMGATE_BENCH_SCALE_EVENTS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let rounds: usize = std::env::var("VRAMGATE_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let deliveries = std::env::var("VRAMGATE_BENCH_SCALE_DELIVERY").unwrap_or_else(|_| "exactly-once,at-least-once".into());
    let protocols: Vec<String> = std::env::var("VRAMGATE_BENCH_SCALE_PROTOCOLS")
        .unwrap_or_else(|_| "classic,consumer".into())
        .split(',')
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect();
    let mut table = Vec::new();
    for delivery in deliveries.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        // Per protocol, per step: the pauses of every round; and the wall times.
        let mut pauses: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); 4]; protocols.len()];
        let mut walls: Vec<Vec<f64>> = vec![Vec::new(); protocols.len()];
        let mut labels: Vec<String> = Vec::new();
        for round in 0..rounds {
            let mut order: Vec<usize> = (0..protocols.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for p in order {
                let run = scale_out(&protocols[p], delivery, events).await?;
                eprintln!(
                    "round {round}, {}, {delivery}: {:.1} s, lost {}, doubled {}; {:?}",
                    protocols[p],
                    run.wall.as_secs_f64(),
                    run.tally.lost.len(),
                    run.tally.duplicated.len(),
                    run.pauses
                );
                eprintln!("  the last gateway: {}", run.state);
                walls[p].push(run.wall.as_secs_f64());
                for (i, (label, pause)) in run.pauses.iter().enumerate().take(4) {
                    pauses[p][i].push(pause.as_secs_f64() * 1000.0);
                    if labels.len() <= i {
                        labels.push(label.clone());
                    }
                }
            }
        }
        for (p, protocol) in protocols.iter().enumerate() {
            let steps: Vec<String> = labels
                .iter()
                .enumerate()
                .map(|(i, label)| format!("{label} {:.0} ms", median(&pauses[p][i])))
                .collect();
            table.push(format!(
                "| {protocol} | {delivery} | {:.1} | {} |",
                median(&walls[p]),
                steps.join("; ")
            ));
        }
    }
    println!("\nscale-out, {events} events, median of {rounds} rounds: the longest gap in outputs read after each step");
    println!("| protocol | delivery | wall s | gap after each step |\n|---|---|---|---|");
    for row in table {
        println!("{row}");
    }
    Ok(())
}
