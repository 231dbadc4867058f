//! Gateways added and removed one at a time (1 → 2 → 3 → 2 → 1) while 5,000 events flow,
//! with both consumer group protocols (`kafka.group_protocol`: `classic`, cooperative-sticky,
//! and KIP-848's `consumer`) in both delivery modes (`vramgate_tests::scale`). Exactly-once:
//! nothing lost or doubled for a `read_committed` reader. At-least-once: nothing lost, and
//! duplicates within `max_in_flight` per gateway removed. The four runs go one after another
//! in one test: two at once would share two cores between six gateways. 5,000 events a run,
//! not 20,000, to keep CI's cold run under an hour (a 20,000-event run takes about two minutes
//! here): `scripts/bench scale-out` runs 20,000 and prints what was lost or doubled with the
//! pause each step caused. Nothing is asserted about the pauses.

use vramgate_tests::scale::{scale_out, ScaleRun};

const EVENTS: usize = 5_000;

fn report(label: &str, run: &ScaleRun) {
    let pauses: Vec<String> = run.pauses.iter().map(|(step, p)| format!("{step}: {} ms", p.as_millis())).collect();
    eprintln!(
        "{label}: {EVENTS} events in {:.1} s; lost {}, doubled {} ({} extra records), dead letters {:?}; longest gap after each step: {}",
        run.wall.as_secs_f64(),
        run.tally.lost.len(),
        run.tally.duplicated.len(),
        run.tally.extra_records,
        run.tally.dead_by_kind,
        pauses.join(", ")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_added_and_removed_mid_stream_keep_each_delivery_promise_with_either_group_protocol() {
    for protocol in ["classic", "consumer"] {
        for delivery in ["exactly-once", "at-least-once"] {
            let run = scale_out(protocol, delivery, EVENTS).await.expect("the run");
            let label = format!("{protocol}, {delivery}");
            report(&label, &run);
            assert!(run.tally.lost.is_empty(), "{label}: lost {} (e.g. {:?})", run.tally.lost.len(), &run.tally.lost[..run.tally.lost.len().min(5)]);
            assert!(run.tally.dead_by_kind.is_empty(), "{label}: dead letters from valid inputs: {:?}", run.tally.dead_by_kind);
            assert_eq!(run.pauses.len(), 4, "{label}: not every step ran: {:?}", run.pauses);
            if delivery == "exactly-once" {
                assert!(run.tally.duplicated.is_empty(), "{label}: {} ids doubled for read_committed", run.tally.duplicated.len());
            } else {
                let bound = run.max_in_flight * run.removed;
                assert!(run.tally.extra_records <= bound, "{label}: {} duplicates, over max_in_flight × gateways removed ({bound})", run.tally.extra_records);
            }
        }
    }
}
