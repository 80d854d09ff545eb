// int4_asym_g128.cu: the INT4 asymmetric `int4_asym_g128` linear layers (W4A16, an fp16 scale and a zero
// point per 128 inputs, docs/FORMAT.md), with their epilogues fused: q/k/v + bias, gate/up + SiLU * up,
// o and down + the fp32 residual add.
//   * decode (T = 1, or a few rows of x through blockIdx.y), two families of GEMV kernels:
//     - t<THREADS>_r<R>: the shared CUDA-core body of gemv_rows.cuh with the asym decoder;
//     - tc_w<NW>_u<U>: the tensor-core body of gemv_tc.cuh with the zero point of each group instead
//       of the fixed 8 (below);
//   * prefill (T > 1), by the launcher's prefill variant (kernels/cuda/int4_asym_g128.py): the tensor-core
//     ring of int4_pipe.cuh with this format's zero point per group (int4_asym_g128_mma_pipe{,64}_f32:
//     exact fp16 products (q - z) x, a 128-input fp32 partial per group, scaled once), or
//     int4_asym_g128_dequant_f32, which writes the exact fp32 weight (q - z) * s (5 x 11 significant bits)
//     into a scratch buffer for one cuBLAS fp32 GEMM; the shared epilogues of epilogues.cu finish both.
//
// Layout the loads assume: qweight uint32 [out, in/8] in int4_sym_g128's ValueShuffle nibble order
// (common.cuh draws it), scale_zero uint32 [out, in/128] (bits 0..15 the fp16 scale, bits 16..31 the
// fp16 number 1024 + z), in % 128 == 0, so a row is in/128 groups of 64 bytes = 4 chunks of 16 bytes;
// x fp16 [T, in], 16-byte aligned. One 4-byte load of scale_zero gives a group's scale and zero point:
// half2(1024 + q) - half2(1024 + z) is q - z exactly, with no integer-to-float conversion.
//
// Entry points: int4_asym_g128_gemv_<epilogue>_<variant>, written out (not a macro) so that the loader
// and the compile test see every name; the launcher picks one per op (backend.gemv_config).
#include "gemv_rows.cuh"
#include "int4_pipe.cuh"
#include "int4_wgmma.cuh"
#include "gemv_tc.cuh"


// ---- the decoder of gemv_rows.cuh -------------------------------------------------------------------

// int4_asym_g128: qweight uint32 ValueShuffle words [out, in/8], scale_zero uint32 [out, in/128]. A
// chunk is 4 words = 32 weights, a quarter of a 128-group, so chunk c's group is c / 4 and one 4-byte
// load gives its scale and zero point. The chunk's 32 products are summed in fp32, then scaled once.
struct DecodeInt4AsymG128 {
    static constexpr int ELEMS = 32;
    typedef u32 Scale;
    typedef u32 Aux;
    __device__ static __forceinline__ u32 aux(const Scale* sz, int row, int in_f, int c) {
        return __ldg(sz + (size_t)row * (in_f / 128) + c / 4);
    }
    __device__ static __forceinline__ float accumulate(float acc, const uint4& w, const float (&xf)[ELEMS], u32 sz) {
        const u32 words[4] = {w.x, w.y, w.z, w.w};
        const u32 zz = zero_pair(sz);
        float p = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // word j holds elements 8j .. 8j+7 of the chunk
            u32 q[4];
            unpack_int4_pairs(words[j], q, zz);
#pragma unroll
            for (int k = 0; k < 4; ++k) p = fma_pair(q[k], xf[8 * j + 2 * k], xf[8 * j + 2 * k + 1], p);
        }
        return fmaf(p, h2f((f16_bits)(sz & 0xFFFFu)), acc);
    }
    __device__ static __forceinline__ float finish(float total, const Scale*, int) { return total; }
};


