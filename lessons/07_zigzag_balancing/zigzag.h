// Lesson 07 — zig-zag load balancing: the contract the tests use.
//
// With a causal mask, the contiguous layout gives rank N−1 about twice the mean work. The
// zig-zag layout cuts the sequence into 2N chunks and gives rank r chunks r and 2N−1−r, so that
// every rank does the same work at every ring step. The learner writes zigzag.cpp.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

#include "ring_attention_backward.h"

namespace cp {

enum class TokenLayout {
  Contiguous,  ///< rank r: tokens [r·S/N, (r+1)·S/N)
  ZigZag,      ///< 2N chunks of S/(2N) tokens; rank r: chunks r and 2N−1−r
  Stripe       ///< rank r: tokens t with t mod N = r
};

std::string to_string(TokenLayout layout);

/// The global positions (int64 [S/N], ascending) of the tokens rank `rank` holds. S must be
/// divisible by N (by 2N for the zig-zag layout): a cp::Error otherwise.
torch::Tensor layout_positions(TokenLayout layout, int64_t seq, int world, int rank);

/// Rank `rank`'s tokens of the whole sequence `full` (along `dim`), in position order.
torch::Tensor shard_sequence(const torch::Tensor& full, TokenLayout layout, int world, int rank, int64_t dim = 2);

/// The whole sequence from the shards of all ranks (shards[r] from rank r): the inverse of
/// shard_sequence.
torch::Tensor unshard_sequence(const std::vector<torch::Tensor>& shards, TokenLayout layout, int64_t dim = 2);

/// The causal work model: for each rank, the number of (query, key) pairs it must compute with
/// a perfect mask — its queries against all keys at or before them.
std::vector<int64_t> causal_work(TokenLayout layout, int64_t seq, int world);

/// The ring schedules of the zig-zag and stripe layouts (RingOptions::schedule).
RingSchedule zigzag_schedule();
RingSchedule stripe_schedule();

/// Ring attention forward/backward on zig-zag shards [B, H, S/N, D] (rank r: chunks r and
/// 2N−1−r): lessons 04 and 05 with options.schedule = zigzag_schedule().
RingResult zigzag_ring_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, RingOptions options = {});
RingGrads zigzag_ring_attention_backward(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q,
                                         const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                         const torch::Tensor& lse, RingOptions options = {});

}  // namespace cp
