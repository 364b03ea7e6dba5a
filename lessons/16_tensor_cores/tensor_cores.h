// Lesson 16 — tensor cores: lesson 03's block attention forward on the GPU's matrix units.
#pragma once

#include <torch/types.h>

#include <optional>

#include "block_attention.h"

#if CP_WITH_CUDA
#include <cuda_runtime_api.h>

#include "block_attention.cuh"
#include "common/dtype.h"
#endif

namespace cp {

/// attention_block_forward (lesson 03) on the matrix units: the same contract (out in q's
/// dtype, lse float32, masks from positions, windows and documents, GQA, any Sq and Sk), for
/// CUDA tensors of float16 or bfloat16 with D = 64 or 128. A cp::Error naming the argument for
/// anything else (a CPU tensor, float32, another head dim).
AttnResult attention_forward_tensor_cores(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const AttentionMask& mask = {}, std::optional<double> scale = std::nullopt);

#if CP_WITH_CUDA
/// A matrix-unit forward on device pointers: lesson 03's launch with a variant number first (lesson
/// 17's version; lesson 16's kernel ignores it).
using MatrixUnitLaunch = void (*)(int variant, const void* q, const void* k, const void* v, void* out, float* lse,
                                  const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos,
                                  const BlockAttentionParams& params, DType dtype, cudaStream_t stream);

/// attention_forward_tensor_cores's checks and tensors around another kernel of the same contract
/// (`launch`, `variant`): lesson 17 runs its versions through it.
AttnResult attention_forward_matrix_units(MatrixUnitLaunch launch, int variant, const torch::Tensor& q,
                                          const torch::Tensor& k, const torch::Tensor& v, const AttentionMask& mask,
                                          std::optional<double> scale);
#endif

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
