// Lesson 10 — Ulysses: the all-to-alls against the unsharded tensors, and each rank's (out, lse,
// dq, dk, dv) against float64 attention over the whole sequence, for every token layout and both
// GQA cases (K/V heads split or replicated), on local worlds of 1, 2, 3, 4, 8 ranks or the mpirun
// world; the bytes sent against the formula; lesson 09's layer trained with Ulysses.
#include <torch/types.h>

#include <cmath>

#include "common/error.h"
#include "common/world.h"
#include "layer_reference.h"
#include "testing/harness.h"
#include "testing/oracle.h"
#include "ulysses.h"

namespace cp {
namespace {

using testing::all_close;
using testing::for_each_world;

const std::vector<std::string> kDims = {"b", "h", "s", "d"};

/// Heads for a world of P ranks: Hq = 2P query heads, and K/V heads that are split (Hkv = P) or,
/// for P > 1, replicated (Hkv = 1: each K/V head serves 2P query heads, copied to every rank).
struct Heads {
  int64_t q, kv;
};
std::vector<Heads> heads_for(int world) {
  std::vector<Heads> heads = {{2 * world, world}};
  if (world > 1) heads.push_back({2 * world, 1});
  if (world == 8) heads.push_back({8, 2});  // Hkv = 2 divides P = 8: each replicated 4 times
  return heads;
}

std::string where(const Comm& comm, const std::string& what) {
  return what + ", rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
}

// ── Task 1: the two all-to-alls ───────────────────────────────────────────────────────────────

CP_TEST(Lesson10, Task1_SeqToHeadsGivesThisRanksHeadsOfTheWholeSequence) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    const int64_t chunk = 5, heads = 2 * p;
    // Every element says where it comes from: 1000·head + token, 0.5 apart in d.
    const torch::Tensor full = (torch::arange(heads).view({1, heads, 1, 1}) * 1000 +
                                torch::arange(chunk * p).view({1, 1, chunk * p, 1}) + torch::arange(3).view({1, 1, 1, 3}) * 0.5)
                                   .expand({2, heads, chunk * p, 3})
                                   .to(torch::kDouble)
                                   .contiguous();
    const torch::Tensor mine = full.narrow(2, comm.rank() * chunk, chunk).contiguous();
    const torch::Tensor by_heads = ulysses_seq_to_heads(comm, mine);
    const torch::Tensor expected = full.narrow(1, comm.rank() * heads / p, heads / p);
    EXPECT_TRUE(torch::equal(by_heads, expected)) << where(comm, "seq_to_heads") << ": got shape " << by_heads.sizes()
                                                  << ", expected " << expected.sizes();
    EXPECT_TRUE(torch::equal(ulysses_heads_to_seq(comm, by_heads), mine)) << where(comm, "heads_to_seq undoes it");
    // lse-shaped tensors [B, H, S/P] take the same path.
    const torch::Tensor lse = mine.select(3, 0).contiguous();
    EXPECT_TRUE(torch::equal(ulysses_seq_to_heads(comm, lse), expected.select(3, 0))) << where(comm, "3-D tensor");
  });
}

// ── Task 2 and 3: forward and backward against the oracle ─────────────────────────────────────

struct Case {
  int64_t batch, chunk, head_dim;  // chunk = S/P, not a multiple of the kernels' tiles
  bool causal;
  TokenLayout layout;
};

void check_case(Comm& comm, const Case& c, const Heads& h, uint64_t seed) {
  const int p = comm.size();
  const int64_t s = c.chunk * p;
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  const torch::Tensor q = torch::randn({c.batch, h.q, s, c.head_dim}, gen),
                      k = torch::randn({c.batch, h.kv, s, c.head_dim}, gen),
                      v = torch::randn({c.batch, h.kv, s, c.head_dim}, gen),
                      dout = torch::randn({c.batch, h.q, s, c.head_dim}, gen);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const torch::Tensor pos = torch::arange(s);
  const auto [out, lse] = testing::oracle_attention(q, k, v, c.causal, pos, pos, scale);
  const auto [dq, dk, dv] = testing::oracle_attention_grads(q, k, v, dout, c.causal, pos, pos, scale);
  auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, c.layout, p, comm.rank()).contiguous(); };
  const UlyssesOptions options = ulysses_options(c.causal, c.layout);
  const UlyssesResult r = ulysses_attention_forward(comm, mine(q), mine(k), mine(v), options);
  const std::string what = where(comm, to_string(c.layout) + (c.causal ? " causal" : " full") + ", Hq " +
                                           std::to_string(h.q) + " Hkv " + std::to_string(h.kv));
  EXPECT_TRUE(all_close(r.out, mine(out), "out " + what, kDims));
  EXPECT_TRUE(all_close(r.lse, mine(lse), "lse " + what, {"b", "h", "s"}));
  const UlyssesGrads g = ulysses_attention_backward(comm, mine(dout), mine(q), mine(k), mine(v), r.out, r.lse, options);
  EXPECT_TRUE(all_close(g.dq, mine(dq), "dq " + what, kDims, testing::gradient_tolerance(torch::kFloat, dq)));
  EXPECT_TRUE(all_close(g.dk, mine(dk), "dk " + what, kDims, testing::gradient_tolerance(torch::kFloat, dk)));
  EXPECT_TRUE(all_close(g.dv, mine(dv), "dv " + what, kDims, testing::gradient_tolerance(torch::kFloat, dv)));
  const UlyssesVolume volume = ulysses_volume(c.batch, h.q, h.kv, s, c.head_dim, p, sizeof(float));
  EXPECT_EQ(r.stats.bytes_sent, volume.forward_bytes) << "forward bytes, " << what;
  EXPECT_EQ(g.stats.bytes_sent, volume.backward_bytes) << "backward bytes, " << what;
}

