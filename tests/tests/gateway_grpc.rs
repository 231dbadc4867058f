//! The gateway calling its worker over gRPC (`worker.protocol = "grpc"`): the same voice clips,
//! photographs and tensor events through a gateway on each door of one worker give the same
//! results (speech segments, MTCNN's whole cascade, a configured `tensor` task of two inputs),
//! a missing file the same dead letter, and the gRPC gateway's readiness asks the worker over
//! gRPC.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::json;
use vramgate_tests::agree;
use vramgate_tests::wav::{change_rate, speak, write_wav, SampleFormat};
use vramgate_tests::{
    collect, faces_task_env, gateway_base_env, photo, producer, repo_root, request_file, request_inline, scratch_dir, send,
    start_gateway_config, start_worker, unique, voice_task_env, worker_config, Gateway, Received, TaskTopics, FACE_MODELS,
    VAD_MODEL,
};

/// A request to send: its task, and its record's value made for a given id.
type Request = (&'static str, Box<dyn Fn(&str) -> Vec<u8>>);

/// A gateway of the voice, image and `stream` tasks on topics of its own, calling the worker
/// at `worker_url` over `protocol`.
struct Door {
    gateway: Gateway,
    voice: TaskTopics,
    image: TaskTopics,
    stream: TaskTopics,
}

impl Door {
    async fn start(name: &str, worker_url: &str, protocol: &str, root: &Path) -> Door {
        let voice = TaskTopics::create(&format!("{name}-voice"), 1).await.expect("topics");
        let image = TaskTopics::create(&format!("{name}-image"), 1).await.expect("topics");
        let stream = TaskTopics::create(&format!("{name}-stream"), 1).await.expect("topics");
        // Silero's streaming step, a model of two inputs, fed by the `tensor` converter.
        let config = root.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "[tasks.stream]\nconverter = \"tensor\"\nmodel = \"silero_stream\"\nrequests_topic = \"{}\"\n\
                 results_topic = \"{}\"\ndlq_topic = \"{}\"\n\n[tasks.stream.tensor]\ninputs = [\"chunk\", \"state\"]\n\
                 datatype = \"FP32\"\n\n[[tasks.stream.outputs]]\nname = \"speech_prob\"\n\n[[tasks.stream.outputs]]\nname = \"next_state\"\n",
                stream.requests, stream.results, stream.dlq
            ),
        )
        .expect("gateway config");
        let mut env = gateway_base_env(&unique("gw"), worker_url, root);
        env.extend(voice_task_env(&voice));
        env.extend(faces_task_env(&image));
        env.push(("WORKER__PROTOCOL", protocol.to_string()));
        let gateway = start_gateway_config(&config, &env).await.expect("gateway starts");
        Door { gateway, voice, image, stream }
    }

    fn topic(&self, task: &str) -> &str {
        match task {
            "voice" => &self.voice.requests,
            "image" => &self.image.requests,
            _ => &self.stream.requests,
        }
    }

    /// Sends every request (task, value made for an id) under ids `<prefix>-<n>`; returns what
    /// each `n` ended as.
    async fn run(&mut self, prefix: &str, requests: &[Request]) -> HashMap<String, Received> {
        let producer = producer();
        for (n, (task, value)) in requests.iter().enumerate() {
            let id = format!("{prefix}-{n}");
            send(&producer, self.topic(task), &id, &value(&id)).await.expect("send");
        }
        let topics = [
            &*self.voice.results,
            &*self.voice.dlq,
            &*self.image.results,
            &*self.image.dlq,
            &*self.stream.results,
            &*self.stream.dlq,
        ];
        let want = requests.len();
        let got = collect(&topics, Duration::from_secs(240), |by_id| by_id.len() >= want).await.expect("collect");
        assert_eq!(got.len(), want, "{} of {want} answered; gateway log:\n{}", got.len(), self.gateway.log_tail());
        got.into_iter().map(|(id, mut r)| (id.rsplit('-').next().unwrap_or_default().to_string(), r.remove(0))).collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_on_the_grpc_door_gets_what_one_on_http_gets() {
    let root = scratch_dir("gateway-grpc");
    let models = [VAD_MODEL, FACE_MODELS[0], FACE_MODELS[1], FACE_MODELS[2]];
    let extra = format!(
        "grpc_listen = \"127.0.0.1:0\"\nmodel_repository = \"{}\"\n[batching]\ncalibrate = false",
        repo_root().join("models/repository").display()
    );
    let mut worker = start_worker(&worker_config(&extra, &models)).await.expect("worker starts");
    let grpc_url = format!("http://{}", worker.grpc.clone().expect("the worker reports its gRPC address"));

    let mut requests: Vec<Request> = Vec::new();
    let mut speech = Vec::new();
    for (n, phrase) in ["The quick brown fox jumps over the lazy dog.", "Please call Stella and ask her to bring these things."]
        .iter()
        .enumerate()
    {
        let voice = speak(phrase).expect("espeak-ng");
        let samples = change_rate(&voice.samples, voice.sample_rate, 16_000);
        let path = root.join(format!("speech-{n}.wav"));
        write_wav(&path, &samples, 16_000, 1, SampleFormat::I16).expect("wav");
        speech.extend(samples);
        requests.push(("voice", Box::new(move |id| request_file(id, "voice", &path))));
    }
    for name in ["Tom_Hanks_54745.png", "astronaut.png"] {
        let path = root.join(name);
        std::fs::copy(photo(name), &path).expect("copy the photograph");
        requests.push(("image", Box::new(move |id| request_file(id, "image", &path))));
    }
    // Two streaming steps over the speech: its first 576 samples from a zero state, then the next.
    let b64 = |values: &[f32]| base64::engine::general_purpose::STANDARD.encode(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
    for step in 0..2 {
        let chunk = b64(&speech[step * 512..step * 512 + 576]);
        let state = b64(&vec![0.1f32 * step as f32; 256]);
        let event = json!({"inputs": [
            {"name": "state", "datatype": "FP32", "shape": [1, 2, 128], "data_b64": state},
            {"name": "chunk", "datatype": "FP32", "shape": [1, 576], "data_b64": chunk},
        ]})
        .to_string();
        requests.push(("stream", Box::new(move |id| request_inline(id, "stream", event.as_bytes()))));
    }
    let missing = root.join("no-such-clip.wav");
    requests.push(("voice", Box::new(move |id| request_file(id, "voice", &missing))));

    let mut http = Door::start("grpc-ref", &worker.url, "http", &root).await;
    let mut grpc = Door::start("grpc-door", &grpc_url, "grpc", &root).await;
    // Ready: its worker asked over gRPC (ServerReady).
    let readiness = grpc.gateway.wait_readiness(|status, _| status == 200).await;
    assert!(readiness["checks"].to_string().contains(&grpc_url), "its readiness names the worker's gRPC URL: {readiness}");

    let started = Instant::now();
    let by_http = http.run(&unique("h"), &requests).await;
    let by_grpc = grpc.run(&unique("g"), &requests).await;
    eprintln!("both doors answered {} requests each in {:?}", requests.len(), started.elapsed());
    for n in 0..requests.len() {
        let (h, g) = (&by_http[&n.to_string()], &by_grpc[&n.to_string()]);
        let kind = |r: &Received| if r.topic.ends_with(".dlq") { "dead letter" } else { "result" };
        assert_eq!(kind(h), kind(g), "request {n}: {} vs {}", h.value, g.value);
        if kind(g) == "dead letter" {
            assert_eq!(h.value["error"]["kind"], g.value["error"]["kind"], "request {n}");
            continue;
        }
        let differ = agree::difference_within(&h.value["output"], &g.value["output"], 1e-3, 0.0);
        assert!(differ.is_none(), "request {n} differs at {}:\nHTTP {}\ngRPC {}", differ.unwrap_or_default(), h.value["output"], g.value["output"]);
        assert_eq!(h.value["model"], g.value["model"], "request {n}");
    }
    let faces = by_grpc["2"].value["output"]["faces"].as_array().map_or(0, Vec::len);
    assert_eq!(faces, 1, "one face in Tom Hanks' photograph through gRPC: {}", by_grpc["2"].value);
    let step = &by_grpc["4"].value["output"]["outputs"];
    assert_eq!(step["next_state"]["shape"], json!([1, 2, 128]), "the stream task's two outputs through gRPC: {step}");
    assert!(worker.service.is_running() && grpc.gateway.service.is_running() && http.gateway.service.is_running());
}
