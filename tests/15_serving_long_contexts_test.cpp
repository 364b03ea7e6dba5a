// Lesson 15 — serving long contexts: the prefills and decode against float64 attention over the
// whole sequence on one device, the cache's contents and every byte sent, on local worlds of 1,
// 2, 3, 4 and 8 ranks and under mpirun.
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/error.h"
#include "common/trace.h"
#include "common/world.h"
#include "serving.h"
#include "testing/counting_comm.h"
#include "testing/harness.h"
#include "testing/oracle.h"

namespace cp {
namespace {

using testing::CountingComm;
using testing::expect_error;
using testing::for_each_world;
using testing::oracle_attention;

const std::vector<std::string> kDims = {"b", "h", "s", "d"};

std::string where(const Comm& comm) { return "rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()); }

/// A whole sequence [1, H, L, D] in float64 (the same on every rank: fixed seed).
struct Sequence {
  torch::Tensor q, k, v;
};

Sequence make_sequence(int64_t length, int64_t heads_q, int64_t heads_kv, int64_t head_dim, uint64_t seed) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  return {torch::randn({1, heads_q, length, head_dim}, gen, f64), torch::randn({1, heads_kv, length, head_dim}, gen, f64),
          torch::randn({1, heads_kv, length, head_dim}, gen, f64)};
}

/// The tokens of the sequence at `positions` (dim 2), in float32.
torch::Tensor at_positions(const torch::Tensor& t, const torch::Tensor& positions) {
  return t.index_select(2, positions).to(torch::kFloat);
}

/// The test's own layout of a prefill's new tokens (the definition, token by token): token i of
/// T lies in part ⌊…⌋ of 2N nearly equal parts; rank r owns parts r and 2N − 1 − r.
torch::Tensor reference_prefill_positions(int64_t first, int64_t count, int world, int rank) {
  std::vector<int64_t> mine;
  const int64_t parts = 2 * world;
  for (int64_t i = 0; i < count; ++i) {
    int64_t part = 0;
    while ((part + 1) * count / parts <= i) ++part;
    if (part == rank || part == parts - 1 - rank) mine.push_back(first + i);
  }
  return torch::tensor(mine, torch::kLong);
}

/// An int64 vector on one line, "[0, 4, 8, … (37 in all)]": a failure message stays short.
std::string positions_text(const torch::Tensor& positions) {
  const torch::Tensor p = positions.cpu().contiguous();
  std::string text = "[";
  for (int64_t i = 0; i < std::min<int64_t>(p.numel(), 8); ++i)
    text += (i ? ", " : "") + std::to_string(p[i].item<int64_t>());
  if (p.numel() > 8) text += ", … (" + std::to_string(p.numel()) + " in all)";
  return text + "]";
}

/// Positions rank r of N holds of the first `length` tokens when each went to rank t mod N.
torch::Tensor held_round_robin(int64_t length, int world, int rank) {
  return torch::arange(rank, std::max<int64_t>(length, rank), world, torch::kLong);
}

/// A cache that grew one token at a time (decode): token t on rank t mod N.
KvCacheShard round_robin_cache(const Sequence& seq, int64_t cached, const Comm& comm) {
  const torch::Tensor positions = held_round_robin(cached, comm.size(), comm.rank());
  return {at_positions(seq.k, positions), at_positions(seq.v, positions), positions};
}

// ── Task 1 ──────────────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson15, Task1_PrefillPositionsSplitTheNewTokensEvenly) {
  for (int world : {1, 2, 3, 4, 8}) {
    for (int64_t count : {0, 1, 5, 16, 37, 64}) {
      for (int64_t first : {0, 7}) {
        std::vector<torch::Tensor> all;
        for (int r = 0; r < world; ++r) {
          const torch::Tensor mine = prefill_positions(first, count, world, r);
          const std::string at = "first " + std::to_string(first) + ", count " + std::to_string(count) + ", rank " +
                                 std::to_string(r) + " of " + std::to_string(world);
          EXPECT_TRUE(torch::equal(mine, reference_prefill_positions(first, count, world, r)))
              << at << ": got " << positions_text(mine) << ", expected "
              << positions_text(reference_prefill_positions(first, count, world, r));
          all.push_back(mine);
        }
        EXPECT_TRUE(torch::equal(std::get<0>(torch::cat(all).sort()), torch::arange(first, first + count)))
            << "every new token on exactly one rank: first " << first << ", count " << count << ", N " << world;
      }
    }
  }
  // T = 10 over N = 2: parts of 2, 3, 2, 3 tokens; rank 1 holds parts 1 and 2.
  EXPECT_TRUE(torch::equal(prefill_positions(100, 10, 2, 1), torch::tensor({102, 103, 104, 105, 106}, torch::kLong)));
}

CP_TEST(Lesson15, Task1_DecodeGrowsEveryShardInTurn) {
  for (int world : {1, 2, 3, 4, 8}) {
    std::vector<int64_t> held(world, 0);
    for (int64_t t = 0; t < 50; ++t) {
      const int owner = decode_owner(t, world);
      ASSERT_TRUE(owner >= 0 && owner < world) << "position " << t << ", N " << world;
      ++held[owner];
      const auto [least, most] = std::minmax_element(held.begin(), held.end());
      EXPECT_LE(*most - *least, 1) << "after position " << t << " on " << world << " ranks: shards differ by more than one";
    }
  }
  EXPECT_EQ(decode_owner(13, 4), 1) << "position 13 of a sequence decoded round robin on 4 ranks from rank 0";
}

CP_TEST(Lesson15, Task1_BadInputGivesClearErrors) {
  prefill_positions(0, 8, 2, 0);  // counts once implemented
  testing::expect_errors({
      {"count -1", [] { prefill_positions(0, -1, 2, 0); }, "first and count must not be negative, got 0 and -1"},
      {"rank 2 of 2", [] { prefill_positions(0, 8, 2, 2); }, "rank 2 is not in a world of 2"},
      {"world 0", [] { prefill_positions(0, 8, 0, 0); }, "world must be at least 1, got 0"},
      {"position -3", [] { decode_owner(-3, 4); }, "position must not be negative, got -3"},
  });
}

// ── Tasks 2 and 3: the prefills ─────────────────────────────────────────────────────────────

struct PrefillCaseT {
  int64_t cached, fresh, heads_q, heads_kv;
  double scale;  ///< 0: the default, 1/√D
};

/// Hit rates 0, a few tokens, 50% and 99%; lengths that do not divide N or 2N; GQA; a scale of
/// the caller's; 3 new tokens and nothing cached (from N = 4 on, a rank holds no token at all).
const std::vector<PrefillCaseT> kPrefills = {
    {0, 37, 4, 2, 0}, {3, 29, 4, 4, 0}, {40, 40, 4, 1, 0.3}, {693, 7, 4, 2, 0}, {0, 3, 4, 2, 0}};

using Prefill = PrefillResult (*)(Comm&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                  const torch::Tensor&, KvCacheShard&, std::optional<double>, Trace*);

void expect_prefill_matches_one_device(Comm& world, Prefill prefill, PrefillVariant variant) {
  const int64_t d = 8;
  for (const PrefillCaseT& c : kPrefills) {
    const int64_t length = c.cached + c.fresh;
    const Sequence seq = make_sequence(length, c.heads_q, c.heads_kv, d, 1500 + length);
    const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(d));
    const auto [out, lse] = oracle_attention(seq.q, seq.k, seq.v, true, torch::arange(length), torch::arange(length),
                                             scale);
    const torch::Tensor mine = reference_prefill_positions(c.cached, c.fresh, world.size(), world.rank());
    KvCacheShard cache = round_robin_cache(seq, c.cached, world);
    const torch::Tensor cached_before = cache.positions.clone();
    CountingComm comm(world);
    const std::optional<double> scale_arg = c.scale > 0 ? std::optional<double>(c.scale) : std::nullopt;
    const PrefillResult r = prefill(comm, at_positions(seq.q, mine), at_positions(seq.k, mine),
                                    at_positions(seq.v, mine), mine, cache, scale_arg, nullptr);
    const std::string at = to_string(variant) + ", P = " + std::to_string(c.cached) + ", T = " +
                           std::to_string(c.fresh) + ", Hq/Hkv " + std::to_string(c.heads_q) + "/" +
                           std::to_string(c.heads_kv) + (c.scale > 0 ? ", scale " + std::to_string(c.scale) : "") +
                           ", " + where(world);
    CP_EXPECT_CLOSE(r.out, out.index_select(2, mine), "out, " + at, kDims);
    CP_EXPECT_CLOSE(r.lse, lse.index_select(2, mine), "lse, " + at, {"b", "h", "s"});
    // The new K/V stay with the rank that computed them, after what it cached before.
    EXPECT_TRUE(torch::equal(cache.positions, torch::cat({cached_before, mine})))
        << at << ": the cache's positions are " << positions_text(cache.positions) << ", expected the ones cached "
        << "before, then the new ones this rank computed: " << positions_text(torch::cat({cached_before, mine}));
    EXPECT_TRUE(torch::equal(cache.k, at_positions(seq.k, cache.positions))) << at << ": the cache's keys";
    EXPECT_TRUE(torch::equal(cache.v, at_positions(seq.v, cache.positions))) << at << ": the cache's values";
    std::vector<int64_t> cached, fresh;
    for (int j = 0; j < world.size(); ++j) {
      cached.push_back(held_round_robin(c.cached, world.size(), j).numel());
      fresh.push_back(reference_prefill_positions(c.cached, c.fresh, world.size(), j).numel());
    }
    const int64_t formula = prefill_bytes(variant, cached, fresh, world.rank(), c.heads_q, c.heads_kv, d, 4);
    EXPECT_EQ(comm.bytes_sent(), formula) << at << ": bytes this rank sent, counted by the test's Comm, against "
                                          << "prefill_bytes";
    EXPECT_EQ(r.bytes_sent, formula) << at << ": bytes_sent, as the code reports it";
  }
}

