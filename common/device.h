// Which devices this build and this machine can use, and the CUDA stream kernels run on.
#pragma once

#include <string>

#include <c10/core/Device.h>
#include <torch/types.h>

#if CP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace cp {

/// Why CUDA tensors cannot be used here, or "" when they can. Tests skip with this reason.
std::string cuda_unavailable_reason();

/// Makes autograd run the backward of every graph this thread starts on this thread, CUDA nodes
/// included. By default PyTorch runs the CUDA nodes of every backward on one worker thread per
/// GPU, shared by all threads of the process: two rank threads whose backward passes communicate
/// (lesson 09's autograd Function) would queue behind each other there, and the first to wait
/// for a peer would wait forever. Every rank thread of a local world calls it, and so do the
/// mpi and nccl worlds (MPI is then called from the rank's own thread). Nothing to do without
/// CUDA tensors: CPU nodes always run on the calling thread.
void run_backward_on_this_thread();

/// Waits until the work queued so far on the current stream of t's device is done (nothing for
/// a CPU tensor). Kernel launches return before the kernel runs: the rings call this around a
/// timed block so that per-step times and trace spans cover the GPU's work, not its launch.
void wait_for_device_work(const torch::Tensor& t);

/// The calling thread's current CUDA device, with its index (what torch::kCUDA without an index
/// means): the GPU an mpi or nccl world gave this process (one per process while the node has
/// enough), cuda:0 in the rank threads of a local world. A cp::Error without CUDA tensors.
torch::Device current_cuda_device();

/// Why kernels cannot be launched on raw device buffers (cudaMalloc) here, or "" when they can:
/// a GPU with nvcc's runtime, or CUDA on the CPU (chipStar + PoCL).
std::string cuda_runtime_unavailable_reason();

#if CP_WITH_CUDA
/// The stream LibTorch's next operation on the current device runs on: kernels are launched
/// on it so that they are ordered with the tensor operations around them.
cudaStream_t current_cuda_stream();

/// Tells LibTorch's caching allocator that work queued on `stream` (created outside LibTorch, on
/// `stream_device`) uses t's memory: when t is freed, the memory goes to no other tensor before
/// the work queued on `stream` by then has finished (Tensor::record_stream). The comm backends
/// call it for the buffers of their transfers, so that a Request destroyed without wait() (its
/// owner threw) frees no memory that a copy still reads or writes, and no host thread waits for
/// a transfer that may never complete.
void record_stream_use(const torch::Tensor& t, cudaStream_t stream, c10::Device stream_device);

/// The major compute capability of a CUDA device (8: A100, 9: H100): which instructions its
/// kernels may use. `device` needs an index (q.device() of a CUDA tensor has one).
int compute_capability_major(c10::Device device);

/// For the scope: the GPU of a CUDA tensor becomes the thread's current device (kernels launch
/// on the current device, and a rank thread starts on device 0 whatever its tensors' device),
/// and stream() is that device's current LibTorch stream. The previous device comes back at the
/// end. The CUDA branches of the lessons launch their kernels inside one.
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(c10::Device device);
  ~CudaDeviceScope();
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;
  cudaStream_t stream() const { return stream_; }

 private:
  int previous_ = -1;
  cudaStream_t stream_ = nullptr;
};
#endif

}  // namespace cp
