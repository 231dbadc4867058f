//! The gateway calling its worker over gRPC (`worker.protocol = "grpc"`): the same voice clips
//! and photographs through a gateway on each door of one worker give the same results (speech
//! segments, MTCNN's whole cascade), a missing file the same dead letter, and the gRPC
//! gateway's readiness asks the worker over gRPC.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use vramgate_tests::wav::{change_rate, speak, write_wav, SampleFormat};
use vramgate_tests::{
    collect, faces_task_env, gateway_base_env, photo, producer, scratch_dir, send, start_gateway, start_worker, unique,
    voice_task_env, worker_config, Gateway, Received, TaskTopics, FACE_MODELS, VAD_MODEL,
};

struct Door {
    gateway: Gateway,
    voice: TaskTopics,
    image: TaskTopics,
}

async fn door(name: &str, worker_url: &str, protocol: &str, root: &std::path::Path) -> Door {
    let voice = TaskTopics::create(&format!("{name}-voice"), 1).await.expect("topics");
    let image = TaskTopics::create(&format!("{name}-image"), 1).await.expect("topics");
    let mut env = gateway_base_env(&unique("gw"), worker_url, root);
    env.extend(voice_task_env(&voice));
    env.extend(faces_task_env(&image));
    env.push(("WORKER__PROTOCOL", protocol.to_string()));
    let gateway = start_gateway(&env).await.expect("gateway starts");
    Door { gateway, voice, image }
}

fn request(id: &str, task: &str, uri: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"id": id, "task": task, "input": {"uri": uri}})).expect("json")
}

/// Sends every input to `door` under ids `<prefix>-<n>`; returns what each id ended as.
async fn run(door: &mut Door, prefix: &str, inputs: &[(&str, String)]) -> HashMap<String, Received> {
    let producer = producer();
    for (n, (task, uri)) in inputs.iter().enumerate() {
        let topic = if *task == "voice" { &door.voice.requests } else { &door.image.requests };
        let id = format!("{prefix}-{n}");
        send(&producer, topic, &id, &request(&id, task, uri)).await.expect("send");
    }
    let topics = [&*door.voice.results, &*door.voice.dlq, &*door.image.results, &*door.image.dlq];
    let want = inputs.len();
    let got = collect(&topics, Duration::from_secs(240), |by_id| by_id.len() >= want).await.expect("collect");
    assert_eq!(got.len(), want, "{} of {want} answered; gateway log:\n{}", got.len(), door.gateway.log_tail());
    got.into_iter().map(|(id, mut r)| (id.rsplit('-').next().unwrap_or_default().to_string(), r.remove(0))).collect()
}

/// Two floats equal within `tolerance` (a batch's rows may move the last bits of a model's answer).
fn near(a: &Value, b: &Value, tolerance: f64) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => (x.as_f64().unwrap_or(f64::NAN) - y.as_f64().unwrap_or(f64::NAN)).abs() <= tolerance,
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| near(x, y, tolerance)),
        (Value::Object(x), Value::Object(y)) => x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| near(v, w, tolerance))),
        (x, y) => x == y,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_on_the_grpc_door_gets_what_one_on_http_gets() {
    let root = scratch_dir("gateway-grpc");
    let models = [VAD_MODEL, FACE_MODELS[0], FACE_MODELS[1], FACE_MODELS[2]];
    let mut worker = start_worker(&worker_config("grpc_listen = \"127.0.0.1:0\"\n[batching]\ncalibrate = false", &models))
        .await
        .expect("worker starts");
    let grpc_url = format!("http://{}", worker.grpc.clone().expect("the worker reports its gRPC address"));

    let mut inputs: Vec<(&str, String)> = Vec::new();
    for (n, phrase) in ["The quick brown fox jumps over the lazy dog.", "Please call Stella and ask her to bring these things."]
        .iter()
        .enumerate()
    {
        let speech = speak(phrase).expect("espeak-ng");
        let path = root.join(format!("speech-{n}.wav"));
        write_wav(&path, &change_rate(&speech.samples, speech.sample_rate, 16_000), 16_000, 1, SampleFormat::I16).expect("wav");
        inputs.push(("voice", format!("file://{}", path.display())));
    }
    for name in ["Tom_Hanks_54745.png", "astronaut.png"] {
        let path = root.join(name);
        std::fs::copy(photo(name), &path).expect("copy the photograph");
        inputs.push(("image", format!("file://{}", path.display())));
    }
    inputs.push(("voice", format!("file://{}", root.join("no-such-clip.wav").display())));

    let mut http = door("grpc-ref", &worker.url, "http", &root).await;
    let mut grpc = door("grpc-door", &grpc_url, "grpc", &root).await;
    // Ready: its worker asked over gRPC (ServerReady).
    let readiness = grpc.gateway.wait_readiness(|status, _| status == 200).await;
    let checks = readiness["checks"].to_string();
    assert!(checks.contains(&grpc_url), "its readiness names the worker's gRPC URL: {readiness}");

    let started = Instant::now();
    let by_http = run(&mut http, &unique("h"), &inputs).await;
    let by_grpc = run(&mut grpc, &unique("g"), &inputs).await;
    eprintln!("both doors answered {} inputs each in {:?}", inputs.len(), started.elapsed());
    for n in 0..inputs.len() {
        let (h, g) = (&by_http[&n.to_string()], &by_grpc[&n.to_string()]);
        let kind = |r: &Received| if r.topic.ends_with(".dlq") { "dead letter" } else { "result" };
        assert_eq!(kind(h), kind(g), "input {n}: {} vs {}", h.value, g.value);
        if kind(g) == "dead letter" {
            assert_eq!(h.value["error"]["kind"], g.value["error"]["kind"], "input {n}");
            continue;
        }
        assert!(near(&h.value["output"], &g.value["output"], 1e-3), "input {n}:\nHTTP {}\ngRPC {}", h.value["output"], g.value["output"]);
        assert_eq!(h.value["model"], g.value["model"], "input {n}");
    }
    let faces = by_grpc["2"].value["output"]["faces"].as_array().map_or(0, Vec::len);
    assert_eq!(faces, 1, "one face in Tom Hanks' photograph through gRPC: {}", by_grpc["2"].value);
    assert!(worker.service.is_running() && grpc.gateway.service.is_running() && http.gateway.service.is_running());
}
