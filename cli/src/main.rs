//! `vramgate-cli`: emit request events for files or folders, watch results and dead letters,
//! and print an event's trace from Jaeger.
//!
//! `produce` starts each event's trace (a PRODUCER span, exported when `OTEL_EXPORTER_OTLP_ENDPOINT`
//! is set) and sends its `traceparent` in the record's headers; it prints `id, file, trace id`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tracing::Instrument;
use base64::Engine;
use clap::{Parser, Subcommand};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use vramgate_cli::jaeger::{self, Jaeger};
use vramgate_cli::outputs::{self, Isolation};
use vramgate_shared::kafka::{check_reachable, Connection, Properties, CONNECT_TIMEOUT};
use vramgate_shared::telemetry::{self, context};
use rdkafka::ClientConfig;
use vramgate_shared::events::{
    DeadLetterEvent, FrameRef, FramesOutput, ImageOutput, InputRef, RequestEvent, ResultEvent, VoiceOutput, SCHEMA_VERSION,
};

#[derive(Parser)]
#[command(version, about = "Emit vramgate request events and watch their results")]
struct Cli {
    /// Kafka bootstrap servers.
    #[arg(long, env = "VRAMGATE_BROKERS", default_value = "127.0.0.1:9092", global = true)]
    brokers: String,
    /// A Kafka client properties file (`key=value` lines, as Kafka's tools take with
    /// `--command-config`): TLS and SASL settings, e.g. `security.protocol=SASL_SSL`. Keeps
    /// passwords off the command line.
    #[arg(long, env = "VRAMGATE_KAFKA_CONFIG", value_name = "FILE", global = true)]
    kafka_config: Option<PathBuf>,
    /// One librdkafka property, `key=value` (repeatable; over the file's), e.g.
    /// `--kafka-property ssl.ca.location=/etc/kafka/ca.pem`.
    #[arg(long = "kafka-property", value_name = "KEY=VALUE", global = true)]
    kafka_properties: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Send one request event per file (folders are walked, recursively) and print each id.
    Produce {
        /// The task type; events go to `<task>.requests` unless --topic says otherwise.
        #[arg(long, default_value = "voice")]
        task: String,
        #[arg(long)]
        topic: Option<String>,
        /// Send the bytes inline (base64) instead of a file:// URI.
        #[arg(long)]
        inline: bool,
        /// Only files with this extension when walking folders (case-insensitive).
        #[arg(long, default_value = "wav")]
        ext: String,
        /// Prefix for generated ids.
        #[arg(long, default_value = "")]
        id_prefix: String,
        /// Send all the files as one event, a batch of frames (`input.frames`, a picture task),
        /// rather than an event each. A video file needs nothing: one event names it.
        #[arg(long)]
        frames: bool,
        /// Extra record header, `name=value` (repeatable). A `traceparent` given here is sent
        /// as given, instead of this event's own.
        #[arg(long = "header", value_name = "NAME=VALUE")]
        headers: Vec<String>,
        /// Files or folders, or `s3://bucket/key` objects (sent as they are: the gateway
        /// reads them from the buckets its `s3.buckets` lists).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Print an event's trace from Jaeger as a tree of spans with their waits. Takes a trace id
    /// (32 hex digits, as `produce` and `watch` print) or an event id.
    Trace {
        /// Trace id or event id.
        id: String,
        /// Jaeger's query service.
        #[arg(long, env = "VRAMGATE_JAEGER_URL", default_value = "http://127.0.0.1:16686")]
        jaeger: String,
        /// Wait up to this many seconds for the trace to appear (spans are exported in batches).
        #[arg(long, default_value_t = 10.0)]
        wait_seconds: f64,
    },
    /// Print results and dead letters as they arrive.
    ///
    /// Reads with isolation.level=read_committed (unless the Kafka properties set it): in
    /// exactly-once delivery, only the outputs of committed transactions.
    Watch {
        #[arg(long, default_value = "voice")]
        task: String,
        /// Stop once these ids (one per line, first column) have all been seen.
        #[arg(long)]
        expect_ids: Option<PathBuf>,
        /// Stop after this many records.
        #[arg(long)]
        count: Option<usize>,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 120.0)]
        timeout_seconds: f64,
        /// Print the raw JSON values instead of a summary.
        #[arg(long)]
        json: bool,
        /// Read with isolation.level=read_uncommitted (over the Kafka properties): show also
        /// what aborted and still open transactions wrote, outputs that exactly-once delivery's
        /// readers never see (a crashed or fenced gateway's, a transaction redone). Without it,
        /// only committed outputs.
        #[arg(long)]
        read_uncommitted: bool,
    },
    /// Send a load (a rate or a burst) and account for every event: table, CSV, plot.
    Load(Box<vramgate_cli::load::LoadArgs>),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let kafka = cli.connection()?;
    match cli.command {
        Command::Produce { task, topic, inline, ext, id_prefix, frames, headers, paths } => {
            let topic = topic.unwrap_or_else(|| format!("{task}.requests"));
            let service = telemetry::Service { name: "vramgate-cli", version: env!("CARGO_PKG_VERSION"), log_spans: &["send"] };
            let tracing = telemetry::init(service, &telemetry::TelemetryConfig::default());
            let how = Sending { inline, frames, ext: &ext, id_prefix: &id_prefix };
            let sent = produce(&kafka, &topic, &task, &how, &headers, &paths).await;
            tracing.shutdown();
            sent
        }
        Command::Trace { id, jaeger, wait_seconds } => trace(&jaeger, &id, wait_seconds).await,
        Command::Watch { task, expect_ids, count, timeout_seconds, json, read_uncommitted } => {
            let isolation = if read_uncommitted { Isolation::ReadUncommitted } else { Isolation::ReadCommitted };
            watch(&kafka, &task, expect_ids.as_deref(), count, timeout_seconds, json, isolation).await
        }
        Command::Load(args) => vramgate_cli::load::run(&kafka, *args).await,
    }
}

