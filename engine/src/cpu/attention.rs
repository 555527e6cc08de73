//! Attention on the CPU, tiled in the manner of flash attention: each query row's softmax is
//! computed as it goes (a running maximum and sum), so no row of scores is kept, and the key and
//! value rows of a tile are widened to f32 once for every query row of a call.
//!
//! **Where the tiles fall.** Positions are cut into tiles of [`TILE`] positions and segments of
//! [`SEGMENT`] positions, both starting at multiples of their size in the sequence (the pool's
//! blocks hold 16 positions, so a tile is a block or part of one). A row's arithmetic depends only
//! on its query, the positions it attends to and their keys and values; never on the other rows of
//! the call, on where its prompt was cut into chunks, or on how many threads share the work:
//! - within a segment, the row's tiles are taken in position order, each updating the running
//!   maximum, the per-lane sums of `e^(s − max)` and the weighted sum of values;
//! - each segment's result (a [`Partial`]) is merged into the row's result in segment order
//!   ([`merge`]), by the same function whether the segments were computed in one call
//!   ([`attend_rows`]) or spread over threads ([`attend_segments`], split decode).
//!
//! So a token's attention is the same bits whether its prompt came in one pass, in chunks, after a
//! prefix-cache hit, after a transfer or during speculation, and whether a decode step split its
//! context. Windows and causality skip whole tiles; a partly visible tile masks its other keys.
//!
//! The loops are compiled for AVX-512 (where the CPU has it) and in portable Rust, the latter
//! also for AVX2; the AVX-512 and portable results differ by summation order and by the
//! exponential, each being deterministic.

use std::ops::Range;

use super::ops::{axpy, dot, ScoreRule};
use crate::kv::dtype::{widen_bf16, widen_f16, widen_fp8};
use crate::kv::{KvDtype, KvSlice};

/// Positions per tile: the key and value rows one step of every query row reads.
pub const TILE: usize = 16;
/// Positions per segment: the unit a row's softmax is merged in, and split decode's unit of work.
pub const SEGMENT: usize = 256;

/// A row's softmax over some positions, before the division: the largest score and the sum of
/// `e^(score − max)`. The weighted sum of values that goes with it is kept beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Partial {
    pub max: f32,
    pub sum: f32,
}

impl Partial {
    /// No positions.
    pub const EMPTY: Partial = Partial { max: f32::NEG_INFINITY, sum: 0.0 };

    pub fn is_empty(&self) -> bool {
        self.max == f32::NEG_INFINITY
    }
}

/// Adds `part` (with its weighted values `part_acc`) into `run` (with `acc`): both rescaled to
/// the larger maximum. An empty part changes nothing; into an empty run, the part is copied.
pub fn merge(run: &mut Partial, acc: &mut [f32], part: Partial, part_acc: &[f32]) {
    if part.is_empty() {
        return;
    }
    if run.is_empty() {
        *run = part;
        acc.copy_from_slice(part_acc);
        return;
    }
    let max = run.max.max(part.max);
    let (a, b) = ((run.max - max).exp(), (part.max - max).exp());
    for (x, &y) in acc.iter_mut().zip(part_acc) {
        *x = *x * a + y * b;
    }
    run.sum = run.sum * a + part.sum * b;
    run.max = max;
}

/// The attention output of a merged row: its weighted values divided by its sum.
pub fn finish(run: Partial, acc: &[f32], out: &mut [f32]) {
    let inv = 1.0 / run.sum;
    for (o, &a) in out.iter_mut().zip(acc) {
        *o = a * inv;
    }
}

/// One row's state inside a segment.
#[derive(Debug, Clone, Copy)]
struct RowState {
    max: f32,
    /// Sums of `e^(s − max)`, lane `i` for the tiles' `i`-th positions.
    lanes: [f32; TILE],
    /// The row sees a position of the segment.
    live: bool,
}

impl Default for RowState {
    fn default() -> Self {
        RowState { max: f32::NEG_INFINITY, lanes: [0.0; TILE], live: false }
    }
}

