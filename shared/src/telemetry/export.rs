//! Span export that can never hold a service up: ended spans go into a bounded queue and one
//! background thread sends them over OTLP in batches. When the queue is full (the collector is
//! down or slow) a span is dropped and counted, never waited for; a batch the collector
//! refuses or times out on is dropped and counted too. `trace_spans_exported_total` and
//! `trace_spans_dropped_total{reason}` are in both services' `/metrics`.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{LazyLock, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;
use prometheus::{IntCounter, IntCounterVec, Opts};

use super::LogLimit;

static EXPORT_LOG: LogLimit = LogLimit::new(1);

/// Spans sent to the collector, and spans dropped, by reason.
pub struct SpanCounters {
    pub exported: IntCounter,
    pub dropped: IntCounterVec,
}

/// The process's span counters; register them with [`register_span_metrics`].
pub static SPAN_COUNTERS: LazyLock<SpanCounters> = LazyLock::new(|| SpanCounters {
    exported: IntCounter::new("trace_spans_exported_total", "Spans sent to the OTLP collector").expect("valid metric"),
    dropped: IntCounterVec::new(
        Opts::new(
            "trace_spans_dropped_total",
            "Spans dropped: the export queue was full (queue_full) or the collector refused or did not answer (export_failed)",
        ),
        &["reason"],
    )
    .expect("valid metric"),
});

/// Adds the span counters to a service's registry.
pub fn register_span_metrics(registry: &prometheus::Registry) -> prometheus::Result<()> {
    registry.register(Box::new(SPAN_COUNTERS.exported.clone()))?;
    registry.register(Box::new(SPAN_COUNTERS.dropped.clone()))?;
    // Both reasons appear from the start, at 0, so a dashboard can rate() them.
    for reason in ["queue_full", "export_failed"] {
        SPAN_COUNTERS.dropped.with_label_values(&[reason]);
    }
    Ok(())
}

/// Bounds of the export queue and its batches.
#[derive(Debug, Clone, Copy)]
pub struct QueueBounds {
    /// Spans waiting for export; past it, new spans are dropped.
    pub max_queued: usize,
    /// Spans per OTLP request.
    pub max_batch: usize,
    /// Longest a span waits for its batch to fill before the batch is sent anyway.
    pub delay: Duration,
}

enum Message {
    Span(Box<SpanData>),
    /// Export everything queued, then answer.
    Flush(SyncSender<()>),
}

/// The processor: `on_end` only tries to enqueue; the thread does the rest.
#[derive(Debug)]
pub struct QueueProcessor {
    queue: SyncSender<Message>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl QueueProcessor {
    /// Starts the export thread. `exporter` is built on that thread (the OTLP client is a
    /// blocking one and must not live on an async runtime's threads).
    pub fn start<E, F>(make_exporter: F, resource: Resource, bounds: QueueBounds) -> std::io::Result<Self>
    where
        E: SpanExporter + 'static,
        F: FnOnce() -> Option<E> + Send + 'static,
    {
        let (queue, spans) = mpsc::sync_channel(bounds.max_queued.max(1));
        let thread = std::thread::Builder::new().name("otlp-export".into()).spawn(move || {
            let Some(mut exporter) = make_exporter() else { return drain_dropping(spans) };
            exporter.set_resource(&resource);
            export_loop(&exporter, &spans, bounds);
            let _ = exporter.shutdown();
        })?;
        Ok(QueueProcessor { queue, thread: Mutex::new(Some(thread)) })
    }

    fn flush(&self, timeout: Duration) -> OTelSdkResult {
        let (done, wait) = mpsc::sync_channel(1);
        self.queue.try_send(Message::Flush(done)).map_err(|_| OTelSdkError::InternalFailure("export queue full or closed".into()))?;
        wait.recv_timeout(timeout).map_err(|_| OTelSdkError::Timeout(timeout))
    }
}

impl SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        match self.queue.try_send(Message::Span(Box::new(span))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => SPAN_COUNTERS.dropped.with_label_values(&["queue_full"]).inc(),
            Err(TrySendError::Disconnected(_)) => SPAN_COUNTERS.dropped.with_label_values(&["export_failed"]).inc(),
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.flush(Duration::from_secs(5))
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let flushed = self.flush(timeout);
        // The thread ends when the last sender goes; the provider holds this one until it
        // drops, so only take the handle (joining here could wait on a hung collector).
        drop(self.thread.lock().unwrap_or_else(|p| p.into_inner()).take());
        flushed
    }
}

fn export_loop<E: SpanExporter>(exporter: &E, spans: &Receiver<Message>, bounds: QueueBounds) {
    let mut batch: Vec<SpanData> = Vec::with_capacity(bounds.max_batch);
    let mut oldest: Option<Instant> = None;
    loop {
        let wait = oldest.map_or(bounds.delay, |t| bounds.delay.saturating_sub(t.elapsed()));
        match spans.recv_timeout(wait) {
            Ok(Message::Span(span)) => {
                oldest.get_or_insert_with(Instant::now);
                batch.push(*span);
                if batch.len() >= bounds.max_batch {
                    send(exporter, &mut batch);
                    oldest = None;
                }
            }
            Ok(Message::Flush(done)) => {
                // Everything queued before the flush is in `batch` or behind it: take it all.
                while let Ok(Message::Span(span)) = spans.try_recv() {
                    batch.push(*span);
                    if batch.len() >= bounds.max_batch {
                        send(exporter, &mut batch);
                    }
                }
                send(exporter, &mut batch);
                oldest = None;
                let _ = done.send(());
            }
            Err(RecvTimeoutError::Timeout) => {
                send(exporter, &mut batch);
                oldest = None;
            }
            Err(RecvTimeoutError::Disconnected) => {
                send(exporter, &mut batch);
                return;
            }
        }
    }
}

fn send<E: SpanExporter>(exporter: &E, batch: &mut Vec<SpanData>) {
    if batch.is_empty() {
        return;
    }
    let n = batch.len() as u64;
    match futures::executor::block_on(exporter.export(std::mem::take(batch))) {
        Ok(()) => SPAN_COUNTERS.exported.inc_by(n),
        Err(error) => {
            SPAN_COUNTERS.dropped.with_label_values(&["export_failed"]).inc_by(n);
            if EXPORT_LOG.allow() {
                let error = error.to_string();
                tracing::warn!(spans = n, error = super::bounded(&error, super::LOG_FIELD_MAX_BYTES), "span export failed; spans dropped (see trace_spans_dropped_total)");
            }
        }
    }
}

/// No exporter could be built: every span is counted as dropped.
fn drain_dropping(spans: Receiver<Message>) {
    for message in spans {
        match message {
            Message::Span(_) => SPAN_COUNTERS.dropped.with_label_values(&["export_failed"]).inc(),
            Message::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}
