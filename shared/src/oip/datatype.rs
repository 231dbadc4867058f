//! The tensor element types ([`DataType`]): their wire spelling, element sizes, which ones
//! [`TensorData`](super::TensorData) can hold, and their (de)serialization as strings.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize, Serializer};

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

    /// Whether [`TensorData`] can hold this type (everything but `BYTES`).
    ///
    /// [`TensorData`]: super::TensorData
    pub const fn is_supported(self) -> bool {
        !matches!(self, DataType::Bytes)
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::oip::test_support::samples;
    use serde_json::json;

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
}
