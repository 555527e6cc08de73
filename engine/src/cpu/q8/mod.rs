//! The 8-bit activation path: `y = x · Wᵀ` with `x` quantized to signed 8 bits per block of 32
//! and integer dot products against the weights' own quants (Q4_0, Q4_1, Q8_0, and Q5_0 as the
//! Q8_0 it converts to; the k-quants' records and kernels are in `kq`).
//!
//! A decode step reads every weight once, and the f32 kernels of [`mod@super::matmul`] cannot turn
//! quantized blocks into products as fast as memory delivers them: rebuilding each weight as an
//! f32 costs more instructions than the load. Here the products are 8-bit integer multiplies
//! summed in 32-bit lanes, and only the per-block scales are floating point.
//!
//! # Packed weights
//! [`PackedMatrix`] re-lays a matrix once, at load time, so that one 32-bit lane of a vector is
//! one weight row: rows are taken 16 at a time ([`ROWS`]), and for every block the 16 rows'
//! scales lie side by side, followed by their quants interleaved four elements per row
//! (`[row 0: e0..e3][row 1: e0..e3]…`). A vector of 64 quant bytes multiplied by one token's four
//! quants broadcast to every lane (`vpdpbusd` on AVX-512 VNNI, `vpmaddubsw` + `vpmaddwd` on AVX2)
//! advances 16 rows' dot products by four elements, the 16 rows' scales are one load, and no
//! horizontal sum is ever needed. Sizes are those of the source matrix (16 rows of a block take
//! exactly the bytes of 16 source blocks), plus padding rows to a multiple of 16.
//!
//! # What is computed
//! Each row of `x` is split into blocks of 32; a block with largest magnitude `a` gets the scale
//! `d = a / 127` and quants `q = round_ties_even(x · 127 / a)` in `-127..=127` (all zero when
//! `a == 0`). For a weight block with scale `dw` (and minimum `mw` for Q4_1) and quants `w`:
//!
//! - Q4_0 (`w` in `0..16`, weight `dw · (w − 8)`): `dw · d · Σ (w − 8) · q`
//! - Q4_1 (weight `dw · w + mw`):                  `dw · d · Σ w · q  +  mw · d · Σ q`
//! - Q8_0 (`w` in `-128..128`, weight `dw · w`):   `dw · d · Σ w · q`
//!
//! The integer sums are exact; the result differs from [`quantized_reference`] (the same formula
//! in f64) only by f32 rounding of the scale products and of the sum over blocks. It differs from
//! the f32 path by the quantization of `x` (per element at most half its block's step `d`),
//! which is why [`crate::backend::Activations::F32`] stays available and is what the
//! reference-parity tests use.
//!
//! # Batch independence
//! Every token's result takes exactly the same operations in the same order whatever the other
//! tokens of the call are and however many there are: a verification pass computes bit for bit
//! what decode steps would, a batched decode step what solo steps would, and a prompt chunk what
//! any other chunking of it would.

use rayon::prelude::*;

use crate::quant::GgmlType;
use crate::weights::Matrix;

#[cfg(target_arch = "x86_64")]
pub mod amx;
mod kq;
use kq::Kind;

/// Elements per activation block (the block length of Q4_0, Q4_1 and Q8_0; a k-quant's
/// super-block of 256 is eight of them).
pub const QBLOCK: usize = 32;
/// Weight rows interleaved in a [`PackedMatrix`] (one per 32-bit lane of a 512-bit vector).
pub const ROWS: usize = 16;
/// Most tokens one kernel call computes while a row group's bytes are in L1.
pub(super) const MAX_GROUP: usize = 8;
/// Tasks are at least this many weight bytes (times tokens, up to a group), so scheduling stays
/// a small fraction of the work.
const MIN_TASK_BYTES: usize = 32 * 1024;

/// Whether weights of this type have integer kernels here (other types take the f32 path): Q4_0,
/// Q4_1 and Q8_0 here, the k-quants in `kq`. Q5_0 is packed as the Q8_0 it converts to exactly
/// ([`q5_0_as_q8_0`]): 34 bytes a block instead of 22, but its kernel is the cheaper one for
/// prompts, which are compute-bound.
pub fn supports(dtype: GgmlType) -> bool {
    matches!(dtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::Q5_0)
        || Kind::of(dtype).is_some()
}

/// A Q5_0 matrix as Q8_0: the same f16 scale per block and the quants `q − 16` (in `-16..16`)
/// as signed bytes. Both dequantize to `(q − 16) · d` computed alike, so the values are the same
/// bit for bit; the integer kernels then take Q5_0 weights (Gemma's GGUFs are mostly Q5_0) at
/// 34 bytes per block of 32 instead of 22.
pub fn q5_0_as_q8_0(w: &Matrix) -> Matrix {
    assert_eq!(w.dtype, GgmlType::Q5_0, "q5_0_as_q8_0: a {} matrix", w.dtype.name());
    let blocks = w.rows * (w.cols / QBLOCK);
    let mut out = vec![0u8; blocks * GgmlType::Q8_0.block_bytes()];
    for (src, dst) in w.data[..blocks * GgmlType::Q5_0.block_bytes()]
        .chunks_exact(GgmlType::Q5_0.block_bytes())
        .zip(out.chunks_exact_mut(GgmlType::Q8_0.block_bytes()))
    {
        dst[..2].copy_from_slice(&src[..2]);
        let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
        let qs = &src[6..22];
        for j in 0..16 {
            let lo = (qs[j] & 0x0F) as i32 | (((qh >> j) & 1) << 4) as i32;
            let hi = (qs[j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
            dst[2 + j] = ((lo - 16) as i8) as u8;
            dst[2 + j + 16] = ((hi - 16) as i8) as u8;
        }
    }
    Matrix { rows: w.rows, cols: w.cols, dtype: GgmlType::Q8_0, data: crate::weights::Bytes::copy_from(&out) }
}

/// Instruction set of the integer kernels.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa8 {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

impl Isa8 {
    /// Every kernel set this CPU can run, portable first.
    pub fn available() -> Vec<Isa8> {
        let mut v = vec![Isa8::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                v.push(Isa8::Avx2);
                if is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
                {
                    v.push(Isa8::Avx512Vnni);
                }
            }
        }
        v
    }

    /// The fastest kernel set this CPU runs.
    pub fn best() -> Isa8 {
        static BEST: std::sync::OnceLock<Isa8> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| *Isa8::available().last().unwrap_or(&Isa8::Portable))
    }

    /// Tokens per kernel call: as many as the accumulators fit in registers.
    fn group(self) -> usize {
        match self {
            Isa8::Portable => 1,
            #[cfg(target_arch = "x86_64")]
            Isa8::Avx2 => 4,
            #[cfg(target_arch = "x86_64")]
            Isa8::Avx512Vnni => MAX_GROUP,
        }
    }
}

/// A weight matrix re-laid for the integer kernels (see the module documentation).
#[derive(Debug, Clone)]
pub struct PackedMatrix {
    pub rows: usize,
    pub cols: usize,
    /// The packed type (a Q5_0 source is packed as Q8_0).
    pub dtype: GgmlType,
    /// Laid out for 16-bit activations ([`PackedMatrix::pack_wide`]).
    pub wide: bool,
    data: Vec<u8>,
}

/// Bytes of one block record (16 rows' scales and quants) of a packed `dtype`.
fn record_bytes(dtype: GgmlType) -> usize {
    match Kind::of(dtype) {
        Some(k) => k.record_bytes(),
        None => ROWS * dtype.block_bytes(),
    }
}

