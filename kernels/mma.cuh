// The matrix units of a warp (tensor cores), for float16 and bfloat16 inputs with float32
// accumulators: the fragments of mma.m16n8k16, the loads that fill them from shared memory
// (ldmatrix) and the product itself.
//
// One mma.m16n8k16 computes D = A·B + C for A 16×16, B 16×8, C and D 16×8, spread over the 32
// lanes of a warp: each lane holds 8 elements of A, 4 of B and 4 of C/D in registers. Which lane
// holds which element is fixed by the hardware, and a kernel that gets it wrong computes garbage.
// The map is code, kernels/mma_map.h, with its picture; the kernels, the emulation below and the
// tests all read it. Row g of C lives in the quad of lanes 4g … 4g+3: a row's maximum or sum is
// a reduction over the quad, two xor shuffles (offsets 1 and 2).
//
// Where it runs: with nvcc for sm_80 and newer, mma, ldmatrix are the real instructions (inline
// PTX). Under CUDA on the CPU (chipStar, which has no PTX) and on older GPUs they are emulated
// with warp shuffles that move exactly the elements the map says, so a kernel that indexes a
// fragment wrongly fails on the CPU as it would on a GPU. The emulation's products are exact in
// float32 and summed in k order; the hardware's order and rounding inside one mma are its own, so
// the two agree to float32 rounding, not bit for bit. Under CUDA on the CPU the emulated ldmatrix
// also refuses what the hardware refuses, an address outside the shared memory the kernel
// declared or not 16-byte aligned, and what it only slows down, rows of one phase on the same
// banks (kernels/strict_shared.cuh: declare_shared, and the launcher's throw_on_emulation_fault).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/dtype.cuh"
#include "kernels/mma_map.h"
#include "kernels/strict_shared.cuh"
#include "kernels/warp.cuh"

// Loops around fragments: unrolled for the real instructions. Registers cannot be indexed at run
// time, so a fragment array indexed by the variable of a loop left rolled goes to local memory:
// still correct, and slow. Not for the emulation: each shuffle there is a barrier, and PoCL
// compiles a kernel in pieces between barriers, so unrolled shuffles make the kernel's
// compilation minutes longer and its code far bigger, for nothing on a CPU.
#if CP_SM80_PTX
#define CP_FRAGMENT_LOOP _Pragma("unroll")
#else
#define CP_FRAGMENT_LOOP _Pragma("unroll 1")
#endif

namespace cp::kernels {

/// A 16×16 operand of 16-bit elements (T = __half or __nv_bfloat16), element e (0..7) of a lane
/// in register e / 2, low half for even e.
struct FragA {
  uint32_t x[4];
};
/// B, 16×8 (k × n), element e (0..3) in register e / 2.
struct FragB {
  uint32_t x[2];
};
/// C and D, 16×8 float32, element e (0..3) in x[e].
struct FragC {
  float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
};

/// The 16 bits of x in the format T.
template <typename T>
__device__ __forceinline__ uint32_t bits16(float x) {
  const T h = from_float<T>(x);
  uint16_t u;
  memcpy(&u, &h, sizeof u);
  return u;
}

/// Two floats rounded to T and packed in one register, `lo` in the low half: the element pair of
/// an A or B register (FlashAttention-2 turns P's accumulator pairs into A's registers so).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return bits16<T>(lo) | (bits16<T>(hi) << 16);
}

/// The float value of the low (half = 0) or high (half = 1) element of a packed register.
template <typename T>
__device__ __forceinline__ float unpack(uint32_t reg, int half) {
  const uint16_t u = static_cast<uint16_t>(half ? reg >> 16 : reg & 0xffffu);
  T h;
  memcpy(&h, &u, sizeof h);
  return to_float(h);
}

#if !CP_SM80_PTX
/// The lane's value of `reg` in lane `src` (a 32-bit shuffle; every lane must call it).
__device__ __forceinline__ uint32_t pull(uint32_t reg, int src) {
  return static_cast<uint32_t>(__shfl_sync(kFullWarp, static_cast<int>(reg), src));
}
/// An address held by lane `src`, as two 32-bit shuffles.
__device__ __forceinline__ const uint16_t* pull_address(const void* p, int src) {
  const uint64_t a = reinterpret_cast<uint64_t>(p);
  const uint32_t lo = pull(static_cast<uint32_t>(a), src), hi = pull(static_cast<uint32_t>(a >> 32), src);
  return reinterpret_cast<const uint16_t*>((static_cast<uint64_t>(hi) << 32) | lo);
}
/// Records a bank conflict unless each phase of an ldmatrix is free of them. The hardware reads
/// the 8 rows of a matrix (lanes 8m … 8m+7 give their addresses) at once; a row of 16 bytes
/// covers 4 of the 32 banks of 4 bytes, the group (address / 16) mod 8, so the 8 rows need 8
/// different groups. `matrices`: 4 for .x4, 2 for .x2. Every lane calls it.
__device__ __forceinline__ void expect_conflict_free(const void* row, int matrices) {
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  unsigned groups = 1u << ((reinterpret_cast<uintptr_t>(row) / 16) % 8);
  for (int offset = 1; offset < 8; offset *= 2)  // OR over the 8 lanes of the phase
    groups |= static_cast<unsigned>(__shfl_xor_sync(kFullWarp, static_cast<int>(groups), offset));
  expect(lane >= 8 * matrices || groups == 0xffu, kLdmatrixBankConflict);
}
/// Two consecutive 16-bit elements at p (p[0] in the low half).
__device__ __forceinline__ uint32_t load_pair(const uint16_t* p) { return p[0] | (static_cast<uint32_t>(p[1]) << 16); }
/// The registers of ldmatrix .trans with kMatrices matrices: register m of lane (g, t) gets rows
/// 2t and 2t+1, column g of matrix m, whose rows lanes 8m … 8m+7 name.
template <int kMatrices>
__device__ __forceinline__ void load_transposed(uint32_t (&r)[kMatrices], const void* row) {
  const int lane = static_cast<int>(threadIdx.x % kWarpSize), g = lane / 4, t = lane % 4;
  CP_FRAGMENT_LOOP
  for (int m = 0; m < kMatrices; ++m) {
    const uint16_t* even = pull_address(row, 8 * m + 2 * t);
    const uint16_t* odd = pull_address(row, 8 * m + 2 * t + 1);
    r[m] = even[g] | (static_cast<uint32_t>(odd[g]) << 16);
  }
}
#endif

