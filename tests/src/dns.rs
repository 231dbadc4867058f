//! A small DNS server for tests, on 127.0.0.1 over UDP and TCP (one port): answers A, AAAA and
//! SRV queries for names it was given, with records the test changes while it runs. A name it
//! holds has an answer of every type, empty for the types it has no records of (NOERROR, no
//! data); any other name is NXDOMAIN. It has no EDNS: a UDP answer over 512 bytes goes out
//! truncated (TC, no records), and the whole answer comes over TCP. It is the resolver the
//! gateway's DNS discovery is pointed at in `tests/gateway_workers.rs`.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

const A: u16 = 1;
const AAAA: u16 = 28;
const SRV: u16 = 33;
/// Largest UDP answer of a server without EDNS (RFC 1035).
const UDP_MAX: usize = 512;

/// One SRV record: priority, weight, port, target.
pub type Srv = (u16, u16, u16, &'static str);

#[derive(Default)]
struct Records {
    ips: HashMap<String, Vec<IpAddr>>,
    srv: HashMap<String, Vec<Srv>>,
}

/// A running DNS server; stops when dropped.
pub struct DnsServer {
    pub addr: SocketAddr,
    records: Arc<Mutex<Records>>,
    tcp_queries: Arc<AtomicUsize>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl DnsServer {
    /// Binds 127.0.0.1 on a free port (UDP and TCP) and serves; must be called inside a tokio
    /// runtime.
    pub async fn start() -> anyhow::Result<Self> {
        let (udp, tcp) = bind_both().await?;
        let addr = udp.local_addr()?;
        let records: Arc<Mutex<Records>> = Arc::default();
        let table = records.clone();
        let udp_task = tokio::spawn(async move {
            let mut buf = vec![0u8; 1500];
            loop {
                let Ok((len, from)) = udp.recv_from(&mut buf).await else { continue };
                let Some(mut answer) = answer(&buf[..len], &table) else { continue };
                if answer.len() > UDP_MAX {
                    truncate(&mut answer);
                }
                let _ = udp.send_to(&answer, from).await;
            }
        });
        let (table, counted) = (records.clone(), Arc::new(AtomicUsize::new(0)));
        let tcp_queries = counted.clone();
        let tcp_task = tokio::spawn(async move {
            // Owned here, so that the connections end with the server.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = tcp.accept().await else { continue };
                connections.spawn(serve_tcp(stream, table.clone(), counted.clone()));
                while connections.try_join_next().is_some() {}
            }
        });
        Ok(DnsServer { addr, records, tcp_queries, tasks: vec![udp_task, tcp_task] })
    }

    /// Makes `name` resolve to `ips`, A and AAAA records (none, and no SRV records: NXDOMAIN).
    pub fn set<I: Into<IpAddr> + Copy>(&self, name: &str, ips: &[I]) {
        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        records.ips.insert(key(name), ips.iter().map(|ip| (*ip).into()).collect());
    }

    /// Makes `name` an SRV name with `records` (none, and no addresses: NXDOMAIN).
    pub fn set_srv(&self, name: &str, records: &[Srv]) {
        let mut table = self.records.lock().unwrap_or_else(|p| p.into_inner());
        table.srv.insert(key(name), records.to_vec());
    }

    /// Queries answered over TCP so far.
    pub fn tcp_queries(&self) -> usize {
        self.tcp_queries.load(Ordering::Relaxed)
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn key(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// A UDP socket and a TCP listener on the same free port of 127.0.0.1.
async fn bind_both() -> anyhow::Result<(tokio::net::UdpSocket, tokio::net::TcpListener)> {
    let mut last = None;
    for _ in 0..20 {
        let udp = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
        match tokio::net::TcpListener::bind(udp.local_addr()?).await {
            Ok(tcp) => return Ok((udp, tcp)),
            Err(e) => last = Some(e),
        }
    }
    Err(anyhow::anyhow!("no port free for both UDP and TCP: {last:?}"))
}

/// Queries on one TCP connection, each with its two-byte length, until the client closes it.
async fn serve_tcp(mut stream: tokio::net::TcpStream, table: Arc<Mutex<Records>>, count: Arc<AtomicUsize>) {
    let mut buf = vec![0u8; u16::MAX as usize];
    loop {
        let Ok(len) = stream.read_u16().await else { return };
        if stream.read_exact(&mut buf[..len as usize]).await.is_err() {
            return;
        }
        let Some(answer) = answer(&buf[..len as usize], &table) else { return };
        count.fetch_add(1, Ordering::Relaxed);
        let Ok(len) = u16::try_from(answer.len()) else { return };
        if stream.write_u16(len).await.is_err() || stream.write_all(&answer).await.is_err() {
            return;
        }
    }
}

/// Cuts an answer to its header and question, with the TC flag set.
fn truncate(answer: &mut Vec<u8>) {
    let question_end = 12 + name_len(&answer[12..]).unwrap_or(0) + 4;
    answer.truncate(question_end);
    answer[2] |= 0x02;
    answer[6..12].fill(0);
}

/// The length of the uncompressed name at the start of `buf`, its final zero byte included.
fn name_len(buf: &[u8]) -> Option<usize> {
    let mut at = 0;
    loop {
        let len = *buf.get(at)? as usize;
        at += 1 + len;
        if len == 0 {
            return Some(at);
        }
    }
}

/// The answer to one query: its question echoed, then the records of the asked type (TTL 0),
/// or NXDOMAIN. `None` for a message that is not a well-formed query of one question.
fn answer(query: &[u8], table: &Mutex<Records>) -> Option<Vec<u8>> {
    if query.len() < 12 || query[4..6] != [0, 1] {
        return None;
    }
    let name_end = 12 + name_len(&query[12..])?;
    let question = query.get(12..name_end + 4)?;
    let qtype = u16::from_be_bytes([question[question.len() - 4], question[question.len() - 3]]);
    let mut labels = Vec::new();
    let mut at = 12;
    while at < name_end - 1 {
        let len = query[at] as usize;
        labels.push(String::from_utf8_lossy(&query[at + 1..at + 1 + len]).to_ascii_lowercase());
        at += 1 + len;
    }
    let name = labels.join(".");
    let table = table.lock().unwrap_or_else(|p| p.into_inner());
    let ips = table.ips.get(&name).filter(|ips| !ips.is_empty());
    let srv = table.srv.get(&name).filter(|srv| !srv.is_empty());
    let exists = ips.is_some() || srv.is_some();
    let mut rdatas: Vec<(u16, Vec<u8>)> = Vec::new();
    for ip in ips.into_iter().flatten() {
        match (ip, qtype) {
            (IpAddr::V4(ip), A) => rdatas.push((A, ip.octets().to_vec())),
            (IpAddr::V6(ip), AAAA) => rdatas.push((AAAA, ip.octets().to_vec())),
            _ => {}
        }
    }
    for (priority, weight, port, target) in srv.into_iter().flatten().filter(|_| qtype == SRV) {
        let mut data = Vec::new();
        for field in [priority, weight, port] {
            data.extend_from_slice(&field.to_be_bytes());
        }
        for label in target.trim_end_matches('.').split('.').filter(|l| !l.is_empty()) {
            data.push(label.len() as u8);
            data.extend_from_slice(label.as_bytes());
        }
        data.push(0);
        rdatas.push((SRV, data));
    }
    let mut a = Vec::with_capacity(12 + question.len() + rdatas.iter().map(|(_, d)| 12 + d.len()).sum::<usize>());
    a.extend_from_slice(&query[0..2]);
    a.extend_from_slice(&[0x81, if exists { 0x80 } else { 0x83 }]);
    a.extend_from_slice(&[0, 1]);
    a.extend_from_slice(&(rdatas.len() as u16).to_be_bytes());
    a.extend_from_slice(&[0, 0, 0, 0]);
    a.extend_from_slice(question);
    for (kind, data) in rdatas {
        a.extend_from_slice(&[0xc0, 12]);
        a.extend_from_slice(&kind.to_be_bytes());
        a.extend_from_slice(&[0, 1, 0, 0, 0, 0]);
        a.extend_from_slice(&(data.len() as u16).to_be_bytes());
        a.extend_from_slice(&data);
    }
    Some(a)
}
