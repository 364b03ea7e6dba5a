// Lesson 05, task 1 — the backward of one attention block on the CPU, and the dispatch to the
// CUDA kernels of task 2 (block_backward.cu).
#include <cmath>

#include "common/error.h"
#include "common/tensor_checks.h"
#include "ring_attention_backward.h"

#if CP_WITH_CUDA
#include "block_backward.cuh"
#include "common/device.h"
#endif

namespace cp {
namespace {

/// D_i = Σ_d dout_id · out_id, float32 [B, Hq, Sq]: the term every dS of row i subtracts.
torch::Tensor softmax_backward_delta(const torch::Tensor& dout, const torch::Tensor& out) {
  // BEGIN YOUR CODE task 1: D = rowsum(dO ∘ O)
  // TODO(lesson 05, task 1): the row sums of dout·out, in float32.
  (void)dout, (void)out;
  throw NotImplemented("lesson 05, task 1: softmax_backward_delta");
  // END YOUR CODE
}

/// Task 1: one (batch, query head) of the block backward. Adds to dq [Sq, D] and to the group's
/// dk, dv [Sk, D] (several query heads share them under GQA).
template <typename T>
void backward_head(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                   const int64_t* q_pos, const int64_t* k_pos, bool causal, float scale, const AttentionShapes& s, float* dq,
                   float* dk, float* dv) {
  const int64_t d_model = s.head_dim;
  // BEGIN YOUR CODE task 1: the gradients of one head
  // TODO(lesson 05, task 1): for every visible pair (i, j): p = exp(scale·q_i·k_j − lse_i),
  // dv_j += p·dout_i, dp = dout_i·v_j, ds = p·(dp − delta_i), dq_i += scale·ds·k_j,
  // dk_j += scale·ds·q_i. A row with lse = -inf has no visible key: skip it (not a NaN row:
  // compare with -inf exactly). Hidden pairs are skipped, never multiplied by p = 0.
  (void)q, (void)k, (void)v, (void)dout, (void)lse, (void)delta, (void)q_pos, (void)k_pos, (void)causal,
  (void)scale, (void)dq, (void)dk, (void)dv, (void)d_model;
  throw NotImplemented("lesson 05, task 1: backward_head");
  // END YOUR CODE
}

}  // namespace

AttnGrads attention_block_backward(const torch::Tensor& dout_in, const torch::Tensor& q_in, const torch::Tensor& k_in,
                                   const torch::Tensor& v_in, const torch::Tensor& out_in, const torch::Tensor& lse_in,
                                   const AttentionMask& mask, std::optional<double> scale) {
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
  const float softmax_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(s.head_dim))));
  const torch::Tensor delta = softmax_backward_delta(dout, out_in).contiguous();
  const auto f32 = q.options().dtype(torch::kFloat);
  AttnGrads grads{torch::zeros(q.sizes(), f32), torch::zeros(k.sizes(), f32), torch::zeros(k.sizes(), f32)};

  if (q.is_cuda()) {
#if CP_WITH_CUDA
    CP_CHECK(block_attention_supports_head_dim(s.head_dim), "q: head dim ", s.head_dim,
             " is not supported by the CUDA kernels (32, 64 or 128)");
    const BlockAttentionParams params{s.batch, s.heads_q, s.heads_kv, s.seq_q, s.seq_k, s.head_dim, softmax_scale, mask.causal};
    const CudaDeviceScope cuda(q.device());  // q's GPU and its current stream
    launch_block_attention_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), lse.data_ptr<float>(),
                                    delta.data_ptr<float>(), q_pos.data_ptr<int64_t>(), k_pos.data_ptr<int64_t>(),
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
      for (int64_t h = 0; h < s.heads_q; ++h) {
        const int64_t bh = b * s.heads_q + h, bh_kv = b * s.heads_kv + h / group;
        backward_head(q.data_ptr<scalar_t>() + bh * sd, k.data_ptr<scalar_t>() + bh_kv * kd,
                      v.data_ptr<scalar_t>() + bh_kv * kd, dout.data_ptr<scalar_t>() + bh * sd,
                      lse.data_ptr<float>() + bh * s.seq_q, delta.data_ptr<float>() + bh * s.seq_q,
                      q_pos.data_ptr<int64_t>(), k_pos.data_ptr<int64_t>(), mask.causal, softmax_scale, s,
                      grads.dq.data_ptr<float>() + bh * sd, grads.dk.data_ptr<float>() + bh_kv * kd,
                      grads.dv.data_ptr<float>() + bh_kv * kd);
      }
    }
  });
  return grads;
}

}  // namespace cp
