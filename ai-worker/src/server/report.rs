//! The worker's admission state for its callers ([`vramgate_shared::worker_state`]): stamped on
//! every answer as headers by [`stamp`] (a few reads under the pool's lock, no round trip), and
//! served whole at `GET /vramgate/state` by [`state`]. A gateway in front of several workers
//! sends each request where the most memory is free from these figures.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use vramgate_shared::worker_state::{self, Admission, Estimate, Unit, WorkerState};

use super::{ApiError, AppState};
use crate::config::AdmissionMode;
use crate::engine::{Engine, Served};

fn admission(engine: &Engine) -> Admission {
    let (budget, admitted, queued_requests, queued) = engine.pool.figures();
    let unit = match engine.mode {
        AdmissionMode::Bytes => Unit::Bytes,
        AdmissionMode::Count => Unit::Count,
    };
    Admission { unit, budget, admitted, queued, queued_requests: queued_requests as u64 }
}

fn estimate(served: &Served) -> Estimate {
    let (base_bytes, bytes_per_element) = served.estimate.terms();
    Estimate { base_bytes, bytes_per_element }
}

/// The model a path names (`/v2/models/{name}/…`), if any.
fn model_in_path(path: &str) -> Option<&str> {
    path.strip_prefix("/v2/models/")?.split('/').next().filter(|name| !name.is_empty())
}

/// Adds the admission figures to every answer once the engine is up, and the model's estimate
/// to answers about a model it serves. Read after the handler ran, so an inference answer
/// reports the pool without its own request.
pub(super) async fn stamp(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let model = model_in_path(request.uri().path()).map(str::to_owned);
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    for (name, value) in stamps(&state, model.as_deref()) {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(name), value);
        }
    }
    response
}

/// The stamps of an answer (HTTP headers, or gRPC metadata of the same names): the admission
/// figures once the engine is up, and `model`'s estimate when it is served here.
pub(super) fn stamps(state: &AppState, model: Option<&str>) -> Vec<(&'static str, String)> {
    let Some(engine) = state.engine.get() else { return Vec::new() };
    let mut stamps = admission(engine).headers().to_vec();
    if let Some(served) = model.and_then(|m| engine.served(m)) {
        stamps.push((worker_state::HEADER_ESTIMATE, worker_state::estimate_header(&estimate(&served))));
    }
    stamps
}

/// `GET /vramgate/state`: the admission figures and every model's estimate; 503 while loading.
pub(super) async fn state(State(state): State<Arc<AppState>>) -> Response {
    let Some(engine) = state.engine.get() else {
        return ApiError::new(axum::http::StatusCode::SERVICE_UNAVAILABLE, "models are still loading").into_response();
    };
    let models = engine.models().into_iter().map(|(name, served)| (name, estimate(&served))).collect();
    Json(WorkerState { admission: admission(engine), models }).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_come_from_model_paths_only() {
        assert_eq!(model_in_path("/v2/models/silero_vad/infer"), Some("silero_vad"));
        assert_eq!(model_in_path("/v2/models/m/versions/1/infer"), Some("m"));
        assert_eq!(model_in_path("/v2/models/m"), Some("m"));
        assert_eq!(model_in_path("/v2/models/"), None);
        assert_eq!(model_in_path("/v2/health/ready"), None);
    }
}
