//! k-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) for the integer kernels of [`super`] (`q8`).
//!
//! # What a k-quant is, read uniformly
//! Every k-quant super-block of 256 weights is, per element `e`,
//! `d · sc[e / sub] · (u[e] − offset) − dmin · mn[e / sub]`, with `d` and `dmin` f16 per super-block,
//! small integer sub-block scales `sc` and minimums `mn`, and unsigned quants `u`:
//!
//! | type | sub-block | `u` | `sc` | `mn` | offset |
//! |---|---:|---|---|---|---:|
//! | Q2_K | 16 | 0..4 | 0..16 | 0..16 | 0 |
//! | Q3_K | 16 | 0..8 | −32..32 | — | 4 |
//! | Q4_K | 32 | 0..16 | 0..64 | 0..64 | 0 |
//! | Q5_K | 32 | 0..32 | 0..64 | 0..64 | 0 |
//! | Q6_K | 16 | 0..64 | −128..128 | — | 32 |
//!
//! `d · sc` and `dmin · mn` are exact in f32 (an f16 times an integer below 2⁷), and they are what
//! `dequantize` multiplies each quant by, so this reading is the file's weights exactly.
//!
//! # Packed records
//! Rows are taken 16 at a time as in [`super`]; a record is 16 rows of one super-block:
//!
//! - `d`: 16 f32 (the rows' `d`), then for types with minimums 16 f32 holding `−dmin`;
//! - `sc`: one byte per row for every sub-block (`[sub-block j][row i]`, as i8), then `mn` alike;
//! - the low four bits of every `u`, eight blocks of 32 elements laid out as a Q4 record's quants
//!   (256 bytes per block; see `q8::place`);
//! - Q5_K's fifth bit, and Q6_K's fifth and sixth, as bit planes: 64 bytes per block and plane,
//!   one bit per quant nibble of the block, in the order the kernels add them (8-bit activations:
//!   eight 64-bit masks, one per 64-byte chunk and nibble; 16-bit activations: sixteen 32-bit
//!   masks, one per 32-byte chunk and nibble, over the chunk's bytes).
//!
//! Q4_K packs to 4.75 bits a weight (4.5 in the file), Q5_K to 5.75 (5.5), Q6_K to 6.625 (6.5625),
//! Q3_K to 4.625 (3.4375) and Q2_K to 5.25 (2.625): the last two keep their quants in nibbles,
//! which costs bytes but no kernel of their own, and files rarely hold them.
//!
//! # What is computed
//! For an activation block of 32 with scale `dx`, quants `q` and, per half of 16, sums `Σ q`:
//! per sub-block, the exact integer `Σ (u − offset) · q` times `d · sc · dx`, plus
//! `−dmin · mn · dx · Σ q` for types with minimums ([`reference`] in f64).

use crate::quant::{q3k_scale, q4k_scale_min, q6k_quants, GgmlType};
use crate::weights::Matrix;

use super::{place, Tok, MAX_GROUP, QBLOCK, ROWS};

/// Elements per super-block.
pub(super) const SUPER: usize = 256;
/// Activation blocks per super-block.
pub(super) const BLOCKS: usize = SUPER / QBLOCK;
/// Bytes of one block's nibbles (16 rows × 32 quants / 2).
pub(super) const NIB_BYTES: usize = ROWS * QBLOCK / 2;
/// Bytes of one block's bit plane.
pub(super) const PLANE_BYTES: usize = ROWS * QBLOCK / 8;

/// How a k-quant type reads (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Kind {
    /// Elements per sub-block (16 or 32).
    pub sub: usize,
    /// Bits of `u`.
    pub bits: u32,
    /// Whether there are minimums.
    pub min: bool,
    /// Subtracted from `u`.
    pub offset: i32,
}

impl Kind {
    pub const fn of(dtype: GgmlType) -> Option<Kind> {
        Some(match dtype {
            GgmlType::Q2_K => Kind { sub: 16, bits: 2, min: true, offset: 0 },
            GgmlType::Q3_K => Kind { sub: 16, bits: 3, min: false, offset: 4 },
            GgmlType::Q4_K => Kind { sub: 32, bits: 4, min: true, offset: 0 },
            GgmlType::Q5_K => Kind { sub: 32, bits: 5, min: true, offset: 0 },
            GgmlType::Q6_K => Kind { sub: 16, bits: 6, min: false, offset: 32 },
            _ => return None,
        })
    }

    /// Sub-blocks per super-block.
    pub(super) const fn nsub(self) -> usize {
        SUPER / self.sub
    }

    /// Bit planes past the nibble.
    pub(super) const fn planes(self) -> usize {
        if self.bits > 4 {
            (self.bits - 4) as usize
        } else {
            0
        }
    }

    /// Offset of the sub-block scales in a record.
    pub const fn sc_at(self) -> usize {
        4 * ROWS * if self.min { 2 } else { 1 }
    }

    /// Offset of the sub-block minimums.
    pub const fn mn_at(self) -> usize {
        self.sc_at() + self.nsub() * ROWS
    }

