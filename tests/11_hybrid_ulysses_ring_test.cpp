// Lesson 11 — hybrid Ulysses × ring: the mesh's communicators, and each rank's (out, lse, dq, dk,
// dv) against float64 attention over the whole sequence on every mesh P_u × P_r of the world
// (local worlds of 1, 2, 3, 4, 8 ranks or the mpirun world); 1 × P equals lesson 07's zig-zag
// ring and P × 1 lesson 10's Ulysses; the bytes sent against the formula; lesson 09's layer
// trained with the hybrid.
#include <torch/types.h>

#include <cmath>
#include <string>
#include <tuple>

#include "common/error.h"
#include "common/trace.h"
#include "common/world.h"
#include "hybrid.h"
#include "layer_reference.h"
#include "testing/harness.h"
#include "testing/oracle.h"
#include "testing/trace_reader.h"

namespace cp {
namespace {

using testing::all_close;
using testing::for_each_world;

const std::vector<std::string> kDims = {"b", "h", "s", "d"};

/// Every mesh P_u × P_r of a world of P ranks.
std::vector<HybridMesh> meshes_of(int world) {
  std::vector<HybridMesh> meshes;
  for (int u = 1; u <= world; ++u)
    if (world % u == 0) meshes.push_back({u, world / u});
  return meshes;
}

std::string where(const Comm& comm, HybridMesh mesh, const std::string& what) {
  return what + ", mesh " + std::to_string(mesh.ulysses) + "x" + std::to_string(mesh.ring) + ", rank " +
         std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
}

HybridOptions hybrid_options(bool causal) {
  HybridOptions options;
  options.causal = causal;
  return options;
}

// ── Task 1: the communicators ─────────────────────────────────────────────────────────────────

/// make_hybrid_comms on every mesh of comm's size: both sizes, this rank's rank in each, and which
/// world ranks each holds (an all_gather of the world ranks). EXPECT, not ASSERT, for the sizes:
/// under mpirun a fatal failure aborts the whole world, and wrong sizes fail the checks below too.
void expect_mesh_comms(Comm& comm) {
  const int r = comm.rank();
  for (const HybridMesh& mesh : meshes_of(comm.size())) {
    const HybridComms comms = make_hybrid_comms(comm, mesh);
    EXPECT_EQ(comms.ulysses->size(), mesh.ulysses) << where(comm, mesh, "group size");
    EXPECT_EQ(comms.ring->size(), mesh.ring) << where(comm, mesh, "ring size");
    const int g = r / mesh.ulysses, u = r % mesh.ulysses;
    EXPECT_EQ(comms.ulysses->rank(), u) << where(comm, mesh, "rank in the group");
    EXPECT_EQ(comms.ring->rank(), g) << where(comm, mesh, "rank in the ring");
    const torch::Tensor me = torch::tensor({static_cast<int64_t>(r)});
    EXPECT_TRUE(torch::equal(comms.ulysses->all_gather(me), torch::arange(g * mesh.ulysses, (g + 1) * mesh.ulysses)))
        << where(comm, mesh, "the group is ranks g·P_u … g·P_u + P_u − 1");
    EXPECT_TRUE(torch::equal(comms.ring->all_gather(me), torch::arange(u, comm.size(), mesh.ulysses)))
        << where(comm, mesh, "the ring is ranks u, u + P_u, …");
  }
}

CP_TEST(Lesson11, Task1_GroupsAreConsecutiveRanksAndRingsTakeOneRankOfEach) {
  for_each_world(expect_mesh_comms);
  // A prime world (mpirun -np 3) has only the meshes 1 x P and P x 1, where groups of consecutive
  // ranks and groups by r mod P_r are the same: under mpirun, local worlds of 4 and 8 ranks too.
  if (testing::under_mpirun())
    for (int n : {4, 8}) run_local_world(n, expect_mesh_comms);
}

// ── Tasks 2 and 3: forward and backward against the oracle ────────────────────────────────────

struct Sequence {
  torch::Tensor q, k, v, dout;  // [B, H, S, D]
  torch::Tensor out, lse, dq, dk, dv;  // float64 oracle over the whole sequence
};

/// q, k, v, dout of `batch` sequences in `dtype` (on the CPU), and the oracle's results for them.
Sequence make_sequence(int64_t hq, int64_t hkv, int64_t s, int64_t d, bool causal, uint64_t seed,
                       torch::ScalarType dtype = torch::kFloat, int64_t batch = 2) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  Sequence x;
  x.q = torch::randn({batch, hq, s, d}, gen).to(dtype);
  x.k = torch::randn({batch, hkv, s, d}, gen).to(dtype);
  x.v = torch::randn({batch, hkv, s, d}, gen).to(dtype);
  x.dout = torch::randn({batch, hq, s, d}, gen).to(dtype);
  const torch::Tensor pos = torch::arange(s);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::tie(x.out, x.lse) = testing::oracle_attention(x.q, x.k, x.v, causal, pos, pos, scale);
  std::tie(x.dq, x.dk, x.dv) = testing::oracle_attention_grads(x.q, x.k, x.v, x.dout, causal, pos, pos, scale);
  return x;
}

/// Runs `check(comm, mesh, x, mine, what)` on every mesh P_u × P_r of every world, causal and not,
/// with Hq = 2P (every P_u divides it) and Hkv = Hq (whole K/V heads on every rank) or Hkv = 2 (1
/// when P is odd: K/V heads split when P_u ≤ Hkv, replicated when P_u > Hkv). S/P = 14: zig-zag
/// chunks of 7 tokens, a multiple of no tile. `mine` cuts this rank's zig-zag shard of a tensor.
template <typename Check>
void on_every_mesh(Check check) {
  for_each_world([&](Comm& comm) {
    const int p = comm.size();
    const int64_t hq = 2 * p, chunk = 14, d = 32;
    uint64_t seed = 300;
    for (int64_t hkv : {hq, static_cast<int64_t>(p % 2 == 0 ? 2 : 1)}) {
      for (bool causal : {true, false}) {
        const Sequence x = make_sequence(hq, hkv, chunk * p, d, causal, seed++);
        auto mine = [&](const torch::Tensor& t) {
          return shard_sequence(t, TokenLayout::ZigZag, p, comm.rank()).contiguous();
        };
        for (const HybridMesh& mesh : meshes_of(p)) {
          const std::string what = where(comm, mesh, (causal ? "causal, Hkv " : "full, Hkv ") + std::to_string(hkv));
          check(make_hybrid_comms(comm, mesh), x, causal, mine, what);
        }
      }
    }
  });
}

/// The bytes one rank sends: Ulysses' part is lesson 10's volume for the group's S/P_r tokens
/// over P_u ranks; the ring's is the rest of hybrid_volume (K/V hops; backward the dK/dV hops too).
struct Bytes {
  int64_t ulysses, ring;
};
std::pair<Bytes, Bytes> expected_bytes(const Sequence& x, HybridMesh mesh) {
  const int64_t b = x.q.size(0), hq = x.q.size(1), hkv = x.k.size(1), s = x.q.size(2), d = x.q.size(3);
  const UlyssesVolume group = ulysses_volume(b, hq, hkv, s / mesh.ring, d, mesh.ulysses, sizeof(float));
  const UlyssesVolume all = hybrid_volume(b, hq, hkv, s, d, mesh, sizeof(float));
  return {{group.forward_bytes, all.forward_bytes - group.forward_bytes},
          {group.backward_bytes, all.backward_bytes - group.backward_bytes}};
}

CP_TEST(Lesson11, Task2_ForwardMatchesFullAttentionOnEveryMesh) {
  on_every_mesh([](const HybridComms& comms, const Sequence& x, bool causal, auto mine, const std::string& what) {
    const HybridResult r = hybrid_attention_forward(comms, mine(x.q), mine(x.k), mine(x.v), hybrid_options(causal));
    CP_EXPECT_CLOSE(r.out, mine(x.out), "out " + what, kDims);
    CP_EXPECT_CLOSE(r.lse, mine(x.lse), "lse " + what, {"b", "h", "s"});
    const Bytes bytes = expected_bytes(x, comms.mesh).first;
    EXPECT_EQ(r.stats.bytes_ulysses, bytes.ulysses) << "forward all-to-all bytes, " << what;
    EXPECT_EQ(r.stats.bytes_ring, bytes.ring) << "forward ring bytes, " << what;
  });
}

/// The HybridResult::saved of a forward that got out and lse right: this rank's q, k, v, out, lse
/// through lesson 10's exchange over the group (K/V heads replicated as lesson 10 does), then in
/// the ring's zig-zag order: the gathered sequence is the group's shards one after the other, each
/// two chunks; the ring's shard is the first chunks in group order, then the second in reverse.
UlyssesSaved saved_from_reference(const HybridComms& comms, const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse) {
  const int pu = comms.mesh.ulysses;
  const int64_t shard = q.size(2), half = shard / 2;
  std::vector<torch::Tensor> order;
  for (int u = 0; u < pu; ++u) order.push_back(torch::arange(u * shard, u * shard + half));
  for (int u = pu - 1; u >= 0; --u) order.push_back(torch::arange(u * shard + half, (u + 1) * shard));
  const torch::Tensor ring_order = torch::cat(order);
  auto on_ring = [&](const torch::Tensor& t) {
    return ulysses_seq_to_heads(*comms.ulysses, t.contiguous()).index_select(2, ring_order);
  };
  const int64_t kv = ulysses_kv_heads(q.size(1), k.size(1), pu);
  return {on_ring(q), on_ring(out), on_ring(replicate_kv_heads(k, kv)), on_ring(replicate_kv_heads(v, kv)),
          on_ring(lse), k.size(1)};
}

CP_TEST(Lesson11, Task3_BackwardMatchesFullAttentionOnEveryMesh) {
  on_every_mesh([](const HybridComms& comms, const Sequence& x, bool causal, auto mine, const std::string& what) {
    // What the forward saves, made from the oracle's out and lse: the backward is checked on its
    // own, whatever the forward does.
    const UlyssesSaved saved = saved_from_reference(comms, mine(x.q), mine(x.k), mine(x.v), mine(x.out).to(torch::kFloat),
                                                    mine(x.lse).to(torch::kFloat));
    const HybridGrads g = hybrid_attention_backward(comms, mine(x.dout), saved, hybrid_options(causal));
    CP_EXPECT_CLOSE(g.dq, mine(x.dq), "dq " + what, kDims, testing::gradient_tolerance(torch::kFloat, x.dq));
    CP_EXPECT_CLOSE(g.dk, mine(x.dk), "dk " + what, kDims, testing::gradient_tolerance(torch::kFloat, x.dk));
    CP_EXPECT_CLOSE(g.dv, mine(x.dv), "dv " + what, kDims, testing::gradient_tolerance(torch::kFloat, x.dv));
    const Bytes bytes = expected_bytes(x, comms.mesh).second;
    EXPECT_EQ(g.stats.bytes_ulysses, bytes.ulysses) << "backward all-to-all bytes, " << what;
    EXPECT_EQ(g.stats.bytes_ring, bytes.ring) << "backward ring bytes, " << what;
  });
}

/// The inputs of the tests of the mesh's ends: Hq = 2P, Hkv = P, S/P = 6 (chunks of 3).
struct EndsInputs {
  torch::Tensor q, k, v, dout;
  std::string me;
};
EndsInputs ends_inputs(const Comm& comm) {
  const int p = comm.size();
  torch::Generator gen = at::detail::createCPUGenerator(310);
  EndsInputs x;
  x.q = torch::randn({1, 2 * p, 6, 32}, gen);
  x.k = torch::randn({1, p, 6, 32}, gen);
  x.v = torch::randn({1, p, 6, 32}, gen);
  x.dout = torch::randn({1, 2 * p, 6, 32}, gen);
  x.me = ", rank " + std::to_string(comm.rank()) + " of " + std::to_string(p);
  return x;
}

CP_TEST(Lesson11, Task2_TheEndsOfTheMeshAreTheRingAndUlysses) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    const EndsInputs x = ends_inputs(comm);
    // 1 x P: no all-to-all, the ring is the world: lesson 07's zig-zag ring, bit for bit.
    const HybridResult ring_end = hybrid_attention_forward(make_hybrid_comms(comm, {1, p}), x.q, x.k, x.v,
                                                           hybrid_options(true));
    const RingResult ring = zigzag_ring_attention_forward(comm, x.q, x.k, x.v, ring_options(true));
    EXPECT_TRUE(torch::equal(ring_end.out, ring.out)) << "1 x P out is lesson 07's zig-zag ring" << x.me;
    EXPECT_TRUE(torch::equal(ring_end.lse, ring.lse)) << "1 x P lse is lesson 07's zig-zag ring" << x.me;
    EXPECT_EQ(ring_end.stats.bytes_ulysses, 0) << x.me;
    EXPECT_EQ(ring_end.stats.bytes_ring, ring.stats.bytes_sent) << x.me;
    // P x 1: one group, a ring of one rank: lesson 10's Ulysses on the zig-zag layout. The same
    // attention of the same tokens, but the keys come in another order: equal up to rounding.
    const HybridResult ulysses_end = hybrid_attention_forward(make_hybrid_comms(comm, {p, 1}), x.q, x.k, x.v,
                                                              hybrid_options(true));
    const UlyssesResult ulysses =
        ulysses_attention_forward(comm, x.q, x.k, x.v, ulysses_options(true, TokenLayout::ZigZag));
    CP_EXPECT_CLOSE(ulysses_end.out, ulysses.out, "P x 1 out against lesson 10's Ulysses" + x.me, kDims);
    CP_EXPECT_CLOSE(ulysses_end.lse, ulysses.lse, "P x 1 lse against lesson 10's Ulysses" + x.me, {"b", "h", "s"});
    EXPECT_EQ(ulysses_end.stats.bytes_ulysses, ulysses.stats.bytes_sent) << x.me;
    EXPECT_EQ(ulysses_end.stats.bytes_ring, 0) << x.me;
  });
}

