// int4_pipe.cuh: the pipelined tensor-core prefill GEMM of the two INT4 group-128 formats, y = x W^T in
// fp32 (int4_sym_g128.cu's int4_mma_pipe{,64}_f32, int4_asym_g128.cu's int4_asym_g128_mma_pipe{,64}_f32).
//
// The sums of int4_sym_g128.cu's int4_mma_f32 (exact fp16 products (n - z) times x on the tensor cores,
// fp32 accumulation, each 128-group's partial scaled once in fp32), laid out for throughput:
//   * tile BM = 128 (or 64) tokens x BN = 128 weight rows, K in steps of PK = 32, 8 warps as 2 (M) x 4
//     (N), each warp 64 x 32 = 4 x 4 mma tiles (twice int4_mma_f32's work per shared-memory byte; or
//     32 x 32 for int4_mma_pipe64_f32);
//   * a PSTAGES-deep cp.async ring: x and the RAW qweight words go global -> shared with no register
//     staging, so the loads of steps kt+1 and kt+2 fly while step kt multiplies; one barrier per step;
//   * the weights stay packed in shared memory (4 x smaller than unpacked fp16) and are unpacked into
//     the mma B fragment where they are read: the fragment of lane (c = lane % 4, n = lane / 4) is
//     elements (2c, 2c+1) and (2c+8, 2c+9) of row n's 16-element slice, i.e. pair c of its two
//     ValueShuffle words, one shift + lop3 + sub each (common.cuh), so one 8-byte shared load feeds it;
//   * A fragments by ldmatrix.x4 (lane l addresses row l % 16, columns (l / 16) * 8 of the 16 x 16 tile);
//   * a group's 8 scales per lane are loaded when the group's first step starts and used when its last
//     ends (int4_mma_f32 loads them at the end: a global-memory wait every 128 inputs).
// Shared rows: x padded to 40 halves (80 B: the 8 rows of an ldmatrix phase land in 8 different
// 16-byte bank groups), weights 4 words (16 B: the 8 rows of a B load land in 8 different bank pairs).
// Rows past T are zero-filled by cp.async (src-size 0) and never stored; rows past N are clamped.
#pragma once
#include "mma.cuh"

#define PIPE_BN 128
#define PIPE_BK 32
#define PIPE_XPAD 40
#define PIPE_WPAD 4
#define PIPE_STAGES 3


// A format's per-group numbers, read where the kernel needs them: `scale(row, g)`, the fp16 bits of
// row's group-g scale (for the C fragment's columns, applied to a finished group's partial), and, when
// ZERO_PER_GROUP, `zero(row, g)`, the half2 (1024 + z, 1024 + z) that int4_pair subtracts (for the B
// fragment's rows).
// int4_sym_g128: fp16 scales [N, K/128] and int4_pair's fixed zero point 8, so no `zero`: nothing is loaded
// or kept (a register array of constants changed the compiled kernel; without it, nvcc 13.0 gives the
// same int4_mma_pipe{,64}_f32 machine code as before the asym format shared this file).
struct SymGroups {
    static constexpr bool ZERO_PER_GROUP = false;
    const f16_bits* __restrict__ scales;
    int groups;
    __device__ __forceinline__ f16_bits scale(int row, int g) const { return __ldg(scales + (size_t)row * groups + g); }
};
// int4_asym_g128: scale_zero uint32 [N, K/128], low half the fp16 scale, high half the fp16 number
// 1024 + z (0x6400 | z), so the zero's half2 is the high half twice (zero_pair) and q - z stays exact.
struct AsymGroups {
    static constexpr bool ZERO_PER_GROUP = true;
    const u32* __restrict__ scale_zero;
    int groups;
    __device__ __forceinline__ f16_bits scale(int row, int g) const {
        return static_cast<f16_bits>(__ldg(scale_zero + (size_t)row * groups + g) & 0xFFFFu);
    }
    __device__ __forceinline__ u32 zero(int row, int g) const {
        return zero_pair(__ldg(scale_zero + (size_t)row * groups + g));  // common.cuh
    }
};

