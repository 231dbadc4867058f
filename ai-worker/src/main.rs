use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use vramgate_shared::telemetry;
use vramgate_worker::WorkerConfig;

/// vramgate ai-worker: TorchScript inference over the Open Inference Protocol v2.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// TOML config file; `VRAMGATE_WORKER_*` environment variables override it.
    #[arg(long, env = "VRAMGATE_WORKER_CONFIG")]
    config: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    // Before any thread exists: see its doc for why the allocator is tuned.
    vramgate_worker::memory::tune_allocator();
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(serve())
}

async fn serve() -> anyhow::Result<()> {
    let args = Args::parse();
    // The worker's own loader: the same layering, plus redaction of secrets and the checks
    // between keys (see `config`).
    let config = WorkerConfig::load(args.config.as_deref()).context("reading ai-worker config")?;
    let service = telemetry::Service { name: "ai-worker", version: env!("CARGO_PKG_VERSION"), log_spans: &["POST /v2/models/{model}/infer"] };
    let telemetry = telemetry::init(service, &config.telemetry);
    anyhow::ensure!(!config.models.is_empty(), "no models configured: add [[models]] to the config file");
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    let grpc = match config.grpc_listen {
        Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr} (grpc_listen)"))?),
        None => None,
    };
    // Tests and scripts read this line to learn the ports when listening on port 0:
    // `listening on HTTP-ADDR`, then ` grpc GRPC-ADDR` when gRPC is on.
    match &grpc {
        Some(g) => println!("listening on {} grpc {}", listener.local_addr()?, g.local_addr()?),
        None => println!("listening on {}", listener.local_addr()?),
    }
    let outcome = vramgate_worker::server::run(config, listener, grpc, vramgate_shared::shutdown::signal()).await;
    telemetry.shutdown();
    outcome
}
