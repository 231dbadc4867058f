//! An inference request body as the worker reads it (`oip::decode_request_in_place` with the
//! default limits, as `server::infer` calls it), the binary tensor extension included, and the
//! same bytes as the gateway reads a worker's answer (`oip::decode_response`).
//!
//! The input is `<Inference-Header-Content-Length>\n<body>`: the line before the first newline
//! (within the first 24 bytes) is the header's value, read by `oip::parse_header_length`; an
//! empty line, or none, stands for a request without the header (the whole body is JSON).
//!
//! Checked: every binary input's range lies in the body and holds exactly its shape's elements;
//! every JSON input holds exactly its shape's values; the tensors, encoded again as the gateway
//! encodes requests (binary, and JSON where every value is finite), decode to the same values.

#![no_main]

use libfuzzer_sys::fuzz_target;
use vramgate_shared::oip::{self, DecodeLimits, RawData, Tensor, TensorData};

/// Bytes the header line may take: `usize::MAX` has 20 digits.
const MAX_HEADER_LINE: usize = 24;

fn split(data: &[u8]) -> (Option<usize>, &[u8]) {
    match data.iter().take(MAX_HEADER_LINE).position(|&b| b == b'\n') {
        Some(0) => (None, &data[1..]),
        Some(n) => match oip::parse_header_length(&data[..n]) {
            Ok(len) => (Some(len), &data[n + 1..]),
            // The worker answers 400 to a header that is not a byte count; nothing to decode.
            Err(_) => (None, &[]),
        },
        None => (None, data),
    }
}

fn finite(data: &TensorData) -> bool {
    match data {
        TensorData::Fp16(v) => v.iter().all(|x| x.to_f32().is_finite()),
        TensorData::Fp32(v) => v.iter().all(|x| x.is_finite()),
        TensorData::Fp64(v) => v.iter().all(|x| x.is_finite()),
        _ => true,
    }
}

fuzz_target!(|data: &[u8]| {
    let (header_len, body) = split(data);
    if body.is_empty() {
        return;
    }
    let _ = oip::decode_response(body, header_len);
    let Ok((request, raw)) = oip::decode_request_in_place(body, header_len, &DecodeLimits::default()) else { return };
    for output in request.outputs.iter().flatten() {
        oip::wants_binary_output(&request, &output.name);
    }
    for tensor in &raw {
        let elements = tensor.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).expect("a decoded shape does not overflow");
        match &tensor.data {
            RawData::Binary(range) => {
                let size = tensor.datatype.element_size().expect("a binary tensor has a fixed element size");
                assert!(range.end <= body.len(), "tensor {} at {range:?} of a {}-byte body", tensor.name, body.len());
                assert_eq!(range.len(), elements * size, "tensor {}", tensor.name);
            }
            RawData::Json(values) => assert_eq!(values.len(), elements, "tensor {}", tensor.name),
        }
    }
    let (_, tensors) = oip::decode_request(body, header_len).expect("decode_request reads what decode_request_in_place read");
    let named = |t: &Tensor| (t.name.clone(), t.shape.clone(), t.datatype());
    assert!(raw.iter().map(|r| (r.name.clone(), r.shape.clone(), r.datatype)).eq(tensors.iter().map(named)));
    vramgate_fuzz::check_wire_round_trip(&tensors);
    if tensors.iter().all(|t| finite(&t.data)) {
        let (json, header) = oip::encode_request(request.id.as_deref(), &tensors, false, &[]);
        assert_eq!(header, None, "a request of JSON data needs no header length");
        let (_, again) = oip::decode_request(&json, None).expect("a JSON request decodes");
        let values = |t: &Tensor| (named(t), vramgate_fuzz::le_bytes(&t.data));
        assert!(tensors.iter().map(values).eq(again.iter().map(values)), "JSON data changed a value");
    }
});
