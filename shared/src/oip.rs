//! The KServe Open Inference Protocol v2 (the HTTP/REST protocol Triton speaks) as the
//! ai-worker serves it and the api-gateway calls it: `POST /v2/models/{name}/infer`.
//!
//! # Framing
//!
//! An inference request or response body is a JSON document, optionally followed by raw
//! tensor bytes (Triton's *binary tensor data extension*):
//!
//! ```text
//! Inference-Header-Content-Length: N          (HTTP header; absent = the whole body is JSON)
//!
//! [ N bytes of JSON header ][ tensor 0 bytes ][ tensor 1 bytes ] ...
//! ```
//!
//! * Without the header the whole body is JSON and every tensor carries its values in `data`,
//!   a flat array in row-major order (nested arrays are accepted when decoding and flattened).
//! * With the header, the first `N` bytes are the JSON header and the rest is the concatenated
//!   raw bytes of every tensor whose `parameters.binary_data_size` is set, in the order those
//!   tensors appear in `inputs` (requests) or `outputs` (responses). Values are little-endian
//!   and row-major; `BOOL` is one byte per element. A tensor is either binary or has `data`,
//!   never both, and the binary section must be consumed exactly.
//! * A client asks for binary outputs per output with
//!   `"outputs": [{"name": "OUT", "parameters": {"binary_data": true}}]`, or for all outputs with
//!   the request-level `"parameters": {"binary_data_output": true}`; the per-output flag wins
//!   (see [`wants_binary_output`]). When `outputs` is absent the server returns all outputs.
//! * Errors are `{"error": "..."}` ([`ErrorBody`]) with a non-2xx status.
//!
//! The HTTP header name is case-insensitive; [`INFERENCE_HEADER_CONTENT_LENGTH`] is its
//! lower-case spelling, and [`parse_header_length`] reads its value.
//!
//! # Decoding
//!
//! [`decode_request`] and [`decode_response`] split the body, parse the JSON header and turn
//! every tensor into a [`Tensor`], checking every size on the way: dimensions must be
//! non-negative, element counts and byte sizes must not overflow, `binary_data_size` must equal
//! shape × element size, binary data must lie inside the body and be used up exactly, JSON
//! `data` must have exactly as many elements as the shape needs and each value must fit the
//! datatype, and the decoded total must stay under a cap ([`DecodeLimits`]). Nothing is
//! allocated in proportion to a claimed size before that size has been checked against the
//! body, and no input makes these functions panic.
//!
//! `FP16` and `BYTES` are understood on the wire but not decoded: they yield
//! [`OipError::Unsupported`].
//!
//! JSON cannot carry NaN or ±infinity: encoded as JSON `data` they become `null`, which the
//! decoder rejects. Send float tensors that may hold them as binary.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize, Serializer};
use serde_json::{Map, Value};

/// HTTP header giving the length of the JSON part of a body that carries binary tensor data.
pub const INFERENCE_HEADER_CONTENT_LENGTH: &str = "inference-header-content-length";
/// Tensor parameter: the tensor's bytes are in the binary section and take this many bytes.
pub const BINARY_DATA_SIZE: &str = "binary_data_size";
/// Requested-output parameter: return this output as binary data.
pub const BINARY_DATA: &str = "binary_data";
/// Request parameter: return every output as binary data unless the output says otherwise.
pub const BINARY_DATA_OUTPUT: &str = "binary_data_output";
/// Default cap on the decoded tensor bytes of one message (all tensors together): 2 GiB.
pub const DEFAULT_MAX_DECODED_BYTES: usize = 1 << 31;

/// Free-form `parameters` object.
pub type Parameters = Map<String, Value>;

// ---------------------------------------------------------------------------------------------
// Wire structs
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Datatypes
// ---------------------------------------------------------------------------------------------

/// A tensor element type, spelled on the wire as in [`DataType::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Fp16,
    Fp32,
    Fp64,
    Bytes,
}

impl DataType {
    /// Every datatype of the protocol.
    pub const ALL: [DataType; 13] = [
        DataType::Bool,
        DataType::Uint8,
        DataType::Uint16,
        DataType::Uint32,
        DataType::Uint64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Fp16,
        DataType::Fp32,
        DataType::Fp64,
        DataType::Bytes,
    ];

