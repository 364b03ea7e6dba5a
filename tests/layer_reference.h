// The single-device reference of lesson 09's layer (float64 LibTorch autograd with plain ops) and
// the check that one training step on N ranks equals it: shared by the tests of the lessons whose
// strategies the layer runs (09, 10, 11).
#pragma once

#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "context_parallel_attention.h"
#include "testing/oracle.h"

namespace cp::testing {

struct Weights {
  torch::Tensor wq, wk, wv, wo;  // as the Linear weights: [out, in]
};

inline Weights make_weights(int64_t e, int64_t hq, int64_t hkv, uint64_t seed) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  const int64_t d = e / hq;
  const double a = 1.0 / std::sqrt(static_cast<double>(e));
  return {torch::randn({hq * d, e}, gen) * a, torch::randn({hkv * d, e}, gen) * a, torch::randn({hkv * d, e}, gen) * a,
          torch::randn({e, hq * d}, gen) * a};
}

/// Forward, loss, backward and one SGD step of the layer on the whole sequence, in float64 with
/// plain LibTorch ops and autograd. loss = Σ (y ∘ target) / (B·S): the mean over tokens.
/// `visible` [S, S] bool: the (query, key) pairs that attend; undefined: causal.
struct ReferenceStep {
  torch::Tensor y, loss;
  Weights updated, grads;
};

inline ReferenceStep reference_step(const torch::Tensor& x, const torch::Tensor& target, const Weights& w, int64_t hq,
                                    int64_t hkv, double lr, const torch::Tensor& visible = {}) {
  auto leaf = [](const torch::Tensor& t) { return t.to(torch::kDouble).requires_grad_(); };
  const torch::Tensor wq = leaf(w.wq), wk = leaf(w.wk), wv = leaf(w.wv), wo = leaf(w.wo);
  const torch::Tensor xd = x.to(torch::kDouble);
  const int64_t b = x.size(0), s = x.size(1), d = w.wq.size(0) / hq;
  auto heads = [&](const torch::Tensor& t, int64_t h) { return t.view({b, s, h, d}).transpose(1, 2); };
  const torch::Tensor q = heads(xd.matmul(wq.t()), hq);
  const torch::Tensor k = heads(xd.matmul(wk.t()), hkv).repeat_interleave(hq / hkv, 1);
  const torch::Tensor v = heads(xd.matmul(wv.t()), hkv).repeat_interleave(hq / hkv, 1);
  const torch::Tensor mask = visible.defined() ? visible : torch::ones({s, s}, torch::kBool).tril();
  const torch::Tensor scores =
      q.matmul(k.transpose(-1, -2)).div(std::sqrt(static_cast<double>(d))).masked_fill(mask.logical_not(), -INFINITY);
  const torch::Tensor o = scores.softmax(-1).matmul(v).transpose(1, 2).reshape({b, s, hq * d});
  const torch::Tensor y = o.matmul(wo.t());
  const torch::Tensor loss = (y * target.to(torch::kDouble)).sum() / (b * s);
  loss.backward();
  auto step = [&](const torch::Tensor& p) { return (p - lr * p.grad()).detach(); };
  return {y.detach(), loss.detach(), {step(wq), step(wk), step(wv), step(wo)},
          {wq.grad(), wk.grad(), wv.grad(), wo.grad()}};
}

inline void load_weights(ContextParallelAttention& layer, const Weights& w) {
  torch::NoGradGuard no_grad;
  layer->q_proj->weight.copy_(w.wq);
  layer->k_proj->weight.copy_(w.wk);
  layer->v_proj->weight.copy_(w.wv);
  layer->o_proj->weight.copy_(w.wo);
}

/// One SGD step of ContextParallelAttention with `strategy` on comm's ranks (each with its shard
/// of the tokens, laid out as the strategy says) against reference_step on the whole sequence:
/// the loss, every rank's y, the all-reduced weight gradients and the updated weights. S = 6N
/// tokens; `visible_of(S)`, if given, the [S, S] pairs that attend (else causal).
inline void expect_training_step_matches_one_device(
    Comm& comm, const Strategy& strategy, uint64_t seed, int64_t e = 64, int64_t hq = 2, int64_t hkv = 1,
    const std::function<torch::Tensor(int64_t s)>& visible_of = nullptr) {
  const int n = comm.size();
  const int64_t s = 2 * n * 3;
  const double lr = 0.5;
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  const torch::Tensor x = torch::randn({2, s, e}, gen), target = torch::randn({2, s, e}, gen);
  const Weights w = make_weights(e, hq, hkv, seed + 1);
  const ReferenceStep ref = reference_step(x, target, w, hq, hkv, lr, visible_of ? visible_of(s) : torch::Tensor{});
  const std::string what = to_string(strategy) + ", rank " + std::to_string(comm.rank()) + " of " + std::to_string(n);
  ContextParallelAttention layer(comm, ContextParallelAttentionOptions{e, hq, hkv, strategy});
  broadcast_parameters(comm, *layer);  // replicated weights, then the test's known values
  load_weights(layer, w);
  auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, layout_of(strategy), n, comm.rank(), 1); };
  const torch::Tensor y = layer->forward(mine(x));
  // Each rank's loss is the mean over its own tokens; the global loss is their mean.
  const torch::Tensor local_loss = (y * mine(target)).sum() / y.size(0) / y.size(1);
  local_loss.backward();
  all_reduce_gradients(comm, *layer);
  torch::Tensor loss = local_loss.detach().clone();
  comm.all_reduce(loss, ReduceOp::Sum);
  EXPECT_NEAR(loss.item<double>() / n, ref.loss.item<double>(), 1e-5 * (1 + std::abs(ref.loss.item<double>())))
      << "loss, " << what;
  // An element of y is a sum over E terms of both signs (o_proj of the attention output), so, as
  // for a gradient, its rounding follows the size of the terms, not of the element (with LibTorch
  // 2.6, E = 512: an error of 1.7e-6 on an element of 0.026, past the elementwise 1.3e-6).
  EXPECT_TRUE(all_close(y, mine(ref.y), "y " + what, {"b", "s", "e"}, gradient_tolerance(torch::kFloat, ref.y)));
  const std::vector<std::pair<torch::nn::Linear*, std::pair<torch::Tensor, torch::Tensor>>> params = {
      {&layer->q_proj, {ref.grads.wq, ref.updated.wq}}, {&layer->k_proj, {ref.grads.wk, ref.updated.wk}},
      {&layer->v_proj, {ref.grads.wv, ref.updated.wv}}, {&layer->o_proj, {ref.grads.wo, ref.updated.wo}}};
  for (const auto& [linear, expected] : params)
    EXPECT_TRUE(all_close((*linear)->weight.grad(), expected.first, "weight grad " + what, {"o", "i"},
                          gradient_tolerance(torch::kFloat, expected.first)));
  torch::optim::SGD sgd(layer->parameters(), torch::optim::SGDOptions(lr));
  sgd.step();
  for (const auto& [linear, expected] : params)
    EXPECT_TRUE(all_close((*linear)->weight, expected.second, "updated weight " + what, {"o", "i"}));
}

}  // namespace cp::testing
