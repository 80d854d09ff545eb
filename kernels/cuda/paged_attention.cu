// paged_attention.cu: causal GQA attention over the paged KV cache, for prefill (T queries) and decode
// (T = 1). Mirrors kernels/numpy/attention.py: K/V read only through the page table, one 16-slot page
// at a time, an online softmax (running max m, running sum l, unnormalised fp32 accumulator), scores
// scaled by 1/sqrt(d) folded into q, fp32 arithmetic, fp16 output.
//
// Grid (nkv, T, splits). A block owns one KV head, one query token t and one span of the keys: all
// `group = nq / nkv` query heads of that KV head are processed together, so each K/V page is loaded
// from global memory once for the whole group (GQA sharing). Query t sees keys 0 .. positions[t]
// (read on the device); slots at or past that length are never loaded: tests fill free pages and
// unwritten slots with NaN, and one slot too far turns the output NaN.
//
// splits == 1: the block writes the normalised output. splits > 1 (decode, long caches): block z covers
// pages [z * pages_per_split, (z + 1) * pages_per_split) and writes its partial (m, l, acc) to scratch;
// attention_combine merges the splits in a fixed order (deterministic; no atomics), or, in the variant at
// the end of this file, the blocks of one thread block cluster merge them themselves. The split count
// (the grid) is fixed when the launch is recorded, so a captured graph stays valid as the sequence
// grows; splits past the length write an empty partial (l = 0). With pages_per_split <= 0 the span is
// computed on the device from the current length, ceil(used pages / splits), so the work spreads over
// every block at any context (decode attention that scales with context); a positive value fixes it.
//
// Shared memory (dynamic, floats): K page [16][d+1] (the +1 pad puts the 16 slots of one column in
// 16 different banks for the score loop), V page [16][d], q [group][d], p [group][16], m/l/alpha [group].
#include "common.cuh"
#include "mma.cuh"

#define PAGE 16
#define ATT_THREADS 128
#define ATT_MAX_ITEMS 16  // group * d <= ATT_THREADS * ATT_MAX_ITEMS (checked by the launcher)

// The keys query token t sees (n_keys = positions[t] + 1) and the pages [first, last) of split z of
// `splits`: pages_per_split of them, or with pages_per_split <= 0 the used pages spread evenly over the
// splits, computed here from the current length. `last` is exclusive and never past the page table, even
// if a position were (wrongly) beyond it. Every decode-attention kernel takes its span from here.
struct SplitPages {
    int n_keys, first, last;
};
__device__ __forceinline__ SplitPages split_pages(const int* __restrict__ positions, int t, int z, int splits,
                                                  int pages_per_split, int max_pages) {
    SplitPages s;
    s.n_keys = positions[t] + 1;
    if (pages_per_split <= 0) {  // dynamic: spread the used pages evenly over the splits
        const int used = imin((s.n_keys + PAGE - 1) / PAGE, max_pages);
        pages_per_split = imax(1, (used + splits - 1) / splits);
    }
    s.first = z * pages_per_split;
    s.last = imin(imin((z + 1) * pages_per_split, (s.n_keys + PAGE - 1) / PAGE), max_pages);
    return s;
}

// A split's result for query head h of token t, in the layout attention_combine_f16 reads: column c of the
// unnormalised output into part_acc [T, nq, splits, d], and from column 0 the head's running max and sum
// into part_m and part_l [T, nq, splits]. Every decode-attention kernel stores its splits through here.
__device__ __forceinline__ void store_split(float* __restrict__ part_m, float* __restrict__ part_l,
                                            float* __restrict__ part_acc, int t, int nq, int h, int splits, int z,
                                            int d, int c, float acc, float m, float l) {
    const size_t pi = ((size_t)t * nq + h) * splits + z;
    part_acc[pi * d + c] = acc;
    if (c == 0) { part_m[pi] = m; part_l[pi] = l; }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
paged_attention_f16(const f16_bits* __restrict__ q, const f16_bits* __restrict__ k_pages,
                    const f16_bits* __restrict__ v_pages, const int* __restrict__ page_table,
                    const int* __restrict__ positions, f16_bits* __restrict__ out,
                    float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
                    int nq, int nkv, int d, int pages_per_split, int max_pages, float scale) {
    extern __shared__ float smem[];
    pdl_enter();  // common.cuh: q, the pages and the positions are earlier kernels' writes
    const int kvh = blockIdx.x, t = blockIdx.y, z = blockIdx.z, splits = gridDim.z;
    const int group = nq / nkv, tid = threadIdx.x;
    const int ks = d + 1;
    float* Ks = smem;                   // [16][d+1]
    float* Vs = Ks + PAGE * ks;         // [16][d]
    float* Qs = Vs + PAGE * d;          // [group][d], pre-scaled
    float* Ps = Qs + group * d;         // [group][16]
    float* Ms = Ps + group * PAGE;      // [group]
    float* Ls = Ms + group;             // [group]
    float* As = Ls + group;             // [group] rescale factor of this page

    const SplitPages span = split_pages(positions, t, z, splits, pages_per_split, max_pages);
    const int n_keys = span.n_keys, first_page = span.first, last_page = span.last;

    for (int i = tid; i < group * d; i += ATT_THREADS)
        Qs[i] = h2f(q[((size_t)t * nq + kvh * group) * d + i]) * scale;
    for (int g = tid; g < group; g += ATT_THREADS) { Ms[g] = neg_inf(); Ls[g] = 0.0f; }

    float acc[ATT_MAX_ITEMS];
#pragma unroll
    for (int k = 0; k < ATT_MAX_ITEMS; ++k) acc[k] = 0.0f;

    const int score_rounds = (group * PAGE + ATT_THREADS - 1) / ATT_THREADS;
    for (int p = first_page; p < last_page; ++p) {
        const int valid = imin(PAGE, n_keys - p * PAGE);  // slots of this page below the length
        const size_t base = (((size_t)page_table[p] * nkv + kvh) * PAGE) * d;
        // Barrier: the previous page's P.V loop (and, on the first page, the q/m/l setup) is done
        // before K/V/P are overwritten.
        __syncthreads();
        // The (page, head) slice is 16 x d contiguous fp16; its first `valid * d` are the slots to read.
        if ((d & 7) == 0) {
            const uint4* kv = reinterpret_cast<const uint4*>(k_pages + base);
            const uint4* vv = reinterpret_cast<const uint4*>(v_pages + base);
            for (int i = tid; i < valid * d / 8; i += ATT_THREADS) {
                u32 kw[4], vw[4];
                uint4_words(kv[i], kw);
                uint4_words(vv[i], vw);
                const int s = (i * 8) / d, c = (i * 8) % d;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    h2x2f(kw[e], Ks[s * ks + c + 2 * e], Ks[s * ks + c + 2 * e + 1]);
                    h2x2f(vw[e], Vs[s * d + c + 2 * e], Vs[s * d + c + 2 * e + 1]);
                }
            }
        } else {
            for (int i = tid; i < valid * d; i += ATT_THREADS) {
                const int s = i / d, c = i % d;
                Ks[s * ks + c] = h2f(k_pages[base + i]);
                Vs[s * d + c] = h2f(v_pages[base + i]);
            }
        }
        __syncthreads();  // K/V of this page are in shared memory

        // Scores: thread -> (head g, slot); the 16 slots of a head are 16 aligned lanes of one warp.
        // Every thread runs every round (no early exit) so the half-warp shuffles are full-mask.
        for (int r = 0; r < score_rounds; ++r) {
            const int idx = r * ATT_THREADS + tid, g = idx / PAGE, slot = idx % PAGE;
            const bool live = g < group && slot < valid;
            float s = neg_inf();
            if (live) {
                float dot = 0.0f;
                for (int c = 0; c < d; ++c) dot = fmaf(Qs[g * d + c], Ks[slot * ks + c], dot);
                s = dot;
            }
            const float m_old = g < group ? Ms[g] : 0.0f;
            const float m_new = fmaxf(m_old, half_warp_max(s));  // finite: slot 0 of the page is valid
            const float prob = live ? expf(s - m_new) : 0.0f;
            const float psum = half_warp_sum(prob);
            __syncwarp();  // every lane of the head has read Ms[g] before lane slot 0 rewrites it
            if (g < group) {
                Ps[g * PAGE + slot] = prob;
                if (slot == 0) {
                    const float alpha = expf(m_old - m_new);  // 0 on the first page (m_old = -inf)
                    As[g] = alpha;
                    Ls[g] = Ls[g] * alpha + psum;
                    Ms[g] = m_new;
                }
            }
        }
        __syncthreads();  // P, alpha of every head are ready for the P.V loop

        // acc[item] for items (g, c) = tid + k * ATT_THREADS: rescale, then add P[g, :] . V[:, c].
#pragma unroll
        for (int k = 0; k < ATT_MAX_ITEMS; ++k) {
            const int item = tid + k * ATT_THREADS;
            if (item < group * d) {
                const int g = item / d, c = item % d;
                float a = acc[k] * As[g];
                for (int s = 0; s < valid; ++s) a = fmaf(Ps[g * PAGE + s], Vs[s * d + c], a);
                acc[k] = a;
            }
        }
    }
    __syncthreads();  // the last page's Ls/Ms writes are visible to every thread

#pragma unroll
    for (int k = 0; k < ATT_MAX_ITEMS; ++k) {
        const int item = tid + k * ATT_THREADS;
        if (item < group * d) {
            const int g = item / d, c = item % d, h = kvh * group + g;
            if (splits == 1) {
                out[((size_t)t * nq + h) * d + c] = f2h(acc[k] / Ls[g]);
            } else {
                store_split(part_m, part_l, part_acc, t, nq, h, splits, z, d, c, acc[k], Ms[g], Ls[g]);
            }
        }
    }
}

