// Lesson 01 — the kernel interface (pointers, no torch): what online_softmax.cu implements and
// the CUDA branch of online_softmax.cpp calls.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

namespace cp {

/// One pass of online softmax statistics per row, then the normalised output.
/// @param x      [rows, n] contiguous, element type `dtype`
/// @param y      [rows, n] same type, or nullptr to skip the output
/// @param lse    [rows] float32, or nullptr to skip the log-sum-exp
void launch_online_softmax(const void* x, void* y, float* lse, int64_t rows, int64_t n, DType dtype,
                           cudaStream_t stream);

}  // namespace cp
