//! AMX tiles for the integer path's compute-bound calls: prompt chunks and large batches of
//! every packed type (Q4_0, Q4_1, Q8_0, Q5_0 as Q8_0, and the k-quants), on Xeons that have
//! AMX-INT8 and a kernel that grants the tile state.
//!
//! # The arithmetic, and why
//! AMX multiplies 8-bit integers (and bf16, which cannot hold a 16-bit quant or a weight times
//! its scale exactly). The tiles here compute exactly the integer sums the AVX-512 VNNI kernels
//! compute, and the floating-point steps after them are the same instructions in the same order,
//! so a result is bit for bit the VNNI kernels' result whichever kernel a call takes:
//!
//! - 8-bit activations: one `tdpbssd` of a 16-token activation tile by a block's weight tile.
//! - 16-bit activations (the default mode): each quant `q` is split into `256 · hi + lo`, `hi`
//!   signed and `lo` unsigned bytes. `tdpbssd` on the high bytes and `tdpbusd` on the low ones
//!   give two exact sums, and `256 · Σhi + Σlo` is the VNNI kernels' `Σ w · q` (at most
//!   32 · 128 · 32767 in magnitude: no overflow).
//!
//! Each tile product covers one block of 32 (a tile of 16 tokens × 32 bytes by 8 × 64 bytes,
//! 16 weight rows in the VNNI layout of four elements per row), or one sub-block of 16 for the
//! k-quants that have them, because every block has its own weight and activation scale: the
//! 16 × 16 integer sums go to memory, and AVX-512 applies the scales to them as the VNNI kernels
//! do. Two row groups are computed together, so four products are in flight.
//!
//! # Memory
//! The packed matrices are not copied: each task unpacks two row groups' blocks into tile panels
//! (512 bytes a block of 16 rows, signed weights: `q − 8` for Q4_0, the nibble for Q4_1,
//! `u − offset` for k-quants) and reuses them for every tile of 16 tokens: 32 bytes a column
//! (64 KiB at 2,048 columns) plus 16 KiB of sums per task. A call also lays its activations out
//! in tiles: 1 byte per element (2 for 16-bit quants), freed when it returns.
//!
//! # When
//! Decode at one token stays on the memory-bound kernels. At start-up, [`choice`] times the
//! VNNI kernels against the tiles on a synthetic matrix for a range of token counts and takes the
//! tiles from the smallest count where they win by 5% there and at every larger count. Since
//! results do not depend on the kernel, the timing can only change speed.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;
use std::time::Instant;

use rayon::prelude::*;

use super::kq::{Kind, BLOCKS, NIB_BYTES, PLANE_BYTES};
use super::{
    group_bytes, quants_at, record_bytes, Isa8, PackedMatrix, QuantizedRows, SharedOut, Tok, QBLOCK, ROWS,
};
use crate::quant::GgmlType;

/// Tokens per activation tile.
const TILE: usize = 16;
/// Bytes of one block's weights as a tile: 8 rows of 64 bytes (16 weight rows × 4 elements).
const PANEL: usize = QBLOCK * ROWS;
/// Tasks are at least this many weight bytes times tokens, as in [`super::run`].
const MIN_TASK_WORK: usize = 256 * 1024;

/// Whether this process may use the tiles, and from how many tokens a call takes them.
#[derive(Debug, Clone)]
pub struct AmxChoice {
    /// Calls of at least this many tokens take them (`None`: never, see `why`).
    pub from: Option<usize>,
    /// What was found, in words (logged once, printed by `tandem bench`).
    pub why: String,
}

/// `arch_prctl` codes of Linux's dynamic XSAVE features, and the tile data's feature number.
#[cfg(target_os = "linux")]
const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
#[cfg(target_os = "linux")]
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
#[cfg(target_os = "linux")]
const XFEATURE_XTILEDATA: libc::c_long = 18;

/// Whether the tiles can be used: the CPU lists AMX-TILE and AMX-INT8, the VNNI kernels (whose
/// float steps the tiles share) run, `TANDEM_AMX` is not `off`, the kernel grants the tile
/// state, and a tile product computes what it should. `Err` says which failed.
pub fn usable() -> Result<(), String> {
    static USABLE: OnceLock<Result<(), String>> = OnceLock::new();
    USABLE.get_or_init(probe).clone()
}

/// Whether this CPU lists AMX-TILE and AMX-INT8 (whatever the kernel grants).
pub fn listed() -> bool {
    // A CPU without leaf 7 returns zeros for it, which reads as "not listed".
    let leaf = __cpuid_count(7, 0);
    leaf.edx & (1 << 24) != 0 && leaf.edx & (1 << 25) != 0
}

fn probe() -> Result<(), String> {
    if std::env::var("TANDEM_AMX").is_ok_and(|v| v == "off") {
        return Err("TANDEM_AMX=off".into());
    }
    if !listed() {
        return Err("this CPU has no AMX-INT8".into());
    }
    if !Isa8::available().contains(&Isa8::Avx512Vnni) {
        return Err("this CPU has no AVX-512 VNNI".into());
    }
    request_tiles()?;
    self_test()
}

