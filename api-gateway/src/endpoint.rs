//! The gateway's operations endpoint on `metrics_listen`: `GET /metrics` (the registry of
//! [`crate::metrics`], its gauges refreshed first), `/healthz` (the process answers) and
//! `/readyz` ([`crate::health`]'s report). It only reads the modules it serves.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;

use crate::health::Health;
use crate::metrics::Metrics;

/// Binds the metrics endpoint (with `/healthz` and `/readyz`) and serves it in the background.
/// Returns the bound address.
pub async fn serve(
    listen: &str,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    refresh: impl Fn() + Send + Sync + 'static,
) -> anyhow::Result<SocketAddr> {
    use anyhow::Context;
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding metrics on {listen}"))?;
    let addr = listener.local_addr()?;
    let refresh = Arc::new(refresh);
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                let refresh = refresh.clone();
                async move {
                    refresh();
                    metrics.render()
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let health = health.clone();
                async move {
                    let (ready, report) = health.report();
                    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
                    (status, axum::Json(report))
                }
            }),
        );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok(addr)
}
