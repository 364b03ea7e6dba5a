// GENERATED from solutions/13_training_a_model/training.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
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
  // BEGIN YOUR CODE task 2: shift, then shard
  // TODO(lesson 13, task 2): this rank's tokens, global positions and labels under `layout`, every token
  // with the label it has in the whole sequence. README, "Task 2 — `shard_batch`".
  (void)layout, (void)pad_token;
  throw NotImplemented("lesson 13, task 2: shard_batch");
  // END YOUR CODE
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
  // BEGIN YOUR CODE task 3: the token-weighted loss
  // TODO(lesson 13, task 3): the sum of this rank's token losses, the sums and valid-token counts of all
  // ranks (one all-reduce), and the objective whose averaged gradient is that of the global mean.
  // README, "Task 3 — `sharded_cross_entropy`".
  (void)comm, (void)v;
  throw NotImplemented("lesson 13, task 3: sharded_cross_entropy");
  // END YOUR CODE
}

ShardedLoss train_step(Comm& comm, TinyLM& model, torch::optim::Optimizer& optimizer, const TokenShard& shard) {
  // BEGIN YOUR CODE task 4: the training step
  // TODO(lesson 13, task 4): one optimizer step, the same on every rank and equal to the step on one
  // device. README, "Task 4 — `train_step`".
  (void)comm, (void)model, (void)optimizer, (void)shard;
  throw NotImplemented("lesson 13, task 4: train_step");
  // END YOUR CODE
}

}  // namespace cp
