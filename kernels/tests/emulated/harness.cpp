// Runs the forward-pass kernels of kernels/cuda/model.cu on the CPU (through shim.h) against plain
// double-precision references written here, and prints one line per check. The kernel source is
// included as MODEL_CU (a copy whose dynamic shared-memory declaration points at the shim's
// buffer; see kernels/tests/emulated.rs). Exit status 1 on the first failed check.
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <type_traits>

#include "shim.h"
#include MODEL_CU

static std::mt19937 rng(1234);

static std::vector<float> randn(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}

static int failures = 0;

static void check(const char* what, double err, double tol) {
    bool ok = err <= tol;
    std::printf("%s %s: max error %.3g (tolerance %.3g)\n", ok ? "ok" : "FAIL", what, err, tol);
    if (!ok) failures++;
}

static void check_eq(const char* what, long long got, long long want) {
    bool ok = got == want;
    std::printf("%s %s: got %lld, want %lld\n", ok ? "ok" : "FAIL", what, got, want);
    if (!ok) failures++;
}

static double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
    double m = 0;
    for (size_t i = 0; i < a.size(); i++) {
        double d = std::fabs((double)a[i] - b[i]);
        if (std::isnan(d)) return INFINITY;  // an unwritten (NaN-poisoned) or broken output
        m = std::max(m, d);
    }
    return m;
}

static float bf16_round(float f) {
    unsigned u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}

// ---- KV pool dtypes ----------------------------------------------------------------------------

// The kernels that read or write a KV pool, by the pool's element type.
template <typename P>
struct Kv;
template <>
struct Kv<float> {
    static constexpr const char* name = "f32";
    static constexpr auto write = kv_write_f32;
    static constexpr auto commit = kv_commit_f32;
    static constexpr auto partial = attn_partial_f32;
    static constexpr auto tiled_f32 = attn_tiled_f32_kvf32;
    static constexpr auto tiled_bf16 = attn_tiled_bf16_kvf32;
    static constexpr auto mma64 = attn_mma_hd64_kvf32;
    static constexpr auto mma128 = attn_mma_hd128_kvf32;
    static constexpr auto mma256 = attn_mma_hd256_kvf32;
};
template <>
struct Kv<bf16_t> {
    static constexpr const char* name = "bf16";
    static constexpr auto write = kv_write_bf16;
    static constexpr auto commit = kv_commit_bf16;
    static constexpr auto partial = attn_partial_bf16;
    static constexpr auto tiled_f32 = attn_tiled_f32_kvbf16;
    static constexpr auto tiled_bf16 = attn_tiled_bf16_kvbf16;
    static constexpr auto mma64 = attn_mma_hd64_kvbf16;
    static constexpr auto mma128 = attn_mma_hd128_kvbf16;
    static constexpr auto mma256 = attn_mma_hd256_kvbf16;
};
template <>
struct Kv<fp8_t> {
    static constexpr const char* name = "fp8";
    static constexpr auto write = kv_write_fp8;
    static constexpr auto commit = kv_commit_fp8;
    static constexpr auto partial = attn_partial_fp8;
    static constexpr auto tiled_f32 = attn_tiled_f32_kvfp8;
    static constexpr auto tiled_bf16 = attn_tiled_bf16_kvfp8;
    static constexpr auto mma64 = attn_mma_hd64_kvfp8;
    static constexpr auto mma128 = attn_mma_hd128_kvfp8;
    static constexpr auto mma256 = attn_mma_hd256_kvfp8;
};

// Values as a pool of P stores them (`raw`, through the kernels' own `st`) and gives them back
// (`wide`, through `ld`); the conversions themselves are checked in test_fp8_conversions.
template <typename P>
struct Stored {
    std::vector<P> raw;
    std::vector<float> wide;
};
template <typename P>
static Stored<P> store(const std::vector<float>& x) {
    Stored<P> s{std::vector<P>(x.size()), std::vector<float>(x.size())};
    for (size_t i = 0; i < x.size(); i++) {
        st(s.raw.data(), i, x[i]);
        s.wide[i] = ld(s.raw.data(), i);
    }
    return s;
}

static std::string with_kv(const char* name, const char* what) { return std::string(what) + " [" + name + " pool]"; }

// An E4M3 code's value from its definition, in double.
static double fp8_reference(unsigned b) {
    int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    double mag = e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
    return (b & 0x80) ? -mag : mag;
}

// The fp8 pool's conversions against the format's definition: every code decodes to its value and
// encodes back to itself; encoding picks the nearest code, ties to the even significand, saturates
// at ±448 (infinities included) and keeps NaN a NaN of its sign. The CPU backend's rule
// (engine/src/kv/dtype.rs) is held to the same definition, so both devices store the same bytes.
static void test_fp8_conversions() {
    long long bad_decode = 0, bad_round_trip = 0;
    std::vector<std::pair<unsigned, double>> finite;
    for (unsigned b = 0; b < 256; b++) {
        fp8_t c = (fp8_t)b;
        float got = ld(&c, 0);
        double want = fp8_reference(b);
        if (std::isnan(want)) {
            bad_decode += !(std::isnan(got) && std::signbit(got) == ((b & 0x80) != 0));
            continue;
        }
        bad_decode += (double)got != want || std::signbit(got) != ((b & 0x80) != 0);
        fp8_t back;
        st(&back, 0, got);
        bad_round_trip += back != b;
        finite.push_back({b, want});
    }
    check_eq("fp8: every code decodes to its value (NaN codes to a NaN of their sign)", bad_decode, 0);
    check_eq("fp8: every finite code encodes back to itself", bad_round_trip, 0);

    auto nearest = [&](float x) -> unsigned {
        if (std::fabs(x) >= 448.0f) return std::signbit(x) ? 0xfe : 0x7e;
        unsigned best = 0;
        double bd = INFINITY;
        for (auto [b, v] : finite) {
            if (((b & 0x80) != 0) != std::signbit(x)) continue;
            double d = std::fabs(v - (double)x);
            if (d < bd || (d == bd && (b & 1) == 0)) best = b, bd = d;
        }
        return best;
    };
    std::vector<float> xs;
    std::mt19937 bits(77);
    while (xs.size() < 200000) {
        float x = __uint_as_float((unsigned)bits());
        if (std::isfinite(x) && std::fabs(x) < 1e4f) xs.push_back(x);
    }
    std::vector<double> pos;
    for (auto [b, v] : finite)
        if (!(b & 0x80)) pos.push_back(v);
    for (size_t i = 0; i + 1 < pos.size(); i++) {
        float mid = (float)((pos[i] + pos[i + 1]) / 2);
        for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
            xs.push_back(x);
            xs.push_back(-x);
        }
    }
    for (float x : {464.0f, 463.9f, 1e30f, -1e30f, 0.0f, -0.0f}) xs.push_back(x);
    long long wrong = 0;
    for (float x : xs) {
        fp8_t c;
        st(&c, 0, x);
        wrong += c != nearest(x);
    }
    check_eq("fp8: encoding picks the nearest code, ties to even, saturating (values tried, wrong)", wrong, 0);
    fp8_t pinf, ninf, qnan, nnan;
    st(&pinf, 0, INFINITY);
    st(&ninf, 0, -INFINITY);
    st(&qnan, 0, NAN);
    st(&nnan, 0, -NAN);
    check_eq("fp8: +inf, -inf, NaN, -NaN encode as 0x7e, 0xfe, 0x7f, 0xff",
             (pinf == 0x7e) + (ninf == 0xfe) + (qnan == 0x7f) + (nnan == 0xff), 4);
}

static void test_rms_norm() {
    int n = 5, h = 72;
    auto x = randn(n * h), w = randn(h);
    std::vector<int> rows = {4, 1};
    std::vector<float> out(2 * h);
    std::vector<unsigned short> out16(2 * h);
    launch({2}, {128}, 0, [&] { rms_norm_f32(x.data(), w.data(), rows.data(), out.data(), h, 1e-5f); });
    launch({2}, {128}, 0, [&] { rms_norm_bf16(x.data(), w.data(), rows.data(), out16.data(), h, 1e-5f); });
    std::vector<double> want(2 * h);
    double err16 = 0;
    for (int r = 0; r < 2; r++) {
        const float* xr = &x[rows[r] * h];
        double ss = 0;
        for (int i = 0; i < h; i++) ss += (double)xr[i] * xr[i];
        double inv = 1.0 / std::sqrt(ss / h + 1e-5);
        for (int i = 0; i < h; i++) {
            want[r * h + i] = w[i] * xr[i] * inv;
            float got16 = __uint_as_float((unsigned)out16[r * h + i] << 16);
            err16 = std::max(err16, (double)std::fabs(got16 - bf16_round(out[r * h + i])));
        }
    }
    check("rms_norm_f32 (selected rows)", max_abs_diff(out, want), 1e-5);
    check("rms_norm_bf16 rounds the f32 result to nearest even", err16, 0.0);
}

// add_rms_norm against add_inplace then rms_norm: the same bits in x and in out (f32 and bf16).
static void test_add_rms_norm() {
    int n = 3, h = 200;
    auto x = randn(n * h), y = randn(n * h), w = randn(h);
    auto xa = x, xb = x, xc = x;
    std::vector<float> want(n * h), got(n * h);
    std::vector<unsigned short> want16(n * h), got16(n * h);
    launch({1}, {256}, 0, [&] { add_inplace(xa.data(), y.data(), (long long)n * h); });
    launch({(unsigned)n}, {256}, 0, [&] { rms_norm_f32(xa.data(), w.data(), nullptr, want.data(), h, 1e-6f); });
    launch({(unsigned)n}, {256}, 0, [&] { rms_norm_bf16(xa.data(), w.data(), nullptr, want16.data(), h, 1e-6f); });
    launch({(unsigned)n}, {256}, 0, [&] { add_rms_norm_f32(xb.data(), y.data(), w.data(), got.data(), h, 1e-6f); });
    launch({(unsigned)n}, {256}, 0, [&] { add_rms_norm_bf16(xc.data(), y.data(), w.data(), got16.data(), h, 1e-6f); });
    long long same = 0;
    for (int i = 0; i < n * h; i++) {
        same += __float_as_uint(xb[i]) == __float_as_uint(xa[i]) && __float_as_uint(xc[i]) == __float_as_uint(xa[i]);
        same += __float_as_uint(got[i]) == __float_as_uint(want[i]);
        same += got16[i] == want16[i];
    }
    check_eq("add_rms_norm: x, f32 out and bf16 out are add_inplace + rms_norm's bits", same, 3LL * n * h);
}

