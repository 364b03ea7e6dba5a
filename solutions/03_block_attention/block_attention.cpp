// Lesson 03, tasks 1 and 2 — the merge of partial attention results, and block attention on
// the CPU with the same tiled algorithm as the CUDA kernel (task 3, block_attention.cu).
#include "block_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/tensor_checks.h"
#include "kernels/cpu_simd.h"
#include "kernels/cpu_tile.h"

#if CP_WITH_CUDA
#include "block_attention.cuh"
#include "common/device.h"
#endif

namespace cp {
namespace {

// ── The CPU path ─────────────────────────────────────────────────────────────────────────────
//
// FlashAttention on one core: the keys of a (batch, kv head) are packed once into tiles of
// kBc = 32 keys, and the queries into tiles of kBr = 32 rows; each query tile meets each key tile
// in attend_tile (task 2), which keeps the (m, l, O) state of its rows. On a GPU a tile lives in
// shared memory and a row's numbers in registers; here the key tile (8 KiB of K and 8 KiB of V at
// D = 64) stays in the L1 cache while the kBr rows reuse it, a group of rows at a time (four;
// eight with AVX-512), and the scores of a group against 2W keys stay in SIMD registers while the
// loop over the head dim runs. Each of the tile's three steps (scores, softmax, O += P V) runs
// over all the rows before the next, so that K and then V are read from L1. The key tiles come
// kKeyTilesPerPass at a time (a pass), which every query tile meets in turn while it stays in the
// L2 cache (README, "The CPU path"). The scores are kept in base 2, s · log2 e, as
// FlashAttention-2 keeps them: each p is then one exp2_nonpos, cheaper than exp_nonpos, and
// lse = ln 2 · (m + log2 l).

using kernels::exp2_nonpos;
using kernels::fvec;
using kernels::kBc;
using kernels::kBr;
using kernels::kDimAlign;
using kernels::kKeyTilesPerPass;
using kernels::load;
using kernels::max_keep_nan;
using kernels::max_lane_fast;
using kernels::splat;
using kernels::store;
using kernels::sum_lanes;

/// One (batch, kv head)'s keys and values, float32, in tiles of kBc keys (the last one padded
/// with zero keys): kt holds each tile transposed, [dim][key], so that dim d of the tile's keys is
/// kBc consecutive floats (kKeyVecs vectors); v holds rows of dp floats. The smallest and largest
/// key position of each tile decide the causal skip.
struct KeyTiles {
  int64_t dp = 0, tiles = 0;  // dp: the head dim padded to a multiple of kDimAlign
  kernels::TileFloats kt;     // [tiles][dp][kBc]
  kernels::TileFloats v;      // [tiles · kBc][dp]
  std::vector<int64_t> min_pos, max_pos;
};

template <typename T>
void pack_keys(const T* k, const T* v, const int64_t* k_pos, int64_t seq_k, int64_t d_model, KeyTiles& kv) {
  kv.dp = kernels::padded_dim(d_model);
  kv.tiles = (seq_k + kBc - 1) / kBc;
  kernels::pack_transposed(k, seq_k, d_model, kv.dp, kv.kt);
  kernels::pack_rows(v, seq_k, d_model, kv.dp, kBc, kv.v);
  kernels::tile_position_bounds(k_pos, seq_k, kBc, kv.min_pos, kv.max_pos);
}

/// The (m, l, O) state of a query tile's rows: m in base 2 (the largest s · log2 e so far), l the
/// sum of the rows' p = 2^(s log2 e - m), O is [kBr][dp], unnormalised, float32.
struct RowState {
  float m[kBr], l[kBr];
  kernels::TileFloats o;
};

/// log2 e and ln 2: scores in base 2 (x log2 e), and back (lse = ln 2 · (m + log2 l)).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;

/// Task 2: `rows` query rows (q: [rows][dp] float32; row i sees the key positions first[i] ..
/// last[i]) against one key tile of n keys (kt: [dp][kBc], the tile transposed; v: [kBc][dp];
/// positions k_pos). masked: some pair may be hidden (a key of the tile outside some row's range),
/// else every pair of the first n keys is visible. Updates m, l and O of every row in `state`
/// (its arrays hold kBr rows: a group may reach past `rows`).
/// W: floats per SIMD register; the loop is compiled for each width the CPU may have (AttendTile).
template <int W>
CP_SIMD_INLINE void attend_tile(const float* q, int64_t rows, const float* kt, const float* v, int64_t n,
                                const int64_t* first, const int64_t* last, const int64_t* k_pos, bool masked,
                                float scale, int64_t dp, RowState& state) {
  constexpr int64_t kRowGroup = kernels::row_group(W);  // rows per group: 4, or 8 with AVX-512's 32 registers
  using V = fvec<W>;                     // W floats: 4, 8 or 16 (kernels/cpu_simd.h)
  using G = fvec<kRowGroup>;             // one float per row of a group
  constexpr int64_t kKeyVecs = kBc / W;  // a row's kBc scores: 8, 4 or 2 vectors
  constexpr int64_t kTileVecs = 2;       // a register tile: kRowGroup rows × 2 vectors
  static_assert(kBr % kRowGroup == 0 && kDimAlign % (kTileVecs * W) == 0, "groups and register tiles must fit");
  // BEGIN SOLUTION task 2: one query tile against one key tile
  // STUB: // TODO(lesson 03, task 2): the scores of each row against the tile's keys, then its (m, l, O) update.
  // STUB: // README, "Task 2 — the CPU forward (`block_attention.cpp`)" and "The CPU path".
  // STUB: (void)q, (void)rows, (void)kt, (void)v, (void)n, (void)first, (void)last, (void)k_pos, (void)masked,
  // STUB: (void)scale, (void)dp, (void)state;
  // STUB: throw NotImplemented("lesson 03, task 2: attend_tile (the CPU tile loop)");
  // The tile's three steps, each over all row groups in turn: S = scale · log2 e · Q Kᵀ (the
  // scores in base 2), the online softmax of S (m, l and P), O = alpha O + P V. Each step reads
  // one tile of K or V while it is in the L1 cache, and the scores and P of all the tile's rows
  // wait between the steps.
  const float scale_log2e = scale * kLog2e;
  alignas(64) float s[kBr][kBc], p[kBr][kBc];
  alignas(64) float alpha[kBr];
  bool any_minus_inf[kBr / kRowGroup];  // per group: some score is -inf
  // 1. Scores, kTileVecs · W keys at a time: each K vector, loaded once, meets every row of a
  //    group; the group's sums stay in registers over the head dim.
  for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
    const float* q_g = q + r0 * dp;
    for (int64_t c0 = 0; c0 < kKeyVecs; c0 += kTileVecs) {
      V acc[kRowGroup][kTileVecs] = {};
      for (int64_t d = 0; d < dp; ++d) {
        V k_d[kTileVecs];
#pragma GCC unroll 2
        for (int64_t c = 0; c < kTileVecs; ++c) k_d[c] = load<V>(kt + d * kBc + (c0 + c) * W);
#pragma GCC unroll 8
        for (int64_t r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 2
          for (int64_t c = 0; c < kTileVecs; ++c) acc[r][c] += q_g[r * dp + d] * k_d[c];  // the bare scalar: splat in cpu_simd.h
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 2
        for (int64_t c = 0; c < kTileVecs; ++c) store(s[r0 + r] + (c0 + c) * W, acc[r][c] * splat<V>(scale_log2e));
    }
  }
  // 2. The online softmax, a group at a time. First -inf for a key past the last, a key outside
  //    the row's range (masked), and every key of a row past the tile's last (it must stay
  //    inert). Then each row's tile maximum, and whether any score is -inf: those keys are left
  //    out of O += P V below. A NaN score needs no care in the maximum: no row is skipped, so its
  //    p = NaN reaches l and O. The -inf test keeps the group's smallest score with a select, as
  //    the maximum does: GCC 14 compiled the bits of `s_c == -INFINITY`, ORed over the group, into
  //    one scalar comparison per lane at AVX-512, and the forward ran 1.4 times slower.
  for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
    const int64_t live = std::min(kRowGroup, rows - r0);  // rows of the group that exist
    if (masked || n < kBc || live < kRowGroup)
      for (int64_t r = 0; r < kRowGroup; ++r)
        for (int64_t jj = 0; jj < kBc; ++jj)
          if (r >= live || jj >= n || (masked && (k_pos[jj] < first[r0 + r] || k_pos[jj] > last[r0 + r])))
            s[r0 + r][jj] = -INFINITY;
    alignas(32) float tile_max[kRowGroup];
    V lowest = splat<V>(INFINITY);  // the group's smallest score, lane by lane (a NaN is passed over)
#pragma GCC unroll 8
    for (int64_t r = 0; r < kRowGroup; ++r) {
      V row_max = load<V>(s[r0 + r]);
#pragma GCC unroll 8
      for (int64_t c = 0; c < kKeyVecs; ++c) {
        const V s_c = load<V>(s[r0 + r] + c * W);
        row_max = s_c > row_max ? s_c : row_max;  // a plain max: a NaN score reaches l and O through its p
        lowest = s_c < lowest ? s_c : lowest;
      }
      tile_max[r] = max_lane_fast(row_max);
    }
    any_minus_inf[r0 / kRowGroup] = max_lane_fast(V{} - lowest) == INFINITY;  // some lane of lowest is -inf
    // The group's update as vectors of one float per row: m_new, one exp2 for all the alpha
    // (1 where m is unchanged, -inf included; 0 on a row's first visible tile), then
    // p = 2^(s - m_new) in vectors, and l = alpha l + sum p. A row with no visible key yet
    // subtracts 0, not -inf (2^(-inf - -inf) would be NaN): its p are 2^-inf = 0.
    const G m_old = load<G>(state.m + r0);
    const G m_new = max_keep_nan(load<G>(tile_max), m_old);
    const G alpha_g = exp2_nonpos(m_new == m_old ? G{} : m_old - m_new);
    alignas(32) float m_sub[kRowGroup], p_sum[kRowGroup];
    store(alpha + r0, alpha_g);
    store(m_sub, m_new == -INFINITY ? G{} : m_new);
    store(state.m + r0, m_new);
#pragma GCC unroll 8
    for (int64_t r = 0; r < kRowGroup; ++r) {
      V sum = {};
#pragma GCC unroll 8
      for (int64_t c = 0; c < kKeyVecs; ++c) {
        const V p_c = exp2_nonpos(load<V>(s[r0 + r] + c * W) - splat<V>(m_sub[r]));
        store(p[r0 + r] + c * W, p_c);
        sum += p_c;
      }
      p_sum[r] = sum_lanes(sum);
    }
    store(state.l + r0, load<G>(state.l + r0) * alpha_g + load<G>(p_sum));
  }
  // 3. O = alpha O + P V, kTileVecs · W dims at a time: each V vector, loaded once, meets
  //    every row of a group. A key with s = -inf (hidden) is left out, not multiplied by p = 0: its
  //    v may be NaN. A visible key counts at p = 0. The test costs a branch per row and key, so it
  //    is compiled only into the copy that groups with a -inf score run.
  for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
    float* o_g = state.o.data() + r0 * dp;
    auto accumulate = [&](auto leave_out_minus_inf) CP_SIMD_LAMBDA {
      for (int64_t d0 = 0; d0 < dp; d0 += kTileVecs * W) {
        V acc[kRowGroup][kTileVecs];
#pragma GCC unroll 8
        for (int64_t r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 2
          for (int64_t c = 0; c < kTileVecs; ++c)
            acc[r][c] = load<V>(o_g + r * dp + d0 + c * W) * splat<V>(alpha[r0 + r]);
        for (int64_t jj = 0; jj < kBc; ++jj) {
          V v_j[kTileVecs];
#pragma GCC unroll 2
          for (int64_t c = 0; c < kTileVecs; ++c) v_j[c] = load<V>(v + jj * dp + d0 + c * W);
#pragma GCC unroll 8
          for (int64_t r = 0; r < kRowGroup; ++r) {
            if (decltype(leave_out_minus_inf)::value && s[r0 + r][jj] == -INFINITY) continue;
#pragma GCC unroll 2
            for (int64_t c = 0; c < kTileVecs; ++c) acc[r][c] += p[r0 + r][jj] * v_j[c];
          }
        }
#pragma GCC unroll 8
        for (int64_t r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 2
          for (int64_t c = 0; c < kTileVecs; ++c) store(o_g + r * dp + d0 + c * W, acc[r][c]);
      }
    };
    if (any_minus_inf[r0 / kRowGroup])
      accumulate(std::true_type{});
    else
      accumulate(std::false_type{});
  }
  // END SOLUTION
}

/// attend_tile for each SIMD width: kernels::simd_call<AttendTile> runs the CPU's widest.
struct AttendTile {
  template <int W, typename... Args>
  CP_SIMD_INLINE static void run(Args&&... args) {
    attend_tile<W>(args...);
  }
};

/// Task 2: out ([rows][d_model], the input dtype) and lse of a query tile's rows from their state.
template <typename T>
void finish_rows(const RowState& state, int64_t rows, int64_t d_model, int64_t dp, T* out, float* lse) {
  // BEGIN SOLUTION task 2: out and lse of the tile's rows
  // STUB: // TODO(lesson 03, task 2): out = O / l and lse = ln 2 (m + log2 l) of each row (0, -inf: no visible key).
  // STUB: (void)state, (void)rows, (void)d_model, (void)dp, (void)out, (void)lse;
  // STUB: throw NotImplemented("lesson 03, task 2: finish_rows");
  for (int64_t i = 0; i < rows; ++i) {
    const float m = state.m[i], l = state.l[i];
    // l = 0: no visible key, out 0 and lse -inf. Not `l > 0`, which a NaN row (l = NaN) would fail.
    const float inv_l = l == 0.0f ? 0.0f : 1.0f / l;
    for (int64_t d = 0; d < d_model; ++d) out[i * d_model + d] = static_cast<T>(state.o[i * dp + d] * inv_l);
    // m is in base 2. A +inf score: l = inf/inf = NaN, lse +inf.
    lse[i] = l == 0.0f ? -INFINITY : m == INFINITY ? INFINITY : kLn2 * (m + std::log2(l));
  }
  // END SOLUTION
}

/// A query tile of a head: its rows, packed as float32, their state and the keys they see.
struct QueryTile {
  int64_t i0 = 0, rows = 0;
  kernels::TileFloats q;  // [kBr][dp]
  RowState state;
  kernels::RowRanges ranges;
};

AttnResult forward_cpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& k_pos, const VisibleKeys& keys, float scale, const AttentionShapes& s) {
  AttnResult result{torch::empty_like(q), torch::empty({s.batch, s.heads_q, s.seq_q}, q.options().dtype(torch::kFloat))};
  const int64_t group = s.heads_q / s.heads_kv;
  KeyTiles kv;
  std::vector<QueryTile> query((s.seq_q + kBr - 1) / kBr);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_block_forward", [&] {
    const scalar_t* pq = q.data_ptr<scalar_t>();
    const scalar_t* pk = k.data_ptr<scalar_t>();
    const scalar_t* pv = v.data_ptr<scalar_t>();
    scalar_t* pout = result.out.data_ptr<scalar_t>();
    float* plse = result.lse.data_ptr<float>();
    const int64_t* first = keys.masked ? keys.first.data_ptr<int64_t>() : nullptr;
    const int64_t* last = keys.masked ? keys.last.data_ptr<int64_t>() : nullptr;
    const int64_t* kp = k_pos.data_ptr<int64_t>();
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t h = 0; h < s.heads_q; ++h) {
        const int64_t bh = b * s.heads_q + h, bh_kv = b * s.heads_kv + h / group;
        if (h % group == 0)  // the group's query heads share one packed kv head
          pack_keys(pk + bh_kv * s.seq_k * s.head_dim, pv + bh_kv * s.seq_k * s.head_dim, kp, s.seq_k, s.head_dim, kv);
        for (int64_t u = 0; u < static_cast<int64_t>(query.size()); ++u) {
          QueryTile& tile = query[u];
          tile.i0 = u * kBr;
          tile.rows = std::min(kBr, s.seq_q - tile.i0);
          tile.q.assign(kBr * kv.dp, 0.0f);
          const scalar_t* q_rows = pq + (bh * s.seq_q + tile.i0) * s.head_dim;
          for (int64_t i = 0; i < tile.rows; ++i)
            for (int64_t d = 0; d < s.head_dim; ++d)
              tile.q[i * kv.dp + d] = static_cast<float>(q_rows[i * s.head_dim + d]);
          std::fill(tile.state.m, tile.state.m + kBr, -INFINITY);  // every row of the tile, used or not
          std::fill(tile.state.l, tile.state.l + kBr, 0.0f);
          tile.state.o.assign(kBr * kv.dp, 0.0f);
          tile.ranges = kernels::row_ranges(first, last, tile.i0, tile.rows);
        }
        for (int64_t pass_t0 = 0; pass_t0 < kv.tiles; pass_t0 += kKeyTilesPerPass) {
          const int64_t pass_end = std::min(kv.tiles, pass_t0 + kKeyTilesPerPass);
          for (QueryTile& tile : query) {
            for (int64_t t = pass_t0; t < pass_end; ++t) {
              if (tile.ranges.misses(kv.min_pos[t], kv.max_pos[t])) {  // no row sees any key of the tile
                ++result.tiles_skipped;
                continue;
              }
              ++result.tiles_computed;
              const bool masked = !tile.ranges.sees_all(kv.min_pos[t], kv.max_pos[t]);
              kernels::simd_call<AttendTile>(tile.q.data(), tile.rows, kv.kt.data() + t * kv.dp * kBc,
                                             kv.v.data() + t * kBc * kv.dp, std::min(kBc, s.seq_k - t * kBc),
                                             first ? first + tile.i0 : nullptr, last ? last + tile.i0 : nullptr,
                                             kp + t * kBc, masked, scale, kv.dp, tile.state);
            }
          }
        }
        for (const QueryTile& tile : query)
          finish_rows(tile.state, tile.rows, s.head_dim, kv.dp, pout + (bh * s.seq_q + tile.i0) * s.head_dim,
                      plse + bh * s.seq_q + tile.i0);
      }
    }
  });
  return result;
}

