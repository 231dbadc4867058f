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
    // Tests and scripts read this line to learn the port when listening on port 0.
    println!("listening on {}", listener.local_addr()?);
    let outcome = vramgate_worker::server::run(config, listener, vramgate_shared::shutdown::signal()).await;
    telemetry.shutdown();
    outcome
}