/// Each ring step but the last computes while the next block travels: the step's "compute" span
/// (recorded by the code) lies inside a span from start() to the end of wait() of an exchange
/// (recorded by the test's Comm).
void expect_steps_overlap_their_transfers(Comm& world, Prefill prefill, PrefillVariant variant) {
  const int64_t d = 8, cached = 40, fresh = 24;
  const Sequence seq = make_sequence(cached + fresh, 4, 2, d, 1505);
  const torch::Tensor mine = reference_prefill_positions(cached, fresh, world.size(), world.rank());
  KvCacheShard cache = round_robin_cache(seq, cached, world);
  Trace trace;
  CountingComm comm(world, &trace);
  prefill(comm, at_positions(seq.q, mine), at_positions(seq.k, mine), at_positions(seq.v, mine), mine, cache,
          std::nullopt, &trace);
  std::vector<Trace::Span> computes, transfers;
  for (const Trace::Span& span : trace.spans()) (span.lane == "compute" ? computes : transfers).push_back(span);
  const std::string at = to_string(variant) + ", " + where(world);
  ASSERT_EQ(static_cast<int>(computes.size()), world.size())
      << at << ": expected one span on lane \"compute\" per ring step (TraceSpan around each step's attention)";
  std::sort(computes.begin(), computes.end(), [](const auto& a, const auto& b) { return a.start_ns < b.start_ns; });
  for (int step = 0; step + 1 < world.size(); ++step) {
    const Trace::Span& c = computes[step];
    const bool inside = std::any_of(transfers.begin(), transfers.end(), [&](const Trace::Span& t) {
      return t.start_ns <= c.start_ns && c.start_ns + c.duration_ns <= t.start_ns + t.duration_ns;
    });
    EXPECT_TRUE(inside) << at << ": step " << step << " computed while no exchange was in flight (started and not "
                        << "yet waited for): was the next block's exchange started before this step's attention, "
                        << "and waited for after it?";
  }
}