impl Cli {
    /// The brokers and the properties of `--kafka-config`, then of `--kafka-property`.
    fn connection(&self) -> anyhow::Result<Connection> {
        let mut properties = Properties::default();
        if let Some(path) = &self.kafka_config {
            properties.read_file(path)?;
        }
        for pair in &self.kafka_properties {
            properties.insert_pair(pair)?;
        }
        Ok(Connection { brokers: self.brokers.clone(), properties })
    }
}

/// An `s3://` argument: an object the gateway reads, not a local file.
fn object_uri(path: &std::path::Path) -> Option<&str> {
    path.to_str().filter(|p| p.starts_with("s3://"))
}

fn collect_files(paths: &[PathBuf], ext: &str, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for path in paths {
        if object_uri(path).is_some() {
            out.push(path.clone());
        } else if path.is_dir() {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
                .with_context(|| format!("reading folder {}", path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .collect();
            entries.sort();
            let (dirs, files): (Vec<_>, Vec<_>) = entries.into_iter().partition(|p| p.is_dir());
            out.extend(files.into_iter().filter(|p| {
                p.extension().and_then(|e| e.to_str()).is_some_and(|e| e.eq_ignore_ascii_case(ext))
            }));
            collect_files(&dirs, ext, out)?;
        } else if path.is_file() {
            out.push(path.clone());
        } else {
            bail!("{} is neither a file nor a folder", path.display());
        }
    }
    Ok(())
}

/// How `produce` makes its events of the files it is given.
struct Sending<'a> {
    inline: bool,
    frames: bool,
    ext: &'a str,
    id_prefix: &'a str,
}

/// A file's input: an object's URI, its bytes inline, or a `file://` URI.
fn input_of(file: &Path, inline: bool) -> anyhow::Result<InputRef> {
    Ok(if let Some(uri) = object_uri(file) {
        anyhow::ensure!(!inline, "--inline sends local files; {uri} is an object the gateway reads");
        InputRef::Uri { uri: uri.to_string() }
    } else if inline {
        let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
        InputRef::Inline { data_b64: base64::engine::general_purpose::STANDARD.encode(bytes) }
    } else {
        let abs = file.canonicalize().with_context(|| format!("resolving {}", file.display()))?;
        InputRef::Uri { uri: format!("file://{}", abs.display()) }
    })
}

/// The events `produce` sends for `files`: one a file, or with `--frames` one for them all (a
/// batch named after its first file).
fn events_of(files: &[PathBuf], how: &Sending<'_>) -> anyhow::Result<Vec<(PathBuf, InputRef)>> {
    if !how.frames {
        return files.iter().map(|file| Ok((file.clone(), input_of(file, how.inline)?))).collect();
    }
    let frames = files
        .iter()
        .map(|file| match input_of(file, how.inline)? {
            InputRef::Uri { uri } => Ok(FrameRef::Uri { uri }),
            InputRef::Inline { data_b64 } => Ok(FrameRef::Inline { data_b64 }),
            InputRef::Frames { .. } => unreachable!("a file is one input"),
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(vec![(files[0].clone(), InputRef::Frames { frames })])
}

async fn produce(
    kafka: &Connection,
    topic: &str,
    task: &str,
    how: &Sending<'_>,
    extra_headers: &[String],
    paths: &[PathBuf],
) -> anyhow::Result<()> {
    let extra: Vec<(&str, &str)> = extra_headers
        .iter()
        .map(|h| h.split_once('=').with_context(|| format!("--header '{h}' is not name=value")))
        .collect::<anyhow::Result<_>>()?;
    let own_traceparent = !extra.iter().any(|(name, _)| name.eq_ignore_ascii_case("traceparent"));
    let mut files = Vec::new();
    collect_files(paths, how.ext, &mut files)?;
    if files.is_empty() {
        bail!("no .{} files found in {paths:?}", how.ext);
    }
    let events = events_of(&files, how)?;
    let mut defaults = ClientConfig::new();
    defaults.set("enable.idempotence", "true");
    let producer: FutureProducer = kafka.create(defaults, "the kafka producer")?;
    tokio::task::block_in_place(|| check_reachable(producer.client(), &kafka.brokers, CONNECT_TIMEOUT))?;
    for (file, input) in events {
        let id = format!("{}{}-{}", how.id_prefix, stem(&file), &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let event = RequestEvent { version: SCHEMA_VERSION, id: id.clone(), task: task.into(), input, options: None };
        let payload = serde_json::to_vec(&event)?;
        let span = tracing::info_span!(
            "send",
            otel.name = format!("send {topic}"),
            otel.kind = "producer",
            messaging.system = "kafka",
            messaging.operation.type = "send",
            messaging.destination.name = topic,
            messaging.message.id = id.as_str(),
        );
        let mut headers = OwnedHeaders::new();
        let trace = if own_traceparent { context::headers_of(&span) } else { None };
        if let Some((parent, state)) = &trace {
            headers = headers.insert(Header { key: "traceparent", value: Some(parent.as_str()) });
            if let Some(state) = state {
                headers = headers.insert(Header { key: "tracestate", value: Some(state.as_str()) });
            }
        }
        for (name, value) in &extra {
            headers = headers.insert(Header { key: name, value: Some(*value) });
        }
        let record = FutureRecord::to(topic).key(&id).payload(&payload).headers(headers);
        let sent = producer.send(record, Duration::from_secs(30)).instrument(span.clone()).await;
        sent.map_err(|(e, _)| anyhow::anyhow!("producing to {topic}: {e}"))?;
        let trace_id = context::trace_id_of(&span).unwrap_or_else(|| "-".into());
        println!("{id}\t{}\t{trace_id}", file.display());
    }
    Ok(())
}

async fn trace(jaeger_url: &str, id: &str, wait_seconds: f64) -> anyhow::Result<()> {
    let jaeger = Jaeger::new(jaeger_url)?;
    let is_trace_id = id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit());
    let deadline = Instant::now() + Duration::from_secs_f64(wait_seconds.clamp(0.0, 600.0));
    // Spans arrive in batches from each service: wait until the trace stops growing.
    let mut latest: Option<jaeger::Trace> = None;
    loop {
        let found = if is_trace_id {
            jaeger.trace(&id.to_ascii_lowercase()).await?
        } else {
            jaeger.find("api-gateway", "messaging.message.id", id, 1).await?.into_iter().next()
        };
        let settled = match (&found, &latest) {
            (Some(now), Some(before)) => now.spans.len() == before.spans.len(),
            _ => false,
        };
        if found.is_some() {
            latest = found;
        }
        if settled || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1000)).await;
    }
    match latest {
        Some(trace) => {
            print!("{}", jaeger::render(&trace));
            Ok(())
        }
        None => bail!("Jaeger at {jaeger_url} has no trace for '{id}' (is tracing on? see docs/observability.md)"),
    }
}

fn stem(path: &Path) -> String {
    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "input".into())
}

