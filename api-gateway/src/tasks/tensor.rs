//! The `tensor` converter: the model's input tensor is in the event itself, for models whose
//! input no converter here makes (features computed upstream, token ids, embeddings).
//!
//! The input bytes (inline `data_b64` or a `file://` file, like any input) are one JSON object:
//! - OIP's JSON form: `{"datatype": "FP32", "shape": [1, 4], "data": [0.5, 1, 2, 3]}`
//!   (`data` flat or nested, row-major);
//! - or raw little-endian bytes: `{"datatype": "FP32", "shape": [1, 4], "data_b64": "…"}`,
//!   exactly `elements × element size` bytes.
//!
//! Either is decoded by the worker protocol's own decoder (`vramgate_shared::oip`), so the
//! checks are the worker's: datatype spelling, shape against the values, no negative or
//! overflowing dimension. On top: `max_elements`, and the task's `datatype` when it names one.
//! The tensor goes to the model input `input` as it is; the outputs go through the task's
//! `[[outputs]]` rows.
//!
//! A model of several inputs: the task names them, `inputs = ["chunk", "state"]`, and the event
//! holds each under its name, in OIP's own form: `{"inputs": [{"name": "chunk", "datatype",
//! "shape", "data" | "data_b64"}, …]}`; each is checked as above, all must be there and no other.

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use vramgate_shared::events::{ErrorKind, Stage};
use vramgate_shared::oip::{self, DataType, DecodeLimits, Tensor};

use super::fit::{Sent, SentTensor};
use super::outputs::{InputConverter, ModelInput};
use crate::failure::Failure;

/// Largest `max_elements`.
pub const MAX_TENSOR_ELEMENTS: usize = 1 << 28;
/// Most `inputs` a task may name.
pub const MAX_TENSOR_INPUTS: usize = 8;

/// Options of the `tensor` converter (`[tasks.<name>.tensor]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TensorOptions {
    /// The model input's name.
    pub input: String,
    /// A model of several inputs: their names, in the model's order, instead of `input`
    /// (1 to [`MAX_TENSOR_INPUTS`], each once).
    pub inputs: Option<Vec<String>>,
    /// When set, the only datatype taken (another is a dead letter naming both).
    pub datatype: Option<DataType>,
    /// Most elements of one input tensor.
    pub max_elements: usize,
}

impl Default for TensorOptions {
    fn default() -> Self {
        TensorOptions { input: "input".into(), inputs: None, datatype: None, max_elements: 1 << 20 }
    }
}

impl TensorOptions {
    pub fn validate(&self) -> Result<(), String> {
        if self.input.is_empty() || self.input.len() > 128 {
            return Err("tensor.input must be 1 to 128 bytes".into());
        }
        if let Some(inputs) = &self.inputs {
            if !(1..=MAX_TENSOR_INPUTS).contains(&inputs.len()) {
                return Err(format!("tensor.inputs must name 1 to {MAX_TENSOR_INPUTS} inputs, got {}", inputs.len()));
            }
            if let Some((k, _)) = inputs.iter().enumerate().find(|(_, n)| n.is_empty() || n.len() > 128) {
                return Err(format!("tensor.inputs[{k}] must be 1 to 128 bytes"));
            }
            if let Some(k) = (1..inputs.len()).find(|&k| inputs[..k].contains(&inputs[k])) {
                return Err(format!("tensor.inputs[{k}] '{}' is named twice", inputs[k]));
            }
        }
        if !(1..=MAX_TENSOR_ELEMENTS).contains(&self.max_elements) {
            return Err(format!("tensor.max_elements must be 1 to {MAX_TENSOR_ELEMENTS}, got {}", self.max_elements));
        }
        if self.datatype == Some(DataType::Bytes) {
            return Err("tensor.datatype BYTES is not a tensor a model takes here".into());
        }
        Ok(())
    }
}

/// The event's tensor, either form (`name` only in an event of several).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventTensor {
    #[serde(default)]
    name: Option<String>,
    datatype: String,
    shape: Vec<i64>,
    #[serde(default)]
    data: Option<Value>,
    #[serde(default)]
    data_b64: Option<String>,
}

/// The input side of the `tensor` converter (a [`super::outputs::ConfiguredTask`]).
pub struct TensorInput {
    pub options: TensorOptions,
}

fn invalid(message: String) -> Failure {
    Failure::new(ErrorKind::InvalidRequest, Stage::Convert, message)
}

impl TensorInput {
    /// The most bytes a decoded tensor may hold (the widest element is 8 bytes).
    fn max_decoded_bytes(&self) -> usize {
        self.options.max_elements.saturating_mul(8)
    }

