//! Keeps a task's worker sets current (one per model it calls, all from the same source): probes workers that are out of service or not heard from
//! yet every [`PROBE_INTERVAL`] (and refreshes stale reports of load, `workers::STALE_REPORT`),
//! and, for workers found in DNS, resolves the name again every
//! `refresh_seconds` and adds and removes endpoints as the answer changes, without a restart.
//!
//! A name's workers ([`Finder`]) are its A and AAAA addresses on `port`, or, with `srv = true`,
//! every SRV target's A and AAAA addresses on that record's port. Two resolvers:
//! - **The system's** (no `nameserver`): addresses through `getaddrinfo` (tokio), so
//!   `/etc/hosts`, `nsswitch.conf`, `resolv.conf` and its search domains and `ndots` apply
//!   exactly as to any other process in the pod (a Kubernetes headless Service's short name
//!   resolves to one address per ready pod). `getaddrinfo` has no SRV, so SRV names go to
//!   hickory-resolver built from the same `resolv.conf` (its name servers, search domains and
//!   `ndots`) and `/etc/hosts`.
//! - **A named DNS server** (`nameserver = "ip:port"`): hickory-resolver with that server only
//!   (no system configuration, no hosts file), over UDP with EDNS, and over TCP when an answer
//!   comes back truncated.
//!
//! Every hickory query is bounded by [`PROBE_TIMEOUT`] and retried once; one whole lookup (A
//! and AAAA together; SRV, then its targets) by [`LOOKUP_TIMEOUT`]. Its cache is off, so a
//! change in DNS shows at the next refresh whatever the records' TTL.
//!
//! A name that does not exist (NXDOMAIN) or has no records empties the set; a lookup that fails
//! (no answer, timeout, a server error, one SRV target's lookup failing) keeps the previous set
//! and is logged. A and AAAA are asked separately so that one family failing keeps the set too,
//! rather than dropping the other family's workers for one refresh (hickory's `lookup_ip`
//! returns whichever family answered).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use hickory_resolver::config::{NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::rdata::SRV;
use hickory_resolver::proto::rr::{Name, RData, Record};
use hickory_resolver::TokioResolver;
use vramgate_shared::telemetry::{bounded, LogLimit, LOG_FIELD_MAX_BYTES};

use super::workers::WorkerSet;
use crate::config::{DnsConfig, WorkerSource};

/// How often workers out of service (or not heard from yet) are checked for a probe.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(250);
/// Limit of one probe, and of one DNS query (one try; a query is tried twice at most).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Limit of one whole lookup of a name's workers; past it the workers known are kept.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(4);
/// SRV targets looked up at a time.
const TARGETS_AT_ONCE: usize = 8;

static DNS_LOG: LogLimit = LogLimit::new(2);