#[cfg(target_os = "linux")]
fn request_tiles() -> Result<(), String> {
    // SAFETY: arch_prctl with these codes reads its arguments as integers (REQ) or writes one
    // u64 through the pointer given (GET).
    let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if rc != 0 {
        return Err(format!("the kernel refused the tile state: {}", std::io::Error::last_os_error()));
    }
    let mut granted: u64 = 0;
    let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mut granted as *mut u64) };
    if rc != 0 || granted & (1 << XFEATURE_XTILEDATA) == 0 {
        return Err("the kernel did not grant the tile state".into());
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn request_tiles() -> Result<(), String> {
    Err("tile state is requested only on Linux".into())
}

/// One tile configuration: palette 1, then per tile its bytes per row and its rows.
#[repr(C, align(64))]
pub(crate) struct Config([u8; 64]);

impl Config {
    /// Palette 1 with tile `t` `shapes[t].0` rows of `shapes[t].1` bytes.
    fn of(shapes: [(usize, usize); 8]) -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        for (t, (rows, bytes)) in shapes.into_iter().enumerate() {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&(bytes as u16).to_le_bytes());
            c[48 + t] = rows as u8;
        }
        Config(c)
    }

    /// All eight tiles `rows` rows of `bytes` bytes.
    pub(crate) fn uniform(rows: usize, bytes: usize) -> Config {
        Config::of([(rows, bytes); 8])
    }

    /// Tiles for `m` tokens: 2 and 3 the activations (low and high bytes; 2 alone for 8-bit
    /// activations), 4 and 7 two row groups' weights, 0 and 1 the first group's sums (low and
    /// high bytes), 5 and 6 the second's. `span`: elements per product (32, or 16 for k-quants'
    /// sub-blocks of 16).
    fn for_tokens(m: usize, span: usize) -> Config {
        let k = span / 4;
        Config::of([(m, 64), (m, 64), (m, span), (m, span), (k, 64), (m, 64), (m, 64), (k, 64)])
    }

    /// Loads the configuration into this thread's tile registers.
    ///
    /// # Safety
    /// [`usable`] must have returned `Ok`.
    pub(crate) unsafe fn load(&self) {
        // SAFETY: the caller checked the tiles are usable; the configuration is valid (palette 1,
        // at most 16 rows of at most 64 bytes).
        unsafe { asm!("ldtilecfg [{0}]", in(reg) self.0.as_ptr(), options(nostack, readonly)) };
    }
}

/// Returns this thread's tiles to their initial state (so a context switch saves no tile data).
///
/// # Safety
/// As [`Config::load`].
pub(crate) unsafe fn release() {
    // SAFETY: as the caller's.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Sums of 16 rows × 16 columns, as a tile stores them.
#[repr(C, align(64))]
struct Sums([[i32; ROWS]; TILE]);

/// One tile product on fixed bytes against its scalar sums: both instructions the kernels use,
/// with every sign combination they meet.
fn self_test() -> Result<(), String> {
    let a: Vec<u8> = (0..TILE * QBLOCK).map(|i| (i * 37 + 11) as u8).collect();
    let b: Vec<u8> = (0..PANEL).map(|i| (i * 91 + 5) as u8).collect();
    let (mut ss, mut us) = (Sums([[0; ROWS]; TILE]), Sums([[0; ROWS]; TILE]));
    // SAFETY: the CPU lists AMX-INT8 and the kernel granted the tile state (checked by the
    // caller); the buffers hold what the configured tiles read and write.
    unsafe {
        Config::for_tokens(TILE, QBLOCK).load();
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tileloadd tmm2, [{a} + {sa}*1]",
            "tileloadd tmm4, [{b} + {sb}*1]",
            "tdpbssd tmm0, tmm2, tmm4",
            "tdpbusd tmm1, tmm2, tmm4",
            "tilestored [{s} + {sb}*1], tmm0",
            "tilestored [{u} + {sb}*1], tmm1",
            a = in(reg) a.as_ptr(), b = in(reg) b.as_ptr(), s = in(reg) ss.0.as_mut_ptr(),
            u = in(reg) us.0.as_mut_ptr(), sa = in(reg) QBLOCK, sb = in(reg) 64usize,
            options(nostack),
        );
        release();
    }
    for t in 0..TILE {
        for r in 0..ROWS {
            let (mut s, mut u) = (0i32, 0i32);
            for k in 0..QBLOCK {
                let w = b[(k / 4) * 64 + 4 * r + k % 4] as i8 as i32;
                s += a[t * QBLOCK + k] as i8 as i32 * w;
                u += a[t * QBLOCK + k] as i32 * w;
            }
            if ss.0[t][r] != s || us.0[t][r] != u {
                return Err("a tile product computed a wrong sum".into());
            }
        }
    }
    Ok(())
}

