// Lesson 13, tasks 2 to 4 — a rank's tokens, positions and labels, the loss over all ranks, and
// one training step that equals the step on one device.
#include <torch/nn/functional/loss.h>

#include <algorithm>

#include "common/error.h"
#include "common/tensor_checks.h"
#include "training.h"

namespace cp {

TokenShard shard_batch(const torch::Tensor& tokens, TokenLayout layout, int world, int rank, int64_t pad_token) {
  check_defined(tokens, "tokens", 2);
  CP_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong, "tokens: expected int64 [B, S], got ",
           tokens.dtype(), " ", tokens.sizes());
  CP_CHECK(world >= 1 && rank >= 0 && rank < world, "rank: expected 0 … world − 1 = ", world - 1, ", got ", rank);
  // BEGIN SOLUTION task 2: shift, then shard
  // STUB: // TODO(lesson 13, task 2): this rank's tokens, global positions and labels under `layout`, every token
  // STUB: // with the label it has in the whole sequence. README, "Task 2 — `shard_batch`".
  // STUB: (void)layout, (void)pad_token;
  // STUB: throw NotImplemented("lesson 13, task 2: shard_batch");
  const int64_t s = tokens.size(1);
  torch::Tensor labels = torch::full_like(tokens, kIgnoreLabel);
  if (s > 1) {
    const torch::Tensor next = tokens.narrow(1, 1, s - 1);
    labels.narrow(1, 0, s - 1).copy_(torch::where(next == pad_token, torch::full_like(next, kIgnoreLabel), next));
  }
  const torch::Tensor positions = layout_positions(layout, s, world, rank).to(tokens.device());
  return {tokens.index_select(1, positions), positions, labels.index_select(1, positions)};
  // END SOLUTION
}

ShardedLoss sharded_cross_entropy(Comm& comm, const torch::Tensor& logits, const torch::Tensor& labels) {
  check_defined(logits, "logits", 3);
  check_float_dtype(logits, "logits");
  CP_CHECK(logits.dim() == 3, "logits: expected [B, S/N, V], got ", logits.sizes());
  check_defined(labels, "labels", 2);
  CP_CHECK(labels.scalar_type() == torch::kLong && labels.sizes() == logits.sizes().slice(0, 2),
           "labels: expected int64 ", logits.sizes().slice(0, 2), " (logits without V), got ", labels.dtype(), " ",
           labels.sizes());
  const int64_t v = logits.size(2);
  CP_CHECK(labels.numel() == 0 ||
               ((labels == kIgnoreLabel) | ((labels >= 0) & (labels < v))).all().item<bool>(),
           "labels: each must be kIgnoreLabel (", kIgnoreLabel, ") or a token id in 0 … V − 1 = ", v - 1);
  check_same_on_every_rank(comm, logits, "logits", "Does every rank hold the same batch and the same number of tokens?");
  // BEGIN SOLUTION task 3: the token-weighted loss
  // STUB: // TODO(lesson 13, task 3): the sum of this rank's token losses, the sums and valid-token counts of all
  // STUB: // ranks (one all-reduce), and the objective whose averaged gradient is that of the global mean.
  // STUB: // README, "Task 3 — `sharded_cross_entropy`".
  // STUB: (void)comm, (void)v;
  // STUB: throw NotImplemented("lesson 13, task 3: sharded_cross_entropy");
  namespace F = torch::nn::functional;
  const torch::Tensor local_sum = F::cross_entropy(
      logits.reshape({-1, v}), labels.reshape({-1}),
      F::CrossEntropyFuncOptions().ignore_index(kIgnoreLabel).reduction(torch::kSum));
  const int64_t local_tokens = (labels != kIgnoreLabel).sum().item<int64_t>();
  // One collective for both numbers: the loss sum in float64, the count exact below 2⁵³.
  torch::Tensor totals = torch::stack({local_sum.detach().to(torch::kCPU, torch::kDouble),
                                       torch::tensor(static_cast<double>(local_tokens), torch::kDouble)});
  comm.all_reduce(totals, ReduceOp::Sum);
  const double total_sum = totals[0].item<double>();
  const int64_t tokens = static_cast<int64_t>(totals[1].item<double>());
  // all_reduce_gradients averages over the N ranks: N · (this rank's sum) / (all valid tokens)
  // averages to the gradient of (all sums) / (all valid tokens).
  const double scale = static_cast<double>(comm.size()) / static_cast<double>(std::max<int64_t>(tokens, 1));
  return {local_sum * scale, tokens > 0 ? total_sum / static_cast<double>(tokens) : 0.0, tokens};
  // END SOLUTION
}

ShardedLoss train_step(Comm& comm, TinyLM& model, torch::optim::Optimizer& optimizer, const TokenShard& shard) {
  // BEGIN SOLUTION task 4: the training step
  // STUB: // TODO(lesson 13, task 4): one optimizer step, the same on every rank and equal to the step on one
  // STUB: // device. README, "Task 4 — `train_step`".
  // STUB: (void)comm, (void)model, (void)optimizer, (void)shard;
  // STUB: throw NotImplemented("lesson 13, task 4: train_step");
  optimizer.zero_grad();
  const ShardedLoss loss = sharded_cross_entropy(comm, model->forward(shard.tokens, shard.positions), shard.labels);
  loss.objective.backward();
  all_reduce_gradients(comm, *model);
  optimizer.step();
  return loss;
  // END SOLUTION
}

}  // namespace cp
