//! Finding NaN and ±infinity among a request's FP32 inputs without a pass of its own over
//! memory.
//!
//! Every FP32 input is checked before a model sees it (see `server::take_inputs`). A separate
//! pass over a 2.7 MB body once it has been read goes to main memory: with many requests in
//! flight the first bytes of a body have left the caches long before its last arrive. That pass
//! was 16% of the worker's CPU on the request-path bench (64 in flight, 2026-12-01; about
//! 0.5 ms a request). [`Scan`] looks at each part of the body right after it is copied out of
//! hyper's buffer, while it is in the cache, and keeps one byte a 64 KiB block; the check of an
//! input then reads those bytes, and goes through the values only in a block that holds one
//! that is not finite.
//!
//! The scan cannot know where the FP32 inputs start (the JSON header that says so is parsed
//! later), so it looks at every byte offset at once. An FP32 value is NaN or ±infinity exactly
//! when its exponent bits are all ones: in little-endian order, the value's last byte has its
//! low seven bits set and the byte before it has its top bit set. For each block the scan
//! records, for each of the four offsets modulo 4, whether a byte at that offset starts such a
//! pair. For the offset an input's values end at the answer is exact (a set bit means a
//! non-finite value, or bytes of another tensor that share the block); for the three others it
//! is noise and never read.

use std::ops::Range;

/// Bytes of body a mask byte stands for. A multiple of 8 (a step never straddles two).
pub const BLOCK: usize = 64 << 10;

const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
const ONES: u64 = 0x0101_0101_0101_0101;
const TOP: u64 = 0x8080_8080_8080_8080;

/// The scan of a buffer that grows at its end (see the module doc).
#[derive(Debug, Default, Clone)]
pub struct Scan {
    /// Per block: bit `k` set when a byte at an offset ≡ `k` (mod 4) ends an all-ones exponent.
    masks: Vec<u8>,
    /// Bytes scanned so far: a multiple of 8 until [`Scan::finish`].
    scanned: usize,
    finished: bool,
}

impl Scan {
    /// Scans what `buffer` holds past what was scanned, in whole steps of 8 bytes; the rest
    /// waits for more bytes or for [`Scan::finish`]. `buffer` is the same buffer every call,
    /// longer or as long.
    pub fn advance(&mut self, buffer: &[u8]) {
        let end = buffer.len() / 8 * 8;
        if self.finished || end <= self.scanned {
            return;
        }
        self.masks.resize(end.div_ceil(BLOCK), 0);
        let mut at = self.scanned;
        if at == 0 {
            // The first byte has none before it: the step's previous bytes are its own, shifted.
            let w = word(&buffer[..8]);
            self.mark(0, ends_exponent(w, w << 8));
            at = 8;
        }
        while at < end {
            let stop = ((at / BLOCK + 1) * BLOCK).min(end);
            let hits = buffer[at..stop]
                .chunks_exact(8)
                .zip(buffer[at - 1..stop - 1].chunks_exact(8))
                .fold(0u64, |hits, (w, before)| hits | ends_exponent(word(w), word(before)));
            self.mark(at, hits);
            at = stop;
        }
        self.scanned = end;
    }

    /// Scans the last bytes (fewer than 8) once the buffer is whole: after it `buffer` may not
    /// grow.
    pub fn finish(&mut self, buffer: &[u8]) {
        self.advance(buffer);
        if self.finished {
            return;
        }
        self.masks.resize(buffer.len().div_ceil(BLOCK), 0);
        for at in self.scanned..buffer.len() {
            let before = if at == 0 { 0 } else { buffer[at - 1] };
            if buffer[at] & 0x7f == 0x7f && before & 0x80 != 0 {
                self.masks[at / BLOCK] |= 1 << (at % 4);
            }
        }
        self.scanned = buffer.len();
        self.finished = true;
    }

    /// Whether the little-endian FP32 values at `range` of the scanned buffer may hold NaN or
    /// ±infinity: `false` means none of them does. `true` for bytes not yet scanned.
    pub fn may_hold_non_finite(&self, range: Range<usize>) -> bool {
        if range.end > self.scanned || range.end < range.start {
            return true;
        }
        if range.len() < 4 {
            return false;
        }
        // Each value's last byte is at start + 3 + 4k.
        let (first, last) = (range.start + 3, range.end - 1);
        let bit = 1u8 << (first % 4);
        self.masks[first / BLOCK..=last / BLOCK].iter().any(|m| m & bit != 0)
    }

    /// Records a step's hits (`hits` of the 8 bytes from `at`, a multiple of 8) in its block.
    fn mark(&mut self, at: usize, hits: u64) {
        if hits == 0 {
            return;
        }
        // Byte k of the step is at offset at + k ≡ k (mod 4); bytes k and k + 4 share a bit.
        let byte = |k: u32| ((hits >> (8 * k + 7)) & 1) as u8;
        let mask = (0..8).fold(0u8, |m, k| m | (byte(k) << (k % 4)));
        self.masks[at / BLOCK] |= mask;
    }
}

fn word(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes.try_into().expect("a step is 8 bytes"))
}