AttnResult forward_cuda(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& k_pos, const VisibleKeys& keys, float scale, const AttentionShapes& s) {
#if CP_WITH_CUDA
  CP_CHECK(block_attention_supports_head_dim(s.head_dim), "q: head dim ", s.head_dim,
           " is not supported by the CUDA kernel (32, 64 or 128)");
  AttnResult result{torch::empty_like(q), torch::empty({s.batch, s.heads_q, s.seq_q}, q.options().dtype(torch::kFloat))};
  const BlockAttentionParams params{s.batch, s.heads_q, s.heads_kv, s.seq_q, s.seq_k, s.head_dim, scale, keys.masked};
  const CudaDeviceScope cuda(q.device());  // q's GPU and its current stream
  launch_block_attention_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), result.out.data_ptr(),
                                 result.lse.data_ptr<float>(), keys.masked ? keys.first.data_ptr<int64_t>() : nullptr,
                                 keys.masked ? keys.last.data_ptr<int64_t>() : nullptr, k_pos.data_ptr<int64_t>(),
                                 params, kernel_dtype(q, "q"), cuda.stream());
  return result;
#else
  (void)k, (void)v, (void)k_pos, (void)keys, (void)scale, (void)s;
  CP_FAIL("q is a CUDA tensor (", q.device(), ") but this build has no CUDA (nvcc was not found)");
