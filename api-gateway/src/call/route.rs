//! Which worker a request goes to: a pure function of what the gateway knows of each worker,
//! so that every policy is unit-tested.
//!
//! **Memory** (the default): the worker with the most admission room left after this request,
//! `free − cost`, where `free` is what the worker last reported (budget − admitted − queued,
//! stamped on every answer) less what this gateway sent it since that report, and `cost` is
//! the request's estimate by that worker's own fit for the model (`base + per_element ×
//! elements`). Ties go to the fewest calls in progress. A worker not heard from yet ranks by
//! calls in progress only, after every worker known to have room.
//!
//! A **full scan**, not power-of-two-choices: a task has at most 64 workers, so scanning all of
//! them is a few hundred nanoseconds beside a call of milliseconds, and it always finds the
//! roomiest. Power-of-two-choices exists for many balancers reading one stale view; here each
//! worker's view is refreshed by every answer and corrected by this gateway's own sends, and
//! several gateways' herding on one worker is bounded by that worker's own adaptive permits
//! (its 503s lower only its limit).
//!
//! Only workers in service are chosen, and among them those with a permit free when there are
//! any (else the best one is waited for); by memory, a worker known to be short of room for
//! the request does not count as one with a permit free, so the roomiest is waited for
//! instead of the request queueing on a full worker and coming back 503. A worker that just
//! failed this request is avoided when another is in service. With no worker in service, the
//! ejected one due back first is tried, so a set of one behaves as a single worker always did.

use crate::config::Routing;

/// What the gateway knows of one worker at the moment of choosing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Admission room after its last report and this gateway's sends since; `None`: no report
    /// yet.
    pub free: Option<i64>,
    /// The request's estimated cost on this worker (bytes, or 1 in count admission).
    pub cost: i64,
    /// This gateway's calls to it in progress.
    pub in_flight: usize,
    /// Whether one of its permits is free now.
    pub permit_free: bool,
    /// `None`: in service; `Some(ms)`: ejected, due to be probed in `ms`.
    pub ejected_for_ms: Option<u64>,
    /// It failed this request's previous attempt.
    pub just_failed: bool,
}

impl Candidate {
    /// Its last report, less this gateway's sends since, leaves less room than the request
    /// costs.
    fn known_short(&self) -> bool {
        self.free.is_some_and(|free| free < self.cost)
    }
}

/// Picks a candidate by `routing`; `turn` is the round-robin counter (advanced by the caller).
/// `None` only when there are no candidates.
pub fn choose(routing: Routing, candidates: &[Candidate], turn: usize) -> Option<usize> {
    if candidates.is_empty() {
        return None;
    }
    let in_service: Vec<usize> = (0..candidates.len()).filter(|&i| candidates[i].ejected_for_ms.is_none()).collect();
    if in_service.is_empty() {
        return (0..candidates.len()).min_by_key(|&i| (candidates[i].ejected_for_ms, candidates[i].just_failed));
    }
    let fresh: Vec<usize> = in_service.iter().copied().filter(|&i| !candidates[i].just_failed).collect();
    let pool = if fresh.is_empty() { in_service } else { fresh };
    if routing == Routing::RoundRobin {
        return Some(pool[turn % pool.len()]);
    }
    // A free permit beats more room, but not on a worker known to be short of room for this
    // request: sent there, it waits in that worker's queue and is likely refused (503), where
    // waiting here for the roomiest worker's permit costs no retry.
    let ready: Vec<usize> = pool
        .iter()
        .copied()
        .filter(|&i| candidates[i].permit_free && (routing != Routing::Memory || !candidates[i].known_short()))
        .collect();
    let pool = if ready.is_empty() { pool } else { ready };
    match routing {
        Routing::LeastInFlight => pool.into_iter().min_by_key(|&i| (candidates[i].in_flight, i)),
        _ => pool.into_iter().max_by_key(|&i| memory_rank(&candidates[i], i)),
    }
}

