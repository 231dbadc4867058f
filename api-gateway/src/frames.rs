//! An event of many pictures: a batch of frames (`input.frames`) or a video whose frames the
//! task's policy chooses ([`crate::video`]). Each frame is answered as one picture is
//! ([`crate::answer`]): its own charge in the byte budget, conversion, permits and worker calls,
//! so that a video costs the card what its frames cost as pictures and no more at once. Frames
//! of one event run together, up to `video.frames_in_flight` and the task's
//! `gpu_permits.max`; the decoder waits while that many are held. The result has one entry per
//! frame, in frame order; a frame that fails has its reason in its entry while the others are
//! answered, and the event is a dead letter only when no frame was answered.

use std::sync::Arc;
use std::time::Instant;

use futures::stream::{FuturesOrdered, StreamExt};
use tokio::sync::mpsc;
use tracing::Instrument;
use vramgate_shared::events::{ErrorInfo, ErrorKind, FrameEntry, FramesOutput, Stage, VideoInfo};

use crate::answer::{answer, Answered, Named, Services};
use crate::budget::{ByteBudget, Held};
use crate::failure::Failure;
use crate::input::{InputSource, Opened};
use crate::task::Task;
use crate::tasks::Plan;
use crate::video::ffmpeg::{self, Frame, VideoFile};

/// Frames of one event answered at once.
fn parallel(task: &Task) -> usize {
    task.config.video.frames_in_flight.min(task.config.gpu_permits.max).max(1)
}

/// One frame answered, in its own span and its own charge of the byte budget.
#[allow(clippy::too_many_arguments)]
async fn one(
    services: Services<'_>,
    budget: &Arc<ByteBudget>,
    task: &Task,
    id: &str,
    plan: &Arc<dyn Plan>,
    index: u32,
    pts_seconds: Option<f64>,
    bytes: Result<(Vec<u8>, Option<Held>), Failure>,
) -> (FrameEntry, Option<Answered>) {
    let span = tracing::info_span!("frame", frame.index = index, frame.pts_seconds = pts_seconds);
    let started = Instant::now();
    let answered = async {
        // The frame's charge: reserved before it was read, or counted now that it is here.
        let (bytes, held) = bytes?;
        let mut held = held.unwrap_or_else(|| budget.hold(bytes.len() as u64));
        let store_id = format!("{id}.frame-{index}");
        answer(services, task, &mut held, Named { id, store_id: &store_id, keep: 0 }, plan, bytes, started).await
    }
    .instrument(span)
    .await;
    let mut entry = FrameEntry { index, pts_seconds, output: None, error: None };
    match answered {
        Ok(answered) => {
            entry.output = Some(answered.output.clone());
            (entry, Some(answered))
        }
        Err(failure) => {
            entry.error = Some(ErrorInfo { kind: failure.kind, message: failure.message, stage: failure.stage });
            (entry, None)
        }
    }
}

/// The event's answer from its frames' (see the module doc).
fn gather(results: Vec<(FrameEntry, Option<Answered>)>, video: Option<VideoInfo>) -> Result<Answered, Failure> {
    let answered: Vec<&Answered> = results.iter().filter_map(|(_, a)| a.as_ref()).collect();
    if answered.is_empty() {
        let Some((entry, _)) = results.first() else {
            return Err(Failure::new(ErrorKind::InvalidVideo, Stage::Convert, "no frame was chosen from the input"));
        };
        let error = entry.error.clone().expect("an entry without an answer has an error");
        return Err(Failure::new(error.kind, error.stage, format!("no frame could be answered; frame {}: {}", entry.index, error.message)));
    }
    let mut models: Vec<(String, String)> = Vec::new();
    for model in answered.iter().flat_map(|a| &a.models) {
        if !models.contains(model) {
            models.push(model.clone());
        }
    }
    let sum = |f: fn(&Answered) -> f64| answered.iter().map(|a| f(a)).sum::<f64>();
    let (convert_ms, wait_ms, inference_ms) = (sum(|a| a.convert_ms), sum(|a| a.wait_ms), sum(|a| a.inference_ms));
    let attempts = answered.iter().map(|a| a.attempts).sum();
    let frames = results.into_iter().map(|(entry, _)| entry).collect();
    let output = serde_json::to_value(FramesOutput { frames, video }).expect("the frames' output serialises");
    Ok(Answered { output, models, convert_ms, wait_ms, inference_ms, attempts })
}

