// GENERATED from solutions/01_online_softmax/online_softmax.cu by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 01, task 4 — the online softmax kernel: one warp per row.
//
// Each lane walks the row with stride 32 (neighbouring lanes read neighbouring elements, so
// every load instruction of the warp is coalesced) and keeps its own (m, l) state. The 32
// states are merged with a butterfly of shuffles: after log2(32) = 5 steps every lane holds the
// state of the whole row. The statistics therefore cost one read of the row; the output pass
// reads it once more (from L2 for rows that fit) and writes y.
#include "common/cuda_check.h"
#include "kernels/dtype.cuh"
#include "kernels/warp.cuh"
#include "online_softmax.cuh"
#include "softmax_state.h"

namespace cp {
namespace {

using kernels::kFullWarp;
using kernels::kWarpSize;

constexpr int kWarpsPerBlock = 4;  // 128 threads: small blocks keep many rows in flight

template <typename T>
__global__ void online_softmax_kernel(const T* __restrict__ x,  // [rows, n]
                                      T* __restrict__ y,        // [rows, n] or nullptr
                                      float* __restrict__ lse,  // [rows] or nullptr
                                      int64_t rows, int64_t n) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  // A warp past the last row does not return yet: every lane of the block must reach every
  // shuffle (kernels/README.md, rule 1). It merges the states of an empty row and leaves
  // before the stores.
  const bool active = row < rows;
  const int64_t row_len = active ? n : 0;  // elements this warp reads
  const T* x_row = x + (active ? row : 0) * n;
  SoftmaxState state = SoftmaxState::empty();

  // BEGIN YOUR CODE task 4: per-lane states and the warp merge
  // TODO(lesson 01, task 4): (a) each lane's state of its elements, (b) the butterfly merge with __shfl_xor_sync.
  // README, "Task 4 — the warp-per-row CUDA kernel (`online_softmax.cu`)" and "How the CUDA kernel works".
  (void)x_row, (void)lane, (void)row_len;
  // END YOUR CODE
  if (!active) return;  // past the last shuffle: an idle warp may leave now

  // BEGIN YOUR CODE task 4: write lse and y
  // TODO(lesson 01, task 4): (c) lane 0 writes lse[row], the lanes write y (each unless its pointer is null).
  // README, "Task 4 — the warp-per-row CUDA kernel (`online_softmax.cu`)".
  (void)y, (void)lse, (void)state;
  // END YOUR CODE
}

}  // namespace

void launch_online_softmax(const void* x, void* y, float* lse, int64_t rows, int64_t n, DType dtype,
                           cudaStream_t stream) {
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;  // one warp per row
  CP_CHECK(blocks <= INT32_MAX, "x: too many rows for one launch (", rows, ")");
  if (rows == 0) return;  // a grid of zero blocks is a launch error, and there is nothing to do
  // BEGIN YOUR CODE task 4: launch the kernel
  // TODO(lesson 01, task 4): launch online_softmax_kernel<T>, T from kernels::dispatch_dtype, and check the launch.
  // README, "Task 4 — the warp-per-row CUDA kernel (`online_softmax.cu`)".
  (void)x, (void)y, (void)lse, (void)n, (void)dtype, (void)stream;
  throw NotImplemented("lesson 01, task 4: launch_online_softmax");
  // END YOUR CODE
}

}  // namespace cp
