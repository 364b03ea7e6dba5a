// The probe of kernels/async_copy.cuh (tests/kernels_test.cpp): one warp copies two tiles from
// global to shared memory in two groups and writes back what shared memory held after each wait.
#pragma once

#include <cuda_runtime_api.h>

namespace cp::testing {

/// Every pointer is device memory.
struct AsyncCopyProbe {
  const float* src;         ///< [2][256]: tile 0 (group 0), tile 1 (group 1)
  float* after_wait1;       ///< [2][256]: shared memory after wait_all_but_newest (group 0 must have landed)
  float* after_wait0;       ///< [2][256]: shared memory after wait_all (both)
  /// A mistake the probe makes on purpose: 0 none, 1 a copy into global memory, 2 a copy to a
  /// shared address 4 bytes past a 16-byte boundary.
  int misuse = 0;
};

/// Runs the probe with one warp; shared memory starts as -1 everywhere.
void launch_async_copy_probe(const AsyncCopyProbe& probe, cudaStream_t stream);

}  // namespace cp::testing
