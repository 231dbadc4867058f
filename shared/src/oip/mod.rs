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
//! `BYTES` is understood on the wire but not decoded: it yields [`OipError::Unsupported`].
//! `FP16` values are [`F16`]s (the bits of each half-precision value); in JSON `data` they are
//! numbers, rounded to the nearest half-precision value.
//!
//! JSON cannot carry NaN or ±infinity: encoded as JSON `data` they become `null`, which the
//! decoder rejects. Send float tensors that may hold them as binary.

// This module owns the overview above and the public names; the code lives in private
// submodules, each re-exported here, so every item is used as `oip::Name`:
//
// * `wire`: the JSON documents as they are on the wire (requests, responses, metadata,
//   errors);
// * `datatype`: the tensor element types and their wire spelling;
// * `fp16`: the half-precision element and its conversions;
// * `tensor`: decoded tensors and their values;
// * `binary`: the binary tensor data extension (header and parameter names, body layout,
//   element byte layout, which outputs a client wants as binary);
// * `error`: why a body could not be decoded;
// * `decode`: the request and response decoders;
// * `check`: the checks on one wire tensor and the decode limits;
// * `convert`: turning binary bytes and JSON `data` into tensor values;
// * `encode`: the request, response and error encoders.
// * `test_support` (tests only): helpers the unit tests of several submodules share.

mod binary;
mod check;
mod convert;
mod datatype;
mod decode;
mod encode;
mod error;
mod fp16;
mod tensor;
#[cfg(test)]
mod test_support;
mod wire;

pub use binary::{
    parse_header_length, wants_binary_output, BINARY_DATA, BINARY_DATA_OUTPUT, BINARY_DATA_SIZE,
    INFERENCE_HEADER_CONTENT_LENGTH,
};
pub use check::{DecodeLimits, DEFAULT_MAX_DECODED_BYTES};
pub use datatype::{DataType, UnknownDataType};
pub use decode::{
    decode_request, decode_request_in_place, decode_request_with_limits, decode_response,
    decode_response_with_limits,
};
pub use encode::{encode_error, encode_request, encode_request_binary_outputs, encode_response, encode_response_parts, RequestOutputSpec};
pub use error::{OipError, TensorKind};
pub use fp16::F16;
pub use tensor::{RawData, RawTensor, Tensor, TensorData};
pub use wire::{
    ErrorBody, InferRequest, InferResponse, ModelMetadata, Parameters, RequestInput,
    RequestOutput, ResponseOutput, ServerMetadata, TensorMetadata,
};
