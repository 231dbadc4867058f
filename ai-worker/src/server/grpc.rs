//! The worker's gRPC front door: the Open Inference Protocol's `GRPCInferenceService`
//! (`proto/inference.proto`), which `tritonclient.grpc` and KServe's clients speak, over the
//! same engine as the HTTP door. One engine, two doors: a gRPC inference is admitted by
//! bytes, batched, given its deadline and traced exactly as an HTTP one.
//!
//! To share the HTTP door's checks rather than repeat them, a `ModelInfer` request is turned
//! into the HTTP binary-extension request it stands for (a JSON header naming each input's
//! `binary_data_size`, then the inputs' little-endian bytes) and decoded by
//! [`oip::decode_request_in_place`]: datatypes, shapes, sizes, duplicates and limits are
//! refused with the same messages on both doors. Typed `contents` become those bytes first,
//! each datatype from the list the protocol gives it, integers narrowed only when they fit.
//!
//! Before tonic reads a message, [`BodyGate`] checks the bearer token of the guarded calls
//! and reads the message under the HTTP door's [`BodyLimits`]: at most `max_request_bytes`,
//! charged to the `max_body_bytes_in_flight` the two doors share, within
//! `body_read_timeout_ms`. The charge is held until the call has answered.
//!
//! Errors are gRPC status codes carrying the HTTP door's messages ([`status_of`]). Every
//! `ModelInfer` answer, result or error, carries the admission state and the model's estimate
//! as metadata under the HTTP door's header names (`report::stamps`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::HeaderMap;
use bytes::Bytes;
use tonic::body::Body as GrpcBody;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};
use vramgate_shared::oip::{self, DataType, Parameters};

use super::*;

/// The code `tonic-prost-build` generated from `proto/inference.proto`.
#[allow(clippy::all, missing_docs)]
pub mod proto {
    tonic::include_proto!("inference");
}

use proto::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use proto::infer_parameter::ParameterChoice;
use proto::model_infer_request::InferInputTensor;
use proto::model_infer_response::InferOutputTensor;
use proto::{InferParameter, InferTensorContents, ModelInferRequest, ModelInferResponse};

