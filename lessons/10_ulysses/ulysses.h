// Lesson 10 — Ulysses sequence parallelism: the contract the tests use.
//
// The other family of context parallelism (DeepSpeed-Ulysses, S. A. Jacobs et al., 2023): the
// ranks hold the sequence split, [B, H, S/P, D], and one all-to-all swaps that split for a split
// of the heads, [B, H/P, S, D]. Each rank then runs ordinary attention (lesson 03) over the whole
// sequence for its heads, and a second all-to-all swaps back. The learner writes ulysses.cpp.
#pragma once

#include <torch/types.h>

#include <optional>
#include <vector>

#include "common/comm.h"
#include "common/trace.h"
#include "context_parallel_attention.h"
#include "zigzag.h"

namespace cp {

/// Options of the Ulysses forward and backward.
struct UlyssesOptions {
  bool causal = false;
  std::optional<double> scale;  ///< default 1/sqrt(D)
  /// Which tokens each rank holds (lesson 07). Attention runs over the whole sequence, so any
  /// layout works; causality comes from the layout's global positions.
  TokenLayout layout = TokenLayout::Contiguous;
  Trace* trace = nullptr;  ///< if set, compute and communication spans are recorded in it
};

/// UlyssesOptions with `causal` (and `layout`, `trace`) set, every other field at its default.
inline UlyssesOptions ulysses_options(bool causal, TokenLayout layout = TokenLayout::Contiguous,
                                      Trace* trace = nullptr) {
  UlyssesOptions options;
  options.causal = causal;
  options.layout = layout;
  options.trace = trace;
  return options;
}

/// Task 1. Sequence-sharded to head-sharded, one all-to-all over `comm` (P ranks).
/// @param x  [B, H, S/P, ...] this rank's tokens of every head (any trailing dims: [B, H, S/P]
///           works for lse), H divisible by P, the same shape on every rank.
/// @return   [B, H/P, S, ...]: heads [r·H/P, (r+1)·H/P) of rank r, over the tokens of every rank
///           in rank order (rank 0's S/P tokens, then rank 1's, ...).
torch::Tensor ulysses_seq_to_heads(Comm& comm, const torch::Tensor& x);

/// Task 1. The inverse of ulysses_seq_to_heads: [B, H/P, S, ...] to [B, H, S/P, ...].
torch::Tensor ulysses_heads_to_seq(Comm& comm, const torch::Tensor& x);

/// Task 1. The global positions (int64 [S], on the CPU) of the S tokens of the sequence that
/// ulysses_seq_to_heads gathers, index i being the token at index i of its result, when each of the
/// `world` ranks holds its S/P tokens as `layout` says (lesson 07). The attention's causal mask
/// compares these positions. S must suit the layout (divisible by P; by 2P for zig-zag): a
/// cp::Error otherwise, raised before any exchange.
torch::Tensor ulysses_positions(TokenLayout layout, int64_t seq, int world);

/// How many key/value heads the all-to-all moves: Hkv when P divides Hkv; P when Hkv divides P
/// (each K/V head is then replicated P/Hkv times, so that every rank receives the one K/V head
/// its Hq/P query heads read). Anything else is a cp::Error naming both counts.
int64_t ulysses_kv_heads(int64_t heads_q, int64_t heads_kv, int world);

/// Task 2. K or V [B, Hkv, ...] with `heads` heads along dim 1 (ulysses_kv_heads(Hq, Hkv, P)):
/// t itself when heads = Hkv; else each of t's Hkv heads heads/Hkv times, laid out so that after
/// ulysses_seq_to_heads every rank holds the K/V head its query heads read (README, "Grouped-query
/// attention"). Lesson 11 uses it too. A cp::Error when Hkv does not divide `heads`.
torch::Tensor replicate_kv_heads(const torch::Tensor& t, int64_t heads);

/// Task 3. The gradient of K or V with `heads_kv` heads, [B, Hkv, ...], from the gradient of its
/// replicas [B, heads, ...] laid out as replicate_kv_heads lays them: each head's gradient is
/// the sum over its copies; grad itself when it has Hkv heads. Lesson 11 uses it too.
torch::Tensor sum_kv_replicas(const torch::Tensor& grad, int64_t heads_kv);

/// Bytes one rank sends in an all-to-all of `t` over `world` ranks: all of it but its own 1/world.
int64_t all_to_all_bytes(const torch::Tensor& t, int world);

/// What one call cost this rank.
struct UlyssesStats {
  int64_t bytes_sent = 0;  ///< payload this rank sent to other ranks (its own part stays)
};

/// The bytes one rank sends, from the formula: each all-to-all of a [B, H, S/P, D] tensor keeps
/// 1/P of it and sends the rest, (P−1)/P · B·H·(S/P)·D elements. Forward: q, k, v in (K/V with
/// ulysses_kv_heads heads), out and lse back. Backward: dout in, dq, dk, dv back (the rest it
/// needs the forward kept in the head split, UlyssesSaved). `element_size` is the size of one
/// element of q (lse is float32).
struct UlyssesVolume {
  int64_t forward_bytes = 0;
  int64_t backward_bytes = 0;
};
UlyssesVolume ulysses_volume(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq, int64_t head_dim,
                             int world, int64_t element_size);

/// What the backward needs, kept by the forward in the head split where the attention ran: a
/// head-split tensor holds as many elements as its sequence shard, so keeping these instead of
/// q, k, v, out, lse costs no memory (except K/V heads replicated for P > Hkv), and the backward
/// does not send them again.
struct UlyssesSaved {
  torch::Tensor q, out;  ///< [B, Hq/P, S, D], dtype of q
  torch::Tensor k, v;    ///< [B, kv/P, S, D] with kv = ulysses_kv_heads(Hq, Hkv, P): replicas included
  torch::Tensor lse;     ///< [B, Hq/P, S] float32
  int64_t heads_kv = 0;  ///< Hkv of the caller's k and v: the backward sums the gradients of the replicas
};

/// This rank's share of full attention over the whole sequence.
struct UlyssesResult {
  torch::Tensor out;  ///< [B, Hq, S/P, D], dtype of q
  torch::Tensor lse;  ///< [B, Hq, S/P] float32
  UlyssesStats stats;
  UlyssesSaved saved;  ///< for ulysses_attention_backward
};

/// Task 2. Ulysses attention forward.
/// @param q     [B, Hq, S/P, D]; k, v [B, Hkv, S/P, D], laid out as options.layout says; Hq
///              divisible by P, Hkv divisible by P or dividing P (ulysses_kv_heads), Hq divisible
///              by Hkv. Every rank passes the same shapes, dtype and device kind.
/// CPU: float32/float64; CUDA tensors: float32/float16/bfloat16, D in {32, 64, 128} (lesson 03).
UlyssesResult ulysses_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v, const UlyssesOptions& options = {});