// ---- a warp per page (the default where it fits: head_dim 64 or 128, at most 8 query heads per KV head)
//
// paged_attention_f16 above stages each page in shared memory as fp32 behind three block barriers and
// gives each score a serial 128-long dot from shared memory: latency, not bytes, set its time (about
// 19 us per layer for 1 MB of KV at the 7B shape). Here each warp of the block owns whole pages and
// keeps them in registers; the block's warps take the span's pages round-robin, each with its own
// online softmax, and merge once at the end. No block barrier inside the page loop.
//
// Same grid (nkv, T, splits), same page spans, same partial outputs and combine kernel, same
// arithmetic contract (fp32 scores, probabilities and sums, q pre-scaled, fp16 output).
//
// Per page, lane (slot s = lane % 16, half hf = lane / 16):
//   * scores: loads dims [hf D/2, hf D/2 + D/2) of K row s with 16-byte loads (the page's K slice is
//     16 rows of D contiguous fp16, so the warp reads it whole) and forms the partial dot with every
//     query head of the group (q from shared memory, one broadcast per half-warp); one xor-16 shuffle
//     adds the two halves, so both lanes of a slot hold its score;
//   * softmax: max and sum over the 16 slots by xor shuffles inside each half-warp (both halves agree);
//     slots at or past the length get probability 0 and are never loaded (tests fill them with NaN);
//   * P.V: lane owns dims [lane D/32, lane D/32 + D/32) of every head's accumulator and reads those dims
//     of the 16 V rows (the warp reads each V row whole, 8 B a lane at D = 128); the probabilities go
//     through a per-warp shared array read back as float4 broadcasts (4 slots a load).
// The per-warp (m, l, acc) are merged in warp order through shared memory: deterministic.
#define ATT_WARPS 4
#define ATT_MAX_GROUP 8  // query heads per KV head this kernel holds (the launcher checks)

template <int D>
__device__ __forceinline__ void attention_warp_pages(const f16_bits* __restrict__ q, const f16_bits* __restrict__ k_pages,
                                                     const f16_bits* __restrict__ v_pages, const int* __restrict__ page_table,
                                                     const int* __restrict__ positions, f16_bits* __restrict__ out,
                                                     float* __restrict__ part_m, float* __restrict__ part_l,
                                                     float* __restrict__ part_acc, int nq, int nkv, int pages_per_split,
                                                     int max_pages, float scale) {
    constexpr int G = ATT_MAX_GROUP;
    constexpr int KH = D / 2;    // K dims per lane (half a row)
    constexpr int KL = KH / 8;   // 16-byte K loads per lane
    constexpr int DL = D / 32;   // accumulator dims per lane
    constexpr int VW = DL / 2;   // 32-bit V words per lane per slot
    __shared__ float Qs[G * D];                       // pre-scaled q of the group's heads
    __shared__ __align__(16) float Ps[ATT_WARPS][G][PAGE];  // each warp's probabilities of its page
    __shared__ float Mw[ATT_WARPS][G], Lw[ATT_WARPS][G];
    __shared__ float Aw[ATT_WARPS][G * D];

    const int kvh = blockIdx.x, t = blockIdx.y, z = blockIdx.z, splits = gridDim.z;
    const int group = nq / nkv, tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int s = lane % PAGE, hf = lane / PAGE;

    const SplitPages span = split_pages(positions, t, z, splits, pages_per_split, max_pages);
    const int n_keys = span.n_keys, first_page = span.first, last_page = span.last;

    for (int i = tid; i < group * D; i += ATT_WARPS * WARP)
        Qs[i] = h2f(q[((size_t)t * nq + kvh * group) * D + i]) * scale;
    __syncthreads();  // q is in shared memory before any warp scores

    float m[G], l[G], acc[G][DL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = neg_inf();
        l[g] = 0.0f;
#pragma unroll
        for (int k = 0; k < DL; ++k) acc[g][k] = 0.0f;
    }

    for (int p = first_page + warp; p < last_page; p += ATT_WARPS) {
        const int valid = imin(PAGE, n_keys - p * PAGE);  // >= 1: p is below the last used page
        const size_t base = (((size_t)page_table[p] * nkv + kvh) * PAGE) * D;
        const bool live = s < valid;
        // Every load of the page first (K half-row, this lane's dims of the valid V rows): one trip of
        // memory latency per page, not one per use.
        uint4 kr[KL];
        if (live) {
            const uint4* kp = reinterpret_cast<const uint4*>(k_pages + base + (size_t)s * D + hf * KH);
#pragma unroll
            for (int j = 0; j < KL; ++j) kr[j] = __ldg(kp + j);
        }
        u32 vr[PAGE][VW];
#pragma unroll
        for (int sl = 0; sl < PAGE; ++sl) {
            const u32* vp = reinterpret_cast<const u32*>(v_pages + base + (size_t)sl * D + lane * DL);
#pragma unroll
            for (int w = 0; w < VW; ++w) vr[sl][w] = sl < valid ? __ldg(vp + w) : 0u;  // never read a slot past the length
        }

        float sc[G];
#pragma unroll
        for (int g = 0; g < G; ++g) sc[g] = 0.0f;
        if (live) {
#pragma unroll
            for (int j = 0; j < KL; ++j) {
                u32 kw[4];
                uint4_words(kr[j], kw);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float k0, k1;
                    h2x2f(kw[e], k0, k1);
                    const int c = hf * KH + 8 * j + 2 * e;
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        if (g < group) {
                            const float2 qq = *reinterpret_cast<const float2*>(Qs + g * D + c);
                            sc[g] = fmaf(qq.x, k0, sc[g]);
                            sc[g] = fmaf(qq.y, k1, sc[g]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g < group) {  // uniform across the warp
                const float dot = sc[g] + __shfl_xor_sync(FULL_MASK, sc[g], 16);
                const float sg = live ? dot : neg_inf();
                const float m_new = fmaxf(m[g], half_warp_max(sg));  // finite: slot 0 is valid
                const float prob = live ? expf(sg - m_new) : 0.0f;
                const float alpha = expf(m[g] - m_new);  // 0 on the warp's first page (m = -inf)
                l[g] = l[g] * alpha + half_warp_sum(prob);
                m[g] = m_new;
#pragma unroll
                for (int k = 0; k < DL; ++k) acc[g][k] *= alpha;
                if (hf == 0) Ps[warp][g][s] = prob;
            }
        }
        __syncwarp();  // this warp's probabilities are in Ps before its lanes read them back
#pragma unroll
        for (int s4 = 0; s4 < PAGE; s4 += 4) {
            float vf[4][DL];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int w = 0; w < VW; ++w) h2x2f(vr[s4 + i][w], vf[i][2 * w], vf[i][2 * w + 1]);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                if (g < group) {
                    const float4 pp = *reinterpret_cast<const float4*>(&Ps[warp][g][s4]);  // slots past valid: 0
#pragma unroll
                    for (int k = 0; k < DL; ++k) {
                        float a = acc[g][k];
                        a = fmaf(pp.x, vf[0][k], a);
                        a = fmaf(pp.y, vf[1][k], a);
                        a = fmaf(pp.z, vf[2][k], a);
                        a = fmaf(pp.w, vf[3][k], a);
                        acc[g][k] = a;
                    }
                }
            }
        }
        __syncwarp();  // every lane has read Ps before the warp's next page rewrites it
    }

    // Merge the warps in warp order. A warp that had no page holds m = -inf, l = 0 and weighs 0.
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g < group) {
            if (lane == 0) { Mw[warp][g] = m[g]; Lw[warp][g] = l[g]; }
#pragma unroll
            for (int k = 0; k < DL; ++k) Aw[warp][g * D + lane * DL + k] = acc[g][k];
        }
    }
    __syncthreads();  // every warp's state is in shared memory
    for (int item = tid; item < group * D; item += ATT_WARPS * WARP) {
        const int g = item / D, c = item % D;
        float M = neg_inf();
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) M = Lw[w][g] > 0.0f ? fmaxf(M, Mw[w][g]) : M;
        float L = 0.0f, A = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) {
            const float e = Lw[w][g] > 0.0f ? expf(Mw[w][g] - M) : 0.0f;
            L = fmaf(Lw[w][g], e, L);
            A = fmaf(Aw[w][item], e, A);
        }
        const int h = kvh * group + g;
        if (splits == 1) {
            out[((size_t)t * nq + h) * D + c] = f2h(A / L);
        } else {  // an empty split writes l = 0 (and m = -inf, acc = 0): the combine gives it weight 0
            store_split(part_m, part_l, part_acc, t, nq, h, splits, z, D, c, A, M, L);
        }
    }
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
paged_attention_warp_d64(const f16_bits* q, const f16_bits* k_pages, const f16_bits* v_pages, const int* page_table,
                         const int* positions, f16_bits* out, float* part_m, float* part_l, float* part_acc,
                         int nq, int nkv, int d, int pages_per_split, int max_pages, float scale) {
    pdl_enter();  // common.cuh: q, the pages and the positions are earlier kernels' writes
    attention_warp_pages<64>(q, k_pages, v_pages, page_table, positions, out, part_m, part_l, part_acc, nq, nkv,
                             pages_per_split, max_pages, scale);
}
extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
paged_attention_warp_d128(const f16_bits* q, const f16_bits* k_pages, const f16_bits* v_pages, const int* page_table,
                          const int* positions, f16_bits* out, float* part_m, float* part_l, float* part_acc,
                          int nq, int nkv, int d, int pages_per_split, int max_pages, float scale) {
    pdl_enter();  // common.cuh: q, the pages and the positions are earlier kernels' writes
    attention_warp_pages<128>(q, k_pages, v_pages, page_table, positions, out, part_m, part_l, part_acc, nq, nkv,
                              pages_per_split, max_pages, scale);
}