/// Bytes of one packed row group of a `cols`-wide matrix of `dtype`.
fn group_bytes(dtype: GgmlType, cols: usize) -> usize {
    cols / dtype.block_len() * record_bytes(dtype)
}

/// Where weight `e` (0..32) of row `i` (0..16) of a block lives among a record's quant bytes, and
/// whether in the high nibble (Q4). The layouts put what one vector instruction multiplies in one
/// 32-bit lane per row:
/// - 8-bit activations, Q4: chunks of 64 bytes; chunk `e / 8` holds, at `4i..4i+4`, elements
///   `e % 8 < 4` in the low nibbles and the next four in the high ones.
/// - 8-bit activations, Q8_0: chunks of 64 bytes; chunk `e / 4` holds elements `4i..4i+4`.
/// - 16-bit activations, Q4: chunks of 32 bytes; chunk `e / 4` holds at `2i..2i+2` elements
///   `e % 4 < 2` in the low nibbles and the next two in the high ones.
/// - 16-bit activations, Q8_0: chunks of 32 bytes; chunk `e / 2` holds elements at `2i..2i+2`.
pub(super) fn place(wide: bool, q4: bool, i: usize, e: usize) -> (usize, bool) {
    match (wide, q4) {
        (false, true) => ((e / 8) * 64 + i * 4 + e % 4, e % 8 >= 4),
        (false, false) => ((e / 4) * 64 + i * 4 + e % 4, false),
        (true, true) => ((e / 4) * 32 + i * 2 + e % 2, e % 4 >= 2),
        (true, false) => ((e / 2) * 32 + i * 2 + e % 2, false),
    }
}

/// Offset of the quants in a record: after the 16 scales (and the 16 minimums of Q4_1).
fn quants_at(dtype: GgmlType) -> usize {
    if dtype == GgmlType::Q4_1 {
        4 * ROWS
    } else {
        2 * ROWS
    }
}

impl PackedMatrix {
    /// Packs `w` for 8-bit activations (rows past the last multiple of 16 are padded with zero
    /// weights).
    ///
    /// # Panics
    /// If `!supports(w.dtype)` or `w.data` is shorter than its rows.
    pub fn pack(w: &Matrix) -> PackedMatrix {
        Self::pack_for(w, false)
    }

    /// Packs `w` for 16-bit activations.
    ///
    /// # Panics
    /// As [`Self::pack`].
    pub fn pack_wide(w: &Matrix) -> PackedMatrix {
        Self::pack_for(w, true)
    }

    fn pack_for(w: &Matrix, wide: bool) -> PackedMatrix {
        assert!(supports(w.dtype), "PackedMatrix::pack: no integer kernels for {}", w.dtype.name());
        if w.dtype == GgmlType::Q5_0 {
            return Self::pack_for(&q5_0_as_q8_0(w), wide);
        }
        if Kind::of(w.dtype).is_some() {
            return PackedMatrix {
                rows: w.rows,
                cols: w.cols,
                dtype: w.dtype,
                wide,
                data: kq::pack(w, wide),
            };
        }
        let (bb, nb) = (w.dtype.block_bytes(), w.cols / QBLOCK);
        let groups = w.rows.div_ceil(ROWS);
        let rec = record_bytes(w.dtype);
        let qa = quants_at(w.dtype);
        let q4 = w.dtype != GgmlType::Q8_0;
        let mut data = vec![0u8; groups * nb * rec];
        for (gi, group) in data.chunks_exact_mut(nb * rec).enumerate() {
            for (b, out) in group.chunks_exact_mut(rec).enumerate() {
                for i in 0..ROWS {
                    let r = gi * ROWS + i;
                    if r >= w.rows {
                        // Padding rows: zero scale, so they contribute nothing. Q8_0 quants are
                        // stored offset by 128; zero is 0x80.
                        if !q4 {
                            for e in 0..QBLOCK {
                                out[qa + place(wide, q4, i, e).0] = 0x80;
                            }
                        }
                        continue;
                    }
                    let src = &w.row(r)[b * bb..(b + 1) * bb];
                    out[2 * i..2 * i + 2].copy_from_slice(&src[0..2]);
                    if w.dtype == GgmlType::Q4_1 {
                        out[2 * ROWS + 2 * i..2 * ROWS + 2 * i + 2].copy_from_slice(&src[2..4]);
                    }
                    let qs = &src[bb - if q4 { 16 } else { 32 }..];
                    for e in 0..QBLOCK {
                        let (at, high) = place(wide, q4, i, e);
                        if q4 {
                            let v = if e < 16 { qs[e] & 0x0F } else { qs[e - 16] >> 4 };
                            out[qa + at] |= if high { v << 4 } else { v };
                        } else {
                            out[qa + at] = qs[e] ^ 0x80;
                        }
                    }
                }
            }
        }
        PackedMatrix { rows: w.rows, cols: w.cols, dtype: w.dtype, wide, data }
    }

    /// Weight `e` of row `i` of block record `r`, as the integer the kernels multiply
    /// (Q4: `0..16`; Q8_0: the signed quant).
    fn quant(&self, r: &[u8], i: usize, e: usize) -> i32 {
        let q4 = self.dtype != GgmlType::Q8_0;
        let (at, high) = place(self.wide, q4, i, e);
        let byte = r[quants_at(self.dtype) + at];
        match (q4, high) {
            (true, false) => (byte & 0x0F) as i32,
            (true, true) => (byte >> 4) as i32,
            (false, _) => (byte ^ 0x80) as i8 as i32,
        }
    }

    fn group(&self, g: usize) -> &[u8] {
        let len = group_bytes(self.dtype, self.cols);
        &self.data[g * len..(g + 1) * len]
    }
}

/// Rows of activations quantized per block of [`QBLOCK`] (see the module documentation). Reused
/// across calls: [`Self::quantize`] only grows the buffers.
#[derive(Debug, Default, Clone)]
pub struct QuantizedRows {
    n: usize,
    cols: usize,
    /// 16-bit quants ([`Self::quantize_wide`]) rather than 8-bit ones.
    wide: bool,
    /// `n × cols` quants (8-bit).
    qs: Vec<i8>,
    /// `n × cols` quants (16-bit).
    qw: Vec<i16>,
    /// Per block: the scale `d`, `Σ q`, and `d · Σ q`.
    d: Vec<f32>,
    sum: Vec<i32>,
    ds: Vec<f32>,
    /// Per half block (16 elements): `Σ q` (the k-quants' sub-blocks of 16 take it).
    sum16: Vec<i32>,
}

/// One token's share of a [`QuantizedRows`].
#[derive(Clone, Copy)]
pub(super) struct Tok<'a> {
    pub(super) qs: &'a [i8],
    pub(super) qw: &'a [i16],
    pub(super) d: &'a [f32],
    pub(super) sum: &'a [i32],
    pub(super) ds: &'a [f32],
    pub(super) sum16: &'a [i32],
}

impl QuantizedRows {
    /// An empty set (quantize into it).
    pub fn new() -> QuantizedRows {
        QuantizedRows::default()
    }

    /// Rows held.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Quantizes `n` rows of `cols` elements (`x.len() == n * cols`, `cols` a multiple of
    /// [`QBLOCK`]) to 8 bits, in parallel on rayon's current pool when there are several rows.
    ///
    /// # Panics
    /// If the sizes disagree (callers size everything from the model config).
    pub fn quantize(&mut self, x: &[f32], n: usize, cols: usize) {
        self.quantize_to(x, n, cols, false)
    }

