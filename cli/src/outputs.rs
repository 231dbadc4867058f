//! How `vramgate-cli` reads the gateway's output topics (`watch`, and `load`'s follower and its
//! watermark and lag probes): its own consumer group, no commits, and
//! `isolation.level=read_committed`.
//!
//! In exactly-once delivery the gateway writes its results and dead letters in Kafka
//! transactions; a `read_committed` consumer sees only those of committed transactions, and the
//! end of a partition it reads (its watermark) is the last stable offset: where the first still
//! open transaction begins. librdkafka's default is `read_committed` too, but the CLI sets it
//! explicitly, as a default under the user's properties: a properties file (`--kafka-config`)
//! or `--kafka-property` may still set `isolation.level`, as it may any other default. `watch
//! --read-uncommitted` is the explicit way to see what aborted or still open transactions wrote;
//! being a choice made on the command line, it wins over the properties ([`forcing`]).

use rdkafka::ClientConfig;
use vramgate_shared::kafka::Connection;

/// librdkafka's name of the consumer property.
pub const ISOLATION_LEVEL: &str = "isolation.level";

/// Which records of transactions a consumer sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Isolation {
    /// Only records of committed transactions (and every non-transactional one); a partition
    /// ends at its last stable offset.
    #[default]
    ReadCommitted,
    /// Every record written, including those of aborted and still open transactions; a
    /// partition ends at its high watermark.
    ReadUncommitted,
}

impl Isolation {
    /// The value of `isolation.level`.
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "read_committed",
            Isolation::ReadUncommitted => "read_uncommitted",
        }
    }
}

/// The defaults of a consumer that reads output topics, in consumer group `group`: no
/// commits, `isolation.level=read_committed`. The connection's properties are laid over them
/// ([`Connection::client_config`]).
pub fn reader_defaults(group: &str) -> ClientConfig {
    let mut defaults = ClientConfig::new();
    defaults
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set(ISOLATION_LEVEL, Isolation::ReadCommitted.as_str());
    defaults
}

/// `connection` with `isolation.level` set to `isolation` over its properties: for a choice
/// made on the command line (`watch --read-uncommitted`), which a properties file must not undo.
pub fn forcing(connection: &Connection, isolation: Isolation) -> Connection {
    let mut connection = connection.clone();
    connection.properties.insert(ISOLATION_LEVEL, isolation.as_str());
    connection
}

/// The isolation level a consumer made from [`reader_defaults`] over `connection` reads with
/// (its properties' `isolation.level` when they set one), as librdkafka names it.
pub fn effective_isolation(connection: &Connection) -> String {
    connection.client_config(reader_defaults("-")).get(ISOLATION_LEVEL).unwrap_or(Isolation::ReadCommitted.as_str()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::consumer::BaseConsumer;
    use vramgate_shared::kafka::Properties;

    fn connection(properties: &[(&str, &str)]) -> Connection {
        let mut p = Properties::default();
        for (k, v) in properties {
            p.insert(k, *v);
        }
        // Nothing listens there: creating a consumer does not connect.
        Connection { brokers: "127.0.0.1:9".into(), properties: p }
    }

    #[test]
    fn output_readers_read_committed_by_default_and_librdkafka_takes_it() {
        let defaults = reader_defaults("g");
        assert_eq!(defaults.get(ISOLATION_LEVEL), Some("read_committed"));
        assert_eq!(defaults.get("group.id"), Some("g"));
        assert_eq!(defaults.get("enable.auto.commit"), Some("false"));
        let kafka = connection(&[]);
        assert_eq!(kafka.client_config(reader_defaults("g")).get(ISOLATION_LEVEL), Some("read_committed"));
        assert_eq!(effective_isolation(&kafka), "read_committed");
        // Both values are librdkafka's own: it creates a consumer with each.
        for isolation in [Isolation::ReadCommitted, Isolation::ReadUncommitted] {
            let kafka = forcing(&kafka, isolation);
            kafka.create::<BaseConsumer>(reader_defaults("g"), "a test consumer").expect("librdkafka takes the config");
        }
    }

    #[test]
    fn properties_override_the_default_and_the_command_line_overrides_properties() {
        // A properties file may choose, in either form of the name, as for any other default.
        for key in ["isolation.level", "isolation_level"] {
            let kafka = connection(&[(key, "read_uncommitted")]);
            assert_eq!(kafka.client_config(reader_defaults("g")).get(ISOLATION_LEVEL), Some("read_uncommitted"), "{key}");
            assert_eq!(effective_isolation(&kafka), "read_uncommitted");
        }
        // `watch --read-uncommitted` wins over a file that says read_committed, and keeps the
        // other properties.
        let kafka = connection(&[("isolation.level", "read_committed"), ("security.protocol", "SSL")]);
        let forced = forcing(&kafka, Isolation::ReadUncommitted);
        let config = forced.client_config(reader_defaults("g"));
        assert_eq!(config.get(ISOLATION_LEVEL), Some("read_uncommitted"));
        assert_eq!(config.get("security.protocol"), Some("SSL"));
        assert_eq!(kafka.properties.get(ISOLATION_LEVEL), Some("read_committed"), "the original is unchanged");
    }
}
