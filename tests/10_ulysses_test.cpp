// Lesson 10 — Ulysses: the all-to-alls against the unsharded tensors, and each rank's (out, lse,
// dq, dk, dv) against float64 attention over the whole sequence, for every token layout and both
// GQA cases (K/V heads split or replicated), on local worlds of 1, 2, 3, 4, 8 ranks or the mpirun
// world; the bytes sent against the formula; lesson 09's layer trained with Ulysses.
#include <torch/types.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

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

/// Heads for a world of P ranks, every way the K/V heads can reach the ranks:
///   Hq = Hkv = P             no GQA: one query head and its K/V head per rank
///   Hq = 2P, Hkv = P         GQA, the K/V heads split like the query heads
///   Hq = 2P, Hkv = 2         P = 4 or 8: each K/V head replicated P/2 times
///   Hq = 8, Hkv = 4          P = 8: each K/V head replicated twice
///   Hq = 2P, Hkv = 1         P > 1: the one K/V head replicated on every rank (last)
struct Heads {
  int64_t q, kv;
};
std::vector<Heads> heads_for(int world) {
  std::vector<Heads> heads = {{world, world}, {2 * world, world}};
  if (world == 4 || world == 8) heads.push_back({2 * world, 2});
  if (world == 8) heads.push_back({8, 4});
  if (world > 1) heads.push_back({2 * world, 1});
  return heads;
}

std::string where(const Comm& comm, const std::string& what) {
  return what + ", rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
}

// ── Task 1: the two all-to-alls ───────────────────────────────────────────────────────────────

/// Elements labelled by where they come from: 100000·b + 1000·head + token + d/4.
torch::Tensor labelled(int64_t batch, int64_t heads, int64_t seq, int64_t dim) {
  return (torch::arange(batch).view({batch, 1, 1, 1}) * 100000 + torch::arange(heads).view({1, heads, 1, 1}) * 1000 +
          torch::arange(seq).view({1, 1, seq, 1}) + torch::arange(dim).view({1, 1, 1, dim}) * 0.25)
      .to(torch::kDouble)
      .contiguous();
}

/// Empty when `got` equals `expected` (both labelled); else the first element that differs, as
/// the (b, head, token) that arrived there instead of the one expected.
std::string first_difference(const torch::Tensor& got, const torch::Tensor& expected) {
  std::ostringstream out;
  if (got.sizes() != expected.sizes()) {
    out << "shape " << got.sizes() << ", expected " << expected.sizes();
    return out.str();
  }
  const torch::Tensor wrong = (got != expected).flatten().nonzero().flatten();
  if (wrong.size(0) == 0) return "";
  auto name = [](double x) {
    const auto l = static_cast<int64_t>(x);
    return "(b " + std::to_string(l / 100000) + ", head " + std::to_string(l % 100000 / 1000) + ", token " +
           std::to_string(l % 1000) + ")";
  };
  const int64_t first = wrong[0].item<int64_t>();
  std::vector<int64_t> index(got.dim());
  for (int64_t d = got.dim() - 1, rest = first; d >= 0; --d) index[d] = rest % got.size(d), rest /= got.size(d);
  out << wrong.size(0) << " of " << got.numel() << " elements differ; first at " << torch::IntArrayRef(index)
      << ": got " << name(got.flatten()[first].item<double>()) << ", expected "
      << name(expected.flatten()[first].item<double>());
  return out.str();
}

