#include "common/device.h"

#include <torch/cuda.h>
#include <torch/types.h>

#include <mutex>

#if CP_TORCH_CUDA
#include <c10/core/AutogradState.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR < 2
#error "the CUDA path needs LibTorch 2.0 or newer: run_backward_on_this_thread() uses its per-thread autograd switch"
#endif
#endif

#include "common/error.h"

#if CP_WITH_CUDA
#include "common/cuda_check.h"
#endif

namespace cp {

std::string cuda_unavailable_reason() {
#if !CP_WITH_CUDA
  return "this build has no CUDA (neither nvcc nor CUDA on the CPU was found when CMake configured it)";
#elif defined(CP_CUDA_CPU_ROOT)
  return "this build runs CUDA on the CPU (chipStar), which executes kernels on raw buffers but has no "
         "LibTorch CUDA tensors; the kernel tests (suites ending in Kernels) check the same kernels";
#elif !CP_TORCH_CUDA
  // No GPU at all is the reason to give first: a CUDA LibTorch would not help there.
  if (std::string no_device = cuda_runtime_unavailable_reason(); !no_device.empty()) return no_device;
  return "LibTorch is a CPU-only build (e.g. Debian's libtorch-dev); configure with a CUDA "
         "LibTorch (CMAKE_PREFIX_PATH) to run the CUDA path";
#else
  if (!torch::cuda::is_available()) return "no CUDA GPU is visible to this process";
  return "";
#endif
}

void run_backward_on_this_thread() {
#if CP_TORCH_CUDA
  // The thread-local switch behind Python's torch.autograd.set_multithreading_enabled(False):
  // the engine then queues CUDA nodes on this graph task's own queue, run by this thread.
  c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
#endif
}

void wait_for_device_work(const torch::Tensor& t) {
  if (!t.is_cuda()) return;
#if CP_TORCH_CUDA
  c10::cuda::getCurrentCUDAStream(t.device().index()).synchronize();
#else
  CP_FAIL("a CUDA tensor cannot exist with a CPU-only LibTorch");
#endif
}

torch::Device current_cuda_device() {
#if CP_TORCH_CUDA
  return {torch::kCUDA, c10::cuda::current_device()};
#else
  CP_FAIL("a CUDA tensor cannot exist with a CPU-only LibTorch");
#endif
}

std::string cuda_runtime_unavailable_reason() {
#if !CP_WITH_CUDA
  return "this build has no CUDA. To run the kernels without a GPU, get CUDA on the CPU: `make setup` "
         "installs a prebuilt copy when one is at hand, `make setup-cuda-cpu` builds it (about 16 minutes); "
         "then `make clean && make test` (docs/cuda-on-cpu.md)";
#else
  static std::once_flag once;
  static std::string reason;
  std::call_once(once, [] {
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) {
      reason = std::string("no CUDA device: cudaGetDeviceCount failed with ") + cudaGetErrorName(status);
    } else if (count == 0) {
      reason = "no CUDA device";
    }
#if !defined(CP_CUDA_CPU_ROOT)
    if (!reason.empty())
      reason += " (this build uses nvcc; on a machine without a GPU, CUDA on the CPU runs the kernels: "
                "configure a new build with -DCP_CUDA=cuda-cpu after make setup)";
#endif
  });
  return reason;
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

void record_stream_use(const torch::Tensor& t, cudaStream_t stream, c10::Device stream_device) {
#if CP_TORCH_CUDA
  t.record_stream(c10::cuda::getStreamFromExternal(stream, stream_device.index()));
#else
  (void)t, (void)stream, (void)stream_device;
  CP_FAIL("a CUDA tensor cannot exist with a CPU-only LibTorch");
#endif
}

int compute_capability_major(c10::Device device) {
  CP_CHECK(device.is_cuda() && device.has_index(), "compute_capability_major: expected a CUDA device with an index, got ",
           device);
  int major = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index()));
  return major;
}

CudaDeviceScope::CudaDeviceScope(c10::Device device) {
  CP_CHECK(device.is_cuda() && device.has_index(), "CudaDeviceScope: expected a CUDA device with an index, got ", device);
#if CP_TORCH_CUDA
  CUDA_CHECK(cudaGetDevice(&previous_));
  CUDA_CHECK(cudaSetDevice(device.index()));
  stream_ = c10::cuda::getCurrentCUDAStream(device.index()).stream();
#else
  CP_FAIL("a CUDA tensor cannot exist with a CPU-only LibTorch");
#endif
}

CudaDeviceScope::~CudaDeviceScope() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);  // a destructor does not throw
}
#endif

}  // namespace cp
