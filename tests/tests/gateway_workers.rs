//! Many workers behind one gateway (`call::workers`, `call::route`, `call::discovery`):
//!
//! - three workers sized 1×, 2× and 4× one memory budget under the same mixed load, routed
//!   round-robin and then by free memory: completed work and 503s per worker are printed; by
//!   memory, the 4× card completes more than the 1× card, with no OOM and fewer 503s than
//!   round-robin;
//! - one of them SIGKILLed mid-run and restarted: every event still ends in a result or a dead
//!   letter, the dead worker is ejected, the others take its calls, and it rejoins;
//! - workers found in DNS (a DNS server run by the test): added and removed endpoints are
//!   followed without a restart; A and AAAA answers, SRV targets on their records' ports, a
//!   truncated answer read again over TCP, and the `max_endpoints` cap, on the worker set alone;
//! - a worker another client loaded while the gateway last heard from it: once that load
//!   drains, the gateway's estimate of its room is refreshed without a call of its own.

use std::collections::HashSet;
use std::sync::Arc;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use vramgate_gateway::call::discovery::{refresh, Finder};
use vramgate_gateway::call::workers::WorkerSet;
use vramgate_gateway::config::{DnsConfig, PermitConfig, Routing};
use vramgate_gateway::metrics::Metrics;
use vramgate_tests::dns::DnsServer;
use vramgate_tests::fleet::{self, fleet_env, mixed_events, run_load, shares, start_cards};
use vramgate_tests::wav::{compose, write_wav, SampleFormat};
use vramgate_tests::{
    gateway_base_env, producer, request_file, scratch_dir, send_all, start_gateway, start_worker, start_worker_on,
    unique, voice_task_env, worker_config, Collector, Gateway, TaskTopics, VAD_MODEL,
};

