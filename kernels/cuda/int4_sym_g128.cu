// int4_sym_g128.cu: the INT4 `int4_sym_g128` linear layers, with their epilogues fused: q/k/v + bias,
// gate/up + SiLU * up, o and down + the fp32 residual add.
//   * decode (T = 1, or a few rows of x through blockIdx.y): GEMV kernels that unpack in registers;
//   * prefill (T > 1): a tensor-core kernel (mma.sync m16n8k16, fp16 x fp16 -> fp32) that multiplies x
//     by the UNSCALED nibble values (n - 8, exact in fp16) one 128-group at a time and applies the fp16
//     scale to each group's fp32 partial in the epilogue, so no weight is ever rounded; its fp32 output
//     goes through the shared epilogue kernels of epilogues.cu.
//
// The launcher is kernels/cuda/int4_sym_g128.py (LINEAR): it picks a GEMV variant per op and names the
// entry points int4_gemv_<epilogue>_<variant>.
//
// Mirrors kernels/numpy/int4_sym_g128.py (unpack, fp32 accumulation) and the ops of kernels/numpy/__init__.py.
//
// GEMV work split: a block of THREADS threads owns R accumulator rows (gate/up: R/2 gate rows and the
// same R/2 up rows) across the WHOLE input dimension (split-K inside the block, so even the 3584-row o
// and down weights put thousands of warps in flight). Thread i takes the 16-byte chunks
// c = i, i + THREADS, ... (32 inputs each): per chunk it loads the 32 fp16 activations once (4 x 16 B)
// and one 16-byte weight chunk from each of its R rows, so R independent 16-byte loads are in flight
// per thread. A chunk never straddles a scale group (128 inputs = 4 chunks), so the fp16 scale
// multiplies the chunk's fp32 partial sum once. Partials are reduced with a fixed xor-shuffle tree per
// warp, then across warps in warp order through shared memory: no atomics, deterministic results.
#include "gemv_rows.cuh"
#include "int4_pipe.cuh"
#include "int4_wgmma.cuh"
#include "gemv_tc.cuh"

// x: fp16 [T, in]; qweight: uint32 [out_total, in/8]; scales: fp16 [out_total, in/128].
// EPI_BIAS_F16:     out16[t, r] = acc(r) + bias[r]                         (out_total = rows)
// EPI_RESIDUAL_F32: resid[t, r] += acc(r)                                  (out_total = rows)
// EPI_SILU_MUL_F16: out16[t, r] = silu(acc(r)) * acc(rows + r)             (out_total = 2 rows)
template <int EPI, int THREADS, int R>
__device__ __forceinline__ void int4_gemv(const f16_bits* __restrict__ x, const u32* __restrict__ qweight,
                                          const f16_bits* __restrict__ scales, const f16_bits* __restrict__ bias,
                                          f16_bits* __restrict__ out16, float* __restrict__ resid, int rows, int in_f) {
    constexpr int NW = THREADS / WARP;
    constexpr int RB = EPI == EPI_SILU_MUL_F16 ? R / 2 : R;  // output rows per block
    __shared__ float red[NW][R];
    __shared__ float tot[R];
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int row0 = blockIdx.x * RB;
    const int t = blockIdx.y;
    const int words_per_row = in_f / 8, groups = in_f / 128, chunks = in_f / 32;
    const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)t * in_f);  // 16 B = 8 fp16

    const uint4* wrow[R];
    const f16_bits* srow[R];
#pragma unroll
    for (int a = 0; a < R; ++a) {
        int r = imin(row0 + (a % RB), rows - 1);  // a clamped row is loaded (in bounds) but never stored
        if (EPI == EPI_SILU_MUL_F16 && a >= RB) r += rows;
        wrow[a] = reinterpret_cast<const uint4*>(qweight + (size_t)r * words_per_row);
        srow[a] = scales + (size_t)r * groups;
    }
    pdl_enter();  // common.cuh: x is the previous kernel's output

    float acc[R];
