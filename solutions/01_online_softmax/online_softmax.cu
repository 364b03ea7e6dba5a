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

  // BEGIN SOLUTION task 4: per-lane states and the warp merge
  // STUB: // TODO(lesson 01, task 4): (a) each lane's state of its elements, (b) the butterfly merge with __shfl_xor_sync.
  // STUB: // README, "Task 4 — the warp-per-row CUDA kernel (`online_softmax.cu`)" and "How the CUDA kernel works".
  // STUB: (void)x_row, (void)lane, (void)row_len;
  for (int64_t j = lane; j < row_len; j += kWarpSize) state.add(kernels::to_float(x_row[j]));

  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const SoftmaxState other{__shfl_xor_sync(kFullWarp, state.m, offset),
                             __shfl_xor_sync(kFullWarp, state.l, offset)};
    state = merge(state, other);
  }
  // END SOLUTION
  if (!active) return;  // past the last shuffle: an idle warp may leave now

  // BEGIN SOLUTION task 4: write lse and y
  // STUB: // TODO(lesson 01, task 4): (c) lane 0 writes lse[row], the lanes write y (each unless its pointer is null).
  // STUB: // README, "Task 4 — the warp-per-row CUDA kernel (`online_softmax.cu`)".
  // STUB: (void)y, (void)lse, (void)state;
  if (lse != nullptr && lane == 0) lse[row] = state.logsumexp();
  if (y != nullptr) {
    T* y_row = y + row * n;
    const float inv_l = 1.0f / state.l;  // unused for an empty row, which gives zeros, not NaN
    const bool empty = state.l == 0.0f;  // not `l > 0`: a NaN row (l = NaN) must give NaN, not zeros
    for (int64_t j = lane; j < n; j += kWarpSize)
      y_row[j] = kernels::from_float<T>(empty ? 0.0f : expf(kernels::to_float(x_row[j]) - state.m) * inv_l);
  }
  // END SOLUTION
}

}  // namespace

void launch_online_softmax(const void* x, void* y, float* lse, int64_t rows, int64_t n, DType dtype,
                           cudaStream_t stream) {
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;  // one warp per row
  CP_CHECK(blocks <= INT32_MAX, "x: too many rows for one launch (", rows, ")");
  if (rows == 0) return;  // a grid of zero blocks is a launch error, and there is nothing to do
  // BEGIN SOLUTION task 4: launch the kernel
  // STUB: // TODO(lesson 01, task 4): launch online_softmax_kernel<T>, T from kernels::dispatch_dtype, and check the launch.
  // STUB: // README, "Task 4 — the warp-per-row CUDA kernel (`online_softmax.cu`)".
  // STUB: (void)x, (void)y, (void)lse, (void)n, (void)dtype, (void)stream;
  // STUB: throw NotImplemented("lesson 01, task 4: launch_online_softmax");
  kernels::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    online_softmax_kernel<T><<<static_cast<unsigned>(blocks), kWarpsPerBlock * kWarpSize, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(y), lse, rows, n);
  });
  CUDA_CHECK_LAUNCH();
  // END SOLUTION
}

}  // namespace cp
