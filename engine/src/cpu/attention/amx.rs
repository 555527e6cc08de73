//! Attention's products on AMX bf16 tiles, for 16-bit KV pools and head sizes that are multiples
//! of 32, on Xeons whose kernel grants the tile state.
//!
//! # The arithmetic
//! A tile product multiplies bf16 values (8 significant bits) and accumulates in f32. Used plainly
//! it would round every query and weight to 8 bits, so each operand is split into a high and a
//! low bf16 part and three products are summed:
//! - **Scores.** An f16 key is exactly `kh + kl` (11 significant bits); a bf16 key is `kh` alone.
//!   A query is `qh + ql` to 16 bits (both truncated), and `q · k` is computed as
//!   `kh·qh + kl·qh + kh·ql`: what is left out (`ql·kl`, below 2⁻¹⁴ of `|q_d k_d|`, and the
//!   query's bits past 16, below 2⁻¹⁵) is below 3·2⁻¹⁵ of `Σ|q_d k_d|`, about a fifth of what
//!   storing the key in f16 already costs.
//! - **Weighted values.** A weight `w` in [0, 1] is `wh + wl` to 16 bits, a value `vh + vl`
//!   exactly, and the sum is of `wh·vh + wl·vh + wh·vl`: within 3·2⁻¹⁵ of `Σ w|v|`.
//!
//! # The layout
//! A task's rows go in groups of 16 (a tile's width), and positions in steps of [`STEP`] (32,
//! from multiples of 32 in the sequence). For each step:
//! - the step's keys are split into high and low parts, 32 rows of `hd`; its values are split and
//!   interleaved by pairs of positions (the layout a tile product's second operand takes);
//! - per group, two tile products give the scores of the two halves of the step as
//!   16 positions × 16 rows (keys times the group's queries, which were laid out once per call),
//!   transposed in registers to one vector of 16 scores per row;
//! - each row updates its running maximum, sums and weighted values exactly as the vector kernel
//!   does per tile (in steps of 32 rather than 16), and writes its weights' two parts as a row of
//!   32 bf16;
//! - three more tile products per 16 dimensions add the weights times the values to the rows'
//!   weighted sums, which stay in memory as 16 rows of `hd` f32.
//!
//! Each result of a tile product depends only on one row of its first operand and one column of
//! its second: a row's scores and sums never depend on the other rows of its group. Positions a
//! row does not see get the weight +0 (their keys and values are still multiplied, as zeros when
//! no row of the call sees them). A value row holding an infinity or a NaN (an f16 pool stores
//! one where a value overflowed) is taken out of the tiles and added in scalar code to the rows
//! that see it only, since `0 · ∞` is NaN; and a row's sums leave the kernel with `−0` made `+0`,
//! since the sign of a zero sum could depend on the zeros the other rows' positions added. So a
//! row's bits depend only on its query, the positions it sees and their keys and values, as with
//! the vector kernel.

use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::OnceLock;

use super::x86::{raise, scored};
use super::{check, Emit, Partial, RowState, ScoreRule, SEGMENT};
use crate::cpu::q8::amx as tiles;
use crate::kv::KvSlice;
use crate::vmath::x86::exp16;

/// Positions per step: the weights of a step are one tile row of 32 bf16.
pub const STEP: usize = 32;
/// Rows per group: a tile's columns.
const GROUP: usize = 16;
/// How far ahead of its use (in positions) a key or value row is fetched: further than the
/// vector kernel, whose steps take longer (a decode step at depth waits on memory).
const AHEAD: usize = 128;
/// Bytes of one tile row.
const ROW_BYTES: usize = 64;

