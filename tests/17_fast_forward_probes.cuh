// Lesson 17 — a probe kernel that runs task 1's issue_tile_copies on its own (one block of 4
// warps): the tile in shared memory after the copies have landed, padding included.
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
};
void launch_lesson17_task1_probe(const Lesson17Task1Probe& probe, cudaStream_t stream);

}  // namespace cp::testing