    /// The wire spelling: `"BOOL"`, `"UINT8"`, …, `"FP32"`, `"BYTES"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
            DataType::Bytes => "BYTES",
        }
    }

    /// Bytes per element in the binary encoding; `None` for `BYTES` (variable length).
    pub const fn element_size(self) -> Option<usize> {
        match self {
            DataType::Bool | DataType::Uint8 | DataType::Int8 => Some(1),
            DataType::Uint16 | DataType::Int16 | DataType::Fp16 => Some(2),
            DataType::Uint32 | DataType::Int32 | DataType::Fp32 => Some(4),
            DataType::Uint64 | DataType::Int64 | DataType::Fp64 => Some(8),
            DataType::Bytes => None,
        }
    }

    /// Whether [`TensorData`] can hold this type (everything but `FP16` and `BYTES`).
    pub const fn is_supported(self) -> bool {
        !matches!(self, DataType::Fp16 | DataType::Bytes)
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A datatype string that is not one of the protocol's (they are upper-case).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown datatype '{0}'")]
pub struct UnknownDataType(pub String);

impl FromStr for DataType {
    type Err = UnknownDataType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DataType::ALL
            .into_iter()
            .find(|dt| dt.as_str() == s)
            .ok_or_else(|| UnknownDataType(s.to_owned()))
    }
}

impl Serialize for DataType {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for DataType {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

// ---------------------------------------------------------------------------------------------
// Decoded tensors
// ---------------------------------------------------------------------------------------------

/// A tensor with its values decoded, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: TensorData,
}

impl Tensor {
    pub fn new(name: impl Into<String>, shape: Vec<usize>, data: impl Into<TensorData>) -> Self {
        Self {
            name: name.into(),
            shape,
            data: data.into(),
        }
    }

    /// The number of elements the shape describes (1 for a scalar shape `[]`; saturates at
    /// `usize::MAX`). Decoded tensors always have exactly this many values; the encoders trust
    /// that tensors built by hand do too.
    pub fn element_count(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        self.shape
            .iter()
            .fold(1usize, |acc, &d| acc.saturating_mul(d))
    }

    pub fn datatype(&self) -> DataType {
        self.data.datatype()
    }
}

/// A request input as [`decode_request_in_place`] returns it: checked like a [`Tensor`], but
/// binary data is left where it is in the body.
#[derive(Debug, Clone, PartialEq)]
pub struct RawTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub datatype: DataType,
    pub data: RawData,
}

/// Where a [`RawTensor`]'s values are.
#[derive(Debug, Clone, PartialEq)]
pub enum RawData {
    /// `body[range]`: exactly the shape's elements of the datatype, little-endian, at any
    /// alignment (the binary section starts wherever the JSON header ends).
    Binary(std::ops::Range<usize>),
    /// Decoded from the JSON `data` field.
    Json(TensorData),
}

/// The values of a [`Tensor`], one variant per supported datatype.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    Bool(Vec<bool>),
    Uint8(Vec<u8>),
    Uint16(Vec<u16>),
    Uint32(Vec<u32>),
    Uint64(Vec<u64>),
    Int8(Vec<i8>),
    Int16(Vec<i16>),
    Int32(Vec<i32>),
    Int64(Vec<i64>),
    Fp32(Vec<f32>),
    Fp64(Vec<f64>),
}

/// `match` on every [`TensorData`] variant with one type-generic body.
macro_rules! each_variant {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            TensorData::Bool($v) => $body,
            TensorData::Uint8($v) => $body,
            TensorData::Uint16($v) => $body,
            TensorData::Uint32($v) => $body,
            TensorData::Uint64($v) => $body,
            TensorData::Int8($v) => $body,
            TensorData::Int16($v) => $body,
            TensorData::Int32($v) => $body,
            TensorData::Int64($v) => $body,
            TensorData::Fp32($v) => $body,
            TensorData::Fp64($v) => $body,
        }
    };
}