/// Which kernels compute attention's products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernel {
    /// f32 products on AVX-512 where the CPU has it, else in portable code.
    #[default]
    Vector,
    /// bf16 tile products on AMX ([`amx`]) where the head size is a multiple of 32,
    /// [`Kernel::Vector`] elsewhere. For 16-bit KV pools only: keys and values must be f16 or
    /// bf16 values (f32 rows holding such values, as a pass's fresh rows do, give the same bits
    /// as the stored ones), since only those split exactly into two bf16 parts. Only where
    /// [`amx_usable`] says so.
    Amx,
}

/// Whether the AMX bf16 tiles can compute attention here (`Err` says why not).
pub fn amx_usable() -> Result<(), String> {
    #[cfg(target_arch = "x86_64")]
    return amx::usable();
    #[cfg(not(target_arch = "x86_64"))]
    return Err("AMX is an x86-64 extension".into());
}

/// What the AMX kernel is, in words.
const AMX_WORDS: &str = "attention on AMX bf16 tiles (16-bit KV, head sizes that are multiples of 32)";

/// The kernel a CPU backend uses unless told otherwise, and why, decided once per process (and
/// logged): the AMX tiles where [`amx_usable`] and `TANDEM_AMX_ATTENTION` is not `off`.
pub fn default_kernel() -> &'static (Kernel, String) {
    static CHOICE: std::sync::OnceLock<(Kernel, String)> = std::sync::OnceLock::new();
    CHOICE.get_or_init(|| {
        let choice = if std::env::var("TANDEM_AMX_ATTENTION").is_ok_and(|v| v == "off") {
            (Kernel::Vector, "attention on vector units: TANDEM_AMX_ATTENTION=off".to_string())
        } else {
            match amx_usable() {
                Ok(()) => (Kernel::Amx, AMX_WORDS.to_string()),
                Err(why) => (Kernel::Vector, format!("attention on vector units: {why}")),
            }
        };
        tracing::info!("{}", choice.1);
        choice
    })
}

/// The kernel a CPU backend with a `dtype` KV pool takes for every row, and why, in words:
/// the tiles where `amx` asks for them or (`None`) by [`default_kernel`]; never on an f32 pool,
/// so the exact mode stays exact. `Err`: the tiles were asked for where they cannot run.
pub fn choose(dtype: KvDtype, amx: Option<bool>) -> Result<(Kernel, String), String> {
    match (dtype, amx) {
        (KvDtype::F32, Some(true)) => {
            Err("AMX attention needs a narrow KV pool (--kv-dtype f16, bf16 or fp8)".into())
        }
        (KvDtype::F32, _) => Ok((Kernel::Vector, "attention on vector units: f32 KV".into())),
        (_, Some(false)) => Ok((Kernel::Vector, "attention on vector units, as asked".into())),
        (_, Some(true)) => match amx_usable() {
            Ok(()) => Ok((Kernel::Amx, AMX_WORDS.into())),
            Err(why) => Err(format!("AMX attention is not usable here: {why}")),
        },
        (_, None) => Ok(default_kernel().clone()),
    }
}

/// Reusable buffers of the attention kernels (one per thread), and the kernel they run.
#[derive(Debug, Default)]
pub struct AttendScratch {
    kernels: Kernels,
    run: Vec<Partial>,
    run_acc: Vec<f32>,
}

/// The kernel a scratch runs, and its buffers.
#[derive(Debug, Default)]
struct Kernels {
    kernel: Kernel,
    tile: TileScratch,
    #[cfg(target_arch = "x86_64")]
    amx: amx::AmxScratch,
}

impl AttendScratch {
    /// Buffers for `kernel`.
    ///
    /// # Panics
    /// With [`Kernel::Amx`] where [`amx_usable`] is `Err`.
    pub fn new(kernel: Kernel) -> AttendScratch {
        if kernel == Kernel::Amx {
            if let Err(why) = amx_usable() {
                panic!("attention: the AMX kernel is not usable here: {why}");
            }
        }
        AttendScratch { kernels: Kernels { kernel, ..Kernels::default() }, ..AttendScratch::default() }
    }
}

#[derive(Debug, Default)]
struct TileScratch {
    /// One tile's keys and values as f32, `TILE` rows of `head_dim` each.
    keys: Vec<f32>,
    values: Vec<f32>,
    /// Each row's weighted sum of values over the current segment.
    acc: Vec<f32>,
    state: Vec<RowState>,
}

