//! Keeps a task's worker set current: probes workers that are out of service or not heard from
//! yet every [`PROBE_INTERVAL`] (and refreshes stale reports of load, `workers::STALE_REPORT`),
//! and, for workers found in DNS, resolves the name again every
//! `refresh_seconds` and adds and removes endpoints as the answer changes, without a restart.
//!
//! Two resolvers:
//! - **The system's** (default): `getaddrinfo` through tokio, so `/etc/hosts`, `resolv.conf`
//!   and its search domains apply exactly as to any other process in the pod (a Kubernetes
//!   headless Service's short name resolves to one address per ready pod).
//! - **A named DNS server** (`nameserver = "ip:port"`): one A query over UDP with EDNS (4 KiB
//!   answers, room for 64 addresses), built and parsed here ([`query`], [`parse_answer`]); it
//!   is what the integration test points at a DNS server it controls, and what a deployment
//!   uses to ask a particular server without touching the system's configuration.
//!
//! A name that does not exist (NXDOMAIN) or has no addresses empties the set; a lookup that
//! fails (no answer, timeout, a malformed answer) keeps the previous set and is logged.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vramgate_shared::telemetry::{bounded, LogLimit, LOG_FIELD_MAX_BYTES};

use super::workers::WorkerSet;
use crate::config::{DnsConfig, WorkerSource};

/// How often workers out of service (or not heard from yet) are checked for a probe.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(250);
/// Limit of one probe, and of one DNS query.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest DNS answer read (the EDNS buffer size offered).
const DNS_BUFFER: usize = 4096;

static DNS_LOG: LogLimit = LogLimit::new(2);

