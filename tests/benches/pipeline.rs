//! The pipeline benchmark (`scripts/bench-pipeline`): P2 (raw libtorch loop → worker direct →
//! whole pipeline through Kafka, both models), P4 (the gateway's no-op path vs a raw librdkafka
//! consumer on 100k tiny events, CPU per 1,000 records, RSS under the backlog vs the byte
//! bound) and P1 (byte admission vs static limits, OOMs), measured one after another in one
//! run on the same machine and broker, each part's own figures printed, then one table of the
//! ratios with their goals. What each part measures: `vramgate_tests::bench`. Figures only;
//! nothing is asserted about speed.
//!
//! Knobs: those of the parts (`VRAMGATE_BENCH_EVENTS`, `VRAMGATE_BENCH_PIPELINE_EVENTS`,
//! `VRAMGATE_BENCH_REQUESTS`, …) and `VRAMGATE_BENCH_PARTS` (default `p1,p2,p4`).

use vramgate_tests::bench::admission::{p1, print_p1};
use vramgate_tests::bench::throughput::{p2, p4, print_p2, print_p4};

const MIB: f64 = (1u64 << 20) as f64;

/// One line of the ratio table.
fn line(stage: &str, figure: String, ceiling: String, ratio: Option<f64>, goal: &str) {
    let ratio = ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}"));
    println!("{stage:<44} {figure:>22} {ceiling:>22} {ratio:>7}  {goal}");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let parts = std::env::var("VRAMGATE_BENCH_PARTS").unwrap_or_else(|_| "p1,p2,p4".into());
    let p2 = if parts.contains("p2") { Some(p2().await?) } else { None };
    if let Some(rows) = &p2 {
        print_p2(rows);
    }
    let p4 = if parts.contains("p4") { Some(p4().await?) } else { None };
    if let Some(p4) = &p4 {
        print_p4(p4);
    }
    let p1 = if parts.contains("p1") { Some(p1().await?) } else { None };
    if let Some(p1) = &p1 {
        print_p1(p1);
    }

    println!();
    println!(
        "Pipeline benchmark, one run, {} CPU cores; figure and ceiling in the stage's unit",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("{:<44} {:>22} {:>22} {:>7}  goal", "stage", "figure", "ceiling", "ratio");
    for r in p2.iter().flatten() {
        let unit = r.unit.trim_end_matches("/s");
        line(&format!("P2 worker direct / raw loop, {}", r.label), format!("{:.1} {unit}/s", r.direct), format!("{:.1}", r.raw), Some(r.direct / r.raw), "≥ 0.9");
        line(&format!("P2 pipeline / worker direct, {}", r.label), format!("{:.1} {unit}/s", r.pipeline), format!("{:.1}", r.direct), Some(r.pipeline / r.direct), "≥ 0.9");
    }
    if let Some(all) = &p4 {
        let p4 = &all.median;
        let gw = &p4.gateway;
        line("P4 gateway / raw librdkafka consume (median)", format!("{:.0} records/s", gw.rate), format!("{:.0}", p4.raw), Some(gw.rate / p4.raw), "≥ 0.5");
        let relay = p4.relay.0;
        line("P4 raw relay / raw consume (the path's own)", format!("{relay:.0} records/s"), format!("{:.0}", p4.raw), Some(relay / p4.raw), "");
        let parallel = p4.relay_parallel.0;
        line("P4 raw relay, thread per partition / raw", format!("{parallel:.0} records/s"), format!("{:.0}", p4.raw), Some(parallel / p4.raw), "");
        line("P4 gateway / raw relay", format!("{:.0} records/s", gw.rate), format!("{relay:.0}"), Some(gw.rate / relay), "");
        let raw_cpu = p4.raw_cpu / p4.count as f64 * 1000.0;
        line("P4 CPU s / 1000 records (gateway, raw)", format!("{:.3}", gw.cpu_per_1000), format!("{raw_cpu:.3}"), None, "");
        line(
            "P4 gateway peak RSS / byte bound (100k)",
            format!("{:.0} MiB", gw.peak_rss as f64 / MIB),
            format!("{:.0} MiB", gw.bound as f64 / MIB),
            Some(gw.peak_rss as f64 / gw.bound as f64),
            "≤ 1",
        );
        line("P4 lost (sent − dead letters, all rounds, warm-up included)", format!("{}", all.lost()), String::new(), None, "0");
    }
    if let Some(p1) = &p1 {
        let (c, a) = (&p1.bytes, &p1.safe);
        line("P1 bytes / static count safe for largest", format!("{:.2} images/s", c.throughput()), format!("{:.2}", a.throughput()), Some(c.throughput() / a.throughput()), "≥ 1.5");
        match p1.best_static() {
            Some(best) => line(
                &format!("P1 bytes / best static {}", best.label.trim_start_matches("(b) ")),
                format!("{:.2} images/s", c.throughput()),
                format!("{:.2}", best.throughput()),
                Some(c.throughput() / best.throughput()),
                "≥ 0.9",
            ),
            None => line("P1 bytes / best static count", format!("{:.2} images/s", c.throughput()), "none lost nothing".into(), None, "≥ 0.9"),
        }
        let lost = |r: &vramgate_tests::bench::admission::Run| format!("{} failed{}", r.failed, if r.crashed { ", crashed" } else { "" });
        line("P1 requests lost: bytes (safe static count)", lost(c), lost(a), None, "0");
        line("P1 OOMs: bytes (safe static count)", format!("{}", c.ooms), format!("{}", a.ooms), None, "0");
    }
    Ok(())
}