const EVENTS_PER_TASK: usize = 150;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_aware_routing_splits_work_by_capacity_with_fewer_503s_than_round_robin() {
    let root = scratch_dir("fleet-split");
    let cards = start_cards(&[1, 2, 4]).await.expect("workers start");
    let workers: Vec<_> = cards.iter().collect();
    let timeout = Duration::from_secs(400);
    let rr = run_load(&workers, "round_robin", EVENTS_PER_TASK, &root, timeout).await.expect("round-robin run");
    rr.print("1x/2x/4x cards");
    let memory = run_load(&workers, "memory", EVENTS_PER_TASK, &root, timeout).await.expect("memory run");
    memory.print("1x/2x/4x cards");

    for run in [&rr, &memory] {
        assert!(run.finished && run.lost == 0, "{}: {} of {} events without an output", run.routing, run.lost, run.events);
        assert!(run.dead_letters.is_empty(), "{}: dead letters from valid inputs: {:?}", run.routing, run.dead_letters);
    }
    assert_eq!(memory.ooms, 0.0, "admission by the workers' reports let an OOM happen");
    let done: Vec<f64> = memory.shares.iter().map(fleet::WorkerShare::completed).collect();
    assert!(done[2] > done[0], "by memory, the 4x card completed {} calls, the 1x card {}", done[2], done[0]);
    assert!(
        memory.throttled() < rr.throttled(),
        "routing by memory met {} 503s, round-robin {}",
        memory.throttled(),
        rr.throttled()
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// Whether `done` came to hold for `gateway`'s metrics within `timeout`.
async fn wait_metrics(gateway: &Gateway, timeout: Duration, done: impl Fn(&vramgate_tests::metrics::Scrape) -> bool) -> bool {
    gateway.metrics_when(timeout, &done).await.is_ok_and(|m| done(&m))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_run_is_ejected_and_rejoins_and_no_event_is_lost() {
    let root = scratch_dir("fleet-kill");
    let mut cards = start_cards(&[1, 2, 4]).await.expect("workers start");
    let voice = TaskTopics::create("fleet-kill-v", 4).await.expect("topics");
    let image = TaskTopics::create("fleet-kill-i", 4).await.expect("topics");
    let urls: Vec<String> = cards.iter().map(|w| w.url.clone()).collect();
    let url_refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let env = fleet_env(&unique("gw"), &cards.iter().collect::<Vec<_>>(), "memory", &root, &voice, &image);
    let gateway = start_gateway(&env).await.expect("gateway starts");
    let collector = Collector::start(&[&voice.results, &voice.dlq, &image.results, &image.dlq]).expect("collector");
    let producer = producer();

    let (v1, i1) = mixed_events(&root, EVENTS_PER_TASK);
    let mut ids: Vec<String> = v1.iter().chain(&i1).map(|(id, _)| id.clone()).collect();
    send_all(&producer, &voice.requests, &v1, 256).await.expect("send");
    send_all(&producer, &image.requests, &i1, 256).await.expect("send");
    let wanted: HashSet<String> = ids.iter().cloned().collect();
    let quarter = ids.len() / 4;
    let started = Instant::now();
    assert!(
        collector.wait_until(Duration::from_secs(240), |got| got.keys().filter(|id| wanted.contains(*id)).count() >= quarter).await,
        "a quarter of the events not done in 240 s: {:?}; log:\n{}",
        collector.counts(),
        gateway.log_tail()
    );
    let killed = 2;
    let addr = cards[killed].addr().to_string();
    let status = cards[killed].service.kill().expect("SIGKILL the 4x worker");
    let before = shares(&gateway, &url_refs).await.expect("metrics");
    eprintln!("4x worker killed ({status}) after {:?}; calls so far {before:?}", started.elapsed());
    tokio::time::sleep(Duration::from_secs(2)).await;
    cards[killed] = start_worker_on(&fleet::card_config(4), &addr).await.expect("worker restarts on its address");
    let back = wait_metrics(&gateway, Duration::from_secs(90), |m| {
        m.sum("vramgate_gateway_worker_ejected", &[("worker", urls[killed].as_str())]) == 0.0
    })
    .await;
    assert!(back, "the restarted worker was not back in service within 90 s; log:\n{}", gateway.log_tail());
    let at_rejoin = shares(&gateway, &url_refs).await.expect("metrics");
    eprintln!("restarted and back in service after {:?}", started.elapsed());

    // More load after it rejoined: it takes calls again.
    let more_root = root.join("more");
    std::fs::create_dir_all(&more_root).expect("scratch folder");
    let (v2, i2) = mixed_events(&more_root, EVENTS_PER_TASK / 2);
    ids.extend(v2.iter().chain(&i2).map(|(id, _)| id.clone()));
    send_all(&producer, &voice.requests, &v2, 256).await.expect("send");
    send_all(&producer, &image.requests, &i2, 256).await.expect("send");
    let wanted: HashSet<String> = ids.iter().cloned().collect();
    let all = collector
        .wait_until(Duration::from_secs(300), |got| got.keys().filter(|id| wanted.contains(*id)).count() >= ids.len())
        .await;
    let after = shares(&gateway, &url_refs).await.expect("metrics");
    let records = collector.snapshot();
    let lost: Vec<&String> = ids.iter().filter(|id| !records.contains_key(*id)).collect();
    let mut dead = std::collections::BTreeMap::<String, usize>::new();
    let mut results = 0;
    for id in &ids {
        for r in records.get(id).into_iter().flatten() {
            if r.topic.ends_with(".dlq") {
                *dead.entry(r.value["error"]["kind"].as_str().unwrap_or("?").to_string()).or_default() += 1;
            } else {
                results += 1;
            }
        }
    }
    eprintln!(
        "{} events, the 4x worker killed after {quarter}: {results} results, dead letters {dead:?}, lost {}; \
         per worker at the end {after:?}; wall time {:?}",
        ids.len(),
        lost.len(),
        started.elapsed()
    );
    assert!(all && lost.is_empty(), "{} events lost, e.g. {:?}; log:\n{}", lost.len(), &lost[..lost.len().min(5)], gateway.log_tail());
    let unexpected: Vec<&String> = dead.keys().filter(|k| !["worker_unavailable", "timeout"].contains(&k.as_str())).collect();
    assert!(unexpected.is_empty(), "dead letters of kinds {unexpected:?} from valid inputs");
    assert!(after[killed].ejections >= 1.0, "the killed worker was never ejected: {after:?}");
    for (i, share) in after.iter().enumerate().filter(|(i, _)| *i != killed) {
        assert!(share.completed() > before[i].completed(), "worker {i} took no calls after the kill: {after:?}");
    }
    assert!(
        after[killed].completed() > at_rejoin[killed].completed(),
        "the restarted worker took no calls after it rejoined: at rejoin {:?}, at the end {:?}",
        at_rejoin[killed],
        after[killed]
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// `count` voice events of 1 s, under `root`.
fn clips(root: &std::path::Path, phase: usize, count: usize) -> Vec<(String, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let id = unique(&format!("d{phase}-{i}"));
            let clip = compose(None, 0.5, 0.5, 16_000, 1, (phase * 1000 + i) as u64);
            let path = root.join(format!("d{phase}-{i}.wav"));
            write_wav(&path, &clip.samples, 16_000, 1, SampleFormat::I16).expect("write wav");
            (id.clone(), request_file(&id, "voice", &path))
        })
        .collect()
}

/// One phase of the DNS test: its events sent, and all events so far answered.
struct Phase<'a> {
    root: &'a std::path::Path,
    topics: &'a TaskTopics,
    producer: &'a rdkafka::producer::FutureProducer,
    collector: &'a Collector,
    gateway: &'a Gateway,
}

impl Phase<'_> {
    async fn run(&self, phase: usize, count: usize, ids: &mut Vec<String>) -> vramgate_tests::metrics::Scrape {
        let records = clips(self.root, phase, count);
        ids.extend(records.iter().map(|(id, _)| id.clone()));
        send_all(self.producer, &self.topics.requests, &records, 64).await.expect("send");
        let wanted: HashSet<String> = ids.iter().cloned().collect();
        let n = ids.len();
        let done = self
            .collector
            .wait_until(Duration::from_secs(120), |got| got.keys().filter(|id| wanted.contains(*id)).count() >= n)
            .await;
        assert!(done, "phase {phase} unfinished: {:?}; log:\n{}", self.collector.counts(), self.gateway.log_tail());
        self.gateway.metrics().await.expect("metrics")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_found_in_dns_are_added_and_removed_without_a_restart() {
    const NAME: &str = "workers.vramgate.test";
    let root = scratch_dir("fleet-dns");
    let dns = DnsServer::start().await.expect("dns server");
    let config = worker_config("", &[VAD_MODEL]);
    // Two workers on one port, at two loopback addresses: what DNS tells apart.
    let mut a = start_worker_on(&config, "127.0.0.2:0").await.expect("worker a starts");
    let port: u16 = a.addr().rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port");
    let b = start_worker_on(&config, &format!("127.0.0.3:{port}")).await.expect("worker b starts");
    let (url_a, url_b) = (a.url.clone(), b.url.clone());
    dns.set(NAME, &[Ipv4Addr::new(127, 0, 0, 2)]);

    let topics = TaskTopics::create("fleet-dns", 2).await.expect("topics");
    let mut env = gateway_base_env(&unique("gw"), "http://127.0.0.1:9", &root);
    env.extend([
        ("WORKER__DNS__NAME", NAME.to_string()),
        ("WORKER__DNS__PORT", port.to_string()),
        ("WORKER__DNS__NAMESERVER", dns.addr.to_string()),
        ("WORKER__DNS__REFRESH_SECONDS", "0.5".into()),
        ("TASKS__IMAGE__ENABLED", "false".into()),
        ("TASKS__VOICE__CPU_THREADS", "1".into()),
    ]);
    env.extend(voice_task_env(&topics));
    let gateway = start_gateway(&env).await.expect("gateway starts");
    let collector = Collector::start(&[&topics.results, &topics.dlq]).expect("collector");
    let producer = producer();
    let calls = |m: &vramgate_tests::metrics::Scrape, url: &str| m.sum("vramgate_gateway_worker_requests_total", &[("worker", url)]);
    let knows = |n: f64| move |m: &vramgate_tests::metrics::Scrape| m.sum("vramgate_gateway_workers", &[("task", "voice")]) == n;

    let mut ids = Vec::new();
    let phase = Phase { root: &root, topics: &topics, producer: &producer, collector: &collector, gateway: &gateway };
    assert!(wait_metrics(&gateway, Duration::from_secs(30), knows(1.0)).await, "the DNS worker was not found");
    let m1 = phase.run(1, 30, &mut ids).await;
    eprintln!("one address in DNS: calls a {}, b {}", calls(&m1, &url_a), calls(&m1, &url_b));
    assert!(calls(&m1, &url_a) >= 30.0 && calls(&m1, &url_b) == 0.0);

    dns.set(NAME, &[Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3)]);
    assert!(wait_metrics(&gateway, Duration::from_secs(30), knows(2.0)).await, "the added worker was not found");
    let m2 = phase.run(2, 60, &mut ids).await;
    eprintln!("two addresses in DNS: calls a {}, b {}", calls(&m2, &url_a), calls(&m2, &url_b));
    assert!(calls(&m2, &url_b) > 0.0, "the worker added in DNS took no calls");

    dns.set(NAME, &[Ipv4Addr::new(127, 0, 0, 3)]);
    assert!(wait_metrics(&gateway, Duration::from_secs(30), knows(1.0)).await, "the removed worker was not dropped");
    // Stopped, so a call still sent to it would fail and show as a failure or a dead letter.
    a.service.kill().expect("stop worker a");
    let m3 = phase.run(3, 30, &mut ids).await;
    eprintln!("only b in DNS: calls b {}, a's counters present: {}", calls(&m3, &url_b), m3.text.contains(&url_a));
    assert!(calls(&m3, &url_b) >= calls(&m2, &url_b) + 30.0);
    assert!(!m3.text.contains(&url_a), "the removed worker still has metrics:\n{}", m3.text);
    assert_eq!(m3.sum("vramgate_gateway_worker_failures_total", &[]), 0.0, "calls failed:\n{}", m3.text);
    let records = collector.snapshot();
    let dead: usize = ids.iter().filter_map(|id| records.get(id)).flatten().filter(|r| r.topic == topics.dlq).count();
    assert_eq!(dead, 0, "dead letters from valid inputs");
    drop(b);
    let _ = std::fs::remove_dir_all(&root);
}

/// What DNS discovery makes of answers, on a worker set alone (no broker, no worker: only the
/// URLs matter here): both address families, SRV targets with their records' ports, an answer
/// too long for UDP read over TCP, NXDOMAIN emptying the set, and the `max_endpoints` cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_answers_of_both_families_and_srv_targets_become_workers() {
    let dns = DnsServer::start().await.expect("dns server");
    let set = Arc::new(WorkerSet::new("voice", "m", Routing::Memory, 1.0, None, PermitConfig::default(), Metrics::new()));
    let finder = |name: &str, srv: bool, max_endpoints: usize| {
        let nameserver = Some(dns.addr.to_string());
        Finder::new(DnsConfig { name: name.into(), srv, port: 8081, nameserver, max_endpoints, ..DnsConfig::default() })
    };
    async fn urls_after(set: &Arc<WorkerSet>, finder: &mut Finder) -> Vec<String> {
        refresh(std::slice::from_ref(set), finder).await;
        set.urls()
    }
    let v6 = |last: u16| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, last));

    // A and AAAA of one name: both families, IPv6 in brackets; a change is seen at the next
    // refresh (no cache), with the same finder.
    let dual = "dual.vramgate.test";
    dns.set(dual, &[IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)), v6(1), IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))]);
    let mut both = finder(dual, false, 64);
    let got = urls_after(&set, &mut both).await;
    eprintln!("A and AAAA: {got:?}");
    assert_eq!(got, ["http://10.0.0.1:8081", "http://10.0.0.2:8081", "http://[fd00::1]:8081"]);
    dns.set(dual, &[v6(1), v6(2)]);
    assert_eq!(urls_after(&set, &mut both).await, ["http://[fd00::1]:8081", "http://[fd00::2]:8081"]);

    // SRV: each target's addresses on its record's port (the configured 8081 unused); a target
    // without addresses adds none, and "." is no target.
    let service = "_http._tcp.workers.vramgate.test";
    dns.set("a.vramgate.test", &[Ipv4Addr::new(10, 0, 1, 1)]);
    dns.set("b.vramgate.test", &[IpAddr::V4(Ipv4Addr::new(10, 0, 1, 2)), v6(3)]);
    dns.set_srv(
        service,
        &[(10, 0, 9001, "a.vramgate.test."), (10, 0, 9002, "b.vramgate.test."), (20, 0, 9003, "gone.vramgate.test."), (0, 0, 9, ".")],
    );
    let mut srv = finder(service, true, 64);
    let got = urls_after(&set, &mut srv).await;
    eprintln!("SRV: {got:?}");
    assert_eq!(got, ["http://10.0.1.1:9001", "http://10.0.1.2:9002", "http://[fd00::3]:9002"]);
    // Capped: the most preferred records are looked up, and the URLs cut to max_endpoints.
    let found = finder(service, true, 1).find().await.expect("SRV lookup");
    assert_eq!((found.urls, found.in_dns), (vec!["http://10.0.1.1:9001".to_string()], 3));
    assert_eq!(urls_after(&set, &mut finder(service, true, 2)).await, ["http://10.0.1.1:9001", "http://10.0.1.2:9002"]);

    // 40 addresses: 640 bytes of records, over the server's 512-byte UDP answers, so truncated
    // there and read again over TCP; capped at 32.
    let many = "many.vramgate.test";
    let ips: Vec<Ipv4Addr> = (1..=40).map(|i| Ipv4Addr::new(10, 0, 2, i)).collect();
    dns.set(many, &ips);
    let over_tcp = dns.tcp_queries();
    let found = finder(many, false, 64).find().await.expect("lookup over TCP");
    assert_eq!(found.urls.len(), 40, "{found:?}");
    assert!(dns.tcp_queries() > over_tcp, "the truncated answer was not asked again over TCP");
    assert_eq!(over_tcp, 0, "short answers came over TCP");
    let got = urls_after(&set, &mut finder(many, false, 32)).await;
    assert_eq!(got.len(), 32);
    assert_eq!(got.first().map(String::as_str), Some("http://10.0.2.1:8081"));

    // NXDOMAIN (the name removed) empties the set.
    dns.set::<IpAddr>(dual, &[]);
    assert!(urls_after(&set, &mut both).await.is_empty());
}

