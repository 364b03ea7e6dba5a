// Lesson 11 — hybrid Ulysses × ring: the mesh's communicators, and each rank's (out, lse, dq, dk,
// dv) against float64 attention over the whole sequence on every mesh P_u × P_r of the world
// (local worlds of 1, 2, 3, 4, 8 ranks or the mpirun world); 1 × P equals lesson 07's zig-zag
// ring and P × 1 lesson 10's Ulysses; the bytes sent against the formula; lesson 09's layer
// trained with the hybrid.
#include <torch/types.h>

#include <cmath>

#include "common/error.h"
#include "common/world.h"
#include "hybrid.h"
#include "layer_reference.h"
#include "testing/harness.h"
#include "testing/oracle.h"

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

CP_TEST(Lesson11, Task1_GroupsAreConsecutiveRanksAndRingsTakeOneRankOfEach) {
  for_each_world([](Comm& comm) {
    const int r = comm.rank();
    for (const HybridMesh& mesh : meshes_of(comm.size())) {
      const HybridComms comms = make_hybrid_comms(comm, mesh);
      ASSERT_EQ(comms.ulysses->size(), mesh.ulysses) << where(comm, mesh, "group size");
      ASSERT_EQ(comms.ring->size(), mesh.ring) << where(comm, mesh, "ring size");
      const int g = r / mesh.ulysses, u = r % mesh.ulysses;
      EXPECT_EQ(comms.ulysses->rank(), u) << where(comm, mesh, "rank in the group");
      EXPECT_EQ(comms.ring->rank(), g) << where(comm, mesh, "rank in the ring");
      const torch::Tensor me = torch::tensor({static_cast<int64_t>(r)});
      EXPECT_TRUE(torch::equal(comms.ulysses->all_gather(me), torch::arange(g * mesh.ulysses, (g + 1) * mesh.ulysses)))
          << where(comm, mesh, "the group is ranks g·P_u … g·P_u + P_u − 1");
      EXPECT_TRUE(torch::equal(comms.ring->all_gather(me), torch::arange(u, comm.size(), mesh.ulysses)))
          << where(comm, mesh, "the ring is ranks u, u + P_u, …");
    }
  });
}

// ── Tasks 2 and 3: forward and backward against the oracle ────────────────────────────────────

struct Sequence {
  torch::Tensor q, k, v, dout;  // [B, H, S, D]
  torch::Tensor out, lse, dq, dk, dv;  // float64 oracle over the whole sequence
};

Sequence make_sequence(int64_t hq, int64_t hkv, int64_t s, int64_t d, bool causal, uint64_t seed) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  Sequence x;
  x.q = torch::randn({2, hq, s, d}, gen);
  x.k = torch::randn({2, hkv, s, d}, gen);
  x.v = torch::randn({2, hkv, s, d}, gen);
  x.dout = torch::randn({2, hq, s, d}, gen);
  const torch::Tensor pos = torch::arange(s);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::tie(x.out, x.lse) = testing::oracle_attention(x.q, x.k, x.v, causal, pos, pos, scale);
  std::tie(x.dq, x.dk, x.dv) = testing::oracle_attention_grads(x.q, x.k, x.v, x.dout, causal, pos, pos, scale);
  return x;
}

