//! The image task's faces, end to end through Kafka and the real worker, against
//! facenet-pytorch's own `MTCNN(keep_all=True).detect` run on the same files in the test's
//! set-up (`scripts/mtcnn_reference.py`): real photographs with one face, several, and none
//! (`tests/photos.md`), of different sizes, a JPEG turned by its EXIF orientation, and requests
//! that set their own minimum face size and thresholds. Then the cascade's failures: a stage
//! whose model the worker lacks, a pyramid level larger than the worker's budget, and the worker
//! killed while a burst of photographs is in its stages; each event ends in a result or a clear
//! dead letter, none is lost, and the partition moves on.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use vramgate_tests::images::{jpeg, with_exif_orientation};
use vramgate_tests::mtcnn::{iou, reference, RefFace};
use vramgate_tests::{
    collect, faces_task_env, gateway_base_env, photo, producer, request_file, scratch_dir, send, start_gateway,
    start_worker, start_worker_on, unique, worker_config, Received, TaskTopics, FACE_MODELS, PNET_MODEL, RNET_MODEL,
};

/// The agreement the issue sets: every face at IoU ≥ 0.9 with the reference's, landmarks within
/// 3 pixels, and no face the reference does not report.
const MIN_IOU: f64 = 0.9;
const MAX_LANDMARK_PX: f64 = 3.0;

const PHOTOS: [&str; 7] =
    ["astronaut.png", "camera.png", "chelsea.png", "coffee.png", "rocket.jpg", "t1.jpg", "Tom_Hanks_54745.png"];

/// Agreement of one result with the reference: the smallest IoU and the largest landmark
/// distance over its faces. Panics, naming the photo, when a face is missing or extra.
fn agreement(what: &str, result: &serde_json::Value, want: &[RefFace]) -> (f64, f64) {
    assert_eq!(result["status"], "ok", "{what}: {result}");
    let got: Vec<([f64; 4], [[f64; 2]; 5])> = result["output"]["faces"]
        .as_array()
        .unwrap_or_else(|| panic!("{what}: no faces in {result}"))
        .iter()
        .map(|f| {
            let n = |v: &serde_json::Value| v.as_f64().unwrap_or_else(|| panic!("{what}: {f}"));
            let marks = f["landmarks"].as_array().unwrap_or_else(|| panic!("{what}: no landmarks in {f}"));
            (
                [n(&f["x1"]), n(&f["y1"]), n(&f["x2"]), n(&f["y2"])],
                [0, 1, 2, 3, 4].map(|k| [n(&marks[k][0]), n(&marks[k][1])]),
            )
        })
        .collect();
    assert_eq!(got.len(), want.len(), "{what}: {} faces, facenet-pytorch finds {}: {result}; reference {want:?}", got.len(), want.len());
    let (mut worst_iou, mut worst_px) = (1.0f64, 0.0f64);
    for w in want {
        let (best, marks) = got
            .iter()
            .map(|(b, m)| (iou(b, &w.bbox), m))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .expect("as many faces as the reference");
        assert!(best >= MIN_IOU, "{what}: facenet-pytorch's face {:?} is matched at IoU {best:.3} only: {result}", w.bbox);
        let px = marks.iter().zip(&w.landmarks).map(|(a, b)| (a[0] - b[0]).hypot(a[1] - b[1])).fold(0.0, f64::max);
        assert!(px <= MAX_LANDMARK_PX, "{what}: landmarks {px:.2} px from facenet-pytorch's {:?}: {result}", w.landmarks);
        (worst_iou, worst_px) = (worst_iou.min(best), worst_px.max(px));
    }
    (worst_iou, worst_px)
}

fn base_env(group: &str, worker_url: &str, root: &Path, topics: &TaskTopics) -> Vec<(&'static str, String)> {
    let mut env = gateway_base_env(group, worker_url, root);
    env.extend(faces_task_env(topics));
    env.extend([("COMMIT_INTERVAL_MS", "200".to_string()), ("TASKS__VOICE__ENABLED", "false".into())]);
    env
}

