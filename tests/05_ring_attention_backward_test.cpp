// Lesson 05 — ring attention backward: dq, dk, dv against float64 autograd over the whole
// sequence, on local worlds of 1, 2, 3, 4, 8 ranks or the mpirun world.
#include <torch/types.h>

#include "common/error.h"
#include "common/tensor_checks.h"
#include "common/world.h"
#include "ring_attention_backward.h"
#include "short_ring_schedule.h"
#include "testing/device_buffer.h"
#include "testing/harness.h"
#include "testing/oracle.h"

#if CP_WITH_CUDA
#include "block_backward.cuh"
#endif

namespace cp {
namespace {

using testing::all_close;
using testing::all_close_or_nan;
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

/// dq, dk, dv against float64 autograd of the same rounded inputs (`in` in the dtype under test).
void expect_grads_match_autograd(const AttnGrads& g, const Inputs& in, const testing::OracleMask& mask,
                                 const std::string& what) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(in.q.size(3)));
  const auto [dq, dk, dv] = oracle_attention_grads(in.q, in.k, in.v, in.dout, mask, scale);
  const torch::ScalarType dtype = in.q.scalar_type();
  for (const auto& [grad, name] : {std::pair{&g.dq, "dq"}, {&g.dk, "dk"}, {&g.dv, "dv"}})
    EXPECT_EQ(grad->scalar_type(), torch::kFloat) << name << " is an accumulator: float32";
  const std::string where = what + " " + std::string(c10::toString(dtype));
  CP_EXPECT_CLOSE(g.dq, dq, "dq " + where, kDims, testing::query_key_gradient_tolerance(dtype, dq, dv, mask.window));
  CP_EXPECT_CLOSE(g.dk, dk, "dk " + where, kDims, testing::query_key_gradient_tolerance(dtype, dk, dv, mask.window));
  CP_EXPECT_CLOSE(g.dv, dv, "dv " + where, kDims, testing::gradient_tolerance(dtype, dv));
}

/// Block backward (after lesson 03's forward) against autograd, on `device` in `dtype`.
void check_block_backward(const Inputs& in32, const AttentionMask& mask, torch::Device device, torch::ScalarType dtype,
                          const std::string& what) {
  const Inputs in{in32.q.to(dtype), in32.k.to(dtype), in32.v.to(dtype), in32.dout.to(dtype)};
  auto on = [&](const torch::Tensor& t) { return t.to(device); };
  const torch::Tensor q_pos = mask.q_positions.defined() ? mask.q_positions : torch::arange(in.q.size(2));
  const torch::Tensor k_pos = mask.k_positions.defined() ? mask.k_positions : torch::arange(in.k.size(2));
  AttentionMask on_device = mask;
  on_device.q_positions = q_pos.to(device);
  on_device.k_positions = k_pos.to(device);
  const AttnResult fwd = attention_block_forward(on(in.q), on(in.k), on(in.v), on_device);
  const AttnGrads g = attention_block_backward(on(in.dout), on(in.q), on(in.k), on(in.v), fwd.out, fwd.lse, on_device);
  expect_grads_match_autograd(g, in, {mask.causal, q_pos, k_pos, mask.window, mask.documents}, what);
}

/// A NaN put into one element of q, k, v or dout (head 0 of batch 0): a query row late in the
/// sequence, a key in its middle, a dout row early.
struct NanAt {
  std::string name;
  char tensor;  // 'q', 'k', 'v' or 'o' (dout)
  int64_t dim;
};
const std::vector<NanAt> kNans = {{"NaN in q", 'q', 3}, {"NaN in k", 'k', 5}, {"NaN in v", 'v', 2}, {"NaN in dout", 'o', 1}};

Inputs with_nan(const Inputs& in, const NanAt& at) {
  Inputs out{in.q.clone(), in.k.clone(), in.v.clone(), in.dout.clone()};
  torch::Tensor& t = at.tensor == 'q' ? out.q : at.tensor == 'k' ? out.k : at.tensor == 'v' ? out.v : out.dout;
  const int64_t s = t.size(2);
  t[0][0][at.tensor == 'q' ? s * 2 / 3 : at.tensor == 'o' ? s / 3 : s / 2][at.dim] = NAN;
  return out;
}