async fn watch(
    kafka: &Connection,
    task: &str,
    expect_ids: Option<&Path>,
    count: Option<usize>,
    timeout_seconds: f64,
    json: bool,
    isolation: Isolation,
) -> anyhow::Result<()> {
    let mut pending: Option<HashSet<String>> = match expect_ids {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?
                .lines()
                .filter_map(|l| l.split('\t').next())
                .filter(|id| !id.trim().is_empty())
                .map(|id| id.trim().to_string())
                .collect(),
        ),
        None => None,
    };
    let results = format!("{task}.results");
    let dlq = format!("{task}.dlq");
    let (kafka, defaults) = watch_config(kafka, isolation);
    if isolation == Isolation::ReadUncommitted {
        eprintln!("watch: reading uncommitted: outputs of aborted and still open transactions are shown too");
    }
    let consumer: StreamConsumer = kafka.create(defaults, "the kafka consumer")?;
    tokio::task::block_in_place(|| check_reachable(consumer.client(), &kafka.brokers, CONNECT_TIMEOUT))?;
    consumer.subscribe(&[results.as_str(), dlq.as_str()])?;
    let deadline = Instant::now() + Duration::from_secs_f64(timeout_seconds);
    let mut seen = 0usize;
    loop {
        if pending.as_ref().is_some_and(|p| p.is_empty()) || count.is_some_and(|c| seen >= c) {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let message = match tokio::time::timeout(left, consumer.recv()).await {
            Err(_) => {
                let missing = pending.map(|p| p.len()).unwrap_or(0);
                bail!("timed out after {timeout_seconds} s with {seen} records seen, {missing} expected ids missing");
            }
            Ok(m) => m?,
        };
        let Some(payload) = message.payload() else { continue };
        let id = serde_json::from_slice::<serde_json::Value>(payload)
            .ok()
            .and_then(|v| v.get("id").and_then(|i| i.as_str()).map(str::to_string));
        if let (Some(p), Some(id)) = (pending.as_mut(), id.as_ref()) {
            if !p.remove(id) {
                continue; // an older run's record
            }
        }
        seen += 1;
        let trace = message
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "traceparent"))
            .and_then(|h| h.value)
            .and_then(|v| context::parse_traceparent(v).ok())
            .map_or_else(|| "-".to_string(), |(trace_id, _, _)| trace_id.to_string());
        if json {
            println!("{}", String::from_utf8_lossy(payload));
        } else if message.topic() == results {
            println!("{}  trace {trace}", summarise_result(payload));
        } else {
            println!("{}  trace {trace}", summarise_dead_letter(payload));
        }
    }
}

