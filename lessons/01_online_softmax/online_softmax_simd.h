// Lesson 01, given code: task 3's algorithm on float32 rows, with SIMD lanes as the partial states.
//
// row_state (task 3) keeps kLanes partial states, value j going to lane j % kLanes, and merges
// them at the end. Here the lanes are the lanes of a SIMD register: W floats (4, 8 or 16, the
// widest the CPU has, kernels/cpu_simd.h) times kUnroll registers, updated by one vector
// instruction each, and merged at the end with your merge() of task 1. README, "Fast on the CPU:
// one pass wins only in vectors", says why this is what makes the online softmax faster.
#pragma once

#include <softmax_state.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu_simd.h"

namespace cp::softmax_simd {

using kernels::exp_nonpos;
using kernels::fvec;
using kernels::load;
using kernels::max_lane;
using kernels::splat;
using kernels::sum_lanes;
using kernels::store;

/// Registers per step: kUnroll independent exps in flight, and kUnroll · W partial sums.
constexpr int kUnroll = 4;

/// The larger of a and b, lane by lane (one instruction). A NaN value may be dropped here, but it
/// is never lost: its term exp(NaN - m) makes the lane's sum NaN, and so the row's result.
template <typename V>
CP_SIMD_INLINE V max_fast(V a, V b) {
  return a > b ? a : b;
}

/// The partial states of a row: each of the W lanes has its maximum m, shared by kUnroll sums l.
///
/// The maxima start at the lowest float, not -inf: an all -inf lane keeps l = 0 without the NaN
/// of -inf - (-inf), and a lane whose l is still 0 at the end is empty.
template <int W>
struct LaneStates {
  using V = fvec<W>;
  V m = splat<V>(-FLT_MAX);
  V l[kUnroll] = {};

  /// The online update for kUnroll · W values xs: each lane's new maximum first, then one rescale
  /// of its sums (the merge's correction factor) and one exp per value. Adding values one by one,
  /// as SoftmaxState::add does, would take two exps per new maximum. With `es` non-null it also
  /// keeps es = exp(xs - m) and, in `ms`, the maxima m they are relative to.
  CP_SIMD_INLINE void add_step(const float* xs, float* es, float* ms) {
    V v[kUnroll];
#pragma GCC unroll 4
    for (int u = 0; u < kUnroll; ++u) v[u] = load<V>(xs + u * W);
    V m_new = m;
#pragma GCC unroll 4
    for (int u = 0; u < kUnroll; ++u) m_new = max_fast(v[u], m_new);
    const V alpha = exp_nonpos(m - m_new);  // 1 where the maximum held
    m = m_new;
#pragma GCC unroll 4
    for (int u = 0; u < kUnroll; ++u) {
      const V e_u = exp_nonpos(v[u] - m);
      l[u] = l[u] * alpha + e_u;
      if (es != nullptr) store(es + u * W, e_u);
    }
    if (ms != nullptr) store(ms, m);
  }

