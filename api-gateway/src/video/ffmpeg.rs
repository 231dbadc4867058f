//! FFmpeg as a sandboxed child process: one `ffmpeg` per video reads its header, decodes the
//! frames a policy chooses and writes them to a pipe as binary PPM (`P6`), one after another.
//! Its log (stderr) gives the header as FFmpeg's input dump states it (`Input #0, <container>`,
//! `Duration:`, the first `Stream #0:n: Video: <codec>, …, <w>x<h>` line), checked against the
//! limits before the first frame is taken, and each chosen frame's time (`showinfo`). One
//! process rather than `ffprobe` then `ffmpeg`: starting Debian's FFmpeg costs about 50 ms of
//! CPU (its libraries' loading), which a second process would double for a video of few key
//! frames (`docs/performance.md`, "Video decoding").
//!
//! The video is handed over as a sealed memory file (`memfd`) on descriptor 3, opened by the
//! child as `file:/dev/fd/3`: nothing touches the disk, the child cannot change it, and the
//! only protocol it may open is `file` (so a playlist or reference inside the file cannot
//! reach the network or another path). The child runs with:
//! - only the allowed containers ([`super::CONTAINERS`]) and decoders (`video.decoders`), and
//!   the decoder's own pixel limit (`-max_pixels`);
//! - `RLIMIT_AS` of `video.decoder_memory_bytes`, `RLIMIT_CPU` of `video.decode_timeout_seconds`,
//!   64 open files, no core file, an empty environment but `PATH`, `/` as its directory;
//! - one decoding thread (`-threads 1`): a video costs one core, and several videos share the
//!   machine's cores between them;
//! - a wall-clock bound on every wait for it (the header, each next frame, its exit), after
//!   which it is killed; it is killed too when its reader is dropped (`kill_on_drop`).
//!
//! Its output is read within bounds: PPM headers of at most 32 bytes and frames of at most
//! `video.max_pixels`, stderr lines cut to 512 bytes and only the last few kept for the reason.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::{mpsc, oneshot};
use vramgate_shared::events::{ErrorKind, Stage};

use super::{Named, Policy, VideoOptions, CONTAINERS};
use crate::failure::Failure;

/// Longest stderr line kept (the rest of the line is read and dropped).
const MAX_LINE_BYTES: usize = 512;
/// Stderr lines (other than frame times) kept for a failure's reason.
const KEPT_LINES: usize = 8;

/// A video's bytes as a sealed memory file, for the children to read.
pub struct VideoFile {
    fd: OwnedFd,
}

impl VideoFile {
    pub fn new(bytes: &[u8]) -> Result<Self, Failure> {
        let internal = |what: &str, e: std::io::Error| Failure::new(ErrorKind::Internal, Stage::Convert, format!("{what}: {e}"));
        // SAFETY: a NUL-terminated name and flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"vramgate-video".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(internal("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just made and is owned by nothing else.
        let mut file = unsafe { File::from_raw_fd(fd) };
        file.write_all(bytes).map_err(|e| internal("writing the video to its memory file", e))?;
        let seals = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on a descriptor we own.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(internal("sealing the memory file", std::io::Error::last_os_error()));
        }
        Ok(VideoFile { fd: OwnedFd::from(file) })
    }
}

/// A video's header, as FFmpeg's input dump states it.
#[derive(Debug, Clone, PartialEq)]
pub struct Probed {
    pub container: String,
    pub codec: String,
    pub width: u32,
    pub height: u32,
    pub duration_seconds: Option<f64>,
}

/// One chosen frame: its place among those chosen, its time, and its pixels as binary PPM.
pub struct Frame {
    pub index: u32,
    pub pts_seconds: Option<f64>,
    pub ppm: Vec<u8>,
}

fn failure(kind: ErrorKind, message: impl Into<String>) -> Failure {
    Failure::new(kind, Stage::Convert, message)
}

