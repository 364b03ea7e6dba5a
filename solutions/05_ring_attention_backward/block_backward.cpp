// Lesson 05, task 1 — the backward of one attention block on the CPU, and the dispatch to the
// CUDA kernels of task 2 (block_backward.cu).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/error.h"
#include "common/tensor_checks.h"
#include "kernels/cpu_simd.h"
#include "kernels/cpu_tile.h"
#include "ring_attention_backward.h"

#if CP_WITH_CUDA
#include "block_backward.cuh"
#include "common/device.h"
#endif

namespace cp {
namespace {

/// D_i = Σ_d dout_id · out_id, float32 [B, Hq, Sq]: the term every dS of row i subtracts.
torch::Tensor softmax_backward_delta(const torch::Tensor& dout, const torch::Tensor& out) {
  // BEGIN SOLUTION task 1: D = rowsum(dO ∘ O)
  // STUB: // TODO(lesson 05, task 1): the row sums of dout·out, in float32.
  // STUB: (void)dout, (void)out;
  // STUB: throw NotImplemented("lesson 05, task 1: softmax_backward_delta");
  return (dout.to(torch::kFloat) * out.to(torch::kFloat)).sum(-1);
  // END SOLUTION
}

// ── The CPU path ─────────────────────────────────────────────────────────────────────────────
//
// The backward of lesson 03's tiles: for each (batch, kv head) the keys are packed in tiles of
// kBc = 32, and every key tile meets every query tile of kBr = 32 rows of each query head of the
// group, kKeyTilesPerPass key tiles at a time. A tile pair computes its scores S = Q Kᵀ and
// dP = dO Vᵀ (given below), and backward_tile (task 1) turns them into P, dS and the five
// products' three sums: dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K. dK, dV of the group and dQ of the
// head are float32 accumulators in packed rows, added into the outputs once at the end (README,
// "The block backward on the CPU"). Each sum takes its terms in the same order as without passes.

using kernels::exp_nonpos;
using kernels::fvec;
using kernels::kBc;
using kernels::kBr;
using kernels::kDimAlign;
using kernels::kKeyTilesPerPass;
using kernels::load;
using kernels::pack_rows;
using kernels::pack_transposed;
using kernels::splat;
using kernels::store;

/// A register tile: kRowGroup rows (or keys, kernels::row_group) × 2 vectors. Rows meet the tile
/// a group at a time, as in lesson 03's forward: each vector loaded from a tile serves every row
/// of the group (README, "The block backward on the CPU").
constexpr int64_t kTileVecs = 2;

/// out[i][jj] = a_i · b_jj for `rows` rows of a ([rows][dp], zero rows after them up to a
/// multiple of kRowGroup) and the kBc rows of a tile b packed transposed (bt: [dp][kBc]): the
/// scores S = Q Kᵀ and dP = dO Vᵀ of a tile pair, with lesson 03's register tile (kRowGroup rows
/// × 2W keys in accumulators over the head dim). out has room for kBr rows.
template <int W>
CP_SIMD_INLINE void tile_products(const float* a, int64_t rows, const float* bt, int64_t dp, float* out) {
  using V = fvec<W>;
  constexpr int64_t kRowGroup = kernels::row_group(W);
  constexpr int64_t kKeyVecs = kBc / W;
  static_assert(kBr % kRowGroup == 0 && kKeyVecs % kTileVecs == 0, "groups and register tiles must fit");
  for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
    const float* a_g = a + r0 * dp;
    for (int64_t c0 = 0; c0 < kKeyVecs; c0 += kTileVecs) {
      V acc[kRowGroup][kTileVecs] = {};
      for (int64_t d = 0; d < dp; ++d) {
        V b_d[kTileVecs];
#pragma GCC unroll 2
        for (int64_t c = 0; c < kTileVecs; ++c) b_d[c] = load<V>(bt + d * kBc + (c0 + c) * W);
#pragma GCC unroll 8
        for (int64_t r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 2
          for (int64_t c = 0; c < kTileVecs; ++c) acc[r][c] += a_g[r * dp + d] * b_d[c];
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 2
        for (int64_t c = 0; c < kTileVecs; ++c) store(out + (r0 + r) * kBc + (c0 + c) * W, acc[r][c]);
    }
  }
}

/// Task 1: the gradients of one tile pair: `rows` query rows (q, dout, dq: [rows][dp]; lse,
/// delta: [rows]) against the kBc keys of a key tile (k, dk, dv: [kBc][dp]). s and dpt
/// ([kBr][kBc]) hold q_i · k_j and dout_i · v_j. hidden ([rows][kBc], 1 = hidden) is null when
/// every pair is visible; else it marks the pairs to skip: the mask, rows with lse = -inf,
/// keys past the last. Adds into dq, dk, dv (dq has room for the rows of the last group,
/// which get nothing). W: floats per SIMD register (TilePair).
template <int W>
CP_SIMD_INLINE void backward_tile(const float* s, const float* dpt, const uint8_t* hidden, const float* q,
                                  const float* dout, const float* k, const float* lse, const float* delta,
                                  int64_t rows, float scale, int64_t dp, float* dq, float* dk, float* dv) {
  using V = fvec<W>;                     // W floats: 4, 8 or 16 (kernels/cpu_simd.h)
  constexpr int64_t kRowGroup = kernels::row_group(W);  // rows (or keys) per group: 4, or 8 at AVX-512
  constexpr int64_t kKeyVecs = kBc / W;  // a row's kBc values: 8, 4 or 2 vectors
  static_assert(kBr % kRowGroup == 0 && kBc % kRowGroup == 0 && kDimAlign % (kTileVecs * W) == 0,
                "groups must fit a tile's rows and keys, and register tiles the padded head dim");
  // BEGIN SOLUTION task 1: the gradients of one tile pair
  // STUB: // TODO(lesson 05, task 1): P and dS of the tile, then dv += Pᵀ·dout, dk += dSᵀ·q, dq += dS·k.
  // STUB: // README, "Task 1 — the block backward on the CPU (`block_backward.cpp`)".
  // STUB: (void)s, (void)dpt, (void)hidden, (void)q, (void)dout, (void)k, (void)lse, (void)delta, (void)rows,
  // STUB: (void)scale, (void)dp, (void)dq, (void)dk, (void)dv;
  // STUB: throw NotImplemented("lesson 05, task 1: backward_tile");
  // 1. P = e^(scale·S − lse) from the saved lse, and dS = P ∘ (dP − D), times the scale that dQ
  //    and dK carry. Hidden pairs get numbers too (even NaN): the sums below skip them. The rows
  //    after the last, up to the last group's, get dS = 0: step 3 adds them into dq rows that
  //    are never read.
  alignas(64) float p[kBr * kBc], ds[kBr * kBc];
  for (int64_t i = 0; i < rows; ++i) {
#pragma GCC unroll 8
    for (int64_t c = 0; c < kKeyVecs; ++c) {
      const int64_t at = i * kBc + c * W;
      const V p_c = exp_nonpos(load<V>(s + at) * splat<V>(scale) - splat<V>(lse[i]));
      store(p + at, p_c);
      store(ds + at, p_c * (load<V>(dpt + at) - splat<V>(delta[i])) * splat<V>(scale));
    }
  }
  const int64_t group_rows = (rows + kRowGroup - 1) / kRowGroup * kRowGroup;
  std::fill(ds + rows * kBc, ds + group_rows * kBc, 0.0f);
  // The three sums, each a register tile of kRowGroup × 2W, once without a test of `hidden` (nearly
  // every tile) and once with it. A hidden pair is skipped, not multiplied by 0: its dout, q or
  // k may be NaN.
  auto sums = [&](auto with_hidden) CP_SIMD_LAMBDA {
    constexpr bool kTest = decltype(with_hidden)::value;
    auto skip = [&](int64_t i, int64_t jj) CP_SIMD_LAMBDA { return kTest && (i >= rows || hidden[i * kBc + jj]); };
    for (int64_t d0 = 0; d0 < dp; d0 += kTileVecs * W) {
      // 2. dV += Pᵀ dO and dK += dSᵀ Q, one after the other (each tile's sums fill half the
      //    registers): kRowGroup key rows × 2W dims, summed over the query rows.
      auto sum_over_rows = [&](float* grad, const float* weight, const float* x) CP_SIMD_LAMBDA {
        for (int64_t j0 = 0; j0 < kBc; j0 += kRowGroup) {
          V acc[kRowGroup][kTileVecs];
#pragma GCC unroll 8
          for (int64_t r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 2
            for (int64_t c = 0; c < kTileVecs; ++c) acc[r][c] = load<V>(grad + (j0 + r) * dp + d0 + c * W);
          for (int64_t i = 0; i < rows; ++i) {
            V x_i[kTileVecs];
#pragma GCC unroll 2
            for (int64_t c = 0; c < kTileVecs; ++c) x_i[c] = load<V>(x + i * dp + d0 + c * W);
#pragma GCC unroll 8
            for (int64_t r = 0; r < kRowGroup; ++r) {
              if (skip(i, j0 + r)) continue;
#pragma GCC unroll 2
              for (int64_t c = 0; c < kTileVecs; ++c) acc[r][c] += weight[i * kBc + j0 + r] * x_i[c];
            }
          }
#pragma GCC unroll 8
          for (int64_t r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 2
            for (int64_t c = 0; c < kTileVecs; ++c) store(grad + (j0 + r) * dp + d0 + c * W, acc[r][c]);
        }
      };
      sum_over_rows(dv, p, dout);
      sum_over_rows(dk, ds, q);
      // 3. dQ += dS K: kRowGroup query rows × 2W dims, summed over the tile's keys.
      for (int64_t r0 = 0; r0 < group_rows; r0 += kRowGroup) {
        V acc[kRowGroup][kTileVecs];
#pragma GCC unroll 8
        for (int64_t r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 2
          for (int64_t c = 0; c < kTileVecs; ++c) acc[r][c] = load<V>(dq + (r0 + r) * dp + d0 + c * W);
        for (int64_t jj = 0; jj < kBc; ++jj) {
          V k_j[kTileVecs];
#pragma GCC unroll 2
          for (int64_t c = 0; c < kTileVecs; ++c) k_j[c] = load<V>(k + jj * dp + d0 + c * W);
#pragma GCC unroll 8
          for (int64_t r = 0; r < kRowGroup; ++r) {
            if (skip(r0 + r, jj)) continue;
#pragma GCC unroll 2
            for (int64_t c = 0; c < kTileVecs; ++c) acc[r][c] += ds[(r0 + r) * kBc + jj] * k_j[c];
          }
        }
#pragma GCC unroll 8
        for (int64_t r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 2
          for (int64_t c = 0; c < kTileVecs; ++c) store(dq + (r0 + r) * dp + d0 + c * W, acc[r][c]);
      }
    }
  };
  if (hidden)
    sums(std::true_type{});
  else
    sums(std::false_type{});
  // END SOLUTION
}

/// One tile pair for each SIMD width: its scores S and dP (tile_products), then backward_tile.
/// kernels::simd_call<TilePair> runs the CPU's widest.
struct TilePair {
  template <int W>
  CP_SIMD_INLINE static void run(const float* q, const float* dout, const float* kt, const float* vt, const float* k,
                                 const uint8_t* hidden, const float* lse, const float* delta, int64_t rows,
                                 float scale, int64_t dp, float* s_tile, float* dp_tile, float* dq, float* dk,
                                 float* dv) {
    tile_products<W>(q, rows, kt, dp, s_tile);
    tile_products<W>(dout, rows, vt, dp, dp_tile);
    backward_tile<W>(s_tile, dp_tile, hidden, q, dout, k, lse, delta, rows, scale, dp, dq, dk, dv);
  }
};

/// The tile loops of one (batch, kv head) and its group of query heads: adds the group's dq
/// (each head's rows of it) and dk, dv ([seq_k][d_model]) into the float32 outputs.
template <typename T>
void backward_group(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                    const int64_t* first, const int64_t* last, const int64_t* k_pos, float scale,
                    const AttentionShapes& s, int64_t group, float* dq, float* dk, float* dv) {
  const int64_t d_model = s.head_dim, dp = kernels::padded_dim(d_model);
  const int64_t key_tiles = (s.seq_k + kBc - 1) / kBc, query_tiles = (s.seq_q + kBr - 1) / kBr;
  kernels::TileFloats kt, vt, k_rows, q_rows, do_rows, dq_acc;
  pack_transposed(k, s.seq_k, d_model, dp, kt);
  pack_transposed(v, s.seq_k, d_model, dp, vt);
  pack_rows(k, s.seq_k, d_model, dp, kBc, k_rows);
  kernels::TileFloats dk_acc(k_rows.size(), 0.0f), dv_acc(k_rows.size(), 0.0f);
  std::vector<int64_t> k_min, k_max;  // positions of each key tile
  kernels::tile_position_bounds(k_pos, s.seq_k, kBc, k_min, k_max);
  std::vector<kernels::RowRanges> ranges;  // the keys each query tile sees (first = nullptr: all)
  for (int64_t i0 = 0; i0 < s.seq_q; i0 += kBr) ranges.push_back(kernels::row_ranges(first, last, i0, std::min(kBr, s.seq_q - i0)));
  alignas(64) float s_tile[kBr * kBc], dp_tile[kBr * kBc];
  uint8_t hidden[kBr * kBc];
  const int64_t sd = s.seq_q * d_model;
  for (int64_t h = 0; h < group; ++h) {
    pack_rows(q + h * sd, s.seq_q, d_model, dp, kBr, q_rows);
    pack_rows(dout + h * sd, s.seq_q, d_model, dp, kBr, do_rows);
    dq_acc.assign(q_rows.size(), 0.0f);
    const float* lse_h = lse + h * s.seq_q;
    const float* delta_h = delta + h * s.seq_q;
    std::vector<bool> empty_row_in_tile(query_tiles, false);  // a row with lse = -inf sees nothing
    for (int64_t i = 0; i < s.seq_q; ++i)
      if (lse_h[i] == -INFINITY) empty_row_in_tile[i / kBr] = true;
    for (int64_t pass_t0 = 0; pass_t0 < key_tiles; pass_t0 += kKeyTilesPerPass) {
      const int64_t pass_end = std::min(key_tiles, pass_t0 + kKeyTilesPerPass);
      for (int64_t u = 0; u < query_tiles; ++u) {
        const int64_t i0 = u * kBr, rows = std::min(kBr, s.seq_q - i0);
        for (int64_t t = pass_t0; t < pass_end; ++t) {
          const int64_t j0 = t * kBc, n = std::min(kBc, s.seq_k - j0);
          if (ranges[u].misses(k_min[t], k_max[t])) continue;  // no row sees any key of the tile: skip the pair
          const bool by_mask = !ranges[u].sees_all(k_min[t], k_max[t]);
          const bool masked = by_mask || n < kBc || empty_row_in_tile[u];
          if (masked) {
            for (int64_t i = 0; i < rows; ++i)
              for (int64_t jj = 0; jj < kBc; ++jj)
                hidden[i * kBc + jj] = jj >= n || lse_h[i0 + i] == -INFINITY ||
                                       (by_mask && (k_pos[j0 + jj] < first[i0 + i] || k_pos[j0 + jj] > last[i0 + i]));
          }
          kernels::simd_call<TilePair>(q_rows.data() + i0 * dp, do_rows.data() + i0 * dp, kt.data() + t * dp * kBc,
                                       vt.data() + t * dp * kBc, k_rows.data() + j0 * dp,
                                       masked ? hidden : nullptr, lse_h + i0, delta_h + i0, rows, scale, dp, s_tile,
                                       dp_tile, dq_acc.data() + i0 * dp, dk_acc.data() + j0 * dp,
                                       dv_acc.data() + j0 * dp);
        }
      }
    }
    for (int64_t i = 0; i < s.seq_q; ++i)
      for (int64_t d = 0; d < d_model; ++d) dq[h * sd + i * d_model + d] += dq_acc[i * dp + d];
  }
  for (int64_t j = 0; j < s.seq_k; ++j)
    for (int64_t d = 0; d < d_model; ++d) {
      dk[j * d_model + d] += dk_acc[j * dp + d];
      dv[j * d_model + d] += dv_acc[j * dp + d];
    }
}

#if CP_WITH_CUDA
std::atomic<CudaBackwardOverride> cuda_backward_override{nullptr};
#endif

}  // namespace

#if CP_WITH_CUDA
void set_cuda_backward_override(CudaBackwardOverride backward) { cuda_backward_override.store(backward); }
#endif

namespace {

#if CP_WITH_CUDA
using BackwardKernel = CudaBackwardOverride;
#else
using BackwardKernel = std::nullptr_t;  // no CUDA: nothing to take over
#endif

/// attention_block_backward, whose CUDA inputs go first to `cuda_backward` (null: lesson 05's
/// kernels).
AttnGrads block_backward(const torch::Tensor& dout_in, const torch::Tensor& q_in, const torch::Tensor& k_in,
                         const torch::Tensor& v_in, const torch::Tensor& out_in, const torch::Tensor& lse_in,
                         const AttentionMask& mask, std::optional<double> scale,
                         [[maybe_unused]] BackwardKernel cuda_backward) {
  const AttentionShapes s = check_attention_inputs(q_in, k_in, v_in);
  for (auto [t, name] : {std::pair{&dout_in, "dout"}, {&out_in, "out"}}) {
    check_defined(*t, name);
    CP_CHECK(t->sizes() == q_in.sizes() && t->scalar_type() == q_in.scalar_type() && t->device() == q_in.device(), name,
             ": expected q's shape, dtype and device (", q_in.sizes(), ", ", q_in.dtype(), ", ", q_in.device(), "), got ",
             t->sizes(), ", ", t->dtype(), ", ", t->device());
  }
  CP_CHECK(lse_in.defined() && lse_in.scalar_type() == torch::kFloat && lse_in.device() == q_in.device() &&
               lse_in.sizes() == torch::IntArrayRef({s.batch, s.heads_q, s.seq_q}),
           "lse: expected float32 [", s.batch, ", ", s.heads_q, ", ", s.seq_q, "] on ", q_in.device(), ", got ",
           lse_in.defined() ? c10::str(lse_in.dtype(), " ", lse_in.sizes(), " on ", lse_in.device()) : "undefined");

  const torch::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const torch::Tensor dout = dout_in.contiguous(), lse = lse_in.contiguous();
  const torch::Tensor q_pos = mask_positions(mask.q_positions, s.seq_q, q.device(), "mask.q_positions");
  const torch::Tensor k_pos = mask_positions(mask.k_positions, s.seq_k, q.device(), "mask.k_positions");
  const VisibleKeys keys = visible_keys(mask, q_pos);
  const int64_t* first = keys.masked ? keys.first.data_ptr<int64_t>() : nullptr;
  const int64_t* last = keys.masked ? keys.last.data_ptr<int64_t>() : nullptr;
  const float softmax_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(s.head_dim))));
  const torch::Tensor delta = softmax_backward_delta(dout, out_in).contiguous();
  const auto f32 = q.options().dtype(torch::kFloat);
  AttnGrads grads{torch::zeros(q.sizes(), f32), torch::zeros(k.sizes(), f32), torch::zeros(k.sizes(), f32)};

  if (q.is_cuda()) {
#if CP_WITH_CUDA
    CP_CHECK(block_attention_supports_head_dim(s.head_dim), "q: head dim ", s.head_dim,
             " is not supported by the CUDA kernels (32, 64 or 128)");
    const BlockAttentionParams params{s.batch, s.heads_q, s.heads_kv, s.seq_q, s.seq_k, s.head_dim, softmax_scale, keys.masked};
    const CudaDeviceScope cuda(q.device());  // q's GPU and its current stream
    if (cuda_backward &&
        cuda_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), lse.data_ptr<float>(),
                             delta.data_ptr<float>(), first, last, k_pos.data_ptr<int64_t>(), grads.dq.data_ptr<float>(),
                             grads.dk.data_ptr<float>(), grads.dv.data_ptr<float>(), params, kernel_dtype(q, "q"),
                             cuda.stream(), compute_capability_major(q.device())))
      return grads;
    launch_block_attention_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), lse.data_ptr<float>(),
                                    delta.data_ptr<float>(), first, last, k_pos.data_ptr<int64_t>(),
                                    grads.dq.data_ptr<float>(), grads.dk.data_ptr<float>(), grads.dv.data_ptr<float>(),
                                    params, kernel_dtype(q, "q"), cuda.stream());
    return grads;
#else
    CP_FAIL("q is a CUDA tensor (", q.device(), ") but this build has no CUDA (nvcc was not found)");
#endif
  }
  const int64_t group = s.heads_q / s.heads_kv, sd = s.seq_q * s.head_dim, kd = s.seq_k * s.head_dim;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_block_backward", [&] {
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t h_kv = 0; h_kv < s.heads_kv; ++h_kv) {
        const int64_t bh = b * s.heads_q + h_kv * group, bh_kv = b * s.heads_kv + h_kv;  // the group's first query head
        backward_group(q.data_ptr<scalar_t>() + bh * sd, k.data_ptr<scalar_t>() + bh_kv * kd,
                       v.data_ptr<scalar_t>() + bh_kv * kd, dout.data_ptr<scalar_t>() + bh * sd,
                       lse.data_ptr<float>() + bh * s.seq_q, delta.data_ptr<float>() + bh * s.seq_q,
                       first, last, k_pos.data_ptr<int64_t>(), softmax_scale, s, group,
                       grads.dq.data_ptr<float>() + bh * sd, grads.dk.data_ptr<float>() + bh_kv * kd,
                       grads.dv.data_ptr<float>() + bh_kv * kd);
      }
    }
  });
  return grads;
}

}  // namespace

AttnGrads attention_block_backward(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                   const AttentionMask& mask, std::optional<double> scale) {
#if CP_WITH_CUDA
  return block_backward(dout, q, k, v, out, lse, mask, scale, cuda_backward_override.load());
#else
  return block_backward(dout, q, k, v, out, lse, mask, scale, nullptr);
#endif
}

#if CP_WITH_CUDA
AttnGrads attention_block_backward_on(CudaBackwardOverride backward, const torch::Tensor& dout, const torch::Tensor& q,
                                      const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                      const torch::Tensor& lse, const AttentionMask& mask,
                                      std::optional<double> scale) {
  return block_backward(dout, q, k, v, out, lse, mask, scale, backward);
}
#endif

}  // namespace cp