// ---- prefill on the tensor cores: attention_prefill_tc_d<D> ----------------------------------------
//
// The kernels above give every query token its own block and re-read its keys page by page: a prefill
// of T tokens reads ~T^2/32 pages per KV head with a few hundred instructions of overhead each. Here a
// block owns a tile of query ROWS (token, head) pairs of one KV head, 64 of them: qt = 64 / group
// consecutive tokens times the group's query heads, row r = (token r / group, head r % group). Every
// K/V page is staged once per tile in shared memory (cp.async, two buffers: page p+1 loads while p is
// used) and both products run on mma.sync m16n8k16 (mma.cuh), each warp owning 16 rows:
//   * S = Q K^T: q and k are fp16, so every product is exact and the sums are fp32 (as the CUDA-core
//     kernels' fp32 dots); the 1/sqrt(d) scale multiplies the fp32 score (they fold it into q first:
//     a different rounding of the same fp32 arithmetic, far under the fp16 output's);
//   * causal mask per row: key j counts iff j <= positions[row's token]; a masked score is -inf (a
//     select, so NaN in a slot past the length never reaches a sum: such slots are also zero-filled);
//   * online softmax per row in fp32 (running max m, sum l), the max and sums over a row's 16 keys by
//     two xor shuffles (a row's scores sit on the 4 lanes of a quad);
//   * O += P V with the fp32 probabilities split as P = P_hi + P_lo, two fp16 numbers (P_lo the
//     rounding error of P_hi): two mmas, exact products with fp16 V, fp32 sums, so P keeps ~22 bits
//     (the precision contract's fp32 probabilities) rather than fp16's 11. S's C fragment is P's A
//     fragment register for register (mma.cuh's layouts), so P never leaves registers.
// Rows past the tile (group does not divide 64, or the last tile's tokens past T) compute with the
// tile's first token's position and are never stored. Grid (nkv, ceil(T / qt)), 128 threads; block y takes
// the tile of tokens from (gridDim.y - 1 - y) qt (below).
#define TC_ROWS 64

// Pieces both prefill kernels (attention_prefill_tc, attention_prefill_wg) share: the same tile, rows and
// fragment layout of O.
// The tile's keys: 1 + the largest position of its tokens t0 .. t0 + qt - 1 below T (positions need not be
// sorted), a warp's max (every lane gets it).
__device__ __forceinline__ int prefill_tile_keys(const int* __restrict__ positions, int t0, int qt, int T, int lane) {
    int mx = 0;
    for (int i = lane; i < qt; i += WARP)
        if (t0 + i < T) mx = imax(mx, positions[t0 + i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = imax(mx, __shfl_xor_sync(FULL_MASK, mx, o));
    return mx + 1;
}
// Row r's position: its token's, or, for a row past the tile (never stored), the tile's first token's.
__device__ __forceinline__ int prefill_row_position(const int* __restrict__ positions, int t0, int r, int group,
                                                    int rows_used, int T) {
    const int tok = t0 + r / group;
    return r < rows_used && tok < T ? positions[tok] : positions[t0];
}
// out[token, head, dims 8 n + 2 c, +1] for a lane's two rows rlo and rhi = rlo + 8 (C fragment rows r and
// r + 8): o[4 n + e] holds n-tile n's element e (e < 2 row lo, e >= 2 row hi), each row divided by its l.
template <int D>
__device__ __forceinline__ void prefill_store_rows(f16_bits* __restrict__ out, const float* o, int rlo, int rhi, int c,
                                                   int t0, int group, int rows_used, int T, int nq, int kvh, float l_lo,
                                                   float l_hi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = h ? rhi : rlo, tok = t0 + r / group;
        if (r >= rows_used || tok >= T) continue;
        const float inv_l = 1.0f / (h ? l_hi : l_lo);
        f16_bits* dst = out + ((size_t)tok * nq + kvh * group + r % group) * D + 2 * c;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            dst[n * 8] = f2h(o[4 * n + 2 * h] * inv_l);
            dst[n * 8 + 1] = f2h(o[4 * n + 2 * h + 1] * inv_l);
        }
    }
}

