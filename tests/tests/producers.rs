//! Producers in other languages (issue 43): `examples/python/producer.py` (confluent-kafka)
//! and `examples/java` (kafka-clients) each send a WAV of real speech, a real photograph and a
//! request for a missing file, built and checked against `schemas/v1`, through the real
//! gateway and worker on the test broker, and hold every result and dead letter they read to
//! the same schemas.

use std::path::PathBuf;
use std::process::{Command, Output};

use vramgate_tests::wav::{change_rate, speak, write_wav, SampleFormat};
use vramgate_tests::{
    brokers, faces_task_env, gateway_base_env, photo, repo_root, scratch_dir, start_gateway, start_worker, unique, venv_python,
    voice_task_env, worker_config, Gateway, TaskTopics, Worker, FACE_MODELS, VAD_MODEL,
};

/// A worker with Silero and MTCNN, a gateway with the voice and image tasks on fresh topics,
/// and a WAV of real speech.
struct Stack {
    worker: Worker,
    gateway: Gateway,
    voice: TaskTopics,
    image: TaskTopics,
    wav: PathBuf,
}

impl Stack {
    async fn start(name: &str) -> Stack {
        let voice = TaskTopics::create(&format!("{name}-voice"), 1).await.expect("topics");
        let image = TaskTopics::create(&format!("{name}-image"), 1).await.expect("topics");
        let root = scratch_dir(name);
        let models = [VAD_MODEL, FACE_MODELS[0], FACE_MODELS[1], FACE_MODELS[2]];
        let worker = start_worker(&worker_config("[batching]\ncalibrate = false", &models)).await.expect("worker starts");
        let mut env = gateway_base_env(&unique("gw"), &worker.url, &root);
        env.extend(voice_task_env(&voice));
        env.extend(faces_task_env(&image));
        let gateway = start_gateway(&env).await.expect("gateway starts");
        let speech = speak("Kafka delivers the messages and the worker listens.").expect("espeak-ng");
        let wav = root.join("speech.wav");
        write_wav(&wav, &change_rate(&speech.samples, speech.sample_rate, 16_000), 16_000, 1, SampleFormat::I16).expect("wav");
        Stack { worker, gateway, voice, image, wav }
    }

    /// Checks what a producer printed: it succeeded, found speech, one face and the dead letter.
    fn check(&mut self, what: &str, output: Output) {
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{what} failed:\n{stdout}\n{}\ngateway log:\n{}",
            String::from_utf8_lossy(&output.stderr),
            self.gateway.log_tail()
        );
        eprint!("{stdout}");
        for want in ["voice: ", "image: 1 face(s)", "missing: dead letter input_not_found", "every event and answer matches schemas/v1"] {
            assert!(stdout.contains(want), "{what} did not print {want:?}:\n{stdout}");
        }
        assert!(self.worker.service.is_running() && self.gateway.service.is_running());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_producer_sends_by_the_schema_and_its_answers_match_it() {
    let mut stack = Stack::start("py-producer").await;
    let output = Command::new(venv_python())
        .arg(repo_root().join("examples/python/producer.py"))
        .args(["--brokers", &brokers(), "--schemas"])
        .arg(repo_root().join("schemas/v1"))
        .args(["--voice-topics", &stack.voice.requests, &stack.voice.results, &stack.voice.dlq])
        .args(["--image-topics", &stack.image.requests, &stack.image.results, &stack.image.dlq])
        .arg("--wav")
        .arg(&stack.wav)
        .arg("--image")
        .arg(photo("Tom_Hanks_54745.png"))
        .output()
        .expect("runs python");
    stack.check("examples/python/producer.py", output);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_java_producer_sends_by_the_schema_and_its_answers_match_it() {
    let mut stack = Stack::start("java-producer").await;
    let root = repo_root();
    let project = root.join("examples/java");
    // Its libraries from Maven Central, cached where scripts/broker caches Kafka's.
    let built = Command::new("mvn")
        .args(["-q", "-B"])
        .arg(format!("-Dmaven.repo.local={}", root.join(".local/m2").display()))
        .arg("-f")
        .arg(project.join("pom.xml"))
        .arg("package")
        .output()
        .expect("runs mvn");
    assert!(built.status.success(), "mvn package failed:\n{}{}", String::from_utf8_lossy(&built.stdout), String::from_utf8_lossy(&built.stderr));
    let output = Command::new("java")
        .arg("-cp")
        .arg(project.join("target/lib/*"))
        .arg(project.join("src/main/java/Producer.java"))
        .args([&brokers(), &root.join("schemas/v1").display().to_string()])
        .args([&stack.voice.requests, &stack.voice.results, &stack.voice.dlq])
        .args([&stack.image.requests, &stack.image.results, &stack.image.dlq])
        .arg(&stack.wav)
        .arg(photo("Tom_Hanks_54745.png"))
        .output()
        .expect("runs java");
    stack.check("examples/java Producer", output);
}