    /// The event's tensors, in the order of `inputs` (or the one tensor for `input`).
    fn decode(&self, bytes: &[u8]) -> Result<Vec<Tensor>, Failure> {
        let Some(names) = &self.options.inputs else {
            let event: EventTensor = serde_json::from_slice(bytes).map_err(|e| {
                invalid(format!(
                    "input is not a tensor: {e} (expected {{\"datatype\", \"shape\", \"data\"}} or {{…, \"data_b64\"}})"
                ))
            })?;
            if event.name.is_some() {
                return Err(invalid("a tensor of a task of one input has no name (the task's tensor.input names it)".into()));
            }
            return Ok(vec![self.decode_one(event, &self.options.input)?]);
        };
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct EventInputs {
            inputs: Vec<EventTensor>,
        }
        let event: EventInputs = serde_json::from_slice(bytes).map_err(|e| {
            invalid(format!(
                "input is not a set of tensors: {e} (expected {{\"inputs\": [{{\"name\", \"datatype\", \"shape\", \"data\" or \"data_b64\"}}, …]}})"
            ))
        })?;
        let mut sent: Vec<Option<EventTensor>> = event.inputs.into_iter().map(Some).collect();
        if let Some(extra) = sent.iter().flatten().find(|t| !t.name.as_ref().is_some_and(|n| names.contains(n))) {
            return Err(invalid(format!(
                "the event's tensor {:?} is none of this task's inputs ({})",
                extra.name.as_deref().map(cut).unwrap_or_else(|| "without a name".into()),
                names.join(", ")
            )));
        }
        let mut tensors = Vec::with_capacity(names.len());
        for name in names {
            let mut found = sent.iter_mut().filter(|t| t.as_ref().is_some_and(|t| t.name.as_ref() == Some(name)));
            let tensor = found.next().and_then(Option::take).ok_or_else(|| invalid(format!("the event has no tensor '{name}'")))?;
            if found.next().is_some() {
                return Err(invalid(format!("the event has tensor '{name}' twice")));
            }
            tensors.push(self.decode_one(tensor, name)?);
        }
        Ok(tensors)
    }

    /// One tensor of the event, for the model input `name`.
    fn decode_one(&self, event: EventTensor, name: &str) -> Result<Tensor, Failure> {
        let elements = event.shape.iter().try_fold(1u64, |acc, &d| u64::try_from(d).ok().and_then(|d| acc.checked_mul(d)));
        match elements {
            Some(n) if n <= self.options.max_elements as u64 => {}
            Some(n) => {
                return Err(Failure::new(
                    ErrorKind::InputTooLarge,
                    Stage::Convert,
                    format!(
                        "tensor '{name}' of shape {:?} holds {n} elements, more than tensor.max_elements {}",
                        event.shape, self.options.max_elements
                    ),
                ))
            }
            None => return Err(invalid(format!("tensor '{name}' of shape {:?} has a negative or overflowing dimension", event.shape))),
        }
        if let Some(want) = self.options.datatype {
            if event.datatype != want.as_str() {
                return Err(invalid(format!("tensor '{name}' datatype is {:?}; this task takes {}", cut(&event.datatype), want.as_str())));
            }
        }
        let limits = DecodeLimits { max_decoded_bytes: self.max_decoded_bytes() };
        let input = oip::RequestInput {
            name: name.to_string(),
            shape: event.shape,
            datatype: event.datatype,
            parameters: None,
            data: None,
        };
        let (body, header_len) = match (event.data, event.data_b64) {
            (Some(data), None) => {
                let request = oip::InferRequest { inputs: vec![oip::RequestInput { data: Some(data), ..input }], ..Default::default() };
                (serde_json::to_vec(&request).expect("a request serialises"), None)
            }
            (None, Some(b64)) => {
                let raw = base64::engine::general_purpose::STANDARD
                    .decode(b64.as_bytes())
                    .map_err(|e| invalid(format!("tensor '{name}' data_b64 is not base64: {e}")))?;
                let mut parameters = oip::Parameters::default();
                parameters.insert("binary_data_size".into(), json!(raw.len()));
                let request = oip::InferRequest {
                    inputs: vec![oip::RequestInput { parameters: Some(parameters), ..input }],
                    ..Default::default()
                };
                let mut body = serde_json::to_vec(&request).expect("a request serialises");
                let header = body.len();
                body.extend_from_slice(&raw);
                (body, Some(header))
            }
            _ => return Err(invalid(format!("tensor '{name}' needs exactly one of data and data_b64"))),
        };
        let (_, mut tensors) = oip::decode_request_with_limits(&body, header_len, &limits)
            .map_err(|e| invalid(format!("tensor: {}", cut(&e.to_string()))))?;
        Ok(tensors.remove(0))
    }
}

