// The operations decoder forward passes are written in (engine/src/models): every model family
// is a sequence of these kernels and cuBLAS GEMMs; no kernel knows a family.
//
// Conventions, shared with the host code in engine/src/cuda:
// - No CUDA headers: NVRTC compiles this file alone. bf16 values travel as `unsigned short` and are
//   converted with bit operations (round to nearest even, NaN kept quiet).
// - The residual stream, Q/K/V, norms, RoPE and attention's arithmetic are f32. Matrix inputs (the
//   operands of the cuBLAS GEMMs) are bf16 or f32 depending on the backend's compute dtype; kernels
//   that produce them come in `_bf16` and `_f32` variants.
// - The KV pool stores f32, bf16 or fp8 (E4M3, scale 1, saturating); the kernels that write or read
//   it come in one variant per pool dtype, named by a `_f32`/`_bf16`/`_fp8` suffix (`_kv...` after
//   the output's suffix for tiled attention). kv_write rounds the pass's fresh K/V in place to the
//   pool's dtype, so attention reads the same values from this pass as later from the pool. The
//   conversions are the CPU backend's bit rules (engine/src/kv/dtype.rs).
// - Every per-token or per-sequence quantity of a pass (token ids, positions, pool slots, block
//   tables) is read from device memory, never passed by value, so a captured CUDA graph replays
//   correctly after the host rewrites that memory. Launch parameters depend only on the model, the
//   number of tokens and the split count.
// - Sums of squares accumulate in double, as the CPU backend does, so both round alike.
// - Kernels the host may launch with up to 1024 threads per block say so (__launch_bounds__), so
//   the compiler never gives them more registers than such a block can have.

typedef unsigned short bf16_t;
typedef unsigned char fp8_t;
typedef unsigned int u32;

// Sixteen bytes, for vector loads.
struct alignas(16) u32x4 {
    u32 x, y, z, w;
};
// Dynamic shared memory, sized per launch (the kernels that use it say how).
extern __shared__ u32x4 sm_dyn[];

// Programmatic dependent launch (sm_90 and later): every kernel waits here, before touching
// memory, until the kernel before it on the stream has finished and its writes are visible, and
// lets the next kernel start its launch at once. The host launches with programmatic stream
// serialization where the device has it, so a kernel's launch overlaps its predecessor's tail;
// elsewhere (and on the CPU emulation) both are no-ops and launches are ordered as usual.
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

#define MAX_HD_REGS 8  // head_dim up to 256: values one lane holds of a head (attention, qkv_split)

__device__ __forceinline__ float ld(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, size_t i) {
    return __uint_as_float(((u32)p[i]) << 16);
}
__device__ __forceinline__ void st(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16_t* p, size_t i, float v) {
    u32 u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        p[i] = (bf16_t)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (bf16_t)(u >> 16);
}
// fp8 E4M3 (`e4m3fn`: bias 7, no infinities, 0x7f/0xff NaN). A code's low seven bits plus 120 << 3
// are an f32's exponent and top significand bits once shifted up by 20; codes below 8 are m · 2^-9.
__device__ __forceinline__ float ld(const fp8_t* p, size_t i) {
    u32 b = p[i], mag = b & 0x7fu;
    float f = mag == 0x7fu ? __uint_as_float(0x7fc00000u)
              : mag >= 8u  ? __uint_as_float((mag + (120u << 3)) << 20)
                           : (float)mag * (1.0f / 512.0f);
    return (b & 0x80u) ? -f : f;
}
// Round to nearest, ties to even; magnitudes at or beyond 448 (infinities too) saturate to ±448;
// NaN keeps its sign.
__device__ __forceinline__ void st(fp8_t* p, size_t i, float v) {
    u32 b = __float_as_uint(v), sign = (b >> 24) & 0x80u, a = b & 0x7fffffffu, code;
    if (a > 0x7f800000u) {
        code = 0x7fu;
    } else if (a >= 0x43e00000u) {
        code = 0x7eu;
    } else if (a < 0x3c800000u) {
        code = (u32)rintf(__uint_as_float(a) * 512.0f);  // exact scaling; 8 is the smallest normal
    } else {
        u32 r = a + 0x7ffffu + ((a >> 20) & 1u);
        code = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);
    }
    p[i] = (fp8_t)(sign | code);
}
// `v` as a pool of `P` gives it back.
template <typename P>
__device__ __forceinline__ float kv_round(float v) {
    P tmp[1];
    st(tmp, 0, v);
    return ld(tmp, 0);
}
// A fresh K or V value: rounded in place to what a pool of `P` holds (a no-op for f32), and stored
// at pool[at] unless `at` is negative (a staged token, or no pool).
template <typename P>
__device__ __forceinline__ void kv_keep(float* fresh, P* pool, long long at) {
    float r = kv_round<P>(*fresh);
    if (sizeof(P) != sizeof(float)) *fresh = r;
    if (at >= 0) st(pool, (size_t)at, r);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ double block_sum_d(double v) {
    __shared__ double part[32];
    __shared__ double total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_d(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double s = lane < nw ? part[lane] : 0.0;
        s = warp_sum_d(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// ---- embedding -------------------------------------------------------------------------------

// x[t, :] = table[tokens[t], :] * scale (1 when the model does not scale: exact). Grid: one block
// per token.
template <typename W>
__device__ void embed_impl(const W* table, const u32* tokens, float* x, int h, float scale) {
    size_t t = blockIdx.x;
    size_t row = (size_t)tokens[t] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) x[t * h + i] = ld(table, row + i) * scale;
}
extern "C" __global__ void embed_bf16(const bf16_t* table, const u32* tokens, float* x, int h, float scale) {
    grid_dep_wait();
    embed_impl(table, tokens, x, h, scale);
}
extern "C" __global__ void embed_f32(const float* table, const u32* tokens, float* x, int h, float scale) {
    grid_dep_wait();
    embed_impl(table, tokens, x, h, scale);
}

// out[r, :] = x[rows[r], :] for the rows that return logits. Grid: one block per output row.
extern "C" __global__ void gather_rows(const float* x, const int* rows, float* out, int width) {
    grid_dep_wait();
    size_t r = blockIdx.x;
    const float* src = x + (size_t)rows[r] * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[r * width + i] = src[i];
}

// ---- RMSNorm ---------------------------------------------------------------------------------

// This thread's share of the sum of squares of the row `xr` (h values), in double.
__device__ __forceinline__ double row_sum_sq(const float* xr, int h) {
    double ss = 0.0;
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        double v = xr[i];
        ss += v * v;
    }
    return ss;
}

// The end of an RMSNorm of the row `xr` (h values) whose threads hold partial sums of squares
// `ss`: out[i] = w[i] * (xr[i] / rms). Every thread of the block calls it.
template <typename O>
__device__ void norm_row(const float* xr, double ss, const float* w, O* out, int h, float eps) {
    ss = block_sum_d(ss);
    float inv = 1.0f / sqrtf((float)(ss / h) + eps);
    for (int i = threadIdx.x; i < h; i += blockDim.x) st(out, i, w[i] * (xr[i] * inv));
}

// out[r, :] = w * (x[src, :] / rms(x[src, :])), src = rows ? rows[r] : r. Grid: one block per row.
template <typename O>
__device__ void rms_norm_impl(const float* x, const float* w, const int* rows, O* out, int h, float eps) {
    size_t r = blockIdx.x;
    size_t src = rows ? (size_t)rows[r] : r;
    const float* xr = x + src * h;
    norm_row(xr, row_sum_sq(xr, h), w, out + r * h, h, eps);
}
extern "C" __global__ void __launch_bounds__(1024) rms_norm_bf16(const float* x, const float* w, const int* rows, bf16_t* out, int h,
                                         float eps) {
    grid_dep_wait();
    rms_norm_impl(x, w, rows, out, h, eps);
}
extern "C" __global__ void __launch_bounds__(1024) rms_norm_f32(const float* x, const float* w, const int* rows, float* out, int h,
                                        float eps) {
    grid_dep_wait();
    rms_norm_impl(x, w, rows, out, h, eps);
}

// x[r, :] += y[r, :], then out[r, :] = w * (x[r, :] / rms(x[r, :])): the residual add and the norm
// that reads it, in one launch, with add_inplace's and rms_norm's arithmetic (each thread adds
// and later reads the same elements, so the sums are those of the two kernels). Grid: one block
// per row.
template <typename O>
__device__ void add_rms_norm_impl(float* x, const float* y, const float* w, O* out, int h, float eps) {
    size_t r = blockIdx.x;
    float* xr = x + r * h;
    const float* yr = y + r * h;
    double ss = 0.0;
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        float s = xr[i] + yr[i];
        xr[i] = s;
        double v = s;
        ss += v * v;
    }
    norm_row(xr, ss, w, out + r * h, h, eps);
}
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_bf16(float* x, const float* y, const float* w,
                                                                    bf16_t* out, int h, float eps) {
    grid_dep_wait();
    add_rms_norm_impl(x, y, w, out, h, eps);
}
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_f32(float* x, const float* y, const float* w,
                                                                   float* out, int h, float eps) {
    grid_dep_wait();
    add_rms_norm_impl(x, y, w, out, h, eps);
}

// In-place RMSNorm of `n_rows` rows of `hd` values (Qwen3's per-head q/k norm). One warp per row;
// blockDim.x = 128.
extern "C" __global__ void head_rms_norm(float* x, const float* w, int n_rows, int hd, float eps) {
    grid_dep_wait();
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= n_rows) return;
    float* xr = x + (size_t)row * hd;
    double ss = 0.0;
    for (int i = lane; i < hd; i += 32) {
        double v = xr[i];
        ss += v * v;
    }
    ss = warp_sum_d(ss);
    float inv = 1.0f / sqrtf((float)(ss / hd) + eps);
    for (int i = lane; i < hd; i += 32) xr[i] = w[i] * (xr[i] * inv);
}

// ---- elementwise -----------------------------------------------------------------------------

// y[t, j] += b[j] for a [n, width] matrix.
extern "C" __global__ void add_bias(float* y, const float* b, long long count, int width) {
    grid_dep_wait();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x)
        y[i] += b[i % width];
}

// x += y.
extern "C" __global__ void add_inplace(float* x, const float* y, long long count) {
    grid_dep_wait();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

// The gated activations, shared by the kernels over separate gate/up buffers and over one fused
// gate/up matrix, so both compute the same bits.
__device__ __forceinline__ float silu_of(float g) { return g / (1.0f + expf(-g)); }
// PyTorch's tanh approximation of GELU, in the CPU backend's operation order.
__device__ __forceinline__ float gelu_tanh_of(float g) {
    const float k = 0.7978846f;  // sqrt(2/pi) as f32
    float inner = k * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.0f + tanhf(inner));
}
// act(gate) * up for ACT 0 (SiLU) or 1 (GELU-tanh): what every fused gated activation writes.
template <int ACT>
__device__ __forceinline__ float gated_of(float g, float u) {
    return (ACT == 0 ? silu_of(g) : gelu_tanh_of(g)) * u;
}

// out = silu(gate) * up, SwiGLU's activation, written in the matrix-input dtype.
template <typename O>
__device__ void silu_mul_impl(const float* gate, const float* up, O* out, long long count) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        st(out, i, silu_of(gate[i]) * up[i]);
    }
}
extern "C" __global__ void silu_mul_bf16(const float* gate, const float* up, bf16_t* out, long long count) {
    grid_dep_wait();
    silu_mul_impl(gate, up, out, count);
}
extern "C" __global__ void silu_mul_f32(const float* gate, const float* up, float* out, long long count) {
    grid_dep_wait();
    silu_mul_impl(gate, up, out, count);
}

// out = gelu_tanh(gate) * up, GeGLU's activation (PyTorch's tanh approximation, same operation
// order as the CPU backend), written in the dtype of the output buffer.
template <typename O>
__device__ void gelu_tanh_mul_impl(const float* gate, const float* up, O* out, long long count) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        st(out, i, gelu_tanh_of(gate[i]) * up[i]);
    }
}
extern "C" __global__ void gelu_tanh_mul_bf16(const float* gate, const float* up, bf16_t* out, long long count) {
    grid_dep_wait();
    gelu_tanh_mul_impl(gate, up, out, count);
}
extern "C" __global__ void gelu_tanh_mul_f32(const float* gate, const float* up, float* out, long long count) {
    grid_dep_wait();
    gelu_tanh_mul_impl(gate, up, out, count);
}

// ---- fused projections -----------------------------------------------------------------------

// out[t, j] = act(gu[t, j]) * gu[t, f + j] over a [n, 2f] matrix from one GEMM of the fused
// gate/up weights; `count` = n * f. act 0: SiLU, 1: GELU (tanh).
template <int ACT, typename O>
__device__ void gated_fused_impl(const float* gu, O* out, int f, long long count) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = i / f, j = i % f;
        const float* row = gu + t * 2 * f;
        float g = row[j];
        st(out, i, gated_of<ACT>(g, row[f + j]));
    }
}
#define GATED_FUSED_KERNEL(NAME, ACT, SFX, O)                                                         \
    extern "C" __global__ void NAME##_fused_##SFX(const float* gu, O* out, int f, long long count) { grid_dep_wait(); \
        gated_fused_impl<ACT>(gu, out, f, count);                                                     \
    }
GATED_FUSED_KERNEL(silu_mul, 0, bf16, bf16_t)
GATED_FUSED_KERNEL(silu_mul, 0, f32, float)
GATED_FUSED_KERNEL(gelu_tanh_mul, 1, bf16, bf16_t)
GATED_FUSED_KERNEL(gelu_tanh_mul, 1, f32, float)

// ---- decode products of our own (bf16 weights, a few tokens) ------------------------------------