// The decode products (gemv_*) for n tokens of `cols` inputs and `rows` outputs, run on a grid
// smaller than the rows so warps take several rows each:
// - gemv_mat against a double-precision x·Wᵀ of the same bf16 values (f32 sums in another order:
//   within 1e-5 of the sum of |products|);
// - gemv_norm: its normalized rows (xn_out) are rms_norm_bf16's bits, and its products are
//   gemv_mat's over those rows, bit for bit;
// - gemv_mat_add: the same y, and the residual stream plus exactly y;
// - the gated forms over a [2·rows, cols] gate/up matrix: act(gate) · up rounded to bf16 from
//   gemv_mat's own gate and up sums, bit for bit (SiLU and GELU-tanh, both inputs).
static void test_gemv(int n, int rows, int cols, unsigned grid) {
    auto to_bf16 = [](const std::vector<float>& x) {
        std::vector<bf16_t> b(x.size());
        for (size_t i = 0; i < x.size(); i++) st(b.data(), i, x[i]);
        return b;
    };
    auto w = to_bf16(randn((size_t)2 * rows * cols, 0.1f));  // gate rows, then up rows
    auto x = to_bf16(randn((size_t)n * cols));
    auto xr = randn((size_t)n * cols), nw = randn(cols);
    size_t shared = (size_t)n * cols / 2;
    std::vector<float> y(n * rows, NAN), y2(n * 2 * rows, NAN);
    launch({grid}, {GV_THREADS}, shared, [&] {
        gemv_mat(w.data(), rows, cols, x.data(), nullptr, nullptr, 0.0f, nullptr, y.data(), nullptr, nullptr, n);
    });
    double err = 0;
    for (int t = 0; t < n; t++)
        for (int r = 0; r < rows; r++) {
            double want = 0, mag = 0;
            for (int c = 0; c < cols; c++) {
                double pr = (double)ld(w.data(), (size_t)r * cols + c) * ld(x.data(), (size_t)t * cols + c);
                want += pr;
                mag += std::fabs(pr);
            }
            double d = std::fabs(y[t * rows + r] - want) / (mag + 1e-30);
            err = std::max(err, std::isnan(d) ? INFINITY : d);
        }
    std::string what = "gemv " + std::to_string(n) + " x " + std::to_string(cols) + " -> " + std::to_string(rows);
    check((what + ": x·Wᵀ (relative to the sum of |products|)").c_str(), err, 1e-5);

    // The norm prologue: its rows are rms_norm_bf16's, its products gemv_mat's over them.
    std::vector<bf16_t> xn_ref(n * cols), xn(n * cols, 0xFFFF);
    launch({(unsigned)n}, {GV_THREADS}, 0, [&] { rms_norm_bf16(xr.data(), nw.data(), nullptr, xn_ref.data(), cols, 1e-6f); });
    std::vector<float> yn_ref(n * rows), yn(n * rows, NAN);
    launch({grid}, {GV_THREADS}, shared, [&] {
        gemv_mat(w.data(), rows, cols, xn_ref.data(), nullptr, nullptr, 0.0f, nullptr, yn_ref.data(), nullptr, nullptr, n);
    });
    launch({grid}, {GV_THREADS}, shared, [&] {
        gemv_norm(w.data(), rows, cols, nullptr, xr.data(), nw.data(), 1e-6f, xn.data(), yn.data(), nullptr, nullptr, n);
    });
    long long same = 0;
    for (int i = 0; i < n * cols; i++) same += xn[i] == xn_ref[i];
    for (int i = 0; i < n * rows; i++) same += __float_as_uint(yn[i]) == __float_as_uint(yn_ref[i]);
    check_eq((what + ": gemv_norm is rms_norm_bf16 then gemv_mat, bit for bit").c_str(), same,
             (long long)n * (cols + rows));

    // The residual epilogue.
    auto res0 = randn((size_t)n * rows), res = res0;
    std::vector<float> ya(n * rows, NAN);
    launch({grid}, {GV_THREADS}, shared, [&] {
        gemv_mat_add(w.data(), rows, cols, x.data(), nullptr, nullptr, 0.0f, nullptr, ya.data(), res.data(), nullptr, n);
    });
    same = 0;
    for (int i = 0; i < n * rows; i++)
        same += __float_as_uint(ya[i]) == __float_as_uint(y[i]) && __float_as_uint(res[i]) == __float_as_uint(res0[i] + y[i]);
    check_eq((what + ": gemv_mat_add stores y and adds exactly y to the residual").c_str(), same, (long long)n * rows);

    // The gated epilogues, from gemv_mat's gate and up sums over the whole [2·rows, cols] matrix.
    launch({grid}, {GV_THREADS}, shared, [&] {
        gemv_mat(w.data(), 2 * rows, cols, x.data(), nullptr, nullptr, 0.0f, nullptr, y2.data(), nullptr, nullptr, n);
    });
    std::vector<float> y2n(n * 2 * rows, NAN);
    launch({grid}, {GV_THREADS}, shared, [&] {
        gemv_mat(w.data(), 2 * rows, cols, xn_ref.data(), nullptr, nullptr, 0.0f, nullptr, y2n.data(), nullptr, nullptr, n);
    });
    long long gated_same = 0;
    for (int act = 0; act < 2; act++)
        for (int norm = 0; norm < 2; norm++) {
            std::vector<bf16_t> out(n * rows, 0xFFFF);
            auto kernel = act == 0 ? (norm ? gemv_norm_silu : gemv_mat_silu) : (norm ? gemv_norm_gelu : gemv_mat_gelu);
            launch({grid}, {GV_THREADS}, shared, [&] {
                kernel(w.data(), rows, cols, x.data(), xr.data(), nw.data(), 1e-6f, nullptr, nullptr, nullptr, out.data(), n);
            });
            const auto& gu = norm ? y2n : y2;
            for (int t = 0; t < n; t++)
                for (int r = 0; r < rows; r++) {
                    float g = gu[(size_t)t * 2 * rows + r], u = gu[(size_t)t * 2 * rows + rows + r];
                    bf16_t want;
                    st(&want, 0, (act == 0 ? silu_of(g) : gelu_tanh_of(g)) * u);
                    gated_same += out[t * rows + r] == want;
                }
        }
    check_eq((what + ": gated SiLU/GELU epilogues, from x and from the norm, are the unfused bits").c_str(),
             gated_same, 4LL * n * rows);
}

// A decode step's mixture of experts over routed experts only (moe_gemv_*, moe_combine) against
// the decode products of one expert at a time (gemv_mat_silu/gelu over the expert's gate and up
// rows, gemv_mat over its down rows) and moe_accumulate, bit for bit. Experts 1 and 3 have no
// token routed to them and a null matrix address: reading them would crash the harness.
static void test_moe_decode(int act) {
    int n = 3, n_exp = 5, h = 64, ff = 48;
    auto to_bf16 = [](const std::vector<float>& x) {
        std::vector<bf16_t> b(x.size());
        for (size_t i = 0; i < x.size(); i++) st(b.data(), i, x[i]);
        return b;
    };
    std::vector<std::vector<bf16_t>> gu(n_exp), down(n_exp);  // gate rows then up rows; down
    std::vector<unsigned long long> gate_tab(n_exp, 0), up_tab(n_exp, 0), down_tab(n_exp, 0);
    // Token 0: experts 0 and 2; token 1: expert 4; token 2: experts 2 and 4.
    std::vector<float> route = {0.7f, 0, 0.3f, 0, 0, /**/ 0, 0, 0, 0, 1.0f, /**/ 0, 0, 0.4f, 0, 0.6f};
    for (int e = 0; e < n_exp; e++) {
        gu[e] = to_bf16(randn((size_t)2 * ff * h, 0.2f));
        down[e] = to_bf16(randn((size_t)h * ff, 0.2f));
        if (e == 1 || e == 3) continue;
        gate_tab[e] = (unsigned long long)(uintptr_t)gu[e].data();
        up_tab[e] = (unsigned long long)(uintptr_t)(gu[e].data() + (size_t)ff * h);
        down_tab[e] = (unsigned long long)(uintptr_t)down[e].data();
    }
    auto x = to_bf16(randn((size_t)n * h));
    std::vector<bf16_t> acts((size_t)n_exp * n * ff, 0);
    std::vector<float> ye((size_t)n_exp * n * h, NAN), out((size_t)n * h, NAN);
    auto gated = act == 0 ? moe_gemv_silu : moe_gemv_gelu;
    launch({2, (unsigned)n_exp}, {GV_THREADS}, (size_t)n * h / 2, [&] {
        gated(gate_tab.data(), up_tab.data(), ff, h, x.data(), route.data(), n_exp, acts.data(), n);
    });
    launch({2, (unsigned)n_exp}, {GV_THREADS}, (size_t)n * ff / 2, [&] {
        moe_gemv_down(down_tab.data(), h, ff, acts.data(), route.data(), n_exp, ye.data(), n);
    });
    launch({1}, {128}, 0, [&] { moe_combine(out.data(), ye.data(), route.data(), n_exp, h, n); });

    std::vector<float> want((size_t)n * h, 0.0f);
    long long same_acts = 0, routed = 0;
    for (int e = 0; e < n_exp; e++) {
        if (e == 1 || e == 3) continue;
        std::vector<bf16_t> a((size_t)n * ff);
        std::vector<float> y((size_t)n * h);
        auto single = act == 0 ? gemv_mat_silu : gemv_mat_gelu;
        launch({2}, {GV_THREADS}, (size_t)n * h / 2, [&] {
            single(gu[e].data(), ff, h, x.data(), nullptr, nullptr, 0.0f, nullptr, nullptr, nullptr, a.data(), n);
        });
        launch({2}, {GV_THREADS}, (size_t)n * ff / 2, [&] {
            gemv_mat(down[e].data(), h, ff, a.data(), nullptr, nullptr, 0.0f, nullptr, y.data(), nullptr, nullptr, n);
        });
        for (size_t i = 0; i < a.size(); i++) same_acts += a[i] == acts[(size_t)e * n * ff + i];
        routed += (long long)a.size();
        launch({1}, {128}, 0, [&] {
            moe_accumulate(want.data(), y.data(), route.data(), e, n_exp, h, (long long)n * h);
        });
    }
    long long same = 0;
    for (int i = 0; i < n * h; i++) same += __float_as_uint(out[i]) == __float_as_uint(want[i]);
    std::string what = std::string("moe decode (") + (act == 0 ? "SiLU" : "GELU") + ")";
    check_eq((what + ": routed experts' activations are the single-expert products' bits").c_str(), same_acts, routed);
    check_eq((what + ": the mixture is moe_accumulate's over them, bit for bit; unrouted experts unread").c_str(),
             same, (long long)n * h);
}

