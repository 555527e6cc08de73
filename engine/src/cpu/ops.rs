//! Element-wise and attention kernels of the CPU backend (the matrix products live in
//! [`super::matmul`]). Everything computes in f32, like the reference implementation.

use crate::config::RopeScaling;

/// Dot product with several accumulators so the compiler can vectorise it.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y += a * x`.
#[inline(always)]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// RMSNorm of each `weight.len()`-sized row of `x` into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ss: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let inv = 1.0 / ((ss / n as f64) as f32 + eps).sqrt();
        for ((oi, &xi), &wi) in o.iter_mut().zip(row).zip(weight) {
            *oi = wi * (xi * inv);
        }
    }
}

/// In-place RMSNorm of every `weight.len()`-sized row (Qwen3's per-head q/k norm).
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = weight.len();
    for row in x.chunks_exact_mut(n) {
        let ss: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let inv = 1.0 / ((ss / n as f64) as f32 + eps).sqrt();
        for (xi, &wi) in row.iter_mut().zip(weight) {
            *xi = wi * (*xi * inv);
        }
    }
}

/// `gate = silu(gate) * up`, SwiGLU's activation: `g / (1 + e^-g) · u`, 16 at a time with
/// [`crate::vmath`]'s exponential where the CPU has AVX-512 (the same operations otherwise, with
/// `f32::exp`).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: lengths");
    #[cfg(target_arch = "x86_64")]
    if crate::vmath::x86::available() {
        // SAFETY: the CPU has AVX-512F and FMA, checked just above.
        unsafe { x86::silu_mul(gate, up) };
        return;
    }
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// √(2/π) as f32, GELU's tanh approximation's factor.
const GELU_K: f32 = 0.797_884_6;

/// `out = gelu_tanh(gate) * up`, GeGLU's activation with PyTorch's tanh approximation
/// (`gelu_pytorch_tanh`): `0.5·x·(1 + tanh(y))` with `y = √(2/π)·(x + 0.044715·x³)`. Where the CPU
/// has AVX-512 it is computed 16 at a time as the equal `x / (1 + e^(−2y))` with
/// [`crate::vmath`]'s exponential (the C library's `tanhf` one element at a time was a seventh of
/// Gemma 3's prompt time); otherwise in f32 in PyTorch's order with `f32::tanh`. The two agree
/// to a few units in the last place.
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && out.len() == up.len(), "gelu_tanh_mul: lengths");
    #[cfg(target_arch = "x86_64")]
    if crate::vmath::x86::available() {
        // SAFETY: the CPU has AVX-512F and FMA, checked just above.
        unsafe { x86::gelu_tanh_mul(gate, up, out) };
        return;
    }
    const K: f32 = GELU_K;
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let inner = K * (g + 0.044715 * g * g * g);
        *o = 0.5 * g * (1.0 + inner.tanh()) * u;
    }
}

/// One token's routing in a mixture of experts (the rule of [`crate::models::Ops::moe`]), from
/// its router logits: the softmax in f32 (`exp(l - max)` over their sum, summed in expert order),
/// the `top_k` largest probabilities (ties to the lower expert index, NaN below everything),
/// divided by their sum (added in rank order) when `renormalize`. Leaves `(expert, weight)` in
/// `chosen`, sorted by expert index; `probs` is scratch. The CUDA kernel `moe_route` computes the
/// same, operation for operation.
pub fn moe_route(
    logits: &[f32],
    top_k: usize,
    renormalize: bool,
    probs: &mut Vec<f32>,
    chosen: &mut Vec<(usize, f32)>,
) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    probs.clear();
    probs.extend(logits.iter().map(|&l| (l - max).exp()));
    let sum = probs.iter().fold(0f32, |s, &p| s + p);
    probs.iter_mut().for_each(|p| *p /= sum);
    chosen.clear();
    for _ in 0..top_k.min(logits.len()) {
        let mut best: Option<(usize, f32)> = None;
        for (e, &p) in probs.iter().enumerate() {
            let p = if p.is_nan() { f32::NEG_INFINITY } else { p };
            if chosen.iter().any(|&(c, _)| c == e) {
                continue;
            }
            if best.is_none_or(|(_, b)| p > b) {
                best = Some((e, p));
            }
        }
        let (e, _) = best.expect("fewer chosen experts than experts");
        chosen.push((e, probs[e]));
    }
    if renormalize {
        let total = chosen.iter().fold(0f32, |s, &(_, w)| s + w);
        chosen.iter_mut().for_each(|(_, w)| *w /= total);
    }
    chosen.sort_unstable_by_key(|&(e, _)| e);
}