#endif
}

void check_merge_operand(const torch::Tensor& t, const torch::Tensor& like, const char* arg, bool float32) {
  check_defined(t, arg);
  CP_CHECK(t.sizes() == like.sizes(), arg, ": shape must be ", like.sizes(), ", got ", t.sizes());
  CP_CHECK(t.device() == like.device(), arg, ": device must be ", like.device(), ", got ", t.device());
  CP_CHECK(!float32 || t.scalar_type() == torch::kFloat, arg, ": must be float32, got ", t.dtype());
}

}  // namespace

AttentionShapes check_attention_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  check_defined(q, "q", 4);
  check_defined(k, "k", 4);
  check_defined(v, "v", 4);
  CP_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v: expected [B, H, S, D] tensors, got q ",
           q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  check_float_dtype(q, "q");
  CP_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "k, v: dtype must be q's (",
           q.dtype(), "), got k ", k.dtype(), ", v ", v.dtype());
  CP_CHECK(k.device() == q.device() && v.device() == q.device(), "k, v: device must be q's (", q.device(),
           "), got k ", k.device(), ", v ", v.device());
  CP_CHECK(k.sizes() == v.sizes(), "v: shape must be k's ", k.sizes(), ", got ", v.sizes());
  const AttentionShapes s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  CP_CHECK(k.size(0) == s.batch, "k: batch ", k.size(0), " differs from q's ", s.batch);
  CP_CHECK(k.size(3) == s.head_dim, "k: head dim ", k.size(3), " differs from q's ", s.head_dim);
  CP_CHECK(s.heads_kv > 0 && s.heads_q % s.heads_kv == 0, "q, k: H_q (", s.heads_q,
           ") must be divisible by H_kv (", s.heads_kv, ")");
  return s;
}