/// Error text from the input is cut to keep a dead letter's message bounded.
fn cut(s: &str) -> String {
    s.chars().take(200).collect()
}

impl InputConverter for TensorInput {
    fn sends(&self) -> Sent {
        let datatype = self.options.datatype;
        match &self.options.inputs {
            Some(names) => Sent::Named {
                key: format!("tensor.inputs = {names:?}"),
                tensors: names.iter().map(|name| SentTensor::new("tensor.inputs", name, datatype, None)).collect(),
            },
            None => Sent::One(SentTensor::new("tensor.input", &self.options.input, datatype, None)),
        }
    }

    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure> {
        // The parsed JSON, the request body rebuilt from it, and the tensor. A value takes at
        // least two bytes of JSON ("0,"), 32 parsed (a `serde_json::Value`, and at most
        // `max_elements` of them pass; an array's own Value counted with its first element)
        // and at most eight decoded; base64 is larger than its bytes.
        let len = bytes.len() as u64;
        let elements = self.options.max_elements as u64;
        let parsed = len.saturating_mul(16).min(elements.saturating_mul(64)).max(len);
        let count = self.options.inputs.as_ref().map_or(1, Vec::len) as u64;
        let tensor = len.saturating_mul(4).min((self.max_decoded_bytes() as u64).saturating_mul(count));
        Ok(parsed.saturating_add(len).saturating_add(tensor))
    }

    fn convert(&self, bytes: &[u8]) -> Result<ModelInput, Failure> {
        let tensors = self.decode(bytes)?;
        let input = match &tensors[..] {
            [tensor] if self.options.inputs.is_none() => json!({ "datatype": tensor.datatype().as_str(), "shape": tensor.shape }),
            _ => json!({ "inputs": tensors
                .iter()
                .map(|t| json!({ "name": t.name, "datatype": t.datatype().as_str(), "shape": t.shape }))
                .collect::<Vec<_>>() }),
        };
        Ok(ModelInput { tensors, input, placement: None })
    }
}

#[cfg(test)]
mod tests {
    use vramgate_shared::oip::TensorData;

    use super::*;
    use crate::tasks::outputs::{ConfiguredTask, OutputRule, Outputs};
    use crate::tasks::{Converter, Plan};
    use std::sync::Arc;

