//! What HTTP clients can make the worker hold, and for how long: the bytes of request bodies
//! being read at once, and the time a connection may spend on its headers, its body or doing
//! nothing.
//!
//! # Bodies
//!
//! [`read_body`] reads a request body under three bounds:
//!
//! * **Size.** A `Content-Length` over `max_request_bytes` is refused before one byte of the
//!   body is read (so before `100 Continue` is sent); a chunked body as soon as it passes the
//!   limit.
//! * **Bytes in flight.** [`BodyBudget`] (`max_body_bytes_in_flight`) is charged *before*
//!   reading: the whole `Content-Length` at once, or a chunked body step by step as it
//!   arrives. A charge that does not fit is refused at once (the caller answers 503 +
//!   `Retry-After`) rather than queued: a client that waits holds a connection, one that
//!   retries holds nothing. The refused body is discarded as it arrives, kept nowhere (see
//!   [`discard_body`]). The [`BodyCharge`] is held until the caller drops it, after the
//!   body is decoded, so a burst of large bodies can no longer add up past the host memory
//!   the worker was given (`memory_host_allowance_bytes`), where a failed allocation in Rust
//!   aborts the process.
//! * **Time.** The whole body must arrive within `body_read_timeout_ms` of the first read; a
//!   client that declares more than it sends cannot hold its charge longer.
//!
//! A body is read into a buffer taken from a [`BodyPool`] and goes back to it when its last
//! slice is dropped (after the batch has copied the input out of it). Under load every body
//! is a fresh buffer of megabytes held for the request's whole wait in the queue, and the
//! allocator gave their pages back and took them again all the time: page faults took a
//! fifth of the worker's CPU, most of them in bodies, on the request-path bench (P-Net's
//! 2.7 MB input, 64 in flight, 2026-11-30). A pooled buffer is already paged in. The pool
//! keeps idle buffers of at most [`BodyPool::idle_capacity`] bytes (a buffer returned past it
//! is freed): in steady load a returned buffer is taken again within milliseconds, so a small
//! idle bound reuses nearly every one, and after a burst at most that much stays resident.
//!
//! A request refused before its body is read (no token, unknown model, budget spent) has its
//! body read and dropped by [`discard_body`] before the answer, within the same size and time
//! bounds: most clients (reqwest, the gateway's) send the whole body before they read an
//! answer, and a connection closed under a body they are still writing shows them a broken
//! pipe instead of the 401 or the 503 + `Retry-After` meant for them. A client that sent
//! `Expect: 100-continue` has not sent its body yet, and one that declared more than
//! `max_request_bytes` will not be read: those are answered at once, and the connection
//! closed.
//!
//! # Connections
//!
//! [`serve`] replaces `axum::serve` (which has no timeouts) with hyper's HTTP/1 connection,
//! watched by a small state machine per connection:
//!
//! * **Head**: from accepting the connection, or from the first byte of the next request on a
//!   kept-alive one, until the request's headers are parsed: `header_read_timeout_ms`.
//! * **Busy**: the request is being handled (its body read under the bound above, inference
//!   under the request's own deadline): no connection timeout.
//! * **Idle**: from the response being handed to hyper until the first byte of the next
//!   request: `idle_timeout_ms`. This also bounds writing the response to a client that has
//!   stopped reading.
//!
//! Past a deadline the connection is dropped (closed). hyper's own `header_read_timeout` is
//! not used: its timer starts when a kept-alive connection goes idle, so it cannot tell a
//! slow header from an idle connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, HttpBody};
use axum::http::{header, HeaderMap};
use axum::Router;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use tower::ServiceExt;

use crate::finite::Scan;

/// The budget of request-body bytes being read at once (`max_body_bytes_in_flight`).
/// Cheap to clone: every clone is the same budget.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    state: Arc<BudgetState>,
}

#[derive(Debug)]
struct BudgetState {
    capacity: u64,
    in_use: AtomicU64,
}

/// A charge did not fit: what it needed and what the budget held at that moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("request bodies being read hold {in_use} of {capacity} bytes; {needed} more do not fit")]
pub struct BudgetSpent {
    /// Bytes the refused charge asked for.
    pub needed: u64,
    /// Bytes charged when it was refused.
    pub in_use: u64,
    /// The budget's capacity.
    pub capacity: u64,
}

