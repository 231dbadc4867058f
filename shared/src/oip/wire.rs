//! The JSON documents of the protocol as they are on the wire: the request and response
//! headers with their tensors, model and server metadata, and the error body; plus the one
//! helper that serializes them.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Free-form `parameters` object.
pub type Parameters = Map<String, Value>;

/// The JSON header of an inference request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InferRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Parameters>,
    pub inputs: Vec<RequestInput>,
    /// Which outputs to return; absent means all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outputs: Option<Vec<RequestOutput>>,
}

/// One input tensor of a request, as it is on the wire.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestInput {
    pub name: String,
    /// Signed on the wire so that negative dimensions can be reported rather than misparsed.
    pub shape: Vec<i64>,
    /// Kept as a string so that an unknown datatype is reported with the tensor's name.
    pub datatype: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Parameters>,
    /// Row-major values; `None` for binary tensors. Moved out into the [`Tensor`] by
    /// [`decode_request`], so it is always `None` in the request that function returns.
    ///
    /// [`Tensor`]: super::Tensor
    /// [`decode_request`]: super::decode_request
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

/// One requested output of a request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestOutput {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Parameters>,
}

/// The JSON header of an inference response.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InferResponse {
    pub model_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Parameters>,
    #[serde(default)]
    pub outputs: Vec<ResponseOutput>,
}

/// One output tensor of a response, as it is on the wire.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResponseOutput {
    pub name: String,
    pub shape: Vec<i64>,
    pub datatype: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Parameters>,
    /// Row-major values; `None` for binary tensors. Moved out into the [`Tensor`] by
    /// [`decode_response`], so it is always `None` in the response that function returns.
    ///
    /// [`Tensor`]: super::Tensor
    /// [`decode_response`]: super::decode_response
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

/// `GET /v2/models/{name}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelMetadata {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub versions: Option<Vec<String>>,
    #[serde(default)]
    pub platform: String,
    #[serde(default)]
    pub inputs: Vec<TensorMetadata>,
    #[serde(default)]
    pub outputs: Vec<TensorMetadata>,
    /// Server-specific facts about the model (vramgate: its measured memory estimate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Parameters>,
}

/// A tensor in [`ModelMetadata`]; `-1` in `shape` is a variable dimension.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TensorMetadata {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
}

/// `GET /v2`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerMetadata {
    pub name: String,
    pub version: String,
    #[serde(default)]
    pub extensions: Vec<String>,
}

/// The body of every error response.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

impl ErrorBody {
    pub fn new(error: impl Into<String>) -> Self {
        Self {
            error: error.into(),
        }
    }

    /// The JSON body.
    pub fn to_json(&self) -> Vec<u8> {
        to_json_vec(self)
    }
}

pub(super) fn to_json_vec<T: Serialize>(value: &T) -> Vec<u8> {
    // Only string-keyed structs, strings, numbers and `Value`s: serializing cannot fail.
    serde_json::to_vec(value).expect("serializing OIP json cannot fail")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn wire_structs_skip_absent_fields() {
        let req = InferRequest {
            inputs: vec![RequestInput {
                name: "x".into(),
                shape: vec![1],
                datatype: "FP32".into(),
                data: Some(json!([1.0])),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_string(&req).unwrap(),
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1.0]}]}"#
        );
        let meta = ModelMetadata {
            name: "asr".into(),
            versions: None,
            platform: "pytorch_libtorch".into(),
            inputs: vec![TensorMetadata {
                name: "audio".into(),
                datatype: "FP32".into(),
                shape: vec![1, -1],
            }],
            outputs: vec![],
            parameters: None,
        };
        let text = serde_json::to_string(&meta).unwrap();
        assert_eq!(
            text,
            r#"{"name":"asr","platform":"pytorch_libtorch","inputs":[{"name":"audio","datatype":"FP32","shape":[1,-1]}],"outputs":[]}"#
        );
        assert_eq!(serde_json::from_str::<ModelMetadata>(&text).unwrap(), meta);
        let server: ServerMetadata = serde_json::from_str(
            r#"{"name":"triton","version":"2.40.0","extensions":["classification","binary_tensor_data"]}"#,
        )
        .unwrap();
        assert_eq!(server.extensions.len(), 2);
    }
}
