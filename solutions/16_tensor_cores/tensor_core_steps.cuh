// Lesson 16 — the steps of the matrix-unit forward that you write, one device function each, so
// that each can be tested on its own (tests/16_tensor_cores_probes.cu runs them on known tiles)
// and tensor_core_attention.cu calls them in its frame.
//
// One warp owns 16 query rows. Lane (g, t) holds, of every C fragment, rows g and g + 8 of those
// 16 (index r = 0 and 1 below) and the columns kernels/mma_map.h names. Shared-memory tiles are
// row-major with kLd<D> elements a row.
#pragma once

#include <climits>
#include <cstdint>

#include "block_attention.cuh"
#include "common/error.h"
#include "kernels/mma.cuh"
#include "kernels/warp.cuh"

namespace cp::tensor_core {

using kernels::FragA;
using kernels::FragB;
using kernels::FragC;

constexpr int kWarps = 4;
constexpr int kBr = 16 * kWarps;  // query rows per block: 16 per warp, the rows of an mma
constexpr int kBc = 64;           // keys per tile

/// Shared-memory rows of D 16-bit elements and 8 of padding: 16 more bytes per row put the 8 rows
/// an ldmatrix reads at once on different banks, and keep every row 16-byte aligned.
template <int D>
constexpr int kLd = D + 8;

/// The larger of a and b, where a NaN in either wins (fmaxf drops it).
__device__ __forceinline__ float max_keep_nan(float a, float b) { return (a > b || a != a) ? a : b; }

/// Task 1. q_frag[kk] holds, as an A operand, the warp's 16 query rows (rows 16·warp … 16·warp + 15
/// of `q_tile`, [kBr][kLd<D>] in shared memory) and their dims 16·kk … 16·kk + 15.
template <typename T, int D>
__device__ __forceinline__ void load_q_fragments(FragA (&q_frag)[D / 16], const T* q_tile, int warp, int lane) {
  // BEGIN SOLUTION task 1: Q fragments
  // STUB: // TODO(lesson 16, task 1): q_frag[kk], for every kk < D/16, must hold in A's layout the warp's 16 rows
  // STUB: // of q_tile and dims 16kk … 16kk+15. README, "Task 1". Delete the #define below once written: the
  // STUB: // task 1 tests wait for it.
  // STUB: #define CP_LESSON16_TASK1_NOT_STARTED 1
  // STUB: (void)q_frag, (void)q_tile, (void)warp, (void)lane;
CP_FRAGMENT_LOOP
  for (int kk = 0; kk < D / 16; ++kk)
    kernels::ldmatrix_x4(q_frag[kk].x, q_tile + (16 * warp + lane % 16) * kLd<D> + 16 * kk + 8 * (lane / 16));
  // END SOLUTION
}

/// Task 1. s[nt] = Q · Kᵀ for the warp's 16 rows and keys 8·nt … 8·nt + 7 of `k_tile` ([kBc][kLd<D>]
/// in shared memory), in float32, unscaled and unmasked.
template <typename T, int D>
__device__ __forceinline__ void compute_scores(FragC (&s)[kBc / 8], const FragA (&q_frag)[D / 16], const T* k_tile,
                                               int lane) {
  // BEGIN SOLUTION task 1: S = Q·Kᵀ
  // STUB: // TODO(lesson 16, task 1): s[nt], for every nt < kBc/8, must hold in C's layout Q·Kᵀ of the warp's 16
  // STUB: // rows and keys 8nt … 8nt+7 of k_tile, summed over all D dims. README, "Task 1".
  // STUB: (void)s, (void)q_frag, (void)k_tile, (void)lane;
CP_FRAGMENT_LOOP
  for (int nt = 0; nt < kBc / 8; ++nt) {
    s[nt] = FragC{};
CP_FRAGMENT_LOOP
    for (int kk = 0; kk < D / 16; ++kk) {
      FragB kb;  // B[dim][key] = K[key][dim]: K's rows are B's columns, as ldmatrix gives them
      kernels::ldmatrix_x2(kb.x, k_tile + (8 * nt + lane % 8) * kLd<D> + 16 * kk + 8 * ((lane / 8) % 2));
      kernels::mma<T>(s[nt], q_frag[kk], kb);
    }
  }
  // END SOLUTION
}

/// Task 2. One tile of the online softmax on fragments. On entry s holds the raw scores of the
/// warp's rows against the tile's keys; key j of the tile is at position kpos_tile[j] and exists
/// for j < n; row r of this lane sees the positions [first[r], last[r]]. m[r] is row r's maximum
/// so far (the same in the whole quad), l[r] this lane's part of the row's sum of p, o[dt] the
/// row's unnormalised output. On return: s holds p = exp(scale·s − m_new) (0 where hidden), m the
/// new maxima, l and o rescaled to them with this tile's p added to l. A row that has seen no key
/// keeps m = −inf, l = 0 and o = 0; no NaN from a hidden key.
template <int D>
__device__ __forceinline__ void softmax_tile(FragC (&s)[kBc / 8], FragC (&o)[D / 8], float (&m)[2], float (&l)[2],
                                             const int64_t* kpos_tile, int n, const int64_t (&first)[2],
                                             const int64_t (&last)[2], float scale, int lane) {
  // BEGIN SOLUTION task 2: the mask and the online softmax on fragments
  // STUB: // TODO(lesson 16, task 2): afterwards each element of s holds p = exp(scale·s − m) if its key is visible
  // STUB: // to its row by the global positions, else 0; m is each row's maximum so far (the same in its quad),
  // STUB: // l this lane's part of its row's sum, and l and o are rescaled to the new m. README, "Task 2".
  // STUB: // Delete the #define below once written: the task 2 tests wait for it.
  // STUB: #define CP_LESSON16_TASK2_NOT_STARTED 1
  // STUB: (void)s, (void)o, (void)m, (void)l, (void)kpos_tile, (void)n, (void)first, (void)last, (void)scale,
  // STUB: (void)lane;
  float tile_max[2] = {-INFINITY, -INFINITY};
CP_FRAGMENT_LOOP
  for (int nt = 0; nt < kBc / 8; ++nt)
CP_FRAGMENT_LOOP
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2, key = 8 * nt + kernels::frag_c_col(lane, e);
      const int64_t pos = kpos_tile[key];
      const bool visible = key < n && first[r] <= pos && pos <= last[r];
      s[nt].x[e] = visible ? s[nt].x[e] * scale : -INFINITY;
      tile_max[r] = max_keep_nan(tile_max[r], s[nt].x[e]);
    }
  float alpha[2];
CP_FRAGMENT_LOOP
  for (int r = 0; r < 2; ++r) {
    // The row's 64 scores lie in the 4 lanes of the quad: two shuffles give each the maximum.
    tile_max[r] = max_keep_nan(tile_max[r], __shfl_xor_sync(kernels::kFullWarp, tile_max[r], 1));
    tile_max[r] = max_keep_nan(tile_max[r], __shfl_xor_sync(kernels::kFullWarp, tile_max[r], 2));
    const float m_new = max_keep_nan(m[r], tile_max[r]);
    alpha[r] = m_new == -INFINITY ? 1.0f : expf(m[r] - m_new);  // 0 on the row's first visible tile
    m[r] = m_new;
    l[r] *= alpha[r];
  }
CP_FRAGMENT_LOOP
  for (int nt = 0; nt < kBc / 8; ++nt)
CP_FRAGMENT_LOOP
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2;
      s[nt].x[e] = s[nt].x[e] == -INFINITY ? 0.0f : expf(s[nt].x[e] - m[r]);  // s becomes p
      l[r] += s[nt].x[e];
    }