// A prompt's mixture over routed tokens only (moe_sort, moe_gemm_*, moe_gather) against double
// precision: each token's routed experts, the gated activation rounded to bf16 as the kernels store
// it. 80 tokens, 7 experts (one routed to by no token, one by more tokens than a tile holds), top 2;
// h = 168 and ff = 104 leave partial column blocks and partial inner steps.
static void test_moe_routed(int act) {
    int n = 80, n_exp = 7, top_k = 2, h = 168, ff = 104;
    auto to_bf16 = [](const std::vector<float>& x) {
        std::vector<bf16_t> b(x.size());
        for (size_t i = 0; i < x.size(); i++) st(b.data(), i, x[i]);
        return b;
    };
    auto route = randn((size_t)n * n_exp, 1.0f);
    for (int t = 0; t < n; t++) {
        route[(size_t)t * n_exp + 5] = -50.0f;                 // expert 5: never routed
        if (t < 70) route[(size_t)t * n_exp + 1] = 40.0f;      // expert 1: 70 tokens...
        if (t >= 5 && t < 30) route[(size_t)t * n_exp + 2] = 41.0f;  // ...and 25 of them to expert 2
    }
    launch({1}, {64}, 0, [&] { moe_route(route.data(), n, n_exp, top_k, 1); });
    std::vector<std::vector<bf16_t>> gate(n_exp), up(n_exp), down(n_exp);
    std::vector<unsigned long long> gate_tab(n_exp), up_tab(n_exp), down_tab(n_exp);
    for (int e = 0; e < n_exp; e++) {
        gate[e] = to_bf16(randn((size_t)ff * h, 0.1f));
        up[e] = to_bf16(randn((size_t)ff * h, 0.1f));
        down[e] = to_bf16(randn((size_t)h * ff, 0.1f));
        gate_tab[e] = (unsigned long long)(uintptr_t)gate[e].data();
        up_tab[e] = (unsigned long long)(uintptr_t)up[e].data();
        down_tab[e] = (unsigned long long)(uintptr_t)down[e].data();
    }
    auto x = to_bf16(randn((size_t)n * h));
    int max_tiles = (n * top_k + MR_ROWS - 1) / MR_ROWS + n_exp;
    std::vector<int> counts(n_exp), slot_of((size_t)n * n_exp), sorted_tok((size_t)max_tiles * MR_ROWS, -7),
        tile_expert(max_tiles, -7), n_tiles(1, -7), tok_exp((size_t)n * top_k, -7);
    launch({1}, {256}, 0, [&] {
        moe_sort(route.data(), n, n_exp, top_k, counts.data(), slot_of.data(), sorted_tok.data(), tile_expert.data(),
                 n_tiles.data(), tok_exp.data());
    });
    std::vector<bf16_t> acts((size_t)max_tiles * MR_ROWS * ff, 0x7fc0);
    std::vector<float> ye((size_t)max_tiles * MR_ROWS * h, NAN), out((size_t)n * h, NAN);
    auto gated = act == 0 ? moe_gemm_silu : moe_gemm_gelu;
    unsigned cols_f = (ff + MR_COLS - 1) / MR_COLS, cols_h = (h + MR_COLS - 1) / MR_COLS;
    launch({(unsigned)max_tiles, cols_f}, {MR_THREADS}, 0, [&] {
        gated(gate_tab.data(), up_tab.data(), ff, h, x.data(), sorted_tok.data(), tile_expert.data(), n_tiles.data(),
              acts.data());
    });
    launch({(unsigned)max_tiles, cols_h}, {MR_THREADS}, 0, [&] {
        moe_gemm_down(down_tab.data(), h, ff, acts.data(), tile_expert.data(), n_tiles.data(), ye.data());
    });
    launch({3}, {128}, 0, [&] {
        moe_gather(out.data(), ye.data(), route.data(), slot_of.data(), tok_exp.data(), n_exp, top_k, h, n);
    });

    std::string what = std::string("moe over routed tokens (") + (act == 0 ? "SiLU" : "GELU") + ")";
    // The layout: every routed pair has one row of its expert's tiles, and the tiles in use are the
    // experts' counts padded to whole tiles.
    long long placed = 0, pairs = 0, want_tiles = 0;
    std::vector<int> per(n_exp, 0);
    for (int t = 0; t < n; t++)
        for (int e = 0; e < n_exp; e++) {
            if (route[(size_t)t * n_exp + e] == 0.0f) continue;
            pairs++;
            per[e]++;
            int p = slot_of[(size_t)t * n_exp + e];
            placed += p >= 0 && sorted_tok[p] == t && tile_expert[p / MR_ROWS] == e;
        }
    for (int e = 0; e < n_exp; e++) want_tiles += (per[e] + MR_ROWS - 1) / MR_ROWS;
    long long listed = 0;
    for (int t = 0; t < n; t++) {
        int j = 0;
        for (int e = 0; e < n_exp; e++)
            if (route[(size_t)t * n_exp + e] != 0.0f) listed += tok_exp[(size_t)t * top_k + j++] == e;
        for (; j < top_k; j++) listed += tok_exp[(size_t)t * top_k + j] == -1;
    }
    check_eq((what + ": each token lists its experts in order").c_str(), listed, (long long)n * top_k);
    check_eq((what + ": every routed (token, expert) has its row in its expert's tiles").c_str(), placed, pairs);
    check_eq((what + ": tiles in use").c_str(), n_tiles[0], want_tiles);
    check_eq((what + ": expert 5 is routed to by no token").c_str(), per[5], 0);
    check_eq((what + ": expert 1 takes more than one tile's rows").c_str(), per[1] > MR_ROWS ? 1 : 0, 1);
    std::vector<double> want((size_t)n * h, 0.0);
    double scale = 0;
    for (int t = 0; t < n; t++)
        for (int e = 0; e < n_exp; e++) {
            double w = route[(size_t)t * n_exp + e];
            if (w == 0.0) continue;
            std::vector<float> a(ff);
            for (int f = 0; f < ff; f++) {
                double g = 0, u = 0;
                for (int k = 0; k < h; k++) {
                    g += (double)ld(gate[e].data(), (size_t)f * h + k) * ld(x.data(), (size_t)t * h + k);
                    u += (double)ld(up[e].data(), (size_t)f * h + k) * ld(x.data(), (size_t)t * h + k);
                }
                bf16_t b;
                st(&b, 0, (act == 0 ? silu_of((float)g) : gelu_tanh_of((float)g)) * (float)u);
                a[f] = ld(&b, 0);
            }
            for (int r = 0; r < h; r++) {
                double y = 0;
                for (int f = 0; f < ff; f++) y += (double)ld(down[e].data(), (size_t)r * ff + f) * a[f];
                want[(size_t)t * h + r] += w * y;
            }
        }
    for (double v : want) scale = std::max(scale, std::fabs(v));
    check((what + ": the mixture against double precision (relative to its largest value)").c_str(),
          max_abs_diff(out, want) / scale, 1e-3);
}

// qkv_split with the KV write into a pool of P against kv_write over the unfused q, k, v: the same
// q, the same rounded k and v, the same pool bytes (slot -1 for one token: rounded, not stored).
template <typename P>
static void qkv_split_with_pool(const std::vector<float>& qkv, const float* bq, const float* bk, const float* bv,
                                const float* wq, const float* wk, const std::vector<float>& cs,
                                const std::vector<float>& sn, const std::vector<int>& pos, std::vector<float> q,
                                std::vector<float> k, std::vector<float> v, int nh, int nkv, int hd) {
    int n = (int)pos.size(), kvd = nkv * hd, slots_n = 9;
    std::vector<int> slots = {4, -1, 0, 8, 2};
    std::vector<P> kp(slots_n * kvd, P(0)), vp(slots_n * kvd, P(0)), kp2 = kp, vp2 = vp;
    launch({(unsigned)n}, {32}, 0, [&] { Kv<P>::write(k.data(), v.data(), kp.data(), vp.data(), slots.data(), kvd); });
    std::vector<float> q2(q.size(), NAN), k2(k.size(), NAN), v2(v.size(), NAN);
    auto fused = [&] {
        if constexpr (std::is_same_v<P, float>)
            return qkv_split_f32;
        else if constexpr (std::is_same_v<P, bf16_t>)
            return qkv_split_bf16;
        else
            return qkv_split_fp8;
    }();
    launch({(unsigned)n}, {64}, 0, [&] {
        fused(qkv.data(), bq, bk, bv, wq, wk, cs.data(), sn.data(), pos.data(), q2.data(), k2.data(), v2.data(),
              kp2.data(), vp2.data(), slots.data(), nh, nkv, hd, 1e-6f);
    });
    long long ok = 0, want = (long long)(q.size() + k.size() + v.size() + 2 * kp.size());
    for (size_t i = 0; i < q.size(); i++) ok += __float_as_uint(q[i]) == __float_as_uint(q2[i]);
    for (size_t i = 0; i < k.size(); i++) ok += __float_as_uint(k[i]) == __float_as_uint(k2[i]);
    for (size_t i = 0; i < v.size(); i++) ok += __float_as_uint(v[i]) == __float_as_uint(v2[i]);
    for (size_t i = 0; i < kp.size(); i++)
        ok += (std::memcmp(&kp[i], &kp2[i], sizeof(P)) == 0) + (std::memcmp(&vp[i], &vp2[i], sizeof(P)) == 0);
    check_eq(with_kv(Kv<P>::name, "qkv_split with the KV write: the unfused kernels' and kv_write's bits").c_str(), ok,
             want);
}