std::vector<int64_t> check_mask(const AttentionMask& mask) {
  constexpr int64_t kMaxWindow = int64_t{1} << 62;  // q_pos − (W − 1) cannot overflow for positions >= −2^62
  CP_CHECK(mask.window >= 0 && mask.window <= kMaxWindow, "mask.window: must be at least 1 (0: no window), got ",
           mask.window);
  CP_CHECK(mask.window == 0 || mask.causal, "mask.window: a sliding window (", mask.window, ") needs causal = true: ",
           "a query sees its own key and the W − 1 before it");
  const torch::Tensor& documents = mask.documents;
  if (!documents.defined()) return {};
  CP_CHECK(documents.dim() == 1 && documents.size(0) >= 2 &&
               documents.scalar_type() == torch::kLong,
           "mask.documents: expected cu_seqlens, an int64 tensor [n_docs + 1] with at least one document, got ",
           documents.dtype(), " ", documents.sizes());
  const torch::Tensor cu = documents.cpu().contiguous();
  const std::vector<int64_t> c(cu.data_ptr<int64_t>(), cu.data_ptr<int64_t>() + cu.numel());
  CP_CHECK(c[0] == 0, "mask.documents: must start at 0 (the first document's first position), got ", c[0]);
  for (size_t d = 0; d + 1 < c.size(); ++d)
    CP_CHECK(c[d] <= c[d + 1], "mask.documents: must be non-decreasing (document d holds the positions [c_d, c_{d+1})), ",
             "but c_", d, " = ", c[d], " > c_", d + 1, " = ", c[d + 1]);
  return c;
}