/// Sums per block of 32: one, or two for k-quants with sub-blocks of 16.
fn halves(dtype: GgmlType) -> usize {
    match Kind::of(dtype) {
        Some(k) => QBLOCK / k.sub,
        None => 1,
    }
}

/// The start-up choice: whether the tiles are usable and from how many tokens they are faster
/// (measured once per process, on the calling thread's rayon pool).
pub fn choice() -> &'static AmxChoice {
    static CHOICE: OnceLock<AmxChoice> = OnceLock::new();
    CHOICE.get_or_init(|| {
        let c = match usable() {
            Err(why) => AmxChoice { from: None, why: format!("AMX not used: {why}") },
            Ok(()) => calibrate(),
        };
        tracing::info!("{}", c.why);
        c
    })
}

/// Token counts the calibration tries.
const TRIED: [usize; 6] = [4, 8, 16, 32, 64, 128];

/// Times the VNNI kernels and the tiles on a synthetic 16-bit Q8_0 matrix (1,536 × 576, the
/// shape of a small model's MLP) for each of [`TRIED`].
fn calibrate() -> AmxChoice {
    let (rows, cols) = (1536, 576);
    let bb = GgmlType::Q8_0.block_bytes();
    let mut data = vec![0u8; rows * cols / QBLOCK * bb];
    for (i, b) in data.chunks_exact_mut(bb).enumerate() {
        b[..2].copy_from_slice(&half::f16::from_f32(0.01 + (i % 7) as f32 * 1e-3).to_bits().to_le_bytes());
        for (j, q) in b[2..].iter_mut().enumerate() {
            *q = ((i * 31 + j * 17) % 255) as u8;
        }
    }
    let m = crate::weights::Matrix {
        rows,
        cols,
        dtype: GgmlType::Q8_0,
        data: crate::weights::Bytes::copy_from(&data),
    };
    let w = PackedMatrix::pack_wide(&m);
    let n_max = *TRIED.last().unwrap();
    let x: Vec<f32> = (0..n_max * cols).map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 1001.0).collect();
    // One thread (the other cores' load moves less), the two kernels alternating, the best of
    // nine runs each.
    let Ok(pool) = rayon::ThreadPoolBuilder::new().num_threads(1).build() else {
        return AmxChoice { from: None, why: "AMX not used: no thread to time it on".into() };
    };
    let mut wins = Vec::new();
    let mut figures = Vec::new();
    for n in TRIED {
        let mut xq = QuantizedRows::new();
        xq.quantize_wide(&x[..n * cols], n, cols);
        let (mut y, mut y2) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        let (mut vnni, mut tiles) = (f64::INFINITY, f64::INFINITY);
        pool.install(|| {
            for _ in 0..9 {
                let t0 = Instant::now();
                super::run_vnni(Isa8::Avx512Vnni, &w, &xq, &mut y);
                let t1 = Instant::now();
                run(&w, &xq, &mut y2);
                vnni = vnni.min((t1 - t0).as_secs_f64());
                tiles = tiles.min(t1.elapsed().as_secs_f64());
            }
        });
        // The sums agree bit for bit whichever kernel runs (the module's premise).
        if y != y2 {
            return AmxChoice {
                from: None,
                why: "AMX not used: the tiles' sums differ from the VNNI kernels'".into(),
            };
        }
        // A margin, so noise alone does not switch kernels.
        wins.push(tiles * 1.05 < vnni);
        figures.push(format!("{n}: {:.2}x", vnni / tiles));
    }
    // The smallest count from which the tiles win at every larger count tried.
    let from = (0..TRIED.len()).find(|&i| wins[i..].iter().all(|&w| w)).map(|i| TRIED[i]);
    let figures = figures.join(", ");
    let why = match from {
        Some(f) => format!("AMX int8 tiles for calls of {f} tokens or more (speed-up by tokens: {figures})"),
        None => format!("AMX not used: no faster than AVX-512 VNNI here ({figures})"),
    };
    AmxChoice { from, why }
}

/// A call's activations laid out for the tiles: per tile of 16 tokens and block, 512 bytes of
/// 8-bit quants, or 512 of the low bytes then 512 of the high bytes of 16-bit ones (16 rows of 32,
/// so a tile load reads whole cache lines), and per tile and block the 16 tokens' scales `d` (then
/// `d · Σ q` for Q4_1). Tokens past the last are zeros.
struct TileActs {
    bytes: Vec<u8>,
    d: Vec<f32>,
    /// Per tile, block, half (one for Q4_1 and sub-blocks of 32, two for sub-blocks of 16) and
    /// token: `d · Σ q` over the half, as the VNNI kernels compute it (Q4_1 and k-quants with
    /// minimums only).
    ds: Vec<f32>,
}

