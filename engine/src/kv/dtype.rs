//! The element type of a KV pool ([`KvDtype`]) and the conversions between it and the f32 the
//! backends compute in.
//!
//! Invariants:
//! - f32 → f16 and f32 → bf16 round to nearest, ties to even; values beyond the range become ±inf,
//!   NaN stays NaN (quiet). f16/bf16 → f32 is exact.
//! - f32 → fp8 (OCP E4M3, the `fn` variant: no infinities, one NaN code per sign) rounds to
//!   nearest, ties to even, and saturates: anything at or beyond ±448, ±inf included, becomes ±448;
//!   NaN stays NaN. The scale is 1 for every tensor (no per-block or per-head factors), the rule
//!   vLLM follows for an fp8 cache when a checkpoint gives no scales; the GPU kernels use the same
//!   bit rule (kernels/cuda/model.cu), so a block means the same values on either device.
//! - One function per direction and dtype ([`KvDtype::encode`], [`KvDtype::round`],
//!   [`KvSlice::widen`]), whatever SIMD the CPU has: the bytes a write puts in the pool and the
//!   values a pass rounds its fresh K/V to are the same, which is what keeps a token's K/V
//!   identical whether attention reads them from this pass or later from the pool.
//! - The vectorized paths (AVX-512F, F16C, AVX2) are chosen at run time and give the same bits as
//!   the portable ones.

use serde::{Deserialize, Serialize};

/// Element type of a KV pool. Part of the layout ([`super::KvLayout`]) and so of the layout name
/// two workers compare before they exchange blocks as raw bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// IEEE single precision: exact, 4 bytes per value.
    F32,
    /// IEEE half precision: 2 bytes, 11-bit significand, range ±65504.
    F16,
    /// bfloat16: 2 bytes, f32's range with an 8-bit significand.
    Bf16,
    /// fp8 E4M3 (OCP `e4m3fn`): 1 byte, a 4-bit significand, range ±448, saturating, scale 1.
    Fp8,
}

impl KvDtype {
    /// Every dtype, in the order the flag's help lists them.
    pub const ALL: [KvDtype; 4] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::Fp8];

    /// Bytes of one value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::Fp8 => 1,
        }
    }

    /// The flag / compatibility-record spelling: `f32`, `f16`, `bf16` or `fp8`.
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8 => "fp8",
        }
    }

    /// Name of the byte layout of a pool of this dtype (see [`super::KvLayout::name`]).
    pub fn layout_name(self) -> &'static str {
        match self {
            KvDtype::F32 => "tandem-f32-lkv-v1",
            KvDtype::F16 => "tandem-f16-lkv-v1",
            KvDtype::Bf16 => "tandem-bf16-lkv-v1",
            KvDtype::Fp8 => "tandem-fp8e4m3-lkv-v1",
        }
    }

    /// The dtype whose [`Self::layout_name`] is `name`.
    pub fn from_layout_name(name: &str) -> Option<KvDtype> {
        Self::ALL.into_iter().find(|d| d.layout_name() == name)
    }

    /// Writes `src` into `dst` as little-endian values of this dtype (`dst` is `src.len() *
    /// self.bytes()` long).
    ///
    /// # Panics
    /// If the lengths disagree (callers check shapes first).
    pub fn encode(self, src: &[f32], dst: &mut [u8]) {
        assert_eq!(dst.len(), src.len() * self.bytes(), "KvDtype::encode: buffer lengths");
        match self {
            KvDtype::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
            KvDtype::F16 => {
                #[cfg(target_arch = "x86_64")]
                if has_f16c() {
                    // SAFETY: the CPU supports F16C and AVX, checked just above.
                    return unsafe { simd::encode_f16_f16c(src, dst) };
                }
                for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&f16_bits(x).to_le_bytes());
                }
            }
            KvDtype::Bf16 => {
                for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&bf16_bits(x).to_le_bytes());
                }
            }
            KvDtype::Fp8 => {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = fp8_bits(x);
                }
            }
        }
    }

    /// Rounds every value to this dtype and back (f32 → dtype → f32): afterwards each value is
    /// exactly what a pool of this dtype would give back for it. A no-op for f32.
    pub fn round(self, x: &mut [f32]) {
        match self {
            KvDtype::F32 => {}
            KvDtype::F16 => {
                #[cfg(target_arch = "x86_64")]
                if has_f16c() {
                    // SAFETY: the CPU supports F16C and AVX, checked just above.
                    return unsafe { simd::round_f16_f16c(x) };
                }
                x.iter_mut().for_each(|v| *v = f16_to_f32(f16_bits(*v)))
            }
            KvDtype::Bf16 => x.iter_mut().for_each(|v| *v = bf16_to_f32(bf16_bits(*v))),
            KvDtype::Fp8 => x.iter_mut().for_each(|v| *v = fp8_to_f32(fp8_bits(*v))),
        }
    }

    /// The values of little-endian bytes of this dtype, as f32 (tests, debugging, parity checks).
    pub fn decode(self, src: &[u8]) -> Vec<f32> {
        let words = |n: usize| src.chunks_exact(n);
        match self {
            KvDtype::F32 => words(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            KvDtype::F16 => words(2).map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect(),
            KvDtype::Bf16 => words(2).map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect(),
            KvDtype::Fp8 => src.iter().map(|&b| fp8_to_f32(b)).collect(),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(KvDtype::F32),
            "f16" | "float16" | "half" => Ok(KvDtype::F16),
            "bf16" | "bfloat16" => Ok(KvDtype::Bf16),
            "fp8" | "fp8_e4m3" | "e4m3" => Ok(KvDtype::Fp8),
            _ => Err(format!("unknown KV dtype {s:?} (expected f32, f16, bf16 or fp8)")),
        }
    }
}

