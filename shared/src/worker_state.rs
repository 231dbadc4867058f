//! What a worker tells its callers about its admission, so that a gateway in front of several
//! workers can send each request where memory is free: on every answer of the OIP endpoints (as
//! response headers, no extra round trip) and at `GET /vramgate/state` (JSON, for a gateway that
//! has not called a worker yet or probes one it ejected).
//!
//! In `bytes` admission the figures are bytes of the worker's memory budget; in `count`
//! admission they are requests (every request costs 1). A model's estimate is the worker's
//! current fit `bytes ≈ base + per_element × elements` of one request's peak.
//!
//! Beside them, on error answers, the kind of error where the status does not tell it
//! ([`HEADER_ERROR_KIND`]).

use serde::{Deserialize, Serialize};

/// Path of the worker's state endpoint.
pub const STATE_PATH: &str = "/vramgate/state";

/// `bytes` or `count`: the unit of the figures below.
pub const HEADER_UNIT: &str = "x-vramgate-admission-unit";
/// What admission may hand out now (the memory budget, or `max_concurrent`).
pub const HEADER_BUDGET: &str = "x-vramgate-budget";
/// Granted to requests being served.
pub const HEADER_ADMITTED: &str = "x-vramgate-admitted";
/// Asked for by requests waiting for admission.
pub const HEADER_QUEUED: &str = "x-vramgate-queued";
/// Requests waiting for admission.
pub const HEADER_QUEUED_REQUESTS: &str = "x-vramgate-queued-requests";
/// The model's estimate, `<base bytes>;<bytes per element>`, on answers about one model.
pub const HEADER_ESTIMATE: &str = "x-vramgate-estimate";
/// On an error answer whose status alone does not say what failed: the kind of error. Only
/// [`ERROR_KIND_MODEL`] so far.
pub const HEADER_ERROR_KIND: &str = "x-vramgate-error-kind";
/// [`HEADER_ERROR_KIND`] on a 400 for a request the model itself raised an error on, run alone
/// (neither out of memory nor a device fault): the input's fault, so retrying it (here or on
/// another worker) cannot help.
pub const ERROR_KIND_MODEL: &str = "model_error";

/// The unit of a worker's admission figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unit {
    Bytes,
    Count,
}

impl Unit {
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Bytes => "bytes",
            Unit::Count => "count",
        }
    }
}

/// A model's per-request estimate: `base + per_element × elements` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    pub base_bytes: f64,
    pub bytes_per_element: f64,
}

impl Estimate {
    /// Estimated bytes of one request of `elements` input elements.
    pub fn bytes(&self, elements: u64) -> u64 {
        let bytes = self.base_bytes + self.bytes_per_element * elements as f64;
        if bytes.is_finite() {
            bytes.max(1.0).ceil() as u64
        } else {
            u64::MAX
        }
    }
}

/// The admission figures of a worker at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Admission {
    pub unit: Unit,
    pub budget: u64,
    pub admitted: u64,
    pub queued: u64,
    pub queued_requests: u64,
}

impl Admission {
    /// What admission could still grant without queueing: budget less admitted and queued
    /// (negative when more is asked for than the budget holds).
    pub fn free(&self) -> i64 {
        clamp_i64(self.budget) - clamp_i64(self.admitted) - clamp_i64(self.queued)
    }

    /// The response headers carrying these figures.
    pub fn headers(&self) -> [(&'static str, String); 5] {
        [
            (HEADER_UNIT, self.unit.as_str().to_string()),
            (HEADER_BUDGET, self.budget.to_string()),
            (HEADER_ADMITTED, self.admitted.to_string()),
            (HEADER_QUEUED, self.queued.to_string()),
            (HEADER_QUEUED_REQUESTS, self.queued_requests.to_string()),
        ]
    }

    /// Reads the figures back from response headers (`get` looks one up by name); `None` when
    /// one is missing or malformed, e.g. from a worker that does not send them.
    pub fn from_headers<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Option<Admission> {
        let number = |name: &str| get(name).and_then(|v| v.trim().parse::<u64>().ok());
        let unit = match get(HEADER_UNIT)?.trim() {
            "bytes" => Unit::Bytes,
            "count" => Unit::Count,
            _ => return None,
        };
        Some(Admission {
            unit,
            budget: number(HEADER_BUDGET)?,
            admitted: number(HEADER_ADMITTED)?,
            queued: number(HEADER_QUEUED)?,
            queued_requests: number(HEADER_QUEUED_REQUESTS)?,
        })
    }
}

/// The value of [`HEADER_ESTIMATE`].
pub fn estimate_header(estimate: &Estimate) -> String {
    format!("{};{}", estimate.base_bytes, estimate.bytes_per_element)
}

/// Parses a [`HEADER_ESTIMATE`] value; `None` unless both terms are finite and non-negative.
pub fn parse_estimate_header(value: &str) -> Option<Estimate> {
    let (base, per) = value.trim().split_once(';')?;
    let base_bytes: f64 = base.trim().parse().ok()?;
    let bytes_per_element: f64 = per.trim().parse().ok()?;
    let ok = |x: f64| x.is_finite() && x >= 0.0;
    (ok(base_bytes) && ok(bytes_per_element)).then_some(Estimate { base_bytes, bytes_per_element })
}

/// The body of `GET /vramgate/state`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerState {
    pub admission: Admission,
    /// Each served model's estimate, by model name.
    pub models: std::collections::BTreeMap<String, Estimate>,
}

fn clamp_i64(x: u64) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX / 4).min(i64::MAX / 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_malformed_ones_are_ignored() {
        let a = Admission { unit: Unit::Bytes, budget: 1000, admitted: 300, queued: 900, queued_requests: 2 };
        assert_eq!(a.free(), -200);
        let headers = a.headers();
        let get = |name: &str| headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str());
        assert_eq!(Admission::from_headers(get), Some(a));
        let broken = |name: &str| if name == HEADER_QUEUED { Some("lots") } else { get(name) };
        assert_eq!(Admission::from_headers(broken), None);
        assert_eq!(Admission::from_headers(|_| None), None);
        let huge = Admission { budget: u64::MAX, admitted: 0, queued: 0, ..a };
        assert!(huge.free() > 0, "no overflow");
    }

    #[test]
    fn estimates_round_trip_and_refuse_nonsense() {
        let e = Estimate { base_bytes: 1.5e6, bytes_per_element: 12.25 };
        assert_eq!(parse_estimate_header(&estimate_header(&e)), Some(e));
        assert_eq!(e.bytes(1000), 1_512_250);
        for bad in ["", "1", "1;x", "NaN;1", "-1;2", "1;inf"] {
            assert_eq!(parse_estimate_header(bad), None, "{bad}");
        }
        assert_eq!(Estimate { base_bytes: 0.0, bytes_per_element: 0.0 }.bytes(5), 1);
    }
}
