// Lesson 07 — zig-zag load balancing: layouts and the work model exactly, and the zig-zag ring
// forward and backward against float64 attention over the whole sequence.
#include <torch/types.h>

#include <numeric>

#include "common/error.h"
#include "common/world.h"
#include "testing/harness.h"
#include "testing/oracle.h"
#include "zigzag.h"

namespace cp {
namespace {

using testing::all_close;
using testing::expect_error;
using testing::for_each_world;

const std::vector<TokenLayout> kLayouts = {TokenLayout::Contiguous, TokenLayout::ZigZag, TokenLayout::Stripe};
const std::vector<std::string> kDims = {"b", "h", "s", "d"};

/// The causal pairs of each rank counted the slow way: a full S × S mask, summed per query row.
std::vector<int64_t> brute_force_work(TokenLayout layout, int64_t seq, int world) {
  const torch::Tensor visible_per_query = torch::tril(torch::ones({seq, seq}, torch::kLong)).sum(1);
  std::vector<int64_t> work;
  for (int r = 0; r < world; ++r)
    work.push_back(visible_per_query.index_select(0, layout_positions(layout, seq, world, r)).sum().item<int64_t>());
  return work;
}

// ── Task 1: layouts ───────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson07, Task1_EveryTokenIsOwnedExactlyOnce) {
  for (int n = 1; n <= 8; ++n) {
    const int64_t s = 2 * n * 5;
    for (TokenLayout layout : kLayouts) {
      std::vector<torch::Tensor> all;
      for (int r = 0; r < n; ++r) {
        const torch::Tensor p = layout_positions(layout, s, n, r);
        EXPECT_EQ(p.numel(), s / n) << to_string(layout) << ", N = " << n;
        EXPECT_TRUE(torch::equal(p, std::get<0>(p.sort()))) << to_string(layout) << ": positions must ascend";
        all.push_back(p);
      }
      EXPECT_TRUE(torch::equal(std::get<0>(torch::cat(all).sort()), torch::arange(s))) << to_string(layout) << ", N = " << n;
    }
  }
  // Zig-zag, N = 4, S = 16: rank 1 holds chunks 1 and 6 of 2 tokens.
  EXPECT_TRUE(torch::equal(layout_positions(TokenLayout::ZigZag, 16, 4, 1), torch::tensor({2, 3, 12, 13}, torch::kLong)));
  EXPECT_TRUE(torch::equal(layout_positions(TokenLayout::Stripe, 12, 4, 1), torch::tensor({1, 5, 9}, torch::kLong)));
}

CP_TEST(Lesson07, Task1_ShardAndUnshardRoundTripExactly) {
  const torch::Tensor full = torch::randn({2, 3, 48, 4});
  for (int n : {1, 2, 3, 4, 8}) {
    for (TokenLayout layout : kLayouts) {
      if (48 % (layout == TokenLayout::ZigZag ? 2 * n : n)) continue;
      std::vector<torch::Tensor> shards;
      for (int r = 0; r < n; ++r) shards.push_back(shard_sequence(full, layout, n, r));
      EXPECT_TRUE(torch::equal(unshard_sequence(shards, layout), full)) << to_string(layout) << ", N = " << n;
    }
  }
}

CP_TEST(Lesson07, Task1_LengthsThatDoNotDivideAreClearErrors) {
  layout_positions(TokenLayout::ZigZag, 12, 3, 0);  // counts once implemented
  expect_error([] { layout_positions(TokenLayout::ZigZag, 9, 3, 0); }, "S = 9 is not divisible by 2N = 6");
  expect_error([] { layout_positions(TokenLayout::Contiguous, 10, 4, 0); }, "S = 10 is not divisible by N = 4");
  expect_error([] { layout_positions(TokenLayout::Stripe, 8, 4, 4); }, "rank 4 is not in a world of 4");
}

// ── Task 2: the work model ────────────────────────────────────────────────────────────────────

CP_TEST(Lesson07, Task2_BadInputGivesClearErrors) {
  causal_work(TokenLayout::ZigZag, 12, 3);  // counts once implemented
  testing::expect_errors({
      {"world 0", [] { causal_work(TokenLayout::Contiguous, 8, 0); }, "causal_work: world must be at least 1, got 0"},
      {"world -1", [] { causal_work(TokenLayout::Stripe, 8, -1); }, "causal_work: world must be at least 1, got -1"},
      {"S = 10 over 4 ranks", [] { causal_work(TokenLayout::Contiguous, 10, 4); }, "S = 10 is not divisible by N = 4"},
  });
}

CP_TEST(Lesson07, Task2_CausalWorkIsExact) {
  for (int n : {1, 2, 3, 4, 8}) {
    const int64_t s = 2 * n * 6;
    for (TokenLayout layout : kLayouts)
      EXPECT_EQ(causal_work(layout, s, n), brute_force_work(layout, s, n)) << to_string(layout) << ", N = " << n;
  }
}

CP_TEST(Lesson07, Task2_ZigZagIsBalancedAndContiguousIsNot) {
  for (int n : {2, 4, 8}) {
    const int64_t s = 2 * n * 64;
    const std::vector<int64_t> zigzag = causal_work(TokenLayout::ZigZag, s, n);
    EXPECT_TRUE(std::all_of(zigzag.begin(), zigzag.end(), [&](int64_t w) { return w == zigzag[0]; }))
        << "zig-zag must give every rank the same work, N = " << n;
    // Contiguous: rank r has r full blocks and one triangle: max/mean → 2 − 1/N for long chunks.
    const std::vector<int64_t> contiguous = causal_work(TokenLayout::Contiguous, s, n);
    const double mean = std::accumulate(contiguous.begin(), contiguous.end(), 0.0) / n;
    const double c = static_cast<double>(s) / n;
    const double exact = ((n - 1) * c * c + c * (c + 1) / 2) / (s * (s + 1.0) / 2 / n);
    EXPECT_DOUBLE_EQ(*std::max_element(contiguous.begin(), contiguous.end()) / mean, exact);
    EXPECT_NEAR(exact, 2.0 - 1.0 / n, 0.02);
  }
}

// ── Task 3: the zig-zag ring ──────────────────────────────────────────────────────────────────

struct Sequence {
  torch::Tensor q, k, v, dout;
};

/// Q, K, V, dO of a whole sequence of 2·chunk·world tokens (Hq = 4, Hkv = 2), rounded to dtype.
Sequence make_sequence(int world, int64_t chunk, uint64_t seed, int64_t d = 32,
                       torch::ScalarType dtype = torch::kFloat) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  const int64_t s = 2 * chunk * world;
  auto make = [&](int64_t heads) { return torch::randn({1, heads, s, d}, gen).to(dtype); };
  return {make(4), make(2), make(2), make(4)};
}

