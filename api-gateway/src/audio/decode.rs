//! Audio in the formats producers send: WAV through this crate's own parser ([`super::wav`]),
//! FLAC, Ogg Vorbis and MP3 through symphonia. Which one is told by the bytes' magic, never by
//! a name the producer chose.
//!
//! Untrusted input is bounded before it is decoded where the container says its length (WAV,
//! FLAC's stream info, an Ogg stream's last page, an MP3 with a Xing/Info header); otherwise the
//! decode stops as soon as it passes the caller's frame limit. A decoder panic is caught and
//! reported as an error, since a panic on a task's pool would take the process down.

use std::io::Cursor;
use std::panic::AssertUnwindSafe;

use symphonia::core::codecs::audio::AudioDecoderOptions;
use symphonia::core::formats::probe::Hint;
use symphonia::core::formats::{FormatOptions, FormatReader, TrackType};
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;

use super::wav::{self, Audio, MAX_CHANNELS, MAX_SAMPLE_RATE_HZ, MIN_SAMPLE_RATE_HZ};

/// The containers told apart by their first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Container {
    Wav,
    Flac,
    Ogg,
    Mp3,
}

impl Container {
    pub fn as_str(self) -> &'static str {
        match self {
            Container::Wav => "wav",
            Container::Flac => "flac",
            Container::Ogg => "ogg",
            Container::Mp3 => "mp3",
        }
    }

    /// By magic: `RIFF…WAVE`, `fLaC`, `OggS`, an ID3 tag or an MPEG audio frame sync.
    pub fn sniff(bytes: &[u8]) -> Option<Container> {
        match bytes {
            [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'A', b'V', b'E', ..] => Some(Container::Wav),
            [b'f', b'L', b'a', b'C', ..] => Some(Container::Flac),
            [b'O', b'g', b'g', b'S', ..] => Some(Container::Ogg),
            [b'I', b'D', b'3', ..] => Some(Container::Mp3),
            // Frame sync (11 bits), MPEG 1/2/2.5 layer III.
            [0xFF, b, ..] if b & 0xE0 == 0xE0 && b & 0x06 == 0x02 => Some(Container::Mp3),
            _ => None,
        }
    }
}

/// What the header says, before any sample is decoded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Header {
    pub container: Container,
    pub sample_rate: u32,
    pub channels: u16,
    /// Frames (samples per channel), when the container states them.
    pub frames: Option<u64>,
}

impl Header {
    pub fn duration_seconds(&self) -> Option<f64> {
        self.frames.map(|f| f as f64 / f64::from(self.sample_rate.max(1)))
    }
}

