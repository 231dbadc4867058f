//! What the crash tests (`gateway_chaos`, `gateway_exactly_once`) count and wait for: which
//! ids came out, how often, and as what; a gateway stopped gracefully with its commits checked.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use crate::{uncommitted_records, ById, Collector, Gateway};

/// What happened to a test's ids: those that never came out, those that came out more than
/// once (and the records beyond the first), the results, and the dead letters by kind.
#[derive(Debug, Default)]
pub struct Tally {
    pub lost: Vec<String>,
    pub duplicated: Vec<String>,
    pub extra_records: usize,
    pub results: usize,
    pub dead_by_kind: BTreeMap<String, usize>,
}

/// Tallies `records` (as a [`Collector`] read them) for `ids`; a record of one of `dlq_topics`
/// is a dead letter.
pub fn tally(ids: &[String], records: &ById, dlq_topics: &[&str]) -> Tally {
    let mut t = Tally::default();
    for id in ids {
        let Some(got) = records.get(id) else {
            t.lost.push(id.clone());
            continue;
        };
        if got.len() > 1 {
            t.duplicated.push(id.clone());
            t.extra_records += got.len() - 1;
        }
        for r in got {
            if dlq_topics.contains(&r.topic.as_str()) {
                let kind = r.value["error"]["kind"].as_str().unwrap_or("?").to_string();
                *t.dead_by_kind.entry(kind).or_default() += 1;
            } else {
                t.results += 1;
            }
        }
    }
    t
}

/// How many of `wanted` the collector has read.
pub fn seen(collector: &Collector, wanted: &HashSet<String>) -> usize {
    collector.with(|got| got.keys().filter(|id| wanted.contains(*id)).count())
}

/// Waits until the collector has read `count` of `wanted`, or `timeout` passes; returns
/// whether it got there.
pub async fn wait_for(collector: &Collector, wanted: &HashSet<String>, count: usize, timeout: Duration) -> bool {
    collector.wait_until(timeout, |got| got.keys().filter(|id| wanted.contains(*id)).count() >= count).await
}

/// SIGTERM, a clean exit, and nothing of `topics` left uncommitted by `group`.
pub async fn terminate_and_check_commits(gateway: &mut Gateway, group: &str, topics: &[&str]) {
    let status = gateway.service.terminate(Duration::from_secs(40)).await.expect("gateway stops");
    assert!(status.success(), "gateway exited with {status}; log:\n{}", gateway.log_tail());
    for topic in topics {
        let behind = uncommitted_records(group, topic).expect("committed offsets");
        assert_eq!(behind, 0, "{behind} records of {topic} not committed after a graceful shutdown");
    }
}