impl BudgetState {
    fn try_take(&self, bytes: u64) -> Result<(), BudgetSpent> {
        self.in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= self.capacity)
            })
            .map(drop)
            .map_err(|in_use| BudgetSpent { needed: bytes, in_use, capacity: self.capacity })
    }
}

impl BodyBudget {
    pub fn new(capacity_bytes: u64) -> Self {
        BodyBudget { state: Arc::new(BudgetState { capacity: capacity_bytes, in_use: AtomicU64::new(0) }) }
    }

    pub fn capacity(&self) -> u64 {
        self.state.capacity
    }

    /// Bytes charged now, all bodies together.
    pub fn in_use(&self) -> u64 {
        self.state.in_use.load(Ordering::Acquire)
    }

    /// Charges `bytes` if they fit now; never waits.
    pub fn try_charge(&self, bytes: u64) -> Result<BodyCharge, BudgetSpent> {
        let mut charge = BodyCharge { state: self.state.clone(), bytes: 0 };
        charge.try_grow(bytes)?;
        Ok(charge)
    }
}

/// Bytes held in a [`BodyBudget`]; given back when dropped, on every path.
#[derive(Debug)]
pub struct BodyCharge {
    state: Arc<BudgetState>,
    bytes: u64,
}

impl BodyCharge {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Charges `more` bytes on top, if they fit now.
    pub fn try_grow(&mut self, more: u64) -> Result<(), BudgetSpent> {
        self.state.try_take(more)?;
        self.bytes += more;
        Ok(())
    }
}

impl Drop for BodyCharge {
    fn drop(&mut self) {
        self.state.in_use.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// How request bodies are read: the size limit, the budget, the deadline, and the buffers.
#[derive(Debug, Clone)]
pub struct BodyLimits {
    /// `max_request_bytes`.
    pub max_request_bytes: u64,
    /// `max_body_bytes_in_flight`.
    pub budget: BodyBudget,
    /// `body_read_timeout_ms`.
    pub read_timeout: Duration,
    /// Where bodies are read into (see the module doc).
    pub pool: BodyPool,
}

impl BodyLimits {
    /// The limits of the config's three keys, with a pool of idle buffers of at most an
    /// eighth of `max_body_bytes_in_flight` and [`BodyPool::MAX_IDLE_BYTES`].
    pub fn new(max_request_bytes: u64, max_body_bytes_in_flight: u64, read_timeout: Duration) -> BodyLimits {
        BodyLimits {
            max_request_bytes,
            budget: BodyBudget::new(max_body_bytes_in_flight),
            read_timeout,
            pool: BodyPool::new((max_body_bytes_in_flight / 8).min(BodyPool::MAX_IDLE_BYTES)),
        }
    }
}

/// Buffers of request bodies for reuse (see the module doc). Cheap to clone: every clone is
/// the same pool.
#[derive(Debug, Clone)]
pub struct BodyPool {
    state: Arc<PoolState>,
}

#[derive(Debug)]
struct PoolState {
    idle_capacity: u64,
    idle: std::sync::Mutex<Idle>,
}

#[derive(Debug, Default)]
struct Idle {
    buffers: Vec<Vec<u8>>,
    bytes: u64,
}

impl BodyPool {
    /// The most idle bytes a worker's pool keeps, whatever its budget of bodies.
    pub const MAX_IDLE_BYTES: u64 = 32 << 20;
    /// Bodies under this many bytes are not pooled: the allocator reuses small blocks well.
    pub const MIN_POOLED_BYTES: usize = 256 << 10;

    /// A pool that keeps idle buffers of at most `idle_capacity` bytes in all.
    pub fn new(idle_capacity: u64) -> BodyPool {
        BodyPool { state: Arc::new(PoolState { idle_capacity, idle: std::sync::Mutex::new(Idle::default()) }) }
    }

    /// The most bytes of idle buffers the pool keeps.
    pub fn idle_capacity(&self) -> u64 {
        self.state.idle_capacity
    }

    /// Bytes of idle buffers kept now.
    pub fn idle_bytes(&self) -> u64 {
        self.idle().bytes
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Idle> {
        // A panic under the lock leaves the list whole (each change is one push or remove).
        self.state.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An empty buffer with room for `len` bytes: the smallest idle one that has room and is
    /// at most an eighth larger (so a body holds little more than it was charged for), or a
    /// new one of exactly `len`.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len >= Self::MIN_POOLED_BYTES {
            let most = len.saturating_add(len / 8);
            let mut idle = self.idle();
            let best = (0..idle.buffers.len())
                .filter(|&i| (len..=most).contains(&idle.buffers[i].capacity()))
                .min_by_key(|&i| idle.buffers[i].capacity());
            if let Some(i) = best {
                let buffer = idle.buffers.swap_remove(i);
                idle.bytes -= buffer.capacity() as u64;
                return buffer;
            }
        }
        Vec::with_capacity(len)
    }

    /// Keeps `buffer` for reuse if it is worth pooling and fits under the idle bound; frees it
    /// otherwise.
    pub fn give_back(&self, mut buffer: Vec<u8>) {
        let capacity = buffer.capacity() as u64;
        if buffer.capacity() < Self::MIN_POOLED_BYTES {
            return;
        }
        let mut idle = self.idle();
        if idle.bytes + capacity <= self.state.idle_capacity {
            buffer.clear();
            idle.bytes += capacity;
            idle.buffers.push(buffer);
        }
    }

    /// `buffer`'s bytes as [`Bytes`] whose last drop gives the buffer back to the pool.
    pub fn freeze(&self, buffer: Vec<u8>) -> Bytes {
        if buffer.capacity() < Self::MIN_POOLED_BYTES {
            return Bytes::from(buffer);
        }
        Bytes::from_owner(Pooled { buffer, pool: self.clone() })
    }
}

/// A body's buffer on loan from its pool, as the owner of the body's [`Bytes`].
struct Pooled {
    buffer: Vec<u8>,
    pool: BodyPool,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buffer
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.buffer));
    }
}