extern "C" __global__ void __launch_bounds__(64) int4_asym_g128_gemv_bias_f16_t64_r4(
    const f16_bits* x, const u32* qweight, const u32* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_BIAS_F16, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(64) int4_asym_g128_gemv_residual_f32_t64_r4(
    const f16_bits* x, const u32* qweight, const u32* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_RESIDUAL_F32, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(64) int4_asym_g128_gemv_silu_mul_f16_t64_r4(
    const f16_bits* x, const u32* qweight, const u32* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_SILU_MUL_F16, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_asym_g128_gemv_bias_f16_t128_r4(
    const f16_bits* x, const u32* qweight, const u32* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_BIAS_F16, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_asym_g128_gemv_residual_f32_t128_r4(
    const f16_bits* x, const u32* qweight, const u32* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_RESIDUAL_F32, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_asym_g128_gemv_silu_mul_f16_t128_r4(
    const f16_bits* x, const u32* qweight, const u32* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_SILU_MUL_F16, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_asym_g128_gemv_bias_f16_t128_r8(
    const f16_bits* x, const u32* qweight, const u32* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_BIAS_F16, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_asym_g128_gemv_residual_f32_t128_r8(
    const f16_bits* x, const u32* qweight, const u32* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_RESIDUAL_F32, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_asym_g128_gemv_silu_mul_f16_t128_r8(
    const f16_bits* x, const u32* qweight, const u32* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_SILU_MUL_F16, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_asym_g128_gemv_bias_f16_t256_r8(
    const f16_bits* x, const u32* qweight, const u32* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_BIAS_F16, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_asym_g128_gemv_residual_f32_t256_r8(
    const f16_bits* x, const u32* qweight, const u32* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_RESIDUAL_F32, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_asym_g128_gemv_silu_mul_f16_t256_r8(
    const f16_bits* x, const u32* qweight, const u32* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4AsymG128, EPI_SILU_MUL_F16, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}

// ---- decode GEMV on the tensor cores (variants tc_w<NW>_u<U>) --------------------------------------
//
// gemv_tc.cuh's body (int4_sym_g128's tensor-core GEMV: fragment layout, double-buffered loads, fixed
// reduction order) with this format's group reader: one 4-byte scale_zero word a group gives both its
// zero point (the nibbles are unpacked against it: q - z, exact in fp16, so every mma product is exact
// and the sums are fp32) and its scale (the low half), which multiplies the group's fp32 sum.
struct TcAsymG128 {
    typedef u32 Word;
    __device__ static __forceinline__ u32 zero(Word sz) { return zero_pair(sz); }
    __device__ static __forceinline__ float scale(Word sz) { return h2f((f16_bits)(sz & 0xFFFFu)); }
};

extern "C" __global__ void __launch_bounds__(128) int4_asym_g128_gemv_bias_f16_tc_w4_u4(
    const f16_bits* x, const u32* qweight, const u32* scale_zero, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcAsymG128, EPI_BIAS_F16, 4, 4>(x, qweight, scale_zero, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_asym_g128_gemv_residual_f32_tc_w4_u4(
    const f16_bits* x, const u32* qweight, const u32* scale_zero, float* resid, int rows, int in_f) {
    gemv_tc<TcAsymG128, EPI_RESIDUAL_F32, 4, 4>(x, qweight, scale_zero, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_asym_g128_gemv_silu_mul_f16_tc_w4_u4(
    const f16_bits* x, const u32* qweight, const u32* scale_zero, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcAsymG128, EPI_SILU_MUL_F16, 4, 4>(x, qweight, scale_zero, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_asym_g128_gemv_bias_f16_tc_w8_u4(
    const f16_bits* x, const u32* qweight, const u32* scale_zero, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcAsymG128, EPI_BIAS_F16, 8, 4>(x, qweight, scale_zero, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_asym_g128_gemv_residual_f32_tc_w8_u4(
    const f16_bits* x, const u32* qweight, const u32* scale_zero, float* resid, int rows, int in_f) {
    gemv_tc<TcAsymG128, EPI_RESIDUAL_F32, 8, 4>(x, qweight, scale_zero, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_asym_g128_gemv_silu_mul_f16_tc_w8_u4(
    const f16_bits* x, const u32* qweight, const u32* scale_zero, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcAsymG128, EPI_SILU_MUL_F16, 8, 4>(x, qweight, scale_zero, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_asym_g128_gemv_bias_f16_tc_w8_u2(
    const f16_bits* x, const u32* qweight, const u32* scale_zero, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcAsymG128, EPI_BIAS_F16, 8, 2>(x, qweight, scale_zero, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_asym_g128_gemv_residual_f32_tc_w8_u2(
    const f16_bits* x, const u32* qweight, const u32* scale_zero, float* resid, int rows, int in_f) {
    gemv_tc<TcAsymG128, EPI_RESIDUAL_F32, 8, 2>(x, qweight, scale_zero, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_asym_g128_gemv_silu_mul_f16_tc_w8_u2(
    const f16_bits* x, const u32* qweight, const u32* scale_zero, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcAsymG128, EPI_SILU_MUL_F16, 8, 2>(x, qweight, scale_zero, nullptr, out, nullptr, rows, in_f);
}

// ---- prefill path: the exact fp32 weight for cuBLAS ---------------------------------------------------

// w[r, k] = (q[r, k] - z[r, k/128]) * s[r, k/128]  (fp32 [rows, in_f]; exact). One thread per qweight
// word (8 weights of one row, one group: 16 words per group), unpacked by the GEMV's own helper; the
// word's elements 2k, 2k+1 come out as pair k.
extern "C" __global__ void int4_asym_g128_dequant_f32(const u32* qweight, const u32* scale_zero, float* w, int rows,
                                                      int in_f) {
    const int words_per_row = in_f / 8, groups = in_f / 128;
    const size_t n = (size_t)rows * words_per_row;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t row = i / words_per_row;
        const int word = (int)(i % words_per_row);
        const u32 sz = scale_zero[row * groups + word / 16];
        const float s = h2f((f16_bits)(sz & 0xFFFFu));
        u32 q[4];
        unpack_int4_pairs(qweight[i], q, zero_pair(sz));
        float* out = w + row * in_f + 8 * word;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float v0, v1;
            h2x2f(q[k], v0, v1);
            out[2 * k] = v0 * s;
            out[2 * k + 1] = v1 * s;
        }
    }
}

// ---- prefill path: the tensor-core ring (int4_pipe.cuh) -----------------------------------------------
// x fp16 [T, K], qweight uint32 [N, K/8], scale_zero uint32 [N, K/128] -> y fp32 [T, N]; K % 128 == 0.
extern "C" __global__ void __launch_bounds__(256, 1)
int4_asym_g128_mma_pipe_f32(const f16_bits* x, const u32* qweight, const u32* scale_zero, float* y, int T, int N, int K) {
    int4_mma_pipe<4>(x, qweight, AsymGroups{scale_zero, K / 128}, y, T, N, K);
}
extern "C" __global__ void __launch_bounds__(256, 2)
int4_asym_g128_mma_pipe64_f32(const f16_bits* x, const u32* qweight, const u32* scale_zero, float* y, int T, int N,
                              int K) {
    int4_mma_pipe<2>(x, qweight, AsymGroups{scale_zero, K / 128}, y, T, N, K);
}

// ---- prefill on wgmma (sm_90a): int4_wgmma.cuh with the zero point per group ----------------------------
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
int4_asym_g128_wgmma_f32(const __grid_constant__ TmaMap xmap, const u32* qweight, const u32* scale_zero, float* y,
                         int T, int N, int K, float* carry, unsigned* flags) {
    int4_wgmma_entry(xmap, qweight, AsymGroups{scale_zero, K / 128}, y, T, N, K, carry, flags);
}
