//! The WAV format as the voice task's events carry it: the format tags and sample encodings
//! the gateway's decoder reads (`api-gateway/src/audio/wav.rs`), and a writer for every one of
//! them.
//!
//! No service writes WAV on a request path. The writer makes the clips `vramgate-cli load`
//! sends, the inputs of the decoder's unit tests and of the end-to-end tests, and the files the
//! gateway's `audio_libs` example measures decoders on. Those inputs include malformed ones, so
//! besides the whole-file [`wav_bytes`] the building blocks are public too: a chunk with any
//! declared size, a RIFF container, a classic or `WAVE_FORMAT_EXTENSIBLE` `fmt ` body. That
//! every encoding round-trips through the decoder is tested beside the decoder, whose tests
//! build their files here.

/// `WAVE_FORMAT_PCM`: integer samples.
pub const FORMAT_PCM: u16 = 0x0001;
/// `WAVE_FORMAT_IEEE_FLOAT`: 32- or 64-bit float samples.
pub const FORMAT_IEEE_FLOAT: u16 = 0x0003;
/// `WAVE_FORMAT_EXTENSIBLE`: the real format lives in the sub-format GUID.
pub const FORMAT_EXTENSIBLE: u16 = 0xFFFE;

/// Bytes 2..16 shared by every `KSDATAFORMAT_SUBTYPE_*` GUID derived from a
/// classic format tag; the first two bytes carry that tag little-endian.
pub const KSDATAFORMAT_GUID_TAIL: [u8; 14] = [
    0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x80, 0x00, 0x00, 0xAA, 0x00, 0x38, 0x9B, 0x71,
];

/// How one sample is stored in the data chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleFormat {
    U8,
    I16,
    I24,
    I32,
    F32,
    F64,
}

impl SampleFormat {
    /// Bytes per stored sample.
    pub fn bytes(self) -> u16 {
        match self {
            SampleFormat::U8 => 1,
            SampleFormat::I16 => 2,
            SampleFormat::I24 => 3,
            SampleFormat::I32 | SampleFormat::F32 => 4,
            SampleFormat::F64 => 8,
        }
    }

    /// Every encoding the decoder reads, for tests that cover them all.
    pub const ALL: [SampleFormat; 6] =
        [SampleFormat::U8, SampleFormat::I16, SampleFormat::I24, SampleFormat::I32, SampleFormat::F32, SampleFormat::F64];

    /// Bits per sample (`wBitsPerSample`).
    pub fn bits(self) -> u16 {
        self.bytes() * 8
    }

    /// The classic format tag: PCM for integers, IEEE float for floats.
    pub fn format_tag(self) -> u16 {
        match self {
            SampleFormat::F32 | SampleFormat::F64 => FORMAT_IEEE_FLOAT,
            _ => FORMAT_PCM,
        }
    }

    /// Appends one sample. Integers are clamped to `[-1, 1]`, scaled by `2^(bits-1) - 1` and
    /// rounded (8-bit is unsigned, offset by 128), as common writers do; the decoder divides
    /// by `2^(bits-1)`, so a round trip is off by at most two quantisation steps. Floats are
    /// written as given, past full scale or not finite too: careless writers do that, and the
    /// decoder's tests need such files.
    pub fn push(self, sample: f32, out: &mut Vec<u8>) {
        let int = |bits: u32| {
            let x = f64::from(sample.clamp(-1.0, 1.0));
            (x * ((1u64 << (bits - 1)) - 1) as f64).round() as i64
        };
        match self {
            SampleFormat::U8 => out.push((int(8) + 128) as u8),
            SampleFormat::I16 => out.extend_from_slice(&(int(16) as i16).to_le_bytes()),
            SampleFormat::I24 => out.extend_from_slice(&(int(24) as i32).to_le_bytes()[..3]),
            SampleFormat::I32 => out.extend_from_slice(&(int(32) as i32).to_le_bytes()),
            SampleFormat::F32 => out.extend_from_slice(&sample.to_le_bytes()),
            SampleFormat::F64 => out.extend_from_slice(&f64::from(sample).to_le_bytes()),
        }
    }

