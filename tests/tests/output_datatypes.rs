//! Model outputs of every datatype the worker serves, through a task's `[[outputs]]` rows, and
//! the gateway's start-up check of its task rows against the model's metadata
//! (`docs/models.md`, "Outputs" and "The start-up check"). The model is written here with the
//! venv's torch (`tests/python/token_stats_model.py`): INT64 token ids in; INT64, INT32, BOOL,
//! UINT8, FP16 and FP32 outputs. Through a `tensor` task:
//! - the INT64 values reach the result as exact integers (a sum past 2^53 that no float holds),
//!   booleans as booleans, and `threshold`, `top_k` with labels, `softmax` + `argmax` each on the
//!   datatype it takes;
//! - a gateway whose rows do not fit the model (an output the model lacks, softmax on INT64, an
//!   input datatype the model does not take) exits non-zero at start-up naming each row and the
//!   model's declaration;
//! - a gateway started before its worker consumes unchecked after its wait, says so, and stops
//!   (non-zero) once the worker answers with a model its rows do not fit.

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use serde_json::json;
use vramgate_tests::{
    collect, producer, python_check, request_inline, scratch_dir, send, start_gateway_config, start_worker, start_worker_on, unique,
    Gateway, TaskTopics,
};

/// The model's declaration, as a worker's `[[models]]` entry.
const KEYS: &str = "input = { name = \"tokens\", datatype = \"INT64\", shape = [-1, -1] }\n\
    outputs = [\n\
      { name = \"length\", datatype = \"INT64\", shape = [-1] },\n\
      { name = \"total\", datatype = \"INT64\", shape = [-1] },\n\
      { name = \"count32\", datatype = \"INT32\", shape = [-1] },\n\
      { name = \"mask\", datatype = \"BOOL\", shape = [-1, -1] },\n\
      { name = \"clipped\", datatype = \"UINT8\", shape = [-1, -1] },\n\
      { name = \"half\", datatype = \"FP16\", shape = [-1, -1] },\n\
      { name = \"mean\", shape = [-1] },\n\
    ]\n\
    probe_sizes = [4, 16, 64]\n";

/// Rows that do not fit: an output the model lacks, softmax on its INT64 output.
const MISFIT_ROWS: &str = "[[tasks.tokens.outputs]]\nname = \"nope\"\n\n\
    [[tasks.tokens.outputs]]\nname = \"length\"\npost = [\"softmax\"]\n";

/// 2^53 + 2: the first token of the test's event; the row's sum, 2^53 + 307, is odd, so no
/// double holds it.
const BIG: i64 = (1 << 53) + 2;

fn worker_toml(model: &Path) -> String {
    format!(
        "listen = \"127.0.0.1:0\"\ndevice = \"cpu\"\ntorch_threads = 1\n\n[batching]\ncalibrate = false\n\n\
         [[models]]\nname = \"token_stats\"\npath = \"{}\"\n{KEYS}",
        model.display()
    )
}

/// A gateway config of one `tensor` task on `token_stats` taking `datatype`, with `rows`.
fn gateway_toml(root: &Path, worker: &str, wait_seconds: f64, topics: &TaskTopics, datatype: &str, rows: &str) -> PathBuf {
    let path = root.join(format!("{}.toml", unique("gateway")));
    let text = format!(
        "[kafka]\ngroup_id = \"{group}\"\n\n[worker]\nurl = \"{worker}\"\nmodel_check_wait_seconds = {wait_seconds:.1}\n\n\
         [input]\nfile_root = \"{root}\"\n\n[tasks.voice]\nenabled = false\n\n[tasks.image]\nenabled = false\n\n\
         [tasks.tokens]\nconverter = \"tensor\"\nmodel = \"token_stats\"\nrequests_topic = \"{req}\"\nresults_topic = \"{res}\"\n\
         dlq_topic = \"{dlq}\"\n\n[tasks.tokens.tensor]\ninput = \"tokens\"\ndatatype = \"{datatype}\"\n\n{rows}",
        group = unique("datatypes-gw"),
        root = root.display(),
        req = topics.requests,
        res = topics.results,
        dlq = topics.dlq,
    );
    std::fs::write(&path, text).expect("writing the gateway config");
    path
}

/// The model file, written by the venv's torch.
fn model(root: &Path) -> PathBuf {
    let path = root.join("token_stats.pt");
    python_check("token_stats_model.py", [&path], String::new);
    path
}

