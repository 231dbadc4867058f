//! The model repository at run time: Triton's repository extension (`POST
//! /v2/repository/index`, `.../models/{name}/load`, `.../models/{name}/unload`) and `poll`
//! mode, over the same engine that serves.
//!
//! A load reads the model's folder again (`config.toml`, its version folders, its version
//! policy) and loads each version that is new or whose declaration or file changed:
//!
//! 1. **Admitted by bytes**, like a request: before the file is read, the load takes
//!    `2 × file size + load_warmup_bytes` of the admission budget, waiting at most
//!    `load_wait_ms` for in-flight work to give them back (else 503), refused at once when the
//!    budget could never hold them (507). While the load holds them no request is admitted
//!    into that memory, so a load never makes in-flight work run out of memory.
//! 2. **Probed and calibrated as at start-up** while the old version keeps serving; the memory
//!    probes run in the engine's serial lane (alone on the device, so they can be measured).
//! 3. **Switched**: only once every new version is ready do requests that name no version go
//!    to the newest; versions the policy no longer selects are retired.
//!
//! A retired version (an unload, or one replaced) takes no new request; those it admitted
//! finish, then its batch threads end and its memory is freed (the index shows it `UNLOADING`
//! until then). The budget counts a version's weights (its file's size per instance) as not
//! the requests' from its load until its memory is freed
//! ([`crate::memory::Budget::available`]). A failed load (a file
//! libtorch cannot read, a declaration the model does not fit) leaves what was served
//! untouched; the index gives the reason until the next load succeeds.
//!
//! One load or unload runs at a time; the others wait their turn. With `model_control =
//! "none"` (the default) the index answers and load and unload are refused (400), as Triton's.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use serde::Serialize;
use vramgate_shared::admission::AdmitError;

use super::*;
use crate::config::{ModelConfig, ModelControl};

/// The largest body a repository call may carry (Triton's optional parameters).
const MAX_CALL_BODY_BYTES: usize = 64 * 1024;
/// Failures of poll mode logged a minute, across models (the index keeps each one's reason).
const POLL_FAILURES_LOGGED_PER_MINUTE: usize = 10;

/// The repository's run-time side; see the module's documentation.
pub(super) struct Repository {
    folder: Option<PathBuf>,
    control: ModelControl,
    config: WorkerConfig,
    device: ComputeDevice,
    engine: Arc<Engine>,
    /// One load or unload at a time, from either door or the poll.
    turn: tokio::sync::Mutex<()>,
    status: Mutex<Status>,
}

#[derive(Default)]
struct Status {
    /// What each served version was loaded from.
    loaded: HashMap<(String, u64), Fingerprint>,
    /// The model being loaded now, if any.
    loading: Option<String>,
    /// Why a model's last load failed, until one succeeds or it is unloaded.
    failed: HashMap<String, String>,
}

/// What a loaded version came from: its declaration, and its file's size and modification time.
#[derive(Debug, Clone, PartialEq)]
struct Fingerprint(String);

fn fingerprint(model: &ModelConfig) -> Fingerprint {
    let file = std::fs::metadata(&model.path).ok().map(|m| (m.len(), m.modified().ok()));
    Fingerprint(format!("{}|{file:?}", serde_json::to_string(model).unwrap_or_default()))
}

/// One row of the index, as Triton writes it.
#[derive(Debug, Serialize)]
pub(super) struct IndexEntry {
    pub(super) name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) version: Option<String>,
    pub(super) state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reason: Option<String>,
}

impl Repository {
    pub(super) fn new(config: &WorkerConfig, device: ComputeDevice, engine: Arc<Engine>) -> Repository {
        let mut status = Status::default();
        for model in &config.models {
            status.loaded.insert((model.name.clone(), model.version), fingerprint(model));
        }
        Repository {
            folder: config.model_repository.clone(),
            control: config.model_control,
            config: config.clone(),
            device,
            engine,
            turn: tokio::sync::Mutex::new(()),
            status: Mutex::new(status),
        }
    }

    fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `name` is being loaded now.
    pub(super) fn is_loading(&self, name: &str) -> bool {
        self.status().loading.as_deref() == Some(name)
    }

    /// Whether `name` is a model of the repository folder.
    pub(super) fn knows(&self, name: &str) -> bool {
        // One file looked at, not the folder listed: this runs on every 404. A valid name
        // cannot leave the folder (no `/`, no leading `.`).
        crate::config::check_model_name(name).is_ok()
            && self.folder.as_ref().is_some_and(|f| f.join(name).join(crate::config::MODEL_CONFIG_FILE).is_file())
    }

