//! The decoders: a request or response body, with or without binary data, into its JSON
//! header and its tensors ([`decode_request`], [`decode_request_in_place`],
//! [`decode_response`] and their `_with_limits` forms).

use std::collections::HashSet;

use super::binary::split_body;
use super::check::{Cursor, WireTensor};
use super::convert::decode_binary;
use super::{
    DecodeLimits, ErrorBody, InferRequest, InferResponse, OipError, RawData, RawTensor, Tensor,
    TensorKind,
};

/// Decodes a request body; `header_len` is the value of the
/// [`INFERENCE_HEADER_CONTENT_LENGTH`] header, `None` when the request had none.
///
/// Returns the JSON header (with every input's `data` moved out, so `None`) and the inputs as
/// tensors, in order. Uses [`DecodeLimits::default`].
///
/// [`INFERENCE_HEADER_CONTENT_LENGTH`]: super::INFERENCE_HEADER_CONTENT_LENGTH
pub fn decode_request(
    body: &[u8],
    header_len: Option<usize>,
) -> Result<(InferRequest, Vec<Tensor>), OipError> {
    decode_request_with_limits(body, header_len, &DecodeLimits::default())
}

/// [`decode_request`] with explicit limits.
pub fn decode_request_with_limits(
    body: &[u8],
    header_len: Option<usize>,
    limits: &DecodeLimits,
) -> Result<(InferRequest, Vec<Tensor>), OipError> {
    let (request, raw) = decode_request_in_place(body, header_len, limits)?;
    let tensors = raw.into_iter().map(|t| t.into_tensor(body)).collect();
    Ok((request, tensors))
}

/// [`decode_request_with_limits`] that leaves binary data in the body: each binary input is
/// checked (datatype, shape, size, bounds, limits) and returned as its range of `body`, so a
/// server can copy it once, straight to where it is used. JSON inputs are decoded.
pub fn decode_request_in_place(
    body: &[u8],
    header_len: Option<usize>,
    limits: &DecodeLimits,
) -> Result<(InferRequest, Vec<RawTensor>), OipError> {
    let (json, binary) = split_body(body, header_len)?;
    let mut request: InferRequest = serde_json::from_slice(json)?;
    let mut cursor = Cursor::new(binary, limits);
    let mut seen = HashSet::with_capacity(request.inputs.len());
    let mut tensors = Vec::with_capacity(request.inputs.len());
    for input in &mut request.inputs {
        let wire = WireTensor {
            kind: TensorKind::Input,
            name: &input.name,
            shape: &input.shape,
            datatype: &input.datatype,
            parameters: input.parameters.as_ref(),
            data: input.data.take(),
        };
        tensors.push(wire.decode(&mut cursor, &mut seen)?.offset_by(json.len()));
    }
    cursor.finish()?;
    Ok((request, tensors))
}

impl RawTensor {
    /// Decodes the values; `body` is the body the tensor was decoded from.
    fn into_tensor(self, body: &[u8]) -> Tensor {
        let data = match self.data {
            RawData::Binary(range) => decode_binary(self.datatype, &body[range]),
            RawData::Json(data) => data,
        };
        Tensor { name: self.name, shape: self.shape, data }
    }

    /// The same tensor with its binary range moved `by` bytes on (from the binary section to
    /// the whole body).
    fn offset_by(mut self, by: usize) -> Self {
        if let RawData::Binary(range) = &mut self.data {
            *range = range.start + by..range.end + by;
        }
        self
    }
}

/// Decodes a response body; `header_len` is the value of the
/// [`INFERENCE_HEADER_CONTENT_LENGTH`] header, `None` when the response had none.
///
/// Returns the JSON header (with every output's `data` moved out, so `None`) and the outputs
/// as tensors, in order. An [`ErrorBody`] yields [`OipError::Server`]. Uses
/// [`DecodeLimits::default`].
///
/// [`INFERENCE_HEADER_CONTENT_LENGTH`]: super::INFERENCE_HEADER_CONTENT_LENGTH
pub fn decode_response(
    body: &[u8],
    header_len: Option<usize>,
) -> Result<(InferResponse, Vec<Tensor>), OipError> {
    decode_response_with_limits(body, header_len, &DecodeLimits::default())
}

