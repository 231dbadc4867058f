//! The encoders: tensors into a request body ([`encode_request`], with the outputs the
//! client asks for as [`RequestOutputSpec`]s), a response body ([`encode_response`]) or an
//! error body ([`encode_error`]), and the borrowed views they serialize.

use serde::Serialize;

use super::binary::frame;
use super::wire::to_json_vec;
use super::{ErrorBody, Tensor, TensorData};

/// An output a client asks for, as binary data or as JSON `data`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOutputSpec {
    pub name: String,
    pub binary: bool,
}

impl RequestOutputSpec {
    pub fn binary(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            binary: true,
        }
    }

    pub fn json(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            binary: false,
        }
    }
}

/// Encodes a request. With `binary_inputs` every input goes in the binary section, otherwise
/// in JSON `data`; `outputs` empty leaves `outputs` out (the server then returns all outputs,
/// as JSON). Returns the body and the value for the [`INFERENCE_HEADER_CONTENT_LENGTH`] header
/// (`None`: send no such header).
///
/// [`INFERENCE_HEADER_CONTENT_LENGTH`]: super::INFERENCE_HEADER_CONTENT_LENGTH
pub fn encode_request(
    id: Option<&str>,
    inputs: &[Tensor],
    binary_inputs: bool,
    outputs: &[RequestOutputSpec],
) -> (Vec<u8>, Option<usize>) {
    encode_request_with(id, inputs, binary_inputs, outputs, false)
}

/// [`encode_request`] for a client that does not name the model's outputs but wants every one
/// of them in binary: the request-level `"parameters": {"binary_data_output": true}`. Without
/// it a server answers in JSON, which for a large output costs both sides far more than the
/// model (a 1.3 MB output: 9 ms to print in the worker, 23 ms to parse in a client, on a CPU).
pub fn encode_request_binary_outputs(id: Option<&str>, inputs: &[Tensor], binary_inputs: bool) -> (Vec<u8>, Option<usize>) {
    encode_request_with(id, inputs, binary_inputs, &[], true)
}

fn encode_request_with(
    id: Option<&str>,
    inputs: &[Tensor],
    binary_inputs: bool,
    outputs: &[RequestOutputSpec],
    all_outputs_binary: bool,
) -> (Vec<u8>, Option<usize>) {
    let binary = vec![binary_inputs; inputs.len()];
    let header = RequestOut {
        id,
        inputs: tensors_out(inputs, &binary),
        outputs: outputs
            .iter()
            .map(|o| OutputSpecOut {
                name: &o.name,
                parameters: BinaryFlag {
                    binary_data: o.binary,
                },
            })
            .collect(),
        parameters: all_outputs_binary.then_some(RequestParameters { binary_data_output: true }),
    };
    frame(&header, inputs, &binary)
}

/// Encodes a response; `binary(name)` says whether output `name` goes in the binary section
/// (typically `|name| wants_binary_output(&request, name)`). Returns the body and the value for
/// the [`INFERENCE_HEADER_CONTENT_LENGTH`] header (`None`: send no such header).
///
/// [`INFERENCE_HEADER_CONTENT_LENGTH`]: super::INFERENCE_HEADER_CONTENT_LENGTH
pub fn encode_response(
    model_name: &str,
    model_version: Option<&str>,
    id: Option<&str>,
    outputs: &[Tensor],
    binary: impl Fn(&str) -> bool,
) -> (Vec<u8>, Option<usize>) {
    let binary: Vec<bool> = outputs.iter().map(|t| binary(&t.name)).collect();
    let header = ResponseOut {
        model_name,
        model_version,
        id,
        outputs: tensors_out(outputs, &binary),
    };
    frame(&header, outputs, &binary)
}

/// [`encode_response`] as the parts of its body, in order, taking the outputs: the JSON header
/// (with any output not asked for as binary), then each binary output's bytes, its values' own
/// memory where the host's byte order allows ([`TensorData::into_le_bytes`]). A server writes
/// the parts one after the other (vectored) instead of copying every output into one buffer.
pub fn encode_response_parts(
    model_name: &str,
    model_version: Option<&str>,
    id: Option<&str>,
    outputs: Vec<Tensor>,
    binary: impl Fn(&str) -> bool,
) -> (Vec<bytes::Bytes>, Option<usize>) {
    let binary: Vec<bool> = outputs.iter().map(|t| binary(&t.name)).collect();
    let header = ResponseOut { model_name, model_version, id, outputs: tensors_out(&outputs, &binary) };
    let header = to_json_vec(&header);
    if !binary.contains(&true) {
        return (vec![bytes::Bytes::from(header)], None);
    }
    let header_len = header.len();
    let mut parts = Vec::with_capacity(1 + outputs.len());
    parts.push(bytes::Bytes::from(header));
    parts.extend(outputs.into_iter().zip(&binary).filter(|(_, &b)| b).map(|(t, _)| t.data.into_le_bytes()));
    (parts, Some(header_len))
}