impl TileActs {
    fn new(xq: &QuantizedRows, toks: &[Tok<'_>], mins: bool, halves: usize) -> TileActs {
        let (n, nb) = (xq.n, xq.cols / QBLOCK);
        let parts = if xq.wide { 2 } else { 1 };
        let tiles = n.div_ceil(TILE);
        let per_tile = nb * parts * PANEL;
        let mut acts = TileActs {
            bytes: vec![0u8; tiles * per_tile],
            d: vec![0f32; tiles * nb * TILE],
            ds: vec![0f32; if mins { tiles * nb * halves * TILE } else { 0 }],
        };
        let ds_chunk = nb * halves * TILE;
        acts.bytes.par_chunks_mut(per_tile).zip(acts.d.par_chunks_mut(nb * TILE)).enumerate().for_each(
            |(tile, (bytes, d))| {
                for i in 0..TILE.min(n - tile * TILE) {
                    let t = &toks[tile * TILE + i];
                    for b in 0..nb {
                        d[b * TILE + i] = t.d[b];
                        let at = b * parts * PANEL + i * QBLOCK;
                        let e = b * QBLOCK;
                        if xq.wide {
                            let (lo, hi) = bytes[at..at + PANEL + QBLOCK].split_at_mut(PANEL);
                            // SAFETY: the CPU has AVX-512 BW (part of `usable`).
                            unsafe { split16(&t.qw[e..e + QBLOCK], &mut lo[..QBLOCK], &mut hi[..QBLOCK]) };
                        } else {
                            for (k, &q) in t.qs[e..e + QBLOCK].iter().enumerate() {
                                bytes[at + k] = q as u8;
                            }
                        }
                    }
                }
            },
        );
        if mins {
            for (tile, ds) in acts.ds.chunks_mut(ds_chunk).enumerate() {
                for i in 0..TILE.min(n - tile * TILE) {
                    let t = &toks[tile * TILE + i];
                    for b in 0..nb {
                        for h in 0..halves {
                            ds[(b * halves + h) * TILE + i] =
                                if halves == 1 { t.ds[b] } else { t.d[b] * t.sum16[2 * b + h] as f32 };
                        }
                    }
                }
            }
        }
        acts
    }
}

/// One block of 32 16-bit quants as their low bytes and their high bytes (`q = 256 · hi + lo`).
///
/// # Safety
/// AVX-512 F/BW must be available; every slice holds 32 elements.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn split16(q: &[i16], lo: &mut [u8], hi: &mut [u8]) {
    assert!(q.len() == QBLOCK && lo.len() == QBLOCK && hi.len() == QBLOCK, "split16: a block is 32");
    // SAFETY: 64 bytes read, 32 written to each of lo and hi (checked above).
    unsafe {
        let v = _mm512_loadu_si512(q.as_ptr() as *const _);
        _mm256_storeu_si256(lo.as_mut_ptr() as *mut __m256i, _mm512_cvtepi16_epi8(v));
        _mm256_storeu_si256(hi.as_mut_ptr() as *mut __m256i, _mm512_cvtepi16_epi8(_mm512_srai_epi16::<8>(v)));
    }
}

/// `matmul_q8` on the tiles, for every token of `xq`.
///
/// # Panics
/// If the tiles are not usable or the sizes disagree (as `matmul_q8`).
pub(super) fn run(w: &PackedMatrix, xq: &QuantizedRows, y: &mut [f32]) {
    assert!(usable().is_ok(), "AMX tiles are not usable here: {}", usable().unwrap_err());
    if !super::sizes_agree(w, xq, y) {
        return;
    }
    let n = xq.n;
    let (rows, groups) = (w.rows, w.rows.div_ceil(ROWS));
    let threads = rayon::current_num_threads().max(1);
    let by_balance = groups.div_ceil(threads * 4);
    let by_size = MIN_TASK_WORK.div_ceil(group_bytes(w.dtype, w.cols) * n);
    let per_task = by_balance.max(by_size).max(1);
    let n_tasks = groups.div_ceil(per_task);
    let toks: Vec<Tok<'_>> = (0..n).map(|t| xq.tok(t)).collect();
    let mins = w.dtype == GgmlType::Q4_1 || Kind::of(w.dtype).is_some_and(|k| k.min);
    let acts = TileActs::new(xq, &toks, mins, halves(w.dtype));
    let out = SharedOut(y.as_mut_ptr());
    let task = |task: usize| {
        let mut panels = [vec![0u8; w.cols / QBLOCK * PANEL], vec![0u8; w.cols / QBLOCK * PANEL]];
        let mut sums = block_sums();
        let end = ((task + 1) * per_task).min(groups);
        for g in (task * per_task..end).step_by(2) {
            let second = g + 1 < end;
            // SAFETY: the tiles are usable (asserted above), the CPU has AVX-512 VNNI (part of
            // `usable`), and the panels, activations and output are sized as the kernel reads
            // them (checked above).
            unsafe {
                build_panel(w, w.group(g), &mut panels[0]);
                if second {
                    build_panel(w, w.group(g + 1), &mut panels[1]);
                }
                let [p0, p1] = &panels;
                pair_tiles(w, g, second, [p0, if second { p1 } else { p0 }], xq, &acts, out, rows, &mut sums);
            }
        }
        // SAFETY: as above.
        unsafe { release() };
    };
    if n_tasks == 1 {
        task(0);
    } else {
        (0..n_tasks).into_par_iter().for_each(task);
    }
}

