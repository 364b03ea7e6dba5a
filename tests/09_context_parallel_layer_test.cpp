// Lesson 09 — the context-parallel layer: the autograd function of every strategy against
// float64 attention gradients, the layer's forward, and one SGD step on N ranks against the
// same step of the same layer on one device (float64 LibTorch autograd with plain ops).
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <cmath>

#include "common/error.h"
#include "common/world.h"
#include "context_parallel_attention.h"
#include "testing/harness.h"
#include "testing/oracle.h"

namespace cp {
namespace {

using testing::all_close;
using testing::expect_error;
using testing::for_each_world;

const std::vector<std::string> kDims = {"b", "h", "s", "d"};
const std::vector<std::string> kTokenDims = {"b", "s", "e"};

std::string where(Strategy s, const Comm& comm) {
  return to_string(s) + ", rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
}

// ── Task 1: the autograd function ─────────────────────────────────────────────────────────────

CP_TEST(Lesson09, Task1_GradientsOfEveryStrategyMatchAttention) {
  for_each_world([](Comm& comm) {
    const int n = comm.size();
    const int64_t s = 2 * n * 5, d = 32;
    torch::Generator gen = at::detail::createCPUGenerator(90);
    const torch::Tensor q = torch::randn({2, 4, s, d}, gen), k = torch::randn({2, 2, s, d}, gen),
                        v = torch::randn({2, 2, s, d}, gen), dout = torch::randn({2, 4, s, d}, gen);
    const torch::Tensor pos = torch::arange(s);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const auto [out, lse] = testing::oracle_attention(q, k, v, true, pos, pos, scale);
    const auto [dq, dk, dv] = testing::oracle_attention_grads(q, k, v, dout, true, pos, pos, scale);
    for (Strategy strategy : all_strategies()) {
      auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, layout_of(strategy), n, comm.rank()); };
      const torch::Tensor ql = mine(q).requires_grad_(), kl = mine(k).requires_grad_(), vl = mine(v).requires_grad_();
      const torch::Tensor o = context_parallel_attention(comm, ql, kl, vl, strategy);
      (o * mine(dout)).sum().backward();
      const std::string what = where(strategy, comm);
      EXPECT_TRUE(all_close(o, mine(out), "out " + what, kDims));
      EXPECT_TRUE(all_close(ql.grad(), mine(dq), "dq " + what, kDims, testing::gradient_tolerance(torch::kFloat, dq)));
      EXPECT_TRUE(all_close(kl.grad(), mine(dk), "dk " + what, kDims, testing::gradient_tolerance(torch::kFloat, dk)));
      EXPECT_TRUE(all_close(vl.grad(), mine(dv), "dv " + what, kDims, testing::gradient_tolerance(torch::kFloat, dv)));
    }
  });
}

// ── The single-device reference layer ─────────────────────────────────────────────────────────

struct Weights {
  torch::Tensor wq, wk, wv, wo;  // as the Linear weights: [out, in]
};

Weights make_weights(int64_t e, int64_t hq, int64_t hkv, uint64_t seed) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  const int64_t d = e / hq;
  const double a = 1.0 / std::sqrt(static_cast<double>(e));
  return {torch::randn({hq * d, e}, gen) * a, torch::randn({hkv * d, e}, gen) * a, torch::randn({hkv * d, e}, gen) * a,
          torch::randn({e, hq * d}, gen) * a};
}

/// Forward, loss, backward and one SGD step of the layer on the whole sequence, in float64 with
/// plain LibTorch ops and autograd. loss = Σ (y ∘ target) / (B·S): the mean over tokens.
struct ReferenceStep {
  torch::Tensor y, loss;
  Weights updated, grads;
};

ReferenceStep reference_step(const torch::Tensor& x, const torch::Tensor& target, const Weights& w, int64_t hq,
                             int64_t hkv, double lr) {
  auto leaf = [](const torch::Tensor& t) { return t.to(torch::kDouble).requires_grad_(); };
  const torch::Tensor wq = leaf(w.wq), wk = leaf(w.wk), wv = leaf(w.wv), wo = leaf(w.wo);
  const torch::Tensor xd = x.to(torch::kDouble);
  const int64_t b = x.size(0), s = x.size(1), d = w.wq.size(0) / hq;
  auto heads = [&](const torch::Tensor& t, int64_t h) { return t.view({b, s, h, d}).transpose(1, 2); };
  const torch::Tensor q = heads(xd.matmul(wq.t()), hq);
  const torch::Tensor k = heads(xd.matmul(wk.t()), hkv).repeat_interleave(hq / hkv, 1);
  const torch::Tensor v = heads(xd.matmul(wv.t()), hkv).repeat_interleave(hq / hkv, 1);
  const torch::Tensor causal = torch::ones({s, s}, torch::kBool).tril();
  const torch::Tensor scores =
      q.matmul(k.transpose(-1, -2)).div(std::sqrt(static_cast<double>(d))).masked_fill(causal.logical_not(), -INFINITY);
  const torch::Tensor o = scores.softmax(-1).matmul(v).transpose(1, 2).reshape({b, s, hq * d});
  const torch::Tensor y = o.matmul(wo.t());
  const torch::Tensor loss = (y * target.to(torch::kDouble)).sum() / (b * s);
  loss.backward();
  auto step = [&](const torch::Tensor& p) { return (p - lr * p.grad()).detach(); };
  return {y.detach(), loss.detach(), {step(wq), step(wk), step(wv), step(wo)},
          {wq.grad(), wk.grad(), wv.grad(), wo.grad()}};
}