/// Larger is better: known room after the request first (unknown ranks below any known room
/// but above a known shortfall), then fewer calls in progress, then the lower index (stable).
fn memory_rank(c: &Candidate, index: usize) -> (i64, std::cmp::Reverse<usize>, std::cmp::Reverse<usize>) {
    let room = match c.free {
        Some(free) => free.saturating_sub(c.cost),
        None => 0,
    };
    (room, std::cmp::Reverse(c.in_flight), std::cmp::Reverse(index))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(free: Option<i64>) -> Candidate {
        Candidate { free, cost: 100, in_flight: 0, permit_free: true, ejected_for_ms: None, just_failed: false }
    }

    #[test]
    fn memory_picks_the_most_room_after_the_request() {
        let mut c = vec![worker(Some(1_000)), worker(Some(4_000)), worker(Some(2_000))];
        assert_eq!(choose(Routing::Memory, &c, 0), Some(1));
        c[1].cost = 3_500; // the big worker's own estimate of this request is larger
        assert_eq!(choose(Routing::Memory, &c, 0), Some(2));
        c[2].permit_free = false;
        assert_eq!(choose(Routing::Memory, &c, 0), Some(0), "a free permit beats more room");
        for w in &mut c {
            w.permit_free = false;
        }
        assert_eq!(choose(Routing::Memory, &c, 0), Some(2), "all busy: the roomiest is waited for");
    }

    #[test]
    fn a_free_permit_on_a_worker_short_of_room_does_not_beat_waiting_for_room() {
        let mut c = vec![worker(Some(50)), worker(Some(4_000)), worker(None)];
        c[1].permit_free = false;
        c[2].permit_free = false;
        assert_eq!(choose(Routing::Memory, &c, 0), Some(1), "50 free < 100 needed: wait for the roomiest");
        c[2].permit_free = true;
        assert_eq!(choose(Routing::Memory, &c, 0), Some(2), "unknown room with a free permit is tried");
        let mut c = vec![worker(Some(50)), worker(Some(80))];
        c[1].permit_free = false;
        assert_eq!(choose(Routing::Memory, &c, 0), Some(1), "all short: the least short is waited for");
        assert_eq!(choose(Routing::LeastInFlight, &c, 0), Some(0), "other policies ignore room");
    }

    #[test]
    fn unknown_workers_rank_between_room_and_shortfall() {
        let c = vec![worker(Some(50)), worker(None), worker(Some(500))];
        assert_eq!(choose(Routing::Memory, &c, 0), Some(2));
        let c = vec![worker(Some(50)), worker(None)];
        assert_eq!(choose(Routing::Memory, &c, 0), Some(1), "50 free < 100 needed: unknown is better");
        let mut c = vec![worker(Some(1_000)), worker(Some(1_000))];
        c[0].in_flight = 3;
        assert_eq!(choose(Routing::Memory, &c, 0), Some(1), "ties go to fewer calls in progress");
    }

    #[test]
    fn ejected_and_just_failed_workers_are_avoided_while_others_serve() {
        let mut c = vec![worker(Some(9_000)), worker(Some(1_000)), worker(Some(500))];
        c[0].ejected_for_ms = Some(500);
        assert_eq!(choose(Routing::Memory, &c, 0), Some(1));
        c[1].just_failed = true;
        assert_eq!(choose(Routing::Memory, &c, 0), Some(2));
        assert_eq!(choose(Routing::RoundRobin, &c, 7), Some(2));
        c[2].ejected_for_ms = Some(100);
        assert_eq!(choose(Routing::Memory, &c, 0), Some(1), "only the one that failed is in service");
        c[1].ejected_for_ms = Some(2_000);
        assert_eq!(choose(Routing::Memory, &c, 0), Some(2), "none in service: the one due back first");
        assert_eq!(choose(Routing::Memory, &[], 0), None);
    }

    #[test]
    fn round_robin_and_least_in_flight_ignore_memory() {
        let mut c = vec![worker(Some(10)), worker(Some(10_000)), worker(Some(10))];
        let turns: Vec<Option<usize>> = (0..4).map(|t| choose(Routing::RoundRobin, &c, t)).collect();
        assert_eq!(turns, [Some(0), Some(1), Some(2), Some(0)]);
        c[0].in_flight = 2;
        c[1].in_flight = 5;
        c[2].in_flight = 1;
        assert_eq!(choose(Routing::LeastInFlight, &c, 0), Some(2));
    }
}
