//! The ai-worker speaks the Open Inference Protocol v2: the standard Python client works
//! against it, and bad requests get a status and a message while the worker keeps serving.

use vramgate_shared::oip::Tensor;
use vramgate_tests::oip_client::{encode, infer_body};
use vramgate_tests::{python_check, silero_worker_config, start_worker, worker_config, ONET_MODEL};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tritonclient_http_talks_to_the_worker() {
    let worker = start_worker(&silero_worker_config()).await.expect("worker starts");
    let host = worker.url.trim_start_matches("http://").to_string();
    python_check("oip_client_check.py", [&host], || worker.service.log_tail());
}

/// A model only its config entry describes (`kind = "declared"`: MTCNN's O-Net): tritonclient
/// reads its declared metadata, and its answers equal facenet-pytorch's own ONet on the same crops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tritonclient_calls_a_declared_model_and_it_agrees_with_its_package() {
    let worker = start_worker(&worker_config("[batching]\ncalibrate = false", &[ONET_MODEL])).await.expect("worker starts");
    let host = worker.url.trim_start_matches("http://").to_string();
    eprintln!("{}", python_check("declared_model_check.py", [&host], || worker.service.log_tail()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_a_status_and_a_message_and_the_worker_keeps_serving() {
    let worker = start_worker(&silero_worker_config()).await.expect("worker starts");
    let http = reqwest::Client::new();
    let infer = format!("{}/v2/models/silero_vad/infer", worker.url);
    let check = |status: u16, needle: &'static str, response: reqwest::Response| async move {
        assert_eq!(response.status().as_u16(), status);
        let body: serde_json::Value = response.json().await.expect("error bodies are json");
        let message = body["error"].as_str().expect("an error message");
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    };
    check(400, "json", http.post(&infer).body("{not json").send().await.expect("send")).await;
    let wrong_type = serde_json::json!({"inputs": [{"name": "audio", "shape": [1, 2], "datatype": "INT64", "data": [1, 2]}]});
    check(400, "FP32", http.post(&infer).json(&wrong_type).send().await.expect("send")).await;
    let wrong_rank = serde_json::json!({"inputs": [{"name": "audio", "shape": [4], "datatype": "FP32", "data": [0.0, 0.0, 0.0, 0.0]}]});
    check(400, "must have shape [-1, -1]", http.post(&infer).json(&wrong_rank).send().await.expect("send")).await;
    let too_short = serde_json::json!({"inputs": [{"name": "audio", "shape": [1, 4], "datatype": "FP32", "data": [0.0, 0.0, 0.0, 0.0]}]});
    check(400, "must have at least shape [1, 512] (min_shape), got [1, 4]", http.post(&infer).json(&too_short).send().await.expect("send")).await;
    let lying_header = http
        .post(&infer)
        .header("inference-header-content-length", "999")
        .body("{}")
        .send()
        .await
        .expect("send");
    check(400, "999", lying_header).await;
    let unknown = format!("{}/v2/models/nope/infer", worker.url);
    check(404, "unknown model", http.post(&unknown).json(&wrong_type).send().await.expect("send")).await;

    // Still serving: a valid JSON request gets probabilities.
    let ok = serde_json::json!({"inputs": [{"name": "audio", "shape": [1, 1024], "datatype": "FP32", "data": vec![0.0f32; 1024]}]});
    let response = http.post(&infer).json(&ok).send().await.expect("send");
    assert_eq!(response.status().as_u16(), 200);
    let body: serde_json::Value = response.json().await.expect("json answer");
    assert_eq!(body["outputs"][0]["shape"], serde_json::json!([1, 2]), "{body}");
}

/// A binary input is copied from the body straight into the model's tensor: wherever the
/// binary section starts (the JSON header's length decides its alignment) the answer is the
/// JSON input's, and a binary section of the wrong length or datatype gets 400 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_inputs_at_any_alignment_answer_as_json_inputs_and_bad_ones_get_400() {
    let worker = start_worker(&silero_worker_config()).await.expect("worker starts");
    let http = reqwest::Client::new();
    let infer = format!("{}/v2/models/silero_vad/infer", worker.url);
    let audio = vramgate_tests::oip_client::test_audio(2048, 7);
    let le: Vec<u8> = audio.iter().flat_map(|v| v.to_le_bytes()).collect();
    let post = |header: serde_json::Value, pad: usize, binary: Vec<u8>| {
        // Spaces after the JSON header move the binary section by `pad` bytes.
        let mut body = serde_json::to_vec(&header).expect("json");
        body.extend(std::iter::repeat_n(b' ', pad));
        let header_len = body.len();
        body.extend(binary);
        http.post(&infer).header("inference-header-content-length", header_len.to_string()).body(body).send()
    };
    let header = |datatype: &str, size: usize| {
        serde_json::json!({
            "inputs": [{"name": "audio", "shape": [1, 2048], "datatype": datatype, "parameters": {"binary_data_size": size}}],
            "outputs": [{"name": "speech_prob", "parameters": {"binary_data": false}}]
        })
    };

    let json = serde_json::json!({"inputs": [{"name": "audio", "shape": [1, 2048], "datatype": "FP32", "data": audio}]});
    let response = http.post(&infer).json(&json).send().await.expect("send");
    assert_eq!(response.status().as_u16(), 200);
    let expected: serde_json::Value = response.json().await.expect("json answer");
    let expected = &expected["outputs"][0]["data"];
    assert!(expected.as_array().is_some_and(|probs| probs.len() == 4), "{expected}");
    for pad in 0..4 {
        let response = post(header("FP32", le.len()), pad, le.clone()).await.expect("send");
        assert_eq!(response.status().as_u16(), 200, "binary section moved by {pad}");
        let answer: serde_json::Value = response.json().await.expect("json answer");
        assert_eq!(&answer["outputs"][0]["data"], expected, "binary section moved by {pad}");
    }

    let check = |status: u16, needles: &'static [&'static str], response: reqwest::Response| async move {
        assert_eq!(response.status().as_u16(), status);
        let body: serde_json::Value = response.json().await.expect("error bodies are json");
        let message = body["error"].as_str().expect("an error message");
        for needle in needles {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
    };
    // One byte short: the declared size does not match the shape.
    let short = post(header("FP32", le.len() - 1), 1, le[1..].to_vec()).await.expect("send");
    check(400, &["binary_data_size 8191", "8192 bytes"], short).await;
    // The right size, but the body ends early, or goes on past the tensor.
    let cut = post(header("FP32", le.len()), 3, le[..le.len() - 2].to_vec()).await.expect("send");
    check(400, &["8192 bytes", "run past the end"], cut).await;
    let mut long = le.clone();
    long.extend([0u8; 3]);
    check(400, &["3 bytes left over"], post(header("FP32", le.len()), 2, long).await.expect("send")).await;
    // The bytes of another datatype: refused by name, not read as f32.
    let doubles: Vec<u8> = audio.iter().flat_map(|&v| f64::from(v).to_le_bytes()).collect();
    check(400, &["must be FP32, got FP64"], post(header("FP64", doubles.len()), 1, doubles).await.expect("send")).await;
    // A NaN or an infinity inside the binary section, wherever the section starts and wherever
    // in it the value is (the worker scans a body for them as it reads it).
    let last = le.len() / 4 - 1;
    for (pad, at, bad) in [(3, 1000, f32::NAN), (0, 0, f32::NEG_INFINITY), (1, last, f32::INFINITY), (2, 1000, -f32::NAN)] {
        let mut sent = le.clone();
        sent[4 * at..4 * at + 4].copy_from_slice(&bad.to_le_bytes());
        let response = post(header("FP32", sent.len()), pad, sent).await.expect("send");
        assert_eq!(response.status().as_u16(), 400, "{bad} at {at}, section at +{pad}");
        let body: serde_json::Value = response.json().await.expect("error bodies are json");
        let message = body["error"].as_str().expect("an error message");
        assert!(message.contains("non-finite") && message.contains(&format!("element {at}")), "{message:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_carries_the_admission_state_and_the_state_endpoint_has_it_all() {
    use vramgate_shared::worker_state::{self, Admission, Unit, WorkerState};
    // A budget below what the machine has free, so that it stays put between the readings
    // below: without one it follows the host's available memory, which moves with everything
    // else the machine does (a CI run once saw it move by 7 MB between two of them).
    let config = format!("memory_budget_bytes = 1073741824\n{}", silero_worker_config());
    let worker = start_worker(&config).await.expect("worker starts");
    let http = reqwest::Client::new();
    let state: WorkerState = http
        .get(format!("{}{}", worker.url, worker_state::STATE_PATH))
        .send()
        .await
        .expect("state answers")
        .json()
        .await
        .expect("state is json");
    assert_eq!(state.admission.unit, Unit::Bytes);
    assert!(state.admission.budget > 0 && state.admission.admitted == 0, "{state:?}");
    let estimate = state.models.get("silero_vad").expect("the model's estimate");
    assert!(estimate.bytes(1024) > 1, "{estimate:?}");

    let infer = format!("{}/v2/models/silero_vad/infer", worker.url);
    let ok = serde_json::json!({"inputs": [{"name": "audio", "shape": [1, 1024], "datatype": "FP32", "data": vec![0.0f32; 1024]}]});
    let bad = serde_json::json!({"inputs": [{"name": "audio", "shape": [4], "datatype": "FP32", "data": [0.0, 0.0, 0.0, 0.0]}]});
    for (body, status) in [(ok, 200), (bad, 400)] {
        let response = http.post(&infer).json(&body).send().await.expect("send");
        assert_eq!(response.status().as_u16(), status);
        let headers = response.headers();
        let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let admission = Admission::from_headers(get).expect("admission headers on every answer");
        // Read after the request gave its bytes back.
        assert_eq!((admission.budget, admission.admitted), (state.admission.budget, 0), "{admission:?}");
        let line = get(worker_state::HEADER_ESTIMATE).and_then(worker_state::parse_estimate_header);
        // Online corrections only ever raise the line.
        let raised_or_same = line.is_some_and(|l| l.bytes(1024) >= estimate.bytes(1024));
        assert!(raised_or_same, "estimate header {:?}, state {estimate:?}", get(worker_state::HEADER_ESTIMATE));
    }
}

/// P-Net's folder takes its picture as UINT8 too (`from_uint8`: MTCNN's `(x − 127.5) / 128`
/// applied in the worker after the copy): over HTTP, the bytes of a picture get bit for bit
/// the answer its normalised FP32 values get, alone and in a batch padded up to its bucket.
/// The worker warmed every bucket at every timed size before it said ready, and times each
/// phase of a request and of a batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_picture_sent_as_bytes_answers_as_its_normalised_values_and_every_bucket_was_warmed() {
    let keys = "input = { name = \"image\", shape = [-1, 3, -1, -1], min_shape = [1, 3, 12, 12], \
                from_uint8 = { scale = 0.0078125, offset = -0.99609375 } }\n\
                outputs = [{ name = \"box_offsets\", shape = [-1, 4, -1, -1] }, { name = \"face_prob\", shape = [-1, 2, -1, -1] }]\n\
                probe_sizes = [64, 128, 256]\nbatch_probe_sizes = [48, 96]\nbatch_buckets = [1, 2, 4]";
    let worker = start_worker(&worker_config("", &[("mtcnn_pnet", "mtcnn_pnet.jit", keys, "")])).await.expect("worker starts");
    let log = worker.service.log_tail();
    let warmed = log.lines().find(|l| l.contains("batch shapes warmed")).unwrap_or_else(|| panic!("no warm-up line in:\n{log}"));
    assert!(warmed.contains("shapes=6") && warmed.contains("skipped=0"), "two sizes × three buckets: {warmed}");

    let http = reqwest::Client::new();
    let (h, w) = (48, 64);
    let pixels: Vec<u8> = (0..3 * h * w).map(|i| ((i * 37 + i / 7) % 256) as u8).collect();
    let floats: Vec<f32> = pixels.iter().map(|&p| (f32::from(p) - 127.5) / 128.0).collect();
    let send = |tensor: Tensor| {
        let (body, header_len) = encode(&[tensor]);
        let http = http.clone();
        let url = worker.url.clone();
        async move { infer_body(&http, &url, "mtcnn_pnet", body, header_len, None).await.expect("an answer") }
    };
    let from_floats = send(Tensor::new("image", vec![1, 3, h, w], floats)).await;
    assert_eq!(from_floats.status, 200, "{:?}", from_floats.error);
    let bytes = || Tensor::new("image", vec![1, 3, h, w], pixels.clone());
    let compare = |answer: &vramgate_tests::oip_client::Answer, tolerance: f32| {
        assert_eq!(answer.status, 200, "{:?}", answer.error);
        for name in ["box_offsets", "face_prob"] {
            assert_eq!(answer.output(name).shape, from_floats.output(name).shape, "{name}");
            let worst = answer.fp32(name).iter().zip(from_floats.fp32(name)).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(worst <= tolerance, "{name}: the bytes' answer differs from the values' by {worst}");
        }
    };
    // Alone: the same shape, the same kernels, bit for bit.
    compare(&send(bytes()).await, 0.0);
    // Three at once may share a batch of three rows, run as four: a batch may take other CPU
    // kernels than one row, so within 1e-6.
    for answer in futures::future::join_all((0..3).map(|_| send(bytes()))).await {
        compare(&answer, 1e-6);
    }
    let int64 = send(Tensor::new("image", vec![1, 3, 12, 12], vec![0i64; 3 * 144])).await;
    assert_eq!(int64.status, 400);
    assert!(int64.error.as_deref().is_some_and(|e| e.contains("must be FP32 (or UINT8, normalised on the device), got INT64")), "{:?}", int64.error);

    let metrics = vramgate_tests::oip_client::metrics_text(&http, &worker.url).await.expect("metrics");
    for phase in ["body", "decode", "infer", "encode"] {
        let sample = format!("request_phase_seconds_count{{model=\"mtcnn_pnet\",phase=\"{phase}\"}}");
        assert!(vramgate_tests::oip_client::metric(&metrics, &sample) >= 5.0, "{sample} in:\n{metrics}");
    }
    for phase in ["inputs", "to_device", "model", "outputs"] {
        let sample = format!("inference_phase_seconds_count{{model=\"mtcnn_pnet\",phase=\"{phase}\"}}");
        assert!(vramgate_tests::oip_client::metric(&metrics, &sample) >= 1.0, "{sample} in:\n{metrics}");
    }
}