// y = x · Wᵀ for passes of at most GV_MAX_N tokens (decode steps), reading each bf16 weight once
// in 16-byte loads, with what surrounds the product fused in:
// - input: IN 0 takes x as a bf16 matrix input [n, cols]; IN 1 takes the f32 residual stream and
//   RMS-normalizes it first (weight nw, eps), with rms_norm's arithmetic and bf16 rounding, and
//   block 0 also writes the normalized rows to xn_out (what rms_norm would have written);
// - output: OUT 0 stores y [n, rows] (f32); OUT 1 stores y and adds it into the residual stream
//   res [n, rows] (an output projection and its residual add); OUT 2 and 3 read the fused
//   gate/up matrix (gate rows 0..rows, up rows rows..2·rows) and store act(gate) · up as the
//   bf16 matrix input out [n, rows] (SiLU and GELU-tanh, as silu_mul_fused computes them).
// The block's tokens sit in dynamic shared memory as bf16 (n · cols · 2 bytes); each warp owns
// one output row (or gate/up pair) at a time, its lanes striding over the columns 8 at a time,
// so every output is written by exactly one lane. Needs cols % 8 == 0, 16-byte aligned rows,
// n <= GV_MAX_N, blockDim.x a multiple of 32.
#define GV_MAX_N 8
#define GV_THREADS 256
__device__ __forceinline__ void bf16x8(u32x4 v, float* f) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
// The n tokens' sums of one weight row (and of its up row when gated) over the bf16 inputs in
// shared memory xs [n, cols], by one warp: each lane strides over the columns 8 at a time, then
// the warp reduces. Every lane returns the sums.
template <bool GATED>
__device__ __forceinline__ void gemv_row(const bf16_t* wg, const bf16_t* wu, const bf16_t* xs, int cols, int n,
                                         float* acc, float* acc_up) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < GV_MAX_N; t++) acc[t] = acc_up[t] = 0.0f;
#pragma unroll 2
    for (int c = lane * 8; c < cols; c += 256) {
        float wf[8], uf[8];
        bf16x8(*(const u32x4*)(wg + c), wf);
        if (GATED) bf16x8(*(const u32x4*)(wu + c), uf);
#pragma unroll
        for (int t = 0; t < GV_MAX_N; t++) {
            if (t < n) {
                float xf[8];
                bf16x8(*(const u32x4*)(xs + (size_t)t * cols + c), xf);
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    acc[t] += wf[j] * xf[j];
                    if (GATED) acc_up[t] += uf[j] * xf[j];
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < GV_MAX_N; t++) {
        if (t < n) {
            acc[t] = warp_sum(acc[t]);
            if (GATED) acc_up[t] = warp_sum(acc_up[t]);
        }
    }
}
// Copies `count` bf16 values (a multiple of 8) from global memory into shared memory.
__device__ __forceinline__ void stage_bf16(const bf16_t* src, bf16_t* dst, int count) {
    for (int i = threadIdx.x; i < count / 8; i += blockDim.x) ((u32x4*)dst)[i] = ((const u32x4*)src)[i];
}
template <int IN, int OUT>
__device__ void gemv_impl(const bf16_t* W, int rows, int cols, const bf16_t* xm, const float* xr, const float* nw,
                          float eps, bf16_t* xn_out, float* y, float* res, bf16_t* out, int n) {
    bf16_t* xs = (bf16_t*)sm_dyn;
    if (IN == 0) {
        stage_bf16(xm, xs, n * cols);
    } else {
        for (int t = 0; t < n; t++) {
            const float* x = xr + (size_t)t * cols;
            bf16_t* row = xs + (size_t)t * cols;
            norm_row(x, row_sum_sq(x, cols), nw, row, cols, eps);
            // Each thread copies the elements it normalized itself.
            if (blockIdx.x == 0 && xn_out)
                for (int i = threadIdx.x; i < cols; i += blockDim.x) xn_out[(size_t)t * cols + i] = row[i];
        }
    }
    __syncthreads();
    const bool gated = OUT >= 2;
    int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (int r = blockIdx.x * nwarps + (threadIdx.x >> 5); r < rows; r += gridDim.x * nwarps) {
        float acc[GV_MAX_N], acc_up[GV_MAX_N];
        const bf16_t* wg = W + (size_t)r * cols;
        gemv_row<gated>(wg, gated ? W + (size_t)(rows + r) * cols : wg, xs, cols, n, acc, acc_up);
#pragma unroll
        for (int t = 0; t < GV_MAX_N; t++) {
            if (t < n) {
                float g = acc[t], u = acc_up[t];
                if (lane == 0) {
                    size_t at = (size_t)t * rows + r;
                    if (OUT == 0 || OUT == 1) y[at] = g;
                    if (OUT == 1) res[at] += g;
                    if (OUT >= 2) st(out, at, gated_of<OUT == 3>(g, u));
                }
            }
        }
    }
}
#define GEMV_KERNEL(NAME, IN, OUT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GV_THREADS)                                                       \
        NAME(const bf16_t* W, int rows, int cols, const bf16_t* xm, const float* xr, const float* nw, float eps,   \
             bf16_t* xn_out, float* y, float* res, bf16_t* out, int n) { grid_dep_wait();                                           \
        gemv_impl<IN, OUT>(W, rows, cols, xm, xr, nw, eps, xn_out, y, res, out, n);                               \
    }
GEMV_KERNEL(gemv_mat, 0, 0)
GEMV_KERNEL(gemv_mat_add, 0, 1)
GEMV_KERNEL(gemv_norm, 1, 0)
GEMV_KERNEL(gemv_mat_silu, 0, 2)
GEMV_KERNEL(gemv_mat_gelu, 0, 3)
GEMV_KERNEL(gemv_norm_silu, 1, 2)
GEMV_KERNEL(gemv_norm_gelu, 1, 3)

// Decode products over GGUF weights kept in their file's blocks, for passes of at most GV_MAX_N
// tokens. A row is its blocks back to back, rows back to back, as the file stores them. QT names
// the type:
// - 8 = Q8_0 (f16 scale d, 32 int8: 34 bytes; weight d·q);
// - 0 = Q4_0 (f16 d, 16 bytes of nibbles: element i < 16 is byte i's low half, element i ≥ 16 byte
//   i − 16's high half; weight d·(q − 8): 18 bytes);
// - 1 = Q4_1 (f16 d, f16 minimum, the nibbles; weight d·q + minimum: 20 bytes);
// - 6 = Q5_0 (f16 d, a u32 whose bit i is element i's fifth bit, the nibbles as Q4_0's; weight
//   d·(q − 16): 22 bytes);
// - 7 = Q5_1 (f16 d, f16 minimum, then as Q5_0; weight d·q + minimum: 24 bytes);
// - 10 = Q2_K, a super-block of 256 (16 bytes of 4-bit scale and minimum pairs, one per 16
//   weights, 64 bytes of 2-bit quants, f16 d, f16 dmin: 84 bytes; weights d·sc·q − dmin·m, element
//   32·s + l of each half of 128 in bits 2s of byte l of that half's 32);
// - 11 = Q3_K (32 bytes of high bits, 64 of low bit pairs laid out as Q2_K's, 12 bytes of sixteen
//   packed 6-bit scales offset by 32, f16 d: 110 bytes; weights d·(sc − 32)·(q − 4 when the high
//   bit, bit 32·k + l's k of byte l, is clear));
// - 12 = Q4_K, a super-block of 256 (f16 d, f16 dmin, 12 bytes of packed 6-bit scales and
//   minimums, 128 bytes of nibbles: 144 bytes; sub-block j's weights d·sc_j·q − dmin·m_j, its
//   nibbles the low (j even) or high (j odd) halves of bytes 32·(j/2) ..);
// - 13 = Q5_K (as Q4_K with 32 bytes of fifth bits before the nibbles, bit j of byte l for element
//   l of sub-block j: 176 bytes);
// - 14 = Q6_K (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, f16 d: 210 bytes;
//   each 16 weights d·sc·(q − 32)).
// A warp owns a row, and its lanes take the row's sub-blocks of 32 weights in turn: each becomes 32
// small integers (exact as floats), each token's Σ q·x over its two halves of 16 is scaled once per
// half, less each half's minimum times its Σ x, and the warp reduces. Numerics: the dequantized row times the
// bf16 inputs, in f32, in a different order than the CPU's dequantize-then-dot. Needs cols a
// multiple of the block, n <= GV_MAX_N, blockDim.x a multiple of 32; dynamic shared memory
// n · cols · 2 bytes.
__device__ __forceinline__ float f16_bits(u32 h) {
    u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) return __uint_as_float(sign | __float_as_uint((float)m * 5.9604644775390625e-8f));  // m · 2^-24
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}
// The bytes of one block of type qt (256 weights for the k-quants, 32 for the others), and of a
// row of cols weights (the kernels and the emulation harness both size rows by it).
__device__ __forceinline__ constexpr int qblock_bytes(int qt) {
    return qt == 8    ? 34
           : qt == 0  ? 18
           : qt == 1  ? 20
           : qt == 6  ? 22
           : qt == 7  ? 24
           : qt == 10 ? 84
           : qt == 11 ? 110
           : qt == 12 ? 144
           : qt == 13 ? 176
                      : 210;
}
__device__ __forceinline__ size_t qrow_bytes(int qt, int cols) {
    return (size_t)(cols / (qt >= 10 ? 256 : 32)) * qblock_bytes(qt);
}
// Q3_K's j-th 6-bit scale (before the offset of 32), from its 12 packed bytes q.
__device__ __forceinline__ int q3k_scale(const unsigned char* q, int j) {
    int low = j < 8 ? q[j] & 15 : q[j - 8] >> 4;
    return low | (((q[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
}
// Q4_K's and Q5_K's j-th 6-bit scale and minimum, from their 12 packed bytes q.
__device__ __forceinline__ void kq_scale_min(const unsigned char* q, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}
// Sub-block u (weights 32·u ..) of the row at w: its 32 integer weights wq, the scales a and b of
// its halves of 16, and the minimums m[0] and m[1] each half takes off per unit of input (Q4_1's
// and Q5_1's are added: m holds their negative; 0 for types without one).
template <int QT>
__device__ __forceinline__ void q_sub_block(const unsigned char* w, int u, float* wq, float* a, float* b, float* m) {
    if constexpr (QT == 10 || QT == 11) {
        const unsigned char* blk = w + (size_t)(u / 8) * qblock_bytes(QT);
        int j = u % 8, half = j / 4, s = j % 4;
        const unsigned char* q = blk + (QT == 10 ? 16 : 32) + 32 * half;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> (2 * s)) & 3;
            if (QT == 11) v -= ((blk[l] >> j) & 1) ? 0 : 4;
            wq[l] = (float)v;
        }
        if constexpr (QT == 10) {
            float d = f16_bits((u32)blk[80] | ((u32)blk[81] << 8)), dmin = f16_bits((u32)blk[82] | ((u32)blk[83] << 8));
            u32 s0 = blk[2 * j], s1 = blk[2 * j + 1];
            *a = d * (float)(s0 & 15u);
            *b = d * (float)(s1 & 15u);
            m[0] = dmin * (float)(s0 >> 4);
            m[1] = dmin * (float)(s1 >> 4);
        } else {
            float d = f16_bits((u32)blk[108] | ((u32)blk[109] << 8));
            *a = d * (float)(q3k_scale(blk + 96, 2 * j) - 32);
            *b = d * (float)(q3k_scale(blk + 96, 2 * j + 1) - 32);
            m[0] = m[1] = 0.0f;
        }
    } else if constexpr (QT == 6 || QT == 7) {
        const unsigned char* blk = w + (size_t)u * qblock_bytes(QT);
        constexpr int QH = QT == 7 ? 4 : 2;
        *a = *b = f16_bits((u32)blk[0] | ((u32)blk[1] << 8));
        m[0] = m[1] = QT == 7 ? -f16_bits((u32)blk[2] | ((u32)blk[3] << 8)) : 0.0f;
        u32 qh = (u32)blk[QH] | ((u32)blk[QH + 1] << 8) | ((u32)blk[QH + 2] << 16) | ((u32)blk[QH + 3] << 24);
        const unsigned char* qs = blk + QH + 4;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            u32 byte = qs[i & 15];
            int v = (int)((i < 16 ? (byte & 15u) : (byte >> 4)) | (((qh >> i) & 1u) << 4));
            wq[i] = (float)(QT == 6 ? v - 16 : v);
        }
    } else if constexpr (QT == 14) {
        const unsigned char* blk = w + (size_t)(u / 8) * qblock_bytes(QT);
        int j = u % 8, half = j / 4, k = j % 4;
        float d = f16_bits((u32)blk[208] | ((u32)blk[209] << 8));
        const unsigned char *ql = blk + 64 * half + (k & 1) * 32, *qh = blk + 128 + 32 * half;
        const signed char* scales = (const signed char*)(blk + 192) + 8 * half + 2 * k;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int lo = (k < 2 ? ql[l] & 15 : ql[l] >> 4), hi = (qh[l] >> (2 * k)) & 3;
            wq[l] = (float)((lo | (hi << 4)) - 32);
        }
        *a = d * (float)scales[0];
        *b = d * (float)scales[1];
        m[0] = m[1] = 0.0f;
    } else if constexpr (QT >= 12) {
        const unsigned char* blk = w + (size_t)(u / 8) * qblock_bytes(QT);
        int j = u % 8, sc, mn;
        float d = f16_bits((u32)blk[0] | ((u32)blk[1] << 8)), dmin = f16_bits((u32)blk[2] | ((u32)blk[3] << 8));
        kq_scale_min(blk + 4, j, &sc, &mn);
        const unsigned char* qs = blk + (QT == 13 ? 48 : 16) + 32 * (j / 2);
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int q = j % 2 ? qs[l] >> 4 : qs[l] & 15;
            if (QT == 13) q += ((blk[16 + l] >> j) & 1) << 4;
            wq[l] = (float)q;
        }
        *a = *b = d * (float)sc;
        m[0] = m[1] = dmin * (float)mn;
    } else {
        constexpr int QAT = QT == 1 ? 4 : 2;
        const unsigned char* blk = w + (size_t)u * qblock_bytes(QT);
        *a = *b = f16_bits((u32)blk[0] | ((u32)blk[1] << 8));
        m[0] = m[1] = QT == 1 ? -f16_bits((u32)blk[2] | ((u32)blk[3] << 8)) : 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            if (QT == 8) wq[i] = (float)(signed char)blk[QAT + i];
            else {
                u32 byte = blk[QAT + (i & 15)];
                wq[i] = (float)(int)(i < 16 ? (byte & 15u) : (byte >> 4)) - (QT == 0 ? 8.0f : 0.0f);
            }
        }
    }
}
// The n tokens' sums of one row (xs [n, cols] in shared memory), by one warp; every lane returns
// them.
template <int QT>
__device__ __forceinline__ void qgemv_row(const unsigned char* w, const bf16_t* xs, int cols, int n, float* acc) {
    constexpr bool MIN = QT == 1 || QT == 7 || QT == 10 || QT == 12 || QT == 13;
    int lane = threadIdx.x & 31, nsub = cols / 32;
#pragma unroll
    for (int t = 0; t < GV_MAX_N; t++) acc[t] = 0.0f;
    for (int u = lane; u < nsub; u += 32) {
        float wq[32], a, b, m[2];
        q_sub_block<QT>(w, u, wq, &a, &b, m);
#pragma unroll
        for (int t = 0; t < GV_MAX_N; t++) {
            if (t < n) {
                const bf16_t* x = xs + (size_t)t * cols + (size_t)u * 32;
                float s[2] = {0.0f, 0.0f}, sx[2] = {0.0f, 0.0f};
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    float xf[8];
                    bf16x8(*(const u32x4*)(x + 8 * k), xf);
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        s[k / 2] += wq[8 * k + i] * xf[i];
                        if (MIN) sx[k / 2] += xf[i];
                    }
                }
                acc[t] += a * s[0] + b * s[1] - m[0] * sx[0] - m[1] * sx[1];
            }
        }
    }
