//! Logging set-up shared by both services, and the rate limit of repeated log lines.
//!
//! Logs go to stderr through `tracing`; `RUST_LOG` filters them (default `info`), and
//! `VRAMGATE_LOG_FORMAT=json` switches to one JSON object per line for log shippers. Colours
//! only when stderr is a terminal, so log files carry no escape codes.
//! Trace export over OTLP is not built yet: spans exist but stay in-process.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing_subscriber::{fmt, EnvFilter};

/// Installs the global subscriber. Safe to call twice (the second call does nothing), so
/// library code started from tests can call it too.
pub fn init(service: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("VRAMGATE_LOG_FORMAT").is_ok_and(|v| v == "json");
    let ansi = std::io::stderr().is_terminal();
    let result = if json {
        fmt().with_env_filter(filter).with_writer(std::io::stderr).json().try_init()
    } else {
        fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).try_init()
    };
    if result.is_ok() {
        tracing::debug!(service, "logging initialised");
    }
}

/// At most `per_second` log lines a second from one place; the rest are counted, not written,
/// so a flood of bad input or a broker outage cannot flood the log (or slow the service down
/// writing it). Lock-free: one atomic word holds the current second and the lines let through.
#[derive(Debug)]
pub struct LogLimit {
    per_second: u32,
    /// Upper 40 bits: the second (since the epoch); lower 24: lines allowed in it.
    state: AtomicU64,
    suppressed: AtomicU64,
}

impl LogLimit {
    pub const fn new(per_second: u32) -> Self {
        LogLimit { per_second, state: AtomicU64::new(0), suppressed: AtomicU64::new(0) }
    }

    /// Whether one more line may be written now.
    pub fn allow(&self) -> bool {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.allow_at(now)
    }

    fn allow_at(&self, second: u64) -> bool {
        let mut current = self.state.load(Ordering::Relaxed);
        loop {
            let (at, count) = (current >> 24, current & 0xFF_FFFF);
            let next = if at == second & 0xFF_FFFF_FFFF {
                if count >= u64::from(self.per_second) {
                    self.suppressed.fetch_add(1, Ordering::Relaxed);
                    return false;
                }
                current + 1
            } else {
                ((second & 0xFF_FFFF_FFFF) << 24) | 1
            };
            match self.state.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(seen) => current = seen,
            }
        }
    }

    /// Lines suppressed so far.
    pub fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }
}

/// Longest string a log field carries: ids, messages and header values are cut to it.
pub const LOG_FIELD_MAX_BYTES: usize = 256;

/// `s` cut to at most `max` bytes, at a character boundary: for log fields that come from
/// outside (an event id, an error message quoting input), which must not make a log line huge.
pub fn bounded(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    &s[..cut]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lets_through_the_rate_then_counts_the_rest() {
        let limit = LogLimit::new(3);
        let allowed = (0..10).filter(|_| limit.allow_at(100)).count();
        assert_eq!(allowed, 3);
        assert_eq!(limit.suppressed(), 7);
        assert!(limit.allow_at(101), "a new second starts afresh");
        let shared = std::sync::Arc::new(LogLimit::new(50));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let limit = shared.clone();
                std::thread::spawn(move || (0..1000).filter(|_| limit.allow_at(7)).count())
            })
            .collect();
        let allowed: usize = threads.into_iter().map(|t| t.join().expect("thread")).sum();
        assert_eq!(allowed, 50, "the rate holds across threads");
    }

    #[test]
    fn bounded_cuts_at_a_character_boundary() {
        assert_eq!(bounded("hello", 10), "hello");
        assert_eq!(bounded("hello", 3), "hel");
        assert_eq!(bounded("héllo", 2), "h", "never inside a character");
        assert_eq!(bounded("", 0), "");
    }
}