CP_TEST(Lesson10, Task2_ForwardAndTask3_BackwardMatchFullAttention) {
  for_each_world([](Comm& comm) {
    uint64_t seed = 100;
    for (const Heads& h : heads_for(comm.size()))
      for (bool causal : {false, true}) check_case(comm, {2, 13, 32, causal, TokenLayout::Contiguous}, h, seed++);
  });
}

CP_TEST(Lesson10, Task2_CausalMaskFromGlobalPositionsForEveryLayout) {
  for_each_world([](Comm& comm) {
    const Heads h = heads_for(comm.size()).back();  // replicated K/V heads where P > 1
    uint64_t seed = 200;
    for (TokenLayout layout : {TokenLayout::ZigZag, TokenLayout::Stripe})
      check_case(comm, {1, 6, 64, true, layout}, h, seed++);  // S = 6P: 2P zig-zag chunks of 3 tokens
  });
}

CP_TEST(Lesson10, Task2_VolumeFormulaIsZeroOnOneRankAndFollowsP) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    const torch::Tensor t = torch::zeros({1, 2, 4, 32});
    EXPECT_EQ(ulysses_attention_forward(comm, t, t, t).stats.bytes_sent, 0);
  });
  const UlyssesVolume one = ulysses_volume(2, 8, 2, 64, 32, 1, 4);
  EXPECT_EQ(one.forward_bytes, 0);
  EXPECT_EQ(one.backward_bytes, 0);
  // P = 4, Hq = Hkv = 8: q, k, v, out each send 3/16 of B·S·H·D = 2·64·8·32 elements; lse 3/16 of B·S·H.
  const int64_t tensor = 3 * 2 * 64 * 8 * 32 / 16 * 4, lse = 3 * 2 * 64 * 8 / 16 * 4;
  const UlyssesVolume four = ulysses_volume(2, 8, 8, 64, 32, 4, 4);
  EXPECT_EQ(four.forward_bytes, 4 * tensor + lse);
  EXPECT_EQ(four.backward_bytes, 8 * tensor + lse);
  EXPECT_EQ(ulysses_kv_heads(8, 2, 4), 4);  // replicated twice
  EXPECT_EQ(ulysses_kv_heads(8, 8, 4), 8);
}

CP_TEST(Lesson10, Task3_EmptyInputGivesEmptyResults) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    for (const auto& shape : {std::vector<int64_t>{0, p, 4, 32}, std::vector<int64_t>{1, p, 0, 32}}) {
      const torch::Tensor t = torch::zeros(shape);
      const UlyssesResult r = ulysses_attention_forward(comm, t, t, t, ulysses_options(true));
      const UlyssesGrads g = ulysses_attention_backward(comm, t, t, t, t, r.out, r.lse, ulysses_options(true));
      EXPECT_EQ(r.out.sizes(), t.sizes());
      EXPECT_EQ(r.lse.sizes(), t.sizes().slice(0, 3));
      EXPECT_EQ(g.dk.sizes(), t.sizes());
    }
  });
}

CP_TEST(Lesson10, Task3_TheLayerTrainsWithUlysses) {
  for_each_world([](Comm& comm) {
    // Hq = 2P query heads over one K/V head: the layer's GQA with K/V replicated where P > 1.
    testing::expect_training_step_matches_one_device(comm, ulysses_strategy(), 130, 32 * 2 * comm.size(),
                                                     2 * comm.size(), 1);
  });
}

CP_TEST(Lesson10, Task2_BadInputGivesClearErrors) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    const torch::Tensor t = torch::zeros({1, 2, 4, 32});
    ulysses_attention_forward(comm, t, t, t);
  });
  auto on_4_ranks = [](std::function<void(Comm&)> body) { return [body] { run_local_world(4, body); }; };
  auto forward = [](int64_t hq, int64_t hkv, int64_t chunk, TokenLayout layout = TokenLayout::Contiguous) {
    return [=](Comm& comm) {
      ulysses_attention_forward(comm, torch::zeros({1, hq, chunk, 32}), torch::zeros({1, hkv, chunk, 32}),
                                torch::zeros({1, hkv, chunk, 32}), ulysses_options(false, layout));
    };
  };
  testing::expect_errors({
      {"Hq = 6 over 4 ranks", on_4_ranks(forward(6, 6, 4)), "query heads Hq = 6 must be divisible by the 4 ranks"},
      {"Hkv = 3 over 4 ranks", on_4_ranks(forward(12, 3, 4)), "Hkv = 3 must be divisible by the 4 ranks, or divide it"},
      {"Hq = 8 not divisible by Hkv = 3", on_4_ranks(forward(8, 3, 4)), "divisible by"},
      {"zig-zag with S = 4·3, not divisible by 2·4", on_4_ranks(forward(4, 4, 3, TokenLayout::ZigZag)), "S = 12 is not divisible by 2N = 8"},
      {"rank 2 holds 5 tokens", on_4_ranks([](Comm& comm) {
         const torch::Tensor t = torch::zeros({1, 4, comm.rank() == 2 ? 5 : 4, 32});
         ulysses_attention_forward(comm, t, t, t);
       }), "Is S divisible by N = 4?"},
      {"3-D q", on_4_ranks([](Comm& comm) {
         const torch::Tensor t = torch::zeros({1, 4, 4, 32});
         ulysses_attention_forward(comm, t[0], t, t);
       }), "q: expected"},
      {"seq_to_heads of 3 heads over 4 ranks", on_4_ranks([](Comm& comm) {
         ulysses_seq_to_heads(comm, torch::zeros({1, 3, 2}));
       }), "head count 3 (dim 1) must be divisible by the 4 ranks"},
  });
}

}  // namespace
}  // namespace cp
