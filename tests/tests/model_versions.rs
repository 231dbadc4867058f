//! Models that change while the worker serves (`docs/models.md`, "Updating a model"): version
//! folders, the repository API (index, load, unload) and `poll` mode, against the real worker
//! and, for the rollout, the real gateway and broker. The model is `shift`
//! (`tests/python/versioned_model.py`): version N answers `y = x + N`, so every answer proves
//! which version made it.
//!
//! - `tritonclient.http` rolls version 2 out, unloads and loads again
//!   (`tests/python/repository_check.py`); a corrupt file and a wrong declaration fail to load
//!   and leave version 2 serving, the index giving the reason; a load larger than the budget
//!   is refused (507); a worker in `none` mode refuses loads (400).
//! - 2,000 events through Kafka while version 2 is loaded and version 1 retired: nothing lost,
//!   no dead letter, every result's `model_version` the version whose output it carries.
//! - `poll` mode: a version folder dropped in is served, a model folder removed is unloaded.
//! - 100 load/unload cycles and 20 failed loads: the worker's resident memory and its
//!   admission budget return to within 5% of where they were after the first load.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};
use vramgate_tests::{
    python_check, request_inline, rss_bytes, scratch_dir, start_gateway_config, start_worker, unique, Collector, TaskTopics,
    Worker,
};

const MODEL: &str = "shift";

/// `shift`'s folder declaration: FP32 `x` `[batch, 4]` in, `y` out.
const DECLARATION: &str = "input = { name = \"x\", shape = [-1, 4] }\noutputs = [ { name = \"y\", shape = [-1, 4] } ]\n";

/// A declaration `shift` does not fit: two outputs, where it returns one tensor.
const MISFIT: &str = "input = { name = \"x\", shape = [-1, 4] }\n\
    outputs = [ { name = \"y\", shape = [-1, 4] }, { name = \"z\", shape = [-1, 4] } ]\n";

/// A model repository holding `shift` version 1, with `floats` floats of weights.
fn repository(name: &str, floats: usize) -> PathBuf {
    let repo = scratch_dir(name).join("repository");
    std::fs::create_dir_all(repo.join(MODEL).join("1")).expect("the version folder");
    std::fs::write(repo.join(MODEL).join("config.toml"), DECLARATION).expect("config.toml");
    write_version(&repo, 1, floats);
    repo
}

/// Writes `shift` version `version` into its folder of `repo`.
fn write_version(repo: &Path, version: u64, floats: usize) {
    let folder = repo.join(MODEL).join(version.to_string());
    std::fs::create_dir_all(&folder).expect("the version folder");
    python_check("versioned_model.py", [folder.join("model.pt").display().to_string(), version.to_string(), floats.to_string()], String::new);
}

fn worker_toml(repo: &Path, extra: &str) -> String {
    format!(
        "listen = \"127.0.0.1:0\"\ndevice = \"cpu\"\ntorch_threads = 1\nmodel_repository = \"{}\"\n{extra}\n[batching]\ncalibrate = false\n",
        repo.display()
    )
}

/// A repository call: its status and body.
async fn call(worker: &Worker, path: &str) -> (u16, String) {
    let response = reqwest::Client::new().post(format!("{}{path}", worker.url)).send().await.expect("the worker answers");
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

async fn index(worker: &Worker) -> Vec<Value> {
    let (status, body) = call(worker, "/v2/repository/index").await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("the index is JSON")
}

/// `shift`'s answer to `x` = four times `at`: the version that answered, and `y`.
async fn infer(worker: &Worker, at: f32) -> (String, Vec<f64>) {
    let body = json!({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [at, at, at, at]}]});
    let response = reqwest::Client::new().post(format!("{}/v2/models/{MODEL}/infer", worker.url)).json(&body).send().await.expect("infer");
    let status = response.status();
    let answer: Value = response.json().await.expect("JSON");
    assert!(status.is_success(), "{status}: {answer}");
    let y = answer["outputs"][0]["data"].as_array().expect("y").iter().map(|v| v.as_f64().expect("a number")).collect();
    (answer["model_version"].as_str().expect("model_version").to_string(), y)
}