CP_TEST(Lesson11, Task2_ForwardAndTask3_BackwardMatchFullAttentionOnEveryMesh) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    // Hq = 2P, Hkv = 2: every P_u divides Hq; K/V heads are split (P_u ≤ 2) or replicated.
    const int64_t hq = 2 * p, hkv = p % 2 == 0 ? 2 : 1, chunk = 14, d = 32;  // S/P = 14: zig-zag chunks of 7
    uint64_t seed = 300;
    for (bool causal : {true, false}) {
      const Sequence x = make_sequence(hq, hkv, chunk * p, d, causal, seed++);
      auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, TokenLayout::ZigZag, p, comm.rank()).contiguous(); };
      for (const HybridMesh& mesh : meshes_of(p)) {
        const HybridComms comms = make_hybrid_comms(comm, mesh);
        const std::string what = where(comm, mesh, causal ? "causal" : "full");
        const HybridResult r = hybrid_attention_forward(comms, mine(x.q), mine(x.k), mine(x.v), hybrid_options(causal));
        EXPECT_TRUE(all_close(r.out, mine(x.out), "out " + what, kDims));
        EXPECT_TRUE(all_close(r.lse, mine(x.lse), "lse " + what, {"b", "h", "s"}));
        const HybridGrads g = hybrid_attention_backward(comms, mine(x.dout), mine(x.q), mine(x.k), mine(x.v), r.out,
                                                        r.lse, hybrid_options(causal));
        EXPECT_TRUE(all_close(g.dq, mine(x.dq), "dq " + what, kDims, testing::gradient_tolerance(torch::kFloat, x.dq)));
        EXPECT_TRUE(all_close(g.dk, mine(x.dk), "dk " + what, kDims, testing::gradient_tolerance(torch::kFloat, x.dk)));
        EXPECT_TRUE(all_close(g.dv, mine(x.dv), "dv " + what, kDims, testing::gradient_tolerance(torch::kFloat, x.dv)));
        const UlyssesVolume volume = hybrid_volume(2, hq, hkv, chunk * p, d, mesh, sizeof(float));
        EXPECT_EQ(r.stats.bytes_ulysses + r.stats.bytes_ring, volume.forward_bytes) << "forward bytes, " << what;
        EXPECT_EQ(g.stats.bytes_ulysses + g.stats.bytes_ring, volume.backward_bytes) << "backward bytes, " << what;
      }
    }
  });
}

CP_TEST(Lesson11, Task2_TheEndsOfTheMeshAreTheRingAndUlysses) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    torch::Generator gen = at::detail::createCPUGenerator(310);
    const torch::Tensor q = torch::randn({1, 2 * p, 6, 32}, gen), k = torch::randn({1, p, 6, 32}, gen),
                        v = torch::randn({1, p, 6, 32}, gen);
    const HybridResult ring_end = hybrid_attention_forward(make_hybrid_comms(comm, {1, p}), q, k, v, hybrid_options(true));
    const RingResult ring = zigzag_ring_attention_forward(comm, q, k, v, ring_options(true));
    EXPECT_TRUE(torch::equal(ring_end.out, ring.out)) << "1 x P is lesson 07's zig-zag ring, rank " << comm.rank();
    EXPECT_TRUE(torch::equal(ring_end.lse, ring.lse)) << "1 x P is lesson 07's zig-zag ring, rank " << comm.rank();
    EXPECT_EQ(ring_end.stats.bytes_ulysses, 0);
    const HybridResult ulysses_end = hybrid_attention_forward(make_hybrid_comms(comm, {p, 1}), q, k, v,
                                                              hybrid_options(true));
    const UlyssesResult ulysses = ulysses_attention_forward(comm, q, k, v, ulysses_options(true, TokenLayout::ZigZag));
    // The same attention of the same tokens; the order of the keys differs, so only up to rounding.
    EXPECT_TRUE(all_close(ulysses_end.out, ulysses.out, "P x 1 against lesson 10's Ulysses", kDims));
    EXPECT_TRUE(all_close(ulysses_end.lse, ulysses.lse, "P x 1 against lesson 10's Ulysses (lse)", {"b", "h", "s"}));
    EXPECT_EQ(ulysses_end.stats.bytes_ulysses, ulysses.stats.bytes_sent);
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
      const HybridGrads g = hybrid_attention_backward(comms, t, t, t, t, r.out, r.lse, hybrid_options(true));
      EXPECT_EQ(r.out.sizes(), t.sizes());
      EXPECT_EQ(r.lse.sizes(), t.sizes().slice(0, 3));
      EXPECT_EQ(g.dk.sizes(), t.sizes());
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
      {"comms not made", [] {
         const torch::Tensor t = torch::zeros({1, 2, 4, 32});
         hybrid_attention_forward(HybridComms{}, t, t, t);
       }, "make_hybrid_comms"},
  });
}

}  // namespace
}  // namespace cp