/// `x = cap · tanh(x / cap)` (Gemma 2's soft-capping of attention scores and final logits).
pub fn softcap(x: &mut [f32], cap: f32) {
    x.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
}

/// How an attention score is made from `q · k`: scaled, then soft-capped where configured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreRule {
    pub scale: f32,
    pub softcap: Option<f32>,
}

impl ScoreRule {
    /// Scaling only.
    pub fn scaled(scale: f32) -> ScoreRule {
        ScoreRule { scale, softcap: None }
    }

    #[inline(always)]
    pub fn apply(self, dot: f32) -> f32 {
        let s = dot * self.scale;
        match self.softcap {
            Some(cap) => cap * (s / cap).tanh(),
            None => s,
        }
    }
}

/// Rotary embedding tables (`cos`, `sin`: `[positions × head_dim/2]`). Each backend instance
/// builds and owns its own; nothing is cached process-wide.
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Frequencies follow the reference implementation's f32 arithmetic, so angles round the same.
    ///
    /// LongRoPE picks its factors per position: the short ones below the original context, the
    /// long ones from there on (transformers picks one set per forward pass, by its last
    /// position; docs/engine.md says where the two differ). Its attention factor multiplies cos
    /// and sin at every position.
    pub fn new(head_dim: usize, theta: f32, scaling: Option<&RopeScaling>, positions: usize) -> RopeTable {
        let half = head_dim / 2;
        let base = |i: usize| theta.powf((2 * i) as f32 / head_dim as f32);
        let mut inv_freq: Vec<f32> = (0..half).map(|i| 1.0 / base(i)).collect();
        // LongRoPE: the frequencies from a position on, and the factor on cos and sin.
        let mut long: Option<(usize, Vec<f32>)> = None;
        let mut mscale = 1.0f32;
        match scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => inv_freq.iter_mut().for_each(|f| *f /= factor),
            Some(RopeScaling::Factors(div)) => inv_freq.iter_mut().zip(div).for_each(|(f, d)| *f /= d),
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                attention_factor,
            }) => {
                // transformers: 1 / (factor · base^(2i/d)), in f32.
                let divided = |f: &[f32]| (0..half).map(|i| 1.0 / (f[i] * base(i))).collect::<Vec<f32>>();
                inv_freq = divided(short_factor);
                long = Some((*original_max_position_embeddings, divided(long_factor)));
                mscale = *attention_factor;
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let low_wavelen = original_max_position_embeddings / low_freq_factor;
                let high_wavelen = original_max_position_embeddings / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (original_max_position_embeddings / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            let freqs = match &long {
                Some((from, long)) if p >= *from => long,
                _ => &inv_freq,
            };
            for &f in freqs {
                let angle = p as f32 * f;
                cos.push((angle as f64).cos() as f32 * mscale);
                sin.push((angle as f64).sin() as f32 * mscale);
            }
        }
        RopeTable { half, cos, sin }
    }

    /// `cos(position * frequency)`, `[positions × head_dim/2]` (the GPU backends upload it).
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// `sin(position * frequency)`, `[positions × head_dim/2]`.
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }

    /// Positions covered by the table.
    pub fn positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotates every head (`2 * half` values) of `x` at position `pos`, rotate-half style:
    /// element `j` pairs with element `j + head_dim/2`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let h = self.half;
        let (c, s) = (&self.cos[pos * h..(pos + 1) * h], &self.sin[pos * h..(pos + 1) * h]);
        for head in x.chunks_exact_mut(2 * h) {
            let (a, b) = head.split_at_mut(h);
            for j in 0..h {
                let (x1, x2) = (a[j], b[j]);
                a[j] = x1 * c[j] - x2 * s[j];
                b[j] = x2 * c[j] + x1 * s[j];
            }
        }
    }
}

