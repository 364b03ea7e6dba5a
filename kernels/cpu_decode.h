// The CPU attention of one decode step (lesson 15): one query row per head against a KV cache read
// where it lies. Lesson 03's CPU forward packs the keys into transposed tiles first, a copy that
// its query rows share; a decode step has one query row per head, so that copy would cost as
// much as the attention itself. Here the query heads that share a kv head (GQA) read each key and
// value row once, together, straight from the cache: the step is bound by reading the cache, as
// FlashDecoding's and vLLM's decode kernels are on a GPU. Where the keys lie is the caller's: a
// contiguous shard (lesson 15, ContiguousKeys) or pages found through a block table (lesson 19),
// and each query row may see its own keys (lesson 19's chunks and draft tokens).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu_simd.h"

namespace cp::kernels {

constexpr int64_t kDecodeBlock = 32;  ///< keys per online-softmax update

/// The keys of lesson 15's cache shard: rows of d floats one after another (row j at k + j · d),
/// key j visible to every query row if k_pos[j] <= q_pos (the shard holds positions in any order).
struct ContiguousKeys {
  const float* k;
  const float* v;
  const int64_t* k_pos;
  int64_t q_pos;
  int64_t d;
  const float* key(int64_t j) const { return k + j * d; }
  const float* value(int64_t j) const { return v + j * d; }
  bool visible(int64_t j, int64_t /*row*/) const { return k_pos[j] <= q_pos; }
};

/// The query rows (q: [rows][d_qk] float32) against n keys, read where they lie through `keys`, a
/// type with key(j) and value(j) (pointers to key j's d_qk floats and value j's d_v floats) and
/// visible(j, row). A score is q · k times `scale`. Writes out [rows][d_v] (O / l, 0 for a row that
/// sees no key) and lse [rows] (m + log l, -inf for no key). work: at least
/// rows · (d_v + kDecodeBlock + 2) floats. The rules of lesson 03's attend_tile hold: a hidden key
/// is skipped (its v may be NaN), NaN in a score wins the maximum.
template <int W, typename Keys>
CP_SIMD_INLINE void decode_attend(const float* q, int64_t group, const Keys& keys, int64_t n, int64_t d_qk,
                                  int64_t d_v, float scale, float* out, float* lse, float* work) {
  using V = fvec<W>;
  constexpr int64_t kScoreVecs = kDecodeBlock / W;
  const int64_t qk_vec = d_qk / W * W, v_vec = d_v / W * W;  // the dims done in vectors; the rest one by one
  float* o = work;                                            // [group][d_v], unnormalised
  float* s = o + group * d_v;                                 // [group][kDecodeBlock] scores, then probabilities
  float* m = s + group * kDecodeBlock;    // [group] each row's maximum so far
  float* l = m + group;                   // [group] each row's sum of e^(s − m)
  for (int64_t h = 0; h < group; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
    for (int64_t d = 0; d < d_v; ++d) o[h * d_v + d] = 0.0f;
  }
  bool any_row[kDecodeBlock];  // key jj visible to at least one row
  for (int64_t j0 = 0; j0 < n; j0 += kDecodeBlock) {
    const int64_t block_keys = std::min(kDecodeBlock, n - j0);
    // 1. Scores: key j's row is read once for every row that sees it.
    bool any = false;
    for (int64_t jj = 0; jj < kDecodeBlock; ++jj) {
      any_row[jj] = false;
      const float* k_j = jj < block_keys ? keys.key(j0 + jj) : nullptr;
      for (int64_t h = 0; h < group; ++h) {
        if (jj >= block_keys || !keys.visible(j0 + jj, h)) {
          s[h * kDecodeBlock + jj] = -INFINITY;
          continue;
        }
        any_row[jj] = any = true;
        const float* q_h = q + h * d_qk;
        V acc = {};
        for (int64_t d = 0; d < qk_vec; d += W) acc += load<V>(q_h + d) * load<V>(k_j + d);
        float dot = sum_lanes(acc);
        for (int64_t d = qk_vec; d < d_qk; ++d) dot += q_h[d] * k_j[d];
        s[h * kDecodeBlock + jj] = dot * scale;
      }
    }
    if (!any) continue;  // a block of keys after every query (not in a decode step's cache, but allowed)
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
        for (int64_t d = 0; d < d_v; ++d) o[h * d_v + d] *= alpha;
    }
    // 3. O += P V: value j's row is read once for every row that sees it.
    for (int64_t jj = 0; jj < block_keys; ++jj) {
      if (!any_row[jj]) continue;
      const float* v_j = keys.value(j0 + jj);
      for (int64_t h = 0; h < group; ++h) {
        if (!keys.visible(j0 + jj, h)) continue;  // p = 0, but its v may be NaN
        const float p = s[h * kDecodeBlock + jj];
        float* o_h = o + h * d_v;
        for (int64_t d = 0; d < v_vec; d += W) store(o_h + d, load<V>(o_h + d) + p * load<V>(v_j + d));
        for (int64_t d = v_vec; d < d_v; ++d) o_h[d] += p * v_j[d];
      }
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    const float inv_l = l[h] == 0.0f ? 0.0f : 1.0f / l[h];  // as lesson 03's finish_rows
    for (int64_t d = 0; d < d_v; ++d) out[h * d_v + d] = o[h * d_v + d] * inv_l;
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
