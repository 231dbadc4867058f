//! The ai-worker's gRPC door (the Open Inference Protocol's `GRPCInferenceService`): the
//! standard `tritonclient.grpc` gets the HTTP door's answers bit for bit on four real models
//! (one input, two inputs, no batch dimension, UINT8 images), and hostile calls get a status
//! code naming the problem while the worker keeps serving. A stream that never finishes its
//! message is ended at `body_read_timeout_ms` with DEADLINE_EXCEEDED; a connection that sends
//! nothing is closed at `header_read_timeout_ms`; the worker's resident memory after the flood
//! of calls is printed and bounded.

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