/// Whether the bf16 tiles can be used here: the integer tiles' conditions (CPU, kernel grant,
/// `TANDEM_AMX`), the CPU lists AMX-BF16, and a bf16 tile product computes what it should.
pub fn usable() -> Result<(), String> {
    static USABLE: OnceLock<Result<(), String>> = OnceLock::new();
    USABLE
        .get_or_init(|| {
            tiles::usable()?;
            use std::arch::is_x86_feature_detected as has;
            let vector = has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq");
            if !(vector && has!("fma") && has!("f16c")) {
                return Err("this CPU lacks AVX-512 F, BW, VL or DQ, FMA or F16C".into());
            }
            // CPUID leaf 7, EDX bit 22: AMX-BF16.
            if __cpuid_count(7, 0).edx & (1 << 22) == 0 {
                return Err("this CPU has no AMX-BF16".into());
            }
            self_test()
        })
        .clone()
}

/// Loads the configuration into this thread's tiles; [`Tiles`]'s drop releases them.
struct Tiles;

impl Tiles {
    /// # Safety
    /// [`usable`] must have returned `Ok`.
    unsafe fn load() -> Tiles {
        // SAFETY: the caller checked the tiles are usable.
        unsafe { tiles::Config::uniform(GROUP, ROW_BYTES).load() };
        Tiles
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: only a loaded configuration makes a `Tiles`; release returns the tiles to their
        // initial state, so a context switch saves no tile data.
        unsafe { tiles::release() };
    }
}

/// One bf16 tile product on small integers (every sum exact in f32) against the scalar sums.
fn self_test() -> Result<(), String> {
    let bf = |x: f32| (x.to_bits() >> 16) as u16;
    let a: Vec<u16> = (0..GROUP * 32).map(|i| bf(((i * 7 + 3) % 17) as f32 - 8.0)).collect();
    let b: Vec<u16> = (0..GROUP * 32).map(|i| bf(((i * 5 + 1) % 13) as f32 - 6.0)).collect();
    let mut c = [0f32; GROUP * GROUP];
    // SAFETY: the integer tiles are usable (checked first by the caller) and the CPU lists
    // AMX-BF16; the buffers hold the 16 rows of 64 bytes each tile reads or writes.
    unsafe {
        let _tiles = Tiles::load();
        asm!(
            "tilezero tmm0",
            "tileloadd tmm2, [{a} + {s}*1]",
            "tileloadd tmm4, [{b} + {s}*1]",
            "tdpbf16ps tmm0, tmm2, tmm4",
            "tilestored [{c} + {s}*1], tmm0",
            a = in(reg) a.as_ptr(), b = in(reg) b.as_ptr(), c = in(reg) c.as_mut_ptr(),
            s = in(reg) ROW_BYTES, options(nostack),
        );
    }
    let f = |x: u16| f32::from_bits((x as u32) << 16);
    for m in 0..GROUP {
        for n in 0..GROUP {
            let want: f32 = (0..32).map(|k| f(a[m * 32 + k]) * f(b[(k / 2) * 32 + 2 * n + k % 2])).sum();
            if c[m * GROUP + n] != want {
                return Err("a bf16 tile product computed a wrong sum".into());
            }
        }
    }
    Ok(())
}

/// The high and low bf16 parts of `x` (both truncated): `x − hi − lo` is below 2⁻¹⁵ of `|x|`
/// (and is 0 for an f16 or bf16 value).
#[inline]
pub fn split(x: f32) -> (u16, u16) {
    let hi = x.to_bits() & 0xFFFF_0000;
    let lo = x - f32::from_bits(hi);
    ((hi >> 16) as u16, (lo.to_bits() >> 16) as u16)
}

/// Reusable buffers (one per thread, inside [`super::AttendScratch`]).
#[derive(Debug, Default)]
pub(super) struct AmxScratch {
    /// The step's keys, high and low parts: [`STEP`] rows of `hd` bf16.
    kh: Vec<u16>,
    kl: Vec<u16>,
    /// The step's values, per 16 dimensions 16 rows (pairs of positions) of 16 × 2 bf16.
    vh: Vec<u16>,
    vl: Vec<u16>,
    /// Per group and 32 dimensions, the queries as 16 rows (pairs of dimensions) of 16 × 2 bf16.
    qh: Vec<u16>,
    ql: Vec<u16>,
    /// Per group, its rows' weighted sums of values over the segment: 16 rows of `hd`.
    acc: Vec<f32>,
    state: Vec<RowState>,
    /// The two halves' scores as tiles store them: 16 positions × 16 rows each.
    scores: Vec<f32>,
    /// A group's weights for the step, high and low parts: 16 rows of 32 bf16.
    wh: Vec<u16>,
    wl: Vec<u16>,
    /// One row's sums as they leave the kernel.
    out: Vec<f32>,
}