/// [`decode_response`] with explicit limits.
pub fn decode_response_with_limits(
    body: &[u8],
    header_len: Option<usize>,
    limits: &DecodeLimits,
) -> Result<(InferResponse, Vec<Tensor>), OipError> {
    let (json, binary) = split_body(body, header_len)?;
    let mut response: InferResponse = match serde_json::from_slice(json) {
        Ok(response) => response,
        Err(err) => {
            return Err(match serde_json::from_slice::<ErrorBody>(json) {
                Ok(ErrorBody { error }) => OipError::Server { message: error },
                Err(_) => OipError::Json(err),
            })
        }
    };
    let mut cursor = Cursor::new(binary, limits);
    let mut seen = HashSet::with_capacity(response.outputs.len());
    let mut tensors = Vec::with_capacity(response.outputs.len());
    for output in &mut response.outputs {
        let wire = WireTensor {
            kind: TensorKind::Output,
            name: &output.name,
            shape: &output.shape,
            datatype: &output.datatype,
            parameters: output.parameters.as_ref(),
            data: output.data.take(),
        };
        tensors.push(wire.decode(&mut cursor, &mut seen)?.into_tensor(binary));
    }
    cursor.finish()?;
    Ok((response, tensors))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::oip::test_support::{outputs_of, req_err, samples};
    use crate::oip::{
        encode_request, encode_response, parse_header_length, wants_binary_output, DataType,
        RequestOutputSpec, TensorData,
    };

    #[test]
    fn mixed_binary_and_json_inputs_hand_written() {
        let mut body = br#"{"inputs":[
            {"name":"a","shape":[2],"datatype":"INT32","parameters":{"binary_data_size":8}},
            {"name":"j","shape":[2,2],"datatype":"FP64","data":[[1,2.5],[-3,4e10]]},
            {"name":"c","shape":[3],"datatype":"UINT8","parameters":{"binary_data_size":3}}
        ]}"#
        .to_vec();
        let header_len = body.len();
        body.extend_from_slice(&7i32.to_le_bytes());
        body.extend_from_slice(&(-9i32).to_le_bytes());
        body.extend_from_slice(&[1, 2, 3]);
        let (_, t) = decode_request(&body, Some(header_len)).unwrap();
        assert_eq!(t[0], Tensor::new("a", vec![2], vec![7i32, -9]));
        assert_eq!(
            t[1],
            Tensor::new("j", vec![2, 2], vec![1.0f64, 2.5, -3.0, 4e10])
        );
        assert_eq!(t[2], Tensor::new("c", vec![3], vec![1u8, 2, 3]));
    }

    #[test]
    fn tritonclient_binary_request_decodes() {
        let mut body = br#"{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","parameters":{"binary_data_size":64}}],"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":true}}]}"#.to_vec();
        let header_len = body.len();
        let values: Vec<f32> = (0..16).map(|i| i as f32 * 0.5 - 2.0).collect();
        for v in &values {
            body.extend_from_slice(&v.to_le_bytes());
        }
        let (req, tensors) = decode_request(&body, Some(header_len)).unwrap();
        assert_eq!(tensors, vec![Tensor::new("INPUT0", vec![1, 16], values)]);
        assert!(wants_binary_output(&req, "OUTPUT0"));
        assert!(!wants_binary_output(&req, "OUTPUT1"));
    }

    #[test]
    fn tritonclient_json_request_decodes() {
        let body = br#"{"id":"7","inputs":[{"name":"INPUT0","shape":[2,3],"datatype":"INT64","data":[1,2,3,4,5,-6]},{"name":"FLAGS","shape":[2],"datatype":"BOOL","data":[true,false]}],"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":false}}],"parameters":{"binary_data_output":true}}"#;
        let (req, t) = decode_request(body, None).unwrap();
        assert_eq!(req.id.as_deref(), Some("7"));
        assert_eq!(
            t[0],
            Tensor::new("INPUT0", vec![2, 3], vec![1i64, 2, 3, 4, 5, -6])
        );
        assert_eq!(t[1], Tensor::new("FLAGS", vec![2], vec![true, false]));
        assert!(
            !wants_binary_output(&req, "OUTPUT0"),
            "per-output flag wins"
        );
        assert!(
            wants_binary_output(&req, "OUTPUT1"),
            "request-level flag applies"
        );
    }

    #[test]
    fn triton_binary_response_decodes() {
        let mut body = br#"{"model_name":"simple","model_version":"1","outputs":[{"name":"OUTPUT0","datatype":"INT32","shape":[1,16],"parameters":{"binary_data_size":64}},{"name":"OUTPUT1","datatype":"INT32","shape":[1,16],"data":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}]}"#.to_vec();
        let header_len = body.len();
        for i in 0..16i32 {
            body.extend_from_slice(&(i * 2).to_le_bytes());
        }
        let (resp, t) = decode_response(&body, Some(header_len)).unwrap();
        assert_eq!(resp.model_version.as_deref(), Some("1"));
        assert_eq!(
            t[0],
            Tensor::new(
                "OUTPUT0",
                vec![1, 16],
                (0..16).map(|i| i * 2).collect::<Vec<i32>>()
            )
        );
        assert_eq!(
            t[1],
            Tensor::new("OUTPUT1", vec![1, 16], (0..16).collect::<Vec<i32>>())
        );
    }

    #[test]
    fn in_place_decode_points_into_the_body_and_agrees_with_decode() {
        let mut body = br#"{"inputs":[
            {"name":"a","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":8}},
            {"name":"j","shape":[2],"datatype":"FP32","data":[1,2.5]},
            {"name":"c","shape":[3],"datatype":"UINT8","parameters":{"binary_data_size":3}}
        ]} "#
        .to_vec();
        let header_len = body.len();
        body.extend_from_slice(&1.5f32.to_le_bytes());
        body.extend_from_slice(&(-2f32).to_le_bytes());
        body.extend_from_slice(&[1, 2, 3]);
        let (_, raw) = decode_request_in_place(&body, Some(header_len), &DecodeLimits::default()).unwrap();
        assert_eq!(raw[0].datatype, DataType::Fp32);
        assert_eq!(raw[0].data, RawData::Binary(header_len..header_len + 8));
        assert_eq!(raw[1].data, RawData::Json(TensorData::Fp32(vec![1.0, 2.5])));
        assert_eq!(raw[2].data, RawData::Binary(header_len + 8..header_len + 11));
        let decoded: Vec<Tensor> = raw.into_iter().map(|t| t.into_tensor(&body)).collect();
        assert_eq!(decoded, decode_request(&body, Some(header_len)).unwrap().1);
        assert_eq!(decoded[0], Tensor::new("a", vec![2], vec![1.5f32, -2.0]));
    }

    // --- error cases ---

    #[test]
    fn error_bad_json() {
        for body in [
            &b"{"[..],
            b"",
            b"not json",
            b"{\"inputs\": 3}",
            b"\xff\xfe",
            b"{\"inputs\":[]} x",
        ] {
            assert!(matches!(req_err(body, None), OipError::Json(_)));
        }
        assert!(matches!(
            decode_response(b"[]", None),
            Err(OipError::Json(_))
        ));
        // Shapes must be integers.
        let err = req_err(
            br#"{"inputs":[{"name":"x","shape":[1.5],"datatype":"FP32","data":[1]}]}"#,
            None,
        );
        assert!(matches!(err, OipError::Json(_)));
    }

    #[test]
    fn error_server_error_body() {
        let err = decode_response(br#"{"error":"model 'x' is not ready"}"#, None).unwrap_err();
        assert!(
            matches!(&err, OipError::Server { message } if message == "model 'x' is not ready")
        );
    }

    // --- robustness ---

    use crate::test_rng::Rng;

    fn try_everything(body: &[u8], header_len: Option<usize>) {
        let limits = DecodeLimits {
            max_decoded_bytes: 1 << 20,
        };
        let _ = decode_request_with_limits(body, header_len, &limits);
        let _ = decode_response_with_limits(body, header_len, &limits);
        let _ = parse_header_length(body);
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for _ in 0..20_000 {
            let len = rng.index(200);
            let body: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            let header_len = match rng.index(3) {
                0 => None,
                1 => Some(rng.index(len + 1)),
                _ => Some(rng.next() as usize),
            };
            try_everything(&body, header_len);
        }
    }

    #[test]
    fn mutated_valid_bodies_never_panic() {
        let mut rng = Rng(42);
        let samples = samples();
        let (req_bin, req_bin_hl) =
            encode_request(Some("i"), &samples, true, &outputs_of(&["o"], true));
        let (req_json, _) = encode_request(None, &samples, false, &[]);
        let (resp_bin, resp_bin_hl) =
            encode_response("m", Some("1"), None, &samples, |n| n.len() < 3);
        let bases = [
            (req_bin, req_bin_hl),
            (req_json, None),
            (resp_bin, resp_bin_hl),
        ];
        // Tokens that make for interesting JSON when spliced in.
        let tokens: [&[u8]; 14] = [
            b"-1",
            b"0",
            b"18446744073709551615",
            b"9223372036854775807",
            b"[",
            b"]",
            b"null",
            b"\"FP16\"",
            b"\"BYTES\"",
            b"1e400",
            b"{}",
            b",",
            b"\"binary_data_size\":",
            b"[[[]]]",
        ];
        for _ in 0..20_000 {
            let (base, base_hl) = &bases[rng.index(bases.len())];
            let mut body = base.clone();
            for _ in 0..=rng.index(4) {
                if body.is_empty() {
                    break;
                }
                let at = rng.index(body.len());
                match rng.index(4) {
                    0 => body[at] = rng.next() as u8,
                    1 => {
                        body.remove(at);
                    }
                    2 => {
                        let token = tokens[rng.index(tokens.len())];
                        body.splice(at..at, token.iter().copied());
                    }
                    _ => body.truncate(at),
                }
            }
            let header_len = match rng.index(4) {
                0 => None,
                1 => Some(rng.index(body.len() + 1)),
                _ => base_hl.map(|hl| hl.min(body.len())),
            };
            try_everything(&body, header_len);
        }
    }

    #[test]
    fn random_structured_bodies_never_panic_and_uphold_invariants() {
        let mut rng = Rng(7);
        let datatypes = [
            "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
            "FP16", "FP32", "FP64", "BYTES", "fp32", "",
        ];
        let dims: [i64; 7] = [-1, 0, 1, 2, 3, i64::MAX, 1 << 40];
        let scalars = [
            "0", "1", "-1", "255", "1.5", "true", "null", "\"s\"", "1e300", "[1]",
        ];
        let mut outcomes = [0usize; 2];
        for _ in 0..20_000 {
            let mut json = String::from(r#"{"inputs":["#);
            let mut binary_len = 0usize;
            for i in 0..rng.index(4) {
                let dt = datatypes[rng.index(datatypes.len())];
                let rank = rng.index(3);
                let shape: Vec<i64> = (0..rank)
                    .map(|_| {
                        if rng.index(4) == 0 {
                            dims[rng.index(dims.len())]
                        } else {
                            rng.index(4) as i64
                        }
                    })
                    .collect();
                let count = shape
                    .iter()
                    .map(|&d| d.clamp(0, 5) as usize)
                    .product::<usize>();
                let size = dt
                    .parse::<DataType>()
                    .ok()
                    .and_then(|d| d.element_size())
                    .unwrap_or(4)
                    * count;
                let shape_text = format!("{shape:?}").replace(' ', "");
                if i > 0 {
                    json.push(',');
                }
                json.push_str(&format!(
                    r#"{{"name":"t{}","shape":{shape_text},"datatype":"{dt}""#,
                    rng.index(3)
                ));
                match rng.index(3) {
                    0 => {
                        let claimed = match rng.index(4) {
                            0 => format!("{}", size + 1),
                            1 => "-8".into(),
                            _ => format!("{size}"),
                        };
                        binary_len += size;
                        json.push_str(&format!(
                            r#","parameters":{{"binary_data_size":{claimed}}}"#
                        ));
                    }
                    1 => {
                        let n = if rng.index(4) == 0 {
                            rng.index(8)
                        } else {
                            count
                        };
                        let values: Vec<&str> = (0..n)
                            .map(|_| {
                                if rng.index(3) == 0 {
                                    scalars[rng.index(scalars.len())]
                                } else {
                                    "1"
                                }
                            })
                            .collect();
                        json.push_str(&format!(r#","data":[{}]"#, values.join(",")));
                    }
                    _ => {}
                }
                json.push('}');
            }
            json.push_str("]}");
            let binary_len = match rng.index(4) {
                0 => rng.index(binary_len + 2),
                _ => binary_len,
            };
            let mut body = json.clone().into_bytes();
            body.extend((0..binary_len).map(|_| rng.next() as u8));
            let header_len = if rng.index(8) == 0 {
                None
            } else {
                Some(json.len())
            };
            match decode_request(&body, header_len) {
                Ok((_, tensors)) => {
                    outcomes[0] += 1;
                    for t in tensors {
                        assert_eq!(t.element_count(), t.data.len(), "{json}");
                    }
                }
                Err(_) => outcomes[1] += 1,
            }
        }
        // The generator reaches both outcomes in earnest.
        assert!(outcomes[0] > 1_000 && outcomes[1] > 1_000, "{outcomes:?}");
    }

    #[test]
    fn deeply_nested_data_is_an_error_not_a_crash() {
        let depth = 100_000;
        let mut body = br#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":"#.to_vec();
        body.extend(std::iter::repeat_n(b'[', depth));
        body.push(b'1');
        body.extend(std::iter::repeat_n(b']', depth));
        body.extend_from_slice(b"}]}");
        assert!(matches!(
            decode_request(&body, None),
            Err(OipError::Json(_))
        ));
    }

    /// Fuzzing the decoder the worker runs on every untrusted body: arbitrary bytes, and a
    /// valid binary request with bytes changed, cut or with a lying header length, never panic
    /// and never yield a tensor whose data disagrees with its shape.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn valid_body() -> (Vec<u8>, Option<usize>) {
            let outputs = [RequestOutputSpec { name: "probs".into(), binary: true }];
            encode_request(Some("id-1"), &samples(), true, &outputs)
        }

        fn check(body: &[u8], header_len: Option<usize>) -> Result<(), TestCaseError> {
            if let Ok((_, tensors)) = decode_request(body, header_len) {
                for t in tensors {
                    let elements: usize = t.shape.iter().product();
                    prop_assert_eq!(elements, t.data.len(), "tensor {} disagrees with its shape", t.name);
                }
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            #[test]
            fn arbitrary_bodies_never_panic(
                body in proptest::collection::vec(any::<u8>(), 0..512),
                header_len in proptest::option::of(0usize..600),
            ) {
                check(&body, header_len)?;
            }

            #[test]
            fn mutated_valid_requests_never_panic(
                edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
                cut in any::<prop::sample::Index>(),
                shift in -8i64..8,
            ) {
                let (mut body, header_len) = valid_body();
                for (at, value) in edits {
                    let at = at.index(body.len());
                    body[at] = value;
                }
                body.truncate(cut.index(body.len() + 1));
                let header_len = header_len.map(|h| (h as i64 + shift).max(0) as usize);
                check(&body, header_len)?;
            }
        }
    }
}
