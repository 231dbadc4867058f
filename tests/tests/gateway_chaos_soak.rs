//! Three minutes of the chaos soak (`scripts/bench chaos` runs it for an hour): two
//! exactly-once gateways, voice and image events with 5% hostile ones, a gateway, the worker or
//! the broker killed about every 30 s. Every event settles as a result or a dead letter, none
//! is lost and none comes out twice for a `read_committed` reader. Alone in its test binary:
//! it restarts the shared broker (cargo runs test binaries one at a time).

use vramgate_tests::chaos_soak::{run, Settings};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_minutes_of_faults_lose_and_double_nothing() {
    // Seed 7's first faults at 30 s a fault: gateway, broker and worker kills all come up.
    let report = run(Settings { seconds: 180, rate: 20.0, fault_every: 30.0, quiet_seconds: 0, seed: 7, group_protocol: "classic" }).await.expect("the soak runs");
    let text = report.text();
    eprintln!("{text}");
    assert!(report.settled(), "not every event settled:\n{text}");
    assert!(report.faults.len() >= 3, "too few faults to mean anything:\n{text}");
    let tasks = report.tasks();
    assert_eq!(tasks.len(), 2, "voice and image both counted:\n{text}");
    for t in tasks {
        assert!(t.sent > 0 && t.results > 0, "{}: nothing sent or nothing came out:\n{text}", t.task);
        // The hostile 5% are dead letters; valid events are results.
        assert!(t.dead_letters > 0, "{}: the missing inputs made no dead letters:\n{text}", t.task);
        assert_eq!(t.lost, 0, "{}: events lost:\n{text}", t.task);
        assert_eq!(t.duplicates, 0, "{}: outputs doubled for read_committed:\n{text}", t.task);
    }
}