    /// [`Self::quantize`] to 16 bits: quants in `-32767..=32767`, scale `a / 32767`.
    pub fn quantize_wide(&mut self, x: &[f32], n: usize, cols: usize) {
        self.quantize_to(x, n, cols, true)
    }

    /// Whether the quants are 16-bit.
    pub fn is_wide(&self) -> bool {
        self.wide
    }

    fn quantize_to(&mut self, x: &[f32], n: usize, cols: usize, wide: bool) {
        assert_eq!(cols % QBLOCK, 0, "quantize: cols must be a multiple of {QBLOCK}");
        assert_eq!(x.len(), n * cols, "quantize: x must be n × cols");
        let nb = cols / QBLOCK;
        self.n = n;
        self.cols = cols;
        self.wide = wide;
        if wide {
            self.qw.resize(n * cols, 0);
        } else {
            self.qs.resize(n * cols, 0);
        }
        self.d.resize(n * nb, 0.0);
        self.sum.resize(n * nb, 0);
        self.ds.resize(n * nb, 0.0);
        self.sum16.resize(2 * n * nb, 0);
        if cols == 0 {
            return;
        }
        let scales = self
            .d
            .par_chunks_exact_mut(nb)
            .zip(self.sum.par_chunks_exact_mut(nb))
            .zip(self.ds.par_chunks_exact_mut(nb).zip(self.sum16.par_chunks_exact_mut(2 * nb)));
        if wide {
            x.par_chunks_exact(cols)
                .zip(self.qw.par_chunks_exact_mut(cols))
                .zip(scales)
                .with_min_len(4)
                .for_each(|((x, q), ((d, sum), (ds, s16)))| quantize_row(x, q, 32767.0, d, sum, ds, s16));
        } else {
            x.par_chunks_exact(cols)
                .zip(self.qs.par_chunks_exact_mut(cols))
                .zip(scales)
                .with_min_len(4)
                .for_each(|((x, q), ((d, sum), (ds, s16)))| quantize_row(x, q, 127.0, d, sum, ds, s16));
        }
    }

    fn tok(&self, t: usize) -> Tok<'_> {
        let (c, nb) = (self.cols, self.cols / QBLOCK);
        let (qs, qw) = if self.wide {
            (&[][..], &self.qw[t * c..(t + 1) * c])
        } else {
            (&self.qs[t * c..(t + 1) * c], &[][..])
        };
        Tok {
            qs,
            qw,
            d: &self.d[t * nb..(t + 1) * nb],
            sum: &self.sum[t * nb..(t + 1) * nb],
            ds: &self.ds[t * nb..(t + 1) * nb],
            sum16: &self.sum16[2 * t * nb..2 * (t + 1) * nb],
        }
    }

    /// Row `t` as the kernels see it: the quants and the scale of every block.
    pub fn row(&self, t: usize) -> (Vec<i32>, &[f32]) {
        let tk = self.tok(t);
        ((0..self.cols).map(|c| tk.q(c)).collect(), tk.d)
    }
}

impl Tok<'_> {
    /// `Σ q` over the `len` (16 or 32) elements from `e` (a multiple of `len`).
    pub(super) fn sub_sum(&self, len: usize, e: usize) -> i32 {
        if len == QBLOCK {
            self.sum[e / QBLOCK]
        } else {
            self.sum16[e / 16]
        }
    }

    /// Quant `c` of the token, whatever its width.
    pub(super) fn q(&self, c: usize) -> i32 {
        if self.qs.is_empty() {
            self.qw[c] as i32
        } else {
            self.qs[c] as i32
        }
    }
}

/// An 8- or 16-bit quant.
trait Quant: Copy + Send + Sync {
    fn from_rounded(v: f32) -> Self;
    fn widen(self) -> i32;
    /// One block quantized as `quantize_row` does, with AVX-512 where the CPU has it: the scale
    /// and the two halves' sums (`None`: do it in scalar code).
    #[cfg(target_arch = "x86_64")]
    fn quantize_avx512(x: &[f32], q: &mut [Self], top: f32) -> Option<(f32, i32, i32)>;
}

/// Whether the CPU has what `x86::quantize_block` is compiled with.
#[cfg(target_arch = "x86_64")]
fn quantize_avx512_available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw"))
}

impl Quant for i8 {
    fn from_rounded(v: f32) -> i8 {
        v as i8
    }
    fn widen(self) -> i32 {
        self as i32
    }
    #[cfg(target_arch = "x86_64")]
    fn quantize_avx512(x: &[f32], q: &mut [i8], top: f32) -> Option<(f32, i32, i32)> {
        // SAFETY: the CPU has AVX-512 F/BW (checked first).
        quantize_avx512_available()
            .then(|| unsafe { x86::quantize_block::<false>(x, q.as_mut_ptr() as *mut u8, top) })
    }
}

impl Quant for i16 {
    fn from_rounded(v: f32) -> i16 {
        v as i16
    }
    fn widen(self) -> i32 {
        self as i32
    }
    #[cfg(target_arch = "x86_64")]
    fn quantize_avx512(x: &[f32], q: &mut [i16], top: f32) -> Option<(f32, i32, i32)> {
        // SAFETY: as for i8; q holds 32 i16.
        quantize_avx512_available()
            .then(|| unsafe { x86::quantize_block::<true>(x, q.as_mut_ptr() as *mut u8, top) })
    }
}

