//! The request-path bench's bare server (`tests/benches/request_path.rs`): an axum server that
//! does on each request only what HTTP requires of any server in the worker's place, so that
//! the worker's own cost per request shows against it. It reads the whole body of every
//! `POST /v2/models/{name}/infer` (up to 256 MiB, the worker's default limit) and answers the
//! bytes of one answer the real worker gave, with the same headers. Nothing is decoded, run or
//! encoded.
//!
//! `bare-oip-server ANSWER_FILE HEADER_LEN` listens on 127.0.0.1 at a free port and prints
//! `listening on ADDR` as its first line, as the worker does.

use std::sync::Arc;

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;

/// The answer given to every request: its bytes and the OIP binary header's length.
struct Answer {
    body: Bytes,
    header_len: HeaderValue,
}

const MAX_BODY_BYTES: usize = 256 * 1024 * 1024;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(file), Some(header_len)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: bare-oip-server ANSWER_FILE HEADER_LEN");
    };
    let body = Bytes::from(std::fs::read(&file).with_context(|| format!("reading {file}"))?);
    let header_len = HeaderValue::from_str(header_len.trim()).context("HEADER_LEN")?;
    let answer = Arc::new(Answer { body, header_len });
    // Like the worker: a multi-threaded runtime with a thread per core.
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async move {
        let app = Router::new()
            .route("/v2/models/{name}/infer", post(infer))
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(answer);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("listening on {}", listener.local_addr()?);
        axum::serve(listener, app).await?;
        anyhow::Ok(())
    })
}

/// Takes the whole body (the extractor reads it), then answers the stored bytes.
async fn infer(State(answer): State<Arc<Answer>>, body: Bytes) -> Response {
    drop(body);
    let mut response = answer.body.clone().into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    headers.insert("inference-header-content-length", answer.header_len.clone());
    response
}