/// 16-bit word `i` of the output takes word `i / 2` of the first 32 bytes (even `i`) or of the
/// second (odd): two 32-byte chunks of two elements per row become one tile row of four.
fn interleave_words() -> __m512i {
    let idx: [i16; 32] = std::array::from_fn(|j| (j / 2 + 16 * (j % 2)) as i16);
    // SAFETY: idx is 64 bytes.
    unsafe { _mm512_loadu_si512(idx.as_ptr() as *const _) }
}

/// Unpacks a row group's records into tile panels: per block, 8 rows of 64 bytes, row `r`
/// holding elements `4r..4r + 4` of each of the 16 weight rows, as signed bytes.
///
/// # Safety
/// AVX-512 F/BW must be available; `group` is whole records of `w`, `panel` one panel per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn build_panel(w: &PackedMatrix, group: &[u8], panel: &mut [u8]) {
    if let Some(kind) = Kind::of(w.dtype) {
        // SAFETY: as the caller's.
        return unsafe { build_panel_k(kind, w.wide, group, panel) };
    }
    let (rec, qa) = (record_bytes(w.dtype), quants_at(w.dtype));
    assert!(panel.len() * rec >= group.len() * PANEL, "build_panel: panel too small");
    let q4 = w.dtype != GgmlType::Q8_0;
    let bias = _mm512_set1_epi8(if w.dtype == GgmlType::Q4_0 { 8 } else { 0 });
    let flip = _mm512_set1_epi8(-128);
    let low = _mm512_set1_epi8(0x0F);
    let idx = interleave_words();
    for (r, p) in group.chunks_exact(rec).zip(panel.chunks_exact_mut(PANEL)) {
        let q = &r[qa..];
        let p = p.as_mut_ptr();
        // SAFETY (all loads and stores): a record's quants are 512 (Q8_0) or 256 (Q4) bytes, a
        // panel 512.
        unsafe {
            match (w.wide, q4) {
                (false, false) => {
                    for c in 0..8 {
                        let v = _mm512_loadu_si512(q.as_ptr().add(64 * c) as *const _);
                        _mm512_storeu_si512(p.add(64 * c) as *mut _, _mm512_xor_si512(v, flip));
                    }
                }
                (false, true) => {
                    for c in 0..4 {
                        let v = _mm512_loadu_si512(q.as_ptr().add(64 * c) as *const _);
                        let lo = _mm512_sub_epi8(_mm512_and_si512(v, low), bias);
                        let hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16::<4>(v), low), bias);
                        _mm512_storeu_si512(p.add(128 * c) as *mut _, lo);
                        _mm512_storeu_si512(p.add(128 * c + 64) as *mut _, hi);
                    }
                }
                (true, false) => {
                    for c in 0..8 {
                        let v = _mm512_loadu_si512(q.as_ptr().add(64 * c) as *const _);
                        let t = _mm512_permutexvar_epi16(idx, v);
                        _mm512_storeu_si512(p.add(64 * c) as *mut _, _mm512_xor_si512(t, flip));
                    }
                }
                (true, true) => {
                    let low = _mm256_set1_epi8(0x0F);
                    for c in 0..8 {
                        let v = _mm256_loadu_si256(q.as_ptr().add(32 * c) as *const __m256i);
                        let lo = _mm256_and_si256(v, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                        let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                        let t = _mm512_sub_epi8(_mm512_permutexvar_epi16(idx, both), bias);
                        _mm512_storeu_si512(p.add(64 * c) as *mut _, t);
                    }
                }
            }
        }
    }
}

