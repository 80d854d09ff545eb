// int4_wgmma.cuh: the warp-specialized wgmma (sm_90a) prefill GEMM of the two INT4 group-128 formats,
// y = x W^T in fp32 (int4_sym_g128.cu's int4_wgmma_f32, int4_asym_g128.cu's int4_asym_g128_wgmma_f32).
//
// The sums of int4_pipe.cuh's ring, bit for bit: each 128-group's products (n - z) x, exact in fp16, summed
// in fp32 on the tensor cores in the same k order from a fresh partial, the partial times the group's scale
// added into the fp32 total (docs/ARCHITECTURE.md, the precision contract). What changes is who waits:
//   * a block is 384 threads, three warpgroups. Warpgroup 2 only copies; warpgroups 0 and 1 multiply, each
//     its 64 weight rows by the block's 128 tokens with wgmma m64n128k16 (y^T = W x^T: the weights are the
//     operand A, which wgmma takes from registers, unpacked there as the ring builds its B fragments; x,
//     already fp16, is the operand B, read by wgmma from shared memory as cp.async left it);
//   * a stage is one 128-input group: x, 128 tokens x 128 inputs (32 KB) in wgmma's 128-byte swizzle,
//     K-major (two atoms of 64 inputs, 16 KB each; token t's row of an atom is 128 B at t * 128, its 16-byte
//     chunk j stored at chunk j ^ (t % 8)), and the 128 weight rows' 16 packed words (rows padded to
//     WG_WPAD = 20 words, 80 B: the 8 rows r of a consumer's uint2 read land in 8 different bank pairs).
//     WG_STAGES stages in dynamic shared memory;
//   * mbarriers instead of block barriers. full[s] completes when the producer's 128 threads' copies into
//     stage s have landed (cp.async.mbarrier.arrive.noinc: the arrival fires once the thread's earlier
//     cp.async are done), empty[s] when all 256 consumer threads are done with it (their wgmma waited for,
//     their weight words read). The two consumer warpgroups share no barrier, so one's unpacking, wait and
//     fold run while the other's wgmma keep the tensor cores busy. The prototypes with a block barrier per
//     step ran at the ring's speed; this one at 1.4-1.8x it (bench/NOTES.md, v5);
//   * why the swizzle: wgmma reads a 128-byte-swizzled operand faster than the no-swizzle layout of core
//     matrices (8 rows x 16 B); CUTLASS's Hopper GEMMs stage theirs swizzled too. The kernel in the
//     no-swizzle layout gave the same sums at 0.6x this one's speed at the 7B prefill shapes
//     (bench/NOTES.md, v5 ninth step);
//   * setmaxnreg: the producer keeps 40 registers, the consumers take 232 (a consumer holds the fp32 total,
//     64, the group's partial, 64, and the group's A fragments, 32). 128 x 40 + 256 x 232 <= 65536.
// Grid (ceil(T / 128), ceil(N / 128)); past 2048 tokens each block's tile comes from a grouped launch order
// (below), so that both the weight bytes and x come from DRAM a few times at most. Rows past T are zero-filled
// by cp.async (src-size 0) and never stored; weight rows past N are read from row N - 1 and never stored.
// K % 128 == 0.
#pragma once
#include "int4_pipe.cuh"

#define WG_THREADS 384
#define WG_BM 128
#define WG_BN 128
#define WG_STAGES 4
#define WG_WPAD 20
#define WG_GROUP_N 16  // the grouped launch order's weight tiles a group, past as many token tiles (below)
#define WG_XBYTES 32768
#define WG_WBYTES 10240
#define WG_SMEM 172096
static_assert(WG_XBYTES == WG_BM * 128 * 2 && WG_WBYTES == WG_BN * WG_WPAD * 4, "a stage: x tile, weight rows");
static_assert(WG_XBYTES % 1024 == 0, "x tiles on 1024-byte bounds (smem __align__(1024)): the atoms' base offset 0");
static_assert(WG_SMEM == WG_STAGES * (WG_XBYTES + WG_WBYTES) + 2 * WG_STAGES * 8, "the stages, then full[], empty[]");

