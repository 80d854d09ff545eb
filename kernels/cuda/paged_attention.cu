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
// attention_combine merges the splits in a fixed order (deterministic; no atomics). The split count
// (the grid) is fixed when the launch is recorded, so a captured graph stays valid as the sequence
// grows; splits past the length write an empty partial (l = 0). With pages_per_split <= 0 the span is
// computed on the device from the current length, ceil(used pages / splits), so the work spreads over
// every block at any context (decode attention that scales with context); a positive value fixes it.
//
// Shared memory (dynamic, floats): K page [16][d+1] (the +1 pad puts the 16 slots of one column in
// 16 different banks for the score loop), V page [16][d], q [group][d], p [group][16], m/l/alpha [group].
#include "common.cuh"

#define PAGE 16
#define ATT_THREADS 128
#define ATT_MAX_ITEMS 16  // group * d <= ATT_THREADS * ATT_MAX_ITEMS (checked by the launcher)

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
paged_attention_f16(const f16_bits* __restrict__ q, const f16_bits* __restrict__ k_pages,
                    const f16_bits* __restrict__ v_pages, const int* __restrict__ page_table,
                    const int* __restrict__ positions, f16_bits* __restrict__ out,
                    float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
                    int nq, int nkv, int d, int pages_per_split, int max_pages, float scale) {
    extern __shared__ float smem[];
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

    const int n_keys = positions[t] + 1;
    if (pages_per_split <= 0) {  // dynamic: spread the used pages evenly over the splits
        const int used = imin((n_keys + PAGE - 1) / PAGE, max_pages);
        pages_per_split = imax(1, (used + splits - 1) / splits);
    }
    const int first_page = z * pages_per_split;
    // exclusive; never past the page table, even if a position were (wrongly) beyond it
    const int last_page = imin(imin((z + 1) * pages_per_split, (n_keys + PAGE - 1) / PAGE), max_pages);

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
                const size_t pi = ((size_t)t * nq + h) * splits + z;
                part_acc[pi * d + c] = acc[k];
                if (c == 0) { part_m[pi] = Ms[g]; part_l[pi] = Ls[g]; }
            }
        }
    }
}

// Merge the splits of one (token, head): out = sum_z acc_z e^(m_z - M) / sum_z l_z e^(m_z - M), z in
// order. A split with l = 0 held no keys and gets weight 0 (its m is -inf, its acc 0). Grid (nq, T), d
// threads (or fewer, striding). The loops load without branching and are unrolled, so the loads of
// several splits are in flight at once (the loop is latency-bound otherwise: one L2 trip per split).
extern "C" __global__ void attention_combine_f16(const float* __restrict__ part_m, const float* __restrict__ part_l,
                                                 const float* __restrict__ part_acc, f16_bits* __restrict__ out,
                                                 int nq, int d, int splits) {
    const int h = blockIdx.x, t = blockIdx.y;
    const size_t p0 = ((size_t)t * nq + h) * splits;
    float M = neg_inf();
#pragma unroll 8
    for (int z = 0; z < splits; ++z) {
        const float l = part_l[p0 + z], m = part_m[p0 + z];
        M = l > 0.0f ? fmaxf(M, m) : M;
    }
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float L = 0.0f, A = 0.0f;
#pragma unroll 8
        for (int z = 0; z < splits; ++z) {
            const float l = part_l[p0 + z], m = part_m[p0 + z], a = part_acc[(p0 + z) * d + c];
            const float w = l > 0.0f ? expf(m - M) : 0.0f;
            L = fmaf(l, w, L);
            A = fmaf(a, w, A);
        }
        out[((size_t)t * nq + h) * d + c] = f2h(A / L);
    }
}
