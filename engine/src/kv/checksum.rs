//! Block checksums: CRC-32 (IEEE 802.3, reflected, as `crc32fast` computes it), and a copy that
//! computes it on the way ([`copy_summed`]) so a transfer sender reads each byte once.
//!
//! Every function here continues a running state the way [`crc32fast::Hasher`] does: the state
//! of no bytes is 0, and the state after some bytes is the CRC-32 of those bytes, so pieces can be
//! summed one after another (a block is summed as every layer's K piece then V piece).
//!
//! On x86-64 CPUs with AVX-512 and VPCLMULQDQ, [`copy_summed`] loads 256 bytes at a time, stores
//! them, and folds them into four 512-bit accumulators (sixteen independent 128-bit lanes) with
//! carry-less multiplications; at the end of the piece the lanes are folded into one 128-bit
//! remainder whose CRC register equals the piece's. The copy then costs about what a plain copy
//! costs, where a copy followed by `crc32fast` over the copied bytes costs both. Elsewhere it is
//! a copy followed by `crc32fast`.
//!
//! Folding: a 128-bit lane holds 16 message bytes with bit `t` (little-endian) standing for the
//! coefficient of `x^(127 - t)`. Moving it forward by `d` bits multiplies it by `x^d`; modulo the
//! CRC polynomial `P` that is the same as multiplying its low 64 bits by `x^(d+31) mod P` and its
//! high 64 bits by `x^(d-33) mod P`, each bit-reversed into 32 bits (the 33-bit offset puts the
//! carry-less product, bit `k` standing for `x^(94 - k)`, back at bit `k` of the lane). Each
//! constant is computed from `P` at compile time.

/// Copies `src` into `dst` (of the same length) and returns `state` continued over the copied
/// bytes.
///
/// # Panics
/// When the lengths differ (callers check them first).
pub fn copy_summed(state: u32, src: &[u8], dst: &mut [u8]) -> u32 {
    assert_eq!(src.len(), dst.len(), "copy_summed: source and destination lengths differ");
    #[cfg(target_arch = "x86_64")]
    if x86::available() && src.len() >= x86::STRIDE {
        // SAFETY: `available` checked the CPU features the function is compiled with, the
        // lengths are equal (asserted above) and at least one step long (checked just above).
        return unsafe { x86::copy_summed(state, src, dst) };
    }
    dst.copy_from_slice(src);
    update(state, dst)
}

/// `state` continued over one layer's piece pair of a block: its K bytes, then its V bytes (the
/// order a block is summed in).
pub fn update_kv(state: u32, k: &[u8], v: &[u8]) -> u32 {
    update(update(state, k), v)
}

/// `state` continued over `bytes`.
pub fn update(state: u32, bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new_with_initial(state);
    h.update(bytes);
    h.finalize()
}

/// The CRC polynomial `x^32 + x^26 + x^23 + ... + 1`, bit `d` the coefficient of `x^d`.
#[cfg(any(target_arch = "x86_64", test))]
const POLY: u64 = 0x1_04C1_1DB7;

/// `x^n mod P`, bit `d` the coefficient of `x^d`.
#[cfg(any(target_arch = "x86_64", test))]
const fn x_pow_mod(n: u32) -> u32 {
    let mut r: u64 = 1;
    let mut i = 0;
    while i < n {
        r <<= 1;
        if r & (1 << 32) != 0 {
            r ^= POLY;
        }
        i += 1;
    }
    r as u32
}

