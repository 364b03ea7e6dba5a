// Kernel tests on raw device memory: the lessons' launch_* functions take pointers, so their
// tests fill device buffers (common/device_buffer.h), launch on a stream and copy the results
// back. No LibTorch CUDA is involved: the same tests run on a GPU (nvcc) and on the CPU (CUDA on
// the CPU, chipStar + PoCL). Here: the macros that skip a kernel test where kernels cannot run.
#pragma once

#include <gtest/gtest.h>
#include <torch/types.h>

#include <string>
#include <vector>

#include "common/device.h"
#include "testing/harness.h"

/// Skips the current test, with the reason, when kernels cannot run here (fails instead when
/// a GPU is expected: testing::gpu_expected()).
#define CP_REQUIRE_CUDA_RUNTIME() \
  CP_SKIP_UNLESS_EMPTY(::cp::cuda_runtime_unavailable_reason(), "needs CUDA to run kernels: ")

/// In a build without CUDA, the one test a kernel suite has: it skips and says how to get CUDA.
#define CP_KERNEL_TESTS_NEED_CUDA(suite) \
  TEST(suite, NeedCuda) { CP_REQUIRE_CUDA_RUNTIME(); }

#include "common/device_buffer.h"