CP_TEST(Lesson15, Task2_PassKvMatchesOneDevice) {
  for_each_world([](Comm& comm) { expect_prefill_matches_one_device(comm, pass_kv_prefill, PrefillVariant::PassKV); });
}

CP_TEST(Lesson15, Task2_PassKvComputesWhileTheNextBlockTravels) {
  for_each_world(
      [](Comm& comm) { expect_steps_overlap_their_transfers(comm, pass_kv_prefill, PrefillVariant::PassKV); });
}

CP_TEST(Lesson15, Task3_PassQMatchesOneDevice) {
  for_each_world([](Comm& comm) { expect_prefill_matches_one_device(comm, pass_q_prefill, PrefillVariant::PassQ); });
}

CP_TEST(Lesson15, Task3_PassQComputesWhileTheNextQueriesTravel) {
  for_each_world([](Comm& comm) { expect_steps_overlap_their_transfers(comm, pass_q_prefill, PrefillVariant::PassQ); });
}

CP_TEST(Lesson15, Task3_PassQGivesTheSameBitsOnEveryRun) {
  // The owner merges its N partials in an order the ranks fix, not in the order they arrive.
  for_each_world([](Comm& comm) {
    const int64_t d = 8, cached = 30, fresh = 50;
    const Sequence seq = make_sequence(cached + fresh, 4, 2, d, 1510);
    const torch::Tensor mine = reference_prefill_positions(cached, fresh, comm.size(), comm.rank());
    std::vector<PrefillResult> runs;
    for (int run = 0; run < 3; ++run) {
      KvCacheShard cache = round_robin_cache(seq, cached, comm);
      runs.push_back(pass_q_prefill(comm, at_positions(seq.q, mine), at_positions(seq.k, mine),
                                    at_positions(seq.v, mine), mine, cache));
    }
    for (int run = 1; run < 3; ++run)
      EXPECT_TRUE(torch::equal(runs[run].out, runs[0].out) && torch::equal(runs[run].lse, runs[0].lse))
          << where(comm) << ": run " << run << " gave other bits than run 0 on the same inputs";
  });
}

