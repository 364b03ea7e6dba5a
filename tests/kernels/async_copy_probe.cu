// The probe of kernels/async_copy.cuh: two groups of copies, a snapshot of shared memory after
// each wait.
#include "common/cuda_check.h"
#include "kernels/async_copy.cuh"
#include "kernels/warp.cuh"
#include "tests/kernels/async_copy_probe.cuh"

namespace cp::testing {
namespace {

constexpr int kTile = 256;                 // floats a tile: 64 copies of 16 bytes
constexpr int kCopies = kTile / 4 / 32;    // copies per thread and tile

__global__ void async_copy_probe_kernel(AsyncCopyProbe p) {
  __shared__ __align__(16) float tiles[2 * kTile];
  kernels::declare_shared(tiles, sizeof tiles);
  const int lane = threadIdx.x;
  for (int i = lane; i < 2 * kTile; i += kernels::kWarpSize) tiles[i] = -1.0f;
  __syncthreads();
  kernels::AsyncCopies<2 * kCopies + 1> copies;
  for (int tile = 0; tile < 2; ++tile) {
    for (int c = 0; c < kCopies; ++c) {
      const int offset = tile * kTile + 4 * (lane + kernels::kWarpSize * c);
      copies.copy16(tiles + offset, p.src + offset);
    }
    copies.commit();
  }
  if (p.misuse == 1) copies.copy16(p.after_wait1, p.src);
  if (p.misuse == 2) copies.copy16(tiles + 1, p.src);
  copies.wait_all_but_newest();
  __syncthreads();  // every thread's group 0 landed before anyone reads it
  for (int i = lane; i < 2 * kTile; i += kernels::kWarpSize) p.after_wait1[i] = tiles[i];
  __syncthreads();  // every thread has read its snapshot before group 1 may land
  copies.wait_all();
  __syncthreads();
  for (int i = lane; i < 2 * kTile; i += kernels::kWarpSize) p.after_wait0[i] = tiles[i];
}

}  // namespace

void launch_async_copy_probe(const AsyncCopyProbe& probe, cudaStream_t stream) {
  async_copy_probe_kernel<<<1, kernels::kWarpSize, 0, stream>>>(probe);
  CUDA_CHECK_LAUNCH();
  kernels::throw_on_emulation_fault(stream, "async_copy_probe_kernel");
}

}  // namespace cp::testing
