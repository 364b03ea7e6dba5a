// Lesson 19 — serving at scale: the contract the tests use.
//
// How a serving engine holds and reads the KV cache of many sequences at once. The cache lives in
// fixed-size pages of one pool, found through a block table per sequence; one step of continuous
// batching attends prefill chunks and decode tokens of different sequences in one call; decode
// context parallelism (DCP) stripes each sequence's tokens over the ranks of a tensor-parallel
// group that would otherwise hold the same cache, and merges the partial results of every head in
// one exchange; MLA keeps one small latent row per token for every head. The learner writes, in
// paged_serving.cpp: the page pool's append and release (task 1), the attention of a mixed batch
// read through the block tables (task 2), where a striped token lives and how many of a shard's
// keys a token sees (task 3), the DCP decode step's limits and exchange (task 4), MLA's absorbed
// decode (task 5) and the cache a model needs per GPU (task 6). Everything is exact attention: the
// tests compare it with float64 attention over each whole sequence on one device.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/comm.h"

namespace cp {

// ── Task 1: the page pool ───────────────────────────────────────────────────────────────────

/// A KV cache in pages (vLLM's PagedAttention): one pool of `pages` pages of `page_size` tokens,
/// a free list, and for each sequence a block table, the list of its pages in token order. A
/// sequence's token i lies in slot i % page_size of page block_table(id)[i / page_size]. Pages
/// are fixed in size, so a sequence wastes less than one page, and a finished sequence's pages
/// serve the next one without moving anything.
class PagedKvCache {
 public:
  /// A pool whose tokens hold `heads_kv` keys of `key_dim` and as many values of `value_dim`.
  /// Every page starts free; pages are taken from the free list, page 0 first. Dtypes: CPU
  /// float32 (the CPU loop reads the pool where it lies, in float32), CUDA float32/float16/
  /// bfloat16. A cp::Error naming the argument for a size below 1 or another dtype.
  PagedKvCache(int64_t pages, int64_t page_size, int64_t heads_kv, int64_t key_dim, int64_t value_dim,
               const torch::TensorOptions& options);

  /// MLA's latent cache (task 5): one row of latent_dim + rope_dim per token and no value pool;
  /// a token's value is the first latent_dim numbers of its row (value_dim() = latent_dim).
  static PagedKvCache latent(int64_t pages, int64_t page_size, int64_t latent_dim, int64_t rope_dim,
                             const torch::TensorOptions& options);

  int64_t pages() const { return key_pages_.size(0); }
  int64_t page_size() const { return key_pages_.size(2); }
  int64_t heads_kv() const { return key_pages_.size(1); }
  int64_t key_dim() const { return key_pages_.size(3); }
  int64_t value_dim() const { return value_dim_; }
  bool is_latent() const { return !value_pages_.defined(); }
  /// [pages, Hkv, page_size, key_dim]: a head's page is page_size rows in a row, read front to back
  const torch::Tensor& key_pages() const { return key_pages_; }
  /// [pages, Hkv, page_size, value_dim]; undefined for a latent cache
  const torch::Tensor& value_pages() const { return value_pages_; }

  /// Starts an empty sequence (no page yet). A cp::Error if `id` is in use.
  void add_sequence(int64_t id);

  /// Task 1. Appends t >= 0 tokens to sequence `id`: k [t, Hkv, key_dim], v [t, Hkv, value_dim]
  /// (undefined for a latent cache), any dtype (copied into the pool's). A sequence takes a page
  /// from the free list only when its last page is full. A cp::Error for an unknown id, a shape
  /// that does not match the pool, or more tokens than the free pages hold (its message says how
  /// many pages are free); after an error nothing has changed (no page taken, no token written,
  /// every sequence as it was).
  void append(int64_t id, const torch::Tensor& k, const torch::Tensor& v = {});

  /// Task 1. Ends sequence `id`: its pages go back to the free list, for any later sequence.
  /// A cp::Error for an unknown id.
  void release(int64_t id);

  int64_t length(int64_t id) const;                         ///< tokens of sequence `id`
  const std::vector<int64_t>& block_table(int64_t id) const;  ///< its pages, in token order
  std::vector<int64_t> sequences() const;                   ///< the ids in use, ascending
  int64_t free_pages() const { return static_cast<int64_t>(free_list_.size()); }
  bool page_is_free(int64_t page) const;  ///< a cp::Error for a page outside the pool

 private:
  struct Sequence {
    std::vector<int64_t> table;  // its pages, in token order
    int64_t length = 0;          // its tokens
  };
  PagedKvCache(torch::Tensor key_pages, torch::Tensor value_pages, int64_t value_dim);
  Sequence& sequence(int64_t id, const char* what);

