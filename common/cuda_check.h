// CUDA_CHECK for host code that calls the CUDA runtime (kernel launchers, the comm backends).
#pragma once

#include <cuda_runtime_api.h>

#include "common/error.h"

/// Throws cp::Error (with rank, file, line) when a CUDA runtime call fails.
#define CUDA_CHECK(call)                                                               \
  do {                                                                                 \
    const cudaError_t cp_cuda_status = (call);                                         \
    if (cp_cuda_status != cudaSuccess)                                                 \
      CP_FAIL("CUDA error ", cudaGetErrorName(cp_cuda_status), " (",                   \
              cudaGetErrorString(cp_cuda_status), ") in ", #call);                     \
  } while (0)

/// Checks the launch of the kernel just enqueued (bad configuration, too much shared memory).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
