// The probe of kernels/mma.cuh (tests/kernels_test.cpp): one warp loads fragments and multiplies,
// and writes back what each lane holds.
#pragma once

#include <cuda_runtime_api.h>

#include "common/dtype.h"

namespace cp::testing {

/// What the probe's warp saw and computed. Every pointer is device memory.
struct MmaProbe {
  const void* a;   ///< [16][16] row-major, dtype
  const void* b;   ///< [16][8] row-major (k × n), dtype
  const float* c;  ///< [16][8]
  float* a_frag;   ///< [32][8]: element e of lane, ldmatrix_x4 from A in shared memory
  float* b_frag;   ///< [32][4]: ldmatrix_x2 from Bᵀ ([n][k], as K is stored) in shared memory
  float* bt_frag;  ///< [32][4]: ldmatrix_x2_trans from B ([k][n], as V is stored) in shared memory
  float* a_as_b_frags;  ///< [32][8]: ldmatrix_x4_trans of A ([k][n]): elements 0–3 the B fragment of
                        ///< A's columns 0–7, 4–7 that of columns 8–15
  float* d_map;    ///< [16][8]: A·B + C from fragments each lane reads from global memory by the map
  float* d_ld;     ///< [16][8]: the same product from the ldmatrix fragments
  /// A mistake the probe makes on purpose after its loads, to show CUDA on the CPU refusing it as
  /// a GPU would: 0 none, 1 ldmatrix_x4 of A from global memory, 2 ldmatrix_x2 of a row address
  /// 2 bytes past a 16-byte boundary, 3 ldmatrix_x2_trans from global memory, 4 ldmatrix_x4_trans
  /// from global memory, 5 ldmatrix_x2 of rows whose phase shares banks.
  int misuse = 0;
};

/// Runs the probe with one warp; dtype Float16 or BFloat16.
void launch_mma_probe(const MmaProbe& probe, DType dtype, cudaStream_t stream);

}  // namespace cp::testing