/// How much a chunked body is charged at a time (or its limit, if smaller): fewer updates of
/// the shared counter than one per chunk, at the price of charging up to this much early.
const CHUNKED_STEP_BYTES: u64 = 1 << 20;

/// Why a body was not read. Each message names the limit and the config key that sets it.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// `Content-Length` over the limit: refused before reading.
    #[error("request body of {declared} bytes (Content-Length) is over the limit of {limit} bytes (max_request_bytes)")]
    DeclaredTooLarge { declared: u64, limit: u64 },
    /// A chunked body passed the limit while it was read.
    #[error("request body is over the limit of {limit} bytes (max_request_bytes): refused after {received} bytes")]
    TooLarge { received: u64, limit: u64 },
    /// The budget of bodies being read is spent; the client should retry later. `drained`:
    /// the body was read to its end and dropped, so the connection can carry another request.
    #[error(
        "the worker is already reading {} bytes of request bodies, of max_body_bytes_in_flight = {} bytes; \
         this body needs {} more: retry later",
        .spent.in_use, .spent.capacity, .spent.needed
    )]
    Busy { spent: BudgetSpent, drained: bool },
    /// The body did not arrive in time.
    #[error(
        "request body not received within {} ms (body_read_timeout_ms): {received} of {} bytes arrived",
        .timeout.as_millis(), expected.map_or_else(|| "a chunked body's".to_string(), |n| n.to_string())
    )]
    Timeout { received: u64, expected: Option<u64>, timeout: Duration },
    /// The connection failed or the client broke the framing.
    #[error("reading the request body failed: {0}")]
    Read(String),
}

/// Reads a whole request body under `limits` (see the module doc). The returned charge
/// covers the body's bytes; hold it until they (and what is decoded from them) are dropped.
pub async fn read_body(limits: &BodyLimits, headers: &HeaderMap, body: Body) -> Result<(Bytes, BodyCharge), BodyError> {
    read_body_scanned(limits, headers, body, false).await.map(|(bytes, charge, _)| (bytes, charge))
}

