//! How vramgate's processes reach Kafka: bootstrap servers plus librdkafka properties (TLS,
//! SASL, tuning), laid over each client's own defaults, and client creation whose errors never
//! show a secret's value.
//!
//! Built only with this crate's `kafka` feature, which the gateway and `vramgate-cli` turn on:
//! the worker and users' own producers get no Kafka client from this crate.
//!
//! Properties come from the gateway's `[kafka.properties]` table, from its environment
//! (`VRAMGATE_GATEWAY_KAFKA__PROPERTIES__SASL_PASSWORD` for `sasl.password`: a name without a
//! dot reads its underscores as dots, since librdkafka's names have none), and for
//! `vramgate-cli` from `--kafka-property` and a `--kafka-config` file. Values of keys that name
//! a secret ([`crate::config::is_secret_key`]: `sasl.password`, `ssl.key.password`,
//! `ssl.key.pem`, …) are hidden from `Debug` and from client-creation errors.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use rdkafka::config::{FromClientConfig, FromClientConfigAndContext};
use rdkafka::error::KafkaError;
use rdkafka::{ClientConfig, ClientContext};
use serde::{Deserialize, Serialize};
use crate::config::is_secret_key;

/// Largest `--kafka-config` file read: a client properties file is a few dozen lines; a larger
/// one is the wrong file.
pub const MAX_PROPERTIES_FILE_BYTES: u64 = 1024 * 1024;

/// librdkafka properties by their librdkafka names, e.g. `security.protocol`. `Debug` shows
/// the value of a secret key as `<hidden>`.
#[derive(Clone, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Properties(BTreeMap<String, String>);

impl Properties {
    /// Sets `key` (in either form: `sasl.password` or `sasl_password`) to `value`.
    pub fn insert(&mut self, key: &str, value: impl Into<String>) {
        self.0.insert(librdkafka_name(key), value.into());
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Reads a Java-style client properties file (`key=value` lines, `#` and `!` comments),
    /// the form Kafka's own tools take with `--command-config`. Errors name the line, never
    /// its value.
    pub fn read_file(&mut self, path: &Path) -> anyhow::Result<()> {
        let size = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?.len();
        anyhow::ensure!(
            size <= MAX_PROPERTIES_FILE_BYTES,
            "{} has {size} bytes; a client properties file has at most {MAX_PROPERTIES_FILE_BYTES}",
            path.display()
        );
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with('!') {
                continue;
            }
            let (key, value) = split_property(line)
                .with_context(|| format!("{} line {}: expected key=value", path.display(), n + 1))?;
            self.insert(key, value);
        }
        Ok(())
    }

    /// Adds one `key=value` (the CLI's `--kafka-property`).
    pub fn insert_pair(&mut self, pair: &str) -> anyhow::Result<()> {
        let (key, value) = split_property(pair).context("a kafka property is key=value, e.g. security.protocol=SSL")?;
        self.insert(key, value);
        Ok(())
    }
}

fn split_property(line: &str) -> Option<(&str, &str)> {
    let (key, value) = line.split_once('=')?;
    let key = key.trim();
    (!key.is_empty()).then_some((key, value.trim()))
}

/// The librdkafka name of a property key: a key without a dot is taken to be in the
/// environment's form, its underscores standing for dots (`ssl_ca_location`).
pub fn librdkafka_name(key: &str) -> String {
    if key.contains('.') {
        key.to_string()
    } else {
        key.to_ascii_lowercase().replace('_', ".")
    }
}

impl std::fmt::Debug for Properties {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(k, v)| (k, if is_secret_key(k) { "<hidden>" } else { v.as_str() })))
            .finish()
    }
}

/// Values may be strings, numbers or booleans, all kept as text (a numeric `sasl.password` is
/// a password); a nested table is flattened with dots, since an environment name with dots
/// (`…__PROPERTIES__sasl.password`, as Kubernetes allows) arrives nested.
impl<'de> Deserialize<'de> for Properties {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Value {
            Text(String),
            Int(i64),
            Float(f64),
            Bool(bool),
            Table(BTreeMap<String, Value>),
        }
        fn flatten(prefix: &str, table: BTreeMap<String, Value>, out: &mut Properties) {
            for (key, value) in table {
                let key = if prefix.is_empty() { key } else { format!("{prefix}.{key}") };
                let text = match value {
                    Value::Text(s) => s,
                    Value::Int(i) => i.to_string(),
                    Value::Float(x) => x.to_string(),
                    Value::Bool(b) => b.to_string(),
                    Value::Table(inner) => {
                        flatten(&key, inner, out);
                        continue;
                    }
                };
                out.insert(&key, text);
            }
        }
        let mut out = Properties::default();
        flatten("", BTreeMap::<String, Value>::deserialize(d)?, &mut out);
        Ok(out)
    }
}

/// Where a process's Kafka clients connect, and with which extra properties.
#[derive(Debug, Clone)]
pub struct Connection {
    pub brokers: String,
    pub properties: Properties,
}

impl Connection {
    /// A client's own `defaults` with the bootstrap servers and then the properties over them
    /// (the properties win, so an operator can override any default).
    pub fn client_config(&self, mut defaults: ClientConfig) -> ClientConfig {
        defaults.set("bootstrap.servers", &self.brokers);
        for (k, v) in self.properties.iter() {
            defaults.set(k, v);
        }
        defaults
    }

    /// Creates a client from `defaults` ([`Connection::client_config`]); `what` names it in
    /// errors ("the kafka producer").
    pub fn create<T: FromClientConfig>(&self, defaults: ClientConfig, what: &str) -> anyhow::Result<T> {
        self.client_config(defaults).create().map_err(|e| creation_error(e, what))
    }

