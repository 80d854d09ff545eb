// gemv_rows.cuh: the decode GEMV body shared by the row-major formats (int8_sym_channel.cu,
// fp8_e4m3_channel.cu, int4_asym_g128.cu), parameterised by a small per-format decoder D, plus the
// decoders' unpack helpers (int4_asym_g128's dequantize kernel and its tensor-core GEMV use them too, so
// its every path reads a weight the same way; fp8's dequantize uses the same hardware conversion).
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

// ---- unpack helpers ---------------------------------------------------------------------------------

// int8: a 32-bit word holds 4 consecutive weights of a row, byte k = element k (little-endian rows).
// h[0] = half2 (e0, e1) and h[1] = half2 (e2, e3), exact. prmt picks bytes: selector nibble i names the
// source byte of result byte i (0..3 from `word`, 4..7 from the second operand, 0 here), so 0x4140
// gives the bytes (e0, 0, e1, 0) and 0x4342 gives (e2, 0, e3, 0): one weight in the low byte of each
// 16-bit half. XOR 0x6480 then flips bit 7 (two's-complement q -> unsigned q + 128, 0..255) and sets
// 0x6400 above it: the fp16 number 1024 + 128 + q (fp16 1024's ulp is 1). Subtracting 1152 (0x6480)
// in half2 leaves q exactly (integers up to 2048 are exact in fp16).
__device__ __forceinline__ void int8_pairs(u32 word, u32 (&h)[2]) {
    u32 t0, t1;
    asm("prmt.b32 %0, %1, %2, 0x4140;" : "=r"(t0) : "r"(word), "r"(0u));
    asm("prmt.b32 %0, %1, %2, 0x4342;" : "=r"(t1) : "r"(word), "r"(0u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(h[0]) : "r"(t0 ^ 0x64806480u), "r"(0x64806480u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(h[1]) : "r"(t1 ^ 0x64806480u), "r"(0x64806480u));
}

// fp8 e4m3: a 32-bit word holds 4 consecutive e4m3 bytes of a row, byte k = element k. The hardware
// conversion cvt.rn.f16x2.e4m3x2 (sm_89+) takes two bytes in a 16-bit register and puts the LOW byte in
// the LOW half of the half2 (the high byte in the high half), so h[0] = (e0, e1), h[1] = (e2, e3).
// Every e4m3 value (subnormals down to 2^-9, up to 448) is exact in fp16; the NaN codes give NaN.
__device__ __forceinline__ void e4m3_pairs(u32 word, u32 (&h)[2]) {
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.rn.f16x2.e4m3x2 %0, lo; cvt.rn.f16x2.e4m3x2 %1, hi; }"
        : "=r"(h[0]), "=r"(h[1]) : "r"(word));
}

// int4_asym_g128: a scale_zero word (low half: fp16 scale, high half: fp16 1024 + z, i.e. 0x6400 | z)
// -> the half2 (1024 + z, 1024 + z): prmt 0x3232 copies bytes (2, 3) into both halves.
__device__ __forceinline__ u32 zero_pair(u32 scale_zero) {
    u32 z;
    asm("prmt.b32 %0, %1, %2, 0x3232;" : "=r"(z) : "r"(scale_zero), "r"(0u));
    return z;
}

// q[k] = half2 (element 2k - z, element 2k+1 - z) of a ValueShuffle word (int4_sym_g128's nibble order,
// common.cuh): (word >> 4k) & 0x000F000F | 0x64006400 is the half2 (1024 + q_2k, 1024 + q_2k+1), and
// subtracting zz = half2 (1024 + z, 1024 + z) leaves q - z exactly (-15 .. 15).
__device__ __forceinline__ void unpack_int4_pairs_zero(u32 word, u32 zz, u32 (&q)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 t;
        // lop3 LUT 0xEA = (a & b) | c  with a = word >> 4k, b = 0x000F000F, c = 0x64006400
        asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(t) : "r"(word >> (4 * k)), "r"(0x000F000Fu), "r"(0x64006400u));
        asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(q[k]) : "r"(t), "r"(zz));
    }
}

