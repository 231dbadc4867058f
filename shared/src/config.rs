//! Layered configuration: built-in defaults, then a TOML file, then environment variables.
//!
//! Each service owns its typed config tree (with `deny_unknown_fields`); this module only does
//! the layering, so both services read config the same way. Environment variables use a
//! service prefix and `__` between levels: `VRAMGATE_WORKER_LISTEN=…`,
//! `VRAMGATE_GATEWAY_KAFKA__BROKERS=…`.

use std::path::Path;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{de::DeserializeOwned, Serialize};

/// A configuration error. Its message never shows the value of a key that names a secret
/// (`*password*`, `*secret*`, `*token*`, `*key*` in any case, at any depth), whatever its type:
/// a wrong type or value there is reported by key and expectation only.
#[derive(Debug)]
pub struct ConfigError(Box<figment::Error>);

impl From<Box<figment::Error>> for ConfigError {
    fn from(e: Box<figment::Error>) -> Self {
        ConfigError(e)
    }
}

impl std::error::Error for ConfigError {}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid configuration: ")?;
        for (i, error) in (*self.0).clone().into_iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            if error.path.iter().any(|k| is_secret_key(k)) {
                let expected = match &error.kind {
                    figment::error::Kind::InvalidType(_, expected) | figment::error::Kind::InvalidValue(_, expected) => {
                        format!("expected {expected}")
                    }
                    _ => "not accepted".to_string(),
                };
                write!(f, "invalid value for `{}`: {expected} (the value is not shown: the key names a secret)", error.path.join("."))?;
            } else {
                write!(f, "{error}")?;
            }
        }
        Ok(())
    }
}

/// A secret from the configuration (a token, a password): its `Debug` and `Display` never show
/// it, so logging a config struct cannot leak it. [`Secret::expose`] is the one way to read it.
#[derive(Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Secret(String);

/// A secret given as a number (an environment variable of digits reads as one) is its text.
impl<'de> serde::Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Int(i64),
            Unsigned(u64),
        }
        Ok(Secret(match Raw::deserialize(d)? {
            Raw::Text(s) => s,
            Raw::Int(i) => i.to_string(),
            Raw::Unsigned(u) => u.to_string(),
        }))
    }
}

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes, hidden>)", self.0.len())
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<hidden>")
    }
}

/// Whether a config key names a secret whose value must never be printed. Underscores read as
/// dots, so a librdkafka key in its environment form (`SSL_KEY_PEM` for `ssl.key.pem`) is
/// recognised as well.
pub fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase().replace('_', ".");
    ["password", "secret", "token", "sasl.oauthbearer.config", "ssl.key", "private"].iter().any(|s| key.contains(s))
}

/// Reads `T` from its defaults, then `file` (if given), then environment variables starting
/// with `env_prefix`.
pub fn load<T>(file: Option<&Path>, env_prefix: &str) -> Result<T, ConfigError>
where
    T: Serialize + DeserializeOwned + Default,
{
    layered::<T>(file, env_prefix)?.extract().map_err(|e| ConfigError(Box::new(e)))
}

/// The layers [`load`] extracts from, for a service that checks more before extracting:
/// defaults, then `file` (a named file that is missing is an error, not a silent fall-back),
/// then the environment. `<PREFIX>CONFIG` names the file itself (the binaries' `--config`), not
/// a key. A variable whose key names a secret ([`is_secret_key`]) is taken verbatim as text,
/// never parsed: a token such as `0123` or `12e4` stays what it is.
pub fn layered<T: Serialize + Default>(file: Option<&Path>, env_prefix: &str) -> Result<Figment, ConfigError> {
    let invalid = |message: String| ConfigError(Box::new(figment::Error::from(message)));
    let mut figment = Figment::from(Serialized::defaults(T::default()));
    if let Some(path) = file {
        if !path.is_file() {
            return Err(invalid(format!("config file {} does not exist", path.display())));
        }
        figment = figment.merge(Toml::file(path));
    }
    figment = figment.merge(
        Env::prefixed(env_prefix).filter(|key| key != "config" && !is_secret_key(key.as_str())).split("__"),
    );
    for (name, value) in std::env::vars_os() {
        let Some(key) = name.to_str().and_then(|n| n.strip_prefix(env_prefix)).filter(|k| is_secret_key(k)) else {
            continue;
        };
        let value = value.into_string().map_err(|_| invalid(format!("{env_prefix}{key} is not valid UTF-8")))?;
        figment = figment.merge(Serialized::default(&key.to_ascii_lowercase().replace("__", "."), value));
    }
    Ok(figment)
}