void load_weights(ContextParallelAttention& layer, const Weights& w) {
  torch::NoGradGuard no_grad;
  layer->q_proj->weight.copy_(w.wq);
  layer->k_proj->weight.copy_(w.wk);
  layer->v_proj->weight.copy_(w.wv);
  layer->o_proj->weight.copy_(w.wo);
}

constexpr int64_t kE = 64, kHq = 2, kHkv = 1;  // D = 32

// ── Task 2: the layer ─────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson09, Task2_LayerForwardMatchesOneDevice) {
  for_each_world([](Comm& comm) {
    const int n = comm.size();
    const int64_t s = 2 * n * 3;
    torch::Generator gen = at::detail::createCPUGenerator(91);
    const torch::Tensor x = torch::randn({2, s, kE}, gen);
    const Weights w = make_weights(kE, kHq, kHkv, 92);
    const ReferenceStep ref = reference_step(x, torch::zeros_like(x), w, kHq, kHkv, 0.0);
    for (Strategy strategy : all_strategies()) {
      ContextParallelAttention layer(comm, ContextParallelAttentionOptions{kE, kHq, kHkv, strategy});
      load_weights(layer, w);
      auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, layout_of(strategy), n, comm.rank(), 1); };
      EXPECT_TRUE(all_close(layer->forward(mine(x)), mine(ref.y), "y " + where(strategy, comm), kTokenDims));
    }
  });
}

CP_TEST(Lesson09, Task2_BadInputGivesClearErrors) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    ContextParallelAttention layer(comm, ContextParallelAttentionOptions{kE, kHq, kHkv, Strategy::Ring});
    layer->forward(torch::zeros({1, 4, kE}));
  });
  run_local_world(1, [](Comm& comm) {
    expect_error([&] { ContextParallelAttention(comm, ContextParallelAttentionOptions{64, 3, 1, Strategy::Ring}); },
                 "embed_dim 64 is not divisible by heads_q 3");
    expect_error([&] { ContextParallelAttention(comm, ContextParallelAttentionOptions{64, 4, 3, Strategy::Ring}); },
                 "heads_q 4 is not divisible by heads_kv 3");
    ContextParallelAttention layer(comm, ContextParallelAttentionOptions{kE, kHq, kHkv, Strategy::Ring});
    const torch::Tensor t = torch::zeros({1, 2, 4, 32});
    testing::expect_errors({
        {"x with E = 32", [&] { layer->forward(torch::zeros({1, 4, 32})); }, "x: expected [B, S/N, E = 64]"},
        {"int64 x", [&] { layer->forward(torch::zeros({1, 4, kE}, torch::kLong)); },
         "x: expected the layer's dtype and device (float on cpu), got long int on cpu"},
        {"float64 x into a float32 layer", [&] { layer->forward(torch::zeros({1, 4, kE}, torch::kDouble)); },
         "x: expected the layer's dtype and device"},
        {"3-D k into strategy_forward", [&] { strategy_forward(comm, t, t[0], t, Strategy::Llama3Fused); },
         "k: expected at least 4 dimension(s)"},
        {"3-D v into strategy_backward", [&] { strategy_backward(comm, t, t, t, t[0], t, t[0][0], Strategy::Ring); },
         "v: expected at least 4 dimension(s)"},
    });
  });
}

CP_TEST(Lesson09, Task1_EmptyInputGivesEmptyResultsForEveryStrategy) {
  for_each_world([](Comm& comm) {
    for (Strategy strategy : all_strategies()) {
      for (const auto& shape : {std::vector<int64_t>{0, 4, 6, 32}, std::vector<int64_t>{2, 4, 0, 32}}) {
        const torch::Tensor q = torch::zeros(shape, torch::requires_grad());
        const torch::Tensor kv = torch::zeros({shape[0], 2, shape[2], 32}, torch::requires_grad());
        const torch::Tensor o = context_parallel_attention(comm, q, kv, kv, strategy);
        o.sum().backward();
        const std::string what = where(strategy, comm) + ", q " + c10::str(q.sizes());
        EXPECT_EQ(o.sizes(), q.sizes()) << what;
        EXPECT_EQ(q.grad().sizes(), q.sizes()) << what;
        EXPECT_EQ(kv.grad().sizes(), kv.sizes()) << what;
      }
    }
  });
}

