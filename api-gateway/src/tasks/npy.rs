//! NumPy's `.npy` format (version 1.0), written for stored outputs: a magic string, a header
//! (a Python dict literal with the dtype, `fortran_order` and the shape, padded with spaces to
//! a multiple of 64 bytes and ended by a newline), then the values row-major, little-endian.
//! `numpy.load` reads it as the array the worker answered.

use vramgate_shared::oip::TensorData;

const MAGIC: &[u8] = b"\x93NUMPY\x01\x00";

/// `data` of `shape` as a `.npy` file; an error for a datatype it does not write.
pub fn encode(shape: &[usize], data: &TensorData) -> Result<Vec<u8>, String> {
    let (descr, body): (&str, Vec<u8>) = match data {
        TensorData::Bool(v) => ("|b1", v.iter().map(|&b| u8::from(b)).collect()),
        TensorData::Uint8(v) => ("|u1", v.clone()),
        TensorData::Int32(v) => ("<i4", v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        TensorData::Int64(v) => ("<i8", v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        TensorData::Fp16(v) => ("<f2", v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()),
        TensorData::Fp32(v) => ("<f4", v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        other => return Err(format!("{} is not written as .npy here", other.datatype().as_str())),
    };
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    // A one-dimensional shape is `(n,)` in Python.
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Magic (8) + header length (2) + header, a multiple of 64, the header ending in '\n'.
    let unpadded = MAGIC.len() + 2 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = Vec::with_capacity(MAGIC.len() + 2 + header.len() + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_aligned_and_describes_the_array() {
        let npy = encode(&[2, 3], &TensorData::Fp32(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0])).expect("encodes");
        assert_eq!(&npy[..8], MAGIC);
        let len = u16::from_le_bytes([npy[8], npy[9]]) as usize;
        assert_eq!((10 + len) % 64, 0);
        let header = std::str::from_utf8(&npy[10..10 + len]).expect("ascii");
        assert!(header.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"), "{header}");
        assert!(header.ends_with('\n'));
        assert_eq!(npy.len(), 10 + len + 24);
        assert_eq!(&npy[10 + len + 4..10 + len + 8], &1.0f32.to_le_bytes());
        let one = encode(&[3], &TensorData::Uint8(vec![1, 2, 3])).expect("encodes");
        assert!(String::from_utf8_lossy(&one).contains("'shape': (3,)"));
        let scalar = encode(&[], &TensorData::Int64(vec![7])).expect("encodes");
        assert!(String::from_utf8_lossy(&scalar).contains("'shape': ()"));
    }
}