/// The pair of multipliers that moves a 128-bit lane forward by `d` bits (`d >= 33`): for its
/// low and its high 64 bits (see the module documentation).
#[cfg(any(target_arch = "x86_64", test))]
const fn fold_constants(d: u32) -> (u64, u64) {
    (x_pow_mod(d + 31).reverse_bits() as u64, x_pow_mod(d - 33).reverse_bits() as u64)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::fold_constants;
    use std::arch::x86_64::*;

    /// Bytes per step: four 64-byte registers.
    pub(super) const STRIDE: usize = 256;

    // Fold pairs by distance in bits, computed at compile time.
    const BY_STRIDE: (u64, u64) = fold_constants(8 * STRIDE as u32);
    const BY_1536: (u64, u64) = fold_constants(1536);
    const BY_1024: (u64, u64) = fold_constants(1024);
    const BY_512: (u64, u64) = fold_constants(512);
    const BY_384: (u64, u64) = fold_constants(384);
    const BY_256: (u64, u64) = fold_constants(256);
    const BY_128: (u64, u64) = fold_constants(128);

    pub(super) fn available() -> bool {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("vpclmulqdq")
                && is_x86_feature_detected!("pclmulqdq")
        })
    }

    /// A fold pair in every 128-bit lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn lanes(k: (u64, u64)) -> __m512i {
        let (lo, hi) = (k.0 as i64, k.1 as i64);
        _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo)
    }

    /// Each lane of `acc` moved forward by the distance of `k`, plus `next`.
    #[inline]
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn fold(acc: __m512i, k: __m512i, next: __m512i) -> __m512i {
        let lo = _mm512_clmulepi64_epi128::<0x00>(acc, k);
        let hi = _mm512_clmulepi64_epi128::<0x11>(acc, k);
        // 0x96: the three-way exclusive or.
        _mm512_ternarylogic_epi64::<0x96>(lo, hi, next)
    }

    /// The same for one 128-bit lane.
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn fold_lane(acc: __m128i, k: (u64, u64), next: __m128i) -> __m128i {
        let k = _mm_set_epi64x(k.1 as i64, k.0 as i64);
        let lo = _mm_clmulepi64_si128::<0x00>(acc, k);
        let hi = _mm_clmulepi64_si128::<0x11>(acc, k);
        _mm_xor_si128(_mm_xor_si128(lo, hi), next)
    }

    /// [`super::copy_summed`] for pieces of at least one step.
    ///
    /// # Safety
    /// The CPU has the features enabled here ([`available`]). (The lengths are checked: they
    /// must be equal and at least [`STRIDE`], since the first step is read and written whole.)
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse2")]
    pub(super) unsafe fn copy_summed(state: u32, src: &[u8], dst: &mut [u8]) -> u32 {
        assert!(
            src.len() == dst.len() && src.len() >= STRIDE,
            "copy_summed: {} and {} bytes",
            src.len(),
            dst.len()
        );
        let bulk = src.len() / STRIDE * STRIDE;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        // SAFETY (both): `o + 64 <= bulk <= len` for every offset used below.
        let load = |o: usize| unsafe { _mm512_loadu_si512(s.add(o).cast()) };
        let store = |o: usize, v: __m512i| unsafe { _mm512_storeu_si512(d.add(o).cast(), v) };
        let (mut a0, mut a1, mut a2, mut a3) = (load(0), load(64), load(128), load(192));
        store(0, a0);
        store(64, a1);
        store(128, a2);
        store(192, a3);
        // The running CRC register enters as an exclusive or over the first 32 message bits.
        a0 = _mm512_xor_si512(a0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(!state as i32)));
        let k = lanes(BY_STRIDE);
        let mut o = STRIDE;
        while o < bulk {
            let (b0, b1, b2, b3) = (load(o), load(o + 64), load(o + 128), load(o + 192));
            store(o, b0);
            store(o + 64, b1);
            store(o + 128, b2);
            store(o + 192, b3);
            a0 = fold(a0, k, b0);
            a1 = fold(a1, k, b1);
            a2 = fold(a2, k, b2);
            a3 = fold(a3, k, b3);
            o += STRIDE;
        }
        // The four registers onto the last one, then its four lanes onto the last lane.
        let x = fold(a0, lanes(BY_1536), a3);
        let x = fold(a1, lanes(BY_1024), x);
        let x = fold(a2, lanes(BY_512), x);
        let r = fold_lane(_mm512_extracti32x4_epi32::<0>(x), BY_384, _mm512_extracti32x4_epi32::<3>(x));
        let r = fold_lane(_mm512_extracti32x4_epi32::<1>(x), BY_256, r);
        let r = fold_lane(_mm512_extracti32x4_epi32::<2>(x), BY_128, r);
        // `r` is congruent to the bulk modulo P, so its 16 bytes leave the CRC register where
        // the bulk leaves it, from a register of 0 (the state !0).
        let mut rest = [0u8; 16];
        // SAFETY: 16 writable bytes.
        unsafe { _mm_storeu_si128(rest.as_mut_ptr().cast(), r) };
        let state = super::update(!0, &rest);
        dst[bulk..].copy_from_slice(&src[bulk..]);
        super::update(state, &dst[bulk..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    /// Carry-less product of two 64-bit values.
    fn clmul(a: u64, b: u64) -> u128 {
        (0..64).filter(|i| b >> i & 1 == 1).fold(0, |acc, i| acc ^ ((a as u128) << i))
    }

    #[test]
    fn a_lane_folded_forward_sums_like_the_lane_followed_by_zeros() {
        // x^32 mod P is P without its top term; x^31 is itself.
        assert_eq!(x_pow_mod(32), 0x04C1_1DB7);
        assert_eq!(x_pow_mod(31), 1 << 31);
        // Folding 16 bytes forward by d bits gives 16 bytes congruent to them followed by d/8
        // zero bytes, so both leave the CRC register (from 0, the state !0) in the same place.
        // Every distance the kernel folds by, computed here without SIMD.
        for (seed, d) in [(1, 128u32), (2, 256), (3, 384), (4, 512), (5, 1024), (6, 1536), (7, 2048)] {
            let lane = bytes(16, seed);
            let (lo, hi) = (
                u64::from_le_bytes(lane[..8].try_into().unwrap()),
                u64::from_le_bytes(lane[8..].try_into().unwrap()),
            );
            let (klo, khi) = fold_constants(d);
            let folded = (clmul(lo, klo) ^ clmul(hi, khi)).to_le_bytes();
            let mut shifted = lane.clone();
            shifted.resize(16 + d as usize / 8, 0);
            assert_eq!(update(!0, &folded), update(!0, &shifted), "distance {d}");
        }
    }

    #[test]
    fn the_wide_path_runs_where_the_cpu_has_it() {
        #[cfg(target_arch = "x86_64")]
        if x86::available() {
            for len in [256, 257, 511, 512, 6144, 6144 + 100] {
                let src = bytes(len, 9);
                let mut dst = vec![0u8; len];
                // SAFETY: the features are there; the lengths are equal and at least a step.
                let got = unsafe { x86::copy_summed(0x5555_aaaa, &src, &mut dst) };
                assert_eq!(got, update(0x5555_aaaa, &src), "length {len}");
                assert_eq!(dst, src);
            }
            return;
        }
        eprintln!(
            "checksum: this CPU has no AVX-512 with VPCLMULQDQ; only the plain copy-then-sum path was tested"
        );
    }

    #[test]
    fn copy_summed_copies_and_sums_like_crc32fast() {
        // Every length around the 256-byte step and its remainders, from several states.
        for len in (0..1100).chain([6144, 6144 + 255, 12288 + 17, 65536 + 3]) {
            let src = bytes(len, len as u32 + 7);
            for state in [0u32, 0xFFFF_FFFF, 0x1234_5678, crc32fast::hash(b"earlier pieces")] {
                let mut dst = vec![0xAAu8; len];
                let got = copy_summed(state, &src, &mut dst);
                let mut h = crc32fast::Hasher::new_with_initial(state);
                h.update(&src);
                assert_eq!(got, h.finalize(), "length {len}, state {state:#x}");
                assert_eq!(dst, src, "length {len}: copy differs");
            }
        }
    }

    #[test]
    fn pieces_summed_one_after_another_equal_the_whole() {
        let src = bytes(30 * 2 * 6144, 3);
        let mut dst = vec![0u8; src.len()];
        let mut state = 0;
        for (s, d) in src.chunks(6144).zip(dst.chunks_mut(6144)) {
            state = copy_summed(state, s, d);
        }
        assert_eq!(state, crc32fast::hash(&src));
        assert_eq!(dst, src);
    }

    #[test]
    fn a_changed_byte_changes_the_sum() {
        let src = bytes(4096, 11);
        let mut dst = vec![0u8; 4096];
        let base = copy_summed(0, &src, &mut dst);
        for at in [0, 1, 255, 256, 1000, 4095] {
            let mut other = src.clone();
            other[at] ^= 0x10;
            assert_ne!(copy_summed(0, &other, &mut dst), base, "flip at {at}");
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn lengths_must_match() {
        copy_summed(0, &[0u8; 300], &mut [0u8; 299]);
    }
}
