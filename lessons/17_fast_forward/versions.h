// Lesson 17 — the ladder's versions, for host code, kernels and tests alike (no torch, no CUDA).
#pragma once

namespace cp {

/// The versions of the ladder, 1 … kFastForwardVersions (the README has a chapter for each):
///   1  lesson 16's kernel, unchanged: the baseline;
///   2  K and V tiles by cp.async with compile-time strides, in FlashAttention-2's order: V_j's copy
///      in flight during S_j = Q·K_jᵀ, K_{j+1}'s during the softmax and P·V_j;
///   3  the mask only where a tile is cut (a tile every row of the block sees whole runs without a
///      test per score) and the softmax in base 2 with the scale folded into one multiply;
///   4  128 query rows a block, 32 a warp: every ldmatrix an .x4, every K and V fragment it loads
///      multiplied with two groups of 16 rows; Q stays in shared memory;
///   5  the blocks that see the most keys (under a causal mask) started first.
constexpr int kFastForwardVersions = 5;

/// What version `version` adds, in a few words (for tables). A cp::Error outside 1 … kFastForwardVersions.
const char* fast_forward_version_name(int version);

/// The version a GPU has measured fastest (README, "The ladder on every ring"): version 1 until a GPU day times the
/// others; a prediction never sets it.
constexpr int kFastestMeasuredVersion = 1;

}  // namespace cp
