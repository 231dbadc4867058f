//! The binary tensor data extension: the names of its HTTP header and parameters, reading
//! the header's value, which outputs a client wants as binary, the body layout (JSON header,
//! then every binary tensor's bytes, in order) and the little-endian byte layout of one
//! element.

use serde::Serialize;
use serde_json::Value;

use super::wire::to_json_vec;
use super::{InferRequest, OipError, Parameters, Tensor, F16};

/// HTTP header giving the length of the JSON part of a body that carries binary tensor data.
pub const INFERENCE_HEADER_CONTENT_LENGTH: &str = "inference-header-content-length";
/// Tensor parameter: the tensor's bytes are in the binary section and take this many bytes.
pub const BINARY_DATA_SIZE: &str = "binary_data_size";
/// Requested-output parameter: return this output as binary data.
pub const BINARY_DATA: &str = "binary_data";
/// Request parameter: return every output as binary data unless the output says otherwise.
pub const BINARY_DATA_OUTPUT: &str = "binary_data_output";

/// Reads the value of the [`INFERENCE_HEADER_CONTENT_LENGTH`] HTTP header.
pub fn parse_header_length(value: &[u8]) -> Result<usize, OipError> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .ok_or_else(|| {
            let mut value = String::from_utf8_lossy(value).into_owned();
            if value.len() > 64 {
                let mut cut = 64;
                while !value.is_char_boundary(cut) {
                    cut -= 1;
                }
                value.truncate(cut);
            }
            OipError::InvalidHeaderValue { value }
        })
}

/// Whether the server should return output `output_name` as binary data: the output's own
/// `binary_data` parameter if the request lists it with one, else the request's
/// `binary_data_output` parameter, else `false`.
pub fn wants_binary_output(req: &InferRequest, output_name: &str) -> bool {
    let flag = |params: Option<&Parameters>, key: &str| {
        params.and_then(|p| p.get(key)).and_then(Value::as_bool)
    };
    req.outputs
        .iter()
        .flatten()
        .find(|o| o.name == output_name)
        .and_then(|o| flag(o.parameters.as_ref(), BINARY_DATA))
        .or_else(|| flag(req.parameters.as_ref(), BINARY_DATA_OUTPUT))
        .unwrap_or(false)
}

pub(super) fn split_body(body: &[u8], header_len: Option<usize>) -> Result<(&[u8], &[u8]), OipError> {
    match header_len {
        None => Ok((body, &[])),
        Some(n) if n <= body.len() => Ok(body.split_at(n)),
        Some(n) => Err(OipError::HeaderLength {
            header_len: n,
            body_len: body.len(),
        }),
    }
}

pub(super) fn frame<T: Serialize>(
    header: &T,
    tensors: &[Tensor],
    binary: &[bool],
) -> (Vec<u8>, Option<usize>) {
    let mut body = to_json_vec(header);
    if !binary.contains(&true) {
        return (body, None);
    }
    let header_len = body.len();
    let binary_len: usize = tensors
        .iter()
        .zip(binary)
        .filter(|(_, &b)| b)
        .map(|(t, _)| t.data.byte_len())
        .sum();
    body.reserve_exact(binary_len);
    for (t, _) in tensors.iter().zip(binary).filter(|(_, &b)| b) {
        t.data.write_le_bytes(&mut body);
    }
    (body, Some(header_len))
}

/// A fixed-size element with a little-endian binary encoding.
pub(super) trait LeElement: Copy {
    const SIZE: usize;
    /// `out` is exactly `SIZE` bytes long.
    fn put(self, out: &mut [u8]);
    /// `b` is exactly `SIZE` bytes long.
    fn get(b: &[u8]) -> Self;
}

macro_rules! le_element {
    ($($t:ty),*) => {$(
        impl LeElement for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn put(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_le_bytes(a)
            }
        }
    )*};
}

le_element!(u8, u16, u32, u64, i8, i16, i32, i64, f32, f64);

impl LeElement for bool {
    const SIZE: usize = 1;
    fn put(self, out: &mut [u8]) {
        out[0] = u8::from(self);
    }
    fn get(b: &[u8]) -> Self {
        b.first().is_some_and(|&x| x != 0)
    }
}

impl LeElement for F16 {
    const SIZE: usize = 2;
    fn put(self, out: &mut [u8]) {
        self.to_bits().put(out);
    }
    fn get(b: &[u8]) -> Self {
        F16::from_bits(u16::get(b))
    }
}

pub(super) fn elem_size_of<T: LeElement>(_: &[T]) -> usize {
    T::SIZE
}

/// One resize, then fixed-size stores: the compiler turns this into a block copy on
/// little-endian hosts (growing the vector element by element does not vectorise).
pub(super) fn put_all<T: LeElement>(v: &[T], out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + v.len() * T::SIZE, 0);
    for (slot, &x) in out[start..].chunks_exact_mut(T::SIZE).zip(v) {
        x.put(slot);
    }
}

pub(super) fn get_all<T: LeElement>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(T::SIZE).map(T::get).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::oip::test_support::req_err;
    use crate::oip::TensorData;
    use serde_json::json;

    #[test]
    fn header_length_value_parsing() {
        assert_eq!(parse_header_length(b"123").unwrap(), 123);
        assert_eq!(parse_header_length(b" 0 ").unwrap(), 0);
        for bad in [
            &b""[..],
            b"-1",
            b"12a",
            b"\xff",
            b"99999999999999999999999999",
        ] {
            assert!(matches!(
                parse_header_length(bad),
                Err(OipError::InvalidHeaderValue { .. })
            ));
        }
    }

    #[test]
    fn wants_binary_output_precedence() {
        let req: InferRequest = serde_json::from_value(json!({
            "inputs": [],
            "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": true}}]
        }))
        .unwrap();
        assert!(!wants_binary_output(&req, "a"));
        assert!(wants_binary_output(&req, "b"));
        let req: InferRequest = serde_json::from_value(json!({
            "inputs": [], "parameters": {"binary_data_output": true},
            "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": false}}]
        }))
        .unwrap();
        assert!(wants_binary_output(&req, "a"));
        assert!(!wants_binary_output(&req, "b"));
        assert!(wants_binary_output(&req, "unlisted"));
        assert!(!wants_binary_output(&InferRequest::default(), "a"));
    }

    #[test]
    fn error_header_length_past_body() {
        let err = req_err(b"{}", Some(3));
        assert!(
            matches!(
                err,
                OipError::HeaderLength {
                    header_len: 3,
                    body_len: 2
                }
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "inference-header-content-length 3 is past the end of the 2-byte body"
        );
    }

    #[test]
    fn binary_encoding_is_little_endian_for_every_width() {
        let mut out = vec![9u8];
        TensorData::Fp32(vec![1.0, -2.5]).write_le_bytes(&mut out);
        TensorData::Uint16(vec![0x0102]).write_le_bytes(&mut out);
        TensorData::Bool(vec![true, false]).write_le_bytes(&mut out);
        TensorData::Fp16(vec![crate::oip::F16::from_bits(0x3c00)]).write_le_bytes(&mut out);
        let mut want = vec![9u8];
        want.extend(1.0f32.to_le_bytes());
        want.extend((-2.5f32).to_le_bytes());
        want.extend([0x02, 0x01, 1, 0, 0x00, 0x3c]);
        assert_eq!(out, want);
    }
}
