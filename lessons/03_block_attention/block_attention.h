// Lesson 03 — block attention with LSE and the merge: the contract the tests use.
//
// The single-device building block of every later lesson: attention of a block of queries over
// one block of keys/values, returning the output *and* the log-sum-exp of every query row, so
// that partial results over different key blocks can be merged exactly.
#pragma once

#include <torch/types.h>

#include <optional>
#include <vector>

namespace cp {

/// Which (query, key) pairs may attend. Everything is decided from *global* token positions,
/// never from local indices, so every later layout (ring chunk, zig-zag, stripe) is just other
/// positions: key j is visible to query i iff
///   causal:    k_positions[j] <= q_positions[i] (when causal is set),
///   window:    q_positions[i] − k_positions[j] < window (when window > 0; causal only),
///   documents: both positions lie in the same document (when documents is set).
/// Lesson 12 adds the window and the documents; until then both are off.
struct AttentionMask {
  bool causal = false;
  torch::Tensor q_positions;  ///< [Sq] int64, on q's device; undefined: 0 .. Sq−1
  torch::Tensor k_positions;  ///< [Sk] int64, on q's device; undefined: 0 .. Sk−1
  int64_t window = 0;         ///< sliding window of W keys (the query's own and W − 1 before it); 0: none
  /// Packed documents: the cumulative lengths (cu_seqlens) of the whole sequence, int64
  /// [n_docs + 1] on any device, 0 = c_0 <= c_1 <= … <= c_n; document d holds the positions
  /// [c_d, c_{d+1}). Positions >= c_n are padding: they see no key and no query sees them.
  /// Undefined: the whole sequence is one document.
  torch::Tensor documents;
};

/// Every mask above is a range of key positions per query, because a document and a window are
/// contiguous in position: key j is visible to query i iff first[i] <= k_positions[j] <= last[i]
/// (first > last: no key). This is what the CPU path and the kernels test, pair by pair, and how
/// they skip a whole tile (every key of it outside every row's range).
struct VisibleKeys {
  bool masked = false;  ///< false: every pair is visible (no causal, no documents) and first/last are undefined
  torch::Tensor first;  ///< [Sq] int64, on q's device
  torch::Tensor last;   ///< [Sq] int64, on q's device
};

/// The checks of a mask's window (0, or at least 1 with causal) and documents (int64 [n + 1 >= 2],
/// from 0, non-decreasing); errors name the field (mask.window, mask.documents). Returns the
/// documents' bounds c_0 … c_n on the host, or nothing without documents.
std::vector<int64_t> check_mask(const AttentionMask& mask);

/// The visible keys of each query of `mask` (q_pos: the checked query positions, e.g. from
/// mask_positions). Checks the mask (check_mask, and no negative position with documents).
VisibleKeys visible_keys(const AttentionMask& mask, const torch::Tensor& q_pos);

/// A mask by name: causal or not, positions 0 .. S−1 (set the positions by name when they differ).
inline AttentionMask causal_mask(bool causal) {
  AttentionMask mask;
  mask.causal = causal;
  return mask;
}

/// An attention result: out in the input dtype, lse float32.
struct AttnResult {
  torch::Tensor out;  ///< [B, Hq, Sq, D]
  torch::Tensor lse;  ///< [B, Hq, Sq] float32: log Σ_j exp(scale · q·k_j) over visible keys; −inf if none
  /// CPU path: the (query tile, key tile) pairs of 32 × 32 computed, and those skipped because the
  /// mask hides every pair of them, over all batches and heads. The CUDA path leaves both 0.
  int64_t tiles_computed = 0, tiles_skipped = 0;
};

/// Shapes of an attention call.
struct AttentionShapes {
  int64_t batch, heads_q, heads_kv, seq_q, seq_k, head_dim;
};

/// Checks q [B, Hq, Sq, D] and k, v [B, Hkv, Sk, D] (same dtype and device, Hq divisible by Hkv)
/// and returns their shapes; errors name the argument.
AttentionShapes check_attention_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

/// The positions a mask gives (or 0 .. n−1 if undefined), checked: int64 [n] on `device`.
torch::Tensor mask_positions(const torch::Tensor& given, int64_t n, torch::Device device, const char* arg);

/// FlashAttention-style forward of q over one block of k/v.
/// @param q      [B, Hq, Sq, D]
/// @param k, v   [B, Hkv, Sk, D], Hq divisible by Hkv (grouped-query attention: query head h
///               reads key/value head h / (Hq / Hkv))
/// @param scale  default 1/sqrt(D)
/// CPU: float32/float64, any D. CUDA: float32/float16/bfloat16 with float32 math, D in {32, 64, 128}.
/// A query row with no visible key gives out = 0 and lse = −inf (never NaN). A NaN or inf in a
/// visible score follows the definition (README, "NaN and inf are never hidden"): NaN is never
/// taken for a masked key.
AttnResult attention_block_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const AttentionMask& mask = {}, std::optional<double> scale = std::nullopt);

/// A forward that takes over attention_block_forward's CUDA path for the inputs it accepts, and
/// returns nothing for the others (lesson 03's kernel then runs). Lesson 16 plugs its matrix-unit
/// kernel in here (use_tensor_cores), so that every ring, layer and strategy built on
/// attention_block_forward runs on it: lesson 03 cannot call lesson 16, which comes later.
using CudaForwardOverride = std::optional<AttnResult> (*)(const torch::Tensor& q, const torch::Tensor& k,
                                                          const torch::Tensor& v, const AttentionMask& mask,
                                                          std::optional<double> scale);

/// Sets the override (nullptr: none, the default) for every thread of the process; set it before
/// the ranks start, not while they compute.
void set_cuda_forward_override(CudaForwardOverride forward);

/// Merges a block result into float32 accumulators, in place: afterwards (out_acc, lse_acc) is
/// the attention over the union of both key sets. Either side may be empty (lse = −inf).
/// @param out_acc  [B, H, S, D] float32     @param lse_acc  [B, H, S] float32
/// @param out_blk  [B, H, S, D] any dtype   @param lse_blk  [B, H, S] float32
void merge_attention(torch::Tensor& out_acc, torch::Tensor& lse_acc, const torch::Tensor& out_blk,
                     const torch::Tensor& lse_blk);

/// merge_attention's checks of its operands (shapes, devices, float32 accumulators): a cp::Error
/// naming the argument. Lesson 13's merge in another form makes the same ones.
void check_merge_inputs(const torch::Tensor& out_acc, const torch::Tensor& lse_acc, const torch::Tensor& out_blk,
                        const torch::Tensor& lse_blk);

}  // namespace cp