CP_FRAGMENT_LOOP
  for (int dt = 0; dt < D / 8; ++dt)
CP_FRAGMENT_LOOP
    for (int e = 0; e < 4; ++e) o[dt].x[e] *= alpha[e / 2];
  // END SOLUTION
}

/// Task 3. o[dt] += P · V for dims 8·dt … 8·dt + 7: p in s (softmax_tile's), rounded to T as the
/// A operand, V from `v_tile` ([kBc][kLd<D>] in shared memory, keys × dims).
template <typename T, int D>
__device__ __forceinline__ void accumulate_pv(FragC (&o)[D / 8], const FragC (&s)[kBc / 8], const T* v_tile,
                                              int lane) {
  // BEGIN SOLUTION task 3: O += P·V with P as the A operand
  // STUB: // TODO(lesson 16, task 3): o[dt] must gain P·V of this tile for the warp's 16 rows and dims 8dt … 8dt+7,
  // STUB: // P taken from s in registers, rounded to T, and V read from v_tile. README, "Task 3".
  // STUB: (void)o, (void)s, (void)v_tile, (void)lane;
CP_FRAGMENT_LOOP
  for (int kk = 0; kk < kBc / 16; ++kk) {
    // C fragments of keys 16kk … 16kk+7 and 16kk+8 … 16kk+15 are, element for element, the
    // halves of an A fragment over those 16 keys (kernels/mma_map.h): no shared memory needed.
    FragA pa;
    pa.x[0] = kernels::pack2<T>(s[2 * kk].x[0], s[2 * kk].x[1]);          // row g,   keys 2t, 2t+1
    pa.x[1] = kernels::pack2<T>(s[2 * kk].x[2], s[2 * kk].x[3]);          // row g+8
    pa.x[2] = kernels::pack2<T>(s[2 * kk + 1].x[0], s[2 * kk + 1].x[1]);  // row g,   keys 2t+8, 2t+9
    pa.x[3] = kernels::pack2<T>(s[2 * kk + 1].x[2], s[2 * kk + 1].x[3]);  // row g+8
CP_FRAGMENT_LOOP
    for (int dt = 0; dt < D / 8; ++dt) {
      FragB vb;  // B[key][dim] = V[key][dim]: row-major, read transposed
      kernels::ldmatrix_x2_trans(vb.x, v_tile + (16 * kk + lane % 16) * kLd<D> + 8 * dt);
      kernels::mma<T>(o[dt], pa, vb);
    }
  }
  // END SOLUTION
}

