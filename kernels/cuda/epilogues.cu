// epilogues.cu: the prefill path's epilogues, shared by every quantized format. With T > 1 a format's
// launcher (kernels/cuda/<format>.py, `matmul_f32`) leaves y = x W^T in an fp32 [T, out] buffer and one
// of these applies the op's epilogue, exactly as the GEMV kernels do it in registers at T = 1:
// one fp32 add (or silu * up) per element, one rounding at an fp16 store.
//
// Grid-stride loops over the T x rows outputs (any grid covers any size, each element has one writer):
// epi_bias_f16 and epi_silu_mul_f16 take tokens on the grid's y and rows on its x, so no element pays a
// division (a flat loop's 64-bit i / rows and i % rows cost more than silu's math: the 7B gate_up
// epilogue at 512 tokens took 54 us a layer for 97 MB, 1.8 TB/s; 23 us now), and where rows % 4 == 0
// and the arrays start 16-byte (y) and 8-byte (bias, out) aligned, a thread takes 4 consecutive rows in
// 16-byte loads and one 8-byte store (every row then starts as aligned as its array). The launcher sizes
// x for the 4-row steps; the other path loops.
#include "common.cuh"

__device__ __forceinline__ bool aligned(const void* p, unsigned bytes) {
    return reinterpret_cast<unsigned long long>(p) % bytes == 0;
}

// four fp16 bit patterns in one 8-byte word, the first in the low bits (memory order)
__device__ __forceinline__ uint2 f16x4(float a, float b, float c, float d) {
    return make_uint2((unsigned)f2h(a) | ((unsigned)f2h(b) << 16), (unsigned)f2h(c) | ((unsigned)f2h(d) << 16));
}

// out16[t, r] = y[t, r] + bias[r]  (y fp32 [T, rows])
extern "C" __global__ void epi_bias_f16(const float* y, const f16_bits* bias, f16_bits* out, int T, int rows) {
    const int first = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        const float* yt = y + (size_t)t * rows;
        f16_bits* ot = out + (size_t)t * rows;
        if (rows % 4 == 0 && aligned(y, 16) && aligned(bias, 8) && aligned(out, 8)) {
            for (int r = 4 * first; r < rows; r += 4 * step) {
                const float4 v = *reinterpret_cast<const float4*>(yt + r);
                const uint2 b = *reinterpret_cast<const uint2*>(bias + r);
                *reinterpret_cast<uint2*>(ot + r) = f16x4(v.x + h2f(b.x & 0xFFFFu), v.y + h2f(b.x >> 16),
                                                          v.z + h2f(b.y & 0xFFFFu), v.w + h2f(b.y >> 16));
            }
        } else {
            for (int r = first; r < rows; r += step) ot[r] = f2h(yt[r] + h2f(bias[r]));
        }
    }
}

// resid[i] += y[i]
extern "C" __global__ void epi_residual_f32(const float* y, float* resid, int T, int rows) {
    const size_t n = (size_t)T * rows;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        resid[i] += y[i];
}

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// out16[t, r] = silu(y[t, r]) * y[t, rows + r]  (y fp32 [T, 2 rows], rows [gate; up])
extern "C" __global__ void epi_silu_mul_f16(const float* y, f16_bits* out, int T, int rows) {
    const int first = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        const float* gt = y + (size_t)t * 2 * rows;
        const float* ut = gt + rows;
        f16_bits* ot = out + (size_t)t * rows;
        if (rows % 4 == 0 && aligned(y, 16) && aligned(out, 8)) {
            for (int r = 4 * first; r < rows; r += 4 * step) {
                const float4 g = *reinterpret_cast<const float4*>(gt + r), u = *reinterpret_cast<const float4*>(ut + r);
                *reinterpret_cast<uint2*>(ot + r) = f16x4(silu_mul(g.x, u.x), silu_mul(g.y, u.y),
                                                          silu_mul(g.z, u.z), silu_mul(g.w, u.w));
            }
        } else {
            for (int r = first; r < rows; r += step) ot[r] = f2h(silu_mul(gt[r], ut[r]));
        }
    }
}
