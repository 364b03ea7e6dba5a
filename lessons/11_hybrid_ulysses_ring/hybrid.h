// Lesson 11 — hybrid context parallelism, Ulysses × ring: the contract the tests use.
//
// The P ranks form a mesh of P_u × P_r: groups of P_u consecutive ranks run Ulysses among
// themselves (lesson 10: all-to-all, heads split P_u ways), and the P_r groups run the zig-zag
// ring across each other (lesson 07) on their share of the heads (J. Fang and S. Zhao, "USP: A
// Unified Sequence Parallelism Approach for Long Context Generative AI", 2024). The learner
// writes hybrid.cpp.
#pragma once

#include <torch/types.h>

#include <memory>
#include <optional>

#include "common/comm.h"
#include "common/trace.h"
#include "ulysses.h"
#include "zigzag.h"

namespace cp {

/// The factorisation P = ulysses · ring.
struct HybridMesh {
  int ulysses = 1;  ///< P_u: ranks per Ulysses group (consecutive ranks)
  int ring = 1;     ///< P_r: groups, around the ring
};

/// The two communicators of one rank of the mesh: rank r = g·P_u + u is rank u of Ulysses group
/// g (ranks g·P_u … g·P_u + P_u − 1) and rank g of ring u (ranks u, u + P_u, u + 2·P_u, …).
struct HybridComms {
  HybridMesh mesh;
  std::shared_ptr<Comm> ulysses;  ///< P_u ranks
  std::shared_ptr<Comm> ring;     ///< P_r ranks
};

/// Task 1. Splits `comm` into the mesh's communicators (collective over comm). A cp::Error when
/// mesh.ulysses · mesh.ring differs from comm.size() or either is < 1.
HybridComms make_hybrid_comms(Comm& comm, HybridMesh mesh);

/// The mesh the course picks for P ranks when none is given: the largest P_u with P_u² ≤ P that
/// divides P and Hq and suits Hkv (ulysses_kv_heads), P_r = P / P_u (P = 4: 2 × 2).
HybridMesh default_hybrid_mesh(int world, int64_t heads_q, int64_t heads_kv);

/// The bytes one rank sends in a forward and a backward, from the formulas: Ulysses over the P_u
/// ranks of its group for the group's S/P_r tokens (ulysses_volume), plus lesson 07's ring over
/// the P_r groups for the K/V of the rank's ulysses_kv_heads/P_u heads: P_r − 1 hops of K and V
/// forward and backward, and backward P_r hops of the float32 dK, dV (lesson 05: N hops, the last
/// one home; none when P_r = 1). A mesh of 1 × P is the ring's volume, P × 1 Ulysses'.
UlyssesVolume hybrid_volume(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq, int64_t head_dim,
                            HybridMesh mesh, int64_t element_size);

/// Options of the hybrid forward and backward.
struct HybridOptions {
  bool causal = false;
  std::optional<double> scale;  ///< default 1/sqrt(D)
  /// If set, spans are recorded under this rank's world rank g·P_u + u: "comm" for the
  /// all-to-alls; the ring's own spans when P_u = 1 (its ranks are then the world's), one
  /// "compute" span around the ring otherwise (its ranks 0 … P_r − 1 are not world ranks).
  Trace* trace = nullptr;
};

/// What one call cost this rank.
struct HybridStats {
  int64_t bytes_ulysses = 0;  ///< sent in the all-to-alls of the Ulysses group
  int64_t bytes_ring = 0;     ///< sent around the ring
  int64_t pairs = 0;          ///< query × key pairs computed, in pairs of one head (the ring's pairs
                              ///< over this rank's H/P_u heads, divided by P_u), summed over the batch
};

struct HybridResult {
  torch::Tensor out;  ///< [B, Hq, S/P, D], dtype of q
  torch::Tensor lse;  ///< [B, Hq, S/P] float32
  HybridStats stats;
  /// For hybrid_attention_backward: what the ring ran on, q, k, v, out, lse in the group's head
  /// split (lesson 10's UlyssesSaved over the P_u ranks of the group), in the ring's zig-zag order.
  UlyssesSaved saved;
};

struct HybridGrads {
  torch::Tensor dq, dk, dv;  ///< shapes and dtypes of q, k, v
  HybridStats stats;
};

/// Task 2. Hybrid attention forward. The sequence is zig-zag sharded over all P ranks (lesson 07:
/// rank r holds chunks r and 2P−1−r of 2P), so S must be divisible by 2P. The tokens of a
/// Ulysses group are then exactly chunks g and 2P_r−1−g of the ring's zig-zag layout, once the
/// all-to-all's result is put in position order.
/// @param q [B, Hq, S/P, D]; k, v [B, Hkv, S/P, D]; Hq divisible by P_u, Hkv as ulysses_kv_heads
///          wants for P_u ranks. P_u = 1 is lesson 07's zig-zag ring; P_r = 1 is lesson 10.
///          Every rank passes the same shapes, dtype and device kind.
/// CPU: float32/float64; CUDA tensors: float32/float16/bfloat16, D in {32, 64, 128} (lesson 03).
/// Empty input (B = 0 or S = 0) gives empty results. A cp::Error names the argument for: comms not made by make_hybrid_comms, heads that
/// do not suit P_u, S not divisible by 2P, shapes that differ across ranks.
HybridResult hybrid_attention_forward(const HybridComms& comms, const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const HybridOptions& options = {});

/// Task 3. Hybrid attention backward: dout [B, Hq, S/P, D] to the group's head split and the
/// ring's order, lesson 07's zig-zag ring backward on what the forward saved
/// (HybridResult::saved), dq, dk, dv back; dk, dv of K/V heads replicated for the group are
/// summed over their copies. options are the forward's. A cp::Error names `dout` or `saved`
/// when they do not fit each other (check_ulysses_saved over the group).
HybridGrads hybrid_attention_backward(const HybridComms& comms, const torch::Tensor& dout, const UlyssesSaved& saved,
                                      const HybridOptions& options = {});

/// The hybrid on `mesh` as a strategy of lesson 09's layer (causal, zig-zag shards); its name
/// says the mesh, P_u x P_r ("hybrid 2x2"). Its StrategyForward::saved is the forward's
/// HybridResult::saved, packed by to_saved_tensors (lesson 10).
Strategy hybrid_strategy(HybridMesh mesh);

}  // namespace cp
