// gemv_rows.cuh: the decode GEMV body shared by the row-major formats (int8_sym_channel.cu,
// fp8_e4m3_channel.cu, int4_asym_g128.cu), parameterised by a small per-format decoder D, plus the
// decoders' unpack helpers (int4_asym_g128's dequantize kernel uses them too and its tensor-core GEMV,
// gemv_tc.cuh, the same common.cuh int4_pair, so its every path reads a weight the same way; fp8's
// dequantize uses the same hardware conversion).
//
// The work split is int4_sym_g128.cu's CUDA-core kernel: a block of THREADS threads owns R accumulator
// rows (gate/up: R/2 gate rows and the same R/2 up rows) across the WHOLE input dimension (split-K
// inside the block). Thread i takes the 16-byte weight chunks c = i, i + THREADS, ... of its R rows; per
// chunk it loads the chunk's fp16 activations once (16-byte loads), widens them to fp32 once, and
// reuses them for all R rows, so R independent 16-byte weight loads are in flight per thread. Partials
// are reduced with a fixed xor-shuffle tree per warp, then across warps in warp order through shared
// memory: no atomics, deterministic results.
//
// Precision (docs/ARCHITECTURE.md): x is fp16; every weight value a decoder hands out is exact (an
// integer, an e4m3 value, or q - z) and is widened to fp32 before its product, so every product is
// exact in fp32 and every sum is an fp32 sum. Scales are applied in fp32: a group format multiplies
// each chunk's fp32 partial by its group's scale (a chunk never straddles a group), a channel format
// multiplies the row's fp32 total once by the row's scale.
//
// A decoder D provides:
//   D::ELEMS                 weights in one 16-byte chunk (16 for 8-bit formats, 32 for 4-bit ones)
//   D::Scale                 element type of the format's second tensor (fp16 scales, uint32 scale_zero)
//   D::Aux                   what one chunk needs besides its 16 bytes (a group's word; unused: int)
//   D::aux(s, row, in_f, c)  that, for chunk c of weight row `row`
//   D::accumulate(acc, w, xf, aux)  acc plus the chunk's products with xf (the chunk's x as fp32)
//   D::finish(total, s, row) the row's dot product from its fp32 total
#pragma once
#include "common.cuh"


// ---- shared by every decoder ------------------------------------------------------------------------

// acc + w0 * x0 + w1 * x1 for a half2 of exact weights and two fp32 activations.
__device__ __forceinline__ float fma_pair(u32 wpair, float x0, float x1, float acc) {
    float w0, w1;
    h2x2f(wpair, w0, w1);
    acc = fmaf(w0, x0, acc);
    return fmaf(w1, x1, acc);
}

// ---- a decoder for one byte a weight and an fp16 scale a row -----------------------------------------

// qweight: one byte per weight, [out, in] row-major; scales: fp16 [out]. A chunk is 16 weights; the
// format says how a 32-bit word of 4 bytes becomes two half2 of exact values (Bytes::pairs: h[0] =
// elements 0, 1 and h[1] = elements 2, 3), and the row's fp32 total is multiplied once by its scale.
// int8_sym_channel.cu and fp8_e4m3_channel.cu differ only in that unpack.
template <class Bytes>
struct DecodeRowScaledBytes {
    static constexpr int ELEMS = 16;
    typedef f16_bits Scale;
    typedef int Aux;
    __device__ static __forceinline__ int aux(const Scale*, int, int, int) { return 0; }
    __device__ static __forceinline__ float accumulate(float acc, const uint4& w, const float (&xf)[ELEMS], int) {
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 h[2];
            Bytes::pairs(words[i], h);
            acc = fma_pair(h[0], xf[4 * i], xf[4 * i + 1], acc);
            acc = fma_pair(h[1], xf[4 * i + 2], xf[4 * i + 3], acc);
        }
        return acc;
    }
    __device__ static __forceinline__ float finish(float total, const Scale* s, int row) { return total * h2f(__ldg(s + row)); }
};

// ---- the GEMV body ------------------------------------------------------------------------------

// Weight row of accumulator a of a block whose first output row is row0: rows past the end are clamped
// (loaded, in bounds, never stored); gate/up's second half reads the matching up rows.
template <int EPI, int RB>
__device__ __forceinline__ int gemv_weight_row(int row0, int a, int rows) {
    int r = imin(row0 + (a % RB), rows - 1);
    if (EPI == EPI_SILU_MUL_F16 && a >= RB) r += rows;
    return r;
}

