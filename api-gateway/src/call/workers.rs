//! A task's workers: each endpoint with its own client, its own adaptive permits (so one small
//! card's 503s lower only its own limit), what it last reported of its admission, this
//! gateway's calls to it since, and its health (ejection with backoff, probing back).
//!
//! - **Accounting.** Every answer carries the worker's admission figures (budget, admitted,
//!   queued) and the model's estimate ([`vramgate_shared::worker_state`]). A call counts its
//!   estimated cost as *unreported* from the moment it is sent until the worker's next report
//!   arrives (that report includes it) or the call ends; a worker's free room is its last
//!   report less the unreported costs.
//! - **Ejection.** A worker is taken out of service at once when no connection can be made
//!   (refused, no route), and after [`EJECT_AFTER_FAILURES`] failures in a row (5xx, a
//!   connection lost mid-call, a timeout). It stays out for a backoff of 1 s doubling to 10 s
//!   per ejection without a success in between, then is probed (`GET /vramgate/state`); a
//!   probe that answers puts it back in service, one that fails doubles the backoff. A 503 or
//!   429 never ejects: the worker is alive and says when to come back.
//! - **Membership.** [`WorkerSet::replace`] sets the endpoints (a static list once, DNS answers
//!   as they change); an endpoint that leaves keeps serving the calls already made to it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use vramgate_shared::config::Secret;
use vramgate_shared::telemetry::{bounded, LogLimit, LOG_FIELD_MAX_BYTES};
use vramgate_shared::worker_state::{self, Admission, Estimate, Unit, WorkerState};

use super::client::{CallError, Protocol, WorkerClient};
use super::permits::AdaptivePermits;
use super::route::{self, Candidate};
use crate::config::{PermitConfig, Routing};
use crate::metrics::Metrics;

/// Failures in a row (5xx, lost connection, timeout) that take a worker out of service.
pub const EJECT_AFTER_FAILURES: u32 = 3;
/// First ejection; each further one without a success in between doubles it, up to the max.
pub const EJECT_BACKOFF_BASE: Duration = Duration::from_secs(1);
pub const EJECT_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// A report this old, from a worker that was not idle when it reported and that this gateway
/// has no call on now, is refreshed by a probe: nothing else would correct it (reports come
/// with answers), and by memory a worker known to be short of room is not sent to while
/// another has room, so a load that other gateways put on it and took away again would keep
/// it idle here.
pub const STALE_REPORT: Duration = Duration::from_secs(1);

static EJECT_LOG: LogLimit = LogLimit::new(20);

/// One worker of a task.
pub struct Endpoint {
    pub url: String,
    pub client: WorkerClient,
    pub permits: AdaptivePermits,
    state: Mutex<Health>,
}

#[derive(Default)]
struct Health {
    admission: Option<Admission>,
    estimate: Option<Estimate>,
    /// Counts reports; a call sent under an older one is already in the latest.
    generation: u64,
    /// Estimated cost of this gateway's calls sent since the last report and still running.
    unreported: u64,
    in_flight: usize,
    /// When the last report arrived.
    reported_at: Option<Instant>,
    failures: u32,
    /// `Some`: out of service; probed once this instant passes.
    ejected_until: Option<Instant>,
    /// Ejections (and failed probes) since the last success: the backoff's exponent.
    ejections_in_a_row: u32,
}

impl Health {
    /// Takes a report, from an answer's headers or a probe: the worker's admission and, when
    /// it came with one, the model's estimate. Every call sent before it is in it.
    fn report(&mut self, admission: Admission, estimate: Option<Estimate>) {
        self.admission = Some(admission);
        if estimate.is_some() {
            self.estimate = estimate;
        }
        self.generation += 1;
        self.unreported = 0;
        self.reported_at = Some(Instant::now());
    }
}

/// A call on its way to an endpoint: what it counts against the endpoint until it ends.
pub struct Sent {
    generation: u64,
    cost: u64,
}

