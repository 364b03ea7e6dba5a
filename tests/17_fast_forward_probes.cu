// Lesson 17 — the probe of tests/17_fast_forward_probes.cuh: issue_tile_copies of the build's
// fast_forward_steps.cuh (the learner's or the solution's), then the tile written back whole.
#include "17_fast_forward_probes.cuh"
#include "common/cuda_check.h"
#include "common/error.h"
#include "fast_forward_steps.cuh"

namespace cp::testing {
namespace {

using namespace cp::fast_forward;

constexpr uint16_t kUntouched = 0x7777;  // what the tile holds before the copies

template <int D>
__global__ void __launch_bounds__(kThreads) task1_probe_kernel(Lesson17Task1Probe p) {
  __shared__ __align__(16) uint16_t tile[kBc * kLd<D>];
  kernels::declare_shared(tile, sizeof tile);
  for (int i = threadIdx.x; i < kBc * kLd<D>; i += kThreads) tile[i] = kUntouched;
  __syncthreads();
  kernels::AsyncCopies<kCopiesPerThread<D, kBc>> copies;
  issue_tile_copies<__half, D, kBc>(copies, reinterpret_cast<__half*>(tile), reinterpret_cast<const __half*>(p.src),
                                    p.row0, p.n);
  copies.commit();
  copies.wait_all();
  __syncthreads();  // every thread's copies have landed
  for (int i = threadIdx.x; i < kBc * kLd<D>; i += kThreads) p.tile[i] = tile[i];
}

}  // namespace

void launch_lesson17_task1_probe(const Lesson17Task1Probe& probe, cudaStream_t stream) {
#ifdef CP_LESSON17_TASK1_NOT_STARTED
  (void)probe, (void)stream;
  throw NotImplemented("lesson 17, task 1: issue_tile_copies (delete the #define of task 1 in fast_forward_steps.cuh "
                       "once it is written)");
#else
  if (probe.head_dim == 64) task1_probe_kernel<64><<<1, kThreads, 0, stream>>>(probe);
  else task1_probe_kernel<128><<<1, kThreads, 0, stream>>>(probe);
  CUDA_CHECK_LAUNCH();
  kernels::throw_on_emulation_fault(stream, "lesson 17's task 1 probe (issue_tile_copies)");
#endif
}

}  // namespace cp::testing
