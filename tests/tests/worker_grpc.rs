//! The ai-worker's gRPC door (the Open Inference Protocol's `GRPCInferenceService`): the
//! standard `tritonclient.grpc` gets the HTTP door's answers bit for bit on four real models
//! (one input, two inputs, no batch dimension, UINT8 images), and hostile calls get a status
//! code naming the problem while the worker keeps serving. A stream that never finishes its
//! message is ended at `body_read_timeout_ms` with DEADLINE_EXCEEDED; a connection that sends
//! nothing is closed at `header_read_timeout_ms`, and one that only answers pings at
//! `idle_timeout_ms`; the worker's resident memory after the flood of calls is printed and
//! bounded. The README's `grpcurl` examples run as written and get the HTTP door's answers.

use std::time::{Duration, Instant};

use vramgate_tests::wav::{change_rate, speak, write_wav, SampleFormat};
use vramgate_tests::{python_check, repo_root, rss_bytes, start_worker, unique, VAD_KEYS};

const TOKEN: &str = "grpc-test-token";
const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;
const BODY_READ_TIMEOUT_MS: u64 = 1500;
const HEADER_READ_TIMEOUT_MS: u64 = 1000;

fn config() -> String {
    let root = repo_root();
    format!(
        "listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\ngrpc_max_concurrent_streams = 16\n\
         device = \"cpu\"\ntorch_threads = 1\nauth_token = \"{TOKEN}\"\n\
         max_request_bytes = {MAX_REQUEST_BYTES}\nmax_body_bytes_in_flight = {}\nbody_read_timeout_ms = {BODY_READ_TIMEOUT_MS}\n\
         header_read_timeout_ms = {HEADER_READ_TIMEOUT_MS}\n\
         model_repository = \"{}\"\n\n[batching]\ncalibrate = false\n\n\
         [[models]]\nname = \"silero_vad\"\npath = \"{}\"\n{VAD_KEYS}\n",
        4 * MAX_REQUEST_BYTES,
        root.join("models/repository").display(),
        root.join("models/silero_vad.jit").display(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tritonclient_grpc_gets_the_http_answers_and_hostile_calls_get_codes() {
    let mut worker = start_worker(&config()).await.expect("worker starts");
    let grpc = worker.grpc.clone().expect("the worker reports its gRPC address");
    let http = worker.url.trim_start_matches("http://").to_string();

    let speech = speak("The quick brown fox jumps over the lazy dog, and then it sings a little song.").expect("espeak-ng");
    let samples = change_rate(&speech.samples, speech.sample_rate, 16_000);
    let wav = std::env::temp_dir().join(format!("{}.wav", unique("grpc-speech")));
    write_wav(&wav, &samples, 16_000, 1, SampleFormat::I16).expect("writing the speech");
    let limit = MAX_REQUEST_BYTES.to_string();
    let args = [http.as_ref(), grpc.as_ref(), TOKEN.as_ref(), wav.as_os_str(), limit.as_ref()];
    let resident_before = rss_bytes(worker.service.pid());
    eprint!("{}", python_check("grpc_client_check.py", args, || worker.service.log_tail()));
    let resident_after = rss_bytes(worker.service.pid());
    // The bodies read at once are bounded by max_body_bytes_in_flight (16 MiB here); the rest
    // of the growth is libtorch's and the allocator's working set after the first calls.
    eprintln!("worker resident memory: {resident_before} bytes before the calls and the flood, {resident_after} after");
    assert!(resident_after < resident_before + (256 << 20), "grew by more than 256 MiB: {resident_before} -> {resident_after}");
    let _ = std::fs::remove_file(&wav);

    // A call whose message never finishes: answered at body_read_timeout_ms, not held open.
    let stream = tokio::net::TcpStream::connect(&grpc).await.expect("connect");
    let (client, connection) = h2::client::handshake(stream).await.expect("HTTP/2 handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut client = client.ready().await.expect("ready");
    let request = http::Request::post(format!("http://{grpc}/inference.GRPCInferenceService/ModelInfer"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(())
        .expect("request");
    let started = Instant::now();
    let (response, mut body) = client.send_request(request, false).expect("send");
    // A gRPC frame that announces 1 MiB, then 100 bytes of it, then nothing.
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(1u32 << 20).to_be_bytes());
    frame.extend_from_slice(&[7u8; 100]);
    body.send_data(bytes::Bytes::from(frame), false).expect("part of a message");
    let response = tokio::time::timeout(Duration::from_secs(30), response).await.expect("answered in time").expect("a response");
    let waited = started.elapsed();
    let status = response.headers().get("grpc-status").and_then(|v| v.to_str().ok()).map(str::to_string);
    let message = response.headers().get("grpc-message").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    assert_eq!(status.as_deref(), Some("4"), "DEADLINE_EXCEEDED for a message never finished: {message}");
    assert!(message.contains("body_read_timeout_ms"), "{message}");
    assert!(waited >= Duration::from_millis(BODY_READ_TIMEOUT_MS - 100), "answered after the read timeout, not before: {waited:?}");
    eprintln!("a stalled message was ended after {waited:?} with DEADLINE_EXCEEDED");

    // A connection that sends nothing (not even HTTP/2's preface) is closed at
    // header_read_timeout_ms.
    let mut silent = tokio::net::TcpStream::connect(&grpc).await.expect("connect");
    let started = Instant::now();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(10), tokio::io::AsyncReadExt::read(&mut silent, &mut byte)).await;
    let waited = started.elapsed();
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "a silent connection is closed, got {read:?} after {waited:?}");
    assert!(waited >= Duration::from_millis(HEADER_READ_TIMEOUT_MS - 100), "closed at the timeout, not before: {waited:?}");
    eprintln!("a silent connection was closed after {waited:?}");

    // Still serving on both doors.
    let ready = reqwest::get(format!("{}/v2/health/ready", worker.url)).await.expect("HTTP ready");
    assert!(ready.status().is_success());
    assert!(worker.service.is_running(), "the worker is still up; log:\n{}", worker.service.log_tail());
}

/// A connection with no call in progress is closed at `idle_timeout_ms`, though it answers
/// every HTTP/2 ping: pings keep a peer's liveness known, not a connection held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_only_answers_pings_is_closed_when_idle() {
    const IDLE_TIMEOUT_MS: u64 = 3000;
    let worker = start_worker(&format!("idle_timeout_ms = {IDLE_TIMEOUT_MS}\n{}", config())).await.expect("worker starts");
    let grpc = worker.grpc.clone().expect("the worker reports its gRPC address");
    let stream = tokio::net::TcpStream::connect(&grpc).await.expect("connect");
    let (client, mut connection) = h2::client::handshake(stream).await.expect("HTTP/2 handshake");
    let mut pings = connection.ping_pong().expect("the connection's ping handle");
    let closed = tokio::spawn(async move {
        let _ = connection.await;
        Instant::now()
    });

    // One call, answered: the idle time counts from its end.
    let mut client = client.ready().await.expect("ready");
    let request = http::Request::post(format!("http://{grpc}/inference.GRPCInferenceService/ServerLive"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("request");
    let (response, mut body) = client.send_request(request, false).expect("send");
    // An empty ServerLiveRequest: an uncompressed frame of length 0.
    body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true).expect("the message");
    let mut answer = response.await.expect("answered").into_body();
    while let Some(chunk) = answer.data().await {
        let chunk = chunk.expect("answer bytes");
        let _ = answer.flow_control().release_capacity(chunk.len());
    }
    let trailers = answer.trailers().await.expect("trailers").expect("gRPC status trailers");
    assert_eq!(trailers.get("grpc-status").and_then(|v| v.to_str().ok()), Some("0"), "ServerLive answered: {trailers:?}");
    let call_ended = Instant::now();

    // Pings every 300 ms, each answered, until the worker closes the connection.
    let mut answered = 0;
    while call_ended.elapsed() < Duration::from_millis(IDLE_TIMEOUT_MS + 10_000) {
        match tokio::time::timeout(Duration::from_secs(2), pings.ping(h2::Ping::opaque())).await {
            Ok(Ok(_)) => answered += 1,
            _ => break,
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let closed_at = tokio::time::timeout(Duration::from_secs(5), closed).await.expect("the connection closed").expect("joins");
    let idle = closed_at.duration_since(call_ended);
    eprintln!("a connection answering pings was closed {idle:?} after its last call ended, {answered} pings answered meanwhile");
    assert!(answered >= 5, "pings were answered while it was idle: {answered}");
    assert!(idle >= Duration::from_millis(IDLE_TIMEOUT_MS - 100), "closed at idle_timeout_ms, not before: {idle:?}");
    assert!(idle < Duration::from_millis(IDLE_TIMEOUT_MS + 5_000), "closed soon after idle_timeout_ms: {idle:?}");
    // The worker serves new connections as before.
    let ready = reqwest::get(format!("{}/v2/health/ready", worker.url)).await.expect("HTTP ready");
    assert!(ready.status().is_success());
}

/// The README's grpcurl examples of the gRPC door, as written there (the test checks that it
/// still shows them): `grpcurl` stands for the binary `scripts/go-tools` builds,
/// `127.0.0.1:8001` for the worker's gRPC address and `<auth_token>` for its token. Both
/// inferences send the samples 0, 1, …, 511.
const README_LIVE: &str = r#"grpcurl -plaintext -import-path ai-worker/proto -proto inference.proto \
  127.0.0.1:8001 inference.GRPCInferenceService/ServerLive"#;
const README_METADATA: &str = r#"grpcurl -plaintext -import-path ai-worker/proto -proto inference.proto \
  -H 'authorization: Bearer <auth_token>' -d '{"name": "silero_vad"}' \
  127.0.0.1:8001 inference.GRPCInferenceService/ModelMetadata"#;
const README_INFER_TYPED: &str = r#"grpcurl -plaintext -import-path ai-worker/proto -proto inference.proto \
  -H 'authorization: Bearer <auth_token>' -d @ \
  127.0.0.1:8001 inference.GRPCInferenceService/ModelInfer <<EOF
{"model_name": "silero_vad", "inputs": [{"name": "audio", "datatype": "FP32", "shape": [1, 512],
  "contents": {"fp32_contents": [$(seq -s, 0 511)]}}]}
EOF"#;
const README_INFER_RAW: &str = r#"grpcurl -plaintext -import-path ai-worker/proto -proto inference.proto \
  -H 'authorization: Bearer <auth_token>' -d @ \
  127.0.0.1:8001 inference.GRPCInferenceService/ModelInfer <<EOF
{"model_name": "silero_vad", "inputs": [{"name": "audio", "datatype": "FP32", "shape": [1, 512]}],
  "raw_input_contents": ["$(perl -e 'print pack("f<*", 0..511)' | base64 | tr -d '\n')"]}
EOF"#;

/// grpcurl's exit status for a call answered with a status code: 64 + the code.
const GRPCURL_STATUS_OFFSET: i32 = 64;
const INVALID_ARGUMENT: i32 = 3;

/// The grpcurl binary `scripts/go-tools` builds (it builds it first when missing: a test that
/// cannot have it fails, it is never skipped).
fn grpcurl_binary() -> std::path::PathBuf {
    let out = vramgate_tests::run_script("go-tools", &["path", "grpcurl"]).expect("scripts/go-tools builds grpcurl (scripts/setup installs it)");
    let path = std::path::PathBuf::from(out.trim());
    assert!(path.is_file(), "scripts/go-tools path grpcurl gave {}, which is not a file", path.display());
    path
}

/// What one grpcurl run printed, and how it exited.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    /// The answer grpcurl printed as JSON, after checking that the call succeeded.
    fn json(&self, what: &str) -> serde_json::Value {
        assert_eq!(self.code, Some(0), "{what}: grpcurl failed:\n{}{}", self.stdout, self.stderr);
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{what}: grpcurl printed no JSON ({e}):\n{}", self.stdout))
    }
}

/// Runs `command` in bash from the repository root (as a reader of the README would), with
/// `grpcurl`, the address and the token of the README's examples replaced by the real ones.
async fn grpcurl(binary: &std::path::Path, grpc: &str, command: &str) -> Run {
    let rest = command.strip_prefix("grpcurl ").expect("the command starts with grpcurl");
    let binary = binary.to_str().expect("a UTF-8 path");
    assert!(!binary.contains('\''), "{binary}: no quotes in the path");
    let script = format!("'{binary}' {rest}").replace("127.0.0.1:8001", grpc).replace("<auth_token>", TOKEN);
    let mut command = tokio::process::Command::new("bash");
    command.arg("-c").arg(&script).current_dir(repo_root()).kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .unwrap_or_else(|_| panic!("grpcurl took more than 60 s: {script}"))
        .expect("bash runs");
    Run {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// The bytes of grpcurl's `raw_output_contents` (base64 in its JSON), with the output's name,
/// datatype and shape, from a ModelInfer answer of one output.
fn grpc_output(answer: &serde_json::Value) -> (String, String, Vec<i64>, Vec<u8>) {
    let outputs = answer["outputs"].as_array().expect("outputs");
    assert_eq!(outputs.len(), 1, "{answer}");
    let output = &outputs[0];
    let shape = dims(&output["shape"]);
    let raw = answer["rawOutputContents"].as_array().expect("rawOutputContents");
    assert_eq!(raw.len(), 1, "{answer}");
    let text = raw[0].as_str().expect("base64");
    let bytes = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, text).expect("valid base64");
    (output["name"].as_str().unwrap_or_default().into(), output["datatype"].as_str().unwrap_or_default().into(), shape, bytes)
}

/// A shape in protobuf's JSON, where an int64 dimension travels as a string (or a number).
fn dims(shape: &serde_json::Value) -> Vec<i64> {
    shape
        .as_array()
        .expect("shape")
        .iter()
        .map(|d| d.as_str().and_then(|d| d.parse().ok()).or_else(|| d.as_i64()).expect("a dimension"))
        .collect()
}

fn floats(le: &[u8]) -> Vec<f32> {
    assert_eq!(le.len() % 4, 0);
    le.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// The README's grpcurl lines, run as written against a real worker: liveness, a model's
/// metadata, and one inference sent as typed `fp32_contents` and as base64
/// `raw_input_contents`, each equal to the HTTP door's answer on the same input (the decoded
/// floats for the JSON one, the bytes for the binary one). A missing input exits grpcurl
/// non-zero with `InvalidArgument` and the HTTP door's message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_runs_the_readme_examples_and_gets_the_http_answers() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    for example in [README_LIVE, README_METADATA, README_INFER_TYPED, README_INFER_RAW] {
        assert!(readme.contains(example), "README.md no longer shows this grpcurl example as the test runs it:\n{example}");
    }
    let binary = grpcurl_binary();
    let worker = start_worker(&config()).await.expect("worker starts");
    let grpc = worker.grpc.clone().expect("the worker reports its gRPC address");
    let http = reqwest::Client::new();
    let bearer = format!("Bearer {TOKEN}");
    let samples: Vec<f32> = (0..512).map(|i| i as f32).collect();

    // ServerLive, as HTTP's /v2/health/live.
    let live = grpcurl(&binary, &grpc, README_LIVE).await.json("ServerLive");
    assert_eq!(live, serde_json::json!({"live": true}));
    let status = http.get(format!("{}/v2/health/live", worker.url)).send().await.expect("HTTP live").status();
    assert!(status.is_success(), "HTTP live: {status}");

    // ModelMetadata, as HTTP's GET /v2/models/silero_vad.
    let grpc_meta = grpcurl(&binary, &grpc, README_METADATA).await.json("ModelMetadata");
    let http_meta: serde_json::Value = http
        .get(format!("{}/v2/models/silero_vad", worker.url))
        .header("authorization", &bearer)
        .send()
        .await
        .expect("HTTP metadata")
        .json()
        .await
        .expect("JSON metadata");
    for key in ["name", "versions", "platform"] {
        assert_eq!(grpc_meta[key], http_meta[key], "{key}: gRPC {grpc_meta}, HTTP {http_meta}");
    }
    for side in ["inputs", "outputs"] {
        let tensors = |meta: &serde_json::Value| -> Vec<(String, String, Vec<i64>)> {
            meta[side]
                .as_array()
                .unwrap_or_else(|| panic!("{side} in {meta}"))
                .iter()
                .map(|t| {
                    (t["name"].as_str().unwrap_or_default().into(), t["datatype"].as_str().unwrap_or_default().into(), dims(&t["shape"]))
                })
                .collect()
        };
        let (g, h) = (tensors(&grpc_meta), tensors(&http_meta));
        assert!(!g.is_empty(), "{side}: none");
        assert_eq!(g, h, "{side}: gRPC vs HTTP");
    }
    eprintln!("grpcurl ModelMetadata: {grpc_meta}");

    // ModelInfer with typed contents, as HTTP's JSON infer on the same samples (decoded floats).
    let typed = grpcurl(&binary, &grpc, README_INFER_TYPED).await.json("ModelInfer, typed contents");
    assert_eq!(typed["modelName"], "silero_vad", "{typed}");
    let (name, datatype, shape, typed_bytes) = grpc_output(&typed);
    let answer: serde_json::Value = http
        .post(format!("{}/v2/models/silero_vad/infer", worker.url))
        .header("authorization", &bearer)
        .json(&serde_json::json!({"inputs": [{"name": "audio", "shape": [1, 512], "datatype": "FP32", "data": samples}]}))
        .send()
        .await
        .expect("HTTP infer")
        .json()
        .await
        .expect("JSON answer");
    assert_eq!(typed["modelVersion"], answer["model_version"], "gRPC {typed}, HTTP {answer}");
    let out = &answer["outputs"][0];
    assert_eq!((name.as_str(), datatype.as_str()), (out["name"].as_str().unwrap_or_default(), out["datatype"].as_str().unwrap_or_default()), "{answer}");
    assert_eq!(serde_json::json!(shape), out["shape"], "{answer}");
    let http_floats: Vec<f32> = out["data"].as_array().expect("data").iter().map(|v| v.as_f64().expect("a number") as f32).collect();
    let grpc_floats = floats(&typed_bytes);
    assert_eq!(grpc_floats.len(), http_floats.len());
    for (g, h) in grpc_floats.iter().zip(&http_floats) {
        assert_eq!(g.to_bits(), h.to_bits(), "typed contents: gRPC {grpc_floats:?}, HTTP {http_floats:?}");
    }
    eprintln!("grpcurl ModelInfer, fp32_contents: speech_prob {grpc_floats:?} (HTTP JSON: {http_floats:?})");

    // ModelInfer with raw_input_contents, as HTTP's binary infer (bit for bit).
    let raw = grpcurl(&binary, &grpc, README_INFER_RAW).await.json("ModelInfer, raw_input_contents");
    let (raw_name, raw_datatype, raw_shape, raw_bytes) = grpc_output(&raw);
    let le: Vec<u8> = samples.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut body = serde_json::to_vec(&serde_json::json!({
        "inputs": [{"name": "audio", "shape": [1, 512], "datatype": "FP32", "parameters": {"binary_data_size": le.len()}}],
        "outputs": [{"name": "speech_prob", "parameters": {"binary_data": true}}]
    }))
    .expect("json");
    let header_len = body.len();
    body.extend_from_slice(&le);
    let response = http
        .post(format!("{}/v2/models/silero_vad/infer", worker.url))
        .header("authorization", &bearer)
        .header("inference-header-content-length", header_len.to_string())
        .body(body)
        .send()
        .await
        .expect("HTTP binary infer");
    assert_eq!(response.status().as_u16(), 200);
    let json_len: usize = response
        .headers()
        .get("inference-header-content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("a binary answer names its JSON header's length");
    let bytes = response.bytes().await.expect("body");
    let header: serde_json::Value = serde_json::from_slice(&bytes[..json_len]).expect("JSON header");
    let out = &header["outputs"][0];
    assert_eq!((raw_name.as_str(), raw_datatype.as_str()), (out["name"].as_str().unwrap_or_default(), out["datatype"].as_str().unwrap_or_default()), "{header}");
    assert_eq!(serde_json::json!(raw_shape), out["shape"], "{header}");
    assert_eq!(raw_bytes, bytes[json_len..], "raw_input_contents: gRPC's raw output bytes are HTTP's binary ones");
    assert_eq!(raw_bytes, typed_bytes, "the same samples, raw or typed, get the same answer");
    eprintln!("grpcurl ModelInfer, raw_input_contents: {} output bytes equal to HTTP's binary answer", raw_bytes.len());

    // A missing input (silero_stream without its `state`): grpcurl exits with the status code,
    // INVALID_ARGUMENT with the message the HTTP door answers with its 400.
    let chunk = vec![0f32; 576];
    let missing = grpcurl(
        &binary,
        &grpc,
        &format!(
            "grpcurl -plaintext -import-path ai-worker/proto -proto inference.proto \
             -H 'authorization: Bearer <auth_token>' -d '{}' 127.0.0.1:8001 inference.GRPCInferenceService/ModelInfer",
            serde_json::json!({"model_name": "silero_stream", "inputs": [{"name": "chunk", "datatype": "FP32", "shape": [1, 576], "contents": {"fp32_contents": chunk}}]})
        ),
    )
    .await;
    let response = http
        .post(format!("{}/v2/models/silero_stream/infer", worker.url))
        .header("authorization", &bearer)
        .json(&serde_json::json!({"inputs": [{"name": "chunk", "shape": [1, 576], "datatype": "FP32", "data": chunk}]}))
        .send()
        .await
        .expect("HTTP infer");
    assert_eq!(response.status().as_u16(), 400);
    let error: serde_json::Value = response.json().await.expect("a JSON error");
    let message = error["error"].as_str().expect("an error message");
    assert!(message.contains("state"), "the message names the missing input: {message}");
    assert_eq!(
        missing.code,
        Some(GRPCURL_STATUS_OFFSET + INVALID_ARGUMENT),
        "grpcurl exits with 64 + INVALID_ARGUMENT:\n{}{}",
        missing.stdout,
        missing.stderr
    );
    assert!(missing.stderr.contains("Code: InvalidArgument"), "{}", missing.stderr);
    assert!(missing.stderr.contains(&format!("Message: {message}")), "the HTTP door's message {message:?} in:\n{}", missing.stderr);
    eprintln!("grpcurl ModelInfer without `state`: exit {:?}\n{}", missing.code, missing.stderr.trim_end());
}
