//! Kafka over TLS on the real broker's TLS listeners (`scripts/broker start --tls`): the real
//! gateway and worker process voice events with the gateway on SASL_SSL + SCRAM-SHA-512,
//! configured by environment variables as a Kubernetes Secret would set them; `vramgate-cli`
//! produces over SASL_SSL (a client properties file) and watches over mTLS (`--kafka-property`);
//! a wrong password and an untrusted CA each leave the gateway running, not ready, saying why,
//! and never printing the password; the Kubernetes component's Secret translation gets the
//! gateway onto SASL_SSL.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use vramgate_tests::tls::{tls_broker, TlsBroker};
use vramgate_tests::wav::{compose, speak, write_wav, SampleFormat};
use vramgate_tests::{
    collect, gateway_base_env, scratch_dir, start_gateway, start_worker, unique, voice_task_env, worker_config, Gateway,
    TaskTopics, VAD_MODEL,
};

/// The gateway's environment for the voice task on `topics`, its Kafka settings as
/// `VRAMGATE_GATEWAY_KAFKA__…` variables (the underscore form of librdkafka's names).
fn gateway_env(tls: &TlsBroker, topics: &TaskTopics, worker_url: &str, root: &Path, password: &str, ca: Option<&Path>) -> Vec<(&'static str, String)> {
    let mut env = gateway_base_env(&unique("gw-tls"), worker_url, root);
    env.extend(voice_task_env(topics));
    env.extend([
        ("TASKS__IMAGE__ENABLED", "false".into()),
        ("KAFKA__BROKERS", tls.sasl_ssl.clone()),
        ("KAFKA__PROPERTIES__SECURITY_PROTOCOL", "SASL_SSL".into()),
        ("KAFKA__PROPERTIES__SASL_MECHANISM", tls.mechanism.clone()),
        ("KAFKA__PROPERTIES__SASL_USERNAME", tls.user.clone()),
        ("KAFKA__PROPERTIES__SASL_PASSWORD", password.to_string()),
    ]);
    if let Some(ca) = ca {
        env.push(("KAFKA__PROPERTIES__SSL_CA_LOCATION", ca.display().to_string()));
    }
    env
}

fn cli(args: &[&str]) -> Output {
    Command::new(vramgate_tests::binary("vramgate-cli")).args(args).output().expect("running vramgate-cli")
}

