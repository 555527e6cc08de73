// A CPU stand-in for the few CUDA features kernels/cuda/*.cu use, so the kernels' index math,
// reductions and numerics can be checked on a machine without a GPU: every CUDA thread of a block
// is an OS thread, blocks run one after another, `__syncthreads` is a block-wide barrier and warp
// shuffles exchange through a per-warp buffer between two per-warp barriers (warps of one block may
// shuffle a different number of times, as in the attention loop). Shared memory is a function-local
// static, which is correct because only one block runs at a time. Test code only.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline std::vector<float> g_dyn_shared;

struct BlockSync {
    std::unique_ptr<std::barrier<>> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<uint64_t> exchange;
    std::vector<uint32_t> mma;  // six fragment registers per thread (mma_bf16)
};
inline BlockSync* g_sync = nullptr;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

using std::max;
using std::min;

inline void __syncthreads() { g_sync->block->arrive_and_wait(); }
// Every lane of the calling warp waits for the others (and sees their writes).
inline void __syncwarp(unsigned = 0xffffffffu) { g_sync->warps[threadIdx.x / 32]->arrive_and_wait(); }

template <typename T>
T __shfl_xor_sync(unsigned, T v, int o) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    unsigned tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    g_sync->exchange[tid] = bits;
    g_sync->warps[warp]->arrive_and_wait();
    uint64_t other = g_sync->exchange[warp * 32 + (lane ^ (unsigned)o)];
    g_sync->warps[warp]->arrive_and_wait();
    T out;
    std::memcpy(&out, &other, sizeof(T));
    return out;
}

// Blocks run one after another here, but a block's threads run at once: atomics are real ones.
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline int atomicMin(int* p, int v) {
    int cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < cur && !__atomic_compare_exchange_n(p, &cur, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return cur;
}
inline int atomicMax(int* p, int v) {
    int cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v > cur && !__atomic_compare_exchange_n(p, &cur, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return cur;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
// Single roundings, never fused into a multiply-add (the harness is built without FMA).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}

// The warp-wide bf16 tensor-core product of model.cu (`mma.m16n8k16`, f32 accumulators), from the
// fragment layout PTX defines: each lane publishes its A and B registers, then computes its four
// outputs from the whole warp's fragments, summing the 16 products in double.
#define TANDEM_EMULATED_MMA 1
inline void mma_bf16(float* d, const unsigned* a, const unsigned* b) {
    unsigned tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    uint32_t* mine = &g_sync->mma[tid * 6];
    for (int i = 0; i < 4; i++) mine[i] = a[i];
    mine[4] = b[0];
    mine[5] = b[1];
    g_sync->warps[warp]->arrive_and_wait();
    auto half = [](uint32_t reg, int upper) { return __uint_as_float((upper ? reg >> 16 : reg & 0xffffu) << 16); };
    const uint32_t* w = &g_sync->mma[warp * 32 * 6];
    // A (row, col): lane 4 * (row % 8) + (col % 8) / 2, register (row / 8) + 2 * (col / 8).
    auto A = [&](int row, int col) {
        return half(w[(4 * (row % 8) + (col % 8) / 2) * 6 + row / 8 + 2 * (col / 8)], col & 1);
    };
    // B (k, col): lane 4 * col + (k % 8) / 2, register k / 8.
    auto B = [&](int k, int col) { return half(w[(4 * col + (k % 8) / 2) * 6 + 4 + k / 8], k & 1); };
    unsigned g = lane / 4, t = lane % 4;
    float out[4];
    for (int e = 0; e < 4; e++) {
        int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
        double acc = 0;
        for (int k = 0; k < 16; k++) acc += (double)A(row, k) * B(k, col);
        out[e] = (float)(d[e] + acc);
    }
    g_sync->warps[warp]->arrive_and_wait();
    for (int e = 0; e < 4; e++) d[e] = out[e];
}

// Runs `kernel` over the grid (x, y and z); `shared_floats` sizes the dynamic shared memory.
inline void launch(dim3 grid, dim3 block, size_t shared_floats, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = block;
    unsigned n = block.x;
    for (unsigned b = 0; b < grid.x * grid.y * grid.z; b++) {
        unsigned bx = b % grid.x, by = b / grid.x % grid.y, bz = b / (grid.x * grid.y);
        BlockSync sync;
        sync.block = std::make_unique<std::barrier<>>(n);
        for (unsigned w = 0; w < (n + 31) / 32; w++)
            sync.warps.push_back(std::make_unique<std::barrier<>>(std::min(32u, n - w * 32)));
        sync.exchange.assign(n, 0);
        sync.mma.assign(n * 6, 0);
        g_sync = &sync;
        g_dyn_shared.assign(shared_floats, 0.0f);
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < n; t++) {
            threads.emplace_back([&, t] {
                threadIdx = dim3{t, 0, 0};
                blockIdx = dim3{bx, by, bz};
                kernel();
            });
        }
        for (auto& th : threads) th.join();
        g_sync = nullptr;
    }
}
