// Lesson 13 — training a small language model under context parallelism: the contract the tests
// use.
//
// A decoder-only language model (token embedding, RMSNorm, grouped-query attention with rotary
// position embeddings, a SwiGLU MLP, an LM head) whose attention runs on any strategy of the
// course. Training it on N ranks takes the same steps as on one device only if four things are
// right: the rotary angles come from the tokens' global positions, the next-token labels are made
// before the sequence is sharded, the loss is weighted by the valid tokens of all ranks, and the
// gradients are all-reduced. Then: how bfloat16 partial results drift as the ring grows, and
// where to accumulate them. The learner writes model.cpp (task 1), training.cpp (tasks 2–4) and
// precision.cpp (task 5).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/comm.h"
#include "context_parallel_attention.h"
#include "zigzag.h"

namespace cp {

/// The label of a token whose next token is not to be predicted (the last token of a sequence,
/// padding): the loss skips it. The value PyTorch's cross_entropy ignores by default.
constexpr int64_t kIgnoreLabel = -100;
/// shard_batch's pad_token when the batch has no padding.
constexpr int64_t kNoPadToken = -1;

// ── Task 1: rotary position embeddings ───────────────────────────────────────────────────────

/// Rotates x [B, H, L, D] (D even) by the angles of `positions` (int64 [L], the tokens' positions
/// in the whole sequence): with h = D/2, for i < h and θ_i = base^(−2i/D),
///   y[..., i]     = x[..., i] cos(p θ_i) − x[..., i + h] sin(p θ_i)
///   y[..., i + h] = x[..., i + h] cos(p θ_i) + x[..., i] sin(p θ_i)
/// (the "rotate half" convention of Llama). So q·k after rotation depends on the positions only
/// through their difference. Returns x's dtype and device; differentiable (autograd).
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& positions, double base = 10000.0);

// ── The model (given) ───────────────────────────────────────────────────────────────────────

struct TinyLMOptions {
  int64_t vocab = 32;      ///< V
  int64_t embed_dim = 64;  ///< E
  int64_t layers = 2;
  int64_t heads_q = 4;   ///< Hq; D = E / Hq must be even (rotary)
  int64_t heads_kv = 2;  ///< Hkv, dividing Hq
  int64_t mlp_dim = 128;
  double rope_base = 10000.0;
  uint64_t seed = 0;  ///< the initial weights are a function of the seed alone: equal on every rank
  Strategy strategy = zigzag_ring_strategy();  ///< where the attention runs; its layout shards the tokens
};

/// x / sqrt(mean(x²) + eps) · weight over the last dim.
class RMSNormImpl : public torch::nn::Module {
 public:
  explicit RMSNormImpl(int64_t dim, double eps = 1e-5);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;  ///< [dim], starts at 1
  double eps;
};
TORCH_MODULE(RMSNorm);

/// One pre-norm decoder block: x + attention(norm(x)), then h + mlp(norm(h)), with
/// attention = o_proj(context_parallel_attention(rotary(q_proj), rotary(k_proj), v_proj)) (causal,
/// grouped-query) and mlp = down(silu(gate(x)) ∘ up(x)). No biases.
class DecoderBlockImpl : public torch::nn::Module {
 public:
  DecoderBlockImpl(Comm& comm, const TinyLMOptions& options);
  /// x [B, S/N, E] this rank's tokens, positions int64 [S/N] their global positions.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions);

  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  torch::nn::Linear gate{nullptr}, up{nullptr}, down{nullptr};

 private:
  Comm* comm_;
  TinyLMOptions options_;
};
TORCH_MODULE(DecoderBlock);

/// The language model: embed → blocks → norm → lm_head (untied). Parameters are replicated on
/// every rank; the sequence is sharded as layout_of(options.strategy) says. Parameter names:
/// `embed.weight`, `blocks.N.{attn_norm,mlp_norm}.weight`, `blocks.N.{q,k,v,o}_proj.weight`,
/// `blocks.N.{gate,up,down}.weight`, `norm.weight`, `lm_head.weight` (N: the block's index).
class TinyLMImpl : public torch::nn::Module {
 public:
  /// `comm` must outlive the model. A cp::Error names a bad option.
  TinyLMImpl(Comm& comm, const TinyLMOptions& options);
  /// tokens int64 [B, S/N] and their global positions int64 [S/N] → logits [B, S/N, V].
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& positions);
  const TinyLMOptions& options() const { return options_; }

  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  RMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  TinyLMOptions options_;
};
TORCH_MODULE(TinyLM);

// ── Task 2: tokens, positions and labels of a rank ──────────────────────────────────────────

/// What one rank trains on.
struct TokenShard {
  torch::Tensor tokens;     ///< int64 [B, S/N]: the rank's tokens, in position order
  torch::Tensor positions;  ///< int64 [S/N]: their positions in the whole sequence
  torch::Tensor labels;     ///< int64 [B, S/N]: the token that follows each one, or kIgnoreLabel
};