template <int D>
__device__ __forceinline__ void attention_prefill_tc(const f16_bits* __restrict__ q, const f16_bits* __restrict__ k_pages,
                                                     const f16_bits* __restrict__ v_pages, const int* __restrict__ page_table,
                                                     const int* __restrict__ positions, f16_bits* __restrict__ out,
                                                     int nq, int nkv, int T, int qt, int max_pages, float scale) {
    constexpr int KP = D + 8;  // padded row (halves): 8 rows of an ldmatrix phase in 8 different bank groups
    constexpr int KS = D / 16; // k steps of S
    constexpr int NT = D / 8;  // n tiles of O
    constexpr int CH = D / 8;  // 16-byte chunks per row
    __shared__ __align__(16) f16_bits Qs[TC_ROWS][KP];
    __shared__ __align__(16) f16_bits Ks[2][PAGE][KP];
    __shared__ __align__(16) f16_bits Vs[2][PAGE][KP];
    __shared__ int tile_keys;

    // Tiles in reverse token order: a causal tile's work grows with its tokens' positions, and blocks start
    // in launch order, so the longest tiles go first and the short ones fill the SMs they leave (the grid's
    // own order ran the longest last, a tail of a few blocks on an otherwise idle GPU at 8192 tokens).
    const int kvh = blockIdx.x, t0 = (gridDim.y - 1 - blockIdx.y) * qt, group = nq / nkv;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int rows_used = qt * group;

    // The tile's keys (prefill_tile_keys), from warp 0 through shared memory.
    if (warp == 0) {
        const int keys = prefill_tile_keys(positions, t0, qt, T, lane);
        if (lane == 0) tile_keys = keys;
    }
    // Q rows -> shared (zero for rows past the tile).
    for (int i = tid; i < TC_ROWS * CH; i += 4 * WARP) {
        const int r = i / CH, ch = i % CH, tok = t0 + r / group;
        const bool ok = r < rows_used && tok < T;
        const f16_bits* src = q + ((size_t)(ok ? tok : 0) * nq + kvh * group + (ok ? r % group : 0)) * D + ch * 8;
        cp_async16(&Qs[r][ch * 8], src, ok ? 16 : 0);
    }
    cp_async_commit();
    __syncthreads();  // tile_keys is set
    const int n_keys = tile_keys;
    const int last_page = imin((n_keys + PAGE - 1) / PAGE, max_pages);

    auto load_page = [&](int p, int b) {
        const size_t base = (((size_t)page_table[p] * nkv + kvh) * PAGE) * D;
        for (int i = tid; i < PAGE * CH; i += 4 * WARP) {
            const int sl = i / CH, ch = i % CH;
            const int bytes = p * PAGE + sl < n_keys ? 16 : 0;  // past the tile's keys: zero-filled
            cp_async16(&Ks[b][sl][ch * 8], k_pages + base + (size_t)sl * D + ch * 8, bytes);
            cp_async16(&Vs[b][sl][ch * 8], v_pages + base + (size_t)sl * D + ch * 8, bytes);
        }
    };
    load_page(0, 0);
    cp_async_commit();

    // This lane's two rows (C fragment rows r and r + 8 of the warp's 16) and their positions.
    const int rlo = warp * 16 + lane / 4, rhi = rlo + 8, c = lane % 4;
    const int plo = prefill_row_position(positions, t0, rlo, group, rows_used, T);
    const int phi = prefill_row_position(positions, t0, rhi, group, rows_used, T);

    cp_async_wait<1>();  // Q has landed (page 0 may still fly)
    __syncthreads();
    u32 qa[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) ldmatrix_x4(qa[ks], &Qs[warp * 16 + (lane % 16)][ks * 16 + (lane / 16) * 8]);

    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_lo = neg_inf(), m_hi = neg_inf(), l_lo = 0.0f, l_hi = 0.0f;

    for (int p = 0; p < last_page; ++p) {
        const int b = p & 1;
        if (p + 1 < last_page) load_page(p + 1, b ^ 1);  // its buffer was last read at p - 1 (barrier below)
        cp_async_commit();
        cp_async_wait<1>();  // page p is in shared memory for this thread's copies ...
        __syncthreads();     // ... and for everyone's

        // S = Q K^T for 16 keys: n tile 0 = keys 0-7, n tile 1 = keys 8-15.
        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            u32 kb[4];  // lanes 0-7: keys 0-7 dims ks*16; 8-15: keys 0-7 dims +8; 16-23: keys 8-15; 24-31: keys 8-15, +8
            ldmatrix_x4(kb, &Ks[b][(lane / 16) * 8 + (lane % 8)][ks * 16 + ((lane / 8) % 2) * 8]);
            const u32 b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
            mma_16816(sc[0], qa[ks], b0);
            mma_16816(sc[1], qa[ks], b1);
        }
        // Mask, scale, row max (a row's 16 scores are on the 4 lanes of its quad).
        float mxl = neg_inf(), mxh = neg_inf();
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = p * PAGE + n * 8 + 2 * c + e;
                sc[n][e] = j <= plo ? sc[n][e] * scale : neg_inf();
                sc[n][e + 2] = j <= phi ? sc[n][e + 2] * scale : neg_inf();
                mxl = fmaxf(mxl, sc[n][e]);
                mxh = fmaxf(mxh, sc[n][e + 2]);
            }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            mxl = fmaxf(mxl, __shfl_xor_sync(FULL_MASK, mxl, o2));
            mxh = fmaxf(mxh, __shfl_xor_sync(FULL_MASK, mxh, o2));
        }
        // Key 0 is on page 0 and every row's position is >= 0, so m is finite from page 0 on.
        const float nl = fmaxf(m_lo, mxl), nh = fmaxf(m_hi, mxh);
        const float al = expf(m_lo - nl), ah = expf(m_hi - nh);  // 0 on page 0 (m = -inf)
        m_lo = nl;
        m_hi = nh;
        float sl_ = 0.0f, sh_ = 0.0f;
        u32 ph[4], pl[4];  // P as the A fragment of the P V mma (hi and lo parts)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            const float p0 = expf(sc[n][0] - nl), p1 = expf(sc[n][1] - nl);  // masked: exp(-inf) = 0
            const float p2 = expf(sc[n][2] - nh), p3 = expf(sc[n][3] - nh);
            sl_ += p0 + p1;
            sh_ += p2 + p3;
            u32 hl, hh, ll, lh;  // row lo's and row hi's pairs, each as two fp16 parts (mma.cuh prob_parts)
            prob_parts(p0, p1, hl, ll);
            prob_parts(p2, p3, hh, lh);
            ph[2 * n] = hl;      // a0 (n = 0) / a2 (n = 1): row lo, keys 8n + 2c, +1
            ph[2 * n + 1] = hh;  // a1 / a3: row hi
            pl[2 * n] = ll;
            pl[2 * n + 1] = lh;
        }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            sl_ += __shfl_xor_sync(FULL_MASK, sl_, o2);
            sh_ += __shfl_xor_sync(FULL_MASK, sh_, o2);
        }
        l_lo = l_lo * al + sl_;
        l_hi = l_hi * ah + sh_;
        const u32 pa_hi[4] = {ph[0], ph[1], ph[2], ph[3]}, pa_lo[4] = {pl[0], pl[1], pl[2], pl[3]};
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            u32 vb[4];  // .trans: lanes 0-7 keys 0-7, 8-15 keys 8-15 at dims 8n; 16-31 the same at dims 8n + 8
            ldmatrix_x4_trans(vb, &Vs[b][(lane % 8) + ((lane / 8) % 2) * 8][n * 8 + (lane / 16) * 8]);
            const u32 b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                o[n][e] *= e < 2 ? al : ah;
                o[n + 1][e] *= e < 2 ? al : ah;
            }
            mma_16816(o[n], pa_hi, b0);
            mma_16816(o[n], pa_lo, b0);
            mma_16816(o[n + 1], pa_hi, b1);
            mma_16816(o[n + 1], pa_lo, b1);
        }
        __syncthreads();  // every warp is done with buffer b before page p + 2 is loaded into it
    }
    cp_async_wait<0>();

    prefill_store_rows<D>(out, &o[0][0], rlo, rhi, c, t0, group, rows_used, T, nq, kvh, l_lo, l_hi);
}

extern "C" __global__ void __launch_bounds__(4 * WARP)
attention_prefill_tc_d64(const f16_bits* q, const f16_bits* k_pages, const f16_bits* v_pages, const int* page_table,
                         const int* positions, f16_bits* out, int nq, int nkv, int T, int qt, int max_pages, float scale) {
    attention_prefill_tc<64>(q, k_pages, v_pages, page_table, positions, out, nq, nkv, T, qt, max_pages, scale);
}
extern "C" __global__ void __launch_bounds__(4 * WARP)
attention_prefill_tc_d128(const f16_bits* q, const f16_bits* k_pages, const f16_bits* v_pages, const int* page_table,
                          const int* positions, f16_bits* out, int nq, int nkv, int T, int qt, int max_pages, float scale) {
    attention_prefill_tc<128>(q, k_pages, v_pages, page_table, positions, out, nq, nkv, T, qt, max_pages, scale);
}