    /// Every model of the repository and every model served, with its versions' states.
    pub(super) fn index(&self, ready_only: bool) -> Vec<IndexEntry> {
        let mut names: Vec<String> = self.folder.as_ref().and_then(|f| crate::config::repository_model_names(f).ok()).unwrap_or_default();
        names.extend(self.engine.models().into_iter().map(|(name, _)| name));
        let retiring = self.engine.retiring();
        names.extend(retiring.iter().map(|(name, _)| name.clone()));
        names.sort();
        names.dedup();
        let status = self.status();
        let mut entries = Vec::new();
        for name in names {
            let served = self.engine.versions(&name);
            for version in &served {
                entries.push(IndexEntry { name: name.clone(), version: Some(version.to_string()), state: "READY", reason: None });
            }
            if ready_only {
                continue;
            }
            for (_, version) in retiring.iter().filter(|(n, _)| *n == name) {
                entries.push(IndexEntry {
                    name: name.clone(),
                    version: Some(version.to_string()),
                    state: "UNLOADING",
                    reason: Some("unloaded: finishing the requests it admitted".into()),
                });
            }
            if status.loading.as_deref() == Some(&name) {
                entries.push(IndexEntry { name: name.clone(), version: None, state: "LOADING", reason: None });
            } else if let Some(reason) = status.failed.get(&name) {
                entries.push(IndexEntry { name: name.clone(), version: None, state: "UNAVAILABLE", reason: Some(reason.clone()) });
            } else if served.is_empty() {
                entries.push(IndexEntry { name: name.clone(), version: None, state: "UNAVAILABLE", reason: Some("unloaded".into()) });
            }
        }
        entries
    }