    /// [`Connection::create`] with a client context.
    pub fn create_with_context<C: ClientContext, T: FromClientConfigAndContext<C>>(
        &self,
        defaults: ClientConfig,
        context: C,
        what: &str,
    ) -> anyhow::Result<T> {
        self.client_config(defaults).create_with_context(context).map_err(|e| creation_error(e, what))
    }
}

/// How long `vramgate-cli` waits for the brokers to answer before it says it cannot reach them.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// Fails, saying what to check, when the brokers do not answer a metadata request within
/// `timeout`: a wrong address, TLS setting or password would otherwise leave a client waiting
/// for its first delivery or message (librdkafka logs its own reason, e.g. "SASL authentication
/// error", as it goes).
pub fn check_reachable<C: ClientContext>(
    client: &rdkafka::client::Client<C>,
    brokers: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    client.fetch_metadata(None, timeout).map(drop).map_err(|e| {
        anyhow::anyhow!(
            "no answer from the Kafka brokers at {brokers} within {timeout:?} ({e}): check the address, \
             and the TLS and SASL settings (--kafka-config, --kafka-property); librdkafka's reason is logged above"
        )
    })
}

/// rdkafka's config errors carry the refused value; for a secret key that value is the secret.
fn creation_error(error: KafkaError, what: &str) -> anyhow::Error {
    match error {
        KafkaError::ClientConfig(_, description, key, value) if is_secret_key(&key) => {
            let description =
                if value.is_empty() { description } else { description.replace(&value, "<hidden>") };
            anyhow::anyhow!("creating {what}: librdkafka refused the value of {key} (not shown: it is a secret): {description}")
        }
        KafkaError::ClientConfig(_, description, key, value) => {
            anyhow::anyhow!("creating {what}: librdkafka refused {key} = {value:?}: {description}")
        }
        other => anyhow::Error::new(other).context(format!("creating {what}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use figment::providers::Format as _;
    use rdkafka::producer::BaseProducer;

    /// The error of creating a producer, which must fail.
    fn refused(connection: &Connection, defaults: ClientConfig) -> String {
        match connection.create::<BaseProducer>(defaults, "the kafka producer") {
            Ok(_) => panic!("librdkafka accepted the config"),
            Err(e) => format!("{e:#} {e:?}"),
        }
    }

    fn properties(toml_text: &str) -> Properties {
        #[derive(Deserialize)]
        struct Wrap {
            p: Properties,
        }
        let wrap: Wrap = figment::Figment::from(figment::providers::Toml::string(toml_text)).extract().expect("parses");
        wrap.p
    }

    #[test]
    fn names_in_either_form_and_nested_tables_reach_librdkafka_names() {
        let p = properties("[p]\nsasl_password = 123\nSSL_CA_LOCATION = \"/ca.pem\"\n\"linger.ms\" = 7\n[p.sasl]\nmechanism = \"SCRAM-SHA-512\"\n");
        let got: Vec<(&str, &str)> = p.iter().collect();
        assert_eq!(
            got,
            [("linger.ms", "7"), ("sasl.mechanism", "SCRAM-SHA-512"), ("sasl.password", "123"), ("ssl.ca.location", "/ca.pem")]
        );
        // librdkafka's own names with an underscore (API-only ones) are left as they are.
        assert_eq!(librdkafka_name("ssl.certificate.verify_cb"), "ssl.certificate.verify_cb");
    }

    #[test]
    fn debug_hides_secret_values() {
        let mut p = Properties::default();
        p.insert("sasl.password", "hunter2-sasl");
        p.insert("ssl_key_password", "hunter2-key");
        p.insert("ssl.key.pem", "-----BEGIN PRIVATE KEY-----hunter2");
        p.insert("sasl.username", "alice");
        let shown = format!("{p:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("alice") && shown.contains("sasl.password"), "{shown}");
    }

    #[test]
    fn properties_files_and_pairs_are_read_and_bad_lines_named_without_their_value() {
        let dir = std::env::temp_dir().join(format!("vramgate-props-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("client.properties");
        std::fs::write(&file, "# TLS\nsecurity.protocol=SASL_SSL\n! also a comment\n\nsasl.password = a=b\n").expect("writes");
        let mut p = Properties::default();
        p.read_file(&file).expect("reads");
        p.insert_pair("sasl_mechanism=SCRAM-SHA-512").expect("a pair");
        assert_eq!(p.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(p.get("sasl.password"), Some("a=b"), "the value runs to the end of the line");
        assert_eq!(p.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        std::fs::write(&file, "sasl.password=ok\nhunter2-no-equals\n").expect("writes");
        let err = format!("{:#}", Properties::default().read_file(&file).expect_err("no ="));
        assert!(err.contains("line 2") && !err.contains("hunter2"), "{err}");
        assert!(Properties::default().insert_pair("=x").is_err());
        std::fs::remove_dir_all(&dir).expect("cleans up");
    }

    #[test]
    fn a_refused_secret_value_is_not_in_the_error() {
        let mut properties = Properties::default();
        // librdkafka refuses a value for a property it does not know; it must not be echoed.
        properties.insert("sasl.password.unknown", "hunter2-refused");
        properties.insert("sasl.password", "hunter2-fine");
        let connection = Connection { brokers: "127.0.0.1:9".into(), properties };
        let text = refused(&connection, ClientConfig::new());
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("sasl.password.unknown") && text.contains("the kafka producer"), "{text}");

        let connection = Connection { brokers: "127.0.0.1:9".into(), properties: Properties::default() };
        let mut defaults = ClientConfig::new();
        defaults.set("linger.ms", "soon");
        let err = refused(&connection, defaults);
        assert!(err.contains("linger.ms") && err.contains("soon"), "other keys keep their value: {err}");
    }
}
