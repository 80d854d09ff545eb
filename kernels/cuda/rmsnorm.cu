// rmsnorm.cu: out16[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * weight, x fp32 (the residual
// stream), weight fp16, out fp16. Mirrors NumpyBackend.rmsnorm: fp32 throughout, x * inv first, then
// * weight, one fp16 rounding at the store.
//
// One block per token row; thread i owns the elements i, i + blockDim.x, ... of the row, so any H works.
// It sums their squares in that order (one fmaf each), then block_sum's fixed shuffle tree adds the
// threads' sums (deterministic, no atomics).
//
// Rows up to RMS_HELD * blockDim.x long (the 7B's 3584 at 256 threads: 14 a thread) are held in
// registers (unless the launcher passes held = 0, CudaBackend.rmsnorm_held off): every load of the row
// is issued at once (one trip of memory latency, not one per element), the weight's before pdl_wait (no
// kernel of the step writes it), and the second pass reads the registers. Measured on an H200 at 512
// tokens of the 7B (bench/NOTES.md, v5): 19.7 us a call with the loop that loads one element an
// iteration, 13.1 held. Longer rows take that loop. Both give the same bits: the same fmaf sequence per
// thread (a held slot past H is 0, and fmaf(0, 0, s) == s for s >= +0).
#include "common.cuh"

#define RMS_HELD 16          // elements a thread holds in registers
#define RMS_THREADS 256      // a block per token row (the launcher's block for T > 1) ...
#define RMS_THREADS_ONE 1024 // ... and the most for the one row of a decode step (T = 1): the launch bounds;
                             // the backend's rmsnorm_threads_one picks the block (this, by default)

// The two kernels' shared steps. Held rows: a thread's RMS_HELD slots of the row (slot j is element
// threadIdx.x + j * blockDim.x; a slot past H holds 0, and fmaf(0, 0, s) == s for s >= +0) and of the weight.
__device__ __forceinline__ void load_held_weight(f16_bits (&w)[RMS_HELD], const f16_bits* __restrict__ weight, int H) {
#pragma unroll
    for (int j = 0; j < RMS_HELD; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        w[j] = i < H ? weight[i] : (f16_bits)0;
    }
}

// o = v / sqrt(mean(v^2) + eps) * w, after this thread's sum of squares `ss` in slot order (one fmaf
// each): block_sum's tree, then x * inv first, * weight, one fp16 rounding at the store.
__device__ __forceinline__ void store_held_norm(const float (&v)[RMS_HELD], const f16_bits (&w)[RMS_HELD],
                                                f16_bits* __restrict__ o, int H, float ss, float eps, float* scratch) {
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
#pragma unroll
    for (int j = 0; j < RMS_HELD; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < H) o[i] = f2h(v[j] * inv * h2f(w[j]));
    }
}

// The loop for any H, after this thread's sum of squares `ss` over elements i, i + blockDim.x, ...:
// o = xr * inv * weight.
__device__ __forceinline__ void store_loop_norm(const float* __restrict__ xr, const f16_bits* __restrict__ weight,
                                                f16_bits* __restrict__ o, int H, float ss, float eps, float* scratch) {
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = f2h(xr[i] * inv * h2f(weight[i]));
}

// __launch_bounds__: the decode step's block is 1024 threads, so a thread gets 64 registers at most.
// held: 0 takes the loop at any H (the backend's `rmsnorm_held` off, so that the bench can time both).
extern "C" __global__ void __launch_bounds__(RMS_THREADS_ONE)
rmsnorm_f32_f16(const float* __restrict__ x, const f16_bits* __restrict__ weight, f16_bits* __restrict__ out, int H,
                long long x_row_stride, float eps, int held) {
    __shared__ float scratch[WARP];
    const int t = blockIdx.x, n = blockDim.x;
    const float* xr = x + (size_t)t * x_row_stride;  // x may be a row slice of a wider residual buffer
    f16_bits* o = out + (size_t)t * H;
    if (held && H <= RMS_HELD * n) {
        f16_bits w[RMS_HELD];
        load_held_weight(w, weight, H);
        pdl_enter();  // common.cuh: x is the previous kernel's residual
        float v[RMS_HELD];
#pragma unroll
        for (int j = 0; j < RMS_HELD; ++j) {
            const int i = threadIdx.x + j * n;
            v[j] = i < H ? xr[i] : 0.0f;
        }
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < RMS_HELD; ++j) ss = fmaf(v[j], v[j], ss);
        store_held_norm(v, w, o, H, ss, eps, scratch);
        return;
    }
    pdl_enter();
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += n) ss = fmaf(xr[i], xr[i], ss);
    store_loop_norm(xr, weight, o, H, ss, eps, scratch);
}

// The fused ops o_proj_residual_rmsnorm and down_residual_rmsnorm on the prefill path (CudaBackend,
// `rmsnorm_fold`): resid[t, :] += y[t, :] (y the GEMM's fp32 x W^T), then out16[t, :] = the rmsnorm of the
// new row, one block (RMS_THREADS) per token row. In place of epi_residual_f32 and rmsnorm_f32_f16: one
// launch and one read of the residual fewer per call, and the same bits, since the new row is the same
// fp32 sum and thread i sums the same elements in the same order as rmsnorm_f32_f16 at RMS_THREADS. Rows
// up to RMS_HELD x the block are held in registers (every load issued at once), longer ones loop.
extern "C" __global__ void __launch_bounds__(RMS_THREADS)
residual_add_rmsnorm_f32_f16(const float* __restrict__ y, float* __restrict__ resid,
                             const f16_bits* __restrict__ weight, f16_bits* __restrict__ out, int H, float eps) {
    __shared__ float scratch[WARP];
    const int n = blockDim.x;
    const size_t row = (size_t)blockIdx.x * H;
    const float* yr = y + row;
    float* xr = resid + row;
    f16_bits* o = out + row;
    if (H <= RMS_HELD * n) {
        f16_bits w[RMS_HELD];
        load_held_weight(w, weight, H);
        pdl_enter();  // common.cuh: y and the residual are earlier kernels' outputs
        float v[RMS_HELD];
#pragma unroll
        for (int j = 0; j < RMS_HELD; ++j) {
            const int i = threadIdx.x + j * n;
            v[j] = i < H ? xr[i] + yr[i] : 0.0f;
        }
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < RMS_HELD; ++j) {
            const int i = threadIdx.x + j * n;
            if (i < H) xr[i] = v[j];
            ss = fmaf(v[j], v[j], ss);
        }
        store_held_norm(v, w, o, H, ss, eps, scratch);
        return;
    }
    pdl_enter();
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += n) {
        const float v = xr[i] + yr[i];
        xr[i] = v;  // read back below by the thread that wrote it: no barrier needed
        ss = fmaf(v, v, ss);
    }
    store_loop_norm(xr, weight, o, H, ss, eps, scratch);
}