/// A prompt in two prefills by `prefill`, in float64: the second finds the first's K/V in the cache;
/// its result is the one-device float64 attention's, to float64's tolerance.
void expect_chunked_prefill_in_float64(Comm& comm, Prefill prefill) {
  const int64_t first = 21, second = 19, d = 8;
  const Sequence seq = make_sequence(first + second, 4, 2, d, 1515);
  const auto [out, lse] = oracle_attention(seq.q, seq.k, seq.v, true, torch::arange(first + second),
                                           torch::arange(first + second), 1.0 / std::sqrt(static_cast<double>(d)));
  KvCacheShard cache = empty_cache_shard(2, d, torch::kDouble);
  const torch::Tensor a = reference_prefill_positions(0, first, comm.size(), comm.rank());
  const torch::Tensor b = reference_prefill_positions(first, second, comm.size(), comm.rank());
  auto pick = [](const torch::Tensor& t, const torch::Tensor& pos) { return t.index_select(2, pos); };
  const PrefillResult r1 =
      prefill(comm, pick(seq.q, a), pick(seq.k, a), pick(seq.v, a), a, cache, std::nullopt, nullptr);
  CP_EXPECT_CLOSE(r1.out, pick(out, a), "out of the first prefill, " + where(comm), kDims);
  const PrefillResult r2 =
      prefill(comm, pick(seq.q, b), pick(seq.k, b), pick(seq.v, b), b, cache, std::nullopt, nullptr);
  CP_EXPECT_CLOSE(r2.out, pick(out, b), "out of the second prefill, " + where(comm), kDims);
  CP_EXPECT_CLOSE(r2.lse, pick(lse, b), "lse of the second prefill, " + where(comm), {"b", "h", "s"});
  EXPECT_EQ(r2.out.scalar_type(), torch::kDouble) << "out keeps q's dtype";
}

CP_TEST(Lesson15, Task2_PassKvInFloat64OverAnEarlierPrefillsCache) {
  for_each_world([](Comm& comm) { expect_chunked_prefill_in_float64(comm, pass_kv_prefill); });
}

CP_TEST(Lesson15, Task3_PassQInFloat64OverAnEarlierPrefillsCache) {
  for_each_world([](Comm& comm) { expect_chunked_prefill_in_float64(comm, pass_q_prefill); });
}

CP_TEST(Lesson15, Task2_BadInputIsAnErrorOnEveryRank) {
  for_each_world([](Comm& comm) {
    const int64_t d = 8;
    const Sequence seq = make_sequence(24, 4, 2, d, 1520);
    const torch::Tensor mine = reference_prefill_positions(8, 16, comm.size(), comm.rank());
    auto fresh = [&](const torch::Tensor& t) { return at_positions(t, mine); };
    auto run = [&](KvCacheShard cache, torch::Tensor positions) {
      pass_kv_prefill(comm, fresh(seq.q), fresh(seq.k), fresh(seq.v), positions, cache);
    };
    run(round_robin_cache(seq, 8, comm), mine);  // counts once implemented
    const bool last = comm.rank() == comm.size() - 1;
    KvCacheShard short_positions = round_robin_cache(seq, 8, comm);
    if (last) short_positions.positions = short_positions.positions.narrow(0, 0, short_positions.positions.size(0) - 1);
    expect_error([&] { run(short_positions, mine); }, "cache.positions: expected int64");
    KvCacheShard late = round_robin_cache(seq, 8, comm);
    if (last) late.positions = late.positions + 100;
    expect_error([&] { run(late, mine); }, "every new token must come after every cached one");
    // A second prefill whose first position is the cache's last (off by one).
    expect_error([&] { run(round_robin_cache(seq, 8, comm), mine - 1); },
                 "every new token must come after every cached one; a cache holds position 7, a new token is at 7");
    // The cache of a world one rank larger that lost its rank 0.
    const torch::Tensor other_world = held_round_robin(8, comm.size() + 1, comm.rank() + 1);
    expect_error([&] { run({at_positions(seq.k, other_world), at_positions(seq.v, other_world), other_world}, mine); },
                 "cache: the ranks' shards hold");
    KvCacheShard wrong_heads = round_robin_cache(seq, 8, comm);
    if (last) wrong_heads.k = wrong_heads.k.repeat({1, 2, 1, 1}), wrong_heads.v = wrong_heads.v.repeat({1, 2, 1, 1});
    expect_error([&] { run(wrong_heads, mine); }, "cache.k: expected k's heads");
    expect_error([&] { run(round_robin_cache(seq, 8, comm), last ? mine.narrow(0, 0, 0) : mine); },
                 "positions: expected int64");
    expect_error(
        [&] {
          KvCacheShard cache = round_robin_cache(seq, 8, comm);
          pass_q_prefill(comm, fresh(seq.q), fresh(seq.k), fresh(seq.v).to(torch::kDouble), mine, cache);
        },
        "v: expected q's dtype");
  });
}

