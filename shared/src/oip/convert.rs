//! Tensor values from their two wire forms into [`TensorData`]: the bytes of a binary tensor
//! ([`decode_binary`]) and the possibly nested JSON `data` array ([`decode_json`]), with a
//! short description of a bad JSON value for error messages.

use serde_json::Value;

use super::binary::get_all;
use super::{DataType, TensorData, F16};

/// `raw` has a whole number of elements of a supported `datatype`.
pub(super) fn decode_binary(datatype: DataType, raw: &[u8]) -> TensorData {
    match datatype {
        DataType::Bool => TensorData::Bool(get_all(raw)),
        DataType::Uint8 => TensorData::Uint8(raw.to_vec()),
        DataType::Uint16 => TensorData::Uint16(get_all(raw)),
        DataType::Uint32 => TensorData::Uint32(get_all(raw)),
        DataType::Uint64 => TensorData::Uint64(get_all(raw)),
        DataType::Int8 => TensorData::Int8(get_all(raw)),
        DataType::Int16 => TensorData::Int16(get_all(raw)),
        DataType::Int32 => TensorData::Int32(get_all(raw)),
        DataType::Int64 => TensorData::Int64(get_all(raw)),
        DataType::Fp16 => TensorData::Fp16(get_all(raw)),
        // Callers reject BYTES first; an empty FP32 tensor is a harmless fallback.
        DataType::Fp32 | DataType::Bytes => TensorData::Fp32(get_all(raw)),
        DataType::Fp64 => TensorData::Fp64(get_all(raw)),
    }
}

/// Converts the leaves of `values` (known to number `count`); on failure, the index and a
/// description of the first bad value.
pub(super) fn decode_json(
    datatype: DataType,
    values: &[Value],
    count: usize,
) -> Result<TensorData, (usize, String)> {
    fn conv<T>(
        values: &[Value],
        count: usize,
        f: impl Fn(&Value) -> Option<T>,
    ) -> Result<Vec<T>, (usize, String)> {
        let mut out = Vec::with_capacity(count);
        for (i, v) in Leaves::new(values).enumerate() {
            out.push(f(v).ok_or_else(|| (i, describe(v)))?);
        }
        Ok(out)
    }
    fn unsigned<T: TryFrom<u64>>(v: &Value) -> Option<T> {
        v.as_u64().and_then(|x| T::try_from(x).ok())
    }
    fn signed<T: TryFrom<i64>>(v: &Value) -> Option<T> {
        v.as_i64().and_then(|x| T::try_from(x).ok())
    }
    Ok(match datatype {
        DataType::Bool => TensorData::Bool(conv(values, count, Value::as_bool)?),
        DataType::Uint8 => TensorData::Uint8(conv(values, count, unsigned)?),
        DataType::Uint16 => TensorData::Uint16(conv(values, count, unsigned)?),
        DataType::Uint32 => TensorData::Uint32(conv(values, count, unsigned)?),
        DataType::Uint64 => TensorData::Uint64(conv(values, count, Value::as_u64)?),
        DataType::Int8 => TensorData::Int8(conv(values, count, signed)?),
        DataType::Int16 => TensorData::Int16(conv(values, count, signed)?),
        DataType::Int32 => TensorData::Int32(conv(values, count, signed)?),
        DataType::Int64 => TensorData::Int64(conv(values, count, Value::as_i64)?),
        // JSON numbers are finite; one that rounds past 65504 is out of range.
        DataType::Fp16 => TensorData::Fp16(conv(values, count, |v| v.as_f64().and_then(F16::from_f64))?),
        DataType::Fp32 | DataType::Bytes => {
            TensorData::Fp32(conv(values, count, |v| {
                // JSON numbers are finite; one that only overflows f32 is out of range.
                v.as_f64().map(|x| x as f32).filter(|x| x.is_finite())
            })?)
        }
        DataType::Fp64 => TensorData::Fp64(conv(values, count, Value::as_f64)?),
    })
}

/// The non-array values inside nested arrays, depth first (row-major order).
pub(super) struct Leaves<'a> {
    stack: Vec<std::slice::Iter<'a, Value>>,
}

impl<'a> Leaves<'a> {
    pub(super) fn new(values: &'a [Value]) -> Self {
        Self {
            stack: vec![values.iter()],
        }
    }
}

impl<'a> Iterator for Leaves<'a> {
    type Item = &'a Value;

    fn next(&mut self) -> Option<&'a Value> {
        loop {
            let top = self.stack.last_mut()?;
            match top.next() {
                None => {
                    self.stack.pop();
                }
                Some(Value::Array(inner)) => self.stack.push(inner.iter()),
                Some(v) => return Some(v),
            }
        }
    }
}

/// A short description of a JSON value for error messages (never the whole of a big value).
pub(super) fn describe(v: &Value) -> String {
    match v {
        Value::Null => {
            "null (json cannot carry nan or infinity; send such floats as binary)".into()
        }
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::oip::test_support::req_err;
    use crate::oip::{decode_response, encode_response, OipError, Tensor};

    #[test]
    fn non_finite_floats_survive_binary_but_not_json() {
        let t = [Tensor::new(
            "f",
            vec![3],
            vec![f32::NAN, f32::INFINITY, 1.0],
        )];
        let (body, hl) = encode_response("m", None, None, &t, |_| true);
        let (_, d) = decode_response(&body, hl).unwrap();
        let TensorData::Fp32(v) = &d[0].data else {
            panic!("wrong type")
        };
        assert!(v[0].is_nan() && v[1] == f32::INFINITY && v[2] == 1.0);
        let (body, hl) = encode_response("m", None, None, &t, |_| false);
        let err = decode_response(&body, hl).unwrap_err();
        assert!(matches!(err, OipError::InvalidData { .. }), "{err}");
        assert!(err.to_string().contains("element 0"), "{err}");
    }

    #[test]
    fn error_json_invalid_values() {
        let cases = [
            ("UINT8", "[256]"),
            ("INT8", "[-129]"),
            ("UINT32", "[-1]"),
            ("INT32", "[1.5]"),
            ("INT64", "[9223372036854775808]"),
            ("BOOL", "[1]"),
            ("FP32", "[1e39]"),
            ("FP16", "[65520]"),
            ("FP16", "[true]"),
            ("FP64", "[\"1.0\"]"),
            ("FP32", "[null]"),
            ("INT16", "[{}]"),
        ];
        for (dt, data) in cases {
            let body = format!(
                r#"{{"inputs":[{{"name":"x","shape":[1],"datatype":"{dt}","data":{data}}}]}}"#
            );
            let err = req_err(body.as_bytes(), None);
            assert!(
                matches!(err, OipError::InvalidData { .. }),
                "{dt} {data}: {err}"
            );
        }
        let err = req_err(
            br#"{"inputs":[{"name":"x","shape":[1],"datatype":"INT32","data":5}]}"#,
            None,
        );
        assert!(matches!(err, OipError::InvalidData { .. }), "{err}");
    }
}
