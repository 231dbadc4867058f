//! The image task's cost per photograph: MTCNN's whole cascade (`mode = "faces"`, the default:
//! P-Net over the pyramid, R-Net, O-Net) against P-Net alone at one scale on the image
//! letterboxed to 320 × 320 (`mode = "proposals"`, what the task did before the cascade), on the
//! same real photographs (`tests/photos.md`), through Kafka, the gateway and one worker with its
//! defaults. Two gateways, one per mode, each with its own topics and group, share the worker;
//! each round runs both, one after the other, and odd rounds swap the order, so drift on a
//! shared machine falls on both alike. Figures only; nothing is asserted about speed.
//!
//! Per mode and round:
//! - **burst**: every photograph `VRAMGATE_BENCH_FACES_COPIES` times (default 4, so 28 events),
//!   sent at once; photographs a second from the first send to the last result read;
//! - **lone**: each photograph sent alone, the next after its result is read; the median
//!   end-to-end time, send to result read (read by polling every 50 ms, so figures are to
//!   about 50 ms).
//!
//! Printed: a line per run on stderr, then the medians over rounds and the cascade's cost as a
//! multiple of P-Net alone. `VRAMGATE_BENCH_ROUNDS` (default 2). About 2 minutes on 2 CPU
//! cores. Run with `scripts/bench faces`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use vramgate_tests::bench::median;
use vramgate_tests::{
    env_or, faces_task_env, gateway_base_env, photo, producer, request_file, scratch_dir, send, send_all, start_gateway,
    start_worker, unique, worker_config, Collector, Gateway, TaskTopics, FACE_MODELS,
};

const PHOTOS: [&str; 7] =
    ["astronaut.png", "camera.png", "chelsea.png", "coffee.png", "rocket.jpg", "t1.jpg", "Tom_Hanks_54745.png"];

struct Lane {
    mode: &'static str,
    topics: TaskTopics,
    collector: Collector,
    _gateway: Gateway,
}

/// One run of a lane: the burst's photographs a second and the lone photographs' median, ms.
async fn run(lane: &Lane, files: &[PathBuf], copies: usize) -> anyhow::Result<(f64, f64)> {
    let producer = producer();
    let mut records = Vec::new();
    for _ in 0..copies {
        for file in files {
            let id = unique(lane.mode);
            records.push((id.clone(), request_file(&id, "image", file)));
        }
    }
    let started = Instant::now();
    send_all(&producer, &lane.topics.requests, &records, 64).await?;
    let ids: Vec<String> = records.iter().map(|(id, _)| id.clone()).collect();
    let done = lane.collector.wait_until(Duration::from_secs(600), |seen| ids.iter().all(|id| seen.contains_key(id))).await;
    anyhow::ensure!(done, "{}: not every burst event was answered", lane.mode);
    let per_second = ids.len() as f64 / started.elapsed().as_secs_f64();

    let mut lone = Vec::new();
    for file in files {
        let id = unique(lane.mode);
        let sent = Instant::now();
        send(&producer, &lane.topics.requests, &id, &request_file(&id, "image", file)).await?;
        let done = lane.collector.wait_until(Duration::from_secs(120), |seen| seen.contains_key(&id)).await;
        anyhow::ensure!(done, "{}: {id} was not answered", lane.mode);
        lone.push(sent.elapsed().as_secs_f64() * 1e3);
    }
    let dead = lane.collector.with(|seen| seen.values().flatten().filter(|r| r.topic == lane.topics.dlq).count());
    anyhow::ensure!(dead == 0, "{}: {dead} dead letters", lane.mode);
    Ok((per_second, median(&lone)))
}


#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let rounds: usize = env_or("VRAMGATE_BENCH_ROUNDS", 2);
    let copies: usize = env_or("VRAMGATE_BENCH_FACES_COPIES", 4);
    let root = scratch_dir("bench-faces");
    let files: Vec<PathBuf> = PHOTOS
        .iter()
        .map(|name| {
            let to = root.join(name);
            std::fs::copy(photo(name), &to).map(|_| to)
        })
        .collect::<Result<_, _>>()?;
    let worker = start_worker(&worker_config("", &FACE_MODELS)).await?;
    let mut lanes = Vec::new();
    for mode in ["proposals", "faces"] {
        let topics = TaskTopics::create(&unique(&format!("bench-faces-{mode}")), 2).await?;
        let mut env = gateway_base_env(&unique("bench-faces"), &worker.url, &root);
        env.extend(faces_task_env(&topics));
        env.extend([("TASKS__IMAGE__IMAGE__MODE", mode.to_string()), ("TASKS__VOICE__ENABLED", "false".into())]);
        let gateway = start_gateway(&env).await?;
        let collector = Collector::start(&[&topics.results, &topics.dlq])?;
        lanes.push(Lane { mode, topics, collector, _gateway: gateway });
    }
    // One untimed pass each: page cache, the worker's size classes, the gateways' connections.
    for lane in &lanes {
        run(lane, &files, 1).await?;
    }
    let mut figures: Vec<Vec<(f64, f64)>> = vec![Vec::new(); lanes.len()];
    for round in 0..rounds {
        let order: Vec<usize> = if round % 2 == 0 { vec![0, 1] } else { vec![1, 0] };
        for i in order {
            let (per_second, lone_ms) = run(&lanes[i], &files, copies).await?;
            eprintln!("round {round}: {:<9} burst {per_second:6.2} photos/s, lone median {lone_ms:7.1} ms", lanes[i].mode);
            figures[i].push((per_second, lone_ms));
        }
    }
    let med = |i: usize, pick: fn(&(f64, f64)) -> f64| median(&figures[i].iter().map(pick).collect::<Vec<_>>());
    let (p_rate, f_rate) = (med(0, |f| f.0), med(1, |f| f.0));
    let (p_lone, f_lone) = (med(0, |f| f.1), med(1, |f| f.1));
    println!("image task, {} photographs × {copies} a burst, medians of {rounds} rounds (one worker, CPU)", files.len());
    println!("{:<26} {:>14} {:>16}", "mode", "burst photos/s", "lone median ms");
    println!("{:<26} {p_rate:>14.2} {p_lone:>16.1}", "proposals (P-Net, 1 scale)");
    println!("{:<26} {f_rate:>14.2} {f_lone:>16.1}", "faces (MTCNN cascade)");
    println!("cascade cost per photograph: {:.2}x P-Net alone's (burst), {:.2}x (lone)", p_rate / f_rate, f_lone / p_lone);
    Ok(())
}
