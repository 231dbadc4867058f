//! Admission, batching and OOM recovery: everything between a decoded request and the model.
//!
//! ```text
//! handler ──price (estimate)──► BytePool (FIFO, bytes) ──guard──► model's batch thread
//!    ▲                                                              │ merge within window,
//!    └──────────────── outputs (or 413 / 503 / 504 / 507) ◄─────────┘ run, split, recover
//! ```
//!
//! * **Price.** A request costs its model's estimate for its input elements (`estimate.rs`) as
//!   it would run alone: a model whose input sets `bucket` pads even a lone request up to its
//!   bucket, so the request is priced at its bucketed shape ([`Model::padded_elements`]).
//!   In `count` mode every request costs 1 and the pool's capacity is `max_concurrent`.
//! * **Admission.** The handler holds the [`ByteGuard`] until its response is built, so the
//!   bytes come back on every path: success, error, client gone, deadline.
//! * **Batching.** One OS thread per model instance takes admitted jobs and merges them up to
//!   the batch size the model's [`BatchSizer`] chose for their input size from measured
//!   throughput (`batching.rs`: batching happens only where it pays), while the padded batch
//!   stays within what its members were granted (`estimate(padded elements) ≤ Σ granted`)
//!   and within the model's learned capacity. While it forms, rows count as the members bring
//!   them; once formed, its last members go back to the queue until the batch fits at its
//!   rows padded up to their batch bucket (three rows that run as four wait for a fourth, or
//!   run as two and one). It takes what is already queued at once; it
//!   waits up to `window_ms` for more only while other requests for the model are on their
//!   way (in the HTTP handler or waiting for admission), requests have overlapped within the
//!   last [`OVERLAP_MEMORY`], or its first request came after a pause that long (it may lead a
//!   burst); a lone client's requests never overlap, so only its first pays the window. A
//!   model whose input declares `batching = "pad"` (Silero VAD) takes members of different
//!   sizes padded to the largest (then, with `bucket`, each variable dimension rounded up to
//!   its step: the one shape function [`Model::padded_shapes`]), which costs
//!   `(largest − own) × bytes_per_element` per member; a member that would make the padded
//!   batch cost more than the members' grants, or make padding more than half of the batch's
//!   work ([`MAX_PADDING_WORK`], against what the members cost alone, bucketed), waits for the
//!   next batch instead, so padding never spends memory nobody was granted nor most of a
//!   batch's time. Any other model (`batching = "equal"`, the default) batches only members
//!   of one shape but rows: P-Net's ceil-mode pooling, for one, lets padding change the last
//!   row and column of a smaller image's map (the gateway resizes images to the model's input
//!   size, so equal sizes are the common case).
//! * **Measuring.** Each batch's duration feeds its model's [`BatchSizer`]. Its memory peak is
//!   measured only when the estimate asks for it (`estimate.rs`: new size classes, a batch
//!   larger than any measured, after an OOM, one batch in `memory_measure_every_batches`),
//!   because on CPU a measurement costs the batch its page faults again (`memory.rs`).
//! * **OOM.** A batch that fails to allocate: empty the cache, lower the learned capacity,
//!   halve the batch and run the halves. A single request that fails runs again in the serial
//!   lane (an exclusive lock every other model's batch also takes, shared), alone on the
//!   device; if it fails there too it gets 507. Any other error in a batch of several is
//!   isolated by running its members one by one, so only the bad request gets an error: 400
//!   when the model itself raised on it alone (the input's fault, `ModelError::Raised`:
//!   retrying cannot help), 500 when the device failed (a CUDA error: another worker may
//!   serve it).
//! * **Deadlines.** Work whose deadline passed (or whose client left) is not started. A
//!   handler stops waiting at its deadline and its bytes return to the pool then; a batch
//!   already running on the device cannot be interrupted (neither libtorch nor CUDA can
//!   cancel a launched kernel), so it finishes in the background, still holding the model's
//!   thread and its real memory, and its results are dropped. The pool may meanwhile admit
//!   work into memory that is not yet free; if that allocation fails, OOM recovery catches it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::KeyValue;
use tokio::sync::oneshot;
use tracing::Instrument;
use vramgate_shared::admission::{AdmitError, ByteGuard, BytePool};
use vramgate_shared::telemetry::context::{self, PastSpan};

use crate::batching::BatchSizer;
use crate::config::{AdmissionMode, WorkerConfig};
use crate::estimate::MemoryEstimate;
use crate::memory::MemoryMonitor;
use crate::metrics::Metrics;
use crate::model::{join_rows, Inputs, Model, ModelError, OutputTensor};

/// Why a request got no outputs.
#[derive(Debug, thiserror::Error)]
pub enum InferError {
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Still out of memory alone in the serial lane.
    #[error("{message}")]
    OutOfMemory { message: String },
    #[error("{0}")]
    TooLarge(String),
    #[error("{message}")]
    Busy { message: String, retry_after_seconds: u64 },
    #[error("{0}")]
    Deadline(String),
}

struct Job {
    input: Inputs,
    /// The request's trace, when sampled: its batch and inference are recorded in it.
    trace: Option<opentelemetry::Context>,
    /// When it was queued for a batch.
    queued_at: SystemTime,
    /// Its request came after a pause ([`Arrival`]): a batch it leads waits its window.
    after_pause: bool,
    /// Bytes (or, in count mode, permits) this job's guard holds.
    granted: u64,
    deadline: Instant,
    reply: oneshot::Sender<Result<Vec<OutputTensor>, InferError>>,
}

