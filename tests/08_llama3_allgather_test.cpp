// Lesson 08 — all-gather context parallelism: the varlen zig-zag layout and the plan exactly,
// forward and backward against float64 attention run document by document on the whole batch,
// both modes bit-identical, and bad cu_seqlens as clear errors.
#include <torch/types.h>

#include <cmath>

#include "common/error.h"
#include "common/world.h"
#include "llama3_allgather.h"
#include "testing/harness.h"
#include "testing/oracle.h"

namespace cp {
namespace {

using testing::all_close;
using testing::expect_error;
using testing::for_each_world;

const std::vector<std::string> kPackedDims = {"t", "h", "d"};
const std::vector<Llama3Mode> kModes = {Llama3Mode::TwoKernels, Llama3Mode::Fused};

/// cu_seqlens of documents whose lengths are `units` × 2N.
torch::Tensor cu_seqlens_of(const std::vector<int64_t>& units, int world) {
  std::vector<int64_t> cu{0};
  for (int64_t u : units) cu.push_back(cu.back() + u * 2 * world);
  return torch::tensor(cu, torch::kLong);
}

// ── Task 1: the varlen zig-zag layout ─────────────────────────────────────────────────────────

CP_TEST(Lesson08, Task1_EveryTokenIsOwnedOnceInDocumentZigZagOrder) {
  // N = 2, documents of 8 and 4 tokens: chunks of 2 and 1 tokens, rank 0 holds chunks 0 and 3 of each.
  const torch::Tensor cu = torch::tensor({0, 8, 12}, torch::kLong);
  EXPECT_TRUE(torch::equal(zigzag_varlen_positions(cu, 2, 0), torch::tensor({0, 1, 6, 7, 8, 11}, torch::kLong)));
  EXPECT_TRUE(torch::equal(zigzag_varlen_positions(cu, 2, 1), torch::tensor({2, 3, 4, 5, 9, 10}, torch::kLong)));
  for (int n = 1; n <= 8; ++n) {
    const torch::Tensor cu_n = cu_seqlens_of({2, 1, 3}, n);
    const int64_t total = cu_n[-1].item<int64_t>();
    std::vector<torch::Tensor> all;
    for (int r = 0; r < n; ++r) all.push_back(zigzag_varlen_positions(cu_n, n, r));
    for (const torch::Tensor& p : all) EXPECT_EQ(p.numel(), total / n) << "N = " << n;
    EXPECT_TRUE(torch::equal(std::get<0>(torch::cat(all).sort()), torch::arange(total))) << "N = " << n;
  }
}

CP_TEST(Lesson08, Task1_ShardAndUnshardRoundTripExactly) {
  for (int n : {1, 2, 3, 4, 8}) {
    const torch::Tensor cu = cu_seqlens_of({3, 1, 2}, n);
    const torch::Tensor full = torch::randn({cu[-1].item<int64_t>(), 3, 4});
    std::vector<torch::Tensor> shards;
    for (int r = 0; r < n; ++r) shards.push_back(zigzag_varlen_shard(full, cu, n, r));
    EXPECT_TRUE(torch::equal(zigzag_varlen_unshard(shards, cu), full)) << "N = " << n;
  }
}

CP_TEST(Lesson08, Task1_BadCuSeqlensAreClearErrors) {
  zigzag_varlen_positions(torch::tensor({0, 8}, torch::kLong), 2, 0);  // counts once implemented
  expect_error([] { zigzag_varlen_positions(torch::tensor({0, 8, 8, 12}, torch::kLong), 2, 0); },
               "must be strictly increasing; document 1 is [8, 8)");
  expect_error([] { zigzag_varlen_positions(torch::tensor({0, 8, 4}, torch::kLong), 2, 0); },
               "must be strictly increasing; document 1 is [8, 4)");
  expect_error([] { zigzag_varlen_positions(torch::tensor({0, 8, 14}, torch::kLong), 2, 0); },
               "document 1 has length 6, not divisible by 2N = 4");
  expect_error([] { zigzag_varlen_positions(torch::tensor({4, 8}, torch::kLong), 2, 0); }, "must start at 0");
  expect_error([] { zigzag_varlen_positions(torch::tensor({0.0, 8.0}), 2, 0); }, "expected int64 or int32");
  expect_error([] { check_cu_seqlens(torch::tensor({0, 8}, torch::kLong), 12, 2); }, "must end at T = 12");
  expect_error([] { zigzag_varlen_positions(torch::tensor({0, 8}, torch::kLong), 2, 2); }, "rank 2 is not in a world of 2");
  const std::vector<torch::Tensor> shards = {torch::zeros({4, 2}), torch::zeros({4, 2})};  // T = 8 over 2 ranks
  testing::expect_errors({
      {"unshard with cu_seqlens of T = 16", [&] { zigzag_varlen_unshard(shards, torch::tensor({0, 16}, torch::kLong)); },
       "zigzag_varlen_unshard: cu_seqlens must end at T = 8 (2 shards of 4 rows), ends at 16"},
      {"unshard with a shard of 3 rows", [] {
         zigzag_varlen_unshard({torch::zeros({4}), torch::zeros({3})}, torch::tensor({0, 8}, torch::kLong));
       }, "shard 1 has shape [3], shard 0 has [4]"},
      {"unshard of a 0-d shard", [] { zigzag_varlen_unshard({torch::zeros({})}, torch::tensor({0, 8}, torch::kLong)); },
       "shards must be packed tensors"},
      {"cu_seqlens with no boundary", [] { zigzag_varlen_positions(torch::zeros({0}, torch::kLong), 2, 0); },
       "expected int64 or int32 [documents + 1]"},
  });
}

CP_TEST(Lesson08, Task1_NoDocumentsIsAnEmptyBatch) {
  zigzag_varlen_positions(torch::tensor({0, 4}, torch::kLong), 1, 0);  // counts once implemented
  const torch::Tensor no_documents = torch::zeros({1}, torch::kLong);  // cu_seqlens [0]
  EXPECT_EQ(zigzag_varlen_positions(no_documents, 3, 1).numel(), 0);
  EXPECT_EQ(zigzag_varlen_shard(torch::zeros({0, 2, 8}), no_documents, 3, 1).sizes(), torch::IntArrayRef({0, 2, 8}));
  EXPECT_EQ(zigzag_varlen_unshard({torch::zeros({0, 2}), torch::zeros({0, 2})}, no_documents).sizes(),
            torch::IntArrayRef({0, 2}));
}

// ── Task 2: query groups and K/V slices ───────────────────────────────────────────────────────

/// Checks one rank's plan against the definition: every local query appears in exactly one
/// segment; its segment's keys are a prefix of its own document that reaches at least the
/// query itself; positions are those inside the document.
void expect_plan_is_sound(const std::vector<int64_t>& cu, int n, int r, Llama3Mode mode) {
  const torch::Tensor cu_t = torch::tensor(cu, torch::kLong);
  const torch::Tensor local_positions = zigzag_varlen_positions(cu_t, n, r);
  const int64_t t_local = local_positions.numel();
  const std::string what = to_string(mode) + ", rank " + std::to_string(r) + " of " + std::to_string(n);
  torch::Tensor seen = torch::zeros({t_local}, torch::kLong);
  for (const Llama3Call& call : llama3_plan(cu, n, r, mode)) {
    const torch::Tensor q_rows = call.q_rows.defined() ? call.q_rows : torch::arange(t_local);
    const torch::Tensor kv_rows = call.kv_rows.defined() ? call.kv_rows : torch::arange(cu.back());
    const VarlenSegments& s = call.segments;
    ASSERT_EQ(s.cu_q.back(), q_rows.numel()) << what;
    ASSERT_EQ(s.cu_k.back(), kv_rows.numel()) << what;
    for (size_t i = 0; i + 1 < s.cu_q.size(); ++i) {
      const torch::Tensor rows = q_rows.slice(0, s.cu_q[i], s.cu_q[i + 1]);
      const torch::Tensor keys = kv_rows.slice(0, s.cu_k[i], s.cu_k[i + 1]);
      const torch::Tensor packed = local_positions.index_select(0, rows);
      const int64_t doc = std::upper_bound(cu.begin(), cu.end(), packed[0].item<int64_t>()) - cu.begin() - 1;
      seen.index_add_(0, rows, torch::ones_like(rows));
      EXPECT_TRUE(torch::equal(keys, torch::arange(cu[doc], cu[doc] + keys.numel())))
          << what << ", segment " << i << ": keys must be a prefix of document " << doc;
      EXPECT_GT(keys.numel(), (packed.max() - cu[doc]).item<int64_t>())
          << what << ", segment " << i << ": a query needs every key up to itself";
      EXPECT_TRUE(torch::equal(s.q_positions.slice(0, s.cu_q[i], s.cu_q[i + 1]), packed - cu[doc])) << what;
      EXPECT_TRUE(torch::equal(s.k_positions.slice(0, s.cu_k[i], s.cu_k[i + 1]), torch::arange(keys.numel()))) << what;
    }
  }
  EXPECT_TRUE(torch::equal(seen, torch::ones({t_local}, torch::kLong))) << what << ": every query exactly once";
}

CP_TEST(Lesson08, Task2_EveryQueryGetsThePrefixOfItsDocument) {
  for (int n : {1, 2, 3, 4, 8}) {
    const torch::Tensor cu_t = cu_seqlens_of({2, 1, 3}, n);
    const std::vector<int64_t> cu(cu_t.data_ptr<int64_t>(), cu_t.data_ptr<int64_t>() + cu_t.numel());
    for (int r = 0; r < n; ++r)
      for (Llama3Mode mode : kModes) expect_plan_is_sound(cu, n, r, mode);
  }
}

CP_TEST(Lesson08, Task2_TheModesSliceAsDescribed) {
  const int n = 4;
  const std::vector<int64_t> cu = {0, 16, 48};  // documents of 16 and 32 tokens: chunks of 2 and 4
  const std::vector<Llama3Call> two = llama3_plan(cu, n, 1, Llama3Mode::TwoKernels);
  ASSERT_EQ(two.size(), 2u) << "one call per group";
  EXPECT_EQ(two[0].segments.cu_k, (std::vector<int64_t>{0, 8, 24})) << "early group: the first half of each document";
  EXPECT_EQ(two[0].segments.cu_q, (std::vector<int64_t>{0, 2, 6}));
  EXPECT_FALSE(two[1].kv_rows.defined()) << "late group: the whole gathered K/V, no copy";
  EXPECT_EQ(two[1].segments.cu_k, cu);
  const std::vector<Llama3Call> fused = llama3_plan(cu, n, 1, Llama3Mode::Fused);
  ASSERT_EQ(fused.size(), 1u);
  EXPECT_FALSE(fused[0].q_rows.defined()) << "fused: the local queries as they are";
  EXPECT_EQ(fused[0].segments.cu_k, (std::vector<int64_t>{0, 8, 24, 40, 72})) << "half + whole, per document";
}

// ── Tasks 3 and 4: forward and backward ───────────────────────────────────────────────────────

struct Batch {
  torch::Tensor cu, q, k, v, dout;  // packed [T, H, D], all documents
};

Batch make_batch(const std::vector<int64_t>& units, int world, int64_t hq, int64_t hkv, uint64_t seed,
                 int64_t d = 32) {
  Batch b;
  b.cu = cu_seqlens_of(units, world);
  const int64_t t = b.cu[-1].item<int64_t>();
  // Outliers of ±4 make some logits dominate their row (a test of the max shift) while keeping
  // float32 logits accurate; larger ones would measure the conditioning of q·k, not the code.
  b.q = testing::random_with_outliers({t, hq, d}, seed, 1.0, 4.0);
  b.k = testing::random_with_outliers({t, hkv, d}, seed + 1, 1.0, 4.0);
  b.v = testing::random_with_outliers({t, hkv, d}, seed + 2, 1.0, 0.0);
  b.dout = testing::random_with_outliers({t, hq, d}, seed + 3, 1.0, 0.0);
  return b;
}

/// Float64 attention of each document on its own, causal inside it, packed again:
/// out [T, Hq, D], lse [Hq, T], dq [T, Hq, D], dk, dv [T, Hkv, D].
struct Expected {
  torch::Tensor out, lse, dq, dk, dv;
};

Expected oracle_by_document(const Batch& b) {
  std::vector<torch::Tensor> out, lse, dq, dk, dv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(b.q.size(2)));
  for (int64_t d = 0; d + 1 < b.cu.numel(); ++d) {
    const int64_t begin = b.cu[d].item<int64_t>(), len = b.cu[d + 1].item<int64_t>() - begin;
    auto block = [&](const torch::Tensor& t) { return t.narrow(0, begin, len).transpose(0, 1).unsqueeze(0); };
    auto packed = [](const torch::Tensor& t) { return t.squeeze(0).transpose(0, 1); };
    const torch::Tensor pos = torch::arange(len);
    const auto [o, l] = testing::oracle_attention(block(b.q), block(b.k), block(b.v), true, pos, pos, scale);
    const auto [gq, gk, gv] =
        testing::oracle_attention_grads(block(b.q), block(b.k), block(b.v), block(b.dout), true, pos, pos, scale);
    out.push_back(packed(o));
    lse.push_back(l.squeeze(0));
    dq.push_back(packed(gq));
    dk.push_back(packed(gk));
    dv.push_back(packed(gv));
  }
  return {torch::cat(out), torch::cat(lse, 1), torch::cat(dq), torch::cat(dk), torch::cat(dv)};
}

struct Case {
  std::vector<int64_t> units;  // document lengths in units of 2N
  int64_t hq, hkv;
};

// 1 to 4 documents of different lengths; MHA, GQA with one K/V head, MHA with 4 heads.
const std::vector<Case> kCases = {{{3}, 1, 1}, {{2, 1, 4}, 4, 1}, {{1, 3, 2, 5}, 4, 4}};

std::string describe(const Case& c, Llama3Mode mode, int rank, int world) {
  return to_string(mode) + ", " + std::to_string(c.units.size()) + " documents, Hq " + std::to_string(c.hq) +
         "/Hkv " + std::to_string(c.hkv) + ", rank " + std::to_string(rank) + " of " + std::to_string(world);
}

CP_TEST(Lesson08, Task3_ForwardMatchesAttentionPerDocument) {
  for_each_world([](Comm& comm) {
    const int n = comm.size(), r = comm.rank();
    for (const Case& c : kCases) {
      const Batch b = make_batch(c.units, n, c.hq, c.hkv, 80);
      const Expected e = oracle_by_document(b);
      auto mine = [&](const torch::Tensor& t) { return zigzag_varlen_shard(t, b.cu, n, r); };
      torch::Tensor first_out;
      for (Llama3Mode mode : kModes) {
        const Llama3Result f = zigzag_llama3_attention_forward(comm, mine(b.q), mine(b.k), mine(b.v), b.cu, mode);
        const std::string what = describe(c, mode, r, n);
        CP_EXPECT_CLOSE(f.out, mine(e.out), "out " + what, kPackedDims);
        CP_EXPECT_CLOSE(f.lse, mine(e.lse.t()).t(), "lse " + what, {"h", "t"});
        if (!first_out.defined()) first_out = f.out;
        else EXPECT_TRUE(torch::equal(f.out, first_out)) << "both modes compute the same blocks: " << what;
      }
    }
  });
}

CP_TEST(Lesson08, Task3_StatsCountTheGatherAndThePairs) {
  for_each_world([](Comm& comm) {
    const int n = comm.size();
    const Batch b = make_batch({1, 2}, n, 4, 2, 81);
    auto mine = [&](const torch::Tensor& t) { return zigzag_varlen_shard(t, b.cu, n, comm.rank()); };
    for (Llama3Mode mode : kModes) {
      const Llama3Stats s = zigzag_llama3_attention_forward(comm, mine(b.q), mine(b.k), mine(b.v), b.cu, mode).stats;
      const int64_t t_local = b.q.size(0) / n;
      EXPECT_EQ(s.bytes_sent, (n - 1) * t_local * 2 * 2 * 32 * 4) << "(N − 1) × the local K and V";
      // Per document of length L (chunk c = L/2N): c queries × L/2 keys + c queries × L keys.
      int64_t pairs = 0;
      for (int64_t u : {1, 2}) pairs += u * (u * 2 * n) / 2 + u * (u * 2 * n);
      EXPECT_EQ(s.pairs, pairs) << to_string(mode) << ": the same on every rank";
    }
  });
}

CP_TEST(Lesson08, Task3_BadInputGivesClearErrors) {
  run_local_world(2, [](Comm& comm) {  // counts once implemented
    const torch::Tensor t = torch::zeros({4, 1, 32});
    zigzag_llama3_attention_forward(comm, t, t, t, torch::tensor({0, 8}, torch::kLong));
  });
  auto forward = [](const torch::Tensor& cu, int64_t hq = 1, int64_t hkv = 1) {
    run_local_world(2, [&](Comm& comm) {
      const torch::Tensor q = torch::zeros({4, hq, 32}), kv = torch::zeros({4, hkv, 32});
      zigzag_llama3_attention_forward(comm, q, kv, kv, cu);
    });
  };
  expect_error([&] { forward(torch::tensor({0, 4}, torch::kLong)); }, "must end at T = 8");
  expect_error([&] { forward(torch::tensor({0, 4, 2, 8}, torch::kLong)); }, "strictly increasing");
  expect_error([&] { forward(torch::tensor({0, 2, 8}, torch::kLong)); }, "document 0 has length 2, not divisible by 2N = 4");
  expect_error([&] { forward(torch::tensor({0, 8}, torch::kLong), 3, 2); }, "divisible");
  // Boundaries that differ between ranks: every rank fails alike, none is left waiting.
  auto per_rank = [](const std::vector<std::vector<int64_t>>& cu) {
    run_local_world(2, [&](Comm& comm) {
      const torch::Tensor t = torch::zeros({8, 1, 32});  // T = 16
      zigzag_llama3_attention_forward(comm, t, t, t, torch::tensor(cu[comm.rank()], torch::kLong));
    });
  };
  expect_error([&] { per_rank({{0, 4, 16}, {0, 16}}); }, "ranks pass between 1 and 2 documents");
  expect_error([&] { per_rank({{0, 4, 16}, {0, 12, 16}}); }, "rank 0 has [0, 4, 16], rank 1 has [0, 12, 16]");
  expect_error([] {
    run_local_world(1, [](Comm& comm) {
      const torch::Tensor t = torch::zeros({1, 4, 8, 32});
      zigzag_llama3_attention_forward(comm, t, t, t, torch::tensor({0, 8}, torch::kLong));
    });
  }, "expected packed [T/N, H, D]");

  // The varlen calls on their own: q [4, 1, 32], k, v [6, 1, 32], two segments.
  const torch::Tensor q = torch::zeros({4, 1, 32}), kv = torch::zeros({6, 1, 32});
  auto varlen = [&](std::vector<int64_t> cu_q, std::vector<int64_t> cu_k, torch::Tensor q_pos, torch::Tensor k_pos,
                    torch::Tensor q_in = {}) {
    return [=] {
      varlen_attention_forward(q_in.defined() ? q_in : q, kv, kv, VarlenSegments{cu_q, cu_k, q_pos, k_pos});
    };
  };
  const torch::Tensor q_pos = torch::arange(4), k_pos = torch::arange(6);
  testing::expect_errors({
      {"segment boundaries that go back", varlen({0, 6, 4}, {0, 2, 6}, q_pos, k_pos),
       "segments: boundaries must not decrease; segment 1 is q [6, 4)"},
      {"key boundaries that go back", varlen({0, 2, 4}, {0, 8, 6}, q_pos, k_pos), "segment 1 is q [2, 4), k [8, 6)"},
      {"q_positions of 3 rows", varlen({0, 2, 4}, {0, 3, 6}, torch::arange(3), k_pos),
       "segments.q_positions: expected int64 [4], got [3]"},
      {"k_positions float32", varlen({0, 2, 4}, {0, 3, 6}, q_pos, torch::arange(6, torch::kFloat)),
       "segments.k_positions: expected int64 [6], got [6] float"},
      {"undefined q_positions", varlen({0, 2, 4}, {0, 3, 6}, torch::Tensor(), k_pos), "segments.q_positions"},
      {"a 4-D q", varlen({0, 2, 4}, {0, 3, 6}, q_pos, k_pos, torch::zeros({1, 4, 1, 32})),
       "q: expected a packed [T, H, D] tensor"},
      {"cu_q ending at 5", varlen({0, 2, 5}, {0, 3, 6}, q_pos, k_pos), "segments: cu_q must end at Tq = 4"},
  });
}

CP_TEST(Lesson08, Task3_NoTokensGiveEmptyResults) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    const torch::Tensor t = torch::zeros({4, 2, 32});
    zigzag_llama3_attention_forward(comm, t, t, t, torch::tensor({0, 4}, torch::kLong), Llama3Mode::TwoKernels);
  });
  for_each_world([](Comm& comm) {
    const torch::Tensor q = torch::zeros({0, 4, 32}), kv = torch::zeros({0, 2, 32});
    const torch::Tensor no_documents = torch::zeros({1}, torch::kLong);
    for (Llama3Mode mode : kModes) {
      const Llama3Result f = zigzag_llama3_attention_forward(comm, q, kv, kv, no_documents, mode);
      EXPECT_EQ(f.out.sizes(), q.sizes()) << to_string(mode);
      EXPECT_EQ(f.lse.sizes(), torch::IntArrayRef({4, 0})) << to_string(mode);
      const Llama3Grads g = zigzag_llama3_attention_backward(comm, q, q, kv, kv, f.out, f.lse, no_documents, mode);
      EXPECT_EQ(g.dq.sizes(), q.sizes()) << to_string(mode);
      EXPECT_EQ(g.dk.sizes(), kv.sizes()) << to_string(mode);
      EXPECT_EQ(g.dv.sizes(), kv.sizes()) << to_string(mode);
    }
  });
}

