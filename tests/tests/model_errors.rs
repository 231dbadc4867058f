//! A model's own failure on one input is that input's fault: through a real broker, the real
//! gateway and the real worker, a token model (`nn.Embedding(100, 8)` then the mean, written by
//! `tests/python/token_model.py`) behind a `tensor` task gets events of one shape, one of them
//! with a token id past the embedding. The model raises on it; the worker isolates it from its
//! batch mates, runs it alone, and answers 400 marked `model_error`; the gateway dead-letters it
//! at once as `model_error` with the model's words, after one worker call, while every good
//! event gets its result.

use std::time::Duration;

use serde_json::json;
use vramgate_tests::oip_client::{metric, metrics_text};
use vramgate_tests::{
    collect, gateway_base_env, producer, python_check, request_inline, scratch_dir, send_all, start_gateway_config,
    start_worker, unique, worker_config, TaskTopics,
};

/// Token ids per event: every event has the same shape, so all may share a batch.
const TOKENS: usize = 16;
/// Events sent; the one at [`BAD`] carries an id past the embedding's 100 rows.
const EVENTS: usize = 8;
const BAD: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_error_is_dead_lettered_at_once_and_its_batch_mates_are_served() {
    let root = scratch_dir("model-errors");
    let model = root.join("tokens.pt");
    // The model's own words for an id past its embedding, as Python's torch reports them.
    let said = python_check("token_model.py", [&model], String::new).trim().to_string();
    assert!(said.contains("index out of range"), "{said}");

    // Batches of up to 8 gathered over a window, so the bad event may share a batch.
    let extra = "[batching]\nwindow_ms = 300.0\nmax_batch_size = 8\ncalibrate = false\ninitial_batch_size = 8\n";
    let keys = "input = { name = \"tokens\", datatype = \"INT64\", shape = [-1, 16] }\n\
                outputs = [{ name = \"embedding\", shape = [-1, 8] }]";
    let path = model.to_str().expect("a utf-8 path");
    let worker = start_worker(&worker_config(extra, &[("tokens", path, keys, "")])).await.expect("worker starts");

    let topics = TaskTopics::create("model-errors", 1).await.expect("topics");
    let gateway_toml = root.join("gateway.toml");
    let config = format!(
        "[tasks.voice]\nenabled = false\n\n[tasks.image]\nenabled = false\n\n\
         [tasks.tokens]\nconverter = \"tensor\"\nmodel = \"tokens\"\n\
         requests_topic = \"{}\"\nresults_topic = \"{}\"\ndlq_topic = \"{}\"\n\
         gpu_permits = {{ initial = {EVENTS}, min = 1, max = 16 }}\n\n\
         [tasks.tokens.tensor]\ninput = \"tokens\"\ndatatype = \"INT64\"\n\n\
         [[tasks.tokens.outputs]]\nname = \"embedding\"\n",
        topics.requests, topics.results, topics.dlq
    );
    std::fs::write(&gateway_toml, config).expect("writing gateway.toml");
    let env = gateway_base_env(&unique("model-errors-gw"), &worker.url, &root);
    let gateway = start_gateway_config(&gateway_toml, &env).await.expect("gateway");

    let events: Vec<(String, Vec<u8>)> = (0..EVENTS)
        .map(|i| {
            let mut ids: Vec<i64> = (0..TOKENS).map(|k| ((i * 13 + k * 7) % 100) as i64).collect();
            if i == BAD {
                ids[5] = 100;
            }
            let id = format!("t{i}");
            let tensor = json!({"datatype": "INT64", "shape": [1, TOKENS], "data": ids});
            let event = request_inline(&id, "tokens", tensor.to_string().as_bytes());
            (id, event)
        })
        .collect();
    send_all(&producer(), &topics.requests, &events, EVENTS).await.expect("sending the events");

    let got = collect(&[&topics.results, &topics.dlq], Duration::from_secs(90), |by_id| by_id.len() >= EVENTS)
        .await
        .expect("reading the outputs");
    let log = || format!("gateway log:\n{}\nworker log:\n{}", gateway.log_tail(), worker.service.log_tail());
    assert_eq!(got.len(), EVENTS, "not every event ended: {got:?}\n{}", log());
    let bad_id = format!("t{BAD}");
    for (id, records) in &got {
        assert_eq!(records.len(), 1, "{id} ended {} times: {records:?}", records.len());
        let record = &records[0];
        if *id == bad_id {
            assert_eq!(record.topic, topics.dlq, "{}", record.value);
            let error = &record.value["error"];
            assert_eq!((error["kind"].as_str(), error["stage"].as_str()), (Some("model_error"), Some("infer")), "{}", record.value);
            let message = error["message"].as_str().unwrap_or("");
            assert!(message.contains(&said) && message.contains("'tokens'"), "the model's words ({said}) missing: {message}");
            assert_eq!(record.value["attempts"], 1, "one worker call, no retry: {}", record.value);
            assert_eq!(record.header("vramgate-error-kind"), Some(&b"model_error"[..]));
        } else {
            assert_eq!(record.topic, topics.results, "{id} failed with its bad neighbour: {}\n{}", record.value, log());
            assert_eq!(record.value["output"]["outputs"]["embedding"]["shape"], json!([1, 8]), "{}", record.value);
        }
    }

    // One call per event, none retried; the dead letter counted under its kind.
    let task = [("task", "tokens")];
    let counted = |s: &vramgate_tests::metrics::Scrape| {
        s.sum("vramgate_gateway_dead_letters_total", &[("task", "tokens"), ("kind", "model_error")]) >= 1.0
            && s.sum("vramgate_gateway_records_produced_total", &task) >= EVENTS as f64
    };
    let scrape = gateway.metrics_when(Duration::from_secs(10), counted).await.expect("gateway metrics");
    assert!(counted(&scrape), "{}", scrape.text);
    assert_eq!(scrape.sum("vramgate_gateway_retries_total", &task), 0.0, "{:?}", scrape.family("vramgate_gateway_retries_total"));
    assert_eq!(scrape.sum("vramgate_gateway_worker_requests_total", &task), EVENTS as f64);
    let text = metrics_text(&reqwest::Client::new(), &worker.url).await.expect("worker metrics");
    assert_eq!(metric(&text, "inference_model_errors_total{model=\"tokens\"}"), 1.0, "{text}");
}