    /// Offset of the nibbles.
    pub const fn q_at(self) -> usize {
        self.mn_at() + if self.min { self.nsub() * ROWS } else { 0 }
    }

    /// Offset of bit plane `p` (0: the fifth bit, 1: the sixth).
    pub const fn plane_at(self, p: usize) -> usize {
        self.q_at() + BLOCKS * NIB_BYTES + p * BLOCKS * PLANE_BYTES
    }

    /// Bytes of a record.
    pub const fn record_bytes(self) -> usize {
        self.plane_at(self.planes())
    }
}

/// One super-block of a source row, read uniformly.
struct Super {
    d: f32,
    dmin: f32,
    sc: [i8; 16],
    mn: [u8; 16],
    u: [u8; SUPER],
}

/// Reads a source super-block of `dtype` (the layouts `quant::dequantize_block` documents).
fn read_super(dtype: GgmlType, b: &[u8]) -> Super {
    let f16 = |at: usize| half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32();
    let mut s = Super { d: 0.0, dmin: 0.0, sc: [0; 16], mn: [0; 16], u: [0; SUPER] };
    match dtype {
        GgmlType::Q2_K => {
            for g in 0..16 {
                s.sc[g] = (b[g] & 0x0F) as i8;
                s.mn[g] = b[g] >> 4;
            }
            let qs = &b[16..80];
            for e in 0..SUPER {
                let (half, s4, l) = (e / 128, (e % 128) / 32, e % 32);
                s.u[e] = (qs[32 * half + l] >> (2 * s4)) & 3;
            }
            s.d = f16(80);
            s.dmin = f16(82);
        }
        GgmlType::Q3_K => {
            let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
            for g in 0..16 {
                s.sc[g] = (q3k_scale(g, sc) - 32) as i8;
            }
            for e in 0..SUPER {
                let (half, s4, l) = (e / 128, (e % 128) / 32, e % 32);
                let low = (qs[32 * half + l] >> (2 * s4)) & 3;
                let high = (hmask[l] >> (e / 32)) & 1;
                s.u[e] = low | (high << 2);
            }
            s.d = f16(108);
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let scales = &b[4..16];
            for j in 0..8 {
                let (sc, m) = q4k_scale_min(j, scales);
                s.sc[j] = sc as i8;
                s.mn[j] = m;
            }
            let (qh, qs) =
                if dtype == GgmlType::Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for chunk in 0..4 {
                for l in 0..32 {
                    let byte = qs[32 * chunk + l];
                    let (e0, e1) = (64 * chunk + l, 64 * chunk + 32 + l);
                    s.u[e0] = byte & 0x0F;
                    s.u[e1] = byte >> 4;
                    if let Some(qh) = qh {
                        s.u[e0] |= ((qh[l] >> (2 * chunk)) & 1) << 4;
                        s.u[e1] |= ((qh[l] >> (2 * chunk + 1)) & 1) << 4;
                    }
                }
            }
            s.d = f16(0);
            s.dmin = f16(2);
        }
        GgmlType::Q6_K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            for g in 0..16 {
                s.sc[g] = sc[g] as i8;
            }
            s.u = q6k_quants(ql, qh);
            s.d = f16(208);
        }
        _ => unreachable!("read_super: {} is not a k-quant", dtype.name()),
    }
    s
}

/// Where the plane bit of element `e` (0..32) of row `i` lies in a block's plane: byte and bit.
fn plane_bit(wide: bool, i: usize, e: usize) -> (usize, u32) {
    let (mask, pos, mask_bytes) = if wide {
        (2 * (e / 4) + usize::from(e % 4 >= 2), 2 * i + e % 2, 4)
    } else {
        (2 * (e / 8) + usize::from(e % 8 >= 4), 4 * i + e % 4, 8)
    };
    (mask * mask_bytes + pos / 8, (pos % 8) as u32)
}

/// Packs `w` (a k-quant) into records (see the module documentation); rows past the last
/// multiple of 16 get zero scales.
pub(super) fn pack(w: &Matrix, wide: bool) -> Vec<u8> {
    let kind = Kind::of(w.dtype).expect("kq::pack: not a k-quant");
    let (bb, nsb) = (w.dtype.block_bytes(), w.cols / SUPER);
    let rec = kind.record_bytes();
    let groups = w.rows.div_ceil(ROWS);
    let mut data = vec![0u8; groups * nsb * rec];
    for (gi, group) in data.chunks_exact_mut(nsb * rec).enumerate() {
        for (sb, out) in group.chunks_exact_mut(rec).enumerate() {
            for i in 0..ROWS.min(w.rows - gi * ROWS) {
                let s = read_super(w.dtype, &w.row(gi * ROWS + i)[sb * bb..(sb + 1) * bb]);
                out[4 * i..4 * i + 4].copy_from_slice(&s.d.to_le_bytes());
                if kind.min {
                    out[4 * ROWS + 4 * i..4 * ROWS + 4 * i + 4].copy_from_slice(&(-s.dmin).to_le_bytes());
                }
                for j in 0..kind.nsub() {
                    out[kind.sc_at() + j * ROWS + i] = s.sc[j] as u8;
                    if kind.min {
                        out[kind.mn_at() + j * ROWS + i] = s.mn[j];
                    }
                }
                for blk in 0..BLOCKS {
                    for e in 0..QBLOCK {
                        let u = s.u[blk * QBLOCK + e];
                        let (at, high) = place(wide, true, i, e);
                        out[kind.q_at() + blk * NIB_BYTES + at] |=
                            if high { (u & 0x0F) << 4 } else { u & 0x0F };
                        let (byte, bit) = plane_bit(wide, i, e);
                        for p in 0..kind.planes() {
                            if (u >> (4 + p)) & 1 == 1 {
                                out[kind.plane_at(p) + blk * PLANE_BYTES + byte] |= 1 << bit;
                            }
                        }
                    }
                }
            }
        }
    }
    data
}

fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Quant `u` of element `e` (0..256) of row `i` in a record.
fn quant(kind: Kind, wide: bool, r: &[u8], i: usize, e: usize) -> i32 {
    let (blk, e) = (e / QBLOCK, e % QBLOCK);
    let (at, high) = place(wide, true, i, e);
    let byte = r[kind.q_at() + blk * NIB_BYTES + at];
    let mut u = if high { byte >> 4 } else { byte & 0x0F } as i32;
    let (pb, bit) = plane_bit(wide, i, e);
    for p in 0..kind.planes() {
        u |= (((r[kind.plane_at(p) + blk * PLANE_BYTES + pb] >> bit) & 1) as i32) << (4 + p);
    }
    u
}

/// One token against one packed row group, in plain Rust (also the reference reading of the
/// records).
pub(super) fn portable_dot(dtype: GgmlType, wide: bool, group: &[u8], t: &Tok<'_>, acc: &mut [f32; ROWS]) {
    let kind = Kind::of(dtype).expect("kq: not a k-quant");
    *acc = [0.0; ROWS];
    for (sb, r) in group.chunks_exact(kind.record_bytes()).enumerate() {
        for (i, a) in acc.iter_mut().enumerate() {
            let d = f32_at(r, 4 * i);
            for j in 0..kind.nsub() {
                let e0 = j * kind.sub;
                let s: i32 = (e0..e0 + kind.sub)
                    .map(|e| (quant(kind, wide, r, i, e) - kind.offset) * t.q(sb * SUPER + e))
                    .sum();
                let b = (sb * SUPER + e0) / QBLOCK;
                let scale = d * r[kind.sc_at() + j * ROWS + i] as i8 as f32;
                *a += scale * t.d[b] * s as f32;
                if kind.min {
                    let m = f32_at(r, 4 * ROWS + 4 * i) * r[kind.mn_at() + j * ROWS + i] as f32;
                    *a += m * t.d[b] * t.sub_sum(kind.sub, sb * SUPER + e0) as f32;
                }
            }
        }
    }
}

/// The formula of the module documentation in f64 for row `r` of `w` and a token (tests compare
/// the kernels and the packing against it).
pub(super) fn reference(w: &Matrix, t: &Tok<'_>, r: usize) -> f64 {
    let kind = Kind::of(w.dtype).expect("kq: not a k-quant");
    let bb = w.dtype.block_bytes();
    let mut acc = 0f64;
    for (sb, blk) in w.row(r).chunks_exact(bb).enumerate() {
        let s = read_super(w.dtype, blk);
        for e in 0..SUPER {
            let c = sb * SUPER + e;
            let j = e / kind.sub;
            let wv = s.d as f64 * s.sc[j] as f64 * (s.u[e] as i32 - kind.offset) as f64
                - s.dmin as f64 * s.mn[j] as f64;
            acc += wv * t.d[c / QBLOCK] as f64 * t.q(c) as f64;
        }
    }
    acc
}