#pragma unroll
    for (int t = 0; t < GV_MAX_N; t++)
        if (t < n) acc[t] = warp_sum(acc[t]);
}
#define QGEMV_KERNEL(NAME, QT)                                                                                      \
    extern "C" __global__ void __launch_bounds__(GV_THREADS)                                                       \
        NAME(const unsigned char* W, int rows, int cols, const bf16_t* xm, float* y, int n) {                      \
        grid_dep_wait();                                                                                            \
        bf16_t* xs = (bf16_t*)sm_dyn;                                                                               \
        stage_bf16(xm, xs, n * cols);                                                                               \
        __syncthreads();                                                                                            \
        int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;                                                      \
        for (int r = blockIdx.x * nwarps + (threadIdx.x >> 5); r < rows; r += gridDim.x * nwarps) {                 \
            float acc[GV_MAX_N];                                                                                    \
            qgemv_row<QT>(W + (size_t)r * qrow_bytes(QT, cols), xs, cols, n, acc);                                 \
            _Pragma("unroll") for (int t = 0; t < GV_MAX_N; t++) if (lane == 0 && t < n) y[(size_t)t * rows + r] = acc[t]; \
        }                                                                                                           \
    }
QGEMV_KERNEL(qgemv_q8_0, 8)
QGEMV_KERNEL(qgemv_q4_0, 0)
QGEMV_KERNEL(qgemv_q4_1, 1)
QGEMV_KERNEL(qgemv_q5_0, 6)
QGEMV_KERNEL(qgemv_q5_1, 7)
QGEMV_KERNEL(qgemv_q2_k, 10)
QGEMV_KERNEL(qgemv_q3_k, 11)
QGEMV_KERNEL(qgemv_q4_k, 12)
QGEMV_KERNEL(qgemv_q5_k, 13)
QGEMV_KERNEL(qgemv_q6_k, 14)

// The weights of GGUF blocks as bf16, for the prompt path: the count sub-blocks of 32 weights at W
// (rows back to back, as the file stores them) expanded into out, one sub-block per thread in a
// grid-stride loop. Each weight is the type's scale times its integer, less the minimum, as the
// engine's `quant::dequantize` computes it (product and difference each rounded to f32: no fused
// multiply-add), then rounded to bf16 to nearest even, so the result is the bf16 of the CPU's f32
// weight, bit for bit.
template <int QT>
__device__ __forceinline__ void qdequant_impl(const unsigned char* W, long long count, bf16_t* out) {
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < count; u += (long long)gridDim.x * blockDim.x) {
        float wq[32], a, b, m[2];
        const unsigned char* base = W + (size_t)(QT >= 10 ? u / 8 : u) * qblock_bytes(QT);
        q_sub_block<QT>(base, (int)(QT >= 10 ? u % 8 : 0), wq, &a, &b, m);
#pragma unroll
        for (int i = 0; i < 32; i++) st(out, (size_t)u * 32 + i, __fsub_rn(__fmul_rn(i < 16 ? a : b, wq[i]), m[i / 16]));
    }
}
#define QDEQUANT_KERNEL(NAME, QT)                                                                  \
    extern "C" __global__ void NAME(const unsigned char* W, long long count, bf16_t* out) {        \
        grid_dep_wait();                                                                            \
        qdequant_impl<QT>(W, count, out);                                                           \
    }
QDEQUANT_KERNEL(qdequant_q8_0, 8)
QDEQUANT_KERNEL(qdequant_q4_0, 0)
QDEQUANT_KERNEL(qdequant_q4_1, 1)
QDEQUANT_KERNEL(qdequant_q5_0, 6)
QDEQUANT_KERNEL(qdequant_q5_1, 7)
QDEQUANT_KERNEL(qdequant_q2_k, 10)
QDEQUANT_KERNEL(qdequant_q3_k, 11)
QDEQUANT_KERNEL(qdequant_q4_k, 12)
QDEQUANT_KERNEL(qdequant_q5_k, 13)
QDEQUANT_KERNEL(qdequant_q6_k, 14)

// A mixture of experts in a decode step (n <= GV_MAX_N tokens), over the experts some token is
// routed to only: blockIdx.y is the expert, and a block whose expert no token of the pass is
// routed to (route[t, e] == 0 for every t, as moe_route leaves it) returns at once, so the
// weights of unrouted experts are never read. tables[e] is the device address of expert e's
// matrix (bf16, row-major). Routed experts compute every token of the pass; the tokens not routed
// to them are weighted by 0 in moe_combine.
__device__ __forceinline__ bool expert_routed(const float* route, int n_exp, int e, int n) {
    bool any = false;
    for (int t = 0; t < n; t++) any = any || route[(size_t)t * n_exp + e] != 0.0f;
    return any;
}
// acts[e, t, :] = act(gate_e · x[t]) · (up_e · x[t]) (bf16), x [n, h] the mixture's bf16 input.
// Dynamic shared memory: n · h · 2 bytes.
template <int ACT>
__device__ void moe_gated_impl(const unsigned long long* gate_tab, const unsigned long long* up_tab, int ff, int h,
                               const bf16_t* x, const float* route, int n_exp, bf16_t* acts, int n) {
    int e = blockIdx.y;
    if (!expert_routed(route, n_exp, e, n)) return;
    bf16_t* xs = (bf16_t*)sm_dyn;
    stage_bf16(x, xs, n * h);
    __syncthreads();
    const bf16_t* G = (const bf16_t*)gate_tab[e];
    const bf16_t* U = (const bf16_t*)up_tab[e];
    int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (int r = blockIdx.x * nwarps + (threadIdx.x >> 5); r < ff; r += gridDim.x * nwarps) {
        float g[GV_MAX_N], u[GV_MAX_N];
        gemv_row<true>(G + (size_t)r * h, U + (size_t)r * h, xs, h, n, g, u);
        // Unrolled to GV_MAX_N so that g and u stay in registers.
#pragma unroll
        for (int t = 0; t < GV_MAX_N; t++)
            if (lane == 0 && t < n) st(acts, ((size_t)e * n + t) * ff + r, gated_of<ACT>(g[t], u[t]));
    }
}
#define MOE_GATED_KERNEL(NAME, ACT)                                                                               \
    extern "C" __global__ void __launch_bounds__(GV_THREADS)                                                     \
        NAME(const unsigned long long* gate_tab, const unsigned long long* up_tab, int ff, int h, const bf16_t* x, \
             const float* route, int n_exp, bf16_t* acts, int n) { grid_dep_wait();                            \
        moe_gated_impl<ACT>(gate_tab, up_tab, ff, h, x, route, n_exp, acts, n);                                  \
    }
MOE_GATED_KERNEL(moe_gemv_silu, 0)
MOE_GATED_KERNEL(moe_gemv_gelu, 1)
// ye[e, t, :] = down_e · acts[e, t] (f32). Dynamic shared memory: n · ff · 2 bytes.
extern "C" __global__ void __launch_bounds__(GV_THREADS)
    moe_gemv_down(const unsigned long long* down_tab, int h, int ff, const bf16_t* acts, const float* route, int n_exp,
                  float* ye, int n) {
    grid_dep_wait();
    int e = blockIdx.y;
    if (!expert_routed(route, n_exp, e, n)) return;
    bf16_t* xs = (bf16_t*)sm_dyn;
    stage_bf16(acts + (size_t)e * n * ff, xs, n * ff);
    __syncthreads();
    const bf16_t* D = (const bf16_t*)down_tab[e];
    int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (int r = blockIdx.x * nwarps + (threadIdx.x >> 5); r < h; r += gridDim.x * nwarps) {
        float y[GV_MAX_N], unused[GV_MAX_N];
        gemv_row<false>(D + (size_t)r * ff, D, xs, ff, n, y, unused);
#pragma unroll
        for (int t = 0; t < GV_MAX_N; t++)
            if (lane == 0 && t < n) ye[((size_t)e * n + t) * h + r] = y[t];
    }
}
// out[t, :] = Σ over experts in increasing index with a non-zero weight of route[t, e] · ye[e, t, :]:
// moe_accumulate's arithmetic and order, in one launch. Grid-stride over n · h.
extern "C" __global__ void moe_combine(float* out, const float* ye, const float* route, int n_exp, int h, int n) {
    grid_dep_wait();
    long long count = (long long)n * h;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = i / h, r = i % h;
        float acc = 0.0f;
        for (int e = 0; e < n_exp; e++) {
            float w = route[t * n_exp + e];
            if (w != 0.0f) acc += w * ye[((size_t)e * n + t) * h + r];
        }
        out[i] = acc;
    }
}

// The attention block's inputs from one GEMM of the fused Q/K/V weights: row t of `qkv` is
// [q (nh heads) | k (nkv heads) | v (nkv heads)], heads of hd values. Per head, in the unfused
// passes' order and arithmetic (add_bias, head_rms_norm, rope, kv_write): the bias where given (b*
// hold the whole projection's bias); for q and k the per-head RMS norm where a weight is given
// (w*, hd values) and rotate-half RoPE at pos[t] (cos/sin tables of hd/2 per position). Written
// to separate q [n, nh*hd], k and v [n, nkv*hd]. With a pool (k_pool non-null: one layer's
// [slots, nkv*hd] K and V planes of P), k and v are then rounded in place to P and stored at
// slot slots[t] (skipped when negative), as kv_write does. One warp per head; grid: one block per
// token, blockDim.x a multiple of 32. Needs hd <= 256 and even.
template <typename P>
__device__ void qkv_split_impl(const float* qkv, const float* bq, const float* bk, const float* bv,
                               const float* wq, const float* wk, const float* cos_t, const float* sin_t,
                               const int* pos, float* q, float* k, float* v, P* k_pool, P* v_pool,
                               const int* slots, int nh, int nkv, int hd, float eps) {
    size_t t = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int heads = nh + 2 * nkv, half = hd / 2;
    size_t p = (size_t)pos[t];
    const float* c = cos_t + p * half;
    const float* s = sin_t + p * half;
    int slot = k_pool ? slots[t] : -1;
    size_t kvd = (size_t)nkv * hd;
    for (int h = warp; h < heads; h += nw) {
        int kind = h < nh ? 0 : h < nh + nkv ? 1 : 2;
        int hh = kind == 0 ? h : kind == 1 ? h - nh : h - nh - nkv;
        int width = (kind == 0 ? nh : nkv) * hd;
        const float* src = qkv + t * (size_t)heads * hd + (size_t)h * hd;
        float* dst = (kind == 0 ? q : kind == 1 ? k : v) + t * (size_t)width + (size_t)hh * hd;
        const float* b = kind == 0 ? bq : kind == 1 ? bk : bv;
        const float* w = kind == 0 ? wq : kind == 1 ? wk : nullptr;
        float x[MAX_HD_REGS];
        double ss = 0.0;
#pragma unroll
        for (int j = 0; j < MAX_HD_REGS; j++) {
            int d = lane + 32 * j;
            x[j] = 0.0f;
            if (d < hd) {
                x[j] = src[d];
                if (b) x[j] = x[j] + b[(size_t)hh * hd + d];
                double vd = x[j];
                ss += vd * vd;
            }
        }
        if (w) {
            ss = warp_sum_d(ss);
            float inv = 1.0f / sqrtf((float)(ss / hd) + eps);
#pragma unroll
            for (int j = 0; j < MAX_HD_REGS; j++) {
                int d = lane + 32 * j;
                if (d < hd) x[j] = w[d] * (x[j] * inv);
            }
        }
#pragma unroll
        for (int j = 0; j < MAX_HD_REGS; j++) {
            int d = lane + 32 * j;
            if (d < hd) dst[d] = x[j];
        }
        if (kind != 2) {
            __syncwarp();
            for (int j = lane; j < half; j += 32) {
                float x1 = dst[j], x2 = dst[j + half];
                dst[j] = x1 * c[j] - x2 * s[j];
                dst[j + half] = x2 * c[j] + x1 * s[j];
            }
            __syncwarp();
        }
        if (kind == 0 || !k_pool) continue;
        P* pool = kind == 1 ? k_pool : v_pool;
        for (int d = lane; d < hd; d += 32)
            kv_keep(dst + d, pool, slot >= 0 ? (long long)slot * kvd + (long long)hh * hd + d : -1);
        __syncwarp();
    }
}
#define QKV_SPLIT_KERNEL(SFX, P)                                                                                 \
    extern "C" __global__ void __launch_bounds__(1024) qkv_split_##SFX(                                         \
        const float* qkv, const float* bq, const float* bk, const float* bv, const float* wq, const float* wk, \
        const float* cos_t, const float* sin_t, const int* pos, float* q, float* k, float* v, P* k_pool,        \
        P* v_pool, const int* slots, int nh, int nkv, int hd, float eps) { grid_dep_wait();                                     \
        qkv_split_impl(qkv, bq, bk, bv, wq, wk, cos_t, sin_t, pos, q, k, v, k_pool, v_pool, slots, nh, nkv, hd, \
                       eps);                                                                                     \
    }

