//! Video for the picture tasks: an event may name a video file instead of a picture, and the
//! gateway chooses frames from it by the task's policy (`[tasks.<name>.video]`), each of which
//! then goes through the task exactly as one picture does: its own conversion, permits and the
//! worker's byte admission ([`crate::record`]).
//!
//! Demuxing and decoding are FFmpeg's, run as a separate process ([`ffmpeg`]) rather than
//! linked in: a decoder that crashes or spins on a hostile file takes down one short-lived
//! process, not the gateway, and the process runs under limits of address space, CPU seconds
//! and open files, reads only the one file it is given (`-protocol_whitelist file`, the
//! containers and decoders allowed below), and is killed past its time. Frames come back over a
//! pipe as binary PPM, which the picture tasks decode as they decode PNG; each frame's
//! presentation time comes from FFmpeg's `showinfo` filter on the same run.

pub mod ffmpeg;

use serde::{Deserialize, Serialize};

/// The containers read (FFmpeg's demuxer names): MP4 and QuickTime, Matroska and WebM, AVI,
/// MPEG program streams.
pub const CONTAINERS: &str = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpeg";

/// Longest `video.decode_timeout_seconds`.
pub const MAX_DECODE_TIMEOUT_SECONDS: f64 = 600.0;
/// Most frames `video.max_frames` may allow a video, and `video.max_batch_frames` a batch.
pub const MAX_FRAMES: u32 = 1024;
/// Most frames `video.frames_in_flight` may allow decoded at once for one event.
pub const MAX_FRAMES_IN_FLIGHT: usize = 64;