/// `acc[i][k] = dot(row k of the group, toks[i])`, on the chosen kernel set (`fetch`: prefetch
/// the weights ahead).
pub(super) fn dot_group(
    isa: super::Isa8,
    dtype: GgmlType,
    wide: bool,
    group: &[u8],
    toks: &[Tok<'_>],
    acc: &mut [[f32; ROWS]; MAX_GROUP],
    fetch: bool,
) {
    use super::Isa8;
    macro_rules! by_count {
        ($($f:ident)::+) => {
            match toks.len() {
                1 => $($f)::+::<1>(dtype, group, toks, acc, fetch),
                2 => $($f)::+::<2>(dtype, group, toks, acc, fetch),
                3 => $($f)::+::<3>(dtype, group, toks, acc, fetch),
                4 => $($f)::+::<4>(dtype, group, toks, acc, fetch),
                5 => $($f)::+::<5>(dtype, group, toks, acc, fetch),
                6 => $($f)::+::<6>(dtype, group, toks, acc, fetch),
                7 => $($f)::+::<7>(dtype, group, toks, acc, fetch),
                _ => $($f)::+::<8>(dtype, group, toks, acc, fetch),
            }
        };
    }
    match isa {
        // SAFETY: the ISA came from `Isa8::available` (checked by the public entry points), and
        // the caller hands each kernel at most its group of tokens, with whole records.
        #[cfg(target_arch = "x86_64")]
        Isa8::Avx512Vnni if wide => unsafe { by_count!(x86::dot16_avx512) },
        #[cfg(target_arch = "x86_64")]
        Isa8::Avx512Vnni => unsafe { by_count!(x86::dot_avx512) },
        #[cfg(target_arch = "x86_64")]
        Isa8::Avx2 if !wide => unsafe { by_count!(x86::dot_avx2) },
        #[cfg(target_arch = "x86_64")]
        Isa8::Avx2 => unsafe { by_count!(x86::dot16_avx2) },
        _ => {
            for (a, t) in acc.iter_mut().zip(toks) {
                portable_dot(dtype, wide, group, t, a);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::cpu::q8::x86::{dpwssd, parts, prefetch_ahead, store, store_half, PARTS};
    use std::arch::x86_64::*;

    /// The four 8-bit quants of a token at element `e` as one 32-bit word.
    #[inline]
    fn quad(t: &Tok<'_>, e: usize) -> i32 {
        let q = &t.qs[e..e + 4];
        // SAFETY: q holds 4 bytes.
        unsafe { (q.as_ptr() as *const i32).read_unaligned() }
    }

    /// Two 16-bit quants of a token at element `e` as one 32-bit word.
    #[inline]
    fn pair(t: &Tok<'_>, e: usize) -> i32 {
        let q = &t.qw[e..e + 2];
        // SAFETY: q holds 2 × 2 bytes.
        unsafe { (q.as_ptr() as *const i32).read_unaligned() }
    }

    /// Calls `$f::<T, K>(args)` with the type code `K` of `dtype` (2..=6 for Q2_K..Q6_K).
    macro_rules! by_type {
        ($dtype:expr, $f:ident::<$t:ident>($($arg:expr),*)) => {
            match $dtype {
                GgmlType::Q2_K => $f::<$t, 2>($($arg),*),
                GgmlType::Q3_K => $f::<$t, 3>($($arg),*),
                GgmlType::Q4_K => $f::<$t, 4>($($arg),*),
                GgmlType::Q5_K => $f::<$t, 5>($($arg),*),
                _ => $f::<$t, 6>($($arg),*),
            }
        };
    }

    const fn kind(k: u8) -> Kind {
        match Kind::of(match k {
            2 => GgmlType::Q2_K,
            3 => GgmlType::Q3_K,
            4 => GgmlType::Q4_K,
            5 => GgmlType::Q5_K,
            _ => GgmlType::Q6_K,
        }) {
            Some(k) => k,
            None => panic!("kq: type code"),
        }
    }

    /// Checks the sizes the kernels rely on: whole records, and tokens long enough for them.
    fn check(kind: Kind, group: &[u8], toks: &[Tok<'_>], wide: bool) -> usize {
        let nsb = group.len() / kind.record_bytes();
        assert_eq!(group.len(), nsb * kind.record_bytes(), "kq: group is not whole records");
        let (cols, nb) = (nsb * SUPER, nsb * BLOCKS);
        for t in toks {
            let q = if wide { t.qw.len() } else { t.qs.len() };
            assert!(
                q >= cols && t.d.len() >= nb && t.sum.len() >= nb && t.sum16.len() >= 2 * nb,
                "kq: token size"
            );
        }
        nsb
    }

    /// Adds one block's sums to the accumulators: per sub-block (one or two per block), the rows'
    /// `d · sc` times the token's `dx` times the integer sum, and the minimums' share.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
    fn scale_block<const T: usize, const K: u8>(
        acc: &mut [__m512; T],
        isum: &[[__m512i; 2]; T],
        r: *const u8,
        blk: usize,
        toks: &[Tok<'_>],
        b: usize,
    ) {
        let kind = kind(K);
        // SAFETY (all loads): the record holds 16 f32 `d` (and 16 `−dmin`) and 16 bytes of scales
        // (and minimums) per sub-block at the offsets `Kind` gives; the caller checked its size.
        let d = unsafe { _mm512_loadu_ps(r as *const f32) };
        let dmin = if kind.min { unsafe { _mm512_loadu_ps(r.add(4 * ROWS) as *const f32) } } else { d };
        let halves = QBLOCK / kind.sub;
        for h in 0..halves {
            let j = blk * halves + h;
            let sc = unsafe { _mm_loadu_si128(r.add(kind.sc_at() + j * ROWS) as *const __m128i) };
            let rs = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
            let rm = if kind.min {
                let mn = unsafe { _mm_loadu_si128(r.add(kind.mn_at() + j * ROWS) as *const __m128i) };
                _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)))
            } else {
                rs
            };
            for ((a, s), t) in acc.iter_mut().zip(isum).zip(toks) {
                let dx = t.d[b];
                *a = _mm512_fmadd_ps(_mm512_mul_ps(rs, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(s[h]), *a);
                if kind.min {
                    let qsum = if halves == 1 { t.sum[b] } else { t.sum16[2 * b + h] };
                    *a = _mm512_fmadd_ps(rm, _mm512_set1_ps(dx * qsum as f32), *a);
                }
            }
        }
    }

    /// Accumulators per sub-block of a block for `T` tokens: a block's one or two sub-blocks share
    /// [`PARTS`] independent partial sums (see `q8::x86::parts`).
    const fn per_sub(kind: Kind, t: usize) -> usize {
        let p = parts(t);
        if kind.sub == 16 {
            if p >= 2 {
                p / 2
            } else {
                1
            }
        } else {
            p
        }
    }

    /// Starting partial sums of a block: `−offset · Σ q` per half for types with an offset, in
    /// each half's first accumulator.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn start<const T: usize>(kind: Kind, toks: &[Tok<'_>], b: usize) -> [[__m512i; PARTS]; T] {
        let mut part = [[_mm512_setzero_si512(); PARTS]; T];
        if kind.offset != 0 {
            let sp = per_sub(kind, T);
            for (s, t) in part.iter_mut().zip(toks) {
                for h in 0..2 {
                    s[h * sp] = _mm512_set1_epi32(-kind.offset * t.sum16[2 * b + h]);
                }
            }
        }
        part
    }

    /// Each token's sums per sub-block of the block (the second is zero for sub-blocks of 32).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn sub_sums<const T: usize>(kind: Kind, part: &[[__m512i; PARTS]; T]) -> [[__m512i; 2]; T] {
        let sp = per_sub(kind, T);
        std::array::from_fn(|i| {
            std::array::from_fn(|h| {
                let mut s = _mm512_setzero_si512();
                if h * sp < PARTS && (h == 0 || kind.sub == 16) {
                    for k in 0..sp {
                        s = _mm512_add_epi32(s, part[i][h * sp + k]);
                    }
                }
                s
            })
        })
    }

    /// The accumulator the `k`-th multiply-add of sub-block `h` goes to.
    #[inline(always)]
    fn slot(kind: Kind, t: usize, h: usize, k: usize) -> usize {
        let sp = per_sub(kind, t);
        h * sp + k % sp
    }

    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL/VNNI; `toks.len() == T <= MAX_GROUP`, the tokens are
    /// quantized to 8 bits, and `group` is whole records of `dtype` packed for them.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
    pub(super) unsafe fn dot_avx512<const T: usize>(
        dtype: GgmlType,
        group: &[u8],
        toks: &[Tok<'_>],
        acc: &mut [[f32; ROWS]; MAX_GROUP],
        fetch: bool,
    ) {
        by_type!(dtype, dot_avx512_k::<T>(group, toks, acc, fetch))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
    fn dot_avx512_k<const T: usize, const K: u8>(
        group: &[u8],
        toks: &[Tok<'_>],
        out: &mut [[f32; ROWS]; MAX_GROUP],
        fetch: bool,
    ) {
        let kind = kind(K);
        let nsb = check(kind, group, toks, false);
        let low = _mm512_set1_epi8(0x0F);
        let (b4, b5) = (_mm512_set1_epi8(16), _mm512_set1_epi8(32));
        let mut acc = [_mm512_setzero_ps(); T];
        for sb in 0..nsb {
            // SAFETY: record sb lies inside `group` (checked).
            let r = unsafe { group.as_ptr().add(sb * kind.record_bytes()) };
            if fetch {
                prefetch_ahead(r, kind.record_bytes());
            }
            for blk in 0..BLOCKS {
                let b = sb * BLOCKS + blk;
                let e0 = b * QBLOCK;
                let mut part = start::<T>(kind, toks, b);
                for c in 0..QBLOCK / 8 {
                    // SAFETY: the block's nibbles are 4 chunks of 64 bytes, its planes 8 masks of
                    // 8 bytes each.
                    let v = unsafe {
                        _mm512_loadu_si512(r.add(kind.q_at() + blk * NIB_BYTES + 64 * c) as *const _)
                    };
                    let mut lo = _mm512_and_si512(v, low);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                    if kind.bits > 4 {
                        let m = unsafe { r.add(kind.plane_at(0) + blk * PLANE_BYTES + 16 * c) as *const u64 };
                        let (ml, mh) = unsafe { (m.read_unaligned(), m.add(1).read_unaligned()) };
                        lo = _mm512_mask_add_epi8(lo, ml, lo, b4);
                        hi = _mm512_mask_add_epi8(hi, mh, hi, b4);
                    }
                    if kind.bits > 5 {
                        let m = unsafe { r.add(kind.plane_at(1) + blk * PLANE_BYTES + 16 * c) as *const u64 };
                        let (ml, mh) = unsafe { (m.read_unaligned(), m.add(1).read_unaligned()) };
                        lo = _mm512_mask_add_epi8(lo, ml, lo, b5);
                        hi = _mm512_mask_add_epi8(hi, mh, hi, b5);
                    }
                    let (h, k) = if kind.sub == 16 { (c / 2, 2 * (c % 2)) } else { (0, 2 * c) };
                    let (i, j) = (slot(kind, T, h, k), slot(kind, T, h, k + 1));
                    for (s, t) in part.iter_mut().zip(toks) {
                        s[i] = _mm512_dpbusd_epi32(s[i], lo, _mm512_set1_epi32(quad(t, e0 + 8 * c)));
                        s[j] = _mm512_dpbusd_epi32(s[j], hi, _mm512_set1_epi32(quad(t, e0 + 8 * c + 4)));
                    }
                }
                scale_block::<T, K>(&mut acc, &sub_sums::<T>(kind, &part), r, blk, toks, b);
            }
        }
        store(out, &acc);
    }

    /// # Safety
    /// As [`dot_avx512`], with the tokens quantized to 16 bits and `group` packed for them.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
    pub(super) unsafe fn dot16_avx512<const T: usize>(
        dtype: GgmlType,
        group: &[u8],
        toks: &[Tok<'_>],
        acc: &mut [[f32; ROWS]; MAX_GROUP],
        fetch: bool,
    ) {
        by_type!(dtype, dot16_avx512_k::<T>(group, toks, acc, fetch))
    }

    /// 16-bit activations: 32 nibble bytes widened to 16 bits give every row's lane two weights.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
    fn dot16_avx512_k<const T: usize, const K: u8>(
        group: &[u8],
        toks: &[Tok<'_>],
        out: &mut [[f32; ROWS]; MAX_GROUP],
        fetch: bool,
    ) {
        let kind = kind(K);
        let nsb = check(kind, group, toks, true);
        let low = _mm512_set1_epi16(0x0F);
        let (b4, b5) = (_mm512_set1_epi16(16), _mm512_set1_epi16(32));
        let mut acc = [_mm512_setzero_ps(); T];
        for sb in 0..nsb {
            // SAFETY: record sb lies inside `group` (checked).
            let r = unsafe { group.as_ptr().add(sb * kind.record_bytes()) };
            if fetch {
                prefetch_ahead(r, kind.record_bytes());
            }
            for blk in 0..BLOCKS {
                let b = sb * BLOCKS + blk;
                let e0 = b * QBLOCK;
                let mut part = start::<T>(kind, toks, b);
                for c in 0..QBLOCK / 4 {
                    // SAFETY: the block's nibbles are 8 chunks of 32 bytes, its planes 16 masks
                    // of 4 bytes each.
                    let v = unsafe {
                        _mm256_loadu_si256(r.add(kind.q_at() + blk * NIB_BYTES + 32 * c) as *const _)
                    };
                    let w = _mm512_cvtepu8_epi16(v);
                    let (mut lo, mut hi) = (_mm512_and_si512(w, low), _mm512_srli_epi16::<4>(w));
                    if kind.bits > 4 {
                        let m = unsafe { r.add(kind.plane_at(0) + blk * PLANE_BYTES + 8 * c) as *const u32 };
                        let (ml, mh) = unsafe { (m.read_unaligned(), m.add(1).read_unaligned()) };
                        lo = _mm512_mask_add_epi16(lo, ml, lo, b4);
                        hi = _mm512_mask_add_epi16(hi, mh, hi, b4);
                    }
                    if kind.bits > 5 {
                        let m = unsafe { r.add(kind.plane_at(1) + blk * PLANE_BYTES + 8 * c) as *const u32 };
                        let (ml, mh) = unsafe { (m.read_unaligned(), m.add(1).read_unaligned()) };
                        lo = _mm512_mask_add_epi16(lo, ml, lo, b5);
                        hi = _mm512_mask_add_epi16(hi, mh, hi, b5);
                    }
                    let (h, k) = if kind.sub == 16 { (c / 4, 2 * (c % 4)) } else { (0, 2 * c) };
                    let (i, j) = (slot(kind, T, h, k), slot(kind, T, h, k + 1));
                    for (s, t) in part.iter_mut().zip(toks) {
                        s[i] = dpwssd(s[i], lo, _mm512_set1_epi32(pair(t, e0 + 4 * c)));
                        s[j] = dpwssd(s[j], hi, _mm512_set1_epi32(pair(t, e0 + 4 * c + 2)));
                    }
                }
                scale_block::<T, K>(&mut acc, &sub_sums::<T>(kind, &part), r, blk, toks, b);
            }
        }
        store(out, &acc);
    }

    /// # Safety
    /// As [`dot_avx512`], with AVX2, FMA and F16C, and `T <= 4`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_avx2<const T: usize>(
        dtype: GgmlType,
        group: &[u8],
        toks: &[Tok<'_>],
        acc: &mut [[f32; ROWS]; MAX_GROUP],
        fetch: bool,
    ) {
        for half in 0..2 {
            by_type!(dtype, dot_avx2_k::<T>(group, toks, acc, half, fetch))
        }
    }

    /// 32 bits of a plane as 32 bytes: `val` where the bit is set, 0 elsewhere.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn expand(bits: u32, val: __m256i) -> __m256i {
        let v = _mm256_set1_epi32(bits as i32);
        let idx = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, idx), bit), bit);
        _mm256_and_si256(set, val)
    }

    /// One half (8 rows) of a group: 32 bytes of every 64-byte chunk.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_k<const T: usize, const K: u8>(
        group: &[u8],
        toks: &[Tok<'_>],
        out: &mut [[f32; ROWS]; MAX_GROUP],
        half: usize,
        fetch: bool,
    ) {
        let kind = kind(K);
        let nsb = check(kind, group, toks, false);
        let (low, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
        let (b4, b5) = (_mm256_set1_epi8(16), _mm256_set1_epi8(32));
        let mut acc = [_mm256_setzero_ps(); T];
        let (ro, qo) = (8 * half, 32 * half);
        for sb in 0..nsb {
            // SAFETY: record sb lies inside `group` (checked); every offset below is inside it
            // by `Kind`'s layout.
            let r = unsafe { group.as_ptr().add(sb * kind.record_bytes()) };
            let d = unsafe { _mm256_loadu_ps((r as *const f32).add(ro)) };
            let dmin = unsafe { _mm256_loadu_ps((r.add(4 * ROWS) as *const f32).add(ro)) };
            if fetch && half == 0 {
                prefetch_ahead(r, kind.record_bytes());
            }
            for blk in 0..BLOCKS {
                let b = sb * BLOCKS + blk;
                let e0 = b * QBLOCK;
                let mut isum = start_half::<T>(kind, toks, b);
                for c in 0..QBLOCK / 8 {
                    let v = unsafe {
                        _mm256_loadu_si256(
                            r.add(kind.q_at() + blk * NIB_BYTES + 64 * c + qo) as *const __m256i
                        )
                    };
                    let mut lo = _mm256_and_si256(v, low);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                    for p in 0..kind.planes() {
                        let m = unsafe {
                            r.add(kind.plane_at(p) + blk * PLANE_BYTES + 16 * c + 4 * half) as *const u32
                        };
                        let (ml, mh) = unsafe { (m.read_unaligned(), m.add(2).read_unaligned()) };
                        let val = if p == 0 { b4 } else { b5 };
                        lo = _mm256_add_epi8(lo, expand(ml, val));
                        hi = _mm256_add_epi8(hi, expand(mh, val));
                    }
                    let h = if kind.sub == 16 { c / 2 } else { 0 };
                    for (s, t) in isum.iter_mut().zip(toks) {
                        let xl = _mm256_set1_epi32(quad(t, e0 + 8 * c));
                        let xh = _mm256_set1_epi32(quad(t, e0 + 8 * c + 4));
                        // Weights below 64 times quants within ±127: pair sums fit in i16.
                        let p = _mm256_add_epi32(
                            _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), ones),
                        );
                        s[h] = _mm256_add_epi32(s[h], p);
                    }
                }
                scale_half::<T>(kind, &mut acc, &isum, r, d, dmin, ro, blk, toks, b);
            }
        }
        store_half(out, &acc, half);
    }

    /// # Safety
    /// As [`dot16_avx512`], with AVX2, FMA and F16C, and `T <= 4`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot16_avx2<const T: usize>(
        dtype: GgmlType,
        group: &[u8],
        toks: &[Tok<'_>],
        acc: &mut [[f32; ROWS]; MAX_GROUP],
        fetch: bool,
    ) {
        for half in 0..2 {
            by_type!(dtype, dot16_avx2_k::<T>(group, toks, acc, half, fetch))
        }
    }

    /// 16 bits of a plane as 16 lanes of 16 bits: `val` where the bit is set, 0 elsewhere.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn expand16(bits: u32, val: __m256i) -> __m256i {
        let bit = _mm256_setr_epi16(
            0x0001, 0x0002, 0x0004, 0x0008, 0x0010, 0x0020, 0x0040, 0x0080, 0x0100, 0x0200, 0x0400, 0x0800,
            0x1000, 0x2000, 0x4000, -0x8000,
        );
        let v = _mm256_set1_epi16(bits as u16 as i16);
        _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(v, bit), bit), val)
    }

    /// One half (8 rows) of a group packed for 16-bit activations: 16 bytes of every 32-byte
    /// chunk, and the matching 16 bits of each plane mask. The integer sums are those of
    /// [`dot16_avx512`] and the scales are applied by the same operations in the same order, so
    /// the results are its bits.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot16_avx2_k<const T: usize, const K: u8>(
        group: &[u8],
        toks: &[Tok<'_>],
        out: &mut [[f32; ROWS]; MAX_GROUP],
        half: usize,
        fetch: bool,
    ) {
        let kind = kind(K);
        let nsb = check(kind, group, toks, true);
        let low = _mm256_set1_epi16(0x0F);
        let (b4, b5) = (_mm256_set1_epi16(16), _mm256_set1_epi16(32));
        let mut acc = [_mm256_setzero_ps(); T];
        let (ro, qo) = (8 * half, 16 * half);
        for sb in 0..nsb {
            // SAFETY: record sb lies inside `group` (checked); every offset below is inside it
            // by `Kind`'s layout.
            let r = unsafe { group.as_ptr().add(sb * kind.record_bytes()) };
            let d = unsafe { _mm256_loadu_ps((r as *const f32).add(ro)) };
            let dmin = if kind.min {
                unsafe { _mm256_loadu_ps((r.add(4 * ROWS) as *const f32).add(ro)) }
            } else {
                d
            };
            if fetch && half == 0 {
                prefetch_ahead(r, kind.record_bytes());
            }
            for blk in 0..BLOCKS {
                let b = sb * BLOCKS + blk;
                let e0 = b * QBLOCK;
                let mut isum = start_half::<T>(kind, toks, b);
                for c in 0..QBLOCK / 4 {
                    let v = unsafe {
                        _mm_loadu_si128(r.add(kind.q_at() + blk * NIB_BYTES + 32 * c + qo) as *const __m128i)
                    };
                    let w = _mm256_cvtepu8_epi16(v);
                    let (mut lo, mut hi) = (_mm256_and_si256(w, low), _mm256_srli_epi16::<4>(w));
                    for p in 0..kind.planes() {
                        let m = unsafe { r.add(kind.plane_at(p) + blk * PLANE_BYTES + 8 * c) as *const u32 };
                        let (ml, mh) = unsafe { (m.read_unaligned(), m.add(1).read_unaligned()) };
                        let (ml, mh) = (ml >> (16 * half), mh >> (16 * half));
                        let val = if p == 0 { b4 } else { b5 };
                        lo = _mm256_add_epi16(lo, expand16(ml, val));
                        hi = _mm256_add_epi16(hi, expand16(mh, val));
                    }
                    let h = if kind.sub == 16 { c / 4 } else { 0 };
                    for (s, t) in isum.iter_mut().zip(toks) {
                        let p = _mm256_add_epi32(
                            _mm256_madd_epi16(lo, _mm256_set1_epi32(pair(t, e0 + 4 * c))),
                            _mm256_madd_epi16(hi, _mm256_set1_epi32(pair(t, e0 + 4 * c + 2))),
                        );
                        s[h] = _mm256_add_epi32(s[h], p);
                    }
                }
                scale_half::<T>(kind, &mut acc, &isum, r, d, dmin, ro, blk, toks, b);
            }
        }
        store_half(out, &acc, half);
    }

    /// Starting sums of a block for one half's kernels: `−offset · Σ q` per sub-block of 16 for
    /// types with an offset, as [`start`] gives the 16-row kernels.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn start_half<const T: usize>(kind: Kind, toks: &[Tok<'_>], b: usize) -> [[__m256i; 2]; T] {
        let mut isum = [[_mm256_setzero_si256(); 2]; T];
        if kind.offset != 0 {
            for (s, t) in isum.iter_mut().zip(toks) {
                for (h, v) in s.iter_mut().enumerate() {
                    *v = _mm256_set1_epi32(-kind.offset * t.sum16[2 * b + h]);
                }
            }
        }
        isum
    }

    /// Adds one block's sums to one half's accumulators, as [`scale_block`] does for 16 rows:
    /// per sub-block, the rows' `d · sc` (from record `r`, whose `d` and `−dmin` for this half are
    /// given) times the token's `dx` times the integer sum, and the minimums' share.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn scale_half<const T: usize>(
        kind: Kind,
        acc: &mut [__m256; T],
        isum: &[[__m256i; 2]; T],
        r: *const u8,
        d: __m256,
        dmin: __m256,
        ro: usize,
        blk: usize,
        toks: &[Tok<'_>],
        b: usize,
    ) {
        let halves = QBLOCK / kind.sub;
        for h in 0..halves {
            let j = blk * halves + h;
            // SAFETY (both loads): a record holds 16 bytes of scales (and of minimums) per
            // sub-block at the offsets `Kind` gives; this half reads 8 of them.
            let sc = unsafe { _mm_loadl_epi64(r.add(kind.sc_at() + j * ROWS + ro) as *const __m128i) };
            let rs = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
            let rm = if kind.min {
                let mn = unsafe { _mm_loadl_epi64(r.add(kind.mn_at() + j * ROWS + ro) as *const __m128i) };
                _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)))
            } else {
                rs
            };
            for ((a, s), t) in acc.iter_mut().zip(isum).zip(toks) {
                let dx = t.d[b];
                *a = _mm256_fmadd_ps(_mm256_mul_ps(rs, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(s[h]), *a);
                if kind.min {
                    let qsum = if halves == 1 { t.sum[b] } else { t.sum16[2 * b + h] };
                    *a = _mm256_fmadd_ps(rm, _mm256_set1_ps(dx * qsum as f32), *a);
                }
            }
        }
    }
}