/// [`build_panel`] for k-quant records: each block's nibbles unpacked as a Q4 record's, its bit
/// planes added under their masks (16 for the fifth bit, 32 for the sixth), then the type's
/// offset subtracted: the signed `u − offset` the VNNI kernels' sums are of.
///
/// # Safety
/// As [`build_panel`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn build_panel_k(kind: Kind, wide: bool, group: &[u8], panel: &mut [u8]) {
    let rec = kind.record_bytes();
    assert!(panel.len() * rec >= group.len() / BLOCKS * PANEL * BLOCKS, "build_panel: panel too small");
    let idx = interleave_words();
    let off = _mm512_set1_epi8(kind.offset as i8);
    let (b4, b5) = (_mm512_set1_epi8(16), _mm512_set1_epi8(32));
    let (c4, c5) = (_mm256_set1_epi8(16), _mm256_set1_epi8(32));
    for (r, sp) in group.chunks_exact(rec).zip(panel.chunks_exact_mut(BLOCKS * PANEL)) {
        for blk in 0..BLOCKS {
            let q = r[kind.q_at() + blk * NIB_BYTES..].as_ptr();
            let plane = |p: usize| r[kind.plane_at(p) + blk * PLANE_BYTES..].as_ptr();
            let p = sp[blk * PANEL..].as_mut_ptr();
            // SAFETY (all loads and stores): a block's nibbles are 256 bytes, each plane 64, and
            // a panel block 512 bytes.
            unsafe {
                if wide {
                    let low = _mm256_set1_epi8(0x0F);
                    for c in 0..8 {
                        let v = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
                        let mut lo = _mm256_and_si256(v, low);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                        for (pl, add) in [(0, c4), (1, c5)].into_iter().take(kind.planes()) {
                            let m = plane(pl).add(8 * c) as *const u32;
                            lo = _mm256_mask_add_epi8(lo, m.read_unaligned(), lo, add);
                            hi = _mm256_mask_add_epi8(hi, m.add(1).read_unaligned(), hi, add);
                        }
                        let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                        let t = _mm512_sub_epi8(_mm512_permutexvar_epi16(idx, both), off);
                        _mm512_storeu_si512(p.add(64 * c) as *mut _, t);
                    }
                } else {
                    let low = _mm512_set1_epi8(0x0F);
                    for c in 0..4 {
                        let v = _mm512_loadu_si512(q.add(64 * c) as *const _);
                        let mut lo = _mm512_and_si512(v, low);
                        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                        for (pl, add) in [(0, b4), (1, b5)].into_iter().take(kind.planes()) {
                            let m = plane(pl).add(16 * c) as *const u64;
                            lo = _mm512_mask_add_epi8(lo, m.read_unaligned(), lo, add);
                            hi = _mm512_mask_add_epi8(hi, m.add(1).read_unaligned(), hi, add);
                        }
                        _mm512_storeu_si512(p.add(128 * c) as *mut _, _mm512_sub_epi8(lo, off));
                        _mm512_storeu_si512(p.add(128 * c + 64) as *mut _, _mm512_sub_epi8(hi, off));
                    }
                }
            }
        }
    }
}

/// Sums of one block for two row groups: per group, the low-byte (or 8-bit) sums and the
/// high-byte sums.
type PairSums = [(Sums, Sums); 2];

/// Two blocks' sums (per half of a block for sub-blocks of 16): one block's being stored by the
/// tiles while the other's are scaled. 16 KiB, allocated once per task.
type BlockSums = [[PairSums; 2]; 2];

fn block_sums() -> Box<BlockSums> {
    let zero = || (Sums([[0; ROWS]; TILE]), Sums([[0; ROWS]; TILE]));
    Box::new(std::array::from_fn(|_| std::array::from_fn(|_| [zero(), zero()])))
}

/// Issues one block's tile products for one tile of tokens and two row groups: four products
/// (two for 8-bit activations) into tiles 0, 1, 5 and 6. [`store_tiles`] stores them; in between
/// the core scales the previous block's sums while the tiles compute (they execute in order, and
/// a store waits for its product).
///
/// # Safety
/// The tiles are configured; `xa` points at the tile's block (512 bytes, or 1,024 for 16-bit
/// quants), `w0` and `w1` at the groups' 512-byte panels of the block.
#[inline(always)]
unsafe fn compute_tiles(wide: bool, xa: *const u8, w0: *const u8, w1: *const u8) {
    // SAFETY: as the caller's contract.
    unsafe {
        if wide {
            asm!(
                "tileloadd tmm2, [{x} + {stride}*1]",
                "tileloadd tmm3, [{x} + {stride}*1 + 512]",
                "tileloadd tmm4, [{w0} + {row}*1]",
                "tileloadd tmm7, [{w1} + {row}*1]",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm5",
                "tilezero tmm6",
                "tdpbusd tmm0, tmm2, tmm4",
                "tdpbssd tmm1, tmm3, tmm4",
                "tdpbusd tmm5, tmm2, tmm7",
                "tdpbssd tmm6, tmm3, tmm7",
                x = in(reg) xa, w0 = in(reg) w0, w1 = in(reg) w1, stride = in(reg) 32usize,
                row = in(reg) 64usize, options(nostack, readonly),
            )
        } else {
            asm!(
                "tileloadd tmm2, [{x} + {stride}*1]",
                "tileloadd tmm4, [{w0} + {row}*1]",
                "tileloadd tmm7, [{w1} + {row}*1]",
                "tilezero tmm0",
                "tilezero tmm5",
                "tdpbssd tmm0, tmm2, tmm4",
                "tdpbssd tmm5, tmm2, tmm7",
                x = in(reg) xa, w0 = in(reg) w0, w1 = in(reg) w1, stride = in(reg) 32usize,
                row = in(reg) 64usize, options(nostack, readonly),
            )
        }
    }
}