/// [`super::tiles`] on the tiles.
///
/// # Safety
/// [`usable`] returned `Ok` (which includes AVX-512 F, BW, VL and DQ, FMA and F16C) and the head
/// size is a multiple of 32. Key and value rows (f16, bf16, or f32 holding such values) are
/// checked to be a head long before they are read.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")]
pub(super) unsafe fn tiles_amx<'a>(
    qs: &[f32],
    spans: &[Range<usize>],
    segs: Range<usize>,
    keys: &impl Fn(usize) -> KvSlice<'a>,
    values: &impl Fn(usize) -> KvSlice<'a>,
    rule: ScoreRule,
    s: &mut AmxScratch,
    emit: &mut Emit<'_>,
) {
    let (hd, lo, hi) = check(qs, spans);
    debug_assert!(hd.is_multiple_of(32));
    let rows = spans.len();
    let groups = rows.div_ceil(GROUP);
    let chunks = hd / 32;
    // The queries in the second operand's layout, once per call.
    let qlen = groups * chunks * GROUP * 32;
    s.qh.clear();
    s.qh.resize(qlen, 0);
    s.ql.clear();
    s.ql.resize(qlen, 0);
    for r in 0..rows {
        let (g, n) = (r / GROUP, r % GROUP);
        for d in 0..hd {
            let (h, l) = split(qs[r * hd + d]);
            let at = ((g * chunks + d / 32) * GROUP + (d % 32) / 2) * 32 + 2 * n + d % 2;
            s.qh[at] = h;
            s.ql[at] = l;
        }
    }
    s.kh.resize(STEP * hd, 0);
    s.kl.resize(STEP * hd, 0);
    s.vh.resize(STEP * hd, 0);
    s.vl.resize(STEP * hd, 0);
    s.acc.resize(groups * GROUP * hd, 0.0);
    s.state.resize(rows, RowState::default());
    s.scores.resize(2 * GROUP * GROUP, 0.0);
    s.wh.resize(GROUP * STEP, 0);
    s.wl.resize(GROUP * STEP, 0);
    // SAFETY: the caller checked the tiles are usable.
    let _tiles = unsafe { Tiles::load() };
    let tr = Transpose::new();
    let mut first_step = true;
    for seg in segs {
        let (s0, s1) = ((seg * SEGMENT).max(lo), ((seg + 1) * SEGMENT).min(hi));
        if s0 >= s1 {
            continue;
        }
        for (r, span) in spans.iter().enumerate() {
            let live = span.start < s1 && s0 < span.end;
            s.state[r] = RowState { live, ..RowState::default() };
        }
        s.acc.fill(0.0);
        let mut t = s0 / STEP * STEP;
        while t < s1 {
            let (a, b) = (t.max(s0), (t + STEP).min(s1));
            // The positions of the step some row sees.
            let (ua, ub) = spans
                .iter()
                .filter(|sp| sp.start < b && a < sp.end)
                .fold((usize::MAX, 0), |(x, y), sp| (x.min(sp.start.max(a)), y.max(sp.end.min(b))));
            if ua < ub {
                // SAFETY: the features are this function's.
                // `bad`: positions of the step whose values are not finite (left out of the tiles).
                let bad = unsafe {
                    super::x86::prefetch_span(keys, values, t, STEP, AHEAD, first_step, hi);
                    lay_out_keys(keys, t, ua..ub, hd, &mut s.kh, &mut s.kl);
                    lay_out_values(values, t, ua..ub, hd, &mut s.vh, &mut s.vl)
                };
                first_step = false;
                for g in 0..groups {
                    let rr = g * GROUP..((g + 1) * GROUP).min(rows);
                    // Per row, the positions of the step it sees, as bits.
                    let masks: [u32; GROUP] = std::array::from_fn(|n| {
                        let Some(sp) = spans.get(g * GROUP + n).filter(|_| n < rr.len()) else { return 0 };
                        let (from, to) = (sp.start.max(a), sp.end.min(b));
                        if from >= to {
                            return 0;
                        }
                        let upto = |x: usize| if x - t >= 32 { u32::MAX } else { (1u32 << (x - t)) - 1 };
                        upto(to) & !upto(from)
                    });
                    if masks.iter().all(|&m| m == 0) {
                        continue;
                    }
                    let acc = &mut s.acc[g * GROUP * hd..][..GROUP * hd];
                    // SAFETY: the tiles are configured; every buffer holds what its tiles read or
                    // write (sized above), and the features are this function's.
                    unsafe {
                        let q = g * chunks * GROUP * 32;
                        scores(&s.kh, &s.kl, &s.qh[q..], &s.ql[q..], hd, &mut s.scores);
                        // Few rows (a decode step) gather their scores; many transpose them
                        // all (the same values either way).
                        let sv = if rr.len() <= FEW_ROWS {
                            gathered(&s.scores, rr.len())
                        } else {
                            transposed(&s.scores, &tr)
                        };
                        for n in 0..GROUP {
                            let (wh, wl) = (&mut s.wh[n * STEP..][..STEP], &mut s.wl[n * STEP..][..STEP]);
                            if masks[n] == 0 {
                                wh.fill(0);
                                wl.fill(0);
                                continue;
                            }
                            let st = &mut s.state[g * GROUP + n];
                            let row_acc = &mut acc[n * hd..][..hd];
                            weights([sv[0][n], sv[1][n]], masks[n], rule, st, row_acc, wh, wl);
                        }
                        add_values(&s.wh, &s.wl, &s.vh, &s.vl, hd, acc);
                    }
                    if bad != 0 {
                        for (n, &m) in masks.iter().enumerate() {
                            add_non_finite(
                                values,
                                t,
                                m & bad,
                                &s.wh[n * STEP..][..STEP],
                                &s.wl[n * STEP..][..STEP],
                                &mut acc[n * hd..][..hd],
                            );
                        }
                    }
                }
            }
            t += STEP;
        }
        for (r, st) in s.state.iter().enumerate() {
            if st.live {
                let sum = super::x86::lane_total(&st.lanes);
                // `x + 0` is `x`, except that `−0` becomes `+0`.
                s.out.clear();
                s.out.extend(s.acc[r * hd..][..hd].iter().map(|&x| x + 0.0));
                emit(r, seg, Partial { max: st.max, sum }, &s.out);
            }
        }
    }
}

