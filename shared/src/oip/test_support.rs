//! Helpers the unit tests of several `oip` submodules share: sample tensors of every
//! supported type, requested outputs, and decoding a request that must fail.

#![allow(clippy::unwrap_used)]

use super::{decode_request, OipError, RequestOutputSpec, Tensor, F16};

/// One tensor of every supported type, with extreme values.
pub(super) fn samples() -> Vec<Tensor> {
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
            "f16",
            vec![5],
            [0x3555u16, 0x8000, 0x7bff, 0x0001, 0xfbff]
                .map(F16::from_bits)
                .to_vec(),
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

pub(super) fn outputs_of(names: &[&str], binary: bool) -> Vec<RequestOutputSpec> {
    names
        .iter()
        .map(|n| RequestOutputSpec {
            name: (*n).into(),
            binary,
        })
        .collect()
}

pub(super) fn req_err(body: &[u8], header_len: Option<usize>) -> OipError {
    decode_request(body, header_len).unwrap_err()
}
