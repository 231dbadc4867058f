//! Commit failures are failures: the gateway's commit path, against a real broker, when the
//! broker refuses a commit (here: a consumer that is not a member of a group whose members are
//! active, as a consumer whose generation went stale in a rebalance would be). The outcome is
//! counted as an error, the offsets are not marked confirmed, and the next commit offers them
//! again. An asynchronous commit used to report success before the broker had answered.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use vramgate_gateway::consume::commit::{Commits, Outcome, Writer};
use vramgate_gateway::consume::offsets::SharedOffsets;
use vramgate_gateway::metrics::Metrics;
use vramgate_tests::{brokers, create_topics, unique};

fn consumer(group: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "45000")
        .create()
        .expect("consumer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_commit_is_counted_as_an_error_and_offered_again() {
    let topic = unique("commits");
    create_topics(&[&topic], 1).await.expect("topic");
    let group = unique("commits-group");

    // A live member owns the group, so a commit from outside it is refused.
    let member = consumer(&group);
    member.subscribe(&[&topic]).expect("subscribe");
    let deadline = Instant::now() + Duration::from_secs(60);
    while member.assignment().map_or(0, |a| a.count()) == 0 {
        assert!(Instant::now() < deadline, "the member never got its partition");
        let _ = member.poll(Duration::from_millis(100));
    }

    let outsider = consumer(&group);
    let offsets = Arc::new(SharedOffsets::default());
    let metrics = Metrics::new();
    let commits = Commits::new(offsets.clone(), metrics.clone(), Writer::Offsets);
    let ticket = offsets.lock().begin((topic.clone(), 0), 0);
    offsets.finish(&ticket);
    let before = offsets.lock().uncommitted();

    let outcome = tokio::task::spawn_blocking(move || {
        let outcome = commits.commit(&outsider);
        (outcome, commits)
    })
    .await
    .expect("commit thread");
    let (outcome, commits) = outcome;
    assert_eq!(outcome, Outcome::Failed, "the broker refused the commit");
    assert_eq!(metrics.commits.with_label_values(&["error"]).get(), 1);
    assert_eq!(metrics.commits.with_label_values(&["ok"]).get(), 0);
    assert_eq!(offsets.lock().uncommitted(), before, "a refused commit confirms nothing");
    assert_eq!(offsets.lock().take_advanced(), vec![((topic.clone(), 0), 1)], "offered to the next commit");
    offsets.lock().untake(&[((topic.clone(), 0), 1)]);

    // The member itself commits fine, and that is confirmed.
    let member = Arc::new(member);
    let outcome = tokio::task::spawn_blocking({
        let member = member.clone();
        move || commits.commit(&*member)
    })
    .await
    .expect("commit thread");
    assert_eq!(outcome, Outcome::Committed);
    assert_eq!(metrics.commits.with_label_values(&["ok"]).get(), 1);
    assert_eq!(offsets.lock().uncommitted(), 0, "confirmed by the broker");
}
