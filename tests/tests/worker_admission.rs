//! The worker admits by bytes, batches, and survives OOM: real worker processes on the CPU,
//! real libtorch, real models (Silero VAD and MTCNN's P-Net).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use vramgate_tests::oip_client::{infer, metric, metrics_text, test_audio, test_image, Answer};
use vramgate_tests::{start_worker, worker_config, PNET_KEYS, VAD_KEYS};

const PNET: (&str, &str, &str, &str) = ("pnet", "mtcnn_pnet.jit", PNET_KEYS, "");
const VAD: (&str, &str, &str, &str) = ("silero_vad", "silero_vad.jit", VAD_KEYS, "");

fn client() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(128).build().expect("http client")
}

async fn image(http: &reqwest::Client, url: &str, side: (usize, usize), seed: usize) -> Answer {
    let (h, w) = side;
    infer(http, url, "pnet", "image", vec![1, 3, h, w], test_image(h, w, seed), None).await.expect("request sent")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_mixed_requests_all_complete_within_the_budget() {
    let budget: u64 = 160 << 20;
    let extra = format!(
        "memory_budget_bytes = {budget}\nmemory_reserve_bytes = 0\nmemory_reserve_fraction = 0.0\n\
         [admission]\nmax_queue_wait_ms = 240000\nmax_queued_requests = 128\n"
    );
    let worker = start_worker(&worker_config(&extra, &[PNET, VAD])).await.expect("worker starts");
    let http = client();
    let url = worker.url.clone();
    let started = Instant::now();
    let calls = (0..64).map(|i| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            if i % 2 == 0 {
                let side = 48 + (i * 37) % 560;
                let answer = image(&http, &url, (side, side + (i % 5) * 16), i).await;
                (i, answer, Some(side))
            } else {
                let samples = 16_000 * (1 + (i * 7) % 30);
                let answer = infer(&http, &url, "silero_vad", "audio", vec![1, samples], test_audio(samples, i), None)
                    .await
                    .expect("request sent");
                (i, answer, None)
            }
        }
    });
    let answers = join_all(calls).await;
    let elapsed = started.elapsed();
    for (i, answer, side) in &answers {
        assert_eq!(answer.status, 200, "request {i}: {:?}\nworker log:\n{}", answer.error, worker.service.log_tail());
        if let Some(side) = side {
            // This image's own map: both probabilities (no-face, face) per cell.
            let h = (side - 2).div_ceil(2) - 4;
            assert_eq!(answer.output("face_prob").shape[..3], [1, 2, h], "request {i}");
        }
    }
    let text = metrics_text(&http, &url).await.expect("metrics");
    let peak = metric(&text, "gpu_memory_admitted_peak_bytes");
    let configured_budget = metric(&text, "gpu_memory_budget_bytes");
    let batches: f64 = metric(&text, "inference_batch_size_count{model=\"pnet\"}")
        + metric(&text, "inference_batch_size_count{model=\"silero_vad\"}");
    eprintln!(
        "64 mixed requests in {elapsed:?}: admitted high-water {peak} of budget {configured_budget} bytes, {batches} batches"
    );
    assert!(configured_budget > 0.0 && configured_budget <= budget as f64, "{text}");
    assert!(peak <= configured_budget, "admitted {peak} bytes over a budget of {configured_budget}");
    assert!(peak > configured_budget / 4.0, "the budget was never exercised: peak {peak}");
    assert_eq!(metric(&text, "gpu_memory_admitted_bytes"), 0.0, "bytes still admitted after every answer");
    assert_eq!(metric(&text, "inference_oom_errors_total{model=\"pnet\"}"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batched_answers_equal_answers_computed_alone() {
    // A long window so that concurrent requests surely share a batch (on a loaded machine
    // their bodies may arrive well apart; a batch waits for the window only while more are on
    // their way), and batches of up to 8 from the start: this test is about what batching
    // computes, not about whether it pays (the worker would otherwise batch only where it
    // measured a gain, `batching.rs`).
    let extra = "[batching]\nwindow_ms = 2000.0\nmax_batch_size = 8\ncalibrate = false\ninitial_batch_size = 8\n";
    let worker = start_worker(&worker_config(extra, &[PNET, VAD])).await.expect("worker starts");
    let http = client();
    // Images: two sizes, bucketed (only equal sizes share a batch).
    let sides: Vec<(usize, usize)> = vec![(64, 64), (77, 90), (64, 64), (77, 90), (64, 64), (77, 90)];
    // Audio: six lengths, padded with silence to the longest.
    let lengths: Vec<usize> = vec![16_000, 3_000, 40_000, 700, 23_456, 16_000];
    let (images, clips) = tokio::join!(
        join_all(sides.iter().enumerate().map(|(i, &s)| {
            let (http, url) = (http.clone(), worker.url.clone());
            async move { image(&http, &url, s, i % 2).await }
        })),
        join_all(lengths.iter().enumerate().map(|(i, &n)| {
            let (http, url) = (http.clone(), worker.url.clone());
            async move { infer(&http, &url, "silero_vad", "audio", vec![1, n], test_audio(n, i), None).await.expect("sent") }
        }))
    );
    let text = metrics_text(&http, &worker.url).await.expect("metrics");
    let image_batches = metric(&text, "inference_batch_size_count{model=\"pnet\"}");
    let audio_batches = metric(&text, "inference_batch_size_count{model=\"silero_vad\"}");
    eprintln!("6 images in {image_batches} batches, 6 clips in {audio_batches} batches");
    assert!(image_batches < 6.0 && audio_batches < 6.0, "nothing was merged: {image_batches} and {audio_batches} batches");
    let close = |what: String, a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len(), "{what}: lengths differ");
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "{what} differs by {worst} between batched and alone");
    };
    for (i, &side) in sides.iter().enumerate() {
        let alone = image(&http, &worker.url, side, i % 2).await;
        assert_eq!(images[i].status, 200, "{:?}", images[i].error);
        assert_eq!(images[i].output("face_prob").shape, alone.output("face_prob").shape);
        for name in ["face_prob", "box_offsets"] {
            close(format!("image {i} {side:?} {name}"), images[i].fp32(name), alone.fp32(name));
        }
    }
    for (i, &n) in lengths.iter().enumerate() {
        let alone = infer(&http, &worker.url, "silero_vad", "audio", vec![1, n], test_audio(n, i), None).await.expect("sent");
        assert_eq!(clips[i].status, 200, "{:?}", clips[i].error);
        assert_eq!(clips[i].output("speech_prob").shape, vec![1, n.div_ceil(512)]);
        close(format!("clip {i} ({n} samples)"), clips[i].fp32("speech_prob"), alone.fp32("speech_prob"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_oom_is_recovered_by_halving_and_not_repeated() {
    // A cap the 8-image batch cannot fit in, and an estimate 30x too low so admission lets
    // all 8 in at once: the batch of 8 must fail to allocate for real. Batches start at 8, as
    // on a GPU where batching pays (on this CPU the measured rule would not batch 1024² images
    // at all, and there would be no batch to fail). The window is long enough for all eight
    // 12 MB bodies to arrive on a loaded machine: with 500 ms, a whole CI=true run here (the
    // Kubernetes build beside it) saw batches of 1, 1, 1, 1 and 4 and no OOM (2026-12-02). A
    // batch leaves as soon as it holds 8, so the window costs nothing when they come at once.
    let extra = "memory_limit_bytes = 700000000\nmemory_host_allowance_bytes = 268435456\n[batching]\nwindow_ms = 10000.0\nmax_batch_size = 8\ncalibrate = false\ninitial_batch_size = 8\n";
    let low = "estimate = { base_bytes = 1000000.0, bytes_per_element = 1.0 }";
    let worker = start_worker(&worker_config(extra, &[("pnet", "mtcnn_pnet.jit", PNET_KEYS, low)]))
        .await
        .expect("worker starts");
    let http = client();
    let burst = |round: usize| {
        let (http, url) = (http.clone(), worker.url.clone());
        async move {
            join_all((0..8).map(|i| {
                let (http, url) = (http.clone(), url.clone());
                async move { image(&http, &url, (1024, 1024), round * 8 + i).await }
            }))
            .await
        }
    };
    let first = burst(0).await;
    for (i, a) in first.iter().enumerate() {
        assert_eq!(a.status, 200, "image {i}: {:?}\nworker log:\n{}", a.error, worker.service.log_tail());
    }
    let text = metrics_text(&http, &worker.url).await.expect("worker alive after OOM");
    let ooms = metric(&text, "inference_oom_errors_total{model=\"pnet\"}");
    let retries = metric(&text, "inference_retry_attempts_total{model=\"pnet\"}");
    eprintln!("first burst: {ooms} OOMs, {retries} retried batches");
    assert!(ooms >= 1.0, "the too-low estimate caused no OOM: the test proves nothing\n{text}");
    assert!(retries >= 2.0, "{text}");

    let second = burst(1).await;
    for (i, a) in second.iter().enumerate() {
        assert_eq!(a.status, 200, "image {i} of the second burst: {:?}", a.error);
    }
    let text = metrics_text(&http, &worker.url).await.expect("metrics");
    let after = metric(&text, "inference_oom_errors_total{model=\"pnet\"}");
    assert_eq!(after, ooms, "the same burst ran out of memory again: nothing was learned\n{text}");
    let meta: serde_json::Value =
        http.get(format!("{}/v2/models/pnet", worker.url)).send().await.expect("metadata").json().await.expect("json");
    let estimate = &meta["parameters"]["memory_estimate"];
    assert!(estimate["learned_max_batch_elements"].as_u64().is_some(), "{meta}");
    assert!(estimate["bytes_per_element"].as_f64().unwrap_or(0.0) > 1.0, "estimate not corrected: {meta}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn oversized_is_413_full_queue_is_503_and_a_model_error_is_400() {
    let extra = "memory_budget_bytes = 120000000\n[admission]\nmax_queued_requests = 1\nmax_queue_wait_ms = 200\n";
    let checked = ("range_checked", "range_checked_vad.jit", VAD_KEYS, "");
    let worker = start_worker(&worker_config(extra, &[PNET, checked])).await.expect("worker starts");
    let http = client();

    let big = image(&http, &worker.url, (1600, 1600), 0).await;
    assert_eq!(big.status, 413, "{big:?}");
    let message = big.error.clone().unwrap_or_default();
    assert!(message.contains("bytes") && message.contains("budget is"), "{message}");

    // Many 700-pixel images at once: a few fit, one may wait, the rest are told to come back.
    let burst = join_all((0..12).map(|i| {
        let (http, url) = (http.clone(), worker.url.clone());
        async move { image(&http, &url, (700, 700), i).await }
    }))
    .await;
    let busy: Vec<&Answer> = burst.iter().filter(|a| a.status == 503).collect();
    assert!(!busy.is_empty(), "no 503 from a full queue: {:?}", burst.iter().map(|a| a.status).collect::<Vec<_>>());
    for a in &busy {
        assert!(a.retry_after.is_some_and(|s| (1..=60).contains(&s)), "503 without a usable Retry-After: {a:?}");
    }
    let odd: Vec<_> = burst.iter().filter(|a| a.status != 200 && a.status != 503).map(|a| (a.status, &a.error)).collect();
    assert!(odd.is_empty(), "{odd:?}");
    assert!(burst.iter().any(|a| a.status == 200));

    // The model itself refuses samples outside [-1, 1]: that request, run alone, gets 400 (the
    // input's fault, counted), its batch mates and later requests are served.
    let http = Arc::new(http);
    let mixed = join_all((0..4).map(|i| {
        let (http, url) = (http.clone(), worker.url.clone());
        async move {
            let mut audio = test_audio(8000, i);
            if i == 2 {
                audio[100] = 3.0;
            }
            infer(&http, &url, "range_checked", "audio", vec![1, 8000], audio, None).await.expect("sent")
        }
    }))
    .await;
    for (i, a) in mixed.iter().enumerate() {
        if i == 2 {
            assert_eq!(a.status, 400, "{a:?}");
            assert!(a.error.as_deref().unwrap_or("").contains("[-1, 1]"), "{a:?}");
        } else {
            assert_eq!(a.status, 200, "request {i} failed with its bad batch mate: {a:?}");
        }
    }
    let after = infer(&http, &worker.url, "range_checked", "audio", vec![1, 1024], vec![0.1; 1024], None).await.expect("sent");
    assert_eq!(after.status, 200);
    assert_eq!(after.output("speech_prob").shape, vec![1, 2]);
    let text = metrics_text(&http, &worker.url).await.expect("metrics");
    assert_eq!(metric(&text, "inference_model_errors_total{model=\"range_checked\"}"), 1.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_deadline_is_504_and_gives_its_bytes_back() {
    let extra = "[admission]\nmode = \"count\"\nmax_concurrent = 1\n";
    let worker = start_worker(&worker_config(extra, &[PNET])).await.expect("worker starts");
    let http = client();
    // One slow request holds the only permit; a second with a 50 ms deadline cannot start.
    let slow = {
        let (http, url) = (http.clone(), worker.url.clone());
        tokio::spawn(async move { image(&http, &url, (1400, 1400), 0).await })
    };
    let until = Instant::now() + Duration::from_secs(30);
    while metric(&metrics_text(&http, &worker.url).await.expect("metrics"), "gpu_memory_admitted_bytes") < 1.0 {
        assert!(Instant::now() < until, "the slow request was never admitted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let hurried = infer(&http, &worker.url, "pnet", "image", vec![1, 3, 64, 64], test_image(64, 64, 1), Some(50))
        .await
        .expect("sent");
    assert_eq!(hurried.status, 504, "{hurried:?}");
    assert!(hurried.error.as_deref().unwrap_or("").contains("deadline"), "{hurried:?}");
    assert_eq!(slow.await.expect("slow request").status, 200);
    let text = metrics_text(&http, &worker.url).await.expect("metrics");
    assert_eq!(metric(&text, "gpu_memory_admitted_bytes"), 0.0, "{text}");

    // A request admitted at once whose inference outlives its deadline: 504 at the deadline,
    // and its permit is back while the batch is still running on the model's thread.
    let started = Instant::now();
    let late = infer(&http, &worker.url, "pnet", "image", vec![1, 3, 1400, 1400], test_image(1400, 1400, 2), Some(60))
        .await
        .expect("sent");
    let answered = started.elapsed();
    assert_eq!(late.status, 504, "{late:?}");
    let text = metrics_text(&http, &worker.url).await.expect("metrics");
    let running = metric(&text, "concurrent_inference_tasks");
    assert_eq!(metric(&text, "gpu_memory_admitted_bytes"), 0.0, "bytes still held after the deadline: {text}");
    eprintln!("late request answered 504 after {answered:?}; batches still running then: {running}");
}

/// A request of several rows priced past the whole budget, each row within it (a pipeline's
/// crops batched for a bigger card than this): answered 200, run as parts that fit one after
/// another, the outputs joined in row order and equal to each row answered alone. A single row
/// past the budget is still refused, 413 naming the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_past_the_budget_runs_in_parts_that_fit() {
    // Declared estimate: 1 MB + 40 B a value (about what P-Net measures on this CPU, so that
    // what it learns from each part moves it little). A 3 × 400 × 400 row is 20.2 MB; the
    // budget of 64 MiB takes three (58.6 MB), not four (77.8 MB) or five.
    let extra = "memory_budget_bytes = 67108864\nmemory_reserve_bytes = 0\nmemory_reserve_fraction = 0.0\n\
                 [admission]\nmax_queue_wait_ms = 120000\n[batching]\ncalibrate = false\n";
    let declared = "estimate = { base_bytes = 1000000.0, bytes_per_element = 40.0 }\nmax_input_elements = 20000000";
    let worker = start_worker(&worker_config(extra, &[("pnet", "mtcnn_pnet.jit", PNET_KEYS, declared)])).await.expect("worker starts");
    let http = client();
    let (side, rows) = (400, 5);
    let row_values: Vec<Vec<f32>> = (0..rows).map(|i| test_image(side, side, 3 * i + 1)).collect();
    let batch = infer(&http, &worker.url, "pnet", "image", vec![rows, 3, side, side], row_values.concat(), None).await.expect("sent");
    assert_eq!(batch.status, 200, "{:?}\nworker log:\n{}", batch.error, worker.service.log_tail());
    let probs = batch.output("face_prob");
    assert_eq!(probs.shape[0], rows, "{:?}", probs.shape);
    let per_row = batch.fp32("face_prob").len() / rows;
    for (i, values) in row_values.into_iter().enumerate() {
        let alone = infer(&http, &worker.url, "pnet", "image", vec![1, 3, side, side], values, None).await.expect("sent");
        assert_eq!(alone.status, 200, "{:?}", alone.error);
        let (got, want) = (&batch.fp32("face_prob")[i * per_row..(i + 1) * per_row], alone.fp32("face_prob"));
        let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst <= 1e-4, "row {i} differs from its answer alone by {worst}");
    }
    // One row larger than the whole budget cannot be split: 413, naming the budget.
    let huge = 1300;
    let refused = infer(&http, &worker.url, "pnet", "image", vec![1, 3, huge, huge], vec![0.0; 3 * huge * huge], None).await.expect("sent");
    assert_eq!(refused.status, 413, "{:?}", refused.error);
    assert!(refused.error.as_deref().is_some_and(|e| e.contains("whole memory budget")), "{:?}", refused.error);
}

/// With batch buckets (CUDA's default 1, 2, 4, …; declared here on the CPU), a batch fills its
/// bucket instead of stopping below it, and never runs at rows nobody was granted. Each request
/// is granted one row (a 1 MB base + 40 B a value: a 320² row is 12.3 MB, twelve bases); three
/// members run as four rows, which three grants do not cover, so the batch former used to stop
/// every batch at two: on an H200, P-Net at 480² never batched past two with 64 in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_fills_its_bucket_and_never_runs_rows_nobody_was_granted() {
    // A window long enough for a burst's bodies to arrive on a loaded machine; a batch waits
    // for it only while more requests are on their way.
    let extra = "[batching]\nwindow_ms = 5000.0\nmax_batch_size = 8\ncalibrate = false\ninitial_batch_size = 8\n";
    let declared = "estimate = { base_bytes = 1000000.0, bytes_per_element = 40.0 }\nbatch_buckets = [1, 2, 4, 8]";
    let worker = start_worker(&worker_config(extra, &[("pnet", "mtcnn_pnet.jit", PNET_KEYS, declared)])).await.expect("worker starts");
    let http = client();
    let batches = |text: &str, le: &str| metric(text, &format!("inference_batch_size_bucket{{model=\"pnet\",le=\"{le}\"}}"));
    let burst = |n: usize| {
        join_all((0..n).map(|i| {
            let (http, url) = (http.clone(), worker.url.clone());
            async move { image(&http, &url, (320, 320), i).await }
        }))
    };
    // Eight at once: one full bucket of eight (before, four batches of two).
    for answer in burst(8).await {
        assert_eq!(answer.status, 200, "{:?}", answer.error);
    }
    let text = metrics_text(&http, &worker.url).await.expect("metrics");
    let (all, up_to_two) = (batches(&text, "+Inf"), batches(&text, "2"));
    assert!(all > up_to_two, "8 concurrent requests never shared a batch of more than two: {all} batches, {up_to_two} of at most two");
    // Three at once: as four rows they would cost 1 MB + 4 × 12.3 MB against three grants of
    // 13.3 MB, so two run together and the third alone (before this change, the same).
    for answer in burst(3).await {
        assert_eq!(answer.status, 200, "{:?}", answer.error);
    }
    let after = metrics_text(&http, &worker.url).await.expect("metrics");
    let new_batches = batches(&after, "+Inf") - all;
    let of_three = (batches(&after, "3") - batches(&after, "2")) - (batches(&text, "3") - batches(&text, "2"));
    assert_eq!(of_three, 0.0, "a batch of three rows ran as four with three rows' grants");
    assert_eq!(new_batches, 2.0, "three requests ran in {new_batches} batches, not two and one");
}
