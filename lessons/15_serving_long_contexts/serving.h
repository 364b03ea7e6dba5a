// Lesson 15 — serving long contexts: the contract the tests use.
//
// Context parallelism for inference. A prompt's keys and values stay in a KV cache sharded over
// the N ranks; new tokens arrive in a prefill (T tokens after P cached ones) or one at a time in
// decode. The learner writes, in serving.cpp: where each new token lives (task 1), the prefill
// that passes K/V around the ring (task 2), the prefill that passes the queries instead and
// returns partial results to their owners (task 3), the choice between the two (task 4), and a
// decode step over a batch of sequences, whose partial results are merged by a gather or a tree
// (task 5). Everything is exact attention: the tests compare it with float64 attention over the
// whole sequence on one device.
#pragma once

#include <torch/types.h>

#include <optional>
#include <string>
#include <vector>

#include "block_attention.h"
#include "common/comm.h"
#include "common/trace.h"
#include "planner.h"

namespace cp {

/// One rank's shard of one sequence's KV cache: the keys and values of the tokens this rank
/// holds, with their global positions (any order: the causal mask compares positions).
struct KvCacheShard {
  torch::Tensor k;          ///< [1, Hkv, n, D]
  torch::Tensor v;          ///< [1, Hkv, n, D]
  torch::Tensor positions;  ///< int64 [n], on k's device
};

/// An empty shard: n = 0, Hkv heads of D, in `options`' dtype and device.
KvCacheShard empty_cache_shard(int64_t heads_kv, int64_t head_dim, const torch::TensorOptions& options);

/// Checks a shard (k, v [1, Hkv, n, D] alike, positions int64 [n] on their device, none
/// negative): a cp::Error naming the field (`arg`.k, `arg`.v, `arg`.positions).
void check_cache_shard(const KvCacheShard& shard, const std::string& arg);

/// Appends tokens to a shard, in place: k, v [1, Hkv, t, D] at `positions` (int64 [t]). The
/// shard's tensors become the first n + t rows of a buffer with room for more (an eighth, at
/// least 64 tokens), so that appending one token copies one token; a buffer that another tensor
/// shares (a copy of the shard) is never written, the shard moves to a new one first.
void cache_append(KvCacheShard& shard, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& positions);

// ── Task 1: where the tokens live ───────────────────────────────────────────────────────────

/// Task 1. The global positions of the new tokens [first, first + count) that rank `rank` of
/// `world` computes in a prefill, ascending: lesson 07's zig-zag over the new tokens only. The new
/// tokens are cut, in order, into 2N consecutive parts whose sizes differ by at most one; part i
/// begins at the token where the mark i/(2N) of the way through them falls (rounded down to a
/// whole token), and rank r takes parts r and 2N − 1 − r. Any count >= 0 (a rank may get none).
/// The new tokens' K/V stay in the cache of the rank that computed them. A cp::Error for
/// first < 0, count < 0, world < 1 or a rank outside the world.
torch::Tensor prefill_positions(int64_t first, int64_t count, int world, int rank);

/// Task 1. The rank whose cache keeps the token at `position` when it arrives in decode: round
/// robin from rank 0 (position 0 on rank 0, each next position on the next rank), so that a
/// growing sequence grows every shard in turn. A cp::Error for a negative position or world < 1.
int decode_owner(int64_t position, int world);

// ── Tasks 2 and 3: the prefill ──────────────────────────────────────────────────────────────

/// A prefill's result on one rank.
struct PrefillResult {
  torch::Tensor out;       ///< [1, Hq, t, D], dtype of q: this rank's new queries
  torch::Tensor lse;       ///< [1, Hq, t] float32
  int64_t bytes_sent = 0;  ///< payload this rank sent (prefill_bytes; the tests also count it)
};

/// The two exact ring prefills: pass-KV moves every rank's K/V (its cache shard and its new
/// tokens'), pass-Q moves the new queries and returns the partial (out, lse) of each to its owner.
enum class PrefillVariant { PassKV, PassQ };
std::string to_string(PrefillVariant variant);

/// Task 2. Pass-KV prefill. On every rank:
/// @param q       [1, Hq, t, D]: this rank's new queries, at `positions`
/// @param k, v    [1, Hkv, t, D]: their keys and values (Hq divisible by Hkv)
/// @param positions int64 [t]: global positions of the new tokens (prefill_positions)
/// @param cache   this rank's shard of the tokens cached before (positions below every new one);
///                the new k, v are appended to it
/// @param scale   softmax scale (default 1/√D)
/// @param trace   if set, a span on lane "compute" of this rank around each ring step's attention
///                (lesson 04's Trace): the tests check that each step but the last computes while
///                the next block is in flight
/// @return out, lse of the new queries over every cached and new key at or before their position.
/// CPU float32/float64; CUDA float32/float16/bfloat16 (lesson 03's kernel). A cp::Error on every
/// rank, before anything is sent, when any rank's inputs disagree (shapes, dtype, device, a cache
/// whose positions do not match its keys, a new position not after every cached one) or when the
/// shards do not hold each position before the new tokens exactly once (a cache sharded over a
/// world of another size).
PrefillResult pass_kv_prefill(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& positions, KvCacheShard& cache,
                              std::optional<double> scale = std::nullopt, Trace* trace = nullptr);

/// Task 3. Pass-Q prefill: pass_kv_prefill's contract, the queries travelling instead of K/V. The
/// owner of a block of queries merges its N partial results in an order fixed by the ranks (not by
/// the order in which messages arrive), so that the same inputs give the same bits on every run.
PrefillResult pass_q_prefill(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& positions, KvCacheShard& cache,
                             std::optional<double> scale = std::nullopt, Trace* trace = nullptr);

/// Bytes rank `rank` sends in a prefill (given: the formula tasks 2 and 3 are tested against).
/// `cached[j]`, `fresh[j]`: the cached and new tokens of rank j. A token's position travels with
/// it (8 bytes). Pass-KV: every rank's K/V but the next rank's, (2·Hkv·D·e + 8) bytes a token.
/// Pass-Q: every rank's queries but the next rank's, (Hq·D·e + 8) a token; then the partials of
/// the other ranks' queries back to their owners, (Hq·D·e + 4·Hq) a token.
int64_t prefill_bytes(PrefillVariant variant, const std::vector<int64_t>& cached, const std::vector<int64_t>& fresh,
                      int rank, int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t element_size);

// ── Task 4: which prefill ───────────────────────────────────────────────────────────────────

/// One prefill to plan: T new tokens after P cached ones, on N GPUs of one node.
struct PrefillCase {
  int64_t new_tokens = 0;     ///< T
  int64_t cached_tokens = 0;  ///< P
  int64_t heads_q = 0, heads_kv = 0, head_dim = 0;
  int64_t element_size = 2;
  int world = 1;
};

/// A prediction for each variant and the choice.
struct PrefillChoice {
  double pass_kv_ms = 0, pass_q_ms = 0;  ///< predicted attention time of one layer
  PrefillVariant choice = PrefillVariant::PassKV;
  std::string reason;  ///< names the choice, both times, and what decided
};

/// Task 4. Predicts the attention time of both variants on `cluster`'s NVLink (one node) with the
/// step model of the README ("Task 4": what a step computes and at which throughput, what it
/// sends, what overlaps and what is exposed) and chooses the faster (pass-KV on a tie).
PrefillChoice choose_prefill(const PrefillCase& c, const Cluster& cluster);

// ── Task 5: decode ──────────────────────────────────────────────────────────────────────────

/// How a decode step merges the ranks' partial results.
enum class DecodeMerge {
  Gather,  ///< all-gather every partial; every rank merges them in rank order (1 round)
  Tree,    ///< pairwise merges up a binomial tree to rank 0 (⌈log₂ N⌉ rounds), then a broadcast
};
std::string to_string(DecodeMerge merge);

/// A decode step's result, the same on every rank (bitwise).
struct DecodeResult {
  torch::Tensor out;       ///< [B, Hq, 1, D], dtype of q
  torch::Tensor lse;       ///< [B, Hq, 1] float32
  int64_t bytes_sent = 0;  ///< payload this rank sent (decode_bytes; the tests also count it)
  int rounds = 0;          ///< rounds of communication in a row on the critical path (decode_bytes)
};

/// Task 5. One decode step of B sequences. On every rank:
/// @param q        [B, Hq, 1, D]: each sequence's new query, the same on every rank
/// @param k, v     [B, Hkv, 1, D]: its key and value, the same on every rank
/// @param positions int64 [B]: its position (the sequence's length before it), the same on every rank
/// @param caches   B shards, this rank's of each sequence; the new token is appended to the shard
///                 of its decode_owner first, and attends to itself
/// Each rank attends its shards (a shard without tokens gives lse = −inf), then the partials are
/// merged as `merge` says. The same checks as the prefill's, plus caches.size() == B and the same
/// positions on every rank.
DecodeResult decode_step(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& positions, std::vector<KvCacheShard>& caches, DecodeMerge merge,
                         std::optional<double> scale = std::nullopt);

/// What a decode step sends from rank `rank` (given: the formula task 5 is tested against).
/// A round is one layer of communication that must finish before the next can start: a message
/// that waits for the one before it (a tree's next level), or one collective (an all-gather, a
/// broadcast), however many messages it sends at once. Rounds count the critical path, the same
/// on every rank.
/// Gather: its partial (out in the dtype, e bytes; lse float32) to each of the N − 1 others: one
/// round, the all-gather. Tree: its float32 accumulator (out and lse) once to its parent, up
/// ⌈log₂ N⌉ levels; rank 0 then broadcasts the result (out in the dtype, lse float32) to the N − 1
/// others: ⌈log₂ N⌉ + 1 rounds.
struct DecodeVolume {
  int64_t bytes = 0;
  int rounds = 0;
};
DecodeVolume decode_bytes(DecodeMerge merge, int world, int rank, int64_t batch, int64_t heads_q, int64_t head_dim,
                          int64_t element_size);

}  // namespace cp