CP_TEST(Lesson11, Task3_TheEndsOfTheMeshAreTheRingAndUlysses) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    const EndsInputs x = ends_inputs(comm);
    // What the forward saves, from lessons 07 and 10, so that only this lesson's backward is under test.
    const HybridComms ring_mesh = make_hybrid_comms(comm, {1, p}), ulysses_mesh = make_hybrid_comms(comm, {p, 1});
    const RingResult ring = zigzag_ring_attention_forward(comm, x.q, x.k, x.v, ring_options(true));
    const HybridGrads ring_end = hybrid_attention_backward(
        ring_mesh, x.dout, saved_from_reference(ring_mesh, x.q, x.k, x.v, ring.out, ring.lse), hybrid_options(true));
    const RingGrads ring_grads =
        zigzag_ring_attention_backward(comm, x.dout, x.q, x.k, x.v, ring.out, ring.lse, ring_options(true));
    EXPECT_TRUE(torch::equal(ring_end.dq, ring_grads.dq)) << "1 x P dq is lesson 07's" << x.me;
    EXPECT_TRUE(torch::equal(ring_end.dk, ring_grads.dk)) << "1 x P dk is lesson 07's" << x.me;
    EXPECT_TRUE(torch::equal(ring_end.dv, ring_grads.dv)) << "1 x P dv is lesson 07's" << x.me;
    EXPECT_EQ(ring_end.stats.bytes_ulysses, 0) << x.me;
    EXPECT_EQ(ring_end.stats.bytes_ring, ring_grads.stats.bytes_sent) << x.me;
    const UlyssesOptions zigzag = ulysses_options(true, TokenLayout::ZigZag);
    const UlyssesResult ulysses = ulysses_attention_forward(comm, x.q, x.k, x.v, zigzag);
    const HybridGrads ulysses_end = hybrid_attention_backward(
        ulysses_mesh, x.dout, saved_from_reference(ulysses_mesh, x.q, x.k, x.v, ulysses.out, ulysses.lse),
        hybrid_options(true));
    const UlyssesGrads ulysses_grads = ulysses_attention_backward(comm, x.dout, ulysses.saved, zigzag);
    for (const auto& [name, got, want] : {std::tuple{"dq", ulysses_end.dq, ulysses_grads.dq},
                                          std::tuple{"dk", ulysses_end.dk, ulysses_grads.dk},
                                          std::tuple{"dv", ulysses_end.dv, ulysses_grads.dv}})
      CP_EXPECT_CLOSE(got, want, std::string("P x 1 ") + name + " against lesson 10's Ulysses" + x.me, kDims,
                            testing::gradient_tolerance(torch::kFloat, want));
    EXPECT_EQ(ulysses_end.stats.bytes_ulysses, ulysses_grads.stats.bytes_sent) << x.me;
    EXPECT_EQ(ulysses_end.stats.bytes_ring, 0) << x.me;
  });
}

