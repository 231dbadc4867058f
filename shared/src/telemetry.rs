//! Logging set-up shared by both services.
//!
//! Logs go to stderr through `tracing`; `RUST_LOG` filters them (default `info`), and
//! `VRAMGATE_LOG_FORMAT=json` switches to one JSON object per line for log shippers.
//! Trace export over OTLP is not built yet: spans exist but stay in-process.

use tracing_subscriber::{fmt, EnvFilter};

/// Installs the global subscriber. Safe to call twice (the second call does nothing), so
/// library code started from tests can call it too.
pub fn init(service: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("VRAMGATE_LOG_FORMAT").is_ok_and(|v| v == "json");
    let result = if json {
        fmt().with_env_filter(filter).with_writer(std::io::stderr).json().try_init()
    } else {
        fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init()
    };
    if result.is_ok() {
        tracing::debug!(service, "logging initialised");
    }
}