VisibleKeys visible_keys(const AttentionMask& mask, const torch::Tensor& q_pos) {
  const std::vector<int64_t> bounds = check_mask(mask);
  VisibleKeys keys;
  if (!mask.causal && !mask.documents.defined()) return keys;  // every pair visible
  keys.masked = true;
  keys.last = mask.causal ? q_pos.clone() : torch::full_like(q_pos, std::numeric_limits<int64_t>::max());
  keys.first = mask.window > 0 ? q_pos - (mask.window - 1) : torch::full_like(q_pos, std::numeric_limits<int64_t>::min());
  if (mask.documents.defined()) {
    const torch::Tensor cu = torch::tensor(bounds, torch::kLong).to(q_pos.device());
    CP_CHECK(q_pos.numel() == 0 || q_pos.min().item<int64_t>() >= 0,
             "mask.q_positions: a negative position belongs to no document of mask.documents (which start at 0)");
    const int64_t docs = cu.size(0) - 1;
    // The query's document d: c_d <= pos < c_{d+1} (empty documents are passed over); d = docs: padding.
    const torch::Tensor d = torch::searchsorted(cu, q_pos, /*out_int32=*/false, /*right=*/true) - 1;
    const torch::Tensor padding = d >= docs;
    const torch::Tensor in_doc = d.clamp_max(docs - 1);
    keys.first = torch::where(padding, torch::full_like(q_pos, std::numeric_limits<int64_t>::max()),
                              torch::maximum(keys.first, cu.index_select(0, in_doc)));
    keys.last = torch::where(padding, torch::full_like(q_pos, std::numeric_limits<int64_t>::min()),
                             torch::minimum(keys.last, cu.index_select(0, in_doc + 1) - 1));
  }
  keys.first = keys.first.contiguous();
  keys.last = keys.last.contiguous();
  return keys;
}