#[cfg(test)]
// figment's `Jail` closures must return its large error type; that is its API, not ours.
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields, default)]
    struct Sample {
        listen: String,
        inner: Inner,
    }

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields, default)]
    struct Inner {
        limit_bytes: u64,
    }

    impl Default for Sample {
        fn default() -> Self {
            Sample { listen: "127.0.0.1:1".into(), inner: Inner::default() }
        }
    }

    impl Default for Inner {
        fn default() -> Self {
            Inner { limit_bytes: 7 }
        }
    }

    #[test]
    fn file_overrides_defaults_and_env_overrides_file() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("c.toml", "listen = \"0.0.0.0:2\"\n[inner]\nlimit_bytes = 9\n")?;
            let from_file: Sample = load(Some(Path::new("c.toml")), "VGTEST_").expect("loads");
            assert_eq!(from_file, Sample { listen: "0.0.0.0:2".into(), inner: Inner { limit_bytes: 9 } });
            jail.set_env("VGTEST_INNER__LIMIT_BYTES", "11");
            let with_env: Sample = load(Some(Path::new("c.toml")), "VGTEST_").expect("loads");
            assert_eq!(with_env.inner.limit_bytes, 11);
            Ok(())
        });
    }

    #[derive(Debug, Serialize, Deserialize, PartialEq, Default)]
    #[serde(deny_unknown_fields, default)]
    struct WithSecret {
        sasl_password: String,
        limit_bytes: u64,
    }

    #[test]
    fn secrets_are_never_echoed_in_errors() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("c.toml", "sasl_password = 987654321\n")?;
            let err = load::<WithSecret>(Some(Path::new("c.toml")), "VGTEST_").expect_err("wrong type").to_string();
            assert!(!err.contains("987654321"), "{err}");
            assert!(err.contains("sasl_password") && err.contains("not shown"), "{err}");
            jail.create_file("d.toml", "limit_bytes = \"many\"\n")?;
            let err = load::<WithSecret>(Some(Path::new("d.toml")), "VGTEST_").expect_err("wrong type").to_string();
            assert!(err.contains("many"), "other keys keep their value in the message: {err}");
            Ok(())
        });
        assert!(is_secret_key("sasl.password") && is_secret_key("AUTH_TOKEN") && is_secret_key("ssl.key.password"));
        assert!(is_secret_key("KAFKA__PROPERTIES__SSL_KEY_PEM") && is_secret_key("kafka__properties__sasl_password"));
        assert!(!is_secret_key("brokers"));
        let secret = Secret::new("hunter2");
        assert!(!format!("{secret:?} {secret}").contains("hunter2"));
        assert_eq!(secret.expose(), "hunter2");
    }

    #[test]
    fn unknown_keys_and_missing_files_are_errors() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("c.toml", "listne = \"0.0.0.0:2\"\n")?;
            let err = load::<Sample>(Some(Path::new("c.toml")), "VGTEST_").expect_err("typo");
            assert!(err.to_string().contains("listne"), "{err}");
            let err = load::<Sample>(Some(Path::new("nope.toml")), "VGTEST_").expect_err("missing");
            assert!(err.to_string().contains("nope.toml"), "{err}");
            Ok(())
        });
    }
}
