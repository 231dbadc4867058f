//! Decoded tensors: [`Tensor`] and its values ([`TensorData`], one variant per supported
//! datatype), and [`RawTensor`], a checked request input whose binary data is still in the
//! body.

use serde::{Serialize, Serializer};

use super::binary::{elem_size_of, put_all};
use super::{DataType, F16};

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
///
/// [`decode_request_in_place`]: super::decode_request_in_place
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
    Fp16(Vec<F16>),
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
            TensorData::Fp16($v) => $body,
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
            TensorData::Fp16(_) => DataType::Fp16,
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

    /// The little-endian binary encoding, taking the values: on a little-endian host the
    /// vector's own memory for every plain numeric type (no copy), else a copy.
    pub fn into_le_bytes(self) -> bytes::Bytes {
        if cfg!(target_endian = "little") {
            match self {
                TensorData::Uint8(v) => return bytes::Bytes::from(v),
                TensorData::Uint16(v) => return bytes::Bytes::from_owner(LeValues(v)),
                TensorData::Uint32(v) => return bytes::Bytes::from_owner(LeValues(v)),
                TensorData::Uint64(v) => return bytes::Bytes::from_owner(LeValues(v)),
                TensorData::Int8(v) => return bytes::Bytes::from_owner(LeValues(v)),
                TensorData::Int16(v) => return bytes::Bytes::from_owner(LeValues(v)),
                TensorData::Int32(v) => return bytes::Bytes::from_owner(LeValues(v)),
                TensorData::Int64(v) => return bytes::Bytes::from_owner(LeValues(v)),
                TensorData::Fp32(v) => return bytes::Bytes::from_owner(LeValues(v)),
                TensorData::Fp64(v) => return bytes::Bytes::from_owner(LeValues(v)),
                other => {
                    let mut out = Vec::with_capacity(other.byte_len());
                    other.write_le_bytes(&mut out);
                    return bytes::Bytes::from(out);
                }
            }
        }
        let mut out = Vec::with_capacity(self.byte_len());
        self.write_le_bytes(&mut out);
        bytes::Bytes::from(out)
    }

    /// Appends the little-endian binary encoding to `out`.
    pub fn write_le_bytes(&self, out: &mut Vec<u8>) {
        match self {
            TensorData::Uint8(v) => out.extend_from_slice(v),
            other => each_variant!(other, v => put_all(v, out)),
        }
    }
}

/// Plain numeric values (no padding, every bit pattern valid) whose memory, on a
/// little-endian host, is their little-endian binary encoding.
trait PlainNumber: Copy + Send + 'static {}
impl PlainNumber for u16 {}
impl PlainNumber for u32 {}
impl PlainNumber for u64 {}
impl PlainNumber for i8 {}
impl PlainNumber for i16 {}
impl PlainNumber for i32 {}
impl PlainNumber for i64 {}
impl PlainNumber for f32 {}
impl PlainNumber for f64 {}

/// A vector of plain numbers seen as its bytes, owned by a `Bytes` ([`TensorData::into_le_bytes`]).
struct LeValues<T: PlainNumber>(Vec<T>);

impl<T: PlainNumber> AsRef<[u8]> for LeValues<T> {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `T` is a plain number (`PlainNumber`: no padding, no invalid bit patterns
        // are read as bytes), the pointer and length come from a live `Vec<T>` owned by `self`,
        // and `u8` has alignment 1; the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast::<u8>(), std::mem::size_of_val(self.0.as_slice())) }
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
    i16 => Int16, i32 => Int32, i64 => Int64, F16 => Fp16, f32 => Fp32, f64 => Fp64,
);
