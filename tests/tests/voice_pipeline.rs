//! End to end on a real broker: voice events through the real api-gateway and ai-worker
//! processes running the real Silero VAD model.

use std::collections::HashMap;
use std::time::Duration;

use vramgate_tests::wav::{compose, speak, write_wav, SampleFormat};
use vramgate_tests::{
    gateway_base_env, voice_task_env,
    collect, producer, scratch_dir, uncommitted_records, send, send_with_headers, silero_worker_config, start_gateway, start_worker, unique, Received,
    TaskTopics,
};

/// Segments must cover the known speech: first start and last end within this of its bounds.
const TOLERANCE_SECONDS: f64 = 0.3;

fn gateway_env(topics: &TaskTopics, group: &str, worker_url: &str, root: &std::path::Path) -> Vec<(&'static str, String)> {
    let mut env = gateway_base_env(group, worker_url, root);
    env.extend(voice_task_env(topics));
    env.extend([
        ("TASKS__VOICE__CPU_THREADS", "2".into()),
        ("TASKS__IMAGE__ENABLED", "false".into()),
    ]);
    env
}

fn request(id: &str, uri: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"id": id, "task": "voice", "input": {"uri": uri}}))
        .expect("json serialises")
}

fn only(records: &HashMap<String, Vec<Received>>, id: &str) -> Received {
    let got = records.get(id).unwrap_or_else(|| panic!("no result or dead letter for {id}"));
    assert_eq!(got.len(), 1, "{id} ended {} times: {got:?}", got.len());
    got[0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_voice_events_get_segments_and_poison_records_get_dead_letters() {
    let topics = TaskTopics::create("voice-e2e", 3).await.expect("topics");
    let root = scratch_dir("voice-e2e");
    let worker = start_worker(&silero_worker_config()).await.expect("worker starts");
    let group = unique("gw");
    let mut gateway = start_gateway(&gateway_env(&topics, &group, &worker.url, &root)).await.expect("gateway starts");

    // 18 spoken clips across rates, channel counts and sample formats, plus 2 of pure noise.
    let phrases = [
        "The quick brown fox jumps over the lazy dog.",
        "Kafka delivers the messages and the worker listens.",
        "Please call Stella and ask her to bring these things.",
    ];
    let speech: Vec<_> = phrases.iter().map(|p| speak(p).expect("espeak-ng speaks")).collect();
    let rates = [8_000, 11_025, 16_000, 22_050, 44_100, 48_000];
    let formats = [
        SampleFormat::I16,
        SampleFormat::F32,
        SampleFormat::I24,
        SampleFormat::U8,
        SampleFormat::I32,
        SampleFormat::ExtensibleI16,
    ];
    let mut expected = HashMap::new();
    let producer = producer();
    for i in 0..20u64 {
        let rate = rates[i as usize % rates.len()];
        let channels = [1u16, 2, 1, 6][i as usize % 4];
        let format = formats[(i as usize / 2) % formats.len()];
        let lead = 0.4 + 0.15 * (i % 7) as f64;
        let tail = 0.5 + 0.1 * (i % 5) as f64;
        let voice = (i < 18).then(|| &speech[i as usize % speech.len()]);
        let clip = compose(voice, lead, tail, rate, channels, i);
        let path = root.join(format!("clip-{i}.wav"));
        write_wav(&path, &clip.samples, rate, channels, format).expect("write wav");
        let id = unique(&format!("clip{i}"));
        let uri = format!("file://{}", path.display());
        send(&producer, &topics.requests, &id, &request(&id, &uri)).await.expect("send");
        expected.insert(id, (clip.speech, rate, channels, format));
    }

    // Poison: a corrupt WAV, a non-JSON value, a missing file; then one more good event to show
    // the gateway keeps going.
    let corrupt = root.join("corrupt.wav");
    std::fs::write(&corrupt, b"RIFF\x10\x00\x00\x00WAVEfmt \x02\x00\x00\x00\x01").expect("write");
    let poison_corrupt = unique("corrupt");
    send(&producer, &topics.requests, &poison_corrupt, &request(&poison_corrupt, &format!("file://{}", corrupt.display())))
        .await
        .expect("send");
    send(&producer, &topics.requests, "not-json", b"{this is not json").await.expect("send");
    let poison_missing = unique("missing");
    let missing_uri = format!("file://{}/nope.wav", root.display());
    send(&producer, &topics.requests, &poison_missing, &request(&poison_missing, &missing_uri)).await.expect("send");
    let after = unique("after-poison");
    let clip = compose(Some(&speech[0]), 0.5, 0.5, 16_000, 1, 99);
    let after_path = root.join("after.wav");
    write_wav(&after_path, &clip.samples, 16_000, 1, SampleFormat::I16).expect("write");
    let traceparent = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let after_value = request(&after, &format!("file://{}", after_path.display()));
    send_with_headers(&producer, &topics.requests, &after, &after_value, &[("traceparent", traceparent)])
        .await
        .expect("send");

    let wanted: Vec<String> =
        expected.keys().cloned().chain([poison_corrupt.clone(), poison_missing.clone(), after.clone()]).collect();
    let records = collect(&[&topics.results, &topics.dlq], Duration::from_secs(240), |got| {
        wanted.iter().all(|id| got.contains_key(id)) && got.contains_key("")
    })
    .await
    .expect("collect");
    let missing: Vec<&String> = wanted.iter().filter(|id| !records.contains_key(*id)).collect();
    assert!(missing.is_empty(), "no output for {missing:?}; gateway log:\n{}", gateway.log_tail());

    for (id, (speech, rate, channels, format)) in &expected {
        let got = only(&records, id);
        let what = format!("{id} ({rate} Hz, {channels} ch, {format:?})");
        assert_eq!(got.topic, topics.results, "{what} was dead-lettered: {}", got.value);
        let value = &got.value;
        assert_eq!(value["status"], "ok", "{what}");
        assert_eq!(value["model"], "silero_vad", "{what}");
        assert_eq!(value["output"]["input_sample_rate_hz"], *rate, "{what}");
        assert_eq!(value["output"]["input_channels"], *channels, "{what}");
        let segments: Vec<(f64, f64)> = value["output"]["segments"]
            .as_array()
            .expect("segments array")
            .iter()
            .map(|s| (s["start_seconds"].as_f64().expect("start"), s["end_seconds"].as_f64().expect("end")))
            .collect();
        match speech {
            None => assert!(segments.is_empty(), "{what}: pure noise gave segments {segments:?}"),
            Some((start, end)) => {
                assert!(!segments.is_empty(), "{what}: no speech found in [{start:.2}, {end:.2}]");
                let first = segments[0].0;
                let last = segments[segments.len() - 1].1;
                assert!(
                    (first - start).abs() <= TOLERANCE_SECONDS && (last - end).abs() <= TOLERANCE_SECONDS,
                    "{what}: segments {segments:?} do not match speech [{start:.2}, {end:.2}] ± {TOLERANCE_SECONDS}"
                );
            }
        }
        for key in ["convert", "gpu_wait", "inference", "total"] {
            assert!(value["timings_ms"][key].as_f64().is_some_and(|v| v >= 0.0), "{what}: timings_ms.{key}");
        }
    }

    let check_dead = |got: &Received, kind: &str, stage: &str| {
        assert_eq!(got.topic, topics.dlq, "expected a dead letter, got {}", got.value);
        assert_eq!(got.value["error"]["kind"], kind, "{}", got.value);
        assert_eq!(got.value["error"]["stage"], stage, "{}", got.value);
        assert!(got.value["error"]["message"].as_str().is_some_and(|m| m.len() > 10), "{}", got.value);
        assert_eq!(got.value["source"]["topic"], topics.requests.as_str());
        assert!(got.value["source"]["value_b64"].is_string());
        // Spring Kafka's dead-letter headers, so tooling that reads those reads ours.
        assert_eq!(got.header("kafka_dlt-original-topic"), Some(topics.requests.as_bytes()));
        let partition = got.value["source"]["partition"].as_i64().and_then(|p| i32::try_from(p).ok()).expect("partition");
        assert_eq!(got.header("kafka_dlt-original-partition"), Some(&partition.to_be_bytes()[..]));
        let offset = got.value["source"]["offset"].as_i64().expect("offset");
        assert_eq!(got.header("kafka_dlt-original-offset"), Some(&offset.to_be_bytes()[..]));
        assert_eq!(got.header("vramgate-error-kind"), Some(kind.as_bytes()));
    };
    check_dead(&only(&records, &poison_corrupt), "invalid_audio", "convert");
    check_dead(&only(&records, &poison_missing), "input_not_found", "fetch");
    let not_json = &records[""];
    assert_eq!(not_json.len(), 1, "{not_json:?}");
    check_dead(&not_json[0], "invalid_json", "parse");
    let after_result = only(&records, &after);
    assert_eq!(after_result.topic, topics.results, "the gateway stopped after the poison records");
    assert_eq!(after_result.header("traceparent"), Some(&traceparent[..]), "trace context not carried");

    // SIGTERM: the gateway finishes, commits and exits 0; every request offset is committed.
    let status = gateway.service.terminate(Duration::from_secs(30)).await.expect("gateway stops");
    assert!(status.success(), "gateway exited with {status}; log:\n{}", gateway.log_tail());
    let behind = uncommitted_records(&group, &topics.requests).expect("read committed offsets");
    assert_eq!(behind, 0, "{behind} request records not committed after a graceful shutdown");
    drop(worker);
}