// x = cap * tanh(x / cap) (Gemma 2's final-logit soft-capping).
extern "C" __global__ void softcap(float* x, long long count, float cap) {
    grid_dep_wait();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

// ---- mixture of experts ----------------------------------------------------------------------

#define MOE_MAX_TOPK 32

// Routing of a mixture of experts, in place on route [n, n_exp]: each token's router logits become
// its routing weights, one per expert, 0 for the experts it is not routed to. Softmax in f32
// (exp(l - max) over their sum, summed in expert order), the top_k largest probabilities (ties to
// the lower expert index, NaN below everything), divided by their sum (added in rank order) when
// `renormalize` is non-zero: the CPU backend's moe_route, operation for operation. top_k is at
// most MOE_MAX_TOPK and n_exp (the host checks). One thread per token, grid-stride.
extern "C" __global__ void moe_route(float* route, int n, int n_exp, int top_k, int renormalize) {
    grid_dep_wait();
    const float neg_inf = __int_as_float(0xff800000);
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += gridDim.x * blockDim.x) {
        float* r = route + (size_t)t * n_exp;
        float mx = neg_inf;
        for (int e = 0; e < n_exp; e++)
            if (r[e] > mx) mx = r[e];
        float sum = 0.0f;
        for (int e = 0; e < n_exp; e++) {
            float p = expf(r[e] - mx);
            r[e] = p;
            sum += p;
        }
        for (int e = 0; e < n_exp; e++) r[e] = r[e] / sum;
        int ids[MOE_MAX_TOPK];
        float ws[MOE_MAX_TOPK];
        int k = min(top_k, min(n_exp, MOE_MAX_TOPK));
        for (int j = 0; j < k; j++) {
            int bi = -1;
            float bp = 0.0f;
            for (int e = 0; e < n_exp; e++) {
                bool taken = false;
                for (int c = 0; c < j; c++) taken = taken || ids[c] == e;
                if (taken) continue;
                float p = r[e];
                if (p != p) p = neg_inf;
                if (bi < 0 || p > bp) {
                    bi = e;
                    bp = p;
                }
            }
            ids[j] = bi;
            ws[j] = r[bi];
        }
        if (renormalize) {
            float total = 0.0f;
            for (int j = 0; j < k; j++) total += ws[j];
            for (int j = 0; j < k; j++) ws[j] = ws[j] / total;
        }
        for (int e = 0; e < n_exp; e++) r[e] = 0.0f;
        for (int j = 0; j < k; j++) r[ids[j]] = ws[j];
    }
}

// out[t, :] += route[t, expert] * y[t, :] for the tokens routed to `expert` (a non-zero weight);
// y [n, h] is that expert's output for every token of the pass. Called once per expert in
// increasing index, so each token's experts are added in that order, as on the CPU.
extern "C" __global__ void moe_accumulate(float* out, const float* y, const float* route, int expert, int n_exp,
                                          int h, long long count) {
    grid_dep_wait();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        float w = route[(size_t)(i / h) * n_exp + expert];
        if (w != 0.0f) out[i] += w * y[i];
    }
}

// ---- LoRA ------------------------------------------------------------------------------------

// The low-rank deltas of LoRA adapters mixed in one pass, Punica-style (BGMV): every token row reads
// its adapter slot from slots[t] (-1: none) and its adapter's matrices through a device table, so
// one launch serves every adapter of the pass, and a captured graph replays whatever adapters the
// slots hold then. The table has one LoraEntry per (slot, target), target = layer * 7 + projection
// (q, k, v, o, gate, up, down), at table[slot * n_targets + target]; rank 0: the adapter has no
// delta for that target. A and B^T are f32, whatever the compute dtype.
//
// One lora call of a model pass covers up to LORA_MAX_OUTS projections sharing the input x
// (q, k, v; gate, up): blockIdx.y (shrink) or blockIdx.z (expand) picks the projection k, and the
// rank-wide intermediate is mid[k, t, 0..rank] (planes of n * stride floats, stride >= every rank).
// A block takes LORA_TILE consecutive tokens and handles the tokens of the tile that share a slot
// together, so each weight it loads serves all of them (the tokens of one sequence, and decode
// tokens of one adapter that sit next to each other). Each token's sums run in the same order
// whichever tokens share its tile, so its result does not depend on the rest of the pass.

#define LORA_TILE 8
#define LORA_RANKS 8  // ranks per shrink block: one per warp, blockDim.x == 32 * LORA_RANKS
#define LORA_MAX_OUTS 3

struct LoraEntry {
    const float* a;   // rank x din, row-major
    const float* bt;  // B^T: rank x dout, row-major
    int rank;         // 0: no delta for this target
    float scale;
};
static_assert(sizeof(LoraEntry) == 24, "the host writes LoraEntry as 24 bytes");

__device__ __forceinline__ int lora_pick(int k, int v0, int v1, int v2) { return k == 0 ? v0 : k == 1 ? v1 : v2; }

// The tokens of the tile at t0 (count of them) that run the same slot as token u, as a bit mask.
__device__ __forceinline__ unsigned lora_group(const int* slots, int t0, int count, int u) {
    int slot = slots[t0 + u];
    unsigned group = 0;
    for (int v = u; v < count; v++)
        if (slots[t0 + v] == slot) group |= 1u << v;
    return group;
}

// Shrink: mid[k, t, j] = x[t, :] . A[j, :] for every token t whose slot's adapter has a delta for
// target k, j < its rank; other entries of mid are left alone. x [n, din] is read in its dtype (a
// matrix-input buffer). Grid: (ceil(n / LORA_TILE), outs, ceil(stride / LORA_RANKS)); warp w of
// block z computes rank index j = z * LORA_RANKS + w: lanes over din, then a warp sum.
template <typename X>
__device__ void lora_shrink_impl(const X* x, const int* slots, const LoraEntry* table, int n_targets, int target0,
                                 int target1, int target2, float* mid, int n, int din, int stride) {
    int t0 = blockIdx.x * LORA_TILE, k = blockIdx.y;
    int target = lora_pick(k, target0, target1, target2);
    int lane = threadIdx.x & 31, j = blockIdx.z * LORA_RANKS + (threadIdx.x >> 5);
    int count = min(LORA_TILE, n - t0);
    float* mk = mid + (size_t)k * n * stride;
    unsigned done = 0;
    for (int u = 0; u < count; u++) {
        if ((done >> u) & 1u) continue;
        unsigned group = lora_group(slots, t0, count, u);
        done |= group;
        int slot = slots[t0 + u];
        if (slot < 0) continue;
        LoraEntry e = table[(size_t)slot * n_targets + target];
        if (j >= e.rank) continue;  // uniform over the warp
        const float* ar = e.a + (size_t)j * din;
        float acc[LORA_TILE];
#pragma unroll
        for (int v = 0; v < LORA_TILE; v++) acc[v] = 0.0f;
        for (int i = lane; i < din; i += 32) {
            float a = ar[i];
#pragma unroll
            for (int v = 0; v < LORA_TILE; v++)
                if ((group >> v) & 1u) acc[v] += ld(x, (size_t)(t0 + v) * din + i) * a;
        }
#pragma unroll
        for (int v = 0; v < LORA_TILE; v++) {
            if (!((group >> v) & 1u)) continue;  // uniform over the block
            float s = warp_sum(acc[v]);
            if (lane == 0) mk[(size_t)(t0 + v) * stride + j] = s;
        }
    }
}
extern "C" __global__ void __launch_bounds__(32 * LORA_RANKS) lora_shrink_bf16(
    const bf16_t* x, const int* slots, const LoraEntry* table, int n_targets, int target0, int target1, int target2,
    float* mid, int n, int din, int stride) {
    grid_dep_wait();
    lora_shrink_impl(x, slots, table, n_targets, target0, target1, target2, mid, n, din, stride);
}
extern "C" __global__ void __launch_bounds__(32 * LORA_RANKS) lora_shrink_f32(
    const float* x, const int* slots, const LoraEntry* table, int n_targets, int target0, int target1, int target2,
    float* mid, int n, int din, int stride) {
    grid_dep_wait();
    lora_shrink_impl(x, slots, table, n_targets, target0, target1, target2, mid, n, din, stride);
}

// Expand: y_k[t, o] += scale * sum_j mid[k, t, j] * B^T[j, o] (j in increasing order) for the same
// tokens as the shrink; y_k [n, dout_k] f32, the outputs of the call's projections (distinct
// buffers). Grid: (ceil(n / LORA_TILE), ceil(max dout / blockDim.x), outs); one thread per output
// column o, reading B^T rows coalesced.
extern "C" __global__ void __launch_bounds__(1024) lora_expand(const float* mid, const int* slots,
                                                                const LoraEntry* table, int n_targets, int target0,
                                                                int target1, int target2, float* y0, float* y1,
                                                                float* y2, int dout0, int dout1, int dout2, int n,
                                                                int stride) {
    grid_dep_wait();
    int t0 = blockIdx.x * LORA_TILE, k = blockIdx.z;
    int target = lora_pick(k, target0, target1, target2), dout = lora_pick(k, dout0, dout1, dout2);
    float* y = k == 0 ? y0 : k == 1 ? y1 : y2;
    int o = blockIdx.y * blockDim.x + threadIdx.x;
    if (o >= dout) return;
    int count = min(LORA_TILE, n - t0);
    const float* mk = mid + (size_t)k * n * stride;
    unsigned done = 0;
    for (int u = 0; u < count; u++) {
        if ((done >> u) & 1u) continue;
        unsigned group = lora_group(slots, t0, count, u);
        done |= group;
        int slot = slots[t0 + u];
        if (slot < 0) continue;
        LoraEntry e = table[(size_t)slot * n_targets + target];
        if (e.rank == 0) continue;
        float acc[LORA_TILE];
#pragma unroll
        for (int v = 0; v < LORA_TILE; v++) acc[v] = 0.0f;
        for (int j = 0; j < e.rank; j++) {
            float b = e.bt[(size_t)j * dout + o];
#pragma unroll
            for (int v = 0; v < LORA_TILE; v++)
                if ((group >> v) & 1u) acc[v] += mk[(size_t)(t0 + v) * stride + j] * b;
        }
#pragma unroll
        for (int v = 0; v < LORA_TILE; v++)
            if ((group >> v) & 1u) y[(size_t)(t0 + v) * dout + o] += e.scale * acc[v];
    }
}

// ---- RoPE ------------------------------------------------------------------------------------

// Rotate-half RoPE on every head of a [n, heads * hd] matrix, in place: element j pairs with
// j + hd/2. cos/sin: [positions, hd/2]. Grid: one block per token.
extern "C" __global__ void __launch_bounds__(1024) rope(float* x, const float* cos_t, const float* sin_t, const int* pos, int heads,
                                int hd) {
    grid_dep_wait();
    size_t t = blockIdx.x;
    int half = hd / 2;
    size_t p = (size_t)pos[t];
    const float* c = cos_t + p * half;
    const float* s = sin_t + p * half;
    float* row = x + t * (size_t)heads * hd;
    for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
        int head = i / half, j = i % half;
        float* hp = row + (size_t)head * hd;
        float x1 = hp[j], x2 = hp[j + half];
        hp[j] = x1 * c[j] - x2 * s[j];
        hp[j + half] = x2 * c[j] + x1 * s[j];
    }
}

// ---- KV cache --------------------------------------------------------------------------------

// Rounds token t's K and V rows in place to the pool's dtype (a no-op for f32) and writes them to
// pool slot slots[t] (skipped when negative: a staged token, whose rounded rows the host copies to
// staging). Grid: one block per token. `k_pool`/`v_pool` are one layer's [slots, kvd] tensors.
template <typename P>
__device__ void kv_write_impl(float* k, float* v, P* k_pool, P* v_pool, const int* slots, int kvd) {
    size_t t = blockIdx.x;
    int slot = slots[t];
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) {
        long long at = slot >= 0 ? (long long)slot * kvd + i : -1;
        kv_keep(k + t * kvd + i, k_pool, at);
        kv_keep(v + t * kvd + i, v_pool, at);
    }
}

// Commits staged rows: for entry i, stores staging row rows[i] of every (layer, K|V) plane in pool
// slot slots[i] of the same plane. Staging is f32 [planes, stage_rows, kvd] (already rounded by
// kv_write, so storing is exact), the pool [planes, pool_slots, kvd], plane = layer * 2 + (0 for K,
// 1 for V). Grid: (entries, planes).
template <typename P>
__device__ void kv_commit_impl(const float* stage, P* pool, const int* rows, const int* slots, int kvd,
                               long long stage_rows, long long pool_slots) {
    size_t plane = blockIdx.y;
    const float* src = stage + (plane * stage_rows + rows[blockIdx.x]) * kvd;
    size_t dst = (plane * pool_slots + slots[blockIdx.x]) * kvd;
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) st(pool, dst + i, src[i]);
}

#define KV_STORE_KERNELS(SFX, P)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024)                                                           \
        kv_write_##SFX(float* k, float* v, P* k_pool, P* v_pool, const int* slots, int kvd) { grid_dep_wait();                     \
        kv_write_impl(k, v, k_pool, v_pool, slots, kvd);                                                         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024) kv_commit_##SFX(                                          \
        const float* stage, P* pool, const int* rows, const int* slots, int kvd, long long stage_rows,           \
        long long pool_slots) { grid_dep_wait();                                                                                   \
        kv_commit_impl(stage, pool, rows, slots, kvd, stage_rows, pool_slots);                                   \
    }
KV_STORE_KERNELS(f32, float)
KV_STORE_KERNELS(bf16, bf16_t)
KV_STORE_KERNELS(fp8, fp8_t)
QKV_SPLIT_KERNEL(f32, float)
QKV_SPLIT_KERNEL(bf16, bf16_t)
QKV_SPLIT_KERNEL(fp8, fp8_t)

// ---- attention -------------------------------------------------------------------------------

#define NEG_BIG (-1.0e30f)

// Merges the n_split partial results (acc[0..hd], max, sum) of (token, head) `th` into
// out[th * hd + d], in the matrix-input dtype (it feeds the output projection). Reads through
// volatile loads: other blocks wrote the partials during this launch.
template <typename O>
__device__ void attn_merge(const float* partial, O* out, size_t th, int n_split, int hd) {
    const volatile float* pp = partial + th * n_split * (size_t)(hd + 2);
    float mx = NEG_BIG;
    for (int s = 0; s < n_split; s++) mx = fmaxf(mx, pp[s * (hd + 2) + hd]);
    float sum = 0.0f;
    for (int s = 0; s < n_split; s++) sum += pp[s * (hd + 2) + hd + 1] * expf(pp[s * (hd + 2) + hd] - mx);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_split; s++) a += pp[s * (hd + 2) + d] * expf(pp[s * (hd + 2) + hd] - mx);
        st(out, th * hd + d, a / sum);
    }
}