CP_TEST(Lesson08, Task4_BackwardMatchesAttentionPerDocument) {
  for_each_world([](Comm& comm) {
    const int n = comm.size(), r = comm.rank();
    for (const Case& c : kCases) {
      const Batch b = make_batch(c.units, n, c.hq, c.hkv, 82);
      const Expected e = oracle_by_document(b);
      auto mine = [&](const torch::Tensor& t) { return zigzag_varlen_shard(t, b.cu, n, r); };
      std::optional<Llama3Grads> first;
      for (Llama3Mode mode : kModes) {
        const Llama3Result f = zigzag_llama3_attention_forward(comm, mine(b.q), mine(b.k), mine(b.v), b.cu, mode);
        const Llama3Grads g = zigzag_llama3_attention_backward(comm, mine(b.dout), mine(b.q), mine(b.k), mine(b.v),
                                                               f.out, f.lse, b.cu, mode);
        const std::string what = describe(c, mode, r, n);
        CP_EXPECT_CLOSE(g.dq, mine(e.dq), "dq " + what, kPackedDims, testing::gradient_tolerance(torch::kFloat, e.dq));
        CP_EXPECT_CLOSE(g.dk, mine(e.dk), "dk " + what, kPackedDims, testing::gradient_tolerance(torch::kFloat, e.dk));
        CP_EXPECT_CLOSE(g.dv, mine(e.dv), "dv " + what, kPackedDims, testing::gradient_tolerance(torch::kFloat, e.dv));
        EXPECT_EQ(g.dk.scalar_type(), torch::kFloat);
        if (!first) {
          first = g;
        } else {
          // Both modes add the same blocks, possibly in another order: equal up to rounding.
          EXPECT_TRUE(torch::equal(g.dq, first->dq)) << "dq, both modes: " << what;
          EXPECT_TRUE(torch::allclose(g.dk, first->dk, 1e-6, 1e-6)) << "dk, both modes: " << what;
        }
      }
    }
  });
}