/// The service's full name, the first part of every call's path.
const SERVICE: &str = "inference.GRPCInferenceService";
/// Calls behind the bearer token when one is configured: inference, model metadata and the
/// repository, as on HTTP. Liveness, readiness and server metadata stay open.
const GUARDED: [&str; 5] = ["ModelInfer", "ModelMetadata", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"];
/// How often an idle connection is pinged, and how long the answer may take before the
/// connection is closed: a peer that vanished does not hold a connection for ever.
const KEEPALIVE: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 flow-control windows: what a client may send on one call, and on one connection,
/// before the worker has read it. HTTP/2's 64 KiB default made a 320 KB Silero clip wait for
/// several window updates. The bytes the worker buffers unread are bounded by these (the
/// connection's window across its calls); what it reads is charged to the body budget.
const STREAM_WINDOW_BYTES: u32 = 1 << 20;
const CONNECTION_WINDOW_BYTES: u32 = 16 << 20;
/// Connections accepted and not yet taken by tonic.
const ACCEPTED_QUEUE: usize = 64;
/// The metadata key carrying the seconds to wait before retrying a refused call (HTTP's
/// `Retry-After`).
pub const RETRY_AFTER_KEY: &str = "retry-after";

/// Serves the gRPC door on `listener` until `shutdown` resolves.
pub(super) async fn serve(
    state: Arc<AppState>,
    listener: TcpListener,
    config: &WorkerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let limit = config.max_request_bytes;
    let service = GrpcInferenceServiceServer::new(Door { state: state.clone() })
        .max_decoding_message_size(limit)
        .max_encoding_message_size(usize::MAX);
    tonic::transport::Server::builder()
        .max_concurrent_streams(config.grpc_max_concurrent_streams)
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .http2_keepalive_interval(Some(KEEPALIVE))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .tcp_nodelay(true)
        .layer(tower::layer::layer_fn(move |inner| BodyGate { inner, state: state.clone() }))
        .add_service(service)
        // Answers are written at once: without TCP_NODELAY a small answer waited for the
        // client's delayed ACK (P2 over gRPC at 32×32: 0.19× HTTP's rate before, see
        // docs/performance.md). The builder's `tcp_nodelay` covers only listeners it binds;
        // `incoming` sets it on each connection.
        .serve_with_incoming_shutdown(
            incoming(
                listener,
                Duration::from_millis(config.header_read_timeout_ms),
                Duration::from_millis(config.idle_timeout_ms),
            ),
            shutdown,
        )
        .await?;
    Ok(())
}

/// The connections `listener` accepts, each handed to tonic only once it has sent its first
/// bytes (HTTP/2's connection preface) within `first_bytes` (`header_read_timeout_ms`): one
/// that sends nothing is closed then, as the HTTP door closes one that sends no request head,
/// so silent sockets cannot pile up. `TCP_NODELAY` is set on each, and each is closed once it
/// has had no call for `idle` ([`IdleClosing`]).
fn incoming(
    listener: TcpListener,
    first_bytes: Duration,
    idle: Duration,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<IdleClosing>> {
    let (tx, rx) = tokio::sync::mpsc::channel(ACCEPTED_QUEUE);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = tx.closed() => return, // the server stopped
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, say: not fatal, but not a busy loop either.
                    tracing::warn!(error = %e, "gRPC accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                if let Ok(Ok(1..)) = tokio::time::timeout(first_bytes, stream.peek(&mut first)).await {
                    let _ = tx.send(Ok(IdleClosing::new(stream, idle))).await;
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// The calls in progress on one connection, and since when it has had none. Tonic hands it to
/// each call as the connection's info ([`tonic::transport::server::Connected`]), and
/// [`BodyGate`] counts the call while it runs.
#[derive(Clone)]
struct Calls(Arc<CallsInner>);

struct CallsInner {
    running: AtomicUsize,
    idle_since: std::sync::Mutex<tokio::time::Instant>,
}

impl Calls {
    fn new() -> Self {
        Calls(Arc::new(CallsInner { running: AtomicUsize::new(0), idle_since: std::sync::Mutex::new(tokio::time::Instant::now()) }))
    }

    /// A call begins; it ends when the guard is dropped.
    fn begin(&self) -> CallRunning {
        self.0.running.fetch_add(1, Ordering::SeqCst);
        CallRunning(self.clone())
    }

    /// When the connection's idle time runs out, or `None` while a call runs.
    fn idle_until(&self, idle: Duration) -> Option<tokio::time::Instant> {
        let since = *self.0.idle_since.lock().unwrap_or_else(|p| p.into_inner());
        (self.0.running.load(Ordering::SeqCst) == 0).then_some(since + idle)
    }
}

struct CallRunning(Calls);

impl Drop for CallRunning {
    fn drop(&mut self) {
        let inner = &self.0 .0;
        let mut since = inner.idle_since.lock().unwrap_or_else(|p| p.into_inner());
        if inner.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            *since = tokio::time::Instant::now();
        }
    }
}

/// A gRPC connection's socket that reads as closed once the connection has had no call in
/// progress for `idle` (`idle_timeout_ms`, as on the HTTP door), so hyper closes it. HTTP/2
/// pings are answered without a call, so a client that pings and never calls no longer holds
/// a connection, with its windows' buffers, for ever. Only a read that would wait ends it:
/// bytes that arrived are always read first, and a call that begins restarts the count. The
/// connection's task reads again whenever it has written (a call's answer), which arms the
/// timer once the last call ended.
struct IdleClosing {
    stream: tokio::net::TcpStream,
    calls: Calls,
    idle: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl IdleClosing {
    fn new(stream: tokio::net::TcpStream, idle: Duration) -> Self {
        let calls = Calls::new();
        let timer = Box::pin(tokio::time::sleep(idle));
        IdleClosing { stream, calls, idle, timer }
    }
}

impl tonic::transport::server::Connected for IdleClosing {
    type ConnectInfo = Calls;

    fn connect_info(&self) -> Calls {
        self.calls.clone()
    }
}

impl tokio::io::AsyncRead for IdleClosing {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut tokio::io::ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let ready @ Poll::Ready(_) = Pin::new(&mut this.stream).poll_read(cx, buf) {
            return ready;
        }
        let Some(until) = this.calls.idle_until(this.idle) else { return Poll::Pending };
        if this.timer.deadline() != until {
            this.timer.as_mut().reset(until);
        }
        if this.timer.as_mut().poll(cx).is_ready() {
            tracing::debug!(idle_ms = this.idle.as_millis() as u64, "closing a gRPC connection idle past idle_timeout_ms");
            return Poll::Ready(Ok(())); // read as the end of the stream: hyper closes it
        }
        Poll::Pending
    }
}

impl tokio::io::AsyncWrite for IdleClosing {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// The service itself: each call reads the shared [`AppState`].
struct Door {
    state: Arc<AppState>,
}

#[tonic::async_trait]
impl GrpcInferenceService for Door {
    async fn repository_index(
        &self,
        request: tonic::Request<proto::RepositoryIndexRequest>,
    ) -> Result<tonic::Response<proto::RepositoryIndexResponse>, Status> {
        let request = request.into_inner();
        one_repository(&request.repository_name)?;
        let entries = super::repository::repository(&self.state).map_err(status_of)?.index(request.ready);
        let models = entries
            .into_iter()
            .map(|e| proto::repository_index_response::ModelIndex {
                name: e.name,
                version: e.version.unwrap_or_default(),
                state: e.state.into(),
                reason: e.reason.unwrap_or_default(),
            })
            .collect();
        Ok(tonic::Response::new(proto::RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        request: tonic::Request<proto::RepositoryModelLoadRequest>,
    ) -> Result<tonic::Response<proto::RepositoryModelLoadResponse>, Status> {
        let request = request.into_inner();
        let repository = self.changing(&request.repository_name)?;
        super::repository::refuse_overrides(request.parameters.keys().map(String::as_str)).map_err(status_of)?;
        repository.load(&request.model_name).await.map_err(status_of)?;
        Ok(tonic::Response::new(proto::RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        request: tonic::Request<proto::RepositoryModelUnloadRequest>,
    ) -> Result<tonic::Response<proto::RepositoryModelUnloadResponse>, Status> {
        let request = request.into_inner();
        self.changing(&request.repository_name)?.unload(&request.model_name).await.map_err(status_of)?;
        Ok(tonic::Response::new(proto::RepositoryModelUnloadResponse {}))
    }

    async fn server_live(
        &self,
        _: tonic::Request<proto::ServerLiveRequest>,
    ) -> Result<tonic::Response<proto::ServerLiveResponse>, Status> {
        Ok(tonic::Response::new(proto::ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: tonic::Request<proto::ServerReadyRequest>,
    ) -> Result<tonic::Response<proto::ServerReadyResponse>, Status> {
        Ok(tonic::Response::new(proto::ServerReadyResponse { ready: self.state.engine.get().is_some() }))
    }

    async fn model_ready(
        &self,
        request: tonic::Request<proto::ModelReadyRequest>,
    ) -> Result<tonic::Response<proto::ModelReadyResponse>, Status> {
        // Still loading or not served here: not ready, as the HTTP door's 503 and 404 read
        // to `tritonclient.http` (which answers `False` to both).
        let request = request.get_ref();
        let ready = self.state.served_at(&request.name, Some(&request.version)).is_ok();
        Ok(tonic::Response::new(proto::ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: tonic::Request<proto::ServerMetadataRequest>,
    ) -> Result<tonic::Response<proto::ServerMetadataResponse>, Status> {
        // The HTTP door's binary tensor extension is an HTTP matter: gRPC has raw contents.
        Ok(tonic::Response::new(proto::ServerMetadataResponse {
            name: SERVER_NAME.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: Vec::new(),
        }))
    }

    async fn model_metadata(
        &self,
        request: tonic::Request<proto::ModelMetadataRequest>,
    ) -> Result<tonic::Response<proto::ModelMetadataResponse>, Status> {
        let request = request.get_ref();
        let meta = metadata_of(&self.state, &request.name, Some(&request.version)).map_err(status_of)?;
        let tensor = |t: oip::TensorMetadata| proto::model_metadata_response::TensorMetadata {
            name: t.name,
            datatype: t.datatype,
            shape: t.shape,
        };
        Ok(tonic::Response::new(proto::ModelMetadataResponse {
            name: meta.name,
            versions: meta.versions.unwrap_or_default(),
            platform: meta.platform,
            inputs: meta.inputs.into_iter().map(tensor).collect(),
            outputs: meta.outputs.into_iter().map(tensor).collect(),
        }))
    }

    async fn model_infer(
        &self,
        request: tonic::Request<ModelInferRequest>,
    ) -> Result<tonic::Response<ModelInferResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        let headers = metadata.into_headers();
        let model = bounded(&message.model_name, LOG_FIELD_MAX_BYTES).to_string();
        let span = tracing::info_span!(
            "grpc ModelInfer",
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = SERVICE,
            rpc.method = "ModelInfer",
            vramgate.model = %model,
            rpc.grpc.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        Carried::from_headers(headers.iter().map(|(k, v)| (k.as_str(), v.as_bytes()))).adopt(&span);
        let result = infer(&self.state, &headers, message).instrument(span.clone()).await;
        let code = match &result {
            Ok(_) => Code::Ok,
            Err(e) => status_code(e),
        };
        span.record("rpc.grpc.status_code", code as i32);
        if let Err(e) = &result {
            if e.status.is_server_error() {
                span.record("otel.status_code", "ERROR");
                span.record("error.type", e.status.as_str());
            }
            // As the HTTP door's logging middleware writes a failed request: once, bounded.
            tracing::info!(%model, ?code, error = bounded(&e.message, LOG_FIELD_MAX_BYTES), "gRPC ModelInfer failed");
        }
        // The admission state and the model's estimate, as the HTTP door stamps its answers.
        let stamps = report::stamps(&self.state, Some(&model));
        let stamp = |metadata: &mut tonic::metadata::MetadataMap| {
            for (name, value) in &stamps {
                if let Ok(value) = MetadataValue::try_from(value.as_str()) {
                    metadata.insert(*name, value);
                }
            }
        };
        match result {
            Ok(answer) => {
                let mut response = tonic::Response::new(answer);
                stamp(response.metadata_mut());
                Ok(response)
            }
            Err(e) => {
                let mut status = status_of(e);
                stamp(status.metadata_mut());
                Err(status)
            }
        }
    }
}

/// One inference through the shared engine; every failure is the [`ApiError`] the HTTP door
/// would have answered.
async fn infer(state: &AppState, headers: &HeaderMap, message: ModelInferRequest) -> Result<ModelInferResponse, ApiError> {
    let (engine, served) = state.served_at(&message.model_name, Some(&message.model_version))?;
    let mut arrival = served.arrive();
    let model = served.model.clone();
    let limits = oip::DecodeLimits::default();
    let (body, header_len) = as_binary_request(&message, &limits).map_err(|m| ApiError::new(StatusCode::BAD_REQUEST, m))?;
    let id = message.id;
    drop(message.raw_input_contents);
    let (request, tensors) = oip::decode_request_in_place(&body, Some(header_len), &limits)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.to_string()))?;
    let inputs = take_inputs(&model, tensors, &body, None)?;
    drop(body);
    let input = model.accept(inputs)?;
    let mut timeout = request_timeout(headers, &request, engine.default_timeout)?;
    if let Some(deadline) = grpc_timeout(headers)? {
        timeout = timeout.min(deadline);
    }
    let outputs = engine.infer(&served, input, timeout, &mut arrival).await?;

    let asked: Vec<&str> = request.outputs.iter().flatten().map(|o| o.name.as_str()).collect();
    let mut response = ModelInferResponse {
        model_name: model.name().into(),
        model_version: served.version.to_string(),
        id,
        ..Default::default()
    };
    for output in outputs.into_iter().filter(|o| asked.is_empty() || asked.contains(&&*o.name)) {
        let mut raw = Vec::with_capacity(output.data.byte_len());
        output.data.write_le_bytes(&mut raw);
        response.outputs.push(InferOutputTensor {
            name: output.name.to_string(),
            datatype: output.data.datatype().as_str().into(),
            shape: output.shape.iter().map(|&d| d as i64).collect(),
            ..Default::default()
        });
        response.raw_output_contents.push(Bytes::from(raw));
    }
    Ok(response)
}

/// The HTTP binary-extension request that `message` stands for: its JSON header and the
/// inputs' bytes after it, and the header's length. Refuses what has no such request: raw
/// contents that are not one per input, an input with both raw and typed values or none,
/// typed values in the wrong list or out of their datatype's range.
fn as_binary_request(message: &ModelInferRequest, limits: &oip::DecodeLimits) -> Result<(Bytes, usize), String> {
    let raw = &message.raw_input_contents;
    if !raw.is_empty() && raw.len() != message.inputs.len() {
        return Err(format!(
            "raw_input_contents has {} entries for {} inputs: give one per input, in the order of inputs, or none",
            raw.len(),
            message.inputs.len()
        ));
    }
    let mut values: Vec<Bytes> = Vec::with_capacity(message.inputs.len());
    let mut total = 0usize;
    for (k, input) in message.inputs.iter().enumerate() {
        let name = bounded(&input.name, LOG_FIELD_MAX_BYTES);
        let bytes = match (raw.get(k), &input.contents) {
            (Some(_), Some(c)) if !is_empty(c) => {
                return Err(format!("input '{name}' has both raw_input_contents and contents: send its values once"))
            }
            (Some(bytes), _) => bytes.clone(),
            (None, Some(contents)) => Bytes::from(contents_le(input, contents, limits.max_decoded_bytes.saturating_sub(total))?),
            (None, None) => {
                return Err(format!("input '{name}' has no values: send them in raw_input_contents or in contents"))
            }
        };
        total = total.saturating_add(bytes.len());
        values.push(bytes);
    }
    let header = oip::InferRequest {
        id: (!message.id.is_empty()).then(|| message.id.clone()),
        parameters: parameters(&message.parameters),
        inputs: message
            .inputs
            .iter()
            .zip(&values)
            .map(|(input, bytes)| {
                let mut p = parameters(&input.parameters).unwrap_or_default();
                p.insert(oip::BINARY_DATA_SIZE.into(), bytes.len().into());
                oip::RequestInput {
                    name: input.name.clone(),
                    shape: input.shape.clone(),
                    datatype: input.datatype.clone(),
                    parameters: Some(p),
                    data: None,
                }
            })
            .collect(),
        outputs: (!message.outputs.is_empty()).then(|| {
            message
                .outputs
                .iter()
                .map(|o| oip::RequestOutput { name: o.name.clone(), parameters: parameters(&o.parameters) })
                .collect()
        }),
    };
    let mut body = serde_json::to_vec(&header).map_err(|e| format!("the request's parameters cannot be encoded: {e}"))?;
    let header_len = body.len();
    body.reserve(total);
    for bytes in values {
        body.extend_from_slice(&bytes);
    }
    Ok((Bytes::from(body), header_len))
}

fn is_empty(c: &InferTensorContents) -> bool {
    c.bool_contents.is_empty()
        && c.int_contents.is_empty()
        && c.int64_contents.is_empty()
        && c.uint_contents.is_empty()
        && c.uint64_contents.is_empty()
        && c.fp32_contents.is_empty()
        && c.fp64_contents.is_empty()
        && c.bytes_contents.is_empty()
}

/// The little-endian bytes of a typed `contents`, from the one list the protocol gives the
/// input's datatype; at most `room` bytes (what is left of the decode limit).
fn contents_le(input: &InferInputTensor, contents: &InferTensorContents, room: usize) -> Result<Vec<u8>, String> {
    let name = bounded(&input.name, LOG_FIELD_MAX_BYTES);
    let Ok(datatype) = input.datatype.parse::<DataType>() else {
        // Named as unknown by the decode, with the HTTP door's message.
        return Ok(Vec::new());
    };
    let c = contents;
    let lists: [(&str, usize); 8] = [
        ("bool_contents", c.bool_contents.len()),
        ("int_contents", c.int_contents.len()),
        ("int64_contents", c.int64_contents.len()),
        ("uint_contents", c.uint_contents.len()),
        ("uint64_contents", c.uint64_contents.len()),
        ("fp32_contents", c.fp32_contents.len()),
        ("fp64_contents", c.fp64_contents.len()),
        ("bytes_contents", c.bytes_contents.len()),
    ];
    let own = match datatype {
        DataType::Bool => "bool_contents",
        DataType::Int8 | DataType::Int16 | DataType::Int32 => "int_contents",
        DataType::Int64 => "int64_contents",
        DataType::Uint8 | DataType::Uint16 | DataType::Uint32 => "uint_contents",
        DataType::Uint64 => "uint64_contents",
        DataType::Fp32 => "fp32_contents",
        DataType::Fp64 => "fp64_contents",
        DataType::Bytes => "bytes_contents",
        other => return Err(format!("input '{name}' is {other}, which has no contents list: send it in raw_input_contents")),
    };
    if let Some((list, _)) = lists.iter().find(|(list, n)| *list != own && *n > 0) {
        return Err(format!("input '{name}' is {datatype} but has values in {list}: {datatype} values go in {own}"));
    }
    let count = lists.iter().find(|(list, _)| *list == own).map_or(0, |(_, n)| *n);
    let size = datatype.element_size().unwrap_or(1);
    if count.saturating_mul(size) > room {
        return Err(format!(
            "input '{name}' has {count} values of {size} bytes, over the {room} bytes of tensors a request may hold"
        ));
    }
    let mut out = Vec::with_capacity(count * size);
    let narrow = |k: usize, v: i128, lo: i128, hi: i128| -> Result<i128, String> {
        if (lo..=hi).contains(&v) {
            Ok(v)
        } else {
            Err(format!("input '{name}' value {k} ({v}) is out of the range of {datatype}"))
        }
    };
    match datatype {
        DataType::Bool => out.extend(c.bool_contents.iter().map(|&b| u8::from(b))),
        DataType::Int8 => {
            for (k, &v) in c.int_contents.iter().enumerate() {
                out.extend((narrow(k, v.into(), i8::MIN.into(), i8::MAX.into())? as i8).to_le_bytes());
            }
        }
        DataType::Int16 => {
            for (k, &v) in c.int_contents.iter().enumerate() {
                out.extend((narrow(k, v.into(), i16::MIN.into(), i16::MAX.into())? as i16).to_le_bytes());
            }
        }
        DataType::Int32 => c.int_contents.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DataType::Int64 => c.int64_contents.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DataType::Uint8 => {
            for (k, &v) in c.uint_contents.iter().enumerate() {
                out.push(narrow(k, v.into(), 0, u8::MAX.into())? as u8);
            }
        }
        DataType::Uint16 => {
            for (k, &v) in c.uint_contents.iter().enumerate() {
                out.extend((narrow(k, v.into(), 0, u16::MAX.into())? as u16).to_le_bytes());
            }
        }
        DataType::Uint32 => c.uint_contents.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DataType::Uint64 => c.uint64_contents.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DataType::Fp32 => c.fp32_contents.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DataType::Fp64 => c.fp64_contents.iter().for_each(|v| out.extend(v.to_le_bytes())),
        // No model of the worker takes BYTES: the decode refuses it by name.
        _ => {}
    }
    Ok(out)
}

/// The protocol's parameters as the JSON the HTTP door takes; `None` when there are none.
fn parameters(map: &std::collections::HashMap<String, InferParameter>) -> Option<Parameters> {
    if map.is_empty() {
        return None;
    }
    let value = |p: &InferParameter| match &p.parameter_choice {
        Some(ParameterChoice::BoolParam(b)) => serde_json::Value::from(*b),
        Some(ParameterChoice::Int64Param(n)) => serde_json::Value::from(*n),
        Some(ParameterChoice::StringParam(s)) => serde_json::Value::from(s.clone()),
        Some(ParameterChoice::DoubleParam(x)) => serde_json::Value::from(*x),
        Some(ParameterChoice::Uint64Param(n)) => serde_json::Value::from(*n),
        None => serde_json::Value::Null,
    };
    Some(map.iter().map(|(k, v)| (k.clone(), value(v))).collect())
}

/// The call's gRPC deadline (`grpc-timeout`: up to 8 digits and a unit, H M S m u n), if the
/// client set one.
fn grpc_timeout(headers: &HeaderMap) -> Result<Option<Duration>, ApiError> {
    let Some(value) = headers.get("grpc-timeout") else { return Ok(None) };
    let refused = || ApiError::new(StatusCode::BAD_REQUEST, "grpc-timeout must be up to 8 digits and a unit (H, M, S, m, u, n)");
    let text = value.to_str().map_err(|_| refused())?;
    let (digits, unit) = text.split_at(text.len().saturating_sub(1));
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(refused());
    }
    let n: u64 = digits.parse().map_err(|_| refused())?;
    let timeout = match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return Err(refused()),
    };
    Ok(Some(timeout))
}

/// The gRPC code of an error the HTTP door answers with `e.status`: bad input
/// `INVALID_ARGUMENT`; unknown model `NOT_FOUND`; no token `UNAUTHENTICATED`; refused for
/// memory or busy (413, 503 with a retry hint, 507) `RESOURCE_EXHAUSTED`; still loading
/// `UNAVAILABLE`; a deadline passed `DEADLINE_EXCEEDED`; the rest `INTERNAL`.
fn status_code(e: &ApiError) -> Code {
    match e.status.as_u16() {
        400 | 422 => Code::InvalidArgument,
        401 => Code::Unauthenticated,
        404 => Code::NotFound,
        408 | 504 => Code::DeadlineExceeded,
        413 | 507 => Code::ResourceExhausted,
        503 if e.retry_after_seconds.is_some() => Code::ResourceExhausted,
        503 => Code::Unavailable,
        _ => Code::Internal,
    }
}

impl Door {
    /// The repository, for a call that would load or unload in `repository_name`: refused
    /// unless it is this worker's (empty) and `model_control` lets the API change models.
    fn changing(&self, repository_name: &str) -> Result<Arc<super::repository::Repository>, Status> {
        one_repository(repository_name)?;
        let repository = super::repository::repository(&self.state).map_err(status_of)?;
        repository.api_allowed().map_err(status_of)?;
        Ok(repository)
    }
}

/// The worker has one repository: a call naming another is refused.
fn one_repository(name: &str) -> Result<(), Status> {
    if name.is_empty() {
        return Ok(());
    }
    Err(Status::invalid_argument(format!(
        "repository '{}' is not this worker's: leave repository_name empty",
        bounded(name, LOG_FIELD_MAX_BYTES)
    )))
}

/// `e` as a gRPC status: its code ([`status_code`]), the HTTP door's message, and in the
/// metadata the retry hint (`retry-after`, seconds) and the error kind
/// (`x-vramgate-error-kind`) where HTTP sends them as headers.
fn status_of(e: ApiError) -> Status {
    let mut status = Status::new(status_code(&e), e.message.clone());
    if let Some(seconds) = e.retry_after_seconds {
        status.metadata_mut().insert(RETRY_AFTER_KEY, MetadataValue::from(seconds));
    }
    for (name, value) in &e.headers {
        if name.as_str().starts_with("x-vramgate-") {
            let key = tonic::metadata::MetadataKey::from_bytes(name.as_str().as_bytes());
            if let (Ok(key), Ok(value)) = (key, MetadataValue::try_from(value.as_bytes())) {
                status.metadata_mut().insert(key, value);
            }
        }
    }
    status
}

/// Checks the bearer token of the guarded calls, then reads the message under the HTTP
/// door's body limits before tonic sees it (the module doc).
#[derive(Clone)]
struct BodyGate<S> {
    inner: S,
    state: Arc<AppState>,
}

impl<S> tower::Service<axum::http::Request<GrpcBody>> for BodyGate<S>
where
    S: tower::Service<axum::http::Request<GrpcBody>, Response = axum::http::Response<GrpcBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: axum::http::Request<GrpcBody>) -> Self::Future {
        // The clone that was polled ready serves this call; the fresh one waits for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let state = self.state.clone();
        // Counted from its headers to its answer: the connection is not idle meanwhile.
        let running = request.extensions().get::<Calls>().map(Calls::begin);
        Box::pin(async move {
            let _running = running;
            let method = request.uri().path().rsplit('/').next().unwrap_or_default();
            if GUARDED.contains(&method) {
                if let Some(token) = &state.auth_token {
                    if let Some(message) = bearer_refusal(token, request.headers().get(header::AUTHORIZATION)) {
                        return Ok(Status::unauthenticated(message).into_http());
                    }
                }
            }
            let (parts, body) = request.into_parts();
            let (bytes, charge) = match limits::read_body(&state.body_limits, &parts.headers, axum::body::Body::new(body)).await {
                Ok(read) => read,
                Err(e) => return Ok(status_of(ApiError::from(e)).into_http()),
            };
            let request = axum::http::Request::from_parts(parts, GrpcBody::new(http_body_util::Full::new(bytes)));
            let response = inner.call(request).await;
            drop(charge);
            response
        })
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn input(name: &str, datatype: &str, shape: &[i64], contents: Option<InferTensorContents>) -> InferInputTensor {
        InferInputTensor { name: name.into(), datatype: datatype.into(), shape: shape.to_vec(), contents, ..Default::default() }
    }

    fn decoded(message: &ModelInferRequest) -> Result<(oip::InferRequest, Vec<oip::RawTensor>, Bytes), String> {
        let limits = oip::DecodeLimits::default();
        let (body, header_len) = as_binary_request(message, &limits)?;
        let (request, tensors) = oip::decode_request_in_place(&body, Some(header_len), &limits).map_err(|e| e.to_string())?;
        Ok((request, tensors, body))
    }

    #[test]
    fn raw_and_typed_contents_decode_to_the_same_little_endian_bytes() {
        let values = [1.5f32, -2.0, 0.25, 7.0];
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let by_raw = ModelInferRequest {
            model_name: "m".into(),
            inputs: vec![input("x", "FP32", &[1, 4], None)],
            raw_input_contents: vec![Bytes::from(raw.clone())],
            ..Default::default()
        };
        let typed = InferTensorContents { fp32_contents: values.to_vec(), ..Default::default() };
        let by_contents =
            ModelInferRequest { model_name: "m".into(), inputs: vec![input("x", "FP32", &[1, 4], Some(typed))], ..Default::default() };
        for message in [by_raw, by_contents] {
            let (_, tensors, body) = decoded(&message).expect("decodes");
            let [tensor] = &tensors[..] else { panic!("one tensor") };
            assert_eq!((tensor.shape.as_slice(), tensor.datatype), (&[1usize, 4][..], DataType::Fp32));
            let RawData::Binary(range) = &tensor.data else { panic!("binary") };
            assert_eq!(&body[range.clone()], &raw[..]);
        }
    }

    #[test]
    fn integers_are_narrowed_only_when_they_fit() {
        let message = |datatype: &str, ints: Vec<i32>| ModelInferRequest {
            inputs: vec![input("x", datatype, &[ints.len() as i64], Some(InferTensorContents { int_contents: ints, ..Default::default() }))],
            ..Default::default()
        };
        let (_, tensors, body) = decoded(&message("INT8", vec![-128, 127, 5])).expect("in range");
        let RawData::Binary(range) = &tensors[0].data else { panic!("binary") };
        assert_eq!(&body[range.clone()], &[0x80, 0x7f, 5]);
        let err = decoded(&message("INT8", vec![1, 128])).expect_err("out of range");
        assert!(err.contains("value 1 (128) is out of the range of INT8"), "{err}");
        let err = decoded(&message("INT16", vec![-40000])).expect_err("out of range");
        assert!(err.contains("INT16"), "{err}");
    }

    #[test]
    fn values_in_the_wrong_list_or_twice_or_nowhere_are_named() {
        let wrong = ModelInferRequest {
            inputs: vec![input("x", "FP32", &[2], Some(InferTensorContents { int_contents: vec![1, 2], ..Default::default() }))],
            ..Default::default()
        };
        let err = decoded(&wrong).expect_err("wrong list");
        assert!(err.contains("'x' is FP32 but has values in int_contents"), "{err}");
        let twice = ModelInferRequest {
            inputs: vec![input("x", "FP32", &[1], Some(InferTensorContents { fp32_contents: vec![1.0], ..Default::default() }))],
            raw_input_contents: vec![Bytes::from_static(&[0, 0, 128, 63])],
            ..Default::default()
        };
        assert!(decoded(&twice).expect_err("twice").contains("both raw_input_contents and contents"));
        let nowhere = ModelInferRequest { inputs: vec![input("x", "FP32", &[1], None)], ..Default::default() };
        assert!(decoded(&nowhere).expect_err("none").contains("has no values"));
        let fp16 = ModelInferRequest {
            inputs: vec![input("x", "FP16", &[1], Some(InferTensorContents { fp32_contents: vec![1.0], ..Default::default() }))],
            ..Default::default()
        };
        assert!(decoded(&fp16).expect_err("fp16").contains("send it in raw_input_contents"));
    }

    #[test]
    fn raw_contents_must_be_one_per_input_and_fill_the_shape() {
        let short = ModelInferRequest {
            inputs: vec![input("a", "FP32", &[1], None), input("b", "FP32", &[1], None)],
            raw_input_contents: vec![Bytes::from_static(&[0; 4])],
            ..Default::default()
        };
        assert!(decoded(&short).expect_err("one for two").contains("raw_input_contents has 1 entries for 2 inputs"));
        let mismatch = ModelInferRequest {
            inputs: vec![input("a", "FP32", &[1, 3], None)],
            raw_input_contents: vec![Bytes::from_static(&[0; 8])],
            ..Default::default()
        };
        let err = decoded(&mismatch).expect_err("8 bytes for 3 floats");
        assert!(err.contains('a') && err.contains("12"), "names the input and the bytes its shape needs: {err}");
        let unknown = ModelInferRequest {
            inputs: vec![input("a", "FP33", &[1], None)],
            raw_input_contents: vec![Bytes::from_static(&[0; 4])],
            ..Default::default()
        };
        assert!(decoded(&unknown).expect_err("unknown").contains("FP33"));
    }

    #[test]
    fn typed_contents_are_bounded_before_they_are_converted() {
        let limits = oip::DecodeLimits { max_decoded_bytes: 16 };
        let big = ModelInferRequest {
            inputs: vec![input("x", "INT64", &[3], Some(InferTensorContents { int64_contents: vec![1, 2, 3], ..Default::default() }))],
            ..Default::default()
        };
        let err = as_binary_request(&big, &limits).expect_err("24 bytes over 16");
        assert!(err.contains("over the 16 bytes"), "{err}");
    }

    #[test]
    fn parameters_and_requested_outputs_carry_over() {
        let mut params = std::collections::HashMap::new();
        params.insert("timeout".to_string(), InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(2500)) });
        let message = ModelInferRequest {
            id: "r1".into(),
            parameters: params,
            inputs: vec![input("x", "FP32", &[1], Some(InferTensorContents { fp32_contents: vec![1.0], ..Default::default() }))],
            outputs: vec![proto::model_infer_request::InferRequestedOutputTensor { name: "y".into(), ..Default::default() }],
            ..Default::default()
        };
        let (request, _, _) = decoded(&message).expect("decodes");
        assert_eq!(request.id.as_deref(), Some("r1"));
        assert_eq!(request.parameters.as_ref().and_then(|p| p.get("timeout")).and_then(|v| v.as_u64()), Some(2500));
        assert_eq!(request.outputs.as_ref().map(|o| o[0].name.as_str()), Some("y"));
    }

    #[test]
    fn grpc_deadlines_parse_by_unit_and_refuse_the_rest() {
        let at = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert("grpc-timeout", HeaderValue::from_str(v).expect("ascii"));
            grpc_timeout(&h)
        };
        assert_eq!(at("250m").expect("ms"), Some(Duration::from_millis(250)));
        assert_eq!(at("2S").expect("s"), Some(Duration::from_secs(2)));
        assert_eq!(at("1H").expect("h"), Some(Duration::from_secs(3600)));
        assert_eq!(at("99999999n").expect("ns"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "m", "123456789m", "12x", "-1S", "1.5S"] {
            assert!(at(bad).is_err(), "{bad:?}");
        }
        assert_eq!(grpc_timeout(&HeaderMap::new()).expect("none"), None);
    }

    #[test]
    fn errors_keep_their_message_and_become_the_protocol_s_codes() {
        let cases = [
            (StatusCode::BAD_REQUEST, None, Code::InvalidArgument),
            (StatusCode::UNAUTHORIZED, None, Code::Unauthenticated),
            (StatusCode::NOT_FOUND, None, Code::NotFound),
            (StatusCode::PAYLOAD_TOO_LARGE, None, Code::ResourceExhausted),
            (StatusCode::SERVICE_UNAVAILABLE, Some(3), Code::ResourceExhausted),
            (StatusCode::SERVICE_UNAVAILABLE, None, Code::Unavailable),
            (StatusCode::GATEWAY_TIMEOUT, None, Code::DeadlineExceeded),
            (StatusCode::INSUFFICIENT_STORAGE, None, Code::ResourceExhausted),
            (StatusCode::INTERNAL_SERVER_ERROR, None, Code::Internal),
        ];
        for (http, retry, code) in cases {
            let e = ApiError { retry_after_seconds: retry, ..ApiError::new(http, format!("because {http}")) };
            let status = status_of(e);
            assert_eq!(status.code(), code, "{http}");
            assert_eq!(status.message(), format!("because {http}"));
            assert_eq!(status.metadata().get(RETRY_AFTER_KEY).map(|v| v.to_str().expect("ascii").to_string()), retry.map(|s| s.to_string()));
        }
        let marked = ApiError::new(StatusCode::BAD_REQUEST, "the model refused it")
            .with_header(HeaderName::from_static("x-vramgate-error-kind"), HeaderValue::from_static("model_error"));
        assert_eq!(status_of(marked).metadata().get("x-vramgate-error-kind").map(|v| v.to_str().expect("ascii")), Some("model_error"));
    }
}
