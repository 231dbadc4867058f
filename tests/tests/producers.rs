//! Producers in other languages (issue 43): `examples/python/producer.py` (confluent-kafka)
//! sends a WAV of real speech, a real photograph and a request for a missing file, built and
//! checked against `schemas/v1`, through the real gateway and worker on the test broker, and
//! holds every result and dead letter it reads to the same schemas.

use std::process::Command;

use vramgate_tests::wav::{change_rate, speak, write_wav, SampleFormat};
use vramgate_tests::{
    brokers, faces_task_env, gateway_base_env, photo, repo_root, scratch_dir, start_gateway, start_worker, unique, venv_python,
    voice_task_env, worker_config, TaskTopics, FACE_MODELS, VAD_MODEL,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_producer_sends_by_the_schema_and_its_answers_match_it() {
    let voice = TaskTopics::create("py-voice", 1).await.expect("topics");
    let image = TaskTopics::create("py-image", 1).await.expect("topics");
    let root = scratch_dir("py-producer");
    let models = [VAD_MODEL, FACE_MODELS[0], FACE_MODELS[1], FACE_MODELS[2]];
    let mut worker = start_worker(&worker_config("[batching]\ncalibrate = false", &models)).await.expect("worker starts");
    let mut env = gateway_base_env(&unique("gw"), &worker.url, &root);
    env.extend(voice_task_env(&voice));
    env.extend(faces_task_env(&image));
    let mut gateway = start_gateway(&env).await.expect("gateway starts");

    let speech = speak("Kafka delivers the messages and the worker listens.").expect("espeak-ng");
    let wav = root.join("speech.wav");
    write_wav(&wav, &change_rate(&speech.samples, speech.sample_rate, 16_000), 16_000, 1, SampleFormat::I16).expect("wav");
    let output = Command::new(venv_python())
        .arg(repo_root().join("examples/python/producer.py"))
        .args(["--brokers", &brokers(), "--schemas"])
        .arg(repo_root().join("schemas/v1"))
        .args(["--voice-topics", &voice.requests, &voice.results, &voice.dlq])
        .args(["--image-topics", &image.requests, &image.results, &image.dlq])
        .arg("--wav")
        .arg(&wav)
        .arg("--image")
        .arg(photo("Tom_Hanks_54745.png"))
        .output()
        .expect("runs python");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "producer.py failed:\n{stdout}\n{}\ngateway log:\n{}",
        String::from_utf8_lossy(&output.stderr),
        gateway.log_tail()
    );
    eprint!("{stdout}");
    assert!(stdout.contains("voice:") && stdout.contains("image: 1 face(s)") && stdout.contains("input_not_found"), "{stdout}");
    assert!(worker.service.is_running() && gateway.service.is_running());
}