CP_TEST(Lesson11, Task2_DefaultMeshAndVolumeFormula) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    const torch::Tensor t = torch::zeros({1, 2, 4, 32});
    hybrid_attention_forward(make_hybrid_comms(comm, {1, 1}), t, t, t);
  });
  EXPECT_EQ(default_hybrid_mesh(4, 8, 2).ulysses, 2);  // 2 × 2
  EXPECT_EQ(default_hybrid_mesh(8, 8, 2).ulysses, 2);  // 2 × 4: P_u² ≤ P
  EXPECT_EQ(default_hybrid_mesh(4, 6, 6).ulysses, 2);
  EXPECT_EQ(default_hybrid_mesh(9, 6, 6).ulysses, 3);
  EXPECT_EQ(default_hybrid_mesh(4, 3, 3).ulysses, 1);  // 3 heads cannot be split 2 ways: the ring alone
  // 1 × P is the ring: P − 1 hops of K and V, and backward P hops of float32 dK, dV.
  const int64_t kv_chunk = 2 * 4 * (64 / 4) * 32;  // B · Hkv · S/P · D elements
  const UlyssesVolume ring = hybrid_volume(2, 8, 4, 64, 32, {1, 4}, 2);
  EXPECT_EQ(ring.forward_bytes, 3 * 2 * kv_chunk * 2);
  EXPECT_EQ(ring.backward_bytes, 3 * 2 * kv_chunk * 2 + 4 * 2 * kv_chunk * 4);
  // P × 1 is Ulysses: a ring of one rank sends nothing.
  const UlyssesVolume ulysses = ulysses_volume(2, 8, 4, 64, 32, 4, 2), whole = hybrid_volume(2, 8, 4, 64, 32, {4, 1}, 2);
  EXPECT_EQ(whole.forward_bytes, ulysses.forward_bytes);
  EXPECT_EQ(whole.backward_bytes, ulysses.backward_bytes);
}