impl Endpoint {
    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The estimated cost of a request of `elements` on this worker: its model's estimate in
    /// `bytes` admission, 1 in `count` admission, 0 while unknown.
    fn cost(health: &Health, elements: u64) -> u64 {
        match (health.admission.map(|a| a.unit), health.estimate) {
            (Some(Unit::Count), _) => 1,
            (_, Some(estimate)) => estimate.bytes(elements),
            _ => 0,
        }
    }

    /// Admission room this gateway expects the worker to have now; `None` before a report.
    pub fn free(&self) -> Option<i64> {
        let h = self.health();
        h.admission.map(|a| a.free().saturating_sub(i64::try_from(h.unreported).unwrap_or(i64::MAX)))
    }

    pub fn is_ejected(&self) -> bool {
        self.health().ejected_until.is_some()
    }

    /// A call of `elements` is being sent now.
    pub fn send(&self, elements: u64) -> Sent {
        let mut h = self.health();
        let cost = Self::cost(&h, elements);
        h.unreported = h.unreported.saturating_add(cost);
        h.in_flight += 1;
        Sent { generation: h.generation, cost }
    }

    /// Records what an answer's headers report (on every status).
    pub fn observe(&self, headers: &reqwest::header::HeaderMap) {
        let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let Some(admission) = Admission::from_headers(get) else { return };
        let estimate = get(worker_state::HEADER_ESTIMATE).and_then(worker_state::parse_estimate_header);
        self.health().report(admission, estimate);
    }

    /// Records a probe's full state report for `model`.
    fn observe_state(&self, state: &WorkerState, model: &str) {
        self.health().report(state.admission, state.models.get(model).copied());
    }

    /// A refresh of a stale report, sent under report count `generation` (from [`stale`]),
    /// answered with `state`: taken unless a call was sent or answered while it was on its way
    /// (that answer reports, and the probe's figures may predate it).
    ///
    /// [`stale`]: Self::stale
    fn refreshed(&self, state: &WorkerState, model: &str, generation: u64) {
        let mut h = self.health();
        if h.in_flight == 0 && h.generation == generation {
            h.report(state.admission, state.models.get(model).copied());
        }
    }

    /// The call `sent` ended with `outcome`. Returns whether this took the worker out of service.
    pub fn finish(&self, sent: Sent, outcome: Result<(), &CallError>) -> bool {
        let mut h = self.health();
        h.in_flight = h.in_flight.saturating_sub(1);
        if sent.generation == h.generation {
            h.unreported = h.unreported.saturating_sub(sent.cost);
        }
        let eject = match outcome {
            Ok(()) => {
                // An answer is the best probe: a worker tried while out of service is back.
                h.ejected_until = None;
                h.failures = 0;
                h.ejections_in_a_row = 0;
                false
            }
            Err(CallError::Unreachable { .. }) => true,
            Err(CallError::Failed { .. } | CallError::TimedOut { .. }) => {
                h.failures += 1;
                h.failures >= EJECT_AFTER_FAILURES
            }
            // Busy, or a verdict on the request: the worker is alive.
            Err(_) => {
                h.failures = 0;
                false
            }
        };
        if !eject || h.ejected_until.is_some() {
            return false;
        }
        Self::eject(&mut h);
        true
    }

    fn eject(h: &mut Health) {
        let backoff = EJECT_BACKOFF_BASE.saturating_mul(1 << h.ejections_in_a_row.min(5)).min(EJECT_BACKOFF_MAX);
        h.ejected_until = Some(Instant::now() + backoff);
        h.ejections_in_a_row = h.ejections_in_a_row.saturating_add(1);
        h.failures = 0;
        // What it reported before failing says nothing of the process that comes back.
        h.admission = None;
        h.unreported = 0;
    }

    /// Whether the worker is out of service and due to be probed.
    fn due_for_probe(&self, now: Instant) -> bool {
        self.health().ejected_until.is_some_and(|until| until <= now)
    }

    /// Whether its last report is worth refreshing at `now` ([`STALE_REPORT`]): in service, no
    /// call of this gateway on it, and it had admitted or queued work when it reported. `Some`:
    /// the report count the refresh is sent under (for [`refreshed`](Self::refreshed)).
    fn stale(&self, now: Instant) -> Option<u64> {
        let h = self.health();
        let stale = h.ejected_until.is_none()
            && h.in_flight == 0
            && h.admission.is_some_and(|a| a.admitted > 0 || a.queued > 0)
            && h.reported_at.is_some_and(|at| now.saturating_duration_since(at) >= STALE_REPORT);
        stale.then_some(h.generation)
    }

