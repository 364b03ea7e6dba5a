// Lesson 05 — the kernel interface (pointers, no torch) of block_backward.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "block_attention.cuh"
#include "common/dtype.h"

namespace cp {

/// q, dout [B, Hq, Sq, D] and k, v [B, Hkv, Sk, D] of `dtype`; lse, delta (= rowsum(dout ∘ out))
/// [B, Hq, Sq] float32; q_first, q_last [Sq] and k_pos [Sk] int64 (the visible keys, as for
/// launch_block_attention_forward); outputs dq [B, Hq, Sq, D] and dk, dv [B, Hkv, Sk, D] float32,
/// overwritten. Two kernels: one owns query rows (dQ), one owns key rows (dK, dV).
void launch_block_attention_backward(const void* q, const void* k, const void* v, const void* dout,
                                     const float* lse, const float* delta, const int64_t* q_first,
                                     const int64_t* q_last, const int64_t* k_pos, float* dq, float* dk, float* dv,
                                     const BlockAttentionParams& params, DType dtype, cudaStream_t stream);

/// A kernel that takes over launch_block_attention_backward's work for the inputs it accepts: the
/// same arguments, and the GPU's compute capability (major); it returns false for inputs it does
/// not take (lesson 05's kernels then run). Lesson 18 plugs its matrix-unit backward in here
/// (use_fast_backward), so that the backward of every ring, layer and strategy built on
/// attention_block_backward runs on it: lesson 05 cannot call lesson 18, which comes later.
using CudaBackwardOverride = bool (*)(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                                      const float* delta, const int64_t* q_first, const int64_t* q_last,
                                      const int64_t* k_pos, float* dq, float* dk, float* dv,
                                      const BlockAttentionParams& params, DType dtype, cudaStream_t stream,
                                      int compute_capability_major);

/// Sets the override (nullptr: none, the default) for every thread of the process; set it before
/// the ranks start, not while they compute.
void set_cuda_backward_override(CudaBackwardOverride backward);

}  // namespace cp
