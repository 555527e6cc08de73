//! The element type of a KV pool ([`KvDtype`]) and the conversions between it and the f32 the
//! backends compute in.
//!
//! Invariants:
//! - f32 → f16 and f32 → bf16 round to nearest, ties to even; values beyond the range become ±inf,
//!   NaN stays NaN (quiet). f16/bf16 → f32 is exact.
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
}

impl KvDtype {
    /// Every dtype, in the order the flag's help lists them.
    pub const ALL: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];

    /// Bytes of one value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    /// The flag / compatibility-record spelling: `f32`, `f16` or `bf16`.
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
        }
    }

    /// Name of the byte layout of a pool of this dtype (see [`super::KvLayout::name`]).
    pub fn layout_name(self) -> &'static str {
        match self {
            KvDtype::F32 => "tandem-f32-lkv-v1",
            KvDtype::F16 => "tandem-f16-lkv-v1",
            KvDtype::Bf16 => "tandem-bf16-lkv-v1",
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
        }
    }

    /// The values of little-endian bytes of this dtype, as f32 (tests, debugging, parity checks).
    pub fn decode(self, src: &[u8]) -> Vec<f32> {
        let words = |n: usize| src.chunks_exact(n);
        match self {
            KvDtype::F32 => words(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            KvDtype::F16 => words(2).map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect(),
            KvDtype::Bf16 => words(2).map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect(),
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
            _ => Err(format!("unknown KV dtype {s:?} (expected f32, f16 or bf16)")),
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
}

impl<'a> KvSlice<'a> {
    /// Values in the slice.
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) | KvSlice::Bf16(s) => s.len(),
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

#[cfg(target_arch = "x86_64")]
fn has_f16c() -> bool {
    std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
}

/// The x86 paths. F16C rounds f32 → f16 to nearest even like the portable rule (`half`, which
/// itself uses the same instruction when it can).
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{bf16_to_f32, f16_bits, f16_to_f32};

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
        let e = "fp8".parse::<KvDtype>().unwrap_err();
        assert!(e.contains("fp8") && e.contains("f32, f16 or bf16"), "{e}");
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
            assert_eq!(back[2], f32::INFINITY, "{d}");
            assert_eq!(back[3], f32::NEG_INFINITY, "{d}");
            let mut r = xs;
            d.round(&mut r);
            assert!(r[0].is_nan() && r[4].is_nan() && r[2] == f32::INFINITY, "{d}: {r:?}");
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
}