/// A batch of frames, each an input of its own: sized (objects asked for theirs) and held to
/// `video.max_batch_bytes` together before any is read, then read and answered.
#[allow(clippy::too_many_arguments)]
pub async fn batch(
    services: Services<'_>,
    budget: &Arc<ByteBudget>,
    input: &InputSource,
    task: &Task,
    id: &str,
    plan: &Arc<dyn Plan>,
    frames: Vec<Opened>,
) -> Result<Answered, Failure> {
    let fetch_failed = |e: crate::input::FetchError| Failure::new(e.kind(), Stage::Fetch, e.to_string());
    let located = futures::future::join_all(frames.into_iter().map(|opened| input.locate(opened))).await;
    let total: u64 = located.iter().filter_map(|l| l.as_ref().ok()).map(Opened::size).sum();
    let limit = task.config.video.max_batch_bytes;
    if total > limit {
        return Err(Failure::new(
            ErrorKind::InputTooLarge,
            Stage::Fetch,
            format!("the batch's frames are {total} bytes together, more than the limit of {limit} bytes (video.max_batch_bytes)"),
        ));
    }
    let results = futures::stream::iter(located.into_iter().enumerate())
        .map(|(index, located)| async move {
            let bytes = match located {
                Ok(opened) => {
                    // Reserved before it is read, as an event's one input is.
                    let mut held = budget.hold(0);
                    held.grow(opened.size()).await;
                    input.read(opened).await.map(|bytes| (bytes, Some(held))).map_err(fetch_failed)
                }
                Err(e) => Err(fetch_failed(e)),
            };
            one(services, budget, task, id, plan, index as u32, None, bytes).await
        })
        .buffered(parallel(task))
        .collect::<Vec<_>>()
        .await;
    gather(results, None)
}

/// What the decoding task hands over.
enum Decoded {
    Frame(Frame),
    /// Decoding stopped early: the frames before stand.
    Stopped(Failure),
    End { truncated: bool },
}