impl TensorData {
    pub fn datatype(&self) -> DataType {
        match self {
            TensorData::Bool(_) => DataType::Bool,
            TensorData::Uint8(_) => DataType::Uint8,
            TensorData::Uint16(_) => DataType::Uint16,
            TensorData::Uint32(_) => DataType::Uint32,
            TensorData::Uint64(_) => DataType::Uint64,
            TensorData::Int8(_) => DataType::Int8,
            TensorData::Int16(_) => DataType::Int16,
            TensorData::Int32(_) => DataType::Int32,
            TensorData::Int64(_) => DataType::Int64,
            TensorData::Fp32(_) => DataType::Fp32,
            TensorData::Fp64(_) => DataType::Fp64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        each_variant!(self, v => v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of the binary encoding in bytes.
    pub fn byte_len(&self) -> usize {
        each_variant!(self, v => v.len() * elem_size_of(v))
    }

    /// Appends the little-endian binary encoding to `out`.
    pub fn write_le_bytes(&self, out: &mut Vec<u8>) {
        match self {
            TensorData::Uint8(v) => out.extend_from_slice(v),
            other => each_variant!(other, v => put_all(v, out)),
        }
    }
}

/// Serializes as a flat JSON array (the `data` field).
impl Serialize for TensorData {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        each_variant!(self, v => v.serialize(serializer))
    }
}

macro_rules! from_vec {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<Vec<$t>> for TensorData {
            fn from(v: Vec<$t>) -> Self {
                TensorData::$variant(v)
            }
        }
    )*};
}

from_vec!(
    bool => Bool, u8 => Uint8, u16 => Uint16, u32 => Uint32, u64 => Uint64, i8 => Int8,
    i16 => Int16, i32 => Int32, i64 => Int64, f32 => Fp32, f64 => Fp64,
);

/// A fixed-size element with a little-endian binary encoding.
trait LeElement: Copy {
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

fn elem_size_of<T: LeElement>(_: &[T]) -> usize {
    T::SIZE
}

/// One resize, then fixed-size stores: the compiler turns this into a block copy on
/// little-endian hosts (growing the vector element by element does not vectorise).
fn put_all<T: LeElement>(v: &[T], out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + v.len() * T::SIZE, 0);
    for (slot, &x) in out[start..].chunks_exact_mut(T::SIZE).zip(v) {
        x.put(slot);
    }
}

fn get_all<T: LeElement>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(T::SIZE).map(T::get).collect()
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Whether a tensor is a request input or a response output (for error messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKind {
    Input,
    Output,
}

impl fmt::Display for TensorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TensorKind::Input => "input",
            TensorKind::Output => "output",
        })
    }
}

/// Why a body could not be decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OipError {
    #[error("invalid {INFERENCE_HEADER_CONTENT_LENGTH} value '{value}'")]
    InvalidHeaderValue { value: String },
    #[error(
        "{INFERENCE_HEADER_CONTENT_LENGTH} {header_len} is past the end of the {body_len}-byte body"
    )]
    HeaderLength { header_len: usize, body_len: usize },
    #[error("invalid json header: {0}")]
    Json(#[from] serde_json::Error),
    /// [`decode_response`] got an [`ErrorBody`].
    #[error("server error: {message}")]
    Server { message: String },
    #[error("duplicate {kind} '{tensor}'")]
    Duplicate { kind: TensorKind, tensor: String },
    #[error("{kind} '{tensor}': unknown datatype '{datatype}'")]
    UnknownDatatype {
        kind: TensorKind,
        tensor: String,
        datatype: String,
    },
    #[error("{kind} '{tensor}': datatype {datatype} is not supported")]
    Unsupported {
        kind: TensorKind,
        tensor: String,
        datatype: DataType,
    },
    #[error("{kind} '{tensor}': shape {shape:?} has a negative dimension")]
    NegativeDimension {
        kind: TensorKind,
        tensor: String,
        shape: Vec<i64>,
    },
    #[error("{kind} '{tensor}': size of shape {shape:?} of {datatype} overflows")]
    ShapeOverflow {
        kind: TensorKind,
        tensor: String,
        shape: Vec<i64>,
        datatype: DataType,
    },
    #[error("{kind} '{tensor}': invalid parameter '{parameter}': {reason}")]
    InvalidParameter {
        kind: TensorKind,
        tensor: String,
        parameter: String,
        reason: String,
    },
    #[error("{kind} '{tensor}': has neither 'data' nor a '{BINARY_DATA_SIZE}' parameter")]
    MissingData { kind: TensorKind, tensor: String },
    #[error("{kind} '{tensor}': has both 'data' and a '{BINARY_DATA_SIZE}' parameter")]
    ConflictingData { kind: TensorKind, tensor: String },
    #[error(
        "{kind} '{tensor}': {bytes} bytes of tensor data exceed the decode limit \
         ({remaining} bytes left of {limit} for the whole message)"
    )]
    TooLarge {
        kind: TensorKind,
        tensor: String,
        bytes: usize,
        remaining: usize,
        limit: usize,
    },
    #[error(
        "{kind} '{tensor}': {BINARY_DATA_SIZE} {size} does not match shape {shape:?} of \
         {datatype} ({expected} bytes)"
    )]
    BinarySizeMismatch {
        kind: TensorKind,
        tensor: String,
        size: u64,
        shape: Vec<usize>,
        datatype: DataType,
        expected: usize,
    },
    #[error(
        "{kind} '{tensor}': {size} bytes of binary data at offset {offset} run past the end \
         of the body ({available} bytes left)"
    )]
    BinaryOutOfBounds {
        kind: TensorKind,
        tensor: String,
        offset: usize,
        size: usize,
        available: usize,
    },
    #[error("{count} bytes left over after the binary tensor data")]
    TrailingBytes { count: usize },
    #[error("{kind} '{tensor}': data has {got} elements but shape {shape:?} needs {expected}")]
    ElementCount {
        kind: TensorKind,
        tensor: String,
        got: usize,
        shape: Vec<usize>,
        expected: usize,
    },
    #[error("{kind} '{tensor}': {reason}")]
    InvalidData {
        kind: TensorKind,
        tensor: String,
        reason: String,
    },
}