/// Runs for as long as the gateway: probes, and follows DNS when the source is DNS.
pub async fn maintain(set: Arc<WorkerSet>, source: WorkerSource) {
    let http = match reqwest::Client::builder().timeout(PROBE_TIMEOUT).connect_timeout(PROBE_TIMEOUT).build() {
        Ok(http) => http,
        Err(e) => {
            tracing::error!(error = %e, task = %set.task, "worker probes cannot start");
            return;
        }
    };
    let mut next_lookup = Instant::now();
    loop {
        if let WorkerSource::Dns(dns) = &source {
            if Instant::now() >= next_lookup {
                refresh(&set, dns).await;
                next_lookup = Instant::now() + dns.refresh();
            }
        }
        set.probe(&http).await;
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

/// Resolves `dns` once and makes the set match the answer.
pub async fn refresh(set: &WorkerSet, dns: &DnsConfig) {
    let addresses = match resolve(dns).await {
        Ok(addresses) => addresses,
        Err(e) => {
            if DNS_LOG.allow() {
                let error = bounded(&e, LOG_FIELD_MAX_BYTES);
                tracing::warn!(task = %set.task, name = %dns.name, error, "worker lookup failed; keeping the workers known");
            }
            return;
        }
    };
    let mut urls: Vec<String> = addresses.iter().map(|ip| url(&dns.scheme, *ip, dns.port)).collect();
    if urls.len() > dns.max_endpoints {
        tracing::warn!(
            task = %set.task, name = %dns.name, found = urls.len(), max_endpoints = dns.max_endpoints,
            "more workers in DNS than max_endpoints; the rest are ignored"
        );
        urls.truncate(dns.max_endpoints);
    }
    match set.replace(&urls) {
        Ok((added, removed)) if !added.is_empty() || !removed.is_empty() => {
            tracing::info!(task = %set.task, name = %dns.name, ?added, ?removed, workers = urls.len(), "workers changed in DNS");
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(task = %set.task, error = %e, "workers from DNS could not be set up"),
    }
}

fn url(scheme: &str, ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(ip) => format!("{scheme}://{ip}:{port}"),
        IpAddr::V6(ip) => format!("{scheme}://[{ip}]:{port}"),
    }
}

/// The addresses of `dns.name`, sorted and without repeats.
pub async fn resolve(dns: &DnsConfig) -> Result<Vec<IpAddr>, String> {
    let mut addresses: Vec<IpAddr> = match &dns.nameserver {
        Some(server) => {
            let server: SocketAddr =
                server.parse().map_err(|_| format!("nameserver '{server}' is not ip:port"))?;
            query(server, &dns.name).await?.into_iter().map(IpAddr::V4).collect()
        }
        None => {
            let found = tokio::time::timeout(PROBE_TIMEOUT, tokio::net::lookup_host((dns.name.as_str(), dns.port)))
                .await
                .map_err(|_| format!("resolving {} took longer than {PROBE_TIMEOUT:?}", dns.name))?
                .map_err(|e| format!("resolving {}: {e}", dns.name))?;
            found.map(|a| a.ip()).collect()
        }
    };
    addresses.sort();
    addresses.dedup();
    Ok(addresses)
}

/// Asks `server` for the A records of `name` over UDP. NXDOMAIN is an empty answer.
pub async fn query(server: SocketAddr, name: &str) -> Result<Vec<Ipv4Addr>, String> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let id = (nanos ^ std::process::id()) as u16;
    let request = build_query(id, name)?;
    let local: SocketAddr = if server.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("valid address");
    let socket = tokio::net::UdpSocket::bind(local).await.map_err(|e| format!("opening a UDP socket: {e}"))?;
    socket.connect(server).await.map_err(|e| format!("DNS server {server}: {e}"))?;
    socket.send(&request).await.map_err(|e| format!("asking {server}: {e}"))?;
    let mut buffer = vec![0u8; DNS_BUFFER];
    let deadline = tokio::time::Instant::now() + PROBE_TIMEOUT;
    loop {
        let len = tokio::time::timeout_at(deadline, socket.recv(&mut buffer))
            .await
            .map_err(|_| format!("DNS server {server} did not answer within {PROBE_TIMEOUT:?}"))?
            .map_err(|e| format!("reading {server}'s answer: {e}"))?;
        match parse_answer(id, &buffer[..len]) {
            // A stray datagram (another id) is skipped; the deadline bounds the wait.
            Err(AnswerError::OtherId) => continue,
            Err(AnswerError::Bad(e)) => return Err(format!("{server} answered for {name}: {e}")),
            Ok(addresses) => return Ok(addresses),
        }
    }
}

/// An A query for `name`, recursion desired, with an EDNS record offering [`DNS_BUFFER`].
fn build_query(id: u16, name: &str) -> Result<Vec<u8>, String> {
    let name = name.trim().trim_end_matches('.');
    if name.is_empty() || name.len() > 253 {
        return Err(format!("'{name}' is not a DNS name (1 to 253 characters)"));
    }
    let mut q = Vec::with_capacity(name.len() + 30);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 1]); // RD; 1 question, 1 additional
    for label in name.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(format!("'{name}' has an empty label or one longer than 63 characters"));
        }
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]); // root; type A; class IN
    q.extend_from_slice(&[0, 0, 41]); // OPT record: root name, type 41
    q.extend_from_slice(&(DNS_BUFFER as u16).to_be_bytes());
    q.extend_from_slice(&[0, 0, 0, 0, 0, 0]); // extended rcode and flags, no data
    Ok(q)
}

#[derive(Debug, PartialEq)]
enum AnswerError {
    OtherId,
    Bad(String),
}

