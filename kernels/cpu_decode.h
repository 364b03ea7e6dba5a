// The CPU attention of one decode step (lesson 15): one query row per head against a KV cache read
// where it lies. Lesson 03's CPU forward packs the keys into transposed tiles first, a copy that
// its query rows share; a decode step has one query row per head, so that copy would cost as
// much as the attention itself. Here the query heads that share a kv head (GQA) read each key and
// value row once, together, straight from the cache: the step is bound by reading the cache, as
// FlashDecoding's and vLLM's decode kernels are on a GPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu_simd.h"

namespace cp::kernels {

constexpr int64_t kDecodeBlock = 32;  ///< keys per online-softmax update

/// The query rows of `group` heads (q: [group][d_model] float32) against n keys and values (row j at k + j · d_model and v + j · d_model, float32), key j
/// visible if k_pos[j] <= q_pos; a score is q · k times `scale`. Writes out [group][d_model] (O / l, 0 for a row that sees no key)
/// and lse [group] (m + log l, -inf for no key). work: at least group · (d_model + kDecodeBlock + 2)
/// floats. The rules of lesson 03's attend_tile hold: a hidden key is skipped (its v may be NaN),
/// NaN in a score wins the maximum.
template <int W>
CP_SIMD_INLINE void decode_attend(const float* q, int64_t group, const float* k, const float* v, const int64_t* k_pos,
                                  int64_t n, int64_t q_pos, int64_t d_model, float scale, float* out, float* lse,
                                  float* work) {
  using V = fvec<W>;
  constexpr int64_t kScoreVecs = kDecodeBlock / W;
  const int64_t d_vec = d_model / W * W;  // the dims done in vectors; the rest one by one
  float* o = work;                        // [group][d_model], unnormalised
  float* s = o + group * d_model;         // [group][kDecodeBlock] scores, then probabilities
  float* m = s + group * kDecodeBlock;    // [group] each row's maximum so far
  float* l = m + group;                   // [group] each row's sum of e^(s − m)
  for (int64_t h = 0; h < group; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
    for (int64_t d = 0; d < d_model; ++d) o[h * d_model + d] = 0.0f;
  }
  bool visible[kDecodeBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kDecodeBlock) {
    const int64_t keys = std::min(kDecodeBlock, n - j0);
    // 1. Scores: key j's row is read once for every head of the group.
    bool any = false;
    for (int64_t jj = 0; jj < kDecodeBlock; ++jj) {
      visible[jj] = jj < keys && k_pos[j0 + jj] <= q_pos;
      any |= visible[jj];
      if (!visible[jj]) {
        for (int64_t h = 0; h < group; ++h) s[h * kDecodeBlock + jj] = -INFINITY;
        continue;
      }
      const float* k_j = k + (j0 + jj) * d_model;
      for (int64_t h = 0; h < group; ++h) {
        const float* q_h = q + h * d_model;
        V acc = {};
        for (int64_t d = 0; d < d_vec; d += W) acc += load<V>(q_h + d) * load<V>(k_j + d);
        float dot = sum_lanes(acc);
        for (int64_t d = d_vec; d < d_model; ++d) dot += q_h[d] * k_j[d];
        s[h * kDecodeBlock + jj] = dot * scale;
      }
    }
    if (!any) continue;  // a block of keys after the query (not in a decode step's cache, but allowed)
    // 2. Each head's online update over the block: the block maximum, one rescale, p = e^(s − m).
    for (int64_t h = 0; h < group; ++h) {
      float* s_h = s + h * kDecodeBlock;
      // A NaN score wins the maximum: the plain maximum and the NaN seen are kept apart, each a
      // select on one comparison (max_keep_nan, which joins two, is compiled lane by lane at
      // W = 16), and added at the end: nan_seen's lanes are 0 or NaN.
      V block_max = splat<V>(-INFINITY), nan_seen = {};
#pragma GCC unroll 8
      for (int64_t c = 0; c < kScoreVecs; ++c) {
        const V s_c = load<V>(s_h + c * W);
        block_max = s_c > block_max ? s_c : block_max;
        nan_seen = s_c != s_c ? s_c : nan_seen;
      }
      const float m_block = max_lane_fast(block_max) + sum_lanes(nan_seen);
      if (m_block == -INFINITY) {  // every visible score -inf: p = 0 for the whole block
        for (int64_t jj = 0; jj < kDecodeBlock; ++jj) s_h[jj] = 0.0f;
        continue;
      }
      const float m_new = (m_block > m[h] || m_block != m_block) ? m_block : m[h];
      const float alpha = m_new == m[h] ? 1.0f : std::exp(m[h] - m_new);
      m[h] = m_new;
      V p_sum = {};
#pragma GCC unroll 8
      for (int64_t c = 0; c < kScoreVecs; ++c) {
        const V p_c = exp_nonpos(load<V>(s_h + c * W) - m_new);
        p_sum += p_c;
        store(s_h + c * W, p_c);  // s becomes p (0 for a hidden key, which step 3 skips: its v may be NaN)
      }
      l[h] = l[h] * alpha + sum_lanes(p_sum);
      if (alpha != 1.0f)
        for (int64_t d = 0; d < d_model; ++d) o[h * d_model + d] *= alpha;
    }
    // 3. O += P V: value j's row is read once for every head.
    for (int64_t jj = 0; jj < keys; ++jj) {
      if (!visible[jj]) continue;
      const float* v_j = v + (j0 + jj) * d_model;
      for (int64_t h = 0; h < group; ++h) {
        const float p = s[h * kDecodeBlock + jj];
        float* o_h = o + h * d_model;
        for (int64_t d = 0; d < d_vec; d += W) store(o_h + d, load<V>(o_h + d) + p * load<V>(v_j + d));
        for (int64_t d = d_vec; d < d_model; ++d) o_h[d] += p * v_j[d];
      }
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    const float inv_l = l[h] == 0.0f ? 0.0f : 1.0f / l[h];  // as lesson 03's finish_rows
    for (int64_t d = 0; d < d_model; ++d) out[h * d_model + d] = o[h * d_model + d] * inv_l;
    lse[h] = l[h] == 0.0f ? -INFINITY : m[h] == INFINITY ? INFINITY : m[h] + std::log(l[h]);
  }
}

/// decode_attend for each SIMD width: kernels::simd_call<DecodeAttend> runs the CPU's widest.
struct DecodeAttend {
  template <int W, typename... Args>
  CP_SIMD_INLINE static void run(Args&&... args) {
    decode_attend<W>(args...);
  }
};

}  // namespace cp::kernels