fn seconds(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// A child reading the video on descriptor 3, within the limits (see the module doc).
fn command(program: &str, file: &VideoFile, options: &VideoOptions) -> Command {
    let mut command = Command::new(program);
    command.env_clear().current_dir("/").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
    if let Some(path) = std::env::var_os("PATH") {
        command.env("PATH", path);
    }
    let fd = file.fd.as_raw_fd();
    let memory = options.decoder_memory_bytes;
    let cpu = options.decode_timeout_seconds.ceil() as u64;
    // SAFETY: only async-signal-safe calls (dup2, fcntl, setrlimit) between fork and exec.
    unsafe {
        command.pre_exec(move || {
            if fd == 3 {
                let flags = libc::fcntl(3, libc::F_GETFD);
                if flags < 0 || libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            for (resource, limit) in [
                (libc::RLIMIT_AS, memory),
                (libc::RLIMIT_CPU, cpu),
                (libc::RLIMIT_NOFILE, 64),
                (libc::RLIMIT_CORE, 0),
            ] {
                let limit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
                if libc::setrlimit(resource, &limit) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    command
}

fn spawn(program: &str, command: &mut Command) -> Result<Child, Failure> {
    command.spawn().map_err(|e| {
        failure(
            ErrorKind::UnsupportedInput,
            format!("this gateway cannot decode video: starting '{program}' failed ({e}); install FFmpeg or set video.enabled = false"),
        )
    })
}

/// The allowed decoders as FFmpeg's `-codec_whitelist` takes them.
fn decoder_list(options: &VideoOptions) -> String {
    options.decoders.join(",")
}

/// Whether a stream of `codec` (FFmpeg's name) has an allowed decoder.
fn codec_allowed(options: &VideoOptions, codec: &str) -> bool {
    options.decoders.iter().any(|d| d == codec || (codec == "av1" && matches!(d.as_str(), "libdav1d" | "libaom-av1")))
}

/// FFmpeg's closing lines, which say only that something before them failed.
const GENERIC: [&str; 4] = ["Conversion failed!", "Error marking filters as finished", "Consider increasing the value", "Error while filtering"];

/// The last line of FFmpeg's stderr worth giving as a reason: not one of its [`GENERIC`]
/// closing lines, without its `[demuxer @ 0x…]` prefix and the path it was given, cut to
/// [`MAX_LINE_BYTES`], printable ASCII only; "(the file is cut short)" after it when FFmpeg
/// said so on any line.
fn reason(lines: &[String]) -> String {
    let worth = |l: &&String| !l.trim().is_empty() && !GENERIC.iter().any(|g| l.contains(g));
    let line = lines.iter().rev().find(worth).map_or("", String::as_str);
    let mut line = line;
    // Each `[context @ 0x…] ` prefix (a decoder's, then a helper's within it).
    while let Some(rest) = line.strip_prefix('[').and_then(|l| l.split_once("] ")).filter(|(context, _)| context.contains(" @ 0x")).map(|(_, rest)| rest) {
        line = rest;
    }
    let line = line.replace("file:/dev/fd/3: ", "").replace("file:/dev/fd/3", "the video");
    let clean: String = line.chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).take(MAX_LINE_BYTES).collect();
    let clean = clean.trim();
    let cut = lines.iter().any(|l| l.contains("partial file"));
    match (clean.is_empty(), cut) {
        (true, true) => "the file is cut short".into(),
        (true, false) => "no reason given".into(),
        (false, true) if !clean.contains("partial file") => format!("{clean} (the file is cut short)"),
        (false, _) => clean.to_string(),
    }
}

/// How a child ended, as a failure when it did not end well.
fn ended(program: &str, status: ExitStatus, lines: &[String], options: &VideoOptions) -> Result<(), Failure> {
    use std::os::unix::process::ExitStatusExt;
    if status.success() {
        return Ok(());
    }
    match status.signal() {
        Some(libc::SIGXCPU) | Some(libc::SIGKILL) => Err(failure(
            ErrorKind::Timeout,
            format!("{program} used its {} s of CPU (video.decode_timeout_seconds) and was stopped", options.decode_timeout_seconds),
        )),
        Some(signal) => Err(failure(ErrorKind::InvalidVideo, format!("{program} crashed on this video (signal {signal}); the gateway goes on"))),
        None => Err(failure(ErrorKind::InvalidVideo, format!("{program} could not read the video: {}", reason(lines)))),
    }
}

/// What FFmpeg's input dump says of the video, as far as it has been read.
#[derive(Debug, Default)]
pub struct Header {
    container: Option<String>,
    duration_seconds: Option<f64>,
}

impl Header {
    /// Reads one line of FFmpeg's log; `Some` once the first video stream's line is read:
    /// the header, checked against the limits.
    pub fn read(&mut self, line: &str, options: &VideoOptions) -> Option<Result<Probed, Failure>> {
        let cut = |s: &str| s.chars().take(64).collect::<String>();
        if let Some(rest) = line.strip_prefix("Input #0, ") {
            self.container = rest.split_once(", from ").map(|(name, _)| cut(name));
            return None;
        }
        if let Some(rest) = line.trim_start().strip_prefix("Duration: ") {
            self.duration_seconds = rest.split(',').next().and_then(clock_seconds);
            return None;
        }
        let (_, video) = line.trim_start().strip_prefix("Stream #0:")?.split_once(": Video: ")?;
        let codec = cut(video.split([' ', ',']).next().unwrap_or("unknown"));
        let size = video.split([' ', ',']).find_map(|t| {
            let (w, h) = t.split_once('x')?;
            Some((w.parse::<u32>().ok()?, h.parse::<u32>().ok()?))
        });
        let probed = Probed {
            container: self.container.clone().unwrap_or_default(),
            codec,
            width: size.map_or(0, |s| s.0),
            height: size.map_or(0, |s| s.1),
            duration_seconds: self.duration_seconds,
        };
        Some(check(probed, options))
    }
}

/// `HH:MM:SS.ss` as seconds; `None` for `N/A` or anything else.
fn clock_seconds(clock: &str) -> Option<f64> {
    let mut parts = clock.trim().split(':');
    let (h, m, s) = (parts.next()?.parse::<f64>().ok()?, parts.next()?.parse::<f64>().ok()?, parts.next()?.parse::<f64>().ok()?);
    let seconds = h * 3600.0 + m * 60.0 + s;
    (parts.next().is_none() && seconds.is_finite() && seconds >= 0.0).then_some(seconds)
}

/// A video's header held to the limits: an allowed codec, a frame size within `max_pixels`, a
/// stated duration within `max_duration_seconds`.
fn check(probed: Probed, options: &VideoOptions) -> Result<Probed, Failure> {
    let Probed { codec, width, height, duration_seconds, .. } = &probed;
    if !codec_allowed(options, codec) {
        return Err(failure(
            ErrorKind::UnsupportedInput,
            format!("the video stream is {codec}; this task decodes {} (video.decoders)", options.decoders.join(", ")),
        ));
    }
    if *width == 0 || *height == 0 {
        return Err(failure(ErrorKind::InvalidVideo, format!("the {codec} stream states no frame size")));
    }
    let pixels = u64::from(*width) * u64::from(*height);
    if pixels > options.max_pixels {
        return Err(failure(
            ErrorKind::InputTooLarge,
            format!("video frames are {width} × {height} = {pixels} pixels, more than the limit of {} (video.max_pixels)", options.max_pixels),
        ));
    }
    if let Some(d) = duration_seconds.filter(|d| *d > options.max_duration_seconds) {
        return Err(failure(
            ErrorKind::InputTooLarge,
            format!("the video lasts {d:.1} s, more than the limit of {} s (video.max_duration_seconds)", options.max_duration_seconds),
        ));
    }
    Ok(probed)
}

/// The `-vf` chain that chooses the frames (after the decoder; `intra` chooses by skipping the
/// other frames in the decoder itself) and reports each one's time.
fn filters(policy: Policy) -> String {
    let select = match policy {
        // Skipped in the decoder already where it can (`-skip_frame nokey`); some decoders
        // (VP9, AV1) give every frame regardless, and the key flag takes their key frames.
        Policy::Named(Named::Intra) => "select='eq(key\\,1)',".to_string(),
        Policy::EverySeconds { every_seconds } => format!("select='isnan(prev_selected_t)+gte(t-prev_selected_t\\,{every_seconds})',"),
        Policy::SceneChange { scene_change } => format!("select='eq(n\\,0)+gt(scene\\,{scene_change})',"),
    };
    format!("{select}showinfo=checksum=0")
}

/// A running decode: the frames as they come, at most `video.max_frames`.
pub struct Decoder {
    child: Child,
    stdout: BufReader<ChildStdout>,
    header: oneshot::Receiver<Result<Probed, Failure>>,
    times: mpsc::UnboundedReceiver<Option<f64>>,
    lines: tokio::task::JoinHandle<Log>,
    options: VideoOptions,
    max_pixels: u64,
    next: u32,
    /// More frames were chosen than `max_frames`.
    pub truncated: bool,
    done: bool,
}

/// Starts decoding the frames `policy` chooses.
pub fn decode(file: &VideoFile, options: &VideoOptions, policy: Policy) -> Result<Decoder, Failure> {
    let mut command = command(&options.ffmpeg, file, options);
    command.args(["-nostdin", "-hide_banner", "-nostats", "-loglevel", "info", "-threads", "1", "-filter_threads", "1"]);
    command.args(["-protocol_whitelist", "file", "-format_whitelist", CONTAINERS, "-codec_whitelist"]);
    command.arg(decoder_list(options));
    command.args(["-max_pixels", &options.max_pixels.to_string()]);
    if policy == Policy::Named(Named::Intra) {
        command.args(["-skip_frame", "nokey"]);
    }
    // Times as the container gives them (ffprobe's pts_time), not shifted to start at 0.
    command.args(["-copyts", "-i", "file:/dev/fd/3", "-map", "0:v:0", "-an", "-sn", "-dn", "-fps_mode", "passthrough"]);
    command.args(["-vf", &filters(policy)]);
    // One frame past the limit, to know that the policy chose more.
    command.args(["-frames:v", &(options.max_frames + 1).to_string()]);
    command.args(["-f", "image2pipe", "-c:v", "ppm", "-pix_fmt", "rgb24", "pipe:1"]);
    let mut child = spawn(&options.ffmpeg, &mut command)?;
    let stdout = BufReader::with_capacity(1 << 16, child.stdout.take().expect("piped"));
    let stderr = child.stderr.take().expect("piped");
    let (tx, times) = mpsc::unbounded_channel();
    let (header_tx, header) = oneshot::channel();
    let wanted = options.max_frames as usize + 1;
    let lines = tokio::spawn(read_log(stderr, header_tx, options.clone(), tx, wanted));
    Ok(Decoder {
        child,
        stdout,
        header,
        times,
        lines,
        options: options.clone(),
        max_pixels: options.max_pixels,
        next: 0,
        truncated: false,
        done: false,
    })
}

/// Reads FFmpeg's log: the input dump's header goes to `header` (checked, once; never sent
/// when the dump has no video stream), each `showinfo` line's `pts_time` to `times` (at most
/// `wanted`), and the last [`KEPT_LINES`] other lines are returned for a failure's reason.
async fn read_log(
    stderr: tokio::process::ChildStderr,
    header: oneshot::Sender<Result<Probed, Failure>>,
    options: VideoOptions,
    times: mpsc::UnboundedSender<Option<f64>>,
    wanted: usize,
) -> Log {
    let mut reader = BufReader::new(stderr);
    let mut over_pixels = None;
    let mut header = Some(header);
    let mut dump = Header::default();
    let mut kept: std::collections::VecDeque<String> = std::collections::VecDeque::new();
    let mut sent = 0;
    let mut line = Vec::new();
    loop {
        line.clear();
        // A bounded line: read up to the newline, keeping at most MAX_LINE_BYTES.
        let mut done = false;
        loop {
            let available = match reader.fill_buf().await {
                Ok([]) | Err(_) => {
                    done = true;
                    break;
                }
                Ok(b) => b,
            };
            let (take, newline) = match available.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (available.len(), false),
            };
            let room = MAX_LINE_BYTES.saturating_sub(line.len());
            line.extend_from_slice(&available[..take.min(room)]);
            reader.consume(take);
            if newline {
                break;
            }
        }
        if done && line.is_empty() {
            break;
        }
        let text = String::from_utf8_lossy(&line).trim_end().to_string();
        if text.starts_with("Output #") || text.starts_with("Stream mapping:") {
            // The input dump is over; what follows describes the output.
            header = None;
        }
        if over_pixels.is_none() && text.contains("exceeds specified max pixel count") {
            over_pixels = Some(reason(std::slice::from_ref(&text)));
        }
        if header.is_some() {
            if let Some(mut read) = dump.read(&text, &options) {
                // The decoder refused the frame size while reading the header (the dump then
                // states none).
                if let Some(said) = &over_pixels {
                    read = Err(failure(ErrorKind::InputTooLarge, format!("a video frame is past video.max_pixels ({}): {said}", options.max_pixels)));
                }
                let _ = header.take().expect("checked").send(read);
            }
        }
        if text.contains("Parsed_showinfo") {
            if let Some(time) = showinfo_time(&text) {
                if sent < wanted {
                    let _ = times.send(time);
                    sent += 1;
                }
                continue;
            }
            continue;
        }
        if kept.len() == KEPT_LINES {
            kept.pop_front();
        }
        kept.push_back(text);
        if done {
            break;
        }
    }
    Log { lines: kept.into(), over_pixels }
}

/// What the log kept for a failure's reason.
#[derive(Default)]
struct Log {
    /// Its last lines (not frame times).
    lines: Vec<String>,
    /// The decoder's refusal of a picture past `-max_pixels`, if it said so.
    over_pixels: Option<String>,
}

/// A `showinfo` frame line's `pts_time`: `Some(None)` for a frame without one, `None` for
/// another `showinfo` line (its configuration).
pub fn showinfo_time(line: &str) -> Option<Option<f64>> {
    let after = line.split_once("] ")?.1;
    if !after.trim_start().starts_with("n:") {
        return None;
    }
    let time = after.split_once("pts_time:").and_then(|(_, rest)| rest.split_whitespace().next()).and_then(|t| t.parse::<f64>().ok());
    Some(time.filter(|t| t.is_finite()))
}

impl Decoder {
    /// The video's header, checked against the limits; to be asked before the frames. A
    /// failure here ends the decode.
    pub async fn header(&mut self) -> Result<Probed, Failure> {
        let wait = seconds(self.options.decode_timeout_seconds);
        let read = tokio::time::timeout(wait, &mut self.header).await;
        let failed = match read {
            Ok(Ok(Ok(probed))) => return Ok(probed),
            Ok(Ok(Err(refused))) => refused,
            Err(_) => failure(
                ErrorKind::Timeout,
                format!("reading the video's header took more than {} s (video.decode_timeout_seconds)", self.options.decode_timeout_seconds),
            ),
            // The log ended, or went past the input, without a video stream.
            Ok(Err(_)) => {
                self.done = true;
                return Err(match self.finish().await {
                    Err(failed) => failed,
                    Ok(()) => failure(ErrorKind::InvalidVideo, "the file has no video stream"),
                });
            }
        };
        self.done = true;
        let _ = self.child.start_kill();
        Err(failed)
    }

    /// The next chosen frame; `None` once there are no more (or `max_frames` were given). An
    /// error ends the decode: the frames given before it stand.
    pub async fn next(&mut self) -> Option<Result<Frame, Failure>> {
        if self.done {
            return None;
        }
        let wait = seconds(self.options.decode_timeout_seconds);
        let read = tokio::time::timeout(wait, read_ppm(&mut self.stdout, self.max_pixels)).await;
        let ppm = match read {
            Err(_) => {
                self.done = true;
                let _ = self.child.start_kill();
                return Some(Err(failure(
                    ErrorKind::Timeout,
                    format!("the decoder gave no frame for {} s (video.decode_timeout_seconds) and was stopped", self.options.decode_timeout_seconds),
                )));
            }
            Ok(Err(e)) => {
                self.done = true;
                let _ = self.child.start_kill();
                return Some(Err(e));
            }
            Ok(Ok(None)) => {
                self.done = true;
                return self.finish().await.err().map(Err);
            }
            Ok(Ok(Some(ppm))) => ppm,
        };
        if self.next == self.options.max_frames {
            // The frame past the limit: the policy chose more.
            self.truncated = true;
            self.done = true;
            let _ = self.child.start_kill();
            return None;
        }
        let pts_seconds = tokio::time::timeout(wait, self.times.recv()).await.ok().flatten().flatten();
        let index = self.next;
        self.next += 1;
        Some(Ok(Frame { index, pts_seconds, ppm }))
    }

    /// Waits for the decoder's exit and says how it went.
    async fn finish(&mut self) -> Result<(), Failure> {
        let wait = seconds(self.options.decode_timeout_seconds);
        let status = match tokio::time::timeout(wait, self.child.wait()).await {
            Ok(Ok(status)) => status,
            Ok(Err(e)) => return Err(failure(ErrorKind::Internal, format!("waiting for ffmpeg: {e}"))),
            Err(_) => {
                let _ = self.child.start_kill();
                return Err(failure(ErrorKind::Timeout, "the decoder did not exit after its last frame and was stopped"));
            }
        };
        let Log { lines, over_pixels } = (&mut self.lines).await.unwrap_or_default();
        ended("ffmpeg", status, &lines, &self.options).map_err(|mut f| {
            if f.kind == ErrorKind::InvalidVideo {
                if let Some(said) = over_pixels {
                    f = failure(ErrorKind::InputTooLarge, format!("a video frame is past video.max_pixels ({}): {said}", self.options.max_pixels));
                } else if lines.iter().any(|l| l.contains("Invalid data found")) {
                    f.message = format!("the input is not a video this gateway reads (containers: {CONTAINERS}): {}", reason(&lines));
                }
            }
            f
        })
    }
}

/// One binary PPM frame as FFmpeg's encoder writes it (`P6\n<w> <h>\n255\n` and the pixels);
/// `None` at the end of the stream.
pub async fn read_ppm(reader: &mut (impl AsyncRead + Unpin), max_pixels: u64) -> Result<Option<Vec<u8>>, Failure> {
    let bad = |what: &str| failure(ErrorKind::Internal, format!("the decoder's frame stream is malformed: {what}"));
    let mut header = Vec::with_capacity(32);
    let mut newlines = 0;
    while newlines < 3 {
        let mut byte = [0u8; 1];
        match reader.read(&mut byte).await {
            Ok(0) if header.is_empty() => return Ok(None),
            Ok(0) => return Err(bad("it ends inside a header")),
            Ok(_) => {}
            Err(e) => return Err(bad(&e.to_string())),
        }
        header.push(byte[0]);
        if byte[0] == b'\n' {
            newlines += 1;
        }
        if header.len() > 32 {
            return Err(bad("a header of more than 32 bytes"));
        }
    }
    let text = std::str::from_utf8(&header).map_err(|_| bad("a header that is not text"))?;
    let mut parts = text.split_ascii_whitespace();
    let (magic, width, height, max) = (parts.next(), parts.next(), parts.next(), parts.next());
    let number = |s: Option<&str>| s.and_then(|s| s.parse::<u64>().ok()).filter(|&n| n > 0);
    let (Some("P6"), Some(width), Some(height), Some("255")) = (magic, number(width), number(height), max) else {
        return Err(bad("not a P6 header with 8-bit samples"));
    };
    if width * height > max_pixels {
        return Err(failure(ErrorKind::InputTooLarge, format!("a decoded frame is {width} × {height}, more than video.max_pixels ({max_pixels})")));
    }
    let mut ppm = header;
    let start = ppm.len();
    ppm.resize(start + (width * height * 3) as usize, 0);
    reader.read_exact(&mut ppm[start..]).await.map_err(|_| bad("it ends inside a frame"))?;
    Ok(Some(ppm))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn showinfo_lines_give_times() {
        let frame = "[Parsed_showinfo_0 @ 0x559af2903340] n:   3 pts:  12800 pts_time:0.54    pos:    13035 fmt:yuv420p";
        assert_eq!(showinfo_time(frame), Some(Some(0.54)));
        let config = "[Parsed_showinfo_0 @ 0x559af2903340] config in time_base: 1/25, frame_rate: 25/1";
        assert_eq!(showinfo_time(config), None);
        let nopts = "[Parsed_showinfo_1 @ 0x1] n:   0 pts:NOPTS pts_time:NOPTS pos: 1";
        assert_eq!(showinfo_time(nopts), Some(None));
    }

    #[tokio::test]
    async fn ppm_frames_are_read_within_bounds() {
        let mut stream = b"P6\n2 1\n255\n\x01\x02\x03\x04\x05\x06P6\n1 1\n255\n\x07\x08\x09".to_vec();
        let mut reader = &stream[..];
        let first = read_ppm(&mut reader, 4).await.unwrap().unwrap();
        assert_eq!(&first[first.len() - 6..], &[1, 2, 3, 4, 5, 6]);
        let second = read_ppm(&mut reader, 4).await.unwrap().unwrap();
        assert_eq!(&second[second.len() - 3..], &[7, 8, 9]);
        assert!(read_ppm(&mut reader, 4).await.unwrap().is_none());
        let mut big = &b"P6\n100 100\n255\n"[..];
        assert_eq!(read_ppm(&mut big, 4).await.err().unwrap().kind, ErrorKind::InputTooLarge);
        stream.truncate(10);
        let mut cut = &stream[..];
        assert!(read_ppm(&mut cut, 4).await.is_err());
        let mut long = &b"P6 999999999999999999999999999999999999"[..];
        assert!(read_ppm(&mut long, 4).await.err().unwrap().message.contains("32 bytes"));
    }

    /// FFmpeg's input dump, as Debian's FFmpeg 5.1 writes it (the MP4 test clip's).
    const DUMP: [&str; 5] = [
        "Input #0, mov,mp4,m4a,3gp,3g2,mj2, from 'file:/dev/fd/3':",
        "  Metadata:",
        "  Duration: 00:00:53.48, start: 0.000000, bitrate: 150 kb/s",
        "  Stream #0:0[0x1](und): Video: h264 (High) (avc1 / 0x31637661), yuv420p(progressive), 400x300 [SAR 1:1 DAR 4:3], 148 kb/s, 25 fps",
        "  Stream #0:1[0x2](und): Audio: aac (LC), 44100 Hz, stereo",
    ];

    fn header_of(lines: &[&str], options: &VideoOptions) -> Option<Result<Probed, Failure>> {
        let mut header = Header::default();
        lines.iter().find_map(|line| header.read(line, options))
    }

    #[test]
    fn the_input_dump_gives_the_header_held_to_the_limits() {
        let options = VideoOptions::default();
        let read = header_of(&DUMP, &options).expect("a video stream").expect("within the limits");
        let want = Probed { container: "mov,mp4,m4a,3gp,3g2,mj2".into(), codec: "h264".into(), width: 400, height: 300, duration_seconds: Some(53.48) };
        assert_eq!(read, want);
        let vp8 = ["Input #0, matroska,webm, from 'x':", "  Duration: N/A, start: 0.000000", "  Stream #0:0: Video: vp8, yuv420p(tv, progressive), 32x24, SAR 1:1 DAR 4:3, 10 fps"];
        let read = header_of(&vp8, &options).expect("a stream").expect("fine");
        assert_eq!((read.codec.as_str(), read.width, read.height, read.duration_seconds), ("vp8", 32, 24, None));
        let av1 = ["  Stream #0:0: Video: av1 (Main), yuv420p(tv, progressive), 32x24, SAR 1:1 DAR 4:3"];
        assert!(header_of(&av1, &options).expect("a stream").is_ok(), "av1 through libdav1d");
        let prores = ["  Stream #0:0: Video: prores (HQ), yuv422p10le, 64x48"];
        let refused = header_of(&prores, &options).expect("a stream").unwrap_err();
        assert_eq!(refused.kind, ErrorKind::UnsupportedInput);
        assert!(refused.message.contains("prores"), "{}", refused.message);
        let small = VideoOptions { max_pixels: 1000, ..VideoOptions::default() };
        let big = header_of(&DUMP, &small).expect("a stream").unwrap_err();
        assert!(big.message.contains("video.max_pixels"), "{}", big.message);
        let short = VideoOptions { max_duration_seconds: 10.0, ..VideoOptions::default() };
        let long = header_of(&DUMP, &short).expect("a stream").unwrap_err();
        assert!(long.message.contains("video.max_duration_seconds"), "{}", long.message);
        let sizeless = ["  Stream #0:0: Video: h264, none"];
        assert!(header_of(&sizeless, &options).expect("a stream").unwrap_err().message.contains("no frame size"));
        assert!(header_of(&DUMP[..3], &options).is_none(), "no video stream yet");
        assert_eq!(clock_seconds("01:02:03.50"), Some(3723.5));
        assert_eq!(clock_seconds("N/A"), None);
    }

    #[test]
    fn reasons_hide_the_descriptor_and_odd_bytes() {
        let lines = vec!["file:/dev/fd/3: Invalid data found when processing input\u{1b}[0m".to_string(), String::new()];
        assert_eq!(reason(&lines), "Invalid data found when processing input?[0m");
        let cut = [
            "[mov,mp4,m4a,3gp,3g2,mj2 @ 0x55ad04ea99c0] stream 0, offset 0x49e9: partial file",
            "Cannot determine format of input stream 0:0 after EOF",
            "Error marking filters as finished",
            "Conversion failed!",
        ]
        .map(String::from);
        assert_eq!(reason(&cut), "Cannot determine format of input stream 0:0 after EOF (the file is cut short)");
        assert_eq!(reason(&cut[..1]), "stream 0, offset 0x49e9: partial file");
        let nested = ["[mpeg4 @ 0x1] [IMGUTILS @ 0x7ffe] Picture size 64x48 exceeds specified max pixel count 1000".to_string()];
        assert_eq!(reason(&nested), "Picture size 64x48 exceeds specified max pixel count 1000");
    }

    /// A clip made by FFmpeg's own test source: `seconds` long at 10 frames a second, a key
    /// frame every `gop` frames.
    fn clip(seconds: u32, gop: u32, codec: &str, container: &str) -> Vec<u8> {
        // A folder per call: tests run at once, and two that made the same clip in one folder
        // removed it under each other (CI, 2026-11-29).
        static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("vramgate-video-{}-{n}-{gop}-{codec}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join(format!("clip.{container}"));
        let made = std::process::Command::new("ffmpeg")
            .args(["-v", "error", "-y", "-f", "lavfi", "-i", &format!("testsrc=size=64x48:rate=10:duration={seconds}")])
            .args(["-c:v", codec, "-g", &gop.to_string(), "-pix_fmt", "yuv420p"])
            .arg(&path)
            .status()
            .expect("ffmpeg runs (scripts/setup installs it)");
        assert!(made.success(), "making the test clip");
        let bytes = std::fs::read(&path).expect("clip");
        let _ = std::fs::remove_dir_all(&dir);
        bytes
    }

    /// The header of a video, as the decoder reads it.
    async fn probe(file: &VideoFile, options: &VideoOptions) -> Result<Probed, Failure> {
        decode(file, options, Policy::Named(Named::Intra))?.header().await
    }

    async fn all(file: &VideoFile, options: &VideoOptions, policy: Policy) -> (Vec<Frame>, Option<Failure>, bool) {
        let mut decoder = decode(file, options, policy).expect("starts");
        if let Err(failed) = decoder.header().await {
            return (Vec::new(), Some(failed), false);
        }
        let mut frames = Vec::new();
        let mut failed = None;
        while let Some(next) = decoder.next().await {
            match next {
                Ok(frame) => frames.push(frame),
                Err(e) => failed = Some(e),
            }
        }
        (frames, failed, decoder.truncated)
    }

    #[tokio::test]
    async fn key_frames_come_with_their_times_and_pixels() {
        let bytes = clip(3, 10, "mpeg4", "avi");
        assert_eq!(super::super::sniff(&bytes), Some("avi"));
        let file = VideoFile::new(&bytes).unwrap();
        let options = VideoOptions::default();
        let probed = probe(&file, &options).await.unwrap();
        assert_eq!((probed.codec.as_str(), probed.width, probed.height), ("mpeg4", 64, 48));
        let (frames, failed, truncated) = all(&file, &options, Policy::Named(Named::Intra)).await;
        assert!(failed.is_none(), "{:?}", failed.map(|f| f.message));
        assert!(!truncated);
        let times: Vec<Option<f64>> = frames.iter().map(|f| f.pts_seconds).collect();
        assert_eq!(times, vec![Some(0.0), Some(1.0), Some(2.0)]);
        for frame in &frames {
            let (image, format) = crate::tasks::image::decode_rgb(&frame.ppm, 10_000).expect("a picture");
            assert_eq!((image.width(), image.height(), format), (64, 48, "ppm"));
        }
        let (every, _, _) = all(&file, &options, Policy::EverySeconds { every_seconds: 0.5 }).await;
        let times: Vec<f64> = every.iter().filter_map(|f| f.pts_seconds).collect();
        assert_eq!(times, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        let few = VideoOptions { max_frames: 2, ..VideoOptions::default() };
        let (frames, failed, truncated) = all(&file, &few, Policy::Named(Named::Intra)).await;
        assert_eq!((frames.len(), failed.is_none(), truncated), (2, true, true));
    }

    #[tokio::test]
    async fn hostile_videos_end_in_a_reason_not_a_crash() {
        let options = VideoOptions { decode_timeout_seconds: 5.0, ..VideoOptions::default() };
        // Not a video at all, though it starts like Matroska.
        let mut junk = vec![0x1a, 0x45, 0xdf, 0xa3];
        junk.extend((0..4000u32).map(|i| (i * 7919 % 251) as u8));
        let file = VideoFile::new(&junk).unwrap();
        let refused = probe(&file, &options).await.unwrap_err();
        assert_eq!(refused.kind, ErrorKind::InvalidVideo, "{}", refused.message);
        // Cut in half: the header reads, the frames after the cut do not come.
        let whole = clip(4, 10, "libvpx", "webm");
        let half = VideoFile::new(&whole[..whole.len() / 2]).unwrap();
        if probe(&half, &options).await.is_ok() {
            let (frames, _, _) = all(&half, &options, Policy::Named(Named::Intra)).await;
            assert!(frames.len() < 4, "{} frames from half a clip", frames.len());
        }
        // A codec that is not allowed.
        let only_h264 = VideoOptions { decoders: vec!["h264".into()], ..options.clone() };
        let mpeg4 = VideoFile::new(&clip(1, 10, "mpeg4", "avi")).unwrap();
        let refused = probe(&mpeg4, &only_h264).await.unwrap_err();
        assert_eq!(refused.kind, ErrorKind::UnsupportedInput);
        // Frames larger than the limit, refused from the header.
        let small = VideoOptions { max_pixels: 1000, ..options.clone() };
        let refused = probe(&mpeg4, &small).await.unwrap_err();
        assert_eq!(refused.kind, ErrorKind::InputTooLarge, "{}", refused.message);
        // A decoder that cannot start is a clear refusal.
        let missing = VideoOptions { ffmpeg: "/nonexistent/ffmpeg".into(), ..options };
        let refused = probe(&mpeg4, &missing).await.unwrap_err();
        assert!(refused.message.contains("install FFmpeg"), "{}", refused.message);
    }

    #[tokio::test]
    async fn a_decoder_past_its_memory_fails_alone() {
        let file = VideoFile::new(&clip(1, 10, "mpeg4", "avi")).unwrap();
        // Debian's FFmpeg maps more than 256 MiB to start; 64 MiB of address space stops it.
        let tight = VideoOptions { decoder_memory_bytes: 64 << 20, ..VideoOptions::default() };
        let failure = probe(&file, &tight).await.unwrap_err();
        assert_eq!(failure.kind, ErrorKind::InvalidVideo, "{}", failure.message);
        assert!(failure.message.starts_with("ffmpeg could not read the video"), "{}", failure.message);
    }

    /// A stand-in for FFmpeg that misbehaves as `script` says, as an executable file.
    fn program(name: &str, script: &str) -> String {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("vramgate-fake-ffmpeg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{script}\n")).expect("script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path.to_string_lossy().into_owned()
    }

    #[tokio::test]
    async fn a_decoder_that_hangs_or_crashes_is_stopped_with_a_reason() {
        let file = VideoFile::new(b"\x1a\x45\xdf\xa3 not really").unwrap();
        let options = VideoOptions { decode_timeout_seconds: 0.5, ..VideoOptions::default() };
        let hang = VideoOptions { ffmpeg: program("hang", "exec sleep 30"), ..options.clone() };
        let started = std::time::Instant::now();
        let failure = probe(&file, &hang).await.unwrap_err();
        assert_eq!(failure.kind, ErrorKind::Timeout, "{}", failure.message);
        // A header, then nothing.
        let stall = program("stall", "echo '  Stream #0:0: Video: vp8, yuv420p, 8x8' >&2; exec sleep 30");
        let mut decoder = decode(&file, &VideoOptions { ffmpeg: stall, ..options.clone() }, Policy::Named(Named::Intra)).unwrap();
        decoder.header().await.expect("the header");
        let failure = decoder.next().await.expect("an answer").err().expect("a failure");
        assert_eq!(failure.kind, ErrorKind::Timeout, "{}", failure.message);
        assert!(decoder.next().await.is_none(), "nothing after the failure");
        // Both programs sleep 30 s: ending well before that is the time-outs' doing, with room
        // for a loaded machine.
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "{:?}", started.elapsed());

        let crash = VideoOptions { ffmpeg: program("crash", "kill -SEGV $$"), ..options.clone() };
        let failure = probe(&file, &crash).await.unwrap_err();
        assert_eq!(failure.kind, ErrorKind::InvalidVideo);
        assert!(failure.message.contains("crashed on this video (signal 11)"), "{}", failure.message);

        // A frame, then a crash: the frame stands, the crash is the reason decoding stopped.
        let one = program(
            "one-frame",
            "echo '  Stream #0:0: Video: vp8, yuv420p, 1x1' >&2; printf 'P6\\n1 1\\n255\\nabc'; \
             echo '[Parsed_showinfo_0 @ 0x1] n:   0 pts:      0 pts_time:0.5 pos: 1' >&2; kill -SEGV $$",
        );
        let mut decoder = decode(&file, &VideoOptions { ffmpeg: one, ..options.clone() }, Policy::Named(Named::Intra)).unwrap();
        decoder.header().await.expect("the header");
        let frame = decoder.next().await.expect("a frame").expect("read");
        assert_eq!((frame.index, frame.pts_seconds, &frame.ppm[frame.ppm.len() - 3..]), (0, Some(0.5), &b"abc"[..]));
        let failure = decoder.next().await.expect("the end").err().expect("a failure");
        assert!(failure.message.contains("signal 11"), "{}", failure.message);

        // What the child may do is bounded: its address space and CPU time as configured.
        let limits = program("limits", "echo \"as=$(ulimit -v) cpu=$(ulimit -t) files=$(ulimit -n) core=$(ulimit -c)\" >&2; exit 1");
        let failure = probe(&file, &VideoOptions { ffmpeg: limits, ..options }).await.unwrap_err();
        assert!(failure.message.ends_with("as=2097152 cpu=1 files=64 core=0"), "{}", failure.message);
    }

    #[tokio::test]
    async fn every_container_and_codec_read_gives_its_key_frames() {
        // The fuzz seeds: FFmpeg's test pattern in each container and codec the gateway reads,
        // 0.6 s at 10 frames a second with a key frame every 3 (fuzz/README.md).
        let seeds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/video");
        let mut read = Vec::new();
        for entry in std::fs::read_dir(&seeds).expect("the seeds") {
            let path = entry.expect("an entry").path();
            let bytes = std::fs::read(&path).expect("a seed");
            let name = path.file_name().expect("a name").to_string_lossy().into_owned();
            assert!(super::super::sniff(&bytes).is_some(), "{name} is not told as a video");
            let file = VideoFile::new(&bytes).unwrap();
            let probed = probe(&file, &VideoOptions::default()).await.unwrap_or_else(|f| panic!("{name}: {}", f.message));
            let (frames, failed, _) = all(&file, &VideoOptions::default(), Policy::Named(Named::Intra)).await;
            assert!(failed.is_none(), "{name}: {:?}", failed.map(|f| f.message));
            assert_eq!(frames.len(), 2, "{name}: key frames at 0 and 0.3 s");
            read.push(format!("{name} ({})", probed.codec));
        }
        read.sort();
        assert_eq!(read.len(), 8, "{read:?}");
        eprintln!("read: {}", read.join(", "));
    }

    #[tokio::test]
    async fn a_scene_change_is_a_frame_chosen() {
        // One second of the test pattern, then one of plain red: the cut at 1 s is the change.
        let dir = std::env::temp_dir().join(format!("vramgate-scene-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("cut.avi");
        let made = std::process::Command::new("ffmpeg")
            .args(["-v", "error", "-y", "-f", "lavfi", "-i", "testsrc=size=64x48:rate=10:duration=1"])
            .args(["-f", "lavfi", "-i", "color=c=red:size=64x48:rate=10:duration=1"])
            .args(["-filter_complex", "[0:v][1:v]concat=n=2:v=1[v]", "-map", "[v]", "-c:v", "mpeg4", "-g", "5"])
            .arg(&path)
            .status()
            .expect("ffmpeg runs");
        assert!(made.success());
        let file = VideoFile::new(&std::fs::read(&path).expect("clip")).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let (frames, failed, _) = all(&file, &VideoOptions::default(), Policy::SceneChange { scene_change: 0.3 }).await;
        assert!(failed.is_none(), "{:?}", failed.map(|f| f.message));
        let times: Vec<Option<f64>> = frames.iter().map(|f| f.pts_seconds).collect();
        assert_eq!(times, vec![Some(0.0), Some(1.0)], "the first frame and the cut");
    }
}