CP_TEST(Lesson08, Task4_BackwardCountsTheReduceScatter) {
  for_each_world([](Comm& comm) {
    const int n = comm.size();
    const Batch b = make_batch({2}, n, 2, 1, 83);
    auto mine = [&](const torch::Tensor& t) { return zigzag_varlen_shard(t, b.cu, n, comm.rank()); };
    const Llama3Result f = zigzag_llama3_attention_forward(comm, mine(b.q), mine(b.k), mine(b.v), b.cu);
    const Llama3Stats s = zigzag_llama3_attention_backward(comm, mine(b.dout), mine(b.q), mine(b.k), mine(b.v), f.out,
                                                           f.lse, b.cu).stats;
    const int64_t t_local = b.q.size(0) / n, kv_bytes = t_local * 2 * 1 * 32 * 4;
    EXPECT_EQ(s.bytes_sent, 2 * (n - 1) * kv_bytes) << "all-gather of K/V + reduce-scatter of float32 dK/dV";
    EXPECT_EQ(s.pairs, f.stats.pairs) << "the backward computes the blocks of the forward";
  });
}

CP_TEST(Lesson08Cuda, Task4_ForwardAndBackwardOnCuda) {
  CP_REQUIRE_GPU();
  for_each_world([](Comm& comm) {
    const int n = comm.size(), r = comm.rank();
    const Batch b = make_batch({2, 5}, n, 4, 1, 84, 64);
    const Expected e = oracle_by_document(b);
    auto mine = [&](const torch::Tensor& t) { return zigzag_varlen_shard(t, b.cu, n, r); };
    for (Llama3Mode mode : kModes) {
      const Llama3Result f =
          zigzag_llama3_attention_forward(comm, mine(b.q).cuda(), mine(b.k).cuda(), mine(b.v).cuda(), b.cu, mode);
      const Llama3Grads g = zigzag_llama3_attention_backward(comm, mine(b.dout).cuda(), mine(b.q).cuda(),
                                                             mine(b.k).cuda(), mine(b.v).cuda(), f.out, f.lse, b.cu, mode);
      const std::string what = to_string(mode) + " cuda, rank " + std::to_string(r);
      CP_EXPECT_CLOSE(f.out, mine(e.out), "out " + what, kPackedDims);
      CP_EXPECT_CLOSE(f.lse, mine(e.lse.t()).t(), "lse " + what, {"h", "t"});
      CP_EXPECT_CLOSE(g.dk, mine(e.dk), "dk " + what, kPackedDims, testing::gradient_tolerance(torch::kFloat, e.dk));
      CP_EXPECT_CLOSE(g.dv, mine(e.dv), "dv " + what, kPackedDims, testing::gradient_tolerance(torch::kFloat, e.dv));
      CP_EXPECT_CLOSE(g.dq, mine(e.dq), "dq " + what, kPackedDims, testing::gradient_tolerance(torch::kFloat, e.dq));
    }
  });
}

}  // namespace
}  // namespace cp