fn check(qs: &[f32], spans: &[Range<usize>]) -> (usize, usize, usize) {
    let rows = spans.len();
    assert!(rows > 0, "attend: no query rows");
    assert!(qs.len().is_multiple_of(rows), "attend: {} query values for {rows} rows", qs.len());
    assert!(spans.iter().all(|s| !s.is_empty()), "attend: a row sees no position");
    let lo = spans.iter().map(|s| s.start).min().unwrap_or(0);
    let hi = spans.iter().map(|s| s.end).max().unwrap_or(0);
    (qs.len() / rows, lo, hi)
}

/// Attention for query rows of one KV head: row `r` (its query at `qs[r * hd..]`, its result
/// written to `out[r * hd..]`) attends to the positions `spans[r]` (positions in the sequence),
/// whose keys and values `keys(p)` / `values(p)` give. Each key and value row is read and widened
/// once for all the rows that see it; each row's result is the bits it would get alone.
pub fn attend_rows<'a>(
    qs: &[f32],
    spans: &[Range<usize>],
    keys: impl Fn(usize) -> KvSlice<'a>,
    values: impl Fn(usize) -> KvSlice<'a>,
    rule: ScoreRule,
    scratch: &mut AttendScratch,
    out: &mut [f32],
) {
    let (hd, lo, hi) = check(qs, spans);
    assert_eq!(out.len(), qs.len(), "attend: output length");
    let rows = spans.len();
    let AttendScratch { kernels, run, run_acc } = scratch;
    run.clear();
    run.resize(rows, Partial::EMPTY);
    run_acc.resize(rows * hd, 0.0);
    let mut emit = |r: usize, _seg: usize, part: Partial, part_acc: &[f32]| {
        merge(&mut run[r], &mut run_acc[r * hd..][..hd], part, part_acc)
    };
    dispatch(qs, spans, lo / SEGMENT..hi.div_ceil(SEGMENT), &keys, &values, rule, kernels, &mut emit);
    for r in 0..rows {
        finish(run[r], &run_acc[r * hd..][..hd], &mut out[r * hd..][..hd]);
    }
}

/// One query row alone over positions `0..n` ([`attend_rows`] with one row).
pub fn attend<'a>(
    q: &[f32],
    n: usize,
    keys: impl Fn(usize) -> KvSlice<'a>,
    values: impl Fn(usize) -> KvSlice<'a>,
    rule: ScoreRule,
    scratch: &mut AttendScratch,
    out: &mut [f32],
) {
    attend_rows(q, std::slice::from_ref(&(0..n)), keys, values, rule, scratch, out)
}

/// The segments `segs` of [`attend_rows`]'s work, unmerged: segment `s`'s partial result of row
/// `r` goes to `parts[(s - segs.start) * rows + r]` and its weighted values to the `hd` values
/// of `part_acc` at that index times `hd`; a row that sees no position of a segment gets
/// [`Partial::EMPTY`]. Merging every segment's parts in segment order with [`merge`], then
/// [`finish`], gives [`attend_rows`]'s result bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn attend_segments<'a>(
    qs: &[f32],
    spans: &[Range<usize>],
    segs: Range<usize>,
    keys: impl Fn(usize) -> KvSlice<'a>,
    values: impl Fn(usize) -> KvSlice<'a>,
    rule: ScoreRule,
    scratch: &mut AttendScratch,
    parts: &mut [Partial],
    part_acc: &mut [f32],
) {
    let (hd, _, _) = check(qs, spans);
    let rows = spans.len();
    assert!(
        parts.len() == segs.len() * rows && part_acc.len() == parts.len() * hd,
        "attend: partial buffers for {} segments of {rows} rows",
        segs.len()
    );
    parts.fill(Partial::EMPTY);
    let first = segs.start;
    let mut emit = |r: usize, seg: usize, part: Partial, acc: &[f32]| {
        let at = (seg - first) * rows + r;
        parts[at] = part;
        part_acc[at * hd..][..hd].copy_from_slice(acc);
    };
    dispatch(qs, spans, segs, &keys, &values, rule, &mut scratch.kernels, &mut emit);
}