/// Element-wise kernels with AVX-512, and the 16-key reduction attention's scores use.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use crate::vmath::x86::{exp16, tail};
    use std::arch::x86_64::*;

    /// Whether the CPU has every feature [`attend_avx512`] is compiled with (AVX-512F alone is
    /// not enough: the 16-bit masked loads need BW and VL).
    pub(crate) fn has_avx512() -> bool {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("f16c")
                && is_x86_feature_detected!("fma")
        })
    }

    /// The lane sums of 16 keys at once, key `i` in lane `i`. Each key's 16 lanes are added in
    /// the tree `_mm512_reduce_add_ps` uses for one vector (lane `l` with `l + 8`, then with
    /// `l + 4`, `l + 2`, `l + 1`), so a score is the same bits as when keys were summed one at a
    /// time, and does not depend on which keys share its group.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn sum16(a: &[__m512; 16]) -> __m512 {
        // Quarters (128-bit lanes) of the two operands: imm = a0 | a1 << 2 | b0 << 4 | b1 << 6.
        const HALVES_LO: i32 = 0b01_00_01_00; // a.q0 a.q1 b.q0 b.q1
        const HALVES_HI: i32 = 0b11_10_11_10; // a.q2 a.q3 b.q2 b.q3
        const EVEN_Q: i32 = 0b10_00_10_00; // a.q0 a.q2 b.q0 b.q2
        const ODD_Q: i32 = 0b11_01_11_01; // a.q1 a.q3 b.q1 b.q3

        // l + 8: keys 2k and 2k+1 in the low and high halves of t[k], 8 partial sums each.
        let t: [__m512; 8] = std::array::from_fn(|k| {
            let (x, y) = (a[2 * k], a[2 * k + 1]);
            _mm512_add_ps(_mm512_shuffle_f32x4::<HALVES_LO>(x, y), _mm512_shuffle_f32x4::<HALVES_HI>(x, y))
        });
        // l + 4: keys 4k..4k+4 in the quarters of u[k], 4 partial sums each.
        let u: [__m512; 4] = std::array::from_fn(|k| {
            let (x, y) = (t[2 * k], t[2 * k + 1]);
            _mm512_add_ps(_mm512_shuffle_f32x4::<EVEN_Q>(x, y), _mm512_shuffle_f32x4::<ODD_Q>(x, y))
        });
        // l + 2: within quarter c of v[k], elements (0, 1) belong to key 8k + c and (2, 3) to
        // key 8k + 4 + c.
        let v: [__m512; 2] = std::array::from_fn(|k| {
            let (x, y) = (u[2 * k], u[2 * k + 1]);
            _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(x, y), _mm512_shuffle_ps::<0b11_10_11_10>(x, y))
        });
        // l + 1: quarter c holds keys c, 4 + c, 8 + c, 12 + c.
        let w = _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(v[0], v[1]),
            _mm512_shuffle_ps::<0b11_01_11_01>(v[0], v[1]),
        );
        // Key i sits in lane 4 * (i % 4) + i / 4.
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, w)
    }

    /// [`super::silu_mul`] 16 lanes at a time.
    ///
    /// # Safety
    /// `gate.len() == up.len()`, on a CPU with the features enabled here.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
        let n = gate.len();
        let one = _mm512_set1_ps(1.0);
        for i in (0..n).step_by(16) {
            let m = tail(n, i);
            // SAFETY: the mask keeps every access inside gate and up (both n long).
            unsafe {
                let p = gate.as_mut_ptr().add(i);
                let g = _mm512_maskz_loadu_ps(m, p);
                let u = _mm512_maskz_loadu_ps(m, up.as_ptr().add(i));
                let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
                _mm512_mask_storeu_ps(p, m, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u));
            }
        }
    }

    /// [`super::gelu_tanh_mul`] on AVX-512: `g / (1 + e^(−2y)) · u`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F and FMA; the slices are equally long.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = gate.len();
        assert!(up.len() == n && out.len() == n, "gelu_tanh_mul: lengths");
        let (one, c) = (_mm512_set1_ps(1.0), _mm512_set1_ps(0.044715));
        let k2 = _mm512_set1_ps(-2.0 * super::GELU_K);
        for i in (0..n).step_by(16) {
            let m = tail(n, i);
            // SAFETY: the mask keeps every access inside the three slices (all n long).
            unsafe {
                let g = _mm512_maskz_loadu_ps(m, gate.as_ptr().add(i));
                let u = _mm512_maskz_loadu_ps(m, up.as_ptr().add(i));
                // −2y = −2·√(2/π)·(g + 0.044715·g³)
                let inner = _mm512_fmadd_ps(_mm512_mul_ps(c, g), _mm512_mul_ps(g, g), g);
                let e = exp16(_mm512_mul_ps(k2, inner));
                let v = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u);
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), m, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GeGLU's activation, 16 at a time where the CPU has AVX-512, is within 4e-6 relative (plus
    /// the conditioning of the exponential's f32 argument) of the formula in f64 (PyTorch's f32 order itself loses all precision once `1 + tanh y`
    /// cancels, below x ≈ −5) at every 0.001 over [-12, 12] (where the gate's output is not below
    /// 1e-30), times an `up` of 1 and of −3; a tail shorter than 16 is computed too, and
    /// inf, −inf and NaN come out as PyTorch's formula gives them: inf, NaN and NaN.
    #[test]
    fn gelu_tanh_mul_matches_f64() {
        let xs: Vec<f32> = (-12_000..=12_000).map(|i| i as f32 * 1e-3).collect();
        for up in [1.0f32, -3.0] {
            let ups = vec![up; xs.len()];
            let mut out = vec![0f32; xs.len()];
            gelu_tanh_mul(&xs, &ups, &mut out);
            for (&x, &o) in xs.iter().zip(&out) {
                let xd = x as f64;
                let y = (2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd * xd * xd);
                // 0.5·x·(1 + tanh y) = x / (1 + e^(−2y)), the form f64 computes without
                // cancellation for negative y.
                let exact = xd / (1.0 + (-2.0 * y).exp()) * up as f64;
                if exact.abs() < 1e-30 {
                    assert!(o.abs() < 1e-29, "gelu({x}) = {o}, exact {exact}");
                    continue;
                }
                // Rounding the exponent's argument `2y` to f32 alone moves e^(−2y) by up to
                // |2y| · 2⁻²⁴ relative; the rest (the exponential, the division) a few ulps.
                let rel = ((o as f64 - exact) / exact).abs();
                assert!(
                    rel <= 4e-6 + (2.0 * y).abs() * 2.0 * f32::EPSILON as f64 / 2.0,
                    "gelu({x}) · {up} = {o}, exact {exact} (relative error {rel})"
                );
            }
        }
        let edge = [f32::NEG_INFINITY, f32::INFINITY, f32::NAN, 0.0, -0.0, 3.0, -3.0];
        let mut out = [0f32; 7];
        gelu_tanh_mul(&edge, &[1.0; 7], &mut out);
        assert!(out[0].is_nan(), "−inf · 0 in either form, as PyTorch computes it");
        assert_eq!(out[1], f32::INFINITY);
        assert!(out[2].is_nan());
        assert_eq!((out[3], out[4]), (0.0, 0.0));
        assert!((out[5] - 2.996_363_7).abs() < 1e-5 && (out[6] + 0.003_637_3).abs() < 1e-6, "{out:?}");
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        let t = RopeTable::new(4, 10000.0, None, 8);
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        t.apply(&mut x, 0);
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0], "position 0 is the identity");
        let norm0: f32 = x.iter().map(|v| v * v).sum();
        t.apply(&mut x, 5);
        let norm1: f32 = x.iter().map(|v| v * v).sum();
        assert!((norm0 - norm1).abs() < 1e-4);
        // pair (0, 2) rotates by angle 5 * 1.0
        let (c, s) = (5f32.cos(), 5f32.sin());
        assert!((x[0] - (1.0 * c - 3.0 * s)).abs() < 1e-5);
        assert!((x[2] - (3.0 * c + 1.0 * s)).abs() < 1e-5);
    }

    #[test]
    fn llama3_scaling_divides_low_frequencies_only() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64.0,
        };
        let plain = RopeTable::new(32, 10000.0, None, 2);
        let scaled = RopeTable::new(32, 10000.0, Some(&s), 2);
        // Highest frequency (wavelength 2π < 16) is unchanged; the lowest is divided by 8.
        assert_eq!(plain.sin[16], scaled.sin[16]);
        let (lo_p, lo_s) = (plain.sin[16 + 15].asin(), scaled.sin[16 + 15].asin());
        assert!((lo_p / lo_s - 8.0).abs() < 1e-3, "{lo_p} {lo_s}");
    }

    fn longrope(attention_factor: f32) -> RopeScaling {
        RopeScaling::LongRope {
            short_factor: vec![1.0, 1.5, 2.0, 4.0],
            long_factor: vec![1.0, 3.0, 9.0, 27.0],
            original_max_position_embeddings: 6,
            attention_factor,
        }
    }

    /// Below the original context every frequency is divided by its short factor, from it on by
    /// its long factor; cos and sin are multiplied by the attention factor at every position.
    #[test]
    fn longrope_switches_factors_at_the_original_context() {
        let (hd, af) = (8usize, 1.25f32);
        let s = longrope(af);
        let t = RopeTable::new(hd, 10000.0, Some(&s), 10);
        let RopeScaling::LongRope { short_factor, long_factor, .. } = &s else { unreachable!() };
        for p in 0..10 {
            let factors = if p < 6 { short_factor } else { long_factor };
            for (i, &factor) in factors.iter().enumerate() {
                let inv = 1.0 / (factor * 10000f32.powf((2 * i) as f32 / hd as f32));
                let angle = (p as f32 * inv) as f64;
                let (c, s) = (t.cos[p * 4 + i], t.sin[p * 4 + i]);
                assert!((c as f64 - af as f64 * angle.cos()).abs() < 1e-6, "cos p={p} i={i}");
                assert!((s as f64 - af as f64 * angle.sin()).abs() < 1e-6, "sin p={p} i={i}");
            }
        }
        // Position 0: every angle is 0, so cos is the attention factor itself.
        assert!(t.cos[..4].iter().all(|&c| c == af) && t.sin[..4].iter().all(|&s| s == 0.0));
        // The last short and the first long position differ in the factors they use: the slowest
        // pair (factor 4 → 27) turns by far less at 6 than at 5.
        let angle = |p: usize| t.sin[p * 4 + 3].atan2(t.cos[p * 4 + 3]);
        assert!(angle(6) < angle(5) / 3.0, "{} {}", angle(5), angle(6));
        // A rotation by the table scales vectors by the attention factor.
        let mut x = vec![1.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        t.apply(&mut x, 7);
        let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((norm - af).abs() < 1e-5, "{norm}");
    }

    /// With unit factors and attention factor 1, LongRoPE is plain RoPE, bit for bit.
    #[test]
    fn longrope_with_unit_factors_is_plain_rope() {
        let s = RopeScaling::LongRope {
            short_factor: vec![1.0; 8],
            long_factor: vec![1.0; 8],
            original_max_position_embeddings: 3,
            attention_factor: 1.0,
        };
        let (plain, scaled) = (RopeTable::new(16, 500.0, None, 9), RopeTable::new(16, 500.0, Some(&s), 9));
        assert_eq!(plain.cos, scaled.cos);
        assert_eq!(plain.sin, scaled.sin);
    }

    /// The 16-key reduction adds each key's lanes in the tree `_mm512_reduce_add_ps` uses, so a
    /// key's score is the same bits whichever keys share its block.
    #[test]
    fn sixteen_keys_sum_like_one_key_at_a_time() {
        #[cfg(target_arch = "x86_64")]
        if x86::has_avx512() {
            use std::arch::x86_64::*;
            let mut seed = 11u32;
            let mut rnd = move || {
                seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                // Wide exponents, so that the order of additions changes the rounding.
                ((seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 2f32.powi((seed % 24) as i32 - 12)
            };
            for _ in 0..200 {
                let v: Vec<[f32; 16]> = (0..16).map(|_| std::array::from_fn(|_| rnd())).collect();
                // SAFETY: AVX-512F was detected above; every load reads 16 floats of a [f32; 16].
                let (got, want) = unsafe {
                    let a: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(v[i].as_ptr()));
                    let mut got = [0f32; 16];
                    _mm512_storeu_ps(got.as_mut_ptr(), x86::sum16(&a));
                    (got, a.map(|x| _mm512_reduce_add_ps(x)))
                };
                assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "{v:?}");
            }
            return;
        }
        println!("no AVX-512 on this CPU: the 16-key reduction never runs here, nothing to compare");
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x = [3.0f32, 4.0];
        let mut out = [0f32; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let r = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6 && (out[1] - 8.0 / r).abs() < 1e-6);
    }

    #[test]
    fn moe_route_ties_go_to_the_lower_expert() {
        let (mut probs, mut chosen) = (Vec::new(), Vec::new());
        // Experts 5 and 1 tie for first, 3 and 0 for third.
        let logits = [1.0f32, 3.0, -2.0, 1.0, 0.5, 3.0];
        moe_route(&logits, 1, true, &mut probs, &mut chosen);
        assert_eq!(chosen, [(1, 1.0)], "top 1 of a tie, renormalized to 1");
        moe_route(&logits, 3, false, &mut probs, &mut chosen);
        let ids: Vec<usize> = chosen.iter().map(|&(e, _)| e).collect();
        assert_eq!(ids, [0, 1, 5], "sorted by expert; the tie at the last place kept expert 0");
        let z: f64 = logits.iter().map(|&l| (l as f64 - 3.0).exp()).sum();
        for &(e, w) in &chosen {
            assert!(
                (w as f64 - (logits[e] as f64 - 3.0).exp() / z).abs() < 1e-7,
                "raw softmax weight of {e}"
            );
        }
        moe_route(&logits, 3, true, &mut probs, &mut chosen);
        let total: f32 = chosen.iter().map(|&(_, w)| w).sum();
        assert!((total - 1.0).abs() < 1e-6, "renormalized weights sum to {total}");
        assert!((chosen[1].1 - chosen[2].1).abs() == 0.0, "equal logits, equal weights");
    }
}