CP_TEST(Lesson10, Task1_SeqToHeadsGivesThisRanksHeadsOfTheWholeSequence) {
  for_each_world([](Comm& comm) {
    const int p = comm.size(), r = comm.rank();
    const int64_t chunk = 5, heads = 2 * p;
    const torch::Tensor full = labelled(2, heads, chunk * p, 3);  // the unsharded tensor
    const torch::Tensor mine = full.narrow(2, r * chunk, chunk).contiguous();
    const torch::Tensor expected = full.narrow(1, r * heads / p, heads / p).contiguous();
    EXPECT_EQ(first_difference(ulysses_seq_to_heads(comm, mine), expected), "")
        << where(comm, "seq_to_heads: heads [" + std::to_string(r * heads / p) + ", " +
                           std::to_string((r + 1) * heads / p) + ") of the whole sequence");
    EXPECT_EQ(first_difference(ulysses_heads_to_seq(comm, expected), mine), "")
        << where(comm, "heads_to_seq: tokens [" + std::to_string(r * chunk) + ", " + std::to_string((r + 1) * chunk) +
                           ") of every head");
    EXPECT_EQ(first_difference(ulysses_heads_to_seq(comm, ulysses_seq_to_heads(comm, mine)), mine), "")
        << where(comm, "heads_to_seq(seq_to_heads(x)) = x");
    // lse-shaped tensors [B, H, S/P] take the same path.
    EXPECT_EQ(first_difference(ulysses_seq_to_heads(comm, mine.select(3, 0).contiguous()), expected.select(3, 0)), "")
        << where(comm, "seq_to_heads of a 3-D tensor");
  });
}

// ── Task 2 and 3: forward and backward against the oracle ─────────────────────────────────────

struct Case {
  int64_t batch, chunk, head_dim;  // chunk = S/P, not a multiple of the kernels' tiles
  bool causal;
  TokenLayout layout;
};

/// What check_case runs: the forward, the backward (from what the forward would keep, made from
/// the reference's out and lse, so that it does not depend on the forward), or the backward from
/// what the forward kept.
enum class Pass { Forward, Backward, Both };

/// The UlyssesSaved of a forward that got out and lse right: this rank's q, k, v, out, lse brought
/// to the head split with task 1's exchange (K/V heads replicated as the forward does).
UlyssesSaved saved_from_reference(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& out, const torch::Tensor& lse) {
  const int64_t kv = ulysses_kv_heads(q.size(1), k.size(1), comm.size());
  auto heads = [&](const torch::Tensor& t) { return ulysses_seq_to_heads(comm, t.contiguous()); };
  return {heads(q), heads(out), heads(replicate_kv_heads(k, kv)), heads(replicate_kv_heads(v, kv)), heads(lse),
          k.size(1)};
}

/// One case on every rank: the shards of a random sequence (in `dtype`, on `device`) through the
/// forward and/or the backward, every output against float64 attention over the whole sequence in
/// position order, and the bytes sent against ulysses_volume.
void check_case(Comm& comm, const Case& c, const Heads& h, uint64_t seed, Pass pass,
                torch::Dtype dtype = torch::kFloat, torch::Device device = torch::kCPU) {
  const int p = comm.size();
  const int64_t s = c.chunk * p;
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  const torch::Tensor q = torch::randn({c.batch, h.q, s, c.head_dim}, gen).to(dtype),
                      k = torch::randn({c.batch, h.kv, s, c.head_dim}, gen).to(dtype),
                      v = torch::randn({c.batch, h.kv, s, c.head_dim}, gen).to(dtype),
                      dout = torch::randn({c.batch, h.q, s, c.head_dim}, gen).to(dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const torch::Tensor pos = torch::arange(s);
  const auto [out, lse] = testing::oracle_attention(q, k, v, c.causal, pos, pos, scale);
  auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, c.layout, p, comm.rank()).contiguous(); };
  auto in = [&](const torch::Tensor& t) { return mine(t).to(device); };
  const UlyssesOptions options = ulysses_options(c.causal, c.layout);
  const UlyssesVolume volume = ulysses_volume(c.batch, h.q, h.kv, s, c.head_dim, p, q.element_size());
  const std::string what = where(comm, to_string(c.layout) + (c.causal ? " causal" : " full") + ", Hq " +
                                           std::to_string(h.q) + " Hkv " + std::to_string(h.kv) + ", " +
                                           c10::toString(dtype) + (device.is_cuda() ? " cuda" : ""));
  UlyssesSaved saved;
  if (pass != Pass::Backward) {
    const UlyssesResult r = ulysses_attention_forward(comm, in(q), in(k), in(v), options);
    EXPECT_EQ(r.out.scalar_type(), dtype) << what;
    EXPECT_TRUE(all_close(r.out, mine(out), "out " + what, kDims));
    EXPECT_TRUE(all_close(r.lse, mine(lse), "lse " + what, {"b", "h", "s"}));
    EXPECT_EQ(r.stats.bytes_sent, volume.forward_bytes) << "forward bytes, " << what;
    saved = r.saved;
  } else {
    saved = saved_from_reference(comm, in(q), in(k), in(v), in(out.to(dtype)), in(lse.to(torch::kFloat)));
  }
  if (pass == Pass::Forward) return;
  const auto [dq, dk, dv] = testing::oracle_attention_grads(q, k, v, dout, c.causal, pos, pos, scale);
  const UlyssesGrads g = ulysses_attention_backward(comm, in(dout), saved, options);
  EXPECT_TRUE(all_close(g.dq, mine(dq), "dq " + what, kDims, testing::gradient_tolerance(dtype, dq)));
  EXPECT_TRUE(all_close(g.dk, mine(dk), "dk " + what, kDims, testing::gradient_tolerance(dtype, dk)));
  EXPECT_TRUE(all_close(g.dv, mine(dv), "dv " + what, kDims, testing::gradient_tolerance(dtype, dv)));
  EXPECT_EQ(g.dk.scalar_type(), dtype) << what;
  EXPECT_EQ(g.stats.bytes_sent, volume.backward_bytes) << "backward bytes, " << what;
}