// acc + w0 * x0 + w1 * x1 for a half2 of exact weights and two fp32 activations.
__device__ __forceinline__ float fma_pair(u32 wpair, float x0, float x1, float acc) {
    float w0, w1;
    h2x2f(wpair, w0, w1);
    acc = fmaf(w0, x0, acc);
    return fmaf(w1, x1, acc);
}

// ---- decoders ---------------------------------------------------------------------------------------

// int8_sym_channel: qweight int8 [out, in] row-major, scales fp16 [out]. A chunk is 16 weights.
struct DecodeInt8SymChannel {
    static constexpr int ELEMS = 16;
    typedef f16_bits Scale;
    typedef int Aux;
    __device__ static __forceinline__ int aux(const Scale*, int, int, int) { return 0; }
    __device__ static __forceinline__ float accumulate(float acc, const uint4& w, const float (&xf)[ELEMS], int) {
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 h[2];
            int8_pairs(words[i], h);
            acc = fma_pair(h[0], xf[4 * i], xf[4 * i + 1], acc);
            acc = fma_pair(h[1], xf[4 * i + 2], xf[4 * i + 3], acc);
        }
        return acc;
    }
    __device__ static __forceinline__ float finish(float total, const Scale* s, int row) { return total * h2f(__ldg(s + row)); }
};

// fp8_e4m3_channel: qweight uint8 e4m3 [out, in] row-major, scales fp16 [out]. A chunk is 16 weights.
struct DecodeFp8E4m3Channel {
    static constexpr int ELEMS = 16;
    typedef f16_bits Scale;
    typedef int Aux;
    __device__ static __forceinline__ int aux(const Scale*, int, int, int) { return 0; }
    __device__ static __forceinline__ float accumulate(float acc, const uint4& w, const float (&xf)[ELEMS], int) {
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 h[2];
            e4m3_pairs(words[i], h);
            acc = fma_pair(h[0], xf[4 * i], xf[4 * i + 1], acc);
            acc = fma_pair(h[1], xf[4 * i + 2], xf[4 * i + 3], acc);
        }
        return acc;
    }
    __device__ static __forceinline__ float finish(float total, const Scale* s, int row) { return total * h2f(__ldg(s + row)); }
};

// int4_asym_g128: qweight uint32 ValueShuffle words [out, in/8], scale_zero uint32 [out, in/128]. A
// chunk is 4 words = 32 weights, a quarter of a 128-group, so chunk c's group is c / 4 and one 4-byte
// load gives its scale and zero point. The chunk's 32 products are summed in fp32, then scaled once.
struct DecodeInt4AsymG128 {
    static constexpr int ELEMS = 32;
    typedef u32 Scale;
    typedef u32 Aux;
    __device__ static __forceinline__ u32 aux(const Scale* sz, int row, int in_f, int c) {
        return __ldg(sz + (size_t)row * (in_f / 128) + c / 4);
    }
    __device__ static __forceinline__ float accumulate(float acc, const uint4& w, const float (&xf)[ELEMS], u32 sz) {
        const u32 words[4] = {w.x, w.y, w.z, w.w};
        const u32 zz = zero_pair(sz);
        float p = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // word j holds elements 8j .. 8j+7 of the chunk
            u32 q[4];
            unpack_int4_pairs_zero(words[j], zz, q);
#pragma unroll
            for (int k = 0; k < 4; ++k) p = fma_pair(q[k], xf[8 * j + 2 * k], xf[8 * j + 2 * k + 1], p);
        }
        return fmaf(p, h2f((f16_bits)(sz & 0xFFFFu)), acc);
    }
    __device__ static __forceinline__ float finish(float total, const Scale*, int) { return total; }
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
