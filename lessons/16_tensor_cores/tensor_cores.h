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

/// Whether use_tensor_cores sends a CUDA forward of these inputs to the matrix units: float16 or
/// bfloat16, D = 64 or 128, on a GPU of compute capability 8.0 or newer (mma.m16n8k16 needs
/// sm_80; an older GPU would run the emulation, slower than lesson 03's kernel).
bool takes_tensor_cores(torch::ScalarType dtype, int64_t head_dim, int compute_capability_major);

/// on: from now on attention_block_forward (lesson 03), and every ring, layer and strategy built
/// on it, runs the CUDA inputs takes_tensor_cores accepts on attention_forward_tensor_cores;
/// everything else stays on lesson 03's kernels. off: lesson 03's kernel for all. Call it before
/// the ranks start (lesson 03's set_cuda_forward_override).
void use_tensor_cores(bool on);

}  // namespace cp
