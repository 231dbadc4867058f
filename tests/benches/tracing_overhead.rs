//! Tracing overhead: the same events through the same gateway and worker, with trace export
//! off and with 100% sampling exported to a real Jaeger, in alternating runs of one process
//! each (off, on, off, on, …), so both see the same machine. Prints each run's rate and the
//! ratio of the medians; asserts nothing about speed.
//!
//! Two paths: `pipeline`, voice events (1 s WAV files) through the gateway and the worker
//! (14 spans per event: the whole trace); and `fast`, tiny events whose input is missing, so
//! each is consumed, dead-lettered and committed at the gateway's top speed (3 spans per event,
//! tens of thousands a second: the worst case for a span queue).
//!
//! `VRAMGATE_BENCH_PIPELINE_EVENTS` (default 300), `VRAMGATE_BENCH_EVENTS` (default 20,000),
//! `VRAMGATE_BENCH_ROUNDS` (default 2 pairs). Run with `scripts/bench tracing`.

use std::path::Path;
use std::time::Duration;

use vramgate_tests::bench::throughput::rate_until_produced;
use vramgate_tests::jaeger::JaegerProcess;
use vramgate_tests::wav::{compose, write_wav, SampleFormat};
use vramgate_tests::bench::median;
use vramgate_tests::{
    env_or, gateway_base_env, producer, request_file, scratch_dir, send_all, start_gateway, start_worker, unique,
    voice_task_env, worker_config, TaskTopics, VAD_MODEL,
};

const JAEGER_PORT: u16 = 26_731;


/// One gateway process over `events` already in `topics`; records per second from its first
/// consumed record to its last produced output.
async fn run(topics: &TaskTopics, root: &Path, worker: &str, events: usize, otlp: Option<&str>) -> anyhow::Result<f64> {
    let mut env = gateway_base_env(&unique("bench-trace"), worker, root);
    env.extend(voice_task_env(topics));
    env.push(("TASKS__IMAGE__ENABLED", "false".into()));
    if let Some(endpoint) = otlp {
        env.push(("TELEMETRY__OTLP_ENDPOINT", endpoint.to_string()));
    }
    let gateway = start_gateway(&env).await?;
    let rate = rate_until_produced(&gateway, events, Duration::from_secs(900)).await?;
    if otlp.is_some() {
        let scrape = gateway.metrics().await?;
        let exported = scrape.sum("vramgate_gateway_trace_spans_exported_total", &[]);
        let dropped = scrape.sum("vramgate_gateway_trace_spans_dropped_total", &[]);
        eprintln!("    (spans exported {exported:.0}, dropped {dropped:.0} so far)");
    }
    Ok(rate)
}

async fn compare(name: &str, topics_for: impl Fn(usize) -> TaskTopics, root: &Path, worker: &str, events: usize, otlp: &str, rounds: usize) -> anyhow::Result<()> {
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // A fresh group reads the same records each time: same inputs for every run.
        let topics = topics_for(round);
        off.push(run(&topics, root, worker, events, None).await?);
        on.push(run(&topics, root, worker, events, Some(otlp)).await?);
        eprintln!("{name} round {round}: off {:.0}/s, on {:.0}/s", off[round], on[round]);
    }
    let (off_m, on_m) = (median(&off), median(&on));
    println!(
        "    {name:<9} {events:>7} events   off {off_m:>9.1}/s   traced {on_m:>9.1}/s   ratio {:.3}   (runs off {off:.0?}, on {on:.0?})",
        on_m / off_m
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let pipeline_events: usize = env_or("VRAMGATE_BENCH_PIPELINE_EVENTS", 300);
    let fast_events: usize = env_or("VRAMGATE_BENCH_EVENTS", 20_000);
    let rounds: usize = env_or("VRAMGATE_BENCH_ROUNDS", 2);
    let jaeger = JaegerProcess::start(JAEGER_PORT)?;
    let otlp = jaeger.otlp_url();
    let worker_toml = format!("[telemetry]\notlp_endpoint = \"{otlp}\"\n");
    // The worker exports in both runs: what is compared is the gateway's tracing and the
    // context it sends (an untraced call starts no trace in the worker).
    let worker = start_worker(&worker_config(&worker_toml, &[VAD_MODEL])).await?;
    let root = scratch_dir("bench-trace");

    let clip = root.join("clip.wav");
    write_wav(&clip, &compose(None, 0.5, 0.5, 16_000, 1, 9).samples, 16_000, 1, SampleFormat::I16)?;
    let pipeline = TaskTopics::create("bench-trace-p", 3).await?;
    let requests: Vec<(String, Vec<u8>)> =
        (0..pipeline_events).map(|i| (format!("t{i}"), request_file(&format!("t{i}"), "voice", &clip))).collect();
    send_all(&producer(), &pipeline.requests, &requests, 500).await?;
    let fast = TaskTopics::create("bench-trace-f", 3).await?;
    let missing: Vec<(String, Vec<u8>)> = (0..fast_events)
        .map(|i| (format!("f{i}"), request_file(&format!("f{i}"), "voice", &root.join(format!("missing-{i}.wav")))))
        .collect();
    send_all(&producer(), &fast.requests, &missing, 5000).await?;

    println!();
    println!("Tracing overhead: export off vs 100% sampled to Jaeger, same events, alternating runs");
    let same = |t: &TaskTopics| TaskTopics { requests: t.requests.clone(), results: t.results.clone(), dlq: t.dlq.clone() };
    compare("pipeline", |_| same(&pipeline), &root, &worker.url, pipeline_events, &otlp, rounds).await?;
    compare("fast", |_| same(&fast), &root, &worker.url, fast_events, &otlp, rounds).await?;
    Ok(())
}
