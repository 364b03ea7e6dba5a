// Lesson 03, tasks 1 and 2 — the merge of partial attention results, and block attention on
// the CPU with the same tiled algorithm as the CUDA kernel (task 3, block_attention.cu).
#include "block_attention.h"

#include <cmath>
#include <vector>

#include "common/error.h"
#include "common/tensor_checks.h"

#if CP_WITH_CUDA
#include "block_attention.cuh"
#include "common/device.h"
#endif

namespace cp {
namespace {

constexpr int64_t kBc = 32;  // keys per tile, as in the kernel

/// Task 2: attention of one query row over all keys, tile by tile, with the (m, l, O) state.
/// q_row, out_row: [D]; k_head, v_head: [Sk, D]; o: scratch of D floats.
template <typename T>
void attend_row(const T* q_row, const T* k_head, const T* v_head, const int64_t* k_pos, int64_t q_pos, bool causal,
                float scale, int64_t seq_k, int64_t d_model, float* o, T* out_row, float* lse) {
  // BEGIN SOLUTION task 2: one query row, tile by tile
  // STUB: // TODO(lesson 03, task 2): m = -inf, l = 0, o = 0. For each tile of kBc keys: the scores
  // STUB: // s_j = scale · q·k_j (-inf if causal and k_pos[j] > q_pos), the tile max; skip a tile with
  // STUB: // no visible key; m_new = max(m, tile max); rescale l and o by exp(m − m_new); add
  // STUB: // exp(s_j − m_new) to l and exp(s_j − m_new)·v_j to o for every key with s_j > -inf. Then
  // STUB: // out = o / l and lse = m + log l (+inf if m = +inf), or out = 0 and lse = -inf when l = 0.
  // STUB: // NaN is never a masked key: the maxima must keep it (std::max drops it), l = 0 means empty.
  // STUB: (void)q_row, (void)k_head, (void)v_head, (void)k_pos, (void)q_pos, (void)causal, (void)scale,
  // STUB: (void)seq_k, (void)d_model, (void)o, (void)out_row, (void)lse;
  // STUB: throw NotImplemented("lesson 03, task 2: attend_row (the CPU tile loop)");
  float m = -INFINITY, l = 0.0f;
  std::fill(o, o + d_model, 0.0f);
  float s[kBc];
  for (int64_t j0 = 0; j0 < seq_k; j0 += kBc) {
    const int64_t n = std::min(kBc, seq_k - j0);
    float tile_max = -INFINITY;
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj;
      if (causal && k_pos[j] > q_pos) {
        s[jj] = -INFINITY;
        continue;
      }
      float dot = 0.0f;
      for (int64_t d = 0; d < d_model; ++d) dot += static_cast<float>(q_row[d]) * static_cast<float>(k_head[j * d_model + d]);
      s[jj] = dot * scale;
      tile_max = (s[jj] > tile_max || s[jj] != s[jj]) ? s[jj] : tile_max;  // NaN wins: std::max drops it
    }
    if (tile_max == -INFINITY) continue;  // no visible key in this tile
    const float m_new = (tile_max > m || tile_max != tile_max) ? tile_max : m;  // NaN in m or tile_max wins
    const float alpha = std::exp(m - m_new);  // 0 on the first visible tile (m = -inf)
    l *= alpha;
    for (int64_t d = 0; d < d_model; ++d) o[d] *= alpha;
    for (int64_t jj = 0; jj < n; ++jj) {
      if (s[jj] == -INFINITY) continue;  // a masked key; a visible one counts even at p = 0 (its v may be NaN)
      const float p = std::exp(s[jj] - m_new);
      l += p;
      const T* v_row = v_head + (j0 + jj) * d_model;
      for (int64_t d = 0; d < d_model; ++d) o[d] += p * static_cast<float>(v_row[d]);
    }
    m = m_new;
  }
  // l = 0: no visible key, out 0 and lse -inf. Not `l > 0`, which a NaN row (l = NaN) would fail.
  const float inv_l = l == 0.0f ? 0.0f : 1.0f / l;
  for (int64_t d = 0; d < d_model; ++d) out_row[d] = static_cast<T>(o[d] * inv_l);
  *lse = l == 0.0f ? -INFINITY : m == INFINITY ? INFINITY : m + std::log(l);  // a +inf score: l = inf/inf = NaN
  // END SOLUTION
}

AttnResult forward_cpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& q_pos, const torch::Tensor& k_pos, bool causal, float scale,
                       const AttentionShapes& s) {
  AttnResult result{torch::empty_like(q), torch::empty({s.batch, s.heads_q, s.seq_q}, q.options().dtype(torch::kFloat))};
  const int64_t group = s.heads_q / s.heads_kv;
  std::vector<float> o(s.head_dim);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_block_forward", [&] {
    const scalar_t* pq = q.data_ptr<scalar_t>();
    const scalar_t* pk = k.data_ptr<scalar_t>();
    const scalar_t* pv = v.data_ptr<scalar_t>();
    scalar_t* pout = result.out.data_ptr<scalar_t>();
    float* plse = result.lse.data_ptr<float>();
    const int64_t* qp = q_pos.data_ptr<int64_t>();
    const int64_t* kp = k_pos.data_ptr<int64_t>();
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t h = 0; h < s.heads_q; ++h) {
        const int64_t bh = b * s.heads_q + h, bh_kv = b * s.heads_kv + h / group;
        for (int64_t i = 0; i < s.seq_q; ++i) {
          attend_row(pq + (bh * s.seq_q + i) * s.head_dim, pk + bh_kv * s.seq_k * s.head_dim,
                     pv + bh_kv * s.seq_k * s.head_dim, kp, qp[i], causal, scale, s.seq_k, s.head_dim, o.data(),
                     pout + (bh * s.seq_q + i) * s.head_dim, plse + bh * s.seq_q + i);
        }
      }
    }
  });
  return result;
}

