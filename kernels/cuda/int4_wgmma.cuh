// int4_wgmma.cuh: the warp-specialized wgmma (sm_90a) prefill GEMM of the two INT4 group-128 formats,
// y = x W^T in fp32 (int4_sym_g128.cu's int4_wgmma_f32, int4_asym_g128.cu's int4_asym_g128_wgmma_f32).
//
// The sums of int4_pipe.cuh's ring, bit for bit: each 128-group's products (n - z) x, exact in fp16, summed
// in fp32 on the tensor cores in the same k order from a fresh partial, the partial times the group's scale
// added into the fp32 total (docs/ARCHITECTURE.md, the precision contract). What changes is who waits:
//   * a block is 384 threads, three warpgroups. Warpgroup 2 only copies; warpgroups 0 and 1 multiply, each
//     its 64 weight rows by the block's 128 tokens with wgmma m64n128k16 (y^T = W x^T: the weights are the
//     operand A, which wgmma takes from registers, unpacked there as the ring builds its B fragments; x,
//     already fp16, is the operand B, read by wgmma from shared memory as TMA left it);
//   * x comes by TMA (the copy engine, two boxes a stage from one thread, through the tensor map the
//     launcher encodes), the weight words by cp.async (16 bytes a thread, into padded rows that TMA cannot
//     lay out). With x by cp.async too, the producer's 2,048 16-byte copies a stage held the kernel back:
//     the same kernel with x copied only once ran 1.23-1.30x faster (bench/NOTES.md, v5 twelfth step);
//   * a stage is one 128-input group: x, 128 tokens x 128 inputs (32 KB) in wgmma's 128-byte swizzle,
//     K-major (two atoms of 64 inputs, 16 KB each; token t's row of an atom is 128 B at t * 128, its 16-byte
//     chunk j stored at chunk j ^ (t % 8)), and the 128 weight rows' 16 packed words (rows padded to
//     WG_WPAD = 20 words, 80 B: the 8 rows r of a consumer's uint2 read land in 8 different bank pairs).
//     WG_STAGES stages in dynamic shared memory (five: the most that fit);
//   * mbarriers instead of block barriers. full[s] completes when the producer's 128 threads' copies into
//     stage s have landed (cp.async.mbarrier.arrive.noinc: the arrival fires once the thread's earlier
//     cp.async are done) and x's 32 KB with them (thread 0's expect_tx arrival), empty[s] when all 256
//     consumer threads are done with it (their wgmma waited for, their weight words read). The two
//     consumer warpgroups share no barrier, so one's unpacking, wait and fold run while the other's wgmma
//     keep the tensor cores busy. The prototypes with a block barrier per step ran at the ring's speed;
//     this one at 1.4-1.8x it (bench/NOTES.md, v5);
//   * why the swizzle: wgmma reads a 128-byte-swizzled operand faster than the no-swizzle layout of core
//     matrices (8 rows x 16 B); CUTLASS's Hopper GEMMs stage theirs swizzled too. The kernel in the
//     no-swizzle layout gave the same sums at 0.6x this one's speed at the 7B prefill shapes
//     (bench/NOTES.md, v5 ninth step);
//   * setmaxnreg: the producer keeps 40 registers, the consumers take 232 (a consumer holds the fp32 total,
//     64, the group's partial, 64, and the group's A fragments, 32). 128 x 40 + 256 x 232 <= 65536.
// Two launches (kernels/cuda/linear.py launch_wgmma picks):
//   * one block a tile: grid (ceil(T / 128), ceil(N / 128)); past 2048 tokens each block's tile comes from a
//     grouped launch order (below), so that both the weight bytes and x come from DRAM a few times at most;
//   * spread (carry != nullptr; its own instantiation, SPREAD, so that one block a tile runs the plain
//     loop: with the plan's segments read at run time it ran 3-7% slower): grid (P), P <= the tiles, every
//     block resident at once (one an SM). A tile of 128 groups' work is `groups` units; block b takes units
//     [b U / P, (b + 1) U / P) of the U in tile order, so every block gets the same work within one group
//     (below: WgPlan). A tile count just past a multiple of the SMs (the 7B qkv_proj at 512 tokens: 144
//     tiles on 132 SMs) otherwise runs a second wave of 12 blocks while 120 SMs wait. A tile cut between
//     blocks b - 1 and b keeps its sums exact: b - 1 runs the tile's first groups before anything else and
//     leaves its fp32 totals in carry, and b runs the rest last, continuing from those totals in the same
//     group order: the bits of one block a tile.
// Rows past T are zero-filled by TMA (outside the map's [T, K]) and never stored; weight rows past N are read
// from row N - 1 and never stored. K % 128 == 0.
#pragma once
#include "int4_pipe.cuh"