/// A gradient against the oracle's, NaN where it has NaN (the tolerance from its other elements).
::testing::AssertionResult grad_close_or_nan(const torch::Tensor& actual, const torch::Tensor& expected,
                                             torch::ScalarType dtype, const std::string& what) {
  const torch::Tensor finite_part = expected.masked_fill(expected.isnan(), 0);
  return all_close_or_nan(actual, expected, what, kDims, testing::gradient_tolerance(dtype, finite_part));
}

/// dq, dk, dv of the block backward (CPU, or the kernels) against the oracle, for inputs with one
/// NaN, without and with causal masks of every layout.
void check_nan_backward(const std::function<AttnGrads(const Inputs&, bool, const torch::Tensor&, const torch::Tensor&)>& grads_of,
                        int64_t s, int64_t d, const std::string& what) {
  const Inputs clean = random_inputs(1, 2, 1, s, s, d, 41);
  std::vector<testing::PositionLayout> layouts = testing::causal_position_layouts(s);
  layouts.insert(layouts.begin(), testing::PositionLayout{"full", torch::arange(s), torch::arange(s)});
  for (const NanAt& at : kNans) {
    const Inputs in = with_nan(clean, at);
    for (const testing::PositionLayout& l : layouts) {
      const bool causal = l.name != "full";
      const auto [dq, dk, dv] = oracle_attention_grads(in.q, in.k, in.v, in.dout, causal, l.q_pos, l.k_pos,
                                                       1.0 / std::sqrt(static_cast<double>(d)));
      if (l.name == "contiguous")  // the test means something: some rows of dq are NaN, not all
        EXPECT_TRUE(dq.isnan().any().item<bool>() && !dq.isnan().all().item<bool>()) << at.name;
      const AttnGrads g = grads_of(in, causal, l.q_pos, l.k_pos);
      const std::string where = what + ", " + at.name + ", " + l.name;
      EXPECT_TRUE(grad_close_or_nan(g.dq, dq, torch::kFloat, "dq " + where));
      EXPECT_TRUE(grad_close_or_nan(g.dk, dk, torch::kFloat, "dk " + where));
      EXPECT_TRUE(grad_close_or_nan(g.dv, dv, torch::kFloat, "dv " + where));
    }
  }
}

// ── Task 1: the block backward on the CPU ─────────────────────────────────────────────────────

