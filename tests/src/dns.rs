//! A small DNS server for tests: answers A queries for names it was given, over UDP on
//! 127.0.0.1, with records the test changes while it runs (NXDOMAIN for any other name). It is
//! the resolver the gateway's DNS discovery is pointed at in `tests/gateway_workers.rs`.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

/// A running DNS server; stops when dropped.
pub struct DnsServer {
    pub addr: SocketAddr,
    records: Arc<Mutex<HashMap<String, Vec<Ipv4Addr>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl DnsServer {
    /// Binds 127.0.0.1 on a free port and serves; must be called inside a tokio runtime.
    pub async fn start() -> anyhow::Result<Self> {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
        let addr = socket.local_addr()?;
        let records: Arc<Mutex<HashMap<String, Vec<Ipv4Addr>>>> = Arc::default();
        let table = records.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 1500];
            loop {
                let Ok((len, from)) = socket.recv_from(&mut buf).await else { continue };
                let answer = {
                    let table = table.lock().unwrap_or_else(|p| p.into_inner());
                    answer(&buf[..len], &table)
                };
                if let Some(answer) = answer {
                    let _ = socket.send_to(&answer, from).await;
                }
            }
        });
        Ok(DnsServer { addr, records, task })
    }

    /// Makes `name` resolve to `ips` (none: NXDOMAIN).
    pub fn set(&self, name: &str, ips: &[Ipv4Addr]) {
        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        records.insert(name.trim_end_matches('.').to_ascii_lowercase(), ips.to_vec());
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The answer to one query: its question echoed, one A record per address (TTL 0), or
/// NXDOMAIN. `None` for a datagram that is not a well-formed query of one question.
fn answer(query: &[u8], records: &HashMap<String, Vec<Ipv4Addr>>) -> Option<Vec<u8>> {
    if query.len() < 12 || query[4..6] != [0, 1] {
        return None;
    }
    let mut labels = Vec::new();
    let mut at = 12;
    loop {
        let len = *query.get(at)? as usize;
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(query.get(at..at + len)?).to_ascii_lowercase());
        at += len;
    }
    let question_end = at + 4;
    let question = query.get(12..question_end)?;
    let ips = records.get(&labels.join(".")).filter(|ips| !ips.is_empty());
    let mut a = Vec::with_capacity(question_end + 16 * ips.map_or(0, Vec::len));
    a.extend_from_slice(&query[0..2]);
    a.extend_from_slice(&[0x81, if ips.is_some() { 0x80 } else { 0x83 }]);
    a.extend_from_slice(&[0, 1]);
    a.extend_from_slice(&(ips.map_or(0, Vec::len) as u16).to_be_bytes());
    a.extend_from_slice(&[0, 0, 0, 0]);
    a.extend_from_slice(question);
    for ip in ips.into_iter().flatten() {
        a.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 0, 0, 4]);
        a.extend_from_slice(&ip.octets());
    }
    Some(a)
}
