// pipe8.cuh: the tensor-core prefill GEMM of the 8-bit formats whose scale is one per output row
// (int8_sym_channel.cu, fp8_e4m3_channel.cu): y[t, n] = s[n] * sum_k x[t, k] q[n, k], fp32 out, every
// weight decoded to its exact fp16 value where the B fragment is built (no weight is ever rounded).
//
// It is int4_sym_g128.cu's int4_mma_pipe with bytes for nibbles:
//   * tile BM = 32 MI tokens x BN = 128 weight rows, K in steps of P8_BK = 32 inputs, 8 warps as 2 (M) x 4
//     (N), each warp 16 MI x 32 = MI x 4 mma tiles (m16n8k16, fp16 x fp16 -> fp32, mma.cuh);
//   * a P8_STAGES-deep cp.async ring: the x rows and the raw weight bytes go global -> shared with no
//     register staging, so the loads of steps kt+1 and kt+2 fly while step kt multiplies; one barrier a step;
//   * the B fragment of lane (c = lane % 4, n = lane / 4) is elements (2c, 2c+1) and (2c+8, 2c+9) of row
//     n's 16-input slice (mma.cuh's layout): two 16-bit shared loads, each turned into a half2 by the
//     format's `Bytes::pairs` (the low byte into the low half; every int8 and e4m3 value is exact in fp16);
//   * the tensor cores sum 128 inputs at a time into a fresh fp32 partial, which is then added to an fp32
//     total on the CUDA cores: the 128-long partials of the precision contract, as in the INT4 kernels (a
//     whole-K tensor-core sum measured outside the fp32 ops' bound, bench/NOTES.md). The total is multiplied
//     by the row's fp16 scale once, at the end (the cuBLAS path multiplies q * s, exact in fp32, instead:
//     the two differ by fp32 rounding, inside the bound);
//   * K % 16 == 0 (both formats' in_multiple) and nothing more: the 16-input half of a step past K is
//     zero-filled by cp.async (src-size 0), x and weights alike, so it adds exact zeros. Rows of x past T
//     are zero-filled and never stored; weight rows past N are clamped (loaded in bounds, never stored).
// Shared rows: x padded to 40 halves (80 B: the 8 rows of an ldmatrix phase land in 8 different 16-byte
// bank groups, as in int4_mma_pipe); weights 48 B (a step's 32 B + 16 B of padding: the B loads of one
// instruction read rows r = lane / 4 at word 12 r + c / 2 (mod 32 banks): 0, 12, 24, 4, 16, 28, 8, 20 plus
// 0 or 1, sixteen different banks, and rows stay 16-byte aligned for cp.async). 48 KB of static shared
// memory at MI = 4, the most a block may declare.
//
// Requires: x fp16 [T, K] with 16-byte aligned rows (K % 8 == 0), qweight 8-bit [N, K] row-major,
// scales fp16 [N], y fp32 [T, N]. Grid (ceil(N / 128), ceil(T / BM)), 256 threads.
#pragma once
#include "mma.cuh"

#define P8_BN 128
#define P8_BK 32
#define P8_XPAD 40
#define P8_WROW 48
#define P8_STAGES 3

