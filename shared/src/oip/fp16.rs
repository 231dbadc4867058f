//! [`F16`], the element of an `FP16` tensor: an IEEE 754 half-precision value kept as its
//! bits (the workspace has no half-float crate of its own), with the two conversions the
//! protocol needs: to `f32` (exact; for JSON `data` and for reading values) and from a JSON
//! number (rounded to nearest, ties to even; out of range is refused, as for `FP32`).

use serde::{Serialize, Serializer};

/// An IEEE 754 binary16 value, by its bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct F16(u16);

impl F16 {
    /// The largest finite value, 65504.
    pub const MAX: F16 = F16(0x7bff);

    pub const fn from_bits(bits: u16) -> F16 {
        F16(bits)
    }

    pub const fn to_bits(self) -> u16 {
        self.0
    }

    /// Whether the value is neither NaN nor ±infinity (exponent bits not all ones).
    pub const fn is_finite(self) -> bool {
        self.0 & 0x7c00 != 0x7c00
    }

    /// The value as an `f32`: exact, as every half-precision value is one.
    pub fn to_f32(self) -> f32 {
        let sign = if self.0 & 0x8000 != 0 { -1.0f32 } else { 1.0 };
        let exponent = i32::from((self.0 >> 10) & 0x1f);
        let mantissa = f32::from(self.0 & 0x3ff);
        match exponent {
            0 => sign * mantissa * 2f32.powi(-24),
            0x1f if mantissa == 0.0 => sign * f32::INFINITY,
            0x1f => f32::NAN,
            _ => sign * (1024.0 + mantissa) * 2f32.powi(exponent - 25),
        }
    }

    /// The nearest half-precision value to `x` (ties to even), or `None` when `x` is not
    /// finite or rounds past [`F16::MAX`].
    pub fn from_f64(x: f64) -> Option<F16> {
        if !x.is_finite() {
            return None;
        }
        let sign = if x.is_sign_negative() { 0x8000u16 } else { 0 };
        let magnitude = x.abs();
        if magnitude == 0.0 {
            return Some(F16(sign));
        }
        // The binade of `magnitude` (f64 subnormals are far below half precision's range),
        // no lower than half precision's smallest normal one, whose quantum also spaces the
        // subnormals.
        let binade = (((magnitude.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(-14);
        let quantum = 2f64.powi(binade - 10);
        // Division by a power of two is exact: `steps` is the value in quanta, rounded once.
        let steps = (magnitude / quantum).round_ties_even();
        let (binade, steps) = if steps >= 2048.0 { (binade + 1, steps / 2.0) } else { (binade, steps) };
        if binade > 15 {
            return None;
        }
        let steps = steps as u16;
        let bits = if steps < 1024 { steps } else { (((binade + 15) as u16) << 10) | (steps - 1024) };
        Some(F16(sign | bits))
    }
}

/// Serializes as the number it is (JSON `data`); NaN and ±infinity as `f32` would be (JSON:
/// `null`).
impl Serialize for F16 {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_f32(self.to_f32())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_half_survives_f32_and_back() {
        for bits in 0..=u16::MAX {
            let h = F16::from_bits(bits);
            let x = h.to_f32();
            assert_eq!(h.is_finite(), x.is_finite(), "{bits:#06x}");
            if h.is_finite() {
                assert_eq!(F16::from_f64(f64::from(x)), Some(h), "{bits:#06x} = {x}");
            }
        }
    }

    #[test]
    fn rounding_is_to_nearest_even_and_range_is_checked() {
        let check = |x: f64, want: Option<u16>| assert_eq!(F16::from_f64(x).map(F16::to_bits), want, "{x}");
        check(1.0, Some(0x3c00));
        check(-2.0, Some(0xc000));
        check(-0.0, Some(0x8000));
        check(65504.0, Some(0x7bff));
        check(65519.99, Some(0x7bff));
        check(65520.0, None); // the tie rounds to even: to 65536, past the range
        check(1e300, None);
        check(f64::NAN, None);
        check(f64::INFINITY, None);
        // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: to even (1); 1 + 3·2^-11 up.
        check(1.0 + 2f64.powi(-11), Some(0x3c00));
        check(1.0 + 3.0 * 2f64.powi(-11), Some(0x3c02));
        // Subnormals: the smallest is 2^-24; half of it is a tie to even (zero).
        check(2f64.powi(-24), Some(0x0001));
        check(2f64.powi(-25), Some(0x0000));
        check(1.5 * 2f64.powi(-25), Some(0x0001));
        check(-3.0 * 2f64.powi(-25), Some(0x8002));
        // Rounding up across the top subnormal into the smallest normal.
        check(2f64.powi(-14) - 2f64.powi(-26), Some(0x0400));
        check(5e-324, Some(0x0000));
        check(1.0 / 3.0, Some(0x3555));
        assert_eq!(F16::MAX.to_f32(), 65504.0);
        assert!(F16::from_bits(0x7e00).to_f32().is_nan());
        assert_eq!(F16::from_bits(0xfc00).to_f32(), f32::NEG_INFINITY);
        assert_eq!(serde_json::to_string(&F16::from_bits(0x3555)).expect("json"), "0.33325195");
    }
}