  torch::Tensor key_pages_, value_pages_;
  int64_t value_dim_ = 0;
  std::vector<int64_t> free_list_;   // the free pages; the next page taken is free_list_.back()
  std::vector<char> page_free_;      // page_free_[p]: page p is on the free list
  std::map<int64_t, Sequence> sequences_;
};

// ── Task 2: continuous batching ─────────────────────────────────────────────────────────────

/// One step of continuous batching: B sequences of a cache, each bringing q_len new query tokens
/// (a prefill chunk: many; a decode step: one), whose keys and values are already appended. The
/// queries of sequence b are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q; they are its last
/// q_len of kv_len tokens, each seeing every token of the sequence up to itself. The tables are
/// host data (a GPU engine copies them to the device once a step).
struct PagedBatch {
  std::vector<int64_t> cu_seqlens_q;               ///< B + 1 offsets, from 0, non-decreasing
  std::vector<int64_t> kv_lens;                    ///< B: each sequence's tokens in the cache
  std::vector<std::vector<int64_t>> block_tables;  ///< B: each sequence's pages
};

/// The batch of sequences `ids` of `cache`, bringing q_lens[b] new tokens each (their kv_len and
/// block table from the cache: given). A cp::Error for an unknown id or a q_len above its length.
PagedBatch make_batch(const PagedKvCache& cache, const std::vector<int64_t>& ids, const std::vector<int64_t>& q_lens);

/// Attention of many query rows of many sequences at once.
struct PagedResult {
  torch::Tensor out;  ///< [T, Hq, value_dim], dtype of q
  torch::Tensor lse;  ///< [T, Hq] float32; −inf for a row that sees no key
};

/// Task 2. One step of continuous batching: q [T, Hq, key_dim] (T = cu_seqlens_q.back(), Hq
/// divisible by Hkv: query head h reads kv head h / (Hq / Hkv)), read against `cache` through
/// the batch's block tables where the keys lie: on the CPU no key or value is copied out of the
/// pool. Each row's result equals attention of that token over its own sequence alone. scale:
/// default 1/√key_dim. CPU float32/float64 (kernels/cpu_decode.h's loop); CUDA tensors (one
/// sequence at a time: its pages gathered, lesson 03's kernel; key_dim = value_dim only). A
/// cp::Error naming the argument, before anything is read, for a q that does not fit the cache, a
/// batch whose sizes disagree, a table entry outside the pool or on a free page, or a kv_len that
/// its pages cannot hold.
PagedResult paged_attention(const torch::Tensor& q, const PagedKvCache& cache, const PagedBatch& batch,
                            std::optional<double> scale = std::nullopt);

// ── Task 3: decode context parallelism, where the tokens live ──────────────────────────────

/// Task 3. The rank of a DCP group of `world` ranks whose shard holds the token at `position`:
/// positions go to the ranks in runs of `interleave` consecutive tokens, rank 0 first, then rank
/// 1, …, and round again (interleave 1: round robin; interleave = page_size: whole pages). A
/// cp::Error for a negative position, world < 1 or interleave < 1.
int dcp_owner(int64_t position, int world, int64_t interleave);

/// Task 3. How many of the positions 0 .. length − 1 rank `rank` holds: the size of its shard of
/// a sequence of `length` tokens. A cp::Error for a negative length, world < 1, interleave < 1 or
/// a rank outside the world.
int64_t dcp_local_length(int64_t length, int rank, int world, int64_t interleave);

// ── Task 4: the DCP decode step ─────────────────────────────────────────────────────────────

/// How the ranks return each other's partial results.
enum class DcpExchange {
  AllToAll,   ///< each rank sends each other rank only that rank's heads: one packed all-to-all
  AllGather,  ///< each rank sends every head's partial to every rank, which keeps its own heads
};
std::string to_string(DcpExchange exchange);

/// A DCP decode step's result on one rank: its own query heads.
struct DcpResult {
  torch::Tensor out;       ///< [B, T, Hq/N, value_dim], dtype of q
  torch::Tensor lse;       ///< [B, T, Hq/N] float32
  int64_t bytes_sent = 0;  ///< payload this rank sent (dcp_bytes; the tests also count it)
};

/// Task 4. One decode step of B sequences, T new tokens each (T = 1, or a token and the draft
/// tokens of speculative decoding, which attend causally among themselves), on the N ranks of
/// `comm`: the ranks of a tensor-parallel group that would each hold the same Hkv kv heads (a
/// GQA head's replicas, MLA's latent). Query heads are split over them, the cache is striped.
/// @param q        [B, T, Hq/N, key_dim]: this rank's query heads (rank r has heads r·Hq/N ..)
/// @param k, v     [B, T, Hkv, key_dim], [B, T, Hkv, value_dim] (v undefined for a latent
///                 cache): the new tokens' keys and values, the same on every rank
/// @param cache    this rank's shard: of every sequence, the tokens dcp_owner gives this rank, in
///                 position order; each new token is appended to its owner's shard first
/// @param ids      the B sequences (each on every rank's cache)
/// @param lengths  each sequence's length before the step (its first new token's position), the
///                 same on every rank
/// The token at position p sees every token at or before p. Bytes: dcp_bytes. CPU float32/
/// float64. A cp::Error on every rank, before anything is sent, when the ranks disagree (shapes,
/// dtype, ids, lengths, interleave), Hq is not divisible by Hkv, a shard does not hold its share
/// of a sequence (dcp_local_length of its length), or a shard's pool has no room for the new
/// tokens it keeps.
DcpResult dcp_decode_step(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          PagedKvCache& cache, const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths,
                          int64_t interleave, DcpExchange exchange, std::optional<double> scale = std::nullopt);

/// Bytes one rank sends in dcp_decode_step (given: the formula task 4 is tested against). The
/// queries first: an all-gather of its [B, T, Hq/N, key_dim] in the dtype (e bytes). Then each
/// partial result of one token and one head is value_dim float32 numbers of out and one of lse:
/// AllToAll sends the other N − 1 ranks their Hq/N heads, AllGather sends all Hq heads to each of
/// the N − 1.
int64_t dcp_bytes(DcpExchange exchange, int world, int64_t batch, int64_t tokens, int64_t heads_q, int64_t key_dim,
                  int64_t value_dim, int64_t element_size);

// ── Task 5: MLA's latent cache ──────────────────────────────────────────────────────────────

/// One attention layer's projections of multi-head latent attention (DeepSeek-V2/V3), per head h:
/// a token's latent c (latent_dim) gives its key k_h = [w_uk[h] · c, k_rope] and its value
/// v_h = w_uv[h] · c; k_rope (rope_dim) is shared by every head. The cache keeps [c, k_rope].
struct MlaWeights {
  torch::Tensor w_uk;  ///< [H, nope_dim, latent_dim]: the keys' up-projection
  torch::Tensor w_uv;  ///< [H, value_dim, latent_dim]: the values' up-projection
};

/// Task 5. Decode against a latent cache in the absorbed form: no head's key or value is ever
/// formed. q_nope [T, H, nope_dim] and q_rope [T, H, rope_dim] are the rows of one step of `batch`
/// (as in paged_attention); `cache` is latent (PagedKvCache::latent) with key_dim = latent_dim +
/// rope_dim. The scores and weights are those of attention with the explicit k_h, v_h above and
/// scale (default 1/√(nope_dim + rope_dim)). Returns out [T, H, value_dim] (dtype of q_nope) and lse
/// [T, H]. CPU float32/float64. A cp::Error naming the argument for shapes that do not fit.
PagedResult mla_decode(const torch::Tensor& q_nope, const torch::Tensor& q_rope, const MlaWeights& weights,
                       const PagedKvCache& cache, const PagedBatch& batch, std::optional<double> scale = std::nullopt);

// ── Task 6: the cache a model needs ─────────────────────────────────────────────────────────

/// A model's attention shapes, as its config gives them.
struct ModelShape {
  std::string name;
  int64_t layers = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;     ///< GQA: kv heads; MLA: 1 (the latent, shared by every head)
  int64_t key_dim = 0;      ///< GQA: head_dim; MLA: latent_dim + rope_dim
  int64_t value_dim = 0;    ///< GQA: head_dim; MLA: 0 (the value is part of the latent row)
  int64_t element_size = 2;  ///< bytes of one cached number (bfloat16)
};

/// Qwen3-235B-A22B: 94 layers, 64 query heads, 4 kv heads of 128 (GQA).
ModelShape qwen3_235b();
/// DeepSeek-V3: 61 layers, 128 heads, MLA with a 512 latent and a 64 RoPE key.
ModelShape deepseek_v3();

/// Task 6. Bytes of KV cache one token of one sequence takes on one GPU, on average over a long
/// sequence (a token striped by DCP lives on one GPU of the stripe), of a tensor-parallel group
/// of `tp` GPUs, with decode context parallelism of `dcp` inside it (dcp = 1: TP alone). Under TP
/// a GPU holds the kv heads its query heads read (kv heads are split over the GPUs while there are
/// enough, and copied when there are fewer kv heads than GPUs); DCP stripes the tokens over the
/// GPUs that hold the same kv heads. A cp::Error when tp or dcp is below 1, Hkv and tp do not
/// divide one another, or dcp does not divide the number of GPUs holding the same kv heads.
double cache_bytes_per_token(const ModelShape& model, int tp, int dcp);

/// The longest context one sequence can have when `cache_bytes` of each GPU hold its cache
/// (given: cache_bytes / cache_bytes_per_token, rounded down).
int64_t max_context_tokens(const ModelShape& model, int tp, int dcp, int64_t cache_bytes);

}  // namespace cp