fn quantize_row<Q: Quant>(
    x: &[f32],
    qs: &mut [Q],
    top: f32,
    d: &mut [f32],
    sum: &mut [i32],
    ds: &mut [f32],
    sum16: &mut [i32],
) {
    for (b, (xb, qb)) in x.chunks_exact(QBLOCK).zip(qs.chunks_exact_mut(QBLOCK)).enumerate() {
        #[cfg(target_arch = "x86_64")]
        let (db, s0, s1) = match Q::quantize_avx512(xb, qb, top) {
            Some(r) => r,
            None => quantize_block(xb, qb, top),
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (db, s0, s1) = quantize_block(xb, qb, top);
        sum16[2 * b] = s0;
        sum16[2 * b + 1] = s1;
        d[b] = db;
        sum[b] = s0 + s1;
        ds[b] = db * (s0 + s1) as f32;
    }
}

/// One block of 32: its scale, its quants into `qb`, and the sums of its two halves.
fn quantize_block<Q: Quant>(xb: &[f32], qb: &mut [Q], top: f32) -> (f32, i32, i32) {
    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (db, inv) = if amax > 0.0 && amax.is_finite() { (amax / top, top / amax) } else { (0.0, 0.0) };
    // Adding and subtracting 1.5 · 2²³ rounds to the nearest integer, ties to even, for
    // |v| < 2²² (IEEE round-to-nearest): `round_ties_even` without a libm call. `as` saturates
    // (and maps NaN to 0), so a non-finite input cannot wrap around.
    const ROUND: f32 = 12_582_912.0;
    for (q, &v) in qb.iter_mut().zip(xb) {
        *q = Q::from_rounded(((v * inv).clamp(-top, top) + ROUND) - ROUND);
    }
    let s0: i32 = qb[..16].iter().map(|&q| q.widen()).sum();
    let s1: i32 = qb[16..].iter().map(|&q| q.widen()).sum();
    (db, s0, s1)
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The AVX-512 quantization of a block is the scalar one bit for bit: scales, quants and
    /// sums, at 8 and 16 bits, on random blocks and on NaN, ±inf, ±0, subnormals, ties and
    /// blocks whose largest value is negative.
    #[test]
    fn vector_quantization_equals_scalar() {
        if !quantize_avx512_available() {
            // Only the scalar code runs on this CPU: nothing to compare it with.
            return;
        }
        let mut seed = 0x1234_5678u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            seed
        };
        let mut blocks: Vec<[f32; 32]> = (0..2000)
            .map(|i| {
                let scale = [1e-30f32, 1e-3, 1.0, 7.5, 1e4, 3e38][i % 6];
                std::array::from_fn(|_| (next() as i32 as f32 / i32::MAX as f32) * scale)
            })
            .collect();
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1e-40, -3.5, 127.0, 0.5];
        for (k, &v) in specials.iter().enumerate() {
            let mut b: [f32; 32] = std::array::from_fn(|j| j as f32 * 0.25 - 4.0);
            b[k * 3] = v;
            blocks.push(b);
        }
        blocks.push([0.0; 32]);
        blocks.push(std::array::from_fn(|j| -(j as f32)));
        for b in &blocks {
            let (mut q8s, mut q8v) = ([0i8; 32], [0i8; 32]);
            let (mut q16s, mut q16v) = ([0i16; 32], [0i16; 32]);
            let s8 = quantize_block(b, &mut q8s, 127.0);
            // SAFETY: checked above; the buffers hold 32 quants.
            let v8 = unsafe { x86::quantize_block::<false>(b, q8v.as_mut_ptr() as *mut u8, 127.0) };
            let s16 = quantize_block(b, &mut q16s, 32767.0);
            let v16 = unsafe { x86::quantize_block::<true>(b, q16v.as_mut_ptr() as *mut u8, 32767.0) };
            assert_eq!((s8.0.to_bits(), s8.1, s8.2, q8s), (v8.0.to_bits(), v8.1, v8.2, q8v), "8-bit: {b:?}");
            assert_eq!(
                (s16.0.to_bits(), s16.1, s16.2, q16s),
                (v16.0.to_bits(), v16.1, v16.2, q16v),
                "16-bit: {b:?}"
            );
        }
    }
}

/// `y[t * w.rows + r] = Σ_c x[t][c] · W[r][c]` with `x` given quantized, for every row `t` of
/// `xq`, on rayon's current pool with the fastest kernels of this CPU.
///
/// # Panics
/// If `xq.cols() != w.cols` or `y.len() != xq.n() * w.rows`.
pub fn matmul_q8(w: &PackedMatrix, xq: &QuantizedRows, y: &mut [f32]) {
    matmul_q8_many(&mut [(w, y)], xq)
}

/// [`matmul_q8`] with a chosen kernel set, never the AMX tiles (tests compare them all).
///
/// # Panics
/// As [`matmul_q8`], and if this CPU cannot run `isa`.
#[doc(hidden)]
pub fn matmul_q8_with(isa: Isa8, w: &PackedMatrix, xq: &QuantizedRows, y: &mut [f32]) {
    assert!(Isa8::available().contains(&isa), "matmul_q8_with: {isa:?} is not supported by this CPU");
    run_vnni(isa, w, xq, y)
}

/// [`matmul_q8`] on the AMX tiles, whatever the token count (tests compare them with the VNNI
/// kernels).
///
/// # Panics
/// As [`matmul_q8`], and if the tiles are not usable here.
#[doc(hidden)]
#[cfg(target_arch = "x86_64")]
pub fn matmul_q8_amx(w: &PackedMatrix, xq: &QuantizedRows, y: &mut [f32]) {
    amx::run(w, xq, y)
}

/// Whether prompt chunks and large batches take the AMX tiles here, in words (`None` off
/// x86-64). Decided once per process; `tandem bench` prints it.
pub fn amx_report() -> Option<String> {
    #[cfg(target_arch = "x86_64")]
    return Some(amx::choice().why.clone());
    #[cfg(not(target_arch = "x86_64"))]
    return None;
}

/// Row-major result `n × w.rows` through a raw pointer shared by tasks owning disjoint rows.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: each task writes only `y[t * rows + r]` for the rows `r` of its own groups; groups are
// disjoint and `y` outlives the parallel loop.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

/// Checks the sizes of a product (panicking as [`matmul_q8`] documents) and settles the empty
/// ones; `false`: nothing is left to compute.
fn sizes_agree(w: &PackedMatrix, xq: &QuantizedRows, y: &mut [f32]) -> bool {
    assert_eq!(xq.cols, w.cols, "matmul_q8: activations have {} columns, weights {}", xq.cols, w.cols);
    assert_eq!(xq.wide, w.wide, "matmul_q8: activation and weight packing widths differ");
    assert_eq!(y.len(), xq.n * w.rows, "matmul_q8: y must be n × rows");
    if w.cols == 0 {
        y.fill(0.0);
    }
    xq.n > 0 && w.rows > 0 && w.cols > 0
}

fn run_vnni(isa: Isa8, w: &PackedMatrix, xq: &QuantizedRows, y: &mut [f32]) {
    run_vnni_many(isa, &mut [(w, y)], xq)
}

/// How one product is cut into tasks: `per_task` row groups each, `n_tasks` of them.
struct Plan<'a> {
    w: &'a PackedMatrix,
    out: SharedOut,
    groups: usize,
    per_task: usize,
    n_tasks: usize,
}

impl Plan<'_> {
    /// Computes the rows of task `task` for every token.
    fn run_task(&self, isa: Isa8, toks: &[Tok<'_>], task: usize) {
        let (w, out, rows) = (self.w, self.out, self.w.rows);
        let gsize = isa.group();
        for g in task * self.per_task..((task + 1) * self.per_task).min(self.groups) {
            let valid = (rows - g * ROWS).min(ROWS);
            for (tg, chunk) in toks.chunks(gsize).enumerate() {
                let mut acc = [[0f32; ROWS]; MAX_GROUP];
                // Only the first group of tokens reads the weights from memory; later ones find them in
                // cache, and prefetching again would only cost them instructions.
                dot_group(isa, w, w.group(g), chunk, &mut acc, tg == 0);
                for (i, a) in acc[..chunk.len()].iter().enumerate() {
                    let t = tg * gsize + i;
                    for (k, &v) in a[..valid].iter().enumerate() {
                        // SAFETY: t < n and g·ROWS + k < rows, so the index is inside this
                        // product's `y`; this task alone owns group g's rows (see `SharedOut`).
                        unsafe { *out.0.add(t * rows + g * ROWS + k) = v };
                    }
                }
            }
        }
    }
}

