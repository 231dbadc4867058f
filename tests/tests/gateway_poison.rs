//! The image task end to end (PNG and JPEG of many sizes, an EXIF rotation, faces inside the
//! picture), and poison records of every kind on single-partition topics: each becomes exactly
//! one dead letter with the right kind and Spring-style headers, the good record behind it is
//! still served, and the group's committed offsets end up covering every record.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use vramgate_tests::images::{self, crowd, jpeg, picture, png, with_exif_orientation};
use vramgate_tests::metrics::Scrape;
use vramgate_tests::wav::{compose, write_wav, SampleFormat};
use vramgate_tests::{
    gateway_base_env,
    collect, image_task_env, producer, request_file, request_inline, scratch_dir, send, start_gateway, start_worker,
    uncommitted_records, unique, voice_task_env, worker_config, Gateway, Position, Received, TaskTopics, PNET_MODEL,
    VAD_MODEL,
};

/// The image task's detection threshold, set explicitly so the score bound below is ours.
const THRESHOLD: f64 = 0.7;

fn base_env(group: &str, worker_url: &str, root: &Path) -> Vec<(&'static str, String)> {
    let mut env = gateway_base_env(group, worker_url, root);
    env.extend([
        ("COMMIT_INTERVAL_MS", "200".into()),
        ("TASKS__IMAGE__CPU_THREADS", "2".into()),
        ("TASKS__IMAGE__IMAGE__THRESHOLD", THRESHOLD.to_string()),
        ("TASKS__VOICE__CPU_THREADS", "2".into()),
    ]);
    env
}

/// One image sent to the gateway and what its result must say.
struct Case {
    label: String,
    bytes: Vec<u8>,
    format: &'static str,
    /// Width and height as viewed, after the EXIF orientation.
    viewed: (u32, u32),
    inline: bool,
}

fn cases() -> Vec<Case> {
    // Crowds of small faces (about 16 px once the image is letterboxed to 320 px) give P-Net
    // something to find, so the bounds checks below check boxes that exist.
    let crowd_of = |w: u32, h: u32, seed: u64| crowd(w, h, 16.0 * w.max(h) as f32 / 320.0, seed);
    let mut cases = Vec::new();
    let mut add = |label: &str, bytes: Vec<u8>, format: &'static str, viewed: (u32, u32), inline: bool| {
        cases.push(Case { label: label.to_string(), bytes, format, viewed, inline });
    };
    add("crowd 320x320 png", png(&crowd_of(320, 320, 1)), "png", (320, 320), false);
    add("crowd 640x480 jpeg", jpeg(&crowd_of(640, 480, 2), 90), "jpeg", (640, 480), true);
    add("crowd 480x640 png", png(&crowd_of(480, 640, 3)), "png", (480, 640), false);
    add("crowd 1200x300 jpeg", jpeg(&crowd_of(1200, 300, 4), 85), "jpeg", (1200, 300), false);
    add("crowd 300x1200 png", png(&crowd_of(300, 1200, 5)), "png", (300, 1200), true);
    add("portrait 64x64 png", png(&picture(64, 64, 6)), "png", (64, 64), false);
    add("portrait 33x47 jpeg", jpeg(&picture(33, 47, 7), 90), "jpeg", (33, 47), true);
    add("crowd 1024x768 jpeg q75", jpeg(&crowd_of(1024, 768, 8), 75), "jpeg", (1024, 768), false);
    add("portrait 800x800 png", png(&picture(800, 800, 9)), "png", (800, 800), false);
    add("crowd 2000x1500 jpeg", jpeg(&crowd_of(2000, 1500, 10), 85), "jpeg", (2000, 1500), false);
    add("crowd 150x100 png", png(&crowd_of(150, 100, 11)), "png", (150, 100), true);
    // Stored 400 wide and 240 high, EXIF orientation 6: viewed 240 wide and 400 high.
    let rotated = with_exif_orientation(&jpeg(&crowd_of(400, 240, 12), 90), 6);
    add("crowd 400x240 jpeg, EXIF orientation 6", rotated, "jpeg", (240, 400), false);
    cases
}

fn only<'a>(records: &'a BTreeMap<String, Vec<Received>>, id: &str, what: &str) -> &'a Received {
    let got = records.get(id).unwrap_or_else(|| panic!("no result or dead letter for {what} ({id})"));
    assert_eq!(got.len(), 1, "{what} ({id}) ended {} times: {got:?}", got.len());
    &got[0]
}