// Causal attention over a paged cache, one (token, query head) per blockIdx.x and one slice of its
// visible positions per blockIdx.y (split-K: gridDim.y slices, merged by the last to finish).
//
// Token t of chunk c sits at position pos[t]. Positions >= chunk_start[c] were computed in this pass
// and are read from k_new/v_new at row chunk_base[c] + (p - chunk_start[c]); older ones from the
// pool through the chunk's block table (block_tables + chunk_bt[c]). A staged pass thus sees its
// own tokens without them being in the pool. With window > 0 only the last `window` positions are
// visible (a sliding window). With softcap > 0 a scaled score s becomes softcap * tanh(s / softcap)
// (Gemma 2).
//
// Each warp walks every (blockDim.x/32)-th position with an online softmax; lanes hold head_dim/32
// components. The warps then merge through shared memory (dynamic: (blockDim.x/32) * hd floats) and
// write (acc[0..hd], max, sum) to partial[(bid.x * gridDim.y + bid.y) * (hd + 2)]. The last of a
// (token, head)'s slices to finish (counted in done[bid.x], which it leaves at 0 for the next
// pass) merges them all into out[bid.x * hd + d], in the matrix-input dtype (out16 where given,
// else out32): split-K and its merge are one launch.
template <typename P>
__device__ void attn_partial_impl(const float* q, const float* k_new, const float* v_new, const P* k_pool,
                                  const P* v_pool, const int* tok_chunk, const int* pos, const int* chunk_start,
                                  const int* chunk_base, const int* chunk_bt, const int* block_tables,
                                  float* partial, int* done, float* out32, bf16_t* out16, int nh, int nkv, int hd,
                                  int bs, int window, float scale, float softcap) {
    float* sm_acc = (float*)sm_dyn;
    __shared__ float sm_m[32], sm_l[32];
    int th = blockIdx.x;
    int t = th / nh, head = th % nh;
    int split = blockIdx.y, n_split = gridDim.y;
    int c = tok_chunk[t];
    int p_tok = pos[t];
    int start = chunk_start[c], base = chunk_base[c];
    const int* bt = block_tables + chunk_bt[c];
    int first = window > 0 ? max(0, p_tok + 1 - window) : 0;
    int len = p_tok + 1 - first;
    int per = (len + n_split - 1) / n_split;
    int lo = first + split * per;
    int hi = min(first + len, lo + per);
    int kvh = head / (nh / nkv);
    size_t kvd = (size_t)nkv * hd;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;

    float qr[MAX_HD_REGS], acc[MAX_HD_REGS];
    const float* qp = q + (size_t)t * nh * hd + (size_t)head * hd;
#pragma unroll
    for (int j = 0; j < MAX_HD_REGS; j++) {
        int d = lane + 32 * j;
        qr[j] = d < hd ? qp[d] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = NEG_BIG, l = 0.0f;
    for (int p = lo + warp; p < hi; p += nw) {
        // In-pass rows are f32 (rounded to the pool's dtype by kv_write); pool rows are widened.
        bool fresh = p >= start;
        size_t row = fresh ? (size_t)(base + p - start) * kvd + (size_t)kvh * hd
                           : ((size_t)bt[p / bs] * bs + p % bs) * kvd + (size_t)kvh * hd;
        float vr[MAX_HD_REGS];
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_HD_REGS; j++) {
            int d = lane + 32 * j;
            if (d < hd) {
                dot += qr[j] * (fresh ? k_new[row + d] : ld(k_pool, row + d));
                vr[j] = fresh ? v_new[row + d] : ld(v_pool, row + d);
            }
        }
        float s = warp_sum(dot) * scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        float mn = fmaxf(m, s);
        float corr = expf(m - mn), w = expf(s - mn);
        l = l * corr + w;
#pragma unroll
        for (int j = 0; j < MAX_HD_REGS; j++) {
            int d = lane + 32 * j;
            if (d < hd) acc[j] = acc[j] * corr + w * vr[j];
        }
        m = mn;
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < MAX_HD_REGS; j++) {
        int d = lane + 32 * j;
        if (d < hd) sm_acc[warp * hd + d] = acc[j];
    }
    __syncthreads();
    float mx = NEG_BIG;
    for (int w = 0; w < nw; w++) mx = fmaxf(mx, sm_m[w]);
    float* out = partial + ((size_t)th * n_split + split) * (hd + 2);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < nw; w++) a += sm_acc[w * hd + d] * expf(sm_m[w] - mx);
        out[d] = a;
    }
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int w = 0; w < nw; w++) sum += sm_l[w] * expf(sm_m[w] - mx);
        out[hd] = mx;
        out[hd + 1] = sum;
    }
    // Each thread's partial is visible device-wide before the block counts itself done; the
    // block that completes the count reads every slice's.
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) {
        last = atomicAdd(&done[th], 1) == n_split - 1;
        if (last) done[th] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (out16)
        attn_merge(partial, out16, th, n_split, hd);
    else
        attn_merge(partial, out32, th, n_split, hd);
}
#define ATTN_PARTIAL_KERNEL(SFX, P)                                                                               \
    extern "C" __global__ void attn_partial_##SFX(                                                               \
        const float* q, const float* k_new, const float* v_new, const P* k_pool, const P* v_pool,                \
        const int* tok_chunk, const int* pos, const int* chunk_start, const int* chunk_base, const int* chunk_bt, \
        const int* block_tables, float* partial, int* done, float* out32, bf16_t* out16, int nh, int nkv, int hd, \
        int bs, int window, float scale, float softcap) { grid_dep_wait();                                                         \
        attn_partial_impl(q, k_new, v_new, k_pool, v_pool, tok_chunk, pos, chunk_start, chunk_base, chunk_bt,     \
                          block_tables, partial, done, out32, out16, nh, nkv, hd, bs, window, scale, softcap);    \
    }
ATTN_PARTIAL_KERNEL(f32, float)
ATTN_PARTIAL_KERNEL(bf16, bf16_t)
ATTN_PARTIAL_KERNEL(fp8, fp8_t)

// Where a block of a tiled attention kernel (attn_tiled, attn_mma) works: its tile's first token
// t0 and chunk c, the tile's `count` tokens (at most tpt, never past the chunk), its KV head and
// first query head (blockIdx.y picks a group of gp query heads sharing one KV head), and the
// chunk's first in-pass position, first row and block table.
struct TileBlock {
    int t0, c, count, kvh, head0, start, base;
    const int* bt;
};
__device__ __forceinline__ TileBlock tile_block(const int* tiles, const int* tok_chunk, const int* chunk_start,
                                                const int* chunk_base, const int* chunk_bt,
                                                const int* block_tables, int n, int nh, int nkv, int gp, int tpt) {
    TileBlock b;
    b.t0 = tiles[blockIdx.x];
    b.c = tok_chunk[b.t0];
    b.count = 0;
    while (b.count < tpt && b.t0 + b.count < n && tok_chunk[b.t0 + b.count] == b.c) b.count++;
    int groups = (nh / nkv) / gp;
    b.kvh = blockIdx.y / groups;
    b.head0 = b.kvh * (nh / nkv) + (blockIdx.y % groups) * gp;
    b.start = chunk_start[b.c];
    b.base = chunk_base[b.c];
    b.bt = block_tables + chunk_bt[b.c];
    return b;
}

// Causal attention for passes with prompt chunks, in tiles: one block per (tile of up to `tpt`
// consecutive tokens of one chunk, group of `gp` query heads sharing one KV head), so that each
// K/V row is read from memory once per tile instead of once per (token, head). The block's
// AT_ROWS rows are (token r / gp, head r % gp of the group); it walks the tile's visible positions
// AT_KEYS at a time: K rows into shared memory, scores with an online softmax per row (each row
// is 16 lanes of one warp), then V rows into the same shared memory, accumulated per row. Rows
// past the tile's last token compute nothing visible and write nothing. Output goes straight to
// out[t, head * hd + d] in the matrix-input dtype (no split-K partials).
//
// tiles[i] is the first token of tile i (host-built: tiles never cross a chunk). Needs
// hd <= AT_MAX_HD, blockDim.x == AT_THREADS, gp * tpt <= AT_ROWS, (nh / nkv) % gp == 0.
#define AT_ROWS 16
#define AT_KEYS 16
#define AT_THREADS 256
#define AT_MAX_HD 256
template <typename O, typename P>
__device__ void attn_tiled_impl(const float* q, const float* k_new, const float* v_new, const P* k_pool,
                                const P* v_pool, const int* tok_chunk, const int* pos, const int* chunk_start,
                                const int* chunk_base, const int* chunk_bt, const int* block_tables,
                                const int* tiles, O* out, int n, int nh, int nkv, int hd, int bs, int window,
                                float scale, float softcap, int gp, int tpt) {
    __shared__ float sq[AT_ROWS * (AT_MAX_HD + 1)];
    __shared__ float skv[AT_KEYS * (AT_MAX_HD + 1)];
    __shared__ float sp[AT_ROWS * (AT_KEYS + 1)];
    const int lds = hd + 1;  // padded rows: the 16 keys of one column fall in distinct banks
    TileBlock tb = tile_block(tiles, tok_chunk, chunk_start, chunk_base, chunk_bt, block_tables, n, nh, nkv, gp, tpt);
    int t0 = tb.t0, count = tb.count, kvh = tb.kvh, head0 = tb.head0, start = tb.start, base = tb.base;
    const int* bt = tb.bt;
    size_t kvd = (size_t)nkv * hd;

    int i = threadIdx.x, r = i >> 4, j = i & 15;
    bool row_ok = r < gp * count;
    int t_r = t0 + (row_ok ? r / gp : 0);
    int p_r = row_ok ? pos[t_r] : -1;
    int lo_r = window > 0 ? max(0, p_r + 1 - window) : 0;
    int p_first = pos[t0], p_last = pos[t0 + count - 1];
    int k_lo = window > 0 ? max(0, p_first + 1 - window) : 0;

    for (int idx = i; idx < AT_ROWS * hd; idx += AT_THREADS) {
        int rr = idx / hd, d = idx % hd;
        float v = 0.0f;
        if (rr < gp * count) {
            int t = t0 + rr / gp, head = head0 + rr % gp;
            v = q[((size_t)t * nh + head) * hd + d] * scale;
        }
        sq[rr * lds + d] = v;
    }
    float acc[AT_MAX_HD / 16];
#pragma unroll
    for (int k = 0; k < AT_MAX_HD / 16; k++) acc[k] = 0.0f;
    float m = NEG_BIG, l = 0.0f;

    for (int kb = k_lo; kb <= p_last; kb += AT_KEYS) {
        for (int pass = 0; pass < 2; pass++) {  // 0: K rows, 1: V rows
            __syncthreads();
            const float* src_new = pass == 0 ? k_new : v_new;
            const P* src_pool = pass == 0 ? k_pool : v_pool;
            for (int idx = i; idx < AT_KEYS * hd; idx += AT_THREADS) {
                int jj = idx / hd, d = idx % hd, p = kb + jj;
                float v = 0.0f;
                if (p <= p_last) {
                    if (p >= start) {
                        v = src_new[(size_t)(base + p - start) * kvd + (size_t)kvh * hd + d];
                    } else {
                        size_t slot = (size_t)bt[p / bs] * bs + p % bs;
                        v = ld(src_pool, slot * kvd + (size_t)kvh * hd + d);
                    }
                }
                skv[jj * lds + d] = v;
            }
            __syncthreads();
            if (pass == 0) {
                float s = 0.0f;
                const float* qr = sq + r * lds;
                const float* kr = skv + j * lds;
                for (int d = 0; d < hd; d++) s += qr[d] * kr[d];
                if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                int p = kb + j;
                bool visible = row_ok && p <= p_r && p >= lo_r;
                float mx = visible ? s : NEG_BIG;
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                float mn = fmaxf(m, mx);
                float corr = expf(m - mn);
                float w = visible ? expf(s - mn) : 0.0f;
                float sum = w;
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
                l = l * corr + sum;
                m = mn;
                sp[r * (AT_KEYS + 1) + j] = w;
#pragma unroll
                for (int k = 0; k < AT_MAX_HD / 16; k++) acc[k] *= corr;
            } else {
                const float* pr = sp + r * (AT_KEYS + 1);
#pragma unroll
                for (int k = 0; k < AT_MAX_HD / 16; k++) {
                    int d = j + 16 * k;
                    if (d < hd) {
                        float a = acc[k];
                        for (int jj = 0; jj < AT_KEYS; jj++) a += pr[jj] * skv[jj * lds + d];
                        acc[k] = a;
                    }
                }
            }
        }
    }
    if (row_ok) {
        int head = head0 + r % gp;
        size_t o = ((size_t)t_r * nh + head) * hd;
        float inv = 1.0f / l;
#pragma unroll
        for (int k = 0; k < AT_MAX_HD / 16; k++) {
            int d = j + 16 * k;
            if (d < hd) st(out, o + d, acc[k] * inv);
        }
    }
}
// attn_tiled_<output dtype>_kv<pool dtype>.
#define ATTN_TILED_KERNEL(OSFX, O, PSFX, P)                                                                       \
    extern "C" __global__ void __launch_bounds__(AT_THREADS) attn_tiled_##OSFX##_kv##PSFX(                       \
        const float* q, const float* k_new, const float* v_new, const P* k_pool, const P* v_pool,                \
        const int* tok_chunk, const int* pos, const int* chunk_start, const int* chunk_base, const int* chunk_bt, \
        const int* block_tables, const int* tiles, O* out, int n, int nh, int nkv, int hd, int bs, int window,   \
        float scale, float softcap, int gp, int tpt) { grid_dep_wait();                                                            \
        attn_tiled_impl(q, k_new, v_new, k_pool, v_pool, tok_chunk, pos, chunk_start, chunk_base, chunk_bt,       \
                        block_tables, tiles, out, n, nh, nkv, hd, bs, window, scale, softcap, gp, tpt);           \
    }