// x: fp16 [T, in_f] (16-byte aligned rows: in_f % 8 == 0, x 16-byte aligned); qweight: [out_total] rows
// of in_f / D::ELEMS 16-byte chunks; scales: D's second tensor. Grid (ceil(rows / RB), T), THREADS threads.
// EPI_BIAS_F16:     out16[t, r] = dot(r) + bias[r]                         (out_total = rows)
// EPI_RESIDUAL_F32: resid[t, r] += dot(r)                                  (out_total = rows)
// EPI_SILU_MUL_F16: out16[t, r] = silu(dot(r)) * dot(rows + r)            (out_total = 2 rows)
template <class D, int EPI, int THREADS, int R>
__device__ __forceinline__ void gemv_rows(const f16_bits* __restrict__ x, const uint4* __restrict__ qweight,
                                          const typename D::Scale* __restrict__ scales, const f16_bits* __restrict__ bias,
                                          f16_bits* __restrict__ out16, float* __restrict__ resid, int rows, int in_f) {
    constexpr int NW = THREADS / WARP;
    constexpr int RB = EPI == EPI_SILU_MUL_F16 ? R / 2 : R;  // output rows per block
    constexpr int XL = D::ELEMS / 8;                          // 16-byte loads of x per chunk
    __shared__ float red[NW][R];
    __shared__ float tot[R];
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int row0 = blockIdx.x * RB;
    const int t = blockIdx.y;
    const int chunks = in_f / D::ELEMS;
    const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)t * in_f);  // 16 B = 8 fp16

    int wr[R];
    const uint4* wrow[R];
#pragma unroll
    for (int a = 0; a < R; ++a) {
        wr[a] = gemv_weight_row<EPI, RB>(row0, a, rows);
        wrow[a] = qweight + (size_t)wr[a] * chunks;
    }
    pdl_enter();  // common.cuh: x is the previous kernel's output

    float acc[R];
#pragma unroll
    for (int a = 0; a < R; ++a) acc[a] = 0.0f;

    for (int c = tid; c < chunks; c += THREADS) {
        uint4 w[R];
        typename D::Aux aux[R];
#pragma unroll
        for (int a = 0; a < R; ++a) {
            w[a] = __ldg(wrow[a] + c);  // R independent 16-byte loads in flight
            aux[a] = D::aux(scales, wr[a], in_f, c);
        }
        // The chunk's ELEMS activations x[c * ELEMS ..], widened to fp32 once for all R rows.
        float xf[D::ELEMS];
#pragma unroll
        for (int j = 0; j < XL; ++j) {
            u32 xw[4];
            uint4_words(__ldg(xv + c * XL + j), xw);
#pragma unroll
            for (int k = 0; k < 4; ++k) h2x2f(xw[k], xf[8 * j + 2 * k], xf[8 * j + 2 * k + 1]);
        }
#pragma unroll
        for (int a = 0; a < R; ++a) acc[a] = D::accumulate(acc[a], w[a], xf, aux[a]);
    }
#pragma unroll
    for (int a = 0; a < R; ++a) {
        const float v = warp_sum(acc[a]);
        if (lane == 0) red[warp][a] = v;
    }
    __syncthreads();  // every warp's partials are in shared memory
    if (tid < R) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) s += red[w][tid];  // fixed order: deterministic
        tot[tid] = D::finish(s, scales, gemv_weight_row<EPI, RB>(row0, tid, rows));
    }
    __syncthreads();  // tot[] complete (gate/up needs both halves)
    if (tid >= RB) return;
    const int r = row0 + tid;
    if (r >= rows) return;
    if (EPI == EPI_BIAS_F16) {
        out16[(size_t)t * rows + r] = f2h(tot[tid] + h2f(bias[r]));
    } else if (EPI == EPI_RESIDUAL_F32) {
        resid[(size_t)t * rows + r] += tot[tid];  // one writer per element: no atomic needed
    } else {
        const float g = tot[tid], u = tot[tid + RB];
        out16[(size_t)t * rows + r] = f2h(g / (1.0f + expf(-g)) * u);
    }
}