async fn terminate(gateway: &mut Gateway) {
    let status = gateway.service.terminate(Duration::from_secs(40)).await.expect("gateway stops");
    assert!(status.success(), "gateway exited with {status}; log:\n{}", gateway.log_tail());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_of_all_shapes_get_faces_inside_their_bounds() {
    let topics = TaskTopics::create("image-e2e", 3).await.expect("topics");
    let root = scratch_dir("image-e2e");
    let worker = start_worker(&worker_config("", &[PNET_MODEL])).await.expect("worker starts");
    let group = unique("gw");
    let mut env = base_env(&group, &worker.url, &root);
    env.extend(image_task_env(&topics));
    env.push(("TASKS__VOICE__ENABLED", "false".into()));
    let mut gateway = start_gateway(&env).await.expect("gateway starts");

    let producer = producer();
    let cases = cases();
    let mut ids = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let id = unique(&format!("img{i}"));
        let value = if case.inline {
            request_inline(&id, "image", &case.bytes)
        } else {
            let ext = if case.format == "png" { "png" } else { "jpg" };
            request_file(&id, "image", &images::write(&root, &format!("img-{i}.{ext}"), &case.bytes))
        };
        send(&producer, &topics.requests, &id, &value).await.expect("send");
        ids.push(id);
    }

    let records = collect(&[&topics.results, &topics.dlq], Duration::from_secs(180), |got| {
        ids.iter().all(|id| got.contains_key(id))
    })
    .await
    .expect("collect");
    let records: BTreeMap<String, Vec<Received>> = records.into_iter().collect();
    let missing: Vec<&str> =
        ids.iter().zip(&cases).filter(|(id, _)| !records.contains_key(*id)).map(|(_, c)| c.label.as_str()).collect();
    assert!(missing.is_empty(), "no output for {missing:?}; gateway log:\n{}", gateway.log_tail());

    let mut total_faces = 0;
    for (id, case) in ids.iter().zip(&cases) {
        let what = &case.label;
        let got = only(&records, id, what);
        assert_eq!(got.topic, topics.results, "{what} was dead-lettered: {}", got.value);
        let value = &got.value;
        assert_eq!(value["version"], 1, "{what}: {value}");
        assert_eq!(value["status"], "ok", "{what}: {value}");
        assert_eq!(value["task"], "image", "{what}: {value}");
        assert_eq!(value["model"], PNET_MODEL.0, "{what}: {value}");
        assert!(value["attempts"].as_u64().is_some_and(|a| a >= 1), "{what}: attempts in {value}");
        assert!(value["timings_ms"]["total"].as_f64().is_some_and(|t| t >= 0.0), "{what}: timings in {value}");
        let output = &value["output"];
        assert_eq!(output["format"], case.format, "{what}: {output}");
        let (w, h) = case.viewed;
        assert_eq!(
            (output["width"].as_u64(), output["height"].as_u64()),
            (Some(w.into()), Some(h.into())),
            "{what}: {output}"
        );
        let faces = output["faces"].as_array().unwrap_or_else(|| panic!("{what}: no faces array in {output}"));
        let (w, h) = (f64::from(w), f64::from(h));
        let eps = 1e-3;
        for face in faces {
            let f = |k: &str| face[k].as_f64().unwrap_or_else(|| panic!("{what}: face without {k}: {face}"));
            let (x1, y1, x2, y2, score) = (f("x1"), f("y1"), f("x2"), f("y2"), f("score"));
            assert!(
                -eps <= x1 && x1 < x2 && x2 <= w + eps && -eps <= y1 && y1 < y2 && y2 <= h + eps,
                "{what}: box {face} outside the {w}x{h} image"
            );
            assert!((THRESHOLD - eps..=1.0 + eps).contains(&score), "{what}: score of {face} not in [{THRESHOLD}, 1]");
        }
        eprintln!("{what}: {} faces, {}", faces.len(), value["timings_ms"]);
        total_faces += faces.len();
    }
    assert!(total_faces > 0, "no faces found in any of the crowds: the bounds checks checked nothing");

    let results = |m: &Scrape| m.sum("vramgate_gateway_records_produced_total", &[("task", "image"), ("outcome", "result")]);
    let metrics = gateway
        .metrics_when(Duration::from_secs(30), |m| results(m) >= cases.len() as f64)
        .await
        .expect("metrics");
    let consumed = metrics.sum("vramgate_gateway_records_consumed_total", &[("task", "image")]);
    let produced = results(&metrics);
    eprintln!("{} images: {total_faces} faces; metrics: {consumed} consumed, {produced} results", cases.len());
    assert_eq!(consumed, cases.len() as f64, "records_consumed_total{{task=\"image\"}}:\n{}", metrics.text);
    assert_eq!(produced, cases.len() as f64, "records_produced_total{{task=\"image\"}}:\n{}", metrics.text);

    terminate(&mut gateway).await;
    drop(worker);
}