/// f32 → IEEE half bits, round to nearest even (F16C when the CPU has it, else the same rule in
/// software; both give the same bits).
#[inline]
pub fn f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// IEEE half bits → f32 (exact).
#[inline]
pub fn f16_to_f32(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

/// f32 → bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN of the same sign.
#[inline]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        // Keep the sign and the top payload bits, and make sure a mantissa bit survives.
        return ((b >> 16) as u16) | 0x0040;
    }
    // Adding 0x7fff plus the lowest kept bit rounds half-way cases to the even neighbour;
    // overflow past the largest finite value carries into the exponent and gives inf.
    let lsb = (b >> 16) & 1;
    ((b + 0x7fff + lsb) >> 16) as u16
}

/// bfloat16 bits → f32 (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// The largest finite fp8 E4M3 value; larger magnitudes saturate to it.
pub const FP8_MAX: f32 = 448.0;

/// f32 → fp8 E4M3 bits (`e4m3fn`: bias 7, no infinities, `0x7f`/`0xff` NaN): round to nearest,
/// ties to even; magnitudes at or beyond [`FP8_MAX`] (±inf too) saturate to ±448; NaN keeps its
/// sign. The CUDA kernels' `st` for fp8 is this rule, step for step.
#[inline]
pub fn fp8_bits(x: f32) -> u8 {
    let b = x.to_bits();
    let sign = ((b >> 24) & 0x80) as u8;
    let a = b & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return sign | 0x7f;
    }
    // 448 = 1.75 · 2^8 (0x43e0_0000); the next code up is NaN, so the half-way value 464 and
    // everything above it saturate as well as rounding would.
    if a >= 0x43e0_0000 {
        return sign | 0x7e;
    }
    if a < 0x3c80_0000 {
        // Below the smallest normal (2^-6): multiples of 2^-9. The scaling is exact, and 8 means
        // the smallest normal, whose code is 8 as well.
        return sign | (f32::from_bits(a) * 512.0).round_ties_even() as u8;
    }
    // Keep 3 of the 23 significand bits, ties to even; a carry moves into the exponent.
    let r = a + 0x7_ffff + ((a >> 20) & 1);
    let e = (r >> 23) - 120;
    sign | ((e << 3) as u8) | ((r >> 20) & 7) as u8
}