/// Stores the sums [`compute_tiles`] computed.
///
/// # Safety
/// The tiles are configured; each `Sums` takes at most 16 rows of 64 bytes.
#[inline(always)]
unsafe fn store_tiles(wide: bool, s: &mut PairSums) {
    let [(l0, h0), (l1, h1)] = s;
    // SAFETY: as the caller's contract.
    unsafe {
        if wide {
            asm!(
                "tilestored [{l0} + {row}*1], tmm0",
                "tilestored [{h0} + {row}*1], tmm1",
                "tilestored [{l1} + {row}*1], tmm5",
                "tilestored [{h1} + {row}*1], tmm6",
                row = in(reg) 64usize, l0 = in(reg) l0.0.as_mut_ptr(), h0 = in(reg) h0.0.as_mut_ptr(),
                l1 = in(reg) l1.0.as_mut_ptr(), h1 = in(reg) h1.0.as_mut_ptr(),
                options(nostack),
            )
        } else {
            asm!(
                "tilestored [{l0} + {row}*1], tmm0",
                "tilestored [{l1} + {row}*1], tmm5",
                row = in(reg) 64usize, l0 = in(reg) l0.0.as_mut_ptr(), l1 = in(reg) l1.0.as_mut_ptr(),
                options(nostack),
            )
        }
    }
}

/// Adds one block's scaled sums to one group's accumulators: the VNNI kernels' `scale_block`,
/// operation for operation, on the sums the tiles stored.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn scale_sums(
    acc: &mut [__m512; TILE],
    lo: &Sums,
    hi: &Sums,
    wide: bool,
    record: *const u8,
    mins: bool,
    d: &[f32],
    ds: &[f32],
) {
    // SAFETY (the loads): a record holds 16 f16 scales (and 16 minimums for Q4_1) before its
    // quants; each row of sums is 16 aligned i32. The intrinsics need AVX-512 F and F16C, which
    // the only caller (`pair_tiles`) enables.
    unsafe {
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(record as *const __m256i));
        let mw = if mins {
            _mm512_cvtph_ps(_mm256_loadu_si256(record.add(2 * ROWS) as *const __m256i))
        } else {
            _mm512_setzero_ps()
        };
        for (i, a) in acc.iter_mut().enumerate() {
            let mut s = _mm512_load_si512(lo.0[i].as_ptr() as *const _);
            if wide {
                let h = _mm512_load_si512(hi.0[i].as_ptr() as *const _);
                s = _mm512_add_epi32(s, _mm512_slli_epi32::<8>(h));
            }
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(d[i]));
            *a = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s), *a);
            if mins {
                *a = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds[i]), *a);
            }
        }
    }
}

/// [`scale_sums`] for k-quants: the VNNI kernels' `kq` `scale_block`, operation for operation,
/// for each of the block's `sums` (one per sub-block it holds).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn scale_sums_k(
    acc: &mut [__m512; TILE],
    sums: [&(Sums, Sums); 2],
    wide: bool,
    kind: Kind,
    record: *const u8,
    blk: usize,
    d: &[f32],
    ds: &[f32],
) {
    let halves = QBLOCK / kind.sub;
    // SAFETY (the loads): the record holds 16 f32 `d` (and 16 `−dmin`) and 16 bytes of scales
    // (and minimums) per sub-block at the offsets `Kind` gives; each row of sums is 16 aligned
    // i32. The intrinsics need AVX-512 F, which the only caller (`pair_tiles`) enables.
    unsafe {
        let dd = _mm512_loadu_ps(record as *const f32);
        let dmin = if kind.min { _mm512_loadu_ps(record.add(4 * ROWS) as *const f32) } else { dd };
        for (h, (lo, hi)) in sums.into_iter().enumerate().take(halves) {
            let j = blk * halves + h;
            let sc = _mm_loadu_si128(record.add(kind.sc_at() + j * ROWS) as *const __m128i);
            let rs = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
            let rm = if kind.min {
                let mn = _mm_loadu_si128(record.add(kind.mn_at() + j * ROWS) as *const __m128i);
                _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)))
            } else {
                rs
            };
            for (i, a) in acc.iter_mut().enumerate() {
                let mut s = _mm512_load_si512(lo.0[i].as_ptr() as *const _);
                if wide {
                    let hv = _mm512_load_si512(hi.0[i].as_ptr() as *const _);
                    s = _mm512_add_epi32(s, _mm512_slli_epi32::<8>(hv));
                }
                *a = _mm512_fmadd_ps(_mm512_mul_ps(rs, _mm512_set1_ps(d[i])), _mm512_cvtepi32_ps(s), *a);
                if kind.min {
                    *a = _mm512_fmadd_ps(rm, _mm512_set1_ps(ds[h * TILE + i]), *a);
                }
            }
        }
    }
}

