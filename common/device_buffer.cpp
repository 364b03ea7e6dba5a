#include "common/device_buffer.h"

#if CP_WITH_CUDA
#include "common/cuda_check.h"

namespace cp {

DeviceBuffer::DeviceBuffer(std::vector<int64_t> shape, torch::ScalarType dtype)
    : shape_(std::move(shape)), dtype_(dtype) {
  int64_t numel = 1;
  for (int64_t n : shape_) numel *= n;
  bytes_ = static_cast<size_t>(numel) * c10::elementSize(dtype_);
  if (bytes_ == 0) return;
  CUDA_CHECK(cudaMalloc(&ptr_, bytes_));
  CUDA_CHECK(cudaMemset(ptr_, 0xFF, bytes_));
}

DeviceBuffer::DeviceBuffer(const torch::Tensor& host) : DeviceBuffer(host.sizes().vec(), host.scalar_type()) {
  CP_CHECK(host.device().is_cpu(), "DeviceBuffer: expected a CPU tensor, got one on ", host.device());
  const torch::Tensor src = host.contiguous();
  if (bytes_ > 0) CUDA_CHECK(cudaMemcpy(ptr_, src.data_ptr(), bytes_, cudaMemcpyHostToDevice));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) (void)cudaFree(ptr_);  // a destructor does not throw; a leak is all that is lost
}

torch::Tensor DeviceBuffer::to_host(cudaStream_t stream) const {
  CUDA_CHECK(cudaStreamSynchronize(stream));  // also reports a kernel that failed while running
  torch::Tensor host = torch::empty(shape_, torch::TensorOptions().dtype(dtype_));
  if (bytes_ > 0) CUDA_CHECK(cudaMemcpy(host.data_ptr(), ptr_, bytes_, cudaMemcpyDeviceToHost));
  return host;
}

CudaStream::CudaStream() { CUDA_CHECK(cudaStreamCreate(&stream_)); }

CudaStream::~CudaStream() { (void)cudaStreamDestroy(stream_); }

}  // namespace cp
#endif