// ── Task 3: gradients all-reduced, one training step ──────────────────────────────────────────

CP_TEST(Lesson09, Task3_AllReduceGradientsAverages) {
  for_each_world([](Comm& comm) {
    torch::nn::Linear layer(torch::nn::LinearOptions(3, 2));
    layer->weight.mutable_grad() = torch::full({2, 3}, static_cast<float>(comm.rank() + 1));
    // The bias has no gradient here: it takes part with zeros.
    all_reduce_gradients(comm, *layer);
    const float mean = (comm.size() + 1) / 2.0f;
    EXPECT_TRUE(torch::equal(layer->weight.grad(), torch::full({2, 3}, mean))) << "rank " << comm.rank();
    ASSERT_TRUE(layer->bias.grad().defined());
    EXPECT_TRUE(torch::equal(layer->bias.grad(), torch::zeros({2})));
  });
}

CP_TEST(Lesson09, Task3_OneTrainingStepEqualsTheSingleDeviceStep) {
  for_each_world([](Comm& comm) {
    const int n = comm.size();
    const int64_t s = 2 * n * 3;
    const double lr = 0.5;
    torch::Generator gen = at::detail::createCPUGenerator(93);
    const torch::Tensor x = torch::randn({2, s, kE}, gen), target = torch::randn({2, s, kE}, gen);
    const Weights w = make_weights(kE, kHq, kHkv, 94);
    const ReferenceStep ref = reference_step(x, target, w, kHq, kHkv, lr);
    for (Strategy strategy : all_strategies()) {
      const std::string what = where(strategy, comm);
      ContextParallelAttention layer(comm, ContextParallelAttentionOptions{kE, kHq, kHkv, strategy});
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
      EXPECT_TRUE(all_close(y, mine(ref.y), "y " + what, kTokenDims));
      const std::vector<std::pair<torch::nn::Linear*, std::pair<torch::Tensor, torch::Tensor>>> params = {
          {&layer->q_proj, {ref.grads.wq, ref.updated.wq}}, {&layer->k_proj, {ref.grads.wk, ref.updated.wk}},
          {&layer->v_proj, {ref.grads.wv, ref.updated.wv}}, {&layer->o_proj, {ref.grads.wo, ref.updated.wo}}};
      for (const auto& [linear, expected] : params)
        EXPECT_TRUE(all_close((*linear)->weight.grad(), expected.first, "weight grad " + what, {"o", "i"},
                              testing::gradient_tolerance(torch::kFloat, expected.first)));
      torch::optim::SGD sgd(layer->parameters(), torch::optim::SGDOptions(lr));
      sgd.step();
      for (const auto& [linear, expected] : params)
        EXPECT_TRUE(all_close((*linear)->weight, expected.second, "updated weight " + what, {"o", "i"}));
    }
  });
}

CP_TEST(Lesson09Cuda, Task3_TrainingStepOnCuda) {
  CP_REQUIRE_GPU();
  for_each_world([](Comm& comm) {
    const int n = comm.size();
    const int64_t s = 2 * n * 16, e = 128, hq = 4, hkv = 2;  // D = 32
    torch::Generator gen = at::detail::createCPUGenerator(95);
    const torch::Tensor x = torch::randn({1, s, e}, gen), target = torch::randn({1, s, e}, gen);
    const Weights w = make_weights(e, hq, hkv, 96);
    const ReferenceStep ref = reference_step(x, target, w, hq, hkv, 0.5);
    for (Strategy strategy : all_strategies()) {
      ContextParallelAttention layer(comm, ContextParallelAttentionOptions{e, hq, hkv, strategy});
      load_weights(layer, w);
      layer->to(torch::kCUDA);
      auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, layout_of(strategy), n, comm.rank(), 1); };
      const torch::Tensor y = layer->forward(mine(x).cuda());
      ((y * mine(target).cuda()).sum() / y.size(0) / y.size(1)).backward();
      all_reduce_gradients(comm, *layer);
      EXPECT_TRUE(all_close(y, mine(ref.y), "y cuda " + where(strategy, comm), kTokenDims));
      EXPECT_TRUE(all_close(layer->q_proj->weight.grad(), ref.grads.wq, "q_proj grad cuda " + where(strategy, comm),
                            {"o", "i"}, testing::gradient_tolerance(torch::kFloat, ref.grads.wq)));
    }
  });
}

}  // namespace
}  // namespace cp
