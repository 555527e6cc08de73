//! GGML tensor types: block layouts and dequantization (the CPU matrix kernels over them live in
//! [`crate::cpu::matmul`]).
//!
//! Invariant: every dequantization here is bit-identical to GGML's reference code (and to gguf-py,
//! which Hugging Face transformers uses to load GGUF files), because greedy output is compared
//! token for token against transformers. Each block-quantized row is `cols / block_len` blocks.

use crate::error::{EngineError, Result};

pub use tandem_model::ggml::GgmlType;

/// Dequantizes `out.len()` elements stored as `dtype` in `bytes` into `out`.
///
/// `out.len()` must be a multiple of the block length and `bytes` exactly as long as those
/// elements need; anything else is an [`EngineError::Internal`] (the loaders validate sizes first,
/// so a mismatch here is a bug in the caller). The values are bit-identical to GGML's reference
/// dequantization (and gguf-py's, which Hugging Face transformers uses).
pub fn dequantize(dtype: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let bl = dtype.block_len();
    if !out.len().is_multiple_of(bl) {
        return Err(EngineError::Internal(format!(
            "dequantize {dtype}: {} elements is not a multiple of the block length {bl}",
            out.len()
        )));
    }
    let need = dtype.row_bytes(out.len());
    if bytes.len() != need {
        return Err(EngineError::Internal(format!(
            "dequantize {dtype}: {} elements need {need} bytes, got {}",
            out.len(),
            bytes.len()
        )));
    }
    dequantize_unchecked(dtype, bytes, out);
    Ok(())
}

/// Dequantization without size checks. `bytes` must hold at least the blocks of `out` (slices are
/// still bounds-checked, so a violation panics rather than reading out of bounds).
pub(crate) fn dequantize_unchecked(dtype: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let bb = dtype.block_bytes();
    let bl = dtype.block_len();
    match dtype {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_le(c[0], c[1]);
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        _ => {
            for (o, b) in out.chunks_exact_mut(bl).zip(bytes.chunks_exact(bb)) {
                dequantize_block(dtype, b, o);
            }
        }
    }
}

/// An IEEE half stored little-endian, widened exactly to `f32`.
#[inline(always)]
pub(crate) fn f16_le(lo: u8, hi: u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

/// Dequantizes one block of a block-quantized type. The operation order (`d * q + m`, `d * sc`
/// rounded to f32 before multiplying the quant, ...) follows GGML's reference code exactly, so
/// the results are bit-identical; `out.len() == dtype.block_len()`.
pub(crate) fn dequantize_block(dtype: GgmlType, b: &[u8], out: &mut [f32]) {
    match dtype {
        GgmlType::Q4_0 => {
            // d: f16, qs[16]: element j in the low nibble of qs[j], element j + 16 in the high one.
            let d = f16_le(b[0], b[1]);
            let qs = &b[2..18];
            for j in 0..16 {
                out[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
                out[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            // d: f16, m: f16, qs[16]; value = d * q + m (rounded after the product and the sum).
            let d = f16_le(b[0], b[1]);
            let m = f16_le(b[2], b[3]);
            let qs = &b[4..20];
            for j in 0..16 {
                out[j] = d * (qs[j] & 0x0F) as f32 + m;
                out[j + 16] = d * (qs[j] >> 4) as f32 + m;
            }
        }
        GgmlType::Q8_0 => {
            let d = f16_le(b[0], b[1]);
            for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                *o = q as i8 as f32 * d;
            }
        }
        GgmlType::Q4_K => {
            // d, dmin: f16; scales[12]: eight 6-bit (scale, min) pairs; qs[128]: 4-bit quants,
            // 64 elements per 32 bytes (low nibbles first, then high nibbles).
            let d = f16_le(b[0], b[1]);
            let dmin = f16_le(b[2], b[3]);
            let scales = &b[4..16];
            let qs = &b[16..144];
            for chunk in 0..4 {
                let (sc0, m0) = q4k_scale_min(2 * chunk, scales);
                let (sc1, m1) = q4k_scale_min(2 * chunk + 1, scales);
                let (d0, dm0) = (d * sc0 as f32, dmin * m0 as f32);
                let (d1, dm1) = (d * sc1 as f32, dmin * m1 as f32);
                let q = &qs[32 * chunk..32 * chunk + 32];
                let o = &mut out[64 * chunk..64 * chunk + 64];
                for l in 0..32 {
                    o[l] = d0 * (q[l] & 0x0F) as f32 - dm0;
                    o[l + 32] = d1 * (q[l] >> 4) as f32 - dm1;
                }
            }
        }
        GgmlType::Q6_K => {
            // ql[128]: low 4 bits, qh[64]: high 2 bits, scales[16]: i8 per 16 elements, d: f16.
            let ql = &b[0..128];
            let qh = &b[128..192];
            let sc = &b[192..208];
            let d = f16_le(b[208], b[209]);
            for half in 0..2 {
                let ql = &ql[64 * half..64 * half + 64];
                let qh = &qh[32 * half..32 * half + 32];
                let o = &mut out[128 * half..128 * half + 128];
                for l in 0..32 {
                    let h = qh[l];
                    let q = [
                        (ql[l] & 0x0F) | ((h & 3) << 4),
                        (ql[l + 32] & 0x0F) | (((h >> 2) & 3) << 4),
                        (ql[l] >> 4) | (((h >> 4) & 3) << 4),
                        (ql[l + 32] >> 4) | (((h >> 6) & 3) << 4),
                    ];
                    for (g, &qv) in q.iter().enumerate() {
                        let e = 32 * g + l;
                        let scale = d * (sc[8 * half + e / 16] as i8) as f32;
                        o[e] = scale * (qv as i32 - 32) as f32;
                    }
                }
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            dequantize_unchecked(dtype, b, out);
        }
    }
}

/// The `j`-th (scale, min) pair of a Q4_K block's packed 12-byte scale array.
#[inline(always)]
fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for t in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::BF16,
        ] {
            assert_eq!(GgmlType::from_ggml_id(t as u32), Some(t));
            assert!(!t.name().is_empty());
        }
        assert_eq!(GgmlType::from_ggml_id(6), None); // Q5_0: not supported
        assert_eq!(GgmlType::from_ggml_id(u32::MAX), None);
    }

    #[test]
    fn q4_1_by_hand() {
        // d = 0.5, m = -1.0, byte j = (j << 4) | (15 - j) for j < 16.
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(-1.0).to_bits().to_le_bytes());
        for j in 0..16 {
            b[4 + j] = ((j as u8) << 4) | (15 - j as u8);
        }
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_1, &b, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * (15 - j) as f32 - 1.0);
            assert_eq!(out[j + 16], 0.5 * j as f32 - 1.0);
        }
    }

    #[test]
    fn size_mismatch_is_an_error() {
        let mut out = [0f32; 32];
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33], &mut out).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], &mut out[..31]).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], &mut out).is_ok());
    }
}
