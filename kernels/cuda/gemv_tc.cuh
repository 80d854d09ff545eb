// gemv_tc.cuh: the tensor-core decode GEMV shared by the two INT4 formats (int4_sym_g128.cu and
// int4_asym_g128.cu, variants tc_w<NW>_u<U>), parameterised by a small per-format group reader G.
//
// The sums: the unpacked nibbles (n - zero, exact in fp16) are fed to mma.sync.m16n8k16 (fp16 x fp16 ->
// fp32) with x as B, so every product is exact and every sum is an fp32 sum, as in the CUDA-core
// kernels (gemv_rows.cuh), at about a quarter of the instructions per weight byte (those convert every
// value to fp32 and spend an FMA on it; here one mma does 256 multiply-adds).
//
// Layout the loads assume: qweight uint32 [out_total, in/8] in the ValueShuffle nibble order
// (common.cuh), in % 128 == 0, so a row is in/128 groups of 64 bytes = 4 chunks of 16 bytes, 16-byte
// aligned; the per-group tensor G::Word [out_total, in/128]; x fp16 [T, in], 16-byte aligned.
//
// The work split: a warp owns a tile of 16 weight rows: lane (c = lane % 4, r = lane / 4) holds row `lo`
// = tile row r and row `hi` = tile row r + 8 (gate/up: gate row r and the matching up row), and in each
// 128-group g it reads words 4c .. 4c+3 of the group's 16 words of both rows (one 16-byte load each)
// and the group's word of G for both rows. Word j gives pairs q0..q3 (elements 2k, 2k+1 of the word);
// the mma's k slots (2c, 2c+1) and (2c+8, 2c+9) take (q0, q1) in one mma and (q2, q3) in the next, and B
// takes the matching x pairs (x words 4c + j of the group, the same for every r), so row and column
// agree on which input each k slot holds. Every column of B holds the same x, so every column of C is
// the same dot product: c0 is row lo's group sum and c2 row hi's. The scale multiplies each group's sum
// once (fp32). The NW warps of a block split the groups: warp w takes the batches of U groups starting
// at w U, w U + NW U, ...; then the warps add their partials in warp order through shared memory: no
// atomics, deterministic results.
//
// The loads: a warp keeps two batches in registers, the one its mma consume and the next one in flight
// (double buffering: batch b + 1's loads are issued before batch b's mma), and the first batch is
// requested before pdl_wait(), since weights are no kernel's output (common.cuh).
// Measured at the 7B shapes on an H200 (bench/NOTES.md, v5): one batch at a time left the warps waiting
// on their loads (stall long scoreboard 55-68%), the gate/up GEMV at 2.3 TB/s. Weight loads carry the
// L2::256B prefetch size: a warp reads U x 64 bytes of each row per batch (256 bytes at U = 4), and the
// hint has the L2 fetch the whole 256-byte line from DRAM on the first miss; alone it took the
// one-batch kernel from 2.40 to 2.71 TB/s on gate/up.
//
// A group reader G provides:
//   G::Word            element type of the format's per-group tensor (fp16 scale, uint32 scale_zero)
//   G::zero(word)      the half2 subtracted from each (1024 + n) pair: (1024 + z, 1024 + z)
//   G::scale(word)     the group's scale as fp32
#pragma once
#include "common.cuh"
#include "mma.cuh"

// A 16-byte read-only weight load whose L2 miss fetches the aligned 256 bytes around it (see above).
__device__ __forceinline__ uint4 ldg_stream256(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// One batch: U groups of this lane's two rows, in registers.
template <class G, int U>
struct TcBatch {
    uint4 wl[U], wh[U];
    typename G::Word sl[U], sh[U];

    __device__ __forceinline__ void load(const uint4* wlo, const uint4* whi, const typename G::Word* slo,
                                         const typename G::Word* shi, int g0, int groups) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int g = imin(g0 + u, groups - 1);  // past the end: a valid group, result discarded
            wl[u] = ldg_stream256(wlo + 4 * g);
            wh[u] = ldg_stream256(whi + 4 * g);
            sl[u] = __ldg(slo + g);
            sh[u] = __ldg(shi + g);
        }
    }

    // tlo/thi += each group's scaled sum, groups g0 .. g0 + U - 1 (those below `groups`) in order
    __device__ __forceinline__ void mma(const uint4* xv, int g0, int groups, float& tlo, float& thi) const {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (g0 + u >= groups) break;
            const int g = g0 + u;
            u32 xw[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) uint4_words(__ldg(xv + 16 * g + j), xw[j]);
            const u32 lw[4] = {wl[u].x, wl[u].y, wl[u].z, wl[u].w};
            const u32 hw[4] = {wh[u].x, wh[u].y, wh[u].z, wh[u].w};
            const u32 zl = G::zero(sl[u]), zh = G::zero(sh[u]);
            float acc0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                u32 ql[4], qh[4];
                // unpack_int4_pairs (common.cuh) per row, interleaved: two calls give the same values in
                // another instruction order, not the code the GPU measured (nvcc 13.0: other cubin bytes)
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    ql[k] = int4_pair(lw[j], k, zl);
                    qh[k] = int4_pair(hw[j], k, zh);
                }
                const u32 a01[4] = {ql[0], qh[0], ql[1], qh[1]}, a23[4] = {ql[2], qh[2], ql[3], qh[3]};
                const u32 b01[2] = {xw[j][0], xw[j][1]}, b23[2] = {xw[j][2], xw[j][3]};
                if (j % 2 == 0) {
                    mma_16816(acc0, a01, b01);
                    mma_16816(acc0, a23, b23);
                } else {
                    mma_16816(acc1, a01, b01);
                    mma_16816(acc1, a23, b23);
                }
            }
            tlo = fmaf(acc0[0] + acc1[0], G::scale(sl[u]), tlo);
            thi = fmaf(acc0[2] + acc1[2], G::scale(sh[u]), thi);
        }
    }
};

