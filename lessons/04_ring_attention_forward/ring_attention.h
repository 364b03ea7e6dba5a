// Lesson 04 — ring attention forward: the contract the tests use.
//
// The sequence is split contiguously over the N ranks of `comm`: rank r holds tokens
// [r·S/N, (r+1)·S/N) of q, k and v. K/V chunks travel around the ring (r sends to r+1, receives
// from r−1) while every rank attends its queries to the chunk it currently holds and merges the
// block results with lesson 03's merge. The learner writes ring_attention.cpp.
#pragma once

#include <torch/types.h>

#include <functional>
#include <optional>
#include <vector>

#include "block_attention.h"
#include "common/comm.h"
#include "common/trace.h"

namespace cp {

/// How a ring step moves its tensors: sends `outgoing` (in order) to rank r+1 and receives
/// `incoming` (in the same order) from rank r−1. It may return with the transfer in flight (a
/// batched start) or complete it before returning (the blocking strategies of lesson 06); the
/// ring waits on the Request before it reads `incoming` or writes `outgoing`.
using RingExchange = std::function<Request(Comm& comm, const std::vector<torch::Tensor>& outgoing,
                                           const std::vector<torch::Tensor>& incoming)>;

/// The default RingExchange: one batch of non-blocking sends and receives (Comm::start).
Request batched_ring_exchange(Comm& comm, const std::vector<torch::Tensor>& outgoing,
                              const std::vector<torch::Tensor>& incoming);

/// Which part of a ring step's block to compute: rows [q_begin, q_begin + q_len) of this rank's
/// queries against rows [k_begin, k_begin + k_len) of the K/V chunk in hand, with the causal mask
/// from positions or without any mask (when every pair is visible).
struct BlockPlan {
  bool compute = false;  ///< false: the whole block is masked, skip it
  int64_t q_begin = 0, q_len = 0, k_begin = 0, k_len = 0;
  bool causal_mask = false;
  int64_t window = 0;       ///< the block's sliding window (AttentionMask::window; lesson 12), 0: none
  torch::Tensor documents;  ///< the block's documents (AttentionMask::documents; lesson 12), undefined: none
};

/// The mask of a planned block: the planned rows' positions, causal only if the plan says so.
AttentionMask plan_mask(const BlockPlan& plan, const torch::Tensor& q_positions, const torch::Tensor& k_positions);

/// What the ring computes at each step, for one token layout (which tokens a rank holds): the
/// global positions of a rank's tokens, and the block to compute when rank `rank` holds the K/V
/// chunk of rank `source`. Lesson 04 has the schedule of the contiguous layout; lesson 07 adds
/// those of the zig-zag and stripe layouts.
struct RingSchedule {
  std::function<torch::Tensor(int rank, int world, int64_t chunk, torch::Device device)> positions;
  std::function<BlockPlan(int rank, int source, int world, int64_t chunk, bool causal)> plan;
  /// How many ring steps to run, the same on every rank: steps 0 … steps − 1 bring the chunks of
  /// ranks r, r − 1, …, r − steps + 1, and no block of a later step may be computed (a sliding
  /// window needs only the last few chunks: lesson 12). Unset: N, every chunk visits every rank.
  std::function<int(int world, int64_t chunk, bool causal)> steps;
};

/// The ring steps to run under `schedule` (RingSchedule::steps, or N when it is unset), checked
/// to lie in 1 … N.
int ring_steps(const RingSchedule& schedule, int world, int64_t chunk, bool causal);

/// Rank r holds tokens [r·chunk, (r+1)·chunk). Causal: the own chunk with the mask, earlier chunks
/// whole without it, later chunks skipped.
RingSchedule contiguous_schedule();

/// Options of the ring attention forward and backward.
struct RingOptions {
  bool causal = false;
  std::optional<double> scale;  ///< default 1/sqrt(D)
  /// Start the exchange of the next K/V chunk before computing on the current one (double
  /// buffering). Off: compute, then exchange. The results are identical; only time differs.
  bool overlap = true;
  Trace* trace = nullptr;  ///< if set, compute and communication spans are recorded in it
  RingExchange exchange = batched_ring_exchange;  ///< how chunks move (lesson 06 offers others)
  RingSchedule schedule = contiguous_schedule();  ///< where tokens live, what each step computes (lesson 07 offers others)
};

/// RingOptions with `causal` (and `trace`) set and every other field at its default. Callers set
/// fields by name, never by position, so a field added later cannot change what a call means:
///   RingOptions options = ring_options(true);
///   options.overlap = false;
inline RingOptions ring_options(bool causal, Trace* trace = nullptr) {
  RingOptions options;
  options.causal = causal;
  options.trace = trace;
  return options;
}

/// The work of one computed ring step.
struct StepWork {
  int source;      ///< whose K/V chunk
  int64_t pairs;   ///< query × key pairs of the block computed (per batch and head; masked ones included)
  double ms;       ///< wall time of the block computation
};

/// What one rank did.
struct RingStats {
  int steps_computed = 0;  ///< ring steps whose block was computed
  int steps_skipped = 0;   ///< ring steps run whose block was masked whole (causal: a chunk after all our queries)
  int steps_not_run = 0;   ///< N − ring_steps: steps the schedule stopped before (nothing sent for them)
  int64_t bytes_sent = 0;  ///< payload this rank sent
  std::vector<StepWork> steps;  ///< one entry per computed step
};

/// This rank's share of full attention over the whole sequence.
struct RingResult {
  torch::Tensor out;  ///< [B, Hq, S/N, D], dtype of q
  torch::Tensor lse;  ///< [B, Hq, S/N] float32
  RingStats stats;
};

/// Ring attention forward on this rank's shard (contiguous unless options.schedule says otherwise).
/// @param q     [B, Hq, S/N, D]; k, v [B, Hkv, S/N, D] (GQA: Hq divisible by Hkv). Every rank must
///              pass the same shapes (S divisible by N), dtype and device kind.
RingResult ring_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const RingOptions& options = {});

/// The checks of a ring call: q, k, v as for attention_block_forward, the same on every rank
/// (check_same_on_every_rank), as many tokens of q as of k, an exchange and a schedule that puts
/// S/N positions on every rank. Returns the chunk length S/N.
int64_t check_ring_inputs(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const RingOptions& options);

}  // namespace cp