// ---- prefill on wgmma (sm_90a): attention_prefill_wg_d<D> ------------------------------------------------
//
// attention_prefill_tc's tile (64 query rows of one KV head, the same row order, grid and reverse tile
// order) with both products issued by the whole warpgroup as wgmma, 64 keys (four pages) a step:
//   * S = Q K^T: wgmma m64n64k16, Q the A operand from registers (each warp's 16 rows in mma.sync's A
//     layout, as ldmatrix gives them), K the B operand from shared memory, K-major: a key's D halves;
//   * O += P V: wgmma m64n<D>k16, P the A operand from registers (S's D fragment is P's A fragment, register
//     for register, as in the tc kernel), V the B operand N-major (TRANS_B 1): a key's row of D halves is
//     N-contiguous, so V is staged exactly as K is, no transpose anywhere;
//   * a stage holds the step's K and V, [D / 64 atoms][64 keys][128 B] each in the 128-byte swizzle (key k's
//     16-byte chunk j of an atom at chunk j ^ (k % 8), atoms 1024-byte aligned): for K the atom's rows are
//     keys (SBO 1024 to the next 8 keys), for V the same rows are wgmma's k-rows (SBO 1024 to the next 8
//     keys, LBO one atom column, 64 keys x 128 B, to the next 64 dims);
//   * two stages by cp.async (16 B a thread a copy, zero-filled past the tile's keys and the page table):
//     cp.async writes through the generic proxy and wgmma reads through the async proxy, so each thread
//     fences the proxies after its copies land and before the block barrier that publishes the stage.
// The precision contract as in the tc kernel: exact fp16 products summed in fp32, the scale on the fp32
// score, the online softmax in fp32 (now over 64 keys a step), P = P_hi + P_lo, two fp16 numbers, two
// products. 128 threads (one warpgroup), 2 x 2 x 64 D halves of dynamic shared memory; Q is staged
// through the second stage before its first use.
#define WG_ATT_KEYS 64

template <int D>
__device__ __forceinline__ void attention_prefill_wg(const f16_bits* __restrict__ q, const f16_bits* __restrict__ k_pages,
                                                     const f16_bits* __restrict__ v_pages, const int* __restrict__ page_table,
                                                     const int* __restrict__ positions, f16_bits* __restrict__ out,
                                                     int nq, int nkv, int T, int qt, int max_pages, float scale) {
    constexpr int KS = D / 16;                      // k steps of S (over the head's dims)
    constexpr int CH = D / 8;                       // 16-byte chunks of a key's row
    constexpr int ATOM_COL = WG_ATT_KEYS * 128;     // bytes of one 64-dim atom column of a stage's K or V
    constexpr int TILE = (D / 64) * ATOM_COL;       // bytes of a stage's K (or V)
    extern __shared__ __align__(1024) unsigned char wg_smem[];  // the atoms' 1024-byte alignment (no static smem)
    auto k_tile = [&](int b) { return wg_smem + b * 2 * TILE; };
    auto v_tile = [&](int b) { return wg_smem + b * 2 * TILE + TILE; };
    // byte offset of (row, 16-byte chunk ch) in a [D / 64][64][128 B] swizzled tile (rows: keys, or Q's rows)
    auto swz = [](int row, int ch) { return (ch / 8) * ATOM_COL + row * 128 + (((ch % 8) ^ (row % 8)) << 4); };

    const int kvh = blockIdx.x, t0 = (gridDim.y - 1 - blockIdx.y) * qt, group = nq / nkv;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int rows_used = qt * group;

    // The tile's keys (prefill_tile_keys), computed by every warp (no shared word).
    const int n_keys = prefill_tile_keys(positions, t0, qt, T, lane);
    const int steps = (imin(n_keys, max_pages * PAGE) + WG_ATT_KEYS - 1) / WG_ATT_KEYS;

    // Q rows -> stage 1's K tile (zero for rows past the tile), read into registers before stage 1 is loaded.
    unsigned char* const qs = k_tile(1);
    for (int i = tid; i < TC_ROWS * CH; i += 4 * WARP) {
        const int r = i / CH, ch = i % CH, tok = t0 + r / group;
        const bool ok = r < rows_used && tok < T;
        const f16_bits* src = q + ((size_t)(ok ? tok : 0) * nq + kvh * group + (ok ? r % group : 0)) * D + ch * 8;
        cp_async16(qs + swz(r, ch), src, ok ? 16 : 0);
    }
    cp_async_commit();

    auto load_step = [&](int st, int b) {
        unsigned char* const ks = k_tile(b);
        unsigned char* const vs = v_tile(b);
        for (int i = tid; i < WG_ATT_KEYS * CH; i += 4 * WARP) {
            const int key = i / CH, ch = i % CH, j = st * WG_ATT_KEYS + key, pg = j / PAGE;
            const bool ok = j < n_keys && pg < max_pages;  // past the tile's keys or the table: zero-filled
            const size_t off = (((size_t)page_table[ok ? pg : 0] * nkv + kvh) * PAGE + (ok ? j % PAGE : 0)) * D + ch * 8;
            cp_async16(ks + swz(key, ch), k_pages + off, ok ? 16 : 0);
            cp_async16(vs + swz(key, ch), v_pages + off, ok ? 16 : 0);
        }
    };
    load_step(0, 0);
    cp_async_commit();

    const int rlo = warp * 16 + lane / 4, rhi = rlo + 8, c = lane % 4;
    const int plo = prefill_row_position(positions, t0, rlo, group, rows_used, T);
    const int phi = prefill_row_position(positions, t0, rhi, group, rows_used, T), pmin = imin(plo, phi);

    cp_async_wait<1>();  // Q has landed (step 0 may still fly); ldmatrix reads it through the generic proxy
    __syncthreads();
    u32 qa[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {  // lanes 0-15: rows 0-15 at dims 16 ks; lanes 16-31: the same at +8
        const int r = warp * 16 + (lane % 16), ch = 2 * ks + lane / 16;
        ldmatrix_x4(qa[ks], qs + swz(r, ch));
    }
    __syncthreads();  // every warp has its Q: stage 1 may be overwritten

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    float m_lo = neg_inf(), m_hi = neg_inf(), l_lo = 0.0f, l_hi = 0.0f;

    for (int st = 0; st < steps; ++st) {
        const int b = st & 1;
        if (st + 1 < steps) load_step(st + 1, b ^ 1);  // its stage was last read at st - 1 (barrier below)
        cp_async_commit();
        cp_async_wait<1>();  // this thread's copies of step st have landed ...
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // ... and are visible to wgmma's reads
        __syncthreads();     // ... and everyone's

        // S = Q K^T for the step's 64 keys: scale_d 0 on the first k step, so wgmma reads none of sc's
        // values (they need no zeroing) and writes a fresh accumulator.
        float sc[32];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
            wgmma_m64n64k16_rs<0>(sc, qa[ks], wgmma_desc_sw128(k_tile(b) + (ks / 4) * ATOM_COL + (ks % 4) * 32), ks);
        wgmma_commit();
        wgmma_wait_all();
        wgmma_touch(sc);

        // Mask (only where a key may pass a row's position), scale, row max. sc[4 j + e]: key 8 j + 2 c +
        // (e & 1) of the step, row lo for e < 2, row hi for e >= 2; a row's 64 scores are on its quad.
        const int k0 = st * WG_ATT_KEYS;
        const bool masked = k0 + WG_ATT_KEYS - 1 > pmin;
        float mxl = neg_inf(), mxh = neg_inf();
#pragma unroll
        for (int jb = 0; jb < 8; ++jb)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = k0 + jb * 8 + 2 * c + e;
                float& sl = sc[4 * jb + e];
                float& sh = sc[4 * jb + e + 2];
                sl = !masked || j <= plo ? sl * scale : neg_inf();
                sh = !masked || j <= phi ? sh * scale : neg_inf();
                mxl = fmaxf(mxl, sl);
                mxh = fmaxf(mxh, sh);
            }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            mxl = fmaxf(mxl, __shfl_xor_sync(FULL_MASK, mxl, o2));
            mxh = fmaxf(mxh, __shfl_xor_sync(FULL_MASK, mxh, o2));
        }
        // Key 0 is in step 0 and every row's position is >= 0, so m is finite from step 0 on; a later step
        // with all of a row's keys masked keeps its m (alpha 1, p 0).
        const float nl = fmaxf(m_lo, mxl), nh = fmaxf(m_hi, mxh);
        const float al = expf(m_lo - nl), ah = expf(m_hi - nh);  // 0 at step 0 (m = -inf)
        m_lo = nl;
        m_hi = nh;
        float sl_ = 0.0f, sh_ = 0.0f;
        u32 ph[4][4], pl[4][4];  // P as the A fragments of the P V products, k step kk = keys 16 kk .. + 15
#pragma unroll
        for (int jb = 0; jb < 8; ++jb) {
            const float p0 = expf(sc[4 * jb] - nl), p1 = expf(sc[4 * jb + 1] - nl);  // masked: exp(-inf) = 0
            const float p2 = expf(sc[4 * jb + 2] - nh), p3 = expf(sc[4 * jb + 3] - nh);
            sl_ += p0 + p1;
            sh_ += p2 + p3;
            u32 hl, hh, ll, lh;  // row lo's and row hi's pairs, each as two fp16 parts (mma.cuh prob_parts)
            prob_parts(p0, p1, hl, ll);
            prob_parts(p2, p3, hh, lh);
            // A fragment of k step jb / 2: a0 / a1 (row lo / hi) keys 2c, +1 of its first 8; a2 / a3 the next 8
            ph[jb / 2][2 * (jb % 2)] = hl;
            ph[jb / 2][2 * (jb % 2) + 1] = hh;
            pl[jb / 2][2 * (jb % 2)] = ll;
            pl[jb / 2][2 * (jb % 2) + 1] = lh;
        }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            sl_ += __shfl_xor_sync(FULL_MASK, sl_, o2);
            sh_ += __shfl_xor_sync(FULL_MASK, sh_, o2);
        }
        l_lo = l_lo * al + sl_;
        l_hi = l_hi * ah + sh_;
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] *= (i % 4) < 2 ? al : ah;

        // O += P_hi V + P_lo V, 16 keys (two k-row atoms, 2 KB) a k step.
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const unsigned long long dv = wgmma_desc_mn_sw128(v_tile(b) + kk * 2048, ATOM_COL);
            if constexpr (D == 128) {
                wgmma_m64n128k16_rs<1>(o, ph[kk], dv, 1);
                wgmma_m64n128k16_rs<1>(o, pl[kk], dv, 1);
            } else {
                wgmma_m64n64k16_rs<1>(o, ph[kk], dv, 1);
                wgmma_m64n64k16_rs<1>(o, pl[kk], dv, 1);
            }
        }
        wgmma_commit();
        wgmma_wait_all();
        wgmma_touch(o);
        __syncthreads();  // every warp's wgmma are done with stage b before step st + 2 is loaded into it
    }
    cp_async_wait<0>();

    prefill_store_rows<D>(out, o, rlo, rhi, c, t0, group, rows_used, T, nq, kvh, l_lo, l_hi);
}

