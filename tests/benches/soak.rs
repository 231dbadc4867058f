//! Soak: the real gateway and worker under mixed good and bad traffic at a bounded rate for a
//! long time (default 30 minutes), with the resident memory of both services sampled as it
//! goes. Prints events sent, good and bad, how each ended (results, dead letters by kind),
//! **lost** (sent minus accounted for: must be 0), duplicates, and both services' RSS at the
//! start, the end and its peak. A benchmark that prints figures: it asserts nothing about time.
//!
//! Knobs: `VRAMGATE_SOAK_SECONDS` (1800), `VRAMGATE_SOAK_RATE` (events a second, 20).
//! Run with `scripts/bench soak`.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::{Duration, Instant};

use vramgate_tests::images::{crowd, png, png_declaring, truncated_png, write};
use vramgate_tests::wav::{noise, write_wav, SampleFormat};
use vramgate_tests::{
    env_or, gateway_base_env, image_task_env, producer, request_file, request_inline, rss_bytes, scratch_dir, send,
    send_with_headers, start_gateway, start_worker, unique, voice_task_env, worker_config, Collector, TaskTopics,
    PNET_MODEL, VAD_MODEL,
};

const MIB: f64 = (1u64 << 20) as f64;


/// One kind of event the soak sends, and whether a result (true) or a dead letter is right.
struct Kind {
    name: &'static str,
    good: bool,
}

const KINDS: [Kind; 12] = [
    Kind { name: "voice", good: true },
    Kind { name: "image", good: true },
    Kind { name: "voice inline", good: true },
    Kind { name: "voice forged traceparent", good: true },
    Kind { name: "missing file", good: false },
    Kind { name: "outside root", good: false },
    Kind { name: "corrupt wav", good: false },
    Kind { name: "truncated png", good: false },
    Kind { name: "png declaring 50000²", good: false },
    Kind { name: "not json", good: false },
    Kind { name: "huge id", good: false },
    Kind { name: "fifo", good: false },
];

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let seconds: u64 = env_or("VRAMGATE_SOAK_SECONDS", 1800);
    let rate: f64 = env_or("VRAMGATE_SOAK_RATE", 20.0);
    let voice = TaskTopics::create("soak-voice", 3).await?;
    let image = TaskTopics::create("soak-image", 3).await?;
    let worker = start_worker(&worker_config("", &[VAD_MODEL, PNET_MODEL])).await?;
    let root = scratch_dir("soak");
    let outside = scratch_dir("soak-outside");
    let wav = root.join("noise.wav");
    write_wav(&wav, &noise(32_000, 0.05, 1), 16_000, 1, SampleFormat::I16)?;
    let outside_wav = outside.join("elsewhere.wav");
    write_wav(&outside_wav, &noise(8_000, 0.05, 2), 16_000, 1, SampleFormat::I16)?;
    let corrupt = write(&root, "corrupt.wav", b"RIFF\x10\x00\x00\x00WAVEjunkjunk");
    let picture = write(&root, "crowd.png", &png(&crowd(320, 240, 16.0, 3)));
    let truncated = write(&root, "truncated.png", &truncated_png(200, 200, 4));
    let huge = write(&root, "huge.png", &png_declaring(50_000, 50_000));
    let fifo = root.join("input.fifo");
    anyhow::ensure!(std::process::Command::new("mkfifo").arg(&fifo).status()?.success(), "mkfifo");
    let inline_clip = std::fs::read(&wav)?;

    let group = unique("soak");
    let mut env = gateway_base_env(&group, &worker.url, &root);
    env.extend(voice_task_env(&voice));
    env.extend(image_task_env(&image));
    let gateway = start_gateway(&env).await?;
    let collector = Collector::start(&[&voice.results, &voice.dlq, &image.results, &image.dlq])?;
    let (gw_pid, worker_pid) = (gateway.pid(), worker.service.pid());
    let rss = || (rss_bytes(gw_pid), rss_bytes(worker_pid));
    let start_rss = rss();
    let mut peak = start_rss;

    let producer = producer();
    let started = Instant::now();
    let mut sent: Vec<(String, usize)> = Vec::new();
    let mut next_sample = Instant::now();
    let mut samples = Vec::new();
    let interval = Duration::from_secs_f64(1.0 / rate.max(0.1));
    let mut tick = tokio::time::interval(interval);
    let mut i = 0usize;
    while started.elapsed() < Duration::from_secs(seconds) {
        tick.tick().await;
        let k = i % KINDS.len();
        let id = unique(&format!("soak{i}"));
        let topic = if matches!(k, 1 | 7 | 8) { &image.requests } else { &voice.requests };
        let value = match k {
            0 | 3 => request_file(&id, "voice", &wav),
            1 => request_file(&id, "image", &picture),
            2 => request_inline(&id, "voice", &inline_clip),
            4 => request_file(&id, "voice", &root.join(format!("missing-{i}.wav"))),
            5 => request_file(&id, "voice", &outside_wav),
            6 => request_file(&id, "voice", &corrupt),
            7 => request_file(&id, "image", &truncated),
            8 => request_file(&id, "image", &huge),
            9 => format!("{{\"id\": \"{id}\", not json").into_bytes(),
            10 => serde_json::to_vec(&serde_json::json!({"id": huge_id(&id), "task": "voice", "input": {"uri": "file:///x"}}))?,
            _ => request_file(&id, "voice", &fifo),
        };
        if k == 3 {
            let forged = vec![b'f'; 2048];
            send_with_headers(&producer, topic, &id, &value, &[("traceparent", &forged), ("traceparent", b"00-x")]).await?;
        } else {
            send(&producer, topic, &id, &value).await?;
        }
        sent.push((id, k));
        i += 1;
        if Instant::now() >= next_sample {
            let now = rss();
            peak = (peak.0.max(now.0), peak.1.max(now.1));
            samples.push((started.elapsed().as_secs(), now));
            let (records, _) = collector.counts();
            print!(
                "\r{:>5} s  sent {:>7}  outputs {:>7}  gateway {:>5.0} MiB  worker {:>5.0} MiB",
                started.elapsed().as_secs(),
                sent.len(),
                records,
                now.0 as f64 / MIB,
                now.1 as f64 / MIB
            );
            let _ = std::io::stdout().flush();
            next_sample = Instant::now() + Duration::from_secs(10);
        }
    }
    println!();
    // Let what is in flight finish, then account for every event sent.
    let wait_for = Duration::from_secs(120);
    collector.wait_until(wait_for, |by_id| accounted(by_id, &sent).0 >= sent.len()).await;
    let end_rss = rss();
    let by_id = collector.snapshot();
    let (found, duplicates, outcome) = accounted(&by_id, &sent);
    let bad = sent.iter().filter(|(_, k)| !KINDS[*k].good).count();
    println!("soak: {seconds} s at {rate} events/s: {} events sent, {bad} of them bad", sent.len());
    println!("  {:<28} {:>8} {:>10}", "kind", "right", "wrong end");
    for (kind, (right, wrong)) in &outcome {
        println!("  {kind:<28} {right:>8} {wrong:>10}");
    }
    println!("  accounted for {found} of {}   lost {}   duplicates {duplicates}", sent.len(), sent.len().saturating_sub(found));
    println!(
        "  gateway RSS  start {:.0} MiB  end {:.0} MiB  peak {:.0} MiB",
        start_rss.0 as f64 / MIB,
        end_rss.0 as f64 / MIB,
        peak.0 as f64 / MIB
    );
    println!(
        "  worker RSS   start {:.0} MiB  end {:.0} MiB  peak {:.0} MiB",
        start_rss.1 as f64 / MIB,
        end_rss.1 as f64 / MIB,
        peak.1 as f64 / MIB
    );
    let series: Vec<String> =
        samples.iter().map(|(t, (g, w))| format!("{t}s:{:.0}/{:.0}", *g as f64 / MIB, *w as f64 / MIB)).collect();
    println!("  RSS over time (gateway/worker MiB): {}", series.join(" "));
    Ok(())
}

