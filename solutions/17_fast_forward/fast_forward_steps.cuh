// Lesson 17 — the steps of the ladder's versions that you write, one device function each:
// tests/17_fast_forward_probes.cu runs them on their own, fast_forward.cu calls them in its frame.
#pragma once

#include <cstdint>

#include "kernels/async_copy.cuh"
#include "kernels/mma.cuh"
#include "kernels/warp.cuh"
#include "tensor_core_steps.cuh"  // lesson 16's steps: the fragments, kBr, kBc, kLd

namespace cp::fast_forward {

using namespace cp::tensor_core;

constexpr int kThreads = kWarps * kernels::kWarpSize;

/// How many 16-byte copies one thread issues for a tile of kRows rows of D 16-bit elements.
template <int D, int kRows>
constexpr int kCopiesPerThread = kRows * (D / 8) / kThreads;

/// Task 1 (version 2). Starts the copies of rows [row0, row0 + n) of a [rows, D] matrix `src` in
/// global memory into rows 0 … n − 1 of `tile` ([kRows][kLd<D>] in shared memory) with `copies`,
/// without waiting for them, and writes zeros into rows n … kRows − 1 (a tile past the end of the
/// sequence). Every thread of the block calls it and issues kCopiesPerThread<D, kRows> pieces of 16
/// bytes, each at a place the compiler knows (no loop whose trip count depends on the data), and
/// consecutive threads take consecutive pieces of a row. The caller commits the group.
template <typename T, int D, int kRows, int kMax>
__device__ __forceinline__ void issue_tile_copies(kernels::AsyncCopies<kMax>& copies, T* tile, const T* src,
                                                  int64_t row0, int n) {
  static_assert(kRows * (D / 8) % kThreads == 0, "a tile is a whole number of pieces for every thread");
  // BEGIN SOLUTION task 1: the tile's copies, issued all at once
  // STUB: // TODO(lesson 17, task 1): every piece of 16 bytes of the tile started with copies.copy16, each
  // STUB: // thread's pieces known at compile time; zeros where the rows end. README, "Task 1". Delete the
  // STUB: // #define below once written: the task 1 test waits for it.
  // STUB: #define CP_LESSON17_TASK1_NOT_STARTED 1
  // STUB: (void)copies, (void)tile, (void)src, (void)row0, (void)n;
  constexpr int kChunks = D / 8;  // 16-byte pieces of a row
#pragma unroll
  for (int i = 0; i < kCopiesPerThread<D, kRows>; ++i) {
    const int piece = static_cast<int>(threadIdx.x) + i * kThreads, r = piece / kChunks, c = piece % kChunks;
    T* to = tile + r * kLd<D> + 8 * c;
    if (r < n) copies.copy16(to, src + (row0 + r) * D + 8 * c);
    else *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
  }
  // END SOLUTION
}

/// Task 3 (version 3). Lesson 16's softmax_tile in base 2: on entry s holds the raw scores; on
/// return s holds p = 2^(scale_log2·s − m), m each row's maximum of scale_log2·s so far (base-2
/// units: the caller's finish multiplies it by ln 2), l and o rescaled by α = 2^(m_old − m) and l
/// given this tile's p. kCut: whether the tile is cut by the mask (a key missing, or one that some
/// row of the block does not see); an uncut tile is visible to every row whole, and its scores
/// need no test at all. A row that has seen no key keeps m = −inf, l = 0, o = 0; no NaN from a
/// hidden key.
template <int D, bool kCut>
__device__ __forceinline__ void softmax_tile_exp2(FragC (&s)[kBc / 8], FragC (&o)[D / 8], float (&m)[2], float (&l)[2],
                                                  const int64_t* kpos_tile, int n, const int64_t (&first)[2],
                                                  const int64_t (&last)[2], float scale_log2, int lane) {
  // BEGIN SOLUTION task 3: the softmax in base 2, tests only where the tile is cut
  // STUB: // TODO(lesson 17, task 3): lesson 16's softmax_tile with one multiply per score for scale and
  // STUB: // base, 2^x in place of e^x, and no per-score test when the tile is not cut. README, "Task 3".
  // STUB: // Delete the #define below once written: the task 3 test waits for it.
  // STUB: #define CP_LESSON17_TASK3_NOT_STARTED 1
  // STUB: (void)s, (void)o, (void)m, (void)l, (void)kpos_tile, (void)n, (void)first, (void)last, (void)scale_log2,
  // STUB: (void)lane;
  float tile_max[2] = {-INFINITY, -INFINITY};
CP_FRAGMENT_LOOP
  for (int nt = 0; nt < kBc / 8; ++nt)
CP_FRAGMENT_LOOP
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2;
      if constexpr (kCut) {
        const int key = 8 * nt + kernels::frag_c_col(lane, e);
        const int64_t pos = kpos_tile[key];
        const bool visible = key < n && first[r] <= pos && pos <= last[r];
        s[nt].x[e] = visible ? s[nt].x[e] * scale_log2 : -INFINITY;
      } else {
        s[nt].x[e] *= scale_log2;  // every key of the tile is visible to every row
      }
      tile_max[r] = max_keep_nan(tile_max[r], s[nt].x[e]);
    }
  float alpha[2];
CP_FRAGMENT_LOOP
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = max_keep_nan(tile_max[r], __shfl_xor_sync(kernels::kFullWarp, tile_max[r], 1));
    tile_max[r] = max_keep_nan(tile_max[r], __shfl_xor_sync(kernels::kFullWarp, tile_max[r], 2));
    const float m_new = max_keep_nan(m[r], tile_max[r]);
    alpha[r] = m_new == -INFINITY ? 1.0f : exp2f(m[r] - m_new);
    m[r] = m_new;
    l[r] *= alpha[r];
  }
CP_FRAGMENT_LOOP
  for (int nt = 0; nt < kBc / 8; ++nt)
CP_FRAGMENT_LOOP
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2;
      s[nt].x[e] = s[nt].x[e] == -INFINITY ? 0.0f : exp2f(s[nt].x[e] - m[r]);  // s becomes p
      l[r] += s[nt].x[e];
    }
CP_FRAGMENT_LOOP
  for (int dt = 0; dt < D / 8; ++dt)
CP_FRAGMENT_LOOP
    for (int e = 0; e < 4; ++e) o[dt].x[e] *= alpha[e / 2];
  // END SOLUTION
}

}  // namespace cp::fast_forward
