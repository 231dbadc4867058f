//! Hostile HTTP clients against the real worker process (issue 13, the worker's side): raw TCP
//! clients that never finish their headers or bodies, or lie about their length; bodies over
//! the limit or past the budget of bodies being read at once; a burst of large bodies under a
//! hard memory cap; NaN and infinity in a tensor; requests without the bearer token; config
//! errors about a secret. Each answer is a JSON error that names the limit and its config key,
//! and the worker keeps serving.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::future::join_all;
use vramgate_shared::oip::{self, RequestOutputSpec, Tensor};
use vramgate_tests::oip_client::{infer, test_audio};
use vramgate_tests::{binary, repo_root, start_worker, unique, worker_config, Worker, VAD_KEYS, VAD_MODEL};

const INFER: &str = "/v2/models/silero_vad/infer";

/// How long a raw client waits for an answer or for the worker to close the connection:
/// generous, since only whether it happens is asserted, never how fast.
const PATIENCE: Duration = Duration::from_secs(20);

/// A raw HTTP/1.1 client on a plain socket, to send what no well-behaved client would.
struct Raw {
    stream: TcpStream,
    buf: Vec<u8>,
}

/// One response as read off the socket.
#[derive(Debug)]
struct RawResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl RawResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The `error` of a JSON error body; panics when the body is not one.
    fn error(&self) -> String {
        let body: serde_json::Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("status {}: body is not JSON ({e}): {:?}", self.status, String::from_utf8_lossy(&self.body)));
        body["error"].as_str().unwrap_or_else(|| panic!("no \"error\" in {body}")).to_string()
    }
}

impl Raw {
    fn connect(addr: &str) -> Raw {
        let stream = TcpStream::connect(addr).expect("connect to the worker");
        stream.set_read_timeout(Some(PATIENCE)).expect("read timeout");
        Raw { stream, buf: Vec::new() }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("send to the worker");
    }

    /// Reads more bytes into the buffer; panics at end of stream or after [`PATIENCE`].
    fn fill(&mut self) {
        let mut chunk = [0u8; 64 * 1024];
        match self.stream.read(&mut chunk) {
            Ok(0) => panic!("the worker closed the connection; read so far: {:?}", String::from_utf8_lossy(&self.buf)),
            Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            Err(e) => panic!("no answer from the worker within {PATIENCE:?}: {e}"),
        }
    }

    /// The next response (a `100 Continue` counts as one).
    fn response(&mut self) -> RawResponse {
        let head_end = loop {
            if let Some(at) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            self.fill();
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).to_string();
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("status line {status_line:?}"));
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
            .collect();
        self.buf.drain(..head_end);
        let length: usize = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .map_or(0, |(_, v)| v.parse().expect("a content length"));
        while self.buf.len() < length {
            self.fill();
        }
        let body = self.buf.drain(..length).collect();
        RawResponse { status, headers, body }
    }

    /// Whether the worker closes the connection (end of stream or reset) within `patience`;
    /// anything it sends meanwhile is dropped.
    fn closed_within(&mut self, patience: Duration) -> bool {
        let deadline = Instant::now() + patience;
        let mut chunk = [0u8; 64 * 1024];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            self.stream.set_read_timeout(Some(left)).expect("read timeout");
            match self.stream.read(&mut chunk) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted) => return true,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => continue,
                Err(e) => panic!("reading from the worker: {e}"),
            }
        }
    }
}

/// A binary OIP request for Silero VAD: `samples` of audio (4 bytes each), and the value of
/// its `Inference-Header-Content-Length`.
fn audio_request(samples: usize) -> (Vec<u8>, usize) {
    let tensor = Tensor::new("audio", vec![1, samples], test_audio(samples, 1));
    let (body, header_len) = oip::encode_request(None, &[tensor], true, &[] as &[RequestOutputSpec]);
    (body, header_len.expect("binary inputs have a JSON header length"))
}

/// The head of `POST path` declaring `length` bytes of body, with `extra` header lines.
fn post_head(path: &str, length: usize, header_len: Option<usize>, extra: &str) -> Vec<u8> {
    let inference = header_len.map(|n| format!("Inference-Header-Content-Length: {n}\r\n")).unwrap_or_default();
    format!(
        "POST {path} HTTP/1.1\r\nHost: worker\r\nContent-Type: application/octet-stream\r\n\
         Content-Length: {length}\r\n{inference}{extra}\r\n"
    )
    .into_bytes()
}

