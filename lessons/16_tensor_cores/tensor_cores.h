// Lesson 16 — tensor cores: lesson 03's block attention forward on the GPU's matrix units.
#pragma once

#include <torch/types.h>

#include <optional>

#include "block_attention.h"

namespace cp {

/// attention_block_forward (lesson 03) on the matrix units: the same contract (out in q's
/// dtype, lse float32, masks from positions, windows and documents, GQA, any Sq and Sk), for
/// CUDA tensors of float16 or bfloat16 with D = 64 or 128. A cp::Error naming the argument for
/// anything else (a CPU tensor, float32, another head dim).
AttnResult attention_forward_tensor_cores(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const AttentionMask& mask = {}, std::optional<double> scale = std::nullopt);

}  // namespace cp