template <int MI, class Bytes>
__device__ __forceinline__ void byte_mma_pipe(const f16_bits* __restrict__ x, const unsigned char* __restrict__ qweight,
                                              const f16_bits* __restrict__ scales, float* __restrict__ y, int T, int N, int K) {
    constexpr int BM = 32 * MI;
    __shared__ __align__(16) f16_bits Xs[P8_STAGES][BM][P8_XPAD];
    __shared__ __align__(16) unsigned char Ws[P8_STAGES][P8_BN][P8_WROW];
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int wm = warp % 2, wn = warp / 2;  // warp tile: rows wm*16*MI.., cols wn*32..
    const int n0 = blockIdx.x * P8_BN, m0 = blockIdx.y * BM;
    const int ktiles = (K + P8_BK - 1) / P8_BK;

    // cp.async sources. x: rows (tid / 4) + 64 i (i < MI / 2), 16-byte chunk tid % 4 of the step's 32 inputs.
    // Weights: row tid / 2, 16-byte chunk tid % 2 of the step's 32 bytes (256 threads, 128 rows x 2 chunks).
    const int xr = tid / 4, xch = tid % 4;
    const f16_bits* xrow[MI / 2];
    bool xin[MI / 2];
#pragma unroll
    for (int i = 0; i < MI / 2; ++i) {
        const int row = m0 + xr + 64 * i;
        xin[i] = row < T;
        xrow[i] = x + (size_t)(row < T ? row : 0) * K;  // past T: zero-fill, from a valid address
    }
    const int wr = tid / 2, wch = tid % 2;
    const unsigned char* wrow = qweight + (size_t)imin(n0 + wr, N - 1) * K;
    auto load = [&](int kt, int st) {
        const int k0 = kt * P8_BK;
#pragma unroll
        for (int i = 0; i < MI / 2; ++i) {
            const bool in = xin[i] && k0 + xch * 8 < K;  // K % 16 == 0: a chunk is wholly in or wholly past K
            cp_async16(&Xs[st][xr + 64 * i][xch * 8], in ? xrow[i] + k0 + xch * 8 : xrow[i], in ? 16 : 0);
        }
        const bool win = k0 + wch * 16 < K;
        cp_async16(&Ws[st][wr][wch * 16], win ? wrow + k0 + wch * 16 : wrow, win ? 16 : 0);
    };

    float acc[MI][4][4], tot[MI][4][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = tot[i][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < P8_STAGES - 1; ++s) {
        if (s < ktiles) load(s, s);
        cp_async_commit();  // one group per step, empty past the end, so wait_group counts stay exact
    }
    const int c = lane % 4;
    for (int kt = 0; kt < ktiles; ++kt) {
        const int st = kt % P8_STAGES;
        cp_async_wait<P8_STAGES - 2>();  // this thread's copies of step kt are done ...
        __syncthreads();  // ... and everyone's; and everyone finished step kt-1, whose slot is refilled below
        if (kt + P8_STAGES - 1 < ktiles) load(kt + P8_STAGES - 1, (kt + P8_STAGES - 1) % P8_STAGES);
        cp_async_commit();

#pragma unroll
        for (int ks = 0; ks < P8_BK; ks += 16) {
            u32 a[MI][4], b[4][2];
#pragma unroll
            for (int i = 0; i < MI; ++i)
                ldmatrix_x4(a[i], &Xs[st][wm * 16 * MI + i * 16 + (lane % 16)][ks + (lane / 16) * 8]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned char* w = &Ws[st][wn * 32 + j * 8 + lane / 4][ks + 2 * c];
                u32 h[2];
                Bytes::pairs(*reinterpret_cast<const unsigned short*>(w), h);  // elements ks + 2c, +1
                b[j][0] = h[0];
                Bytes::pairs(*reinterpret_cast<const unsigned short*>(w + 8), h);  // elements ks + 8 + 2c, +1
                b[j][1] = h[0];
            }
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_16816(acc[i][j], a[i], b[j]);
        }
        if (((kt + 1) * P8_BK) % 128 == 0 || kt + 1 == ktiles) {  // 128 inputs (or the last): into the total
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        tot[i][j][e] += acc[i][j][e];
                        acc[i][j][e] = 0.0f;
                    }
        }
    }
    cp_async_wait<0>();  // no copy outlives the block (the trailing groups are empty)

#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int col = n0 + wn * 32 + j * 8 + c * 2;
        const float s0 = h2f(__ldg(scales + imin(col, N - 1)));
        const float s1 = h2f(__ldg(scales + imin(col + 1, N - 1)));
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + wm * 16 * MI + i * 16 + lane / 4 + h * 8;
                if (row >= T) continue;
                if (col < N) y[(size_t)row * N + col] = tot[i][j][2 * h] * s0;
                if (col + 1 < N) y[(size_t)row * N + col + 1] = tot[i][j][2 * h + 1] * s1;
            }
    }
}