// The fused projections' kernels against the unfused ones they replace, bit for bit: the gated
// activations over one [n, 2f] gate/up matrix, and qkv_split (bias, per-head norm, RoPE, split)
// against add_bias, head_rms_norm and rope over separate q/k/v buffers.
static void test_fused_projections() {
    int n = 5, f = 70;
    auto gu = randn((size_t)n * 2 * f, 2.0f);
    std::vector<float> g(n * f), u(n * f);
    for (int t = 0; t < n; t++)
        for (int j = 0; j < f; j++) {
            g[t * f + j] = gu[(size_t)t * 2 * f + j];
            u[t * f + j] = gu[(size_t)t * 2 * f + f + j];
        }
    long long count = (long long)n * f, same = 0;
    std::vector<float> a(count), b(count);
    std::vector<unsigned short> a16(count), b16(count);
    launch({3}, {64}, 0, [&] { silu_mul_f32(g.data(), u.data(), a.data(), count); });
    launch({3}, {64}, 0, [&] { silu_mul_fused_f32(gu.data(), b.data(), f, count); });
    launch({3}, {64}, 0, [&] { gelu_tanh_mul_bf16(g.data(), u.data(), a16.data(), count); });
    launch({3}, {64}, 0, [&] { gelu_tanh_mul_fused_bf16(gu.data(), b16.data(), f, count); });
    for (long long i = 0; i < count; i++) same += (__float_as_uint(a[i]) == __float_as_uint(b[i])) + (a16[i] == b16[i]);
    launch({3}, {64}, 0, [&] { gelu_tanh_mul_f32(g.data(), u.data(), a.data(), count); });
    launch({3}, {64}, 0, [&] { gelu_tanh_mul_fused_f32(gu.data(), b.data(), f, count); });
    launch({3}, {64}, 0, [&] { silu_mul_bf16(g.data(), u.data(), a16.data(), count); });
    launch({3}, {64}, 0, [&] { silu_mul_fused_bf16(gu.data(), b16.data(), f, count); });
    for (long long i = 0; i < count; i++) same += (__float_as_uint(a[i]) == __float_as_uint(b[i])) + (a16[i] == b16[i]);
    check_eq("gated activations over one fused gate/up matrix: the unfused kernels' bits", same, 4 * count);

    // (biases, q/k norms, head size): Qwen2's shape, Qwen3's, both at once, Gemma 3's head size.
    struct Variant {
        bool bias, norm;
        int hd;
    };
    for (Variant var : {Variant{true, false, 48}, Variant{false, true, 48}, Variant{true, true, 128},
                        Variant{false, true, 256}}) {
        int nh = 4, nkv = 2, hd = var.hd, half = hd / 2, heads = nh + 2 * nkv, positions = 40;
        auto qkv = randn((size_t)n * heads * hd);
        auto bq = randn(nh * hd), bk = randn(nkv * hd), bv = randn(nkv * hd);
        auto wq = randn(hd), wk = randn(hd);
        std::vector<float> cs(positions * half), sn(positions * half);
        for (int p = 0; p < positions; p++)
            for (int j = 0; j < half; j++) {
                double th = p * std::pow(10000.0, -2.0 * j / hd);
                cs[p * half + j] = (float)std::cos(th);
                sn[p * half + j] = (float)std::sin(th);
            }
        std::vector<int> pos = {0, 7, 3, 39, 12};
        const float *pbq = var.bias ? bq.data() : nullptr, *pbk = var.bias ? bk.data() : nullptr,
                    *pbv = var.bias ? bv.data() : nullptr, *pwq = var.norm ? wq.data() : nullptr,
                    *pwk = var.norm ? wk.data() : nullptr;
        // Unfused: split the rows, then the kernels the families call one by one.
        std::vector<float> q(n * nh * hd), k(n * nkv * hd), v(n * nkv * hd);
        for (int t = 0; t < n; t++) {
            const float* row = &qkv[(size_t)t * heads * hd];
            std::copy(row, row + nh * hd, &q[t * nh * hd]);
            std::copy(row + nh * hd, row + (nh + nkv) * hd, &k[t * nkv * hd]);
            std::copy(row + (nh + nkv) * hd, row + heads * hd, &v[t * nkv * hd]);
        }
        if (var.bias) {
            launch({2}, {64}, 0, [&] { add_bias(q.data(), bq.data(), (long long)q.size(), nh * hd); });
            launch({2}, {64}, 0, [&] { add_bias(k.data(), bk.data(), (long long)k.size(), nkv * hd); });
            launch({2}, {64}, 0, [&] { add_bias(v.data(), bv.data(), (long long)v.size(), nkv * hd); });
        }
        if (var.norm) {
            launch({(unsigned)(n * nh + 3) / 4}, {128}, 0, [&] { head_rms_norm(q.data(), wq.data(), n * nh, hd, 1e-6f); });
            launch({(unsigned)(n * nkv + 3) / 4}, {128}, 0, [&] { head_rms_norm(k.data(), wk.data(), n * nkv, hd, 1e-6f); });
        }
        launch({(unsigned)n}, {64}, 0, [&] { rope(q.data(), cs.data(), sn.data(), pos.data(), nh, hd); });
        launch({(unsigned)n}, {64}, 0, [&] { rope(k.data(), cs.data(), sn.data(), pos.data(), nkv, hd); });
        std::vector<float> q2(q.size(), NAN), k2(k.size(), NAN), v2(v.size(), NAN);
        launch({(unsigned)n}, {96}, 0, [&] {
            qkv_split_f32(qkv.data(), pbq, pbk, pbv, pwq, pwk, cs.data(), sn.data(), pos.data(), q2.data(), k2.data(),
                          v2.data(), nullptr, nullptr, nullptr, nh, nkv, hd, 1e-6f);
        });
        long long ok = 0;
        for (size_t i = 0; i < q.size(); i++) ok += __float_as_uint(q[i]) == __float_as_uint(q2[i]);
        for (size_t i = 0; i < k.size(); i++) ok += __float_as_uint(k[i]) == __float_as_uint(k2[i]);
        for (size_t i = 0; i < v.size(); i++) ok += __float_as_uint(v[i]) == __float_as_uint(v2[i]);
        std::string what = std::string("qkv_split (") + (var.bias ? "biases, " : "") + (var.norm ? "q/k norms, " : "") +
                           "RoPE, head size " + std::to_string(hd) + "): the unfused kernels' bits";
        check_eq(what.c_str(), ok, (long long)(q.size() + k.size() + v.size()));
        // With the KV write: the unfused kernels then kv_write, into a pool of each dtype.
        qkv_split_with_pool<float>(qkv, pbq, pbk, pbv, pwq, pwk, cs, sn, pos, q, k, v, nh, nkv, hd);
        qkv_split_with_pool<bf16_t>(qkv, pbq, pbk, pbv, pwq, pwk, cs, sn, pos, q, k, v, nh, nkv, hd);
        qkv_split_with_pool<fp8_t>(qkv, pbq, pbk, pbv, pwq, pwk, cs, sn, pos, q, k, v, nh, nkv, hd);
    }
}

static void test_head_norm_rope() {
    int n = 3, heads = 4, hd = 16, half = hd / 2, positions = 40;
    auto x = randn(n * heads * hd), w = randn(hd);
    auto x0 = x;
    launch({(unsigned)((n * heads + 3) / 4)}, {128}, 0, [&] { head_rms_norm(x.data(), w.data(), n * heads, hd, 1e-6f); });
    std::vector<double> want(x.size());
    for (int r = 0; r < n * heads; r++) {
        double ss = 0;
        for (int i = 0; i < hd; i++) ss += (double)x0[r * hd + i] * x0[r * hd + i];
        double inv = 1.0 / std::sqrt(ss / hd + 1e-6);
        for (int i = 0; i < hd; i++) want[r * hd + i] = w[i] * x0[r * hd + i] * inv;
    }
    check("head_rms_norm", max_abs_diff(x, want), 1e-5);

    std::vector<float> cos_t(positions * half), sin_t(positions * half);
    for (int p = 0; p < positions; p++)
        for (int j = 0; j < half; j++) {
            double a = p * std::pow(10000.0, -2.0 * j / hd);
            cos_t[p * half + j] = (float)std::cos(a);
            sin_t[p * half + j] = (float)std::sin(a);
        }
    std::vector<int> pos = {0, 17, 39};
    auto y = x;
    launch({(unsigned)n}, {32}, 0, [&] { rope(y.data(), cos_t.data(), sin_t.data(), pos.data(), heads, hd); });
    for (int t = 0; t < n; t++)
        for (int h = 0; h < heads; h++)
            for (int j = 0; j < half; j++) {
                size_t b = (size_t)(t * heads + h) * hd;
                double c = cos_t[pos[t] * half + j], s = sin_t[pos[t] * half + j];
                double x1 = x[b + j], x2 = x[b + j + half];
                want[b + j] = x1 * c - x2 * s;
                want[b + j + half] = x2 * c + x1 * s;
            }
    check("rope (rotate-half, per-token positions)", max_abs_diff(y, want), 1e-5);
}

static void test_elementwise() {
    long long n = 1000;
    int width = 40;
    auto g = randn(n), u = randn(n), b = randn(width);
    std::vector<float> out(n), y = g;
    launch({4}, {256}, 0, [&] { silu_mul_f32(g.data(), u.data(), out.data(), n); });
    std::vector<double> want(n);
    for (long long i = 0; i < n; i++) want[i] = g[i] / (1.0 + std::exp(-(double)g[i])) * u[i];
    check("silu_mul_f32", max_abs_diff(out, want), 1e-5);
    launch({2}, {256}, 0, [&] { add_bias(y.data(), b.data(), n, width); });
    for (long long i = 0; i < n; i++) want[i] = (double)g[i] + b[i % width];
    check("add_bias", max_abs_diff(y, want), 1e-6);
    launch({1}, {64}, 0, [&] { add_inplace(y.data(), u.data(), n); });
    for (long long i = 0; i < n; i++) want[i] += u[i];
    check("add_inplace (grid-stride)", max_abs_diff(y, want), 1e-5);

    std::vector<unsigned short> table(7 * 4);
    for (size_t i = 0; i < table.size(); i++) table[i] = (unsigned short)(0x3f80 + i);
    std::vector<unsigned> tokens = {6, 0, 3};
    std::vector<float> x(3 * 4);
    launch({3}, {32}, 0, [&] { embed_bf16(table.data(), tokens.data(), x.data(), 4, 1.0f); });
    double e = 0;
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < 4; i++)
            e = std::max(e, (double)std::fabs(x[t * 4 + i] - __uint_as_float((unsigned)table[tokens[t] * 4 + i] << 16)));
    check("embed_bf16", e, 0.0);
}

// Embedding with Gemma's scale (sqrt(hidden)): the kernel rounds the scale and the product to f32,
// so each value may differ from the exact product by two f32 roundings (at most 2^-23 relative).
static void test_embed_scaled() {
    int vocab = 9, h = 80;
    auto tf = randn(vocab * h);
    std::vector<unsigned short> t16(tf.size());
    for (size_t i = 0; i < tf.size(); i++) {
        t16[i] = (unsigned short)(__float_as_uint(bf16_round(tf[i])) >> 16);
        tf[i] = __uint_as_float((unsigned)t16[i] << 16);  // the same values for the f32 table
    }
    std::vector<unsigned> tokens = {8, 0, 3, 8};
    int n = (int)tokens.size();
    double scale = std::sqrt(640.0);
    std::vector<float> x16(n * h), x32(n * h);
    launch({(unsigned)n}, {32}, 0, [&] { embed_bf16(t16.data(), tokens.data(), x16.data(), h, (float)scale); });
    launch({(unsigned)n}, {32}, 0, [&] { embed_f32(tf.data(), tokens.data(), x32.data(), h, (float)scale); });
    double e16 = 0, e32 = 0;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < h; i++) {
            double want = (double)tf[tokens[t] * h + i] * scale;
            e16 = std::max(e16, std::fabs(x16[t * h + i] - want) / std::fabs(want));
            e32 = std::max(e32, std::fabs(x32[t * h + i] - want) / std::fabs(want));
        }
    check("embed_bf16 scaled by sqrt(640) (relative)", e16, 1.2e-7);
    check("embed_f32 scaled by sqrt(640) (relative)", e32, 1.2e-7);
}

static void test_gather_rows() {
    int n = 6, width = 100;  // wider than the block: each thread copies several values
    auto x = randn(n * width);
    std::vector<int> rows = {5, 0, 5, 2};
    std::vector<float> out(rows.size() * width, -1.0f);
    launch({(unsigned)rows.size()}, {32}, 0, [&] { gather_rows(x.data(), rows.data(), out.data(), width); });
    double e = 0;
    for (size_t r = 0; r < rows.size(); r++)
        for (int i = 0; i < width; i++) e = std::max(e, (double)std::fabs(out[r * width + i] - x[rows[r] * width + i]));
    check("gather_rows (repeated and reordered rows)", e, 0.0);
}

// GeGLU: out = gelu_tanh(g) * u. The gelu factor 0.5 * (1 + tanh(..)) lies in [0, 1], so errors are
// measured relative to |g * u|: f32 rounding of the inner polynomial, tanhf and 1 + tanh (which
// cancels for very negative g) keeps them within a few 2^-24. Includes g = 0 and |g| = 30, where
// tanh saturates (g = -30 gives exactly 0, g = 30 exactly g * u).
static void test_gelu_tanh_mul() {
    size_t at = 1000;  // g = 0, 30, -30 and others from here
    auto g = randn(at, 3.0f), u = randn(at);
    for (float s : {0.0f, 30.0f, -30.0f, 10.0f, -10.0f, 5.0f, -5.0f, 1e-20f, -1e-20f}) {
        g.push_back(s);
        u.push_back(randn(1)[0]);
    }
    long long n = (long long)g.size();
    std::vector<float> out(n);
    std::vector<unsigned short> out16(n);
    launch({2}, {128}, 0, [&] { gelu_tanh_mul_f32(g.data(), u.data(), out.data(), n); });
    launch({2}, {128}, 0, [&] { gelu_tanh_mul_bf16(g.data(), u.data(), out16.data(), n); });
    const double k = std::sqrt(2.0 / std::numbers::pi);
    double e = 0, e16 = 0, round16 = 0;
    for (long long i = 0; i < n; i++) {
        double gd = g[i], want = 0.5 * gd * (1.0 + std::tanh(k * (gd + 0.044715 * gd * gd * gd))) * u[i];
        double mag = std::fabs(gd * u[i]);
        float got16 = __uint_as_float((unsigned)out16[i] << 16);
        double d = std::fabs(out[i] - want), d16 = std::fabs(got16 - want);
        e = std::max(e, d == 0 ? 0.0 : d / mag);
        e16 = std::max(e16, d16 == 0 ? 0.0 : d16 / mag);
        round16 = std::max(round16, (double)std::fabs(got16 - bf16_round(out[i])));
    }
    check("gelu_tanh_mul_f32 (error relative to |gate * up|)", e, 1e-6);
    check("gelu_tanh_mul_bf16 within bf16 rounding (2^-8) of the reference", e16, 1.0 / 256 + 1e-6);
    check("gelu_tanh_mul_bf16 rounds the f32 result to nearest even", round16, 0.0);
    check("gelu_tanh_mul_f32: g = 0 and g = -30 give 0, g = 30 gives g * up",
          std::fabs(out[at]) + std::fabs(out[at + 2]) + std::fabs(out[at + 1] - 30.0f * u[at + 1]), 0.0);
}

