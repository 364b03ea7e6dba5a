// Lesson 03 — block attention with LSE and the merge: the contract the tests use.
//
// The single-device building block of every later lesson: attention of a block of queries over
// one block of keys/values, returning the output *and* the log-sum-exp of every query row, so
// that partial results over different key blocks can be merged exactly.
#pragma once

#include <torch/types.h>

#include <optional>

namespace cp {

/// Which (query, key) pairs may attend. Causality is decided from *global* token positions,
/// never from local indices, so every later layout (ring chunk, zig-zag, stripe) is just other
/// positions: key j is visible to query i iff !causal or k_positions[j] <= q_positions[i].
struct AttentionMask {
  bool causal = false;
  torch::Tensor q_positions;  ///< [Sq] int64, on q's device; undefined: 0 .. Sq−1
  torch::Tensor k_positions;  ///< [Sk] int64, on q's device; undefined: 0 .. Sk−1
};

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

/// Merges a block result into float32 accumulators, in place: afterwards (out_acc, lse_acc) is
/// the attention over the union of both key sets. Either side may be empty (lse = −inf).
/// @param out_acc  [B, H, S, D] float32     @param lse_acc  [B, H, S] float32
/// @param out_blk  [B, H, S, D] any dtype   @param lse_blk  [B, H, S] float32
void merge_attention(torch::Tensor& out_acc, torch::Tensor& lse_acc, const torch::Tensor& out_blk,
                     const torch::Tensor& lse_blk);

}  // namespace cp