  /// The row's state: the lanes merged by task 1's merge, for all W lanes at once: the largest
  /// maximum M, and the sums rescaled to it, L = sum_k l_k · exp(m_k - M). An empty lane
  /// (m = lowest float, l = 0) adds nothing. One vector exp, where W scalar merges would take 2W.
  CP_SIMD_INLINE SoftmaxState merged(const float* x, int64_t n) const {
    V l_sum = l[0];  // a lane's kUnroll sums share its maximum: plain sums
#pragma GCC unroll 4
    for (int u = 1; u < kUnroll; ++u) l_sum += l[u];
    const float m_row = max_lane(m);  // a NaN lane makes the sum NaN: the rescan below
    const SoftmaxState state{m_row, sum_lanes(l_sum * exp_nonpos(m - m_row))};
    if (state.l == 0.0f) return SoftmaxState::empty();
    if (state.l != state.l) {
      // A NaN or a +inf reached a sum; the one-instruction maximum may have dropped a NaN, so
      // look for one (rare: such rows only) to give the state of the contract, NaN before +inf.
      for (int64_t j = 0; j < n; ++j)
        if (x[j] != x[j]) return {NAN, NAN};
      return {INFINITY, NAN};
    }
    return state;
  }
};

/// The state of one row of n floats in one pass, kUnroll · W values per step. With `e` non-null
/// it also keeps what the output needs: e[j] = exp(x[j] - m) for the lane's maximum m at x[j]'s
/// step, and those maxima in `step_max` (W floats per step).
template <int W>
CP_SIMD_INLINE SoftmaxState row_state(const float* x, int64_t n, float* e = nullptr, float* step_max = nullptr) {
  constexpr int64_t kStep = kUnroll * W;
  LaneStates<W> lanes;
  int64_t j = 0, step = 0;
  for (; j + kStep <= n; j += kStep, ++step)
    lanes.add_step(x + j, e ? e + j : nullptr, step_max ? step_max + step * W : nullptr);
  if (j < n) {  // the last, partial step: the missing values are -inf, which add nothing
    float rest[kStep], e_rest[kStep];
    for (float& r : rest) r = -INFINITY;
    std::memcpy(rest, x + j, (n - j) * sizeof(float));
    lanes.add_step(rest, e_rest, step_max ? step_max + step * W : nullptr);
    if (e != nullptr) std::memcpy(e + j, e_rest, (n - j) * sizeof(float));
  }
  return lanes.merged(x, n);
}

/// softmax of one row: row_state keeps e = exp(x - m_step) in y, and this pass rescales it to
/// exp(x - m) / l with the row's m and l: y = e · exp(m_step - m) / l, one exp per step of
/// kUnroll · W values (FlashAttention rescales its output the same way).
template <int W>
CP_SIMD_INLINE void softmax_row(const float* x, float* y, int64_t n, float* step_max) {
  using V = fvec<W>;
  constexpr int64_t kStep = kUnroll * W;
  const SoftmaxState state = row_state<W>(x, n, y, step_max);
  if (state.l == 0.0f) {  // an empty or all -inf row: zeros (README, "The -inf cases")
    std::memset(y, 0, n * sizeof(float));
    return;
  }
  const V m = splat<V>(state.m);
  const float inv_l = 1.0f / state.l;
  int64_t j = 0, step = 0;
  for (; j + kStep <= n; j += kStep, ++step) {
    const V scale = exp_nonpos(load<V>(step_max + step * W) - m) * inv_l;
#pragma GCC unroll 4
    for (int u = 0; u < kUnroll; ++u) store(y + j + u * W, load<V>(y + j + u * W) * scale);
  }
  if (j < n) {
    const V scale = exp_nonpos(load<V>(step_max + step * W) - m) * inv_l;
    float rest[kStep] = {};
    std::memcpy(rest, y + j, (n - j) * sizeof(float));
#pragma GCC unroll 4
    for (int u = 0; u < kUnroll; ++u) store(rest + u * W, load<V>(rest + u * W) * scale);
    std::memcpy(y + j, rest, (n - j) * sizeof(float));
  }
}

/// softmax of `rows` rows of n floats, each row's two passes while it is in cache.
struct SoftmaxRows {
  template <int W>
  CP_SIMD_INLINE static void run(const float* x, float* y, int64_t rows, int64_t n) {
    std::vector<float> step_max((n + kUnroll * W - 1) / (kUnroll * W) * W);
    for (int64_t r = 0; r < rows; ++r) softmax_row<W>(x + r * n, y + r * n, n, step_max.data());
  }
};

/// logsumexp of `rows` rows of n floats.
struct LogsumexpRows {
  template <int W>
  CP_SIMD_INLINE static void run(const float* x, float* lse, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) lse[r] = row_state<W>(x + r * n, n).logsumexp();
  }
};

}  // namespace cp::softmax_simd
