//! Object storage, end to end: a real S3-compatible server (SeaweedFS, started by
//! `scripts/object-store`), the real broker, gateway and worker.
//! - Inputs: an event naming `s3://bucket/key` gets the result the same bytes get by `file://`;
//!   every failure of storage is a dead letter naming the object or the limit, and the next
//!   event goes on; a server that goes away and comes back costs retries, not events.
//! - Outputs (the claim check): a `[1, 512, 512]` map stored as `.npy` and as a mask PNG the
//!   input photograph's size; read back, they equal the model's own output, and the result names
//!   them with their SHA-256.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vramgate_tests::agree;
use vramgate_tests::object_store::ObjectServer;
use vramgate_tests::wav::{change_rate, speak, write_wav, SampleFormat};
use vramgate_tests::{
    collect, photo, producer, Collector, Isolation, python_check, repo_root, request_file, scratch_dir, send,
    start_gateway_config_with, start_worker, unique, venv_python, worker_config, Received, TaskTopics,
    FACE_MODELS, VAD_MODEL,
};

/// The S3 ports of this file's servers, one per test (the default, 18333, is left to the
/// user's).
const PORT: u16 = 18_433;
const OUTPUTS_PORT: u16 = 18_443;
const EXACTLY_ONCE_PORT: u16 = 18_453;
/// `input.max_input_bytes` for the test's gateway: the oversized object is just past it.
const MAX_INPUT_BYTES: u64 = 8 << 20;

fn request_uri(id: &str, task: &str, uri: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({"id": id, "task": task, "input": {"uri": uri}})).expect("json")
}

/// A result without what differs between two runs of the same input.
fn comparable(record: &Received) -> Value {
    let mut value = record.value.clone();
    for key in ["id", "timings_ms"] {
        value.as_object_mut().expect("an object").remove(key);
    }
    value
}