/// The body of an error response: `{"error": "..."}`.
pub fn encode_error(message: &str) -> Vec<u8> {
    to_json_vec(&ErrorBody::new(message))
}

#[derive(Serialize)]
struct RequestOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    inputs: Vec<TensorOut<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    outputs: Vec<OutputSpecOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<RequestParameters>,
}

#[derive(Serialize)]
struct RequestParameters {
    binary_data_output: bool,
}

#[derive(Serialize)]
struct OutputSpecOut<'a> {
    name: &'a str,
    parameters: BinaryFlag,
}

#[derive(Serialize)]
struct BinaryFlag {
    binary_data: bool,
}

#[derive(Serialize)]
struct ResponseOut<'a> {
    model_name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    model_version: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    outputs: Vec<TensorOut<'a>>,
}

#[derive(Serialize)]
struct TensorOut<'a> {
    name: &'a str,
    datatype: &'static str,
    shape: &'a [usize],
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<BinarySize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<&'a TensorData>,
}

#[derive(Serialize)]
struct BinarySize {
    binary_data_size: usize,
}

fn tensors_out<'a>(tensors: &'a [Tensor], binary: &[bool]) -> Vec<TensorOut<'a>> {
    tensors
        .iter()
        .zip(binary)
        .map(|(t, &bin)| TensorOut {
            name: &t.name,
            datatype: t.datatype().as_str(),
            shape: &t.shape,
            parameters: bin.then(|| BinarySize {
                binary_data_size: t.data.byte_len(),
            }),
            data: (!bin).then_some(&t.data),
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::oip::test_support::{outputs_of, samples};
    use crate::oip::{decode_request, decode_response, wants_binary_output, BINARY_DATA_SIZE};
    use serde_json::Value;

    #[test]
    fn request_round_trip_binary_every_type() {
        let inputs = samples();
        let (body, header_len) = encode_request(Some("r1"), &inputs, true, &[]);
        let header_len = header_len.unwrap();
        let expected_binary: usize = inputs.iter().map(|t| t.data.byte_len()).sum();
        assert_eq!(body.len(), header_len + expected_binary);
        let (req, decoded) = decode_request(&body, Some(header_len)).unwrap();
        assert_eq!(decoded, inputs);
        assert_eq!(req.id.as_deref(), Some("r1"));
        assert!(req.outputs.is_none());
        assert!(req.inputs.iter().all(|i| i.data.is_none()));
        for (wire, t) in req.inputs.iter().zip(&inputs) {
            assert_eq!(wire.datatype, t.datatype().as_str());
            let size = wire.parameters.as_ref().unwrap()[BINARY_DATA_SIZE]
                .as_u64()
                .unwrap();
            assert_eq!(size as usize, t.data.byte_len());
        }
    }

    #[test]
    fn request_round_trip_json_every_type() {
        let inputs = samples();
        let (body, header_len) = encode_request(None, &inputs, false, &outputs_of(&["o"], false));
        assert_eq!(header_len, None);
        let (req, decoded) = decode_request(&body, None).unwrap();
        assert_eq!(decoded, inputs);
        assert!(req.id.is_none());
        assert!(!wants_binary_output(&req, "o"));
        // The same body is also valid with an explicit header length covering all of it.
        assert_eq!(decode_request(&body, Some(body.len())).unwrap().1, inputs);
    }

    #[test]
    fn a_request_asking_every_output_in_binary_says_so_once_for_all() {
        let inputs = samples();
        let (body, header_len) = encode_request_binary_outputs(Some("r"), &inputs, true);
        let header: Value = serde_json::from_slice(&body[..header_len.unwrap()]).unwrap();
        assert_eq!(header["parameters"], serde_json::json!({"binary_data_output": true}));
        assert!(header.get("outputs").is_none());
        let (req, decoded) = decode_request(&body, header_len).unwrap();
        assert_eq!(decoded, inputs);
        assert!(wants_binary_output(&req, "any output"));
        // A plain request carries no request-level parameters, so its outputs come as JSON.
        let (body, header_len) = encode_request(None, &inputs, true, &[]);
        let (req, _) = decode_request(&body, header_len).unwrap();
        assert!(req.parameters.is_none());
        assert!(!wants_binary_output(&req, "any output"));
    }

    #[test]
    fn a_response_in_parts_is_the_same_bytes_as_in_one_body() {
        let outputs = samples();
        let names: Vec<String> = outputs.iter().map(|t| t.name.clone()).collect();
        // Every output binary, none, and every other one (JSON outputs stay in the header).
        let choices: [&dyn Fn(&str) -> bool; 3] = [&|_| true, &|_| false, &|n| names.iter().position(|m| m == n).is_some_and(|i| i % 2 == 0)];
        for binary in choices {
            let (whole, header_len) = encode_response("m", Some("3"), Some("x"), &outputs, binary);
            let (parts, parts_header_len) = encode_response_parts("m", Some("3"), Some("x"), outputs.clone(), binary);
            assert_eq!(parts_header_len, header_len);
            assert_eq!(parts.concat(), whole);
            let binary_parts = outputs.iter().filter(|t| binary(&t.name)).count();
            assert_eq!(parts.len(), 1 + binary_parts);
        }
    }

    #[test]
    fn response_round_trip_binary_and_json_every_type() {
        let outputs = samples();
        for binary in [false, true] {
            let (body, header_len) =
                encode_response("m", Some("3"), Some("x"), &outputs, |_| binary);
            assert_eq!(header_len.is_some(), binary);
            let (resp, decoded) = decode_response(&body, header_len).unwrap();
            assert_eq!(decoded, outputs);
            assert_eq!(resp.model_name, "m");
            assert_eq!(resp.model_version.as_deref(), Some("3"));
            assert_eq!(resp.id.as_deref(), Some("x"));
        }
    }

    #[test]
    fn mixed_binary_and_json_outputs_keep_order() {
        let outputs = samples();
        let binary_names = ["u16", "f32", "b", "empty"];
        let (body, header_len) =
            encode_response("m", None, None, &outputs, |n| binary_names.contains(&n));
        let header_len = header_len.unwrap();
        let header: Value = serde_json::from_slice(&body[..header_len]).unwrap();
        for o in header["outputs"].as_array().unwrap() {
            let is_binary = binary_names.contains(&o["name"].as_str().unwrap());
            assert_eq!(o.get("data").is_none(), is_binary);
            assert_eq!(o.get("parameters").is_some(), is_binary);
        }
        let (_, decoded) = decode_response(&body, Some(header_len)).unwrap();
        assert_eq!(decoded, outputs);
    }

    #[test]
    fn encoded_request_json_is_exactly_triton_shaped() {
        let inputs = [Tensor::new("audio", vec![1, 2], vec![0.5f32, -1.0])];
        let (body, header_len) = encode_request(
            Some("id1"),
            &inputs,
            true,
            &[RequestOutputSpec::binary("text")],
        );
        let header = std::str::from_utf8(&body[..header_len.unwrap()]).unwrap();
        assert_eq!(
            header,
            r#"{"id":"id1","inputs":[{"name":"audio","datatype":"FP32","shape":[1,2],"parameters":{"binary_data_size":8}}],"outputs":[{"name":"text","parameters":{"binary_data":true}}]}"#
        );
        let (body, header_len) = encode_request(None, &inputs, false, &[]);
        assert_eq!(header_len, None);
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            r#"{"inputs":[{"name":"audio","datatype":"FP32","shape":[1,2],"data":[0.5,-1.0]}]}"#
        );
    }

    #[test]
    fn encoded_response_json_is_exactly_triton_shaped() {
        let outputs = [Tensor::new("n", vec![2], vec![3i64, 4])];
        let (body, header_len) = encode_response("asr", None, None, &outputs, |_| false);
        assert_eq!(header_len, None);
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            r#"{"model_name":"asr","outputs":[{"name":"n","datatype":"INT64","shape":[2],"data":[3,4]}]}"#
        );
        assert_eq!(
            encode_error("model 'x' not found"),
            br#"{"error":"model 'x' not found"}"#
        );
    }
}
