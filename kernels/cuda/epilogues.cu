// epilogues.cu: the prefill path's epilogues, shared by every quantized format. With T > 1 a format's
// launcher (kernels/cuda/<format>.py, `matmul_f32`) leaves y = x W^T in an fp32 [T, out] buffer and one
// of these applies the op's epilogue, exactly as the GEMV kernels do it in registers at T = 1:
// one fp32 add (or silu * up) per element, one rounding at an fp16 store.
//
// Grid-stride loops over the T x rows outputs: any grid covers any size, each element has one writer.
#include "common.cuh"

// out16[t, r] = y[t, r] + bias[r]  (y fp32 [T, rows])
extern "C" __global__ void epi_bias_f16(const float* y, const f16_bits* bias, f16_bits* out, int T, int rows) {
    const size_t n = (size_t)T * rows;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = f2h(y[i] + h2f(bias[i % rows]));
}

// resid[i] += y[i]
extern "C" __global__ void epi_residual_f32(const float* y, float* resid, int T, int rows) {
    const size_t n = (size_t)T * rows;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        resid[i] += y[i];
}

// out16[t, r] = silu(y[t, r]) * y[t, rows + r]  (y fp32 [T, 2 rows], rows [gate; up])
extern "C" __global__ void epi_silu_mul_f16(const float* y, f16_bits* out, int T, int rows) {
    const size_t n = (size_t)T * rows;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / rows, r = i % rows;
        const float g = y[t * 2 * rows + r], u = y[t * 2 * rows + rows + r];
        out[i] = f2h(g / (1.0f + expf(-g)) * u);
    }
}