    /// Whether the worker has never reported (just discovered, or back from an ejection).
    fn unknown(&self) -> bool {
        self.health().admission.is_none()
    }

    /// A probe answered with `state` (`Ok`) or failed: back in service, or out for longer.
    /// Returns whether the worker was put back.
    fn probed(&self, result: Result<&WorkerState, ()>, model: &str) -> bool {
        match result {
            Ok(state) => {
                self.observe_state(state, model);
                let mut h = self.health();
                let was_out = h.ejected_until.take().is_some();
                h.failures = 0;
                was_out
            }
            Err(()) => {
                let mut h = self.health();
                Self::eject(&mut h);
                false
            }
        }
    }

    fn candidate(&self, elements: u64, now: Instant, just_failed: bool) -> Candidate {
        let h = self.health();
        let cost = Self::cost(&h, elements);
        Candidate {
            free: h.admission.map(|a| a.free().saturating_sub(i64::try_from(h.unreported).unwrap_or(i64::MAX))),
            cost: i64::try_from(cost).unwrap_or(i64::MAX),
            in_flight: h.in_flight,
            permit_free: self.permits.in_use() < self.permits.limit(),
            ejected_for_ms: h.ejected_until.map(|until| until.saturating_duration_since(now).as_millis() as u64),
            just_failed,
        }
    }
}

/// How a set makes its endpoints.
struct Blueprint {
    timeout_seconds: f64,
    token: Option<Secret>,
    protocol: Protocol,
    permits: PermitConfig,
}

/// All workers of one task.
pub struct WorkerSet {
    pub task: String,
    pub model: String,
    /// The version of `model` its calls name (the task's `model_version`); `None`: the newest
    /// the worker serves.
    pub version: Option<u64>,
    routing: Routing,
    blueprint: Blueprint,
    endpoints: RwLock<Vec<Arc<Endpoint>>>,
    turn: AtomicUsize,
    metrics: Arc<Metrics>,
}

impl WorkerSet {
    pub fn new(
        task: &str,
        model: &str,
        routing: Routing,
        timeout_seconds: f64,
        token: Option<Secret>,
        permits: PermitConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        WorkerSet {
            task: task.to_string(),
            model: model.to_string(),
            version: None,
            routing,
            blueprint: Blueprint { timeout_seconds, token, protocol: Protocol::Http, permits },
            endpoints: RwLock::new(Vec::new()),
            turn: AtomicUsize::new(0),
            metrics,
        }
    }

    /// The set calling its workers through `protocol` (HTTP unless set); before any endpoint
    /// is added.
    pub fn speaking(mut self, protocol: Protocol) -> Self {
        self.blueprint.protocol = protocol;
        self
    }

    /// The set calling `version` of its model (`None`: the newest served).
    pub fn pinned(mut self, version: Option<u64>) -> Self {
        self.version = version;
        self
    }

    /// The door its workers are called through (`worker.protocol`).
    pub fn protocol(&self) -> Protocol {
        self.blueprint.protocol
    }