/// [`read_body`], and when `scan` is set, the body scanned for non-finite FP32 values part by
/// part as it is read, while each part is in the cache (see [`crate::finite`]).
pub async fn read_body_scanned(
    limits: &BodyLimits,
    headers: &HeaderMap,
    body: Body,
    scan: bool,
) -> Result<(Bytes, BodyCharge, Option<Scan>), BodyError> {
    let mut scan = scan.then(Scan::default);
    let limit = limits.max_request_bytes;
    // hyper reports the `Content-Length` here; `None` for a chunked body.
    let declared = body.size_hint().exact();
    if let Some(declared) = declared {
        if declared > limit {
            return Err(BodyError::DeclaredTooLarge { declared, limit });
        }
    }
    let mut charge = match limits.budget.try_charge(declared.unwrap_or_else(|| CHUNKED_STEP_BYTES.min(limit))) {
        Ok(charge) => charge,
        Err(spent) => return Err(BodyError::Busy { spent, drained: discard_body(limits, headers, body).await }),
    };
    // Within the limit and charged: reserving it up front saves the copies of growing.
    let mut buf = limits.pool.take(usize::try_from(declared.unwrap_or(0)).unwrap_or(0));
    let deadline = Instant::now() + limits.read_timeout;
    let mut body = body;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return Err(BodyError::Timeout {
                    received: buf.len() as u64,
                    expected: declared,
                    timeout: limits.read_timeout,
                })
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(BodyError::Read(e.to_string())),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else { continue }; // trailers carry nothing we use
        let received = buf.len() as u64 + data.len() as u64;
        if received > limit {
            return Err(BodyError::TooLarge { received, limit });
        }
        if received > charge.bytes() {
            let more = (received - charge.bytes()).max(CHUNKED_STEP_BYTES).min(limit - charge.bytes());
            if let Err(spent) = charge.try_grow(more) {
                drop((buf, charge));
                return Err(BodyError::Busy { spent, drained: discard_body(limits, headers, body).await });
            }
        }
        buf.extend_from_slice(&data);
        if let Some(scan) = &mut scan {
            scan.advance(&buf);
        }
    }
    if let Some(scan) = &mut scan {
        scan.finish(&buf);
    }
    Ok((limits.pool.freeze(buf), charge, scan))
}

/// Reads a body that will not be used and drops it as it arrives, so that a client still
/// sending it gets to read the answer (see the module doc). Within `max_request_bytes` and
/// `body_read_timeout_ms`; nothing is read for a client waiting for `100 Continue` or one
/// that declared more than the limit. Returns whether the body was read to its end, i.e.
/// whether the connection can carry another request.
pub async fn discard_body(limits: &BodyLimits, headers: &HeaderMap, mut body: Body) -> bool {
    let expects_continue = headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue || body.size_hint().exact().is_some_and(|n| n > limits.max_request_bytes) {
        return body.is_end_stream();
    }
    let deadline = Instant::now() + limits.read_timeout;
    let mut received = 0u64;
    loop {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(None) => return true,
            Ok(Some(Ok(frame))) => {
                received += frame.data_ref().map_or(0, |d| d.len() as u64);
                if received > limits.max_request_bytes {
                    return false;
                }
            }
            Ok(Some(Err(_))) | Err(_) => return false,
        }
    }
}

/// The connection timeouts [`serve`] enforces (see the module doc).
#[derive(Debug, Clone, Copy)]
pub struct ConnTimeouts {
    /// `header_read_timeout_ms`.
    pub header_read: Duration,
    /// `idle_timeout_ms`.
    pub idle: Duration,
}

/// Where a connection is in its request cycle, and since when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for (the rest of) a request's headers, since the connection opened or the
    /// first byte of this request arrived.
    Head(Instant),
    /// A request is being handled.
    Busy,
    /// Between requests, since the last response was handed over.
    Idle(Instant),
}

type PhaseTx = Arc<watch::Sender<Phase>>;

/// Serves `router` over HTTP/1 on `listener` until `shutdown` resolves, then stops accepting,
/// lets every connection finish its request in progress and returns once all are closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    timeouts: ConnTimeouts,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    // Every connection holds a receiver; `closed()` resolves when the last one is gone.
    let (open_tx, open_rx) = watch::channel(());
    drop(open_rx);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Responses are written in one go; do not let Nagle hold their tail back.
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_connection(stream, router.clone(), timeouts, stop_rx.clone(), open_tx.subscribe()));
    }
    drop(listener);
    let _ = stop_tx.send(true);
    open_tx.closed().await;
    Ok(())
}