template <class Groups>
__device__ __forceinline__ void int4_wgmma(const f16_bits* __restrict__ x, const u32* __restrict__ qweight,
                                           const Groups gs, float* __restrict__ y, int T, int N, int K) {
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char* xs0 = smem;
    u32* ws0 = reinterpret_cast<u32*>(smem + WG_STAGES * WG_XBYTES);
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem + WG_STAGES * (WG_XBYTES + WG_WBYTES));
    unsigned long long* empty = full + WG_STAGES;
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    // The block's tile. Blocks start in launch order (blockIdx.x fastest), one an SM (the shared memory), so
    // the order decides what a wave of 132 blocks reads. Token tiles fastest (the grid's own order) read all
    // of x for every few weight tiles: right while x fits in L2 (up to WG_GROUP_N token tiles, 2048 tokens),
    // but at 8192 tokens x is 58-310 MB and came from DRAM again each time. Past WG_GROUP_N token tiles the
    // tiles run in groups of WG_GROUP_N weight tiles by every token tile, so a wave reads about 8 token tiles
    // of x and 16 weight tiles, which L2 holds (gate_up at 8192: 1.07x; grouped at 2048 it was 0.95x).
    int mt = blockIdx.x, nt = blockIdx.y;
    if (gridDim.x > WG_GROUP_N) {
        const int id = blockIdx.x + blockIdx.y * gridDim.x, per_group = WG_GROUP_N * gridDim.x;
        const int first_n = id / per_group * WG_GROUP_N, group_n = imin(gridDim.y - first_n, WG_GROUP_N);
        mt = id % per_group / group_n;
        nt = first_n + id % per_group % group_n;
    }
    const int m0 = mt * WG_BM, n0 = nt * WG_BN;
    const int words_per_row = K / 8, groups = K / 128;
    if (tid == 0) {
        for (int s = 0; s < WG_STAGES; ++s) {
            mbar_init(&full[s], 128);   // the producer's 128 threads, one arrival each when their copies land
            mbar_init(&empty[s], 256);  // the consumers' 256 threads, one each when done with the stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the only block barrier: the mbarriers are initialized

    if (warp >= 8) {  // ---- the producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
        const int p = tid - 256;
        // x: thread p copies the 16-byte input chunk col8 = p % 16 of tokens 8 i + t0, i = 0..15;
        // weights: the 16-byte quarter wq of the group's 16 words of rows 32 i + p / 4, i = 0..3
        const int col8 = p % 16, t0 = p / 16, wq = p % 4;
        for (int g = 0; g < groups; ++g) {
            const int s = g % WG_STAGES;
            if (g >= WG_STAGES) mbar_wait(&empty[s], (g / WG_STAGES - 1) & 1);  // the consumers' last use of s
            unsigned char* xs = xs0 + s * WG_XBYTES;
#pragma unroll 4
            for (int i = 0; i < 16; ++i) {  // (unrolled fully, the addresses outgrow the producer's 40 registers)
                const int t = 8 * i + t0;
                const bool in = m0 + t < T;
                // atom col8 / 8, row t, chunk col8 % 8 swizzled by t % 8 (= t0)
                cp_async16(xs + (col8 / 8) * 16384 + t * 128 + ((col8 % 8) ^ t0) * 16,
                           x + (size_t)(in ? m0 + t : 0) * K + g * 128 + col8 * 8, in ? 16 : 0);
            }
            u32* ws = ws0 + s * (WG_WBYTES / 4);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = 32 * i + p / 4;
                cp_async16(ws + row * WG_WPAD + wq * 4,
                           qweight + (size_t)imin(n0 + row, N - 1) * words_per_row + g * 16 + wq * 4, 16);
            }
            mbar_arrive_on_copies(&full[s]);
        }
        cp_async_wait<0>();  // no copy outlives the block
        return;
    }

    // ---- the consumer warpgroups: wg owns weight rows n0 + 64 wg .. + 63; this thread rows rl and rl + 8
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
    const int wg = warp / 4, r = lane / 4, c = lane % 4;
    const int rl = 64 * wg + 16 * (warp % 4) + r;
    const int row0 = imin(n0 + rl, N - 1), row1 = imin(n0 + rl + 8, N - 1);
    float tot[64], acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) tot[i] = acc[i] = 0.0f;
    for (int g = 0; g < groups; ++g) {
        const int s = g % WG_STAGES;
        const float s0 = h2f(gs.scale(row0, g)), s1 = h2f(gs.scale(row1, g));  // in flight while the group multiplies
        u32 z0 = SYM_ZERO_PAIR, z1 = SYM_ZERO_PAIR;  // int4_pair's fixed zero point 8, or the rows' own
        if constexpr (Groups::ZERO_PER_GROUP) {
            z0 = gs.zero(row0, g);
            z1 = gs.zero(row1, g);
        }
        mbar_wait(&full[s], (g / WG_STAGES) & 1);
        fence_proxy_async();
        // A of k-step ks: a0 = (row rl, k 2c, 2c+1), a1 = (row rl + 8, ...), a2 / a3 the same at k + 8: pair c of
        // the rows' words 2 ks (inputs 16 ks .. 16 ks + 7) and 2 ks + 1
        const u32* ws = ws0 + s * (WG_WBYTES / 4);
        u32 a[8][4];
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
            const uint2 lo = *reinterpret_cast<const uint2*>(ws + rl * WG_WPAD + 2 * ks);
            const uint2 hi = *reinterpret_cast<const uint2*>(ws + (rl + 8) * WG_WPAD + 2 * ks);
            a[ks][0] = int4_pair(lo.x, c, z0);
            a[ks][1] = int4_pair(hi.x, c, z1);
            a[ks][2] = int4_pair(lo.y, c, z0);
            a[ks][3] = int4_pair(hi.y, c, z1);
        }
        wgmma_touch(acc);  // the last group's fold is done with acc
        wgmma_fence();
        const unsigned char* xs = xs0 + s * WG_XBYTES;