/// A whole binary request for `samples` of audio: head and body.
fn whole_request(samples: usize, extra: &str) -> Vec<u8> {
    let (body, header_len) = audio_request(samples);
    let mut request = post_head(INFER, body.len(), Some(header_len), extra);
    request.extend_from_slice(&body);
    request
}

async fn still_serves(worker: &Worker) {
    let http = reqwest::Client::new();
    let answer = infer(&http, &worker.url, "silero_vad", "audio", vec![1, 4096], test_audio(4096, 2), None)
        .await
        .expect("request sent");
    assert_eq!(answer.status, 200, "{:?}\nworker log:\n{}", answer.error, worker.service.log_tail());
}

/// Defect 3: header, body and idle timeouts, with raw clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_silent_and_lying_clients_are_cut_off_and_the_worker_keeps_serving() {
    let extra = "header_read_timeout_ms = 1000\nbody_read_timeout_ms = 1500\nidle_timeout_ms = 2000\n";
    let worker = start_worker(&worker_config(extra, &[VAD_MODEL])).await.expect("worker starts");
    let addr = worker.addr().to_string();
    tokio::task::spawn_blocking(move || {
        // Headers that never end, trickled a byte every 100 ms: closed after
        // header_read_timeout_ms although bytes keep coming.
        let mut slow = Raw::connect(&addr);
        let mut writer = slow.stream.try_clone().expect("clone the socket");
        let mut trickle = format!("POST {INFER} HTTP/1.1\r\nHost: worker\r\nX-Slow: ").into_bytes();
        trickle.resize(trickle.len() + 400, b'a');
        let trickler = std::thread::spawn(move || {
            for byte in trickle {
                if writer.write_all(&[byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        assert!(slow.closed_within(PATIENCE), "a connection still trickling its headers was left open");
        trickler.join().expect("trickler");

        // A connection that sends nothing at all.
        let mut silent = Raw::connect(&addr);
        assert!(silent.closed_within(PATIENCE), "a silent connection was left open");

        // A body that never arrives (12 of 1000 bytes): 408 naming the key, then closed.
        let mut liar = Raw::connect(&addr);
        liar.send(&post_head(INFER, 1000, None, ""));
        liar.send(b"{\"inputs\": [");
        let answer = liar.response();
        assert_eq!(answer.status, 408, "{answer:?}");
        assert!(answer.error().contains("body_read_timeout_ms") && answer.error().contains("12 of 1000"), "{}", answer.error());
        assert!(liar.closed_within(PATIENCE), "the connection of a timed-out body was left open");

        // The case: Content-Length 2 000 000 000 and a few bytes sent. Refused at once,
        // by its length, with the limit and its key; then closed.
        let mut liar = Raw::connect(&addr);
        liar.send(&post_head(INFER, 2_000_000_000, None, ""));
        liar.send(b"{\"inputs\": [");
        let answer = liar.response();
        assert_eq!(answer.status, 413, "{answer:?}");
        let error = answer.error();
        assert!(error.contains("2000000000") && error.contains("268435456") && error.contains("max_request_bytes"), "{error}");
        assert!(liar.closed_within(PATIENCE));

        // Keep-alive works (two requests on one connection), and an idle connection is
        // closed after idle_timeout_ms.
        let mut idle = Raw::connect(&addr);
        idle.send(b"GET /v2/health/live HTTP/1.1\r\nHost: worker\r\n\r\n");
        assert_eq!(idle.response().status, 200);
        idle.send(b"GET /v2/health/ready HTTP/1.1\r\nHost: worker\r\n\r\n");
        assert_eq!(idle.response().status, 200);
        assert!(idle.closed_within(PATIENCE), "an idle keep-alive connection was left open");

        // A request sent whole, at once, is not cut by any of the timeouts.
        let mut fine = Raw::connect(&addr);
        fine.send(&whole_request(16_000, ""));
        let answer = fine.response();
        assert_eq!(answer.status, 200, "{answer:?}");
    })
    .await
    .expect("raw clients");
    still_serves(&worker).await;
}

/// Defects 2 and 10: a body over the limit is refused before it is read, with a JSON error
/// naming the limit; bodies read at once are bounded by a budget, past which 503 +
/// `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_are_bounded_before_they_are_read() {
    // 12 MiB per body, 12 MiB of bodies at once; each large request below is 8 MB.
    let extra = "max_request_bytes = 12582912\nmax_body_bytes_in_flight = 12582912\n";
    let worker = start_worker(&worker_config(extra, &[VAD_MODEL])).await.expect("worker starts");
    let addr = worker.addr().to_string();
    tokio::task::spawn_blocking(move || {
        // Over max_request_bytes by Content-Length: 413 before one byte of the body is sent.
        let mut big = Raw::connect(&addr);
        big.send(&post_head(INFER, 12_582_913, Some(100), ""));
        let answer = big.response();
        assert_eq!(answer.status, 413, "{answer:?}");
        assert_eq!(answer.header("content-type"), Some("application/json"));
        assert_eq!(answer.header("connection"), Some("close"));
        let error = answer.error();
        assert!(error.contains("12582913") && error.contains("12582912") && error.contains("max_request_bytes"), "{error}");

        // A chunked body passing the limit: 413 while it streams.
        let mut chunked = Raw::connect(&addr);
        chunked.send(format!("POST {INFER} HTTP/1.1\r\nHost: worker\r\nTransfer-Encoding: chunked\r\n\r\n").as_bytes());
        for size in std::iter::repeat_n(1 << 20, 12).chain([1]) {
            let mut chunk = format!("{size:x}\r\n").into_bytes();
            chunk.resize(chunk.len() + size, b'0');
            chunk.extend_from_slice(b"\r\n");
            chunked.send(&chunk);
        }
        let answer = chunked.response();
        assert_eq!(answer.status, 413, "{answer:?}");
        assert!(answer.error().contains("max_request_bytes") && answer.error().contains("12582912"), "{}", answer.error());

        // A declares 8 MB and waits for `100 Continue`, which the worker sends only once the
        // body is charged; it then holds its charge while it has not sent its body.
        let (body, header_len) = audio_request(2_000_000);
        let mut a = Raw::connect(&addr);
        a.send(&post_head(INFER, body.len(), Some(header_len), "Expect: 100-continue\r\n"));
        assert_eq!(a.response().status, 100);

        // B: 8 MB more do not fit in 12 MiB: 503 + Retry-After at once, body unread.
        let mut b = Raw::connect(&addr);
        b.send(&post_head(INFER, body.len(), Some(header_len), "Expect: 100-continue\r\n"));
        let answer = b.response();
        assert_eq!(answer.status, 503, "{answer:?}");
        let retry: u64 = answer.header("retry-after").and_then(|v| v.parse().ok()).expect("a Retry-After in seconds");
        assert!((1..=60).contains(&retry));
        let error = answer.error();
        assert!(error.contains("max_body_bytes_in_flight") && error.contains("12582912"), "{error}");

        // A small request still fits beside A.
        let mut small = Raw::connect(&addr);
        small.send(&whole_request(16_000, ""));
        assert_eq!(small.response().status, 200);

        // A sends its body and is answered; its charge comes back, so B's retry fits.
        a.send(&body);
        let answer = a.response();
        assert_eq!(answer.status, 200, "{answer:?}");
        let mut b = Raw::connect(&addr);
        b.send(&post_head(INFER, body.len(), Some(header_len), ""));
        b.send(&body);
        let answer = b.response();
        assert_eq!(answer.status, 200, "{answer:?}");
    })
    .await
    .expect("raw clients");
    still_serves(&worker).await;
}

/// Defect 2, the crash: a burst of concurrent large bodies under a hard memory cap
/// used to abort the worker (`memory allocation failed`). Each body here fails validation
/// once decoded (too many elements: 413), so all memory in play is bodies and decoding.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_large_bodies_under_a_memory_cap_does_not_abort_the_worker() {
    // 40 MB bodies, one read at a time (48 MiB), under a cap that leaves about 165 MB of
    // address space: 12 bodies read and decoded at once would need about 1 GB.
    let extra = "memory_limit_bytes = 100000000\nmemory_host_allowance_bytes = 67108864\n\
                 max_request_bytes = 50331648\nmax_body_bytes_in_flight = 50331648\n";
    let vad = ("silero_vad", "silero_vad.jit", VAD_KEYS, "max_input_elements = 1000000");
    let worker = start_worker(&worker_config(extra, &[vad])).await.expect("worker starts");
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().expect("http client");
    let (body, header_len) = audio_request(10_000_000);
    let url = format!("{}{INFER}", worker.url);
    let calls = (0..12).map(|_| {
        let request = http
            .post(&url)
            .header(oip::INFERENCE_HEADER_CONTENT_LENGTH, header_len.to_string())
            .body(body.clone());
        async move {
            let response = request.send().await?;
            let status = response.status().as_u16();
            let retry_after = response.headers().contains_key("retry-after");
            let text = response.text().await?;
            anyhow::Ok((status, retry_after, text))
        }
    });
    let answers = join_all(calls).await;
    let mut refused_busy = 0;
    for answer in answers {
        let (status, retry_after, text) =
            answer.unwrap_or_else(|e| panic!("a request failed ({e:#}); worker log:\n{}", worker.service.log_tail()));
        let error: serde_json::Value = serde_json::from_str(&text).expect("a JSON error");
        match status {
            // Over the model's `max_input_elements`: refused by size, naming both numbers.
            413 => assert!(text.contains("10000000 elements") && text.contains("limit of 1000000"), "{error}"),
            503 => {
                assert!(retry_after && text.contains("max_body_bytes_in_flight"), "{error}");
                refused_busy += 1;
            }
            other => panic!("status {other}: {error}"),
        }
    }
    eprintln!("12 bodies of {} bytes: {refused_busy} refused with 503 (budget spent), the rest read", body.len());
    let mut worker = worker;
    assert!(worker.service.is_running(), "the worker died; log:\n{}", worker.service.log_tail());
    still_serves(&worker).await;
}

/// Defect 9: NaN and infinity (binary tensors can carry them) are refused with 400 naming
/// the tensor and where.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nan_and_infinity_are_refused_naming_the_tensor() {
    let worker = start_worker(&worker_config("", &[VAD_MODEL])).await.expect("worker starts");
    let http = reqwest::Client::new();
    for (at, bad, shown) in [(5, f32::NAN, "NaN"), (4000, f32::INFINITY, "inf"), (4095, f32::NEG_INFINITY, "-inf")] {
        let mut audio = test_audio(4096, 3);
        audio[at] = bad;
        let answer = infer(&http, &worker.url, "silero_vad", "audio", vec![1, 4096], audio, None).await.expect("sent");
        assert_eq!(answer.status, 400, "{bad} at {at}: {:?}", answer.error);
        let error = answer.error.unwrap_or_default();
        assert!(error.contains("'audio'") && error.contains(&format!("element {at}")) && error.contains(shown), "{error}");
    }
    still_serves(&worker).await;
}

/// Defects 8 and 10: with `auth_token`, inference and model metadata need the bearer token
/// (checked before the body is read); health, readiness and metrics stay open; the token is
/// never logged; every error, axum's own included, is a JSON body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inference_needs_the_bearer_token_and_health_stays_open() {
    const TOKEN: &str = "vg-test-token-6f1d2c";
    let worker = start_worker(&worker_config(&format!("auth_token = \"{TOKEN}\"\n"), &[VAD_MODEL]))
        .await
        .expect("worker starts");
    let http = reqwest::Client::new();
    let url = &worker.url;
    let (body, header_len) = audio_request(4096);
    let call = |auth: Option<String>| {
        let mut request = http
            .post(format!("{url}{INFER}"))
            .header(oip::INFERENCE_HEADER_CONTENT_LENGTH, header_len.to_string())
            .body(body.clone());
        if let Some(auth) = auth {
            request = request.header("authorization", auth);
        }
        request.send()
    };
    for (auth, needle) in [
        (None, "bearer token"),
        (Some(format!("Bearer {TOKEN}x")), "does not match"),
        (Some("Bearer ".to_string()), "does not match"),
        (Some(format!("Basic {TOKEN}")), "Bearer scheme"),
    ] {
        let response = call(auth.clone()).await.expect("sent");
        assert_eq!(response.status().as_u16(), 401, "{auth:?}");
        assert!(response.headers().get("www-authenticate").is_some_and(|v| v.as_bytes().starts_with(b"Bearer")));
        let error: serde_json::Value = response.json().await.expect("a JSON error");
        let message = error["error"].as_str().expect("a message");
        assert!(message.contains(needle) && !message.contains(TOKEN), "{auth:?}: {message}");
    }
    for auth in [format!("Bearer {TOKEN}"), format!("bearer {TOKEN}")] {
        let response = call(Some(auth)).await.expect("sent");
        assert_eq!(response.status().as_u16(), 200);
    }
    let metadata = format!("{url}/v2/models/silero_vad");
    assert_eq!(http.get(&metadata).send().await.expect("sent").status().as_u16(), 401);
    let with_token = http.get(&metadata).bearer_auth(TOKEN).send().await.expect("sent");
    assert_eq!(with_token.status().as_u16(), 200);
    for open in ["/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/silero_vad/ready", "/metrics"] {
        assert_eq!(http.get(format!("{url}{open}")).send().await.expect("sent").status().as_u16(), 200, "{open}");
    }

    // Checked before the body is read: a large declared body with no token gets 401 at once.
    let addr = worker.addr().to_string();
    tokio::task::spawn_blocking(move || {
        let mut raw = Raw::connect(&addr);
        raw.send(&post_head(INFER, 10_000_000, None, ""));
        let answer = raw.response();
        assert_eq!(answer.status, 401, "{answer:?}");

        // axum's own rejections are JSON too, saying what was asked.
        let mut raw = Raw::connect(&addr);
        raw.send(b"GET /v2/nothing/here HTTP/1.1\r\nHost: worker\r\n\r\n");
        let answer = raw.response();
        assert_eq!(answer.status, 404);
        assert!(answer.error().contains("/v2/nothing/here"), "{}", answer.error());
        raw.send(b"DELETE /v2/health/live HTTP/1.1\r\nHost: worker\r\n\r\n");
        let answer = raw.response();
        assert_eq!(answer.status, 405);
        assert!(answer.error().contains("not allowed") && answer.header("allow").is_some(), "{answer:?}");
    })
    .await
    .expect("raw clients");
    assert!(!worker.service.log_tail().contains(TOKEN), "the token is in the worker's log");
}