// ---------------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------------

/// Caps applied while decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// The most decoded tensor bytes (element count × element size, summed over all tensors of
    /// the message) a decode may produce.
    pub max_decoded_bytes: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        Self {
            max_decoded_bytes: DEFAULT_MAX_DECODED_BYTES,
        }
    }
}

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

/// Decodes a request body; `header_len` is the value of the
/// [`INFERENCE_HEADER_CONTENT_LENGTH`] header, `None` when the request had none.
///
/// Returns the JSON header (with every input's `data` moved out, so `None`) and the inputs as
/// tensors, in order. Uses [`DecodeLimits::default`].
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

fn split_body(body: &[u8], header_len: Option<usize>) -> Result<(&[u8], &[u8]), OipError> {
    match header_len {
        None => Ok((body, &[])),
        Some(n) if n <= body.len() => Ok(body.split_at(n)),
        Some(n) => Err(OipError::HeaderLength {
            header_len: n,
            body_len: body.len(),
        }),
    }
}

/// Position in the binary section and what is left of the decode budget.
struct Cursor<'a> {
    binary: &'a [u8],
    offset: usize,
    remaining: usize,
    limit: usize,
}

impl<'a> Cursor<'a> {
    fn new(binary: &'a [u8], limits: &DecodeLimits) -> Self {
        Self {
            binary,
            offset: 0,
            remaining: limits.max_decoded_bytes,
            limit: limits.max_decoded_bytes,
        }
    }

    fn finish(&self) -> Result<(), OipError> {
        match self.binary.len() - self.offset {
            0 => Ok(()),
            count => Err(OipError::TrailingBytes { count }),
        }
    }
}

/// The fields of a [`RequestInput`] or [`ResponseOutput`].
struct WireTensor<'a> {
    kind: TensorKind,
    name: &'a str,
    shape: &'a [i64],
    datatype: &'a str,
    parameters: Option<&'a Parameters>,
    data: Option<Value>,
}

