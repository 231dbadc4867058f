//! A chaos soak a user can run ([`vramgate_tests::chaos_soak`]): two gateways in exactly-once
//! delivery, mixed voice and image events with 5% hostile ones, a gateway, the worker or the
//! broker killed at random intervals, every event counted by `vramgate-cli load`. Prints what
//! was sent, results, dead letters, lost and duplicates for `read_committed`, redone outputs,
//! hanging transactions, the faults, and each service's resident memory. A benchmark that
//! prints figures: nothing is asserted (CI asserts on three minutes of it,
//! `tests/tests/gateway_chaos_soak.rs`).
//!
//! Knobs (environment): `VRAMGATE_CHAOS_SECONDS` (3600), `VRAMGATE_CHAOS_RATE` (events a second,
//! 20), `VRAMGATE_CHAOS_FAULT_EVERY` (seconds between faults, drawn from [S/2, 3S/2], 30),
//! `VRAMGATE_CHAOS_SEED` (the faults' order, 7), `VRAMGATE_CHAOS_GROUP_PROTOCOL` (the gateways'
//! `kafka.group_protocol`: `classic`, the default, or `consumer` for KIP-848),
//! `VRAMGATE_CHAOS_QUIET_SECONDS` (the last seconds of sending without a fault, so that the end
//! memory figures come from processes that have served that long: a sixth of the run, at most
//! 300). Run with `scripts/bench chaos`.

use vramgate_tests::chaos_soak::{run, Settings};
use vramgate_tests::env_or;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let seconds = env_or("VRAMGATE_CHAOS_SECONDS", 3600u64);
    let settings = Settings {
        seconds,
        rate: env_or("VRAMGATE_CHAOS_RATE", 20.0),
        fault_every: env_or("VRAMGATE_CHAOS_FAULT_EVERY", 30.0),
        quiet_seconds: env_or("VRAMGATE_CHAOS_QUIET_SECONDS", (seconds / 6).min(300)),
        seed: env_or("VRAMGATE_CHAOS_SEED", 7),
        group_protocol: match std::env::var("VRAMGATE_CHAOS_GROUP_PROTOCOL").as_deref() {
            Err(_) | Ok("classic") => "classic",
            Ok("consumer") => "consumer",
            Ok(other) => anyhow::bail!("VRAMGATE_CHAOS_GROUP_PROTOCOL is classic or consumer, not {other:?}"),
        },
    };
    let report = run(settings).await?;
    println!("\n{}", report.text());
    Ok(())
}