/// 16 values of a key or value row from `at`, as f32.
///
/// # Safety
/// On a CPU with AVX-512F and F16C; `at + 16 <= row.len()`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn load16(row: KvSlice<'_>, at: usize) -> __m512 {
    // SAFETY: 16 elements from `at` lie inside the row (the caller's promise).
    unsafe {
        match row {
            KvSlice::F16(x) => _mm512_cvtph_ps(_mm256_loadu_si256(x.as_ptr().add(at) as *const __m256i)),
            KvSlice::Bf16(x) => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(x.as_ptr().add(at) as *const __m256i),
            ))),
            KvSlice::F32(x) => _mm512_loadu_ps(x.as_ptr().add(at)),
            KvSlice::Fp8(x) => {
                crate::kv::dtype::simd::fp8x16(_mm_loadu_si128(x.as_ptr().add(at) as *const __m128i))
            }
        }
    }
}

/// The f32 bits that are a bf16 value: the high half.
#[inline]
#[target_feature(enable = "avx512f")]
fn high_half(x: __m512) -> __m512 {
    _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0xFFFF_0000u32 as i32)))
}

/// The high halves of `a`'s then `b`'s 16 lanes: 32 bf16 (truncated).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn pack_high(a: __m512, b: __m512) -> __m512i {
    // Word 2i + 1 is the high half of lane i; indices from 32 read `b`.
    let idx = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15,
        13, 11, 9, 7, 5, 3, 1,
    );
    _mm512_permutex2var_epi16(_mm512_castps_si512(a), idx, _mm512_castps_si512(b))
}

