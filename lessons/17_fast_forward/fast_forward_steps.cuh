// GENERATED from solutions/17_fast_forward/fast_forward_steps.cuh by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
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
/// consecutive threads take consecutive pieces of a row. The caller commits the group. `copies`:
/// a kernels::AsyncCopies (the tests' probe passes one that also logs where each copy goes).
template <typename T, int D, int kRows, typename Copies>
__device__ __forceinline__ void issue_tile_copies(Copies& copies, T* tile, const T* src, int64_t row0, int n) {
  static_assert(kRows * (D / 8) % kThreads == 0, "a tile is a whole number of pieces for every thread");
  // BEGIN YOUR CODE task 1: the tile's copies, issued all at once
  // TODO(lesson 17, task 1): every piece of 16 bytes of the tile started with copies.copy16, each
  // thread's pieces known at compile time; zeros where the rows end. README, "Task 1". Delete the
  // #define below once written: the task 1 test waits for it.
  #define CP_LESSON17_TASK1_NOT_STARTED 1
  (void)copies, (void)tile, (void)src, (void)row0, (void)n;
  // END YOUR CODE
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
  // BEGIN YOUR CODE task 3: the softmax in base 2, tests only where the tile is cut
  // TODO(lesson 17, task 3): lesson 16's softmax_tile with one multiply per score for scale and
  // base, 2^x in place of e^x, and no per-score test when the tile is not cut. README, "Task 3".
  // Delete the #define below once written: the task 3 test waits for it.
  #define CP_LESSON17_TASK3_NOT_STARTED 1
  (void)s, (void)o, (void)m, (void)l, (void)kpos_tile, (void)n, (void)first, (void)last, (void)scale_log2,
  (void)lane;
  // END YOUR CODE
}

/// Versions 4 and up: 128 query rows a block, 32 a warp, as two groups of lesson 16's 16 rows
/// (group i of warp w: rows 32·w + 16·i … 32·w + 16·i + 15 of the block). Lane (g, t) holds of
/// each group the rows and columns of lesson 16's C fragments.
constexpr int kGroups = 2;
constexpr int kWideRows = kGroups * 16 * kWarps;

/// Task 4 (version 4). s[i][nt] = Q · Kᵀ for group i of the warp's rows and keys 8·nt … 8·nt + 7,
/// float32, unscaled and unmasked, where Q is read from `q_tile` ([kWideRows][kLd<D>] in shared
/// memory; it stays there, no Q fragment is kept from tile to tile) and K from `k_tile` ([kBc][kLd<D>]).
/// Every ldmatrix is an .x4 (four 8×8 matrices), and every fragment of K it loads is multiplied
/// with both groups' Q.
template <typename T, int D>
__device__ __forceinline__ void compute_scores_wide(FragC (&s)[kGroups][kBc / 8], const T* q_tile, const T* k_tile,
                                                    int warp, int lane) {
  // BEGIN YOUR CODE task 4: S for two groups, every ldmatrix .x4
  // TODO(lesson 17, task 4): s[i][nt] in C's layout: Q·Kᵀ of group i's 16 rows and keys 8nt … 8nt+7,
  // summed over all D dims; Q and K both by ldmatrix .x4, each K fragment used by both groups.
  // README, "Task 4". Delete the #define below once written: the task 4 test waits for it.
  #define CP_LESSON17_TASK4_NOT_STARTED 1
  (void)s, (void)q_tile, (void)k_tile, (void)warp, (void)lane;
  // END YOUR CODE
}

/// Task 4 (version 4). o[i][dt] += P · V for group i and dims 8·dt … 8·dt + 7: P in s (group i's
/// softmax_tile_exp2), rounded to T as the A operand; V from `v_tile` ([kBc][kLd<D>], keys × dims)
/// by ldmatrix .x4.trans, every fragment of V multiplied with both groups' P.
template <typename T, int D>
__device__ __forceinline__ void accumulate_pv_wide(FragC (&o)[kGroups][D / 8], const FragC (&s)[kGroups][kBc / 8],
                                                   const T* v_tile, int lane) {
  // BEGIN YOUR CODE task 4: O += P·V for two groups, V by .x4.trans
  // TODO(lesson 17, task 4): o[i][dt] must gain P·V of this tile for group i and dims 8dt … 8dt+7, P from
  // s rounded to T, V by ldmatrix .x4.trans, each V fragment used by both groups. README, "Task 4".
  (void)o, (void)s, (void)v_tile, (void)lane;
  // END YOUR CODE
}

}  // namespace cp::fast_forward