/// Task 3. The rows' results: out = O / l and lse = m + log l for this lane's two rows, each
/// row's l first summed over its quad; a row that saw no key gets out = 0 and lse = −inf.
/// out_rows[r]: row r's D outputs in global memory (null for a row past Sq); lane 4g writes lse.
template <typename T, int D>
__device__ __forceinline__ void finish_rows(T* const (&out_rows)[2], float* const (&lse_rows)[2],
                                            const FragC (&o)[D / 8], const float (&m)[2], float (&l)[2], int lane) {
  // BEGIN SOLUTION task 3: out and lse
  // STUB: // TODO(lesson 16, task 3): for each row with an out_rows pointer, out = O / l in T with l the whole
  // STUB: // row's sum, and lse = m + log l (natural log) written once; a row that saw no key gets 0 and −inf.
  // STUB: // README, "Task 3".
  // STUB: (void)out_rows, (void)lse_rows, (void)o, (void)m, (void)l, (void)lane;
  float inv_l[2];
CP_FRAGMENT_LOOP
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(kernels::kFullWarp, l[r], 1);
    l[r] += __shfl_xor_sync(kernels::kFullWarp, l[r], 2);
    inv_l[r] = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
  }
CP_FRAGMENT_LOOP
  for (int dt = 0; dt < D / 8; ++dt)
CP_FRAGMENT_LOOP
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2;
      if (out_rows[r])
        out_rows[r][8 * dt + kernels::frag_c_col(lane, e)] = kernels::from_float<T>(o[dt].x[e] * inv_l[r]);
    }
  for (int r = 0; r < 2; ++r)
    if (lse_rows[r] && lane % 4 == 0)
      *lse_rows[r] = l[r] == 0.0f ? -INFINITY : m[r] == INFINITY ? INFINITY : m[r] + logf(l[r]);
  // END SOLUTION
}

// ── The frame's pieces that the kernels of lessons 16 and 17 share (given) ────────────────────

/// The checks of a launch of a kernel built on these steps (lesson 16's, lesson 17's versions):
/// a cp::Error naming `kernel` for float32, another head dim, a grid CUDA cannot launch, or q, k,
/// v not 16-byte aligned (the tiles are loaded 16 bytes at a time).
inline void check_launch(const char* kernel, const void* q, const void* k, const void* v,
                         const BlockAttentionParams& p, DType dtype) {
  CP_CHECK(dtype != DType::Float32, kernel, ": the matrix units take float16 or bfloat16, got float32");
  CP_CHECK(p.head_dim == 64 || p.head_dim == 128, kernel, ": unsupported head dim ", p.head_dim, " (64 or 128)");
  CP_CHECK(p.batch * p.heads_q <= INT32_MAX && (p.seq_q + kBr - 1) / kBr <= 65535, kernel,
           ": grid too large (B·Hq = ", p.batch * p.heads_q, ", Sq = ", p.seq_q, ")");
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  CP_CHECK(aligned(q) && aligned(k) && aligned(v), kernel, ": q, k and v must start on a 16-byte boundary (the ",
           "tiles are loaded 16 bytes at a time)");
}

/// A lane's two rows of its warp's 16 (r = 0: row g, r = 1: row g + 8, kernels/mma_map.h), as
/// rows of the head, and the key positions each sees, [first, last]. A row past Sq sees nothing
/// (first > last) and stays: it joins every barrier and shuffle, and writes nothing.
struct LaneRows {
  int64_t row[2], first[2], last[2];
};

__device__ __forceinline__ LaneRows lane_rows(int64_t row0, int warp, int lane, const BlockAttentionParams& p,
                                              const int64_t* q_first, const int64_t* q_last) {
  LaneRows rows;
  for (int r = 0; r < 2; ++r) {
    rows.row[r] = row0 + 16 * warp + kernels::frag_c_row(lane, 2 * r);
    const bool active = rows.row[r] < p.seq_q;
    rows.first[r] = !active ? LLONG_MAX : p.masked ? q_first[rows.row[r]] : LLONG_MIN;
    rows.last[r] = !active ? LLONG_MIN : p.masked ? q_last[rows.row[r]] : LLONG_MAX;
  }
  return rows;
}

/// finish_rows for a lane's rows of head bh: out [.., Sq, D] and lse [.., Sq], nothing past Sq.
template <typename T, int D>
__device__ __forceinline__ void finish_head_rows(T* out, float* lse, int64_t bh, const LaneRows& rows,
                                                 const BlockAttentionParams& p, const FragC (&o)[D / 8],
                                                 const float (&m)[2], float (&l)[2], int lane) {
  T* out_rows[2];
  float* lse_rows[2];
  for (int r = 0; r < 2; ++r) {
    const bool active = rows.row[r] < p.seq_q;
    out_rows[r] = active ? out + (bh * p.seq_q + rows.row[r]) * D : nullptr;
    lse_rows[r] = active ? lse + bh * p.seq_q + rows.row[r] : nullptr;
  }
  finish_rows<T, D>(out_rows, lse_rows, o, m, l, lane);
}

}  // namespace cp::tensor_core