impl Job {
    /// Answers jobs that must not start: the client left, or the deadline passed.
    fn still_wanted(self) -> Option<Job> {
        if self.reply.is_closed() {
            return None;
        }
        if Instant::now() >= self.deadline {
            let _ = self.reply.send(Err(InferError::Deadline("the deadline passed before the request could start".into())));
            return None;
        }
        Some(self)
    }
}

/// A padded batch's work (its padded elements) may be at most this many times the work its
/// members brought (their own elements, each as it runs alone: with a `bucket`, its bucket's):
/// padding is never most of a batch's time.
pub const MAX_PADDING_WORK: f64 = 2.0;

/// One served model: the model, its estimate, its batch sizes, and the way into its batch
/// thread.
pub struct Served {
    /// Its version: the folder's number in the model repository, else 1.
    pub version: u64,
    /// What its weights hold in memory, as the budget counts them: its file's size for each
    /// instance (a TorchScript archive is its weights, stored).
    pub weight_bytes: u64,
    pub model: Arc<Model>,
    pub estimate: Arc<MemoryEstimate>,
    pub sizer: Arc<BatchSizer>,
    jobs: Sender<Job>,
    traffic: Arc<Traffic>,
}

impl Served {
    /// Marks a request for this model as in the worker until the returned guard is dropped
    /// (hold it until the answer is built), and as on its way to the batch queue until
    /// [`Engine::infer`] queues its job: a batch waits its window only for requests that are
    /// coming, or when requests have lately overlapped.
    pub fn arrive(&self) -> Arrival {
        let t = &self.traffic;
        let now = (t.epoch.elapsed().as_millis() as u64).max(1);
        t.arriving.fetch_add(1, Ordering::SeqCst);
        if t.in_worker.fetch_add(1, Ordering::SeqCst) > 0 {
            t.overlapped_ms.store(now, Ordering::Relaxed);
        }
        let last = t.last_arrival_ms.swap(now, Ordering::Relaxed);
        let after_pause = last == 0 || now.saturating_sub(last) >= OVERLAP_MEMORY.as_millis() as u64;
        Arrival { traffic: self.traffic.clone(), queued: false, after_pause }
    }
}

/// A batch waits for more only while a request overlapped another this recently, or when its
/// first request came after a pause this long (it may lead a burst).
pub const OVERLAP_MEMORY: Duration = Duration::from_secs(1);

/// What a model's batch threads know of the requests not yet in their queue.
struct Traffic {
    /// Requests between the HTTP handler and the batch queue.
    arriving: AtomicUsize,
    /// Requests between the HTTP handler and their answer.
    in_worker: AtomicUsize,
    /// When a request last arrived while another was in the worker, in ms after `epoch`
    /// (0: never).
    overlapped_ms: AtomicU64,
    /// When the last request arrived, in ms after `epoch` (0: none yet).
    last_arrival_ms: AtomicU64,
    epoch: Instant,
}

