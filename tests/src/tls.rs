//! The test broker's TLS listeners (`scripts/broker start --tls`): an SSL listener that
//! requires a client certificate and a SASL_SSL listener with SCRAM-SHA-512, both signed by a
//! throwaway CA. `VRAMGATE_TEST_TLS_ENV` may name another broker's `listeners.env`; otherwise
//! the test broker's own port is started (or found running) with `--tls`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use rdkafka::ClientConfig;

use crate::{brokers, repo_root};

/// What `scripts/broker start --tls` wrote to `run-PORT/tls/listeners.env`.
#[derive(Clone)]
pub struct TlsBroker {
    /// The CA that signed the broker's (and the client's) certificate.
    pub ca: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// `host:port` of the mTLS listener.
    pub ssl: String,
    /// `host:port` of the SASL_SSL listener.
    pub sasl_ssl: String,
    pub mechanism: String,
    pub user: String,
    pub password: String,
}

/// The TLS listeners of the test broker; starts them on first use.
pub fn tls_broker() -> &'static TlsBroker {
    static TLS: OnceLock<TlsBroker> = OnceLock::new();
    TLS.get_or_init(|| {
        let env_file = match std::env::var_os("VRAMGATE_TEST_TLS_ENV") {
            Some(path) => PathBuf::from(path),
            None => {
                let plaintext = brokers();
                let port = plaintext.rsplit(':').next().expect("host:port").to_string();
                let status = Command::new(repo_root().join("scripts/broker"))
                    .args(["start", "--port", &port, "--tls"])
                    .status()
                    .expect("running scripts/broker");
                assert!(status.success(), "scripts/broker start --port {port} --tls failed (its reason is above)");
                repo_root().join(format!(".local/kafka/run-{port}/tls/listeners.env"))
            }
        };
        let text = std::fs::read_to_string(&env_file)
            .unwrap_or_else(|e| panic!("reading {}: {e}", env_file.display()));
        let vars: HashMap<&str, &str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split_once('='))
            .collect();
        let get = |k: &str| vars.get(k).unwrap_or_else(|| panic!("{} has no {k}", env_file.display())).to_string();
        TlsBroker {
            ca: get("VRAMGATE_KAFKA_TLS_CA").into(),
            client_cert: get("VRAMGATE_KAFKA_TLS_CLIENT_CERT").into(),
            client_key: get("VRAMGATE_KAFKA_TLS_CLIENT_KEY").into(),
            ssl: get("VRAMGATE_KAFKA_SSL"),
            sasl_ssl: get("VRAMGATE_KAFKA_SASL_SSL"),
            mechanism: get("VRAMGATE_KAFKA_SCRAM_MECHANISM"),
            user: get("VRAMGATE_KAFKA_SCRAM_USER"),
            password: get("VRAMGATE_KAFKA_SCRAM_PASSWORD"),
        }
    })
}

impl TlsBroker {
    /// librdkafka properties for the SASL_SSL listener, with `password`.
    pub fn sasl_ssl_properties(&self, password: &str) -> Vec<(&'static str, String)> {
        vec![
            ("security.protocol", "SASL_SSL".into()),
            ("sasl.mechanism", self.mechanism.clone()),
            ("sasl.username", self.user.clone()),
            ("sasl.password", password.to_string()),
            ("ssl.ca.location", self.ca.display().to_string()),
        ]
    }

    /// librdkafka properties for the mTLS listener.
    pub fn mtls_properties(&self) -> Vec<(&'static str, String)> {
        vec![
            ("security.protocol", "SSL".into()),
            ("ssl.ca.location", self.ca.display().to_string()),
            ("ssl.certificate.location", self.client_cert.display().to_string()),
            ("ssl.key.location", self.client_key.display().to_string()),
        ]
    }

    /// A client config for the SASL_SSL listener with the right password.
    pub fn sasl_ssl_client(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.sasl_ssl);
        for (k, v) in self.sasl_ssl_properties(&self.password) {
            c.set(k, v);
        }
        c
    }
}
