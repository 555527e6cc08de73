//! Exponentials and maxima over f32 rows, 16 lanes at a time where the CPU has AVX-512: the
//! softmax of CPU attention and the sampler's log-normaliser over a vocabulary row.
//!
//! `exp16` is its own function, not the C library's `expf`: `e^x = 2^n · e^r` with
//! `n = round(x / ln 2)`, `r = x - n·ln 2` (Cody–Waite, in two parts) and `e^r` from its Taylor
//! polynomial of degree 7 (truncation below 10⁻⁸ relative for `|r| <= ln 2 / 2`), within about
//! one unit in the last place of the exact value. `-inf` gives 0, `+inf` gives `+inf`, NaN stays
//! NaN. Each call does the same operations whatever else is in its row, so a result depends only
//! on its own input.

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// Whether the CPU has what this module's AVX-512 code is compiled with.
    pub(crate) fn available() -> bool {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma"))
    }

    /// `e^x` in every lane (see the module's documentation).
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) fn exp16(x: __m512) -> __m512 {
        const LN2_HI: f32 = 0.693_359_4; // 0.693359375: 9 significant bits, so n·LN2_HI is exact
        const LN2_LO: f32 = -2.121_944_4e-4;
        // 1/k! for k = 7 down to 0.
        const C: [f32; 8] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];
        // Clamped where e^x is already 0 or inf in f32 (x as the second operand, so NaN passes).
        let x = _mm512_max_ps(_mm512_set1_ps(-104.0), _mm512_min_ps(_mm512_set1_ps(88.8), x));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(C[0]);
        for &c in &C[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        // p · 2^n, with overflow to inf and gradual underflow to 0 done by the instruction.
        _mm512_scalef_ps(p, n)
    }

    /// Low mask of the `len - i` lanes left (all 16 when at least 16 are).
    #[inline]
    pub(crate) fn tail(len: usize, i: usize) -> __mmask16 {
        let left = len - i;
        if left >= 16 {
            0xFFFF
        } else {
            (1u16 << left) - 1
        }
    }

    /// The largest value of `xs` (NaN ignored; `-inf` for an empty row or one of NaN and `-inf`).
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) fn max(xs: &[f32]) -> f32 {
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut m = ninf;
        for i in (0..xs.len()).step_by(16) {
            // SAFETY: the mask keeps the load inside xs; masked-off lanes read as -inf.
            let x = unsafe { _mm512_mask_loadu_ps(ninf, tail(xs.len(), i), xs.as_ptr().add(i)) };
            // maxps returns its second operand when either is NaN: m, so NaN is skipped.
            m = _mm512_max_ps(x, m);
        }
        _mm512_reduce_max_ps(m)
    }

    /// `Σ e^(x - shift)` over the row, each term rounded to f32 and summed in f64.
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) fn sum_exp_f64(xs: &[f32], shift: f32) -> f64 {
        let (mut lo, mut hi) = (_mm512_setzero_pd(), _mm512_setzero_pd());
        let s = _mm512_set1_ps(shift);
        for i in (0..xs.len()).step_by(16) {
            let m = tail(xs.len(), i);
            // SAFETY: the mask keeps the load inside xs; masked-off lanes give e^-inf = 0.
            let x = unsafe { _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), m, xs.as_ptr().add(i)) };
            let e = exp16(_mm512_sub_ps(x, s));
            lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            let upper = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e)));
            hi = _mm512_add_pd(hi, _mm512_cvtps_pd(upper));
        }
        _mm512_reduce_add_pd(_mm512_add_pd(lo, hi))
    }
}

/// `Σ e^(x - shift)` over a row, in f64: 16 lanes at a time with `x86::exp16` where the CPU has
/// AVX-512, else `f32::exp` term by term (the two differ in the last bits).
pub fn sum_exp_f64(xs: &[f32], shift: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU has AVX-512F and FMA, checked just above.
        return unsafe { x86::sum_exp_f64(xs, shift) };
    }
    xs.iter().map(|&l| f64::from((l - shift).exp())).sum()
}

/// The largest value of a row, NaN ignored (`-inf` when there is none).
pub fn max(xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU has AVX-512F and FMA, checked just above.
        return unsafe { x86::max(xs) };
    }
    xs.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp16_is_within_an_ulp_or_two_of_the_exact_value_and_handles_the_edges() {
        #[cfg(target_arch = "x86_64")]
        if x86::available() {
            use std::arch::x86_64::*;
            let mut xs: Vec<f32> = (-110_000..=90_000).map(|i| i as f32 * 1e-3).collect();
            xs.extend([0.0, -0.0, 1e-30, -1e-30, f32::MIN_POSITIVE, 88.72, 88.73, -87.3, -103.0]);
            let mut worst = 0f64;
            for chunk in xs.chunks(16) {
                let mut buf = [0f32; 16];
                buf[..chunk.len()].copy_from_slice(chunk);
                let mut out = [0f32; 16];
                // SAFETY: AVX-512F and FMA were detected above; 16-float buffers.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr(), x86::exp16(_mm512_loadu_ps(buf.as_ptr()))) };
                for (&x, &y) in chunk.iter().zip(&out) {
                    let exact = (x as f64).exp();
                    if exact > f32::MAX as f64 {
                        assert_eq!(y, f32::INFINITY, "e^{x}");
                    } else if exact < f32::MIN_POSITIVE as f64 {
                        // Gradual underflow: within one step of the smallest subnormal.
                        assert!((y as f64 - exact).abs() <= 1.5e-45, "e^{x} = {y}, exactly {exact}");
                    } else {
                        let ulp = (exact as f32).to_bits().abs_diff(y.to_bits());
                        worst = worst.max(ulp as f64);
                        assert!(ulp <= 2, "e^{x} = {y}, exactly {exact}: {ulp} ulps");
                    }
                }
            }
            let special = [f32::NEG_INFINITY, f32::INFINITY, f32::NAN, -1e30, 1e30, 0.0, 0.0, 0.0];
            let mut buf = [0f32; 16];
            buf[..8].copy_from_slice(&special);
            let mut out = [0f32; 16];
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), x86::exp16(_mm512_loadu_ps(buf.as_ptr()))) };
            assert_eq!(out[0], 0.0, "e^-inf");
            assert_eq!(out[1], f32::INFINITY, "e^inf");
            assert!(out[2].is_nan(), "e^NaN");
            assert_eq!((out[3], out[4], out[5]), (0.0, f32::INFINITY, 1.0));
            println!("exp16: worst error {worst} ulp");
            return;
        }
        println!("no AVX-512 on this CPU: exp16 never runs here");
    }

    #[test]
    fn row_max_and_exponential_sum_match_their_definitions() {
        let row: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1013) as f32 * 0.01 - 5.0).collect();
        for len in [0, 1, 15, 16, 17, 1000] {
            let xs = &row[..len];
            let want = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(xs), want, "max of {len}");
            let sum: f64 = xs.iter().map(|&x| ((x - 2.0) as f64).exp()).sum();
            let got = sum_exp_f64(xs, 2.0);
            assert!((got - sum).abs() <= 1e-6 * sum.max(1e-30), "Σ exp over {len}: {got} vs {sum}");
        }
        let mut odd = row[..40].to_vec();
        odd[3] = f32::NAN;
        odd[30] = f32::NEG_INFINITY;
        let want = odd.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max(&odd), want, "NaN is ignored");
        assert_eq!(max(&[f32::NAN, f32::NEG_INFINITY]), f32::NEG_INFINITY);
        assert_eq!(sum_exp_f64(&[f32::NEG_INFINITY; 20], 0.0), 0.0);
    }
}
