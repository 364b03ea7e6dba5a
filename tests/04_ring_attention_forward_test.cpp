// Lesson 04 — ring attention forward: each rank's (out, lse) against float64 attention over the
// whole sequence, on local worlds of 1, 2, 3, 4, 8 ranks or the mpirun world.
#include <torch/types.h>

#include "common/error.h"
#include "common/world.h"
#include "ring_attention.h"
#include "short_ring_schedule.h"
#include "testing/harness.h"
#include "testing/oracle.h"
#include "testing/trace_reader.h"

namespace cp {
namespace {

using testing::all_close;
using testing::all_close_or_nan;
using testing::for_each_world;
using testing::oracle_attention;

struct Problem {
  int64_t batch, heads_q, heads_kv, chunk, head_dim;  // chunk = S / N, not a multiple of the tiles
};

struct Sequence {
  torch::Tensor q, k, v;  // whole sequence [B, H, S, D], the same on every rank (fixed seed)
};

Sequence make_sequence(const Problem& p, int world, uint64_t seed) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  const int64_t s = p.chunk * world;
  return {torch::randn({p.batch, p.heads_q, s, p.head_dim}, gen), torch::randn({p.batch, p.heads_kv, s, p.head_dim}, gen),
          torch::randn({p.batch, p.heads_kv, s, p.head_dim}, gen)};
}

torch::Tensor shard(const torch::Tensor& t, const Comm& comm, int dim = 2) {
  const int64_t chunk = t.size(dim) / comm.size();
  return t.narrow(dim, comm.rank() * chunk, chunk);
}

const std::vector<Problem> kProblems = {{1, 2, 2, 37, 32}, {2, 4, 2, 33, 64}};

CP_TEST(Lesson04, Task1_ForwardMatchesFullAttention) {
  for_each_world([](Comm& comm) {
    for (const Problem& p : kProblems) {
      for (bool causal : {false, true}) {
        const Sequence seq = make_sequence(p, comm.size(), 7 + p.chunk);
        const int64_t s = seq.q.size(2);
        const auto [out, lse] = oracle_attention(seq.q, seq.k, seq.v, causal, torch::arange(s), torch::arange(s),
                                                 1.0 / std::sqrt(static_cast<double>(p.head_dim)));
        const RingResult r = ring_attention_forward(comm, shard(seq.q, comm), shard(seq.k, comm), shard(seq.v, comm),
                                                    ring_options(causal));
        const std::string what = std::string(causal ? "causal" : "full") + " rank " + std::to_string(comm.rank()) +
                                 " of " + std::to_string(comm.size());
        CP_EXPECT_CLOSE(r.out, shard(out, comm), "out " + what, {"b", "h", "s", "d"});
        CP_EXPECT_CLOSE(r.lse, shard(lse, comm), "lse " + what, {"b", "h", "s"});
      }
    }
  });
}

// A layout other than the contiguous one, defined here so that lesson 04 needs nothing from
// lesson 07: rank r holds the tokens r, r + N, r + 2N, ... (a stripe), and every step computes
// its whole block with the causal mask from both chunks' positions. With the contiguous layout
// the positions decide only the diagonal step (where source = rank); here they decide every
// step, so a mask built from the wrong chunk's positions fails.
RingSchedule striped_test_schedule() {
  RingSchedule schedule;
  schedule.positions = [](int rank, int world, int64_t chunk, torch::Device device) {
    return torch::arange(rank, chunk * world, world, torch::TensorOptions().dtype(torch::kLong).device(device));
  };
  schedule.plan = [](int, int, int, int64_t chunk, bool causal) { return BlockPlan{true, 0, chunk, 0, chunk, causal}; };
  return schedule;
}

CP_TEST(Lesson04, Task1_AnyScheduleMatchesFullAttention) {
  for_each_world([](Comm& comm) {
    const Problem p{1, 2, 1, 13, 32};
    const Sequence seq = make_sequence(p, comm.size(), 23);
    const int64_t s = seq.q.size(2);
    RingSchedule schedule = striped_test_schedule();
    const torch::Tensor mine = schedule.positions(comm.rank(), comm.size(), p.chunk, torch::kCPU);
    auto take = [&](const torch::Tensor& t) { return t.index_select(2, mine); };
    for (bool causal : {false, true}) {
      const auto [out, lse] = oracle_attention(seq.q, seq.k, seq.v, causal, torch::arange(s), torch::arange(s),
                                               1.0 / std::sqrt(static_cast<double>(p.head_dim)));
      RingOptions options = ring_options(causal);
      options.schedule = schedule;
      const RingResult r = ring_attention_forward(comm, take(seq.q), take(seq.k), take(seq.v), options);
      const std::string what = std::string("striped layout, ") + (causal ? "causal" : "full") + ", rank " +
                               std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) +
                               " (rows are this rank's tokens; the mask of each step must use the positions of "
                               "the chunk in hand, the source's)";
      CP_EXPECT_CLOSE(r.out, take(out), "out " + what, {"b", "h", "s", "d"});
      CP_EXPECT_CLOSE(r.lse, lse.index_select(2, mine), "lse " + what, {"b", "h", "s"});
    }
  });
}

