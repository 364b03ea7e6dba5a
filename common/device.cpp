#include "common/device.h"

#include <torch/cuda.h>
#include <torch/types.h>

#if CP_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include "common/error.h"

namespace cp {

std::string cuda_unavailable_reason() {
#if !CP_WITH_CUDA
  return "this build has no CUDA (nvcc was not found when CMake configured it)";
#elif !CP_TORCH_CUDA
  return "LibTorch is a CPU-only build (e.g. Debian's libtorch-dev); configure with a CUDA "
         "LibTorch (CMAKE_PREFIX_PATH) to run the CUDA path";
#else
  if (!torch::cuda::is_available()) return "no CUDA GPU is visible to this process";
  return "";
#endif
}

#if CP_WITH_CUDA
cudaStream_t current_cuda_stream() {
#if CP_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream().stream();
#else
  CP_FAIL("a CUDA tensor cannot exist with a CPU-only LibTorch");
#endif
}
#endif

}  // namespace cp
