// int8_sym_channel.cu: the INT8 `int8_sym_channel` linear layers (W8A16: int8 weights, one fp16 scale
// per output row, docs/FORMAT.md), with their epilogues fused: q/k/v + bias, gate/up + SiLU * up, o and
// down + the fp32 residual add.
//   * decode (T = 1, or a few rows of x through blockIdx.y): the shared GEMV body of gemv_rows.cuh with
//     the int8 decoder: a 16-byte load is 16 consecutive weights of a row, each turned into its exact
//     fp16 value by the prmt / XOR / half2-subtract trick (int8_pairs), widened to fp32, multiplied by
//     fp32 x; the row's fp32 total is multiplied once by the row's fp16 scale;
//   * prefill (T > 1), one of (the launcher kernels/cuda/int8_sym_channel.py picks by
//     backend.prefill_variant), then the shared epilogues of epilogues.cu:
//     - "cublas": int8_sym_channel_dequant_f32 writes the exact fp32 weight q * s (8 x 11 significant bits
//       fit fp32's 24) into a scratch buffer and cuBLAS multiplies in fp32;
//     - "pipe" / "pipe64": the tensor-core GEMM of pipe8.cuh, q decoded to fp16 in the B fragments.
//
// Layout the loads assume: qweight int8 [out, in] row-major with in % 16 == 0 (the format's
// in_multiple), so every row starts 16-byte aligned and holds in / 16 whole chunks; x fp16 [T, in],
// 16-byte aligned (its rows then are too: 2 in bytes, a multiple of 32).
//
// Entry points: int8_sym_channel_gemv_<epilogue>_t<THREADS>_r<R>, written out (not a macro) so that the
// loader and the compile test see every name; the launcher picks one per op (backend.gemv_config).
#include "gemv_rows.cuh"
#include "pipe8.cuh"

// ---- unpack helpers --------------------------------------------------------------------------------

// int8: a 32-bit word holds 4 consecutive weights of a row, byte k = element k (little-endian rows).
// h[0] = half2 (e0, e1) and h[1] = half2 (e2, e3), exact. prmt picks bytes: selector nibble i names the
// source byte of result byte i (0..3 from `word`, 4..7 from the second operand, 0 here), so 0x4140
// gives the bytes (e0, 0, e1, 0) and 0x4342 gives (e2, 0, e3, 0): one weight in the low byte of each
// 16-bit half. XOR 0x6480 then flips bit 7 (two's-complement q -> unsigned q + 128, 0..255) and sets
// 0x6400 above it: the fp16 number 1024 + 128 + q (fp16 1024's ulp is 1). Subtracting 1152 (0x6480)
// in half2 leaves q exactly (integers up to 2048 are exact in fp16).
__device__ __forceinline__ void int8_pairs(u32 word, u32 (&h)[2]) {
    u32 t0, t1;
    asm("prmt.b32 %0, %1, %2, 0x4140;" : "=r"(t0) : "r"(word), "r"(0u));
    asm("prmt.b32 %0, %1, %2, 0x4342;" : "=r"(t1) : "r"(word), "r"(0u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(h[0]) : "r"(t0 ^ 0x64806480u), "r"(0x64806480u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(h[1]) : "r"(t1 ^ 0x64806480u), "r"(0x64806480u));
}


// ---- the decoder of gemv_rows.cuh -------------------------------------------------------------------

// int8_sym_channel: qweight int8 [out, in] row-major, scales fp16 [out]: gemv_rows.cuh's decoder for
// one byte a weight and a scale a row, with this format's unpack.
struct Int8Bytes {
    __device__ static __forceinline__ void pairs(u32 word, u32 (&h)[2]) { int8_pairs(word, h); }
};
typedef DecodeRowScaledBytes<Int8Bytes> DecodeInt8SymChannel;


extern "C" __global__ void __launch_bounds__(64) int8_sym_channel_gemv_bias_f16_t64_r4(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_BIAS_F16, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(64) int8_sym_channel_gemv_residual_f32_t64_r4(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_RESIDUAL_F32, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(64) int8_sym_channel_gemv_silu_mul_f16_t64_r4(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_SILU_MUL_F16, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int8_sym_channel_gemv_bias_f16_t128_r4(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_BIAS_F16, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int8_sym_channel_gemv_residual_f32_t128_r4(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_RESIDUAL_F32, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int8_sym_channel_gemv_silu_mul_f16_t128_r4(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_SILU_MUL_F16, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int8_sym_channel_gemv_bias_f16_t128_r8(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_BIAS_F16, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int8_sym_channel_gemv_residual_f32_t128_r8(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_RESIDUAL_F32, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int8_sym_channel_gemv_silu_mul_f16_t128_r8(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_SILU_MUL_F16, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int8_sym_channel_gemv_bias_f16_t256_r8(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_BIAS_F16, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int8_sym_channel_gemv_residual_f32_t256_r8(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_RESIDUAL_F32, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int8_sym_channel_gemv_silu_mul_f16_t256_r8(
    const f16_bits* x, const signed char* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt8SymChannel, EPI_SILU_MUL_F16, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}

// ---- prefill on the tensor cores (pipe8.cuh): "pipe" 128 x 128 tiles, "pipe64" 64 x 128 ----------------

extern "C" __global__ void __launch_bounds__(256, 1)
int8_sym_channel_mma_pipe_f32(const f16_bits* x, const signed char* qweight, const f16_bits* scales, float* y, int T, int N, int K) {
    byte_mma_pipe<4, Int8Bytes>(x, reinterpret_cast<const unsigned char*>(qweight), scales, y, T, N, K);
}
extern "C" __global__ void __launch_bounds__(256, 2)
int8_sym_channel_mma_pipe64_f32(const f16_bits* x, const signed char* qweight, const f16_bits* scales, float* y, int T, int N, int K) {
    byte_mma_pipe<2, Int8Bytes>(x, reinterpret_cast<const unsigned char*>(qweight), scales, y, T, N, K);
}

// ---- prefill path: the exact fp32 weight ------------------------------------------------------------

// w[r, k] = q[r, k] * s[r]  (fp32 [rows, in_f]; exact). Grid-stride over the elements: any grid covers
// any size; the product of an integer |q| <= 128 and an fp16 scale has at most 19 significant bits.
extern "C" __global__ void int8_sym_channel_dequant_f32(const signed char* qweight, const f16_bits* scales, float* w,
                                                        int rows, int in_f) {
    const size_t n = (size_t)rows * in_f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        w[i] = (float)qweight[i] * h2f(scales[i / in_f]);
}
