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

#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(#[from] Box<figment::Error>);

/// Reads `T` from its defaults, then `file` (if given), then environment variables starting
/// with `env_prefix`.
pub fn load<T>(file: Option<&Path>, env_prefix: &str) -> Result<T, ConfigError>
where
    T: Serialize + DeserializeOwned + Default,
{
    let mut figment = Figment::from(Serialized::defaults(T::default()));
    if let Some(path) = file {
        // A named file that is missing is an error, not a silent fall-back to defaults.
        if !path.is_file() {
            return Err(ConfigError(Box::new(figment::Error::from(format!(
                "config file {} does not exist",
                path.display()
            )))));
        }
        figment = figment.merge(Toml::file(path));
    }
    figment = figment.merge(Env::prefixed(env_prefix).split("__"));
    figment.extract().map_err(|e| ConfigError(Box::new(e)))
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
