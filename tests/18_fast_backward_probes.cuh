// Lesson 18 — a probe kernel that runs task 1's tile_gradients on its own (one block of 4 warps)
// on a 64 × 64 tile of scores given in either layout, and writes the results back whole.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace cp::testing {

/// Every pointer is device memory. A "tile" is [64][64] float32 in the layout of `key_rows`:
/// row-major over (query row, key) when false, over (key, query row) when true.
struct Lesson18Task1Probe {
  const float* s;         ///< the scores q·k, unscaled
  const float* dp;        ///< dO·v
  const float* lse;       ///< [64] per query row
  const float* delta;     ///< [64] per query row
  const int64_t* first;   ///< [64] per query row: the positions it sees, [first, last]
  const int64_t* last;    ///< [64]
  const int64_t* key_pos; ///< [64]
  int n_keys;             ///< keys at or past it do not exist
  float scale;
  bool key_rows;
  float* p_out;           ///< out: the tile of P, same layout
  float* ds_out;          ///< out: the tile of dS, same layout
};
void launch_lesson18_task1_probe(const Lesson18Task1Probe& probe, cudaStream_t stream);

}  // namespace cp::testing