/// The connection and consumer defaults `watch` reads with: a group of its own, from the
/// start, `read_committed` unless the properties say otherwise, or `read_uncommitted` whatever
/// they say when `--read-uncommitted` asks for it.
fn watch_config(kafka: &Connection, isolation: Isolation) -> (Connection, ClientConfig) {
    let mut defaults = outputs::reader_defaults(&format!("vramgate-cli-{}", uuid::Uuid::new_v4()));
    defaults.set("auto.offset.reset", "earliest");
    let kafka = match isolation {
        Isolation::ReadCommitted => kafka.clone(),
        Isolation::ReadUncommitted => outputs::forcing(kafka, isolation),
    };
    (kafka, defaults)
}

fn summarise_result(payload: &[u8]) -> String {
    let Ok(result) = serde_json::from_slice::<ResultEvent>(payload) else {
        return format!("unreadable result: {}", String::from_utf8_lossy(payload));
    };
    let detail = match serde_json::from_value::<FramesOutput>(result.output.clone()) {
        Ok(frames) => summarise_frames(&frames),
        Err(_) => summarise_output(&result.output),
    };
    format!(
        "{}  ok  {detail}  [{} · {:.0} ms total, {:.0} ms inference]",
        result.id, result.model, result.timings_ms.total, result.timings_ms.inference
    )
}