extern "C" __global__ void __launch_bounds__(4 * WARP)
attention_prefill_wg_d64(const f16_bits* q, const f16_bits* k_pages, const f16_bits* v_pages, const int* page_table,
                         const int* positions, f16_bits* out, int nq, int nkv, int T, int qt, int max_pages, float scale) {
    attention_prefill_wg<64>(q, k_pages, v_pages, page_table, positions, out, nq, nkv, T, qt, max_pages, scale);
}
extern "C" __global__ void __launch_bounds__(4 * WARP)
attention_prefill_wg_d128(const f16_bits* q, const f16_bits* k_pages, const f16_bits* v_pages, const int* page_table,
                          const int* positions, f16_bits* out, int nq, int nkv, int T, int qt, int max_pages, float scale) {
    attention_prefill_wg<128>(q, k_pages, v_pages, page_table, positions, out, nq, nkv, T, qt, max_pages, scale);
}

// Merge the splits of one (token, head): out = sum_z acc_z e^(m_z - M) / sum_z l_z e^(m_z - M). A split
// with l = 0 held no keys and gets weight 0 (its m is -inf, its acc 0). Grid (nq, T), COMBINE_THREADS
// threads, splits <= COMBINE_MAX_SPLITS (the launcher checks). Latency, not bytes, is this kernel's
// cost, so every load is independent of the others: the weights e^(m_z - M) are computed once per
// split into shared memory (one load of m, l per split, spread over the block), then thread (column
// lane cw, split group zg) sums acc_z over z = zg, zg + COMBINE_ZG, ... for columns cw, cw + 32, ..., and
// the COMBINE_ZG partial sums are added in zg order. Every sum has a fixed order: deterministic.
#define COMBINE_THREADS 256
#define COMBINE_ZG (COMBINE_THREADS / WARP)
#define COMBINE_MAX_SPLITS 512
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
attention_combine_f16(const float* __restrict__ part_m, const float* __restrict__ part_l,
                      const float* __restrict__ part_acc, f16_bits* __restrict__ out, int nq, int d, int splits) {
    pdl_enter();  // common.cuh: the partials are the attention kernel's
    __shared__ float Wz[COMBINE_MAX_SPLITS];
    __shared__ float red[WARP];
    __shared__ float Ap[COMBINE_ZG][WARP * 4];
    const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x, cw = tid % WARP, zg = tid / WARP;
    const size_t p0 = ((size_t)t * nq + h) * splits;

    float mx = neg_inf();
    for (int z = tid; z < splits; z += COMBINE_THREADS) {
        const float l = part_l[p0 + z], m = part_m[p0 + z];
        mx = l > 0.0f ? fmaxf(mx, m) : mx;
    }
    // block max (order-free), through the same fixed tree as block_sum
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
    if (cw == 0) red[zg] = mx;
    __syncthreads();  // every warp's max is in red[]
    float M = neg_inf();
#pragma unroll
    for (int w = 0; w < COMBINE_ZG; ++w) M = fmaxf(M, red[w]);
    __syncthreads();  // red[] is read before block_sum reuses it
    float lsum = 0.0f;
    for (int z = tid; z < splits; z += COMBINE_THREADS) {
        const float l = part_l[p0 + z], m = part_m[p0 + z];
        const float w = l > 0.0f ? expf(m - M) : 0.0f;
        Wz[z] = w;
        lsum = fmaf(l, w, lsum);
    }
    const float L = block_sum(lsum, red);  // fixed tree; its barrier also publishes Wz[]

    for (int c0 = 0; c0 < d; c0 += WARP * 4) {  // columns c0 + cw + 32 k, k = 0..3
        float A[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (int z = zg; z < splits; z += COMBINE_ZG) {
            const float w = Wz[z];
            const float* a = part_acc + (p0 + z) * d + c0 + cw;
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (c0 + cw + WARP * k < d) A[k] = fmaf(a[WARP * k], w, A[k]);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) Ap[zg][cw + WARP * k] = A[k];
        __syncthreads();  // every split group's partial sums are in Ap
        if (tid < WARP * 4 && c0 + tid < d) {
            float s = 0.0f;
#pragma unroll
            for (int g = 0; g < COMBINE_ZG; ++g) s += Ap[g][tid];  // zg order
            out[((size_t)t * nq + h) * d + c0 + tid] = f2h(s / L);
        }
        __syncthreads();  // Ap is read before the next column block rewrites it
    }
}

// ---- decode on the tensor cores: paged_attention_tc_d<D> (attention_variant "tc") -------------------
//
// The warp kernel above gives every page ~D/2 * group fmaf of scores and D/32 * 16 * group of P.V per
// lane, one dependent chain after another: at a few pages per warp (decode at any context: the pages are
// spread over ~2 blocks an SM) that latency, not bytes, sets its time. Here both products of a page are
// mma.sync m16n8k16 (mma.cuh's layouts), the prefill tc kernel's arithmetic (FlashAttention-2's
// register reuse), with the query heads of the group as the mma's rows:
//   * S = Q K^T, A = q (row r = head r of the group; rows past the group and rows 8-15 zero: group <= 8),
//     B = K^T in two n-tiles, column n = slot n (tile 0) and slot 8 + n (tile 1). A dot product does not
//     care in which order its dims are summed, so the 16 k of an mma may be any 16 dims as long as A and B
//     take the same ones: lane c loads 16-byte runs (dims 32j + 8c .. + 8 of chunk j) of its q row and of
//     K rows r and 8 + r; words 0-1 of a run feed mma 2j, words 2-3 mma 2j + 1. Straight from global
//     memory into registers, 16 bytes a load, no shared staging.
//     C: lane (r, c) holds head r's scores of slots 2c, 2c + 1 (tile 0) and 8 + 2c, 9 + 2c (tile 1), so
//     head r's online softmax is the quad's: max and sum by two xor shuffles (lanes 4r .. 4r + 3).
//   * O += P V: S's C fragments are P's A fragment as they stand (k = slot), P split as P_hi + P_lo, two
//     fp16 numbers (P_lo the rounding error of P_hi): two mmas, exact products with fp16 V, fp32 sums, so
//     P keeps ~22 bits (the precision contract's fp32 probabilities); l sums the fp32 P.
//     B = V ("col": k = slot, column = dim) needs two slots of one dim per register: lane (r, c) loads
//     32-bit words (dims 16t + 2r, + 1) of V rows 2c, 2c + 1, 2c + 8, 2c + 9 and prmt pairs them, the
//     low halves for n-tile 2t (column r = dim 16t + 2r), the high halves for n-tile 2t + 1 (dim + 1).
//     O's C: lane (r, c) holds head r's dims 16t + 4c .. + 3 (tiles 2t, 2t + 1, columns 2c, 2c + 1).
//   * q and k, P_hi / P_lo and v are fp16: products exact, sums fp32 (the contract's fp32 scores,
//     probabilities and sums). 1/sqrt(d) multiplies the fp32 score (the warp kernel folds it into q: a
//     different rounding of the same fp32 arithmetic, far under the fp16 output's).
// Slots at or past the length: K and V rows never loaded (zero), scores -inf, probabilities 0. Grid,
// spans, the partials, attention_combine_f16 and the per-warp merge are the warp kernel's; the merge
// weights e^(m_w - M) are computed once per (warp, head). Measured on an H200 at the 7B layout (28 query
// heads, 4 KV heads of 128): 4.7 us a layer at 512 keys and 11.1 at 8192, the warp kernel's 10.1 and 22.6
// in the same runs (bench/NOTES.md, v5).
template <int D, int W = ATT_WARPS>  // W warps a block: ATT_WARPS, or CLUSTER_WARPS in the cluster kernel
__device__ __forceinline__ void attention_tc_pages(const f16_bits* __restrict__ q, const f16_bits* __restrict__ k_pages,
                                                   const f16_bits* __restrict__ v_pages, const int* __restrict__ page_table,
                                                   const int* __restrict__ positions, f16_bits* __restrict__ out,
                                                   float* __restrict__ part_m, float* __restrict__ part_l,
                                                   float* __restrict__ part_acc, int nq, int nkv, int pages_per_split,
                                                   int max_pages, float scale) {
    constexpr int G = ATT_MAX_GROUP;
    constexpr int CH = D / 32;   // 32-dim chunks of S's k: two mmas each
    constexpr int NP = D / 16;   // n-tile pairs of O (16 dims each)
    constexpr int RUNS = D / 8;  // 16-byte runs per row
    __shared__ float Mw[W][G], Lw[W][G], Ew[W][G], Mb[G], Lb[G];
    __shared__ __align__(16) float Aw[W][G * D];

    const int kvh = blockIdx.x, t = blockIdx.y, z = blockIdx.z, splits = gridDim.z;
    const int group = nq / nkv, tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int r = lane / 4, c = lane % 4;

    const SplitPages span = split_pages(positions, t, z, splits, pages_per_split, max_pages);
    const int n_keys = span.n_keys, first_page = span.first, last_page = span.last;

    u32 qa[CH][4];  // A of S: head r's run of each chunk (zero past the group)
    {
        // (read only for r below the group)
        const uint4* qp = reinterpret_cast<const uint4*>(q + ((size_t)t * nq + kvh * group + r) * D) + c;
#pragma unroll
        for (int j = 0; j < CH; ++j) uint4_words(r < group ? __ldg(qp + 4 * j) : make_uint4(0u, 0u, 0u, 0u), qa[j]);
    }
    float m = neg_inf(), l = 0.0f;  // head r's running max and sum (the quad's four lanes agree)
    float o[2 * NP][2];             // O of head r: n-tile n, columns 2c, 2c + 1
#pragma unroll
    for (int n = 0; n < 2 * NP; ++n) o[n][0] = o[n][1] = 0.0f;

    for (int p = first_page + warp; p < last_page; p += W) {
        const int valid = imin(PAGE, n_keys - p * PAGE);  // >= 1: p is below the last used page
        const size_t base = (((size_t)page_table[p] * nkv + kvh) * PAGE) * D;
        // Every load of the page first (one trip of memory latency a page): K rows r and 8 + r (this lane's
        // runs), V rows 2c, 2c + 1, 2c + 8, 2c + 9 (this lane's words). Rows past the length stay zero.
        const uint4* kp = reinterpret_cast<const uint4*>(k_pages + base) + c;
        uint4 k0[CH], k1[CH];
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            k0[j] = r < valid ? __ldg(kp + r * RUNS + 4 * j) : make_uint4(0u, 0u, 0u, 0u);
            k1[j] = 8 + r < valid ? __ldg(kp + (8 + r) * RUNS + 4 * j) : make_uint4(0u, 0u, 0u, 0u);
        }
        const u32* vp = reinterpret_cast<const u32*>(v_pages + base) + r;
        u32 vw[NP][4];
#pragma unroll
        for (int tp = 0; tp < NP; ++tp) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int slot = 2 * c + (i & 1) + 8 * (i >> 1);  // 2c, 2c + 1, 2c + 8, 2c + 9
                vw[tp][i] = slot < valid ? __ldg(vp + slot * (D / 2) + 8 * tp) : 0u;
            }
        }

        float s0[2] = {0.0f, 0.0f}, s1[2] = {0.0f, 0.0f};  // slots 2c, 2c + 1 and 8 + 2c, 9 + 2c
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            u32 w0[4], w1[4];
            uint4_words(k0[j], w0);
            uint4_words(k1[j], w1);
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // mma 2j + h: words 2h, 2h + 1 of the runs
                const u32 b0[2] = {w0[2 * h], w0[2 * h + 1]}, b1[2] = {w1[2 * h], w1[2 * h + 1]};
                mma_16816_rows8(s0, qa[j][2 * h], qa[j][2 * h + 1], b0);
                mma_16816_rows8(s1, qa[j][2 * h], qa[j][2 * h + 1], b1);
            }
        }
        float sc[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int slot = 2 * c + (e & 1) + 8 * (e >> 1);
            sc[e] = slot < valid ? (e < 2 ? s0[e] : s1[e - 2]) * scale : neg_inf();
        }
        float mx = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
        const float m_new = fmaxf(m, mx);  // finite: slot 0 is valid
        const float alpha = expf(m - m_new);  // 0 on the warp's first page (m = -inf)
        float pr[4], ps = 0.0f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            pr[e] = expf(sc[e] - m_new);  // masked: exp(-inf) = 0
            ps += pr[e];
        }
        ps += __shfl_xor_sync(FULL_MASK, ps, 1);
        ps += __shfl_xor_sync(FULL_MASK, ps, 2);
        l = l * alpha + ps;
        m = m_new;
        u32 ph[2], pl[2];  // a0 (slots 2c, 2c + 1) and a2 (slots 8 + 2c, 9 + 2c), hi and lo parts
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            prob_parts(pr[2 * h], pr[2 * h + 1], ph[h], pl[h]);  // low half = slot 2c (mma.cuh)
        }
