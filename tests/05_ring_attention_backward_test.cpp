// Lesson 05 — ring attention backward: dq, dk, dv against float64 autograd over the whole
// sequence, on local worlds of 1, 2, 3, 4, 8 ranks or the mpirun world.
#include <torch/types.h>

#include "common/error.h"
#include "common/world.h"
#include "ring_attention_backward.h"
#include "testing/harness.h"
#include "testing/oracle.h"

namespace cp {
namespace {

using testing::all_close;
using testing::expect_error;
using testing::for_each_world;
using testing::oracle_attention_grads;

const std::vector<std::string> kDims = {"b", "h", "s", "d"};

struct Inputs {
  torch::Tensor q, k, v, dout;
};

Inputs random_inputs(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_q, int64_t seq_k, int64_t d,
                     uint64_t seed) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  return {torch::randn({batch, heads_q, seq_q, d}, gen), torch::randn({batch, heads_kv, seq_k, d}, gen),
          torch::randn({batch, heads_kv, seq_k, d}, gen), torch::randn({batch, heads_q, seq_q, d}, gen)};
}

torch::Tensor shard(const torch::Tensor& t, const Comm& comm) {
  const int64_t chunk = t.size(2) / comm.size();
  return t.narrow(2, comm.rank() * chunk, chunk);
}

/// Block backward (after lesson 03's forward) against autograd, on `device` in `dtype`.
void check_block_backward(const Inputs& in, const AttentionMask& mask, torch::Device device, torch::ScalarType dtype,
                          const std::string& what) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(in.q.size(3)));
  auto on = [&](const torch::Tensor& t) { return t.to(device, dtype); };
  const torch::Tensor q_pos = mask.q_positions.defined() ? mask.q_positions : torch::arange(in.q.size(2));
  const torch::Tensor k_pos = mask.k_positions.defined() ? mask.k_positions : torch::arange(in.k.size(2));
  AttentionMask on_device{mask.causal, q_pos.to(device), k_pos.to(device)};
  const AttnResult fwd = attention_block_forward(on(in.q), on(in.k), on(in.v), on_device);
  const AttnGrads g = attention_block_backward(on(in.dout), on(in.q), on(in.k), on(in.v), fwd.out, fwd.lse, on_device);
  // The oracle differentiates the same rounded inputs.
  const auto [dq, dk, dv] =
      oracle_attention_grads(on(in.q), on(in.k), on(in.v), on(in.dout), mask.causal, q_pos, k_pos, scale);
  for (const auto& [grad, name] : {std::pair{&g.dq, "dq"}, {&g.dk, "dk"}, {&g.dv, "dv"}})
    EXPECT_EQ(grad->scalar_type(), torch::kFloat) << name << " is an accumulator: float32";
  EXPECT_TRUE(all_close(g.dq, dq, "dq " + what, kDims, testing::gradient_tolerance(dtype, dq)));
  EXPECT_TRUE(all_close(g.dk, dk, "dk " + what, kDims, testing::gradient_tolerance(dtype, dk)));
  EXPECT_TRUE(all_close(g.dv, dv, "dv " + what, kDims, testing::gradient_tolerance(dtype, dv)));
}

// ── Task 1: the block backward on the CPU ─────────────────────────────────────────────────────

CP_TEST(Lesson05, Task1_BlockBackwardMatchesAutograd) {
  struct Case {
    int64_t b, hq, hkv, sq, sk, d;
    bool causal;
  };
  uint64_t seed = 1;
  for (const Case& c : std::vector<Case>{{1, 1, 1, 1, 1, 32, false}, {2, 4, 2, 33, 65, 32, false},
                                         {1, 4, 1, 70, 70, 64, true}, {1, 2, 2, 45, 100, 24, false}})
    check_block_backward(random_inputs(c.b, c.hq, c.hkv, c.sq, c.sk, c.d, seed++), {c.causal, {}, {}}, torch::kCPU,
                         torch::kFloat, "cpu");
}

CP_TEST(Lesson05, Task1_CausalPositionsAndFullyMaskedRows) {
  const Inputs in = random_inputs(1, 2, 1, 40, 40, 32, 9);
  // Queries 0..39, keys at 20..59: rows 0..19 see nothing and must get zero gradients.
  check_block_backward(in, {true, torch::arange(40), torch::arange(40) + 20}, torch::kCPU, torch::kFloat,
                       "keys after half of the queries");
  check_block_backward(in, {true, torch::arange(40) + 100, torch::arange(40)}, torch::kCPU, torch::kFloat,
                       "keys before all queries");
}

CP_TEST(Lesson05, Task1_BadInputGivesClearErrors) {
  const Inputs in = random_inputs(1, 2, 1, 8, 8, 32, 4);
  const AttnResult fwd = attention_block_forward(in.q, in.k, in.v);
  attention_block_backward(in.dout, in.q, in.k, in.v, fwd.out, fwd.lse);  // counts once implemented
  expect_error([&] { attention_block_backward(in.dout, in.q, in.k, in.v, fwd.out, fwd.lse.narrow(2, 0, 7)); },
               "lse: expected float32 [1, 2, 8]");
  expect_error([&] { attention_block_backward(in.dout, in.q, in.k, in.v, fwd.out, fwd.lse.to(torch::kDouble)); },
               "lse: expected float32");
  expect_error([&] { attention_block_backward(in.dout.narrow(2, 0, 7), in.q, in.k, in.v, fwd.out, fwd.lse); },
               "dout: expected q's shape");
}