/// Most frames of a video's or a batch's result summarised, one line each.
const SUMMARISED_FRAMES: usize = 8;

/// A video's or a batch's result: what was read of the video, then a line per frame.
fn summarise_frames(frames: &FramesOutput) -> String {
    let mut text = match &frames.video {
        Some(v) => format!(
            "{} frame(s) of a {} {}×{} video ({}{})",
            frames.frames.len(),
            v.codec,
            v.width,
            v.height,
            v.policy,
            if v.truncated { ", more not taken" } else { "" }
        ),
        None => format!("{} frame(s)", frames.frames.len()),
    };
    for frame in frames.frames.iter().take(SUMMARISED_FRAMES) {
        let at = frame.pts_seconds.map(|t| format!(" @ {t:.2} s")).unwrap_or_default();
        let what = match (&frame.output, &frame.error) {
            (Some(output), _) => summarise_output(output),
            (None, Some(error)) => format!("failed: {} ({})", error.message, error.kind.as_str()),
            (None, None) => "nothing".into(),
        };
        text.push_str(&format!("\n    frame {}{at}: {what}", frame.index));
    }
    if frames.frames.len() > SUMMARISED_FRAMES {
        text.push_str(&format!("\n    and {} more frame(s)", frames.frames.len() - SUMMARISED_FRAMES));
    }
    text
}

/// One input's output: speech segments, faces, or a configured task's outputs.
fn summarise_output(output: &serde_json::Value) -> String {
    match serde_json::from_value::<VoiceOutput>(output.clone()) {
        Ok(v) if v.segments.is_empty() => format!("no speech in {:.2} s", v.duration_seconds),
        Ok(v) => {
            let segments: Vec<String> = v
                .segments
                .iter()
                .map(|s| format!("{:.2}–{:.2} s", s.start_seconds, s.end_seconds))
                .collect();
            format!("speech {} (of {:.2} s)", segments.join(", "), v.duration_seconds)
        }
        Err(_) => match serde_json::from_value::<ImageOutput>(output.clone()) {
            Ok(image) if image.faces.is_empty() => {
                format!("no face in {}×{} {}", image.width, image.height, image.format)
            }
            Ok(image) => {
                let best: Vec<String> = image
                    .faces
                    .iter()
                    .take(3)
                    .map(|f| format!("({:.0},{:.0})–({:.0},{:.0}) p={:.2}", f.x1, f.y1, f.x2, f.y2, f.score))
                    .collect();
                let more = image.faces.len().saturating_sub(best.len());
                let more = if more > 0 { format!(" and {more} more") } else { String::new() };
                format!(
                    "{} face(s) in {}×{} {}: {}{more}",
                    image.faces.len(),
                    image.width,
                    image.height,
                    image.format,
                    best.join(", ")
                )
            }
            Err(_) => summarise_outputs(output).unwrap_or_else(|| output.to_string()),
        },
    }
}