/// Rank `rank`'s share of the batch `tokens` (int64 [B, S]) under `layout` (lesson 07: S
/// divisible by N, by 2N for the zig-zag). The label of position t is tokens[t + 1], decided on
/// the whole sequence before it is sharded; kIgnoreLabel for t = S − 1 and where tokens[t + 1] is
/// `pad_token` (padding is never predicted).
TokenShard shard_batch(const torch::Tensor& tokens, TokenLayout layout, int world, int rank,
                       int64_t pad_token = kNoPadToken);

// ── Task 3: the loss ────────────────────────────────────────────────────────────────────────

/// The cross-entropy of the whole batch, from the shards.
struct ShardedLoss {
  /// The scalar this rank backpropagates: after all_reduce_gradients (which averages over the N
  /// ranks), every parameter's gradient is that of the mean loss over the valid tokens of all
  /// ranks. 0 (with a gradient of 0) when no rank has a valid token.
  torch::Tensor objective;
  double loss = 0;     ///< the mean loss over the valid tokens of all ranks: the same on every rank (0 if none)
  int64_t tokens = 0;  ///< valid tokens (label != kIgnoreLabel) on all ranks
};

/// logits [B, S/N, V] (float32/float64), labels int64 [B, S/N] (kIgnoreLabel or 0 … V − 1).
/// Collective: every rank of comm must call it.
ShardedLoss sharded_cross_entropy(Comm& comm, const torch::Tensor& logits, const torch::Tensor& labels);

// ── Task 4: a training step ─────────────────────────────────────────────────────────────────

/// One optimizer step of `model` on this rank's shard: gradients zeroed, forward, loss, backward,
/// gradients all-reduced (lesson 09's all_reduce_gradients), optimizer step. Returns the loss of
/// the whole batch (ShardedLoss::loss). Collective.
ShardedLoss train_step(Comm& comm, TinyLM& model, torch::optim::Optimizer& optimizer, const TokenShard& shard);

// ── Task 5: the merge in another form; the precision experiment ─────────────────────────────

/// Lesson 03's merge_attention written with a sigmoid (the form of PyTorch's context parallelism
/// and ring-flash-attention): with s = sigmoid(lse_blk − lse_acc),
///   out_acc ← out_acc − s (out_acc − out_blk),
///   lse_acc ← max(lse_acc, lse_blk) − log sigmoid(|lse_acc − lse_blk|)   (= log(e^lse_acc + e^lse_blk)).
/// The same contract as merge_attention: float32 accumulators, in place, either side may be empty
/// (lse = −inf: both empty stays out = 0, lse = −inf, never NaN).
void merge_attention_sigmoid(torch::Tensor& out_acc, torch::Tensor& lse_acc, const torch::Tensor& out_blk,
                             const torch::Tensor& lse_blk);

/// Where the ring keeps the sum of its bfloat16 partial results.
enum class Accumulator {
  Bfloat16,  ///< rounded to bfloat16 after every merge or addition
  Float32    ///< float32, rounded to bfloat16 once at the end (the course's kernels and rings)
};
enum class MergeForm {
  Exp,     ///< merge_attention (lesson 03)
  Sigmoid  ///< merge_attention_sigmoid (task 5)
};
std::string to_string(Accumulator accumulator);
std::string to_string(MergeForm form);

/// The sizes of the precision experiment: N ranks of `chunk` tokens (S = N · chunk), causal,
/// q, k, v, dout drawn from randn with `seed` and rounded to bfloat16. The defaults are the
/// sizes of make precision and of the README's table.
struct PrecisionSetup {
  int64_t chunk = 128;
  int64_t heads = 2;
  int64_t dim = 64;
  uint64_t seed = 0;
};

/// Errors against float64 attention, as mean |error| / mean |reference| (lse: mean |error|),
/// where the ring merges most: out, lse and dq of the last rank (N key chunks merged), dk and dv
/// of the first chunk (N query chunks' contributions summed).
struct PrecisionErrors {
  double out = 0, lse = 0, dq = 0, dk = 0, dv = 0;
};

/// One way of keeping the ring's sums, and its errors.
struct PrecisionResult {
  Accumulator accumulator;
  MergeForm form;
  PrecisionErrors errors;
};

/// The ring of N ranks simulated on the CPU in one process: each block's out (forward) and
/// dq/dk/dv (backward) are computed in float32 from the bfloat16 inputs and rounded to bfloat16,
/// as a bfloat16 kernel returns them; lse stays float32. The partials are combined in ring order
/// in each accumulator (the forward in each form; the backward's sums have no form) and the result
/// rounded to bfloat16. The backward starts from the exact forward rounded as a kernel returns
/// it (out bfloat16, lse float32), so that its errors are its own. Returns the four combinations
/// of Accumulator and MergeForm, against one float64 reference.
std::vector<PrecisionResult> ring_precision(int world, const PrecisionSetup& setup = {});

}  // namespace cp