// ── Task 2: the CUDA kernels ──────────────────────────────────────────────────────────────────

CP_TEST(Lesson05Cuda, Task2_BlockBackwardOnCudaForEveryDtypeAndHeadDim) {
  CP_REQUIRE_GPU();
  uint64_t seed = 50;
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
    for (int64_t d : {32, 64, 128})
      for (bool causal : {false, true})
        check_block_backward(random_inputs(2, 4, 2, 70, 97, d, seed++), {causal, {}, {}}, torch::kCUDA, dtype, "cuda");
  check_block_backward(random_inputs(1, 2, 1, 40, 40, 64, 3), {true, torch::arange(40), torch::arange(40) + 20},
                       torch::kCUDA, torch::kFloat, "cuda, half the rows fully masked");
}

// ── Task 3: the ring backward ─────────────────────────────────────────────────────────────────

void check_ring_backward(Comm& comm, torch::Device device, torch::ScalarType dtype, bool causal, bool overlap) {
  const int64_t chunk = 29, d = 32;
  const Inputs in = random_inputs(1, 4, 2, chunk * comm.size(), chunk * comm.size(), d, 21);
  auto mine = [&](const torch::Tensor& t) { return shard(t.to(dtype), comm).to(device); };
  const int64_t s = in.q.size(2);
  const auto [dq, dk, dv] = oracle_attention_grads(in.q.to(dtype), in.k.to(dtype), in.v.to(dtype), in.dout.to(dtype),
                                                   causal, torch::arange(s), torch::arange(s), 1.0 / std::sqrt(32.0));
  const RingOptions options{causal, {}, overlap, nullptr};
  const RingResult fwd = ring_attention_forward(comm, mine(in.q), mine(in.k), mine(in.v), options);
  const RingGrads g = ring_attention_backward(comm, mine(in.dout), mine(in.q), mine(in.k), mine(in.v), fwd.out, fwd.lse,
                                              options);
  const std::string what = std::string(causal ? "causal" : "full") + (overlap ? "" : ", no overlap") + ", rank " +
                           std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
  EXPECT_EQ(g.dq.scalar_type(), dtype);
  EXPECT_TRUE(all_close(g.dq, shard(dq, comm), "dq " + what, kDims, testing::gradient_tolerance(dtype, dq)));
  EXPECT_TRUE(all_close(g.dk, shard(dk, comm), "dk " + what, kDims, testing::gradient_tolerance(dtype, dk)));
  EXPECT_TRUE(all_close(g.dv, shard(dv, comm), "dv " + what, kDims, testing::gradient_tolerance(dtype, dv)));
  EXPECT_EQ(g.stats.steps_computed, causal ? comm.rank() + 1 : comm.size());
  EXPECT_EQ(g.stats.steps_skipped, causal ? comm.size() - 1 - comm.rank() : 0);
}

CP_TEST(Lesson05, Task3_RingBackwardMatchesAutograd) {
  for_each_world([](Comm& comm) {
    for (bool causal : {false, true}) check_ring_backward(comm, torch::kCPU, torch::kFloat, causal, true);
  });
}

CP_TEST(Lesson05, Task3_OverlapOnAndOffGiveIdenticalGradients) {
  for_each_world([](Comm& comm) {
    const Inputs in = random_inputs(1, 2, 2, 23 * comm.size(), 23 * comm.size(), 32, 5);
    RingGrads results[2];
    for (bool overlap : {false, true}) {
      const RingOptions options{true, {}, overlap, nullptr};
      const RingResult fwd = ring_attention_forward(comm, shard(in.q, comm), shard(in.k, comm), shard(in.v, comm), options);
      results[overlap] = ring_attention_backward(comm, shard(in.dout, comm), shard(in.q, comm), shard(in.k, comm),
                                                 shard(in.v, comm), fwd.out, fwd.lse, options);
    }
    EXPECT_TRUE(torch::equal(results[0].dq, results[1].dq));
    EXPECT_TRUE(torch::equal(results[0].dk, results[1].dk));
    EXPECT_TRUE(torch::equal(results[0].dv, results[1].dv));
  });
}

CP_TEST(Lesson05, Task3_BadInputGivesClearErrors) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    const torch::Tensor t = torch::zeros({1, 1, 4, 32});
    ring_attention_backward(comm, t, t, t, t, t, torch::zeros({1, 1, 4}));
  });
  try {
    run_local_world(2, [](Comm& comm) {
      const torch::Tensor t = torch::zeros({1, 1, 4, 32});
      ring_attention_backward(comm, t, t, t, t, t, torch::zeros({1, 1, 5}));
    });
    ADD_FAILURE() << "expected a cp::Error for an lse of the wrong shape";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lse: expected shape [1, 1, 4]"), std::string::npos) << e.what();
  }
}

CP_TEST(Lesson05Cuda, Task3_RingBackwardOnCudaForEveryDtype) {
  CP_REQUIRE_GPU();
  for_each_world([](Comm& comm) {
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
      for (bool causal : {false, true}) check_ring_backward(comm, torch::kCUDA, dtype, causal, true);
  });
}

}  // namespace
}  // namespace cp