/// Lane `i`: the high half of `odd`'s lane `i` above the high half of `even`'s (a pair of
/// positions in the layout of a tile product's second operand).
#[inline]
#[target_feature(enable = "avx512f")]
fn pair_high(even: __m512, odd: __m512) -> __m512i {
    let e = _mm512_srli_epi32::<16>(_mm512_castps_si512(even));
    // (odd & mask) | e
    _mm512_ternarylogic_epi32::<0xEA>(_mm512_castps_si512(odd), _mm512_set1_epi32(0xFFFF_0000u32 as i32), e)
}

/// The keys of positions `seen` (inside the step from `t`) split into rows of `kh` and `kl`;
/// the step's other rows are zeros.
///
/// # Safety
/// On a CPU with the features enabled here; `kh` and `kl` hold [`STEP`] rows of `hd`, a multiple
/// of 32; `keys` gives f16 or bf16 rows of `hd`.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn lay_out_keys<'a>(
    keys: &impl Fn(usize) -> KvSlice<'a>,
    t: usize,
    seen: Range<usize>,
    hd: usize,
    kh: &mut [u16],
    kl: &mut [u16],
) {
    for i in 0..STEP {
        let (h, l) = (&mut kh[i * hd..][..hd], &mut kl[i * hd..][..hd]);
        if !seen.contains(&(t + i)) {
            h.fill(0);
            l.fill(0);
            continue;
        }
        let row = keys(t + i);
        assert_eq!(row.len(), hd, "attention: key row of position {}", t + i);
        for c in (0..hd).step_by(32) {
            // SAFETY: 32 values from `c` lie inside the row and inside `h` and `l`.
            unsafe {
                let (x0, x1) = (load16(row, c), load16(row, c + 16));
                let (l0, l1) = (_mm512_sub_ps(x0, high_half(x0)), _mm512_sub_ps(x1, high_half(x1)));
                _mm512_storeu_si512(h.as_mut_ptr().add(c) as *mut __m512i, pack_high(x0, x1));
                _mm512_storeu_si512(l.as_mut_ptr().add(c) as *mut __m512i, pack_high(l0, l1));
            }
        }
    }
}

/// The values of positions `seen` (inside the step from `t`) split and interleaved by pairs of
/// positions: per 16 dimensions, row `i / 2` lane `n` holds positions `i` and `i + 1` of
/// dimension `n`; positions outside `seen` are zeros, and so are positions whose row holds a
/// value that is not finite: bit `i` of the result says so for position `t + i`.
///
/// # Safety
/// As [`lay_out_keys`], for `values`.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn lay_out_values<'a>(
    values: &impl Fn(usize) -> KvSlice<'a>,
    t: usize,
    seen: Range<usize>,
    hd: usize,
    vh: &mut [u16],
    vl: &mut [u16],
) -> u32 {
    let mut bad = 0u32;
    for pair in 0..STEP / 2 {
        let (p0, p1) = (t + 2 * pair, t + 2 * pair + 1);
        let take = |p: usize| {
            seen.contains(&p).then(|| {
                let row = values(p);
                assert_eq!(row.len(), hd, "attention: value row of position {p}");
                row
            })
        };
        let mut rows = [take(p0), take(p1)];
        loop {
            // Per position, lanes whose value is not finite (its low part `x − hi` is then NaN).
            let mut unord: [__mmask16; 2] = [0; 2];
            for c in (0..hd).step_by(16) {
                // SAFETY: 16 values from `c` lie inside a row; the 16 × 2 bf16 written lie inside
                // the buffers (`hd / 16` blocks of 16 rows of 32).
                unsafe {
                    let [x0, x1] = rows.map(|r| match r {
                        Some(r) => load16(r, c),
                        None => _mm512_setzero_ps(),
                    });
                    let (l0, l1) = (_mm512_sub_ps(x0, high_half(x0)), _mm512_sub_ps(x1, high_half(x1)));
                    unord[0] |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(l0, l0);
                    unord[1] |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(l1, l1);
                    let at = ((c / 16) * GROUP + pair) * 32;
                    _mm512_storeu_si512(vh.as_mut_ptr().add(at) as *mut __m512i, pair_high(x0, x1));
                    _mm512_storeu_si512(vl.as_mut_ptr().add(at) as *mut __m512i, pair_high(l0, l1));
                }
            }
            if unord == [0, 0] {
                break;
            }
            // Again, without the rows that are not finite (rare): they become zeros.
            for (j, u) in unord.into_iter().enumerate() {
                if u != 0 {
                    bad |= 1 << (2 * pair + j);
                    rows[j] = None;
                }
            }
        }
    }
    bad
}