/// The classifier from the model repository, as `models.rs` configures it.
fn classifier_repository(root: &Path) -> std::path::PathBuf {
    let repository = root.join("repository");
    let folder = repository.join("classifier");
    std::fs::create_dir_all(&folder).expect("model folder");
    let from = repo_root().join("models/repository/mobilenet_v2/model.pt");
    assert!(from.is_file(), "{} missing: run scripts/setup", from.display());
    std::fs::copy(&from, folder.join("model.pt")).expect("copying the model");
    std::fs::write(
        folder.join("config.toml"),
        "input = { name = \"image\", datatype = \"UINT8\", shape = [-1, 224, 224, 3] }\n\
         outputs = [{ name = \"logits\", shape = [-1, 1000] }]\n",
    )
    .expect("config.toml");
    repository
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_inputs_get_the_results_their_files_get_and_each_storage_failure_is_a_dead_letter() {
    let root = scratch_dir("s3-inputs");
    let server = ObjectServer::start(PORT).expect("the object store starts (scripts/object-store)");

    // --- The samples, on disk and in the bucket. -------------------------------------------
    let speech = speak("Objects in a bucket are read by the gateway, and the worker listens.").expect("espeak-ng");
    let wav = root.join("speech.wav");
    write_wav(&wav, &change_rate(&speech.samples, speech.sample_rate, 16_000), 16_000, 1, SampleFormat::I16).expect("wav");
    let mut files = vec![("voice", wav)];
    for name in ["t1.jpg", "astronaut.png"] {
        let to = root.join(name);
        std::fs::copy(photo(name), &to).expect("copying a photograph");
        files.push(("image", to));
    }
    let coffee = root.join("coffee.png");
    std::fs::copy(photo("coffee.png"), &coffee).expect("copying a photograph");
    files.push(("classify", coffee));
    for (task, file) in &files {
        let key = format!("{task}/{}", file.file_name().expect("a name").to_string_lossy());
        server.put("samples", &key, std::fs::read(file).expect("read")).await.expect("put a sample");
    }
    server.put("samples", "image/not-an-image.jpg", b"this is text, not a JPEG".to_vec()).await.expect("put");
    server.put("samples", "image/huge.png", vec![0u8; MAX_INPUT_BYTES as usize + 1]).await.expect("put");
    server.put("forbidden", "image/t1.jpg", std::fs::read(photo("t1.jpg")).expect("read")).await.expect_err("the test identity may not write there");

    // --- The worker and a gateway that reads the two buckets. ----------------------------
    let repository = classifier_repository(&root);
    let mut models = FACE_MODELS.to_vec();
    models.push(VAD_MODEL);
    let worker = start_worker(&worker_config(&format!("model_repository = \"{}\"", repository.display()), &models))
        .await
        .expect("the worker starts");
    let (voice, image, classify) = (
        TaskTopics::create(&unique("s3-voice"), 1).await.expect("topics"),
        TaskTopics::create(&unique("s3-image"), 1).await.expect("topics"),
        TaskTopics::create(&unique("s3-classify"), 1).await.expect("topics"),
    );
    let topics = |t: &TaskTopics| format!("requests_topic = \"{}\"\nresults_topic = \"{}\"\ndlq_topic = \"{}\"\n", t.requests, t.results, t.dlq);
    // https:// inputs (here plain http://, on loopback) from two listed hosts: the object
    // store's filer, which serves the same files over HTTP, and a server that redirects every
    // request to it, which must not be followed.
    let filer = format!("127.0.0.1:{}", server.port + 6);
    let mut redirector = std::process::Command::new(venv_python())
        .args(["-c", REDIRECTOR, &format!("http://{filer}/buckets/samples/image/t1.jpg")])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the redirecting server");
    let redirect = {
        use std::io::BufRead;
        let mut line = String::new();
        std::io::BufReader::new(redirector.stdout.take().expect("stdout")).read_line(&mut line).expect("its port");
        format!("127.0.0.1:{}", line.trim())
    };
    let config = root.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "commit_interval_ms = 200\n\n[kafka]\ngroup_id = \"{group}\"\n\n[worker]\nurl = \"{worker}\"\n\n\
             [input]\nfile_root = \"{root}\"\nmax_input_bytes = {MAX_INPUT_BYTES}\n\n\
             [input.http]\nhosts = [\"{filer}\", \"{redirect}\"]\nallow_http = true\nrequest_timeout_seconds = 5.0\nmax_retries = 2\nretry_timeout_seconds = 3.0\n\n\
             [s3]\nbuckets = [\"samples\", \"forbidden\"]\nendpoint = \"{endpoint}\"\nallow_http = true\nrequest_timeout_seconds = 5.0\n\n\
             [tasks.voice]\n{voice}\n[tasks.image]\n{image}\n\
             [tasks.classify]\nconverter = \"image\"\nmodel = \"classifier\"\n{classify}\n\
             [tasks.classify.image]\nmode = \"tensor\"\nresize = \"shorter_side_crop\"\nshorter_side = 256\nwidth = 224\nheight = 224\n\
             layout = \"nhwc\"\ndatatype = \"UINT8\"\n\n\
             [[tasks.classify.outputs]]\nname = \"logits\"\npost = [\"softmax\", \"top_k\"]\ntop_k = 5\n",
            group = unique("s3-gw"),
            worker = worker.url,
            root = root.display(),
            endpoint = server.endpoint(),
            voice = topics(&voice),
            image = topics(&image),
            classify = topics(&classify),
        ),
    )
    .expect("gateway.toml");
    // Credentials through the AWS chain's environment variables, as a deployment gives them.
    let aws: Vec<(&str, &str)> = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
        .iter()
        .map(|k| (*k, server.var(k).expect("scripts/object-store env exports it")))
        .collect();
    let gateway = start_gateway_config_with(&config, &[], &aws).await.expect("the gateway starts");
    let topic = |task: &str| match task {
        "voice" => voice.requests.clone(),
        "image" => image.requests.clone(),
        _ => classify.requests.clone(),
    };
    let outputs: Vec<&str> =
        [&voice.results, &voice.dlq, &image.results, &image.dlq, &classify.results, &classify.dlq].map(String::as_str).to_vec();

    // --- Each sample by file:// and by s3://: the same result. ----------------------------
    let producer = producer();
    let mut pairs = Vec::new();
    for (task, file) in &files {
        let name = file.file_name().expect("a name").to_string_lossy().into_owned();
        let (by_file, by_key) = (unique(&format!("file-{task}")), unique(&format!("s3-{task}")));
        send(&producer, &topic(task), &by_file, &request_file(&by_file, task, file)).await.expect("send");
        let uri = format!("s3://samples/{task}/{name}");
        send(&producer, &topic(task), &by_key, &request_uri(&by_key, task, &uri)).await.expect("send");
        let by_url = unique(&format!("url-{task}"));
        let url = format!("http://{filer}/buckets/samples/{task}/{name}");
        send(&producer, &topic(task), &by_url, &request_uri(&by_url, task, &url)).await.expect("send");
        pairs.push((name, by_file, by_key, by_url));
    }
    // --- Each failure of storage, then one good event after them. -----------------------
    let elsewhere = format!("http://localhost:{}/buckets/samples/image/t1.jpg", server.port + 6);
    let redirected = format!("http://{redirect}/t1.jpg");
    let failures: Vec<(String, &str, &str, &str, Vec<&str>)> = vec![
        (unique("missing"), "image", "s3://samples/image/no-such-key.jpg", "input_not_found", vec!["s3://samples/image/no-such-key.jpg", "not found"]),
        (unique("denied"), "image", "s3://forbidden/image/t1.jpg", "fetch_failed", vec!["s3://forbidden/image/t1.jpg", "may not be read"]),
        (unique("unlisted"), "image", "s3://elsewhere/t1.jpg", "unsupported_input", vec!["'elsewhere'", "s3.buckets"]),
        (unique("text"), "image", "s3://samples/image/not-an-image.jpg", "invalid_image", vec![]),
        (unique("huge"), "image", "s3://samples/image/huge.png", "input_too_large", vec!["limit of 8388608 bytes", "max_input_bytes"]),
        (unique("host"), "image", &elsewhere, "unsupported_input", vec!["'localhost:", "input.http.hosts"]),
        (unique("metadata"), "image", "http://169.254.169.254/latest/meta-data/iam", "unsupported_input", vec!["'169.254.169.254'"]),
        (unique("redirect"), "image", &redirected, "fetch_failed", vec![&redirected, "302"]),
    ];
    for (id, task, uri, _, _) in &failures {
        send(&producer, &topic(task), id, &request_uri(id, task, uri)).await.expect("send");
    }
    let after = unique("after");
    send(&producer, &image.requests, &after, &request_uri(&after, "image", "s3://samples/image/t1.jpg")).await.expect("send");

    let mut ids: Vec<String> = pairs.iter().flat_map(|(_, a, b, c)| [a.clone(), b.clone(), c.clone()]).collect();
    ids.extend(failures.iter().map(|f| f.0.clone()));
    ids.push(after.clone());
    let got = collect(&outputs, Duration::from_secs(300), |got| ids.iter().all(|id| got.contains_key(id))).await.expect("collect");
    let one = |id: &str| -> &Received {
        let records = got.get(id).unwrap_or_else(|| panic!("no output for {id}; gateway log:\n{}", gateway.log_tail()));
        assert_eq!(records.len(), 1, "{id}: {records:?}");
        &records[0]
    };
    for (name, by_file, by_key, by_url) in &pairs {
        let (file, key, url) = (one(by_file), one(by_key), one(by_url));
        assert_eq!(file.value["status"], "ok", "{name} by file: {}", file.value);
        for (how, other) in [("s3://", key), ("http://", url)] {
            let differ = agree::difference(&comparable(other), &comparable(file));
            assert!(differ.is_none(), "{name}: {how} and file:// differ at {}\n{}\n{}", differ.unwrap_or_default(), other.value, file.value);
        }
        eprintln!("{name}: the same result by s3://, http:// and file:// (model {})", key.value["model"]);
    }
    for (id, _, uri, kind, needles) in &failures {
        let record = one(id);
        assert_eq!(record.topic, image.dlq, "{uri}: {}", record.value);
        assert_eq!(record.value["error"]["kind"], *kind, "{uri}: {}", record.value);
        let message = record.value["error"]["message"].as_str().unwrap_or_default();
        for needle in needles {
            assert!(message.contains(needle), "{uri}: '{message}' does not say '{needle}'");
        }
        assert!(!message.contains(server.var("AWS_SECRET_ACCESS_KEY").expect("secret")), "a secret in a dead letter");
        eprintln!("{uri}: {kind}: {message}");
    }
    assert_eq!(one(&after).value["status"], "ok", "the event after the failures: {}", one(&after).value);

    // --- The server stopped mid-run and started again: retries, then every result. -------
    server.stop().expect("stop the object store");
    let stopped_at = Instant::now();
    let during: Vec<String> = (0..4).map(|i| unique(&format!("outage{i}"))).collect();
    for id in &during {
        send(&producer, &voice.requests, id, &request_uri(id, "voice", "s3://samples/voice/speech.wav")).await.expect("send");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    server.restart().expect("restart the object store");
    eprintln!("outage: the object store was down for {:.1?}", stopped_at.elapsed());
    let back = collect(&[&voice.results, &voice.dlq], Duration::from_secs(180), |got| during.iter().all(|id| got.contains_key(id)))
        .await
        .expect("collect");
    let want = comparable(one(&pairs[0].1));
    for id in &during {
        let records = back.get(id).unwrap_or_else(|| panic!("{id} lost over the outage; gateway log:\n{}", gateway.log_tail()));
        assert_eq!(records.len(), 1, "{id}: {records:?}");
        let differ = agree::difference(&comparable(&records[0]), &want);
        assert!(differ.is_none(), "{id} over the outage differs at {}: {}", differ.unwrap_or_default(), records[0].value);
    }
    let scrape = gateway.metrics_when(Duration::from_secs(30), |m| m.sum("vramgate_gateway_held_bytes", &[]) == 0.0).await;
    assert!(scrape.is_ok(), "bytes still held after every event ended");
    let _ = redirector.kill();
}