/// The id of a "huge id" event: far over the gateway's 256-byte limit.
fn huge_id(id: &str) -> String {
    format!("{id}{}", "x".repeat(4096))
}

/// How many events sent ended in an output, the duplicates, and per kind of event how many
/// ended the right way (a result for a good one, a dead letter for a bad one) and the wrong way.
/// Events with no usable id are matched otherwise: a huge id comes back cut to 256 bytes, and
/// a value that is not JSON gives a dead letter with no id (counted by number).
fn accounted(by_id: &vramgate_tests::ById, sent: &[(String, usize)]) -> (usize, usize, BTreeMap<&'static str, (usize, usize)>) {
    let mut found = 0;
    let mut duplicates = 0;
    let mut outcome: BTreeMap<&'static str, (usize, usize)> = BTreeMap::new();
    let mut unnamed = by_id.get("").map_or(0, Vec::len);
    for (id, k) in sent {
        let kind = &KINDS[*k];
        let records = match *k {
            10 => by_id.get(&huge_id(id)[..256]),
            9 if unnamed > 0 => {
                unnamed -= 1;
                found += 1;
                outcome.entry(kind.name).or_default().0 += 1;
                continue;
            }
            _ => by_id.get(id),
        };
        let Some(records) = records else { continue };
        found += 1;
        duplicates += records.len() - 1;
        let entry = outcome.entry(kind.name).or_default();
        if records[0].topic.ends_with(".results") == kind.good {
            entry.0 += 1;
        } else {
            entry.1 += 1;
        }
    }
    (found, duplicates, outcome)
}