#define WG_THREADS 384
#define WG_BM 128
#define WG_BN 128
#define WG_STAGES 5  // 5 x 42 KB of the 227 KB a block may have; 4 ran 1.01-1.17x slower (bench/NOTES.md, v5)
#define WG_WPAD 20
#define WG_GROUP_N 16  // the grouped launch order's weight tiles a group, past as many token tiles (below)
#define WG_XBYTES 32768
#define WG_WBYTES 10240
#define WG_SMEM 215120
#define WG_TO_CARRY 1    // a segment that leaves its totals to the next block (the spread launch's cut tile)
#define WG_FROM_CARRY 2  // a segment that starts from the block before's totals
#define WG_CARRY_SPINS (1 << 26)  // polls of a carry's flag (an L2 round trip each: about a minute), then a trap
static_assert(WG_XBYTES == WG_BM * 128 * 2 && WG_WBYTES == WG_BN * WG_WPAD * 4, "a stage: x tile, weight rows");
static_assert(WG_XBYTES % 1024 == 0, "x tiles on 1024-byte bounds (smem __align__(1024)): the atoms' base offset 0");
static_assert(WG_SMEM == WG_STAGES * (WG_XBYTES + WG_WBYTES) + 2 * WG_STAGES * 8, "the stages, then full[], empty[]");

// A block's work: `count` segments, each groups [g0, g1) of one tile (m0, n0), in the order they run. One
// block a tile: one segment, the whole tile. Spread: block b's units [lo, hi) are the rest of the tile lo
// falls in (a tail, from group lo % groups: the block before cut it), whole tiles, and the start of the tile
// hi falls in (a head, up to group hi % groups). The head runs first and the tail last, so the block before
// has left the tail's totals long before they are read; the host spreads only while P <= tiles, so a block's
// units (U / P >= groups) never lie inside one tile and a cut tile has one head and one tail.
struct WgSegment {
    int m0, n0, g0, g1, link;  // link: WG_TO_CARRY, WG_FROM_CARRY or 0 (from zero, into y)
};

struct WgPlan {
    int mtiles, groups, count;
    int whole0;                // the first whole tile (tiles numbered token tile fastest: mt + nt * mtiles)
    int head_tile, head_g1;    // head_g1 == 0: no head
    int tail_tile, tail_g0;    // tail_g0 == 0: no tail

    __device__ __forceinline__ WgSegment segment(int j) const {
        int t = whole0 + j - (head_g1 > 0), g0 = 0, g1 = groups, link = 0;
        if (j == 0 && head_g1 > 0) {
            t = head_tile, g1 = head_g1, link = WG_TO_CARRY;
        } else if (j == count - 1 && tail_g0 > 0) {
            t = tail_tile, g0 = tail_g0, link = WG_FROM_CARRY;
        }
        return {t % mtiles * WG_BM, t / mtiles * WG_BN, g0, g1, link};
    }
};