/// Several products over the same activations in one parallel loop: the tasks of every product
/// are queued together, so threads meet once instead of once per matrix. Each row is computed as
/// a product of its own computes it, bit for bit.
fn run_vnni_many(isa: Isa8, outs: &mut [(&PackedMatrix, &mut [f32])], xq: &QuantizedRows) {
    let n = xq.n;
    let gsize = isa.group();
    let threads = rayon::current_num_threads().max(1);
    let mut plans = Vec::with_capacity(outs.len());
    for (w, y) in outs.iter_mut() {
        if !sizes_agree(w, xq, y) {
            continue;
        }
        let groups = w.rows.div_ceil(ROWS);
        let group_bytes = group_bytes(w.dtype, w.cols);
        let by_balance = groups.div_ceil(threads * 4);
        let by_size = MIN_TASK_BYTES.div_ceil(group_bytes * n.min(gsize));
        let per_task = by_balance.max(by_size).max(1);
        plans.push(Plan {
            w,
            out: SharedOut(y.as_mut_ptr()),
            groups,
            per_task,
            n_tasks: groups.div_ceil(per_task),
        });
    }
    let total: usize = plans.iter().map(|p| p.n_tasks).sum();
    let toks: Vec<Tok<'_>> = (0..n).map(|t| xq.tok(t)).collect();
    let task = |mut i: usize| {
        for p in &plans {
            if i < p.n_tasks {
                return p.run_task(isa, &toks, i);
            }
            i -= p.n_tasks;
        }
    };
    match total {
        0 => {}
        1 => task(0),
        _ => (0..total).into_par_iter().for_each(task),
    }
}

/// [`matmul_q8`] of several matrices over the same activations (`y_i = x · W_iᵀ`): on the vector
/// kernels, one parallel loop for all of them; where the AMX tiles take the call, one after
/// another. Each `y_i` holds the bits [`matmul_q8`] would give it.
///
/// # Panics
/// As [`matmul_q8`], for any of the products.
pub fn matmul_q8_many(outs: &mut [(&PackedMatrix, &mut [f32])], xq: &QuantizedRows) {
    let isa = Isa8::best();
    #[cfg(target_arch = "x86_64")]
    if isa == Isa8::Avx512Vnni && amx::choice().from.is_some_and(|f| xq.n >= f) {
        for (w, y) in outs.iter_mut() {
            amx::run(w, xq, y);
        }
        return;
    }
    run_vnni_many(isa, outs, xq)
}

