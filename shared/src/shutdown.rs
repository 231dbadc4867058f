//! The signal both services stop on: SIGTERM (what Kubernetes and `docker stop` send) or
//! SIGINT (Ctrl-C).

/// Resolves on the first SIGTERM or SIGINT. If the SIGTERM handler cannot be installed the
/// process still stops on Ctrl-C, and the failure is logged rather than fatal.
pub async fn signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops this process");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
    tracing::info!("shutdown requested");
}