__device__ __forceinline__ WgPlan wg_plan(int T, int N, int groups, bool spread) {
    WgPlan p;
    p.mtiles = (T + WG_BM - 1) / WG_BM;
    p.groups = groups;
    p.head_g1 = p.tail_g0 = 0;
    if (!spread) {
        // Blocks start in launch order (blockIdx.x fastest), one an SM (the shared memory), so the order
        // decides what a wave of 132 blocks reads. Token tiles fastest (the grid's own order) read all of x
        // for every few weight tiles: right while x fits in L2 (up to WG_GROUP_N token tiles, 2048 tokens), but
        // at 8192 tokens x is 58-310 MB and came from DRAM again each time. Past WG_GROUP_N token tiles the
        // tiles run in groups of WG_GROUP_N weight tiles by every token tile, so a wave reads about 8 token
        // tiles of x and 16 weight tiles, which L2 holds (gate_up at 8192: 1.07x; grouped at 2048 it was 0.95x).
        int mt = blockIdx.x, nt = blockIdx.y;
        if (gridDim.x > WG_GROUP_N) {
            const int id = blockIdx.x + blockIdx.y * gridDim.x, per_group = WG_GROUP_N * gridDim.x;
            const int first_n = id / per_group * WG_GROUP_N, group_n = imin(gridDim.y - first_n, WG_GROUP_N);
            mt = id % per_group / group_n;
            nt = first_n + id % per_group % group_n;
        }
        p.whole0 = mt + nt * p.mtiles;
        p.count = 1;
        return p;
    }
    const long long units = (long long)p.mtiles * ((N + WG_BN - 1) / WG_BN) * groups;
    const long long lo = units * blockIdx.x / gridDim.x, hi = units * (blockIdx.x + 1) / gridDim.x;
    p.tail_tile = (int)(lo / groups), p.tail_g0 = (int)(lo % groups);
    p.head_tile = (int)(hi / groups), p.head_g1 = (int)(hi % groups);
    p.whole0 = p.tail_tile + (p.tail_g0 > 0);
    p.count = (p.head_tile - p.whole0) + (p.head_g1 > 0) + (p.tail_g0 > 0);
    return p;
}

// The carry between a cut tile's two blocks: flags[b] is set (release, device scope) once block b's head
// totals are in carry slot b, and put back to 0 by block b + 1 once it has read them, so every launch finds
// the flags as it left them (a graph replay too). Waiting needs block b running while block b + 1 polls:
// blocks are issued in index order and the spread launch has no more blocks than SMs, one an SM.
__device__ __forceinline__ void wg_flag_release(unsigned* f) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(f), "r"(1u) : "memory");
}
__device__ __forceinline__ unsigned wg_flag_acquire(const unsigned* f) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(f) : "memory");
    return v;
}
// Polls until the flag is set; traps (a launch failure, not a hang) if the block before never sets it. Not
// inlined: the poll loop inlined into the consumers' main loop made ptxas spill 56 bytes of it.
__device__ __noinline__ void wg_wait_flag(const unsigned* f) {
    for (int spins = 0; wg_flag_acquire(f) == 0u; ++spins) {
        if (spins == WG_CARRY_SPINS) __trap();
        __nanosleep(128);
    }
}
// the 256 consumer threads alone (the producer warpgroup has left): named barrier 1
__device__ __forceinline__ void wg_consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

