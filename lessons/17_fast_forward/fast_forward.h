// Lesson 17 — the fast forward: lesson 16's kernel as a ladder of numbered versions, each one idea
// more than the one before (versions.h lists them). This header is the torch side; the kernels
// are in fast_forward.cu (interface: fast_forward.cuh). The steps you write are in
// fast_forward_steps.cuh (tasks 1, 3 and 4), fast_forward.cu (task 2) and block_order.h (task 5).
#pragma once

#include <torch/types.h>

#include <optional>

#include "block_attention.h"
#include "versions.h"

namespace cp {

/// Lesson 16's attention_forward_tensor_cores (the same contract: CUDA tensors of float16 or
/// bfloat16, D = 64 or 128, lesson 03's masks, GQA) by version `version` of the ladder.
AttnResult attention_forward_fast(int version, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const AttentionMask& mask = {}, std::optional<double> scale = std::nullopt);

/// Lesson 16's use_tensor_cores(true) with version `version` of the ladder: from now on
/// attention_block_forward (lesson 03), and every ring, layer and strategy built on it, runs the
/// CUDA inputs takes_tensor_cores accepts on attention_forward_fast(version, …); 0 turns it off
/// (lesson 03's kernels for all). Call it before the ranks start.
void use_fast_forward(int version = kFastestMeasuredVersion);

}  // namespace cp