/// How frames are chosen from a video.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(untagged, deny_unknown_fields)]
pub enum Policy {
    /// `"intra"`: the stream's own key frames, as `ffprobe -skip_frame nokey` lists them. Only
    /// they are decoded where the decoder can skip the others (H.264, H.265, VP8, MPEG-2,
    /// MPEG-4), which makes this the cheapest; VP9 and AV1 decode every frame and keep those
    /// flagged as key frames (where `ffprobe -skip_frame nokey` lists every frame).
    Named(Named),
    /// `{ every_seconds = S }`: the first frame, then each first frame at least `S` seconds
    /// after the last one chosen.
    EverySeconds { every_seconds: f64 },
    /// `{ scene_change = T }`: the first frame, then each frame whose difference from the one
    /// before is above `T` (0 to 1; FFmpeg's `scene` score).
    SceneChange { scene_change: f64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Named {
    Intra,
}

impl Policy {
    pub fn describe(&self) -> String {
        match self {
            Policy::Named(Named::Intra) => "intra".into(),
            Policy::EverySeconds { every_seconds } => format!("every_seconds={every_seconds}"),
            Policy::SceneChange { scene_change } => format!("scene_change={scene_change}"),
        }
    }

    fn validate(&self) -> Result<(), String> {
        match *self {
            Policy::Named(Named::Intra) => Ok(()),
            Policy::EverySeconds { every_seconds } if every_seconds.is_finite() && every_seconds > 0.0 && every_seconds <= 86_400.0 => Ok(()),
            Policy::EverySeconds { every_seconds } => Err(format!("every_seconds must be in (0, 86400], got {every_seconds}")),
            Policy::SceneChange { scene_change } if (0.0..1.0).contains(&scene_change) => Ok(()),
            Policy::SceneChange { scene_change } => Err(format!("scene_change must be in [0, 1), got {scene_change}")),
        }
    }
}

/// `[tasks.<name>.video]`, for tasks of the `image` converter: videos and frame batches.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VideoOptions {
    /// Whether an event may name a video; off: a video is refused as an unsupported input.
    /// Frame batches are always taken.
    pub enabled: bool,
    /// How frames are chosen.
    pub keyframes: Policy,
    /// At most this many frames a video (the first ones chosen); the result says when more
    /// were (`video.truncated`).
    pub max_frames: u32,
    /// A video whose frames have more pixels than this is refused (`input_too_large`), from
    /// its header, before a frame is taken; the decoder enforces it too (`-max_pixels`).
    pub max_pixels: u64,
    /// A video whose container states a longer duration is refused (`input_too_large`).
    pub max_duration_seconds: f64,
    /// The decoder's CPU time for one video, and the longest wait for its next frame (or for
    /// the header read): past either it is killed and the event is a dead letter (`timeout`),
    /// or, if some frames were answered already, the result says where decoding stopped.
    pub decode_timeout_seconds: f64,
    /// The decoder process's address space (bytes); past it the decoder fails, not the gateway.
    pub decoder_memory_bytes: u64,
    /// Frames of one event decoded and held at once (waiting for or in their worker calls);
    /// the decoder waits while this many are. Also at most the task's `gpu_permits.max`.
    pub frames_in_flight: usize,
    /// The decoders allowed (FFmpeg's names); a stream of another codec is
    /// `unsupported_input`.
    pub decoders: Vec<String>,
    /// Most frames in one `input.frames` batch.
    pub max_batch_frames: u32,
    /// Most bytes of one batch's frames together (each frame is held to `input.max_input_bytes`
    /// as well).
    pub max_batch_bytes: u64,
    /// The FFmpeg program, by path or by name on `PATH`.
    pub ffmpeg: String,
}

impl Default for VideoOptions {
    fn default() -> Self {
        VideoOptions {
            enabled: true,
            keyframes: Policy::Named(Named::Intra),
            max_frames: 32,
            max_pixels: 3840 * 2160,
            max_duration_seconds: 3600.0,
            decode_timeout_seconds: 60.0,
            decoder_memory_bytes: 2 << 30,
            frames_in_flight: 4,
            decoders: ["h264", "hevc", "vp8", "vp9", "libdav1d", "libaom-av1", "av1", "mpeg1video", "mpeg2video", "mpeg4"]
                .map(String::from)
                .to_vec(),
            max_batch_frames: 64,
            max_batch_bytes: 64 << 20,
            ffmpeg: "ffmpeg".into(),
        }
    }
}

impl VideoOptions {
    pub fn validate(&self) -> Result<(), String> {
        self.keyframes.validate().map_err(|e| format!("video.keyframes: {e}"))?;
        if !(1..=MAX_FRAMES).contains(&self.max_frames) {
            return Err(format!("video.max_frames must be 1 to {MAX_FRAMES}, got {}", self.max_frames));
        }
        if !(1..=MAX_FRAMES).contains(&self.max_batch_frames) {
            return Err(format!("video.max_batch_frames must be 1 to {MAX_FRAMES}, got {}", self.max_batch_frames));
        }
        if !(1..=MAX_FRAMES_IN_FLIGHT).contains(&self.frames_in_flight) {
            return Err(format!("video.frames_in_flight must be 1 to {MAX_FRAMES_IN_FLIGHT}, got {}", self.frames_in_flight));
        }
        if !(self.decode_timeout_seconds > 0.0 && self.decode_timeout_seconds <= MAX_DECODE_TIMEOUT_SECONDS) {
            return Err(format!(
                "video.decode_timeout_seconds must be in (0, {MAX_DECODE_TIMEOUT_SECONDS}], got {}",
                self.decode_timeout_seconds
            ));
        }
        if !(self.max_duration_seconds > 0.0 && self.max_duration_seconds.is_finite()) {
            return Err(format!("video.max_duration_seconds must be positive, got {}", self.max_duration_seconds));
        }
        if self.max_pixels == 0 || self.max_pixels > i32::MAX as u64 {
            return Err(format!("video.max_pixels must be 1 to {}, got {}", i32::MAX, self.max_pixels));
        }
        if self.decoder_memory_bytes < 512 << 20 {
            // Debian's FFmpeg maps more than 256 MiB of libraries before reading a byte.
            return Err(format!("video.decoder_memory_bytes must be at least 512 MiB, got {}", self.decoder_memory_bytes));
        }
        if self.max_batch_bytes == 0 {
            return Err("video.max_batch_bytes must be positive".into());
        }
        if self.decoders.is_empty() || self.decoders.iter().any(|d| d.is_empty() || !d.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')) {
            return Err("video.decoders must name at least one decoder, each of letters, digits, '_' or '-'".into());
        }
        if self.ffmpeg.is_empty() {
            return Err("video.ffmpeg must name a program".into());
        }
        Ok(())
    }
}

/// The container a file's first bytes say it is, if it is one this module reads; `None`: not
/// a video (a picture, or something else the picture decoder will refuse by name).
pub fn sniff(bytes: &[u8]) -> Option<&'static str> {
    let at = |i: usize, magic: &[u8]| bytes.get(i..i + magic.len()) == Some(magic);
    if at(4, b"ftyp") {
        // ISO media that holds pictures, not video (AVIF, HEIF): the picture decoder names it.
        let brand = bytes.get(8..12).unwrap_or_default();
        if [&b"avif"[..], b"heic", b"heix", b"mif1", b"msf1"].contains(&brand) {
            return None;
        }
        return Some("mp4");
    }
    if at(4, b"moov") || at(4, b"mdat") || at(4, b"wide") || (at(4, b"free") && bytes.len() > 64) {
        return Some("mov");
    }
    if at(0, &[0x1a, 0x45, 0xdf, 0xa3]) {
        return Some("matroska");
    }
    if at(0, b"RIFF") && at(8, b"AVI ") {
        return Some("avi");
    }
    if at(0, &[0, 0, 1, 0xba]) || at(0, &[0, 0, 1, 0xb3]) {
        return Some("mpeg");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containers_are_told_by_their_first_bytes() {
        let mut mp4 = vec![0, 0, 0, 0x20];
        mp4.extend_from_slice(b"ftypisom\0\0\0\0");
        assert_eq!(sniff(&mp4), Some("mp4"));
        let mut avif = vec![0, 0, 0, 0x20];
        avif.extend_from_slice(b"ftypavif");
        assert_eq!(sniff(&avif), None);
        assert_eq!(sniff(&[0x1a, 0x45, 0xdf, 0xa3, 1]), Some("matroska"));
        assert_eq!(sniff(b"RIFF\0\0\0\0AVI LIST"), Some("avi"));
        assert_eq!(sniff(b"RIFF\0\0\0\0WAVEfmt "), None);
        assert_eq!(sniff(&[0, 0, 1, 0xba, 0x44]), Some("mpeg"));
        assert_eq!(sniff(b"\x89PNG\r\n\x1a\n"), None);
        assert_eq!(sniff(b""), None);
    }

    #[test]
    fn policies_read_as_written() {
        #[derive(Deserialize)]
        struct T {
            keyframes: Policy,
        }
        let read = |s: &str| -> Result<Policy, String> {
            let t: T = toml_from(s)?;
            t.keyframes.validate()?;
            Ok(t.keyframes)
        };
        assert_eq!(read("keyframes = \"intra\"").unwrap(), Policy::Named(Named::Intra));
        assert_eq!(read("keyframes = { every_seconds = 2.5 }").unwrap(), Policy::EverySeconds { every_seconds: 2.5 });
        assert_eq!(read("keyframes = { scene_change = 0.3 }").unwrap(), Policy::SceneChange { scene_change: 0.3 });
        assert!(read("keyframes = \"all\"").is_err());
        assert!(read("keyframes = { every_seconds = 0 }").unwrap_err().contains("every_seconds"));
        assert!(read("keyframes = { scene_change = 1.5 }").unwrap_err().contains("scene_change"));
    }

    fn toml_from<T: serde::de::DeserializeOwned>(s: &str) -> Result<T, String> {
        use figment::providers::{Format, Toml};
        figment::Figment::from(Toml::string(s)).extract().map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_are_valid_and_bounds_are_named() {
        VideoOptions::default().validate().expect("defaults");
        let over = VideoOptions { max_frames: MAX_FRAMES + 1, ..VideoOptions::default() };
        assert!(over.validate().unwrap_err().contains("video.max_frames"));
        let slow = VideoOptions { decode_timeout_seconds: 0.0, ..VideoOptions::default() };
        assert!(slow.validate().unwrap_err().contains("decode_timeout_seconds"));
        let odd = VideoOptions { decoders: vec!["h264;rm".into()], ..VideoOptions::default() };
        assert!(odd.validate().unwrap_err().contains("video.decoders"));
    }
}
