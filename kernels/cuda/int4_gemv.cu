// int4_gemv.cu: the INT4 `int4_sym_g128` linear layers of the decode step (T = 1, or a few rows of x
// through blockIdx.y), with their epilogues fused: q/k/v + bias, gate/up + SiLU * up, o and down + the
// fp32 residual add. Also the dequantize kernel and the epilogues of the prefill path (T > 1), where the
// launcher dequantizes to fp32 and multiplies with cuBLAS.
//
// Mirrors kernels/numpy/int4.py (unpack, fp32 accumulation) and the ops of kernels/numpy/__init__.py.
//
// Work split: one warp per ROWS output rows (gate/up: ROWS gate rows and the same ROWS up rows). A row
// of qweight is in/8 words; a lane takes one 16-byte chunk (4 words = 32 inputs) at a time, the warp's
// 32 lanes reading 512 consecutive bytes of a row (coalesced). The matching 32 fp16 activations (64
// bytes, 4 x 16-byte loads) are loaded once per chunk and reused for every row the warp owns. A chunk
// never straddles a scale group (128 inputs = 4 chunks), so the fp16 scale multiplies the chunk's fp32
// partial sum once. Lanes reduce with a fixed xor-shuffle tree: no atomics, deterministic results.
#include "common.cuh"

#define GEMV_WARPS 4  // warps per block; rows per block = GEMV_WARPS * ROWS
#define GEMV_ROWS 4   // output rows per warp (x chunk reuse)

enum { EPI_BIAS_F16 = 0, EPI_RESIDUAL_F32 = 1, EPI_SILU_MUL_F16 = 2 };

// x: fp16 [T, in]; qweight: uint32 [out_total, in/8]; scales: fp16 [out_total, in/128].
// EPI_BIAS_F16:     out16[t, r] = acc(r) + bias[r]                         (out_total = rows)
// EPI_RESIDUAL_F32: resid[t, r] += acc(r)                                  (out_total = rows)
// EPI_SILU_MUL_F16: out16[t, r] = silu(acc(r)) * acc(rows + r)             (out_total = 2 rows)
template <int EPI>
__device__ __forceinline__ void int4_gemv(const f16_bits* __restrict__ x, const u32* __restrict__ qweight,
                                          const f16_bits* __restrict__ scales, const f16_bits* __restrict__ bias,
                                          f16_bits* __restrict__ out16, float* __restrict__ resid, int rows, int in_f) {
    constexpr int NACC = EPI == EPI_SILU_MUL_F16 ? 2 * GEMV_ROWS : GEMV_ROWS;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    const int t = blockIdx.y;
    if (row0 >= rows) return;  // a whole warp leaves together: the shuffles below stay full-mask

    const int words_per_row = in_f / 8, groups = in_f / 128, chunks = in_f / 32;
    const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)t * in_f);  // 16 B = 8 fp16

    int row[NACC];
    bool ok[NACC];
#pragma unroll
    for (int a = 0; a < NACC; ++a) {
        int r = row0 + (a % GEMV_ROWS);
        ok[a] = r < rows;
        r = ok[a] ? r : rows - 1;  // a clamped row is loaded (in bounds) but never stored
        row[a] = EPI == EPI_SILU_MUL_F16 && a >= GEMV_ROWS ? r + rows : r;
    }

    float acc[NACC];
#pragma unroll
    for (int a = 0; a < NACC; ++a) acc[a] = 0.0f;

    for (int c = lane; c < chunks; c += WARP) {
        // 32 activations: 4 x 16-byte loads; x[c*32 + 8j .. 8j+7] pairs up with weight word j.
        u32 xw[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) uint4_words(__ldg(xv + c * 4 + j), xw[j]);
#pragma unroll
        for (int a = 0; a < NACC; ++a) {
            const uint4 w = __ldg(reinterpret_cast<const uint4*>(qweight + (size_t)row[a] * words_per_row) + c);
            float p = 0.0f;
            p = dot_int4_word(w.x, xw[0], p);
            p = dot_int4_word(w.y, xw[1], p);
            p = dot_int4_word(w.z, xw[2], p);
            p = dot_int4_word(w.w, xw[3], p);
            acc[a] = fmaf(p, h2f(scales[(size_t)row[a] * groups + c / 4]), acc[a]);
        }
    }
#pragma unroll
    for (int a = 0; a < NACC; ++a) acc[a] = warp_sum(acc[a]);

    if (lane != 0) return;
#pragma unroll
    for (int a = 0; a < GEMV_ROWS; ++a) {
        if (!ok[a]) continue;
        const int r = row[a];
        if (EPI == EPI_BIAS_F16) {
            out16[(size_t)t * rows + r] = f2h(acc[a] + h2f(bias[r]));
        } else if (EPI == EPI_RESIDUAL_F32) {
            resid[(size_t)t * rows + r] += acc[a];  // one writer per element: no atomic needed
        } else {
            const float g = acc[a], u = acc[a + GEMV_ROWS];
            out16[(size_t)t * rows + r] = f2h(g / (1.0f + expf(-g)) * u);
        }
    }
}

extern "C" __global__ void int4_gemv_bias_f16(const f16_bits* x, const u32* qweight, const f16_bits* scales,
                                              const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    int4_gemv<EPI_BIAS_F16>(x, qweight, scales, bias, out, nullptr, rows, in_f);
}

extern "C" __global__ void int4_gemv_residual_f32(const f16_bits* x, const u32* qweight, const f16_bits* scales,
                                                  float* resid, int rows, int in_f) {
    int4_gemv<EPI_RESIDUAL_F32>(x, qweight, scales, nullptr, nullptr, resid, rows, in_f);
}

extern "C" __global__ void int4_gemv_silu_mul_f16(const f16_bits* x, const u32* qweight, const f16_bits* scales,
                                                  f16_bits* out, int rows, int in_f) {
    int4_gemv<EPI_SILU_MUL_F16>(x, qweight, scales, nullptr, out, nullptr, rows, in_f);
}

// ---- prefill path (T > 1): dequantize to fp32, cuBLAS, then these epilogues -----------------------

// w[o, 8j + e] = (nibble - 8) * scale, exact in fp32. One thread per qweight word.
extern "C" __global__ void int4_dequant_f32(const u32* __restrict__ qweight, const f16_bits* __restrict__ scales,
                                            float* __restrict__ w, int out_f, int in_f) {
    const size_t words = (size_t)out_f * (in_f / 8);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
        const size_t o = i / (in_f / 8), j = i % (in_f / 8);
        const float s = h2f(scales[o * (in_f / 128) + (j * 8) / 128]);
        u32 q[4];
        unpack_int4_pairs(qweight[i], q);
        float* dst = w + o * in_f + j * 8;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float a, b;
            h2x2f(q[k], a, b);
            dst[2 * k] = a * s;
            dst[2 * k + 1] = b * s;
        }
    }
}

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
