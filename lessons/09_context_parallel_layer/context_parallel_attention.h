// Lesson 09 — a context-parallel attention layer: the contract the tests use.
//
// The strategies of lessons 04–08 become one differentiable operation (a
// torch::autograd::Function), used inside an ordinary torch::nn::Module: Q/K/V/O projections
// replicated on every rank, the sequence sharded over the ranks. One training step of the
// layer on N ranks must equal the same step on one device. The learner writes
// context_parallel_attention.cpp.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include <string>
#include <vector>

#include "common/comm.h"
#include "common/trace.h"
#include "llama3_allgather.h"
#include "zigzag.h"

namespace cp {

/// The context-parallel attention algorithms of the course, all causal.
enum class Strategy {
  Ring,              ///< lessons 04–05: contiguous shards, K/V around the ring
  ZigZagRing,        ///< lesson 07: zig-zag shards, balanced ring
  Llama3TwoKernels,  ///< lesson 08: zig-zag shards, all-gathered K/V, one call per query group
  Llama3Fused        ///< lesson 08: the same with one call over duplicated K/V slices
};

std::string to_string(Strategy strategy);
const std::vector<Strategy>& all_strategies();

/// How a strategy expects the sequence to be sharded (lesson 07's layouts): contiguous for the
/// plain ring, zig-zag for the others (for Llama 3 every sequence of the batch is one document).
TokenLayout layout_of(Strategy strategy);

/// What one strategy call cost this rank.
struct StrategyStats {
  int64_t pairs = 0;       ///< query × key pairs computed, per head, summed over the batch
  int64_t bytes_sent = 0;  ///< payload this rank sent (ring: K/V hops; Llama 3: collectives)
};

struct StrategyForward {
  torch::Tensor out;  ///< [B, Hq, S/N, D], dtype of q
  torch::Tensor lse;  ///< [B, Hq, S/N] float32
  StrategyStats stats;
};

struct StrategyBackward {
  torch::Tensor dq, dk, dv;  ///< shapes and dtypes of q, k, v
  StrategyStats stats;
};

/// Causal attention of this rank's shards q [B, Hq, S/N, D], k, v [B, Hkv, S/N, D] (laid out
/// as layout_of(strategy) says) with the given strategy; the backward takes the forward's out
/// and lse. Every strategy gives the same numbers up to rounding.
StrategyForward strategy_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 Strategy strategy, Trace* trace = nullptr);
StrategyBackward strategy_backward(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q,
                                   const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                   const torch::Tensor& lse, Strategy strategy, Trace* trace = nullptr);

/// strategy_forward as a differentiable operation: returns out [B, Hq, S/N, D]; autograd's
/// backward calls strategy_backward (which communicates: every rank of comm must run it).
torch::Tensor context_parallel_attention(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, Strategy strategy);

struct ContextParallelAttentionOptions {
  int64_t embed_dim = 0;  ///< E
  int64_t heads_q = 0;    ///< Hq; the head dim is D = E / Hq
  int64_t heads_kv = 0;   ///< Hkv, dividing Hq (grouped-query attention)
  Strategy strategy = Strategy::ZigZagRing;
};

/// Causal multi-head (grouped-query) self-attention whose sequence is sharded over `comm`:
/// y = attention(x Wqᵀ, x Wkᵀ, x Wvᵀ) Woᵀ, no biases. The weights are replicated: every rank
/// holds all of them (broadcast_parameters makes them equal, all_reduce_gradients keeps them so).
class ContextParallelAttentionImpl : public torch::nn::Module {
 public:
  /// `comm` must outlive the module.
  ContextParallelAttentionImpl(Comm& comm, const ContextParallelAttentionOptions& options);

  /// @param x [B, S/N, E] this rank's tokens, laid out as layout_of(options.strategy) says
  /// @return  [B, S/N, E]
  torch::Tensor forward(const torch::Tensor& x);

  const ContextParallelAttentionOptions& options() const { return options_; }

  torch::nn::Linear q_proj{nullptr};  ///< weight [Hq·D, E]
  torch::nn::Linear k_proj{nullptr};  ///< weight [Hkv·D, E]
  torch::nn::Linear v_proj{nullptr};  ///< weight [Hkv·D, E]
  torch::nn::Linear o_proj{nullptr};  ///< weight [E, Hq·D]

 private:
  Comm* comm_;
  ContextParallelAttentionOptions options_;
};
TORCH_MODULE(ContextParallelAttention);

/// Copies every parameter of rank `root` to all ranks (replicated weights start equal).
void broadcast_parameters(Comm& comm, torch::nn::Module& module, int root = 0);

/// Averages every parameter's gradient over the ranks of `comm` (sum, then divide by N), in
/// place, so that each rank takes the same optimizer step. A parameter without a gradient gets
/// a zero one and takes part, so that every rank makes the same collective calls.
void all_reduce_gradients(Comm& comm, torch::nn::Module& module);

}  // namespace cp