// ── Task 4 ──────────────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson15, Task4_PassQWinsAtHighHitRatesAndPassKvOnLongNewPrompts) {
  const Cluster& h100 = cluster_preset("h100x8");
  // Llama-3.1-70B's attention (64 query heads, 8 K/V heads) on 8 GPUs.
  auto plan = [&](int64_t fresh, int64_t cached) {
    return choose_prefill({fresh, cached, 64, 8, 128, 2, 8}, h100);
  };
  const PrefillChoice full = plan(131072, 0);
  EXPECT_EQ(full.choice, PrefillVariant::PassKV) << "a whole 128k prompt: " << full.reason;
  const PrefillChoice follow_up = plan(256, 130816);
  EXPECT_EQ(follow_up.choice, PrefillVariant::PassQ) << "256 new tokens after 128k cached: " << follow_up.reason;
  for (const PrefillChoice& c : {full, follow_up}) {
    EXPECT_GT(c.pass_kv_ms, 0);
    EXPECT_GT(c.pass_q_ms, 0);
    EXPECT_TRUE(c.reason.find(to_string(c.choice)) != std::string::npos)
        << "the reason should name the choice, " << to_string(c.choice) << "; it says: " << c.reason;
  }
  // One GPU: nothing travels, both are the compute alone.
  const PrefillChoice alone = choose_prefill({4096, 4096, 64, 8, 128, 2, 1}, h100);
  EXPECT_DOUBLE_EQ(alone.pass_kv_ms, alone.pass_q_ms);
  EXPECT_EQ(alone.choice, PrefillVariant::PassKV) << "a tie goes to pass-KV";
  // Compute-bound: 16 times the new tokens, at least 16 times the time.
  EXPECT_GT(plan(131072, 0).pass_kv_ms, 16 * plan(8192, 0).pass_kv_ms);
}

CP_TEST(Lesson15, Task4_TimesFollowTheStepModelExactly) {
  // A made-up cluster slow enough for round numbers: 1e-8 TFLOP/s without a mask (10 FLOPs a
  // millisecond) and half that for a causal call over 8 tokens (lesson 14's rule with
  // causal_tokens = 8), 1e-6 GB/s (a byte a millisecond) and 1 ms of latency a message.
  // T = 8 new tokens after P = 16 cached, N = 4, Hq 2, Hkv 1, D 4, 2-byte elements.
  Cluster slow = cluster_preset("h100x8");
  slow.forward_tflops = 1e-8;
  slow.forward_causal_tflops = 0.5e-8;
  slow.causal_tokens = 8;
  slow.intra = {1e-6, 1000};
  const PrefillChoice c = choose_prefill({8, 16, 2, 1, 4, 2, 4}, slow);
  EXPECT_NEAR(c.pass_kv_ms, 473.4, 1e-6) << "pass-KV: " << c.reason;
  EXPECT_NEAR(c.pass_q_ms, 330.4, 1e-6)
      << "pass-Q: " << c.reason << " (the step model is in the README, Task 4; 2 ms more would be the return of "
      << "the partials paying the latency once per owner instead of once for the batch)";
  EXPECT_EQ(c.choice, PrefillVariant::PassQ) << c.reason;
  // Without the causal rule (the causal rate as fast as the unmasked one), the compute is shorter.
  slow.forward_causal_tflops = slow.forward_tflops;
  const PrefillChoice unmasked_rate = choose_prefill({8, 16, 2, 1, 4, 2, 4}, slow);
  EXPECT_NEAR(unmasked_rate.pass_kv_ms, 3 * 145 + 32, 1e-6)
      << "pass-KV when the causal call runs at the unmasked rate: " << unmasked_rate.reason;
}

CP_TEST(Lesson15, Task4_BadInputGivesClearErrors) {
  const Cluster& h100 = cluster_preset("h100x8");
  choose_prefill({1024, 0, 8, 8, 64, 2, 2}, h100);  // counts once implemented
  testing::expect_errors({
      {"Hkv 3 of Hq 8", [&] { choose_prefill({1024, 0, 8, 3, 64, 2, 2}, h100); }, "Hkv dividing Hq"},
      {"world 0", [&] { choose_prefill({1024, 0, 8, 8, 64, 2, 0}, h100); }, "N = 0"},
  });
}

// ── Task 5: decode ──────────────────────────────────────────────────────────────────────────

/// The K/V a shard holds equal the sequence's at the positions it holds, token for token; the
/// tokens at `negated` positions were appended as −k, −v.
void expect_cache_holds(const KvCacheShard& shard, const Sequence& seq, const torch::Tensor& negated,
                        const std::string& what) {
  const torch::Tensor sign = 1 - 2 * torch::isin(shard.positions, negated).to(torch::kFloat).view({1, 1, -1, 1});
  EXPECT_TRUE(torch::equal(shard.k, at_positions(seq.k, shard.positions) * sign)) << what << ": the cache's k";
  EXPECT_TRUE(torch::equal(shard.v, at_positions(seq.v, shard.positions) * sign)) << what << ": the cache's v";
}