/// A poison record sent, and the dead letter it must become.
struct Poison {
    what: &'static str,
    /// `None` for a value that is not json (its dead letter has no id).
    id: Option<String>,
    kind: &'static str,
    task: &'static str,
    key: String,
    value: Vec<u8>,
    at: Option<Position>,
}

impl Poison {
    /// A poison record with an id (`unique(prefix)`), keyed by it, whose value `value` builds
    /// from that id.
    fn new(what: &'static str, kind: &'static str, task: &'static str, prefix: &str, value: impl FnOnce(&str) -> Vec<u8>) -> Self {
        let id = unique(prefix);
        Poison { what, kind, task, value: value(&id), key: id.clone(), id: Some(id), at: None }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_records_each_become_one_dead_letter_and_the_partition_keeps_moving() {
    let voice = TaskTopics::create("poison-voice", 1).await.expect("topics");
    let image = TaskTopics::create("poison-image", 1).await.expect("topics");
    let root = scratch_dir("poison");
    let outside = scratch_dir("poison-outside");
    let worker = start_worker(&worker_config("", &[VAD_MODEL, PNET_MODEL])).await.expect("worker starts");
    let group = unique("gw");
    let mut env = base_env(&group, &worker.url, &root);
    env.extend(voice_task_env(&voice));
    env.extend(image_task_env(&image));
    let mut gateway = start_gateway(&env).await.expect("gateway starts");

    // Good inputs, and the bad ones.
    let clip = compose(None, 0.5, 0.5, 16_000, 1, 7);
    let good_wav = root.join("good.wav");
    write_wav(&good_wav, &clip.samples, 16_000, 1, SampleFormat::I16).expect("write wav");
    let good_png = images::write(&root, "good.png", &png(&crowd(320, 240, 16.0, 1)));
    let outside_wav = outside.join("elsewhere.wav");
    write_wav(&outside_wav, &clip.samples, 16_000, 1, SampleFormat::I16).expect("write wav");
    let corrupt_wav = root.join("corrupt.wav");
    std::fs::write(&corrupt_wav, b"RIFF\x10\x00\x00\x00WAVEfmt \x02\x00\x00\x00\x01").expect("write");
    let truncated_png = images::write(&root, "truncated.png", &images::truncated_png(320, 240, 2));
    let huge_png = images::png_declaring(50_000, 50_000);
    assert_eq!(images::dimensions(&huge_png).expect("header"), (50_000, 50_000));

    let json = |v: serde_json::Value| serde_json::to_vec(&v).expect("json serialises");
    let file_uri = |p: &Path| format!("file://{}", p.display());
    let mut poisons = vec![
        Poison {
            what: "a value that is not json",
            id: None,
            kind: "invalid_json",
            task: "voice",
            key: unique("not-json"),
            value: b"{this is not json".to_vec(),
            at: None,
        },
        Poison::new("a task no gateway serves", "unknown_task", "voice", "unknown-task", |id| {
            json(serde_json::json!({"id": id, "task": "translate", "input": {"uri": file_uri(&good_wav)}}))
        }),
        Poison::new("an image request on the voice topic", "unknown_task", "voice", "wrong-topic", |id| {
            json(serde_json::json!({"id": id, "task": "image", "input": {"uri": file_uri(&good_png)}}))
        }),
        Poison::new("a file that does not exist", "input_not_found", "voice", "missing", |id| {
            request_file(id, "voice", &root.join("nope.wav"))
        }),
        // The same answer as a missing file: dead letters must not tell which paths exist
        // outside the root.
        Poison::new("a real file outside the input root", "input_not_found", "voice", "outside", |id| {
            request_file(id, "voice", &outside_wav)
        }),
        // A FIFO with no writer: opening or reading it the usual way blocks for ever.
        Poison::new("a fifo under the input root", "unsupported_input", "voice", "fifo", |id| {
            let fifo = root.join("input.fifo");
            let status = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
            assert!(status.success(), "mkfifo failed");
            request_file(id, "voice", &fifo)
        }),
        Poison::new("a corrupt wav", "invalid_audio", "voice", "corrupt", |id| request_file(id, "voice", &corrupt_wav)),
        Poison::new("a truncated png", "invalid_image", "image", "truncated", |id| {
            request_file(id, "image", &truncated_png)
        }),
        Poison::new("a png declaring 50000 x 50000 pixels", "input_too_large", "image", "huge", |id| {
            request_inline(id, "image", &huge_png)
        }),
    ];

    // Each poison record is followed on its partition by a good one.
    let producer = producer();
    let mut good = Vec::new();
    for poison in &mut poisons {
        let (topics, task, input) =
            if poison.task == "voice" { (&voice, "voice", &good_wav) } else { (&image, "image", &good_png) };
        poison.at = Some(send(&producer, &topics.requests, &poison.key, &poison.value).await.expect("send"));
        let id = unique(&format!("good-after-{}", poison.kind));
        send(&producer, &topics.requests, &id, &request_file(&id, task, input)).await.expect("send");
        good.push((id, topics.results.clone(), poison.what));
    }

    let wanted: Vec<String> =
        good.iter().map(|(id, ..)| id.clone()).chain(poisons.iter().filter_map(|p| p.id.clone())).collect();
    let records = collect(&[&voice.results, &voice.dlq, &image.results, &image.dlq], Duration::from_secs(180), |got| {
        wanted.iter().all(|id| got.contains_key(id)) && got.contains_key("")
    })
    .await
    .expect("collect");
    let records: BTreeMap<String, Vec<Received>> = records.into_iter().collect();
    let missing: Vec<&String> = wanted.iter().filter(|id| !records.contains_key(*id)).collect();
    assert!(missing.is_empty(), "no output for {missing:?}; gateway log:\n{}", gateway.log_tail());

    for poison in &poisons {
        let (topics, what) = (if poison.task == "voice" { &voice } else { &image }, poison.what);
        let got = match &poison.id {
            Some(id) => only(&records, id, what),
            None => {
                let unnamed = records.get("").expect("the dead letter of the value that is not json");
                assert_eq!(unnamed.len(), 1, "{what}: {unnamed:?}");
                &unnamed[0]
            }
        };
        check_dead_letter(got, poison, topics);
        eprintln!(
            "{what}: {} at {}/{} stage {}: {}",
            got.value["error"]["kind"],
            got.value["source"]["partition"],
            got.value["source"]["offset"],
            got.value["error"]["stage"],
            got.value["error"]["message"]
        );
    }
    for (id, results, after) in &good {
        let got = only(&records, id, &format!("the good record after {after}"));
        assert_eq!(&got.topic, results, "the good record after {after} was dead-lettered: {}", got.value);
        assert_eq!(got.value["status"], "ok", "{}", got.value);
    }

    // Every record, poison or not, is finished: the committed offsets reach the end of both
    // partitions while the gateway runs (commits every COMMIT_INTERVAL_MS).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let behind_voice = uncommitted_records(&group, &voice.requests).expect("committed offsets");
        let behind_image = uncommitted_records(&group, &image.requests).expect("committed offsets");
        if behind_voice == 0 && behind_image == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{behind_voice} voice and {behind_image} image records still not committed; gateway log:\n{}",
            gateway.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // Nothing exports here, so each record's span carries only its log fields; a dead letter's
    // log line still names the record.
    let log = std::fs::read_to_string(&gateway.service.log).expect("gateway log");
    let line = log
        .lines()
        .find(|l| l.contains("dead-lettering record") && l.contains("event_id="))
        .unwrap_or_else(|| panic!("no dead-letter line naming its event; log:\n{}", gateway.log_tail()));
    for field in ["task=", "messaging.destination.name=", "messaging.destination.partition.id=", "messaging.kafka.offset="] {
        assert!(line.contains(field), "{field} missing from: {line}");
    }
    assert!(!line.contains("otel.") && !line.contains("messaging.system"), "exporter-only fields logged: {line}");

    let finished = (poisons.len() + good.len()) as f64;
    let metrics = gateway
        .metrics_when(Duration::from_secs(30), |m| {
            m.sum("vramgate_gateway_record_seconds_count", &[]) >= finished
                && m.sum("vramgate_gateway_records_produced_total", &[]) >= finished
        })
        .await
        .expect("metrics");
    let dead = |kind: &str| metrics.sum("vramgate_gateway_dead_letters_total", &[("kind", kind)]);
    for kind in ["invalid_json", "unsupported_input", "invalid_audio", "invalid_image", "input_too_large"] {
        assert_eq!(dead(kind), 1.0, "dead_letters_total{{kind=\"{kind}\"}}:\n{}", metrics.text);
    }
    assert_eq!(dead("input_not_found"), 2.0, "missing and outside the root:\n{}", metrics.text);
    assert_eq!(dead("input_outside_root"), 0.0, "{}", metrics.text);
    assert_eq!(dead("unknown_task"), 2.0, "dead_letters_total{{kind=\"unknown_task\"}}:\n{}", metrics.text);
    let produced = |outcome: &str| metrics.sum("vramgate_gateway_records_produced_total", &[("outcome", outcome)]);
    assert_eq!(produced("dead_letter"), poisons.len() as f64, "{}", metrics.text);
    assert_eq!(produced("result"), good.len() as f64, "{}", metrics.text);
    // Every finished record, refused at once or served by the worker, is timed from its fetch
    // to its output acknowledged; the commits that followed, sent to answered.
    let records = metrics.sum("vramgate_gateway_record_seconds_count", &[]);
    assert_eq!(records, (poisons.len() + good.len()) as f64, "{}", metrics.text);
    let seconds = metrics.sum("vramgate_gateway_record_seconds_sum", &[]);
    assert!(seconds > 0.0 && seconds / records < 60.0, "mean {} s:\n{}", seconds / records, metrics.text);
    assert!(metrics.sum("vramgate_gateway_offset_commit_seconds_count", &[]) >= 1.0, "{}", metrics.text);

    terminate(&mut gateway).await;
    drop(worker);
}

fn check_dead_letter(got: &Received, poison: &Poison, topics: &TaskTopics) {
    let (what, kind) = (poison.what, poison.kind);
    let at = poison.at.expect("sent");
    let value = &got.value;
    assert_eq!(got.topic, topics.dlq, "{what}: expected a dead letter, got {value}");
    assert_eq!(value["version"], 1, "{what}: {value}");
    assert_eq!(value["error"]["kind"], kind, "{what}: {value}");
    assert!(value["error"]["stage"].as_str().is_some_and(|s| !s.is_empty()), "{what}: no stage in {value}");
    assert!(value["error"]["message"].as_str().is_some_and(|m| m.len() > 10), "{what}: no message in {value}");
    // No worker call was made for any of these.
    assert_eq!(value["attempts"].as_u64(), Some(0), "{what}: attempts in {value}");
    if let Some(id) = &poison.id {
        assert_eq!(value["id"], id.as_str(), "{what}: {value}");
    }
    let source = &value["source"];
    assert_eq!(source["topic"], topics.requests.as_str(), "{what}: {value}");
    assert_eq!(source["partition"].as_i64(), Some(i64::from(at.partition)), "{what}: {value}");
    assert_eq!(source["offset"].as_i64(), Some(at.offset), "{what}: {value}");
    let b64 = base64::engine::general_purpose::STANDARD;
    if let Some(v) = source["value_b64"].as_str() {
        assert_eq!(b64.decode(v).expect("value_b64 is base64"), poison.value, "{what}: source.value_b64");
    } else {
        eprintln!("{what}: the dead letter carries no source.value_b64");
    }
    if let Some(k) = source["key_b64"].as_str() {
        assert_eq!(b64.decode(k).expect("key_b64 is base64"), poison.key.as_bytes(), "{what}: source.key_b64");
    }
    // Spring Kafka's dead-letter headers, so tooling that reads those reads ours.
    assert_eq!(got.header("kafka_dlt-original-topic"), Some(topics.requests.as_bytes()), "{what}");
    assert_eq!(got.header("kafka_dlt-original-partition"), Some(&at.partition.to_be_bytes()[..]), "{what}");
    assert_eq!(got.header("kafka_dlt-original-offset"), Some(&at.offset.to_be_bytes()[..]), "{what}");
    for header in ["kafka_dlt-exception-fqcn", "kafka_dlt-exception-message"] {
        assert!(got.header(header).is_some_and(|h| !h.is_empty()), "{what}: no {header} header: {:?}", got.headers);
    }
    assert_eq!(got.header("vramgate-error-kind"), Some(kind.as_bytes()), "{what}");
}