CP_TEST(Lesson10, Task2_ForwardMatchesFullAttention) {
  for_each_world([](Comm& comm) {
    uint64_t seed = 100;
    for (const Heads& h : heads_for(comm.size()))
      for (bool causal : {false, true})
        check_case(comm, {2, 13, 32, causal, TokenLayout::Contiguous}, h, seed++, Pass::Forward);
  });
}

CP_TEST(Lesson10, Task2_CausalMaskFromGlobalPositionsForEveryLayout) {
  for_each_world([](Comm& comm) {
    const Heads h = heads_for(comm.size()).back();  // replicated K/V heads where P > 1
    uint64_t seed = 200;
    for (TokenLayout layout : {TokenLayout::ZigZag, TokenLayout::Stripe})
      check_case(comm, {1, 6, 64, true, layout}, h, seed++, Pass::Forward);  // S = 6P: 2P zig-zag chunks of 3
  });
}

CP_TEST(Lesson10, Task3_BackwardMatchesFullAttentionForEveryLayout) {
  for_each_world([](Comm& comm) {
    uint64_t seed = 100;  // the inputs of the forward tests
    for (const Heads& h : heads_for(comm.size()))
      for (bool causal : {false, true})
        check_case(comm, {2, 13, 32, causal, TokenLayout::Contiguous}, h, seed++, Pass::Backward);
    seed = 200;
    for (TokenLayout layout : {TokenLayout::ZigZag, TokenLayout::Stripe})
      check_case(comm, {1, 6, 64, true, layout}, heads_for(comm.size()).back(), seed++, Pass::Backward);
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
  // P = 4, Hq = Hkv = 8: each tensor sends 3/16 of B·S·H·D = 2·64·8·32 elements; lse 3/16 of B·S·H.
  const int64_t tensor = 3 * 2 * 64 * 8 * 32 / 16 * 4, lse = 3 * 2 * 64 * 8 / 16 * 4;
  const UlyssesVolume four = ulysses_volume(2, 8, 8, 64, 32, 4, 4);
  EXPECT_EQ(four.forward_bytes, 4 * tensor + lse);  // q, k, v in; out, lse back
  EXPECT_EQ(four.backward_bytes, 4 * tensor);       // dout in; dq, dk, dv back: 4·(P−1)/P²·B·S·H·D elements
  EXPECT_EQ(ulysses_kv_heads(8, 2, 4), 4);  // replicated twice
  EXPECT_EQ(ulysses_kv_heads(8, 8, 4), 8);
}

CP_TEST(Lesson10, Task2_TraceRecordsTheExchangesAndTheAttention) {
  Trace trace;
  run_local_world(3, [&](Comm& comm) {
    const torch::Tensor t = torch::ones({1, 3, 4, 32});
    ulysses_attention_forward(comm, t, t, t, ulysses_options(true, TokenLayout::Contiguous, &trace));
  });
  // One file per process: under mpirun every rank runs this test.
  const std::string path =
      ::testing::TempDir() + "lesson10_trace_rank" + std::to_string(testing::process_rank()) + ".json";
  trace.write(path);
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  std::remove(path.c_str());
  EXPECT_NE(text.str().find("\"cat\": \"compute\""), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("\"cat\": \"comm\""), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("\"name\": \"rank 2\""), std::string::npos) << text.str();
}

CP_TEST(Lesson10, Task3_EmptyInputGivesEmptyResults) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    for (const auto& shape : {std::vector<int64_t>{0, p, 4, 32}, std::vector<int64_t>{1, p, 0, 32}}) {
      const torch::Tensor t = torch::zeros(shape);
      const UlyssesResult r = ulysses_attention_forward(comm, t, t, t, ulysses_options(true));
      const UlyssesGrads g = ulysses_attention_backward(comm, t, r.saved, ulysses_options(true));
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
      {"Hq = 8 not divisible by Hkv = 3", on_4_ranks(forward(8, 3, 4)), "H_q (8) must be divisible by H_kv (3)"},
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

CP_TEST(Lesson10, Task3_BackwardRejectsSavedTensorsThatDoNotFitDout) {
  const torch::Tensor t = torch::zeros({1, 4, 4, 32});
  run_local_world(1, [&](Comm& comm) {  // counts once implemented
    ulysses_attention_backward(comm, t, ulysses_attention_forward(comm, t, t, t).saved);
  });
  // On 2 ranks: the forward of t, then a backward given `dout` and something else than its saved.
  auto backward = [&](torch::Tensor dout, std::function<UlyssesSaved(const UlyssesSaved&)> change) {
    return [=] {
      run_local_world(2, [&](Comm& comm) {
        ulysses_attention_backward(comm, dout, change(ulysses_attention_forward(comm, t, t, t).saved));
      });
    };
  };
  const auto as_is = [](const UlyssesSaved& s) { return s; };
  testing::expect_errors({
      {"no saved tensors", backward(t, [](const UlyssesSaved&) { return UlyssesSaved{}; }), "saved: empty"},
      {"dout of 6 tokens for a forward of 4", backward(torch::zeros({1, 4, 6, 32}), as_is),
       "saved: expected the forward's head split for dout [1, 4, 6, 32] on 2 ranks"},
      {"lse saved in float64", backward(t, [](UlyssesSaved s) { s.lse = s.lse.to(torch::kDouble); return s; }),
       "saved: q must have dout's dtype"},
      {"3-D dout", backward(t[0], as_is), "dout: expected"},
  });
}

CP_TEST(Lesson10Cuda, Task3_ForwardAndBackwardOnCudaForEveryDtype) {
  // Every output in float32, float16 and bfloat16, D = 32 and 128, zig-zag chunks of 40 tokens
  // (not a multiple of the kernels' 64-row blocks), K/V heads replicated where P > 1.
  CP_REQUIRE_GPU();
  for_each_world([](Comm& comm) {
    const Heads h = heads_for(comm.size()).back();
    uint64_t seed = 300;
    for (torch::Dtype dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
      for (int64_t d : {32, 128}) check_case(comm, {1, 40, d, true, TokenLayout::ZigZag}, h, seed++, Pass::Both, dtype, torch::kCUDA);
  });
}

}  // namespace
}  // namespace cp
