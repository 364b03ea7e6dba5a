// Lesson 16 — the kernel interface (pointers, no torch) of tensor_core_attention.cu: lesson 03's
// forward on the matrix units.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "block_attention.cuh"
#include "common/dtype.h"

namespace cp {

/// Head dims the matrix-unit kernel is compiled for.
bool tensor_core_attention_supports_head_dim(int64_t head_dim);

/// Lesson 03's launch_block_attention_forward (the same pointers, shapes and params), computed
/// with mma.m16n8k16: q, k, v and out in `dtype`, float16 or bfloat16; lse float32; D 64 or 128.
/// A cp::Error for another dtype or head dim.
void launch_tensor_core_attention_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                                          const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos,
                                          const BlockAttentionParams& params, DType dtype, cudaStream_t stream);

}  // namespace cp