/// A configured task's `outputs` (a pipeline's `<stage>.<output>` too), one short part each:
/// stored objects by shape and URI, boxes by count and best labels, per-crop items by count,
/// anything else by its keys. `None` when the output has no `outputs` object.
fn summarise_outputs(output: &serde_json::Value) -> Option<String> {
    let outputs = output.get("outputs")?.as_object()?;
    let parts: Vec<String> = outputs
        .iter()
        .map(|(name, value)| {
            let shape = |v: &serde_json::Value| v.as_array().map(|d| d.iter().map(|x| x.to_string()).collect::<Vec<_>>().join("×")).unwrap_or_default();
            if let Some(uri) = value["uri"].as_str() {
                format!("{name} {} → {uri}", shape(&value["shape"]))
            } else if let Some(boxes) = value["boxes"].as_array().or_else(|| value["faces"].as_array()) {
                let best: Vec<String> = boxes
                    .iter()
                    .take(3)
                    .map(|b| format!("{} p={:.2}", b["label"].as_str().unwrap_or("box"), b["score"].as_f64().unwrap_or(f64::NAN)))
                    .collect();
                let cut = if value["cut"] == true { ", cut" } else { "" };
                format!("{name} {} box(es){}{cut}", boxes.len(), if best.is_empty() { String::new() } else { format!(": {}", best.join(", ")) })
            } else if let Some(items) = value["items"].as_array() {
                format!("{name} {} item(s)", items.len())
            } else {
                let keys: Vec<&str> = value.as_object().map(|o| o.keys().map(String::as_str).collect()).unwrap_or_default();
                format!("{name} {{{}}}", keys.join(", "))
            }
        })
        .collect();
    Some(parts.join("; "))
}

