// GENERATED from solutions/18_fast_backward/fast_backward_steps.cuh by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 18 — the steps of the matrix-unit backward that you write, one device function each:
// tests/18_fast_backward_probes.cu runs them on their own, fast_backward.cu calls them in its
// frame. Lesson 16's steps (load_q_fragments, compute_scores, accumulate_pv) do every product.
//
// Two kernels (fast_backward.cu): one owns 64 keys and makes their dK, dV; one owns 64 query
// rows and makes their dQ. A warp owns 16 rows of its block's tile, the rows of an mma; a C
// fragment's element e of lane (g, t) is row g (e < 2) or g + 8 of the warp's 16, and column
// 8·nt + kernels::frag_c_col(lane, e) of the other tile.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/mma.cuh"
#include "tensor_core_steps.cuh"  // lesson 16's steps: the fragments, kBr = kBc = 64, kLd

namespace cp::fast_backward {

using namespace cp::tensor_core;

constexpr int kThreads = kWarps * kernels::kWarpSize;

/// What the steps need of a tile of 64 query rows: per row its lse and Δ = rowsum(dO ∘ O), and
/// the key positions it sees, [first, last] (a row past Sq: first > last). In shared memory.
struct QueryRows {
  float lse[kBr];
  float delta[kBr];
  int64_t first[kBr];
  int64_t last[kBr];
};

/// Task 1. P and dS of a tile, in the layout the scores come in. On entry s[nt] holds the warp's
/// 16 × 64 block of scores q·k (unscaled) and dp[nt] the same block of dO·v, both C fragments:
///   kKeyRows = false: rows are query rows 16·warp … of `rows`, columns the tile's keys (S, dP);
///   kKeyRows = true:  rows are keys 16·warp … of `key_pos`, columns the query rows (Sᵀ, dPᵀ).
/// On return s holds, in the same layout, each pair's probability exp(scale·q·k − lse of its
/// query row), and dp its dS = P ∘ (dP − Δ of its query row); both 0 for a pair the mask hides
/// (a key at or past n_keys, a query row that does not see the key's position, a row past Sq),
/// whatever the scores hold there. Row r of `rows` sees the key positions [first[r], last[r]].
template <bool kKeyRows>
__device__ __forceinline__ void tile_gradients(FragC (&s)[8], FragC (&dp)[8], const QueryRows& rows,
                                               const int64_t* key_pos, int n_keys, float scale, int warp, int lane) {
  static_assert(kBr == 64 && kBc == 64, "8 fragments of 8 columns: 64 keys or 64 query rows");
  // BEGIN YOUR CODE task 1: P and dS, elementwise in the layout the scores come in
  // TODO(lesson 18, task 1): s becomes P and dp becomes dS, element by element, in either layout; a
  // hidden pair gives 0. README, "Task 1". Delete the #define below once written: the task 1 tests
  // wait for it.
  #define CP_LESSON18_TASK1_NOT_STARTED 1
  (void)s, (void)dp, (void)rows, (void)key_pos, (void)n_keys, (void)scale, (void)warp, (void)lane;
  // END YOUR CODE
}

}  // namespace cp::fast_backward