#pragma unroll
        for (int ks = 0; ks < 8; ++ks)  // k-step ks: inputs 16 ks .. 16 ks + 15, 32 B into atom ks / 4
            wgmma_m64n128k16_rs(acc, a[ks], wgmma_desc_sw128(xs + (ks / 4) * 16384 + (ks % 4) * 32), ks == 0 ? 0 : 1);
        wgmma_commit();
        wgmma_wait_all();
#pragma unroll
        for (int ks = 0; ks < 8; ++ks)  // a[] stays allocated, unwritten, until the wgmma that read it are done
            asm volatile("" :: "r"(a[ks][0]), "r"(a[ks][1]), "r"(a[ks][2]), "r"(a[ks][3]) : "memory");
        wgmma_touch(acc);
        mbar_arrive(&empty[s]);
        // the group's partial times its row's scale into the total (e < 2: row rl, e >= 2: row rl + 8)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            tot[4 * j + 0] = fmaf(acc[4 * j + 0], s0, tot[4 * j + 0]);
            tot[4 * j + 1] = fmaf(acc[4 * j + 1], s0, tot[4 * j + 1]);
            tot[4 * j + 2] = fmaf(acc[4 * j + 2], s1, tot[4 * j + 2]);
            tot[4 * j + 3] = fmaf(acc[4 * j + 3], s1, tot[4 * j + 3]);
        }
    }
    // y[token, row]: the 8 lanes of one c write 8 consecutive rows of one token
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int token = m0 + 8 * j + 2 * c + (e & 1), row = n0 + rl + 8 * (e >> 1);
            if (token < T && row < N) y[(size_t)token * N + row] = tot[4 * j + e];
        }
}