/// As `axum::serve` does: errors of one connection are ignored; others (e.g. out of file
/// descriptors) are logged and accepting pauses, so the loop does not spin.
async fn accept_failed(e: io::Error) {
    if matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "accepting a connection failed; pausing for 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

async fn serve_connection(
    stream: TcpStream,
    router: Router,
    timeouts: ConnTimeouts,
    mut stop: watch::Receiver<bool>,
    _open: watch::Receiver<()>,
) {
    let (phase_tx, mut phase_rx) = watch::channel(Phase::Head(Instant::now()));
    let phase_tx: PhaseTx = Arc::new(phase_tx);
    let io = TokioIo::new(WatchedStream { inner: stream, phase: phase_tx.clone() });
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        phase_tx.send_replace(Phase::Busy);
        let idle = IdleWhenDropped(phase_tx.clone());
        let router = router.clone();
        async move {
            let response = router.oneshot(request.map(Body::new)).await;
            response.map(|response| response.map(|body| Body::new(IdleAtEnd { body, _idle: idle })))
        }
    });
    let mut builder = http1::Builder::new();
    // Our own timers do this (see the module doc); hyper's would need a timer and start
    // counting when the connection goes idle.
    builder.header_read_timeout(None);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            what = expired(&mut phase_rx, timeouts) => {
                tracing::debug!(timeout = what, "closing a connection past its timeout");
                return;
            }
            _ = stop.changed(), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Resolves when the connection has stayed in a timed phase past its timeout; returns which.
async fn expired(phase: &mut watch::Receiver<Phase>, timeouts: ConnTimeouts) -> &'static str {
    loop {
        let deadline = match *phase.borrow_and_update() {
            Phase::Busy => None,
            Phase::Head(since) => Some((since + timeouts.header_read, "header_read_timeout_ms")),
            Phase::Idle(since) => Some((since + timeouts.idle, "idle_timeout_ms")),
        };
        let changed = match deadline {
            None => phase.changed().await,
            Some((at, what)) => tokio::select! {
                () = tokio::time::sleep_until(at) => return what,
                changed = phase.changed() => changed,
            },
        };
        if changed.is_err() {
            // Every sender lives inside the connection: it is ending anyway.
            std::future::pending::<()>().await;
        }
    }
}

/// The connection's socket, noting the first byte of a request that arrives on an idle
/// connection (Idle → Head).
struct WatchedStream {
    inner: TcpStream,
    phase: PhaseTx,
}

impl AsyncRead for WatchedStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.phase.send_if_modified(|phase| match phase {
                Phase::Idle(_) => {
                    *phase = Phase::Head(Instant::now());
                    true
                }
                _ => false,
            });
        }
        polled
    }
}

impl AsyncWrite for WatchedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Busy → Idle when dropped: with the response body once hyper has taken all of it, or with
/// the handler's future if the connection goes away first.
struct IdleWhenDropped(PhaseTx);

impl Drop for IdleWhenDropped {
    fn drop(&mut self) {
        self.0.send_if_modified(|phase| match phase {
            Phase::Busy => {
                *phase = Phase::Idle(Instant::now());
                true
            }
            _ => false,
        });
    }
}

/// A response body that marks its connection idle when hyper is done with it.
struct IdleAtEnd {
    body: Body,
    _idle: IdleWhenDropped,
}

impl HttpBody for IdleAtEnd {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_never_grants_past_its_capacity_and_charges_come_back() {
        let budget = BodyBudget::new(100);
        let mut a = budget.try_charge(60).expect("fits");
        let spent = budget.try_charge(41).expect_err("past the capacity");
        assert_eq!(spent, BudgetSpent { needed: 41, in_use: 60, capacity: 100 });
        let b = budget.try_charge(40).expect("fits exactly");
        assert!(a.try_grow(1).is_err());
        assert_eq!((a.bytes(), budget.in_use()), (60, 100));
        drop(b);
        a.try_grow(40).expect("room again");
        assert_eq!(budget.in_use(), 100);
        drop(a);
        assert_eq!(budget.in_use(), 0);
    }

    fn limits(max_request_bytes: u64, budget: u64) -> BodyLimits {
        BodyLimits::new(max_request_bytes, budget, Duration::from_secs(5))
    }