AttnResult forward_cuda(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& q_pos, const torch::Tensor& k_pos, bool causal, float scale,
                        const AttentionShapes& s) {
#if CP_WITH_CUDA
  CP_CHECK(block_attention_supports_head_dim(s.head_dim), "q: head dim ", s.head_dim,
           " is not supported by the CUDA kernel (32, 64 or 128)");
  AttnResult result{torch::empty_like(q), torch::empty({s.batch, s.heads_q, s.seq_q}, q.options().dtype(torch::kFloat))};
  const BlockAttentionParams params{s.batch, s.heads_q, s.heads_kv, s.seq_q, s.seq_k, s.head_dim, scale, causal};
  const CudaDeviceScope cuda(q.device());  // q's GPU and its current stream
  launch_block_attention_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), result.out.data_ptr(),
                                 result.lse.data_ptr<float>(), q_pos.data_ptr<int64_t>(), k_pos.data_ptr<int64_t>(),
                                 params, kernel_dtype(q, "q"), cuda.stream());
  return result;
#else
  (void)k, (void)v, (void)q_pos, (void)k_pos, (void)causal, (void)scale, (void)s;
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

torch::Tensor mask_positions(const torch::Tensor& given, int64_t n, torch::Device device, const char* arg) {
  if (!given.defined()) return torch::arange(n, torch::TensorOptions().dtype(torch::kLong).device(device));
  CP_CHECK(given.dim() == 1 && given.size(0) == n && given.scalar_type() == torch::kLong, arg,
           ": expected an int64 tensor of shape [", n, "], got ", given.dtype(), " ", given.sizes());
  CP_CHECK(given.device() == device, arg, ": must be on ", device, " like q, got ", given.device());
  return given.contiguous();
}

AttnResult attention_block_forward(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                                   const AttentionMask& mask, std::optional<double> scale) {
  const AttentionShapes s = check_attention_inputs(q_in, k_in, v_in);
  const torch::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const torch::Tensor q_pos = mask_positions(mask.q_positions, s.seq_q, q.device(), "mask.q_positions");
  const torch::Tensor k_pos = mask_positions(mask.k_positions, s.seq_k, q.device(), "mask.k_positions");
  const float softmax_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(s.head_dim))));
  if (q.is_cuda()) return forward_cuda(q, k, v, q_pos, k_pos, mask.causal, softmax_scale, s);
  return forward_cpu(q, k, v, q_pos, k_pos, mask.causal, softmax_scale, s);
}

void merge_attention(torch::Tensor& out_acc, torch::Tensor& lse_acc, const torch::Tensor& out_blk,
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
  // BEGIN SOLUTION task 1: the merge
  // STUB: // TODO(lesson 03, task 1): m = max(lse_acc, lse_blk); weights w = exp(lse − m) (use 0 as a
  // STUB: // stand-in for m where it is ±inf, as torch.logsumexp does: both sides empty, or a +inf score);
  // STUB: // out = (w_acc·out_acc + w_blk·out_blk) / (w_acc + w_blk), lse = m + log(w_acc + w_blk); rows
  // STUB: // where both sides are empty stay (0, -inf); a NaN on either side gives NaN. In place.
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