torch::Tensor mask_positions(const torch::Tensor& given, int64_t n, torch::Device device, const char* arg) {
  if (!given.defined()) return torch::arange(n, torch::TensorOptions().dtype(torch::kLong).device(device));
  CP_CHECK(given.dim() == 1 && given.size(0) == n && given.scalar_type() == torch::kLong, arg,
           ": expected an int64 tensor of shape [", n, "], got ", given.dtype(), " ", given.sizes());
  CP_CHECK(given.device() == device, arg, ": must be on ", device, " like q, got ", given.device());
  return given.contiguous();
}

namespace {
std::atomic<CudaForwardOverride> cuda_forward_override{nullptr};
}  // namespace

void set_cuda_forward_override(CudaForwardOverride forward) { cuda_forward_override.store(forward); }

AttnResult attention_block_forward(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                                   const AttentionMask& mask, std::optional<double> scale) {
  const AttentionShapes s = check_attention_inputs(q_in, k_in, v_in);
  if (const CudaForwardOverride forward = cuda_forward_override.load(); forward && q_in.is_cuda())
    if (std::optional<AttnResult> result = forward(q_in, k_in, v_in, mask, scale)) return *std::move(result);
  const torch::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const torch::Tensor q_pos = mask_positions(mask.q_positions, s.seq_q, q.device(), "mask.q_positions");
  const torch::Tensor k_pos = mask_positions(mask.k_positions, s.seq_k, q.device(), "mask.k_positions");
  const float softmax_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(s.head_dim))));
  const VisibleKeys keys = visible_keys(mask, q_pos);
  if (q.is_cuda()) return forward_cuda(q, k, v, k_pos, keys, softmax_scale, s);
  return forward_cpu(q, k, v, k_pos, keys, softmax_scale, s);
}