    /// Refuses load and unload unless `model_control` lets the API change the models.
    pub(super) fn api_allowed(&self) -> Result<(), ApiError> {
        match self.control {
            ModelControl::Explicit => Ok(()),
            ModelControl::None => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "explicit model load / unload is not allowed: the worker runs with model_control = \"none\" (set \"explicit\")",
            )),
            ModelControl::Poll => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "explicit model load / unload is not allowed: the worker polls its repository (model_control = \"poll\")",
            )),
        }
    }

    /// Loads what the folder of `name` now declares (see the module's documentation); the
    /// versions served afterwards.
    pub(super) async fn load(&self, name: &str) -> Result<Vec<u64>, ApiError> {
        let _turn = self.turn.lock().await;
        let Some(folder) = &self.folder else {
            return Err(ApiError::new(StatusCode::BAD_REQUEST, "the worker has no model_repository to load from"));
        };
        let wanted = crate::config::repository_read_folder(folder, name).map_err(|e| self.failed(name, StatusCode::BAD_REQUEST, e))?;
        let before = self.engine.versions(name);
        let new: Vec<ModelConfig> = {
            let status = self.status();
            wanted
                .iter()
                .filter(|m| !before.contains(&m.version) || status.loaded.get(&(name.to_string(), m.version)) != Some(&fingerprint(m)))
                .cloned()
                .collect()
        };
        self.status().loading = Some(name.to_string());
        let mut ready = Vec::new();
        for model in new {
            let print = fingerprint(&model);
            let version = model.version;
            match self.prepare(model).await {
                Ok(calibrated) => ready.push((version, calibrated, print)),
                Err(error) => {
                    self.status().loading = None;
                    return Err(self.failed(name, error.status, error.message));
                }
            }
        }
        // Every new version is ready: switch, then retire what the policy no longer selects.
        let mut installed = Vec::new();
        for (version, calibrated, print) in ready {
            // Its batch threads warm their shapes before it is served: seconds, off the runtime.
            let engine = self.engine.clone();
            let started = tokio::task::spawn_blocking(move || engine.install(version, calibrated, true))
                .await
                .unwrap_or_else(|e| Err(anyhow::anyhow!("the install task failed: {e}")));
            if let Err(e) = started {
                self.status().loading = None;
                return Err(self.failed(name, StatusCode::INTERNAL_SERVER_ERROR, format!("starting version {version}: {e:#}")));
            }
            self.status().loaded.insert((name.to_string(), version), print);
            installed.push(version);
        }
        let keep: Vec<u64> = wanted.iter().map(|m| m.version).collect();
        let mut retired = Vec::new();
        for version in before.iter().filter(|v| !keep.contains(v)) {
            retired.extend(self.engine.retire(name, Some(*version)));
            self.status().loaded.remove(&(name.to_string(), *version));
        }
        {
            let mut status = self.status();
            status.loading = None;
            status.failed.remove(name);
        }
        tracing::info!(model = %name, loaded = ?installed, retired = ?retired, serving = ?self.engine.versions(name), "model loaded");
        Ok(self.engine.versions(name))
    }

    /// Retires every version of `name`; the versions retired.
    pub(super) async fn unload(&self, name: &str) -> Result<Vec<u64>, ApiError> {
        let _turn = self.turn.lock().await;
        let retired = self.engine.retire(name, None);
        if retired.is_empty() {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("failed to unload '{}': no version of it is loaded", bounded(name, LOG_FIELD_MAX_BYTES)),
            ));
        }
        let mut status = self.status();
        status.loaded.retain(|(n, _), _| n != name);
        status.failed.remove(name);
        drop(status);
        tracing::info!(model = %name, retired = ?retired, "model unloaded: its in-flight requests finish, then its memory is freed");
        Ok(retired)
    }

    /// Remembers why `name` failed to load (for the index), logs it, and returns the answer.
    fn failed(&self, name: &str, status: StatusCode, message: String) -> ApiError {
        let message = format!("failed to load '{}': {message}", bounded(name, LOG_FIELD_MAX_BYTES));
        tracing::warn!(model = %bounded(name, LOG_FIELD_MAX_BYTES), reason = %bounded(&message, LOG_FIELD_MAX_BYTES), "model load failed; what was served still is");
        self.status().failed.insert(name.to_string(), message.clone());
        ApiError::new(status, message)
    }

    /// One version loaded, warmed and calibrated under its grant of the budget.
    async fn prepare(&self, model: ModelConfig) -> Result<Calibrated, ApiError> {
        let version = model.version;
        let file_bytes = std::fs::metadata(&model.path).map(|m| m.len()).unwrap_or(0);
        let price = match self.engine.mode {
            AdmissionMode::Bytes => file_bytes.saturating_mul(2).saturating_add(self.config.load_warmup_bytes),
            AdmissionMode::Count => 0,
        };
        let wait = Duration::from_millis(self.config.load_wait_ms);
        let grant = match self.engine.pool.acquire_timeout(price, wait, usize::MAX).await {
            Ok(grant) => grant,
            Err(AdmitError::TooLarge { needed, capacity }) => {
                return Err(ApiError::new(
                    StatusCode::INSUFFICIENT_STORAGE,
                    format!(
                        "version {version} is priced at {needed} bytes to load (2 × its {file_bytes}-byte file + load_warmup_bytes), \
                         more than the whole admission budget of {capacity} bytes"
                    ),
                ))
            }
            Err(_) => {
                let (capacity, in_use) = (self.engine.pool.capacity(), self.engine.pool.in_use());
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "version {version} needs {price} bytes of the admission budget to load; in-flight work held {in_use} of \
                         {capacity} for load_wait_ms ({} ms): retry when it drains",
                        self.config.load_wait_ms
                    ),
                ))
            }
        };
        let (config, device, engine) = (self.config.clone(), self.device, self.engine.clone());
        let cap = grant.bytes();
        let loaded = tokio::task::spawn_blocking(move || {
            let calibrated = prepare(&config, &model, device, &engine.monitor, Some(cap), Some(&engine));
            // The memory the new version holds is now used, and the budget's next re-reading
            // of free memory shows it; the grant covered it until then.
            engine.monitor.empty_cache();
            calibrated
        })
        .await;
        drop(grant);
        match loaded {
            Ok(Ok(calibrated)) => Ok(calibrated),
            Ok(Err(e)) => Err(ApiError::new(StatusCode::BAD_REQUEST, format!("version {version}: {e:#}"))),
            Err(e) => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("version {version}: the load panicked: {e}"))),
        }
    }

    /// `poll` mode: every `repository_poll_seconds`, loads each model folder whose versions,
    /// declaration or files changed, and unloads the models whose folder is gone. A failure
    /// leaves what was served, and is retried at the next poll only if the folder changed.
    pub(super) async fn poll(self: Arc<Self>) {
        let Some(folder) = self.folder.clone() else { return };
        let mut ticker = tokio::time::interval(Duration::from_secs_f64(self.config.repository_poll_seconds));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        // What a failed load was tried with, so an unchanged folder is not loaded again.
        let mut tried: HashMap<String, Vec<Fingerprint>> = HashMap::new();
        let mut logged = (std::time::Instant::now(), 0usize);
        loop {
            ticker.tick().await;
            // The log allowance renews every minute, whether the reads succeed or not.
            if logged.0.elapsed() >= Duration::from_secs(60) {
                logged = (std::time::Instant::now(), 0);
            }
            let names = match crate::config::repository_model_names(&folder) {
                Ok(names) => names,
                Err(e) => {
                    if logged.1 < POLL_FAILURES_LOGGED_PER_MINUTE {
                        tracing::warn!(error = %bounded(&e, LOG_FIELD_MAX_BYTES), "poll: cannot read the model repository");
                        logged.1 += 1;
                    }
                    continue;
                }
            };
            for name in &names {
                let prints: Vec<Fingerprint> = match crate::config::repository_read_folder(&folder, name) {
                    Ok(models) => models.iter().map(fingerprint).collect(),
                    Err(_) => vec![Fingerprint(format!("unreadable {:?}", std::fs::metadata(folder.join(name).join("config.toml")).and_then(|m| m.modified()).ok()))],
                };
                let current: Vec<Fingerprint> = {
                    let status = self.status();
                    let mut current: Vec<(u64, Fingerprint)> =
                        status.loaded.iter().filter(|((n, _), _)| n == name).map(|((_, v), f)| (*v, f.clone())).collect();
                    current.sort_by_key(|(v, _)| *v);
                    current.into_iter().map(|(_, f)| f).collect()
                };
                if prints == current || tried.get(name) == Some(&prints) {
                    continue;
                }
                if self.load(name).await.is_err() {
                    tried.insert(name.clone(), prints);
                } else {
                    tried.remove(name);
                }
            }
            // A model whose folder is gone is unloaded; one from the config file's `[[models]]`
            // has no folder and stays.
            let mut loaded: Vec<String> = self.status().loaded.keys().map(|(n, _)| n.clone()).collect();
            loaded.sort();
            loaded.dedup();
            for name in loaded.into_iter().filter(|n| !names.contains(n)) {
                let from_file = self.config.models.iter().any(|m| m.name == name && !m.path.starts_with(&folder));
                if !from_file {
                    tried.remove(&name);
                    let _ = self.unload(&name).await;
                }
            }
        }
    }
}