/// Defect 8: a config error about a secret names the key but never its value, whatever its
/// type; a token given through the environment is taken verbatim (`0123` stays `0123`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_never_echoed_and_the_env_token_is_taken_verbatim() {
    let config_path = std::env::temp_dir().join(format!("{}.toml", unique("worker-secret")));
    for (value, secret) in [("918273.645", "918273"), ("[\"918273645\"]", "918273645"), ("\"with space 918273\"", "918273")] {
        std::fs::write(&config_path, worker_config(&format!("auth_token = {value}\n"), &[VAD_MODEL])).expect("config");
        let out = Command::new(binary("ai-worker"))
            .arg("--config")
            .arg(&config_path)
            .current_dir(repo_root())
            .output()
            .expect("runs the worker");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{value}: started");
        assert!(stderr.contains("auth_token") && !stderr.contains(secret), "{value}: {stderr}");
    }

    std::fs::write(&config_path, worker_config("", &[VAD_MODEL])).expect("config");
    let mut child = Command::new(binary("ai-worker"))
        .arg("--config")
        .arg(&config_path)
        .env("VRAMGATE_WORKER_AUTH_TOKEN", "0123")
        .current_dir(repo_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starts the worker");
    // The first line says where it listens; the rest is drained so the worker never meets a
    // closed pipe.
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = std::io::BufReader::new(stdout);
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(&mut reader, &mut line);
        let _ = tx.send(line);
        let _ = std::io::copy(&mut reader, &mut std::io::sink());
    });
    let line = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(120)))
        .await
        .expect("reader")
        .expect("the worker's first line");
    let addr = line.trim().trim_start_matches("listening on ").split_whitespace().next().unwrap_or_default().to_string();
    let url = format!("http://{addr}");
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !http.get(format!("{url}/v2/health/ready")).send().await.is_ok_and(|r| r.status().is_success()) {
        assert!(Instant::now() < deadline, "worker not ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metadata = format!("{url}/v2/models/silero_vad");
    let statuses = [
        http.get(&metadata).bearer_auth("0123").send().await.map(|r| r.status().as_u16()),
        http.get(&metadata).bearer_auth("123").send().await.map(|r| r.status().as_u16()),
    ];
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&config_path);
    assert_eq!(statuses.map(|s| s.expect("sent")), [200, 401]);
}
