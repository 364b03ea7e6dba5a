// Lesson 17 — the fast forward: lesson 16's kernel as a ladder of numbered versions, each one idea
// more than the one before. The kernels are in fast_forward.cu (interface: fast_forward.cuh); the
// steps you write are in fast_forward_steps.cuh (tasks 1 and 3) and fast_forward.cu (task 2).
#pragma once

namespace cp {

/// The versions of the ladder, 1 … kFastForwardVersions (the README has a chapter for each):
///   1  lesson 16's kernel, unchanged: the baseline;
///   2  K and V tiles by cp.async with compile-time strides, in FlashAttention-2's order: V_j's copy
///      in flight during S_j = Q·K_jᵀ, K_{j+1}'s during the softmax and P·V_j;
///   3  the mask only where a tile is cut (a tile every row of the block sees whole runs without a
///      test per score) and the softmax in base 2 with the scale folded into one multiply.
constexpr int kFastForwardVersions = 3;

/// What version `version` adds, in a few words (for tables). A cp::Error outside 1 … kFastForwardVersions.
const char* fast_forward_version_name(int version);

}  // namespace cp