/// Merges [`attend_segments`]'s output (every segment of the rows' context, `parts` and
/// `part_acc` laid out as it writes them) in segment order and writes each row's result to
/// `out[r * hd..]`: [`attend_rows`]'s result bit for bit.
pub fn merge_segments(parts: &[Partial], part_acc: &[f32], rows: usize, out: &mut [f32]) {
    let hd = out.len() / rows;
    assert!(
        out.len() == rows * hd && parts.len().is_multiple_of(rows) && part_acc.len() == parts.len() * hd,
        "attend: partial buffers do not fit {rows} rows"
    );
    let mut acc = vec![0f32; hd];
    for r in 0..rows {
        // An empty run takes its first segment as it is, so `acc` needs no clearing.
        let mut run = Partial::EMPTY;
        for at in (r..parts.len()).step_by(rows) {
            merge(&mut run, &mut acc, parts[at], &part_acc[at * hd..][..hd]);
        }
        finish(run, &acc, &mut out[r * hd..][..hd]);
    }
}

type Emit<'e> = dyn FnMut(usize, usize, Partial, &[f32]) + 'e;

#[allow(clippy::too_many_arguments)]
fn dispatch<'a>(
    qs: &[f32],
    spans: &[Range<usize>],
    segs: Range<usize>,
    keys: &impl Fn(usize) -> KvSlice<'a>,
    values: &impl Fn(usize) -> KvSlice<'a>,
    rule: ScoreRule,
    kernels: &mut Kernels,
    emit: &mut Emit<'_>,
) {
    let s = &mut kernels.tile;
    #[cfg(target_arch = "x86_64")]
    {
        if kernels.kernel == Kernel::Amx && (qs.len() / spans.len()).is_multiple_of(32) {
            // SAFETY: an `Amx` scratch is made only where the tiles are usable (`new`), which
            // includes the vector features; the head size was checked just above, and the kernel
            // asserts every key and value row's length before reading it.
            return unsafe { amx::tiles_amx(qs, spans, segs, keys, values, rule, &mut kernels.amx, emit) };
        }
        if super::ops::x86::has_avx512() {
            // SAFETY: the CPU has every feature `tiles_avx512` enables, checked just above.
            return unsafe { x86::tiles_avx512(qs, spans, segs, keys, values, rule, s, emit) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { tiles_avx2(qs, spans, segs, keys, values, rule, s, emit) };
        }
    }
    tiles::<false>(qs, spans, segs, keys, values, rule, s, emit)
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2")]
unsafe fn tiles_avx2<'a>(
    qs: &[f32],
    spans: &[Range<usize>],
    segs: Range<usize>,
    keys: &impl Fn(usize) -> KvSlice<'a>,
    values: &impl Fn(usize) -> KvSlice<'a>,
    rule: ScoreRule,
    s: &mut TileScratch,
    emit: &mut Emit<'_>,
) {
    tiles::<false>(qs, spans, segs, keys, values, rule, s, emit)
}

/// Copies (widening) the rows of positions `present` into `dst`, the tile's row `p - t` for
/// position `p`.
#[inline(always)]
fn widen_tile<'a>(
    rows: &impl Fn(usize) -> KvSlice<'a>,
    t: usize,
    present: Range<usize>,
    hd: usize,
    dst: &mut [f32],
) {
    for p in present {
        let d = &mut dst[(p - t) * hd..][..hd];
        match rows(p) {
            KvSlice::F32(x) => d.copy_from_slice(x),
            KvSlice::F16(x) => widen_f16(x, d),
            KvSlice::Bf16(x) => widen_bf16(x, d),
            KvSlice::Fp8(x) => widen_fp8(x, d),
        }
    }
}

