// rope.cu: RoPE on q and k, and the KV page write, for T tokens at device positions.
// Mirrors NumpyBackend.rope_kv_write: rotate-half convention of Hugging Face's Qwen2
// (x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]), angles in fp32 as pos * inv_freq[i].
// inv_freq (fp32 [d/2], theta^(-2i/d)) is computed once on the host by the launcher, the way NumPy
// computes it, so both backends rotate by bit-identical angles; cos/sin are CUDA's accurate cosf/sinf.
//
// Positions and the page table are read here, on the device (never baked in as host ints), so a
// captured decode step stays valid as the sequence grows across page boundaries.
// Layout: qkv fp16 [T, (nq + 2 nkv) d] = [q | k | v]; q_out fp16 [T, nq, d];
// k_pages / v_pages fp16 [P, nkv, 16, d]; token at position p -> page page_table[p / 16], slot p % 16.
#include "common.cuh"

#define PAGE 16

// Grid (T, any number of blocks), any block size.
extern "C" __global__ void rope_kv_write_f16(const f16_bits* __restrict__ qkv, const int* __restrict__ positions,
                                             const float* __restrict__ inv_freq, f16_bits* __restrict__ k_pages,
                                             f16_bits* __restrict__ v_pages, const int* __restrict__ page_table,
                                             f16_bits* __restrict__ q_out, int nq, int nkv, int d) {
    pdl_enter();  // common.cuh: qkv is the previous kernel's output
    const int t = blockIdx.x, half = d / 2;
    const int pos = positions[t];
    const size_t page = (size_t)page_table[pos / PAGE];
    const int slot = pos % PAGE;
    const f16_bits* row = qkv + (size_t)t * (nq + 2 * nkv) * d;
    const float fpos = (float)pos;

    // Grid (T, blocks): the block's threads stride over the token's work together.
    const int first = blockIdx.y * blockDim.x + threadIdx.x, stride = gridDim.y * blockDim.x;
    // Rotation pairs (i, i + d/2) of every q head, then every k head.
    for (int idx = first; idx < (nq + nkv) * half; idx += stride) {
        const int h = idx / half, i = idx % half;
        const float ang = fpos * inv_freq[i];
        const float c = cosf(ang), s = sinf(ang);
        const float x1 = h2f(row[h * d + i]), x2 = h2f(row[h * d + i + half]);
        const f16_bits o1 = f2h(x1 * c - x2 * s), o2 = f2h(x2 * c + x1 * s);
        if (h < nq) {
            f16_bits* q = q_out + ((size_t)t * nq + h) * d;
            q[i] = o1;
            q[i + half] = o2;
        } else {
            f16_bits* k = k_pages + ((page * nkv + (h - nq)) * PAGE + slot) * d;
            k[i] = o1;
            k[i + half] = o2;
        }
    }
    // V is written as is.
    for (int idx = first; idx < nkv * d; idx += stride) {
        const int h = idx / d, i = idx % d;
        v_pages[((page * nkv + h) * PAGE + slot) * d + i] = row[(nq + nkv) * d + idx];
    }
}
