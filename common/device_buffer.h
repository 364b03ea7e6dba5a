// Raw device memory for the code that calls the lessons' launch_* functions directly (the kernel
// tests, the demos): buffers of one tensor's shape and dtype, copied from and to CPU tensors, and
// a stream of one's own. No LibTorch CUDA is involved, so they work on a GPU (nvcc) and on CUDA on
// the CPU (chipStar + PoCL) alike.
#pragma once

#include <torch/types.h>

#include <vector>

#if CP_WITH_CUDA
#include <cuda_runtime_api.h>

namespace cp {

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

/// A non-default stream of one's own (cudaStreamCreate/Destroy): kernels launch on it, as on a
/// GPU where the caller picks the stream.
class CudaStream {
 public:
  CudaStream();
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace cp
#endif
