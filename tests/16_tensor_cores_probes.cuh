// Lesson 16 — probe kernels that run one task's device function of tensor_core_steps.cuh on known
// tiles (one block of 4 warps), so that a mistake in task 1 or 2 fails a test of its own instead of
// the whole kernel's. Host launchers: pointers to device memory, no torch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

namespace cp::testing {

/// Task 1: load_q_fragments and compute_scores on a Q tile and a K tile of 64 rows each.
struct Lesson16Task1Probe {
  const void* q;  ///< [64, D] in dtype: the block's 64 query rows
  const void* k;  ///< [64, D] in dtype: one tile of keys
  float* q_frag;  ///< out: [4 warps][32 lanes][D/16 fragments][8 elements], unpacked to float
  float* s;       ///< out: [64, 64] float32, S = Q·Kᵀ written back through the C map
  int64_t head_dim;
  DType dtype;  ///< Float16 (D = 64 only) or BFloat16 (D = 128 only): one instantiation each
};
void launch_lesson16_task1_probe(const Lesson16Task1Probe& probe, cudaStream_t stream);

/// Task 2: softmax_tile on one tile, D = 64. Per row of the block's 64: the state before (m, l, o)
/// and after; s in, p out, each [64, 64] float32 written through the C map.
struct Lesson16Task2Probe {
  const float* s;       ///< [64, 64] raw scores
  const int64_t* kpos;  ///< [64] positions of the tile's keys
  int n;                ///< keys of the tile that exist
  const int64_t* first; ///< [64] per row
  const int64_t* last;  ///< [64]
  float scale;
  const float* m_in;  ///< [64]
  const float* l_in;  ///< [64]: the row's sum, given to lane t = 0 of the quad (the others start at 0)
  const float* o_in;  ///< [64, 64]
  float* p;           ///< out [64, 64]
  float* m_out;       ///< out [64]
  float* l_out;       ///< out [64]: the row's sum over its quad
  float* o_out;       ///< out [64, 64]
};
void launch_lesson16_task2_probe(const Lesson16Task2Probe& probe, cudaStream_t stream);

}  // namespace cp::testing