ATTN_TILED_KERNEL(bf16, bf16_t, f32, float)
ATTN_TILED_KERNEL(bf16, bf16_t, bf16, bf16_t)
ATTN_TILED_KERNEL(bf16, bf16_t, fp8, fp8_t)
ATTN_TILED_KERNEL(f32, float, f32, float)
ATTN_TILED_KERNEL(f32, float, bf16, bf16_t)
ATTN_TILED_KERNEL(f32, float, fp8, fp8_t)

// ---- prompt attention on tensor cores ------------------------------------------------------------

// d (16×8, f32) += a (16×16 bf16, row-major) · b (16×8 bf16, column-major): one warp-wide
// `mma.m16n8k16` (sm_80 and later). Fragments as PTX lays them out, with lane = 4·g + t:
// a[0] holds row g, columns 2t and 2t+1 (low half first); a[1] row g+8, the same columns; a[2]
// and a[3] the same rows at columns 2t+8 and 2t+9. b[0] holds rows 2t and 2t+1 of column g, b[1]
// rows 2t+8 and 2t+9. d[0], d[1] are row g, columns 2t and 2t+1; d[2], d[3] row g+8. The CPU
// emulation (kernels/tests/emulated/shim.h) defines its own from the same layout.
#ifndef TANDEM_EMULATED_MMA
__device__ __forceinline__ void mma_bf16(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
// Two values as a bf16 pair (the first in the low half), rounded as `st` rounds.
__device__ __forceinline__ u32 bf16_pair(float lo, float hi) {
    bf16_t b[2];
    st(b, 0, lo);
    st(b, 1, hi);
    return (u32)b[0] | ((u32)b[1] << 16);
}

// Causal attention for passes with prompt chunks, on tensor cores (bf16 products, f32 sums):
// flash-attention tiling with an online softmax and no score matrix in memory. Tiles and rows are
// those of attn_tiled (tiles[i] is the first token of tile i; a block's rows are (token r / gp,
// head r % gp of its group of query heads sharing one KV head), with AM_ROWS rows per block, 16
// per warp. Each warp keeps its rows' q (scaled, rounded to bf16) as mma fragments; the block
// walks the visible positions AM_KEYS(HD) at a time, K rows into shared memory and V transposed,
// both rounded to bf16 (exact for bf16 and fp8 pools); a warp scores its 16 rows against the
// keys (S = q·Kᵀ in f32), masks, soft-caps, updates its rows' running max and sum, and multiplies
// the weights, rounded to bf16, by V into its f32 accumulators. A warp skips key tiles entirely
// outside its rows' windows. Output is bf16 (the matrix input of the output projection).
//
// HD is the largest head dimension of the variant: hd <= HD, zero-padded; blockDim.x ==
// AM_THREADS, gp * tpt <= AM_ROWS, (nh / nkv) % gp == 0.
#define AM_ROWS 64
#define AM_THREADS 128
#define AM_KEYS(HD) ((HD) > 128 ? 32 : 64)
template <int HD, typename P>
__device__ void attn_mma_impl(const float* q, const float* k_new, const float* v_new, const P* k_pool,
                              const P* v_pool, const int* tok_chunk, const int* pos, const int* chunk_start,
                              const int* chunk_base, const int* chunk_bt, const int* block_tables,
                              const int* tiles, bf16_t* out, int n, int nh, int nkv, int hd, int bs, int window,
                              float scale, float softcap, int gp, int tpt) {
    const int KT = AM_KEYS(HD);
    // Padded strides (in 32-bit words): the 8 row groups of a fragment load fall in distinct banks.
    const int KS = HD / 2 + 4, VS = KT / 2 + 4;
    __shared__ u32 sk[KT * (HD / 2 + 4)];  // key j, dims 2i and 2i+1: sk[j * KS + i]
    __shared__ u32 sv[HD * (KT / 2 + 4)];  // dim d, keys 2i and 2i+1: sv[d * VS + i]
    bf16_t* sv16 = (bf16_t*)sv;
    const float NEG_INF = __uint_as_float(0xff800000u);

    TileBlock tb = tile_block(tiles, tok_chunk, chunk_start, chunk_base, chunk_bt, block_tables, n, nh, nkv, gp, tpt);
    int t0 = tb.t0, count = tb.count, kvh = tb.kvh, head0 = tb.head0, start = tb.start, base = tb.base;
    const int* bt = tb.bt;
    size_t kvd = (size_t)nkv * hd;
    int rows = gp * count;
    int p_last = pos[t0 + count - 1];
    int k_lo = window > 0 ? max(0, pos[t0] + 1 - window) : 0;

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    int r_first = warp * 16;
    bool warp_on = r_first < rows;
    // This lane's two rows (g and g + 8 of the warp's 16) and the positions each sees.
    int rr[2] = {r_first + g, r_first + g + 8};
    bool ok[2];
    int p_r[2], lo_r[2];
    for (int h = 0; h < 2; h++) {
        ok[h] = rr[h] < rows;
        p_r[h] = ok[h] ? pos[t0 + rr[h] / gp] : -1;
        lo_r[h] = window > 0 ? max(0, p_r[h] + 1 - window) : 0;
    }
    // The warp's key range: from its first row's window start to its last row's position.
    int w_hi = warp_on ? pos[t0 + (min(r_first + 15, rows - 1)) / gp] : -1;
    int w_lo = window > 0 && warp_on ? max(0, pos[t0 + r_first / gp] + 1 - window) : 0;

    u32 qa[HD / 16][4];
#pragma unroll
    for (int ks = 0; ks < HD / 16; ks++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int h = i & 1, d = ks * 16 + 2 * tq + ((i & 2) ? 8 : 0);
            float x0 = 0.0f, x1 = 0.0f;
            if (ok[h]) {
                const float* qr = q + ((size_t)(t0 + rr[h] / gp) * nh + head0 + rr[h] % gp) * hd;
                if (d < hd) x0 = qr[d] * scale;
                if (d + 1 < hd) x1 = qr[d + 1] * scale;
            }
            qa[ks][i] = bf16_pair(x0, x1);
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int nt = 0; nt < HD / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[nt][e] = 0.0f;
    float m[2] = {NEG_BIG, NEG_BIG}, l[2] = {0.0f, 0.0f};

    for (int kb = k_lo; kb <= p_last; kb += KT) {
        __syncthreads();  // the previous tile's readers are done
        for (int idx = threadIdx.x; idx < KT * (HD / 2); idx += AM_THREADS) {
            int j = idx / (HD / 2), i = idx % (HD / 2), d = 2 * i, p = kb + j;
            float k0 = 0.0f, k1 = 0.0f, v0 = 0.0f, v1 = 0.0f;
            if (p <= p_last && d < hd) {
                bool two = d + 1 < hd;
                if (p >= start) {
                    size_t row = (size_t)(base + p - start) * kvd + (size_t)kvh * hd + d;
                    k0 = k_new[row];
                    v0 = v_new[row];
                    if (two) {
                        k1 = k_new[row + 1];
                        v1 = v_new[row + 1];
                    }
                } else {
                    size_t row = ((size_t)bt[p / bs] * bs + p % bs) * kvd + (size_t)kvh * hd + d;
                    k0 = ld(k_pool, row);
                    v0 = ld(v_pool, row);
                    if (two) {
                        k1 = ld(k_pool, row + 1);
                        v1 = ld(v_pool, row + 1);
                    }
                }
            }
            sk[j * KS + i] = bf16_pair(k0, k1);
            st(sv16, (size_t)d * (2 * VS) + j, v0);
            st(sv16, (size_t)(d + 1) * (2 * VS) + j, v1);
        }
        __syncthreads();
        if (!warp_on || kb > w_hi || kb + KT <= w_lo) continue;

        float s[KT / 8][4];
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[nt][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++) {
            if (ks * 16 >= hd) break;
#pragma unroll
            for (int nt = 0; nt < KT / 8; nt++) {
                const u32* kr = sk + (nt * 8 + g) * KS + ks * 8 + tq;
                u32 b[2] = {kr[0], kr[4]};
                mma_bf16(s[nt], qa[ks], b);
            }
        }
        float mx[2] = {NEG_BIG, NEG_BIG};
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int h = e >> 1, p = kb + nt * 8 + 2 * tq + (e & 1);
                float x = s[nt][e];
                if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                bool visible = ok[h] && p <= p_r[h] && p >= lo_r[h];
                s[nt][e] = visible ? x : NEG_INF;
                mx[h] = fmaxf(mx[h], s[nt][e]);
            }
        float corr[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            float mn = fmaxf(m[h], mx[h]);
            corr[h] = expf(m[h] - mn);
            m[h] = mn;
        }
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float w = expf(s[nt][e] - m[e >> 1]);  // 0 where masked (-inf)
                s[nt][e] = w;
                sum[e >> 1] += w;
            }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
            sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
            l[h] = l[h] * corr[h] + sum[h];
        }
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[nt][e] *= corr[e >> 1];
        // The weights' accumulator fragments are the A fragments of the product with V.
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) {
            u32 pa[4] = {bf16_pair(s[2 * kk][0], s[2 * kk][1]), bf16_pair(s[2 * kk][2], s[2 * kk][3]),
                         bf16_pair(s[2 * kk + 1][0], s[2 * kk + 1][1]), bf16_pair(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int nt = 0; nt < HD / 8; nt++) {
                if (nt * 8 >= hd) break;
                const u32* vr = sv + (nt * 8 + g) * VS + kk * 8 + tq;
                u32 b[2] = {vr[0], vr[4]};
                mma_bf16(o[nt], pa, b);
            }
        }
    }
    if (!warp_on) return;
#pragma unroll
    for (int nt = 0; nt < HD / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int h = e >> 1, d = nt * 8 + 2 * tq + (e & 1);
            if (ok[h] && d < hd) {
                size_t at = ((size_t)(t0 + rr[h] / gp) * nh + head0 + rr[h] % gp) * hd + d;
                st(out, at, o[nt][e] / l[h]);
            }
        }
}
// attn_mma_hd<largest head dimension>_kv<pool dtype>.
#define ATTN_MMA_KERNEL(HD, PSFX, P)                                                                              \
    extern "C" __global__ void __launch_bounds__(AM_THREADS) attn_mma_hd##HD##_kv##PSFX(                         \
        const float* q, const float* k_new, const float* v_new, const P* k_pool, const P* v_pool,                \
        const int* tok_chunk, const int* pos, const int* chunk_start, const int* chunk_base, const int* chunk_bt, \
        const int* block_tables, const int* tiles, bf16_t* out, int n, int nh, int nkv, int hd, int bs,          \
        int window, float scale, float softcap, int gp, int tpt) { grid_dep_wait();                                               \
        attn_mma_impl<HD>(q, k_new, v_new, k_pool, v_pool, tok_chunk, pos, chunk_start, chunk_base, chunk_bt,     \
                          block_tables, tiles, out, n, nh, nkv, hd, bs, window, scale, softcap, gp, tpt);         \
    }
ATTN_MMA_KERNEL(64, f32, float)
ATTN_MMA_KERNEL(64, bf16, bf16_t)
ATTN_MMA_KERNEL(64, fp8, fp8_t)
ATTN_MMA_KERNEL(128, f32, float)
ATTN_MMA_KERNEL(128, bf16, bf16_t)
ATTN_MMA_KERNEL(128, fp8, fp8_t)
ATTN_MMA_KERNEL(256, f32, float)
ATTN_MMA_KERNEL(256, bf16, bf16_t)
ATTN_MMA_KERNEL(256, fp8, fp8_t)

// ---- mixtures of experts over routed tokens (prompts) --------------------------------------------
//
// A pass of more tokens than the decode products take runs each expert over the tokens routed to
// it only, on tensor cores. moe_sort groups the (token, expert) pairs by expert into tiles of
// MR_ROWS rows, each tile one expert's (padded with -1); moe_gemm_* run one grouped product per
// projection over those tiles, MR_COLS output columns per block (blocks past the tiles in use exit
// at once, so the grid is sized for the most tiles a pass can have and a graph can hold it);
// moe_gather sums each token's experts weighted by its routing, in moe_accumulate's order. The
// expert tables are the decode products' (device addresses of each expert's bf16 matrices).

#define MR_ROWS 64   // rows (token, expert) of one tile: 4 warps of 16
#define MR_COLS 64   // output columns of one block
#define MR_K 32      // inner elements staged per step
#define MR_KS 20     // u32 stride of a staged row (16 pairs + 4, against bank conflicts)
#define MR_THREADS 128

// One block: counts each expert's routed tokens (route[t, e] != 0), lays the experts' rows out in
// tiles of MR_ROWS (counts padded up), and writes, per row, its token (sorted_tok, -1 for
// padding), per tile its expert (tile_expert), per pair its row (slot_of[t * n_exp + e], -1 where
// not routed), per token its experts in increasing order (tok_exp[t * top_k + j], -1 past the
// last), and the tiles in use (n_tiles[0]). counts holds n_exp ints of scratch.
extern "C" __global__ void __launch_bounds__(1024)
    moe_sort(const float* route, int n, int n_exp, int top_k, int* counts, int* slot_of, int* sorted_tok,
             int* tile_expert, int* n_tiles, int* tok_exp) {
    grid_dep_wait();
    __shared__ int s_tiles;
    const int pairs = n * n_exp;
    for (int e = threadIdx.x; e < n_exp; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x)
        slot_of[i] = route[i] != 0.0f ? atomicAdd(&counts[i % n_exp], 1) : -1;
    __syncthreads();
    if (threadIdx.x == 0) {
        int tiles = 0;
        for (int e = 0; e < n_exp; e++) {
            int c = counts[e], t = (c + MR_ROWS - 1) / MR_ROWS;
            counts[e] = tiles * MR_ROWS;  // now the expert's first row
            for (int j = 0; j < t; j++) tile_expert[tiles + j] = e;
            tiles += t;
        }
        s_tiles = tiles;
        n_tiles[0] = tiles;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < s_tiles * MR_ROWS; p += blockDim.x) sorted_tok[p] = -1;
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        if (slot_of[i] < 0) continue;
        int p = counts[i % n_exp] + slot_of[i];
        slot_of[i] = p;
        sorted_tok[p] = i / n_exp;
    }
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
        int j = 0;
        for (int e = 0; e < n_exp && j < top_k; e++)
            if (route[(size_t)t * n_exp + e] != 0.0f) tok_exp[t * top_k + j++] = e;
        for (; j < top_k; j++) tok_exp[t * top_k + j] = -1;
    }
}