impl<'a> WireTensor<'a> {
    fn decode(
        self,
        cursor: &mut Cursor<'_>,
        seen: &mut HashSet<&'a str>,
    ) -> Result<RawTensor, OipError> {
        let (kind, name) = (self.kind, self.name);
        let tensor = || name.to_owned();
        if !seen.insert(name) {
            return Err(OipError::Duplicate {
                kind,
                tensor: tensor(),
            });
        }
        let datatype: DataType = self
            .datatype
            .parse()
            .map_err(|_| OipError::UnknownDatatype {
                kind,
                tensor: tensor(),
                datatype: self.datatype.to_owned(),
            })?;
        let elem_size = match datatype.element_size() {
            Some(size) if datatype.is_supported() => size,
            _ => {
                return Err(OipError::Unsupported {
                    kind,
                    tensor: tensor(),
                    datatype,
                })
            }
        };

        // Shape → dims, element count and byte size, all checked.
        let mut dims = Vec::with_capacity(self.shape.len());
        for &d in self.shape {
            let d = usize::try_from(d).map_err(|_| {
                if d < 0 {
                    OipError::NegativeDimension {
                        kind,
                        tensor: tensor(),
                        shape: self.shape.to_vec(),
                    }
                } else {
                    OipError::ShapeOverflow {
                        kind,
                        tensor: tensor(),
                        shape: self.shape.to_vec(),
                        datatype,
                    }
                }
            })?;
            dims.push(d);
        }
        let overflow = || OipError::ShapeOverflow {
            kind,
            tensor: tensor(),
            shape: self.shape.to_vec(),
            datatype,
        };
        let count = if dims.contains(&0) {
            0
        } else {
            dims.iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .ok_or_else(overflow)?
        };
        let bytes = count.checked_mul(elem_size).ok_or_else(overflow)?;

        let binary_size = match self.parameters.and_then(|p| p.get(BINARY_DATA_SIZE)) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| OipError::InvalidParameter {
                kind,
                tensor: tensor(),
                parameter: BINARY_DATA_SIZE.to_owned(),
                reason: format!("expected a non-negative integer, got {}", describe(v)),
            })?),
        };
        if binary_size.is_some() && self.data.is_some() {
            return Err(OipError::ConflictingData {
                kind,
                tensor: tensor(),
            });
        }
        if binary_size.is_none() && self.data.is_none() {
            return Err(OipError::MissingData {
                kind,
                tensor: tensor(),
            });
        }
        if bytes > cursor.remaining {
            return Err(OipError::TooLarge {
                kind,
                tensor: tensor(),
                bytes,
                remaining: cursor.remaining,
                limit: cursor.limit,
            });
        }

        let data = if let Some(size) = binary_size {
            if size != bytes as u64 {
                return Err(OipError::BinarySizeMismatch {
                    kind,
                    tensor: tensor(),
                    size,
                    shape: dims,
                    datatype,
                    expected: bytes,
                });
            }
            let available = cursor.binary.len() - cursor.offset;
            if bytes > available {
                return Err(OipError::BinaryOutOfBounds {
                    kind,
                    tensor: tensor(),
                    offset: cursor.offset,
                    size: bytes,
                    available,
                });
            }
            let range = cursor.offset..cursor.offset + bytes;
            cursor.offset += bytes;
            RawData::Binary(range)
        } else {
            let invalid = |reason: String| OipError::InvalidData {
                kind,
                tensor: tensor(),
                reason,
            };
            let Some(Value::Array(values)) = self.data else {
                let got = self
                    .data
                    .as_ref()
                    .map_or_else(|| "nothing".to_owned(), describe);
                return Err(invalid(format!("data must be a json array, got {got}")));
            };
            let got = Leaves::new(&values).count();
            if got != count {
                return Err(OipError::ElementCount {
                    kind,
                    tensor: tensor(),
                    got,
                    shape: dims,
                    expected: count,
                });
            }
            RawData::Json(decode_json(datatype, &values, count).map_err(|(index, value)| {
                invalid(format!(
                    "element {index} of data is not a valid {datatype}: {value}"
                ))
            })?)
        };
        cursor.remaining -= bytes;
        Ok(RawTensor {
            name: name.to_owned(),
            shape: dims,
            datatype,
            data,
        })
    }
}

/// `raw` has a whole number of elements of a supported `datatype`.
fn decode_binary(datatype: DataType, raw: &[u8]) -> TensorData {
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
        // Callers reject FP16 and BYTES first; an empty FP32 tensor is a harmless fallback.
        DataType::Fp32 | DataType::Fp16 | DataType::Bytes => TensorData::Fp32(get_all(raw)),
        DataType::Fp64 => TensorData::Fp64(get_all(raw)),
    }
}

