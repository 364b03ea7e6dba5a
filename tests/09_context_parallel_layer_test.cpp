// Lesson 09 — the context-parallel layer: the autograd function of every strategy against
// float64 attention gradients, the layer's forward, and one SGD step on N ranks against the
// same step of the same layer on one device (float64 LibTorch autograd with plain ops).
#include <torch/types.h>

#include <cmath>
#include <memory>

#include "common/error.h"
#include "common/world.h"
#include "context_parallel_attention.h"
#include "layer_reference.h"
#include "testing/harness.h"
#include "testing/oracle.h"

namespace cp {
namespace {

using testing::all_close;
using testing::expect_error;
using testing::for_each_world;
using testing::load_weights;
using testing::make_weights;
using testing::reference_step;
using testing::ReferenceStep;
using testing::Weights;

const std::vector<std::string> kDims = {"b", "h", "s", "d"};
const std::vector<std::string> kTokenDims = {"b", "s", "e"};

std::string where(const Strategy& s, const Comm& comm) {
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
    for (const Strategy& strategy : all_strategies()) {
      auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, layout_of(strategy), n, comm.rank()); };
      const torch::Tensor ql = mine(q).requires_grad_(), kl = mine(k).requires_grad_(), vl = mine(v).requires_grad_();
      const torch::Tensor o = context_parallel_attention(comm, ql, kl, vl, strategy);
      (o * mine(dout)).sum().backward();
      const std::string what = where(strategy, comm);
      CP_EXPECT_CLOSE(o, mine(out), "out " + what, kDims);
      CP_EXPECT_CLOSE(ql.grad(), mine(dq), "dq " + what, kDims, testing::gradient_tolerance(torch::kFloat, dq));
      CP_EXPECT_CLOSE(kl.grad(), mine(dk), "dk " + what, kDims, testing::gradient_tolerance(torch::kFloat, dk));
      CP_EXPECT_CLOSE(vl.grad(), mine(dv), "dv " + what, kDims, testing::gradient_tolerance(torch::kFloat, dv));
    }
  });
}

/// What the strategy of Task1_TheBackwardGetsWhatTheStrategySaved saw.
struct SavedLog {
  std::vector<torch::Tensor> returned;  // StrategyForward::saved as its forward returned it
  bool backward_ran = false, got_them = false;
};

/// The ring, saving its tensors in a form of its own, as lessons 10 and 11 do (their head split):
/// out, lse, v, k, q and a marker. Its backward records whether it received exactly what its
/// forward returned, and puts them back in the ring's order.
Strategy ring_saving_its_own_way(const std::shared_ptr<SavedLog>& log) {
  const Strategy ring = ring_strategy();
  Strategy strategy = ring;
  strategy.name = "ring with saved tensors of its own";
  strategy.forward = [ring, log](Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 Trace* trace) {
    StrategyForward f = ring.forward(comm, q, k, v, trace);  // saved: q, k, v, out, lse
    f.saved = {f.saved[3], f.saved[4], f.saved[2], f.saved[1], f.saved[0], torch::tensor({42.0f})};
    log->returned = f.saved;
    return f;
  };
  strategy.backward = [ring, log](Comm& comm, const torch::Tensor& dout, const std::vector<torch::Tensor>& saved,
                                  Trace* trace) {
    const std::vector<torch::Tensor>& want = log->returned;
    log->backward_ran = true;
    log->got_them = saved.size() == want.size();
    for (size_t i = 0; log->got_them && i < saved.size(); ++i)
      log->got_them = saved[i].defined() && saved[i].sizes() == want[i].sizes() &&
                      saved[i].scalar_type() == want[i].scalar_type() && torch::equal(saved[i], want[i]);
    if (!log->got_them)  // gradients of the right shapes: the test fails on got_them, not inside autograd
      return StrategyBackward{torch::zeros_like(want[4]), torch::zeros_like(want[3]), torch::zeros_like(want[2]), {}};
    return ring.backward(comm, dout, {saved[4], saved[3], saved[2], saved[0], saved[1]}, trace);
  };
  return strategy;
}