// x: fp16 [T, in]; qweight: uint32 [out_total, in/8]; words: G::Word [out_total, in/128]. Grid (row tiles,
// T): a block owns 16 output rows (gate/up: 8 gate rows and the same 8 up rows) of token blockIdx.y.
// EPI_BIAS_F16:     out16[t, r] = acc(r) + bias[r]                         (out_total = rows)
// EPI_RESIDUAL_F32: resid[t, r] += acc(r)                                  (out_total = rows)
// EPI_SILU_MUL_F16: out16[t, r] = silu(acc(r)) * acc(rows + r)             (out_total = 2 rows)
template <class G, int EPI, int NW, int U>
__device__ __forceinline__ void gemv_tc(const f16_bits* __restrict__ x, const u32* __restrict__ qweight,
                                        const typename G::Word* __restrict__ words, const f16_bits* __restrict__ bias,
                                        f16_bits* __restrict__ out16, float* __restrict__ resid, int rows, int in_f) {
    __shared__ float red[NW][16];
    __shared__ float tot[16];
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, c = lane % 4, r = lane / 4;
    const int t = blockIdx.y;
    const int words_per_row = in_f / 8, groups = in_f / 128;
    int base, lo, hi;
    if (EPI == EPI_SILU_MUL_F16) {
        base = blockIdx.x * 8;
        lo = imin(base + r, rows - 1);  // clamped rows are loaded (in bounds) but never stored
        hi = lo + rows;
    } else {
        base = blockIdx.x * 16;
        lo = imin(base + r, rows - 1);
        hi = imin(base + 8 + r, rows - 1);
    }
    const uint4* wlo = reinterpret_cast<const uint4*>(qweight + (size_t)lo * words_per_row) + c;
    const uint4* whi = reinterpret_cast<const uint4*>(qweight + (size_t)hi * words_per_row) + c;
    const typename G::Word* slo = words + (size_t)lo * groups;
    const typename G::Word* shi = words + (size_t)hi * groups;
    const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)t * in_f) + 4 * c;
    constexpr int S = NW * U;  // groups from one of a warp's batches to its next

    // At the top of each half of the loop `a` (or `b`) holds batch g0; the other one is loaded with batch
    // g0 + S before batch g0's mma. The weights are no kernel's output: the first batch goes out before
    // the wait. (Loading batch g0 + 2 S after batch g0's mma instead, with two batches out before the
    // wait, gives the same sums in 20 more registers a thread: ptxas, nvcc 13.0.)
    TcBatch<G, U> a, b;
    int g0 = warp * U;
    if (g0 < groups) a.load(wlo, whi, slo, shi, g0, groups);
    pdl_enter();  // common.cuh: x is the previous kernel's output

    float tlo = 0.0f, thi = 0.0f;
    while (g0 < groups) {
        if (g0 + S < groups) b.load(wlo, whi, slo, shi, g0 + S, groups);
        a.mma(xv, g0, groups, tlo, thi);
        g0 += S;
        if (g0 >= groups) break;
        if (g0 + S < groups) a.load(wlo, whi, slo, shi, g0 + S, groups);
        b.mma(xv, g0, groups, tlo, thi);
        g0 += S;
    }
    if (c == 0) {
        red[warp][r] = tlo;
        red[warp][r + 8] = thi;
    }
    __syncthreads();  // every warp's partials are in shared memory
    if (tid < 16) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) s += red[w][tid];  // fixed order: deterministic
        tot[tid] = s;
    }
    __syncthreads();  // tot[] complete (gate/up needs both halves)
    if (EPI == EPI_SILU_MUL_F16) {
        const int row = base + tid;
        if (tid < 8 && row < rows) {
            const float g = tot[tid], u = tot[tid + 8];
            out16[(size_t)t * rows + row] = f2h(g / (1.0f + expf(-g)) * u);
        }
    } else if (tid < 16) {
        const int row = base + tid;
        if (row < rows) {
            if (EPI == EPI_BIAS_F16) out16[(size_t)t * rows + row] = f2h(tot[tid] + h2f(bias[row]));
            else resid[(size_t)t * rows + row] += tot[tid];
        }
    }
}
