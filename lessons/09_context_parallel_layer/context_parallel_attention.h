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

#include <functional>
#include <string>
#include <vector>

#include "common/comm.h"
#include "common/trace.h"
#include "llama3_allgather.h"
#include "zigzag.h"

namespace cp {

/// What one strategy call cost this rank.
struct StrategyStats {
  int64_t pairs = 0;       ///< query × key pairs computed, per head, summed over the batch
  int64_t bytes_sent = 0;  ///< payload this rank sent (ring: K/V hops; Llama 3: collectives; Ulysses: all-to-alls)
};

struct StrategyForward {
  torch::Tensor out;  ///< [B, Hq, S/N, D], dtype of q
  torch::Tensor lse;  ///< [B, Hq, S/N] float32
  StrategyStats stats;
  /// What this strategy's backward needs, in the form it wants it; the layer keeps these between
  /// the passes and hands them to strategy_backward. The ring family and Llama 3: this rank's q,
  /// k, v, out, lse. Ulysses and the hybrid (lessons 10, 11): the same in their head split, where
  /// the attention ran, so that the backward does not send them again.
  std::vector<torch::Tensor> saved;
};

struct StrategyBackward {
  torch::Tensor dq, dk, dv;  ///< shapes and dtypes of q, k, v
  StrategyStats stats;
};

/// A context-parallel attention algorithm, causal, as the layer sees it: how the sequence is
/// sharded (lesson 07's layouts) and its forward and backward on this rank's shards q
/// [B, Hq, S/N, D], k, v [B, Hkv, S/N, D]; the backward takes the gradient of out and what the
/// forward saved (StrategyForward::saved). Every strategy gives the same numbers up to rounding.
/// A value, so that later lessons add their own (lesson 10's ulysses_strategy, lesson 11's
/// hybrid_strategy) without this lesson knowing them.
struct Strategy {
  std::string name;
  TokenLayout layout = TokenLayout::Contiguous;
  std::function<StrategyForward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                Trace* trace)>
      forward;
  std::function<StrategyBackward(Comm& comm, const torch::Tensor& dout, const std::vector<torch::Tensor>& saved,
                                 Trace* trace)>
      backward;
};

/// A ring forward and backward of the course on one layout's shards (lessons 04, 05, 07, 12).
using RingForward = std::function<RingResult(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                             const torch::Tensor& v, RingOptions options)>;
using RingBackward = std::function<RingGrads(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q,
                                             const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                             const torch::Tensor& lse, RingOptions options)>;

/// A causal ring strategy named `name` on `layout`'s shards from a ring forward and backward: the
/// pairs of its blocks and its bytes in the stats, this rank's q, k, v, out, lse saved.
Strategy ring_family_strategy(const std::string& name, TokenLayout layout, RingForward forward, RingBackward backward);

Strategy ring_strategy();                   ///< lessons 04–05: contiguous shards, K/V around the ring
Strategy zigzag_ring_strategy();            ///< lesson 07: zig-zag shards, balanced ring
Strategy stripe_ring_strategy();            ///< lesson 07: stripe shards (token t on rank t mod N), the ring on their schedule
Strategy llama3_strategy(Llama3Mode mode);  ///< lesson 08: zig-zag shards, all-gathered K/V (two kernels or fused)

/// The strategies of lessons 04–08, in course order.
const std::vector<Strategy>& all_strategies();

std::string to_string(const Strategy& strategy);
/// How a strategy expects the sequence to be sharded (for Llama 3 every sequence of the batch is
/// one document).
TokenLayout layout_of(const Strategy& strategy);

/// strategy.forward after checking q, k, v (check_attention_inputs).
StrategyForward strategy_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const Strategy& strategy, Trace* trace = nullptr);
/// strategy.backward: dout [B, Hq, S/N, D], the gradient of the forward's out, and the forward's
/// StrategyForward::saved.
StrategyBackward strategy_backward(Comm& comm, const torch::Tensor& dout, const std::vector<torch::Tensor>& saved,
                                   const Strategy& strategy, Trace* trace = nullptr);
/// For a strategy's backward: a cp::Error naming `saved` unless it holds `count` defined tensors.
void check_saved(const std::vector<torch::Tensor>& saved, size_t count, const std::string& strategy);

/// strategy_forward as a differentiable operation: returns out [B, Hq, S/N, D]; autograd's
/// backward calls strategy_backward (which communicates: every rank of comm must run it).
torch::Tensor context_parallel_attention(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const Strategy& strategy);

struct ContextParallelAttentionOptions {
  int64_t embed_dim = 0;  ///< E
  int64_t heads_q = 0;    ///< Hq; the head dim is D = E / Hq
  int64_t heads_kv = 0;   ///< Hkv, dividing Hq (grouped-query attention)
  Strategy strategy = zigzag_ring_strategy();
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