/// One output per id within `timeout`, or a panic naming what is missing.
async fn outputs(topics: &TaskTopics, ids: &[String], timeout: Duration, log: impl Fn() -> String) -> BTreeMap<String, Received> {
    let got = collect(&[&topics.results, &topics.dlq], timeout, |got| ids.iter().all(|id| got.contains_key(id)))
        .await
        .expect("collect");
    let mut by_id = BTreeMap::new();
    for id in ids {
        let records = got.get(id).unwrap_or_else(|| panic!("no output for {id}; gateway log:\n{}", log()));
        assert_eq!(records.len(), 1, "{id}: {} outputs: {records:?}", records.len());
        by_id.insert(id.clone(), records[0].clone());
    }
    by_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faces_agree_with_facenet_pytorch_on_real_photographs() {
    let root = scratch_dir("faces");
    // The photographs as they are, and the astronaut as a JPEG stored on its side with an EXIF
    // orientation that turns it upright.
    let mut files: Vec<PathBuf> = PHOTOS.iter().map(|name| {
        let to = root.join(name);
        std::fs::copy(photo(name), &to).expect("copying a photograph");
        to
    }).collect();
    let astronaut = image::open(photo("astronaut.png")).expect("astronaut decodes").into_rgb8();
    let stored = image::imageops::rotate270(&astronaut);
    let turned = root.join("astronaut-exif6.jpg");
    std::fs::write(&turned, with_exif_orientation(&jpeg(&stored, 95), 6)).expect("writing the turned jpeg");
    files.push(turned.clone());
    let want = reference(&files, &[]);
    // The options case on t1's pixels as this side decodes them, saved losslessly: two JPEG
    // decoders (Pillow's libjpeg-turbo, the image crate's) differ by a grey level here and there,
    // which moves a landmark by a pixel or two; the options' effect is what this case checks.
    let t1 = root.join("t1-decoded.png");
    image::open(root.join("t1.jpg")).expect("t1 decodes").into_rgb8().save(&t1).expect("writing t1 as png");
    let want_large = reference(std::slice::from_ref(&t1), &["--min-face-size", "60", "--thresholds", "0.6,0.7,0.95"]);

    // A small admission budget, so that the burst below queues at every stage.
    let budget = 256u64 << 20;
    let worker = start_worker(&worker_config(&format!("memory_budget_bytes = {budget}"), &FACE_MODELS)).await.expect("worker");
    let topics = TaskTopics::create(&unique("faces"), 2).await.expect("topics");
    let gateway = start_gateway(&base_env(&unique("gw"), &worker.url, &root, &topics)).await.expect("gateway");

    // Every photograph three times over, all at once, and t1 once with its own options.
    let producer = producer();
    let mut sent: Vec<(String, String)> = Vec::new();
    for round in 0..3 {
        for file in &files {
            let id = unique(&format!("face{round}"));
            send(&producer, &topics.requests, &id, &request_file(&id, "image", file)).await.expect("send");
            sent.push((id, file.file_name().expect("a file name").to_string_lossy().into_owned()));
        }
    }
    let options_id = unique("face-options");
    let mut event: serde_json::Value = serde_json::from_slice(&request_file(&options_id, "image", &t1)).expect("json");
    event["options"] = serde_json::json!({"min_face_size": 60, "thresholds": [0.6, 0.7, 0.95]});
    send(&producer, &topics.requests, &options_id, &serde_json::to_vec(&event).expect("json")).await.expect("send");

    let mut ids: Vec<String> = sent.iter().map(|(id, _)| id.clone()).collect();
    ids.push(options_id.clone());
    let got = outputs(&topics, &ids, Duration::from_secs(600), || gateway.log_tail()).await;
    let mut figures = BTreeMap::new();
    for (id, name) in &sent {
        let record = &got[id];
        assert_eq!(record.topic, topics.results, "{name} was dead-lettered: {}", record.value);
        let (worst_iou, worst_px) = agreement(name, &record.value, &want[name]);
        let entry = figures.entry(name.clone()).or_insert((want[name].len(), worst_iou, worst_px, 0.0f64));
        (entry.1, entry.2) = (entry.1.min(worst_iou), entry.2.max(worst_px));
        entry.3 = entry.3.max(record.value["timings_ms"]["total"].as_f64().unwrap_or(0.0));
        // The models of the stages it reached: a face needs all three.
        let models = record.value["model"].as_str().unwrap_or_default();
        assert!(models.starts_with("mtcnn_pnet"), "{name}: {}", record.value);
        if !want[name].is_empty() {
            assert_eq!(models, "mtcnn_pnet,mtcnn_rnet,mtcnn_onet", "{name}: {}", record.value);
        }
    }
    let options = &got[&options_id];
    let (iou_options, px_options) =
        agreement("t1 (min_face_size 60, thresholds 0.6/0.7/0.95)", &options.value, &want_large["t1-decoded.png"]);
    for (name, (faces, worst_iou, worst_px, ms)) in &figures {
        eprintln!("{name}: {faces} faces; worst IoU {worst_iou:.4}, worst landmark {worst_px:.2} px; slowest {ms:.0} ms");
    }
    let large = want_large["t1-decoded.png"].len();
    eprintln!("t1 with options: {large} faces; IoU {iou_options:.4}, landmark {px_options:.2} px");
    assert!(want["t1.jpg"].len() > large, "the options changed nothing");
    assert_eq!(want["astronaut.png"].len(), 1, "the reference's astronaut: {:?}", want["astronaut.png"]);

    // Admission kept every stage inside the budget: the most it admitted at once stayed under it,
    // and no batch ran out of memory (the answers' agreement above is the stronger check: an
    // OOM recovered from still answers, one not recovered from is a dead letter).
    let metrics = reqwest::get(format!("{}/metrics", worker.url)).await.expect("metrics").text().await.expect("text");
    let sum = |name: &str| -> f64 {
        metrics.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).fold(0.0, |a, b| a + b)
    };
    let (ooms, peak) = (sum("inference_oom_errors_total"), sum("gpu_memory_admitted_peak_bytes"));
    eprintln!("worker: {ooms} OOMs, {} refused, peak admitted {peak} of {budget} bytes", sum("admission_rejections_total"));
    assert_eq!(ooms, 0.0, "{metrics}");
    assert!(peak > 0.0 && peak <= budget as f64, "peak admitted {peak} of {budget}: {metrics}");
    assert_eq!(sum("admission_rejections_total"), 0.0, "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_stage_dead_letters_its_event_by_name_and_the_next_goes_on() {
    let root = scratch_dir("faces-fail");
    let copy = |name: &str| {
        let to = root.join(name);
        std::fs::copy(photo(name), &to).expect("copying a photograph");
        to
    };
    let (astronaut, coffee, t1) = (copy("astronaut.png"), copy("coffee.png"), copy("t1.jpg"));
    // A large photograph: the astronaut at 3072 × 3072, whose first pyramid level (1844²) P-Net
    // cannot fit in this worker's budget.
    let big = root.join("astronaut-big.png");
    let astronaut_image = image::open(&astronaut).expect("decodes");
    astronaut_image.resize_exact(3072, 3072, image::imageops::FilterType::Triangle).save(&big).expect("writing");

    // The worker serves P-Net and R-Net, not O-Net, on a small budget.
    let config = worker_config("memory_budget_bytes = 100000000\n[batching]\ncalibrate = false", &[PNET_MODEL, RNET_MODEL]);
    let worker = start_worker(&config).await.expect("worker");
    let topics = TaskTopics::create(&unique("faces-fail"), 1).await.expect("topics");
    let gateway = start_gateway(&base_env(&unique("gw"), &worker.url, &root, &topics)).await.expect("gateway");
    let producer = producer();
    let mut ids = Vec::new();
    for file in [&astronaut, &big, &coffee] {
        let id = unique("fail");
        let mut event: serde_json::Value = serde_json::from_slice(&request_file(&id, "image", file)).expect("json");
        if file == &coffee {
            // R-Net's probabilities never exceed 1: nothing passes it, so O-Net is never needed.
            event["options"] = serde_json::json!({"thresholds": [0.6, 1.0, 0.7]});
        }
        send(&producer, &topics.requests, &id, &serde_json::to_vec(&event).expect("json")).await.expect("send");
        ids.push(id);
    }
    let got = outputs(&topics, &ids, Duration::from_secs(300), || gateway.log_tail()).await;

    // The astronaut reaches O-Net, which this worker does not serve: a dead letter naming stage 3.
    let dead = &got[&ids[0]];
    assert_eq!(dead.topic, topics.dlq, "{}", dead.value);
    let message = dead.value["error"]["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("stage 3 of 3 (mtcnn_onet): "), "{}", dead.value);
    assert_eq!(dead.value["error"]["kind"], "worker_rejected", "{}", dead.value);
    // The large photograph's levels are refused at stage 1, by size: its first (1844²) has more
    // elements than P-Net's `max_input_elements`, the next ones need more than the budget.
    // Both are 413, so the dead letter says input_too_large whichever answer came first.
    let large = &got[&ids[1]];
    assert_eq!(large.topic, topics.dlq, "{}", large.value);
    assert_eq!(large.value["error"]["kind"], "input_too_large", "{}", large.value);
    assert!(
        large.value["error"]["message"].as_str().is_some_and(|m| m.starts_with("stage 1 of 3 (mtcnn_pnet): ")),
        "{}",
        large.value
    );
    // The coffee cup, asked for an R-Net threshold nothing passes: a result, no faces, and
    // R-Net was called (its candidates existed).
    let cup = &got[&ids[2]];
    assert_eq!(cup.topic, topics.results, "{}", cup.value);
    assert_eq!(cup.value["output"]["faces"], serde_json::json!([]), "{}", cup.value);
    assert_eq!(cup.value["model"], "mtcnn_pnet,mtcnn_rnet", "{}", cup.value);
    eprintln!("dead letters: {message:?}; {:?}", large.value["error"]["message"]);

    // The worker killed while a burst is in its stages, and started again on its address with
    // all three models: every event still ends in one result, through the gateway's retries.
    drop(gateway);
    let listen = worker.url.trim_start_matches("http://").to_string();
    drop(worker);
    let full = worker_config("[batching]\ncalibrate = false", &FACE_MODELS);
    let worker = start_worker_on(&full, &listen).await.expect("worker");
    let topics = TaskTopics::create(&unique("faces-kill"), 2).await.expect("topics");
    let gateway = start_gateway(&base_env(&unique("gw"), &worker.url, &root, &topics)).await.expect("gateway");
    let mut ids = Vec::new();
    for _ in 0..16 {
        let id = unique("kill");
        send(&producer, &topics.requests, &id, &request_file(&id, "image", &t1)).await.expect("send");
        ids.push(id);
    }
    let first = collect(&[&topics.results], Duration::from_secs(120), |got| !got.is_empty()).await.expect("collect");
    assert!(!first.is_empty(), "no result before the kill; gateway log:\n{}", gateway.log_tail());
    drop(worker);
    let worker = start_worker_on(&full, &listen).await.expect("worker restarts");
    let got = outputs(&topics, &ids, Duration::from_secs(300), || gateway.log_tail()).await;
    let results = got.values().filter(|r| r.topic == topics.results).count();
    for record in got.values() {
        assert_eq!(record.topic, topics.results, "an event was dead-lettered over a worker restart: {}", record.value);
        assert_eq!(record.value["output"]["faces"].as_array().map(Vec::len), Some(8), "{}", record.value);
    }
    let metrics = gateway.metrics().await.expect("metrics");
    let retried = metrics.sum("vramgate_gateway_retries_total", &[("task", "image"), ("reason", "error")]);
    eprintln!("worker killed mid-burst: {results} of {} results, {retried} calls retried", ids.len());
    assert!(retried > 0.0, "the kill hit no call in flight:\n{}", metrics.text);

    // Odd images through the whole cascade: other pixel formats (alpha, grey, 16-bit, WebP),
    // strips, and images too small for any pyramid level. Each is a result of its own size.
    let rgb = astronaut_image.to_rgb8();
    let odd_dir = root.join("odd");
    std::fs::create_dir_all(&odd_dir).expect("a folder");
    let mut odd: Vec<(&str, image::DynamicImage, image::ImageFormat, usize)> = vec![
        ("rgba.png", image::DynamicImage::ImageRgba8(astronaut_image.to_rgba8()), image::ImageFormat::Png, 1),
        ("grey.png", image::DynamicImage::ImageLuma8(astronaut_image.to_luma8()), image::ImageFormat::Png, 1),
        ("rgb16.png", image::DynamicImage::ImageRgb16(astronaut_image.to_rgb16()), image::ImageFormat::Png, 1),
        ("lossless.webp", image::DynamicImage::ImageRgb8(rgb.clone()), image::ImageFormat::WebP, 1),
        ("11x11.png", image::DynamicImage::ImageRgb8(image::imageops::thumbnail(&rgb, 11, 11)), image::ImageFormat::Png, 0),
    ];
    for (name, w, h) in [("strip-4000x20.png", 4000, 20), ("strip-20x4000.png", 20, 4000), ("12x12.png", 12, 12)] {
        let resized = image::imageops::resize(&rgb, w, h, image::imageops::FilterType::Triangle);
        odd.push((name, image::DynamicImage::ImageRgb8(resized), image::ImageFormat::Png, usize::MAX));
    }
    let mut ids = Vec::new();
    for (name, picture, format, _) in &odd {
        let path = odd_dir.join(name);
        picture.save_with_format(&path, *format).expect("writing an odd image");
        let id = unique("odd");
        send(&producer, &topics.requests, &id, &request_file(&id, "image", &path)).await.expect("send");
        ids.push(id);
    }
    let got = outputs(&topics, &ids, Duration::from_secs(120), || gateway.log_tail()).await;
    for (id, (name, picture, _, faces)) in ids.iter().zip(&odd) {
        let value = &got[id].value;
        assert_eq!(got[id].topic, topics.results, "{name}: {value}");
        let size = (value["output"]["width"].as_u64(), value["output"]["height"].as_u64());
        assert_eq!(size, (Some(picture.width().into()), Some(picture.height().into())), "{name}: {value}");
        let found = value["output"]["faces"].as_array().map_or(usize::MAX, Vec::len);
        assert!(*faces == usize::MAX || found == *faces, "{name}: {found} faces, expected {faces}: {value}");
        eprintln!("{name}: {found} faces [{}]", value["model"]);
    }
    drop((gateway, worker));
}