#pragma unroll
        for (int tp = 0; tp < NP; ++tp) {
            u32 lo[2], hi[2];  // n-tile 2tp: dim 16tp + 2r (low halves); 2tp + 1: dim + 1 (high halves)
            asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(lo[0]) : "r"(vw[tp][0]), "r"(vw[tp][1]));
            asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(lo[1]) : "r"(vw[tp][2]), "r"(vw[tp][3]));
            asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(hi[0]) : "r"(vw[tp][0]), "r"(vw[tp][1]));
            asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(hi[1]) : "r"(vw[tp][2]), "r"(vw[tp][3]));
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                o[2 * tp][e] *= alpha;
                o[2 * tp + 1][e] *= alpha;
            }
            mma_16816_rows8(o[2 * tp], ph[0], ph[1], lo);
            mma_16816_rows8(o[2 * tp], pl[0], pl[1], lo);
            mma_16816_rows8(o[2 * tp + 1], ph[0], ph[1], hi);
            mma_16816_rows8(o[2 * tp + 1], pl[0], pl[1], hi);
        }
    }

    // Merge the warps in warp order. A warp that had no page holds m = -inf, l = 0 and weighs 0.
    if (r < group) {
        if (c == 0) { Mw[warp][r] = m; Lw[warp][r] = l; }
#pragma unroll
        for (int tp = 0; tp < NP; ++tp)
            *reinterpret_cast<float4*>(&Aw[warp][r * D + 16 * tp + 4 * c]) =
                make_float4(o[2 * tp][0], o[2 * tp + 1][0], o[2 * tp][1], o[2 * tp + 1][1]);
    }
    __syncthreads();  // every warp's state is in shared memory
    if (tid < group) {  // the merge weights, once per (warp, head)
        float M = neg_inf();
#pragma unroll
        for (int w = 0; w < W; ++w) M = Lw[w][tid] > 0.0f ? fmaxf(M, Mw[w][tid]) : M;
        float L = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) {
            const float e = Lw[w][tid] > 0.0f ? expf(Mw[w][tid] - M) : 0.0f;
            Ew[w][tid] = e;
            L = fmaf(Lw[w][tid], e, L);
        }
        Mb[tid] = M;  // a block with no page: M = -inf, L = 0 (and O = 0), weight 0 wherever it is merged
        Lb[tid] = L;
    }
    __syncthreads();  // the weights are in shared memory
    for (int item = tid; item < group * D; item += W * WARP) {
        const int g = item / D, col = item % D, h = kvh * group + g;
        float A = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) A = fmaf(Aw[w][item], Ew[w][g], A);
        if (splits == 1) {
            out[((size_t)t * nq + h) * D + col] = f2h(A / Lb[g]);
        } else {
            store_split(part_m, part_l, part_acc, t, nq, h, splits, z, D, col, A, Mb[g], Lb[g]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
paged_attention_tc_d64(const f16_bits* q, const f16_bits* k_pages, const f16_bits* v_pages, const int* page_table,
                       const int* positions, f16_bits* out, float* part_m, float* part_l, float* part_acc,
                       int nq, int nkv, int d, int pages_per_split, int max_pages, float scale) {
    pdl_enter();  // common.cuh: q, the pages and the positions are earlier kernels' writes
    attention_tc_pages<64>(q, k_pages, v_pages, page_table, positions, out, part_m, part_l, part_acc, nq, nkv,
                           pages_per_split, max_pages, scale);
}
extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
paged_attention_tc_d128(const f16_bits* q, const f16_bits* k_pages, const f16_bits* v_pages, const int* page_table,
                        const int* positions, f16_bits* out, float* part_m, float* part_l, float* part_acc,
                        int nq, int nkv, int d, int pages_per_split, int max_pages, float scale) {
    pdl_enter();  // common.cuh: q, the pages and the positions are earlier kernels' writes
    attention_tc_pages<128>(q, k_pages, v_pages, page_table, positions, out, part_m, part_l, part_acc, nq, nkv,
                            pages_per_split, max_pages, scale);
}

// ---- the splits merged inside a thread block cluster: paged_attention_tc_cluster_d<D> ----------------
// (attention_variant "tc_cluster")
//
// Hopper groups the CLUSTER_SPLITS blocks of a (KV head, token) into one cluster (`__cluster_dims__`: the
// grid's z, the splits, is exactly one cluster), scheduled together on one GPC. Each block runs
// attention_tc_pages as above with CLUSTER_WARPS warps (8: the cluster's 8 splits then hold 64 pages in one
// round of a page a warp, as "tc"'s up to 66 splits of 4 warps do) and stores its split's partial; then one
// cluster barrier (arrive with release, wait with acquire semantics at cluster scope: every block's partial
// stores happen before any block's loads after it) replaces the combine kernel's launch, and the merge is
// spread over the whole cluster: block r merges items r * THREADS + tid (an item is one column of one query
// head), each thread's 3 x CLUSTER_SPLITS loads (m, l and the column of every split, through L2: other SMs
// wrote them) in flight at once. One fixed order, whichever block finishes first: the max M over the splits
// holding keys (l > 0), weights w_z = e^(m_z - M) (0 for an empty split), L = sum l_z w_z and the column's
// sum acc_z w_z in z order, then acc / L.
//
// Why: at a short context the combine's work is small (512 keys, 7B: 11 splits of 128 floats a head) and
// its cost is its launch, the wait for the whole attention grid to end and its own ramp. The cluster took
// 0.05 ms off a 2.03 ms decode step (bench/NOTES.md v5, sixteenth step). A version whose last block to
// finish merged the splits (a fence and an acquire-release count a KV head) measured 0.03 ms slower than
// the combine, and was taken out.
//
// The launcher runs it where no warp is given more than two pages (a page table of at most
// CLUSTER_SPLITS x CLUSTER_WARPS x 2 pages, the dynamic spread giving each split ceil(used / CLUSTER_SPLITS)),
// else "tc" and the combine.
#define CLUSTER_SPLITS 8
#define CLUSTER_WARPS 8
template <int D>
__device__ __forceinline__ void merge_in_the_cluster(const float* part_m, const float* part_l, const float* part_acc,
                                                     f16_bits* __restrict__ out, int nq, int nkv) {
    constexpr int THREADS = CLUSTER_WARPS * WARP;
    const int kvh = blockIdx.x, t = blockIdx.y, rank = blockIdx.z, group = nq / nkv;
    // every thread of every block of the cluster: its partial stores released, the others' acquired
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    for (int item = rank * THREADS + threadIdx.x; item < group * D; item += CLUSTER_SPLITS * THREADS) {
        const int g = item / D, col = item % D;
        const size_t pi = ((size_t)t * nq + (size_t)kvh * group + g) * CLUSTER_SPLITS;  // split z at pi + z
        float m[CLUSTER_SPLITS], l[CLUSTER_SPLITS], a[CLUSTER_SPLITS];
#pragma unroll
        for (int z = 0; z < CLUSTER_SPLITS; ++z) {
            m[z] = __ldcg(part_m + pi + z);
            l[z] = __ldcg(part_l + pi + z);
            a[z] = __ldcg(part_acc + (pi + z) * D + col);
        }
        float M = neg_inf();
#pragma unroll
        for (int z = 0; z < CLUSTER_SPLITS; ++z) M = l[z] > 0.0f ? fmaxf(M, m[z]) : M;
        float L = 0.0f, A = 0.0f;
#pragma unroll
        for (int z = 0; z < CLUSTER_SPLITS; ++z) {
            const float w = l[z] > 0.0f ? expf(m[z] - M) : 0.0f;
            L = fmaf(l[z], w, L);
            A = fmaf(a[z], w, A);
        }
        out[((size_t)t * nq + (size_t)kvh * group + g) * D + col] = f2h(A / L);
    }
}

extern "C" __global__ void __launch_bounds__(CLUSTER_WARPS * WARP) __cluster_dims__(1, 1, CLUSTER_SPLITS)
paged_attention_tc_cluster_d64(const f16_bits* q, const f16_bits* k_pages, const f16_bits* v_pages,
                               const int* page_table, const int* positions, f16_bits* out, float* part_m,
                               float* part_l, float* part_acc, int nq, int nkv, int d, int pages_per_split,
                               int max_pages, float scale) {
    pdl_enter();  // common.cuh: q, the pages and the positions are earlier kernels' writes
    attention_tc_pages<64, CLUSTER_WARPS>(q, k_pages, v_pages, page_table, positions, out, part_m, part_l, part_acc,
                                          nq, nkv, pages_per_split, max_pages, scale);
    merge_in_the_cluster<64>(part_m, part_l, part_acc, out, nq, nkv);
}
extern "C" __global__ void __launch_bounds__(CLUSTER_WARPS * WARP) __cluster_dims__(1, 1, CLUSTER_SPLITS)
paged_attention_tc_cluster_d128(const f16_bits* q, const f16_bits* k_pages, const f16_bits* v_pages,
                                const int* page_table, const int* positions, f16_bits* out, float* part_m,
                                float* part_l, float* part_acc, int nq, int nkv, int d, int pages_per_split,
                                int max_pages, float scale) {
    pdl_enter();  // common.cuh: q, the pages and the positions are earlier kernels' writes
    attention_tc_pages<128, CLUSTER_WARPS>(q, k_pages, v_pages, page_table, positions, out, part_m, part_l, part_acc,
                                           nq, nkv, pages_per_split, max_pages, scale);
    merge_in_the_cluster<128>(part_m, part_l, part_acc, out, nq, nkv);
}