/// Every token of `xq` against row groups `g` and `g + 1` (`second`: whether there is a group
/// `g + 1`; without one, the first group's panel stands in and its results are dropped), whose
/// panels are built, in tiles of 16 tokens.
///
/// # Safety
/// The tiles are usable and the CPU has AVX-512 VNNI; `panels` hold the groups' panels; `out`
/// is `n × rows` and this task owns the groups' rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn pair_tiles(
    w: &PackedMatrix,
    g: usize,
    second: bool,
    panels: [&[u8]; 2],
    xq: &QuantizedRows,
    acts: &TileActs,
    out: SharedOut,
    rows: usize,
    sums: &mut BlockSums,
) {
    let (n, cols, wide) = (xq.n, xq.cols, xq.wide);
    let nb = cols / QBLOCK;
    let parts = if wide { 2 } else { 1 };
    assert!(panels.iter().all(|p| p.len() >= nb * PANEL), "pair_tiles: panel too small");
    let kind = Kind::of(w.dtype);
    let halves = halves(w.dtype);
    let span = QBLOCK / halves;
    let rec = record_bytes(w.dtype);
    // Elements per record: a block, or a k-quant's super-block of eight.
    let per_rec = if kind.is_some() { BLOCKS } else { 1 };
    let groups = [w.group(g), if second { w.group(g + 1) } else { w.group(g) }];
    let mins = w.dtype == GgmlType::Q4_1 || kind.is_some_and(|k| k.min);
    let mut configured = 0;
    for t0 in (0..n).step_by(TILE) {
        let m = (n - t0).min(TILE);
        if m != configured {
            // SAFETY: the tiles are usable (the caller's contract).
            unsafe { Config::for_tokens(m, span).load() };
            configured = m;
        }
        let tile = t0 / TILE;
        let xa = &acts.bytes[tile * nb * parts * PANEL..(tile + 1) * nb * parts * PANEL];
        let d = &acts.d[tile * nb * TILE..(tile + 1) * nb * TILE];
        let per_ds = nb * halves * TILE;
        let ds = if mins { &acts.ds[tile * per_ds..(tile + 1) * per_ds] } else { &[][..] };
        // Block b's products for every half; all but the last half stored at once (the next
        // half reuses the tiles), the last left for `store_last` after the previous block's
        // sums are scaled.
        let compute = |b: usize, s: &mut [PairSums; 2]| {
            for (h, s) in s.iter_mut().enumerate().take(halves) {
                // SAFETY: the tile's block b (at half h) and the panels' block b lie inside
                // their slices; the configured spans read within the block.
                unsafe {
                    compute_tiles(
                        wide,
                        xa[b * parts * PANEL + h * span..].as_ptr(),
                        panels[0][b * PANEL + h * PANEL / halves..].as_ptr(),
                        panels[1][b * PANEL + h * PANEL / halves..].as_ptr(),
                    );
                    if h + 1 < halves {
                        store_tiles(wide, s);
                    }
                }
            }
        };
        // SAFETY: the tiles are configured; the buffers are `PairSums`.
        let store_last = |s: &mut [PairSums; 2]| unsafe { store_tiles(wide, &mut s[halves - 1]) };
        let mut acc = [[_mm512_setzero_ps(); TILE]; 2];
        compute(0, &mut sums[0]);
        store_last(&mut sums[0]);
        for b in 0..nb {
            if b + 1 < nb {
                compute(b + 1, &mut sums[(b + 1) % 2]);
            }
            let db = &d[b * TILE..(b + 1) * TILE];
            let dsb = if mins { &ds[b * halves * TILE..(b + 1) * halves * TILE] } else { &[][..] };
            let record = |k: usize| groups[k][(b / per_rec) * rec..].as_ptr();
            for (k, a) in acc.iter_mut().enumerate() {
                let s = &sums[b % 2];
                match kind {
                    Some(kind) => {
                        scale_sums_k(a, [&s[0][k], &s[1][k]], wide, kind, record(k), b % per_rec, db, dsb)
                    }
                    None => scale_sums(a, &s[0][k].0, &s[0][k].1, wide, record(k), mins, db, dsb),
                }
            }
            if b + 1 < nb {
                store_last(&mut sums[(b + 1) % 2]);
            }
        }
        let mut lanes = [0f32; ROWS];
        for (k, acc) in acc.iter().enumerate().take(if second { 2 } else { 1 }) {
            let base = (g + k) * ROWS;
            let valid = (rows - base).min(ROWS);
            for (i, a) in acc[..m].iter().enumerate() {
                // SAFETY: lanes holds 16 f32.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *a) };
                for (r, &v) in lanes[..valid].iter().enumerate() {
                    // SAFETY: t0 + i < n and base + r < rows; this task owns the groups' rows.
                    unsafe { *out.0.add((t0 + i) * rows + base + r) = v };
                }
            }
        }
    }
}
