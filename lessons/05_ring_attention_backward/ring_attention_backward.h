// Lesson 05 — ring attention backward: the contract the tests use.
//
// The block backward recomputes the attention probabilities from the saved lse (no stored
// attention matrix). The ring backward rotates K/V as the forward does; dQ stays home, and the
// dK/dV accumulators travel *with* their K/V chunk, arriving home after N hops. The learner writes
// block_backward.cpp, block_backward.cu and ring_attention_backward.cpp.
#pragma once

#include <torch/types.h>

#include <optional>

#include "block_attention.h"
#include "common/comm.h"
#include "ring_attention.h"

#if CP_WITH_CUDA
#include "block_backward.cuh"  // CudaBackwardOverride
#endif

namespace cp {

/// Gradients of one block, float32 whatever the input dtype (they are accumulators).
struct AttnGrads {
  torch::Tensor dq;  ///< [B, Hq, Sq, D] float32
  torch::Tensor dk;  ///< [B, Hkv, Sk, D] float32 (summed over the query heads of each group)
  torch::Tensor dv;  ///< [B, Hkv, Sk, D] float32
};

/// Backward of attention of q over one block of k/v, given the *final* out and lse of these
/// queries (over all keys, not only this block's): P = exp(scale·q·kᵀ − lse) on visible pairs,
/// D = rowsum(dout ∘ out), dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − D), dQ = dS K · scale,
/// dK = dSᵀ Q · scale.
/// @param dout, out  [B, Hq, Sq, D] (dtype of q)   @param lse  [B, Hq, Sq] float32
/// CPU: float32/float64, any D. CUDA: float32/float16/bfloat16, D in {32, 64, 128}.
AttnGrads attention_block_backward(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                   const AttentionMask& mask = {}, std::optional<double> scale = std::nullopt);

#if CP_WITH_CUDA
/// attention_block_backward with `backward` (lesson 18's kernels) in place of whatever
/// set_cuda_backward_override holds: the same checks and tensors around another kernel.
AttnGrads attention_block_backward_on(CudaBackwardOverride backward, const torch::Tensor& dout, const torch::Tensor& q,
                                      const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                      const torch::Tensor& lse, const AttentionMask& mask = {},
                                      std::optional<double> scale = std::nullopt);
#endif

/// This rank's gradients of full attention over the whole (contiguously sharded) sequence.
struct RingGrads {
  torch::Tensor dq, dk, dv;  ///< shapes and dtype of q, k, v
  RingStats stats;
};

/// Ring attention backward: q, k, v, out, lse are this rank's shard and the forward's results
/// (ring_attention_forward), dout the gradient of this rank's out.
RingGrads ring_attention_backward(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q,
                                  const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                  const torch::Tensor& lse, const RingOptions& options = {});

}  // namespace cp