CP_TEST(Lesson11, Task3_EmptyInputGivesEmptyResults) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    const HybridComms comms = make_hybrid_comms(comm, default_hybrid_mesh(p, p, p));
    for (const auto& shape : {std::vector<int64_t>{0, p, 4, 32}, std::vector<int64_t>{1, p, 0, 32}}) {
      const torch::Tensor t = torch::zeros(shape);
      const HybridResult r = hybrid_attention_forward(comms, t, t, t, hybrid_options(true));
      const HybridGrads g = hybrid_attention_backward(comms, t, r.saved, hybrid_options(true));
      EXPECT_EQ(r.out.sizes(), t.sizes());
      EXPECT_EQ(r.lse.sizes(), t.sizes().slice(0, 3));
      EXPECT_EQ(g.dk.sizes(), t.sizes());
    }
  });
}

CP_TEST(Lesson11, Task3_TraceSpansAreNamedByWorldRank) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    // Ranks name their spans by world rank; a span of the ring under its ring rank would land on
    // another rank's row (the ring's rank 1 is world rank P_u).
    for (const HybridMesh& mesh : meshes_of(p)) {
      const HybridComms comms = make_hybrid_comms(comm, mesh);
      Trace trace;
      HybridOptions options = hybrid_options(true);
      options.trace = &trace;
      const torch::Tensor t = torch::ones({1, p, 4, 32});
      const HybridResult r = hybrid_attention_forward(comms, t, t, t, options);
      hybrid_attention_backward(comms, t, r.saved, options);
      const testing::TraceContents seen = testing::read_trace(trace);
      EXPECT_TRUE(seen.spans_per_rank.size() == 1 && seen.spans_per_rank.count(comm.rank()))
          << where(comm, mesh, "the spans of this rank's trace must all carry its world rank, " +
                                   std::to_string(comm.rank()) + " (" + seen.describe() + ")");
    }
  });
}