/// This rank's gradients of full attention over the whole sequence.
struct UlyssesGrads {
  torch::Tensor dq, dk, dv;  ///< [B, Hq, S/P, D] and [B, Hkv, S/P, D], dtype of q
  UlyssesStats stats;
};

/// The checks of a backward (ulysses_attention_backward, lesson 11's hybrid): dout is defined,
/// 4-D and the same on every rank of `comm`, and `saved` is the head split of a forward for it
/// over comm's P ranks; a cp::Error names `dout` or `saved` otherwise.
void check_ulysses_saved(Comm& comm, const torch::Tensor& dout, const UlyssesSaved& saved);

/// Task 3. Ulysses attention backward: dout [B, Hq, S/P, D] is the gradient of this rank's out,
/// `saved` what the forward kept (UlyssesResult::saved), options the forward's. The forward's
/// exchanges transposed: dout to the head split, lesson 05's block backward over the whole
/// sequence, dq, dk, dv back to the sequence split (dk, dv of replicated K/V heads summed over
/// their replicas). A cp::Error names `saved` or `dout` when they do not fit each other.
UlyssesGrads ulysses_attention_backward(Comm& comm, const torch::Tensor& dout, const UlyssesSaved& saved,
                                        const UlyssesOptions& options = {});

/// Ulysses as a strategy of lesson 09's layer (causal, contiguous shards): the layer and its
/// training step run with it as with the ring. Its StrategyForward::saved is the forward's
/// UlyssesSaved, as to_saved_tensors packs it.
Strategy ulysses_strategy();

/// UlyssesSaved as the tensors a strategy saves (q, out, k, v, lse, and Hkv as a 0-dim int64
/// tensor), and back; from_saved_tensors gives a cp::Error naming `saved` for anything else.
std::vector<torch::Tensor> to_saved_tensors(const UlyssesSaved& saved);
UlyssesSaved from_saved_tensors(const std::vector<torch::Tensor>& saved);

}  // namespace cp
