// Lesson 03 — the kernel interface (pointers, no torch) of block_attention.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

namespace cp {

/// Shapes and options of one attention_block_forward launch.
struct BlockAttentionParams {
  int64_t batch, heads_q, heads_kv, seq_q, seq_k, head_dim;
  float scale;
  bool masked;  ///< false: every pair is visible (q_first and q_last are not read)
};

/// Head dims the kernel is compiled for.
bool block_attention_supports_head_dim(int64_t head_dim);

/// q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D], out [B, Hq, Sq, D] (all `dtype`, contiguous),
/// lse [B, Hq, Sq] float32, q_first and q_last [Sq] int64 (query i sees the keys positioned
/// q_first[i] .. q_last[i], lesson 03's VisibleKeys), k_pos [Sk] int64, all on the current device.
void launch_block_attention_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                                    const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos,
                                    const BlockAttentionParams& params, DType dtype, cudaStream_t stream);

}  // namespace cp
