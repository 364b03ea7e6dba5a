// Lesson 08 — all-gather context parallelism, Llama 3 style: the contract the tests use.
//
// A packed batch of documents (varlen: tokens of all documents one after the other, document d
// at [cu_seqlens[d], cu_seqlens[d+1])) is sharded zig-zag *per document*: each document of
// length L is cut into 2N chunks of L/(2N) tokens and rank r holds chunks r and 2N−1−r of every
// document, document after document. Instead of passing K/V around a ring, every rank gathers
// all K/V at once (one all-gather: small with GQA), then attends its queries to what they need.
// The learner writes llama3_allgather.cpp.
#pragma once

#include <torch/types.h>

#include <optional>
#include <string>
#include <vector>

#include "common/comm.h"
#include "common/trace.h"
#include "ring_attention_backward.h"

namespace cp {

/// How the two query groups of a rank are computed; the results are identical.
enum class Llama3Mode {
  TwoKernels,  ///< one varlen attention call per group: early queries over the first half of each
               ///< document, late queries over the whole gathered K/V (no copy)
  Fused        ///< one call over K/V slices laid out next to their queries: each document's first
               ///< half and the whole document, duplicated into one packed buffer
};

std::string to_string(Llama3Mode mode);

/// Checks cu_seqlens (int64 or int32 [D+1] on any device: 0, strictly increasing, ending at
/// `total` unless total < 0, every document length divisible by 2N) and returns it on the host.
/// D = 0 ([0]) is an empty batch, valid like every empty input of the course. Errors name the
/// document and say what was expected.
std::vector<int64_t> check_cu_seqlens(const torch::Tensor& cu_seqlens, int64_t total, int world);

/// The packed indices (int64 [T/N]) of the tokens rank `rank` holds, in its local order: for
/// each document, chunk r then chunk 2N−1−r.
torch::Tensor zigzag_varlen_positions(const torch::Tensor& cu_seqlens, int world, int rank);

/// Rank `rank`'s rows of the packed tensor `full` [T, ...] (along dim 0).
torch::Tensor zigzag_varlen_shard(const torch::Tensor& full, const torch::Tensor& cu_seqlens, int world, int rank);

/// The packed tensor [T, ...] from the shards of all ranks (shards[r] from rank r): the inverse
/// of zigzag_varlen_shard.
torch::Tensor zigzag_varlen_unshard(const std::vector<torch::Tensor>& shards, const torch::Tensor& cu_seqlens);

/// Segments of a packed varlen attention call: query segment i (rows [cu_q[i], cu_q[i+1]))
/// attends to key segment i only, causally by the positions *inside the document*.
struct VarlenSegments {
  std::vector<int64_t> cu_q, cu_k;  ///< host, both of size segments + 1, starting at 0
  torch::Tensor q_positions;        ///< int64 [Tq]: each query's position in its document
  torch::Tensor k_positions;        ///< int64 [Tk]: each key's position in its document
};

/// Varlen causal attention (what flash_attn_varlen_func does in one launch; here a loop of
/// lesson 03 blocks, one per segment).
/// @param q [Tq, Hq, D]   @param k, v [Tk, Hkv, D], Hq divisible by Hkv
/// @return out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] float32 (the varlen convention)
AttnResult varlen_attention_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const VarlenSegments& segments, std::optional<double> scale = std::nullopt);

/// Backward of varlen_attention_forward (lesson 05's block backward per segment).
/// @return dq [Tq, Hq, D], dk, dv [Tk, Hkv, D], float32
AttnGrads varlen_attention_backward(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                    const VarlenSegments& segments, std::optional<double> scale = std::nullopt);

/// One varlen attention call of a rank: which local queries, against which rows of the
/// gathered K/V (in document order), cut into segments.
struct Llama3Call {
  torch::Tensor q_rows;   ///< int64 [Tq]: local query rows in call order; undefined: all, in local order
  torch::Tensor kv_rows;  ///< int64 [Tk]: rows of the gathered K/V in call order; undefined: all of them
  VarlenSegments segments;
};

/// The calls rank `rank` makes in `mode`: TwoKernels gives two (early group, then late group),
/// Fused gives one. cu_seqlens as returned by check_cu_seqlens.
std::vector<Llama3Call> llama3_plan(const std::vector<int64_t>& cu_seqlens, int world, int rank, Llama3Mode mode);

/// The query × key pairs of one call, per head: each segment's rows times its keys (masked pairs
/// included), what Llama3Stats::pairs adds up. Lesson 14's planner counts with it too.
int64_t call_pairs(const Llama3Call& call);

struct Llama3Options {
  std::optional<double> scale;  ///< default 1/sqrt(D)
  Trace* trace = nullptr;       ///< if set, the collective and each call are recorded in it
};

/// What a call of the forward or backward cost this rank.
struct Llama3Stats {
  int64_t pairs = 0;       ///< query × key pairs computed, per head (masked ones included)
  int64_t bytes_sent = 0;  ///< what this rank sends in the collectives, counted as a ring all-gather
                           ///< or reduce-scatter does: (N−1) × its shard
};

struct Llama3Result {
  torch::Tensor out;  ///< [T/N, Hq, D], dtype of q, local order
  torch::Tensor lse;  ///< [Hq, T/N] float32
  Llama3Stats stats;
};

struct Llama3Grads {
  torch::Tensor dq, dk, dv;  ///< shapes and dtypes of q, k, v (local order)
  Llama3Stats stats;
};

/// Causal attention inside each document of a zig-zag-sharded packed batch.
/// @param q          [T/N, Hq, D] this rank's queries (local order)
/// @param k, v       [T/N, Hkv, D]
/// @param cu_seqlens the *global* document boundaries (same on every rank)
Llama3Result zigzag_llama3_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                             const torch::Tensor& v, const torch::Tensor& cu_seqlens,
                                             Llama3Mode mode = Llama3Mode::TwoKernels, const Llama3Options& options = {});

/// Its backward: out and lse from the forward, dout the gradient of this rank's out.
Llama3Grads zigzag_llama3_attention_backward(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q,
                                             const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                             const torch::Tensor& lse, const torch::Tensor& cu_seqlens,
                                             Llama3Mode mode = Llama3Mode::TwoKernels,
                                             const Llama3Options& options = {});

}  // namespace cp