// Soft-capping x = cap * tanh(x / cap), relative error, with values far beyond the cap (which must
// come out at the cap, never beyond it) and 0.
static void test_softcap() {
    float cap = 30.0f;
    auto x = randn(1000, 40.0f);
    for (float s : {0.0f, 1e-3f, -1e-3f, 300.0f, -300.0f, 1e5f, -1e5f, 1e30f, -1e30f}) x.push_back(s);
    auto x0 = x;
    long long n = (long long)x.size();
    launch({2}, {128}, 0, [&] { softcap(x.data(), n, cap); });
    double e = 0, over = 0;
    for (long long i = 0; i < n; i++) {
        double want = cap * std::tanh((double)x0[i] / cap), d = std::fabs(x[i] - want);
        e = std::max(e, d == 0 ? 0.0 : d / std::fabs(want));
        over = std::max(over, std::fabs((double)x[i]) - cap);
    }
    check("softcap 30 (relative)", e, 1e-6);
    check("softcap: no value beyond the cap", std::max(over, 0.0), 0.0);
}

// Causal paged attention in double precision, the reference both attention kernels are held to:
// each (token, query head) row of the output, from in-pass K/V for positions from its chunk's
// start and from the pool through the block table before that, with an optional window and
// soft-cap of the scaled scores.
using Floats = std::vector<float>;
using Ints = std::vector<int>;
static std::vector<double> attention_reference(const Floats& q, const Floats& k_new, const Floats& v_new,
                                               const Floats& k_pool, const Floats& v_pool, const Ints& tok_chunk,
                                               const Ints& pos, const Ints& chunk_start, const Ints& chunk_base,
                                               const Ints& chunk_bt, const Ints& tables, int nh, int nkv, int hd, int bs,
                                               int window, float scale, float softcap) {
    int n = (int)tok_chunk.size(), kvd = nkv * hd;
    std::vector<double> want((size_t)n * nh * hd);
    for (int t = 0; t < n; t++) {
        int c = tok_chunk[t], p_tok = pos[t];
        int first = window > 0 ? std::max(0, p_tok + 1 - window) : 0;
        for (int h = 0; h < nh; h++) {
            int kvh = h / (nh / nkv);
            std::vector<double> s;
            std::vector<const float*> vs;
            for (int p = first; p <= p_tok; p++) {
                const float *kr, *vr;
                if (p >= chunk_start[c]) {
                    size_t row = (size_t)(chunk_base[c] + p - chunk_start[c]) * kvd + kvh * hd;
                    kr = &k_new[row];
                    vr = &v_new[row];
                } else {
                    size_t slot = (size_t)tables[chunk_bt[c] + p / bs] * bs + p % bs;
                    kr = &k_pool[slot * kvd + kvh * hd];
                    vr = &v_pool[slot * kvd + kvh * hd];
                }
                double d = 0;
                for (int i = 0; i < hd; i++) d += (double)q[(t * nh + h) * hd + i] * kr[i];
                d *= scale;
                if (softcap > 0) d = softcap * std::tanh(d / softcap);
                s.push_back(d);
                vs.push_back(vr);
            }
            double m = *std::max_element(s.begin(), s.end()), z = 0;
            for (double& x : s) z += (x = std::exp(x - m));
            for (int i = 0; i < hd; i++) {
                double a = 0;
                for (size_t j = 0; j < s.size(); j++) a += s[j] * vs[j][i];
                want[((size_t)t * nh + h) * hd + i] = a / z;
            }
        }
    }
    return want;
}

// Paged attention over two sequences: A is a prefill chunk of 5 tokens at positions 6..10 with 6
// positions already in the pool, B one decode token at position 13; GQA 4 query heads on 2 KV heads.
// With softcap > 0, q is multiplied by q_scale so that scaled scores (about N(0, q_scale^2)) reach
// and pass the cap.
template <typename P>
static void test_attention(int window, int n_split, const char* what, float softcap = 0.0f, float q_scale = 1.0f) {
    int nh = 4, nkv = 2, hd = 40, bs = 4, blocks = 10, kvd = nkv * hd;
    int starts[2] = {6, 13}, counts[2] = {5, 1};
    std::vector<int> tables = {7, 2, 5, 0, /* B: */ 9, 1, 3, 8};
    int bt_off[2] = {0, 4}, base[2] = {0, 5};
    int n = 6;
    auto q = randn(n * nh * hd, q_scale), k_new = randn(n * kvd), v_new = randn(n * kvd);
    auto kp = store<P>(randn(blocks * bs * kvd)), vp = store<P>(randn(blocks * bs * kvd));
    std::vector<int> tok_chunk(n), pos(n);
    for (int c = 0, t = 0; c < 2; c++)
        for (int j = 0; j < counts[c]; j++, t++) {
            tok_chunk[t] = c;
            pos[t] = starts[c] + j;
        }
    std::vector<int> chunk_start = {starts[0], starts[1]}, chunk_base = {base[0], base[1]}, chunk_bt = {bt_off[0], bt_off[1]};
    std::vector<float> partial((size_t)n * nh * n_split * (hd + 2)), out(n * nh * hd, NAN);
    std::vector<unsigned short> out16(n * nh * hd, 0xFFFF);
    std::vector<int> done(n * nh, 0);
    float scale = 1.0f / std::sqrt((float)hd);
    // Twice, as a graph replays a pass: the f32 output, then the bf16 one with the same counters.
    launch({(unsigned)(n * nh), (unsigned)n_split}, {128}, 4 * hd, [&] {
        Kv<P>::partial(q.data(), k_new.data(), v_new.data(), kp.raw.data(), vp.raw.data(), tok_chunk.data(),
                       pos.data(), chunk_start.data(), chunk_base.data(), chunk_bt.data(), tables.data(), partial.data(),
                       done.data(), out.data(), nullptr, nh, nkv, hd, bs, window, scale, softcap);
    });
    launch({(unsigned)(n * nh), (unsigned)n_split}, {128}, 4 * hd, [&] {
        Kv<P>::partial(q.data(), k_new.data(), v_new.data(), kp.raw.data(), vp.raw.data(), tok_chunk.data(),
                       pos.data(), chunk_start.data(), chunk_base.data(), chunk_bt.data(), tables.data(), partial.data(),
                       done.data(), nullptr, out16.data(), nh, nkv, hd, bs, window, scale, softcap);
    });

    auto want = attention_reference(q, k_new, v_new, kp.wide, vp.wide, tok_chunk, pos, chunk_start, chunk_base,
                                    chunk_bt, tables, nh, nkv, hd, bs, window, scale, softcap);
    check(with_kv(Kv<P>::name, what).c_str(), max_abs_diff(out, want), 2e-5);  // NaN: a row not merged
    long long same = 0, zero = 0;
    for (size_t i = 0; i < out.size(); i++) same += out16[i] == (unsigned short)(__float_as_uint(bf16_round(out[i])) >> 16);
    for (int c : done) zero += c == 0;
    check_eq("  ... the bf16 output is the f32 one rounded, and every slice count is back to 0", same + zero,
             (long long)out.size() + n * nh);
}

// A pass of several chunks over a paged pool, as the tiled attention tests lay it out: chunk c
// holds counts[c] tokens from position starts[c] (earlier positions in the pool), block tables
// scattered over the pool, and tiles of at most `tpt` tokens built as the host builds them
// (never crossing a chunk).
struct PagedPass {
    std::vector<int> tables, chunk_bt, chunk_base, tok_chunk, pos, tiles;
    int n = 0, blocks = 0;
};
static PagedPass paged_pass(const std::vector<int>& starts, const std::vector<int>& counts, int bs, int tpt) {
    PagedPass p;
    int chunks = (int)starts.size();
    for (int c = 0; c < chunks; c++) p.blocks += (starts[c] + counts[c] + bs - 1) / bs;
    std::vector<int> perm(p.blocks);
    for (int b = 0; b < p.blocks; b++) perm[b] = (b * 7 + 3) % p.blocks;  // 7 and blocks coprime here
    for (int c = 0; c < chunks; c++) {
        p.chunk_bt.push_back((int)p.tables.size());
        p.chunk_base.push_back(p.n);
        for (int b = 0; b < (starts[c] + counts[c] + bs - 1) / bs; b++) p.tables.push_back(perm[p.tables.size()]);
        for (int j = 0; j < counts[c]; j++, p.n++) {
            p.tok_chunk.push_back(c);
            p.pos.push_back(starts[c] + j);
        }
    }
    for (int t = 0; t < p.n; t++)
        if (t == 0 || p.tok_chunk[t] != p.tok_chunk[t - 1] || (t - p.chunk_base[p.tok_chunk[t]]) % tpt == 0)
            p.tiles.push_back(t);
    return p;
}

// Tiled attention (attn_tiled_*), the path of passes with prompt chunks, against the same
// double-precision reference: three chunks (a 37-token prompt chunk at positions 11..47 with 11
// positions in the pool, one decode token at position 20, a 3-token prompt from position 0), block
// tables scattered over the pool, tiles built as the host builds them (never crossing a chunk).
// `gp` query heads share a block, `tpt` tokens make a tile (gp * tpt <= 16).
template <typename P>
static void test_attention_tiled(int nh, int nkv, int hd, int gp, int window, float softcap, float q_scale,
                                 const char* what) {
    int bs = 4, kvd = nkv * hd;
    std::vector<int> starts = {11, 20, 0}, counts = {37, 1, 3};
    int tpt = 16 / gp;
    PagedPass pp = paged_pass(starts, counts, bs, tpt);
    auto& [tables, chunk_bt, chunk_base, tok_chunk, pos, tiles, n, blocks] = pp;
    auto q = randn(n * nh * hd, q_scale), k_new = randn(n * kvd), v_new = randn(n * kvd);
    auto kp = store<P>(randn(blocks * bs * kvd)), vp = store<P>(randn(blocks * bs * kvd));
    std::vector<float> out(n * nh * hd, NAN);
    std::vector<unsigned short> out16(n * nh * hd, 0xFFFF);
    float scale = 1.0f / std::sqrt((float)hd);
    unsigned groups = (unsigned)((nh / nkv) / gp);
    launch({(unsigned)tiles.size(), (unsigned)nkv * groups}, {256}, 0, [&] {
        Kv<P>::tiled_f32(q.data(), k_new.data(), v_new.data(), kp.raw.data(), vp.raw.data(), tok_chunk.data(),
                         pos.data(), starts.data(), chunk_base.data(), chunk_bt.data(), tables.data(), tiles.data(),
                         out.data(), n, nh, nkv, hd, bs, window, scale, softcap, gp, tpt);
    });
    launch({(unsigned)tiles.size(), (unsigned)nkv * groups}, {256}, 0, [&] {
        Kv<P>::tiled_bf16(q.data(), k_new.data(), v_new.data(), kp.raw.data(), vp.raw.data(), tok_chunk.data(),
                          pos.data(), starts.data(), chunk_base.data(), chunk_bt.data(), tables.data(), tiles.data(),
                          out16.data(), n, nh, nkv, hd, bs, window, scale, softcap, gp, tpt);
    });
    auto want = attention_reference(q, k_new, v_new, kp.wide, vp.wide, tok_chunk, pos, starts, chunk_base, chunk_bt,
                                    tables, nh, nkv, hd, bs, window, scale, softcap);
    check(with_kv(Kv<P>::name, what).c_str(), max_abs_diff(out, want), 2e-5);  // NaN (an unwritten output) fails too
    double e16 = 0;
    for (size_t i = 0; i < out.size(); i++) {
        float got = __uint_as_float((unsigned)out16[i] << 16);
        e16 = std::max(e16, std::isnan(got) ? 1e9 : (double)std::fabs(got - bf16_round(out[i])));
    }
    check("  ... and the bf16 output is the f32 output rounded", e16, 0.0);
}

