use super::*;

/// Pseudo-random values in [-1, 1) from `seed` (a linear congruential generator).
fn lcg(mut seed: u32) -> impl FnMut() -> f32 {
    move || {
        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        (seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
    }
}

/// `n` random key rows (in [-3, 3)) and value rows of `hd`, as f32 and as f16 and bf16 bits,
/// and the f16 and bf16 values widened back to f32 (as a pass's fresh rows hold them).
struct KvRows {
    kf: Vec<f32>,
    vf: Vec<f32>,
    k16: Vec<u16>,
    v16: Vec<u16>,
    kb: Vec<u16>,
    vb: Vec<u16>,
    k16w: Vec<f32>,
    v16w: Vec<f32>,
    kbw: Vec<f32>,
    vbw: Vec<f32>,
    /// fp8 E4M3 codes, and their values.
    k8: Vec<u8>,
    v8: Vec<u8>,
    k8w: Vec<f32>,
    v8w: Vec<f32>,
}

impl KvRows {
    fn new(n: usize, hd: usize, rnd: &mut impl FnMut() -> f32) -> KvRows {
        let kf: Vec<f32> = (0..n * hd).map(|_| rnd() * 3.0).collect();
        let vf: Vec<f32> = (0..n * hd).map(|_| rnd()).collect();
        let f16 = |x: &[f32]| x.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
        let bf16 = |x: &[f32]| x.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        let (k16, v16, kb, vb): (Vec<u16>, Vec<u16>, Vec<u16>, Vec<u16>) =
            (f16(&kf), f16(&vf), bf16(&kf), bf16(&vf));
        let f16w = |x: &[u16]| x.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect();
        let bf16w = |x: &[u16]| x.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
        let fp8 = |x: &[f32]| x.iter().map(|&v| crate::kv::dtype::fp8_bits(v)).collect::<Vec<u8>>();
        let fp8w = |x: &[u8]| x.iter().map(|&b| crate::kv::dtype::fp8_to_f32(b)).collect();
        let (k8, v8) = (fp8(&kf), fp8(&vf));
        KvRows {
            k8w: fp8w(&k8),
            v8w: fp8w(&v8),
            k8,
            v8,
            k16w: f16w(&k16),
            v16w: f16w(&v16),
            kbw: bf16w(&kb),
            vbw: bf16w(&vb),
            k16,
            v16,
            kb,
            vb,
            kf,
            vf,
        }
    }

    /// Keys and values by position for each stored type; "f16 then f32" holds positions below
    /// `split` in f16 and the rest in f32 (a pass's fresh rows beside the pool's).
    fn cases(&self, hd: usize, split: usize) -> Vec<(&'static str, Pick<'_>, Pick<'_>)> {
        let KvRows { kf, vf, k16, v16, kb, vb, .. } = self;
        vec![
            (
                "f32",
                Box::new(move |i| KvSlice::F32(&kf[i * hd..][..hd])),
                Box::new(move |i| KvSlice::F32(&vf[i * hd..][..hd])),
            ),
            ("f16 then f32", split_pick(k16, false, kf, hd, split), split_pick(v16, false, vf, hd, split)),
            (
                "bf16",
                Box::new(move |i| KvSlice::Bf16(&kb[i * hd..][..hd])),
                Box::new(move |i| KvSlice::Bf16(&vb[i * hd..][..hd])),
            ),
        ]
    }
}

/// Position `i`'s row of `hd`: from the 16-bit `lo` (bf16 where `bf`, else f16) below `split`,
/// from the f32 `hi` from there.
fn split_pick<'a>(lo: &'a [u16], bf: bool, hi: &'a [f32], hd: usize, split: usize) -> Pick<'a> {
    Box::new(move |i| {
        if i < split {
            let x = &lo[i * hd..][..hd];
            if bf {
                KvSlice::Bf16(x)
            } else {
                KvSlice::F16(x)
            }
        } else {
            KvSlice::F32(&hi[i * hd..][..hd])
        }
    })
}

/// As [`split_pick`], with fp8 rows below `split`.
fn split_pick_fp8<'a>(lo: &'a [u8], hi: &'a [f32], hd: usize, split: usize) -> Pick<'a> {
    Box::new(
        move |i| {
            if i < split {
                KvSlice::Fp8(&lo[i * hd..][..hd])
            } else {
                KvSlice::F32(&hi[i * hd..][..hd])
            }
        },
    )
}

type Pick<'a> = Box<dyn Fn(usize) -> KvSlice<'a> + 'a>;

/// Softmax attention of one row in f64, over the f32 values the rows hold.
fn reference(q: &[f32], span: Range<usize>, k: &Pick<'_>, v: &Pick<'_>, rule: ScoreRule) -> Vec<f64> {
    let hd = q.len();
    let scores: Vec<f64> = span
        .clone()
        .map(|p| {
            let d: f64 = q.iter().zip(k(p).to_f32_vec()).map(|(&a, b)| a as f64 * b as f64).sum();
            let s = d * rule.scale as f64;
            match rule.softcap {
                Some(c) => c as f64 * (s / c as f64).tanh(),
                None => s,
            }
        })
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let total: f64 = w.iter().sum();
    let mut out = vec![0f64; hd];
    for (p, wi) in span.zip(&w) {
        for (o, x) in out.iter_mut().zip(v(p).to_f32_vec()) {
            *o += wi / total * x as f64;
        }
    }
    out
}

fn causal(start: usize, rows: usize) -> Vec<Range<usize>> {
    (0..rows).map(|r| 0..start + r + 1).collect()
}

fn windowed(start: usize, rows: usize, w: usize) -> Vec<Range<usize>> {
    (0..rows).map(|r| (start + r + 1).saturating_sub(w)..start + r + 1).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Span layouts crossing tiles and segments, with lengths that are not multiples of either:
/// causal rows of a chunk, sliding windows, a decode row deep in its context, disjoint spans.
fn layouts() -> Vec<Vec<Range<usize>>> {
    vec![
        causal(0, 8),
        causal(37, 5),
        causal(250, 12),
        windowed(40, 8, 7),
        windowed(3, 4, 20),
        windowed(530, 6, 300),
        vec![0..600],
        vec![3..9, 30..47, 0..1, 255..257],
    ]
}

/// The tiled kernels against softmax attention in f64 on the same values: head sizes 8 to 256
/// (some not multiples of 16), every stored type, windows, soft-capping, spans of 1 to 600
/// positions. Bound: 2e-5 absolute plus 2e-5 relative (values lie in [-1, 1)).
#[test]
fn tiled_attention_matches_exact_softmax() {
    let mut rnd = lcg(3);
    for hd in [8, 40, 64, 80, 128, 256] {
        let kv = KvRows::new(610, hd, &mut rnd);
        for spans in layouts() {
            let rows = spans.len();
            let qs: Vec<f32> = (0..rows * hd).map(|_| rnd()).collect();
            for rule in [ScoreRule::scaled(0.125), ScoreRule { scale: 0.3, softcap: Some(5.0) }] {
                for (name, k, v) in &kv.cases(hd, 270) {
                    for portable in [false, true] {
                        let mut out = vec![0f32; rows * hd];
                        let mut scratch = AttendScratch::default();
                        if portable {
                            let (lo, hi) = (
                                spans.iter().map(|s| s.start).min().unwrap(),
                                spans.iter().map(|s| s.end).max().unwrap(),
                            );
                            let mut run = vec![Partial::EMPTY; rows];
                            let mut acc = vec![0f32; rows * hd];
                            let mut emit = |r: usize, _: usize, p: Partial, a: &[f32]| {
                                merge(&mut run[r], &mut acc[r * hd..][..hd], p, a)
                            };
                            tiles::<false>(
                                &qs,
                                &spans,
                                lo / SEGMENT..hi.div_ceil(SEGMENT),
                                k,
                                v,
                                rule,
                                &mut scratch.kernels.tile,
                                &mut emit,
                            );
                            for r in 0..rows {
                                finish(run[r], &acc[r * hd..][..hd], &mut out[r * hd..][..hd]);
                            }
                        } else {
                            attend_rows(&qs, &spans, k, v, rule, &mut scratch, &mut out);
                        }
                        for (r, span) in spans.iter().enumerate() {
                            let want = reference(&qs[r * hd..][..hd], span.clone(), k, v, rule);
                            for (j, (&x, &y)) in out[r * hd..][..hd].iter().zip(&want).enumerate() {
                                assert!(
                                    (x as f64 - y).abs() <= 2e-5 * (1.0 + y.abs()),
                                    "{name} hd={hd} portable={portable} spans={spans:?} row {r} elem {j}: {x} vs {y}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Rows that share a call share reads, never arithmetic: each row's result is the bits it gets
/// alone. This is what makes a token's attention independent of how its prompt was cut into
/// chunks and of which tokens share its pass.
#[test]
fn rows_attended_together_equal_rows_attended_alone() {
    let mut rnd = lcg(5);
    for hd in [8, 40, 64, 80] {
        let kv = KvRows::new(610, hd, &mut rnd);
        for spans in layouts() {
            let rows = spans.len();
            let qs: Vec<f32> = (0..rows * hd).map(|_| rnd()).collect();
            for rule in [ScoreRule::scaled(0.125), ScoreRule { scale: 0.3, softcap: Some(5.0) }] {
                for (name, k, v) in &kv.cases(hd, 20) {
                    let mut together = vec![0f32; rows * hd];
                    let mut scratch = AttendScratch::default();
                    attend_rows(&qs, &spans, k, v, rule, &mut scratch, &mut together);
                    for (r, span) in spans.iter().enumerate() {
                        let mut alone = vec![0f32; hd];
                        let one = std::slice::from_ref(span);
                        attend_rows(&qs[r * hd..][..hd], one, k, v, rule, &mut scratch, &mut alone);
                        assert_eq!(
                            bits(&together[r * hd..][..hd]),
                            bits(&alone),
                            "{name} hd={hd} spans={spans:?} row {r}"
                        );
                    }
                }
            }
        }
    }
}

/// Segments computed apart (split decode: any grouping of segments, in any order of completion)
/// and merged in segment order give [`attend_rows`]'s result bit for bit.
#[test]
fn segments_computed_apart_merge_to_the_same_bits() {
    let mut rnd = lcg(9);
    let hd = 64;
    let kv = KvRows::new(1100, hd, &mut rnd);
    let spans = vec![0..1030, 0..1031, 700..1031, 5..6];
    let rows = spans.len();
    let qs: Vec<f32> = (0..rows * hd).map(|_| rnd()).collect();
    let rule = ScoreRule::scaled(0.125);
    let n_segs = 1031usize.div_ceil(SEGMENT);
    for (name, k, v) in &kv.cases(hd, 900) {
        let mut want = vec![0f32; rows * hd];
        let mut scratch = AttendScratch::default();
        attend_rows(&qs, &spans, k, v, rule, &mut scratch, &mut want);
        for cuts in
            [vec![0, n_segs], vec![0, 1, n_segs], vec![0, 2, 3, n_segs], (0..=n_segs).collect::<Vec<_>>()]
        {
            let mut parts = vec![Partial::EMPTY; n_segs * rows];
            let mut accs = vec![0f32; n_segs * rows * hd];
            // The pieces computed last to first, each into its own place.
            for w in cuts.windows(2).rev() {
                let (a, b) = (w[0], w[1]);
                attend_segments(
                    &qs,
                    &spans,
                    a..b,
                    k,
                    v,
                    rule,
                    &mut scratch,
                    &mut parts[a * rows..b * rows],
                    &mut accs[a * rows * hd..b * rows * hd],
                );
            }
            let mut got = vec![0f32; rows * hd];
            merge_segments(&parts, &accs, rows, &mut got);
            assert_eq!(bits(&got), bits(&want), "{name} cuts {cuts:?}");
        }
    }
}

#[test]
fn attention_over_one_position_returns_its_value() {
    let k = [0.5f32, -1.0];
    let v = [3.0f32, 4.0];
    let mut out = [0f32; 2];
    let mut scratch = AttendScratch::default();
    attend(
        &[1.0, 1.0],
        1,
        |_| KvSlice::F32(&k),
        |_| KvSlice::F32(&v),
        ScoreRule::scaled(1.0),
        &mut scratch,
        &mut out,
    );
    assert_eq!(out, v);
}

#[test]
fn attention_over_narrow_rows_equals_attention_over_their_f32_values() {
    use crate::kv::KvDtype;
    let (n, hd) = (40, 12);
    let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.37).sin()).collect();
    let raw: Vec<f32> = (0..2 * n * hd).map(|i| (i as f32 * 0.91).cos() * 3.0).collect();
    for dtype in [KvDtype::F16, KvDtype::Bf16, KvDtype::Fp8] {
        let mut bytes = vec![0u8; raw.len() * dtype.bytes()];
        dtype.encode(&raw, &mut bytes);
        let stored: Vec<u16> = bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        let pooled = match dtype {
            KvDtype::F16 => KvSlice::F16(&stored),
            KvDtype::Bf16 => KvSlice::Bf16(&stored),
            _ => KvSlice::Fp8(&bytes),
        };
        let wide = pooled.to_f32_vec();
        assert_ne!(wide, raw, "{dtype}: the values were rounded");
        let (mut a, mut b, mut scratch) = (vec![0f32; hd], vec![0f32; hd], AttendScratch::default());
        let (k16, v16) = (|i: usize| pooled.sub(i * hd, hd), |i: usize| pooled.sub((n + i) * hd, hd));
        attend(&q, n, k16, v16, ScoreRule::scaled(0.3), &mut scratch, &mut a);
        let wide = KvSlice::F32(&wide);
        let (k32, v32) = (|i: usize| wide.sub(i * hd, hd), |i: usize| wide.sub((n + i) * hd, hd));
        attend(&q, n, k32, v32, ScoreRule::scaled(0.3), &mut scratch, &mut b);
        assert_eq!(a, b, "{dtype}");
    }
}

/// The kernels to test: the vector one, and the AMX tiles wherever the CPU lists AMX (a CPU that
/// lists it but whose tiles are not usable fails, unless `TANDEM_AMX=off` says not to use them).
fn kernels() -> Vec<Kernel> {
    let mut k = vec![Kernel::Vector];
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::q8::amx::listed() && !std::env::var("TANDEM_AMX").is_ok_and(|v| v == "off") {
        if let Err(why) = amx_usable() {
            panic!("this CPU lists AMX but the attention tiles are not usable: {why}");
        }
        k.push(Kernel::Amx);
    }
    k
}

/// Keys and values by position as the pool and a pass give them to a narrow pool's attention:
/// f16, bf16 or fp8 rows below `split`, f32 rows holding the same rounded values from there.
fn narrow_cases(kv: &KvRows, hd: usize, split: usize) -> Vec<(&'static str, Pick<'_>, Pick<'_>)> {
    let KvRows { k16, v16, kb, vb, k16w, v16w, kbw, vbw, k8, v8, k8w, v8w, .. } = kv;
    vec![
        (
            "f16 then rounded f32",
            split_pick(k16, false, k16w, hd, split),
            split_pick(v16, false, v16w, hd, split),
        ),
        ("bf16 then rounded f32", split_pick(kb, true, kbw, hd, split), split_pick(vb, true, vbw, hd, split)),
        ("fp8 then rounded f32", split_pick_fp8(k8, k8w, hd, split), split_pick_fp8(v8, v8w, hd, split)),
    ]
}

/// Every kernel against softmax attention in f64 on 16-bit KV, head sizes that take the tiles
/// (multiples of 32) and one that does not: the vector kernel within 2e-5, the AMX tiles within
/// 2e-4 (absolute plus relative; values in [-1, 1), keys in [-3, 3)), and the two kernels within
/// 2e-4 of each other.
#[test]
fn every_kernel_matches_exact_softmax_on_narrow_kv() {
    let mut rnd = lcg(11);
    let mut worst = [0f64; 2];
    for hd in [32, 40, 64, 128, 256] {
        let kv = KvRows::new(610, hd, &mut rnd);
        for spans in layouts() {
            let rows = spans.len();
            let qs: Vec<f32> = (0..rows * hd).map(|_| rnd()).collect();
            for rule in
                [ScoreRule::scaled(1.0 / (hd as f32).sqrt()), ScoreRule { scale: 0.3, softcap: Some(5.0) }]
            {
                for (name, k, v) in &narrow_cases(&kv, hd, 270) {
                    let mut outs = Vec::new();
                    for kernel in kernels() {
                        let mut out = vec![0f32; rows * hd];
                        attend_rows(&qs, &spans, k, v, rule, &mut AttendScratch::new(kernel), &mut out);
                        let bound = if kernel == Kernel::Amx { 2e-4 } else { 2e-5 };
                        for (r, span) in spans.iter().enumerate() {
                            let want = reference(&qs[r * hd..][..hd], span.clone(), k, v, rule);
                            for (j, (&x, &y)) in out[r * hd..][..hd].iter().zip(&want).enumerate() {
                                let err = (x as f64 - y).abs() / (1.0 + y.abs());
                                let w = &mut worst[(kernel == Kernel::Amx) as usize];
                                *w = w.max(err);
                                assert!(
                                    err <= bound,
                                    "{kernel:?} {name} hd={hd} spans={spans:?} row {r} elem {j}: {x} vs {y}"
                                );
                            }
                        }
                        outs.push(out);
                    }
                    for o in &outs[1..] {
                        for (j, (&x, &y)) in o.iter().zip(&outs[0]).enumerate() {
                            assert!(
                                (x - y).abs() <= 2e-4 * (1.0 + y.abs()),
                                "{name} hd={hd} elem {j}: {x} vs {y}"
                            );
                        }
                    }
                }
            }
        }
    }
    println!("largest error relative to 1 + |exact|: vector {:.2e}, AMX {:.2e}", worst[0], worst[1]);
}

/// On the tiles, too, a row's bits depend on nothing but its query, its positions and their keys
/// and values: rows together equal rows alone, segments computed apart merge to the same bits,
/// and a pass's fresh rows (f32 holding 16-bit values) give the bits of the stored ones.
#[test]
fn amx_rows_are_independent_of_their_company_and_their_source() {
    if !kernels().contains(&Kernel::Amx) {
        println!("no AMX here: nothing to check");
        return;
    }
    let mut rnd = lcg(13);
    for hd in [32, 64, 256] {
        let kv = KvRows::new(1100, hd, &mut rnd);
        for spans in layouts().into_iter().chain([vec![0..1030, 0..1031, 700..1031, 5..6]]) {
            let rows = spans.len();
            let qs: Vec<f32> = (0..rows * hd).map(|_| rnd()).collect();
            let rule = ScoreRule::scaled(0.125);
            let cases = narrow_cases(&kv, hd, 20);
            let mut scratch = AttendScratch::new(Kernel::Amx);
            let mut stored = vec![0f32; rows * hd];
            let f16_only = (
                |i: usize| KvSlice::F16(&kv.k16[i * hd..][..hd]),
                |i: usize| KvSlice::F16(&kv.v16[i * hd..][..hd]),
            );
            attend_rows(&qs, &spans, f16_only.0, f16_only.1, rule, &mut scratch, &mut stored);
            let (name, k, v) = &cases[0];
            let mut together = vec![0f32; rows * hd];
            attend_rows(&qs, &spans, k, v, rule, &mut scratch, &mut together);
            assert_eq!(
                bits(&together),
                bits(&stored),
                "{name} hd={hd} spans={spans:?}: fresh vs stored rows"
            );
            for (r, span) in spans.iter().enumerate() {
                let mut alone = vec![0f32; hd];
                let one = std::slice::from_ref(span);
                attend_rows(&qs[r * hd..][..hd], one, k, v, rule, &mut scratch, &mut alone);
                assert_eq!(
                    bits(&together[r * hd..][..hd]),
                    bits(&alone),
                    "{name} hd={hd} spans={spans:?} row {r}"
                );
            }
            let hi = spans.iter().map(|s| s.end).max().unwrap();
            let n_segs = hi.div_ceil(SEGMENT);
            let mut parts = vec![Partial::EMPTY; n_segs * rows];
            let mut accs = vec![0f32; n_segs * rows * hd];
            for s in (0..n_segs).rev() {
                let (p, a) =
                    (&mut parts[s * rows..(s + 1) * rows], &mut accs[s * rows * hd..(s + 1) * rows * hd]);
                attend_segments(&qs, &spans, s..s + 1, k, v, rule, &mut scratch, p, a);
            }
            let mut merged = vec![0f32; rows * hd];
            merge_segments(&parts, &accs, rows, &mut merged);
            assert_eq!(bits(&merged), bits(&together), "{name} hd={hd} spans={spans:?}: segments apart");
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn a_float_splits_into_two_bf16_parts_to_16_bits() {
    let mut rnd = lcg(17);
    for _ in 0..10_000 {
        let x = rnd() * 10f32.powi((rnd() * 6.0) as i32);
        let (h, l) = amx::split(x);
        let back = f32::from_bits((h as u32) << 16) as f64 + f32::from_bits((l as u32) << 16) as f64;
        assert!((back - x as f64).abs() <= (x as f64).abs() * 2f64.powi(-15), "{x}: {back}");
        // An f16 value splits exactly.
        let y = half::f16::from_f32(x.clamp(-60000.0, 60000.0)).to_f32();
        let (h, l) = amx::split(y);
        assert_eq!(f32::from_bits((h as u32) << 16) + f32::from_bits((l as u32) << 16), y);
    }
}

/// A key or value that is not finite (an f16 pool stores an infinity where a value overflowed)
/// reaches only the rows that see its position: on every kernel, a row that does not see it
/// gets the bits it gets alone, and a row that does gets a result that is not finite.
#[test]
fn a_non_finite_key_or_value_reaches_only_the_rows_that_see_it() {
    let mut rnd = lcg(19);
    let hd = 64;
    let kv = KvRows::new(80, hd, &mut rnd);
    let inf = half::f16::INFINITY.to_bits();
    let spans = vec![0..20, 0..36, 30..70, 36..40];
    let rows = spans.len();
    let qs: Vec<f32> = (0..rows * hd).map(|_| rnd()).collect();
    for (what, poisoned) in [("key", true), ("value", false)] {
        for bad in [inf, 0x7e00 /* NaN */] {
            let (mut k16, mut v16) = (kv.k16.clone(), kv.v16.clone());
            let target = if poisoned { &mut k16 } else { &mut v16 };
            target[35 * hd + 7] = bad;
            let k = |i: usize| KvSlice::F16(&k16[i * hd..][..hd]);
            let v = |i: usize| KvSlice::F16(&v16[i * hd..][..hd]);
            for kernel in kernels() {
                let mut scratch = AttendScratch::new(kernel);
                let mut together = vec![0f32; rows * hd];
                attend_rows(&qs, &spans, k, v, ScoreRule::scaled(0.125), &mut scratch, &mut together);
                for (r, span) in spans.iter().enumerate() {
                    let mut alone = vec![0f32; hd];
                    let one = std::slice::from_ref(span);
                    attend_rows(
                        &qs[r * hd..][..hd],
                        one,
                        k,
                        v,
                        ScoreRule::scaled(0.125),
                        &mut scratch,
                        &mut alone,
                    );
                    let got = &together[r * hd..][..hd];
                    if span.contains(&35) {
                        assert!(got.iter().any(|x| !x.is_finite()), "{kernel:?} {what} {bad:#x} row {r}");
                    } else {
                        assert!(got.iter().all(|x| x.is_finite()), "{kernel:?} {what} {bad:#x} row {r}");
                        assert_eq!(bits(got), bits(&alone), "{kernel:?} {what} {bad:#x} row {r}");
                    }
                }
            }
        }
    }
}
