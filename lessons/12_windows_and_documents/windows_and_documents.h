// Lesson 12 — masks beyond causal, sliding windows and packed documents, under context
// parallelism: the contract the tests use.
//
// Lesson 03's AttentionMask now has a sliding window and documents, and its kernels skip every
// tile they exclude. This lesson puts them on the ring: which blocks a mask leaves visible, how
// many ring steps a window needs (the ring stops early and sends less), the work each layout gives
// each rank, and sequences and documents of any length (padding that never attends and is never
// attended). The learner writes windows_and_documents.cpp.
#pragma once

#include <torch/types.h>

#include <optional>
#include <string>
#include <vector>

#include "context_parallel_attention.h"
#include "zigzag.h"

namespace cp {

/// The mask of a whole sequence of T tokens at positions 0 … T − 1, beyond lesson 04's plain
/// causal flag: key j is visible to query i as in lesson 03's AttentionMask.
struct SequenceMask {
  bool causal = true;
  int64_t window = 0;       ///< sliding window of W keys (causal only); 0: none
  torch::Tensor documents;  ///< cu_seqlens int64 [n + 1] of the T tokens; undefined: one document
};

/// The checks of a mask over `tokens` tokens: lesson 03's check_mask, and documents that end at
/// `tokens`. Errors name the field (mask.window, mask.documents).
void check_sequence_mask(const SequenceMask& mask, int64_t tokens);

// ── Task 1: which pairs of a block are visible ──────────────────────────────────────────────

enum class Visibility {
  None,  ///< no query sees any key: skip the block
  Some,  ///< some pairs are visible: compute the block with the mask
  All    ///< every query sees every key: compute the block without a mask
};

std::string to_string(Visibility visibility);

/// Whether the queries at `q_positions` see none, some or all of the keys at `k_positions` (int64
/// 1-D on the CPU, any order) under `mask`. No queries or no keys: None.
Visibility block_visibility(const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                            const SequenceMask& mask);

/// A ring schedule under `mask`, on top of `base` (one of lessons 04 and 07, or layout_schedule):
/// the same positions; each block `base` plans is refined by block_visibility (None: skipped, All:
/// computed without a mask, Some: computed with the mask, window and documents included); and
/// steps = masked_ring_steps, so that the ring stops after the last step any rank needs.
RingSchedule masked_schedule(const RingSchedule& base, const SequenceMask& mask);

// ── Task 2: how many ring steps ─────────────────────────────────────────────────────────────

/// The ring steps the ring must run under masked_schedule(base, mask) with `world` ranks of
/// `chunk` tokens: 1 + the latest step t at which any rank computes a block (step t brings rank
/// r the chunk of rank r − t). The same on every rank, so every rank stops together.
int masked_ring_steps(const RingSchedule& base, const SequenceMask& mask, int world, int64_t chunk, bool causal);

// ── Task 3: the prediction ──────────────────────────────────────────────────────────────────

/// The ring steps a sliding window of W keys needs (no documents) over S tokens on N ranks in
/// `layout` (S divisible by N, by 2N for the zig-zag), from the layout alone: equal to
/// masked_ring_steps of that layout's schedule. README, "A window on the ring".
int window_ring_steps(TokenLayout layout, int64_t seq, int world, int64_t window);

// ── Task 4: the work model ──────────────────────────────────────────────────────────────────

/// The visible (query, key) pairs of the queries at `positions` (int64 1-D) under `mask` over
/// `tokens` tokens: the work of a rank with a perfect mask. Positions >= tokens are padding: no
/// work. With mask = causal only, it is lesson 07's causal_work of a rank.
int64_t masked_work(const torch::Tensor& positions, const SequenceMask& mask, int64_t tokens);

/// max / mean of the ranks' work: 1 is perfectly balanced (1 when there is no work at all).
double imbalance(const std::vector<int64_t>& work);

// ── Task 5: any length ──────────────────────────────────────────────────────────────────────

/// Where T tokens live on N ranks, padded so that every rank holds the same number of rows: rank
/// r's rows hold the tokens at positions[r] (int64 [rows], ascending within each chunk), where a
/// position < T is a real token and a position >= T is padding (no document holds it: it never
/// attends and is never attended).
struct PaddedLayout {
  std::string name;
  int64_t tokens = 0;                    ///< T: real tokens
  int64_t rows = 0;                      ///< rows per rank: N · rows >= T
  std::vector<torch::Tensor> positions;  ///< one per rank
};

/// T tokens in one of lesson 07's layouts, padded at the end to a multiple of N (2N for the
/// zig-zag): the padding takes positions T … S' − 1.
PaddedLayout padded_layout(TokenLayout layout, int64_t tokens, int world);

/// The packed documents of `documents` (cu_seqlens, int64 [n + 1]) zig-zag per document: each
/// document is padded to a multiple of 2N and cut into 2N chunks, and rank r holds chunks r and
/// 2N − 1 − r of every document, document after document. Each padding slot takes the next unused
/// position from T on.
PaddedLayout document_zigzag_layout(const torch::Tensor& documents, int world);

/// Padding rows over real tokens: (N · rows − T) / T (0 for T = 0).
double padding_overhead(const PaddedLayout& layout);

/// Rank `rank`'s rows of the sequence `full` [B, H, T, D] under `layout`: the rows of real tokens
/// copied, padding rows zero.
torch::Tensor shard_padded(const torch::Tensor& full, const PaddedLayout& layout, int rank);

/// The sequence [B, H, T, D] from every rank's rows (shards[r] from rank r): the inverse of
/// shard_padded, padding dropped.
torch::Tensor unshard_padded(const std::vector<torch::Tensor>& shards, const PaddedLayout& layout);

/// The ring schedule of a padded layout: its positions, and every block planned whole with the
/// causal mask (causal) or without one; masked_schedule refines it.
RingSchedule layout_schedule(const PaddedLayout& layout);

/// Ring attention forward and backward of this rank's rows under `mask` over the layout's T
/// tokens: options.schedule = masked_schedule(layout_schedule(layout), mask with the padding
/// outside every document), options.causal = mask.causal. q, k, v, dout, out: [B, H, rows, D].
RingResult masked_ring_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const PaddedLayout& layout,
                                         const SequenceMask& mask, RingOptions options = {});