/// Of 8 bytes `w` and the 8 bytes `before` them shifted by one (byte k of `before` is the
/// byte before byte k of `w`), the top bit of each byte of `w` whose low seven bits are all
/// set and whose previous byte's top bit is set. (`x & 0x7f` is at most 0x7f, so adding 1
/// carries into the top bit only when it is 0x7f, and never into the next byte.)
fn ends_exponent(w: u64, before: u64) -> u64 {
    ((w & LOW7) + ONES) & before & TOP
}

/// The index and value of the first NaN or ±infinity among `le` (little-endian f32 values at
/// any alignment), if any. Scans blocks branch-free (the largest absolute bit pattern of a
/// block; vectorised) and looks for the element only in a block that has one.
pub fn first_non_finite(le: &[u8]) -> Option<(usize, f32)> {
    const VALUES: usize = 4096;
    // Exponent all ones: infinity (mantissa 0) or NaN; every larger pattern is a NaN too.
    const NON_FINITE: u32 = 0x7f80_0000;
    let bits = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    le.chunks(VALUES * 4).enumerate().find_map(|(b, block)| {
        let largest = block.chunks_exact(4).fold(0u32, |m, x| m.max(bits(x) & 0x7fff_ffff));
        if largest < NON_FINITE {
            return None;
        }
        block
            .chunks_exact(4)
            .map(|x| f32::from_bits(bits(x)))
            .enumerate()
            .find(|(_, x)| !x.is_finite())
            .map(|(i, x)| (b * VALUES + i, x))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn scanned_in_parts(buffer: &[u8], parts: &[usize]) -> Scan {
        let mut scan = Scan::default();
        let mut end = 0;
        for &part in parts {
            end = (end + part).min(buffer.len());
            scan.advance(&buffer[..end]);
        }
        scan.finish(buffer);
        scan
    }

    fn le(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn a_photo_of_finite_values_is_clean_at_every_start_and_each_bad_value_is_seen() {
        // 3 × 480 × 480 values as P-Net takes them, behind a header of odd length.
        let values: Vec<f32> = (0..3 * 480 * 480).map(|i| ((i * 7919) % 256) as f32 / 128.0 - 0.99609375).collect();
        for header in [0usize, 1, 2, 3, 117] {
            let mut body = vec![b'{'; header];
            body.extend(le(&values));
            let scan = scanned_in_parts(&body, &[65_536 + 3, 400_000, 12]);
            assert!(!scan.may_hold_non_finite(header..body.len()), "header of {header}");
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::from_bits(0xffc0_0001)] {
                for at in [0usize, 1, 16_383, 16_384, values.len() - 1] {
                    let mut body = body.clone();
                    body[header + 4 * at..header + 4 * at + 4].copy_from_slice(&bad.to_le_bytes());
                    let scan = scanned_in_parts(&body, &[7, 131_072, 1 << 30]);
                    assert!(scan.may_hold_non_finite(header..body.len()), "{bad} at {at}, header {header}");
                    assert_eq!(first_non_finite(&body[header..]).map(|(i, _)| i), Some(at));
                }
            }
        }
    }

    #[test]
    fn bytes_not_yet_scanned_may_hold_anything_and_short_ranges_nothing() {
        let body = le(&[1.0; 100]);
        let mut scan = Scan::default();
        scan.advance(&body[..203]);
        assert!(!scan.may_hold_non_finite(0..200));
        assert!(scan.may_hold_non_finite(0..400), "past what was scanned");
        scan.finish(&body);
        assert!(!scan.may_hold_non_finite(0..400));
        assert!(!scan.may_hold_non_finite(8..11), "no whole value");
        assert!(!Scan::default().may_hold_non_finite(0..0));
    }

    proptest! {
        /// Never a miss: wherever the exact check finds a non-finite value, the scan says one
        /// may be there, however the buffer arrived and wherever the values start.
        #[test]
        fn the_scan_never_misses_a_value_the_exact_check_finds(
            bytes in prop::collection::vec(any::<u8>(), 0..600),
            bad in prop::collection::vec((0usize..600, 0u32..4), 0..3),
            parts in prop::collection::vec(1usize..200, 1..6),
            start in 0usize..16,
            len in 0usize..600,
        ) {
            let mut bytes = bytes;
            for (at, kind) in bad {
                let value = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN][kind as usize].to_le_bytes();
                if at + 4 <= bytes.len() {
                    bytes[at..at + 4].copy_from_slice(&value);
                }
            }
            let scan = scanned_in_parts(&bytes, &parts);
            let start = start.min(bytes.len());
            let end = (start + len / 4 * 4).min(start + (bytes.len() - start) / 4 * 4);
            if first_non_finite(&bytes[start..end]).is_some() {
                prop_assert!(scan.may_hold_non_finite(start..end));
            }
            // Over a whole buffer of one block, exact: clean whenever the exact check finds none.
            let whole = bytes.len() / 4 * 4;
            if first_non_finite(&bytes[..whole]).is_none() && whole == bytes.len() {
                prop_assert!(!scan.may_hold_non_finite(0..whole));
            }
        }
    }
}