// Stages MR_COLS rows of a bf16 matrix [rows, k_all] (rows col0.., inner k0..k0+MR_K) as bf16
// pairs; rows past `rows` are zeros. k_all is even.
__device__ __forceinline__ void mr_stage_w(const bf16_t* W, int rows, int k_all, int col0, int k0, u32* sw) {
    for (int idx = threadIdx.x; idx < MR_COLS * (MR_K / 2); idx += MR_THREADS) {
        int c = idx / (MR_K / 2), j = idx % (MR_K / 2), k = k0 + 2 * j;
        u32 v = 0;
        if (col0 + c < rows && k < k_all) v = *(const u32*)(W + (size_t)(col0 + c) * k_all + k);
        sw[c * MR_KS + j] = v;
    }
}

// acc[nt] += rows (16 per warp, staged in sx) · columns nt*8.. (staged in sw), over MR_K inners.
__device__ __forceinline__ void mr_mma(const u32* sx, const u32* sw, float (*acc)[4]) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int ks = 0; ks < MR_K / 16; ks++) {
        const u32* xr = sx + (warp * 16 + g) * MR_KS + ks * 8 + tq;
        u32 a[4] = {xr[0], xr[8 * MR_KS], xr[4], xr[8 * MR_KS + 4]};
#pragma unroll
        for (int nt = 0; nt < MR_COLS / 8; nt++) {
            const u32* wr = sw + (nt * 8 + g) * MR_KS + ks * 8 + tq;
            u32 b[2] = {wr[0], wr[4]};
            mma_bf16(acc[nt], a, b);
        }
    }
}

// Zeroes a block's accumulators (per lane: MR_COLS / 8 fragments of 4).
__device__ __forceinline__ void mr_zero(float (*acc)[4]) {
#pragma unroll
    for (int nt = 0; nt < MR_COLS / 8; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[nt][i] = 0.0f;
}

// Calls out(row of the tile, output column, fragment, element) for each accumulator this lane holds.
template <typename F>
__device__ __forceinline__ void mr_outputs(int col0, F out) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int nt = 0; nt < MR_COLS / 8; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) out(warp * 16 + g + (i >= 2 ? 8 : 0), col0 + nt * 8 + 2 * tq + (i & 1), nt, i);
}

// acts[p, :] = act(gate_e · x[t]) · (up_e · x[t]) in bf16 for row p = (token t, expert e) of the
// tiles (zeros for padding rows). x [n, h] bf16. Grid (tiles the pass may have, ff / MR_COLS up).
template <int ACT>
__device__ void moe_gemm_gated_impl(const unsigned long long* gate_tab, const unsigned long long* up_tab, int ff,
                                    int h, const bf16_t* x, const int* sorted_tok, const int* tile_expert,
                                    const int* n_tiles, bf16_t* acts) {
    __shared__ u32 sx[MR_ROWS * MR_KS], sg[MR_COLS * MR_KS], su[MR_COLS * MR_KS];
    const int tile = blockIdx.x, col0 = blockIdx.y * MR_COLS;
    if (tile >= n_tiles[0]) return;
    const int e = tile_expert[tile];
    const bf16_t* G = (const bf16_t*)gate_tab[e];
    const bf16_t* U = (const bf16_t*)up_tab[e];
    float ga[MR_COLS / 8][4], ua[MR_COLS / 8][4];
    mr_zero(ga);
    mr_zero(ua);
    for (int k0 = 0; k0 < h; k0 += MR_K) {
        for (int idx = threadIdx.x; idx < MR_ROWS * (MR_K / 2); idx += MR_THREADS) {
            int r = idx / (MR_K / 2), j = idx % (MR_K / 2), k = k0 + 2 * j;
            int t = sorted_tok[tile * MR_ROWS + r];
            sx[r * MR_KS + j] = t >= 0 && k < h ? *(const u32*)(x + (size_t)t * h + k) : 0u;
        }
        mr_stage_w(G, ff, h, col0, k0, sg);
        mr_stage_w(U, ff, h, col0, k0, su);
        __syncthreads();
        mr_mma(sx, sg, ga);
        mr_mma(sx, su, ua);
        __syncthreads();
    }
    mr_outputs(col0, [&](int r, int c, int nt, int i) {
        size_t p = (size_t)tile * MR_ROWS + r;
        if (c < ff) st(acts, p * ff + c, sorted_tok[p] >= 0 ? gated_of<ACT>(ga[nt][i], ua[nt][i]) : 0.0f);
    });
}
#define MOE_GEMM_GATED(NAME, ACT)                                                                           \
    extern "C" __global__ void __launch_bounds__(MR_THREADS)                                                \
        NAME(const unsigned long long* gate_tab, const unsigned long long* up_tab, int ff, int h,           \
             const bf16_t* x, const int* sorted_tok, const int* tile_expert, const int* n_tiles, bf16_t* acts) { \
        grid_dep_wait();                                                                                    \
        moe_gemm_gated_impl<ACT>(gate_tab, up_tab, ff, h, x, sorted_tok, tile_expert, n_tiles, acts);       \
    }
MOE_GEMM_GATED(moe_gemm_silu, 0)
MOE_GEMM_GATED(moe_gemm_gelu, 1)

// ye[p, :] = down_e · acts[p, :] (f32) for every row p of the tiles. Grid (tiles the pass may
// have, h / MR_COLS up).
extern "C" __global__ void __launch_bounds__(MR_THREADS)
    moe_gemm_down(const unsigned long long* down_tab, int h, int ff, const bf16_t* acts, const int* tile_expert,
                  const int* n_tiles, float* ye) {
    grid_dep_wait();
    __shared__ u32 sx[MR_ROWS * MR_KS], sw[MR_COLS * MR_KS];
    const int tile = blockIdx.x, col0 = blockIdx.y * MR_COLS;
    if (tile >= n_tiles[0]) return;
    const bf16_t* D = (const bf16_t*)down_tab[tile_expert[tile]];
    float acc[MR_COLS / 8][4];
    mr_zero(acc);
    for (int k0 = 0; k0 < ff; k0 += MR_K) {
        for (int idx = threadIdx.x; idx < MR_ROWS * (MR_K / 2); idx += MR_THREADS) {
            int r = idx / (MR_K / 2), j = idx % (MR_K / 2), k = k0 + 2 * j;
            sx[r * MR_KS + j] = k < ff ? *(const u32*)(acts + ((size_t)tile * MR_ROWS + r) * ff + k) : 0u;
        }
        mr_stage_w(D, h, ff, col0, k0, sw);
        __syncthreads();
        mr_mma(sx, sw, acc);
        __syncthreads();
    }
    mr_outputs(col0, [&](int r, int c, int nt, int i) {
        if (c < h) ye[((size_t)tile * MR_ROWS + r) * h + c] = acc[nt][i];
    });
}

// out[t, :] = Σ over t's experts e in increasing order (tok_exp, from moe_sort) of
// route[t, e] · ye[slot_of[t, e], :] (moe_accumulate's arithmetic and order), reading only the
// routed experts' weights. Grid-stride over n · h.
extern "C" __global__ void moe_gather(float* out, const float* ye, const float* route, const int* slot_of,
                                      const int* tok_exp, int n_exp, int top_k, int h, int n) {
    grid_dep_wait();
    long long count = (long long)n * h;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = i / h, r = i % h;
        float acc = 0.0f;
        for (int j = 0; j < top_k; j++) {
            int e = tok_exp[t * top_k + j];
            if (e < 0) break;
            acc += route[t * n_exp + e] * ye[(size_t)slot_of[t * n_exp + e] * h + r];
        }
        out[i] = acc;
    }
}

// ---- greedy sampling ---------------------------------------------------------------------------

#define F32_MAX 3.402823466e+38f

// (value, index) ordering of the greedy pick: larger value first, then lower index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// For each row of logits [rows, vocab] (one block per row, blockDim.x a multiple of 32): the greedy
// token and its log-probability under the row's softmax, with the host sampler's conventions: NaN
// counts as -inf, +inf as the largest float, ties go to the lowest id. A row with no finite
// maximum yields its first non-NaN id (0 if none) with log-probability -inf.
extern "C" __global__ void __launch_bounds__(1024) greedy_rows(const float* logits, int vocab, int* tokens, float* logprobs) {
    grid_dep_wait();
    __shared__ float s_val[32];
    __shared__ int s_idx[32], s_first[32];
    __shared__ double s_sum[32];
    const float neg_inf = __int_as_float(0xff800000);
    const float* row = logits + (size_t)blockIdx.x * vocab;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float best = neg_inf;
    int bi = 0x7fffffff, first = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float l = row[i];
        if (l != l) continue;
        first = min(first, i);
        if (l > F32_MAX) l = F32_MAX;
        if (l > neg_inf && better(l, i, best, bi)) {
            best = l;
            bi = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        int of = __shfl_xor_sync(0xffffffffu, first, o);
        if (better(ov, oi, best, bi)) {
            best = ov;
            bi = oi;
        }
        first = min(first, of);
    }
    if (lane == 0) {
        s_val[warp] = best;
        s_idx[warp] = bi;
        s_first[warp] = first;
    }
    __syncthreads();
    best = neg_inf;
    bi = 0x7fffffff;
    first = 0x7fffffff;
    for (int w = 0; w < nw; w++) {
        if (better(s_val[w], s_idx[w], best, bi)) {
            best = s_val[w];
            bi = s_idx[w];
        }
        first = min(first, s_first[w]);
    }
    if (bi == 0x7fffffff) {
        if (threadIdx.x == 0) {
            tokens[blockIdx.x] = first == 0x7fffffff ? 0 : first;
            logprobs[blockIdx.x] = neg_inf;
        }
        return;
    }
    double sum = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float l = row[i];
        if (l != l) continue;
        if (l > F32_MAX) l = F32_MAX;
        sum += (double)expf(l - best);
    }
    sum = warp_sum_d(sum);
    if (lane == 0) s_sum[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < nw; w++) total += s_sum[w];
        double log_z = (double)best + log(total);
        tokens[blockIdx.x] = bi;
        logprobs[blockIdx.x] = (float)((double)best - log_z);
    }
}

// ---- sampling on the device --------------------------------------------------------------------
//
// `sample_rows` draws one token per logits row with the host sampler's rules (engine/src/sampler.rs),
// so that only the token, its log-probability and the alternatives asked for come back:
//   - the constraint's mask first (forbidden ids are -inf; when no allowed id has a logit above
//     -inf, the lowest allowed id gets 0), then NaN as -inf and +inf as the largest float;
//   - log-probabilities from that row's log-softmax, before any sampling transform;
//   - the repetition penalty on the ids of a bitmap, then temperature, top-k, top-p, min-p and one
//     draw of the host's uniform, walking the candidates in the host's order: by id when neither
//     top-k nor top-p applies, else by (scaled logit descending, id ascending).
// A sorted draw holds at most SAMPLE_LIST candidates in shared memory: a row whose top-k is larger,
// or whose top-p prefix does not fit, is left to the host (status 1), which samples it from the
// logits row as before. Per row, `fpar` holds temperature, top-p, min-p and the penalty; `ipar`
// holds top-k (negative: leave the row to the host), alternatives asked for, and the word offsets
// into `bits` of the allowed-ids mask and the penalised-ids bitmap (-1: none); `uni` the uniform in
// [0, 1). Out, per row: `out_i` status, token, whether the uniform was used, alternatives, then
// their ids; `out_f` the token's log-probability, then the alternatives'. blockDim.x is a multiple
// of 32, at most 1024.

#define SAMPLE_LIST 4096
#define SAMPLE_MAX_TOP 20
#define SAMPLE_OUT_I (4 + SAMPLE_MAX_TOP)
#define SAMPLE_OUT_F (1 + SAMPLE_MAX_TOP)
#define SAMPLE_NONE 0x7fffffff
// Candidate weights become fixed point with this many fraction bits to find a top-p threshold:
// integer sums are exact and do not depend on the order the threads add them in.
#define SAMPLE_MASS_BITS 40

struct SampleRow {
    const float* row;
    const unsigned* allow;     // null: no constraint
    const unsigned* penalised; // null: no repetition penalty
    float penalty;
    int fix;                   // the allowed id whose logit becomes 0, or -1
};

__device__ __forceinline__ bool bit_set(const unsigned* bits, int i) { return (bits[i >> 5] >> (i & 31)) & 1u; }

__device__ __forceinline__ float safe_logit(float l) {
    return l != l ? __int_as_float(0xff800000) : (l > F32_MAX ? F32_MAX : l);
}

// The logit after the constraint's mask (NaN stays NaN).
__device__ __forceinline__ float masked_logit(const SampleRow& r, int i) {
    if (i == r.fix) return 0.0f;
    if (r.allow && !bit_set(r.allow, i)) return __int_as_float(0xff800000);
    return r.row[i];
}

// The row the log-probabilities report: masked, NaN as -inf, +inf as the largest float.
__device__ __forceinline__ float raw_logit(const SampleRow& r, int i) { return safe_logit(masked_logit(r, i)); }

// The row the draw is made from: the raw one with the repetition penalty applied.
__device__ __forceinline__ float penalised_logit(const SampleRow& r, int i) {
    float l = raw_logit(r, i);
    if (r.penalised && bit_set(r.penalised, i)) l = l < 0.0f ? l * r.penalty : l / r.penalty;
    return l;
}