CP_TEST(Lesson05, Task1_BlockBackwardMatchesAutograd) {
  struct Case {
    int64_t b, hq, hkv, sq, sk, d;
    bool causal;
  };
  uint64_t seed = 1;
  // The last two: 300 keys are 10 key tiles, one pass of 8 and a short one (kernels::kKeyTilesPerPass).
  for (const Case& c : std::vector<Case>{{1, 1, 1, 1, 1, 32, false}, {2, 4, 2, 33, 65, 32, false},
                                         {1, 4, 1, 70, 70, 64, true}, {1, 2, 2, 45, 100, 24, false},
                                         {1, 2, 1, 40, 300, 32, false}, {1, 1, 1, 300, 300, 16, true}})
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

/// Empty shapes through the public block backward: no keys (dq = 0), no queries (dk = dv = 0), no batch.
void check_empty_block_backward(torch::Device device) {
  check_block_backward(random_inputs(1, 2, 1, 10, 0, 32, 6), causal_mask(false), device, torch::kFloat, "no keys");
  check_block_backward(random_inputs(1, 2, 1, 0, 10, 64, 7), causal_mask(true), device, torch::kFloat, "no queries");
  check_block_backward(random_inputs(0, 2, 2, 5, 5, 128, 8), causal_mask(false), device, torch::kFloat, "no batch");
}

CP_TEST(Lesson05, Task1_WindowsAndDocumentsFromGlobalPositions) {
  const int64_t s = 75;
  for (const auto& [name, m] : testing::window_and_document_masks(s)) {
    AttentionMask mask{m.causal, m.q_pos, m.k_pos};
    mask.window = m.window;
    mask.documents = m.documents;
    check_block_backward(random_inputs(1, 2, 1, s, s, 32, 12), mask, torch::kCPU, torch::kFloat, name);
  }
}

CP_TEST(Lesson05, Task1_EmptyShapes) { check_empty_block_backward(torch::kCPU); }

/// Lesson 03's forward, then the block backward, on the CPU.
AttnGrads cpu_grads(const Inputs& in, bool causal, const torch::Tensor& q_pos, const torch::Tensor& k_pos) {
  const AttentionMask mask{causal, q_pos, k_pos};
  const AttnResult fwd = attention_block_forward(in.q, in.k, in.v, mask);
  return attention_block_backward(in.dout, in.q, in.k, in.v, fwd.out, fwd.lse, mask);
}

CP_TEST(Lesson05, Task1_NanInputsGiveNanExactlyWhereTheDefinitionDoes) {
  // A NaN reaches the gradients of every pair that sees it and nothing else (a hidden pair
  // contributes nothing, not 0 · NaN).
  check_nan_backward(cpu_grads, 40, 16, "cpu");
}

CP_TEST(Lesson05, Task1_CpuBackwardAtEverySimdLevel) {
  // The tile loops are compiled for each vector width (4, 8, 16 floats): each copy must hold the
  // same rules. Query tiles cut short inside a group of four or eight rows (33, 70 and 43 rows:
  // last tiles of 1, 6 and 11 rows), rows with no visible key, and a NaN in each input on 43 rows.
  testing::for_each_simd_level([](const std::string& at) {
    check_block_backward(random_inputs(2, 4, 2, 33, 65, 32, 51), causal_mask(false), torch::kCPU, torch::kFloat,
                         "cpu" + at);
    check_block_backward(random_inputs(1, 4, 1, 70, 70, 128, 52), causal_mask(true), torch::kCPU, torch::kFloat,
                         "cpu" + at);
    check_block_backward(random_inputs(1, 2, 1, 40, 40, 64, 53), {true, torch::arange(40), torch::arange(40) + 20},
                         torch::kCPU, torch::kFloat, "rows 0-19 see no key" + at);
    check_nan_backward(cpu_grads, 43, 16, "cpu" + at);
  });
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

// ── Task 2: the CUDA kernels through attention_block_backward() on CUDA tensors (GPU + CUDA LibTorch) ──

CP_TEST(Lesson05Cuda, Task2_BlockBackwardOnCudaForEveryDtypeAndHeadDim) {
  CP_REQUIRE_GPU();
  uint64_t seed = 50;
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
    for (int64_t d : {32, 64, 128})
      for (bool causal : {false, true})
        check_block_backward(random_inputs(2, 4, 2, 70, 97, d, seed++), causal_mask(causal), torch::kCUDA, dtype, "cuda");
  check_block_backward(random_inputs(1, 2, 1, 40, 40, 64, 3), {true, torch::arange(40), torch::arange(40) + 20},
                       torch::kCUDA, torch::kFloat, "cuda, half the rows fully masked");
}

CP_TEST(Lesson05Cuda, Task2_EmptyShapesOnCuda) {
  CP_REQUIRE_GPU();
  check_empty_block_backward(torch::kCUDA);
}

// ── Task 3: the ring backward ─────────────────────────────────────────────────────────────────

void check_ring_backward(Comm& comm, torch::Device device, torch::ScalarType dtype, bool causal, bool overlap,
                         int64_t d = 32) {
  const int64_t chunk = 29;
  const Inputs in = random_inputs(1, 4, 2, chunk * comm.size(), chunk * comm.size(), d, 21);
  auto mine = [&](const torch::Tensor& t) { return shard(t.to(dtype), comm).to(device); };
  const int64_t s = in.q.size(2);
  const auto [dq, dk, dv] = oracle_attention_grads(in.q.to(dtype), in.k.to(dtype), in.v.to(dtype), in.dout.to(dtype),
                                                   causal, torch::arange(s), torch::arange(s),
                                                   1.0 / std::sqrt(static_cast<double>(d)));
  RingOptions options = ring_options(causal);
  options.overlap = overlap;
  const RingResult fwd = ring_attention_forward(comm, mine(in.q), mine(in.k), mine(in.v), options);
  const RingGrads g = ring_attention_backward(comm, mine(in.dout), mine(in.q), mine(in.k), mine(in.v), fwd.out, fwd.lse,
                                              options);
  const std::string what = std::string(causal ? "causal" : "full") + " D=" + std::to_string(d) +
                           (overlap ? "" : ", no overlap") + ", rank " +
                           std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
  for (const auto& [grad, name] : {std::pair{&g.dq, "dq"}, {&g.dk, "dk"}, {&g.dv, "dv"}})
    EXPECT_EQ(grad->scalar_type(), dtype) << name << " must come back in the dtype of the inputs (" << what
                                          << "); the float32 accumulators are converted at the end";
  CP_EXPECT_CLOSE(g.dq, shard(dq, comm), "dq " + what, kDims, testing::gradient_tolerance(dtype, dq));
  CP_EXPECT_CLOSE(g.dk, shard(dk, comm), "dk " + what, kDims, testing::gradient_tolerance(dtype, dk));
  CP_EXPECT_CLOSE(g.dv, shard(dv, comm), "dv " + what, kDims, testing::gradient_tolerance(dtype, dv));
  EXPECT_EQ(g.stats.steps_computed, causal ? comm.rank() + 1 : comm.size());
  EXPECT_EQ(g.stats.steps_skipped, causal ? comm.size() - 1 - comm.rank() : 0);
  // N − 1 hops of K and V in their dtype, N hops of the float32 dK, dV (none on one rank).
  const int64_t n = comm.size(), kv = 2 * 1 * 2 * chunk * d;  // K and V: B · Hkv · S/N · D each
  EXPECT_EQ(g.stats.bytes_sent, (n - 1) * kv * c10::elementSize(dtype) + (n > 1 ? n : 0) * kv * 4) << what;
}

CP_TEST(Lesson05, Task3_ARingThatStopsEarlySendsTheAccumulatorsStraightHome) {
  // A schedule of 2 steps (a window of one chunk): after step 1 the dK, dV of chunk r − 1 are on
  // rank r, one hop from home however large N is; they go straight back, not on round the ring.
  for_each_world([](Comm& comm) {
    const int64_t chunk = 24, window = 17;
    const int n = comm.size(), steps = std::min(n, 2);
    const Inputs in = random_inputs(1, 4, 2, chunk * n, chunk * n, 32, 22);
    const int64_t s = in.q.size(2);
    RingOptions options = ring_options(true);
    options.schedule = testing::two_step_window_schedule(window);
    const RingResult fwd = ring_attention_forward(comm, shard(in.q, comm), shard(in.k, comm), shard(in.v, comm), options);
    const RingGrads g = ring_attention_backward(comm, shard(in.dout, comm), shard(in.q, comm), shard(in.k, comm),
                                                shard(in.v, comm), fwd.out, fwd.lse, options);
    const auto [dq, dk, dv] = oracle_attention_grads(in.q, in.k, in.v, in.dout,
                                                     {true, torch::arange(s), torch::arange(s), window, {}},
                                                     1.0 / std::sqrt(32.0));
    const std::string what = "window of 17 keys, 2 steps, rank " + std::to_string(comm.rank()) + " of " + std::to_string(n);
    CP_EXPECT_CLOSE(g.dq, shard(dq, comm), "dq " + what, kDims, testing::gradient_tolerance(torch::kFloat, dq));
    CP_EXPECT_CLOSE(g.dk, shard(dk, comm), "dk " + what, kDims, testing::gradient_tolerance(torch::kFloat, dk));
    CP_EXPECT_CLOSE(g.dv, shard(dv, comm), "dv " + what, kDims, testing::gradient_tolerance(torch::kFloat, dv));
    const int64_t kv = 2 * 1 * 2 * chunk * 32 * 4;  // K and V (or dK and dV) in float32
    EXPECT_EQ(g.stats.steps_not_run, n - steps) << what;
    EXPECT_EQ(g.stats.bytes_sent, (steps - 1) * kv + (n > 1 ? steps : 0) * kv) << what;
  });
}

CP_TEST(Lesson05, Task3_RingBackwardMatchesAutograd) {
  for_each_world([](Comm& comm) {
    for (bool causal : {false, true}) check_ring_backward(comm, torch::kCPU, torch::kFloat, causal, true);
  });
}

CP_TEST(Lesson05, Task3_GradientsComeBackInTheDtypeOfTheInputs) {
  // float64 on the CPU: the accumulators are float32 whatever the input, so dq, dk and dv must be
  // converted back to the dtypes of q, k and v (a float32 run cannot tell the difference).
  for_each_world([](Comm& comm) { check_ring_backward(comm, torch::kCPU, torch::kDouble, true, true); });
}

CP_TEST(Lesson05, Task3_RingBackwardNanReachesExactlyTheGradientsThatDependOnIt) {
  for_each_world([](Comm& comm) {
    const int64_t chunk = 5, d = 32, s = chunk * comm.size();
    const Inputs clean = random_inputs(1, 2, 1, s, s, d, 43);
    for (const NanAt& at : kNans) {
      const Inputs in = with_nan(clean, at);
      for (bool causal : {false, true}) {
        const auto [dq, dk, dv] = oracle_attention_grads(in.q, in.k, in.v, in.dout, causal, torch::arange(s),
                                                         torch::arange(s), 1.0 / std::sqrt(static_cast<double>(d)));
        const RingOptions options = ring_options(causal);
        const RingResult fwd = ring_attention_forward(comm, shard(in.q, comm), shard(in.k, comm), shard(in.v, comm), options);
        const RingGrads g = ring_attention_backward(comm, shard(in.dout, comm), shard(in.q, comm), shard(in.k, comm),
                                                    shard(in.v, comm), fwd.out, fwd.lse, options);
        const std::string what = at.name + (causal ? ", causal" : ", full") + ", rank " + std::to_string(comm.rank()) +
                                 " of " + std::to_string(comm.size());
        EXPECT_TRUE(grad_close_or_nan(g.dq, shard(dq, comm), torch::kFloat, "dq " + what));
        EXPECT_TRUE(grad_close_or_nan(g.dk, shard(dk, comm), torch::kFloat, "dk " + what));
        EXPECT_TRUE(grad_close_or_nan(g.dv, shard(dv, comm), torch::kFloat, "dv " + what));
      }
    }
  });
}

CP_TEST(Lesson05, Task3_OverlapOnAndOffGiveIdenticalGradients) {
  for_each_world([](Comm& comm) {
    const Inputs in = random_inputs(1, 2, 2, 23 * comm.size(), 23 * comm.size(), 32, 5);
    RingGrads results[2];
    for (bool overlap : {false, true}) {
      RingOptions options = ring_options(true);
      options.overlap = overlap;
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
  // The backward on 3 ranks with every tensor [1, 1, 4, 32] except what `change` replaces on rank 2.
  struct Args {
    torch::Tensor dout, q, k, v, out, lse;
    RingOptions options;
  };
  auto rank_2 = [](std::function<void(Args&)> change) {
    return [change] {
      run_local_world(3, [&](Comm& comm) {
        const torch::Tensor t = torch::zeros({1, 1, 4, 32});
        Args a{t, t, t, t, t, torch::zeros({1, 1, 4}), {}};
        if (comm.rank() == 2) change(a);
        ring_attention_backward(comm, a.dout, a.q, a.k, a.v, a.out, a.lse, a.options);
      });
    };
  };
  testing::expect_errors({
      {"lse of 5 rows", rank_2([](Args& a) { a.lse = torch::zeros({1, 1, 5}); }), "lse: expected shape [1, 1, 4]"},
      {"dout with 3 dimensions", rank_2([](Args& a) { a.dout = torch::zeros({1, 4, 32}); }),
       "dout: expected q's shape [1, 1, 4, 32], got [1, 4, 32]"},
      {"out of 5 rows", rank_2([](Args& a) { a.out = torch::zeros({1, 1, 5, 32}); }), "out: expected q's shape"},
      {"undefined dout", rank_2([](Args& a) { a.dout = torch::Tensor(); }), "dout: expected q's shape"},
      {"q of 5 rows", rank_2([](Args& a) { a.q = torch::zeros({1, 1, 5, 32}); }), "Is S divisible by N = 3?"},
      {"an empty RingOptions::exchange", rank_2([](Args& a) { a.options.exchange = nullptr; }),
       "options.exchange: empty"},
  });
}

CP_TEST(Lesson05Cuda, Task3_RingBackwardOnCudaForEveryDtypeAndHeadDim) {
  CP_REQUIRE_GPU();
  for_each_world([](Comm& comm) {
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
      for (bool causal : {false, true})
        for (int64_t d : {32, 128}) check_ring_backward(comm, torch::kCUDA, dtype, causal, true, d);
  });
}

// ── Task 2: the CUDA kernels on device buffers (a GPU, or CUDA on the CPU) ────────────────────
//
// launch_block_attention_backward is called directly on cudaMalloc'd copies of the inputs, with
// out and lse from the float64 oracle (so a wrong forward cannot hide or cause a failure here):
// no LibTorch CUDA is needed, so these run on a GPU and, without one, on the CPU (chipStar + PoCL).

#if CP_WITH_CUDA

/// The backward kernels on `in` (any kernel dtype) under `m`, given the forward's out and lse.
AttnGrads backward_kernel_masked(const Inputs& in, const testing::OracleMask& m) {
  AttentionMask mask{m.causal, m.q_pos, m.k_pos};
  mask.window = m.window;
  mask.documents = m.documents;
  const VisibleKeys keys = visible_keys(mask, m.q_pos);
  const BlockAttentionParams p{in.q.size(0), in.q.size(1), in.k.size(1), in.q.size(2), in.k.size(2), in.q.size(3),
                               static_cast<float>(1.0 / std::sqrt(static_cast<double>(in.q.size(3)))), keys.masked};
  const auto [out64, lse64] = testing::oracle_attention(in.q, in.k, in.v, m, p.scale);
  const torch::Tensor out = out64.to(in.q.scalar_type());  // what the forward kernel would have written
  // delta = rowsum(dO ∘ O), the term every dS of the row subtracts (float32, as the wrapper gives it).
  const torch::Tensor delta = (in.dout.to(torch::kDouble) * out.to(torch::kDouble)).sum(-1).to(torch::kFloat);
  CudaStream stream;
  DeviceBuffer q(in.q), k(in.k), v(in.v), dout(in.dout), lse(lse64.to(torch::kFloat)), delta_dev(delta);
  DeviceBuffer first(keys.masked ? keys.first : m.q_pos), last(keys.masked ? keys.last : m.q_pos);  // unread unless masked
  DeviceBuffer k_pos_dev(m.k_pos);
  DeviceBuffer dq(in.q.sizes().vec(), torch::kFloat), dk(in.k.sizes().vec(), torch::kFloat),
      dv(in.k.sizes().vec(), torch::kFloat);
  launch_block_attention_backward(q.get(), k.get(), v.get(), dout.get(), lse.as<float>(), delta_dev.as<float>(),
                                  first.as<int64_t>(), last.as<int64_t>(), k_pos_dev.as<int64_t>(), dq.as<float>(),
                                  dk.as<float>(), dv.as<float>(), p, kernel_dtype(in.q, "q"), stream.get());
  return {dq.to_host(stream.get()), dk.to_host(stream.get()), dv.to_host(stream.get())};
}

AttnGrads backward_kernel(const Inputs& in, bool causal, const torch::Tensor& q_pos, const torch::Tensor& k_pos) {
  return backward_kernel_masked(in, {causal, q_pos, k_pos});
}

/// The kernels on random inputs of the given shape (rounded to dtype) against autograd.
void check_backward_kernel(int64_t b, int64_t hq, int64_t hkv, int64_t sq, int64_t sk, int64_t d,
                           const testing::OracleMask& mask, torch::ScalarType dtype, uint64_t seed,
                           const std::string& what) {
  const Inputs in32 = random_inputs(b, hq, hkv, sq, sk, d, seed);
  const Inputs in{in32.q.to(dtype), in32.k.to(dtype), in32.v.to(dtype), in32.dout.to(dtype)};
  const std::string where = what + " B=" + std::to_string(b) + " Hq=" + std::to_string(hq) + " Hkv=" +
                            std::to_string(hkv) + " Sq=" + std::to_string(sq) + " Sk=" + std::to_string(sk) +
                            " D=" + std::to_string(d) + (mask.causal ? " causal" : "");
  expect_grads_match_autograd(backward_kernel_masked(in, mask), in, mask, where);
}

CP_TEST(Lesson05Kernels, Task2_KernelsMatchAutogradForEveryDtypeHeadDimAndGroup) {
  CP_REQUIRE_CUDA_RUNTIME();
  uint64_t seed = 50;
  const torch::Tensor q_pos = torch::arange(70), k_pos = torch::arange(97);  // 70 and 97: no multiple of a tile
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
    for (int64_t d : {32, 64, 128})
      for (bool causal : {false, true}) {
        const int64_t heads_kv = int64_t{4} >> (seed % 3);  // Hq/Hkv = 1, 2, 4 in turn
        const int64_t batch = d == 32 ? 2 : 1;              // B > 1 once per dtype; D = 128 is slow on a CPU
        check_backward_kernel(batch, 4, heads_kv, 70, 97, d, {causal, q_pos, k_pos}, dtype, seed++, "kernels");
      }
}

CP_TEST(Lesson05Kernels, Task2_KernelsCausalMaskFromGlobalPositions) {
  // Includes rows without a visible key (their dq and their share of dk, dv are exactly 0).
  CP_REQUIRE_CUDA_RUNTIME();
  const int64_t s = 100;
  for (const testing::PositionLayout& l : testing::causal_position_layouts(s))
    for (int64_t d : {32, 128})
      check_backward_kernel(1, 4, 2, s, s, d, {true, l.q_pos, l.k_pos}, d == 32 ? torch::kFloat : torch::kBFloat16,
                            23, "kernels, " + l.name);
}

CP_TEST(Lesson05Kernels, Task2_KernelsWindowsAndDocumentsForEveryDtypeAndHeadDim) {
  CP_REQUIRE_CUDA_RUNTIME();
  const int64_t s = 100;
  const std::vector<torch::ScalarType> dtypes = {torch::kFloat, torch::kHalf, torch::kBFloat16};
  const std::vector<int64_t> dims = {32, 64, 128};
  int turn = 0;  // every mask once, dtype and head dim in turn (D = 128 is slow on a CPU)
  for (const auto& [name, mask] : testing::window_and_document_masks(s)) {
    check_backward_kernel(1, 4, 2, s, s, dims[turn % 3], mask, dtypes[(turn / 3 + turn) % 3], 25, "kernels, " + name);
    ++turn;
  }
}

CP_TEST(Lesson05Kernels, Task2_KernelsNanInputsGiveNanExactlyWhereTheDefinitionDoes) {
  CP_REQUIRE_CUDA_RUNTIME();
  check_nan_backward(backward_kernel, 70, 32, "kernels");  // 70: two 64-row blocks, three 32-row tiles
}

CP_TEST(Lesson05Kernels, Task2_KernelsEmptyShapes) {
  // No keys: dq = 0. No queries: dk = dv = 0. No batch: nothing to do.
  CP_REQUIRE_CUDA_RUNTIME();
  check_backward_kernel(1, 2, 1, 10, 0, 32, {false, torch::arange(10), torch::arange(0)}, torch::kFloat, 6, "no keys");
  check_backward_kernel(1, 2, 1, 0, 10, 64, {true, torch::arange(0), torch::arange(10)}, torch::kFloat, 7, "no queries");
  check_backward_kernel(0, 2, 2, 5, 5, 128, {false, torch::arange(5), torch::arange(5)}, torch::kFloat, 8, "no batch");
}
#else
CP_KERNEL_TESTS_NEED_CUDA(Lesson05Kernels)
#endif

}  // namespace
}  // namespace cp