/// Why audio could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("input is not wav, flac, ogg or mp3 audio (it starts with [{0}])")]
    Unknown(String),
    #[error("{0}")]
    Wav(#[from] wav::WavError),
    #[error("{container} audio cannot be decoded: {message}")]
    Codec { container: &'static str, message: String },
    #[error("{container} audio runs past {limit} frames")]
    TooLong { container: &'static str, limit: u64 },
}

fn codec(container: Container, message: impl std::fmt::Display) -> DecodeError {
    let message: String = message.to_string().chars().take(200).collect();
    DecodeError::Codec { container: container.as_str(), message }
}

/// Reads the header.
pub fn probe(bytes: &[u8]) -> Result<Header, DecodeError> {
    let container = sniff(bytes)?;
    if container == Container::Wav {
        let info = wav::probe_wav(bytes)?;
        return Ok(Header { container, sample_rate: info.sample_rate, channels: info.channels, frames: Some(info.frames) });
    }
    guarded(container, || {
        let reader = open(bytes, container)?;
        let (header, _) = track_header(&*reader, container)?;
        Ok(header)
    })
}

/// Decodes to interleaved f32 in `[-1, 1]`, at most `max_frames` frames (past it
/// [`DecodeError::TooLong`]).
pub fn decode(bytes: &[u8], max_frames: u64) -> Result<Audio, DecodeError> {
    let container = sniff(bytes)?;
    if container == Container::Wav {
        return Ok(wav::decode_wav_limited(bytes, max_frames)?);
    }
    guarded(container, || {
        let mut reader = open(bytes, container)?;
        let (header, track_id) = track_header(&*reader, container)?;
        let params = reader
            .tracks()
            .iter()
            .find(|t| t.id == track_id)
            .and_then(|t| t.codec_params.as_ref())
            .and_then(|p| p.audio())
            .cloned()
            .ok_or_else(|| codec(container, "no audio track"))?;
        let mut decoder = symphonia::default::get_codecs()
            .make_audio_decoder(&params, &AudioDecoderOptions::default())
            .map_err(|e| codec(container, e))?;
        let channels = usize::from(header.channels);
        let limit = max_frames.saturating_mul(channels as u64);
        let mut samples: Vec<f32> = Vec::with_capacity(header.frames.map_or(0, |f| f.min(max_frames) as usize * channels));
        loop {
            let packet = match reader.next_packet() {
                Ok(Some(packet)) => packet,
                Ok(None) => break,
                Err(e) => return Err(codec(container, e)),
            };
            if packet.track_id != track_id {
                continue;
            }
            let buf = decoder.decode(&packet).map_err(|e| codec(container, e))?;
            let n = buf.samples_interleaved();
            if buf.num_planes() != channels && n > 0 {
                return Err(codec(container, "the channel count changed mid-stream"));
            }
            if (samples.len() + n) as u64 > limit {
                return Err(DecodeError::TooLong { container: container.as_str(), limit: max_frames });
            }
            let at = samples.len();
            samples.resize(at + n, 0.0);
            buf.copy_to_slice_interleaved(&mut samples[at..]);
        }
        samples.iter_mut().for_each(|s| *s = if s.is_finite() { s.clamp(-1.0, 1.0) } else { 0.0 });
        Ok(Audio { sample_rate: header.sample_rate, channels: header.channels, samples })
    })
}

fn sniff(bytes: &[u8]) -> Result<Container, DecodeError> {
    Container::sniff(bytes).ok_or_else(|| {
        let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
        DecodeError::Unknown(head.join(" "))
    })
}

fn open(bytes: &[u8], container: Container) -> Result<Box<dyn FormatReader + '_>, DecodeError> {
    let mss = MediaSourceStream::new(Box::new(Cursor::new(bytes)), Default::default());
    let mut hint = Hint::new();
    hint.with_extension(container.as_str());
    symphonia::default::get_probe()
        .probe(&hint, mss, FormatOptions::default(), MetadataOptions::default())
        .map_err(|e| codec(container, e))
}

/// The default audio track's header and id, checked against the same bounds as WAV's.
fn track_header(reader: &dyn FormatReader, container: Container) -> Result<(Header, u32), DecodeError> {
    let track = reader.default_track(TrackType::Audio).ok_or_else(|| codec(container, "no audio track"))?;
    let params = track.codec_params.as_ref().and_then(|p| p.audio()).ok_or_else(|| codec(container, "no audio track"))?;
    let sample_rate = params.sample_rate.ok_or_else(|| codec(container, "no sample rate"))?;
    let channels = params.channels.as_ref().map(|c| c.count()).ok_or_else(|| codec(container, "no channel layout"))?;
    if !(MIN_SAMPLE_RATE_HZ..=MAX_SAMPLE_RATE_HZ).contains(&sample_rate) {
        return Err(codec(
            container,
            format!("sample rate {sample_rate} Hz is outside the supported {MIN_SAMPLE_RATE_HZ}–{MAX_SAMPLE_RATE_HZ} Hz"),
        ));
    }
    let channels = u16::try_from(channels).ok().filter(|&c| (1..=MAX_CHANNELS).contains(&c)).ok_or_else(|| {
        codec(container, format!("{channels} channels; 1 to {MAX_CHANNELS} are supported"))
    })?;
    Ok((Header { container, sample_rate, channels, frames: track.num_frames }, track.id))
}

fn guarded<T>(container: Container, f: impl FnOnce() -> Result<T, DecodeError>) -> Result<T, DecodeError> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err(codec(container, "the decoder failed on this input")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containers_are_told_by_magic() {
        assert_eq!(Container::sniff(b"RIFF\0\0\0\0WAVEfmt "), Some(Container::Wav));
        assert_eq!(Container::sniff(b"fLaC\0\0\0\x22"), Some(Container::Flac));
        assert_eq!(Container::sniff(b"OggS\0\x02"), Some(Container::Ogg));
        assert_eq!(Container::sniff(b"ID3\x04"), Some(Container::Mp3));
        assert_eq!(Container::sniff(&[0xFF, 0xFB, 0x90, 0x64]), Some(Container::Mp3));
        assert_eq!(Container::sniff(b"\x89PNG\r\n"), None);
        assert!(matches!(probe(b"hello"), Err(DecodeError::Unknown(head)) if head == "68 65 6c 6c 6f"));
    }

    /// Found by fuzzing (`compressed_audio`, 2026-11-28): a 5 KiB FLAC whose LPC prediction
    /// overflows i32 in symphonia's decoder. The workspace keeps overflow checks on in
    /// symphonia's crates in every profile, so it is refused, never wrapped into noise.
    #[test]
    fn a_flac_whose_prediction_overflows_is_refused_not_wrapped_into_noise() {
        let bytes = include_bytes!("../../../fuzz/corpus/compressed_audio/fuzz-flac-lpc-overflow.flac");
        let header = probe(bytes).expect("its header is valid");
        assert_eq!(header.container, Container::Flac);
        match decode(bytes, 48_000 * 60) {
            Err(DecodeError::Codec { container: "flac", message }) => assert_eq!(message, "the decoder failed on this input"),
            other => panic!("decoded: {:?}", other.map(|a| a.samples.len())),
        }
    }

    /// The overflow checks kept on in symphonia refuse no real clip: the fuzz seeds made by
    /// libsndfile and FFmpeg (FLAC 16 and 24 bit, Ogg Vorbis, MP3 mono and stereo) all decode.
    #[test]
    fn real_clips_decode_with_symphonias_overflow_checks_on() {
        let seeds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/compressed_audio");
        let mut decoded = 0;
        for entry in std::fs::read_dir(&seeds).expect("the fuzz seeds") {
            let path = entry.expect("an entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
            if !(name.starts_with("espeak-") || name.starts_with("gsutil-")) {
                continue;
            }
            let audio = decode(&std::fs::read(&path).expect("a seed"), 48_000 * 60).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(audio.samples.len() > 1_000, "{name}: {} samples", audio.samples.len());
            // gsutil's MP3 is 1.2 s of silence; the espeak clips are speech.
            assert!(name.starts_with("gsutil-") || audio.samples.iter().any(|&s| s.abs() > 0.1), "{name}: silent");
            decoded += 1;
        }
        assert_eq!(decoded, 7, "the FLAC, Ogg and MP3 seeds");
    }

    #[test]
    fn truncated_or_corrupt_compressed_audio_is_an_error_not_a_panic() {
        for bytes in [&b"fLaC"[..], b"fLaC\0\0\0\x22garbage", b"OggS", b"OggS\0\x02\0\0\0\0\0\0\0\0", b"ID3\x04\0\0\0\0\0\x10", &[0xFF, 0xFB, 0x90]] {
            assert!(probe(bytes).is_err(), "{bytes:?}");
            assert!(decode(bytes, 1000).is_err(), "{bytes:?}");
        }
    }
}
