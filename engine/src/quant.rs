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
        GgmlType::Q5_0 => {
            // d: f16, qh: u32 whose bit j is the fifth bit of element j, qs[16]: the low four bits
            // laid out as in Q4_0. The quant is offset by 16, like Q4_0's by 8.
            let d = f16_le(b[0], b[1]);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            for j in 0..16 {
                let lo = (qs[j] & 0x0F) as i32 | (((qh >> j) & 1) << 4) as i32;
                let hi = (qs[j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
                out[j] = (lo - 16) as f32 * d;
                out[j + 16] = (hi - 16) as f32 * d;
            }
        }
        GgmlType::Q5_1 => {
            // d: f16, m: f16, then qh and qs as in Q5_0; value = d * q + m as in Q4_1.
            let d = f16_le(b[0], b[1]);
            let m = f16_le(b[2], b[3]);
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let qs = &b[8..24];
            for j in 0..16 {
                let lo = (qs[j] & 0x0F) as u32 | (((qh >> j) & 1) << 4);
                let hi = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
                out[j] = d * lo as f32 + m;
                out[j + 16] = d * hi as f32 + m;
            }
        }
        GgmlType::Q8_0 => {
            let d = f16_le(b[0], b[1]);
            for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                *o = q as i8 as f32 * d;
            }
        }
        GgmlType::Q2_K => {
            // scales[16]: one byte per 16 elements, scale in the low nibble and min in the high
            // one; qs[64]: 2-bit quants; d, dmin: f16 (stored last). Each 32-byte half of qs holds
            // 128 elements: bits 2s..2s+2 of byte l are element 32 s + l of that half.
            let sc = &b[0..16];
            let qs = &b[16..80];
            let d = f16_le(b[80], b[81]);
            let dmin = f16_le(b[82], b[83]);
            // Scale and min are each rounded to f32 before they meet the quant, as in GGML.
            let dl: [f32; 16] = std::array::from_fn(|g| d * (sc[g] & 0x0F) as f32);
            let ml: [f32; 16] = std::array::from_fn(|g| dmin * (sc[g] >> 4) as f32);
            for half in 0..2 {
                let q = &qs[32 * half..32 * half + 32];
                for s in 0..4 {
                    for (l, &byte) in q.iter().enumerate() {
                        let e = 128 * half + 32 * s + l;
                        let qv = (byte >> (2 * s)) & 3;
                        out[e] = dl[e / 16] * qv as f32 - ml[e / 16];
                    }
                }
            }
        }
        GgmlType::Q3_K => {
            // hmask[32]: bit k of byte l belongs to element 32 k + l; qs[64]: the low two bits,
            // laid out as in Q2_K; scales[12]: sixteen 6-bit scales offset by 32; d: f16 (last).
            let hmask = &b[0..32];
            let qs = &b[32..96];
            let sc = &b[96..108];
            let d = f16_le(b[108], b[109]);
            let dl: [f32; 16] = std::array::from_fn(|g| d * (q3k_scale(g, sc) - 32) as f32);
            for half in 0..2 {
                let q = &qs[32 * half..32 * half + 32];
                for s in 0..4 {
                    for l in 0..32 {
                        let e = 128 * half + 32 * s + l;
                        // A clear high bit subtracts 4 (GGML stores the bit inverted), so the
                        // quant is in -4..=3.
                        let high = (hmask[l] >> (e / 32)) & 1;
                        let qv = ((q[l] >> (2 * s)) & 3) as i32 - if high == 0 { 4 } else { 0 };
                        out[e] = dl[e / 16] * qv as f32;
                    }
                }
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
        GgmlType::Q5_K => {
            // As Q4_K (same d, dmin, scales and low nibbles) plus qh[32] before the nibbles: bit k
            // of qh[l] is the fifth bit of element 32 k + l.
            let d = f16_le(b[0], b[1]);
            let dmin = f16_le(b[2], b[3]);
            let scales = &b[4..16];
            let qh = &b[16..48];
            let qs = &b[48..176];
            for chunk in 0..4 {
                let (sc0, m0) = q4k_scale_min(2 * chunk, scales);
                let (sc1, m1) = q4k_scale_min(2 * chunk + 1, scales);
                let (d0, dm0) = (d * sc0 as f32, dmin * m0 as f32);
                let (d1, dm1) = (d * sc1 as f32, dmin * m1 as f32);
                let q = &qs[32 * chunk..32 * chunk + 32];
                let o = &mut out[64 * chunk..64 * chunk + 64];
                for l in 0..32 {
                    let h0 = ((qh[l] >> (2 * chunk)) & 1) << 4;
                    let h1 = ((qh[l] >> (2 * chunk + 1)) & 1) << 4;
                    o[l] = d0 * ((q[l] & 0x0F) | h0) as f32 - dm0;
                    o[l + 32] = d1 * ((q[l] >> 4) | h1) as f32 - dm1;
                }
            }
        }
        GgmlType::Q6_K => {
            // ql[128]: low 4 bits, qh[64]: high 2 bits, scales[16]: i8 per 16 elements, d: f16.
            let ql = &b[0..128];
            let qh = &b[128..192];
            let sc = &b[192..208];
            let d = f16_le(b[208], b[209]);
            for (e, &qv) in q6k_quants(ql, qh).iter().enumerate() {
                let scale = d * (sc[e / 16] as i8) as f32;
                out[e] = scale * (qv as i32 - 32) as f32;
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            dequantize_unchecked(dtype, b, out);
        }
    }
}

/// A Q6_K block's 256 quants (`0..64`, before the offset of 32) in element order, from its low
/// four bits `ql` and high two bits `qh`: in each half of 128 elements, byte `l` of the half's 64
/// `ql` bytes holds elements `l` (low nibble) and `l + 64` (high), byte `l + 32` elements `l + 32`
/// and `l + 96`, and byte `l` of its 32 `qh` bytes their high bits, two each.
pub(crate) fn q6k_quants(ql: &[u8], qh: &[u8]) -> [u8; 256] {
    let mut u = [0u8; 256];
    for half in 0..2 {
        let (ql, qh) = (&ql[64 * half..64 * half + 64], &qh[32 * half..32 * half + 32]);
        for l in 0..32 {
            let h = qh[l];
            let q = [
                (ql[l] & 0x0F) | ((h & 3) << 4),
                (ql[l + 32] & 0x0F) | (((h >> 2) & 3) << 4),
                (ql[l] >> 4) | (((h >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((h >> 6) & 3) << 4),
            ];
            for (g, &qv) in q.iter().enumerate() {
                u[128 * half + 32 * g + l] = qv;
            }
        }
    }
    u
}

/// The `j`-th of the sixteen 6-bit scales (0..=63, before the offset of 32) packed in a Q3_K
/// block's 12 bytes: the low four bits are nibbles of bytes 0..8 (low nibbles first), the high two
/// bits are 2-bit fields of bytes 8..12 (byte 8 + j % 4, field j / 4).
#[inline(always)]
pub(crate) fn q3k_scale(j: usize, q: &[u8]) -> i32 {
    let low = if j < 8 { q[j] & 0x0F } else { q[j - 8] >> 4 };
    let high = (q[8 + j % 4] >> (2 * (j / 4))) & 3;
    (low | (high << 4)) as i32
}

/// The `j`-th (scale, min) pair of a Q4_K block's packed 12-byte scale array.
#[inline(always)]
pub(crate) fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
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
        // GGML's ids, names and block geometry (ggml.h / gguf-py's GGML_QUANT_SIZES).
        let table = [
            (0, "F32", 1, 4),
            (1, "F16", 1, 2),
            (2, "Q4_0", 32, 18),
            (3, "Q4_1", 32, 20),
            (6, "Q5_0", 32, 22),
            (7, "Q5_1", 32, 24),
            (8, "Q8_0", 32, 34),
            (10, "Q2_K", 256, 84),
            (11, "Q3_K", 256, 110),
            (12, "Q4_K", 256, 144),
            (13, "Q5_K", 256, 176),
            (14, "Q6_K", 256, 210),
            (30, "BF16", 1, 2),
        ];
        assert_eq!(table.len(), GgmlType::ALL.len());
        for (id, name, bl, bb) in table {
            let t = GgmlType::from_ggml_id(id).unwrap_or_else(|| panic!("id {id} ({name})"));
            assert_eq!((t as u32, t.name(), t.block_len(), t.block_bytes()), (id, name, bl, bb));
        }
        assert_eq!(GgmlType::from_ggml_id(9), None); // Q8_1: not supported
        assert_eq!(GgmlType::from_ggml_id(u32::MAX), None);
    }

    fn f16_bytes(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn q5_fifth_bit_by_hand() {
        // qs byte j = j (low nibble j, high nibble 0); qh has the bits of elements 1 and 17 set.
        let qh: u32 = (1 << 1) | (1 << 17);
        let mut b0 = vec![0u8; 22];
        b0[0..2].copy_from_slice(&f16_bytes(0.25));
        b0[2..6].copy_from_slice(&qh.to_le_bytes());
        let mut b1 = vec![0u8; 24];
        b1[0..2].copy_from_slice(&f16_bytes(0.25));
        b1[2..4].copy_from_slice(&f16_bytes(-2.0));
        b1[4..8].copy_from_slice(&qh.to_le_bytes());
        for j in 0..16 {
            b0[6 + j] = j as u8;
            b1[8 + j] = j as u8;
        }
        let (mut o0, mut o1) = ([0f32; 32], [0f32; 32]);
        dequantize(GgmlType::Q5_0, &b0, &mut o0).unwrap();
        dequantize(GgmlType::Q5_1, &b1, &mut o1).unwrap();
        for j in 0..32 {
            let q = if j < 16 { j } else { 0 } + if j == 1 || j == 17 { 16 } else { 0 };
            assert_eq!(o0[j], (q as f32 - 16.0) * 0.25, "Q5_0 element {j}");
            assert_eq!(o1[j], q as f32 * 0.25 - 2.0, "Q5_1 element {j}");
        }
    }

    #[test]
    fn q3_k_by_hand() {
        // All 2-bit quants 3, high bits set only for elements 32..64 (bit 1 of every hmask byte),
        // every 6-bit scale 33 (low nibble 1, high bits 2): scale = d * (33 - 32) = d.
        let mut b = vec![0u8; 110];
        b[0..32].fill(0b10);
        b[32..96].fill(0xFF);
        b[96..104].fill(0x11);
        b[104..108].fill(0b1010_1010);
        b[108..110].copy_from_slice(&f16_bytes(0.5));
        let mut out = [0f32; 256];
        dequantize(GgmlType::Q3_K, &b, &mut out).unwrap();
        for (e, &v) in out.iter().enumerate() {
            let want = if (32..64).contains(&e) { 3.0 * 0.5 } else { (3.0 - 4.0) * 0.5 };
            assert_eq!(v, want, "element {e}");
        }
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
