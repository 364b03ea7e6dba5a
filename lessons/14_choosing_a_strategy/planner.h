// Lesson 14 — choosing a strategy: the contract the tests use.
//
// A planner for context parallelism: for the attention of a model, a sequence length and a
// cluster, it predicts what each strategy of the course costs one GPU — the pairs it computes,
// the bytes it sends, the memory it holds, and the time of one layer's forward and backward with
// the transfers overlapped — on every mesh, and recommends one with its reason. Its counts come
// from the course's own schedules and formulas, so they equal what the strategies measure when
// they run; its times come from a cluster's published figures, and are checked against published
// measurements. The learner writes planner.cpp (tasks 1–4); the presets and the program cp_plan
// are given.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hybrid.h"
#include "zigzag.h"

namespace cp {

// ── What is planned for ─────────────────────────────────────────────────────────────────────

/// The attention of a model (every layer alike) at one sequence length. Causal, as every
/// strategy of lesson 09's layer.
struct AttentionShape {
  std::string model;         ///< a name for the tables ("Llama-3.1-8B")
  int64_t layers = 1;
  int64_t batch = 1;         ///< sequences per step, each of `seq` tokens
  int64_t heads_q = 1;       ///< Hq
  int64_t heads_kv = 1;      ///< Hkv, dividing Hq (grouped-query attention)
  int64_t head_dim = 64;     ///< D
  int64_t seq = 0;           ///< S: tokens of one sequence, all GPUs together
  int64_t element_size = 2;  ///< bytes of one element of q, k, v, out and their gradients (2: bfloat16)
};

/// One direction of a link between two GPUs.
struct Link {
  double gbytes_per_s = 0;  ///< bandwidth, 1e9 bytes/s
  double latency_us = 0;    ///< cost of one message, whatever its size
};

/// A cluster: GPUs in nodes, how fast one GPU computes attention and moves memory, and its links.
/// The figures are published ones (`source` says where from), not measured by the course.
struct Cluster {
  std::string name;
  std::string source;
  int gpus_per_node = 1;
  int nodes = 1;
  /// FlashAttention's throughput on one GPU, in useful TFLOP/s (1e12 FLOP/s, masked pairs not
  /// counted): forward on blocks without a mask, and with the causal mask on a sequence of
  /// `causal_tokens` (the kernel's tiles on the diagonal make it slower per useful FLOP); backward
  /// likewise. The diagonal's tiles grow as S and the work as S², so a causal call over n tokens
  /// runs at tflops / (1 + (tflops / causal_tflops − 1) · causal_tokens / n): slower below
  /// causal_tokens, nearer the unmasked figure above. predict uses this rule for every causal
  /// call, the ideal's over S included.
  double forward_tflops = 0, forward_causal_tflops = 0;
  double backward_tflops = 0, backward_causal_tflops = 0;
  double causal_tokens = 8192;     ///< the sequence length at which the causal figures hold
  double memory_gbytes_per_s = 0;  ///< HBM bandwidth: the merges of partial results are bound by it
  double launch_us = 0;            ///< fixed cost of one attention call (launch, first and last waves)
  Link intra;                      ///< between GPUs of one node (NVLink)
  Link inter;                      ///< between GPUs of different nodes (one NIC per GPU)
  double memory_gbytes = 0;        ///< memory of one GPU, 1e9 bytes
  int gpus() const { return gpus_per_node * nodes; }
};

// ── What is compared ────────────────────────────────────────────────────────────────────────

enum class PlanStrategy {
  Ring,        ///< lessons 04–05: contiguous shards, K/V around the ring
  ZigZagRing,  ///< lesson 07: zig-zag shards, balanced ring
  StripeRing,  ///< lesson 07: stripe shards (token t on rank t mod P)
  Llama3,      ///< lesson 08: zig-zag shards, K/V all-gathered (two kernels)
  Ulysses,     ///< lesson 10: all-to-all to head shards, attention over the whole sequence
  Hybrid       ///< lesson 11: Ulysses inside groups of P_u consecutive GPUs, zig-zag ring across
};
std::string to_string(PlanStrategy strategy);

/// A strategy on a mesh: the rings and Llama 3 use 1 × P, Ulysses P × 1, the hybrid P_u × P_r
/// with both above 1.
struct Candidate {
  PlanStrategy strategy = PlanStrategy::Ring;
  HybridMesh mesh;
};
std::string to_string(const Candidate& candidate);  ///< "hybrid 2x4"

/// Every candidate for `gpus` GPUs: the three rings, Llama 3, Ulysses, and the hybrid on every
/// factorisation P_u × P_r with P_u, P_r > 1 (P_u ascending). None for fewer than 1 GPU.
std::vector<Candidate> candidates(int gpus);

/// Why `candidate` cannot run `shape`, or "" when it can: the sequence must split into the
/// layout's chunks (S divisible by P, by 2P for zig-zag shards); Ulysses needs P_u to divide Hq
/// and to suit Hkv (lesson 10's ulysses_kv_heads: Hkv divisible by P_u, or P_u by Hkv).
std::string constraint(const Candidate& candidate, const AttentionShape& shape);

// ── Task 1: the work of every ring step ─────────────────────────────────────────────────────

/// What one rank computes at one ring step.
struct RingBlock {
  int source = 0;        ///< whose K/V chunk it holds: (rank − step) mod P
  int64_t q_rows = 0;    ///< the block's queries (BlockPlan::q_len); 0 when the block is skipped
  int64_t k_rows = 0;    ///< its keys (BlockPlan::k_len)
  int64_t pairs = 0;     ///< q_rows · k_rows: pairs computed, masked ones included (what
                         ///< RingStats counts)
  int64_t visible = 0;   ///< of those, the pairs the causal mask keeps (what FlashAttention computes)
  bool masked = false;   ///< the block runs with the causal mask (its kernel is the causal one)
};

/// Task 1. The blocks of the causal ring on `layout`'s shards of one sequence of `seq` tokens
/// over `world` ranks: result[step][rank], steps 0 … P − 1, from the layout's RingSchedule
/// (lesson 04's contiguous_schedule, lesson 07's zigzag_schedule and stripe_schedule) and
/// layout_positions. Per head and sequence. S must be divisible as layout_positions requires.
std::vector<std::vector<RingBlock>> ring_blocks(TokenLayout layout, int64_t seq, int world);

// ── Task 2: time with overlap ───────────────────────────────────────────────────────────────

/// Milliseconds to move `bytes` over `link` in `messages` messages (each pays the latency).
double transfer_ms(int64_t bytes, int messages, const Link& link);

/// The forward throughput, in useful TFLOP/s, of a causal call whose diagonal spans `tokens` query
/// rows (Cluster's rule; given: the planner and lesson 15 use the same one).
double forward_causal_tflops(const Cluster& cluster, double tokens);

/// One ring step of one pass, as the time model sees it.
struct StepCost {
  double compute_ms = 0;   ///< the busiest rank's attention and merge at this step
  double transfer_ms = 0;  ///< moving the chunks that travel during this step
};

/// Task 2. The time of a ring pass whose transfers overlap the compute (double buffering): each
/// step takes the larger of its compute and its transfer, and the steps follow one another.
/// Without overlap, the step takes both, one after the other.
double ring_pass_ms(const std::vector<StepCost>& steps, bool overlap = true);

// ── Task 3: memory ──────────────────────────────────────────────────────────────────────────

/// The attention's memory on one GPU for one layer, in bytes: what the strategy holds at its
/// peak beyond the inputs of the pass (q, k, v in the forward; q, k, v, out, lse, dout in the
/// backward): buffers for chunks in flight, gathered or head-split tensors, float32 accumulators,
/// and the outputs.
struct MemoryEstimate {
  int64_t forward_bytes = 0;
  int64_t backward_bytes = 0;
  int64_t saved_bytes = 0;  ///< what the forward keeps for the backward (q, k, v, out, lse)
};

/// Task 3. The memory model of `candidate` for `shape` (README, "Task 3 — `attention_memory`").
MemoryEstimate attention_memory(const Candidate& candidate, const AttentionShape& shape);

// ── The prediction (given), and task 4: the choice ──────────────────────────────────────────

/// Everything the planner predicts for one candidate on one cluster, per GPU and per layer.
struct Prediction {
  Candidate candidate;
  std::string constraint;       ///< why it cannot run; "" when it can (the rest is then set)
  int64_t pairs = 0;            ///< pairs the busiest GPU computes, forward, per head, summed over
                                ///< the batch, masked ones included (StrategyStats::pairs)
  double imbalance = 0;         ///< busiest GPU's visible pairs / the mean GPU's
  int64_t forward_bytes = 0;    ///< sent by one GPU (StrategyStats::bytes_sent)
  int64_t backward_bytes = 0;
  MemoryEstimate memory;
  double forward_ms = 0;        ///< one layer, transfers overlapped where the strategy can
  double backward_ms = 0;
  double exposed_ms = 0;        ///< of forward + backward, time spent waiting for transfers
  double ideal_ms = 0;          ///< one GPU's forward + backward of the whole batch (causal calls over S), / P
  double efficiency() const { return ideal_ms / (forward_ms + backward_ms); }
};

/// Predicts `candidate` for `shape` on `cluster` (README, "The time model"): the blocks of
/// task 1 and the step times of task 2 for the rings (the hybrid's ring over the P_r groups),
/// exposed collectives for Llama 3 and Ulysses, the memory of task 3, the bytes of lessons 05,
/// 08, 10 and 11. A cp::Error when the mesh does not multiply to cluster.gpus().
Prediction predict(const Candidate& candidate, const AttentionShape& shape, const Cluster& cluster);

/// predict() for every candidate of cluster.gpus(), in candidates() order.
std::vector<Prediction> predict_all(const AttentionShape& shape, const Cluster& cluster);

/// The planner's advice.
struct Recommendation {
  int index = -1;      ///< into the predictions; −1 when none can run
  std::string reason;  ///< one or two sentences a learner can act on
};

/// The attention memory a training step needs on one GPU: every layer's saved tensors, plus the
/// larger of one layer's forward and backward buffers.
int64_t step_memory(const Prediction& prediction, int64_t layers);

/// Task 4. Of the predictions that can run and whose step_memory fits in `memory_bytes`, the
/// fastest (forward + backward); ties go to the earlier one. The reason names it, its predicted
/// efficiency, and the runner-up with how much slower it is ("N% slower", N in any format); when
/// none can run or fit, the index is −1 and the reason says what stopped each.
Recommendation recommend(const std::vector<Prediction>& predictions, int64_t layers, int64_t memory_bytes);

// ── Presets (given) ─────────────────────────────────────────────────────────────────────────

/// The clusters of the README with their published figures: "h100x8" (one node of 8 H100 SXM
/// over NVLink 4), "h800x8" (ring-flash-attention's benchmark machine: H100 silicon, NVLink
/// limited to 400 GB/s), "h100x32-ib" (4 such nodes over 400 Gb/s InfiniBand, one NIC per GPU).
const std::vector<Cluster>& cluster_presets();
/// A cp::Error naming `name` and the presets when there is none of that name.
const Cluster& cluster_preset(const std::string& name);

/// Attention shapes of published models (from their configurations), at `seq` tokens:
/// "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b".
AttentionShape model_preset(const std::string& name, int64_t seq);
std::vector<std::string> model_preset_names();

}  // namespace cp