/// Waits until the index shows no version of `shift` still finishing its requests.
async fn settled(worker: &Worker) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let entries = index(worker).await;
        if !entries.iter().any(|e| e["state"] == "UNLOADING" || e["state"] == "LOADING") {
            return;
        }
        assert!(Instant::now() < deadline, "still unloading: {entries:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn budget(worker: &Worker) -> u64 {
    let state: Value = reqwest::get(format!("{}/vramgate/state", worker.url)).await.expect("state").json().await.expect("JSON");
    state["admission"]["budget"].as_u64().expect("the budget")
}

/// A gateway config whose tasks (name, topics, pinned version) each send `x` to `shift` and
/// ask for `y`.
fn gateway_toml(root: &Path, worker: &str, tasks: &[(&str, &TaskTopics, Option<u64>)]) -> PathBuf {
    let mut text = format!(
        "[kafka]\ngroup_id = \"{}\"\n\n[worker]\nurl = \"{worker}\"\n\n[input]\nfile_root = \"{}\"\n\n\
         [tasks.voice]\nenabled = false\n\n[tasks.image]\nenabled = false\n",
        unique("versions-gw"),
        root.display()
    );
    for (name, topics, pin) in tasks {
        let pin = pin.map(|v| format!("model_version = {v}\n")).unwrap_or_default();
        text.push_str(&format!(
            "\n[tasks.{name}]\nconverter = \"tensor\"\nmodel = \"{MODEL}\"\n{pin}requests_topic = \"{}\"\nresults_topic = \"{}\"\n\
             dlq_topic = \"{}\"\n\n[tasks.{name}.tensor]\ninput = \"x\"\ndatatype = \"FP32\"\n\n[[tasks.{name}.outputs]]\nname = \"y\"\n",
            topics.requests, topics.results, topics.dlq
        ));
    }
    let path = root.join(format!("{}.toml", unique("gateway")));
    std::fs::write(&path, text).expect("the gateway config");
    path
}

