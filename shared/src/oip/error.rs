//! Why a body could not be decoded ([`OipError`]), and whether the tensor at fault was an
//! input or an output ([`TensorKind`]).

use std::fmt;

use super::{DataType, BINARY_DATA_SIZE, INFERENCE_HEADER_CONTENT_LENGTH};

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
    ///
    /// [`decode_response`]: super::decode_response
    /// [`ErrorBody`]: super::ErrorBody
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