CP_TEST(Lesson04, Task1_NanAndInfReachExactlyTheRowsThatSeeThem) {
  // One non-finite value in one rank's q, k or v: the rows that see it (on any rank) get the
  // float64 reference's NaN or +inf, the others stay exact; a NaN is never taken for a masked key.
  struct Poison {
    std::string name;
    char tensor;  // 'q', 'k' or 'v'
    int64_t dim;
    float value;
  };
  const std::vector<Poison> poisons = {{"NaN in q", 'q', 3, NAN},        {"NaN in k", 'k', 5, NAN},
                                       {"NaN in v", 'v', 2, NAN},         {"+inf in q", 'q', 1, INFINITY},
                                       {"+inf in k", 'k', 4, INFINITY},   {"-inf in k", 'k', 4, -INFINITY}};
  for_each_world([&](Comm& comm) {
    const Problem p{1, 2, 1, 5, 32};
    const Sequence clean = make_sequence(p, comm.size(), 12);
    const int64_t s = clean.q.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(p.head_dim));
    for (const Poison& x : poisons) {
      Sequence seq{clean.q.clone(), clean.k.clone(), clean.v.clone()};
      torch::Tensor& t = x.tensor == 'q' ? seq.q : x.tensor == 'k' ? seq.k : seq.v;
      t[0][0][x.tensor == 'q' ? s * 2 / 3 : s / 2][x.dim] = x.value;  // a query late, a key mid-sequence
      for (bool causal : {false, true}) {
        const auto [out, lse] = oracle_attention(seq.q, seq.k, seq.v, causal, torch::arange(s), torch::arange(s), scale);
        const RingResult r = ring_attention_forward(comm, shard(seq.q, comm), shard(seq.k, comm), shard(seq.v, comm),
                                                    ring_options(causal));
        const std::string what = x.name + (causal ? ", causal" : ", full") + ", rank " + std::to_string(comm.rank()) +
                                 " of " + std::to_string(comm.size());
        CP_EXPECT_RESULT(all_close_or_nan(r.out, shard(out, comm), "out " + what, {"b", "h", "s", "d"}));
        CP_EXPECT_RESULT(all_close_or_nan(r.lse, shard(lse, comm), "lse " + what, {"b", "h", "s"}));
      }
    }
  });
}

CP_TEST(Lesson04, Task1_CausalSkipsExactlyTheLaterChunks) {
  for_each_world([](Comm& comm) {
    const Problem p{1, 2, 1, 20, 32};
    const Sequence seq = make_sequence(p, comm.size(), 3);
    const int n = comm.size(), r = comm.rank();
    const int64_t chunk_bytes = 2 * p.batch * p.heads_kv * p.chunk * p.head_dim * static_cast<int64_t>(sizeof(float));
    for (bool causal : {false, true}) {
      const RingStats stats =
          ring_attention_forward(comm, shard(seq.q, comm), shard(seq.k, comm), shard(seq.v, comm), ring_options(causal))
              .stats;
      EXPECT_EQ(stats.steps_computed, causal ? r + 1 : n) << "rank " << r << " of " << n;
      EXPECT_EQ(stats.steps_skipped, causal ? n - 1 - r : 0) << "rank " << r << " of " << n;
      EXPECT_EQ(stats.bytes_sent, (n - 1) * chunk_bytes) << "rank " << r << ": K and V go N−1 hops";
      ASSERT_EQ(stats.steps.size(), static_cast<size_t>(stats.steps_computed));
      for (size_t i = 0; i < stats.steps.size(); ++i) {
        EXPECT_EQ(stats.steps[i].source, (r - static_cast<int>(i) + n) % n) << "computed steps are steps 0, 1, …";
        EXPECT_EQ(stats.steps[i].pairs, p.chunk * p.chunk) << "a whole chunk × chunk block per step";
      }
    }
  });
}