/// `acc += w_p · v_p` for the positions `t + i` of `which`'s bits (values left out of the tiles
/// because one is not finite), in increasing position, with the weight's two parts added in f32.
fn add_non_finite<'a>(
    values: &impl Fn(usize) -> KvSlice<'a>,
    t: usize,
    which: u32,
    wh: &[u16],
    wl: &[u16],
    acc: &mut [f32],
) {
    let part = |x: u16| f32::from_bits((x as u32) << 16);
    for i in (0..STEP).filter(|&i| which & (1 << i) != 0) {
        let w = part(wh[i]) + part(wl[i]);
        for (a, v) in acc.iter_mut().zip(values(t + i).to_f32_vec()) {
            *a += w * v;
        }
    }
}

/// The scores (unscaled dot products) of the step's two halves for a group: `out[h * 256 +
/// p * 16 + n]` is position `16 h + p` against row `n`.
///
/// # Safety
/// The tiles are configured ([`Tiles::load`]); `kh` and `kl` hold [`STEP`] rows of `hd` (a
/// multiple of 32), `qh` and `ql` the group's `hd / 32` blocks of 512, `out` 512 floats.
#[inline]
unsafe fn scores(kh: &[u16], kl: &[u16], qh: &[u16], ql: &[u16], hd: usize, out: &mut [f32]) {
    debug_assert!(kh.len() >= STEP * hd && qh.len() >= hd / 32 * 512 && out.len() >= 512);
    let stride = 2 * hd;
    // SAFETY (the block): each tile reads 16 rows of 64 bytes inside its buffer (rows `stride`
    // bytes apart for the keys) and the stores write the 512 floats of `out`.
    unsafe {
        asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
        for c in 0..hd / 32 {
            // Two independent sums (the halves), so two products are in flight.
            asm!(
                "tileloadd tmm4, [{qh} + {r}*1]",
                "tileloadd tmm5, [{ql} + {r}*1]",
                "tileloadd tmm2, [{kh0} + {s}*1]",
                "tileloadd tmm3, [{kl0} + {s}*1]",
                "tileloadd tmm6, [{kh1} + {s}*1]",
                "tileloadd tmm7, [{kl1} + {s}*1]",
                "tdpbf16ps tmm0, tmm2, tmm4",
                "tdpbf16ps tmm1, tmm6, tmm4",
                "tdpbf16ps tmm0, tmm3, tmm4",
                "tdpbf16ps tmm1, tmm7, tmm4",
                "tdpbf16ps tmm0, tmm2, tmm5",
                "tdpbf16ps tmm1, tmm6, tmm5",
                qh = in(reg) qh.as_ptr().add(c * 512),
                ql = in(reg) ql.as_ptr().add(c * 512),
                kh0 = in(reg) kh.as_ptr().add(c * 32),
                kl0 = in(reg) kl.as_ptr().add(c * 32),
                kh1 = in(reg) kh.as_ptr().add(16 * hd + c * 32),
                kl1 = in(reg) kl.as_ptr().add(16 * hd + c * 32),
                s = in(reg) stride,
                r = in(reg) ROW_BYTES,
                options(nostack, readonly),
            );
        }
        asm!(
            "tilestored [{o0} + {r}*1], tmm0",
            "tilestored [{o1} + {r}*1], tmm1",
            o0 = in(reg) out.as_mut_ptr(),
            o1 = in(reg) out.as_mut_ptr().add(256),
            r = in(reg) ROW_BYTES,
            options(nostack),
        );
    }
}

