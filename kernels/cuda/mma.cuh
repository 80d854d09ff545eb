// mma.cuh: the tensor-core and async-copy building blocks of the prefill kernels (int4_sym_g128.cu's
// int4_mma_f32 / int4_mma_pipe_f32, paged_attention.cu's attention_prefill_tc_d<D>), as inline PTX.
//
// mma.sync m16n8k16 (fp16 x fp16 -> fp32), the fragment layouts every caller relies on (lane = 4 r + c):
//   A (16 x 16, row-major): a0 = (row r, k 2c..2c+1), a1 = (row r+8, k 2c..), a2 = (row r, k 2c+8..),
//                           a3 = (row r+8, k 2c+8..), two fp16 per register, lower k in the low half;
//   B (16 x 8, "col": element (k, n) of column n is row n of a [n][k] array): b0 = (k 2c..2c+1, n r),
//                           b1 = (k 2c+8.., n r);
//   C (16 x 8, fp32):       c0, c1 = (row r, n 2c, 2c+1), c2, c3 = (row r+8, n 2c, 2c+1).
// ldmatrix.x4 loads four 8 x 8 fp16 matrices whose row addresses come from lanes 0-7, 8-15, 16-23 and
// 24-31; lane T receives row T/4, elements 2(T%4), +1 of each (with .trans, column T/4, rows 2(T%4), +1).
// cp.async copies 16 bytes global -> shared without registers; src_bytes 0 zero-fills the 16 bytes.
#pragma once
#include "common.cuh"

__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