/// An HTTP server on a free port (printed first) that answers every request with a 302 to the
/// URL it is given.
const REDIRECTOR: &str = r#"
import http.server, sys

class H(http.server.BaseHTTPRequestHandler):
    def redirect(self):
        self.send_response(302)
        self.send_header("Location", sys.argv[1])
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = redirect

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_map_too_big_for_a_record_is_stored_as_npy_and_as_a_mask_png_and_the_result_names_them() {
    let root = scratch_dir("s3-outputs");
    let server = ObjectServer::start(OUTPUTS_PORT).expect("the object store starts (scripts/object-store)");

    red_map_repository(&root);
    let worker = start_worker(&worker_config(&format!("model_repository = \"{}\"", root.join("repository").display()), &[]))
        .await
        .expect("the worker starts");

    // Two tasks on it: one stores to `outputs`, one to `forbidden` (which the gateway's
    // identity may not write: every event of it is a store_failed dead letter).
    let (segment, denied) =
        (TaskTopics::create(&unique("segment"), 1).await.expect("topics"), TaskTopics::create(&unique("denied"), 1).await.expect("topics"));
    let task = segment_task;
    let config = root.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "commit_interval_ms = 200\n\n[kafka]\ngroup_id = \"{}\"\n\n[worker]\nurl = \"{}\"\n\n[input]\nfile_root = \"{}\"\n\n{}\
             [tasks.voice]\nenabled = false\n\n[tasks.image]\nenabled = false\n\n{}{}",
            unique("s3-out-gw"),
            worker.url,
            root.display(),
            server.gateway_section(),
            task("segment", &segment, "s3://outputs/runs/"),
            task("denied", &denied, "s3://forbidden/runs/"),
        ),
    )
    .expect("gateway.toml");
    // This gateway's credentials come from its configuration (the environment's form of
    // s3.access_key_id / s3.secret_access_key), not the AWS chain the other tests use.
    let keys = server.gateway_keys();
    let gateway = start_gateway_config_with(&config, &keys, &[]).await.expect("the gateway starts");
    assert!(!gateway.service.log_text().contains(&keys[1].1), "the secret is in the gateway's log");

    // astronaut.png is the model input's size (the map is its red channel, exactly); coffee.png
    // (600 x 400) is letterboxed into it, and its mask comes back at 600 x 400.
    let producer = producer();
    let mut cases = Vec::new();
    for (name, mode) in [("astronaut.png", "exact"), ("coffee.png", "resized")] {
        let file = root.join(name);
        std::fs::copy(photo(name), &file).expect("copying a photograph");
        let id = format!("{}/{}", unique("seg"), name);
        send(&producer, &segment.requests, &id, &request_file(&id, "segment", &file)).await.expect("send");
        cases.push((id, file, mode));
    }
    let refused = unique("denied");
    send(&producer, &denied.requests, &refused, &request_file(&refused, "denied", &cases[0].1)).await.expect("send");
    let after = unique("after-denied");
    send(&producer, &segment.requests, &after, &request_file(&after, "segment", &cases[0].1)).await.expect("send");
    // Both photographs as one batch of frames: each frame's outputs stored under its own folder.
    let batch = unique("seg-frames");
    let frames: Vec<Value> = cases.iter().map(|c| json!({"uri": format!("file://{}", c.1.display())})).collect();
    let event = json!({"id": batch, "task": "segment", "input": {"frames": frames}});
    send(&producer, &segment.requests, &batch, &serde_json::to_vec(&event).expect("json")).await.expect("send");

    let mut ids: Vec<String> = cases.iter().map(|c| c.0.clone()).collect();
    ids.extend([refused.clone(), after.clone(), batch.clone()]);
    let got = collect(&[&segment.results, &segment.dlq, &denied.results, &denied.dlq], Duration::from_secs(300), |got| {
        ids.iter().all(|id| got.contains_key(id))
    })
    .await
    .expect("collect");
    let one = |id: &str| -> Value {
        let records = got.get(id).unwrap_or_else(|| panic!("no output for {id}; gateway log:\n{}", gateway.log_tail()));
        assert_eq!(records.len(), 1, "{id}: {records:?}");
        records[0].value.clone()
    };
    for (id, file, mode) in &cases {
        let result = one(id);
        assert_eq!(result["status"], "ok", "{id}: {result}");
        let mut local = Vec::new();
        for output in ["map", "mask"] {
            let reference = &result["output"]["outputs"][output];
            let uri = reference["uri"].as_str().unwrap_or_else(|| panic!("{id}: {output} has no uri: {result}"));
            let ext = if output == "map" { "npy" } else { "png" };
            // The key: <prefix><task>/<id>/<output>.<ext>, the id's '/' escaped.
            let want_key = format!("runs/segment/{}/{output}.{ext}", id.replace('/', "%2F"));
            assert_eq!(uri, format!("s3://outputs/{want_key}"), "{id}: {result}");
            let bytes = server.get("outputs", &want_key).await.expect("the stored object");
            assert_eq!(reference["bytes"].as_u64(), Some(bytes.len() as u64), "{id} {output}");
            let digest = sha256_hex(&bytes);
            assert_eq!(reference["sha256"].as_str(), Some(digest.as_str()), "{id} {output}");
            let path = root.join(format!("{}-{output}.{ext}", unique("read-back")));
            std::fs::write(&path, &bytes).expect("write");
            local.push(path);
        }
        assert_eq!(result["output"]["outputs"]["map"]["shape"], json!([1, 512, 512]));
        assert_eq!(result["output"]["outputs"]["map"]["datatype"], "FP32");
        let size = image::image_dimensions(file).expect("photo size");
        assert_eq!(result["output"]["outputs"]["mask"]["shape"], json!([size.1, size.0]), "the mask is the photo's size");
        let figures = python_check("stored_outputs_check.py", [file.as_os_str(), local[0].as_os_str(), local[1].as_os_str(), std::ffi::OsStr::new(mode)], || {
            gateway.log_tail()
        });
        eprintln!("{id}: stored map and mask agree with the photograph: {}", figures.trim());
    }
    let letter = one(&refused);
    assert_eq!(letter["error"]["kind"], "store_failed", "{letter}");
    assert_eq!(letter["error"]["stage"], "store", "{letter}");
    let message = letter["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(&format!("s3://forbidden/runs/denied/{refused}/")), "names the object: {message}");
    assert_eq!(one(&after)["status"], "ok", "the event after a failed store");
    let frames = one(&batch);
    for (i, (id, _, _)) in cases.iter().enumerate() {
        let reference = &frames["output"]["frames"][i]["output"]["outputs"]["mask"];
        let key = format!("runs/segment/{batch}.frame-{i}/mask.png");
        assert_eq!(reference["uri"].as_str(), Some(format!("s3://outputs/{key}").as_str()), "frame {i}: {frames}");
        let stored = server.get("outputs", &key).await.expect("the frame's stored mask");
        let single = server.get("outputs", &format!("runs/segment/{}/mask.png", id.replace('/', "%2F"))).await.expect("the photo's mask");
        assert_eq!(sha256_hex(&stored), sha256_hex(&single), "frame {i}'s mask is its photograph's");
        assert_eq!(reference["sha256"].as_str(), Some(sha256_hex(&stored).as_str()));
    }
    let scrape = gateway.metrics_when(Duration::from_secs(30), |m| m.sum("vramgate_gateway_held_bytes", &[]) == 0.0).await;
    assert!(scrape.is_ok(), "bytes still held after every event ended");
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A model whose `[1, 512, 512]` map is the red channel over 255 (tests/python/red_map_model.py),
/// in `root/repository/red_map`.
fn red_map_repository(root: &Path) {
    let folder = root.join("repository/red_map");
    std::fs::create_dir_all(&folder).expect("model folder");
    let status = std::process::Command::new(venv_python())
        .arg(repo_root().join("tests/python/red_map_model.py"))
        .arg(folder.join("model.pt"))
        .status()
        .expect("python");
    assert!(status.success(), "writing the model");
    std::fs::write(
        folder.join("config.toml"),
        "input = { name = \"image\", datatype = \"UINT8\", shape = [-1, 512, 512, 3] }\n\
         outputs = [{ name = \"map\", shape = [-1, 512, 512] }, { name = \"mask\", shape = [-1, 512, 512] }]\n",
    )
    .expect("config.toml");
}

/// A task row on the red-map model that stores its map (`.npy`) and its mask (PNG) at `store`.
fn segment_task(name: &str, topics: &TaskTopics, store: &str) -> String {
    format!(
        "[tasks.{name}]\nconverter = \"image\"\nmodel = \"red_map\"\nrequests_topic = \"{}\"\nresults_topic = \"{}\"\ndlq_topic = \"{}\"\n\n\
         [tasks.{name}.image]\nmode = \"tensor\"\nresize = \"letterbox\"\nwidth = 512\nheight = 512\nlayout = \"nhwc\"\ndatatype = \"UINT8\"\n\n\
         [[tasks.{name}.outputs]]\nname = \"map\"\nstore = \"{store}\"\n\n\
         [[tasks.{name}.outputs]]\nname = \"mask\"\npost = [\"mask_png\"]\nthreshold = 0.5\nstore = \"{store}\"\n\n",
        topics.requests, topics.results, topics.dlq
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_with_the_gateway_killed_mid_store_every_committed_result_names_an_object_that_matches() {
    const EVENTS: usize = 120;
    let root = scratch_dir("s3-eos");
    let server = ObjectServer::start(EXACTLY_ONCE_PORT).expect("the object store starts (scripts/object-store)");
    red_map_repository(&root);
    let worker = start_worker(&worker_config(&format!("model_repository = \"{}\"", root.join("repository").display()), &[]))
        .await
        .expect("the worker starts");
    let topics = TaskTopics::create(&unique("eos-segment"), 2).await.expect("topics");
    let config = root.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "commit_interval_ms = 100\ndelivery = \"exactly-once\"\ndrain_timeout_seconds = 2\n\n\
             [kafka]\ngroup_id = \"{}\"\ntransactional_id = \"{}\"\nsession_timeout_ms = 6000\ntransaction_timeout_ms = 10000\n\n\
             [worker]\nurl = \"{}\"\n\n[input]\nfile_root = \"{}\"\n\n\
             [s3]\nendpoint = \"{}\"\nallow_http = true\n\n\
             [tasks.voice]\nenabled = false\n\n[tasks.image]\nenabled = false\n\n{}",
            unique("s3-eos-gw"),
            unique("s3-eos-tx"),
            worker.url,
            root.display(),
            server.endpoint(),
            segment_task("segment", &topics, "s3://outputs/eos/"),
        ),
    )
    .expect("gateway.toml");
    let aws: Vec<(&str, &str)> =
        ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"].iter().map(|k| (*k, server.var(k).expect("exported"))).collect();

    // Photographs of both shapes, each event its own id.
    let photos: Vec<std::path::PathBuf> = ["astronaut.png", "coffee.png", "chelsea.png", "camera.png"]
        .iter()
        .map(|name| {
            let to = root.join(name);
            std::fs::copy(photo(name), &to).expect("copying a photograph");
            to
        })
        .collect();
    let producer = producer();
    let mut ids = Vec::new();
    for i in 0..EVENTS {
        let id = unique(&format!("eos{i}"));
        send(&producer, &topics.requests, &id, &request_file(&id, "segment", &photos[i % photos.len()])).await.expect("send");
        ids.push(id);
    }
    let wanted: HashSet<String> = ids.iter().cloned().collect();
    let committed = Collector::start_with(&[&topics.results, &topics.dlq], Isolation::ReadCommitted).expect("collector");
    let seen = |c: &Collector| c.with(|got| got.keys().filter(|k| wanted.contains(*k)).count());

    // The gateway SIGKILLed twice while it writes outputs (soon after results start to commit:
    // it writes about two objects per event as it goes), restarted under its transactional id.
    let mut gateway = start_gateway_config_with(&config, &[], &aws).await.expect("the gateway starts");
    let mut kills = Vec::new();
    for round in 0..2 {
        // The first kill once results commit; the second once the restarted gateway holds
        // records again (it is then writing their objects: two per event).
        if round == 0 {
            let reached = committed.wait_until(Duration::from_secs(300), |got| got.keys().filter(|k| wanted.contains(*k)).count() >= 5).await;
            assert!(reached, "only {} committed; gateway log:\n{}", seen(&committed), gateway.log_tail());
        } else {
            let busy = gateway.metrics_when(Duration::from_secs(120), |m| m.sum("vramgate_gateway_records_in_flight", &[]) >= 4.0).await;
            assert!(busy.is_ok(), "the restarted gateway took no records; log:\n{}", gateway.log_tail());
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        let held = gateway.metrics().await.map(|m| m.sum("vramgate_gateway_records_in_flight", &[])).unwrap_or(f64::NAN);
        let status = gateway.service.kill().expect("SIGKILL the gateway");
        kills.push(seen(&committed));
        eprintln!("gateway killed ({status}) with {} results committed and {held} records in flight", seen(&committed));
        gateway = start_gateway_config_with(&config, &[], &aws).await.expect("the gateway restarts");
    }
    let all = committed.wait_until(Duration::from_secs(400), |got| wanted.iter().all(|id| got.contains_key(id))).await;
    assert!(all, "{} of {EVENTS} committed; gateway log:\n{}", seen(&committed), gateway.log_tail());
    tokio::time::sleep(Duration::from_secs(2)).await;

    // One committed result per event, and every object it names exists with its SHA-256.
    let got = committed.snapshot();
    let mut digests: HashMap<String, String> = HashMap::new();
    for id in &ids {
        let records = &got[id];
        assert_eq!(records.len(), 1, "{id}: {} committed outputs", records.len());
        let result = &records[0].value;
        assert_eq!(result["status"], "ok", "{id}: {result}");
        for output in ["map", "mask"] {
            let reference = &result["output"]["outputs"][output];
            let uri = reference["uri"].as_str().unwrap_or_else(|| panic!("{id}: {result}"));
            let key = uri.strip_prefix("s3://outputs/").unwrap_or_else(|| panic!("{uri}"));
            let bytes = server.get("outputs", key).await.unwrap_or_else(|e| panic!("{uri} named by a committed result: {e}"));
            let digest = sha256_hex(&bytes);
            assert_eq!(reference["sha256"].as_str(), Some(digest.as_str()), "{uri}");
            digests.insert(uri.to_string(), digest);
        }
    }
    eprintln!(
        "exactly-once: {EVENTS} committed results (the gateway killed at {kills:?} committed), {} objects, each present with the SHA-256 its result names",
        digests.len()
    );
}