CP_TEST(Lesson09, Task1_TheBackwardGetsWhatTheStrategySaved) {
  // The strategies of this lesson all save q, k, v, out, lse: a layer that saves those itself
  // passes every other test, and breaks with lessons 10 and 11. Local worlds, under mpirun too.
  for (int n : {1, 2}) {
    run_local_world(n, [](Comm& comm) {
      auto log = std::make_shared<SavedLog>();
      const Strategy strategy = ring_saving_its_own_way(log);
      torch::Generator gen = at::detail::createCPUGenerator(94);
      const torch::Tensor q = torch::randn({1, 2, 8, 32}, gen).requires_grad_(),
                          k = torch::randn({1, 1, 8, 32}, gen).requires_grad_(),
                          v = torch::randn({1, 1, 8, 32}, gen).requires_grad_();
      context_parallel_attention(comm, q, k, v, strategy).sum().backward();
      const std::string what = where(strategy, comm);
      EXPECT_TRUE(log->backward_ran) << what << ": the strategy's backward never ran";
      EXPECT_TRUE(log->got_them) << what << ": the backward must get exactly the tensors the strategy's forward "
                                 << "returned in StrategyForward::saved (here 6, in an order of its own); save f.saved, "
                                 << "not tensors of your choosing";
      EXPECT_TRUE(q.grad().defined() && k.grad().defined() && v.grad().defined()) << what << ": no gradient for q, k, v";
    });
  }
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
    for (const Strategy& strategy : all_strategies()) {
      ContextParallelAttention layer(comm, ContextParallelAttentionOptions{kE, kHq, kHkv, strategy});
      load_weights(layer, w);
      auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, layout_of(strategy), n, comm.rank(), 1); };
      CP_EXPECT_CLOSE(layer->forward(mine(x)), mine(ref.y), "y " + where(strategy, comm), kTokenDims);
    }
  });
}

CP_TEST(Lesson09, Task2_BadInputGivesClearErrors) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    ContextParallelAttention layer(comm, ContextParallelAttentionOptions{kE, kHq, kHkv, ring_strategy()});
    layer->forward(torch::zeros({1, 4, kE}));
  });
  run_local_world(1, [](Comm& comm) {
    expect_error([&] { ContextParallelAttention(comm, ContextParallelAttentionOptions{64, 3, 1, ring_strategy()}); },
                 "embed_dim 64 is not divisible by heads_q 3");
    expect_error([&] { ContextParallelAttention(comm, ContextParallelAttentionOptions{64, 4, 3, ring_strategy()}); },
                 "heads_q 4 is not divisible by heads_kv 3");
    ContextParallelAttention layer(comm, ContextParallelAttentionOptions{kE, kHq, kHkv, ring_strategy()});
    const torch::Tensor t = torch::zeros({1, 2, 4, 32});
    testing::expect_errors({
        {"x with E = 32", [&] { layer->forward(torch::zeros({1, 4, 32})); }, "x: expected [B, S/N, E = 64]"},
        {"int64 x", [&] { layer->forward(torch::zeros({1, 4, kE}, torch::kLong)); },
         "x: expected the layer's dtype and device (float on cpu), got long int on cpu"},
        {"float64 x into a float32 layer", [&] { layer->forward(torch::zeros({1, 4, kE}, torch::kDouble)); },
         "x: expected the layer's dtype and device"},
        {"3-D k into strategy_forward", [&] { strategy_forward(comm, t, t[0], t, llama3_strategy(Llama3Mode::Fused)); },
         "k: expected at least 4 dimension(s)"},
        {"3-D v saved for strategy_backward", [&] { strategy_backward(comm, t, {t, t, t[0], t, t[0][0]}, ring_strategy()); },
         "v: expected at least 4 dimension(s)"},
        {"two tensors saved for the ring's backward", [&] { strategy_backward(comm, t, {t, t}, ring_strategy()); },
         "saved: the backward of 'ring' takes the 5 tensors its forward returned in StrategyForward::saved; got 2"},
    });
  });
}

CP_TEST(Lesson09, Task1_EmptyInputGivesEmptyResultsForEveryStrategy) {
  for_each_world([](Comm& comm) {
    for (const Strategy& strategy : all_strategies()) {
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
    // EXPECT, not ASSERT: under mpirun a fatal failure aborts the whole world.
    EXPECT_TRUE(layer->bias.grad().defined())
        << "rank " << comm.rank() << ": a parameter without a gradient must take part with zeros (and keep them)";
    if (layer->bias.grad().defined()) EXPECT_TRUE(torch::equal(layer->bias.grad(), torch::zeros({2})));
  });
}

CP_TEST(Lesson09, Task3_OneTrainingStepEqualsTheSingleDeviceStep) {
  for_each_world([](Comm& comm) {
    for (const Strategy& strategy : all_strategies()) testing::expect_training_step_matches_one_device(comm, strategy, 93);
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
    for (const Strategy& strategy : all_strategies()) {
      ContextParallelAttention layer(comm, ContextParallelAttentionOptions{e, hq, hkv, strategy});
      load_weights(layer, w);
      layer->to(torch::kCUDA);
      auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, layout_of(strategy), n, comm.rank(), 1); };
      const torch::Tensor y = layer->forward(mine(x).cuda());
      ((y * mine(target).cuda()).sum() / y.size(0) / y.size(1)).backward();
      all_reduce_gradients(comm, *layer);
      CP_EXPECT_CLOSE(y, mine(ref.y), "y cuda " + where(strategy, comm), kTokenDims);
      CP_EXPECT_CLOSE(layer->q_proj->weight.grad(), ref.grads.wq, "q_proj grad cuda " + where(strategy, comm),
                            {"o", "i"}, testing::gradient_tolerance(torch::kFloat, ref.grads.wq));
    }
  });
}

}  // namespace
}  // namespace cp