/// The A records in an answer to query `id`. Every read is bounds-checked: a malformed or
/// hostile answer is an error, never a panic.
fn parse_answer(id: u16, buf: &[u8]) -> Result<Vec<Ipv4Addr>, AnswerError> {
    let bad = |m: &str| AnswerError::Bad(m.to_string());
    let u16_at = |at: usize| -> Result<u16, AnswerError> {
        buf.get(at..at + 2).map(|b| u16::from_be_bytes([b[0], b[1]])).ok_or_else(|| bad("answer cut short"))
    };
    if u16_at(0)? != id {
        return Err(AnswerError::OtherId);
    }
    let flags = u16_at(2)?;
    if flags & 0x8000 == 0 {
        return Err(bad("not an answer"));
    }
    match flags & 0x000f {
        0 => {}
        3 => return Ok(Vec::new()),
        rcode => return Err(AnswerError::Bad(format!("error code {rcode}"))),
    }
    let questions = u16_at(4)?;
    let answers = u16_at(6)?;
    let mut at = 12;
    for _ in 0..questions {
        at = skip_name(buf, at)? + 4;
    }
    let mut found = Vec::new();
    for _ in 0..answers {
        at = skip_name(buf, at)?;
        let (kind, class, len) = (u16_at(at)?, u16_at(at + 2)?, u16_at(at + 8)? as usize);
        let data = buf.get(at + 10..at + 10 + len).ok_or_else(|| bad("record cut short"))?;
        if kind == 1 && class == 1 && len == 4 {
            found.push(Ipv4Addr::new(data[0], data[1], data[2], data[3]));
        }
        at += 10 + len;
    }
    Ok(found)
}

/// The position after the name at `at` (labels, ending in a zero byte or a pointer).
fn skip_name(buf: &[u8], mut at: usize) -> Result<usize, AnswerError> {
    for _ in 0..128 {
        let len = *buf.get(at).ok_or_else(|| AnswerError::Bad("name cut short".into()))? as usize;
        match len & 0xc0 {
            0 if len == 0 => return Ok(at + 1),
            0 => at += 1 + len,
            0xc0 => return Ok(at + 2),
            _ => return Err(AnswerError::Bad("unknown label type".into())),
        }
    }
    Err(AnswerError::Bad("name with too many labels".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer to `query` with `ips` as A records (names as pointers to the question), plus a
    /// CNAME-like record of another type that must be skipped.
    fn answer(query: &[u8], ips: &[[u8; 4]]) -> Vec<u8> {
        let question_end = skip_name(query, 12).expect("name") + 4;
        let mut a = query[..question_end].to_vec();
        a[2] = 0x81;
        a[3] = 0x80;
        a[6..8].copy_from_slice(&((ips.len() + 1) as u16).to_be_bytes());
        a[10..12].copy_from_slice(&[0, 0]);
        a.extend_from_slice(&[0xc0, 12, 0, 5, 0, 1, 0, 0, 0, 30, 0, 2, 0xc0, 12]);
        for ip in ips {
            a.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4]);
            a.extend_from_slice(ip);
        }
        a
    }

    #[test]
    fn answers_are_parsed_and_nonsense_is_an_error() {
        let q = build_query(7, "ai-worker.vramgate.svc.cluster.local.").expect("valid name");
        let a = answer(&q, &[[10, 0, 0, 1], [10, 0, 0, 2]]);
        assert_eq!(parse_answer(7, &a), Ok(vec![Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2)]));
        assert_eq!(parse_answer(8, &a), Err(AnswerError::OtherId));
        let mut nx = a.clone();
        nx[3] = 0x83;
        assert_eq!(parse_answer(7, &nx), Ok(vec![]));
        // Every truncation is an error, never a panic; so is every single-byte corruption.
        for cut in 0..a.len() {
            assert!(parse_answer(7, &a[..cut]).is_err(), "cut at {cut}");
        }
        for at in 0..a.len() {
            for byte in [0x00, 0x3f, 0xc0, 0xff] {
                let mut b = a.clone();
                b[at] = byte;
                let _ = parse_answer(7, &b);
            }
        }
        assert!(build_query(1, "").is_err());
        assert!(build_query(1, &"x".repeat(64)).is_err());
        assert!(build_query(1, "a..b").is_err());
    }

    #[tokio::test]
    async fn the_system_resolver_finds_localhost() {
        let dns = DnsConfig { name: "localhost".into(), ..DnsConfig::default() };
        let found = resolve(&dns).await.expect("localhost resolves");
        assert!(found.iter().any(|ip| ip.is_loopback()), "{found:?}");
    }
}