/// Groups of at most this many rows gather their scores rather than transpose them.
const FEW_ROWS: usize = 6;

/// [`transposed`] for the first `rows` rows, by gathers (the other rows' vectors are zeros).
///
/// # Safety
/// As [`transposed`]; `rows <= 16`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn gathered(scores: &[f32], rows: usize) -> [[__m512; GROUP]; 2] {
    debug_assert!(scores.len() >= 512 && rows <= GROUP);
    let idx = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    std::array::from_fn(|h| {
        std::array::from_fn(|n| {
            if n < rows {
                // SAFETY: the 16 indices from `h * 256 + n` lie inside the 512 floats.
                unsafe { _mm512_i32gather_ps::<4>(idx, scores.as_ptr().add(h * 256 + n)) }
            } else {
                _mm512_setzero_ps()
            }
        })
    })
}

/// The permutation indices of a 16 × 16 transpose in four rounds: per round (blocks of 8, 4, 2
/// and 1), the indices that keep a row's own lanes and those that take its partner's.
pub(super) struct Transpose([(__m512i, __m512i); 4]);

impl Transpose {
    #[target_feature(enable = "avx512f")]
    fn new() -> Transpose {
        Transpose([8usize, 4, 2, 1].map(|b| {
            let (mut keep, mut take) = ([0i32; 16], [0i32; 16]);
            for l in 0..16 {
                keep[l] = if l & b == 0 { l } else { 16 + l - b } as i32;
                take[l] = if l & b == 0 { l + b } else { 16 + l } as i32;
            }
            // SAFETY: 16 indices each.
            unsafe {
                (_mm512_loadu_si512(keep.as_ptr() as *const _), _mm512_loadu_si512(take.as_ptr() as *const _))
            }
        }))
    }
}

/// The two halves' scores, one vector of 16 positions per row: `[half][row]`.
///
/// # Safety
/// On a CPU with AVX-512F; `scores` holds 512 floats as [`scores`] writes them.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn transposed(scores: &[f32], tr: &Transpose) -> [[__m512; GROUP]; 2] {
    debug_assert!(scores.len() >= 512);
    std::array::from_fn(|h| {
        // SAFETY: 16 rows of 16 floats inside `scores`.
        let mut m: [__m512; GROUP] =
            std::array::from_fn(|p| unsafe { _mm512_loadu_ps(scores.as_ptr().add(h * 256 + p * 16)) });
        // Swap the off-diagonal blocks of 8, then 4, 2 and 1: a transpose.
        for (round, b) in [8usize, 4, 2, 1].into_iter().enumerate() {
            let (keep, take) = tr.0[round];
            for i in (0..16).filter(|i| i & b == 0) {
                let (x, y) = (m[i], m[i + b]);
                m[i] = _mm512_permutex2var_ps(x, keep, y);
                m[i + b] = _mm512_permutex2var_ps(x, take, y);
            }
        }
        m
    })
}