/// B sequences of different lengths, one shorter than most worlds (a rank with nothing of it),
/// one longer than a block of keys on every rank, decoded for several steps with `merge`: each
/// step against one device, the same on every rank. At step 1 a copy of the caches (a fork of the
/// batch) takes other tokens: the two must not see each other's.
void expect_decode_matches_one_device(Comm& comm, DecodeMerge merge, std::optional<double> scale) {
  const int64_t heads_q = 4, heads_kv = 2, d = 8, steps = 4;
  const std::vector<int64_t> lengths = {1, 6, 23, 300};  // before the first step
  const int64_t batch = static_cast<int64_t>(lengths.size());
  std::vector<Sequence> seqs;
  std::vector<KvCacheShard> caches;
  for (int64_t b = 0; b < batch; ++b) {
    seqs.push_back(make_sequence(lengths[b] + steps, heads_q, heads_kv, d, 1530 + b));
    caches.push_back(round_robin_cache(seqs[b], lengths[b], comm));
  }
  std::vector<KvCacheShard> fork;
  std::vector<int64_t> fork_tokens;
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<torch::Tensor> q, k, v, out_expected, lse_expected;
    std::vector<int64_t> at;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t pos = lengths[b] + step, len = pos + 1;
      at.push_back(pos);
      const torch::Tensor here = torch::tensor({pos}, torch::kLong);
      q.push_back(at_positions(seqs[b].q, here));
      k.push_back(at_positions(seqs[b].k, here));
      v.push_back(at_positions(seqs[b].v, here));
      const auto [o, l] = oracle_attention(seqs[b].q.narrow(2, pos, 1), seqs[b].k.narrow(2, 0, len),
                                           seqs[b].v.narrow(2, 0, len), true, here, torch::arange(len),
                                           scale.value_or(1.0 / std::sqrt(static_cast<double>(d))));
      out_expected.push_back(o);
      lse_expected.push_back(l);
    }
    CountingComm counted(comm);
    const DecodeResult r =
        decode_step(counted, torch::cat(q), torch::cat(k), torch::cat(v), torch::tensor(at), caches, merge, scale);
    const std::string what = to_string(merge) + ", step " + std::to_string(step) + ", " + where(comm) +
                             (scale ? ", scale " + std::to_string(*scale) : "");
    CP_EXPECT_CLOSE(r.out, torch::cat(out_expected), "out, " + what, kDims);
    CP_EXPECT_CLOSE(r.lse, torch::cat(lse_expected), "lse, " + what, {"b", "h", "s"});
    // Every rank returns the very same bits: the next token must not depend on the rank.
    const torch::Tensor all_out = comm.all_gather(r.out.unsqueeze(0));
    const torch::Tensor all_lse = comm.all_gather(r.lse.unsqueeze(0));
    EXPECT_TRUE(torch::equal(all_out[0], r.out) && torch::equal(all_lse[0], r.lse))
        << what << ": out and lse differ from rank 0's";
    const DecodeVolume volume = decode_bytes(merge, comm.size(), comm.rank(), batch, heads_q, d, 4);
    EXPECT_EQ(counted.bytes_sent(), volume.bytes) << what << ": bytes this rank sent, counted by the test's Comm, "
                                                  << "against decode_bytes";
    EXPECT_EQ(r.bytes_sent, volume.bytes) << what << ": bytes_sent, as the code reports it";
    EXPECT_EQ(r.rounds, volume.rounds) << what << ": rounds";
    // The new token sits in the shard of its owner, and only there.
    for (int64_t b = 0; b < batch; ++b) {
      const torch::Tensor held = held_round_robin(at[b] + 1, comm.size(), comm.rank());
      EXPECT_TRUE(torch::equal(caches[b].positions, held))
          << what << ", sequence " << b << ": the cache's positions are " << positions_text(caches[b].positions)
          << ", expected " << positions_text(held)
          << " (each decoded token in the shard of decode_owner, and only there)";
      expect_cache_holds(caches[b], seqs[b], torch::empty({0}, torch::kLong), what + ", sequence " + std::to_string(b));
    }
    if (step == 1) {  // the fork takes the next positions' tokens negated; the batch takes them next step
      fork = caches;
      std::vector<torch::Tensor> q_next, k_next, v_next;
      for (int64_t b = 0; b < batch; ++b) {
        fork_tokens.push_back(at[b] + 1);
        const torch::Tensor there = torch::tensor({at[b] + 1}, torch::kLong);
        q_next.push_back(at_positions(seqs[b].q, there));
        k_next.push_back(-at_positions(seqs[b].k, there));
        v_next.push_back(-at_positions(seqs[b].v, there));
      }
      decode_step(comm, torch::cat(q_next), torch::cat(k_next), torch::cat(v_next), torch::tensor(fork_tokens), fork,
                  merge, scale);
    }
  }
  for (int64_t b = 0; b < batch; ++b)
    expect_cache_holds(fork[b], seqs[b], torch::tensor({fork_tokens[b]}),
                       "the fork of step 1, sequence " + std::to_string(b) + ", " + where(comm));
}

CP_TEST(Lesson15, Task5_DecodeByGatherMatchesOneDevice) {
  for_each_world([](Comm& comm) { expect_decode_matches_one_device(comm, DecodeMerge::Gather, std::nullopt); });
}

CP_TEST(Lesson15, Task5_DecodeByTreeMatchesOneDevice) {
  for_each_world([](Comm& comm) { expect_decode_matches_one_device(comm, DecodeMerge::Tree, 0.4); });
}

