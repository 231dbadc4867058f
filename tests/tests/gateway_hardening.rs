//! Hostile input against the real gateway, broker and worker: records whose output the broker
//! refuses, odd records (a tombstone, an empty or huge id, a top-level array) and forged trace
//! headers. Each record ends in exactly one output, the partition never stalls, the log stays
//! small, and a trace context is copied only when it is valid.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::FutureRecord;
use rdkafka::ClientConfig;
use vramgate_tests::wav::{noise, write_wav, SampleFormat};
use vramgate_tests::{
    brokers, collect, gateway_base_env, producer, request_file, scratch_dir, send, send_with_headers, start_gateway,
    start_worker, uncommitted_records, unique, voice_task_env, worker_config, Gateway, TaskTopics, Worker, VAD_MODEL,
};

/// Creates `<base>.requests` (1 partition) and `.results` / `.dlq` taking records of at most
/// `max_message_bytes`.
async fn topics_with_limit(prefix: &str, max_message_bytes: usize) -> TaskTopics {
    let base = unique(prefix);
    let topics = TaskTopics {
        requests: format!("{base}.requests"),
        results: format!("{base}.results"),
        dlq: format!("{base}.dlq"),
    };
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers()).create().expect("admin client");
    let limit = max_message_bytes.to_string();
    let new = [
        NewTopic::new(&topics.requests, 1, TopicReplication::Fixed(1)),
        NewTopic::new(&topics.results, 1, TopicReplication::Fixed(1)).set("max.message.bytes", &limit),
        NewTopic::new(&topics.dlq, 1, TopicReplication::Fixed(1)).set("max.message.bytes", &limit),
    ];
    for result in admin.create_topics(&new, &AdminOptions::new()).await.expect("create topics") {
        result.expect("topic created");
    }
    topics
}

/// Creates `<base>.requests` and `.results` (1 partition each), not `.dlq`.
async fn topics_but_the_dlq(prefix: &str) -> TaskTopics {
    let base = unique(prefix);
    let topics = TaskTopics {
        requests: format!("{base}.requests"),
        results: format!("{base}.results"),
        dlq: format!("{base}.dlq"),
    };
    vramgate_tests::create_topics(&[&topics.requests, &topics.results], 1).await.expect("topics");
    topics
}

/// A worker serving the VAD model, a WAV file under a fresh input root, and a gateway whose
/// voice task reads `topics`.
struct Setup {
    _worker: Worker,
    gateway: Gateway,
    group: String,
    wav: std::path::PathBuf,
}

async fn setup(topics: &TaskTopics, name: &str) -> Setup {
    setup_with(topics, name, &[]).await
}

