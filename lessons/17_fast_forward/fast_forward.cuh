// Lesson 17 — the kernel interface (pointers, no torch) of fast_forward.cu: lesson 16's forward as
// a ladder of numbered versions, each one idea more than the one before.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "block_attention.cuh"
#include "common/dtype.h"
#include "versions.h"

namespace cp {

/// Lesson 03's launch_block_attention_forward (the same pointers, shapes and params) by version
/// `version` of the ladder: float16 or bfloat16, D = 64 or 128, q, k and v 16-byte aligned. A
/// cp::Error for another version, dtype or head dim.
void launch_fast_forward(int version, const void* q, const void* k, const void* v, void* out, float* lse,
                         const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos,
                         const BlockAttentionParams& params, DType dtype, cudaStream_t stream);

}  // namespace cp