CP_TEST(Lesson15, Task5_TreeOnWorldsThatAreNotPowersOfTwo) {
  // 5, 6 and 7 ranks: a tree of ⌊log₂ N⌋ levels leaves a rank out, one of ⌈log₂ N⌉ does not.
  for (int world : {5, 6, 7})
    run_local_world(world, [](Comm& comm) { expect_decode_matches_one_device(comm, DecodeMerge::Tree, std::nullopt); });
}

CP_TEST(Lesson15, Task5_DecodeAppendsToTheCacheInPlace) {
  // A step appends one token: the shard's buffers stay where they are (cache_append's room) once
  // the first append has given them room, instead of being copied whole every step.
  for_each_world([](Comm& comm) {
    const int64_t d = 8, cached = 20, steps = 12;
    const Sequence seq = make_sequence(cached + steps, 4, 2, d, 1535);
    std::vector<KvCacheShard> caches = {round_robin_cache(seq, cached, comm)};
    const void* k_data = nullptr;
    const void* v_data = nullptr;
    for (int64_t step = 0; step < steps; ++step) {
      const torch::Tensor here = torch::tensor({cached + step}, torch::kLong);
      const int64_t held_before = caches[0].positions.numel();
      decode_step(comm, at_positions(seq.q, here), at_positions(seq.k, here), at_positions(seq.v, here), here, caches,
                  DecodeMerge::Gather);
      if (caches[0].positions.numel() == held_before) continue;  // another rank's token
      if (k_data)
        EXPECT_TRUE(caches[0].k.data_ptr() == k_data && caches[0].v.data_ptr() == v_data)
            << where(comm) << ", step " << step << ": the shard's k or v moved to a new buffer for one more token "
            << "(was the shard copied whole, torch::cat, instead of appended with cache_append?)";
      k_data = caches[0].k.data_ptr();
      v_data = caches[0].v.data_ptr();
    }
  });
}

CP_TEST(Lesson15, Task5_PrefillThenDecodeThenPrefillOnOneCache) {
  // A conversation: a prompt (pass-KV), three tokens decoded, a follow-up (pass-Q), three more
  // tokens, each against one device over everything before it.
  for_each_world([](Comm& comm) {
    const int64_t d = 8, prompt = 30, follow_up = 11, decoded = 3;
    const int64_t length = prompt + decoded + follow_up + decoded;
    const Sequence seq = make_sequence(length, 4, 2, d, 1545);
    const auto [out, lse] = oracle_attention(seq.q, seq.k, seq.v, true, torch::arange(length), torch::arange(length),
                                             1.0 / std::sqrt(static_cast<double>(d)));
    KvCacheShard cache = empty_cache_shard(2, d, torch::kFloat);
    int64_t next = 0;
    auto prefill = [&](int64_t count, Prefill variant, const std::string& name) {
      const torch::Tensor mine = reference_prefill_positions(next, count, comm.size(), comm.rank());
      const PrefillResult r = variant(comm, at_positions(seq.q, mine), at_positions(seq.k, mine),
                                      at_positions(seq.v, mine), mine, cache, std::nullopt, nullptr);
      CP_EXPECT_CLOSE(r.out, out.index_select(2, mine), "out of " + name + ", " + where(comm), kDims);
      next += count;
    };
    auto decode = [&](const std::string& name) {
      std::vector<KvCacheShard> caches = {cache};
      cache = KvCacheShard{};  // the step's shard is the only one
      for (int64_t i = 0; i < decoded; ++i, ++next) {
        const torch::Tensor here = torch::tensor({next}, torch::kLong);
        const DecodeResult r = decode_step(comm, at_positions(seq.q, here), at_positions(seq.k, here),
                                           at_positions(seq.v, here), here, caches, DecodeMerge::Tree);
        CP_EXPECT_CLOSE(r.out, out.narrow(2, next, 1), name + " token " + std::to_string(next) + ", " + where(comm),
                        kDims);
      }
      cache = caches[0];
    };
    prefill(prompt, pass_kv_prefill, "the prompt (pass-KV)");
    decode("decode after the prompt,");
    prefill(follow_up, pass_q_prefill, "the follow-up (pass-Q)");
    decode("decode after the follow-up,");
  });
}