    /// The `data` chunk's body for interleaved `samples`.
    pub fn encode(self, samples: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(samples.len() * usize::from(self.bits() / 8));
        samples.iter().for_each(|&x| self.push(x, &mut out));
        out
    }
}

/// One RIFF chunk: id, size (`declared`, or the body's true length), body, and the pad byte
/// an odd-sized body takes.
pub fn chunk(id: &[u8; 4], body: &[u8], declared: Option<u32>) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + body.len() + 1);
    out.extend_from_slice(id);
    out.extend_from_slice(&declared.unwrap_or(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    if body.len() % 2 == 1 {
        out.push(0);
    }
    out
}

/// A `RIFF`/`WAVE` container around `chunks`, its size `declared` or the true one.
pub fn riff(chunks: &[Vec<u8>], declared: Option<u32>) -> Vec<u8> {
    let len: usize = chunks.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(12 + len);
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&declared.unwrap_or(len as u32 + 4).to_le_bytes());
    out.extend_from_slice(b"WAVE");
    chunks.iter().for_each(|c| out.extend_from_slice(c));
    out
}

/// A classic 16-byte `fmt ` body. The byte rate is computed wrapping, as a careless writer
/// would, so tests can state absurd rates without overflowing.
pub fn fmt_body(tag: u16, channels: u16, rate: u32, bits: u16) -> Vec<u8> {
    let block_align = channels.wrapping_mul(bits.div_ceil(8));
    let mut b = Vec::with_capacity(40);
    b.extend_from_slice(&tag.to_le_bytes());
    b.extend_from_slice(&channels.to_le_bytes());
    b.extend_from_slice(&rate.to_le_bytes());
    b.extend_from_slice(&rate.wrapping_mul(u32::from(block_align)).to_le_bytes());
    b.extend_from_slice(&block_align.to_le_bytes());
    b.extend_from_slice(&bits.to_le_bytes());
    b
}

/// A 40-byte `WAVE_FORMAT_EXTENSIBLE` `fmt ` body: `valid` bits in a `bits` container, the
/// sub-format GUID of the classic tag `sub_tag`, front channels in the mask.
pub fn fmt_extensible(channels: u16, rate: u32, bits: u16, valid: u16, sub_tag: u16) -> Vec<u8> {
    let mut b = fmt_body(FORMAT_EXTENSIBLE, channels, rate, bits);
    b.extend_from_slice(&22u16.to_le_bytes());
    b.extend_from_slice(&valid.to_le_bytes());
    let mask: u32 = match channels {
        1 => 0x4,
        2 => 0x3,
        _ => 0,
    };
    b.extend_from_slice(&mask.to_le_bytes());
    b.extend_from_slice(&sub_tag.to_le_bytes());
    b.extend_from_slice(&KSDATAFORMAT_GUID_TAIL);
    b
}

/// A whole, well-formed WAV file of interleaved `samples` (`channels` per frame): a classic
/// `fmt ` chunk, then `data`.
pub fn wav_bytes(encoding: SampleFormat, channels: u16, rate: u32, samples: &[f32]) -> Vec<u8> {
    riff(
        &[
            chunk(b"fmt ", &fmt_body(encoding.format_tag(), channels, rate, encoding.bits()), None),
            chunk(b"data", &encoding.encode(samples), None),
        ],
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_samples_past_full_scale_are_clamped_floats_are_not() {
        assert_eq!(SampleFormat::I16.encode(&[2.0, -2.0]), [0xFF, 0x7F, 0x01, 0x80]);
        assert_eq!(SampleFormat::U8.encode(&[5.0, -5.0, 0.0]), [255, 1, 128]);
        assert_eq!(SampleFormat::F32.encode(&[1.5]), 1.5f32.to_le_bytes());
    }

    #[test]
    fn an_odd_chunk_is_padded_and_may_declare_any_size() {
        assert_eq!(chunk(b"LIST", b"abc", None), b"LIST\x03\x00\x00\x00abc\x00");
        assert_eq!(chunk(b"data", b"", Some(0xFFFF_FFFF)), b"data\xFF\xFF\xFF\xFF");
        let file = riff(&[chunk(b"junk", b"ab", None)], None);
        assert_eq!(&file[..12], b"RIFF\x0e\x00\x00\x00WAVE");
    }
}