template <bool SPREAD, class Groups>
__device__ __forceinline__ void int4_wgmma(const TmaMap& xmap, const u32* __restrict__ qweight, const Groups gs,
                                           float* __restrict__ y, int T, int N, int K, float* __restrict__ carry,
                                           unsigned* flags) {
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char* xs0 = smem;
    u32* ws0 = reinterpret_cast<u32*>(smem + WG_STAGES * WG_XBYTES);
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem + WG_STAGES * (WG_XBYTES + WG_WBYTES));
    unsigned long long* empty = full + WG_STAGES;
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const int words_per_row = K / 8, groups = K / 128;
    const WgPlan plan = wg_plan(T, N, groups, SPREAD);
    if (tid == 0) {
        for (int s = 0; s < WG_STAGES; ++s) {
            mbar_init(&full[s], 129);   // the producer's 128 threads when their copies land, and x's expected bytes
            mbar_init(&empty[s], 256);  // the consumers' 256 threads, one each when done with the stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the only block barrier: the mbarriers are initialized

    if (warp >= 8) {  // ---- the producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
        const int p = tid - 256;
        // x: thread 0 of the warpgroup asks the copy engine for the two atoms (TMA, below); weights: thread p
        // copies the 16-byte quarter wq of the group's 16 words of rows 32 i + p / 4, i = 0..3
        const int wq = p % 4;
        if (p == 0) tma_prefetch_map(&xmap);
        int k = 0;  // the block's groups so far, over its segments: stage k % WG_STAGES, in round k / WG_STAGES
        for (int j = 0; j < plan.count; ++j) {
            const WgSegment sg = plan.segment(j);
            for (int g = sg.g0; g < sg.g1; ++g, ++k) {
                const int s = k % WG_STAGES;
                if (k >= WG_STAGES) mbar_wait(&empty[s], (k / WG_STAGES - 1) & 1);  // the consumers' last use of s
                if (p == 0) {
                    // x's tile, inputs g * 128 .. + 127 of tokens m0 .. m0 + 127, as two boxes of 64 inputs x 128
                    // tokens, one an atom: the map's 128-byte swizzle is the atom's (token t's chunk j at chunk
                    // j ^ (t % 8), 1024-byte aligned), and tokens past T land as zeros. The expected bytes are
                    // set before the copies are issued, so the phase cannot complete without them.
                    unsigned char* xs = xs0 + s * WG_XBYTES;
                    mbar_arrive_expect_tx(&full[s], WG_XBYTES);
                    tma_load_2d(xs, &xmap, g * 128, sg.m0, &full[s]);
                    tma_load_2d(xs + WG_XBYTES / 2, &xmap, g * 128 + 64, sg.m0, &full[s]);
                }
                u32* ws = ws0 + s * (WG_WBYTES / 4);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = 32 * i + p / 4;
                    cp_async16(ws + row * WG_WPAD + wq * 4,
                               qweight + (size_t)imin(sg.n0 + row, N - 1) * words_per_row + g * 16 + wq * 4, 16);
                }
                mbar_arrive_on_copies(&full[s]);
            }
        }
        cp_async_wait<0>();  // no copy outlives the block
        return;
    }

    // ---- the consumer warpgroups: wg owns weight rows n0 + 64 wg .. + 63; this thread rows rl and rl + 8
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
    const int wg = warp / 4, r = lane / 4, c = lane % 4;
    const int rl = 64 * wg + 16 * (warp % 4) + r;
    float tot[64], acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    int k = 0;  // as the producer's
    for (int j = 0; j < plan.count; ++j) {
        const WgSegment sg = plan.segment(j);
        const int row0 = imin(sg.n0 + rl, N - 1), row1 = imin(sg.n0 + rl + 8, N - 1);
        if (sg.link == WG_FROM_CARRY) {
            // the tile's totals after its first g0 groups, left by the block before (its head): thread 0 waits
            // for the flag, the barrier holds the other 255 until it has seen it, then each thread reads its own
            // 64 totals (L2: written by another SM)
            if (tid == 0) {
                unsigned* f = flags + blockIdx.x - 1;
                wg_wait_flag(f);
                *f = 0u;  // for the next launch (no other block reads this flag in this one)
            }
            wg_consumers_sync();
            const float* from = carry + (size_t)(blockIdx.x - 1) * 64 * 256 + tid;
#pragma unroll
            for (int i = 0; i < 64; ++i) tot[i] = __ldcg(from + i * 256);
        } else {
#pragma unroll
            for (int i = 0; i < 64; ++i) tot[i] = 0.0f;
        }
        for (int g = sg.g0; g < sg.g1; ++g, ++k) {
            const int s = k % WG_STAGES;
            // the group's scales: in flight while the group multiplies
            const float s0 = h2f(gs.scale(row0, g)), s1 = h2f(gs.scale(row1, g));
            u32 z0 = SYM_ZERO_PAIR, z1 = SYM_ZERO_PAIR;  // int4_pair's fixed zero point 8, or the rows' own
            if constexpr (Groups::ZERO_PER_GROUP) {
                z0 = gs.zero(row0, g);
                z1 = gs.zero(row1, g);
            }
            // x came by TMA (the async proxy, as wgmma reads it) and the weight words by cp.async, read here by
            // plain loads: the barrier's phase alone makes both visible, no proxy fence
            mbar_wait(&full[s], (k / WG_STAGES) & 1);
            // A of k-step ks: a0 = (row rl, k 2c, 2c+1), a1 = (row rl + 8, ...), a2 / a3 the same at k + 8: pair c
            // of the rows' words 2 ks (inputs 16 ks .. 16 ks + 7) and 2 ks + 1
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
                wgmma_m64n128k16_rs(acc, a[ks], wgmma_desc_sw128(xs + (ks / 4) * 16384 + (ks % 4) * 32),
                                    ks == 0 ? 0 : 1);
            wgmma_commit();
            wgmma_wait_all();
#pragma unroll
            for (int ks = 0; ks < 8; ++ks)  // a[] stays allocated, unwritten, until the wgmma that read it are done
                asm volatile("" :: "r"(a[ks][0]), "r"(a[ks][1]), "r"(a[ks][2]), "r"(a[ks][3]) : "memory");
            wgmma_touch(acc);
            mbar_arrive(&empty[s]);
            // the group's partial times its row's scale into the total (e < 2: row rl, e >= 2: row rl + 8)
#pragma unroll
            for (int q = 0; q < 16; ++q) {
                tot[4 * q + 0] = fmaf(acc[4 * q + 0], s0, tot[4 * q + 0]);
                tot[4 * q + 1] = fmaf(acc[4 * q + 1], s0, tot[4 * q + 1]);
                tot[4 * q + 2] = fmaf(acc[4 * q + 2], s1, tot[4 * q + 2]);
                tot[4 * q + 3] = fmaf(acc[4 * q + 3], s1, tot[4 * q + 3]);
            }
        }
        if (sg.link == WG_TO_CARRY) {
            // the head's totals for the next block, coalesced (thread tid's total i at i * 256 + tid); every
            // thread's stores are fenced and all 256 have passed the barrier before thread 0 sets the flag
            float* to = carry + (size_t)blockIdx.x * 64 * 256 + tid;
#pragma unroll
            for (int i = 0; i < 64; ++i) __stcg(to + i * 256, tot[i]);
            __threadfence();
            wg_consumers_sync();
            if (tid == 0) wg_flag_release(flags + blockIdx.x);
            continue;
        }
        // y[token, row]: the 8 lanes of one c write 8 consecutive rows of one token
#pragma unroll
        for (int q = 0; q < 16; ++q)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int token = sg.m0 + 8 * q + 2 * c + (e & 1), row = sg.n0 + rl + 8 * (e >> 1);
                if (token < T && row < N) y[(size_t)token * N + row] = tot[4 * q + e];
            }
    }
}

// An entry point's body: the spread launch (carry != nullptr) and one block a tile, separate instantiations
template <class Groups>
__device__ __forceinline__ void int4_wgmma_entry(const TmaMap& xmap, const u32* qweight, const Groups gs, float* y,
                                                 int T, int N, int K, float* carry, unsigned* flags) {
    if (carry != nullptr)
        int4_wgmma<true>(xmap, qweight, gs, y, T, N, K, carry, flags);
    else
        int4_wgmma<false>(xmap, qweight, gs, y, T, N, K, carry, flags);
}
