// fp8_e4m3_channel.cu: the FP8 `fp8_e4m3_channel` linear layers (W8A16: e4m3 weights, one fp16 scale per
// output row, docs/FORMAT.md), with their epilogues fused: q/k/v + bias, gate/up + SiLU * up, o and down
// + the fp32 residual add.
//   * decode (T = 1, or a few rows of x through blockIdx.y): the shared GEMV body of gemv_rows.cuh with
//     the e4m3 decoder: a 16-byte load is 16 consecutive e4m3 bytes of a row, decoded two at a time by
//     the hardware conversion cvt.rn.f16x2.e4m3x2 (sm_89+; every e4m3 value is exact in fp16), widened
//     to fp32, multiplied by fp32 x; the row's fp32 total is multiplied once by the row's fp16 scale;
//   * prefill (T > 1), one of (the launcher kernels/cuda/fp8_e4m3_channel.py picks by
//     backend.prefill_variant), then the shared epilogues of epilogues.cu:
//     - "cublas": fp8_e4m3_channel_dequant_f32 writes the exact fp32 weight decode(q) * s (4 x 11
//       significant bits) into a scratch buffer and cuBLAS multiplies in fp32;
//     - "pipe" / "pipe64": the tensor-core GEMM of pipe8.cuh, q decoded to fp16 in the B fragments.
//
// Layout the loads assume: qweight uint8 [out, in] row-major with in % 16 == 0 (the format's
// in_multiple), so every row starts 16-byte aligned and holds in / 16 whole chunks; x fp16 [T, in],
// 16-byte aligned.
//
// The NumPy definition (engine/formats/fp8_e4m3_channel.py) is written to match this hardware's
// conversions bit for bit; the two *_pairs entry points at the bottom exist only so that
// ladder/unit/test_fp8_hardware.py can hold it to that.
//
// Entry points: fp8_e4m3_channel_gemv_<epilogue>_t<THREADS>_r<R>, written out (not a macro) so that the
// loader and the compile test see every name; the launcher picks one per op (backend.gemv_config).
#include "gemv_rows.cuh"
#include "pipe8.cuh"

// ---- unpack helpers --------------------------------------------------------------------------------

// fp8 e4m3: a 32-bit word holds 4 consecutive e4m3 bytes of a row, byte k = element k. The hardware
// conversion cvt.rn.f16x2.e4m3x2 (sm_89+) takes two bytes in a 16-bit register and puts the LOW byte in
// the LOW half of the half2 (the high byte in the high half), so h[0] = (e0, e1), h[1] = (e2, e3).
// Every e4m3 value (subnormals down to 2^-9, up to 448) is exact in fp16; the NaN codes give NaN.
__device__ __forceinline__ void e4m3_pairs(u32 word, u32 (&h)[2]) {
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.rn.f16x2.e4m3x2 %0, lo; cvt.rn.f16x2.e4m3x2 %1, hi; }"
        : "=r"(h[0]), "=r"(h[1]) : "r"(word));
}


// ---- the decoder of gemv_rows.cuh -------------------------------------------------------------------

// fp8_e4m3_channel: qweight uint8 e4m3 [out, in] row-major, scales fp16 [out]: gemv_rows.cuh's decoder for
// one byte a weight and a scale a row, with this format's unpack.
struct E4m3Bytes {
    __device__ static __forceinline__ void pairs(u32 word, u32 (&h)[2]) { e4m3_pairs(word, h); }
};
typedef DecodeRowScaledBytes<E4m3Bytes> DecodeFp8E4m3Channel;


