//! A real Jaeger for the trace tests, started and stopped through `scripts/jaeger` on a port
//! of the test's own, so it never meets a Jaeger the user runs.

use crate::run_script;

/// A running Jaeger; stopped when dropped.
pub struct JaegerProcess {
    pub port: u16,
}

impl JaegerProcess {
    /// Starts Jaeger with its query API on `port` (OTLP/HTTP on `port - 16686 + 4318`).
    pub fn start(port: u16) -> anyhow::Result<Self> {
        let jaeger = JaegerProcess { port };
        jaeger.script("start")?;
        Ok(jaeger)
    }

    /// Starts it again after [`stop`](Self::stop), on the same ports.
    pub fn restart(&self) -> anyhow::Result<()> {
        self.script("start")
    }

    pub fn stop(&self) -> anyhow::Result<()> {
        self.script("stop")
    }

    /// The query API, e.g. for `vramgate_cli::jaeger::Jaeger`.
    pub fn query_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The OTLP/HTTP base URL the services export to.
    pub fn otlp_url(&self) -> String {
        format!("http://127.0.0.1:{}", u32::from(self.port) - 16686 + 4318)
    }

    fn script(&self, action: &str) -> anyhow::Result<()> {
        run_script("jaeger", &[action, "--port", &self.port.to_string()]).map(drop)
    }
}

impl Drop for JaegerProcess {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
