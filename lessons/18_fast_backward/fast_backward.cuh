// Lesson 18 — the kernel interface (pointers, no torch) of fast_backward.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "block_attention.cuh"
#include "common/dtype.h"

namespace cp {

/// Lesson 05's launch_block_attention_backward (the same pointers, shapes, params and outputs:
/// dq [B, Hq, Sq, D], dk, dv [B, Hkv, Sk, D] float32, overwritten) on the matrix units: float16
/// or bfloat16, D = 64 or 128, q, k, v and dout 16-byte aligned. A cp::Error for anything else.
void launch_fast_backward(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                          const float* delta, const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos,
                          float* dq, float* dk, float* dv, const BlockAttentionParams& params, DType dtype,
                          cudaStream_t stream);

/// Its two halves, each a kernel of its own: dK and dV (the key kernel, task 2), dQ (the query
/// kernel, task 3).
void launch_fast_backward_keys(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                               const float* delta, const int64_t* q_first, const int64_t* q_last,
                               const int64_t* k_pos, float* dk, float* dv, const BlockAttentionParams& params,
                               DType dtype, cudaStream_t stream);
void launch_fast_backward_queries(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                                  const float* delta, const int64_t* q_first, const int64_t* q_last,
                                  const int64_t* k_pos, float* dq, const BlockAttentionParams& params, DType dtype,
                                  cudaStream_t stream);

}  // namespace cp