fn summarise_dead_letter(payload: &[u8]) -> String {
    match serde_json::from_slice::<DeadLetterEvent>(payload) {
        Ok(d) => format!(
            "{}  DEAD LETTER  {}: {}",
            d.id.as_deref().unwrap_or("(no id)"),
            d.error.kind.as_str(),
            d.error.message
        ),
        Err(_) => format!("unreadable dead letter: {}", String::from_utf8_lossy(payload)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    fn watch_isolation(args: &[&str]) -> Isolation {
        let cli = Cli::try_parse_from(args).expect("parses");
        match cli.command {
            Command::Watch { read_uncommitted: true, .. } => Isolation::ReadUncommitted,
            Command::Watch { read_uncommitted: false, .. } => Isolation::ReadCommitted,
            _ => panic!("not watch"),
        }
    }

    #[test]
    fn the_cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn watch_reads_committed_unless_told_otherwise() {
        assert_eq!(watch_isolation(&["vramgate-cli", "watch"]), Isolation::ReadCommitted);
        assert_eq!(watch_isolation(&["vramgate-cli", "watch", "--task", "image", "--read-uncommitted"]), Isolation::ReadUncommitted);
        assert!(Cli::try_parse_from(["vramgate-cli", "produce", "--read-uncommitted", "x.wav"]).is_err(), "watch's flag only");
        let help = Cli::command().find_subcommand_mut("watch").expect("watch").render_long_help().to_string();
        assert!(help.contains("--read-uncommitted") && help.contains("aborted"), "{help}");

        let file = |isolation: &str| {
            let mut properties = Properties::default();
            properties.insert("isolation.level", isolation);
            Connection { brokers: "127.0.0.1:9".into(), properties }
        };
        let config = |kafka: &Connection, isolation| {
            let (kafka, defaults) = watch_config(kafka, isolation);
            let config = kafka.client_config(defaults);
            (config.get("isolation.level").map(str::to_string), config.get("auto.offset.reset").map(str::to_string))
        };
        let plain = Connection { brokers: "127.0.0.1:9".into(), properties: Properties::default() };
        let earliest = Some("earliest".to_string());
        assert_eq!(config(&plain, Isolation::ReadCommitted), (Some("read_committed".into()), earliest.clone()));
        assert_eq!(config(&plain, Isolation::ReadUncommitted), (Some("read_uncommitted".into()), earliest.clone()));
        // The properties may change the default; the flag wins over them.
        assert_eq!(config(&file("read_uncommitted"), Isolation::ReadCommitted).0.as_deref(), Some("read_uncommitted"));
        assert_eq!(config(&file("read_committed"), Isolation::ReadUncommitted).0.as_deref(), Some("read_uncommitted"));
    }

    #[test]
    fn a_pipeline_result_is_summarised_output_by_output() {
        let output = serde_json::json!({"input": {}, "outputs": {
            "foreground.mask": {"uri": "s3://outputs/p/products/a/foreground.mask.png", "shape": [886, 1280], "bytes": 1, "sha256": "x", "datatype": "UINT8"},
            "people.p5": {"boxes": [{"label": "person", "score": 0.884}], "cut": true},
            "classify.logits": {"items": [{}, {}]},
        }});
        let text = summarise_outputs(&output).expect("outputs");
        assert!(text.contains("foreground.mask 886×1280 → s3://outputs/p/products/a/foreground.mask.png"), "{text}");
        assert!(text.contains("people.p5 1 box(es): person p=0.88, cut"), "{text}");
        assert!(text.contains("classify.logits 2 item(s)"), "{text}");
        assert_eq!(summarise_outputs(&serde_json::json!({"faces": []})), None);
    }

    #[test]
    fn frames_are_one_event_and_files_one_each() {
        let dir = std::env::temp_dir().join(format!("vramgate-cli-frames-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let files: Vec<PathBuf> = ["a.png", "b.png"].iter().map(|n| dir.join(n)).collect();
        for f in &files {
            std::fs::write(f, b"x").expect("write");
        }
        let how = |frames, inline| Sending { inline, frames, ext: "png", id_prefix: "" };
        let each = events_of(&files, &how(false, false)).expect("events");
        assert_eq!(each.len(), 2);
        assert!(matches!(&each[1].1, InputRef::Uri { uri } if uri.ends_with("/b.png")));
        let batch = events_of(&files, &how(true, true)).expect("one batch");
        assert_eq!(batch.len(), 1);
        match &batch[0].1 {
            InputRef::Frames { frames } => assert_eq!(frames, &[FrameRef::Inline { data_b64: "eA==".into() }, FrameRef::Inline { data_b64: "eA==".into() }]),
            other => panic!("not a batch: {other:?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_video_s_result_is_a_line_per_frame() {
        let output = serde_json::json!({
            "frames": [
                {"index": 0, "pts_seconds": 0.0, "output": {"faces": [{"x1": 1.0, "y1": 2.0, "x2": 30.0, "y2": 40.0, "score": 0.99}], "width": 400, "height": 300, "format": "ppm"}},
                {"index": 1, "pts_seconds": 10.0, "error": {"kind": "timeout", "message": "slow", "stage": "infer"}}
            ],
            "video": {"container": "mov,mp4,m4a,3gp,3g2,mj2", "codec": "h264", "width": 400, "height": 300, "policy": "intra", "truncated": true}
        });
        let frames: FramesOutput = serde_json::from_value(output).expect("frames");
        let text = summarise_frames(&frames);
        assert_eq!(
            text,
            "2 frame(s) of a h264 400×300 video (intra, more not taken)\n    frame 0 @ 0.00 s: 1 face(s) in 400×300 ppm: (1,2)–(30,40) p=0.99\n    frame 1 @ 10.00 s: failed: slow (timeout)"
        );
    }
}