// A float's bits as an unsigned integer with the same order (larger float, larger key).
__device__ __forceinline__ unsigned order_key(float f) {
    unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// `better` in the host's total order of floats, where -0 ranks below +0 (the alternatives' order).
__device__ __forceinline__ bool better_total(float v, int i, float bv, int bi) {
    unsigned a = order_key(v), b = order_key(bv);
    return a > b || (a == b && i < bi);
}

// Block-wide reductions; every thread gets the result.
__device__ int block_min_i(int v) {
    __shared__ int cell;
    if (threadIdx.x == 0) cell = SAMPLE_NONE;
    __syncthreads();
    if (v != SAMPLE_NONE) atomicMin(&cell, v);
    __syncthreads();
    int r = cell;
    __syncthreads();
    return r;
}
__device__ int block_max_i(int v) {
    __shared__ int cell;
    if (threadIdx.x == 0) cell = -1;
    __syncthreads();
    if (v >= 0) atomicMax(&cell, v);
    __syncthreads();
    int r = cell;
    __syncthreads();
    return r;
}
__device__ int block_sum_i(int v) {
    __shared__ int cell;
    if (threadIdx.x == 0) cell = 0;
    __syncthreads();
    if (v) atomicAdd(&cell, v);
    __syncthreads();
    int r = cell;
    __syncthreads();
    return r;
}
// The best (value, id) of the block in `better`'s order (`better_total`'s when `total`).
__device__ void block_best(float& v, int& i, bool total = false) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (total ? better_total(ov, oi, v, i) : better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    if (lane == 0) {
        bv[warp] = v;
        bi[warp] = i;
    }
    __syncthreads();
    for (int w = 0; w < nw; w++) {
        if (total ? better_total(bv[w], bi[w], v, i) : better(bv[w], bi[w], v, i)) {
            v = bv[w];
            i = bi[w];
        }
    }
    __syncthreads();
}

// The first index of 0..n whose running sum of `weight` (in index order) is above `u` (at or above
// it when `inclusive`), or SAMPLE_NONE. Each thread owns a contiguous run of indices; runs are
// summed, their sums scanned (in `scan`, shared, one double per thread), and the run where the sum
// crosses `u` is walked again.
template <typename W>
__device__ int first_crossing(int n, W weight, double u, bool inclusive, double* scan) {
    int t = threadIdx.x, nt = blockDim.x;
    int per = (n + nt - 1) / nt, lo = min(n, t * per), hi = min(n, lo + per);
    double own = 0.0;
    for (int i = lo; i < hi; i++) own += weight(i);
    scan[t] = own;
    __syncthreads();
    for (int off = 1; off < nt; off <<= 1) {
        double add = t >= off ? scan[t - off] : 0.0;
        __syncthreads();
        scan[t] += add;
        __syncthreads();
    }
    double before = t > 0 ? scan[t - 1] : 0.0;
    __syncthreads();
    int found = SAMPLE_NONE;
    double end = before + own;
    if (inclusive ? end >= u : end > u) {
        double acc = 0.0;
        for (int i = lo; i < hi; i++) {
            acc += weight(i);
            double at = before + acc;
            if (inclusive ? at >= u : at > u) {
                found = i;
                break;
            }
        }
    }
    return block_min_i(found);
}

// The largest key `k` such that the candidates with key >= k amount to at least `need` (key 0: not
// a candidate), found digit by digit from the top (`hist`: 256 shared counters); the smallest key
// when they never do.
template <typename K, typename A>
__device__ unsigned radix_select(int n, K key, A amount, unsigned long long need, unsigned long long* hist) {
    __shared__ unsigned s_prefix;
    __shared__ unsigned long long s_need;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_need = need;
    }
    unsigned mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        unsigned prefix = s_prefix;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            unsigned k = key(i);
            if (k && (k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], amount(i));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long acc = 0;
            int digit = 0;
            for (int b = 255; b >= 0; b--) {
                if (acc + hist[b] >= s_need) {
                    digit = b;
                    s_need -= acc;
                    break;
                }
                acc += hist[b];
            }
            s_prefix = prefix | ((unsigned)digit << shift);
        }
        mask |= 255u << shift;
        __syncthreads();
    }
    unsigned r = s_prefix;
    __syncthreads();
    return r;
}

extern "C" __global__ void __launch_bounds__(1024)
    sample_rows(const float* logits, int vocab, const float* fpar, const int* ipar, const double* uni,
                const unsigned* bits, int* out_i, float* out_f) {
    grid_dep_wait();
    // Instantiations of one helper would each get their own shared arrays: the kernel owns them.
    __shared__ unsigned long long list[SAMPLE_LIST];
    __shared__ double scan[1024];
    __shared__ unsigned long long hist[256];
    __shared__ int list_len;
    const float neg_inf = __int_as_float(0xff800000);
    const int rix = blockIdx.x, t = threadIdx.x, nt = blockDim.x;
    const float temp = fpar[rix * 4], top_p = fpar[rix * 4 + 1], min_p = fpar[rix * 4 + 2];
    const int top_k = ipar[rix * 4], n_top = min(min(ipar[rix * 4 + 1], SAMPLE_MAX_TOP), vocab);
    const int allow_at = ipar[rix * 4 + 2], pen_at = ipar[rix * 4 + 3];
    SampleRow r;
    r.row = logits + (size_t)rix * vocab;
    r.allow = allow_at >= 0 ? bits + allow_at : nullptr;
    r.penalty = fpar[rix * 4 + 3];
    r.penalised = pen_at >= 0 && r.penalty != 1.0f ? bits + pen_at : nullptr;
    r.fix = -1;
    int* oi = out_i + (size_t)rix * SAMPLE_OUT_I;
    float* of = out_f + (size_t)rix * SAMPLE_OUT_F;
    if (top_k < 0) {
        // The host samples this row itself.
        if (t == 0) oi[0] = 1;
        return;
    }

    // The constraint: when no allowed id has a logit above -inf, the lowest allowed one gets 0.
    if (r.allow) {
        int any = -1, first = SAMPLE_NONE;
        for (int i = t; i < vocab; i += nt) {
            if (!bit_set(r.allow, i)) continue;
            first = min(first, i);
            if (r.row[i] > neg_inf) any = 1;
        }
        any = block_max_i(any);
        first = block_min_i(first);
        if (any < 0 && first != SAMPLE_NONE) r.fix = first;
    }

    // The raw row's maximum, its log-sum-exp, and the first id that is not NaN (the pick when
    // nothing is finite).
    float mx = neg_inf;
    int first_ok = SAMPLE_NONE;
    for (int i = t; i < vocab; i += nt) {
        float m = masked_logit(r, i);
        if (m == m) first_ok = min(first_ok, i);
        mx = fmaxf(mx, safe_logit(m));
    }
    {
        int none = SAMPLE_NONE;
        block_best(mx, none);
    }
    first_ok = block_min_i(first_ok);
    if (mx == neg_inf) {
        if (t == 0) {
            oi[0] = 0;
            oi[1] = first_ok == SAMPLE_NONE ? 0 : first_ok;
            oi[2] = 0;
            oi[3] = 0;
            of[0] = neg_inf;
        }
        return;
    }
    double z = 0.0;
    for (int i = t; i < vocab; i += nt) z += (double)expf(raw_logit(r, i) - mx);
    const double log_z = (double)mx + log(block_sum_d(z));

    // The alternatives: the n_top best raw logits in the host's total order (-0 below +0), each
    // found below the one before.
    float prev_v = 0.0f;
    int prev_i = -1;
    for (int k = 0; k < n_top; k++) {
        float bv = neg_inf;
        int bi = SAMPLE_NONE;
        for (int i = t; i < vocab; i += nt) {
            float l = raw_logit(r, i);
            if (prev_i >= 0 && !better_total(prev_v, prev_i, l, i)) continue;
            if (better_total(l, i, bv, bi)) {
                bv = l;
                bi = i;
            }
        }
        block_best(bv, bi, true);
        if (t == 0) {
            oi[4 + k] = bi;
            of[1 + k] = (float)((double)bv - log_z);
        }
        prev_v = bv;
        prev_i = bi;
    }

    // The penalised row's best token.
    float pmax = neg_inf;
    int pbest = SAMPLE_NONE;
    for (int i = t; i < vocab; i += nt) {
        float l = penalised_logit(r, i);
        if (l > neg_inf && better(l, i, pmax, pbest)) {
            pmax = l;
            pbest = i;
        }
    }
    block_best(pmax, pbest);

    int status = 0, token, drew = 0;
    if (pbest == SAMPLE_NONE) {
        token = first_ok;
    } else if (temp == 0.0f) {
        token = pbest;
    } else {
        drew = 1;
        // Scaled logits relative to the best: (l - max) / T, with -0 made +0 as the host does.
        auto scaled = [&](int i) { return (penalised_logit(r, i) - pmax) / temp + 0.0f; };
        auto kept_by_min_p = [&](float s) { return min_p <= 0.0f || expf(s) >= min_p; };
        int n_cand = 0;
        for (int i = t; i < vocab; i += nt) n_cand += scaled(i) > neg_inf;
        n_cand = block_sum_i(n_cand);
        // No candidate at all (a penalty below 1 can take the largest float to +inf, whose scaled
        // logit is NaN): the host picks the penalised row's best without a draw.
        if (n_cand == 0) drew = 0;
        const bool by_k = top_k > 0 && top_k < n_cand;
        const bool by_p = top_p < 1.0f && (by_k ? top_k : n_cand) > 1;
        const double u01 = uni[rix];
        if (n_cand == 0) {
            token = pbest;
        } else if (!by_k && !by_p) {
            // Every candidate (min-p aside), walked by id.
            auto weight = [&](int i) {
                float s = scaled(i);
                return s > neg_inf && kept_by_min_p(s) ? (double)expf(s) : 0.0;
            };
            double total = 0.0;
            int last = -1, first = SAMPLE_NONE;
            for (int i = t; i < vocab; i += nt) {
                double w = weight(i);
                total += w;
                if (w > 0.0) last = i;
                if (scaled(i) > neg_inf) first = min(first, i);
            }
            total = block_sum_d(total);
            last = block_max_i(last);
            first = block_min_i(first);
            token = first_crossing(vocab, weight, u01 * total, false, scan);
            if (token == SAMPLE_NONE) token = last >= 0 ? last : first;
        } else if (by_k && top_k > SAMPLE_LIST) {
            status = 1;
        } else {
            // A prefix of the candidates in (scaled logit descending, id ascending) order that holds
            // the survivors: the top_k best, or enough for top-p's mass.
            auto key = [&](int i) {
                float s = scaled(i);
                return s > neg_inf ? order_key(s) : 0u;
            };
            double total_all = 0.0;
            unsigned threshold, tie_threshold = 0;
            if (by_k) {
                auto one = [](int) { return 1ull; };
                threshold = radix_select(vocab, key, one, (unsigned long long)top_k, hist);
                // Ties at the threshold past the list: keep only the lowest ids among them, as many
                // as top_k still needs (a second select, over the ties' ids, lower id higher key).
                int at_or_above = 0;
                for (int i = t; i < vocab; i += nt) at_or_above += key(i) >= threshold;
                if (block_sum_i(at_or_above) > SAMPLE_LIST) {
                    int above = 0;
                    for (int i = t; i < vocab; i += nt) above += key(i) > threshold;
                    above = block_sum_i(above);
                    auto tie_key = [&](int i) { return key(i) == threshold ? ~(unsigned)i : 0u; };
                    tie_threshold = radix_select(vocab, tie_key, one, (unsigned long long)(top_k - above), hist);
                }
            } else {
                for (int i = t; i < vocab; i += nt) {
                    float s = scaled(i);
                    if (s > neg_inf) total_all += (double)expf(s);
                }
                total_all = block_sum_d(total_all);
                double scale = (double)(1ull << SAMPLE_MASS_BITS);
                double need = ceil((double)top_p * total_all * scale);
                auto mass = [&](int i) { return (unsigned long long)((double)expf(scaled(i)) * scale); };
                threshold = radix_select(vocab, key, mass, need < 1.0 ? 1ull : (unsigned long long)need, hist);
            }
            if (t == 0) list_len = 0;
            __syncthreads();
            for (int i = t; i < vocab; i += nt) {
                unsigned k = key(i);
                if (k && (k > threshold || (k == threshold && ~(unsigned)i >= tie_threshold))) {
                    int at = atomicAdd(&list_len, 1);
                    if (at < SAMPLE_LIST) list[at] = ((unsigned long long)k << 32) | (0xffffffffu - (unsigned)i);
                }
            }
            __syncthreads();
            int n = list_len;
            __syncthreads();
            if (n > SAMPLE_LIST || n == 0 || (by_k && n < top_k)) {
                status = 1;
            } else {
                // Bitonic sort, descending, over a power of two padded with zeros (below any key).
                int p2 = 1;
                while (p2 < n) p2 <<= 1;
                for (int i = n + t; i < p2; i += nt) list[i] = 0;
                __syncthreads();
                for (int k = 2; k <= p2; k <<= 1) {
                    for (int j = k >> 1; j > 0; j >>= 1) {
                        for (int i = t; i < p2; i += nt) {
                            int o = i ^ j;
                            if (o > i) {
                                unsigned long long a = list[i], b = list[o];
                                if ((i & k) == 0 ? a < b : a > b) {
                                    list[i] = b;
                                    list[o] = a;
                                }
                            }
                        }
                        __syncthreads();
                    }
                }
                auto s_at = [&](int j) { return key_float((unsigned)(list[j] >> 32)); };
                auto id_at = [&](int j) { return (int)(0xffffffffu - (unsigned)(list[j] & 0xffffffffu)); };
                int len = by_k ? top_k : n;
                if (by_p) {
                    double total = total_all;
                    auto w = [&](int j) { return (double)expf(s_at(j)); };
                    if (by_k) {
                        total = 0.0;
                        for (int j = t; j < len; j += nt) total += w(j);
                        total = block_sum_d(total);
                    }
                    int cut = first_crossing(len, w, (double)top_p * total, true, scan);
                    if (cut != SAMPLE_NONE) {
                        len = cut + 1;
                    } else if (!by_k) {
                        status = 1; // rounding left the prefix short of the target: the host decides
                    }
                }
                if (status == 0) {
                    auto weight = [&](int j) {
                        float s = s_at(j);
                        return kept_by_min_p(s) ? (double)expf(s) : 0.0;
                    };
                    double total = 0.0;
                    int last = -1;
                    for (int j = t; j < len; j += nt) {
                        double w = weight(j);
                        total += w;
                        if (w > 0.0) last = j;
                    }
                    total = block_sum_d(total);
                    last = block_max_i(last);
                    int at = first_crossing(len, weight, u01 * total, false, scan);
                    if (at == SAMPLE_NONE) at = last >= 0 ? last : 0;
                    token = id_at(at);
                }
            }
        }
    }
    if (t == 0) {
        oi[0] = status;
        if (status == 0) {
            oi[1] = token;
            oi[2] = drew;
            oi[3] = n_top;
            of[0] = (float)((double)raw_logit(r, token) - log_z);
        }
    }
}