#pragma unroll
    for (int a = 0; a < R; ++a) acc[a] = 0.0f;

    for (int c = tid; c < chunks; c += THREADS) {
        uint4 w[R];
#pragma unroll
        for (int a = 0; a < R; ++a) w[a] = __ldg(wrow[a] + c);  // R independent 16-byte loads in flight
        // 32 activations: 4 x 16-byte loads; x[c*32 + 8j .. 8j+7] pairs up with weight word j.
        u32 xw[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) uint4_words(__ldg(xv + c * 4 + j), xw[j]);
#pragma unroll
        for (int a = 0; a < R; ++a) {
            float p = 0.0f;
            p = dot_int4_word(w[a].x, xw[0], p);
            p = dot_int4_word(w[a].y, xw[1], p);
            p = dot_int4_word(w[a].z, xw[2], p);
            p = dot_int4_word(w[a].w, xw[3], p);
            acc[a] = fmaf(p, h2f(__ldg(srow[a] + c / 4)), acc[a]);
        }
    }
#pragma unroll
    for (int a = 0; a < R; ++a) {
        const float v = warp_sum(acc[a]);
        if (lane == 0) red[warp][a] = v;
    }
    __syncthreads();  // every warp's partials are in shared memory
    if (tid < R) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) s += red[w][tid];  // fixed order: deterministic
        tot[tid] = s;
    }
    __syncthreads();  // tot[] complete (gate/up needs both halves)
    if (tid >= RB) return;
    const int r = row0 + tid;
    if (r >= rows) return;
    if (EPI == EPI_BIAS_F16) {
        out16[(size_t)t * rows + r] = f2h(tot[tid] + h2f(bias[r]));
    } else if (EPI == EPI_RESIDUAL_F32) {
        resid[(size_t)t * rows + r] += tot[tid];  // one writer per element: no atomic needed
    } else {
        const float g = tot[tid], u = tot[tid + RB];
        out16[(size_t)t * rows + r] = f2h(g / (1.0f + expf(-g)) * u);
    }
}

// Entry points: int4_gemv_<epilogue>_t<THREADS>_r<R> (and _tc_w<NW>_u<U> below), written out (not a
// macro) so that the loader and the compile test see every name. The launcher picks one per op
// (kernels/cuda/int4_sym_g128.py DEFAULT_CONFIG, backend.gemv_config).