CP_TEST(Lesson11, Task3_TheLayerTrainsWithTheHybrid) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    const int64_t hq = 2 * p;  // D = 32
    testing::expect_training_step_matches_one_device(comm, hybrid_strategy(default_hybrid_mesh(p, hq, 1)), 140,
                                                     32 * hq, hq, 1);
  });
}

/// A Comm that passes everything to `inner` and counts the calls of split(). (The collectives
/// are Comm's generic ones, over inner's point-to-point.)
class SplitCounter : public Comm {
 public:
  explicit SplitCounter(Comm& inner) : inner_(inner) {}
  int splits() const { return splits_; }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Backend backend() const override { return inner_.backend(); }
  void send(const torch::Tensor& tensor, int peer) override { inner_.send(tensor, peer); }
  void recv(torch::Tensor& tensor, int peer) override { inner_.recv(tensor, peer); }
  Request start(const std::vector<P2POp>& ops) override { return inner_.start(ops); }
  std::shared_ptr<Comm> split(int color, int key) override {
    ++splits_;
    return inner_.split(color, key);
  }

 private:
  Comm& inner_;
  int splits_ = 0;
};

CP_TEST(Lesson11, Task3_TheStrategySplitsEachCommOnce) {
  // The layer calls the strategy in every forward and backward; splitting each time would cost
  // four splits per step (on NCCL, four ncclCommSplit). Two Comms one after the other, most likely
  // at the same address: each gets its own mesh (a cache keyed by address would give the second
  // the first's, made over another Comm).
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    const Strategy strategy = hybrid_strategy(default_hybrid_mesh(p, 2 * p, 1));
    const torch::Tensor q = torch::ones({1, 2 * p, 4, 32}), kv = torch::ones({1, 1, 4, 32});
    for (int comm_number = 0; comm_number < 2; ++comm_number) {
      SplitCounter counted(comm);
      for (int step = 0; step < 2; ++step) {  // two layer steps: a forward and a backward each
        const StrategyForward f = strategy_forward(counted, q, kv, kv, strategy);
        strategy_backward(counted, q, f.saved, strategy);
      }
      EXPECT_EQ(counted.splits(), 2) << "Comm " << comm_number << ", rank " << comm.rank() << " of " << p
                                     << ": two steps should split once into the group and once into the ring";
    }
  });
}