/// The tile loop, shared by the vector and portable kernels (`AVX512` picks the per-tile step).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tiles<'a, const AVX512: bool>(
    qs: &[f32],
    spans: &[Range<usize>],
    segs: Range<usize>,
    keys: &impl Fn(usize) -> KvSlice<'a>,
    values: &impl Fn(usize) -> KvSlice<'a>,
    rule: ScoreRule,
    s: &mut TileScratch,
    emit: &mut Emit<'_>,
) {
    let (hd, lo, hi) = check(qs, spans);
    let rows = spans.len();
    s.keys.resize(TILE * hd, 0.0);
    s.values.resize(TILE * hd, 0.0);
    s.acc.resize(rows * hd, 0.0);
    s.state.resize(rows, RowState::default());
    let mut first_tile = true;
    for seg in segs {
        let (s0, s1) = ((seg * SEGMENT).max(lo), ((seg + 1) * SEGMENT).min(hi));
        if s0 >= s1 {
            continue;
        }
        for (r, span) in spans.iter().enumerate() {
            let live = span.start < s1 && s0 < span.end;
            s.state[r] = RowState { live, ..RowState::default() };
            if live {
                s.acc[r * hd..][..hd].fill(0.0);
            }
        }
        let mut t = s0 / TILE * TILE;
        while t < s1 {
            let (a, b) = (t.max(s0), (t + TILE).min(s1));
            if spans.iter().any(|sp| sp.start < b && a < sp.end) {
                #[cfg(target_arch = "x86_64")]
                if AVX512 {
                    // SAFETY: `AVX512` is only set by `tiles_avx512`, which has the features.
                    unsafe { x86::prefetch_ahead(keys, values, t, first_tile, hi) };
                }
                first_tile = false;
                widen_tile(keys, t, a..b, hd, &mut s.keys);
                widen_tile(values, t, a..b, hd, &mut s.values);
                // The tile positions each row sees (empty when none).
                let seen = |r: usize| {
                    let (from, to) = (spans[r].start.max(a), spans[r].end.min(b));
                    if from < to {
                        from - t..to - t
                    } else {
                        0..0
                    }
                };
                let mut r = 0;
                while r < rows {
                    let here = seen(r);
                    if here.is_empty() {
                        r += 1;
                        continue;
                    }
                    #[cfg(target_arch = "x86_64")]
                    if AVX512 {
                        let next = if r + 1 < rows { seen(r + 1) } else { 0..0 };
                        if !next.is_empty() {
                            // Two rows at once: each value row is loaded once for both.
                            let (q0, q1) = (&qs[r * hd..][..hd], &qs[(r + 1) * hd..][..hd]);
                            let (a0, a1) = s.acc[r * hd..(r + 2) * hd].split_at_mut(hd);
                            let [s0, s1] = &mut s.state[r..r + 2] else { unreachable!("two rows") };
                            // SAFETY: `AVX512` is only set by `tiles_avx512`, which has the features.
                            unsafe {
                                x86::row_tile2(
                                    [q0, q1],
                                    &s.keys,
                                    &s.values,
                                    [here, next],
                                    rule,
                                    [s0, s1],
                                    [a0, a1],
                                )
                            };
                            r += 2;
                            continue;
                        }
                    }
                    let (q, acc, state) = (&qs[r * hd..][..hd], &mut s.acc[r * hd..][..hd], &mut s.state[r]);
                    #[cfg(target_arch = "x86_64")]
                    if AVX512 {
                        // SAFETY: `AVX512` is only set by `tiles_avx512`, which has the features.
                        unsafe { x86::row_tile(q, &s.keys, &s.values, here, rule, state, acc) };
                        r += 1;
                        continue;
                    }
                    row_tile(q, &s.keys, &s.values, here, rule, state, acc);
                    r += 1;
                }
            }
            t += TILE;
        }
        for (r, st) in s.state.iter().enumerate() {
            if st.live {
                #[cfg(target_arch = "x86_64")]
                let sum = if AVX512 { x86::lane_total(&st.lanes) } else { st.lanes.iter().sum() };
                #[cfg(not(target_arch = "x86_64"))]
                let sum = st.lanes.iter().sum();
                emit(r, seg, Partial { max: st.max, sum }, &s.acc[r * hd..][..hd]);
            }
        }
    }
}