CP_TEST(Lesson15, Task5_BadInputIsAnErrorOnEveryRank) {
  for_each_world([](Comm& comm) {
    const int64_t d = 8;
    const Sequence seq = make_sequence(10, 4, 2, d, 1540);
    const torch::Tensor here = torch::tensor({9}, torch::kLong);
    std::vector<KvCacheShard> caches = {round_robin_cache(seq, 9, comm)};
    auto step = [&](std::vector<KvCacheShard> c, const torch::Tensor& positions) {
      decode_step(comm, at_positions(seq.q, here), at_positions(seq.k, here), at_positions(seq.v, here), positions, c,
                  DecodeMerge::Tree);
    };
    step(caches, here);  // counts once implemented
    const bool last = comm.rank() == comm.size() - 1;
    expect_error([&] { step(last ? std::vector<KvCacheShard>{} : caches, here); }, "caches: expected one shard per sequence");
    expect_error([&] { step(caches, torch::tensor({3}, torch::kLong)); }, "at or after the new token's 3");
    expect_error([&] { step(caches, torch::tensor({9, 10}, torch::kLong)); }, "positions: expected int64 [1]");
    // The cache of a world one rank larger that lost its rank 0.
    const torch::Tensor other_world = held_round_robin(9, comm.size() + 1, comm.rank() + 1);
    expect_error([&] { step({{at_positions(seq.k, other_world), at_positions(seq.v, other_world), other_world}}, here); },
                 "caches[0]: the ranks' shards hold");
    if (comm.size() > 1)
      expect_error([&] { step(caches, torch::tensor({last ? 10 : 9}, torch::kLong)); },
                   "positions: every rank decodes the same batch");
  });
}

// ── CUDA tensors ────────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson15Cuda, PrefillsAndDecodeMatchOneDeviceOnCuda) {
  CP_REQUIRE_GPU();
  for_each_world([](Comm& comm) {
    const int64_t d = 64, cached = 50, fresh = 30;
    // The GPU computes on bfloat16 inputs: the oracle takes the same rounded values.
    Sequence seq = make_sequence(cached + fresh, 4, 2, d, 1550);
    for (torch::Tensor* t : {&seq.q, &seq.k, &seq.v}) *t = t->to(torch::kBFloat16).to(torch::kDouble);
    const torch::Tensor v16 = seq.v.to(torch::kBFloat16);  // for the merged tolerance
    const auto [out, lse] = oracle_attention(seq.q, seq.k, seq.v, true, torch::arange(cached + fresh),
                                             torch::arange(cached + fresh), 1.0 / std::sqrt(static_cast<double>(d)));
    const torch::Tensor mine = reference_prefill_positions(cached, fresh, comm.size(), comm.rank());
    auto cuda = [&](const torch::Tensor& t) { return at_positions(t, mine).to(torch::kCUDA, torch::kBFloat16); };
    for (PrefillVariant variant : {PrefillVariant::PassKV, PrefillVariant::PassQ}) {
      KvCacheShard host = round_robin_cache(seq, cached, comm);
      KvCacheShard cache{host.k.to(torch::kCUDA, torch::kBFloat16), host.v.to(torch::kCUDA, torch::kBFloat16),
                         host.positions.to(torch::kCUDA)};
      const torch::Tensor pos = mine.to(torch::kCUDA);
      const PrefillResult r = variant == PrefillVariant::PassKV
                                  ? pass_kv_prefill(comm, cuda(seq.q), cuda(seq.k), cuda(seq.v), pos, cache)
                                  : pass_q_prefill(comm, cuda(seq.q), cuda(seq.k), cuda(seq.v), pos, cache);
      CP_EXPECT_CLOSE(r.out.cpu(), out.index_select(2, mine), to_string(variant) + " out, " + where(comm), kDims,
                      testing::merged_tolerance(v16));
      CP_EXPECT_CLOSE(r.lse.cpu(), lse.index_select(2, mine), to_string(variant) + " lse, " + where(comm),
                      {"b", "h", "s"});
    }
    // Decode of the last token over the cache of the others, sharded round robin, on the GPU.
    const int64_t last = cached + fresh - 1;
    const torch::Tensor here = torch::tensor({last}, torch::kLong);
    auto gpu = [](const torch::Tensor& t) { return t.to(torch::kCUDA, torch::kBFloat16); };
    for (DecodeMerge merge : {DecodeMerge::Gather, DecodeMerge::Tree}) {
      const KvCacheShard host = round_robin_cache(seq, last, comm);
      std::vector<KvCacheShard> caches = {{gpu(host.k), gpu(host.v), host.positions.to(torch::kCUDA)}};
      const DecodeResult r = decode_step(comm, gpu(at_positions(seq.q, here)), gpu(at_positions(seq.k, here)),
                                         gpu(at_positions(seq.v, here)), here.to(torch::kCUDA), caches, merge);
      CP_EXPECT_CLOSE(r.out.cpu(), out.narrow(2, last, 1), "decode " + to_string(merge) + " out, " + where(comm), kDims,
                      testing::merged_tolerance(v16));
      CP_EXPECT_CLOSE(r.lse.cpu(), lse.narrow(2, last, 1), "decode " + to_string(merge) + " lse, " + where(comm),
                      {"b", "h", "s"});
    }
    // A cache left on the CPU for queries on the GPU.
    KvCacheShard on_cpu = round_robin_cache(seq, cached, comm);
    expect_error([&] { pass_kv_prefill(comm, cuda(seq.q), cuda(seq.k), cuda(seq.v), mine.to(torch::kCUDA), on_cpu); },
                 "cache.k: expected k's heads");
  });
}

}  // namespace
}  // namespace cp