/// The zig-zag ring forward and backward on `device` against the oracle over the whole
/// sequence: out, lse, dq, dk and dv of this rank's shard.
void check_zigzag(Comm& comm, torch::Device device, torch::ScalarType dtype, int64_t chunk, int64_t d, bool causal,
                  uint64_t seed) {
  const Sequence seq = make_sequence(comm.size(), chunk, seed, d, dtype);
  const int64_t s = seq.q.size(2);
  const int n = comm.size(), r = comm.rank();
  auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, TokenLayout::ZigZag, n, r); };
  auto on = [&](const torch::Tensor& t) { return mine(t).to(device); };
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto [out, lse] = testing::oracle_attention(seq.q, seq.k, seq.v, causal, torch::arange(s), torch::arange(s), scale);
  const auto [dq, dk, dv] =
      testing::oracle_attention_grads(seq.q, seq.k, seq.v, seq.dout, causal, torch::arange(s), torch::arange(s), scale);
  const RingOptions options = ring_options(causal);
  const RingResult f = zigzag_ring_attention_forward(comm, on(seq.q), on(seq.k), on(seq.v), options);
  const RingGrads g = zigzag_ring_attention_backward(comm, on(seq.dout), on(seq.q), on(seq.k), on(seq.v), f.out, f.lse,
                                                     options);
  const std::string what = std::string(causal ? "causal" : "full") + " " + std::string(c10::toString(dtype)) +
                           " D=" + std::to_string(d) + " on " + device.str() + ", rank " + std::to_string(r) +
                           " of " + std::to_string(n);
  CP_EXPECT_CLOSE(f.out, mine(out), "out " + what, kDims, testing::merged_tolerance(seq.v));
  CP_EXPECT_CLOSE(f.lse, shard_sequence(lse, TokenLayout::ZigZag, n, r), "lse " + what, {"b", "h", "s"});
  CP_EXPECT_CLOSE(g.dq, mine(dq), "dq " + what, kDims, testing::gradient_tolerance(dtype, dq));
  CP_EXPECT_CLOSE(g.dk, mine(dk), "dk " + what, kDims, testing::gradient_tolerance(dtype, dk));
  CP_EXPECT_CLOSE(g.dv, mine(dv), "dv " + what, kDims, testing::gradient_tolerance(dtype, dv));
}

CP_TEST(Lesson07, Task3_ZigZagForwardAndBackwardMatchFullAttention) {
  for_each_world([](Comm& comm) {
    for (bool causal : {false, true}) check_zigzag(comm, torch::kCPU, torch::kFloat, 13, 32, causal, 70);
  });
}

CP_TEST(Lesson07, Task3_EveryRankExecutesTheSameWorkAtEveryStep) {
  for_each_world([](Comm& comm) {
    const int64_t c = 16;
    const Sequence seq = make_sequence(comm.size(), c, 71);
    auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, TokenLayout::ZigZag, comm.size(), comm.rank()); };
    const RingStats stats = zigzag_ring_attention_forward(comm, mine(seq.q), mine(seq.k), mine(seq.v),
                                                          ring_options(true)).stats;
    EXPECT_EQ(stats.steps_computed, comm.size()) << "zig-zag skips nothing";
    ASSERT_EQ(stats.steps.size(), static_cast<size_t>(comm.size()));
    EXPECT_EQ(stats.steps[0].pairs, 4 * c * c) << "step 0: the own two chunks, with the causal mask";
    for (size_t t = 1; t < stats.steps.size(); ++t)
      EXPECT_EQ(stats.steps[t].pairs, 2 * c * c) << "step " << t << ": half the block, on every rank";
  });
}

CP_TEST(Lesson07, Task3_OddShardLengthIsAClearError) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    const torch::Tensor t = torch::zeros({1, 1, 4, 32});
    zigzag_ring_attention_forward(comm, t, t, t, ring_options(true));
  });
  expect_error([] {
    run_local_world(2, [](Comm& comm) {
      const torch::Tensor t = torch::zeros({1, 1, 5, 32});
      zigzag_ring_attention_forward(comm, t, t, t);
    });
  }, "is S divisible by 2N?");
}

CP_TEST(Lesson07Cuda, Task3_ZigZagForwardAndBackwardOnCudaForEveryDtype) {
  // Every output (out, lse, dq, dk, dv), every dtype, D = 32 and 128, chunks of 40 tokens (not a
  // multiple of the kernels' 64-row blocks).
  CP_REQUIRE_GPU();
  for_each_world([](Comm& comm) {
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
      for (int64_t d : {32, 128}) check_zigzag(comm, torch::kCUDA, dtype, 40, d, true, 72);
  });
}

}  // namespace
}  // namespace cp