CP_TEST(Lesson04, Task1_ARingThatStopsEarlyRunsOnlyItsSteps) {
  // A schedule whose `steps` is 2 (a window of one chunk): the ring runs steps 0 and 1 and sends
  // K and V once, on every world (one rank: one step, nothing sent).
  for_each_world([](Comm& comm) {
    const Problem p{1, 2, 1, 20, 32};
    const Sequence seq = make_sequence(p, comm.size(), 4);
    const int n = comm.size(), steps = std::min(n, 2);
    const int64_t s = seq.q.size(2), window = p.chunk;
    RingOptions options = ring_options(true);
    options.schedule = testing::two_step_window_schedule(window);
    const RingResult r = ring_attention_forward(comm, shard(seq.q, comm), shard(seq.k, comm), shard(seq.v, comm), options);
    testing::OracleMask mask{true, torch::arange(s), torch::arange(s), window, {}};
    const auto [out, lse] = oracle_attention(seq.q, seq.k, seq.v, mask, 1.0 / std::sqrt(32.0));
    const std::string what = "window of one chunk, rank " + std::to_string(comm.rank()) + " of " + std::to_string(n);
    CP_EXPECT_CLOSE(r.out, shard(out, comm), "out " + what, {"b", "h", "s", "d"});
    CP_EXPECT_CLOSE(r.lse, shard(lse, comm), "lse " + what, {"b", "h", "s"});
    const int64_t chunk_bytes = 2 * p.batch * p.heads_kv * p.chunk * p.head_dim * static_cast<int64_t>(sizeof(float));
    EXPECT_EQ(r.stats.steps_not_run, n - steps) << what;
    EXPECT_EQ(r.stats.bytes_sent, (steps - 1) * chunk_bytes) << what << ": K and V of the steps run only";
  });
}

CP_TEST(Lesson04, Task1_TheCallersTensorsAreNotOverwritten) {
  for_each_world([](Comm& comm) {
    const Sequence seq = make_sequence({1, 2, 2, 16, 32}, comm.size(), 13);
    const torch::Tensor q = shard(seq.q, comm).contiguous(), k = shard(seq.k, comm).contiguous(),
                        v = shard(seq.v, comm).contiguous();
    const torch::Tensor q0 = q.clone(), k0 = k.clone(), v0 = v.clone();
    ring_attention_forward(comm, q, k, v, ring_options(true));
    EXPECT_TRUE(torch::equal(q, q0) && torch::equal(k, k0) && torch::equal(v, v0))
        << "the ring must receive into buffers of its own, not into the caller's k or v";
  });
}

CP_TEST(Lesson04, Task1_OverlapOnAndOffGiveIdenticalResults) {
  for_each_world([](Comm& comm) {
    const Sequence seq = make_sequence({1, 4, 2, 29, 64}, comm.size(), 11);
    for (bool causal : {false, true}) {
      const RingResult on = ring_attention_forward(comm, shard(seq.q, comm), shard(seq.k, comm), shard(seq.v, comm),
                                                   ring_options(causal));
      RingOptions no_overlap = ring_options(causal);
      no_overlap.overlap = false;
      const RingResult off = ring_attention_forward(comm, shard(seq.q, comm), shard(seq.k, comm), shard(seq.v, comm),
                                                    no_overlap);
      EXPECT_TRUE(torch::equal(on.out, off.out));
      EXPECT_TRUE(torch::equal(on.lse, off.lse));
    }
  });
}

CP_TEST(Lesson04, Task1_TraceRecordsComputeAndCommunication) {
  Trace trace;
  run_local_world(3, [&](Comm& comm) {
    const Sequence seq = make_sequence({1, 1, 1, 16, 32}, 3, 5);
    ring_attention_forward(comm, shard(seq.q, comm), shard(seq.k, comm), shard(seq.v, comm), ring_options(true, &trace));
  });
  const testing::TraceContents seen = testing::read_trace(trace);
  const std::string what = "a causal forward on 3 ranks with options.trace set (" + seen.describe() + ")";
  EXPECT_TRUE(seen.has_trace_events) << what << ": the file is not a Chrome trace";
  EXPECT_TRUE(seen.spans_per_lane.count("compute")) << what << ": no span on lane 'compute' (one per computed block)";
  EXPECT_TRUE(seen.spans_per_lane.count("comm")) << what << ": no span on lane 'comm' (one per exchange)";
  EXPECT_TRUE(seen.spans_per_rank.count(2)) << what << ": no span of rank 2 (each rank records under its own rank)";
}

