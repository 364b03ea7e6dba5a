// Lesson 17 — probe kernels that run a task's steps on their own (one block of 4 warps): task 1's
// issue_tile_copies (the tile in shared memory after the copies have landed, padding included),
// task 4's compute_scores_wide and accumulate_pv_wide (the fragments written back whole).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace cp::testing {

/// Every pointer is device memory; elements are 16-bit (any bit pattern).
struct Lesson17Task1Probe {
  const uint16_t* src;  ///< [rows, D]
  int64_t row0;         ///< the tile's first row of src
  int n;                ///< rows that exist from row0 (the rest of the tile's 64 rows: zeros)
  uint16_t* tile;       ///< out: [64, D + 8], the shared tile after the copies, every row's padding too
  int64_t head_dim;     ///< 64 or 128
  /// out, if not null: [128 threads][copies a thread issues], the place in the tile of each copy
  /// as 16-byte pieces from its start, −1 for a copy not issued (the copies then land at once,
  /// not through cp.async: the log is of the pattern, for the bank test).
  int32_t* places = nullptr;
};
void launch_lesson17_task1_probe(const Lesson17Task1Probe& probe, cudaStream_t stream);

/// Every pointer is device memory, float16. The probe puts Q, K and V in shared memory, runs
/// s = compute_scores_wide(Q, K), then o = accumulate_pv_wide(o = 0, P = s, V), and writes both.
struct Lesson17Task4Probe {
  const void* q;     ///< [128, D]: the block's query rows
  const void* k;     ///< [64, D]: a tile of keys
  const void* v;     ///< [64, D]
  float* scores;     ///< out: [128, 64], s of every warp's two groups
  float* out;        ///< out: [128, D], o of every warp's two groups
  int64_t head_dim;  ///< 64 or 128
};
void launch_lesson17_task4_probe(const Lesson17Task4Probe& probe, cudaStream_t stream);

}  // namespace cp::testing
