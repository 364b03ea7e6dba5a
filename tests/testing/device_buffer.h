// Kernel tests on raw device memory: the lessons' launch_* functions take pointers, so their
// tests fill device buffers, launch on a stream and copy the results back. No LibTorch CUDA is
// involved: the same tests run on a GPU (nvcc) and on the CPU (CUDA on the CPU, chipStar + PoCL).
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

#if CP_WITH_CUDA
#include <cuda_runtime_api.h>

namespace cp::testing {

/// Device memory of one tensor's shape and dtype (cudaMalloc/cudaFree), copied from and to CPU
/// tensors with cudaMemcpy. Zero elements allocate nothing and give a null pointer.
class DeviceBuffer {
 public:
  /// A device copy of `host` (a CPU tensor of any shape and dtype).
  explicit DeviceBuffer(const torch::Tensor& host);
  /// An output buffer, every byte 0xFF: NaN for float types, so an element the kernel never
  /// writes fails the comparison instead of passing by luck.
  DeviceBuffer(std::vector<int64_t> shape, torch::ScalarType dtype);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }

  /// Waits for `stream`, then copies the buffer into a new CPU tensor.
  torch::Tensor to_host(cudaStream_t stream) const;

 private:
  std::vector<int64_t> shape_;
  torch::ScalarType dtype_;
  size_t bytes_ = 0;
  void* ptr_ = nullptr;
};

/// A non-default stream owned by one test: kernels under test launch on it, as on a GPU where
/// the caller picks the stream.
class TestStream {
 public:
  TestStream();
  ~TestStream();
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace cp::testing
#endif