void check_merge_inputs(const torch::Tensor& out_acc, const torch::Tensor& lse_acc, const torch::Tensor& out_blk,
                        const torch::Tensor& lse_blk) {
  check_defined(out_acc, "out_acc", 1);
  CP_CHECK(out_acc.scalar_type() == torch::kFloat, "out_acc: the accumulator must be float32, got ", out_acc.dtype());
  check_defined(lse_acc, "lse_acc");
  const torch::IntArrayRef rows = out_acc.sizes().slice(0, out_acc.dim() - 1);
  CP_CHECK(lse_acc.sizes() == rows, "lse_acc: shape must be ", rows, " (out_acc without its last dim), got ",
           lse_acc.sizes());
  check_merge_operand(lse_acc, lse_acc, "lse_acc", true);
  check_merge_operand(out_blk, out_acc, "out_blk", false);
  check_merge_operand(lse_blk, lse_acc, "lse_blk", true);
}

void merge_attention(torch::Tensor& out_acc, torch::Tensor& lse_acc, const torch::Tensor& out_blk,
                     const torch::Tensor& lse_blk) {
  check_merge_inputs(out_acc, lse_acc, out_blk, lse_blk);
  // BEGIN SOLUTION task 1: the merge
  // STUB: // TODO(lesson 03, task 1): merge (out_blk, lse_blk) into (out_acc, lse_acc), in place.
  // STUB: // README, "Task 1 — `merge_attention` (`block_attention.cpp`)" and "The merge".
  // STUB: throw NotImplemented("lesson 03, task 1: merge_attention");
  const torch::Tensor m = torch::maximum(lse_acc, lse_blk);  // NaN if either side is NaN
  // ±inf -> 0, as in torch.logsumexp: -inf (both empty) avoids -inf − (-inf); +inf (a +inf score)
  // gives w = exp(+inf) = inf, so lse = +inf and out = inf/inf = NaN.
  const torch::Tensor m_safe = torch::where(m.abs() == INFINITY, torch::zeros_like(m), m);
  const torch::Tensor w_acc = torch::exp(lse_acc - m_safe);  // 0 for an empty side
  const torch::Tensor w_blk = torch::exp(lse_blk - m_safe);
  const torch::Tensor total = w_acc + w_blk;
  const torch::Tensor empty = total == 0;
  const torch::Tensor denom = torch::where(empty, torch::ones_like(total), total);
  out_acc.copy_((w_acc / denom).unsqueeze(-1) * out_acc + (w_blk / denom).unsqueeze(-1) * out_blk.to(torch::kFloat));
  lse_acc.copy_(torch::where(empty, torch::full_like(m, -INFINITY), m_safe + torch::log(denom)));
  // END SOLUTION
}

}  // namespace cp