    fn plan(options: TensorOptions) -> Arc<dyn Plan> {
        let rule: OutputRule = serde_json::from_str(r#"{"name": "y"}"#).expect("rule");
        let outputs = Outputs::load(&[rule], 100).expect("outputs");
        ConfiguredTask::new(TensorInput { options }, outputs).plan(None).expect("plan")
    }

    fn tensor_of(plan: &Arc<dyn Plan>, input: Value) -> Result<Tensor, Failure> {
        let bytes = serde_json::to_vec(&input).expect("json");
        plan.convert(&bytes).map(|mut c| c.calls.remove(0).inputs.remove(0))
    }

    #[test]
    fn both_forms_decode_to_the_same_tensor() {
        let p = plan(TensorOptions { input: "x".into(), ..TensorOptions::default() });
        let json_form = tensor_of(&p, json!({"datatype": "FP32", "shape": [2, 2], "data": [[1.0, 2.0], [3.0, -4.5]]})).expect("json");
        let raw: Vec<u8> = [1.0f32, 2.0, 3.0, -4.5].iter().flat_map(|v| v.to_le_bytes()).collect();
        let b64 = base64::engine::general_purpose::STANDARD.encode(raw);
        let raw_form = tensor_of(&p, json!({"datatype": "FP32", "shape": [2, 2], "data_b64": b64})).expect("raw");
        assert_eq!(json_form, raw_form);
        assert_eq!((json_form.name.as_str(), json_form.data), ("x", TensorData::Fp32(vec![1.0, 2.0, 3.0, -4.5])));
        let ints = tensor_of(&p, json!({"datatype": "INT64", "shape": [3], "data": [1, 2, 3]})).expect("ints");
        assert_eq!(ints.data, TensorData::Int64(vec![1, 2, 3]));
    }

    #[test]
    fn a_task_of_several_inputs_takes_each_by_name_in_the_models_order() {
        let p = plan(TensorOptions { inputs: Some(vec!["chunk".into(), "state".into()]), max_elements: 8, ..TensorOptions::default() });
        let raw: Vec<u8> = [0.5f32, -1.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let event = json!({"inputs": [
            {"name": "state", "datatype": "FP32", "shape": [1, 2], "data_b64": base64::engine::general_purpose::STANDARD.encode(raw)},
            {"name": "chunk", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]},
        ]});
        let converted = p.convert(&serde_json::to_vec(&event).expect("json")).expect("both inputs");
        let inputs = &converted.calls[0].inputs;
        let got: Vec<(&str, Vec<usize>)> = inputs.iter().map(|t| (t.name.as_str(), t.shape.clone())).collect();
        assert_eq!(got, [("chunk", vec![1, 3]), ("state", vec![1, 2])], "in the task's order");
        assert_eq!((&inputs[0].data, &inputs[1].data), (&TensorData::Int64(vec![1, 2, 3]), &TensorData::Fp32(vec![0.5, -1.0])));
        let check = |event: Value, want: &str| {
            let err = p.convert(&serde_json::to_vec(&event).expect("json")).err().expect(want);
            assert_eq!(err.kind, ErrorKind::InvalidRequest, "{}", err.message);
            assert!(err.message.contains(want), "{} should contain {want}", err.message);
        };
        let chunk = json!({"name": "chunk", "datatype": "FP32", "shape": [1], "data": [1.0]});
        check(json!({"inputs": [chunk]}), "the event has no tensor 'state'");
        check(json!({"inputs": [chunk, chunk]}), "the event has tensor 'chunk' twice");
        check(json!({"inputs": [chunk, {"name": "mask", "datatype": "FP32", "shape": [1], "data": [1.0]}]}),
              "the event's tensor \"mask\" is none of this task's inputs (chunk, state)");
        let big = json!({"inputs": [chunk, {"name": "state", "datatype": "FP32", "shape": [9], "data": vec![0.0; 9]}]});
        let err = p.convert(&serde_json::to_vec(&big).expect("json")).err().expect("too large");
        assert_eq!(err.kind, ErrorKind::InputTooLarge);
        assert!(err.message.contains("tensor 'state' of shape [9] holds 9 elements, more than tensor.max_elements 8"), "{}", err.message);
        check(json!({"datatype": "FP32", "shape": [1], "data": [1.0]}), "input is not a set of tensors");
        let one = plan(TensorOptions::default());
        let err = one.convert(&serde_json::to_vec(&json!({"inputs": [chunk]})).expect("json")).err().expect("the form of several");
        assert!(err.message.contains("input is not a tensor"), "{}", err.message);
        for (inputs, want) in [
            (vec![], "tensor.inputs must name 1 to 8 inputs, got 0"),
            (vec!["a".to_string(), "a".to_string()], "tensor.inputs[1] 'a' is named twice"),
            (vec![String::new()], "tensor.inputs[0] must be 1 to 128 bytes"),
        ] {
            let err = TensorOptions { inputs: Some(inputs), ..TensorOptions::default() }.validate().expect_err(want);
            assert_eq!(err, want);
        }
    }

    #[test]
    fn bad_tensors_are_named_and_never_panic() {
        let p = plan(TensorOptions { datatype: Some(DataType::Fp32), max_elements: 8, ..TensorOptions::default() });
        let check = |input: Value, kind: ErrorKind, want: &str| {
            let err = tensor_of(&p, input).expect_err(want);
            assert_eq!(err.kind, kind, "{}", err.message);
            assert!(err.message.contains(want), "{} should contain {want}", err.message);
        };
        check(json!({"datatype": "FP32", "shape": [3, 3], "data": vec![0; 9]}), ErrorKind::InputTooLarge, "more than tensor.max_elements 8");
        check(json!({"datatype": "INT64", "shape": [1], "data": [1]}), ErrorKind::InvalidRequest, "this task takes FP32");
        check(json!({"datatype": "FP32", "shape": [2], "data": [1.0]}), ErrorKind::InvalidRequest, "tensor:");
        check(json!({"datatype": "FP32", "shape": [-1], "data": []}), ErrorKind::InvalidRequest, "negative or overflowing");
        check(json!({"datatype": "FP32", "shape": [1]}), ErrorKind::InvalidRequest, "exactly one of data and data_b64");
        check(json!({"datatype": "FP32", "shape": [2], "data_b64": "AAAA"}), ErrorKind::InvalidRequest, "tensor:");
        check(json!({"datatype": "FP32", "shape": [1], "data_b64": "%%"}), ErrorKind::InvalidRequest, "not base64");
        check(json!({"dtype": "FP32"}), ErrorKind::InvalidRequest, "input is not a tensor");
        check(json!({"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}), ErrorKind::InvalidRequest, "has no name");
        for garbage in [&b"\xff\xfe"[..], b"[1,2]", b"", &[b'['; 10_000][..]] {
            assert!(p.convert(garbage).is_err());
        }
    }
}