// x fp16 [T, K], qweight uint32 [N, K/8], the format's group numbers (above) -> y fp32 [T, N]. K % 128 == 0.
// MI = mma tiles per warp along M: BM = 32 MI tokens (MI = 4: 128 x 128 tiles, 216 registers, one block
// an SM; MI = 2: 64 x 128 tiles, half the accumulators, two blocks an SM).
// Grid (ceil(N / 128), ceil(T / BM)), 256 threads.
template <int MI, class Groups>
__device__ __forceinline__ void int4_mma_pipe(const f16_bits* __restrict__ x, const u32* __restrict__ qweight,
                                              const Groups gs, float* __restrict__ y, int T, int N, int K) {
    constexpr int BM = 32 * MI;
    __shared__ __align__(16) f16_bits Xs[PIPE_STAGES][BM][PIPE_XPAD];
    __shared__ __align__(16) u32 Ws[PIPE_STAGES][PIPE_BN][PIPE_WPAD];
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int wm = warp % 2, wn = warp / 2;  // warp tile: rows wm*16*MI.., cols wn*32..
    const int n0 = blockIdx.x * PIPE_BN, m0 = blockIdx.y * BM;
    const int words_per_row = K / 8, ktiles = K / PIPE_BK;

    // cp.async sources: x rows (tid / 4) + 64 i, 16-byte column chunk tid % 4 (i = 0, 1); weight row tid / 2,
    // 16-byte chunk... a step's 4 words of a row are one chunk, so threads 0..127 copy rows 0..127.
    const int xr = tid / 4, xch = tid % 4;
    const f16_bits* xsrc[MI / 2];
    int xbytes[MI / 2];
#pragma unroll
    for (int i = 0; i < MI / 2; ++i) {
        const int row = m0 + xr + 64 * i;
        xbytes[i] = row < T ? 16 : 0;  // past T: zero-fill, from a valid address
        xsrc[i] = x + (size_t)(row < T ? row : 0) * K + xch * 8;
    }
    const u32* wsrc = qweight + (size_t)imin(n0 + (tid % PIPE_BN), N - 1) * words_per_row;
    auto load = [&](int kt, int st) {
#pragma unroll
        for (int i = 0; i < MI / 2; ++i) cp_async16(&Xs[st][xr + 64 * i][xch * 8], xsrc[i] + kt * PIPE_BK, xbytes[i]);
        if (tid < PIPE_BN) cp_async16(&Ws[st][tid][0], wsrc + kt * (PIPE_BK / 8), 16);
    };

    float acc[MI][4][4], tot[MI][4][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = tot[i][j][e] = 0.0f;

    int scol[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) scol[j][e] = imin(n0 + wn * 32 + j * 8 + (lane % 4) * 2 + e, N - 1);
    int zrow[4];  // the weight row of this lane's B fragment column j (lane / 4 of the 8), clamped like its loads
#pragma unroll
    for (int j = 0; j < 4; ++j) zrow[j] = imin(n0 + wn * 32 + j * 8 + lane / 4, N - 1);

#pragma unroll
    for (int s = 0; s < PIPE_STAGES - 1; ++s) {
        if (s < ktiles) load(s, s);
        cp_async_commit();  // one group per step, empty past the end, so wait_group counts stay exact
    }
    const int c = lane % 4;
    f16_bits sg[4][2];  // this group's scales, loaded when the group starts, used when it ends
    u32 zz[4];  // ZERO_PER_GROUP: this group's zero points of the B rows, loaded when it starts
    for (int kt = 0; kt < ktiles; ++kt) {
        const int st = kt % PIPE_STAGES;
        if ((kt * PIPE_BK) % 128 == 0) {  // a group starts: its scale loads fly during its 4 steps
            const int g = (kt * PIPE_BK) / 128;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) sg[j][e] = gs.scale(scol[j][e], g);
            if constexpr (Groups::ZERO_PER_GROUP) {
#pragma unroll
                for (int j = 0; j < 4; ++j) zz[j] = gs.zero(zrow[j], g);
            }
        }
        cp_async_wait<PIPE_STAGES - 2>();  // this thread's copies of step kt are done ...
        __syncthreads();  // ... and everyone's; and everyone finished step kt-1, whose slot is refilled below
        if (kt + PIPE_STAGES - 1 < ktiles) load(kt + PIPE_STAGES - 1, (kt + PIPE_STAGES - 1) % PIPE_STAGES);
        cp_async_commit();

#pragma unroll
        for (int ks = 0; ks < PIPE_BK; ks += 16) {
            u32 a[MI][4], b[4][2];
#pragma unroll
            for (int i = 0; i < MI; ++i)
                ldmatrix_x4(a[i], &Xs[st][wm * 16 * MI + i * 16 + (lane % 16)][ks + (lane / 16) * 8]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint2 ww = *reinterpret_cast<const uint2*>(&Ws[st][wn * 32 + j * 8 + lane / 4][ks / 8]);
                if constexpr (Groups::ZERO_PER_GROUP) {
                    b[j][0] = int4_pair(ww.x, c, zz[j]);  // elements ks + 2c, +1
                    b[j][1] = int4_pair(ww.y, c, zz[j]);  // elements ks + 8 + 2c, +1
                } else {
                    b[j][0] = int4_pair(ww.x, c);  // the fixed zero point 8
                    b[j][1] = int4_pair(ww.y, c);
                }
            }
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_16816(acc[i][j], a[i], b[j]);
        }
        if (((kt + 1) * PIPE_BK) % 128 == 0) {  // a 128-group is complete: scale it into the total
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float s0 = h2f(sg[j][0]);
                const float s1 = h2f(sg[j][1]);
#pragma unroll
                for (int i = 0; i < MI; ++i) {
                    tot[i][j][0] = fmaf(acc[i][j][0], s0, tot[i][j][0]);
                    tot[i][j][1] = fmaf(acc[i][j][1], s1, tot[i][j][1]);
                    tot[i][j][2] = fmaf(acc[i][j][2], s0, tot[i][j][2]);
                    tot[i][j][3] = fmaf(acc[i][j][3], s1, tot[i][j][3]);
                    acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
                }
            }
        }
    }
    cp_async_wait<0>();  // no copy outlives the block (the trailing groups are empty)

#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = n0 + wn * 32 + j * 8 + (lane % 4) * 2;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + wm * 16 * MI + i * 16 + lane / 4 + h * 8;
                if (row >= T) continue;
                if (col < N) y[(size_t)row * N + col] = tot[i][j][2 * h];
                if (col + 1 < N) y[(size_t)row * N + col + 1] = tot[i][j][2 * h + 1];
            }
        }
}