/// Runs for as long as the gateway: probes, and follows DNS when the source is DNS. `sets` are
/// one task's worker sets (one per model it calls): the name is looked up once per refresh for
/// all of them; each set probes its own endpoints, whose health it keeps apart.
pub async fn maintain(sets: Vec<Arc<WorkerSet>>, source: WorkerSource) {
    let Some(first) = sets.first() else { return };
    let http = match reqwest::Client::builder().timeout(PROBE_TIMEOUT).connect_timeout(PROBE_TIMEOUT).build() {
        Ok(http) => http,
        Err(e) => {
            tracing::error!(error = %e, task = %first.task, "worker probes cannot start");
            return;
        }
    };
    let mut finder = match source {
        WorkerSource::Dns(dns) => Some(Finder::new(dns)),
        WorkerSource::Static(_) => None,
    };
    let mut next_lookup = Instant::now();
    loop {
        if let Some(finder) = &mut finder {
            if Instant::now() >= next_lookup {
                refresh(&sets, finder).await;
                next_lookup = Instant::now() + finder.dns.refresh();
            }
        }
        for set in &sets {
            set.probe(&http, PROBE_TIMEOUT).await;
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

/// Resolves the finder's name once and makes every one of `sets` match the answer.
pub async fn refresh(sets: &[Arc<WorkerSet>], finder: &mut Finder) {
    let Some(first) = sets.first() else { return };
    let task = &first.task;
    let found = match finder.find().await {
        Ok(found) => found,
        Err(e) => {
            if DNS_LOG.allow() {
                let error = bounded(&e, LOG_FIELD_MAX_BYTES);
                tracing::warn!(task = %task, name = %finder.dns.name, error, "worker lookup failed; keeping the workers known");
            }
            return;
        }
    };
    let dns = &finder.dns;
    let mut urls = found.urls;
    if found.in_dns > dns.max_endpoints {
        tracing::warn!(
            task = %task, name = %dns.name, found = found.in_dns, max_endpoints = dns.max_endpoints,
            "more workers in DNS than max_endpoints; the rest are ignored"
        );
        urls.truncate(dns.max_endpoints);
    }
    for set in sets {
        match set.replace(&urls) {
            Ok((added, removed)) if !added.is_empty() || !removed.is_empty() => {
                tracing::info!(task = %set.task, name = %dns.name, ?added, ?removed, workers = urls.len(), "workers changed in DNS");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(task = %set.task, error = %e, "workers from DNS could not be set up"),
        }
    }
}

/// What one lookup found.
#[derive(Debug, PartialEq)]
pub struct Found {
    /// Worker URLs, sorted by address and without repeats.
    pub urls: Vec<String>,
    /// Workers in DNS: `urls`, plus one for each SRV record past `max_endpoints` (not looked up).
    pub in_dns: usize,
}

/// Finds a task's workers in DNS. The hickory resolver is built at the first lookup that needs
/// one and kept (a build that fails is a failed lookup, tried again at the next refresh).
pub struct Finder {
    pub dns: DnsConfig,
    resolver: Option<TokioResolver>,
}

impl Finder {
    pub fn new(dns: DnsConfig) -> Self {
        Finder { dns, resolver: None }
    }

    /// The workers of the name now; an error keeps the set as it is.
    pub async fn find(&mut self) -> Result<Found, String> {
        let name = self.dns.name.clone();
        tokio::time::timeout(LOOKUP_TIMEOUT, self.lookup())
            .await
            .map_err(|_| format!("looking up {name} took longer than {LOOKUP_TIMEOUT:?}"))?
    }

    async fn lookup(&mut self) -> Result<Found, String> {
        let dns = &self.dns;
        if dns.nameserver.is_none() && !dns.srv {
            let found = tokio::net::lookup_host((dns.name.as_str(), dns.port))
                .await
                .map_err(|e| format!("resolving {}: {e}", dns.name))?;
            let urls = urls(&dns.scheme, found.collect());
            return Ok(Found { in_dns: urls.len(), urls });
        }
        let resolver: &TokioResolver = match &mut self.resolver {
            Some(resolver) => resolver,
            empty => empty.insert(build_resolver(dns)?),
        };
        let name = query_name(dns)?;
        if !dns.srv {
            let addresses = addresses(resolver, name).await?;
            let urls = urls(&dns.scheme, addresses.into_iter().map(|ip| SocketAddr::new(ip, dns.port)).collect());
            return Ok(Found { in_dns: urls.len(), urls });
        }
        let records = match resolver.srv_lookup(name).await {
            Ok(lookup) => {
                let srv = |r: &Record| match &r.data {
                    RData::SRV(srv) => Some(srv.clone()),
                    _ => None,
                };
                lookup.answers().iter().filter_map(srv).collect()
            }
            Err(e) if e.is_no_records_found() => Vec::new(),
            Err(e) => return Err(format!("SRV of {}: {e}", dns.name)),
        };
        let (targets, skipped) = srv_targets(records, dns.max_endpoints);
        let found: Vec<Vec<SocketAddr>> = futures::stream::iter(targets)
            .map(|(target, port)| async move {
                let ips = addresses(resolver, target).await?;
                Ok::<_, String>(ips.into_iter().map(|ip| SocketAddr::new(ip, port)).collect())
            })
            .buffered(TARGETS_AT_ONCE)
            .try_collect()
            .await?;
        let urls = urls(&dns.scheme, found.into_iter().flatten().collect());
        Ok(Found { in_dns: urls.len() + skipped, urls })
    }
}

/// A hickory resolver for `dns`: its `nameserver` alone, or the system's configuration.
fn build_resolver(dns: &DnsConfig) -> Result<TokioResolver, String> {
    let mut builder = match &dns.nameserver {
        Some(server) => {
            let server: SocketAddr = server.parse().map_err(|_| format!("nameserver '{server}' is not ip:port"))?;
            let mut ns = NameServerConfig::udp_and_tcp(server.ip());
            for connection in &mut ns.connections {
                connection.port = server.port();
            }
            let config = ResolverConfig::from_name_servers(vec![ns]);
            let mut builder = TokioResolver::builder_with_config(config, TokioRuntimeProvider::default());
            builder.options_mut().use_hosts_file = ResolveHosts::Never;
            builder
        }
        None => TokioResolver::builder_tokio().map_err(|e| format!("reading the system's DNS configuration: {e}"))?,
    };
    let options = builder.options_mut();
    options.timeout = PROBE_TIMEOUT;
    options.attempts = 1;
    // No cache: every refresh asks the server, so a change shows at the next one.
    options.cache_size = 0;
    options.positive_max_ttl = Some(Duration::ZERO);
    options.negative_max_ttl = Some(Duration::ZERO);
    builder.build().map_err(|e| format!("building the DNS resolver: {e}"))
}

/// `dns.name` as asked: as written under the system's configuration (its search domains apply
/// to a relative name), fully qualified when asking a named server (which has no search list).
fn query_name(dns: &DnsConfig) -> Result<Name, String> {
    let mut name = Name::from_ascii(dns.name.trim()).map_err(|e| format!("'{}' is not a DNS name: {e}", dns.name))?;
    if dns.nameserver.is_some() {
        name.set_fqdn(true);
    }
    Ok(name)
}

/// The A and AAAA addresses of `name`, asked in parallel. No records (or NXDOMAIN) for a
/// family is none of it; any other failure of either is an error.
async fn addresses(resolver: &TokioResolver, name: Name) -> Result<Vec<IpAddr>, String> {
    let (v4, v6) = tokio::join!(resolver.ipv4_lookup(name.clone()), resolver.ipv6_lookup(name.clone()));
    let mut found = Vec::new();
    for (family, answer) in [("A", v4), ("AAAA", v6)] {
        match answer {
            Ok(lookup) => found.extend(lookup.answers().iter().filter_map(|r| match &r.data {
                RData::A(a) => Some(IpAddr::V4(a.0)),
                RData::AAAA(aaaa) => Some(IpAddr::V6(aaaa.0)),
                _ => None,
            })),
            Err(e) if e.is_no_records_found() => {}
            Err(e) => return Err(format!("{family} of {name}: {e}")),
        }
    }
    Ok(found)
}

/// The (target, port) pairs of an SRV answer to look up, most preferred first (lowest priority,
/// then highest weight), without repeats and without "." (RFC 2782: no service here), at most
/// `max`; and how many more there were. Every target is a worker: priority and weight only
/// decide which are kept past `max`.
fn srv_targets(mut records: Vec<SRV>, max: usize) -> (Vec<(Name, u16)>, usize) {
    records.retain(|r| !r.target.is_root());
    records.sort_by_key(|r| (r.priority, std::cmp::Reverse(r.weight), r.target.clone(), r.port));
    let mut targets: Vec<(Name, u16)> = Vec::with_capacity(records.len().min(max));
    let mut skipped = 0;
    for r in records {
        if targets.iter().any(|(t, p)| *t == r.target && *p == r.port) {
            continue;
        }
        if targets.len() < max {
            targets.push((r.target, r.port));
        } else {
            skipped += 1;
        }
    }
    (targets, skipped)
}

/// Worker URLs of `addresses`, sorted and without repeats.
fn urls(scheme: &str, mut addresses: Vec<SocketAddr>) -> Vec<String> {
    addresses.sort();
    addresses.dedup();
    addresses.iter().map(|a| url(scheme, a.ip(), a.port())).collect()
}

fn url(scheme: &str, ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(ip) => format!("{scheme}://{ip}:{port}"),
        IpAddr::V6(ip) => format!("{scheme}://[{ip}]:{port}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn srv(priority: u16, weight: u16, port: u16, target: &str) -> SRV {
        SRV::new(priority, weight, port, Name::from_ascii(target).expect("a name"))
    }

    fn check_srv(records: Vec<SRV>, max: usize, expected: &[(&str, u16)], skipped: usize) {
        let (targets, more) = srv_targets(records, max);
        let targets: Vec<(String, u16)> = targets.into_iter().map(|(t, p)| (t.to_ascii(), p)).collect();
        let expected: Vec<(String, u16)> = expected.iter().map(|(t, p)| (t.to_string(), *p)).collect();
        assert_eq!((targets, more), (expected, skipped));
    }

    #[test]
    fn srv_records_become_targets_by_preference_without_repeats_or_root() {
        let records = || {
            vec![
                srv(20, 0, 9003, "c.test."),
                srv(10, 1, 9001, "a.test."),
                srv(10, 5, 9002, "b.test."),
                srv(10, 1, 9001, "a.test."),
                srv(0, 0, 9000, "."),
                srv(10, 1, 9004, "a.test."),
            ]
        };
        check_srv(records(), 64, &[("b.test.", 9002), ("a.test.", 9001), ("a.test.", 9004), ("c.test.", 9003)], 0);
        check_srv(records(), 2, &[("b.test.", 9002), ("a.test.", 9001)], 2);
        check_srv(vec![srv(0, 0, 1, ".")], 64, &[], 0);
    }

    #[test]
    fn urls_are_sorted_unique_and_bracket_ipv6() {
        let addrs = ["[::1]:9002", "10.0.0.2:9001", "10.0.0.1:9001", "10.0.0.2:9001", "10.0.0.2:8000"];
        let addrs: Vec<SocketAddr> = addrs.iter().map(|a| a.parse().expect("an address")).collect();
        assert_eq!(
            urls("https", addrs),
            ["https://10.0.0.1:9001", "https://10.0.0.2:8000", "https://10.0.0.2:9001", "https://[::1]:9002"]
        );
    }

    #[test]
    fn names_for_a_named_server_are_fully_qualified() {
        let dns = |nameserver: Option<&str>| DnsConfig {
            name: "workers.ns".into(),
            nameserver: nameserver.map(String::from),
            ..DnsConfig::default()
        };
        assert!(query_name(&dns(Some("127.0.0.1:53"))).expect("a name").is_fqdn());
        assert!(!query_name(&dns(None)).expect("a name").is_fqdn());
        let srv = DnsConfig { name: "_http._tcp.ai-worker.ns.svc.cluster.local".into(), ..dns(None) };
        assert_eq!(query_name(&srv).expect("an SRV name").num_labels(), 7);
    }

    #[tokio::test]
    async fn the_system_resolver_finds_localhost() {
        let mut finder = Finder::new(DnsConfig { name: "localhost".into(), ..DnsConfig::default() });
        let found = finder.find().await.expect("localhost resolves");
        assert!(found.urls.iter().any(|u| u == "http://127.0.0.1:8081" || u == "http://[::1]:8081"), "{found:?}");
    }

    /// A server that never answers: the lookup fails (the set would be kept) within its bound.
    #[tokio::test]
    async fn a_silent_server_is_a_failed_lookup_within_the_bound() {
        let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await.expect("a socket");
        let nameserver = Some(silent.local_addr().expect("its address").to_string());
        let mut finder = Finder::new(DnsConfig { name: "w.test".into(), nameserver, ..DnsConfig::default() });
        let started = Instant::now();
        let error = finder.find().await.expect_err("no answer");
        // Bounded: well short of what an unbounded resolver would wait, with room for a loaded
        // machine (a tight bound here would be a timing assertion that fails under CI load).
        assert!(started.elapsed() <= LOOKUP_TIMEOUT + Duration::from_secs(5), "{:?}: {error}", started.elapsed());
    }
}