RingGrads masked_ring_attention_backward(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q,
                                         const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                         const torch::Tensor& lse, const PaddedLayout& layout,
                                         const SequenceMask& mask, RingOptions options = {});

/// The all-gather variant under a sliding window of `window` keys (causal), on contiguous shards
/// q [B, Hq, S/N, D], k, v [B, Hkv, S/N, D]: instead of gathering every chunk (lesson 08), rank r
/// receives only the K/V of the g = min(r, ⌈(W − 1)/c⌉) ranks before it (each rank sends its
/// chunk to the ranks after it that need it, at once), attends to those g + 1 chunks under the
/// window, and the backward sends each received chunk's dK/dV back to its owner. stats.bytes_sent:
/// the K/V (forward) or K/V and float32 dK/dV (backward) this rank sent.
RingResult windowed_gather_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                             const torch::Tensor& v, int64_t window,
                                             std::optional<double> scale = std::nullopt);
RingGrads windowed_gather_attention_backward(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q,
                                             const torch::Tensor& k, const torch::Tensor& v,
                                             const torch::Tensor& out, const torch::Tensor& lse, int64_t window,
                                             std::optional<double> scale = std::nullopt);

/// Lesson 09's strategy for the ring under `mask` (causal) on `layout`'s shards (contiguous or
/// zig-zag; S divisible by 2N, as lesson 09's layer shards it), for every sequence of the batch:
/// the layer of lesson 09, and the course demo, train and run with a window or documents.
Strategy masked_ring_strategy(TokenLayout layout, const SequenceMask& mask);

}  // namespace cp