impl Traffic {
    fn new() -> Self {
        Traffic {
            arriving: AtomicUsize::new(0),
            in_worker: AtomicUsize::new(0),
            overlapped_ms: AtomicU64::new(0),
            last_arrival_ms: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// Whether more requests are likely within a window: some are on their way, or requests
    /// have overlapped within [`OVERLAP_MEMORY`] (a lone client's never do).
    fn expecting_more(&self) -> bool {
        if self.arriving.load(Ordering::SeqCst) > 0 {
            return true;
        }
        let at = self.overlapped_ms.load(Ordering::Relaxed);
        at > 0 && (self.epoch.elapsed().as_millis() as u64).saturating_sub(at) < OVERLAP_MEMORY.as_millis() as u64
    }
}

/// A request in the worker; see [`Served::arrive`].
pub struct Arrival {
    traffic: Arc<Traffic>,
    queued: bool,
    /// It came after a pause of [`OVERLAP_MEMORY`]: a batch it leads waits its window.
    after_pause: bool,
}

impl Arrival {
    /// The request's job is in the batch queue: it is no longer on its way.
    fn queued(&mut self) {
        if !self.queued {
            self.queued = true;
            self.traffic.arriving.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Arrival {
    fn drop(&mut self) {
        self.queued();
        self.traffic.in_worker.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A model as [`Engine::start`] takes it: loaded, its memory estimate and batch sizes measured.
pub struct Calibrated {
    pub model: Arc<Model>,
    pub estimate: Arc<MemoryEstimate>,
    pub sizer: Arc<BatchSizer>,
    /// The most bytes (by the estimate) a warm-up batch may take on each batch thread; 0: any.
    pub warm_up_bytes: u64,
}

pub struct Engine {
    /// Every model's served versions. A request holds its version's `Arc` until it is
    /// answered, so a version taken out of here ([`Engine::retire`]) finishes what it admitted;
    /// its batch threads end, and its memory is freed, when the last request is answered.
    served: RwLock<HashMap<String, BTreeMap<u64, Arc<Served>>>>,
    /// Versions taken out whose model is still alive (requests or a batch still running),
    /// with their weights' bytes.
    retiring: Mutex<Vec<(String, u64, Weak<Model>, u64)>>,
    /// The weights of the versions loaded since start-up less those freed since
    /// ([`crate::memory::Budget::available`]).
    models_since_start: std::sync::atomic::AtomicI64,
    shared: Arc<Shared>,
    window: Duration,
    measure_every: u64,
    pub pool: BytePool,
    pub mode: AdmissionMode,
    pub monitor: Arc<MemoryMonitor>,
    pub metrics: Arc<Metrics>,
    drain: Mutex<DrainRate>,
    max_queue_wait: Duration,
    max_queued: usize,
    pub default_timeout: Duration,
}

/// What batch threads share.
struct Shared {
    monitor: Arc<MemoryMonitor>,
    metrics: Arc<Metrics>,
    /// Batches take it shared; a request retried alone after an OOM takes it exclusively.
    lane: RwLock<()>,
    batches: std::sync::atomic::AtomicU64,
    cleanup_every: u64,
    cleanup_slack: Option<u64>,
    mode: AdmissionMode,
}

impl Engine {
    /// Starts one batch thread per model. `capacity`: bytes (or permits) admission starts with.
    pub fn start(
        config: &WorkerConfig,
        models: Vec<(u64, Calibrated)>,
        monitor: Arc<MemoryMonitor>,
        metrics: Arc<Metrics>,
        capacity: u64,
    ) -> anyhow::Result<Engine> {
        let shared = Arc::new(Shared {
            monitor: monitor.clone(),
            metrics: metrics.clone(),
            lane: RwLock::new(()),
            batches: Default::default(),
            cleanup_every: config.cleanup_every_batches,
            cleanup_slack: config.cleanup_slack_bytes,
            mode: config.admission.mode,
        });
        let engine = Engine {
            served: RwLock::new(HashMap::new()),
            retiring: Mutex::new(Vec::new()),
            models_since_start: Default::default(),
            shared,
            window: Duration::from_secs_f64(config.batching.window_ms.max(0.0) / 1000.0),
            measure_every: config.memory_measure_every_batches,
            pool: BytePool::new(capacity),
            mode: config.admission.mode,
            monitor,
            metrics,
            drain: Mutex::new(DrainRate::default()),
            max_queue_wait: Duration::from_millis(config.admission.max_queue_wait_ms),
            max_queued: config.admission.max_queued_requests,
            default_timeout: Duration::from_millis(config.default_timeout_ms),
        };
        for (version, calibrated) in models {
            engine.install(version, calibrated, false)?;
        }
        Ok(engine)
    }

    /// Starts the batch threads of `calibrated` as `version` of its model and serves it; a
    /// version served already is replaced (and retired). `at_run_time`: its weights are new
    /// to the budget (a start-up model's are in its baseline).
    pub fn install(&self, version: u64, calibrated: Calibrated, at_run_time: bool) -> anyhow::Result<()> {
        let Calibrated { model, estimate, sizer, warm_up_bytes } = calibrated;
        let file_bytes = std::fs::metadata(&model.config().path).map(|m| m.len()).unwrap_or(0);
        let weight_bytes = file_bytes.saturating_mul(model.instances() as u64);
        estimate.set_measure_every(self.measure_every, self.monitor.periodic_measure_gap());
        let (tx, rx) = std::sync::mpsc::channel();
        let intake = Arc::new(Mutex::new(Intake { jobs: rx, pending: VecDeque::new() }));
        let traffic = Arc::new(Traffic::new());
        let (warmed_tx, warmed_rx) = std::sync::mpsc::channel();
        for instance in 0..model.instances() {
            let batcher = Batcher {
                model: model.clone(),
                estimate: estimate.clone(),
                sizer: sizer.clone(),
                traffic: traffic.clone(),
                shared: self.shared.clone(),
                window: self.window,
            };
            let intake = intake.clone();
            let warmed = warmed_tx.clone();
            std::thread::Builder::new().name(format!("batch-{}-{instance}", model.name())).spawn(move || {
                // Each batch thread warms every shape it will run on itself (its settings and
                // stream are its own) before the model is served.
                batcher.model.use_own_stream();
                let outcome = batcher.model.warm_up(|elements| batcher.estimate.fits(elements, warm_up_bytes));
                let _ = warmed.send(outcome);
                batcher.run(&intake)
            })?;
        }
        drop(warmed_tx);
        for _ in 0..model.instances() {
            match warmed_rx.recv() {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(model = %model.name(), error = %e, "a batch thread's warm-up failed; its first requests meet the shapes cold"),
                Err(_) => anyhow::bail!("a batch thread of '{}' ended during its warm-up", model.name()),
            }
        }
        let name = model.name().to_string();
        if at_run_time {
            self.models_since_start.fetch_add(weight_bytes as i64, Ordering::SeqCst);
        }
        let served = Arc::new(Served { version, weight_bytes, model, estimate, sizer, jobs: tx, traffic });
        let replaced = self.served.write().unwrap_or_else(|p| p.into_inner()).entry(name.clone()).or_default().insert(version, served);
        if let Some(old) = replaced {
            self.retired(name, old);
        }
        Ok(())
    }

    /// Stops serving `version` of `name` (every version: `None`): new requests no longer reach
    /// it, those admitted finish. The versions taken out, ascending.
    pub fn retire(&self, name: &str, version: Option<u64>) -> Vec<u64> {
        let taken: Vec<Arc<Served>> = {
            let mut served = self.served.write().unwrap_or_else(|p| p.into_inner());
            let Some(versions) = served.get_mut(name) else { return Vec::new() };
            let taken = match version {
                Some(v) => versions.remove(&v).into_iter().collect(),
                None => std::mem::take(versions).into_values().collect(),
            };
            if versions.is_empty() {
                served.remove(name);
            }
            taken
        };
        let versions = taken.iter().map(|s| s.version).collect();
        for old in taken {
            self.retired(name.to_string(), old);
        }
        versions
    }

    fn retired(&self, name: String, old: Arc<Served>) {
        let model = Arc::downgrade(&old.model);
        self.retiring.lock().unwrap_or_else(|p| p.into_inner()).push((name, old.version, model, old.weight_bytes));
    }

    /// The versions taken out whose model is still alive: requests admitted before, or a
    /// batch still on the device. Each is gone once its memory is freed, and its weights then
    /// leave the budget's count.
    pub fn retiring(&self) -> Vec<(String, u64)> {
        let mut retiring = self.retiring.lock().unwrap_or_else(|p| p.into_inner());
        retiring.retain(|(_, _, model, bytes)| {
            let alive = model.strong_count() > 0;
            if !alive {
                self.models_since_start.fetch_sub(*bytes as i64, Ordering::SeqCst);
            }
            alive
        });
        retiring.iter().map(|(name, version, _, _)| (name.clone(), *version)).collect()
    }

    /// The weights of the versions loaded since start-up less those freed since; see
    /// [`crate::memory::Budget::available`].
    pub fn models_since_start(&self) -> i64 {
        self.retiring();
        self.models_since_start.load(Ordering::SeqCst)
    }

    /// Runs `f` in the serial lane: no batch of any model runs beside it (a run-time load's
    /// memory probes, which can be measured only alone).
    pub fn alone<R>(&self, f: impl FnOnce() -> R) -> R {
        let _lane = self.shared.lane.write().unwrap_or_else(|p| p.into_inner());
        f()
    }

    /// The newest served version of `name`: where a request that names no version goes.
    pub fn served(&self, name: &str) -> Option<Arc<Served>> {
        let served = self.served.read().unwrap_or_else(|p| p.into_inner());
        served.get(name).and_then(|versions| versions.values().next_back().cloned())
    }

    /// `version` of `name`, if it is served.
    pub fn served_version(&self, name: &str, version: u64) -> Option<Arc<Served>> {
        let served = self.served.read().unwrap_or_else(|p| p.into_inner());
        served.get(name).and_then(|versions| versions.get(&version).cloned())
    }

    /// The served versions of `name`, ascending (empty: not served).
    pub fn versions(&self, name: &str) -> Vec<u64> {
        let served = self.served.read().unwrap_or_else(|p| p.into_inner());
        served.get(name).map(|versions| versions.keys().copied().collect()).unwrap_or_default()
    }

    /// Every served model's newest version, by name.
    pub fn models(&self) -> Vec<(String, Arc<Served>)> {
        let served = self.served.read().unwrap_or_else(|p| p.into_inner());
        served.iter().filter_map(|(name, versions)| Some((name.clone(), versions.values().next_back()?.clone()))).collect()
    }

    /// Every served version of every model.
    pub fn all_versions(&self) -> Vec<Arc<Served>> {
        let served = self.served.read().unwrap_or_else(|p| p.into_inner());
        served.values().flat_map(|versions| versions.values().cloned()).collect()
    }

    /// Copies the pool's state into the admission gauges; called when metrics are scraped,
    /// so the figures are exact at that moment and the request path writes no gauge.
    pub fn publish_admission(&self) {
        let m = &self.metrics;
        m.memory_budget.set(self.pool.capacity() as i64);
        m.memory_admitted.set(self.pool.in_use() as i64);
        m.memory_admitted_peak.set(self.pool.high_water_mark() as i64);
        m.queued_requests.set(self.pool.queued() as i64);
        for (_, served) in self.models() {
            for (class, limit) in served.sizer.limits() {
                let from = (1u64 << class).to_string();
                m.batch_size_limit.with_label_values(&[served.model.name(), from.as_str()]).set(limit as i64);
            }
        }
    }

    /// Admits `input` for `served`, runs it in a batch, and returns its outputs. `arrival` (from
    /// [`Served::arrive`]) is marked queued once the job is.
    ///
    /// The rows of a request are independent items of a batch: one whose rows together are
    /// priced past the whole budget (admission by bytes), but whose single rows are not, runs
    /// as consecutive parts of as many rows as fit, each admitted on its own, and is answered
    /// their outputs joined: what the request would have been answered on a larger card,
    /// instead of a 413 for a batch the client could not have sized without knowing the card.
    pub async fn infer(
        &self,
        served: &Served,
        input: Inputs,
        timeout: Duration,
        arrival: &mut Arrival,
    ) -> Result<Vec<OutputTensor>, InferError> {
        if self.rows_that_fit(served, &input).is_none() {
            return self.infer_whole(served, input, timeout, arrival).await;
        }
        let deadline = Instant::now() + timeout;
        let total = input.rows();
        let mut joined: Option<Vec<OutputTensor>> = None;
        let mut start = 0;
        while start < total {
            // Sized again for each part: the estimate may have learned from the last one.
            let rest = input.row_range(start, total - start).expect("a row range inside the request");
            let rows = self.rows_that_fit(served, &rest).unwrap_or(total - start);
            tracing::debug!(model = served.model.name(), rows = total, start, part_rows = rows, "request split into parts that fit the budget");
            let part = input.row_range(start, rows).expect("a row range inside the request");
            start += rows;
            let outputs = self.infer_whole(served, part, deadline.saturating_duration_since(Instant::now()), arrival).await?;
            joined = Some(match joined {
                None => outputs,
                Some(so_far) => join_rows(so_far, outputs)
                    .map_err(|message| InferError::Model(ModelError::Runtime { name: served.model.name().into(), message }))?,
            });
        }
        Ok(joined.unwrap_or_default())
    }

    /// For a request of several rows priced past the whole budget (admission by bytes): the
    /// most rows of it that fit, when at least one does; `None` when it fits as it is, or
    /// cannot be split to fit.
    fn rows_that_fit(&self, served: &Served, input: &Inputs) -> Option<usize> {
        let rows = input.rows();
        if self.mode != AdmissionMode::Bytes || rows < 2 {
            return None;
        }
        let capacity = self.pool.capacity();
        if served.estimate.bytes(served.model.padded_elements(&[input])) <= capacity {
            return None;
        }
        let price = |n: usize| input.row_range(0, n).map(|part| served.estimate.bytes(served.model.padded_elements(&[&part])));
        if price(1)? > capacity {
            return None;
        }
        // The price grows with the rows: the largest n with price(n) within the budget.
        let (mut fits, mut over) = (1, rows);
        while over - fits > 1 {
            let mid = fits + (over - fits) / 2;
            if price(mid)? <= capacity {
                fits = mid;
            } else {
                over = mid;
            }
        }
        Some(fits)
    }

    async fn infer_whole(
        &self,
        served: &Served,
        input: Inputs,
        timeout: Duration,
        arrival: &mut Arrival,
    ) -> Result<Vec<OutputTensor>, InferError> {
        let deadline = Instant::now() + timeout;
        // Priced as it runs: alone, a bucketed model pads it up to its bucket, and that
        // padding must be within its grant too.
        let elements = served.model.padded_elements(&[&input]);
        let price = match self.mode {
            AdmissionMode::Bytes => served.estimate.bytes(elements),
            AdmissionMode::Count => 1,
        };
        let waited = Instant::now();
        let wait_limit = self.max_queue_wait.min(timeout);
        let waiting = tracing::info_span!(
            "admission_wait",
            model = served.model.name(),
            admission.estimated_bytes = price,
            admission.queued_bytes_ahead = self.pool.queued_bytes(),
            admission.queued_ahead = self.pool.queued(),
            admission.in_use_bytes = self.pool.in_use(),
            admission.budget_bytes = self.pool.capacity(),
        );
        let admitted = self.pool.acquire_timeout(price, wait_limit, self.max_queued).instrument(waiting).await;
        let guard: ByteGuard = match admitted {
            Ok(guard) => guard,
            Err(e) => return Err(self.rejected(e, served, elements, price, wait_limit == timeout)),
        };
        self.metrics.admission_wait.observe(waited.elapsed().as_secs_f64());

        let (tx, rx) = oneshot::channel();
        let job = Job {
            input,
            trace: context::sampled_context(&tracing::Span::current()),
            queued_at: SystemTime::now(),
            after_pause: arrival.after_pause,
            granted: price,
            deadline,
            reply: tx,
        };
        // Marked queued before it is: otherwise the batch thread, woken by the send, can see
        // its own job as still on its way and wait its window for it (a lone client's request
        // then paid the window after all).
        arrival.queued();
        let sent = served.jobs.send(job);
        if sent.is_err() {
            return Err(InferError::Model(ModelError::Runtime {
                name: served.model.name().into(),
                message: "the model's batch thread has stopped".into(),
            }));
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        let outcome = match tokio::time::timeout(remaining, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(InferError::Model(ModelError::Runtime {
                name: served.model.name().into(),
                message: "the model's batch thread dropped the request".into(),
            })),
            Err(_) => {
                self.metrics.admission_rejections.with_label_values(&["deadline"]).inc();
                Err(InferError::Deadline(format!(
                    "inference did not finish within the request's deadline of {} ms",
                    timeout.as_millis()
                )))
            }
        };
        drop(guard);
        self.drain.lock().unwrap_or_else(|p| p.into_inner()).record(price);
        outcome
    }

    fn rejected(&self, e: AdmitError, served: &Served, elements: u64, price: u64, deadline_bound: bool) -> InferError {
        let reason = match (&e, deadline_bound) {
            (AdmitError::TooLarge { .. }, _) => "too_large",
            (AdmitError::QueueFull { .. }, _) => "queue_full",
            (AdmitError::Timeout { .. }, true) => "deadline",
            (AdmitError::Timeout { .. }, false) => "timeout",
        };
        self.metrics.admission_rejections.with_label_values(&[reason]).inc();
        match e {
            AdmitError::TooLarge { needed, capacity } => {
                let view = served.estimate.view();
                let bucketed = if served.model.bucket() > 1 { format!(", padded to its bucket of {}", served.model.bucket()) } else { String::new() };
                InferError::TooLarge(format!(
                    "request needs an estimated {needed} bytes ({elements} input elements{bucketed} at {:.1} bytes each plus {:.0} bytes) \
                     but this worker's whole memory budget is {capacity} bytes; send smaller inputs",
                    view.bytes_per_element, view.base_bytes
                ))
            }
            AdmitError::Timeout { waited } if deadline_bound => InferError::Deadline(format!(
                "no memory was free within the request's deadline ({} ms)",
                waited.as_millis()
            )),
            other => {
                let retry_after_seconds = self.retry_after(price);
                InferError::Busy {
                    message: format!(
                        "worker busy: {other}; {} bytes admitted, {} requests waiting for {} bytes; retry after {retry_after_seconds} s",
                        self.pool.in_use(),
                        self.pool.queued(),
                        self.pool.queued_bytes()
                    ),
                    retry_after_seconds,
                }
            }
        }
    }

    /// How long until the queue ahead of a request of `price` has likely drained: the bytes
    /// waiting (plus its own) over the rate at which bytes were released in the last seconds.
    fn retry_after(&self, price: u64) -> u64 {
        let rate = self.drain.lock().unwrap_or_else(|p| p.into_inner()).per_second();
        let backlog = (self.pool.queued_bytes() + price) as f64;
        if rate <= 0.0 {
            return 5;
        }
        ((backlog / rate).ceil() as u64).clamp(1, 60)
    }
}

/// Bytes given back over the last [`DrainRate::WINDOW`].
#[derive(Default)]
struct DrainRate {
    events: VecDeque<(Instant, u64)>,
}

impl DrainRate {
    const WINDOW: Duration = Duration::from_secs(10);

    fn record(&mut self, bytes: u64) {
        let now = Instant::now();
        self.events.push_back((now, bytes));
        while self.events.front().is_some_and(|(t, _)| now.duration_since(*t) > Self::WINDOW) {
            self.events.pop_front();
        }
    }

    fn per_second(&self) -> f64 {
        let Some((first, _)) = self.events.front() else { return 0.0 };
        let span = first.elapsed().max(Duration::from_secs(1)).min(Self::WINDOW);
        self.events.iter().map(|(_, b)| *b as f64).sum::<f64>() / span.as_secs_f64()
    }
}

/// Where a model's admitted jobs wait: the channel, and the jobs that did not fit the last
/// batch formed (they lead the next one).
struct Intake {
    jobs: Receiver<Job>,
    pending: VecDeque<Job>,
}

struct Batcher {
    model: Arc<Model>,
    estimate: Arc<MemoryEstimate>,
    sizer: Arc<BatchSizer>,
    /// See [`Served::arrive`].
    traffic: Arc<Traffic>,
    shared: Arc<Shared>,
    window: Duration,
}

impl Batcher {
    /// Forms batches and runs them. Several instances of one model share the intake: the one
    /// forming a batch holds it (so a batch is formed from every job available), and lets go
    /// of it before running the batch, so the next instance can form another.
    fn run(self, intake: &Mutex<Intake>) {
        loop {
            let batch = {
                let mut intake = intake.lock().unwrap_or_else(|p| p.into_inner());
                let Intake { jobs, pending } = &mut *intake;
                match self.form_batch(jobs, pending) {
                    Some(batch) => batch,
                    None => return, // the engine is gone
                }
            };
            if !batch.is_empty() {
                self.execute(batch);
            }
        }
    }

    fn form_batch(&self, jobs: &Receiver<Job>, pending: &mut VecDeque<Job>) -> Option<Vec<Job>> {
        let first = match pending.pop_front() {
            Some(job) => job,
            None => jobs.recv().ok()?,
        };
        let Some(first) = first.still_wanted() else { return Some(Vec::new()) };
        // The most rows this batch may hold: measured per input size (`batching.rs`).
        let cap = self.sizer.allowed(self.item_elements(&[&first.input]));
        let after_pause = first.after_pause;
        let mut batch = vec![first];
        let mut skipped = VecDeque::new();
        while let Some(job) = pending.pop_front() {
            if self.fits(&batch, &job, cap) {
                batch.push(job);
            } else {
                skipped.push_back(job);
            }
        }
        *pending = skipped;
        let window_end = Instant::now() + self.window;
        while rows(&batch) < cap {
            let next = match jobs.try_recv() {
                Ok(job) => job,
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty) => {
                    // Wait only when more requests are likely: a lone client's request runs
                    // at once instead of after the window.
                    let wait = window_end.saturating_duration_since(Instant::now());
                    if wait.is_zero() || !(after_pause || self.traffic.expecting_more()) {
                        break;
                    }
                    match jobs.recv_timeout(wait) {
                        Ok(job) => job,
                        Err(_) => break,
                    }
                }
            };
            let Some(next) = next.still_wanted() else { continue };
            if self.fits(&batch, &next, cap) {
                batch.push(next);
            } else {
                pending.push_back(next);
            }
        }
        self.settle(&mut batch, pending);
        Some(batch)
    }

    /// Whether `next` may join `batch` while it is being formed: the batch stays within `cap`
    /// rows, and [`Batcher::within`] holds at the rows its members bring. Their rows are
    /// not padded up to a batch bucket yet: a third member of a batch that runs as four rows
    /// costs a fourth row nobody was granted, until a fourth member comes (P-Net at 480² on a
    /// card: a row costs 37 times the model's base bytes, and no batch grew past two).
    /// [`Batcher::settle`] checks the formed batch as it runs.
    fn fits(&self, batch: &[Job], next: &Job, cap: usize) -> bool {
        if rows(batch) + next.input.rows() > cap {
            return false;
        }
        if !self.model.can_share(&next.input, &batch[0].input) {
            return false;
        }
        let mut inputs: Vec<&Inputs> = batch.iter().map(|j| &j.input).collect();
        inputs.push(&next.input);
        let granted: u64 = batch.iter().map(|j| j.granted).sum::<u64>() + next.granted;
        self.within(&inputs, granted, false)
    }

    /// Whether a batch of `inputs`, granted `granted` bytes in all, may run: its padding within
    /// [`MAX_PADDING_WORK`], it within the learned capacity and, when admitting by bytes, within
    /// what its members were granted. With `bucket_rows` its rows are padded up to their batch
    /// bucket, as it runs; without, as the members bring them.
    fn within(&self, inputs: &[&Inputs], granted: u64, bucket_rows: bool) -> bool {
        let elements = if bucket_rows { self.model.padded_elements(inputs) } else { self.model.elements_at_own_rows(inputs) };
        // What each member costs alone (with a bucket, its bucket's elements): only the
        // padding that sharing the batch adds counts against MAX_PADDING_WORK.
        let own: u64 = inputs.iter().map(|i| self.model.padded_elements(&[i])).sum();
        if elements as f64 > MAX_PADDING_WORK * own as f64 {
            return false;
        }
        if self.estimate.max_batch_elements().is_some_and(|cap| elements > cap) {
            return false;
        }
        match self.shared.mode {
            AdmissionMode::Bytes => self.estimate.bytes(elements) <= granted,
            AdmissionMode::Count => true,
        }
    }

    /// Gives a formed batch its last members back until it runs within its limits as it runs
    /// (rows padded up to their bucket): they go to the front of `pending`, in order, and lead
    /// the next batch. Rows that fill a bucket exactly always pass, so at worst it falls back
    /// to the bucket below; its first member is never given back.
    fn settle(&self, batch: &mut Vec<Job>, pending: &mut VecDeque<Job>) {
        while batch.len() > 1 {
            let inputs: Vec<&Inputs> = batch.iter().map(|j| &j.input).collect();
            let granted = batch.iter().map(|j| j.granted).sum();
            if self.within(&inputs, granted, true) {
                return;
            }
            pending.push_front(batch.pop().expect("more than one member"));
        }
    }

    /// Runs a batch; on OOM halves it and goes on, down to one request alone in the serial
    /// lane. Every job gets exactly one reply.
    fn execute(&self, batch: Vec<Job>) {
        let name = self.model.name().to_string();
        let mut work: VecDeque<(Vec<Job>, bool)> = VecDeque::from([(batch, false)]);
        while let Some((group, is_retry)) = work.pop_front() {
            let group: Vec<Job> = group.into_iter().filter_map(Job::still_wanted).collect();
            if group.is_empty() {
                continue;
            }
            if is_retry {
                self.shared.metrics.retry_attempts.with_label_values(&[&name]).inc();
            }
            let single = group.len() == 1;
            match self.run_group(&group, false) {
                Ok(outputs) => reply_all(group, outputs),
                Err(ModelError::OutOfMemory { message, .. }) => {
                    let elements = self.model.padded_elements(&group.iter().map(|j| &j.input).collect::<Vec<_>>());
                    self.shared.metrics.oom_errors.with_label_values(&[&name]).inc();
                    self.shared.monitor.empty_cache();
                    let learned = self.estimate.learn_from_oom(elements);
                    let granted: u64 = group.iter().map(|j| j.granted).sum();
                    tracing::warn!(
                        model = %name, batch = group.len(), elements, estimated_bytes = self.estimate.bytes(elements),
                        granted, learned_max_batch_elements = learned, error = %message,
                        "out of memory; {}", if single { "retrying alone in the serial lane" } else { "halving the batch" }
                    );
                    if single {
                        self.retry_alone(group);
                    } else {
                        let mut first = group;
                        let second = first.split_off(first.len() / 2);
                        work.push_front((second, true));
                        work.push_front((first, true));
                    }
                }
                Err(e) if !single => {
                    // One bad member must not fail the others: run them one by one.
                    tracing::debug!(model = %name, error = %e, "batch failed; isolating its members");
                    for job in group.into_iter().rev() {
                        work.push_front((vec![job], false));
                    }
                }
                Err(e) => self.fail_alone(group, e),
            }
        }
    }

    fn retry_alone(&self, group: Vec<Job>) {
        let name = self.model.name();
        self.shared.metrics.retry_attempts.with_label_values(&[name]).inc();
        match self.run_group(&group, true) {
            Ok(outputs) => reply_all(group, outputs),
            Err(ModelError::OutOfMemory { message, .. }) => {
                self.shared.metrics.oom_errors.with_label_values(&[name]).inc();
                self.shared.monitor.empty_cache();
                tracing::warn!(model = %name, error = %message, "out of memory alone on the device; answering 507");
                let text = format!(
                    "model '{name}' ran out of memory even alone on the device ({message}); \
                     this input is too large for this worker's memory"
                );
                reply_all_err(group, |_| InferError::OutOfMemory { message: text.clone() });
            }
            Err(e) => self.fail_alone(group, e),
        }
    }

    /// Answers a request whose model call failed with it alone (not for want of memory). The
    /// model's own error on it ([`ModelError::Raised`]) is the input's fault: counted, and
    /// answered so (400) that nobody retries it; any other error stays the worker's (500).
    fn fail_alone(&self, group: Vec<Job>, e: ModelError) {
        if matches!(e, ModelError::Raised { .. }) {
            self.shared.metrics.model_errors.with_label_values(&[self.model.name()]).inc();
        }
        reply_all_err(group, |_| InferError::Model(e.clone()));
    }

    fn run_group(&self, group: &[Job], exclusive: bool) -> Result<Vec<Vec<OutputTensor>>, ModelError> {
        let inputs: Vec<&Inputs> = group.iter().map(|j| &j.input).collect();
        let elements = self.model.padded_elements(&inputs);
        let name = self.model.name();
        let (_shared_lane, _exclusive_lane);
        if exclusive {
            _exclusive_lane = self.shared.lane.write().unwrap_or_else(|p| p.into_inner());
        } else {
            _shared_lane = self.shared.lane.read().unwrap_or_else(|p| p.into_inner());
        }
        let metrics = &self.shared.metrics;
        metrics.concurrent_tasks.inc();
        let started_at = SystemTime::now();
        let started = Instant::now();
        let scope = self.shared.monitor.peak_scope(self.estimate.wants_peak(elements));
        let measuring = scope.measuring();
        let result = self.model.infer_batch(&inputs);
        let seconds = started.elapsed().as_secs_f64();
        let peak = scope.finish();
        metrics.concurrent_tasks.dec();
        if result.is_ok() {
            metrics.inference_duration.with_label_values(&[name]).observe(seconds);
            let phases = crate::model::last_phases();
            for (phase, took) in phases.labelled() {
                metrics.inference_phases.with_label_values(&[name, phase]).observe(took);
            }
            metrics.batch_size.with_label_values(&[name]).observe(group.len() as f64);
            // A measured batch paid for its measurement (page faults on CPU): its time says
            // nothing about its batch size.
            if !measuring {
                self.sizer.record(self.item_elements(&inputs), rows(group), seconds);
            }
            if let Some(peak) = peak {
                let ratio = self.estimate.observe(elements, peak);
                metrics.estimate_ratio.with_label_values(&[name]).set(ratio);
                if ratio > 1.0 {
                    tracing::info!(model = %name, elements, peak_bytes = peak, ratio, "batch used more than estimated; estimate raised");
                }
            }
        }
        self.maybe_clean_up();
        self.record_spans(group, elements, exclusive, started_at, &result);
        result
    }

    /// Puts this batch into the trace of each sampled member: `batch_formation` (queued until
    /// the batch started) and `inference` (the batch's run), with an `oom` event when it ran
    /// out of memory, saying the batch size before and after.
    fn record_spans(
        &self,
        group: &[Job],
        elements: u64,
        exclusive: bool,
        started: SystemTime,
        result: &Result<Vec<Vec<OutputTensor>>, ModelError>,
    ) {
        if group.iter().all(|j| j.trace.is_none()) {
            return;
        }
        let ended = SystemTime::now();
        let size = group.len() as i64;
        let model = self.model.name().to_string();
        let device = self.model.device_name();
        let estimated = self.estimate.bytes(elements) as i64;
        let error = match result {
            Ok(_) => None,
            Err(ModelError::OutOfMemory { .. }) => Some("out_of_memory"),
            Err(_) => Some("model_error"),
        };
        for job in group {
            let Some(trace) = &job.trace else { continue };
            let mut formation = PastSpan::new("batch_formation", job.queued_at.min(started), started);
            formation.attributes = vec![
                KeyValue::new("batch.size", size),
                KeyValue::new("batch.elements", elements as i64),
                KeyValue::new("batch.estimated_bytes", estimated),
            ];
            formation.record(trace);
            let mut inference = PastSpan::new("inference", started, ended);
            inference.attributes = vec![
                KeyValue::new("model", model.clone()),
                KeyValue::new("batch.size", size),
                KeyValue::new("device", device.clone()),
                KeyValue::new("serial_lane", exclusive),
            ];
            if error == Some("out_of_memory") {
                // What happens next (see `execute`): halved, alone in the serial lane, or 507.
                let after = if exclusive { 0 } else if size > 1 { size / 2 } else { 1 };
                let event = vec![KeyValue::new("batch.size.before", size), KeyValue::new("batch.size.after", after)];
                inference.events.push(("oom", ended, event));
            }
            inference.error = error.map(str::to_string);
            inference.record(trace);
        }
    }

    /// Elements of one item (row) of the padded (and bucketed) batch of `inputs`: what its
    /// size class is of.
    fn item_elements(&self, inputs: &[&Inputs]) -> u64 {
        self.model.row_elements(inputs)
    }

    fn maybe_clean_up(&self) {
        let n = self.shared.batches.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let periodic = self.shared.cleanup_every > 0 && n % self.shared.cleanup_every == 0;
        let slack = self
            .shared
            .cleanup_slack
            .is_some_and(|limit| self.shared.monitor.cache_slack().is_some_and(|s| s > limit));
        if periodic || slack {
            self.shared.monitor.empty_cache();
        }
    }
}


/// Items (rows) in a batch.
fn rows(batch: &[Job]) -> usize {
    batch.iter().map(|j| j.input.rows()).sum()
}

fn reply_all(group: Vec<Job>, outputs: Vec<Vec<OutputTensor>>) {
    for (job, out) in group.into_iter().zip(outputs) {
        let _ = job.reply.send(Ok(out));
    }
}

fn reply_all_err(group: Vec<Job>, err: impl Fn(&Job) -> InferError) {
    for job in group {
        let e = err(&job);
        let _ = job.reply.send(Err(e));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_rate_averages_over_at_least_a_second() {
        let mut d = DrainRate::default();
        assert_eq!(d.per_second(), 0.0);
        d.record(1000);
        d.record(1000);
        let rate = d.per_second();
        assert!((rate - 2000.0).abs() < 1.0, "{rate}");
    }
}