extern "C" __global__ void __launch_bounds__(64) fp8_e4m3_channel_gemv_bias_f16_t64_r4(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_BIAS_F16, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(64) fp8_e4m3_channel_gemv_residual_f32_t64_r4(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_RESIDUAL_F32, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(64) fp8_e4m3_channel_gemv_silu_mul_f16_t64_r4(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_SILU_MUL_F16, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) fp8_e4m3_channel_gemv_bias_f16_t128_r4(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_BIAS_F16, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) fp8_e4m3_channel_gemv_residual_f32_t128_r4(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_RESIDUAL_F32, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) fp8_e4m3_channel_gemv_silu_mul_f16_t128_r4(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_SILU_MUL_F16, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) fp8_e4m3_channel_gemv_bias_f16_t128_r8(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_BIAS_F16, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) fp8_e4m3_channel_gemv_residual_f32_t128_r8(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_RESIDUAL_F32, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) fp8_e4m3_channel_gemv_silu_mul_f16_t128_r8(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_SILU_MUL_F16, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) fp8_e4m3_channel_gemv_bias_f16_t256_r8(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_BIAS_F16, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) fp8_e4m3_channel_gemv_residual_f32_t256_r8(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_RESIDUAL_F32, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) fp8_e4m3_channel_gemv_silu_mul_f16_t256_r8(
    const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeFp8E4m3Channel, EPI_SILU_MUL_F16, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}

// ---- prefill on the tensor cores (pipe8.cuh): "pipe" 128 x 128 tiles, "pipe64" 64 x 128 ----------------

extern "C" __global__ void __launch_bounds__(256, 1)
fp8_e4m3_channel_mma_pipe_f32(const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, float* y, int T, int N, int K) {
    byte_mma_pipe<4, E4m3Bytes>(x, reinterpret_cast<const unsigned char*>(qweight), scales, y, T, N, K);
}
extern "C" __global__ void __launch_bounds__(256, 2)
fp8_e4m3_channel_mma_pipe64_f32(const f16_bits* x, const unsigned char* qweight, const f16_bits* scales, float* y, int T, int N, int K) {
    byte_mma_pipe<2, E4m3Bytes>(x, reinterpret_cast<const unsigned char*>(qweight), scales, y, T, N, K);
}

// ---- prefill path: the exact fp32 weight ------------------------------------------------------------

// w[r, k] = decode(q[r, k]) * s[r]  (fp32 [rows, in_f]; exact). One thread per pair of bytes (in_f is
// even, so a pair never straddles two rows), decoded by the same hardware conversion as the GEMV.
extern "C" __global__ void fp8_e4m3_channel_dequant_f32(const unsigned char* qweight, const f16_bits* scales, float* w,
                                                        int rows, int in_f) {
    const size_t pairs = (size_t)rows * in_f / 2;
    const unsigned short* qp = reinterpret_cast<const unsigned short*>(qweight);  // byte 2i low, 2i+1 high
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < pairs; i += (size_t)gridDim.x * blockDim.x) {
        u32 h;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(qp[i]));
        float lo, hi;
        h2x2f(h, lo, hi);  // low half: element 2i
        const float s = h2f(scales[(2 * i) / in_f]);
        w[2 * i] = lo * s;
        w[2 * i + 1] = hi * s;
    }
}

// ---- the hardware conversions, for the unit test only ------------------------------------------------
//
// Byte order: cvt.rn.satfinite.e4m3x2.f32 d, a, b puts a's code in the HIGH byte of the 16-bit d and b's
// in the LOW byte; cvt.rn.f16x2.e4m3x2 d, a decodes a's LOW byte into d's LOW half. With the value of
// element 2i passed as b, the 16-bit word written for pair i is little-endian (code 2i, code 2i+1), so
// the output array read as bytes is the codes in element order; likewise the decoded half2 read as
// fp16 values is in element order.

// codes[i] = e4m3 codes of (v[2i], v[2i+1]): round to nearest even, finite overflow and +-inf saturate
// to +-448 (satfinite), NaN -> NaN.
extern "C" __global__ void fp8_e4m3_encode_pairs(const float* v, unsigned short* codes, int pairs) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x) {
        unsigned short c;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(c) : "f"(v[2 * i + 1]), "f"(v[2 * i]));
        codes[i] = c;
    }
}

// halves[i] = fp16 values (low half: byte 2i, high half: byte 2i+1) of the e4m3 code pair codes[i].
extern "C" __global__ void fp8_e4m3_decode_pairs(const unsigned short* codes, u32* halves, int pairs) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x) {
        u32 h;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(codes[i]));
        halves[i] = h;
    }
}