/// fp8 E4M3 bits → f32 (exact).
#[inline]
pub fn fp8_to_f32(b: u8) -> f32 {
    FP8_TABLE[b as usize]
}

/// Every fp8 E4M3 code's value.
static FP8_TABLE: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        let (e, m) = ((i >> 3) & 15, (i & 7) as u32);
        let mag = if e == 15 && m == 7 {
            f32::NAN
        } else if e == 0 {
            // m · 2^-9
            m as f32 / 512.0
        } else {
            // (8 + m) · 2^(e - 10)
            f32::from_bits(((e as u32 + 120) << 23) | (m << 20))
        };
        t[i] = if i & 0x80 != 0 { -mag } else { mag };
        i += 1;
    }
    t
};

/// A run of K or V values as attention reads them: f32 (this pass's projections, or an f32 pool)
/// or a 16-bit pool's storage, widened to f32 a row at a time ([`KvSlice::widen`]) so the cache
/// is never copied.
#[derive(Debug, Clone, Copy)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    /// IEEE half bits.
    F16(&'a [u16]),
    /// bfloat16 bits.
    Bf16(&'a [u16]),
    /// fp8 E4M3 bits.
    Fp8(&'a [u8]),
}

impl<'a> KvSlice<'a> {
    /// Values in the slice.
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) | KvSlice::Bf16(s) => s.len(),
            KvSlice::Fp8(s) => s.len(),
        }
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len` values from `start`, of the same kind.
    ///
    /// # Panics
    /// If the range is out of bounds.
    #[inline]
    pub fn sub(&self, start: usize, len: usize) -> KvSlice<'a> {
        match *self {
            KvSlice::F32(s) => KvSlice::F32(&s[start..start + len]),
            KvSlice::F16(s) => KvSlice::F16(&s[start..start + len]),
            KvSlice::Bf16(s) => KvSlice::Bf16(&s[start..start + len]),
            KvSlice::Fp8(s) => KvSlice::Fp8(&s[start..start + len]),
        }
    }

    /// The values as f32: the slice itself when it is f32, else widened into `buf` (at least
    /// `self.len()` long), whose prefix is returned.
    #[inline]
    pub fn widen<'b>(&self, buf: &'b mut [f32]) -> &'b [f32]
    where
        'a: 'b,
    {
        match *self {
            KvSlice::F32(s) => s,
            KvSlice::F16(s) => {
                let out = &mut buf[..s.len()];
                widen_f16(s, out);
                out
            }
            KvSlice::Bf16(s) => {
                let out = &mut buf[..s.len()];
                widen_bf16(s, out);
                out
            }
            KvSlice::Fp8(s) => {
                let out = &mut buf[..s.len()];
                widen_fp8(s, out);
                out
            }
        }
    }

    /// A copy of every value as f32 (tests and debugging).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut buf = vec![0f32; self.len()];
        self.widen(&mut buf).to_vec()
    }
}

/// IEEE half bits → f32 for a whole run (`dst.len() == src.len()`), 16 or 8 at a time where the
/// CPU can.
pub fn widen_f16(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_f16: lengths");
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { simd::widen_f16_avx512(src, dst) };
        }
        if has_f16c() {
            // SAFETY: the CPU supports F16C and AVX, checked just above.
            return unsafe { simd::widen_f16_f16c(src, dst) };
        }
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f16_to_f32(s);
    }
}

/// bfloat16 bits → f32 for a whole run (`dst.len() == src.len()`), 16 or 8 at a time where the
/// CPU can.
pub fn widen_bf16(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_bf16: lengths");
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { simd::widen_bf16_avx512(src, dst) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { simd::widen_bf16_avx2(src, dst) };
        }
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_to_f32(s);
    }
}

/// fp8 E4M3 bits → f32 for a whole run (`dst.len() == src.len()`), 16 at a time where the CPU
/// has AVX-512 (the same bits as [`fp8_to_f32`]).
pub fn widen_fp8(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_fp8: lengths");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw") {
        // SAFETY: the CPU supports AVX-512F and BW, checked just above.
        return unsafe { simd::widen_fp8_avx512(src, dst) };
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = fp8_to_f32(s);
    }
}

#[cfg(target_arch = "x86_64")]
fn has_f16c() -> bool {
    std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
}

/// The x86 paths. F16C rounds f32 → f16 to nearest even like the portable rule (`half`, which
/// itself uses the same instruction when it can).
#[cfg(target_arch = "x86_64")]
pub(crate) mod simd {
    use std::arch::x86_64::*;

    use super::{bf16_to_f32, f16_bits, f16_to_f32, fp8_to_f32};

    /// 16 fp8 E4M3 codes as f32. The code's low seven bits, moved up by 7, are an IEEE half
    /// with the same significand and an exponent 8 lower (subnormals included), so widening that
    /// half and multiplying by 2^8 is exact; the NaN codes are put back by mask.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(crate) fn fp8x16(b: __m128i) -> __m512 {
        let w = _mm256_cvtepu8_epi16(b);
        let mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
        let sign = _mm256_slli_epi16::<8>(_mm256_and_si256(w, _mm256_set1_epi16(0x80)));
        let h = _mm256_or_si256(sign, _mm256_slli_epi16::<7>(mag));
        // A NaN code becomes the half quiet NaN of its sign, which widens to f32's.
        let nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f));
        let h = _mm256_blendv_epi8(h, _mm256_or_si256(sign, _mm256_set1_epi16(0x7e00)), nan);
        _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0))
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn widen_fp8_avx512(src: &[u8], dst: &mut [f32]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: `i + 16 <= n <= len` of both slices; unaligned loads and stores.
            unsafe {
                let b = _mm_loadu_si128(src.as_ptr().add(i).cast());
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), fp8x16(b));
            }
        }
        for i in n..src.len() {
            dst[i] = fp8_to_f32(src[i]);
        }
    }

    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn encode_f16_f16c(src: &[f32], dst: &mut [u8]) {
        debug_assert_eq!(dst.len(), 2 * src.len());
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: `i + 8 <= n` values of `src` and `2 * (i + 8)` bytes of `dst` are in
            // bounds; unaligned loads and stores.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
                _mm_storeu_si128(dst.as_mut_ptr().add(2 * i).cast(), h);
            }
        }
        for i in n..src.len() {
            dst[2 * i..2 * i + 2].copy_from_slice(&f16_bits(src[i]).to_le_bytes());
        }
    }

    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn round_f16_f16c(x: &mut [f32]) {
        let n = x.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: `i + 8 <= n <= x.len()`; unaligned loads and stores.
            unsafe {
                let p = x.as_mut_ptr().add(i);
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(p));
                _mm256_storeu_ps(p, _mm256_cvtph_ps(h));
            }
        }
        for v in &mut x[n..] {
            *v = f16_to_f32(f16_bits(*v));
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_f16_avx512(src: &[u16], dst: &mut [f32]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: `i + 16 <= n <= len` of both slices; unaligned loads and stores.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
            }
        }
        for i in n..src.len() {
            dst[i] = f16_to_f32(src[i]);
        }
    }

    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen_f16_f16c(src: &[u16], dst: &mut [f32]) {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: `i + 8 <= n <= len` of both slices; unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        for i in n..src.len() {
            dst[i] = f16_to_f32(src[i]);
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_bf16_avx512(src: &[u16], dst: &mut [f32]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: `i + 16 <= n <= len` of both slices; unaligned loads and stores.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_castsi512_ps(w));
            }
        }
        for i in n..src.len() {
            dst[i] = bf16_to_f32(src[i]);
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn widen_bf16_avx2(src: &[u16], dst: &mut [f32]) {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: `i + 8 <= n <= len` of both slices; unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
                let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_castsi256_ps(w));
            }
        }
        for i in n..src.len() {
            dst[i] = bf16_to_f32(src[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display_round_trip_and_refuse_others() {
        for d in KvDtype::ALL {
            assert_eq!(d.to_string().parse::<KvDtype>(), Ok(d));
            assert_eq!(KvDtype::from_layout_name(d.layout_name()), Some(d));
            assert_eq!(serde_json::to_string(&d).unwrap(), format!("\"{d}\""));
        }
        assert_eq!(" BF16 ".parse::<KvDtype>(), Ok(KvDtype::Bf16));
        assert_eq!("FP8_E4M3".parse::<KvDtype>(), Ok(KvDtype::Fp8));
        let e = "fp8_e5m2".parse::<KvDtype>().unwrap_err();
        assert!(e.contains("fp8_e5m2") && e.contains("f32, f16, bf16 or fp8"), "{e}");
        assert_eq!(KvDtype::from_layout_name("tandem-f64-lkv-v1"), None);
        assert_eq!(KvDtype::F16.layout_name(), "tandem-f16-lkv-v1");
    }

    #[test]
    fn representable_values_round_trip_exactly() {
        let xs = [0.0f32, -0.0, 1.0, -2.5, 0.333_251_95, 65504.0, 6.103_515_6e-5, 5.960_464_5e-8];
        for d in KvDtype::ALL {
            let mut bytes = vec![0u8; xs.len() * d.bytes()];
            let mut rounded = xs;
            d.round(&mut rounded);
            d.encode(&rounded, &mut bytes);
            let back = d.decode(&bytes);
            // Rounding is idempotent, and decoding what was encoded gives the rounded values.
            for (a, b) in rounded.iter().zip(&back) {
                assert_eq!(a.to_bits(), b.to_bits(), "{d}");
            }
        }
        // Exactly representable in f16: unchanged.
        let mut x = xs;
        KvDtype::F16.round(&mut x);
        assert_eq!(x, xs);
        // bf16 keeps 8 significant bits: 1 + 2^-7 survives, 1 + 2^-9 does not.
        let mut x = [1.0 + 2f32.powi(-7), 1.0 + 2f32.powi(-9)];
        KvDtype::Bf16.round(&mut x);
        assert_eq!(x, [1.0 + 2f32.powi(-7), 1.0]);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1.0 = 0x3f80_0000; one bf16 ulp at 1.0 is 0x1_0000 in f32 bits.
        let f = f32::from_bits;
        assert_eq!(bf16_bits(f(0x3f80_8000)), 0x3f80, "tie, even below: down");
        assert_eq!(bf16_bits(f(0x3f81_8000)), 0x3f82, "tie, odd below: up");
        assert_eq!(bf16_bits(f(0x3f80_8001)), 0x3f81, "above the tie: up");
        assert_eq!(bf16_bits(f(0x3f80_7fff)), 0x3f80, "below the tie: down");
        assert_eq!(bf16_bits(f(0xbf81_8000)), 0xbf82, "negative ties alike");
        assert_eq!(bf16_bits(f32::MAX), 0x7f80, "beyond the largest finite bf16: inf");
        assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
        assert_eq!(bf16_bits(f32::NEG_INFINITY), 0xff80);
    }

    #[test]
    fn f16_rounds_to_nearest_even_and_saturates_to_inf() {
        // 2049 lies half-way between the f16 neighbours 2048 and 2050: ties go to even (2048);
        // 2051 between 2050 and 2052 goes to 2052.
        assert_eq!(f16_to_f32(f16_bits(2049.0)), 2048.0);
        assert_eq!(f16_to_f32(f16_bits(2051.0)), 2052.0);
        assert_eq!(f16_to_f32(f16_bits(1e6)), f32::INFINITY);
        assert_eq!(f16_to_f32(f16_bits(-1e6)), f32::NEG_INFINITY);
    }

    #[test]
    fn nan_and_inf_survive_without_panicking() {
        let xs = [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::from_bits(0x7f80_0001)];
        for d in KvDtype::ALL {
            let mut bytes = vec![0u8; xs.len() * d.bytes()];
            d.encode(&xs, &mut bytes);
            let back = d.decode(&bytes);
            assert!(back[0].is_nan() && back[1].is_nan() && back[4].is_nan(), "{d}: {back:?}");
            // fp8 E4M3 has no infinities: they saturate to the largest finite value.
            let inf = if d == KvDtype::Fp8 { FP8_MAX } else { f32::INFINITY };
            assert_eq!(back[2], inf, "{d}");
            assert_eq!(back[3], -inf, "{d}");
            let mut r = xs;
            d.round(&mut r);
            assert!(r[0].is_nan() && r[4].is_nan() && r[2] == inf, "{d}: {r:?}");
        }
    }

    #[test]
    fn vector_widening_equals_the_scalar_rule() {
        // Every 16-bit pattern, in a length that leaves a tail for the scalar remainder.
        let src: Vec<u16> = (0..=u16::MAX).chain(0..7).collect();
        let mut got = vec![0f32; src.len()];
        widen_f16(&src, &mut got);
        for (i, (&s, g)) in src.iter().zip(&got).enumerate() {
            let want = f16_to_f32(s);
            assert!(want.to_bits() == g.to_bits() || (want.is_nan() && g.is_nan()), "f16 {i}: {s:#x}");
        }
        widen_bf16(&src, &mut got);
        for (&s, g) in src.iter().zip(&got) {
            assert_eq!(g.to_bits(), bf16_to_f32(s).to_bits(), "bf16 {s:#x}");
        }
        // f32 → f16 over many magnitudes, ties and specials: vector rounding and encoding agree
        // with the scalar rule.
        let xs: Vec<f32> = (0..20_000u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)))
            .chain([2049.0, 2051.0, 65520.0, f32::INFINITY, f32::NAN, -0.0])
            .collect();
        let mut rounded = xs.clone();
        KvDtype::F16.round(&mut rounded);
        let mut bytes = vec![0u8; 2 * xs.len()];
        KvDtype::F16.encode(&xs, &mut bytes);
        for (i, &x) in xs.iter().enumerate() {
            let want = f16_bits(x);
            let got = u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
            assert!(got == want || (x.is_nan() && got & 0x7c00 == 0x7c00 && got & 0x3ff != 0), "{x}");
            let r = f16_to_f32(want);
            assert!(rounded[i].to_bits() == r.to_bits() || (x.is_nan() && rounded[i].is_nan()), "{x}");
        }
        let slice = KvSlice::Bf16(&src[..3]);
        assert_eq!(slice.to_f32_vec(), vec![0.0, bf16_to_f32(1), bf16_to_f32(2)]);
        assert_eq!(KvSlice::F32(&[1.0, 2.0]).sub(1, 1).to_f32_vec(), vec![2.0]);
    }

    /// The value of an E4M3 code from its definition, in f64.
    fn fp8_reference(b: u8) -> f64 {
        let (e, m) = (((b >> 3) & 15) as i32, (b & 7) as f64);
        if e == 15 && m == 7.0 {
            return f64::NAN;
        }
        let mag = if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
        if b & 0x80 != 0 {
            -mag
        } else {
            mag
        }
    }

    #[test]
    fn fp8_codes_decode_to_their_definition_scalar_and_vector() {
        let codes: Vec<u8> = (0..=255u8).chain(0..=255u8).chain([0x7e, 0xfe, 0x01]).collect();
        let mut wide = vec![0f32; codes.len()];
        widen_fp8(&codes, &mut wide);
        for (&b, &w) in codes.iter().zip(&wide) {
            let want = fp8_reference(b);
            let scalar = fp8_to_f32(b);
            if want.is_nan() {
                assert!(scalar.is_nan() && w.is_nan(), "{b:#x}");
                assert_eq!(scalar.is_sign_negative(), b & 0x80 != 0, "{b:#x}: NaN keeps its sign");
                assert_eq!(w.to_bits(), scalar.to_bits(), "{b:#x}: vector NaN bits");
            } else {
                assert_eq!(scalar as f64, want, "{b:#x}");
                assert_eq!(w.to_bits(), scalar.to_bits(), "{b:#x}: vector");
            }
        }
        assert_eq!(fp8_to_f32(0x7e), FP8_MAX);
        assert_eq!(fp8_to_f32(0x01), 2f32.powi(-9), "the smallest subnormal");
        assert_eq!(fp8_to_f32(0x08), 2f32.powi(-6), "the smallest normal");
        // Every finite code encodes back to itself (±0 keep their sign).
        for b in 0..=255u8 {
            if b & 0x7f != 0x7f {
                assert_eq!(fp8_bits(fp8_to_f32(b)), b, "{b:#x}");
            }
        }
    }

    #[test]
    fn fp8_encoding_rounds_to_the_nearest_code_ties_to_even_and_saturates() {
        // The nearest finite code by search, ties to the code with an even significand.
        let finite: Vec<(u8, f64)> =
            (0..=255u8).filter(|b| b & 0x7f != 0x7f).map(|b| (b, fp8_reference(b))).collect();
        let nearest = |x: f32| -> u8 {
            let x = x as f64;
            if x.abs() >= 448.0 {
                return if x < 0.0 { 0xfe } else { 0x7e };
            }
            let mut best: Option<(u8, f64)> = None;
            for &(b, v) in &finite {
                if (v < 0.0) != x.is_sign_negative() && v != 0.0 {
                    continue;
                }
                if v == 0.0 && (b & 0x80 != 0) != x.is_sign_negative() {
                    continue;
                }
                let d = (v - x).abs();
                best = match best {
                    Some((bb, bd)) if bd < d || (bd == d && bb & 1 == 0) => Some((bb, bd)),
                    _ => Some((b, d)),
                };
            }
            best.unwrap().0
        };
        let mut xs: Vec<f32> = (0..200_000u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)))
            .filter(|x| x.is_finite() && x.abs() < 1e4)
            .collect();
        // Every half-way point between neighbouring codes, and just either side of it.
        for w in finite.iter().filter(|(b, _)| b & 0x80 == 0).map(|&(_, v)| v).collect::<Vec<_>>().windows(2)
        {
            let mid = ((w[0] + w[1]) / 2.0) as f32;
            for x in [mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
                xs.extend([x, -x]);
            }
        }
        xs.extend([464.0, 463.9, 470.0, 1e30, -1e30, 0.0, -0.0, 2f32.powi(-10), 2f32.powi(-10) * 3.0]);
        for &x in &xs {
            assert_eq!(fp8_bits(x), nearest(x), "{x:e} ({:#x})", x.to_bits());
        }
        assert_eq!(fp8_bits(f32::INFINITY), 0x7e);
        assert_eq!(fp8_bits(f32::NEG_INFINITY), 0xfe);
        assert_eq!(fp8_bits(f32::NAN) & 0x7f, 0x7f);
        // Ties: 1 + 1/16 lies between 1 and 1 + 1/8 and goes to 1 (even); 1 + 3/16 to 1 + 1/4.
        assert_eq!(fp8_to_f32(fp8_bits(1.0625)), 1.0);
        assert_eq!(fp8_to_f32(fp8_bits(1.1875)), 1.25);
        // A tie between subnormals: 1.5 · 2^-9 goes to 2 · 2^-9.
        assert_eq!(fp8_to_f32(fp8_bits(1.5 * 2f32.powi(-9))), 2f32.powi(-8));
    }
}