/// One tile for one row, portable: scores of the positions `seen` (tile rows), the running
/// maximum raised (rescaling what came before), then their weights and weighted values.
#[inline(always)]
fn row_tile(
    q: &[f32],
    kt: &[f32],
    vt: &[f32],
    seen: Range<usize>,
    rule: ScoreRule,
    st: &mut RowState,
    acc: &mut [f32],
) {
    let hd = q.len();
    let mut s = [0f32; TILE];
    let mut top = f32::NEG_INFINITY;
    for i in seen.clone() {
        s[i] = rule.apply(dot(q, &kt[i * hd..][..hd]));
        top = top.max(s[i]);
    }
    if top > st.max {
        if st.max != f32::NEG_INFINITY {
            let c = (st.max - top).exp();
            st.lanes.iter_mut().for_each(|x| *x *= c);
            acc.iter_mut().for_each(|x| *x *= c);
        }
        st.max = top;
    }
    for i in seen {
        let p = (s[i] - st.max).exp();
        st.lanes[i] += p;
        axpy(p, &vt[i * hd..][..hd], acc);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Emit, RowState, ScoreRule, TileScratch, TILE};
    use crate::cpu::ops::x86::sum16;
    use crate::kv::KvSlice;
    use crate::vmath::x86::{exp16, tail};
    use std::arch::x86_64::*;
    use std::ops::Range;

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    pub(super) unsafe fn tiles_avx512<'a>(
        qs: &[f32],
        spans: &[Range<usize>],
        segs: Range<usize>,
        keys: &impl Fn(usize) -> KvSlice<'a>,
        values: &impl Fn(usize) -> KvSlice<'a>,
        rule: ScoreRule,
        s: &mut TileScratch,
        emit: &mut Emit<'_>,
    ) {
        super::tiles::<true>(qs, spans, segs, keys, values, rule, s, emit)
    }

    /// The sum of the 16 lanes, in `_mm512_reduce_add_ps`'s order.
    #[inline]
    pub(super) fn lane_total(lanes: &[f32; TILE]) -> f32 {
        // SAFETY: the caller runs on a CPU with AVX-512F (only `tiles::<true>` calls this); 16 floats.
        unsafe { reduce(lanes) }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn reduce(lanes: &[f32; TILE]) -> f32 {
        // SAFETY: 16 floats.
        _mm512_reduce_add_ps(unsafe { _mm512_loadu_ps(lanes.as_ptr()) })
    }

    /// `e^x` by [`exp16`], for one value.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    fn exp1(x: f32) -> f32 {
        _mm512_cvtss_f32(exp16(_mm512_set1_ps(x)))
    }

    /// How far ahead of its use (in positions) a key or value row is fetched.
    const AHEAD: usize = 48;

    /// Asks for every cache line of `row` into the L2 cache ahead of its use.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn prefetch(row: KvSlice<'_>) {
        let (p, bytes) = match row {
            KvSlice::F32(s) => (s.as_ptr() as *const i8, 4 * s.len()),
            KvSlice::F16(s) | KvSlice::Bf16(s) => (s.as_ptr() as *const i8, 2 * s.len()),
            KvSlice::Fp8(s) => (s.as_ptr() as *const i8, s.len()),
        };
        for off in (0..bytes).step_by(64) {
            // A prefetch is a hint and never faults; the address is inside the row.
            _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(off));
        }
    }

    /// While the tile from `t` is used, fetches the rows `AHEAD` positions on (and, for the
    /// first tile, everything up to there), below `hi`: a decode step finds its cache in memory,
    /// and one row after another would wait for each.
    #[target_feature(enable = "avx512f")]
    pub(super) fn prefetch_ahead<'a>(
        keys: &impl Fn(usize) -> KvSlice<'a>,
        values: &impl Fn(usize) -> KvSlice<'a>,
        t: usize,
        first: bool,
        hi: usize,
    ) {
        prefetch_span(keys, values, t, TILE, AHEAD, first, hi)
    }

    /// [`prefetch_ahead`] for a step of `step` positions, `ahead` positions on.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) fn prefetch_span<'a>(
        keys: &impl Fn(usize) -> KvSlice<'a>,
        values: &impl Fn(usize) -> KvSlice<'a>,
        t: usize,
        step: usize,
        ahead: usize,
        first: bool,
        hi: usize,
    ) {
        let from = if first { t } else { t + ahead };
        for p in from..(t + step + ahead).min(hi) {
            prefetch(keys(p));
            prefetch(values(p));
        }
    }

    /// [`super::row_tile`] with AVX-512: a key's products stay in 16 lanes and [`sum16`] sums
    /// the tile's 16 keys at once; the weights are 16 lanes of [`exp16`]; the weighted values
    /// are summed 64 elements (four vectors) at a time.
    ///
    /// # Safety
    /// On a CPU with the features enabled here; `kt` and `vt` hold `TILE` rows of `q.len()`,
    /// `acc` is `q.len()` long and `seen` lies inside `0..TILE`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(super) unsafe fn row_tile(
        q: &[f32],
        kt: &[f32],
        vt: &[f32],
        seen: Range<usize>,
        rule: ScoreRule,
        st: &mut RowState,
        acc: &mut [f32],
    ) {
        // SAFETY: the caller's promises are `weights`' and `add_values`'.
        unsafe {
            let w = weights(q, kt, seen.clone(), rule, st, acc);
            add_values(vt, [(&w, seen.clone(), acc), (&w, 0..0, &mut [])]);
        }
    }

    /// [`row_tile`] for two rows at once: each row's arithmetic is its own, but each value
    /// vector is loaded once for both rows.
    ///
    /// # Safety
    /// As [`row_tile`], for both rows.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(super) unsafe fn row_tile2(
        q: [&[f32]; 2],
        kt: &[f32],
        vt: &[f32],
        seen: [Range<usize>; 2],
        rule: ScoreRule,
        st: [&mut RowState; 2],
        acc: [&mut [f32]; 2],
    ) {
        let [s0, s1] = st;
        let [a0, a1] = acc;
        // SAFETY: the caller's promises are `weights`' and `add_values`'.
        unsafe {
            let w0 = weights(q[0], kt, seen[0].clone(), rule, s0, a0);
            let w1 = weights(q[1], kt, seen[1].clone(), rule, s1, a1);
            let [r0, r1] = seen;
            add_values(vt, [(&w0, r0, a0), (&w1, r1, a1)]);
        }
    }

    /// One row's scores of the tile's keys `seen`, its running maximum raised (rescaling its
    /// sums and `acc`), and its weights `e^(s − max)` (0 outside `seen`), added to its sums.
    ///
    /// # Safety
    /// As [`row_tile`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    unsafe fn weights(
        q: &[f32],
        kt: &[f32],
        seen: Range<usize>,
        rule: ScoreRule,
        st: &mut RowState,
        acc: &mut [f32],
    ) -> [f32; TILE] {
        let hd = q.len();
        debug_assert!(kt.len() >= TILE * hd && acc.len() == hd && seen.end <= TILE);
        let mut lanes = [_mm512_setzero_ps(); TILE];
        let mut j = 0;
        while j < hd {
            let m = tail(hd, j);
            // SAFETY: the masks keep every load inside q and the tile's rows (hd long each).
            unsafe {
                let qv = _mm512_maskz_loadu_ps(m, q.as_ptr().add(j));
                for (i, l) in lanes.iter_mut().enumerate() {
                    *l = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, kt.as_ptr().add(i * hd + j)), *l);
                }
            }
            j += 16;
        }
        let s = scored(sum16(&lanes), rule);
        let mask = ((((1u32 << seen.end) - 1) & !((1u32 << seen.start) - 1)) & 0xFFFF) as __mmask16;
        // SAFETY: 16 floats.
        let mut sum = unsafe { _mm512_loadu_ps(st.lanes.as_ptr()) };
        // SAFETY: the caller's promise on `acc`.
        unsafe { raise([(mask, s)], st, &mut sum, acc) };
        let w = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(s, _mm512_set1_ps(st.max))));
        sum = _mm512_add_ps(sum, w);
        let mut ws = [0f32; TILE];
        // SAFETY: 16 floats each.
        unsafe {
            _mm512_storeu_ps(st.lanes.as_mut_ptr(), sum);
            _mm512_storeu_ps(ws.as_mut_ptr(), w);
        }
        ws
    }

    /// Scores from 16 dot products: scaled, then soft-capped where the rule says so.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn scored(dots: __m512, rule: ScoreRule) -> __m512 {
        match rule.softcap {
            None => _mm512_mul_ps(dots, _mm512_set1_ps(rule.scale)),
            Some(_) => {
                let mut v = [0f32; TILE];
                // SAFETY: 16 floats each way.
                unsafe { _mm512_storeu_ps(v.as_mut_ptr(), dots) };
                v.iter_mut().for_each(|x| *x = rule.apply(*x));
                // SAFETY: 16 floats.
                unsafe { _mm512_loadu_ps(v.as_ptr()) }
            }
        }
    }

    /// A row's running maximum raised to its largest seen score (each vector of `scores` with
    /// the mask of its seen lanes) where one exceeds it, with its lane sums `sum` and its
    /// weighted values `acc` rescaled to the new maximum. One comparison per vector decides, and
    /// the horizontal maximum is taken only then (after a context's first tiles, rarely).
    ///
    /// # Safety
    /// On a CPU with the features enabled here; `acc` is the row's weighted values.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(super) unsafe fn raise<const N: usize>(
        scores: [(__mmask16, __m512); N],
        st: &mut RowState,
        sum: &mut __m512,
        acc: &mut [f32],
    ) {
        let running = _mm512_set1_ps(st.max);
        if scores.iter().all(|&(m, s)| _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(m, s, running) == 0) {
            return;
        }
        let Some(top) = scores.iter().map(|&(m, s)| _mm512_mask_reduce_max_ps(m, s)).reduce(f32::max) else {
            return;
        };
        if st.max != f32::NEG_INFINITY {
            let c = _mm512_set1_ps(exp1(st.max - top));
            *sum = _mm512_mul_ps(*sum, c);
            let hd = acc.len();
            for j in (0..hd).step_by(16) {
                let m = tail(hd, j);
                // SAFETY: the mask keeps both accesses inside acc.
                unsafe {
                    let p = acc.as_mut_ptr().add(j);
                    _mm512_mask_storeu_ps(p, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p), c));
                }
            }
        }
        st.max = top;
    }

    /// `acc += w[i] · v[i]` for each row's positions `i` of its range, in increasing `i`, 64
    /// elements (four vectors) at a time; a value vector is loaded once for both rows. The
    /// second row may be empty (`0..0`, with an empty `acc`).
    ///
    /// # Safety
    /// On a CPU with the features enabled here; `vt` holds `TILE` rows of `hd`, a non-empty
    /// row's `acc` is `hd` long and its range lies inside `0..TILE`; the first row's is not empty.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    unsafe fn add_values(vt: &[f32], rows: [(&[f32; TILE], Range<usize>, &mut [f32]); 2]) {
        let [(w0, r0, acc0), (w1, r1, acc1)] = rows;
        let hd = acc0.len();
        let both = !r1.is_empty();
        debug_assert!(vt.len() >= TILE * hd && (!both || acc1.len() == hd));
        let (from, to) = if both { (r0.start.min(r1.start), r0.end.max(r1.end)) } else { (r0.start, r0.end) };
        let mut j = 0;
        while j < hd {
            let masks: [__mmask16; 4] =
                std::array::from_fn(|c| if j + 16 * c < hd { tail(hd, j + 16 * c) } else { 0 });
            // SAFETY (the block): every access is masked to the `hd` values of an acc or of a
            // tile row; the second row's acc is touched only when it is not empty.
            unsafe {
                let load = |acc: &[f32], c: usize| {
                    _mm512_maskz_loadu_ps(masks[c], acc.as_ptr().wrapping_add(j + 16 * c))
                };
                let mut a: [__m512; 4] = std::array::from_fn(|c| load(acc0, c));
                let mut b: [__m512; 4] = [_mm512_setzero_ps(); 4];
                if both {
                    b = std::array::from_fn(|c| load(acc1, c));
                }
                for i in from..to {
                    let row = vt.as_ptr().wrapping_add(i * hd + j);
                    let x: [__m512; 4] =
                        std::array::from_fn(|c| _mm512_maskz_loadu_ps(masks[c], row.wrapping_add(16 * c)));
                    if r0.contains(&i) {
                        let wi = _mm512_set1_ps(w0[i]);
                        for c in 0..4 {
                            a[c] = _mm512_fmadd_ps(wi, x[c], a[c]);
                        }
                    }
                    if both && r1.contains(&i) {
                        let wi = _mm512_set1_ps(w1[i]);
                        for c in 0..4 {
                            b[c] = _mm512_fmadd_ps(wi, x[c], b[c]);
                        }
                    }
                }
                for c in 0..4 {
                    _mm512_mask_storeu_ps(acc0.as_mut_ptr().wrapping_add(j + 16 * c), masks[c], a[c]);
                    if both {
                        _mm512_mask_storeu_ps(acc1.as_mut_ptr().wrapping_add(j + 16 * c), masks[c], b[c]);
                    }
                }
            }
            j += 64;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod amx;

#[cfg(test)]
mod tests;