CP_TEST(Lesson11, Task2_BadInputGivesClearErrors) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    const torch::Tensor t = torch::zeros({1, 2, 4, 32});
    hybrid_attention_forward(make_hybrid_comms(comm, {1, 1}), t, t, t);
  });
  auto on_4_ranks = [](std::function<void(Comm&)> body) { return [body] { run_local_world(4, body); }; };
  auto forward = [](HybridMesh mesh, int64_t hq, int64_t hkv, int64_t chunk) {
    return [=](Comm& comm) {
      hybrid_attention_forward(make_hybrid_comms(comm, mesh), torch::zeros({1, hq, chunk, 32}),
                               torch::zeros({1, hkv, chunk, 32}), torch::zeros({1, hkv, chunk, 32}));
    };
  };
  testing::expect_errors({
      {"mesh 2 x 3 on 4 ranks", on_4_ranks(forward({2, 3}, 4, 4, 4)), "mesh: ulysses x ring = 2 x 3 = 6 ranks"},
      {"mesh 0 x 4", on_4_ranks(forward({0, 4}, 4, 4, 4)), "must be at least 1"},
      {"Hq = 3 over groups of 2", on_4_ranks(forward({2, 2}, 3, 3, 4)), "query heads Hq = 3 must be divisible by the 2"},
      {"Hkv = 3 over groups of 2", on_4_ranks(forward({2, 2}, 6, 3, 4)), "Hkv = 3 must be divisible by the 2 ranks"},
      {"S/P = 3 is odd", on_4_ranks(forward({2, 2}, 4, 4, 3)), "S must be divisible by 2P = 8"},
      {"rank 3 holds 6 tokens", on_4_ranks([](Comm& comm) {
         const torch::Tensor t = torch::zeros({1, 4, comm.rank() == 3 ? 6 : 4, 32});
         hybrid_attention_forward(make_hybrid_comms(comm, {2, 2}), t, t, t);
       }), "Is S divisible by 2P = 8?"},
      {"dout shorter than the forward's q", on_4_ranks([](Comm& comm) {
         const HybridComms comms = make_hybrid_comms(comm, {2, 2});
         const torch::Tensor t = torch::zeros({1, 4, 4, 32});
         hybrid_attention_backward(comms, torch::zeros({1, 4, 2, 32}), hybrid_attention_forward(comms, t, t, t).saved);
       }), "saved: expected the forward's head split for dout [1, 4, 2, 32] on 2 ranks"},
      {"no saved tensors", on_4_ranks([](Comm& comm) {
         hybrid_attention_backward(make_hybrid_comms(comm, {2, 2}), torch::zeros({1, 4, 4, 32}), UlyssesSaved{});
       }), "saved: empty"},
      {"comms not made", [] {
         const torch::Tensor t = torch::zeros({1, 2, 4, 32});
         hybrid_attention_forward(HybridComms{}, t, t, t);
       }, "make_hybrid_comms"},
  });
}