extern "C" __global__ void __launch_bounds__(64) int4_gemv_bias_f16_t64_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    int4_gemv<EPI_BIAS_F16, 64, 4>(x, qweight, scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(64) int4_gemv_residual_f32_t64_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    int4_gemv<EPI_RESIDUAL_F32, 64, 4>(x, qweight, scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(64) int4_gemv_silu_mul_f16_t64_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    int4_gemv<EPI_SILU_MUL_F16, 64, 4>(x, qweight, scales, nullptr, out, nullptr, rows, in_f);
}

extern "C" __global__ void __launch_bounds__(128) int4_gemv_bias_f16_t128_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    int4_gemv<EPI_BIAS_F16, 128, 4>(x, qweight, scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_residual_f32_t128_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    int4_gemv<EPI_RESIDUAL_F32, 128, 4>(x, qweight, scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_silu_mul_f16_t128_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    int4_gemv<EPI_SILU_MUL_F16, 128, 4>(x, qweight, scales, nullptr, out, nullptr, rows, in_f);
}

extern "C" __global__ void __launch_bounds__(128) int4_gemv_bias_f16_t128_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    int4_gemv<EPI_BIAS_F16, 128, 8>(x, qweight, scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_residual_f32_t128_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    int4_gemv<EPI_RESIDUAL_F32, 128, 8>(x, qweight, scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_silu_mul_f16_t128_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    int4_gemv<EPI_SILU_MUL_F16, 128, 8>(x, qweight, scales, nullptr, out, nullptr, rows, in_f);
}

extern "C" __global__ void __launch_bounds__(256) int4_gemv_bias_f16_t256_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    int4_gemv<EPI_BIAS_F16, 256, 8>(x, qweight, scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_gemv_residual_f32_t256_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    int4_gemv<EPI_RESIDUAL_F32, 256, 8>(x, qweight, scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_gemv_silu_mul_f16_t256_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    int4_gemv<EPI_SILU_MUL_F16, 256, 8>(x, qweight, scales, nullptr, out, nullptr, rows, in_f);
}

// ---- decode GEMV with the nibbles decoded straight to fp32 (variants f<THREADS>_r<R>) -----------------
//
// The kernels above widen every unpacked half2 weight (and, per row, every x pair) with an fp16 -> fp32
// conversion before its FMA; conversions issue at a fraction of the FMA rate, so at 2 weights a byte
// they, not the bytes, bound the big gate/up and down GEMVs. These variants never convert a weight:
// OR-ing a nibble that sits at bits 4p .. 4p+3 into the fp32 pattern 0x4B000000 (2^23, whose ulp is 1)
// gives the float 2^23 + 16^p n exactly, and one FMA with 16^-p and -(2^23 16^-p + 8) gives n - 8
// exactly (the exact value n - 8 is one rounding away, and it is representable). Per weight: one lop3,
// one FMA to decode and one FMA to accumulate, all at full rate; per word one shift brings the odd
// elements (bits 16..31) down to bits 0..15, since a nibble at bits 20..23 would reach the exponent.
// x is widened once per chunk for all R rows (gemv_rows.cuh's body, whose work split and fixed
// reduction order these share). The sums are the t<THREADS>_r<R> kernels' sums in the same order (pair
// k of word j: element 2k, then 2k + 1), so both families give the same bits.

// 2^23 + 16^p n as fp32, n the nibble at bits 4p .. 4p+3 of `word` (p = 0..3: bits 0..15 only).
template <int P>
__device__ __forceinline__ float nibble_magic_f32(u32 word) {
    u32 t;
    // lop3 LUT 0xEA = (a & b) | c  with a = word, b = 0xF << 4p, c = 0x4B000000 (fp32 2^23)
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(t) : "r"(word), "r"(0xFu << (4 * P)), "r"(0x4B000000u));
    return __uint_as_float(t);
}

// sum over the word's 8 elements of (n - zero) * x, fp32, in the pair order of dot_int4_word.
// xf: the word's 8 activations in element order. off[p] = -(2^23 16^-p + zero) (exact).
__device__ __forceinline__ float dot_int4_word_f32(u32 word, const float* xf, const float (&off)[4], float acc) {
    const u32 hi = word >> 16;  // odd elements 1, 3, 5, 7 down to nibbles 0..3
    // nibble p: fma(2^23 + 16^p n, 16^-p, off[p]) = n - zero; pair p = elements 2p (word), 2p+1 (hi)
    acc = fmaf(fmaf(nibble_magic_f32<0>(word), 1.0f, off[0]), xf[0], acc);
    acc = fmaf(fmaf(nibble_magic_f32<0>(hi), 1.0f, off[0]), xf[1], acc);
    acc = fmaf(fmaf(nibble_magic_f32<1>(word), 0.0625f, off[1]), xf[2], acc);
    acc = fmaf(fmaf(nibble_magic_f32<1>(hi), 0.0625f, off[1]), xf[3], acc);
    acc = fmaf(fmaf(nibble_magic_f32<2>(word), 0.00390625f, off[2]), xf[4], acc);
    acc = fmaf(fmaf(nibble_magic_f32<2>(hi), 0.00390625f, off[2]), xf[5], acc);
    acc = fmaf(fmaf(nibble_magic_f32<3>(word), 0.000244140625f, off[3]), xf[6], acc);
    acc = fmaf(fmaf(nibble_magic_f32<3>(hi), 0.000244140625f, off[3]), xf[7], acc);
    return acc;
}

// The decoder of gemv_rows.cuh for int4_sym_g128: a chunk is 4 words = 32 weights, a quarter of a
// 128-group (chunk c's scale is the group c / 4's); the chunk's 32 products are summed in fp32, then
// scaled once, as in int4_gemv above.
struct DecodeInt4SymG128F32 {
    static constexpr int ELEMS = 32;
    typedef f16_bits Scale;
    typedef float Aux;
    __device__ static __forceinline__ float aux(const Scale* s, int row, int in_f, int c) {
        return h2f(__ldg(s + (size_t)row * (in_f / 128) + c / 4));
    }
    __device__ static __forceinline__ float accumulate(float acc, const uint4& w, const float (&xf)[ELEMS], float s) {
        const float off[4] = {-8388616.0f, -524296.0f, -32776.0f, -2056.0f};  // -(2^23 16^-p + 8)
        float p = 0.0f;
        p = dot_int4_word_f32(w.x, xf + 0, off, p);
        p = dot_int4_word_f32(w.y, xf + 8, off, p);
        p = dot_int4_word_f32(w.z, xf + 16, off, p);
        p = dot_int4_word_f32(w.w, xf + 24, off, p);
        return fmaf(p, s, acc);
    }
    __device__ static __forceinline__ float finish(float total, const Scale*, int) { return total; }
};

// Entry points int4_gemv_<epilogue>_f<THREADS>_r<R>, written out like the others.
extern "C" __global__ void __launch_bounds__(64) int4_gemv_bias_f16_f64_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_BIAS_F16, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(64) int4_gemv_residual_f32_f64_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_RESIDUAL_F32, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(64) int4_gemv_silu_mul_f16_f64_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_SILU_MUL_F16, 64, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_bias_f16_f128_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_BIAS_F16, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_residual_f32_f128_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_RESIDUAL_F32, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_silu_mul_f16_f128_r4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_SILU_MUL_F16, 128, 4>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_bias_f16_f128_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_BIAS_F16, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_residual_f32_f128_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_RESIDUAL_F32, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_silu_mul_f16_f128_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_SILU_MUL_F16, 128, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_gemv_bias_f16_f256_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_BIAS_F16, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_gemv_residual_f32_f256_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_RESIDUAL_F32, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_gemv_silu_mul_f16_f256_r8(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_rows<DecodeInt4SymG128F32, EPI_SILU_MUL_F16, 256, 8>(x, reinterpret_cast<const uint4*>(qweight), scales, nullptr, out, nullptr, rows, in_f);
}

// ---- decode GEMV on the tensor cores (variants tc_w<NW>_u<U>) --------------------------------------
//
// The same sums as above, with the unpacked nibbles fed to mma.sync: gemv_tc.cuh's body (its work split,
// double-buffered loads and fixed reduction order) with this format's group reader: zero 8 for every
// group, the fp16 scale of the group.
struct TcSymG128 {
    typedef f16_bits Word;
    __device__ static __forceinline__ u32 zero(Word) { return SYM_ZERO_PAIR; }
    __device__ static __forceinline__ float scale(Word s) { return h2f(s); }
};

extern "C" __global__ void __launch_bounds__(128) int4_gemv_bias_f16_tc_w4_u4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcSymG128, EPI_BIAS_F16, 4, 4>(x, qweight, scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_residual_f32_tc_w4_u4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_tc<TcSymG128, EPI_RESIDUAL_F32, 4, 4>(x, qweight, scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(128) int4_gemv_silu_mul_f16_tc_w4_u4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcSymG128, EPI_SILU_MUL_F16, 4, 4>(x, qweight, scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_gemv_bias_f16_tc_w8_u4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcSymG128, EPI_BIAS_F16, 8, 4>(x, qweight, scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_gemv_residual_f32_tc_w8_u4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_tc<TcSymG128, EPI_RESIDUAL_F32, 8, 4>(x, qweight, scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_gemv_silu_mul_f16_tc_w8_u4(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcSymG128, EPI_SILU_MUL_F16, 8, 4>(x, qweight, scales, nullptr, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_gemv_bias_f16_tc_w8_u2(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, const f16_bits* bias, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcSymG128, EPI_BIAS_F16, 8, 2>(x, qweight, scales, bias, out, nullptr, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_gemv_residual_f32_tc_w8_u2(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, float* resid, int rows, int in_f) {
    gemv_tc<TcSymG128, EPI_RESIDUAL_F32, 8, 2>(x, qweight, scales, nullptr, nullptr, resid, rows, in_f);
}
extern "C" __global__ void __launch_bounds__(256) int4_gemv_silu_mul_f16_tc_w8_u2(
    const f16_bits* x, const u32* qweight, const f16_bits* scales, f16_bits* out, int rows, int in_f) {
    gemv_tc<TcSymG128, EPI_SILU_MUL_F16, 8, 2>(x, qweight, scales, nullptr, out, nullptr, rows, in_f);
}

// ---- prefill path (T > 1): tensor cores, then these epilogues --------------------------------------
//
// y[t, n] = sum_g s[n, g] * (sum_{k in group g} x[t, k] * (nib[n, k] - 8))      fp32 [T, N]
// The inner sums run on the tensor cores (mma.sync.m16n8k16, fp16 inputs, fp32 accumulation): both
// inputs are exact in fp16 (x is fp16; n - 8 is an integer in -8..7), so every product is exact and only
// the fp32 accumulation rounds, as in the fp32 path it replaces. The scale multiplies each group's
// partial once, in fp32, exactly like the GEMV kernels do per chunk.
//
// Tile: BM = 64 tokens x BN = 128 weight rows per block, K in steps of BK = 64 (half a group), 8 warps
// as 2 (M) x 4 (N), each warp 32 x 32 = 2 x 4 mma tiles. Shared rows are padded to 72 halves (144 B),
// which puts the 8 rows of a fragment load in 8 different bank quads. The next K step's global loads
// (x: 2 x 16 B, weights: 16 B = 32 nibbles per thread) are issued before the current step's mma loop.
#define MMA_BM 64
#define MMA_BN 128
#define MMA_BK 64
#define MMA_PAD 72
#define MMA_THREADS 256


// x fp16 [T, K], qweight uint32 [N, K/8], scales fp16 [N, K/128] -> y fp32 [T, N]. K % 128 == 0.
// Grid (ceil(N / 128), ceil(T / 64)), 256 threads.
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
int4_mma_f32(const f16_bits* __restrict__ x, const u32* __restrict__ qweight, const f16_bits* __restrict__ scales,
             float* __restrict__ y, int T, int N, int K) {
    __shared__ __align__(16) f16_bits Xs[MMA_BM][MMA_PAD];
    __shared__ __align__(16) f16_bits Ws[MMA_BN][MMA_PAD];
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int wm = warp % 2, wn = warp / 2;  // warp tile: rows wm*32.., cols wn*32..
    const int n0 = blockIdx.x * MMA_BN, m0 = blockIdx.y * MMA_BM;
    const int words_per_row = K / 8, groups = K / 128, ktiles = K / MMA_BK;

    // global -> register loaders
    const int xr0 = tid / 8, xc = (tid % 8) * 8;  // x: rows xr0 and xr0 + 32, 8 halves at column xc
    const int wr = tid / 2, wc = (tid % 2) * 4;   // weights: row wr, words wc..wc+3 of the k tile's 8
    const bool xok0 = m0 + xr0 < T, xok1 = m0 + xr0 + 32 < T;
    const uint4* xp0 = reinterpret_cast<const uint4*>(x + (size_t)(xok0 ? m0 + xr0 : 0) * K + xc);
    const uint4* xp1 = reinterpret_cast<const uint4*>(x + (size_t)(xok1 ? m0 + xr0 + 32 : 0) * K + xc);
    const uint4* wp = reinterpret_cast<const uint4*>(qweight + (size_t)imin(n0 + wr, N - 1) * words_per_row + wc);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    uint4 rx0, rx1, rw;
    auto load = [&](int kt) {
        rx0 = xok0 ? __ldg(xp0 + kt * (MMA_BK / 8)) : zero;
        rx1 = xok1 ? __ldg(xp1 + kt * (MMA_BK / 8)) : zero;
        rw = __ldg(wp + kt * (MMA_BK / 32));
    };

    float acc[2][4][4], tot[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = tot[i][j][e] = 0.0f;

    // This thread's 8 output columns: n0 + wn*32 + j*8 + (lane%4)*2 + {0,1}; clamped rows for the scales.
    int scol[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) scol[j][e] = imin(n0 + wn * 32 + j * 8 + (lane % 4) * 2 + e, N - 1);

    load(0);
    for (int kt = 0; kt < ktiles; ++kt) {
        *reinterpret_cast<uint4*>(&Xs[xr0][xc]) = rx0;
        *reinterpret_cast<uint4*>(&Xs[xr0 + 32][xc]) = rx1;
        {
            const u32 words[4] = {rw.x, rw.y, rw.z, rw.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 q[4];
                unpack_int4_pairs(words[i], q);  // 8 values n - 8, in element order, exact fp16
                *reinterpret_cast<uint4*>(&Ws[wr][(wc + i) * 8]) = make_uint4(q[0], q[1], q[2], q[3]);
            }
        }
        __syncthreads();  // the tile is in shared memory
        if (kt + 1 < ktiles) load(kt + 1);  // next tile's loads fly during the mma loop

#pragma unroll
        for (int ks = 0; ks < MMA_BK; ks += 16) {
            u32 a[2][4], b[4][2];
            const int r = lane / 4, c = ks + (lane % 4) * 2;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int mr = wm * 32 + i * 16 + r;
                a[i][0] = *reinterpret_cast<const u32*>(&Xs[mr][c]);
                a[i][1] = *reinterpret_cast<const u32*>(&Xs[mr + 8][c]);
                a[i][2] = *reinterpret_cast<const u32*>(&Xs[mr][c + 8]);
                a[i][3] = *reinterpret_cast<const u32*>(&Xs[mr + 8][c + 8]);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int nr = wn * 32 + j * 8 + r;
                b[j][0] = *reinterpret_cast<const u32*>(&Ws[nr][c]);
                b[j][1] = *reinterpret_cast<const u32*>(&Ws[nr][c + 8]);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_16816(acc[i][j], a[i], b[j]);
        }
        if ((kt * MMA_BK + MMA_BK) % 128 == 0) {  // a 128-group is complete: scale it into the total
            const int g = (kt * MMA_BK) / 128;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float s0 = h2f(__ldg(scales + (size_t)scol[j][0] * groups + g));
                const float s1 = h2f(__ldg(scales + (size_t)scol[j][1] * groups + g));
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    tot[i][j][0] = fmaf(acc[i][j][0], s0, tot[i][j][0]);
                    tot[i][j][1] = fmaf(acc[i][j][1], s1, tot[i][j][1]);
                    tot[i][j][2] = fmaf(acc[i][j][2], s0, tot[i][j][2]);
                    tot[i][j][3] = fmaf(acc[i][j][3], s1, tot[i][j][3]);
                    acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
                }
            }
        }
        __syncthreads();  // everyone is done reading the tile before the next one is stored
    }

    // C fragment: c0, c1 at (row lane/4, cols (lane%4)*2 + {0,1}); c2, c3 eight rows below.
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = n0 + wn * 32 + j * 8 + (lane % 4) * 2;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + wm * 32 + i * 16 + lane / 4 + h * 8;
                if (row >= T) continue;
                if (col < N) y[(size_t)row * N + col] = tot[i][j][2 * h];
                if (col + 1 < N) y[(size_t)row * N + col + 1] = tot[i][j][2 * h + 1];
            }
        }
}

// ---- prefill, pipelined: int4_mma_pipe_f32, int4_mma_pipe64_f32 (int4_pipe.cuh) --------------------
// x fp16 [T, K], qweight uint32 [N, K/8], scales fp16 [N, K/128] -> y fp32 [T, N]; K % 128 == 0.
extern "C" __global__ void __launch_bounds__(256, 1)
int4_mma_pipe_f32(const f16_bits* x, const u32* qweight, const f16_bits* scales, float* y, int T, int N, int K) {
    int4_mma_pipe<4>(x, qweight, SymGroups{scales, K / 128}, y, T, N, K);
}
extern "C" __global__ void __launch_bounds__(256, 2)
int4_mma_pipe64_f32(const f16_bits* x, const u32* qweight, const f16_bits* scales, float* y, int T, int N, int K) {
    int4_mma_pipe<2>(x, qweight, SymGroups{scales, K / 128}, y, T, N, K);
}

// ---- prefill on wgmma (sm_90a): int4_wgmma_f32 (int4_wgmma.cuh) ----------------------------------------
// The same arguments and sums, x as its tensor map (fp16 [T, K], 64 x 128 boxes, 128-byte swizzle: kernels/cuda/
// linear.py launch_wgmma), then the spread launch's carry and flags (null: one block a tile); 384 threads,
// WG_SMEM bytes of dynamic shared memory, the grid as int4_wgmma.cuh says.
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
int4_wgmma_f32(const __grid_constant__ TmaMap xmap, const u32* qweight, const f16_bits* scales, float* y, int T,
               int N, int K, float* carry, unsigned* flags) {
    int4_wgmma_entry(xmap, qweight, SymGroups{scales, K / 128}, y, T, N, K, carry, flags);
}