    #[tokio::test]
    async fn a_body_s_buffer_goes_back_to_the_pool_when_its_last_slice_drops_and_is_read_into_again() {
        let big = 4 * BodyPool::MIN_POOLED_BYTES;
        let limits = BodyLimits::new(4 * big as u64, 16 * big as u64, Duration::from_secs(5));
        assert_eq!(limits.pool.idle_capacity(), 2 * big as u64, "an eighth of the bodies' budget");
        let large = BodyLimits::new(1 << 30, 1 << 30, Duration::from_secs(5));
        assert_eq!(large.pool.idle_capacity(), BodyPool::MAX_IDLE_BYTES, "never more than 32 MiB idle");
        let none = HeaderMap::new();
        let (body, charge) = read_body(&limits, &none, Body::from(vec![7u8; big])).await.expect("within");
        let first = body.as_ptr();
        let slice = body.slice(10..20);
        drop((body, charge));
        assert_eq!(limits.pool.idle_bytes(), 0, "a slice still holds the buffer");
        drop(slice);
        assert_eq!(limits.pool.idle_bytes(), big as u64, "back once nothing holds it");
        // Half the size: not that buffer (a body holds at most an eighth more than its charge).
        let (half, _c) = read_body(&limits, &none, Body::from(vec![1u8; big / 2])).await.expect("within");
        assert_ne!(half.as_ptr(), first);
        assert_eq!(limits.pool.idle_bytes(), big as u64);
        // A little smaller: the same buffer, read into again.
        let (again, _charge) = read_body(&limits, &none, Body::from(vec![9u8; big - 64])).await.expect("within");
        assert_eq!((again.as_ptr(), again.len(), limits.pool.idle_bytes()), (first, big - 64, 0));
        assert!(again.iter().all(|&b| b == 9), "only the new body's bytes");
        drop((again, half));
        assert_eq!(limits.pool.idle_bytes(), (big + big / 2) as u64);
        // Past the idle bound, a returned buffer is freed.
        let pool = BodyPool::new(big as u64);
        pool.give_back(Vec::with_capacity(big));
        pool.give_back(Vec::with_capacity(big));
        assert_eq!(pool.idle_bytes(), big as u64);
        // Small bodies are not pooled at all.
        pool.give_back(Vec::with_capacity(BodyPool::MIN_POOLED_BYTES - 1));
        assert_eq!(pool.idle_bytes(), big as u64);
        assert_eq!(pool.take(big).capacity(), big);
        assert_eq!(pool.idle_bytes(), 0);
    }

    #[tokio::test]
    async fn bodies_are_refused_by_length_and_by_budget_and_read_within_both() {
        let limits = limits(10, 16);
        let none = HeaderMap::new();
        let err = read_body(&limits, &none, Body::from(vec![0u8; 11])).await.expect_err("over the limit");
        assert!(matches!(err, BodyError::DeclaredTooLarge { declared: 11, limit: 10 }), "{err}");
        assert!(err.to_string().contains("max_request_bytes"), "{err}");
        let (bytes, charge) = read_body(&limits, &none, Body::from(vec![7u8; 10])).await.expect("within");
        assert_eq!((bytes.len(), charge.bytes(), limits.budget.in_use()), (10, 10, 10));
        let err = read_body(&limits, &none, Body::from(vec![0u8; 7])).await.expect_err("budget spent");
        assert!(matches!(err, BodyError::Busy { drained: true, .. }), "{err}");
        assert!(err.to_string().contains("max_body_bytes_in_flight"), "{err}");
        let mut expecting = HeaderMap::new();
        expecting.insert(header::EXPECT, axum::http::HeaderValue::from_static("100-continue"));
        let err = read_body(&limits, &expecting, Body::from(vec![0u8; 7])).await.expect_err("budget spent");
        assert!(matches!(err, BodyError::Busy { drained: false, .. }), "not read for a client waiting for 100: {err}");
        drop(charge);
        assert_eq!(limits.budget.in_use(), 0, "an error path keeps nothing charged");
    }

    #[tokio::test]
    async fn a_chunked_body_is_charged_as_it_streams_and_cut_at_the_limit() {
        let chunks = |n: usize| Body::new(Chunked((0..n).map(|_| Bytes::from(vec![1u8; 4])).collect()));
        let limits = limits(10, 16);
        let none = HeaderMap::new();
        let (bytes, charge) = read_body(&limits, &none, chunks(2)).await.expect("8 bytes");
        assert_eq!((bytes.len(), charge.bytes()), (8, 10), "charged a step (here the limit) at a time");
        drop(charge);
        let err = read_body(&limits, &none, chunks(3)).await.expect_err("12 bytes");
        assert!(matches!(err, BodyError::TooLarge { received: 12, limit: 10 }), "{err}");
        assert_eq!(limits.budget.in_use(), 0);
    }

    /// A body whose length is not known in advance, as a chunked request's.
    struct Chunked(std::collections::VecDeque<Bytes>);

    impl HttpBody for Chunked {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
        }
    }
}