/// The event of `task` whose `x` is four times `at`.
fn shift_event(id: &str, task: &str, at: f32) -> Vec<u8> {
    let x: Vec<u8> = [at; 4].iter().flat_map(|v| v.to_le_bytes()).collect();
    let event = json!({"datatype": "FP32", "shape": [1, 4], "data_b64": base64::engine::general_purpose::STANDARD.encode(x)});
    request_inline(id, task, &serde_json::to_vec(&event).expect("json"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tritonclient_rolls_a_version_out_and_a_bad_load_leaves_the_served_one() {
    let repo = repository("versions-api", 1024);
    let worker = start_worker(&worker_toml(&repo, "model_control = \"explicit\"\ngrpc_listen = \"127.0.0.1:0\"\n"))
        .await
        .expect("the worker starts");
    let log = || worker.service.log_tail();
    let grpc = worker.grpc.clone().expect("the gRPC door");
    python_check("repository_check.py", [worker.addr().to_string(), repo.display().to_string(), grpc], log);
    assert_eq!(infer(&worker, 3.0).await, ("2".to_string(), vec![5.0; 4]));

    // A version whose file libtorch cannot read: refused with the reason, version 2 serves on.
    let three = repo.join(MODEL).join("3");
    std::fs::create_dir_all(&three).expect("folder 3");
    std::fs::write(three.join("model.pt"), b"not a TorchScript archive").expect("a corrupt file");
    let (status, body) = call(&worker, &format!("/v2/repository/models/{MODEL}/load")).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("failed to load 'shift': version 3:"), "{body}");
    assert_eq!(infer(&worker, 1.0).await.0, "2", "the served version is untouched");
    let entries = index(&worker).await;
    let failed = entries.iter().find(|e| e["state"] == "UNAVAILABLE").unwrap_or_else(|| panic!("no reason in {entries:?}"));
    assert!(failed["reason"].as_str().is_some_and(|r| r.contains("version 3")), "{entries:?}");
    assert!(entries.contains(&json!({"name": MODEL, "version": "2", "state": "READY"})), "{entries:?}");

    // A declaration the model does not fit (two outputs; it returns one tensor): refused,
    // version 2 serves on.
    std::fs::remove_dir_all(&three).expect("folder 3 removed");
    write_version(&repo, 3, 1024);
    std::fs::write(repo.join(MODEL).join("config.toml"), MISFIT).expect("config");
    let (status, body) = call(&worker, &format!("/v2/repository/models/{MODEL}/load")).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(infer(&worker, 1.0).await.0, "2");
    std::fs::write(repo.join(MODEL).join("config.toml"), DECLARATION).expect("config");
    let (status, body) = call(&worker, &format!("/v2/repository/models/{MODEL}/load")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(infer(&worker, 1.0).await, ("3".to_string(), vec![4.0; 4]));
    assert!(index(&worker).await.iter().all(|e| e["state"] != "UNAVAILABLE"), "a successful load clears the reason");

    // A load the budget could never hold: 507 naming the price, nothing unloaded.
    let big = start_worker(&worker_toml(&repo, "model_control = \"explicit\"\nload_warmup_bytes = 1000000000000000\n")).await.expect("starts");
    write_version(&repo, 4, 1024);
    let (status, body) = call(&big, &format!("/v2/repository/models/{MODEL}/load")).await;
    assert_eq!(status, 507, "{body}");
    assert!(body.contains("more than the whole admission budget"), "{body}");
    assert_eq!(infer(&big, 0.0).await.0, "3");
    // The default mode changes nothing at run time.
    let fixed = start_worker(&worker_toml(&repo, "")).await.expect("starts");
    let (status, body) = call(&fixed, &format!("/v2/repository/models/{MODEL}/unload")).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("model_control = \\\"none\\\""), "{body}");
    assert_eq!(infer(&fixed, 0.0).await.0, "4");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_while_events_flow_loses_nothing_and_each_result_names_its_version() {
    const EVENTS: usize = 2000;
    let repo = repository("versions-rollout", 1024);
    // A cap, so that the budget is the cap's less what models hold, whatever the host has free.
    let worker = start_worker(&worker_toml(&repo, "model_control = \"explicit\"\nmemory_limit_bytes = 4294967296\nmemory_resample_ms = 50\n"))
        .await
        .expect("the worker starts");
    let budget_before = budget(&worker).await;
    let root = repo.parent().expect("scratch").to_path_buf();
    let topics = TaskTopics::create(&unique("rollout"), 2).await.expect("topics");
    let config = gateway_toml(&root, &worker.url, &[("shift", &topics, None)]);
    let gateway = start_gateway_config(&config, &[]).await.expect("the gateway starts");
    let collector = Collector::start(&[&topics.results, &topics.dlq]).expect("collector");

    // 2,000 events over about 10 s; event i carries x = [i, i, i, i].
    let requests = topics.requests.clone();
    let prefix = unique("shift");
    let ids: Vec<String> = (0..EVENTS).map(|i| format!("{prefix}-{i}")).collect();
    let sending = {
        let ids = ids.clone();
        tokio::spawn(async move {
            let producer = vramgate_tests::producer();
            for (i, id) in ids.iter().enumerate() {
                vramgate_tests::send(&producer, &requests, id, &shift_event(id, "shift", i as f32)).await.expect("send");
                if i % 20 == 19 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        })
    };
    assert!(collector.wait_until(Duration::from_secs(120), |got| got.len() >= 300).await, "no results: {}", gateway.log_tail());
    write_version(&repo, 2, 1024);
    let (status, body) = call(&worker, &format!("/v2/repository/models/{MODEL}/load")).await;
    assert_eq!(status, 200, "{body}");
    let switched_at = collector.counts().0;
    sending.await.expect("every event sent");
    let all = collector.wait_until(Duration::from_secs(180), |got| got.len() >= EVENTS).await;
    let got = collector.snapshot();
    assert!(all, "{} of {EVENTS} answered; gateway log:\n{}", got.len(), gateway.log_tail());

    let mut by_version = [0usize; 3];
    for (i, id) in ids.iter().enumerate() {
        let records = got.get(id).unwrap_or_else(|| panic!("{id} lost"));
        let record = &records[0];
        assert_eq!(record.topic, topics.results, "a dead letter: {}", record.value);
        let version = record.value["model_version"].as_str().expect("model_version");
        let shift: u64 = version.parse().unwrap_or_else(|_| panic!("model_version {version:?}"));
        let y = &record.value["output"]["outputs"]["y"]["data"];
        let want = i as f64 + shift as f64;
        assert_eq!(y, &json!([want, want, want, want]), "{id}: version {version} answered {y}");
        by_version[shift as usize] += 1;
    }
    eprintln!("rollout: {} results by version 1, {} by version 2 (the load returned at {switched_at} results)", by_version[1], by_version[2]);
    assert!(by_version[1] >= 300 && by_version[2] > 0, "{by_version:?}");
    settled(&worker).await;
    assert!(index(&worker).await.contains(&json!({"name": MODEL, "version": "2", "state": "READY"})));
    // Version 1's weights went back to the budget, version 2's were taken from it.
    let file = |v: u64| std::fs::metadata(repo.join(MODEL).join(v.to_string()).join("model.pt")).expect("the model file").len();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(budget(&worker).await, budget_before + file(1) - file(2), "the budget after the rollout");
    assert!(!index(&worker).await.iter().any(|e| e["version"] == "1"), "version 1 is gone once its requests ended");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_serves_a_new_version_folder_and_unloads_a_removed_model() {
    let repo = repository("versions-poll", 1024);
    let worker = start_worker(&worker_toml(&repo, "model_control = \"poll\"\nrepository_poll_seconds = 0.5\n")).await.expect("starts");
    assert_eq!(infer(&worker, 0.0).await.0, "1");
    let (status, _) = call(&worker, &format!("/v2/repository/models/{MODEL}/load")).await;
    assert_eq!(status, 400, "the API does not load in poll mode");
    let ready = |path: String| async move { reqwest::get(path).await.map(|r| r.status().as_u16()).unwrap_or(0) };
    let dropped = Instant::now();
    write_version(&repo, 3, 1024);
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready(format!("{}/v2/models/{MODEL}/versions/3/ready", worker.url)).await != 200 {
        assert!(Instant::now() < deadline, "version 3 not served; log:\n{}", worker.service.log_tail());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("poll: version 3 served {:?} after its folder appeared", dropped.elapsed());
    assert_eq!(infer(&worker, 1.0).await, ("3".to_string(), vec![4.0; 4]));
    assert_eq!(ready(format!("{}/v2/models/{MODEL}/versions/1/ready", worker.url)).await, 404, "out of the policy");

    std::fs::remove_dir_all(repo.join(MODEL)).expect("the model's folder removed");
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready(format!("{}/v2/models/{MODEL}/ready", worker.url)).await != 404 {
        assert!(Instant::now() < deadline, "the removed model still serves");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    settled(&worker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_load_unload_cycles_and_twenty_failed_loads_give_their_memory_back() {
    // 16 MiB of weights: a version never freed would add that much each cycle.
    const FLOATS: usize = 4 << 20;
    let repo = repository("versions-cycles", FLOATS);
    let worker = start_worker(&worker_toml(&repo, "model_control = \"explicit\"\nmemory_limit_bytes = 4294967296\nmemory_resample_ms = 50\n"))
        .await
        .expect("the worker starts");
    let load = format!("/v2/repository/models/{MODEL}/load");
    let unload = format!("/v2/repository/models/{MODEL}/unload");
    // After the first load (and a first answer, so that libtorch's lazy state exists).
    assert_eq!(infer(&worker, 0.0).await.0, "1");
    let (rss_first, budget_first) = (rss_bytes(worker.service.pid()), budget(&worker).await);
    // Unloaded, its weights are the requests' to use; loaded again, they are not.
    let weights = std::fs::metadata(repo.join(MODEL).join("1").join("model.pt")).expect("the model file").len();
    let (status, body) = call(&worker, &unload).await;
    assert_eq!(status, 200, "{body}");
    settled(&worker).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(budget(&worker).await, budget_first + weights, "the budget after the unload");
    let (status, body) = call(&worker, &load).await;
    assert_eq!(status, 200, "{body}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(budget(&worker).await, budget_first, "the budget after the load");
    let started = Instant::now();
    for cycle in 0..100 {
        let (status, body) = call(&worker, &unload).await;
        assert_eq!(status, 200, "cycle {cycle}: {body}");
        settled(&worker).await;
        let (status, body) = call(&worker, &load).await;
        assert_eq!(status, 200, "cycle {cycle}: {body}");
        assert_eq!(infer(&worker, 1.0).await.0, "1");
    }
    // 20 loads that fail after the file is read: a version 2 whose declaration it does not fit.
    write_version(&repo, 2, FLOATS);
    std::fs::write(repo.join(MODEL).join("config.toml"), MISFIT).expect("config");
    for attempt in 0..20 {
        let (status, body) = call(&worker, &load).await;
        assert_eq!(status, 400, "attempt {attempt}: {body}");
    }
    assert_eq!(infer(&worker, 1.0).await.0, "1", "version 1 serves through the failures");
    settled(&worker).await;
    tokio::time::sleep(Duration::from_millis(300)).await; // the budget is re-read every 50 ms
    let (rss_last, budget_last) = (rss_bytes(worker.service.pid()), budget(&worker).await);
    let ratio = |last: u64, first: u64| last as f64 / first as f64;
    eprintln!(
        "cycles: 100 load/unload cycles and 20 failed loads in {:.1?}; resident {rss_first} -> {rss_last} bytes ({:.3}x), \
         budget {budget_first} -> {budget_last} bytes ({:.3}x)",
        started.elapsed(),
        ratio(rss_last, rss_first),
        ratio(budget_last, budget_first)
    );
    assert!(ratio(rss_last, rss_first) <= 1.05, "resident memory grew: {rss_first} -> {rss_last}");
    assert!((ratio(budget_last, budget_first) - 1.0).abs() <= 0.05, "budget {budget_first} -> {budget_last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_task_keeps_its_version_and_a_task_a_new_version_does_not_fit_pauses_until_it_does() {
    let repo = repository("versions-pin", 1024);
    std::fs::write(repo.join(MODEL).join("config.toml"), format!("version_policy = \"all\"\n{DECLARATION}")).expect("config");
    let worker = start_worker(&worker_toml(&repo, "model_control = \"explicit\"\n")).await.expect("the worker starts");
    let root = repo.parent().expect("scratch").to_path_buf();
    let (pinned, newest) = (TaskTopics::create(&unique("pinned"), 1).await.expect("topics"), TaskTopics::create(&unique("newest"), 1).await.expect("topics"));
    let config = gateway_toml(&root, &worker.url, &[("pinned", &pinned, Some(1)), ("newest", &newest, None)]);
    let gateway = start_gateway_config(&config, &[]).await.expect("the gateway starts");
    let collector = Collector::start(&[&pinned.results, &pinned.dlq, &newest.results, &newest.dlq]).expect("collector");
    let producer = vramgate_tests::producer();
    let prefix = unique("pin");
    // Sends round `round`'s 10 events to each task; their ids.
    let send_round = |round: usize| {
        let (producer, prefix) = (&producer, &prefix);
        let (pinned, newest) = (pinned.requests.clone(), newest.requests.clone());
        async move {
            let mut ids = Vec::new();
            for i in 0..10 {
                for (task, topic) in [("pinned", &pinned), ("newest", &newest)] {
                    let id = format!("{prefix}-{round}-{task}-{i}");
                    vramgate_tests::send(producer, topic, &id, &shift_event(&id, task, i as f32)).await.expect("send");
                    ids.push(id);
                }
            }
            ids
        }
    };
    // Waits for `ids` and returns each one's (task, version answered).
    let answered = |ids: Vec<String>| {
        let collector = &collector;
        async move {
            let all = collector.wait_until(Duration::from_secs(120), |got| ids.iter().all(|id| got.contains_key(id))).await;
            assert!(all, "not every event answered");
            let got = collector.snapshot();
            ids.iter()
                .map(|id| {
                    let record = &got[id][0];
                    assert_eq!(record.value["status"], "ok", "{id}: {}", record.value);
                    let version = record.value["model_version"].as_str().expect("model_version").to_string();
                    let at: f64 = id.rsplit('-').next().expect("i").parse().expect("a number");
                    let shift: f64 = version.parse().expect("a version");
                    assert_eq!(record.value["output"]["outputs"]["y"]["data"], json!([at + shift, at + shift, at + shift, at + shift]), "{id}");
                    (record.value["task"].as_str().expect("task").to_string(), version)
                })
                .collect::<Vec<_>>()
        }
    };
    let versions = |answers: &[(String, String)], task: &str| {
        let mut v: Vec<String> = answers.iter().filter(|(t, _)| t == task).map(|(_, v)| v.clone()).collect();
        v.dedup();
        v
    };

    let first = answered(send_round(0).await).await;
    assert_eq!((versions(&first, "pinned"), versions(&first, "newest")), (vec!["1".to_string()], vec!["1".to_string()]));
    write_version(&repo, 2, 1024);
    assert_eq!(call(&worker, &format!("/v2/repository/models/{MODEL}/load")).await.0, 200);
    let second = answered(send_round(1).await).await;
    assert_eq!((versions(&second, "pinned"), versions(&second, "newest")), (vec!["1".to_string()], vec!["2".to_string()]), "the pin holds");

    // Version 3 declares its output `z`: the rows asking for `y` no longer fit. Both tasks
    // pause (the declaration is the folder's, so version 1 changes too), nothing is lost.
    write_version(&repo, 3, 1024);
    let renamed = DECLARATION.replace("name = \"y\"", "name = \"z\"");
    std::fs::write(repo.join(MODEL).join("config.toml"), format!("version_policy = \"all\"\n{renamed}")).expect("config");
    assert_eq!(call(&worker, &format!("/v2/repository/models/{MODEL}/load")).await.0, 200);
    let paused = gateway
        .metrics_when(Duration::from_secs(30), |m| {
            // The gauge says the check found the misfit; the pause counter that the fetch loop
            // has paused the partitions (it acts on the flag at its next turn, up to a poll later).
            ["newest", "pinned"].iter().all(|task| {
                m.sum("vramgate_gateway_task_misfit", &[("task", task)]) == 1.0
                    && m.sum("vramgate_gateway_partition_pauses_total", &[("task", task), ("reason", "misfit")]) >= 1.0
            })
        })
        .await;
    assert!(paused.is_ok(), "the tasks were not paused; log:\n{}", gateway.log_tail());
    let third = send_round(2).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(collector.with(|got| third.iter().filter(|id| got.contains_key(*id)).count()), 0, "a paused task answered");
    let log = gateway.service.log_text();
    assert!(log.contains("no longer fits it") && log.contains("has no output 'y'"), "the log names the misfit:\n{log}");
    let scrape = gateway.metrics().await.expect("metrics");
    assert!(scrape.sum("vramgate_gateway_partition_pauses_total", &[("reason", "misfit")]) >= 2.0, "paused by misfit");

    // The declaration fixed and loaded again: both resume, and the held events are answered.
    std::fs::write(repo.join(MODEL).join("config.toml"), format!("version_policy = \"all\"\n{DECLARATION}")).expect("config");
    assert_eq!(call(&worker, &format!("/v2/repository/models/{MODEL}/load")).await.0, 200);
    let third = answered(third).await;
    assert_eq!((versions(&third, "pinned"), versions(&third, "newest")), (vec!["1".to_string()], vec!["3".to_string()]));
    let got = collector.snapshot();
    assert!(got.values().flatten().all(|r| r.value["status"] == "ok"), "no dead letter");
    assert!(gateway.metrics().await.expect("metrics").sum("vramgate_gateway_task_misfit", &[]) == 0.0);
}