/// [`setup`], with further gateway settings.
async fn setup_with(topics: &TaskTopics, name: &str, extra: &[(&'static str, String)]) -> Setup {
    let worker = start_worker(&worker_config("", &[VAD_MODEL])).await.expect("worker");
    let root = scratch_dir(name);
    let wav = root.join("noise.wav");
    write_wav(&wav, &noise(8_000, 0.05, 2), 16_000, 1, SampleFormat::I16).expect("write wav");
    let group = unique("gw");
    let mut env = gateway_base_env(&group, &worker.url, &root);
    env.extend(voice_task_env(topics));
    env.push(("TASKS__IMAGE__ENABLED", "false".into()));
    env.extend_from_slice(extra);
    let gateway = start_gateway(&env).await.expect("gateway");
    Setup { _worker: worker, gateway, group, wav }
}

async fn wait_committed(gateway: &Gateway, group: &str, topic: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while uncommitted_records(group, topic).expect("offsets") > 0 {
        assert!(std::time::Instant::now() < deadline, "records still uncommitted; log:\n{}", gateway.log_tail());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_the_broker_refuses_become_trimmed_dead_letters_and_the_partition_moves_on() {
    refused_outputs_become_trimmed_dead_letters(&[]).await;
}

/// The same in exactly-once delivery, where the broker refuses the output inside a
/// transaction: the transaction aborts, and the redone one carries the trimmed dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_the_broker_refuses_inside_a_transaction_become_trimmed_dead_letters_too() {
    let eos = [("DELIVERY", "exactly-once".to_string()), ("KAFKA__TRANSACTIONAL_ID", unique("refused-tx"))];
    let gateway = refused_outputs_become_trimmed_dead_letters(&eos).await;
    let metrics = gateway.metrics().await.expect("metrics");
    let outcome = |o: &str| metrics.sum("vramgate_gateway_transactions_total", &[("outcome", o)]);
    assert!(outcome("aborted") + outcome("fenced") >= 1.0, "the refused output aborted no transaction:\n{}", metrics.text);
    assert!(outcome("committed") >= 1.0, "{}", metrics.text);
}

async fn refused_outputs_become_trimmed_dead_letters(extra: &[(&'static str, String)]) -> Gateway {
    let topics = topics_with_limit("refused", 4096).await;
    let Setup { _worker, gateway, group, wav } = setup_with(&topics, "refused", extra).await;

    let producer = producer();
    // A dead letter echoes the request's value (as base64): 10 KB of options makes it larger
    // than the dead-letter topic takes.
    let big_id = unique("big-options");
    let big = serde_json::to_vec(&serde_json::json!({
        "id": big_id, "task": "voice", "input": {"uri": format!("file://{}", wav.display())},
        "options": {"padding": "p".repeat(10_000)}
    }))
    .expect("json");
    let at = send(&producer, &topics.requests, &big_id, &big).await.expect("send");
    // A 200-byte id is allowed; it is echoed in the result, which still fits.
    let after = unique(&"a".repeat(180));
    send(&producer, &topics.requests, &after, &request_file(&after, "voice", &wav)).await.expect("send");

    let records = collect(&[&topics.results, &topics.dlq], Duration::from_secs(120), |got| {
        got.contains_key(&big_id) && got.contains_key(&after)
    })
    .await
    .expect("collect");
    let letter = &records.get(&big_id).unwrap_or_else(|| panic!("no output for the big record; log:\n{}", gateway.log_tail()))[0];
    assert_eq!(letter.topic, topics.dlq);
    // The trimmed dead letter keeps the original reason, and says why its value is missing.
    assert_eq!(letter.value["error"]["kind"], "invalid_request", "{}", letter.value);
    let message = letter.value["error"]["message"].as_str().expect("message");
    assert!(message.contains("could not be written") && message.contains("value out"), "{message}");
    assert!(letter.value["source"]["value_b64"].is_null(), "{}", letter.value);
    assert_eq!(letter.value["source"]["offset"].as_i64(), Some(at.offset));
    assert_eq!(letter.header("vramgate-output-trimmed"), Some(&b"true"[..]));
    assert_eq!(letter.header("vramgate-original-value-bytes"), Some(big.len().to_string().as_bytes()));
    let result = &records[&after][0];
    assert_eq!(result.topic, topics.results, "the record behind it was served: {}", result.value);

    wait_committed(&gateway, &group, &topics.requests).await;
    let metrics = gateway.metrics().await.expect("metrics");
    assert_eq!(metrics.sum("vramgate_gateway_outputs_rejected_total", &[("outcome", "trimmed")]), 1.0, "{}", metrics.text);
    gateway
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_records_and_forged_trace_headers_neither_crash_nor_flood() {
    let topics = TaskTopics::create("odd", 1).await.expect("topics");
    let Setup { _worker, gateway, group, wav } = setup(&topics, "odd").await;
    let producer = producer();

    // A tombstone: a record with no value.
    producer
        .send(FutureRecord::<str, [u8]>::to(&topics.requests).key("tombstone"), Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)
        .expect("send tombstone");
    let odd: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty-id", br#"{"id":"","task":"voice","input":{"uri":"file:///x.wav"}}"#.to_vec(), "id is empty"),
        ("array", b"[1,2,3]".to_vec(), "is an array"),
        (
            "huge-id",
            format!(r#"{{"id":"{}","task":"voice","input":{{"uri":"file:///x.wav"}}}}"#, "h".repeat(900_000)).into_bytes(),
            "limit is 256 bytes",
        ),
    ];
    for (key, value, _) in &odd {
        send(&producer, &topics.requests, key, value).await.expect("send");
    }
    // A burst of records that are not JSON: far more dead letters in a second than the log
    // takes lines; the rest are counted, not written.
    let burst: Vec<(String, Vec<u8>)> = (0..100).map(|i| (format!("burst-{i}"), b"{not json".to_vec())).collect();
    vramgate_tests::send_all(&producer, &topics.requests, &burst, 100).await.expect("send burst");
    let valid = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let huge = vec![b'0'; 10 * 1024];
    // (id, headers sent, whether the trace context must be copied to the result)
    type Forged<'a> = (String, Vec<(&'a str, &'a [u8])>, bool);
    let forged: Vec<Forged<'_>> = vec![
        (unique("tp-valid"), vec![("traceparent", valid), ("tracestate", b"rojo=00f067aa0ba902b7")], true),
        (unique("tp-malformed"), vec![("traceparent", b"00-zz-yy-01\n\x1b[31m")], false),
        (unique("tp-huge"), vec![("traceparent", &huge), ("tracestate", &huge)], false),
        (unique("tp-repeated"), vec![("traceparent", valid), ("traceparent", valid)], false),
    ];
    for (id, headers, _) in &forged {
        let value = request_file(id, "voice", &wav);
        send_with_headers(&producer, &topics.requests, id, &value, headers).await.expect("send");
    }

    let ids: Vec<&String> = forged.iter().map(|(id, ..)| id).collect();
    let cut_id = "h".repeat(256);
    let records = collect(&[&topics.results, &topics.dlq], Duration::from_secs(120), |got| {
        ids.iter().all(|id| got.contains_key(*id)) && got.get("").map_or(0, Vec::len) >= 103 && got.contains_key(&cut_id)
    })
    .await
    .expect("collect");
    for (id, _, copied) in &forged {
        let got = &records.get(id).unwrap_or_else(|| panic!("no output for {id}; log:\n{}", gateway.log_tail()))[0];
        assert_eq!(got.topic, topics.results, "{id} was processed normally: {}", got.value);
        match copied {
            true => {
                assert_eq!(got.header("traceparent"), Some(&valid[..]), "{id}");
                assert_eq!(got.header("tracestate"), Some(&b"rojo=00f067aa0ba902b7"[..]), "{id}");
            }
            false => {
                assert!(got.header("traceparent").is_none() && got.header("tracestate").is_none(), "{id}: {:?}", got.headers)
            }
        }
    }
    // The records with no usable id: their dead letters carry none, or the id cut to 256 bytes
    // (and, being larger than the broker takes with the value echoed, trimmed), each with the
    // reason in words.
    let cut = &records[&cut_id][0];
    assert_eq!(cut.value["error"]["kind"], "invalid_request", "{}", cut.value);
    let letters: Vec<String> = records
        .values()
        .flatten()
        .filter(|r| r.topic == topics.dlq)
        .map(|r| r.value["error"]["message"].as_str().unwrap_or_default().to_string())
        .collect();
    for needle in ["tombstone"].into_iter().chain(odd.iter().map(|(.., n)| *n)) {
        assert!(letters.iter().any(|m| m.contains(needle)), "no dead letter says '{needle}': {letters:#?}");
    }
    wait_committed(&gateway, &group, &topics.requests).await;
    // Nothing huge reached the log: the 900 KB id and the 10 KB headers are not in it.
    let log_bytes = std::fs::metadata(&gateway.service.log).map(|m| m.len()).unwrap_or(0);
    assert!(log_bytes < 64 * 1024, "gateway log is {log_bytes} bytes:\n{}", gateway.log_tail());
    let metrics = gateway.metrics().await.expect("metrics");
    let suppressed = metrics.sum("vramgate_gateway_log_lines_suppressed_total", &[("kind", "dead_letter")]);
    assert!(suppressed > 0.0, "the burst's dead-letter lines were rate-limited:\n{}", metrics.text);
    assert!(gateway.service.log.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_tells_a_missing_topic_and_a_worker_that_is_gone() {
    // The dead-letter topic is missing: the gateway runs, but is not ready, and says why.
    let topics = topics_but_the_dlq("ready").await;
    let Setup { _worker: mut worker, gateway, .. } = setup(&topics, "ready").await;
    let body = gateway.wait_readiness(|status, body| status == 503 && body["checks"]["kafka"] != "not checked yet").await;
    let kafka = body["checks"]["kafka"].as_str().unwrap_or_default();
    assert!(kafka.contains("topics missing") && kafka.contains(&topics.dlq), "{body}");

    vramgate_tests::create_topics(&[&topics.dlq], 1).await.expect("dlq topic");
    let body = gateway.wait_readiness(|status, _| status == 200).await;
    assert_eq!(body["ready"], true, "{body}");

    worker.service.kill().expect("kill worker");
    let body = gateway.wait_readiness(|status, _| status == 503).await;
    let worker = body["checks"].as_object().and_then(|c| c.iter().find(|(k, _)| k.starts_with("worker ")));
    assert!(worker.is_some_and(|(_, v)| v != "ok"), "{body}");
    // Liveness is not readiness: the process is fine.
    let live = reqwest::get(gateway.metrics_url.replace("/metrics", "/healthz")).await.expect("healthz");
    assert!(live.status().is_success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_sends_the_workers_bearer_token_and_a_wrong_one_is_a_clear_dead_letter() {
    let token = "s3cret-token-for-the-test";
    let worker = start_worker(&worker_config(&format!("auth_token = \"{token}\"\n"), &[VAD_MODEL])).await.expect("worker");
    let root = scratch_dir("token");
    let wav = root.join("noise.wav");
    write_wav(&wav, &noise(8_000, 0.05, 3), 16_000, 1, SampleFormat::I16).expect("write wav");
    let run = |with_token: Option<&str>, prefix: &'static str| {
        let (worker_url, root, wav) = (worker.url.clone(), root.clone(), wav.clone());
        let with_token = with_token.map(str::to_string);
        async move {
            let topics = TaskTopics::create(prefix, 1).await.expect("topics");
            let mut env = gateway_base_env(&unique("gw"), &worker_url, &root);
            env.extend(voice_task_env(&topics));
            env.push(("TASKS__IMAGE__ENABLED", "false".into()));
            if let Some(t) = with_token {
                env.push(("WORKER__AUTH_TOKEN", t));
            }
            let gateway = start_gateway(&env).await.expect("gateway");
            let id = unique(prefix);
            send(&producer(), &topics.requests, &id, &request_file(&id, "voice", &wav)).await.expect("send");
            let records = collect(&[&topics.results, &topics.dlq], Duration::from_secs(60), |got| got.contains_key(&id))
                .await
                .expect("collect");
            let got = records.get(&id).unwrap_or_else(|| panic!("no output; log:\n{}", gateway.log_tail()))[0].clone();
            let log = std::fs::read_to_string(&gateway.service.log).unwrap_or_default();
            (got, log)
        }
    };
    let (got, log) = run(Some(token), "token-ok").await;
    assert!(got.topic.ends_with(".results"), "with the token: {}", got.value);
    assert!(!log.contains(token), "the token is never logged");
    let (got, _) = run(Some("wrong"), "token-wrong").await;
    assert_eq!(got.value["error"]["kind"], "worker_rejected", "{}", got.value);
    assert!(got.value["error"]["message"].as_str().is_some_and(|m| m.contains("401")), "{}", got.value);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_make_the_gateway_not_ready_with_a_clear_reason_and_no_password_in_the_log() {
    // The test broker's listener is PLAINTEXT: a client that insists on SASL fails to
    // authenticate, as one with a wrong password would.
    let topics = TaskTopics::create("sasl", 1).await.expect("topics");
    let root = scratch_dir("sasl");
    let password = "987654321";
    let config = root.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "[kafka.properties]\n\"security.protocol\" = \"SASL_PLAINTEXT\"\n\"sasl.mechanism\" = \"PLAIN\"\n\
             \"sasl.username\" = \"vramgate\"\n\"sasl.password\" = {password}\n"
        ),
    )
    .expect("write config");
    let mut env = gateway_base_env(&unique("gw"), "http://127.0.0.1:9", &root);
    env.extend(voice_task_env(&topics));
    env.push(("TASKS__IMAGE__ENABLED", "false".into()));
    env.push(("CONFIG", config.display().to_string()));
    let gateway = start_gateway(&env).await.expect("gateway starts");
    let body = gateway.wait_readiness(|status, body| {
        status == 503 && body["checks"]["kafka"].as_str().is_some_and(|k| k.contains("authentication"))
    })
    .await;
    assert_eq!(body["ready"], false, "{body}");
    let log = std::fs::read_to_string(&gateway.service.log).unwrap_or_default();
    assert!(log.contains("kafka authentication failed"), "log:\n{}", gateway.log_tail());
    assert!(!log.contains(password), "the password is never logged");
    assert!(log.len() < 64 * 1024, "{} bytes of log in a few seconds", log.len());
    let metrics = gateway.metrics().await.expect("metrics");
    let auth = metrics.sum("vramgate_gateway_kafka_client_errors_total", &[("kind", "authentication")]);
    assert!(auth >= 1.0, "authentication failures are counted:\n{}", metrics.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_the_broker_refuses_for_a_while_is_retried_and_lands_once() {
    // Records refused before any worker call (their input is missing) have their dead letter
    // produced at once, and finished by its acknowledgement. Here the dead-letter topic is
    // missing at first and an output times out after 1.5 s, so every first attempt fails: the
    // records must go on to the retries, hold their commit back meanwhile, and land exactly
    // once when the topic appears.
    let topics = topics_but_the_dlq("dlq-later").await;
    let worker = start_worker(&worker_config("", &[VAD_MODEL])).await.expect("worker");
    let root = scratch_dir("dlq-later");
    let group = unique("gw");
    let mut env = gateway_base_env(&group, &worker.url, &root);
    env.extend(voice_task_env(&topics));
    env.push(("TASKS__IMAGE__ENABLED", "false".into()));
    env.push(("KAFKA__PROPERTIES__MESSAGE_TIMEOUT_MS", "1500".into()));
    let gateway = start_gateway(&env).await.expect("gateway");

    let producer = producer();
    let ids: Vec<String> = (0..3).map(|i| unique(&format!("missing-{i}"))).collect();
    for id in &ids {
        let body = request_file(id, "voice", &root.join(format!("{id}.wav")));
        send(&producer, &topics.requests, id, &body).await.expect("send");
    }

    // Wait for the first attempts to fail and be retried.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let metrics = gateway.metrics().await.expect("metrics");
        if metrics.sum("vramgate_gateway_produce_retries_total", &[]) >= ids.len() as f64 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no retries yet; log:\n{}", gateway.log_tail());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        uncommitted_records(&group, &topics.requests).expect("offsets"),
        ids.len() as i64,
        "nothing is committed while the dead letters are refused"
    );

    vramgate_tests::create_topics(&[&topics.dlq], 1).await.expect("dlq topic");
    let records = collect(&[&topics.results, &topics.dlq], Duration::from_secs(60), |got| {
        ids.iter().all(|id| got.contains_key(id))
    })
    .await
    .expect("collect");
    wait_committed(&gateway, &group, &topics.requests).await;
    // Read again after the commit: a retry that doubled an output would show by now.
    let records_after = collect(&[&topics.dlq], Duration::from_secs(2), |_| false).await.expect("collect");
    for id in &ids {
        let got = records.get(id).unwrap_or_else(|| panic!("no dead letter for {id}; log:\n{}", gateway.log_tail()));
        assert_eq!(got[0].topic, topics.dlq);
        assert_eq!(got[0].value["error"]["kind"], "input_not_found", "{}", got[0].value);
        assert_eq!(records_after.get(id).map_or(0, Vec::len), 1, "{id} was written exactly once");
    }
    // The retry's log line names its record, though a first attempt has no span while nothing
    // exports.
    let log = std::fs::read_to_string(&gateway.service.log).expect("gateway log");
    let retried = log.lines().find(|l| l.contains("produce failed; retrying")).expect("a retry was logged");
    assert!(ids.iter().any(|id| retried.contains(&format!("event_id={id}"))), "{retried}");
    assert!(retried.contains(&format!("messaging.destination.name={}", topics.requests)), "{retried}");
    let metrics = gateway.metrics().await.expect("metrics");
    assert_eq!(
        metrics.sum("vramgate_gateway_dead_letters_total", &[("kind", "input_not_found")]),
        ids.len() as f64,
        "{}",
        metrics.text
    );
    drop(worker);
}
