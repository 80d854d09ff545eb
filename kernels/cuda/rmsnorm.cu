// rmsnorm.cu: out16[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * weight, x fp32 (the residual
// stream), weight fp16, out fp16. Mirrors NumpyBackend.rmsnorm: fp32 throughout, x * inv first, then
// * weight, one fp16 rounding at the store.
//
// One block per token row; the block's threads stride over the row, so any H works. The sum of
// squares goes through block_sum's fixed shuffle tree (deterministic, no atomics).
#include "common.cuh"

extern "C" __global__ void rmsnorm_f32_f16(const float* __restrict__ x, const f16_bits* __restrict__ weight,
                                           f16_bits* __restrict__ out, int H, long long x_row_stride, float eps) {
    __shared__ float scratch[WARP];
    pdl_enter();  // common.cuh: x is the previous kernel's residual
    const int t = blockIdx.x;
    const float* xr = x + (size_t)t * x_row_stride;  // x may be a row slice of a wider residual buffer
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x)
        out[(size_t)t * H + i] = f2h(xr[i] * inv * h2f(weight[i]));
}