/// What the gateway knows of a worker's room comes with the worker's answers; load that another
/// client (another gateway; here the test) put on it is in the last answer the gateway got, and
/// when that load drains the gateway has nothing to learn it from but a refresh of the stale
/// report (`call::workers::STALE_REPORT`). Without it the worker would stay "short" here, and
/// by memory a short worker is not sent to while another has room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_of_load_from_another_client_is_refreshed_once_that_load_drains() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use vramgate_shared::worker_state::{WorkerState, STATE_PATH};
    use vramgate_tests::oip_client::{infer, test_audio};

    let root = scratch_dir("fleet-stale");
    // A set budget (one that followed the machine's free memory would move under the test) of
    // three Silero requests (its fit: 7.5 MiB each, whatever the length), so that the other
    // client's 8 callers always have work admitted or queued: no report in that time can show
    // the worker idle, whichever moment it is taken at.
    let fixed = "memory_budget_bytes = 25165824\nmemory_reserve_bytes = 0\nmemory_reserve_fraction = 0.0\n";
    let worker = start_worker(&worker_config(fixed, &[VAD_MODEL])).await.expect("worker starts");
    let http = reqwest::Client::new();
    let state: WorkerState =
        http.get(format!("{}{STATE_PATH}", worker.url)).send().await.expect("state").json().await.expect("json");
    let budget = state.admission.budget as f64;

    // Another client keeps the worker busy: 8 callers, 30 s clips, back to back.
    let stop = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = (0..8)
        .map(|i| {
            let (http, url, stop) = (http.clone(), worker.url.clone(), stop.clone());
            tokio::spawn(async move {
                let mut calls = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let clip = test_audio(480_000, i);
                    let _ = infer(&http, &url, "silero_vad", "audio", vec![1, 480_000], clip, None).await;
                    calls += 1;
                }
                calls
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;

    let topics = TaskTopics::create("fleet-stale", 2).await.expect("topics");
    let mut env = gateway_base_env(&unique("gw"), &worker.url, &root);
    env.extend([("TASKS__IMAGE__ENABLED", "false".to_string())]);
    env.extend(voice_task_env(&topics));
    let gateway = start_gateway(&env).await.expect("gateway starts");
    let collector = Collector::start(&[&topics.results, &topics.dlq]).expect("collector");
    let events: Vec<(String, Vec<u8>)> = (0..10)
        .map(|i| {
            let id = unique("stale");
            let value = fleet::voice_event(&root, &id, i, 2.0);
            (id, value)
        })
        .collect();
    send_all(&producer(), &topics.requests, &events, 16).await.expect("send");
    let ids: HashSet<String> = events.iter().map(|(id, _)| id.clone()).collect();
    assert!(
        collector.wait_until(Duration::from_secs(120), |got| ids.iter().all(|id| got.contains_key(id))).await,
        "the gateway's events did not finish; log:\n{}",
        gateway.log_tail()
    );
    let free = |m: &vramgate_tests::metrics::Scrape| {
        m.sum("vramgate_gateway_worker_free_estimate", &[("worker", worker.url.as_str())])
    };
    let loaded = free(&gateway.metrics().await.expect("metrics"));
    stop.store(true, Ordering::Relaxed);
    let mut direct = 0;
    for task in load {
        direct += task.await.expect("a load task");
    }
    let drained = Instant::now();
    let refreshed = wait_metrics(&gateway, Duration::from_secs(10), |m| free(m) == budget).await;
    eprintln!(
        "budget {budget}; the gateway's estimate of free room under the other client's load {loaded} \
         ({direct} calls of it), back to the budget {:?} after that load ended: {refreshed}",
        drained.elapsed()
    );
    assert!(loaded < budget, "the other client's load never showed in the gateway's estimate ({loaded} of {budget})");
    let now = free(&gateway.metrics().await.expect("metrics"));
    assert!(refreshed, "the gateway still expects {now} free of {budget} with the worker idle");
    let _ = std::fs::remove_dir_all(&root);
}
