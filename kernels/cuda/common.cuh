// common.cuh: device helpers shared by every kernel of the CUDA backend (kernels/cuda/*.cu).
//
// Header-free on purpose: fp16 values travel as raw 16-bit patterns (unsigned short) and pairs of them
// as 32-bit words, converted with PTX `cvt`, so the same source compiles under NVRTC (cupy.RawModule,
// which may not find cuda_fp16.h) and under nvcc (the CPU-side compile test) without include paths.
// The loader pastes this file in place of `#include "common.cuh"` so that CuPy's kernel cache, which
// hashes the source text it is given, sees every change made here.
//
// Mirrors kernels/numpy/int4_sym_g128.py (the unpack) and the fp32-accumulation contract of docs/ARCHITECTURE.md.
// The loader inlines every `#include "x.cuh"` of this folder once per module, so a header that includes
// this one (gemv_rows.cuh) and a module that includes both get one copy.
#pragma once

typedef unsigned int u32;
typedef unsigned short f16_bits;  // one IEEE fp16 value, bit pattern

#define WARP 32
#define FULL_MASK 0xffffffffu

// The epilogue fused into a quantized linear's GEMV (one per op of docs/BACKEND.md that has a weight):
// q/k/v + fp16 bias -> fp16, o/down + fp32 residual add, gate/up -> fp16 silu(gate) * up. The prefill
// path's standalone versions are the epi_* kernels of epilogues.cu.
enum { EPI_BIAS_F16 = 0, EPI_RESIDUAL_F32 = 1, EPI_SILU_MUL_F16 = 2 };

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// ---- programmatic dependent launch (sm_90) -----------------------------------------------------------
//
// A decode step is a chain of a few hundred short kernels, each reading what the one before wrote; one
// that starts only when its predecessor has ended spends microseconds on launch and ramp-up. Launched
// with the programmatic-serialization attribute (loader.py: into a captured CUDA graph, while the
// backend's `pdl` is on), a kernel may start while its predecessor still runs, so that:
//   * pdl_wait() must come before the kernel reads anything an earlier kernel wrote (activations,
//     positions, lengths, the KV pages) and before it writes anything: it returns once the predecessor
//     has completed and its writes are visible (and at once for a kernel launched without the
//     attribute). Every block calls it, early returns included: so when a kernel has completed, so has
//     every kernel before it;
//   * before that wait a kernel may touch only memory no kernel of the step writes (the weights). A
//     bulk L2 prefetch of each GEMV block's weight rows there was measured and dropped: it slowed the
//     large GEMVs by 6-19% (bench/NOTES.md, v4);
//   * pdl_launch_dependents() lets the next kernel's blocks be scheduled as soon as every block of this
//     one has started (not ended); it orders no memory, the next kernel's own pdl_wait() does.
// The loader launches an entry point with the attribute only when its source calls pdl_wait() (itself
// or through a function it calls): a kernel that does not wait is never overlapped.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// Both, in order: what a kernel that has nothing to prefetch does first.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}

// ---- fp16 <-> fp32 (round to nearest even on the way down, as NumPy's astype(float16)) ----------

__device__ __forceinline__ float h2f(f16_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ f16_bits f2h(float f) {
    f16_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// A 32-bit word holding two fp16 (low half = element 0) -> two floats.
__device__ __forceinline__ void h2x2f(u32 w, float& lo, float& hi) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
        : "=f"(lo), "=f"(hi) : "r"(w));
}

// ---- INT4 int4_sym_g128 (ValueShuffle) unpack -----------------------------------------------------
//
// qweight is uint32 [out, in/8]; word j of a row holds elements 8j .. 8j+7 (docs/FORMAT.md):
//
//     bit   31..28  27..24  23..20  19..16  15..12  11..8   7..4    3..0
//          +-------+-------+-------+-------+-------+-------+-------+-------+
//          |  e7   |  e5   |  e3   |  e1   |  e6   |  e4   |  e2   |  e0   |
//          +-------+-------+-------+-------+-------+-------+-------+-------+
//     nibble   7       6       5       4       3       2       1       0
//
//     nibble k holds element 8j + (0, 2, 4, 6, 1, 3, 5, 7)[k]
//     (word >> 4k) & 0x000F000F  ->  element 2k in bits 0..3, element 2k+1 in bits 16..19:
//     the pair (2k, 2k+1) in the two 16-bit halves, one OR with 0x6400 away from a half2.
//
// Why 0x6400: it is fp16 1024.0, whose ulp is exactly 1, so OR-ing a nibble n (0..15) into its
// mantissa gives the fp16 value 1024 + n exactly. One lop3 does mask-and-or for both halves at once;
// subtracting 1032 (= 1024 + the zero point 8, fp16 0x6408) in half2 leaves n - 8 exactly (-8..7).
// The pair (2k, 2k+1) matches two consecutive fp16 activations, i.e. one 32-bit word of x, so a
// 16-byte load of x (8 halves, 4 words) lines up with one qweight word's 4 pairs.