    pub fn endpoints(&self) -> Vec<Arc<Endpoint>> {
        self.endpoints.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many workers the set has.
    pub fn count(&self) -> usize {
        self.endpoints.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn urls(&self) -> Vec<String> {
        self.endpoints().iter().map(|e| e.url.clone()).collect()
    }

    /// Makes the set exactly `urls` (in order), keeping the endpoints (and their state) of
    /// those already in it. Returns the URLs added and removed.
    pub fn replace(&self, urls: &[String]) -> anyhow::Result<(Vec<String>, Vec<String>)> {
        let old = self.endpoints();
        let mut next = Vec::with_capacity(urls.len());
        let mut added = Vec::new();
        for url in urls {
            let url = url.trim_end_matches('/');
            if next.iter().any(|e: &Arc<Endpoint>| e.url == url) {
                continue;
            }
            match old.iter().find(|e| e.url == url) {
                Some(kept) => next.push(kept.clone()),
                None => {
                    let b = &self.blueprint;
                    let client = WorkerClient::new(url, b.timeout_seconds, b.token.as_ref(), b.protocol)?;
                    let permits = AdaptivePermits::new(b.permits.initial, b.permits.min, b.permits.max);
                    next.push(Arc::new(Endpoint {
                        url: client.url().to_string(),
                        client,
                        permits,
                        state: Mutex::new(Health::default()),
                    }));
                    added.push(url.to_string());
                }
            }
        }
        let removed: Vec<String> =
            old.iter().filter(|e| !next.iter().any(|n| n.url == e.url)).map(|e| e.url.clone()).collect();
        for url in &removed {
            self.forget_metrics(url);
        }
        *self.endpoints.write().unwrap_or_else(|p| p.into_inner()) = next;
        Ok((added, removed))
    }

    /// The endpoint for a request of `elements` input elements; `avoid`: the URL that failed
    /// its previous attempt. `None` only while the set is empty.
    pub fn choose(&self, elements: u64, avoid: Option<&str>) -> Option<Arc<Endpoint>> {
        let endpoints = self.endpoints();
        let now = Instant::now();
        let candidates: Vec<Candidate> =
            endpoints.iter().map(|e| e.candidate(elements, now, avoid == Some(e.url.as_str()))).collect();
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        route::choose(self.routing, &candidates, turn).map(|i| endpoints[i].clone())
    }

    /// Whether an endpoint other than `url` is in service.
    pub fn another_in_service(&self, url: &str) -> bool {
        self.endpoints().iter().any(|e| e.url != url && !e.is_ejected())
    }

    /// Counts the call's outcome on `endpoint`'s metrics; logs and counts an ejection.
    pub fn record(&self, endpoint: &Endpoint, outcome: Result<(), &CallError>, ejected: bool) {
        let labels = [self.task.as_str(), endpoint.url.as_str()];
        let m = &self.metrics;
        m.worker_requests.with_label_values(&labels).inc();
        match outcome {
            Err(CallError::Throttled { .. }) => m.worker_throttled.with_label_values(&labels).inc(),
            Err(CallError::Failed { .. } | CallError::TimedOut { .. } | CallError::Unreachable { .. }) => {
                m.worker_failures.with_label_values(&labels).inc()
            }
            _ => {}
        }
        if ejected {
            m.worker_ejections.with_label_values(&labels).inc();
            if EJECT_LOG.allow() {
                let error = outcome.err().map(|e| bounded(&e.to_string(), LOG_FIELD_MAX_BYTES).to_string()).unwrap_or_default();
                tracing::warn!(task = %self.task, worker = %endpoint.url, error, "worker taken out of service; it will be probed");
            } else {
                m.log_suppressed.with_label_values(&["worker_ejected"]).inc();
            }
        }
    }

    /// Probes every endpoint that is due (out of service past its backoff) or has not reported
    /// yet, and refreshes stale reports ([`STALE_REPORT`]), with `http` (whose timeout bounds
    /// each probe). A failed refresh changes nothing: the worker's own answers decide whether
    /// it is out of service.
    pub async fn probe(&self, http: &reqwest::Client, timeout: Duration) {
        let now = Instant::now();
        for endpoint in self.endpoints() {
            let refresh = endpoint.stale(now);
            if !(refresh.is_some() || endpoint.due_for_probe(now) || (endpoint.unknown() && !endpoint.is_ejected())) {
                continue;
            }
            // HTTP's `GET /vramgate/state`, or the stamps of a gRPC answer (`worker.protocol`).
            let state = endpoint.client.state(http, &self.model, timeout).await;
            if let Some(generation) = refresh {
                if let Some(state) = &state {
                    endpoint.refreshed(state, &self.model, generation);
                }
                continue;
            }
            let was_out = endpoint.is_ejected();
            let back = endpoint.probed(state.as_ref().ok_or(()), &self.model);
            if back {
                tracing::info!(task = %self.task, worker = %endpoint.url, "worker back in service");
            } else if !was_out && endpoint.is_ejected() {
                // A new endpoint that does not answer yet: out until it does.
                self.metrics.worker_ejections.with_label_values(&[&self.task, &endpoint.url]).inc();
            }
        }
    }

    /// Refreshes the per-worker gauges (called when metrics are scraped).
    pub fn publish(&self) {
        let m = &self.metrics;
        let endpoints = self.endpoints();
        m.workers.with_label_values(&[&self.task]).set(endpoints.len() as i64);
        for e in endpoints {
            let labels = [self.task.as_str(), e.url.as_str()];
            m.worker_free.with_label_values(&labels).set(e.free().unwrap_or(0));
            m.worker_permits.with_label_values(&labels).set(e.permits.limit() as i64);
            m.worker_ejected.with_label_values(&labels).set(i64::from(e.is_ejected()));
        }
    }

    fn forget_metrics(&self, url: &str) {
        let m = &self.metrics;
        let labels = [self.task.as_str(), url];
        for family in [&m.worker_requests, &m.worker_throttled, &m.worker_failures, &m.worker_ejections] {
            let _ = family.remove_label_values(&labels);
        }
        for family in [&m.worker_free, &m.worker_permits, &m.worker_ejected] {
            let _ = family.remove_label_values(&labels);
        }
    }

    /// Permits of all endpoints together.
    pub fn permit_limit(&self) -> usize {
        self.endpoints().iter().map(|e| e.permits.limit()).sum()
    }

    /// Records waiting for a permit, all endpoints together.
    pub fn waiting(&self) -> usize {
        self.endpoints().iter().map(|e| e.permits.waiting()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(urls: &[&str]) -> WorkerSet {
        let set = WorkerSet::new("t", "m", Routing::Memory, 1.0, None, PermitConfig::default(), Metrics::new());
        set.replace(&urls.iter().map(|u| u.to_string()).collect::<Vec<_>>()).expect("valid urls");
        set
    }

    fn report(budget: u64, admitted: u64) -> reqwest::header::HeaderMap {
        let mut headers = reqwest::header::HeaderMap::new();
        let admission = Admission { unit: Unit::Bytes, budget, admitted, queued: 0, queued_requests: 0 };
        for (name, value) in admission.headers() {
            headers.insert(name, value.parse().expect("ascii"));
        }
        headers.insert(worker_state::HEADER_ESTIMATE, "100;1".parse().expect("ascii"));
        headers
    }

    #[test]
    fn sends_count_against_a_worker_until_its_next_report() {
        let set = set(&["http://a", "http://b"]);
        let [a, b] = [0, 1].map(|i| set.endpoints()[i].clone());
        a.observe(&report(10_000, 0));
        b.observe(&report(6_000, 0));
        let first = set.choose(900, None).expect("a worker");
        assert_eq!(first.url, "http://a");
        let sent = first.send(900); // costs 100 + 900
        assert_eq!(a.free(), Some(9_000));
        let more: Vec<Sent> = (0..4).map(|_| a.send(900)).collect();
        assert_eq!(a.free(), Some(5_000));
        assert_eq!(set.choose(900, None).expect("a worker").url, "http://b", "a's own sends filled it");
        // A's next report includes what was sent; the calls ending later change nothing.
        a.observe(&report(10_000, 5_000));
        assert_eq!(a.free(), Some(5_000));
        assert!(!a.finish(sent, Ok(())));
        for s in more {
            a.finish(s, Ok(()));
        }
        assert_eq!(a.free(), Some(5_000));
    }

    #[test]
    fn failures_eject_and_a_probe_brings_back() {
        let set = set(&["http://a", "http://b"]);
        let a = set.endpoints()[0].clone();
        let failed = CallError::Failed { message: "500".into() };
        for _ in 1..EJECT_AFTER_FAILURES {
            assert!(!a.finish(a.send(1), Err(&failed)));
        }
        assert!(a.finish(a.send(1), Err(&failed)), "a streak ejects");
        assert!(a.is_ejected() && set.another_in_service("http://a"));
        assert_eq!(set.choose(1, None).expect("a worker").url, "http://b");
        assert!(!a.due_for_probe(Instant::now()), "not before its backoff");
        assert!(!a.probed(Err(()), "m"), "a failed probe keeps it out, for longer");
        let state = WorkerState {
            admission: Admission { unit: Unit::Bytes, budget: 5, admitted: 0, queued: 0, queued_requests: 0 },
            models: [("m".to_string(), Estimate { base_bytes: 1.0, bytes_per_element: 0.0 })].into(),
        };
        assert!(a.probed(Ok(&state), "m"));
        assert!(!a.is_ejected() && a.free() == Some(5));
        let refused = CallError::Unreachable { message: "refused".into() };
        assert!(a.finish(a.send(1), Err(&refused)), "a refused connection ejects at once");
        let busy = CallError::Throttled { status: 503, message: "busy".into(), retry_after: None };
        let b = set.endpoints()[1].clone();
        for _ in 0..10 {
            assert!(!b.finish(b.send(1), Err(&busy)), "503s never eject");
        }
    }

    #[test]
    fn a_report_of_load_goes_stale_once_no_call_is_left_to_refresh_it() {
        let set = set(&["http://a"]);
        let a = set.endpoints()[0].clone();
        let old = || Instant::now() + STALE_REPORT * 2;
        assert_eq!(a.stale(old()), None, "no report yet: the unknown-worker probe covers it");
        a.observe(&report(10_000, 0));
        assert_eq!(a.stale(old()), None, "it was idle when it reported: nothing to learn");
        a.observe(&report(10_000, 9_000));
        assert_eq!(a.stale(Instant::now()), None, "fresh");
        let generation = a.stale(old()).expect("loaded, old, and no call of ours will refresh it");
        let sent = a.send(1);
        assert_eq!(a.stale(old()), None, "a call in flight will bring a report");
        let idle = WorkerState {
            admission: Admission { unit: Unit::Bytes, budget: 10_000, admitted: 0, queued: 0, queued_requests: 0 },
            models: Default::default(),
        };
        a.refreshed(&idle, "m", generation);
        assert_eq!(a.free(), Some(1_000 - 101), "a refresh that crossed a send is dropped");
        a.finish(sent, Ok(()));
        a.observe(&report(10_000, 9_500));
        a.refreshed(&idle, "m", generation);
        assert_eq!(a.free(), Some(500), "a refresh older than the last answer is dropped");
        let generation = a.stale(old()).expect("the last answer showed load too");
        a.refreshed(&idle, "m", generation);
        assert_eq!(a.free(), Some(10_000), "taken with no call on the way");
        assert_eq!(a.stale(old()), None, "idle now");
        let failed = CallError::Unreachable { message: "refused".into() };
        a.finish(a.send(1), Err(&failed));
        assert_eq!(a.stale(old()), None, "ejected: the backoff's probe covers it");
    }

    #[tokio::test]
    async fn a_refresh_that_fails_changes_nothing() {
        // A port nothing listens on: the refresh is refused at once.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
        let set = set(&[&format!("http://{closed}")]);
        let a = set.endpoints()[0].clone();
        a.observe(&report(10_000, 9_000));
        a.health().reported_at = Instant::now().checked_sub(STALE_REPORT * 2);
        assert!(a.stale(Instant::now()).is_some());
        set.probe(&reqwest::Client::new(), Duration::from_secs(2)).await;
        assert!(!a.is_ejected(), "only the worker's answers to calls take it out of service");
        assert_eq!(a.free(), Some(1_000), "the report stands");
    }

    #[test]
    fn replacing_keeps_known_endpoints_and_their_state() {
        let set = set(&["http://a", "http://b/"]);
        set.endpoints()[0].observe(&report(7, 0));
        let (added, removed) = set.replace(&["http://c".into(), "http://a".into()]).expect("valid");
        assert_eq!((added, removed), (vec!["http://c".to_string()], vec!["http://b".to_string()]));
        assert_eq!(set.urls(), ["http://c", "http://a"]);
        assert_eq!(set.endpoints()[1].free(), Some(7));
    }
}
