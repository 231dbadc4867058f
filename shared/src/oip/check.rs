//! The checks on one wire tensor ([`WireTensor::decode`]): its name is new, its datatype
//! known and supported, its shape's element count and byte size fit, it has exactly one of
//! `data` and `binary_data_size`, a binary size matches the shape and lies inside the binary
//! section, JSON `data` has as many elements as the shape needs; and the decode budget
//! ([`DecodeLimits`]) that all the tensors of a message share.

use std::collections::HashSet;

use serde_json::Value;

use super::convert::{decode_json, describe, Leaves};
use super::{DataType, OipError, Parameters, RawData, RawTensor, TensorKind, BINARY_DATA_SIZE};

/// Default cap on the decoded tensor bytes of one message (all tensors together): 2 GiB.
pub const DEFAULT_MAX_DECODED_BYTES: usize = 1 << 31;

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

/// Position in the binary section and what is left of the decode budget.
pub(super) struct Cursor<'a> {
    binary: &'a [u8],
    offset: usize,
    remaining: usize,
    limit: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(binary: &'a [u8], limits: &DecodeLimits) -> Self {
        Self {
            binary,
            offset: 0,
            remaining: limits.max_decoded_bytes,
            limit: limits.max_decoded_bytes,
        }
    }

    pub(super) fn finish(&self) -> Result<(), OipError> {
        match self.binary.len() - self.offset {
            0 => Ok(()),
            count => Err(OipError::TrailingBytes { count }),
        }
    }
}

/// The fields of a [`RequestInput`] or [`ResponseOutput`].
pub(super) struct WireTensor<'a> {
    pub(super) kind: TensorKind,
    pub(super) name: &'a str,
    pub(super) shape: &'a [i64],
    pub(super) datatype: &'a str,
    pub(super) parameters: Option<&'a Parameters>,
    pub(super) data: Option<Value>,
}

impl<'a> WireTensor<'a> {
    pub(super) fn decode(
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::oip::test_support::req_err;
    use crate::oip::{decode_request, decode_request_with_limits};

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
        let err = req_err(
            br#"{"inputs":[{"name":"x","shape":[1],"datatype":"BYTES","data":[1]}]}"#,
            None,
        );
        assert!(matches!(err, OipError::Unsupported { .. }), "{err}");
        assert_eq!(err.to_string(), "input 'x': datatype BYTES is not supported");
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
}
