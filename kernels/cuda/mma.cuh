// mma.cuh: the tensor-core and async-copy building blocks of the prefill kernels (int4_sym_g128.cu's
// int4_mma_f32 / int4_mma_pipe_f32, paged_attention.cu's attention_prefill_tc_d<D>) and of the decode
// kernels on the tensor cores (gemv_tc.cuh, paged_attention.cu's paged_attention_tc_d<D>), as inline PTX.
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

// The same product for an A whose rows 8-15 are zero (a1 = a3 = 0): only c0, c1 (row r) are kept; rows
// 8-15 of C come out of the instruction and are dropped, so no register holds them between products.
__device__ __forceinline__ void mma_16816_rows8(float (&c)[2], u32 a0, u32 a2, const u32 (&b)[2]) {
    asm volatile("{\n\t.reg .f32 d2, d3;\n\t"
                 "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,d2,d3}, {%2,%3,%4,%3}, {%5,%6}, "
                 "{%0,%1,%7,%7};\n\t}"
                 : "+f"(c[0]), "+f"(c[1])
                 : "r"(a0), "r"(0u), "r"(a2), "r"(b[0]), "r"(b[1]), "f"(0.0f));
}

// a generic pointer into shared memory as the 32-bit shared-window address PTX's shared operands take
__device__ __forceinline__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    const unsigned s = smem_addr(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem) {
    const unsigned s = smem_addr(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem) {
    const unsigned s = smem_addr(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

// Two fp32 probabilities (p0, p1) as an mma A register in two parts whose sum keeps fp32's ~22 bits (the
// precision contract's fp32 probabilities; fp16 alone keeps 11): hi = (p0, p1) rounded to fp16, p0 in the
// low half, and lo = what that rounding lost, rounded to fp16 the same way. Two mmas, one per part, with
// the same B, sum P B exactly in fp32 (the attention kernels' P V; paged_attention.cu).
__device__ __forceinline__ void prob_parts(float p0, float p1, u32& hi, u32& lo) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(p1), "f"(p0));  // low half = p0
    float r0, r1;
    h2x2f(hi, r0, r1);
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(p1 - r1), "f"(p0 - r0));
}

// ---- Hopper (sm_90a): wgmma, mbarriers, register hand-over (int4_wgmma.cuh) ---------------------------
//
// wgmma.mma_async m64n128k16 (fp16 x fp16 -> fp32), issued by a whole warpgroup (4 consecutive warps, the
// first a multiple of 4). A from registers, in mma.sync's A layout per warp: warp i of the warpgroup holds
// rows 16 i .. 16 i + 15 (a0..a3 as mma_16816's). B from shared memory through a descriptor. D (64 fp32 a
// thread): d[4 j + e], j = 0..15 the 8-column block, = (row 16 i + r (+ 8 for e >= 2), column 8 j + 2 c +
// (e & 1)), lane = 4 r + c. It runs asynchronously: the registers it reads (A) and writes (D) may not be
// touched between the issue and wgmma.wait_group, and wgmma.fence must come between any register write
// and the next issue. scale_d = 0 starts D from zero (a fresh partial), 1 accumulates. TRANS_B 0 reads B
// K-major (wgmma_desc_sw128), 1 N-major (wgmma_desc_mn_sw128; fp16 allows either).
template <int TRANS_B = 0>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const u32 (&a)[4], unsigned long long desc_b,
                                                    int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
        "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
        "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %69, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(scale_d), "l"(desc_b), "n"(TRANS_B));
}
// The same for N = 64 (attention_prefill_wg's scores, and its P V at head_dim 64): D is 32 fp32 a thread,
// d[4 j + e] for the 8-column blocks j = 0..7, laid out as above.
template <int TRANS_B = 0>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const u32 (&a)[4], unsigned long long desc_b,
                                                   int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
        "%23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %37, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(scale_d), "l"(desc_b), "n"(TRANS_B));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// The compiler sees wgmma's D as written at the issue; the hardware writes it until the wait. Passing every
// register through an empty asm after the wait (and before the next issue) keeps reads of D after the wait
// and writes of D (the fold) before the fence.
template <int N>
__device__ __forceinline__ void wgmma_touch(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared-memory matrix descriptor for a K-major operand in the 128-byte swizzle: start address in 16-byte
// units, LBO 1 (unused by a swizzled K-major operand), SBO 1024 B (8 rows of 128 B: the next 8 rows in M/N),
// base offset 0 (the atoms are 1024-byte aligned), layout type 1 (SWIZZLE_128B) in bits 62-63. An atom is 8
// rows of 128 B (64 fp16 inputs); 16-byte chunk j of row r sits at chunk j ^ (r % 8). The start address of
// k-step ks (16 inputs, 32 B) inside an atom is atom + 32 ks: the hardware applies the XOR to the address it
// forms, so the step's offset is added unswizzled.
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(const void* smem) {
    const unsigned long long a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    return ((a >> 4) & 0x3FFFull) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
// The same swizzle for an N-major B (TRANS_B 1): an atom is 8 k-rows of 128 B (64 fp16 along N), k-row r's
// 16-byte chunk j at chunk j ^ (r % 8). SBO (1024 B) steps to the next 8 k-rows, LBO (`n_atom_bytes`) to
// the next 64 columns of N (PTX ISA, the wgmma shared-memory layouts: "MN-major, 128B swizzling",
// ((8, 8, m), (8, k)) : ((1, 8, LBO), (64, SBO)) in fp16 elements).
__device__ __forceinline__ unsigned long long wgmma_desc_mn_sw128(const void* smem, unsigned n_atom_bytes) {
    const unsigned long long a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    return ((a >> 4) & 0x3FFFull) | ((unsigned long long)((n_atom_bytes >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
// TMA (cp.async.bulk.tensor): the copy engine moves a box of a tensor global -> shared, no thread's registers
// or load slots on the way, laid out (and swizzled) as the tensor map says. TmaMap is CUtensorMap's 128 bytes,
// encoded on the host (kernels/cuda/loader.py tensor_map_2d) and passed by value as a __grid_constant__
// parameter, whose address the copy takes. The box's bytes count against the mbarrier's expected bytes
// (mbar_arrive_expect_tx), out-of-bounds elements included (they land as zeros).
struct alignas(128) TmaMap {
    unsigned long long opaque[16];
};
__device__ __forceinline__ void tma_prefetch_map(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(map) : "memory");
}
// the box at element coordinates (c0 innermost, c1) into smem; its bytes complete barrier b's expected ones
// (a block's own shared memory is its cluster window's too: no cluster launch needed)
__device__ __forceinline__ void tma_load_2d(void* smem, const TmaMap* map, int c0, int c1, unsigned long long* b) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem_addr(smem)), "l"(map), "r"(c0), "r"(c1), "r"(smem_addr(b)) : "memory");
}

// mbarriers in shared memory (64-bit each). A phase completes when `count` arrivals have come; a waiter
// names the phase by its parity (0 for the first, 1 for the second, ...).
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" :: "r"(smem_addr(b)) : "memory");
}
// an arrival that lands when this thread's earlier cp.async have completed (noinc: counted in `count`)
__device__ __forceinline__ void mbar_arrive_on_copies(unsigned long long* b) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(smem_addr(b)) : "memory");
}
// one arrival that also expects `bytes` more of asynchronous copies (TMA) before the phase can complete
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}" :: "r"(smem_addr(b)), "r"(parity) : "memory");
}