// Tensor-core attention (attn_mma_hd<HD>_kv*), the path of prompt chunks in bf16 passes, against
// the double-precision reference fed the values the kernel multiplies: q·scale, K and V rounded
// to bf16. What remains is the rounding of the softmax weights to bf16 before their product with
// V, and of the output to bf16. Three chunks: a 100-token prompt chunk at positions 30..129 (30
// positions in the pool, so several key tiles and a tile of tokens that crosses none), one decode
// token at position 20 and a 3-token prompt from position 0; block tables scattered over the
// pool; tiles built as the host builds them (never crossing a chunk), gp * tpt <= 64.
template <typename P, int HD>
static void test_attention_mma(int nh, int nkv, int hd, int gp, int window, float softcap, float q_scale,
                               const char* what) {
    int bs = 4, kvd = nkv * hd;
    std::vector<int> starts = {30, 20, 0}, counts = {100, 1, 3};
    int tpt = 64 / gp;
    PagedPass pp = paged_pass(starts, counts, bs, tpt);
    auto& [tables, chunk_bt, chunk_base, tok_chunk, pos, tiles, n, blocks] = pp;
    auto q = randn(n * nh * hd, q_scale), k_new = randn(n * kvd), v_new = randn(n * kvd);
    auto kp = store<P>(randn(blocks * bs * kvd)), vp = store<P>(randn(blocks * bs * kvd));
    std::vector<unsigned short> out16(n * nh * hd, 0xFFFF);  // NaN: an unwritten output fails
    float scale = 1.0f / std::sqrt((float)hd);
    unsigned groups = (unsigned)((nh / nkv) / gp);
    auto kernel = HD == 64 ? Kv<P>::mma64 : HD == 128 ? Kv<P>::mma128 : Kv<P>::mma256;
    launch({(unsigned)tiles.size(), (unsigned)nkv * groups}, {128}, 0, [&] {
        kernel(q.data(), k_new.data(), v_new.data(), kp.raw.data(), vp.raw.data(), tok_chunk.data(), pos.data(),
               starts.data(), chunk_base.data(), chunk_bt.data(), tables.data(), tiles.data(), out16.data(), n, nh, nkv,
               hd, bs, window, scale, softcap, gp, tpt);
    });
    auto rounded = [](std::vector<float> x, float by) {
        for (auto& v : x) v = bf16_round(v * by);
        return x;
    };
    auto want = attention_reference(rounded(q, scale), rounded(k_new, 1), rounded(v_new, 1), rounded(kp.wide, 1),
                                    rounded(vp.wide, 1), tok_chunk, pos, starts, chunk_base, chunk_bt, tables, nh, nkv,
                                    hd, bs, window, 1.0f, softcap);
    std::vector<float> got(out16.size());
    for (size_t i = 0; i < got.size(); i++) got[i] = __uint_as_float((unsigned)out16[i] << 16);
    // The output is stored in bf16 (half an ulp is 7.8e-3 for values in [2, 4)) and the
    // probabilities enter the P·V products in bf16: a layout error shows as errors of order 1.
    check(with_kv(Kv<P>::name, what).c_str(), max_abs_diff(got, want), 1.6e-2);
}

// kv_write and kv_commit on a pool of P: the pool holds exactly the bits `st` gives the values
// (nothing else is touched), and kv_write leaves the pass's K/V rounded to what the pool holds,
// the staged token's (slot -1) included.
template <typename P>
static void test_kv() {
    int kvd = 24, n = 4, layers = 2, stage_rows = 6, slots_n = 12;
    auto k = randn(n * kvd), v = randn(n * kvd);
    auto kw = k, vw = v;
    std::vector<P> kp(slots_n * kvd, P(0)), vp(slots_n * kvd, P(0));
    std::vector<int> slots = {9, -1, 0, 5};
    launch({(unsigned)n}, {32}, 0, [&] { Kv<P>::write(kw.data(), vw.data(), kp.data(), vp.data(), slots.data(), kvd); });
    auto ks = store<P>(k), vs = store<P>(v);
    long long wrong = 0, rounded = 0;
    for (int s = 0; s < slots_n; s++)
        for (int i = 0; i < kvd; i++) {
            int t = s == 9 ? 0 : s == 0 ? 2 : s == 5 ? 3 : -1;
            P wk = t < 0 ? P(0) : ks.raw[t * kvd + i], wv = t < 0 ? P(0) : vs.raw[t * kvd + i];
            wrong += std::memcmp(&kp[s * kvd + i], &wk, sizeof(P)) != 0 || std::memcmp(&vp[s * kvd + i], &wv, sizeof(P)) != 0;
        }
    for (int i = 0; i < n * kvd; i++)
        rounded += __float_as_uint(kw[i]) == __float_as_uint(ks.wide[i]) && __float_as_uint(vw[i]) == __float_as_uint(vs.wide[i]);
    check_eq(with_kv(Kv<P>::name, "kv_write: pool values wrong (three slots written, slot -1 and the rest untouched)").c_str(), wrong, 0);
    check_eq(with_kv(Kv<P>::name, "kv_write: fresh K/V left as the pool holds them").c_str(), rounded, n * kvd);

    auto stage = store<P>(randn((size_t)layers * 2 * stage_rows * kvd)).wide;  // rounded, as kv_write leaves it
    std::vector<P> pool((size_t)layers * 2 * slots_n * kvd, P(0));
    std::vector<int> rows = {3, 0}, dst = {11, 4};
    launch({2, (unsigned)(layers * 2)}, {32}, 0, [&] {
        Kv<P>::commit(stage.data(), pool.data(), rows.data(), dst.data(), kvd, stage_rows, slots_n);
    });
    wrong = 0;
    long long written = 0;
    for (int plane = 0; plane < layers * 2; plane++)
        for (int s = 0; s < slots_n; s++)
            for (int i = 0; i < kvd; i++) {
                P got = pool[((size_t)plane * slots_n + s) * kvd + i];
                int r = s == 11 ? 3 : s == 4 ? 0 : -1;
                float want = r < 0 ? 0.0f : stage[((size_t)plane * stage_rows + r) * kvd + i];
                P tmp[1];
                wrong += ld(&got, 0) != want;
                st(tmp, 0, want);
                wrong += std::memcmp(tmp, &got, sizeof(P)) != 0;
                written += r >= 0;
            }
    check_eq(with_kv(Kv<P>::name, "kv_commit: wrong values over every layer's K and V plane").c_str(), wrong, 0);
    check_eq(with_kv(Kv<P>::name, "kv_commit: values written").c_str(), written, (long long)layers * 2 * 2 * kvd);
}