// Pair c (elements 2c, 2c+1) of a qweight word as the half2 (n - z, n' - z), exact: `zz` is the half2
// (1024 + z, 1024 + z), SYM_ZERO_PAIR for int4_sym_g128's fixed zero point 8 (int4_asym_g128 passes its
// group's). c may be a lane's runtime index (the prefill kernel's B fragment) or a constant.
constexpr u32 SYM_ZERO_PAIR = 0x64086408u;  // the half2 (1032, 1032): 1024 + the zero point 8
__device__ __forceinline__ u32 int4_pair(u32 word, int c, u32 zz = SYM_ZERO_PAIR) {
    u32 t, q;
    // lop3 LUT 0xEA = (a & b) | c  with a = word >> 4c, b = 0x000F000F, c = 0x64006400
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(t) : "r"(word >> (4 * c)), "r"(0x000F000Fu), "r"(0x64006400u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(q) : "r"(t), "r"(zz));
    return q;
}

// int4_asym_g128: a scale_zero word (low half: fp16 scale, high half: fp16 1024 + z, i.e. 0x6400 | z)
// -> the half2 (1024 + z, 1024 + z): prmt 0x3232 copies bytes (2, 3) into both halves.
__device__ __forceinline__ u32 zero_pair(u32 scale_zero) {
    u32 z;
    asm("prmt.b32 %0, %1, %2, 0x3232;" : "=r"(z) : "r"(scale_zero), "r"(0u));
    return z;
}

// q[k] = half2 (element 2k - z, element 2k+1 - z) of `word`, k = 0..3, where zz = half2 (1024 + z, 1024 + z):
// int4_sym_g128's fixed z = 8 by default, or an int4_asym_g128 group's zero point (zero_pair); q - z is
// exact in fp16 (-15 .. 15).
__device__ __forceinline__ void unpack_int4_pairs(u32 word, u32 (&q)[4], u32 zz = SYM_ZERO_PAIR) {
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = int4_pair(word, k, zz);
}

// fp32 dot product of 8 fp16 weights (4 words) with 8 fp16 activations (4 words).
__device__ __forceinline__ float dot_f16x8(const u32 (&w)[4], const u32 (&x)[4], float acc) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float w0, w1, x0, x1;
        h2x2f(w[k], w0, w1);
        h2x2f(x[k], x0, x1);
        acc = fmaf(w0, x0, acc);
        acc = fmaf(w1, x1, acc);
    }
    return acc;
}

// fp32 dot product of one qweight word's 8 values (nibble - 8, unscaled) with 8 fp16 activations
// held as 4 words (pair k of x is word k). Products and sums in fp32 (the precision contract).
__device__ __forceinline__ float dot_int4_word(u32 word, const u32 (&x)[4], float acc) {
    u32 q[4];
    unpack_int4_pairs(word, q);  // the 8 values n - 8 as four half2 words, pair k in word k
    return dot_f16x8(q, x, acc);
}

__device__ __forceinline__ void uint4_words(const uint4& v, u32 (&w)[4]) {
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
}

// ---- reductions -------------------------------------------------------------------------------
// Butterfly (xor) shuffles: a fixed tree, so the result does not depend on timing (determinism).
// Every lane of the warp must call these (full mask).

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Sum / max over aligned groups of 16 lanes (one KV page's 16 slots); all 32 lanes must call.
__device__ __forceinline__ float half_warp_sum(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float half_warp_max(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024). `scratch` holds >= 32 floats. Every
// thread gets the result. The first barrier makes all warp partials visible; the last one stops a
// later call from overwriting `scratch` while a slow warp is still reading it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nwarps = blockDim.x / WARP;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}