/// Converts the leaves of `values` (known to number `count`); on failure, the index and a
/// description of the first bad value.
fn decode_json(
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
        DataType::Fp32 | DataType::Fp16 | DataType::Bytes => {
            TensorData::Fp32(conv(values, count, |v| {
                // JSON numbers are finite; one that only overflows f32 is out of range.
                v.as_f64().map(|x| x as f32).filter(|x| x.is_finite())
            })?)
        }
        DataType::Fp64 => TensorData::Fp64(conv(values, count, Value::as_f64)?),
    })
}

/// The non-array values inside nested arrays, depth first (row-major order).
struct Leaves<'a> {
    stack: Vec<std::slice::Iter<'a, Value>>,
}

impl<'a> Leaves<'a> {
    fn new(values: &'a [Value]) -> Self {
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
fn describe(v: &Value) -> String {
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

// ---------------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------------

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

/// Encodes a request. With `binary_inputs` every input goes in the binary section, otherwise
/// in JSON `data`; `outputs` empty leaves `outputs` out (the server then returns all outputs,
/// as JSON). Returns the body and the value for the [`INFERENCE_HEADER_CONTENT_LENGTH`] header
/// (`None`: send no such header).
pub fn encode_request(
    id: Option<&str>,
    inputs: &[Tensor],
    binary_inputs: bool,
    outputs: &[RequestOutputSpec],
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
    };
    frame(&header, inputs, &binary)
}

/// Encodes a response; `binary(name)` says whether output `name` goes in the binary section
/// (typically `|name| wants_binary_output(&request, name)`). Returns the body and the value for
/// the [`INFERENCE_HEADER_CONTENT_LENGTH`] header (`None`: send no such header).
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

fn frame<T: Serialize>(
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

fn to_json_vec<T: Serialize>(value: &T) -> Vec<u8> {
    // Only string-keyed structs, strings, numbers and `Value`s: serializing cannot fail.
    serde_json::to_vec(value).expect("serializing OIP json cannot fail")
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    /// One tensor of every supported type, with extreme values.
    fn samples() -> Vec<Tensor> {
        vec![
            Tensor::new("b", vec![2, 2], vec![true, false, false, true]),
            Tensor::new("u8", vec![3], vec![0u8, 7, 255]),
            Tensor::new("u16", vec![1, 3], vec![0u16, 300, u16::MAX]),
            Tensor::new("u32", vec![3], vec![0u32, 70_000, u32::MAX]),
            Tensor::new("u64", vec![3], vec![0u64, 1 << 60, u64::MAX]),
            Tensor::new("i8", vec![3], vec![i8::MIN, -1, i8::MAX]),
            Tensor::new("i16", vec![3], vec![i16::MIN, -300, i16::MAX]),
            Tensor::new("i32", vec![3, 1], vec![i32::MIN, -70_000, i32::MAX]),
            Tensor::new("i64", vec![3], vec![i64::MIN, -(1 << 60), i64::MAX]),
            Tensor::new(
                "f32",
                vec![2, 3],
                vec![0.1f32, -1.5, f32::MAX, f32::MIN_POSITIVE, 1e-45, 0.0],
            ),
            Tensor::new(
                "f64",
                vec![4],
                vec![0.1f64, -2.5e300, f64::MIN_POSITIVE, 5e-324],
            ),
            Tensor::new("scalar", vec![], vec![42i32]),
            Tensor::new("empty", vec![2, 0, 3], Vec::<f32>::new()),
        ]
    }

    fn outputs_of(names: &[&str], binary: bool) -> Vec<RequestOutputSpec> {
        names
            .iter()
            .map(|n| RequestOutputSpec {
                name: (*n).into(),
                binary,
            })
            .collect()
    }

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
    fn datatype_strings_and_sizes() {
        for dt in DataType::ALL {
            assert_eq!(dt.as_str().parse::<DataType>().unwrap(), dt);
            assert_eq!(dt.to_string(), dt.as_str());
            assert_eq!(serde_json::to_value(dt).unwrap(), json!(dt.as_str()));
        }
        assert_eq!(DataType::Fp32.element_size(), Some(4));
        assert_eq!(DataType::Bool.element_size(), Some(1));
        assert_eq!(DataType::Fp16.element_size(), Some(2));
        assert_eq!(DataType::Int64.element_size(), Some(8));
        assert_eq!(DataType::Bytes.element_size(), None);
        assert_eq!(
            "fp32".parse::<DataType>(),
            Err(UnknownDataType("fp32".into()))
        );
        for t in samples() {
            assert_eq!(
                t.data.byte_len(),
                t.data.len() * t.datatype().element_size().unwrap()
            );
            assert_eq!(t.element_count(), t.data.len());
        }
    }

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

    // --- error cases ---

    fn req_err(body: &[u8], header_len: Option<usize>) -> OipError {
        decode_request(body, header_len).unwrap_err()
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

    #[test]
    fn binary_encoding_is_little_endian_for_every_width() {
        let mut out = vec![9u8];
        TensorData::Fp32(vec![1.0, -2.5]).write_le_bytes(&mut out);
        TensorData::Uint16(vec![0x0102]).write_le_bytes(&mut out);
        TensorData::Bool(vec![true, false]).write_le_bytes(&mut out);
        let mut want = vec![9u8];
        want.extend(1.0f32.to_le_bytes());
        want.extend((-2.5f32).to_le_bytes());
        want.extend([0x02, 0x01, 1, 0]);
        assert_eq!(out, want);
    }

    fn with_binary(json: &str, binary: &[u8]) -> (Vec<u8>, Option<usize>) {
        let mut body = json.as_bytes().to_vec();
        body.extend_from_slice(binary);
        (body, Some(json.len()))
    }

    #[test]
    fn error_binary_size_mismatch() {
        let (body, hl) = with_binary(
            r#"{"inputs":[{"name":"audio","shape":[1,30],"datatype":"FP32","parameters":{"binary_data_size":100}}]}"#,
            &[0; 100],
        );
        let err = req_err(&body, hl);
        assert!(matches!(
            err,
            OipError::BinarySizeMismatch {
                size: 100,
                expected: 120,
                ..
            }
        ));
        assert_eq!(
            err.to_string(),
            "input 'audio': binary_data_size 100 does not match shape [1, 30] of FP32 (120 bytes)"
        );
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
    fn error_trailing_bytes() {
        let (body, hl) = with_binary(
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"INT8","parameters":{"binary_data_size":1}}]}"#,
            &[1, 2, 3],
        );
        assert!(matches!(
            req_err(&body, hl),
            OipError::TrailingBytes { count: 2 }
        ));
        // Binary bytes after a header while every tensor is JSON.
        let (body, hl) = with_binary(
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"INT8","data":[1]}]}"#,
            &[0],
        );
        assert!(matches!(
            req_err(&body, hl),
            OipError::TrailingBytes { count: 1 }
        ));
    }

    #[test]
    fn error_binary_out_of_bounds() {
        let (body, hl) = with_binary(
            r#"{"inputs":[{"name":"x","shape":[4],"datatype":"INT32","parameters":{"binary_data_size":16}}]}"#,
            &[0; 10],
        );
        let err = req_err(&body, hl);
        assert!(
            matches!(
                err,
                OipError::BinaryOutOfBounds {
                    offset: 0,
                    size: 16,
                    available: 10,
                    ..
                }
            ),
            "{err}"
        );
        // Binary tensor but no header at all: nothing is binary.
        let err = req_err(&body[..hl.unwrap()], None);
        assert!(
            matches!(err, OipError::BinaryOutOfBounds { available: 0, .. }),
            "{err}"
        );
    }

    #[test]
    fn error_unknown_datatype() {
        let err = req_err(
            br#"{"inputs":[{"name":"x","shape":[1],"datatype":"FLOAT","data":[1]}]}"#,
            None,
        );
        assert!(matches!(&err, OipError::UnknownDatatype { datatype, .. } if datatype == "FLOAT"));
        assert_eq!(err.to_string(), "input 'x': unknown datatype 'FLOAT'");
    }

    #[test]
    fn error_unsupported_datatypes() {
        for dt in ["FP16", "BYTES"] {
            let body = format!(
                r#"{{"inputs":[{{"name":"x","shape":[1],"datatype":"{dt}","data":[1]}}]}}"#
            );
            let err = req_err(body.as_bytes(), None);
            assert!(matches!(err, OipError::Unsupported { .. }), "{err}");
        }
    }

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

    #[test]
    fn error_negative_dimension_and_overflow() {
        let err = req_err(
            br#"{"inputs":[{"name":"x","shape":[1,-1],"datatype":"FP32","data":[1]}]}"#,
            None,
        );
        assert!(matches!(err, OipError::NegativeDimension { .. }));
        assert_eq!(
            err.to_string(),
            "input 'x': shape [1, -1] has a negative dimension"
        );
        let big = i64::MAX;
        let body = format!(
            r#"{{"inputs":[{{"name":"x","shape":[{big},{big}],"datatype":"FP32","data":[1]}}]}}"#
        );
        assert!(matches!(
            req_err(body.as_bytes(), None),
            OipError::ShapeOverflow { .. }
        ));
        // Element count fits in usize but the byte size does not.
        let n = usize::MAX / 2;
        let body =
            format!(r#"{{"inputs":[{{"name":"x","shape":[{n}],"datatype":"FP64","data":[1]}}]}}"#);
        assert!(matches!(
            req_err(body.as_bytes(), None),
            OipError::ShapeOverflow { .. }
        ));
        // A zero dimension makes the count 0 however large the others are.
        let body = format!(
            r#"{{"inputs":[{{"name":"x","shape":[{big},{big},0],"datatype":"FP32","data":[]}}]}}"#
        );
        let (_, t) = decode_request(body.as_bytes(), None).unwrap();
        assert!(t[0].data.is_empty());
    }

    #[test]
    fn error_too_large() {
        let limits = DecodeLimits {
            max_decoded_bytes: 10,
        };
        let (body, hl) = with_binary(
            r#"{"inputs":[{"name":"a","shape":[2],"datatype":"INT32","parameters":{"binary_data_size":8}},{"name":"b","shape":[1],"datatype":"INT32","data":[5]}]}"#,
            &[0; 8],
        );
        let err = decode_request_with_limits(&body, hl, &limits).unwrap_err();
        assert!(
            matches!(&err, OipError::TooLarge { tensor, bytes: 4, remaining: 2, limit: 10, .. } if tensor == "b"),
            "{err}"
        );
        assert!(decode_request_with_limits(
            &body,
            hl,
            &DecodeLimits {
                max_decoded_bytes: 12
            }
        )
        .is_ok());
        // A huge claimed shape is refused before anything is allocated.
        let body =
            br#"{"inputs":[{"name":"x","shape":[1000000000000],"datatype":"FP32","data":[1]}]}"#;
        assert!(matches!(req_err(body, None), OipError::TooLarge { .. }));
    }

    #[test]
    fn error_json_element_count() {
        let err = req_err(
            br#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"FP32","data":[[1,2],[3]]}]}"#,
            None,
        );
        assert!(
            matches!(
                err,
                OipError::ElementCount {
                    got: 3,
                    expected: 4,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "input 'x': data has 3 elements but shape [2, 2] needs 4"
        );
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

    #[test]
    fn error_missing_conflicting_duplicate_parameter() {
        let err = req_err(
            br#"{"inputs":[{"name":"x","shape":[1],"datatype":"INT32"}]}"#,
            None,
        );
        assert!(matches!(err, OipError::MissingData { .. }));
        let (body, hl) = with_binary(
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"INT32","data":[1],"parameters":{"binary_data_size":4}}]}"#,
            &[0; 4],
        );
        assert!(matches!(
            req_err(&body, hl),
            OipError::ConflictingData { .. }
        ));
        let err = req_err(
            br#"{"inputs":[{"name":"x","shape":[1],"datatype":"INT32","data":[1]},{"name":"x","shape":[1],"datatype":"INT32","data":[1]}]}"#,
            None,
        );
        assert!(matches!(err, OipError::Duplicate { .. }));
        for bad in ["-4", "4.0", "\"4\""] {
            let json = format!(
                r#"{{"inputs":[{{"name":"x","shape":[1],"datatype":"INT32","parameters":{{"binary_data_size":{bad}}}}}]}}"#
            );
            let (body, hl) = with_binary(&json, &[0; 4]);
            assert!(
                matches!(req_err(&body, hl), OipError::InvalidParameter { .. }),
                "{bad}"
            );
        }
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