/// `vramgate-cli produce` of the WAV files in `root` to `topic` over SASL_SSL with `password`,
/// its settings in a client properties file (so the password is not on its command line).
fn produce_over_sasl_ssl(tls: &TlsBroker, password: &str, topic: &str, root: &Path) -> Output {
    let properties = root.join("client.properties");
    let lines: Vec<String> = tls.sasl_ssl_properties(password).iter().map(|(k, v)| format!("{k}={v}")).collect();
    std::fs::write(&properties, lines.join("\n")).expect("write properties");
    let properties = properties.display().to_string();
    let root = root.display().to_string();
    cli(&["--brokers", &tls.sasl_ssl, "--kafka-config", &properties, "produce", "--task", "voice", "--topic", topic, &root])
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

fn log_of(gateway: &Gateway) -> String {
    std::fs::read_to_string(&gateway.service.log).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn voice_events_flow_through_a_gateway_on_sasl_ssl_and_the_cli_produces_and_watches_over_tls() {
    let tls = tls_broker();
    let topics = TaskTopics::create("tls-voice", 2).await.expect("topics");
    let root = scratch_dir("tls-voice");
    let worker = start_worker(&worker_config("", &[VAD_MODEL])).await.expect("worker starts");
    let env = gateway_env(tls, &topics, &worker.url, &root, &tls.password, Some(&tls.ca));
    let mut gateway = start_gateway(&env).await.expect("gateway starts");

    // Two spoken clips, sent by vramgate-cli over SASL_SSL.
    let speech = speak("The gateway reads its requests over TLS.").expect("espeak-ng speaks");
    for i in 0..2u64 {
        let clip = compose(Some(&speech), 0.5, 0.5, 16_000, 1, i);
        write_wav(&root.join(format!("tls-{i}.wav")), &clip.samples, 16_000, 1, SampleFormat::I16).expect("write wav");
    }
    let produced = produce_over_sasl_ssl(tls, &tls.password, &topics.requests, &root);
    assert!(produced.status.success(), "vramgate-cli produce over SASL_SSL failed:\n{}", text(&produced));
    let ids: Vec<String> = String::from_utf8_lossy(&produced.stdout)
        .lines()
        .filter_map(|l| l.split(['\t', ' ', ',']).next())
        .filter(|id| !id.is_empty())
        .map(str::to_string)
        .collect();
    assert_eq!(ids.len(), 2, "one id per clip:\n{}", text(&produced));

    // The gateway's results, read back over the plaintext listener by the tests' own client.
    let records = collect(&[&topics.results, &topics.dlq], Duration::from_secs(180), |got| {
        ids.iter().all(|id| got.contains_key(id))
    })
    .await
    .expect("collect");
    for id in &ids {
        let got = records.get(id).unwrap_or_else(|| panic!("no output for {id}; gateway log:\n{}", gateway.log_tail()));
        let value = &got[0].value;
        assert_eq!(got[0].topic, topics.results, "{id} was dead-lettered: {value}");
        assert_eq!(value["status"], "ok", "{value}");
        assert!(value["output"]["segments"].as_array().is_some_and(|s| !s.is_empty()), "speech found: {value}");
    }
    let ready = gateway.wait_readiness(|status, _| status == 200).await;
    assert_eq!(ready["checks"]["kafka"], "ok", "{ready}");

    // vramgate-cli watch over the mTLS listener, its settings as --kafka-property flags.
    let expect = root.join("ids.txt");
    std::fs::write(&expect, ids.join("\n")).expect("write ids");
    let mut args: Vec<String> = vec!["--brokers".into(), tls.ssl.clone()];
    for (k, v) in tls.mtls_properties() {
        args.extend(["--kafka-property".into(), format!("{k}={v}")]);
    }
    let topic_base = topics.results.trim_end_matches(".results").to_string();
    args.extend(["watch", "--task", &topic_base, "--timeout-seconds", "60", "--expect-ids"].map(String::from));
    args.push(expect.display().to_string());
    let watched = cli(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(watched.status.success(), "vramgate-cli watch over mTLS failed:\n{}", text(&watched));
    for id in &ids {
        assert!(String::from_utf8_lossy(&watched.stdout).contains(id.as_str()), "{id} watched:\n{}", text(&watched));
    }

    let status = gateway.service.terminate(Duration::from_secs(30)).await.expect("gateway stops");
    assert!(status.success(), "gateway exit: {status:?}");
    let log = log_of(&gateway);
    assert!(!log.contains(&tls.password), "the SCRAM password is never logged");

    // With a wrong password, vramgate-cli fails (within its connect timeout, not librdkafka's
    // five-minute delivery timeout) and says why, without printing the password.
    let wrong = format!("wrong-{}", unique("pw"));
    let refused = produce_over_sasl_ssl(tls, &wrong, &topics.requests, &root);
    let said = text(&refused);
    assert!(!refused.status.success(), "produce with a wrong password succeeded:\n{said}");
    assert!(said.contains("no answer from the Kafka brokers") && said.contains("Authentication failed"), "{said}");
    assert!(!said.contains(&wrong), "the password is never printed:\n{said}");
}

/// Starts a gateway on the SASL_SSL listener that cannot connect, waits until it says why on
/// `/readyz`, and checks it keeps running, logs the reason within bounds, and never prints
/// `password`. Returns the readiness reason.
async fn refused(name: &str, password: &str, ca: Option<&Path>, want: &str) -> String {
    let tls = tls_broker();
    let topics = TaskTopics::create(name, 1).await.expect("topics");
    let root = scratch_dir(name);
    let mut gateway = start_gateway(&gateway_env(tls, &topics, "http://127.0.0.1:9", &root, password, ca))
        .await
        .expect("gateway starts");
    let body = gateway
        .wait_readiness(|status, body| status == 503 && body["checks"]["kafka"].as_str().is_some_and(|k| k.contains(want)))
        .await;
    let reason = body["checks"]["kafka"].as_str().unwrap_or_default().to_string();
    assert!(gateway.service.is_running(), "the gateway keeps running; log:\n{}", gateway.log_tail());
    let log = log_of(&gateway);
    assert!(log.contains("kafka authentication failed"), "the log says what failed:\n{}", gateway.log_tail());
    assert!(log.contains(want), "the log carries the broker's reason:\n{}", gateway.log_tail());
    assert!(log.len() < 64 * 1024, "{} bytes of log in a few seconds", log.len());
    let metrics = gateway.metrics().await.expect("metrics");
    assert!(metrics.sum("vramgate_gateway_kafka_client_errors_total", &[("kind", "authentication")]) >= 1.0);
    for shown in [&log, &metrics.text, &body.to_string()] {
        assert!(!shown.contains(password), "the password is never printed");
    }
    let status = gateway.service.terminate(Duration::from_secs(30)).await.expect("gateway stops on SIGTERM");
    assert!(status.success(), "gateway exit: {status:?}");
    reason
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_scram_password_leaves_the_gateway_not_ready_saying_so_without_printing_it() {
    let tls = tls_broker();
    let wrong = format!("wrong-{}", unique("pw"));
    let reason = refused("tls-wrong-password", &wrong, Some(&tls.ca), "Authentication failed").await;
    assert!(reason.contains("SCRAM-SHA-512") || reason.contains("credentials"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_certificate_from_an_untrusted_ca_is_reported_as_a_failed_verification() {
    // No ssl.ca.location: the system's CAs, which do not include the test broker's CA.
    let tls = tls_broker();
    let reason = refused("tls-untrusted-ca", &tls.password, None, "certificate verify failed").await;
    assert!(reason.contains("ssl.ca.location"), "the reason names the setting to fix: {reason}");
}

/// The init script of the Kubernetes component `kafka-sasl`, as its manifest carries it, with
/// its paths moved: the Secret's folder, the ConfigMap's `gateway.toml`, the output folder.
fn kafka_sasl_init_script(auth: &Path, run: &Path) -> String {
    let manifest = std::fs::read_to_string(vramgate_tests::repo_root().join("k8s/components/kafka-sasl/gateway.yaml"))
        .expect("reading the component");
    let mut lines = manifest.lines().skip_while(|l| l.trim_end() != "            - |").skip(1);
    let mut script = String::new();
    for line in lines.by_ref() {
        match line.strip_prefix("              ") {
            Some(text) => script.push_str(text),
            None if line.trim().is_empty() => {}
            None => break,
        }
        script.push('\n');
    }
    let config = vramgate_tests::repo_root().join("k8s/base/config/gateway.toml");
    script
        .replace("/etc/vramgate/kafka-auth", &auth.display().to_string())
        .replace("/etc/vramgate/gateway.toml", &config.display().to_string())
        .replace("/run/vramgate", &run.display().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_components_secret_translation_gets_the_gateway_onto_sasl_ssl() {
    // A Secret as docs/kubernetes.md says to create it, given to the component's own script;
    // the gateway started on the file it writes must reach the broker over SASL_SSL.
    let tls = tls_broker();
    let topics = TaskTopics::create("tls-k8s", 1).await.expect("topics");
    let root = scratch_dir("tls-k8s");
    let (auth, run) = (root.join("auth"), root.join("run"));
    std::fs::create_dir_all(&auth).expect("auth folder");
    std::fs::create_dir_all(&run).expect("run folder");
    let ca = std::fs::read(&tls.ca).expect("reading the CA");
    let secret: [(&str, &[u8]); 5] = [
        ("sasl", b"scram_sha512"),
        ("username", tls.user.as_bytes()),
        ("password", tls.password.as_bytes()),
        ("tls", b"enable"),
        ("ca", &ca),
    ];
    for (key, value) in secret {
        std::fs::write(auth.join(key), value).expect("writing the Secret's key");
    }
    let script = root.join("init.sh");
    std::fs::write(&script, kafka_sasl_init_script(&auth, &run)).expect("writing the script");
    let ran = Command::new("sh").arg(&script).output().expect("running sh");
    assert!(ran.status.success(), "the init script failed:\n{}", text(&ran));
    assert!(!text(&ran).contains(&tls.password), "the init script prints nothing of the password");

    let mut env = gateway_base_env(&unique("gw-k8s"), "http://127.0.0.1:9", &root);
    env.extend(voice_task_env(&topics));
    env.extend([
        ("TASKS__IMAGE__ENABLED", "false".into()),
        ("KAFKA__BROKERS", tls.sasl_ssl.clone()),
        ("CONFIG", run.join("gateway.toml").display().to_string()),
    ]);
    let mut gateway = start_gateway(&env).await.expect("gateway starts");
    let body = gateway.wait_readiness(|_, body| body["checks"]["kafka"] == "ok").await;
    assert_eq!(body["checks"]["kafka"], "ok", "{body}");
    let status = gateway.service.terminate(Duration::from_secs(30)).await.expect("gateway stops");
    assert!(status.success(), "gateway exit: {status:?}");
    assert!(!log_of(&gateway).contains(&tls.password), "the SCRAM password is never logged");
}