CP_TEST(Lesson11Cuda, Task3_ForwardAndBackwardOnCudaOnEveryMesh) {
  // Every output, every dtype, D = 32 and 128, on every mesh; zig-zag chunks of 40 tokens (not a
  // multiple of the kernels' 64-row blocks).
  CP_REQUIRE_GPU();
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    const int64_t hq = 2 * p, hkv = p % 2 == 0 ? 2 : 1, chunk = 80;
    uint64_t seed = 330;
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
      for (int64_t d : {32, 128}) {
        const Sequence x = make_sequence(hq, hkv, chunk * p, d, true, seed++, dtype, 1);
        auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, TokenLayout::ZigZag, p, comm.rank()); };
        auto on = [&](const torch::Tensor& t) { return mine(t).to(torch::kCUDA).contiguous(); };
        for (const HybridMesh& mesh : meshes_of(p)) {
          const HybridComms comms = make_hybrid_comms(comm, mesh);
          const std::string what = where(comm, mesh, std::string(c10::toString(dtype)) + " D=" + std::to_string(d));
          const HybridResult r = hybrid_attention_forward(comms, on(x.q), on(x.k), on(x.v), hybrid_options(true));
          const HybridGrads g = hybrid_attention_backward(comms, on(x.dout), r.saved, hybrid_options(true));
          CP_EXPECT_CLOSE(r.out, mine(x.out), "out " + what, kDims, testing::merged_tolerance(x.v));
          CP_EXPECT_CLOSE(r.lse, mine(x.lse), "lse " + what, {"b", "h", "s"});
          CP_EXPECT_CLOSE(g.dq, mine(x.dq), "dq " + what, kDims, testing::gradient_tolerance(dtype, x.dq));
          CP_EXPECT_CLOSE(g.dk, mine(x.dk), "dk " + what, kDims, testing::gradient_tolerance(dtype, x.dk));
          CP_EXPECT_CLOSE(g.dv, mine(x.dv), "dv " + what, kDims, testing::gradient_tolerance(dtype, x.dv));
        }
      }
    }
  });
}

}  // namespace
}  // namespace cp
