// Which devices this build and this machine can use, and the CUDA stream kernels run on.
#pragma once

#include <string>

#if CP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace cp {

/// Why CUDA tensors cannot be used here, or "" when they can. Tests skip with this reason.
std::string cuda_unavailable_reason();

/// Why kernels cannot be launched on raw device buffers (cudaMalloc) here, or "" when they can:
/// a GPU with nvcc's runtime, or CUDA on the CPU (chipStar + PoCL).
std::string cuda_runtime_unavailable_reason();

#if CP_WITH_CUDA
/// The stream LibTorch's next operation on the current device runs on: kernels are launched
/// on it so that they are ordered with the tensor operations around them.
cudaStream_t current_cuda_stream();
#endif

}  // namespace cp