/// One row's step: its scores (two halves of 16) scaled, its running maximum raised where a seen
/// score exceeds it (rescaling its sums and `acc`), its weights `e^(s − max)` (0 where `mask`'s
/// bit is clear) added to its sums, and written as high and low bf16 parts to `wh` and `wl`.
///
/// # Safety
/// On a CPU with the features enabled here; `acc` is the row's `hd` values, `wh` and `wl` 32 long.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma")]
unsafe fn weights(
    dots: [__m512; 2],
    mask: u32,
    rule: ScoreRule,
    st: &mut RowState,
    acc: &mut [f32],
    wh: &mut [u16],
    wl: &mut [u16],
) {
    let m = [mask as __mmask16, (mask >> 16) as __mmask16];
    let s = dots.map(|d| scored(d, rule));
    // SAFETY: 16 floats.
    let mut sum = unsafe { _mm512_loadu_ps(st.lanes.as_ptr()) };
    // SAFETY: `acc` is the row's weighted values.
    unsafe { raise([(m[0], s[0]), (m[1], s[1])], st, &mut sum, acc) };
    let max = _mm512_set1_ps(st.max);
    let w = [0, 1].map(|h| _mm512_maskz_mov_ps(m[h], exp16(_mm512_sub_ps(s[h], max))));
    sum = _mm512_add_ps(sum, w[0]);
    sum = _mm512_add_ps(sum, w[1]);
    let rest = w.map(|x| _mm512_sub_ps(x, high_half(x)));
    // SAFETY: 16 floats; 32 bf16 each.
    unsafe {
        _mm512_storeu_ps(st.lanes.as_mut_ptr(), sum);
        _mm512_storeu_si512(wh.as_mut_ptr() as *mut __m512i, pack_high(w[0], w[1]));
        _mm512_storeu_si512(wl.as_mut_ptr() as *mut __m512i, pack_high(rest[0], rest[1]));
    }
}

/// `acc += w · v` for a group: per 32 dimensions, two sums of 16 rows × 16 dimensions loaded from
/// `acc`, three products each (`wh·vh`, `wl·vh`, `wh·vl`), stored back.
///
/// # Safety
/// The tiles are configured; `wh` and `wl` hold 16 rows of 32 bf16, `vh` and `vl` the step's
/// values as [`lay_out_values`] writes them, `acc` 16 rows of `hd` (a multiple of 32).
#[inline]
unsafe fn add_values(wh: &[u16], wl: &[u16], vh: &[u16], vl: &[u16], hd: usize, acc: &mut [f32]) {
    debug_assert!(wh.len() >= GROUP * STEP && vh.len() >= STEP * hd && acc.len() >= GROUP * hd);
    // SAFETY (the block): the weights' and values' tiles read 16 rows of 64 bytes inside their
    // buffers; the sums read and write 16 rows of 16 floats, `4 hd` bytes apart, inside `acc`.
    unsafe {
        asm!(
            "tileloadd tmm2, [{wh} + {r}*1]",
            "tileloadd tmm3, [{wl} + {r}*1]",
            wh = in(reg) wh.as_ptr(),
            wl = in(reg) wl.as_ptr(),
            r = in(reg) ROW_BYTES,
            options(nostack, readonly),
        );
        for c in (0..hd).step_by(32) {
            let (v0, v1) = ((c / 16) * 512, (c / 16 + 1) * 512);
            asm!(
                "tileloadd tmm0, [{a0} + {s}*1]",
                "tileloadd tmm1, [{a1} + {s}*1]",
                "tileloadd tmm4, [{vh0} + {r}*1]",
                "tileloadd tmm6, [{vh1} + {r}*1]",
                "tileloadd tmm5, [{vl0} + {r}*1]",
                "tileloadd tmm7, [{vl1} + {r}*1]",
                "tdpbf16ps tmm0, tmm2, tmm4",
                "tdpbf16ps tmm1, tmm2, tmm6",
                "tdpbf16ps tmm0, tmm3, tmm4",
                "tdpbf16ps tmm1, tmm3, tmm6",
                "tdpbf16ps tmm0, tmm2, tmm5",
                "tdpbf16ps tmm1, tmm2, tmm7",
                "tilestored [{a0} + {s}*1], tmm0",
                "tilestored [{a1} + {s}*1], tmm1",
                a0 = in(reg) acc.as_mut_ptr().add(c),
                a1 = in(reg) acc.as_mut_ptr().add(c + 16),
                vh0 = in(reg) vh.as_ptr().add(v0),
                vh1 = in(reg) vh.as_ptr().add(v1),
                vl0 = in(reg) vl.as_ptr().add(v0),
                vl1 = in(reg) vl.as_ptr().add(v1),
                s = in(reg) 4 * hd,
                r = in(reg) ROW_BYTES,
                options(nostack),
            );
        }
    }
}