/// A video: its header read and checked, its frames decoded in a task of their own (at most
/// one waiting beyond those being answered), each answered as it comes.
#[allow(clippy::too_many_arguments)]
pub async fn video(
    services: Services<'_>,
    budget: &Arc<ByteBudget>,
    task: &Task,
    id: &str,
    plan: &Arc<dyn Plan>,
    bytes: Vec<u8>,
    container: &'static str,
) -> Result<Answered, Failure> {
    let options = task.config.video.clone();
    if !options.enabled {
        return Err(Failure::new(
            ErrorKind::UnsupportedInput,
            Stage::Convert,
            format!("input is a {container} video; this task takes pictures only (video.enabled = false)"),
        ));
    }
    let policy = options.keyframes;
    let span = tracing::info_span!(
        "decode",
        video.container = container,
        video.bytes = bytes.len(),
        video.codec = tracing::field::Empty,
        video.width = tracing::field::Empty,
        video.height = tracing::field::Empty,
        video.policy = policy.describe(),
        video.frames = tracing::field::Empty,
    );
    let file = VideoFile::new(&bytes)?;
    drop(bytes);
    let mut decoder = {
        let _entered = span.enter();
        ffmpeg::decode(&file, &options, policy)?
    };
    let probed = decoder.header().instrument(span.clone()).await?;
    span.record("video.codec", probed.codec.as_str());
    span.record("video.width", probed.width);
    span.record("video.height", probed.height);
    let (tx, mut rx) = mpsc::channel::<Decoded>(1);
    let decoding = async move {
        // The memory file lives as long as its reader.
        let _file = file;
        let mut count = 0u32;
        let last = loop {
            let next = tokio::select! {
                next = decoder.next() => next,
                // Nobody waits for the frames any more (the event failed or was dropped).
                () = tx.closed() => return,
            };
            match next {
                Some(Ok(frame)) => {
                    count += 1;
                    if tx.send(Decoded::Frame(frame)).await.is_err() {
                        return;
                    }
                }
                Some(Err(failure)) => break Decoded::Stopped(failure),
                None => break Decoded::End { truncated: decoder.truncated },
            }
        };
        tracing::Span::current().record("video.frames", count);
        let _ = tx.send(last).await;
    };
    tokio::spawn(decoding.instrument(span));

    let parallel = parallel(task);
    let mut running = FuturesOrdered::new();
    let mut results = Vec::new();
    let (mut stopped, mut truncated, mut open) = (None, false, true);
    loop {
        tokio::select! {
            Some(done) = running.next(), if !running.is_empty() => results.push(done),
            decoded = rx.recv(), if open && running.len() < parallel => match decoded {
                Some(Decoded::Frame(frame)) => {
                    running.push_back(one(services, budget, task, id, plan, frame.index, frame.pts_seconds, Ok((frame.ppm, None))));
                }
                Some(Decoded::Stopped(failure)) => (stopped, open) = (Some(failure), false),
                Some(Decoded::End { truncated: t }) => (truncated, open) = (t, false),
                None => open = false,
            },
            else => break,
        }
    }
    if results.is_empty() {
        if let Some(failure) = stopped {
            return Err(failure);
        }
        return Err(Failure::new(ErrorKind::InvalidVideo, Stage::Convert, format!("the video gave no frame (keyframes = {})", policy.describe())));
    }
    let info = VideoInfo {
        container: probed.container,
        codec: probed.codec,
        width: probed.width,
        height: probed.height,
        duration_seconds: probed.duration_seconds,
        policy: policy.describe(),
        truncated,
        stopped: stopped.map(|f| ErrorInfo { kind: f.kind, message: f.message, stage: f.stage }),
    };
    gather(results, Some(info))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(ms: f64, model: &str) -> Answered {
        Answered {
            output: serde_json::json!({"faces": []}),
            models: vec![(model.into(), "1".into())],
            convert_ms: ms,
            wait_ms: ms,
            inference_ms: ms,
            attempts: 1,
        }
    }

    fn entry(index: u32, error: Option<&str>) -> FrameEntry {
        let error = error.map(|m| ErrorInfo { kind: ErrorKind::WorkerUnavailable, message: m.into(), stage: Stage::Infer });
        let output = error.is_none().then(|| serde_json::json!({"faces": []}));
        FrameEntry { index, pts_seconds: None, output, error }
    }

    #[test]
    fn frames_answer_together_and_fail_together_only_when_none_was_answered() {
        let mixed = vec![
            (entry(0, None), Some(answered(2.0, "a"))),
            (entry(1, Some("down")), None),
            (entry(2, None), Some(answered(3.0, "b"))),
        ];
        let done = gather(mixed, None).expect("two frames answered");
        assert_eq!(done.models, [("a".to_string(), "1".to_string()), ("b".to_string(), "1".to_string())]);
        assert_eq!((done.convert_ms, done.inference_ms, done.attempts), (5.0, 5.0, 2));
        let frames = done.output["frames"].as_array().expect("frames");
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[1]["error"]["message"], "down");
        assert!(done.output.get("video").is_none());

        let none = gather(vec![(entry(0, Some("down")), None), (entry(1, Some("gone")), None)], None).err().expect("a dead letter");
        assert_eq!(none.kind, ErrorKind::WorkerUnavailable);
        assert_eq!(none.message, "no frame could be answered; frame 0: down");
        assert_eq!(gather(Vec::new(), None).err().expect("nothing").kind, ErrorKind::InvalidVideo);
    }
}
