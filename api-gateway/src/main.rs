use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use vramgate_gateway::GatewayConfig;
use vramgate_shared::telemetry;

/// mimalloc rather than glibc's allocator: each record makes a few dozen short-lived
/// allocations (the message copy, its JSON, the output and its headers), and glibc's spent
/// about a fifth of the gateway's CPU on them (`_int_malloc`, `_int_free`,
/// `malloc_consolidate` in a profile of 100k records); see docs/performance-notes.md.
/// Counted, for `vramgate_gateway_allocator_bytes{allocator="rust",state="in_use"}`.
#[global_allocator]
static ALLOCATOR: vramgate_gateway::memory::Counted<mimalloc::MiMalloc> =
    vramgate_gateway::memory::Counted::new(mimalloc::MiMalloc);

/// vramgate api-gateway: Kafka request events in, results and dead letters out.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// TOML config file; `VRAMGATE_GATEWAY_*` environment variables override it.
    #[arg(long, env = "VRAMGATE_GATEWAY_CONFIG")]
    config: Option<PathBuf>,
}

/// Threads of tokio's blocking pool (tokio's own default is 512). The gateway's blocking calls
/// are `file://` reads, one readiness metadata request at a time and the joins of its three
/// Kafka threads. A backlog after a broker restart or a gateway's start used to open one
/// thread per record it held (over 500 seen), each with its own stack and allocator heap,
/// and resident memory stayed past the drain; past this bound the reads queue, within their
/// `input.read_timeout_seconds`.
const MAX_BLOCKING_THREADS: usize = 32;

fn main() -> anyhow::Result<()> {
    // Before the runtime's threads and the first backlog: `memory::no_transparent_huge_pages`.
    let huge_pages_off = vramgate_gateway::memory::no_transparent_huge_pages();
    // And freed pages given back at once: `memory::purge_promptly`.
    let purge_delay_ms = vramgate_gateway::memory::purge_promptly();
    let args = Args::parse();
    let config: GatewayConfig =
        vramgate_shared::config::load(args.config.as_deref(), "VRAMGATE_GATEWAY_")
            .context("reading api-gateway config")?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .on_thread_park(vramgate_gateway::memory::collect_on_park)
        .build()
        .context("starting the async runtime")?
        .block_on(serve(config, huge_pages_off, purge_delay_ms))
}

async fn serve(config: GatewayConfig, huge_pages_off: bool, purge_delay_ms: Option<i64>) -> anyhow::Result<()> {
    let service = telemetry::Service { name: "api-gateway", version: env!("CARGO_PKG_VERSION"), log_spans: &["process"] };
    let telemetry = telemetry::init(service, &config.telemetry);
    if !huge_pages_off {
        tracing::warn!("transparent huge pages stay on (prctl PR_SET_THP_DISABLE refused): resident memory may stay high after a backlog");
    }
    match purge_delay_ms {
        Some(ms) => tracing::debug!(purge_delay_ms = ms, "mimalloc gives freed pages back after this delay"),
        None => tracing::info!("mimalloc's purge delay left as it is (MIMALLOC_PURGE_DELAY set, or not mimalloc v3)"),
    }
    let outcome = vramgate_gateway::pipeline::run(config, vramgate_shared::shutdown::signal()).await;
    // The spans of the last records and the drain, before the process goes.
    telemetry.shutdown();
    outcome
}