/// ldmatrix .x4: four 8×8 matrices of 16-bit elements from shared memory. Lane i passes the
/// address of row i % 8 of matrix i / 8 (8 consecutive elements, 16-byte aligned; the rows of a
/// matrix may lie anywhere); register m of lane (g, t) receives row g, columns 2t and 2t+1 of
/// matrix m: two neighbours along a stored row, as an A register holds two neighbours in k.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if CP_SM80_PTX
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#else
  const int lane = static_cast<int>(threadIdx.x % kWarpSize), g = lane / 4, t = lane % 4;
  expect_shared_16(row, kLdmatrixNotShared, kLdmatrixMisaligned);
  expect_conflict_free(row, 4);
  CP_FRAGMENT_LOOP
  for (int m = 0; m < 4; ++m) r[m] = load_pair(pull_address(row, 8 * m + g) + 2 * t);
#endif
}

/// ldmatrix .x2: like .x4, with two 8×8 matrices: only lanes 0–15 pass row addresses (lane i,
/// row i % 8 of matrix i / 8), the other lanes' are ignored, and every lane receives its two
/// registers. A B register holds two neighbours in k: this fills B from stored rows that are B's
/// columns.
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* row) {
#if CP_SM80_PTX
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
#else
  const int lane = static_cast<int>(threadIdx.x % kWarpSize), g = lane / 4, t = lane % 4;
  if (lane < 16) expect_shared_16(row, kLdmatrixNotShared, kLdmatrixMisaligned);
  expect_conflict_free(row, 2);
  CP_FRAGMENT_LOOP
  for (int m = 0; m < 2; ++m) r[m] = load_pair(pull_address(row, 8 * m + g) + 2 * t);
#endif
}

/// ldmatrix .x2.trans: the same addresses as .x2, the two matrices transposed: register m of
/// lane (g, t) receives rows 2t and 2t+1, column g of matrix m, two neighbours down a stored
/// column. This fills B from stored rows that are B's rows (a row-major [k][n] tile).
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* row) {
#if CP_SM80_PTX
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
#else
  if (threadIdx.x % kWarpSize < 16) expect_shared_16(row, kLdmatrixNotShared, kLdmatrixMisaligned);
  expect_conflict_free(row, 2);
  load_transposed(r, row);
#endif
}

/// ldmatrix .x4.trans: the addresses of .x4 (lane i, row i % 8 of matrix i / 8), the four
/// matrices transposed as in .x2.trans: two B fragments at once from a row-major [k][n] tile.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if CP_SM80_PTX
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#else
  expect_shared_16(row, kLdmatrixNotShared, kLdmatrixMisaligned);
  expect_conflict_free(row, 4);
  load_transposed(r, row);
#endif
}

/// D = A·B + D (m16n8k16, float32 accumulators), T = __half or __nv_bfloat16. Every lane of the
/// warp must call it with its own fragments (rule 1 of kernels/README.md). `.row.col` in the
/// instruction's name: A is row-major (k runs along a row of A) and B column-major (k runs down a
/// column of B), so each 32-bit register of A or B holds two elements that are neighbours in k.
template <typename T>
__device__ __forceinline__ void mma(FragC& d, const FragA& a, const FragB& b) {
#if CP_SM80_PTX
  static_assert(sizeof(T) == 2, "mma: float16 or bfloat16 inputs");
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d.x[0]), "+f"(d.x[1]), "+f"(d.x[2]), "+f"(d.x[3])
        : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d.x[0]), "+f"(d.x[1]), "+f"(d.x[2]), "+f"(d.x[3])
        : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
  }
#else
  // Lane (g, t) owns D's rows g and g+8, columns 2t and 2t+1. For each pair of k (2kp, 2kp+1,
  // one register of A and of B) it pulls A's rows from its own quad and B's columns from the
  // quads 2t and 2t+1, where the map puts them.
  const int lane = static_cast<int>(threadIdx.x % kWarpSize), g = lane / 4, t = lane % 4;
  CP_FRAGMENT_LOOP
  for (int kp = 0; kp < 8; ++kp) {
    const int src = kp % 4;  // the place in a quad that holds columns (A) or rows (B) 2kp, 2kp+1
    const uint32_t a_lo = pull(a.x[2 * (kp / 4)], 4 * g + src);      // A row g
    const uint32_t a_hi = pull(a.x[2 * (kp / 4) + 1], 4 * g + src);  // A row g+8
    const uint32_t b_0 = pull(b.x[kp / 4], 4 * (2 * t) + src);       // B column 2t
    const uint32_t b_1 = pull(b.x[kp / 4], 4 * (2 * t + 1) + src);   // B column 2t+1
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float b0 = unpack<T>(b_0, h), b1 = unpack<T>(b_1, h);
      const float alo = unpack<T>(a_lo, h), ahi = unpack<T>(a_hi, h);
      d.x[0] += alo * b0;
      d.x[1] += alo * b1;
      d.x[2] += ahi * b0;
      d.x[3] += ahi * b1;
    }
  }
#endif
}

}  // namespace cp::kernels