static void test_greedy() {
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    int vocab = 2000;
    std::vector<std::vector<float>> rows(4, randn(vocab, 3.0f));
    rows[0][1500] = 50.0f;
    rows[0][700] = 50.0f;  // a tie: the lower id wins
    rows[1][3] = nan;
    rows[1][900] = inf;
    rows[1][901] = inf;
    for (auto& x : rows[2]) x = -inf;
    rows[2][0] = nan;
    rows[2][5] = nan;
    rows[3] = randn(vocab, 3.0f);
    std::vector<float> flat;
    for (auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
    std::vector<int> tokens(4);
    std::vector<float> lps(4);
    launch({4}, {256}, 0, [&] { greedy_rows(flat.data(), vocab, tokens.data(), lps.data()); });
    check_eq("greedy tie goes to the lower id", tokens[0], 700);
    check_eq("greedy: +inf counts as the largest float, first one wins", tokens[1], 900);
    check_eq("greedy: no finite maximum gives the first non-NaN id", tokens[2], 1);
    check("greedy: that row's log-probability is -inf", std::isinf(lps[2]) && lps[2] < 0 ? 0.0 : 1.0, 0.0);
    int best = 0;
    for (int i = 1; i < vocab; i++)
        if (rows[3][i] > rows[3][best]) best = i;
    double m = rows[3][best], z = 0;
    for (float x : rows[3]) z += std::exp((double)x - m);
    check_eq("greedy argmax", tokens[3], best);
    check("greedy log-probability", std::fabs(lps[3] - (-(std::log(z)))), 1e-5);
    check("greedy log-probability of a tie (two equal maxima)", std::fabs(lps[0] - (-std::log(2.0))), 1e-5);
}

// Mixture-of-experts routing against a double-precision softmax and top-k (ties to the lower
// expert index), with and without renormalization, then the weighted accumulation of experts.
static void test_moe() {
    int n = 5, n_exp = 8;
    auto logits = randn(n * n_exp, 2.0f);
    // Token 1: experts 6 and 2 tie for the largest logit, 4 and 5 for the next.
    for (int e = 0; e < n_exp; e++) logits[1 * n_exp + e] = -1.0f - 0.1f * e;
    logits[1 * n_exp + 6] = logits[1 * n_exp + 2] = 3.0f;
    logits[1 * n_exp + 5] = logits[1 * n_exp + 4] = 2.0f;
    for (int top_k : {1, 2, 3}) {
        for (int renorm : {0, 1}) {
            auto route = logits;
            launch({2}, {4}, 0, [&] { moe_route(route.data(), n, n_exp, top_k, renorm); });
            std::vector<double> want(n * n_exp, 0.0);
            for (int t = 0; t < n; t++) {
                const float* l = &logits[t * n_exp];
                double mx = *std::max_element(l, l + n_exp), z = 0;
                std::vector<double> p(n_exp);
                for (int e = 0; e < n_exp; e++) z += (p[e] = std::exp((double)l[e] - mx));
                std::vector<int> chosen;
                double total = 0;
                for (int j = 0; j < top_k; j++) {
                    int best = -1;
                    for (int e = 0; e < n_exp; e++) {
                        if (std::find(chosen.begin(), chosen.end(), e) != chosen.end()) continue;
                        if (best < 0 || l[e] > l[best]) best = e;
                    }
                    chosen.push_back(best);
                    total += p[best] / z;
                }
                for (int e : chosen) want[t * n_exp + e] = p[e] / z / (renorm ? total : 1.0);
            }
            long long chosen_ok = 0;
            for (int i = 0; i < n * n_exp; i++) chosen_ok += (route[i] != 0.0f) == (want[i] != 0.0);
            std::string what = "moe_route top " + std::to_string(top_k) + (renorm ? ", renormalized" : ", raw");
            check((what + ": weights").c_str(), max_abs_diff(route, want), 1e-6);
            check_eq((what + ": chosen experts").c_str(), chosen_ok, n * n_exp);
            // Token 1 with top 1 keeps expert 2 of the tied 2 and 6; with top 3 (2 and 6 first),
            // expert 4 of the tied 4 and 5.
            if (top_k == 1)
                check_eq((what + ": a tie goes to the lower index").c_str(),
                         (route[1 * n_exp + 2] != 0.0f) + 2 * (route[1 * n_exp + 6] != 0.0f), 1);
            if (top_k == 3)
                check_eq((what + ": a tie at the last place goes to the lower index").c_str(),
                         (route[1 * n_exp + 4] != 0.0f) + 2 * (route[1 * n_exp + 5] != 0.0f), 1);
        }
    }

    int h = 24;
    std::vector<float> route(n * n_exp, 0.0f), out = randn(n * h);
    route[0 * n_exp + 3] = 0.25f;
    route[2 * n_exp + 3] = 0.75f;
    route[4 * n_exp + 1] = 0.5f;
    auto y3 = randn(n * h), y1 = randn(n * h);
    y3[1 * h + 5] = std::numeric_limits<float>::infinity();  // token 1 is not routed to expert 3
    std::vector<double> want(out.begin(), out.end());
    launch({3}, {32}, 0, [&] { moe_accumulate(out.data(), y1.data(), route.data(), 1, n_exp, h, (long long)n * h); });
    launch({3}, {32}, 0, [&] { moe_accumulate(out.data(), y3.data(), route.data(), 3, n_exp, h, (long long)n * h); });
    for (int t = 0; t < n; t++)
        for (int i = 0; i < h; i++) {
            double& w = want[t * h + i];
            if (route[t * n_exp + 1] != 0.0f) w += (double)route[t * n_exp + 1] * y1[t * h + i];
            if (route[t * n_exp + 3] != 0.0f) w += (double)route[t * n_exp + 3] * y3[t * h + i];
        }
    check("moe_accumulate (weighted, unrouted tokens untouched)", max_abs_diff(out, want), 1e-6);
}

// LoRA deltas (lora_shrink_* then lora_expand) over 21 tokens and four resident adapters, three
// projections in one call (the third 300 wide: two column blocks), against a double-precision
// reference. Slots: -1 (no adapter), 0 (rank 1), 1 (rank 4, no delta for the second projection),
// 2 (rank 16, none for the third), 3 (rank 64, the stride). Rows the pass must not touch (no
// adapter, or an adapter without that target) must keep their bits, even with mid poisoned (NaN).
// Tolerance: a sum of m f32 products is within m * 2^-24 of exact relative to the sum of the
// magnitudes, so each value must be within (din + rank + 2) * 2^-24 of the reference relative to
// |y| + |scale| * sum_j |b_oj| * sum_i |x_i a_ji|. With bf16 x the reference uses the rounded x
// (the same bound), and the unrounded x within bf16's 2^-8.
struct LoraCase {
    int n, din, n_targets = 21, stride = 64;
    int targets[3] = {14, 15, 16};
    int douts[3] = {48, 24, 300};
    std::vector<int> slots;
    std::vector<std::vector<float>> a, bt;  // [slot * 3 + k]
    std::vector<int> ranks;                 // [slot * 3 + k]
    std::vector<float> scales = {0.5f, 2.0f, 0.125f, 1.0f / 64};
    std::vector<LoraEntry> table;
};

static LoraCase lora_case() {
    LoraCase c;
    c.slots = {0, 0, 0, -1, 1, 1, 2, 0, 0, 0, 0, 0, 0, 0, -1, -1, 2, 2, 3, 1, 3};
    c.n = (int)c.slots.size();
    c.din = 100;
    int rank_of[4] = {1, 4, 16, 64};
    c.table.assign((size_t)4 * c.n_targets, LoraEntry{nullptr, nullptr, 0, 0.0f});
    c.a.resize(12);
    c.bt.resize(12);
    c.ranks.assign(12, 0);
    for (int s = 0; s < 4; s++)
        for (int k = 0; k < 3; k++) {
            bool missing = (s == 1 && k == 1) || (s == 2 && k == 2);
            if (missing) continue;
            int r = rank_of[s], i = s * 3 + k;
            c.ranks[i] = r;
            c.a[i] = randn((size_t)r * c.din, 0.3f);
            c.bt[i] = randn((size_t)r * c.douts[k], 0.3f);
            c.table[(size_t)s * c.n_targets + c.targets[k]] = LoraEntry{c.a[i].data(), c.bt[i].data(), r, c.scales[s]};
        }
    // A target the call does not name, which must not be read.
    c.table[(size_t)0 * c.n_targets + 3] = LoraEntry{nullptr, nullptr, 7, NAN};
    return c;
}

// Runs the two kernels over `x` (f32 or bf16 bits) and the given slots; y[k] is updated in place.
template <typename X>
static void lora_run(const LoraCase& c, const std::vector<X>& x, const std::vector<int>& slots,
                     std::vector<std::vector<float>>& y) {
    int n = (int)slots.size();
    std::vector<float> mid((size_t)3 * n * c.stride, NAN);
    unsigned tiles = (unsigned)((n + LORA_TILE - 1) / LORA_TILE);
    launch({tiles, 3, (unsigned)(c.stride / LORA_RANKS)}, {32 * LORA_RANKS}, 0, [&] {
        if constexpr (sizeof(X) == 2)
            lora_shrink_bf16(x.data(), slots.data(), c.table.data(), c.n_targets, c.targets[0], c.targets[1],
                             c.targets[2], mid.data(), n, c.din, c.stride);
        else
            lora_shrink_f32(x.data(), slots.data(), c.table.data(), c.n_targets, c.targets[0], c.targets[1],
                            c.targets[2], mid.data(), n, c.din, c.stride);
    });
    launch({tiles, 2, 3}, {256}, 0, [&] {
        lora_expand(mid.data(), slots.data(), c.table.data(), c.n_targets, c.targets[0], c.targets[1], c.targets[2],
                    y[0].data(), y[1].data(), y[2].data(), c.douts[0], c.douts[1], c.douts[2], n, c.stride);
    });
}

// Checks y against the reference from x (f32 values); returns the largest error relative to its
// bound, ((din + rank + 2) * 2^-24 + extra) times the magnitudes (the check passes at <= 1), and
// counts the rows left bit-identical that must be.
static double lora_check(const LoraCase& c, const std::vector<float>& x, const std::vector<std::vector<float>>& y0,
                         const std::vector<std::vector<float>>& y, double extra, long long& untouched_ok,
                         long long& untouched_want) {
    double worst = 0;
    for (int k = 0; k < 3; k++)
        for (int t = 0; t < c.n; t++) {
            int s = c.slots[t], d = c.douts[k];
            int r = s < 0 ? 0 : c.ranks[s * 3 + k];
            if (r == 0) {
                untouched_want++;
                bool same = std::memcmp(&y[k][(size_t)t * d], &y0[k][(size_t)t * d], d * sizeof(float)) == 0;
                untouched_ok += same;
                continue;
            }
            const auto &a = c.a[s * 3 + k], &bt = c.bt[s * 3 + k];
            std::vector<double> mid(r), mag_mid(r);
            for (int j = 0; j < r; j++)
                for (int i = 0; i < c.din; i++) {
                    mid[j] += (double)x[(size_t)t * c.din + i] * a[(size_t)j * c.din + i];
                    mag_mid[j] += std::fabs((double)x[(size_t)t * c.din + i] * a[(size_t)j * c.din + i]);
                }
            for (int o = 0; o < d; o++) {
                double delta = 0, mag = 0;
                for (int j = 0; j < r; j++) {
                    delta += mid[j] * bt[(size_t)j * d + o];
                    mag += mag_mid[j] * std::fabs(bt[(size_t)j * d + o]);
                }
                double base = y0[k][(size_t)t * d + o], scale = c.scales[s];
                double want = base + scale * delta;
                double bound = (std::ldexp(1.0, -24) * (c.din + r + 2) + extra) * (std::fabs(base) + std::fabs(scale) * mag);
                double err = std::fabs((double)y[k][(size_t)t * d + o] - want);
                worst = std::max(worst, std::isnan(err) ? INFINITY : err / bound);
            }
        }
    return worst;
}

static void test_lora() {
    auto c = lora_case();
    auto x = randn((size_t)c.n * c.din);
    std::vector<std::vector<float>> y0;
    for (int k = 0; k < 3; k++) y0.push_back(randn((size_t)c.n * c.douts[k]));
    auto y = y0;
    lora_run(c, x, c.slots, y);
    long long ok = 0, want = 0;
    double worst = lora_check(c, x, y0, y, 0.0, ok, want);
    check("lora f32: shrink + expand, 3 projections, ranks 1/4/16/64 (error / its f32 bound)", worst, 1.0);
    check_eq("lora: rows without an adapter or without the target keep their bits", ok, want);

    // bf16 x: exact to f32 rounding from the rounded values, within 2^-8 of the unrounded ones.
    std::vector<unsigned short> x16(x.size());
    std::vector<float> xr(x.size());
    for (size_t i = 0; i < x.size(); i++) {
        x16[i] = (unsigned short)(__float_as_uint(bf16_round(x[i])) >> 16);
        xr[i] = __uint_as_float((unsigned)x16[i] << 16);
    }
    auto y16 = y0;
    lora_run(c, x16, c.slots, y16);
    ok = want = 0;
    check("lora bf16 x: against the rounded x (error / its f32 bound)", lora_check(c, xr, y0, y16, 0.0, ok, want), 1.0);
    check_eq("lora bf16 x: untouched rows keep their bits", ok, want);
    ok = want = 0;
    double bf = lora_check(c, x, y0, y16, 1.0 / 256, ok, want);
    check("lora bf16 x: against the unrounded x (error / a bf16 bound)", bf, 1.0);

    // A token's result does not depend on the tokens sharing its tile: each alone, bit for bit.
    long long same = 0, rows = 0;
    for (int t : {0, 2, 5, 8, 13, 18, 20}) {
        std::vector<float> xt(x.begin() + (size_t)t * c.din, x.begin() + (size_t)(t + 1) * c.din);
        std::vector<std::vector<float>> yt;
        for (int k = 0; k < 3; k++)
            yt.emplace_back(y0[k].begin() + (size_t)t * c.douts[k], y0[k].begin() + (size_t)(t + 1) * c.douts[k]);
        lora_run(c, xt, {c.slots[t]}, yt);
        for (int k = 0; k < 3; k++, rows++)
            same += std::memcmp(yt[k].data(), &y[k][(size_t)t * c.douts[k]], c.douts[k] * sizeof(float)) == 0;
    }
    check_eq("lora: a token alone gives the bits it gets in the mixed pass", same, rows);

    // No token with an adapter: nothing changes.
    auto yn = y0;
    lora_run(c, x, std::vector<int>(c.n, -1), yn);
    ok = 0;
    for (int k = 0; k < 3; k++) ok += yn[k] == y0[k];
    check_eq("lora: a pass without adapters changes nothing", ok, 3);
}

// `harness sample IN OUT`: runs sample_rows over the rows IN describes and writes what it gave to
// OUT, for kernels/tests/emulated.rs to compare with the engine's sampler. IN, little-endian: rows,
// vocab, bitmap words and threads per block (i32 each), then the kernel's inputs in argument order
// (logits, fpar, ipar, uni, bits). OUT: out_i then out_f.
static int run_sample(const char* in_path, const char* out_path) {
    FILE* in = std::fopen(in_path, "rb");
    if (!in) return 2;
    int head[4];
    if (std::fread(head, 4, 4, in) != 4) return 2;
    int rows = head[0], vocab = head[1], words = head[2], threads = head[3];
    std::vector<float> logits((size_t)rows * vocab), fpar(rows * 4);
    std::vector<int> ipar(rows * 4);
    std::vector<double> uni(rows);
    std::vector<unsigned> bits(std::max(words, 1));
    bool ok = std::fread(logits.data(), 4, logits.size(), in) == logits.size() &&
              std::fread(fpar.data(), 4, fpar.size(), in) == fpar.size() &&
              std::fread(ipar.data(), 4, ipar.size(), in) == ipar.size() &&
              std::fread(uni.data(), 8, uni.size(), in) == uni.size() &&
              std::fread(bits.data(), 4, words, in) == (size_t)words;
    std::fclose(in);
    if (!ok) return 2;
    std::vector<int> out_i((size_t)rows * SAMPLE_OUT_I, -7);
    std::vector<float> out_f((size_t)rows * SAMPLE_OUT_F, 0.0f);
    launch({(unsigned)rows}, {(unsigned)threads}, 0, [&] {
        sample_rows(logits.data(), vocab, fpar.data(), ipar.data(), uni.data(), bits.data(), out_i.data(), out_f.data());
    });
    FILE* out = std::fopen(out_path, "wb");
    if (!out) return 2;
    std::fwrite(out_i.data(), 4, out_i.size(), out);
    std::fwrite(out_f.data(), 4, out_f.size(), out);
    std::fclose(out);
    return 0;
}

// The kernel for model.cu's type number qt among one kernel per type, listed in the order Q8_0,
// Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (Q4_0's for an unknown number).
template <class K>
static K by_qtype(int qt, std::initializer_list<K> kernels) {
    static const int order[] = {8, 0, 1, 6, 7, 10, 11, 12, 13, 14};
    for (int i = 0; i < 10; i++)
        if (order[i] == qt) return kernels.begin()[i];
    return kernels.begin()[1];
}

// The quantized decode products (qgemv_*) on inputs the test writes: header (the type as model.cu
// numbers it, rows, cols, n, grid), the weights' GGUF blocks, then the bf16 inputs; writes
// y [n, rows] (f32).
static int run_qgemv(const char* in_path, const char* out_path) {
    FILE* in = std::fopen(in_path, "rb");
    if (!in) return 2;
    int head[5];
    if (std::fread(head, 4, 5, in) != 5) return 2;
    int qt = head[0], rows = head[1], cols = head[2], n = head[3], grid = head[4];
    size_t bytes = (size_t)rows * qrow_bytes(qt, cols);
    std::vector<unsigned char> w(bytes);
    std::vector<bf16_t> x((size_t)n * cols);
    bool ok = std::fread(w.data(), 1, bytes, in) == bytes && std::fread(x.data(), 2, x.size(), in) == x.size();
    std::fclose(in);
    if (!ok) return 2;
    auto kernel = by_qtype(qt, {qgemv_q8_0, qgemv_q4_0, qgemv_q4_1, qgemv_q5_0, qgemv_q5_1, qgemv_q2_k, qgemv_q3_k,
                                qgemv_q4_k, qgemv_q5_k, qgemv_q6_k});
    std::vector<float> y((size_t)n * rows, NAN);
    launch({(unsigned)grid}, {GV_THREADS}, (size_t)n * cols / 2, [&] { kernel(w.data(), rows, cols, x.data(), y.data(), n); });
    FILE* out = std::fopen(out_path, "wb");
    if (!out) return 2;
    std::fwrite(y.data(), 4, y.size(), out);
    std::fclose(out);
    return 0;
}

// The prompt path's dequantization (qdequant_*) on blocks the test writes: header (the type as
// model.cu numbers it, the sub-blocks of 32, grid), then the blocks; writes the bf16 weights.
static int run_qdequant(const char* in_path, const char* out_path) {
    FILE* in = std::fopen(in_path, "rb");
    if (!in) return 2;
    int head[3];
    if (std::fread(head, 4, 3, in) != 3) return 2;
    int qt = head[0], count = head[1], grid = head[2];
    size_t bytes = qrow_bytes(qt, count * 32);
    std::vector<unsigned char> w(bytes);
    bool ok = std::fread(w.data(), 1, bytes, in) == bytes;
    std::fclose(in);
    if (!ok) return 2;
    auto kernel = by_qtype(qt, {qdequant_q8_0, qdequant_q4_0, qdequant_q4_1, qdequant_q5_0, qdequant_q5_1, qdequant_q2_k,
                                qdequant_q3_k, qdequant_q4_k, qdequant_q5_k, qdequant_q6_k});
    std::vector<bf16_t> y((size_t)count * 32, 0xFFFF);
    launch({(unsigned)grid}, {64}, 0, [&] { kernel(w.data(), count, y.data()); });
    FILE* out = std::fopen(out_path, "wb");
    if (!out) return 2;
    std::fwrite(y.data(), 2, y.size(), out);
    std::fclose(out);
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 4 && std::string(argv[1]) == "sample") return run_sample(argv[2], argv[3]);
    if (argc == 4 && std::string(argv[1]) == "qdequant") return run_qdequant(argv[2], argv[3]);
    if (argc == 4 && std::string(argv[1]) == "qgemv") return run_qgemv(argv[2], argv[3]);
    test_rms_norm();
    test_add_rms_norm();
    test_fused_projections();
    test_gemv(1, 72, 96, 2);
    test_gemv(3, 40, 264, 1);
    test_gemv(8, 24, 1024, 2);
    test_moe_decode(0);
    test_moe_decode(1);
    test_moe_routed(0);
    test_moe_routed(1);
    test_head_norm_rope();
    test_elementwise();
    test_embed_scaled();
    test_gather_rows();
    test_gelu_tanh_mul();
    test_softcap();
    test_fp8_conversions();
    test_attention<float>(0, 1, "attention: paged + in-pass K/V, GQA, one slice");
    test_attention<float>(0, 3, "attention: split into 3 slices, merged");
    test_attention<float>(4, 2, "attention: sliding window of 4, 2 slices (some empty)");
    test_attention<float>(0, 16, "attention: more slices than positions");
    test_attention<float>(5, 3, "attention: scores soft-capped at 50, sliding window of 5, 3 slices", 50.0f, 40.0f);
    test_attention<float>(0, 2, "attention: scores soft-capped at 50, 2 slices", 50.0f, 40.0f);
    test_attention<bf16_t>(0, 3, "attention: split into 3 slices, merged");
    test_attention<bf16_t>(4, 2, "attention: sliding window of 4, 2 slices (some empty)");
    test_attention<fp8_t>(0, 3, "attention: split into 3 slices, merged");
    test_attention<fp8_t>(5, 3, "attention: scores soft-capped at 50, sliding window of 5, 3 slices", 50.0f, 40.0f);
    test_attention_tiled<float>(4, 2, 40, 2, 0, 0.0f, 1.0f, "tiled attention: GQA 2, 8 tokens per tile");
    test_attention_tiled<float>(8, 2, 32, 4, 0, 0.0f, 1.0f, "tiled attention: GQA 4, 4 tokens per tile");
    test_attention_tiled<float>(8, 2, 32, 2, 0, 0.0f, 1.0f, "tiled attention: GQA 4 split in 2 groups of 2 heads");
    test_attention_tiled<float>(16, 1, 16, 16, 0, 0.0f, 1.0f, "tiled attention: MQA, 16 heads, 1 token per tile");
    test_attention_tiled<float>(2, 2, 256, 1, 0, 0.0f, 1.0f, "tiled attention: head_dim 256, 16 tokens per tile");
    test_attention_tiled<float>(4, 2, 40, 2, 5, 0.0f, 1.0f, "tiled attention: sliding window of 5");
    test_attention_tiled<float>(4, 2, 40, 2, 19, 0.0f, 1.0f, "tiled attention: sliding window of 19 (across key tiles)");
    test_attention_tiled<float>(4, 2, 40, 2, 7, 50.0f, 40.0f, "tiled attention: soft-capped at 50, window of 7");
    test_attention_tiled<bf16_t>(4, 2, 40, 2, 0, 0.0f, 1.0f, "tiled attention: GQA 2, 8 tokens per tile");
    test_attention_tiled<bf16_t>(4, 2, 40, 2, 19, 0.0f, 1.0f, "tiled attention: sliding window of 19 (across key tiles)");
    test_attention_tiled<fp8_t>(8, 2, 32, 4, 0, 0.0f, 1.0f, "tiled attention: GQA 4, 4 tokens per tile");
    test_attention_tiled<fp8_t>(4, 2, 40, 2, 7, 50.0f, 40.0f, "tiled attention: soft-capped at 50, window of 7");
    test_attention_mma<float, 64>(4, 2, 40, 2, 0, 0.0f, 1.0f, "tensor-core attention: head_dim 40 in 64, GQA 2, 32 tokens per tile");
    test_attention_mma<bf16_t, 64>(4, 2, 64, 2, 0, 0.0f, 1.0f, "tensor-core attention: head_dim 64, GQA 2");
    test_attention_mma<fp8_t, 64>(8, 1, 64, 8, 0, 0.0f, 1.0f, "tensor-core attention: GQA 8, 8 tokens per tile");
    test_attention_mma<bf16_t, 64>(7, 1, 32, 7, 0, 0.0f, 1.0f, "tensor-core attention: 7 heads per KV head, 63 rows");
    test_attention_mma<float, 64>(16, 1, 16, 16, 0, 0.0f, 1.0f, "tensor-core attention: MQA, 16 heads, 4 tokens per tile");
    test_attention_mma<bf16_t, 64>(4, 2, 40, 2, 70, 0.0f, 1.0f, "tensor-core attention: sliding window of 70 (across key tiles)");
    test_attention_mma<bf16_t, 64>(4, 2, 40, 1, 5, 0.0f, 1.0f, "tensor-core attention: sliding window of 5, 2 groups of 1 head");
    test_attention_mma<fp8_t, 64>(4, 2, 40, 2, 7, 50.0f, 40.0f, "tensor-core attention: soft-capped at 50, window of 7");
    test_attention_mma<bf16_t, 128>(4, 2, 128, 2, 0, 0.0f, 1.0f, "tensor-core attention: head_dim 128 (Qwen3's)");
    test_attention_mma<float, 128>(2, 2, 96, 1, 0, 0.0f, 1.0f, "tensor-core attention: head_dim 96 in 128, MHA, 64 tokens per tile");
    test_attention_mma<bf16_t, 256>(4, 1, 256, 4, 0, 0.0f, 1.0f, "tensor-core attention: head_dim 256, 32 keys per tile");
    test_attention_mma<fp8_t, 256>(2, 1, 256, 2, 19, 30.0f, 30.0f, "tensor-core attention: head_dim 256, soft-capped, window of 19");
    test_kv<float>();
    test_kv<bf16_t>();
    test_kv<fp8_t>();
    test_greedy();
    test_moe();
    test_lora();
    std::printf("%d failed\n", failures);
    return failures ? 1 : 0;
}
