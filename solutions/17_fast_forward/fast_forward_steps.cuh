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
  // BEGIN SOLUTION task 4: S for two groups, every ldmatrix .x4
  // STUB: // TODO(lesson 17, task 4): s[i][nt] in C's layout: Q·Kᵀ of group i's 16 rows and keys 8nt … 8nt+7,
  // STUB: // summed over all D dims; Q and K both by ldmatrix .x4, each K fragment used by both groups.
  // STUB: // README, "Task 4". Delete the #define below once written: the task 4 test waits for it.
  // STUB: #define CP_LESSON17_TASK4_NOT_STARTED 1
  // STUB: (void)s, (void)q_tile, (void)k_tile, (void)warp, (void)lane;
CP_FRAGMENT_LOOP
  for (int i = 0; i < kGroups; ++i)
CP_FRAGMENT_LOOP
    for (int nt = 0; nt < kBc / 8; ++nt) s[i][nt] = FragC{};
CP_FRAGMENT_LOOP
  for (int kk = 0; kk < D / 16; ++kk) {
    FragA qa[kGroups];  // dims 16kk … 16kk+15 of each group's rows, as lesson 16's task 1 loads them
CP_FRAGMENT_LOOP
    for (int i = 0; i < kGroups; ++i)
      kernels::ldmatrix_x4(qa[i].x, q_tile + (32 * warp + 16 * i + lane % 16) * kLd<D> + 16 * kk + 8 * (lane / 16));
CP_FRAGMENT_LOOP
    for (int nt = 0; nt < kBc / 8; nt += 2) {
      // Matrices 0, 1: keys 8nt … 8nt+7, dims 16kk … +7 and 16kk+8 … +15 (nt's B fragment);
      // matrices 2, 3: the same for keys 8(nt+1) … (nt+1's). Lane l gives row l % 8 of matrix l / 8.
      uint32_t kb[4];
      kernels::ldmatrix_x4(kb, k_tile + (8 * nt + 8 * (lane / 16) + lane % 8) * kLd<D> + 16 * kk + 8 * ((lane / 8) % 2));
      const FragB b0{{kb[0], kb[1]}}, b1{{kb[2], kb[3]}};
CP_FRAGMENT_LOOP
      for (int i = 0; i < kGroups; ++i) {
        kernels::mma<T>(s[i][nt], qa[i], b0);
        kernels::mma<T>(s[i][nt + 1], qa[i], b1);
      }
    }
  }
  // END SOLUTION
}

/// Task 4 (version 4). o[i][dt] += P · V for group i and dims 8·dt … 8·dt + 7: P in s (group i's
/// softmax_tile_exp2), rounded to T as the A operand; V from `v_tile` ([kBc][kLd<D>], keys × dims)
/// by ldmatrix .x4.trans, every fragment of V multiplied with both groups' P.
template <typename T, int D>
__device__ __forceinline__ void accumulate_pv_wide(FragC (&o)[kGroups][D / 8], const FragC (&s)[kGroups][kBc / 8],
                                                   const T* v_tile, int lane) {
  // BEGIN SOLUTION task 4: O += P·V for two groups, V by .x4.trans
  // STUB: // TODO(lesson 17, task 4): o[i][dt] must gain P·V of this tile for group i and dims 8dt … 8dt+7, P from
  // STUB: // s rounded to T, V by ldmatrix .x4.trans, each V fragment used by both groups. README, "Task 4".
  // STUB: (void)o, (void)s, (void)v_tile, (void)lane;
CP_FRAGMENT_LOOP
  for (int kk = 0; kk < kBc / 16; ++kk) {
    FragA pa[kGroups];  // lesson 16's task 3: two C fragments of P are one A fragment
CP_FRAGMENT_LOOP
    for (int i = 0; i < kGroups; ++i) {
      pa[i].x[0] = kernels::pack2<T>(s[i][2 * kk].x[0], s[i][2 * kk].x[1]);
      pa[i].x[1] = kernels::pack2<T>(s[i][2 * kk].x[2], s[i][2 * kk].x[3]);
      pa[i].x[2] = kernels::pack2<T>(s[i][2 * kk + 1].x[0], s[i][2 * kk + 1].x[1]);
      pa[i].x[3] = kernels::pack2<T>(s[i][2 * kk + 1].x[2], s[i][2 * kk + 1].x[3]);
    }
CP_FRAGMENT_LOOP
    for (int dt = 0; dt < D / 8; dt += 2) {
      // Matrices 0, 1: keys 16kk … +7 and 16kk+8 … +15 of dims 8dt … +7; 2, 3: of dims 8(dt+1) … +7.
      uint32_t vb[4];
      kernels::ldmatrix_x4_trans(vb, v_tile + (16 * kk + lane % 16) * kLd<D> + 8 * dt + 8 * (lane / 16));
      const FragB b0{{vb[0], vb[1]}}, b1{{vb[2], vb[3]}};
CP_FRAGMENT_LOOP
      for (int i = 0; i < kGroups; ++i) {
        kernels::mma<T>(o[i][dt], pa[i], b0);
        kernels::mma<T>(o[i][dt + 1], pa[i], b1);
      }
    }
  }
  // END SOLUTION
}

}  // namespace cp::fast_forward