/// Reads a repository call's optional JSON body. Triton's per-load `config` and `file:`
/// overrides are refused: the model's folder is its declaration.
fn call_body(body: &Bytes) -> Result<Option<serde_json::Map<String, serde_json::Value>>, ApiError> {
    if body.len() > MAX_CALL_BODY_BYTES {
        return Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("a repository call's body is at most {MAX_CALL_BODY_BYTES} bytes")));
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("the body is not JSON: {e}")))?;
    match value {
        serde_json::Value::Object(map) => Ok(Some(map)),
        _ => Err(ApiError::new(StatusCode::BAD_REQUEST, "the body must be a JSON object")),
    }
}

pub(super) fn repository(state: &AppState) -> Result<Arc<Repository>, ApiError> {
    state.repository.get().cloned().ok_or_else(|| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "models are still loading"))
}

/// Refuses Triton's per-load `config` and `file:` overrides, by parameter name.
pub(super) fn refuse_overrides<'a>(mut names: impl Iterator<Item = &'a str>) -> Result<(), ApiError> {
    if names.any(|k| k == "config" || k.starts_with("file:")) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "a load with a config or file override is not supported: change the model's folder, then load it",
        ));
    }
    Ok(())
}

/// `POST /v2/repository/index`: `[{"name", "version", "state", "reason"}]`; `{"ready": true}`
/// lists the versions ready only.
pub(super) async fn index(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let ready = call_body(&body)?.and_then(|b| b.get("ready").and_then(serde_json::Value::as_bool)).unwrap_or(false);
    Ok(Json(repository(&state)?.index(ready)).into_response())
}

/// `POST /v2/repository/models/{name}/load`: 200 once the versions its folder declares serve.
pub(super) async fn load(State(state): State<Arc<AppState>>, Path(name): Path<String>, body: Bytes) -> Result<Response, ApiError> {
    let repository = repository(&state)?;
    repository.api_allowed()?;
    if let Some(serde_json::Value::Object(parameters)) = call_body(&body)?.and_then(|b| b.get("parameters").cloned()) {
        refuse_overrides(parameters.keys().map(String::as_str))?;
    }
    repository.load(&name).await?;
    Ok(StatusCode::OK.into_response())
}

/// `POST /v2/repository/models/{name}/unload`: 200 once no new request reaches the model; its
/// in-flight requests finish and its memory is freed after (the index shows `UNLOADING`).
pub(super) async fn unload(State(state): State<Arc<AppState>>, Path(name): Path<String>, body: Bytes) -> Result<Response, ApiError> {
    let repository = repository(&state)?;
    repository.api_allowed()?;
    call_body(&body)?;
    repository.unload(&name).await?;
    Ok(StatusCode::OK.into_response())
}