/// `acc[i][k] = dot(row k of the group, toks[i])` for up to the ISA's group of tokens; `fetch`:
/// prefetch the weights ahead (the first group of tokens of a call).
fn dot_group(
    isa: Isa8,
    w: &PackedMatrix,
    group: &[u8],
    toks: &[Tok<'_>],
    acc: &mut [[f32; ROWS]; MAX_GROUP],
    fetch: bool,
) {
    let dtype = w.dtype;
    if Kind::of(dtype).is_some() {
        return kq::dot_group(isa, dtype, w.wide, group, toks, acc, fetch);
    }
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
    let wide = w.wide;
    match isa {
        Isa8::Portable => {
            for (a, t) in acc.iter_mut().zip(toks) {
                portable_dot(w, group, t, a);
            }
        }
        // SAFETY: the ISA came from `Isa8::available` (checked by the public entry points), and
        // `run` hands each kernel at most its group of tokens.
        #[cfg(target_arch = "x86_64")]
        Isa8::Avx2 if wide => unsafe { by_count!(x86::dot16_avx2) },
        #[cfg(target_arch = "x86_64")]
        Isa8::Avx2 => unsafe { by_count!(x86::dot_avx2) },
        #[cfg(target_arch = "x86_64")]
        Isa8::Avx512Vnni if wide => unsafe { by_count!(x86::dot16_avx512) },
        #[cfg(target_arch = "x86_64")]
        Isa8::Avx512Vnni => unsafe { by_count!(x86::dot_avx512) },
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// One token against one packed row group, in plain Rust (also the reference reading of the
/// layouts).
fn portable_dot(w: &PackedMatrix, group: &[u8], t: &Tok<'_>, acc: &mut [f32; ROWS]) {
    let rec = record_bytes(w.dtype);
    let bias = if w.dtype == GgmlType::Q4_0 { 8 } else { 0 };
    *acc = [0.0; ROWS];
    for (b, r) in group.chunks_exact(rec).enumerate() {
        for (i, a) in acc.iter_mut().enumerate() {
            let s: i32 = (0..QBLOCK).map(|e| (w.quant(r, i, e) - bias) * t.q(b * QBLOCK + e)).sum();
            *a += f16_at(r, 2 * i) * t.d[b] * s as f32;
            if w.dtype == GgmlType::Q4_1 {
                *a += f16_at(r, 2 * ROWS + 2 * i) * t.ds[b];
            }
        }
    }
}

/// The module's formula in f64 for row `r` of `w` and row `t` of `xq`, from the source matrix
/// (tests compare every kernel set and the packing against it).
#[doc(hidden)]
pub fn quantized_reference(w: &Matrix, xq: &QuantizedRows, r: usize, t: usize) -> f64 {
    if w.dtype == GgmlType::Q5_0 {
        return quantized_reference(&q5_0_as_q8_0(w), xq, r, t);
    }
    if Kind::of(w.dtype).is_some() {
        return kq::reference(w, &xq.tok(t), r);
    }
    let tk = xq.tok(t);
    let bb = w.dtype.block_bytes();
    let mut acc = 0f64;
    for (b, blk) in w.row(r).chunks_exact(bb).enumerate() {
        let d = tk.d[b] as f64;
        let dw = f16_at(blk, 0) as f64;
        for j in 0..QBLOCK {
            let x = tk.q(b * QBLOCK + j);
            let wq = match w.dtype {
                GgmlType::Q4_0 | GgmlType::Q4_1 => {
                    let byte = blk[if w.dtype == GgmlType::Q4_1 { 4 } else { 2 } + j % 16];
                    let nib = if j < 16 { byte & 0x0F } else { byte >> 4 } as f64;
                    if w.dtype == GgmlType::Q4_0 {
                        dw * (nib - 8.0)
                    } else {
                        dw * nib + f16_at(blk, 2) as f64
                    }
                }
                _ => dw * (blk[2 + j] as i8) as f64,
            };
            acc += wq * d * x as f64;
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// One block of 32 quantized exactly as `quantize_row`'s scalar loop does it (the same f32
    /// operations, lane by lane; NaN ignored by the maximum and quantized to 0), stored as 16-bit
    /// (`WIDE`) or 8-bit quants at `q`; returns the scale and the two halves' sums.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW; `x` holds 32 values and `q` room for 32 quants.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn quantize_block<const WIDE: bool>(
        x: &[f32],
        q: *mut u8,
        top: f32,
    ) -> (f32, i32, i32) {
        assert_eq!(x.len(), QBLOCK, "quantize_block: a block is 32");
        // SAFETY: x holds 32 f32 (checked).
        let (v0, v1) = unsafe { (_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(x.as_ptr().add(16))) };
        let abs = |v: __m512| {
            _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFF_FFFF)))
        };
        // `maxps` returns its second operand when either is NaN: NaN inputs (first operand) are
        // skipped, as `f32::max` skips them.
        let m = _mm512_max_ps(abs(v1), _mm512_max_ps(abs(v0), _mm512_setzero_ps()));
        let amax = _mm512_reduce_max_ps(m);
        let (db, inv) = if amax > 0.0 && amax.is_finite() { (amax / top, top / amax) } else { (0.0, 0.0) };
        const ROUND: f32 = 12_582_912.0;
        let quant = |v: __m512| {
            let t = _mm512_mul_ps(v, _mm512_set1_ps(inv));
            let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(t, t);
            let c = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-top)), _mm512_set1_ps(top));
            let r = _mm512_sub_ps(_mm512_add_ps(c, _mm512_set1_ps(ROUND)), _mm512_set1_ps(ROUND));
            _mm512_maskz_mov_epi32(ordered, _mm512_cvttps_epi32(r))
        };
        let (q0, q1) = (quant(v0), quant(v1));
        // SAFETY: q has room for 32 quants (the caller's contract).
        unsafe {
            if WIDE {
                _mm256_storeu_si256(q as *mut __m256i, _mm512_cvtepi32_epi16(q0));
                _mm256_storeu_si256(q.add(32) as *mut __m256i, _mm512_cvtepi32_epi16(q1));
            } else {
                _mm_storeu_si128(q as *mut __m128i, _mm512_cvtepi32_epi8(q0));
                _mm_storeu_si128(q.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(q1));
            }
        }
        (db, _mm512_reduce_add_epi32(q0), _mm512_reduce_add_epi32(q1))
    }

    /// The four quants of token `t` at element `e` as one 32-bit word (broadcast to every lane).
    #[inline]
    fn quad(t: &Tok<'_>, e: usize) -> i32 {
        let q = &t.qs[e..e + 4];
        // SAFETY: q holds 4 bytes; an unaligned read of them (the broadcast then loads straight
        // from memory).
        unsafe { (q.as_ptr() as *const i32).read_unaligned() }
    }

    // ---- AVX-512 VNNI: 16 rows per vector -------------------------------------------------------

    /// The weight type of a kernel's `Q` parameter (0 = Q4_0, 1 = Q4_1, 8 = Q8_0).
    const fn q_type(q: u8) -> GgmlType {
        match q {
            1 => GgmlType::Q4_1,
            0 => GgmlType::Q4_0,
            _ => GgmlType::Q8_0,
        }
    }

    /// Calls `$f::<T, Q>(args)` with the `Q` of `dtype`.
    macro_rules! by_type {
        ($dtype:expr, $f:ident::<$t:ident>($($arg:expr),*)) => {
            match $dtype {
                GgmlType::Q4_1 => $f::<$t, 1>($($arg),*),
                GgmlType::Q4_0 => $f::<$t, 0>($($arg),*),
                _ => $f::<$t, 8>($($arg),*),
            }
        };
    }

    /// The end of a block for 16 rows: each token's integer sums times the rows' scales and the
    /// token's block scale, plus Q4_1's minimums (16 f16 at `mins`) times the token's `d · Σ q`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
    fn scale_block<const T: usize, const Q: u8>(
        acc: &mut [__m512; T],
        isum: &[__m512i; T],
        dw: __m512,
        mins: *const u8,
        toks: &[Tok<'_>],
        b: usize,
    ) {
        let mw = if Q == 1 {
            // SAFETY: for Q4_1 the caller points `mins` at the record's 16 minimums.
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(mins as *const __m256i)) }
        } else {
            _mm512_setzero_ps()
        };
        for ((a, s), t) in acc.iter_mut().zip(isum).zip(toks) {
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(t.d[b]));
            *a = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(*s), *a);
            if Q == 1 {
                *a = _mm512_fmadd_ps(mw, _mm512_set1_ps(t.ds[b]), *a);
            }
        }
    }

    /// How far ahead of the record being read the kernels ask for data: into L1 and into L2.
    /// A decode step streams every weight once, and the hardware's own prefetcher alone keeps too
    /// few lines in flight (it stops at page boundaries): on the 2-core Xeon these distances made
    /// SmolLM2's decode 1.7× and Gemma 3's 1.25× as fast (`docs/benchmarks.md`).
    const L1_AHEAD: usize = 1024;
    const L2_AHEAD: usize = 4096;

    /// Prefetches the `len` bytes [`L1_AHEAD`] and [`L2_AHEAD`] past `r`. Addresses past the
    /// matrix are harmless: a prefetch never faults.
    #[inline(always)]
    pub(in crate::cpu) fn prefetch_ahead(r: *const u8, len: usize) {
        let mut o = 0;
        while o < len {
            // SAFETY: prefetching is a hint that cannot fault, whatever the address.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(L1_AHEAD + o) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(r.wrapping_add(L2_AHEAD + o) as *const i8);
            }
            o += 64;
        }
    }

    /// `acc + Σ` of the 16-bit pairs of `w` times those of `x` in every 32-bit lane: one `vpdpwssd`.
    ///
    /// Written as assembly because LLVM, tuning for a generic x86-64, rewrites the intrinsic as
    /// `vpmaddwd` + `vpaddd` whenever that shortens a chain of dependent sums: two vector
    /// instructions where the CPU has one, on the two ports that 512-bit integer work shares.
    /// With eight tokens' chains in flight the latency it saves was not the limit, and the split
    /// left the 16-bit kernels short of issue slots (`docs/benchmarks.md`, 2026-12-07). The sums
    /// are the same exact integers.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(in crate::cpu) fn dpwssd(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
        let mut a = acc;
        // SAFETY: the instruction reads and writes registers only, and the CPU has AVX-512 VNNI
        // (this function's target features).
        unsafe {
            std::arch::asm!("vpdpwssd {a}, {w}, {x}", a = inout(zmm_reg) a, w = in(zmm_reg) w,
                x = in(zmm_reg) x, options(pure, nomem, nostack, preserves_flags));
        }
        a
    }

    /// Most partial integer sums a token's block is split over.
    pub(in crate::cpu) const PARTS: usize = 4;

    /// Partial sums per token for `T` tokens: one token's chain of dependent multiply-adds would
    /// wait on the instruction's latency, so few tokens split it over independent accumulators.
    /// Integer sums are exact, so the split never changes a result.
    pub(in crate::cpu) const fn parts(t: usize) -> usize {
        if t <= 2 {
            PARTS
        } else if t <= 4 {
            2
        } else {
            1
        }
    }

    /// Each token's partial sums added up.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::cpu) fn gather<const T: usize>(part: &[[__m512i; PARTS]; T]) -> [__m512i; T] {
        std::array::from_fn(|i| {
            let s = &part[i];
            _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]))
        })
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::cpu) fn store<const T: usize>(out: &mut [[f32; ROWS]; MAX_GROUP], acc: &[__m512; T]) {
        for (o, a) in out.iter_mut().zip(acc) {
            // SAFETY: o holds 16 f32.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *a) };
        }
    }

    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL/VNNI and F16C; `toks.len() == T <= MAX_GROUP`,
    /// every token has the group's element count, and `group` is whole records of `dtype` (one
    /// of [`supports`]).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
    pub(super) unsafe fn dot_avx512<const T: usize>(
        dtype: GgmlType,
        group: &[u8],
        toks: &[Tok<'_>],
        acc: &mut [[f32; ROWS]; MAX_GROUP],
        fetch: bool,
    ) {
        by_type!(dtype, dot_avx512_q::<T>(group, toks, acc, fetch))
    }

    /// `Q`: 0 = Q4_0, 1 = Q4_1, 8 = Q8_0.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
    fn dot_avx512_q<const T: usize, const Q: u8>(
        group: &[u8],
        toks: &[Tok<'_>],
        out: &mut [[f32; ROWS]; MAX_GROUP],
        fetch: bool,
    ) {
        let dtype = q_type(Q);
        let (rec, qa) = (record_bytes(dtype), quants_at(dtype));
        let low = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); T];
        for (b, r) in group.chunks_exact(rec).enumerate() {
            // SAFETY: a record holds 16 f16 scales (and 16 minimums for Q4_1) before its quants.
            let dw = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(r.as_ptr() as *const __m256i)) };
            if fetch {
                prefetch_ahead(r.as_ptr(), rec);
            }
            let mut part = [[_mm512_setzero_si512(); PARTS]; T];
            for (s, t) in part.iter_mut().zip(toks) {
                // Q4_0's weights are w − 8 and Q8_0's are stored as w + 128: start from the
                // offset's share, −8 · Σ q or −128 · Σ q.
                s[0] = match Q {
                    0 => _mm512_set1_epi32(-8 * t.sum[b]),
                    8 => _mm512_set1_epi32(-128 * t.sum[b]),
                    _ => _mm512_setzero_si512(),
                };
            }
            let e0 = b * QBLOCK;
            let p = parts(T);
            if Q == 8 {
                for c in 0..QBLOCK / 4 {
                    // SAFETY: the record's quants are 8 chunks of 64 bytes.
                    let w =
                        unsafe { _mm512_loadu_si512(r[qa + 64 * c..qa + 64 * (c + 1)].as_ptr() as *const _) };
                    for (s, t) in part.iter_mut().zip(toks) {
                        s[c % p] = _mm512_dpbusd_epi32(s[c % p], w, _mm512_set1_epi32(quad(t, e0 + 4 * c)));
                    }
                }
            } else {
                for c in 0..QBLOCK / 8 {
                    // SAFETY: the record's quants are 4 chunks of 64 bytes.
                    let v =
                        unsafe { _mm512_loadu_si512(r[qa + 64 * c..qa + 64 * (c + 1)].as_ptr() as *const _) };
                    let lo = _mm512_and_si512(v, low);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                    let (i, j) = ((2 * c) % p, (2 * c + 1) % p);
                    for (s, t) in part.iter_mut().zip(toks) {
                        s[i] = _mm512_dpbusd_epi32(s[i], lo, _mm512_set1_epi32(quad(t, e0 + 8 * c)));
                        s[j] = _mm512_dpbusd_epi32(s[j], hi, _mm512_set1_epi32(quad(t, e0 + 8 * c + 4)));
                    }
                }
            }
            let isum = gather::<T>(&part);
            // SAFETY: as above (a record is at least 4 · 16 bytes before its quants for Q4_1).
            scale_block::<T, Q>(&mut acc, &isum, dw, unsafe { r.as_ptr().add(2 * ROWS) }, toks, b);
        }
        store(out, &acc);
    }

    // ---- AVX-512 VNNI, 16-bit activations: 16 rows per vector, two weights per lane -------------

    /// Checks the sizes the 16-bit kernels rely on (whole records of `rec` bytes, `T` tokens long
    /// enough for them); returns the record count and each token's 16-bit quants.
    fn records16<const T: usize>(group: &[u8], rec: usize, toks: &[Tok<'_>]) -> (usize, [*const i16; T]) {
        let nb = group.len() / rec;
        assert_eq!(group.len(), nb * rec, "dot16: group is not whole records");
        let toks: &[Tok<'_>; T] = toks.try_into().expect("dot16: token count");
        for t in toks {
            assert!(t.qw.len() >= nb * QBLOCK && t.sum.len() >= nb && t.d.len() >= nb && t.ds.len() >= nb);
        }
        (nb, std::array::from_fn(|i| toks[i].qw.as_ptr()))
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
        by_type!(dtype, dot16_avx512_q::<T>(group, toks, acc, fetch))
    }

    /// 16-bit activations: 32 quant bytes widened to 16 bits give every row's 32-bit lane two
    /// of its weights (`vpdpwssd`), so one accumulator per token holds 16 rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
    fn dot16_avx512_q<const T: usize, const Q: u8>(
        group: &[u8],
        toks: &[Tok<'_>],
        out: &mut [[f32; ROWS]; MAX_GROUP],
        fetch: bool,
    ) {
        let dtype = q_type(Q);
        let (rec, qa) = (record_bytes(dtype), quants_at(dtype));
        let (nb, xs) = records16::<T>(group, rec, toks);
        let low = _mm512_set1_epi16(0x0F);
        let flip = _mm256_set1_epi8(-128);
        // Two consecutive 16-bit quants of a token as one 32-bit lane value.
        // SAFETY (all uses): e + 2 <= nb · 32 <= the token's quant count, checked above.
        let pair =
            |x: *const i16, e: usize| unsafe { _mm512_set1_epi32((x.add(e) as *const i32).read_unaligned()) };
        let mut acc = [_mm512_setzero_ps(); T];
        for b in 0..nb {
            // SAFETY: record b lies inside `group` (nb whole records, checked above).
            let r = unsafe { group.as_ptr().add(b * rec) };
            if fetch {
                prefetch_ahead(r, rec);
            }
            // SAFETY: a record holds 16 f16 scales (and 16 minimums for Q4_1) before its quants.
            let dw = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(r as *const __m256i)) };
            let mut part = [[_mm512_setzero_si512(); PARTS]; T];
            if Q == 0 {
                for (s, t) in part.iter_mut().zip(toks) {
                    s[0] = _mm512_set1_epi32(-8 * t.sum[b]);
                }
            }
            let e0 = b * QBLOCK;
            let p = parts(T);
            if Q == 8 {
                for c in 0..QBLOCK / 2 {
                    // SAFETY: the record's quants are 16 chunks of 32 bytes.
                    let v = unsafe { _mm256_loadu_si256(r.add(qa + 32 * c) as *const __m256i) };
                    let w = _mm512_cvtepi8_epi16(_mm256_xor_si256(v, flip));
                    for (s, &x) in part.iter_mut().zip(&xs) {
                        s[c % p] = dpwssd(s[c % p], w, pair(x, e0 + 2 * c));
                    }
                }
            } else {
                for c in 0..QBLOCK / 4 {
                    // SAFETY: the record's quants are 8 chunks of 32 bytes.
                    let v = unsafe { _mm256_loadu_si256(r.add(qa + 32 * c) as *const __m256i) };
                    let w = _mm512_cvtepu8_epi16(v);
                    let (lo, hi) = (_mm512_and_si512(w, low), _mm512_srli_epi16::<4>(w));
                    let (i, j) = ((2 * c) % p, (2 * c + 1) % p);
                    for (s, &x) in part.iter_mut().zip(&xs) {
                        s[i] = dpwssd(s[i], lo, pair(x, e0 + 4 * c));
                        s[j] = dpwssd(s[j], hi, pair(x, e0 + 4 * c + 2));
                    }
                }
            }
            let isum = gather::<T>(&part);
            scale_block::<T, Q>(&mut acc, &isum, dw, r.wrapping_add(2 * ROWS), toks, b);
        }
        store(out, &acc);
    }

    // ---- AVX2: 8 rows per vector, the group in two halves --------------------------------------

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
            by_type!(dtype, dot_avx2_q::<T>(group, toks, acc, half, fetch))
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_q<const T: usize, const Q: u8>(
        group: &[u8],
        toks: &[Tok<'_>],
        out: &mut [[f32; ROWS]; MAX_GROUP],
        half: usize,
        fetch: bool,
    ) {
        let dtype = q_type(Q);
        let (rec, qa) = (record_bytes(dtype), quants_at(dtype));
        let (low, ones, flip) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1), _mm256_set1_epi8(-128));
        let mut acc = [_mm256_setzero_ps(); T];
        // This half's rows: 8 scales (16 bytes) and 32 bytes of every 64-byte chunk.
        let (so, qo) = (16 * half, 32 * half);
        for (b, r) in group.chunks_exact(rec).enumerate() {
            // SAFETY: a record holds 16 f16 scales (and 16 minimums for Q4_1) before its quants.
            let dw = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(r[so..].as_ptr() as *const __m128i)) };
            if fetch && half == 0 {
                prefetch_ahead(r.as_ptr(), rec);
            }
            let mut isum = [_mm256_setzero_si256(); T];
            for (s, t) in isum.iter_mut().zip(toks) {
                if Q == 0 {
                    *s = _mm256_set1_epi32(-8 * t.sum[b]);
                }
            }
            let e0 = b * QBLOCK;
            if Q == 8 {
                for c in 0..QBLOCK / 4 {
                    let at = qa + 64 * c + qo;
                    // SAFETY: the record's quants are 8 chunks of 64 bytes.
                    let v = unsafe { _mm256_loadu_si256(r[at..at + 32].as_ptr() as *const __m256i) };
                    // Back to signed weights; |w| as the unsigned operand and the token's quants
                    // carrying w's sign (pairwise sums stay below 2 · 128 · 127: no saturation).
                    let w = _mm256_xor_si256(v, flip);
                    let aw = _mm256_sign_epi8(w, w);
                    for (s, t) in isum.iter_mut().zip(toks) {
                        let x = _mm256_sign_epi8(_mm256_set1_epi32(quad(t, e0 + 4 * c)), w);
                        *s = _mm256_add_epi32(*s, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones));
                    }
                }
            } else {
                for c in 0..QBLOCK / 8 {
                    let at = qa + 64 * c + qo;
                    // SAFETY: the record's quants are 4 chunks of 64 bytes.
                    let v = unsafe { _mm256_loadu_si256(r[at..at + 32].as_ptr() as *const __m256i) };
                    let lo = _mm256_and_si256(v, low);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                    for (s, t) in isum.iter_mut().zip(toks) {
                        let xl = _mm256_set1_epi32(quad(t, e0 + 8 * c));
                        let xh = _mm256_set1_epi32(quad(t, e0 + 8 * c + 4));
                        let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
                        *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p, ones));
                    }
                }
            }
            // SAFETY: a Q4_1 record holds its 16 minimums after the 16 scales.
            scale_half::<T, Q>(&mut acc, &isum, dw, unsafe { r.as_ptr().add(2 * ROWS + so) }, toks, b);
        }
        store_half(out, &acc, half);
    }

    /// The end of a block for one half (8 rows), as [`scale_block`] does it for 16: each token's
    /// integer sums times the rows' scales and the token's block scale, plus Q4_1's minimums (8
    /// f16 at `mins`) times the token's `d · Σ q`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn scale_half<const T: usize, const Q: u8>(
        acc: &mut [__m256; T],
        isum: &[__m256i; T],
        dw: __m256,
        mins: *const u8,
        toks: &[Tok<'_>],
        b: usize,
    ) {
        let mw = if Q == 1 {
            // SAFETY: for Q4_1 the caller points `mins` at this half's 8 minimums.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(mins as *const __m128i)) }
        } else {
            _mm256_setzero_ps()
        };
        for ((a, s), t) in acc.iter_mut().zip(isum).zip(toks) {
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(t.d[b]));
            *a = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(*s), *a);
            if Q == 1 {
                *a = _mm256_fmadd_ps(mw, _mm256_set1_ps(t.ds[b]), *a);
            }
        }
    }

    /// Writes one half's 8 rows of each token's results.
    #[inline]
    #[target_feature(enable = "avx")]
    pub(in crate::cpu) fn store_half<const T: usize>(
        out: &mut [[f32; ROWS]; MAX_GROUP],
        acc: &[__m256; T],
        half: usize,
    ) {
        for (o, a) in out.iter_mut().zip(acc) {
            // SAFETY: o holds 16 f32; this half writes 8 of them.
            unsafe { _mm256_storeu_ps(o[8 * half..].as_mut_ptr(), *a) };
        }
    }

    // ---- AVX2, 16-bit activations: 8 rows per vector, the group in two halves -------------------

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
            by_type!(dtype, dot16_avx2_q::<T>(group, toks, acc, half, fetch))
        }
    }

    /// One half (8 rows) of a group packed for 16-bit activations: 16 bytes of every 32-byte
    /// chunk widened to 16 bits give each row's lane two weights, and `vpmaddwd` adds their two
    /// products into it. The integer sums are those of [`dot16_avx512`] and the scales are applied
    /// by the same operations in the same order, so the results are its bits.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot16_avx2_q<const T: usize, const Q: u8>(
        group: &[u8],
        toks: &[Tok<'_>],
        out: &mut [[f32; ROWS]; MAX_GROUP],
        half: usize,
        fetch: bool,
    ) {
        let dtype = q_type(Q);
        let (rec, qa) = (record_bytes(dtype), quants_at(dtype));
        let (nb, xs) = records16::<T>(group, rec, toks);
        let (low, flip) = (_mm256_set1_epi16(0x0F), _mm_set1_epi8(-128));
        // SAFETY (all uses): e + 2 <= nb · 32 <= the token's quant count, checked above.
        let pair =
            |x: *const i16, e: usize| unsafe { _mm256_set1_epi32((x.add(e) as *const i32).read_unaligned()) };
        // This half's rows: 8 scales (16 bytes) and 16 bytes of every 32-byte chunk.
        let (so, qo) = (16 * half, 16 * half);
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..nb {
            // SAFETY: record b lies inside `group` (nb whole records, checked above).
            let r = unsafe { group.as_ptr().add(b * rec) };
            if fetch && half == 0 {
                prefetch_ahead(r, rec);
            }
            // SAFETY: a record holds 16 f16 scales (and 16 minimums for Q4_1) before its quants.
            let dw = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(r.add(so) as *const __m128i)) };
            let mut isum = [_mm256_setzero_si256(); T];
            if Q == 0 {
                for (s, t) in isum.iter_mut().zip(toks) {
                    *s = _mm256_set1_epi32(-8 * t.sum[b]);
                }
            }
            let e0 = b * QBLOCK;
            if Q == 8 {
                for c in 0..QBLOCK / 2 {
                    // SAFETY: the record's quants are 16 chunks of 32 bytes.
                    let v = unsafe { _mm_loadu_si128(r.add(qa + 32 * c + qo) as *const __m128i) };
                    let w = _mm256_cvtepi8_epi16(_mm_xor_si128(v, flip));
                    for (s, &x) in isum.iter_mut().zip(&xs) {
                        *s = _mm256_add_epi32(*s, _mm256_madd_epi16(w, pair(x, e0 + 2 * c)));
                    }
                }
            } else {
                for c in 0..QBLOCK / 4 {
                    // SAFETY: the record's quants are 8 chunks of 32 bytes.
                    let v = unsafe { _mm_loadu_si128(r.add(qa + 32 * c + qo) as *const __m128i) };
                    let w = _mm256_cvtepu8_epi16(v);
                    let (lo, hi) = (_mm256_and_si256(w, low), _mm256_srli_epi16::<4>(w));
                    for (s, &x) in isum.iter_mut().zip(&xs) {
                        let p = _mm256_add_epi32(
                            _mm256_madd_epi16(lo, pair(x, e0 + 4 * c)),
                            _mm256_madd_epi16(hi, pair(x, e0 + 4 * c + 2)),
                        );
                        *s = _mm256_add_epi32(*s, p);
                    }
                }
            }
            scale_half::<T, Q>(&mut acc, &isum, dw, r.wrapping_add(2 * ROWS + so), toks, b);
        }
        store_half(out, &acc, half);
    }
}
