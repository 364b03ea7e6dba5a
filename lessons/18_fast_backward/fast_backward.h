// Lesson 18 — the backward on the matrix units: lesson 05's block backward with every product on
// mma.m16n8k16, and the switch that puts it under every ring, layer and strategy. The kernels
// are in fast_backward.cu (interface: fast_backward.cuh); the steps you write are in
// fast_backward_steps.cuh (task 1) and fast_backward.cu (tasks 2 and 3).
#pragma once

#include <torch/types.h>

#include <optional>

#include "ring_attention_backward.h"

namespace cp {

/// attention_block_backward (lesson 05) on the matrix units: the same contract (dout, out in q's
/// dtype, lse float32, masks from positions, windows and documents, GQA, any Sq and Sk; dq, dk,
/// dv float32) for CUDA tensors of float16 or bfloat16 with D = 64 or 128. A cp::Error naming the
/// argument for anything else.
AttnGrads attention_backward_fast(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                  const AttentionMask& mask = {}, std::optional<double> scale = std::nullopt);

/// on: from now on attention_block_backward, and every ring, layer and strategy built on it, runs
/// the CUDA inputs lesson 16's takes_tensor_cores accepts on this lesson's kernels; off: lesson
/// 05's kernels for all. Call it before the ranks start.
void use_fast_backward(bool on);

/// Both halves of attention on the matrix units at once, for training on a GPU: on is lesson 17's
/// use_fast_forward(kFastestMeasuredVersion) and use_fast_backward(true); off turns both off.
void use_matrix_units(bool on);

}  // namespace cp