CP_TEST(Lesson04, Task1_BadInputGivesClearErrors) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    ring_attention_forward(comm, torch::zeros({1, 1, 4, 32}), torch::zeros({1, 1, 4, 32}), torch::zeros({1, 1, 4, 32}));
  });
  // body runs on every rank of a world of 3; a rank's error releases the others.
  auto on_3_ranks = [](std::function<void(Comm&)> body) { return [body] { run_local_world(3, body); }; };
  auto forward = [](Comm& comm, const RingOptions& options) {
    const torch::Tensor t = torch::zeros({1, 1, 4, 32});
    ring_attention_forward(comm, t, t, t, options);
  };
  RingOptions no_exchange;
  no_exchange.exchange = nullptr;
  RingOptions short_schedule;  // a schedule whose positions give every rank one position too few
  short_schedule.schedule.positions = [](int rank, int, int64_t chunk, torch::Device) {
    return torch::arange(rank * chunk, (rank + 1) * chunk - 1, torch::kLong);
  };
  testing::expect_errors({
      {"S = 10 over 3 ranks: rank 2 holds 4 tokens", on_3_ranks([](Comm& comm) {
         const torch::Tensor t = torch::zeros({1, 1, comm.rank() == 2 ? 4 : 3, 32});
         ring_attention_forward(comm, t, t, t);
       }), "Is S divisible by N = 3?"},
      {"rank 1 passes float64", on_3_ranks([](Comm& comm) {
         const torch::Tensor t = torch::zeros({1, 1, 4, 32}, comm.rank() == 1 ? torch::kDouble : torch::kFloat);
         ring_attention_forward(comm, t, t, t);
       }), "q: every rank must pass the same shape and dtype"},
      {"v longer than k", on_3_ranks([](Comm& comm) {
         ring_attention_forward(comm, torch::zeros({1, 1, 4, 32}), torch::zeros({1, 1, 4, 32}), torch::zeros({1, 1, 5, 32}));
       }), "v: shape must be k's"},
      {"k with 3 dimensions", on_3_ranks([](Comm& comm) {
         ring_attention_forward(comm, torch::zeros({1, 1, 4, 32}), torch::zeros({1, 4, 32}), torch::zeros({1, 4, 32}));
       }), "expected at least 4 dimension(s)"},
      {"an empty RingOptions::exchange", on_3_ranks([&](Comm& comm) { forward(comm, no_exchange); }),
       "options.exchange: empty"},
      {"a schedule whose positions are one short", on_3_ranks([&](Comm& comm) { forward(comm, short_schedule); }),
       "options.schedule.positions: rank 0 of 3 must get int64 [S/N = 4], got [3]"},
  });
}

CP_TEST(Lesson04Cuda, Task1_ForwardOnCudaForEveryDtypeAndHeadDim) {
  CP_REQUIRE_GPU();
  for_each_world([](Comm& comm) {
    for (const Problem& p : {Problem{1, 4, 2, 70, 64}, Problem{1, 4, 2, 70, 128}}) {
      const Sequence seq = make_sequence(p, comm.size(), 17);
      const double scale = 1.0 / std::sqrt(static_cast<double>(p.head_dim));
      for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
        for (bool causal : {false, true}) {
          const torch::Tensor q = seq.q.to(dtype), k = seq.k.to(dtype), v = seq.v.to(dtype);
          const int64_t s = q.size(2);
          const auto [out, lse] = oracle_attention(q, k, v, causal, torch::arange(s), torch::arange(s), scale);
          const RingResult r = ring_attention_forward(comm, shard(q, comm).cuda(), shard(k, comm).cuda(),
                                                      shard(v, comm).cuda(), ring_options(causal));
          const std::string what = "cuda " + std::string(c10::toString(dtype)) + " D=" + std::to_string(p.head_dim) +
                                   (causal ? " causal" : "");
          EXPECT_EQ(r.out.scalar_type(), dtype);
          CP_EXPECT_CLOSE(r.out, shard(out, comm), "out " + what, {"b", "h", "s", "d"}, testing::merged_tolerance(v));
          CP_EXPECT_CLOSE(r.lse, shard(lse, comm), "lse " + what, {"b", "h", "s"});
        }
      }
    }
  });
}

}  // namespace
}  // namespace cp
