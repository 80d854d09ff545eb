// embed_lmhead_argmax.cu: the ends of the model. Token embedding (fp16 table -> fp32 residual), the
// fp16 lm_head GEMV (fp32 logits), and the on-device argmax (lowest index wins a tie).
// Mirrors NumpyBackend.embed / lm_head / argmax.
#include "common.cuh"

// out[t, :] = float(table[ids[t], :]). An id outside [0, V) writes NaN rather than reading out of
// bounds: the engine checks ids on the host, so this only fires on a bug, and it fails loudly.
extern "C" __global__ void embed_f16_f32(const int* __restrict__ ids, const f16_bits* __restrict__ table,
                                         float* __restrict__ out, int V, int H) {
    pdl_enter();  // common.cuh: ids may be the previous step's token
    const int t = blockIdx.x;
    const int id = ids[t];
    const bool ok = id >= 0 && id < V;
    for (int i = threadIdx.x; i < H; i += blockDim.x)
        out[(size_t)t * H + i] = ok ? h2f(table[(size_t)id * H + i]) : quiet_nan();
}

#define LM_WARPS 4
#define LM_ROWS 4  // vocab rows per warp: each 16-byte chunk of x is loaded once for four rows

// out[t, v] = sum_h x[t, h] * w[v, h] in fp32. x fp16 [T, H], w fp16 [V, H], H % 8 == 0.
// A lane takes 16-byte chunks (8 fp16) of the row; the warp reads 512 consecutive bytes per step.
extern "C" __global__ void lm_head_f16_f32(const f16_bits* __restrict__ x, const f16_bits* __restrict__ w,
                                           float* __restrict__ out, int V, int H) {
    pdl_enter();  // common.cuh: before the early return below, so every block waits
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, t = blockIdx.y;
    const int row0 = (blockIdx.x * LM_WARPS + warp) * LM_ROWS;
    if (row0 >= V) return;  // whole warp: shuffles stay full-mask
    const int chunks = H / 8;
    const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)t * H);
    float acc[LM_ROWS];
    int row[LM_ROWS];
#pragma unroll
    for (int a = 0; a < LM_ROWS; ++a) {
        acc[a] = 0.0f;
        row[a] = imin(row0 + a, V - 1);  // clamped rows load in bounds and are not stored
    }
    for (int c = lane; c < chunks; c += WARP) {
        u32 xw[4];
        uint4_words(__ldg(xv + c), xw);
#pragma unroll
        for (int a = 0; a < LM_ROWS; ++a) {
            u32 ww[4];
            uint4_words(__ldg(reinterpret_cast<const uint4*>(w + (size_t)row[a] * H) + c), ww);
            acc[a] = dot_f16x8(ww, xw, acc[a]);
        }
    }
#pragma unroll
    for (int a = 0; a < LM_ROWS; ++a) acc[a] = warp_sum(acc[a]);
    if (lane == 0) {
#pragma unroll
        for (int a = 0; a < LM_ROWS; ++a)
            if (row0 + a < V) out[(size_t)t * V + row0 + a] = acc[a];
    }
}

// (v, i) beats (bv, bi)? NaN beats every number (NumPy's argmax returns the first NaN); among
// equal values (or two NaNs) the lower index wins. This total order makes the result independent of
// which thread saw which element first.
__device__ __forceinline__ bool argmax_better(float v, int i, float bv, int bi) {
    const bool vn = v != v, bn = bv != bv;
    if (vn != bn) return vn;
    if (vn || v == bv) return i < bi;
    return v > bv;
}

// Both argmax kernels' block (the launcher reads it from here). block_argmax is written for any block of
// up to WARP warps (a lane past the block's warps takes an empty candidate), but only this one is launched.
#define ARGMAX_THREADS 1024

// The winner of one block's candidates (value, index) -> lane 0 of warp 0. Every thread must call it.
__device__ __forceinline__ void block_argmax(float& bv, int& bi) {
    __shared__ float sv[WARP];
    __shared__ int si[WARP];
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (argmax_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();  // every warp's winner is in shared memory before warp 0 reads them
    if (warp == 0) {
        const int nwarps = blockDim.x / WARP;
        bv = lane < nwarps ? sv[lane] : neg_inf();
        bi = lane < nwarps ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = WARP / 2; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (argmax_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
    }
}

// out[0] = the lowest index of the maximum of logits[0 .. V), in two launches: argmax_partial_f32
// (many blocks, each the winner of a strided slice, as (value, index) pairs) then argmax_f32_i32 over
// those pairs (one block). The total order of argmax_better makes the result independent of the split.
extern "C" __global__ void argmax_partial_f32(const float* __restrict__ logits, float* __restrict__ part_v,
                                              int* __restrict__ part_i, int V) {
    pdl_enter();  // common.cuh
    float bv = neg_inf();
    int bi = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < V; i += gridDim.x * blockDim.x) {
        const float v = logits[i];
        if (argmax_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_argmax(bv, bi);
    if (threadIdx.x == 0) { part_v[blockIdx.x] = bv; part_i[blockIdx.x] = bi; }
}

// One block over n (value, index) candidates (part_i == nullptr: the candidates are logits[0 .. n)).
extern "C" __global__ void argmax_f32_i32(const float* __restrict__ part_v, const int* __restrict__ part_i,
                                          int* __restrict__ out, int n) {
    pdl_enter();  // common.cuh
    float bv = neg_inf();
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = part_v[i];
        const int idx = part_i ? part_i[i] : i;
        if (argmax_better(v, idx, bv, bi)) { bv = v; bi = idx; }
    }
    block_argmax(bv, bi);
    if (threadIdx.x == 0) out[0] = bi;
}

// The fast decode loop's step between two graph replays (engine/cuda_graph.py): the token just picked
// becomes the next input and the position moves on by one, all on the device, so the host never has
// to read a token before it launches the next step.
extern "C" __global__ void decode_advance_i32(const int* __restrict__ next, int* __restrict__ ids,
                                              int* __restrict__ positions) {
    pdl_enter();  // common.cuh
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        ids[0] = next[0];
        positions[0] += 1;
    }
}