/// Waits for the gateway to exit of itself: it must fail, and its log must name every `want`.
async fn fails_naming(gateway: &mut Gateway, want: &[&str]) {
    let status = gateway.service.wait_exit(Duration::from_secs(120)).await.expect("the gateway stops");
    let log = gateway.service.log_text();
    assert!(!status.success(), "the gateway exited {status}; log:\n{log}");
    for part in want {
        assert!(log.contains(part), "the log does not name {part:?}:\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_of_every_datatype_reach_the_result_and_rows_that_do_not_fit_stop_the_gateway() {
    let root = scratch_dir("datatypes");
    let model = model(&root);
    let worker = start_worker(&worker_toml(&model)).await.expect("the worker serves the model");

    // --- Every datatype through its rows. ---------------------------------------------------
    let labels = root.join("labels.txt");
    std::fs::write(&labels, "zero\none\ntwo\nthree\n").expect("labels");
    let rows = format!(
        "[[tasks.tokens.outputs]]\nname = \"length\"\n\n\
         [[tasks.tokens.outputs]]\nname = \"total\"\n\n\
         [[tasks.tokens.outputs]]\nname = \"count32\"\npost = [\"threshold\"]\nthreshold = 2.5\n\n\
         [[tasks.tokens.outputs]]\nname = \"mask\"\n\n\
         [[tasks.tokens.outputs]]\nname = \"clipped\"\npost = [\"top_k\"]\ntop_k = 2\nlabels = \"{}\"\n\n\
         [[tasks.tokens.outputs]]\nname = \"half\"\npost = [\"softmax\", \"argmax\"]\n\n\
         [[tasks.tokens.outputs]]\nname = \"mean\"\n",
        labels.display()
    );
    let topics = TaskTopics::create(&unique("tokens"), 1).await.expect("topics");
    let config = gateway_toml(&root, &worker.url, 30.0, &topics, "INT64", &rows);
    let gateway = start_gateway_config(&config, &[]).await.expect("the gateway starts");
    let tokens: Vec<u8> = [5, 0, BIG, 300, 0, 0, 7, 0].iter().flat_map(|t: &i64| t.to_le_bytes()).collect();
    let event = json!({"datatype": "INT64", "shape": [2, 4], "data_b64": base64::engine::general_purpose::STANDARD.encode(tokens)});
    let id = unique("tokens");
    let bytes = serde_json::to_vec(&event).expect("json");
    send(&producer(), &topics.requests, &id, &request_inline(&id, "tokens", &bytes)).await.expect("send");
    let got = collect(&[&topics.results, &topics.dlq], Duration::from_secs(120), |got| got.contains_key(&id)).await.expect("collect");
    let record = got.get(&id).and_then(|r| r.first()).unwrap_or_else(|| panic!("no answer; gateway log:\n{}", gateway.log_tail()));
    assert_eq!(record.topic, topics.results, "{}", record.value);
    let outputs = &record.value["output"]["outputs"];
    let text = outputs.to_string();
    eprintln!("outputs: {text}");
    assert_eq!(outputs["length"], json!({"shape": [2], "data": [3, 1]}));
    let total = BIG + 5 + 300;
    assert_eq!(outputs["total"]["data"], json!([total, 7]), "an INT64 past 2^53, exactly");
    assert!(text.contains(&format!("[{total},7]")), "written as the integer it is: {text}");
    assert_eq!(outputs["count32"], json!({"shape": [2], "data": [true, false]}));
    assert_eq!(outputs["mask"]["data"], json!([true, false, true, true, false, false, true, false]));
    assert_eq!(
        outputs["clipped"]["top_k"],
        json!([
            [{"index": 2, "label": "two", "score": 255}, {"index": 3, "label": "three", "score": 255}],
            [{"index": 2, "label": "two", "score": 7}, {"index": 0, "label": "zero", "score": 0}],
        ])
    );
    assert_eq!(outputs["half"], json!({"shape": [2], "index": [2, 2]}));
    let mean = outputs["mean"]["data"].as_array().expect("mean values").clone();
    assert_eq!(mean[1], json!(1.75));
    let want = (BIG + 305) as f64 / 4.0;
    assert!((mean[0].as_f64().expect("a number") / want - 1.0).abs() < 1e-6, "{mean:?}");
    drop(gateway);

    // --- Rows that do not fit: refused at start-up, each named with the declaration. --------
    let bad = TaskTopics::create(&unique("misfit"), 1).await.expect("topics");
    let config = gateway_toml(&root, &worker.url, 30.0, &bad, "FP32", MISFIT_ROWS);
    let mut gateway = start_gateway_config(&config, &[]).await.expect("the gateway starts its endpoint");
    fails_naming(
        &mut gateway,
        &[
            "tasks do not fit their models",
            "task 'tokens' [[outputs]] row 1 (name = \"nope\"): model 'token_stats' has no output 'nope'; it declares \
             length INT64 [-1], total INT64 [-1], count32 INT32 [-1], mask BOOL [-1, -1]",
            "task 'tokens' [[outputs]] row 2 (name = \"length\", post = [\"softmax\"]): softmax needs a floating-point output \
             (FP16, FP32); model 'token_stats' declares length INT64 [-1]",
            "task 'tokens' tensor.input = \"tokens\": sends FP32; model 'token_stats' declares tokens INT64 [-1, -1]",
        ],
    )
    .await;

    // --- A worker that comes up after the wait: checked then, and the misfit stops the gateway.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr").port();
    let listen = format!("127.0.0.1:{port}");
    let late = TaskTopics::create(&unique("late"), 1).await.expect("topics");
    let config = gateway_toml(&root, &format!("http://{listen}"), 1.0, &late, "INT64", MISFIT_ROWS);
    let mut gateway = start_gateway_config(&config, &[]).await.expect("the gateway starts");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !gateway.service.log_text().contains("NO WORKER ANSWERED") {
        assert!(gateway.service.is_running(), "the gateway stopped without a worker:\n{}", gateway.log_tail());
        assert!(std::time::Instant::now() < deadline, "no warning of the unchecked task:\n{}", gateway.log_tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _late_worker = start_worker_on(&worker_toml(&model), &listen).await.expect("the worker starts late");
    fails_naming(&mut gateway, &["tasks do not fit their models", "row 1 (name = \"nope\")", "row 2 (name = \"length\", post = [\"softmax\"])"])
        .await;
}
