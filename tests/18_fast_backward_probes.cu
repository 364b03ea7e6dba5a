// Lesson 18 — the probe of tests/18_fast_backward_probes.cuh: tile_gradients of the build's
// fast_backward_steps.cuh (the learner's or the solution's) on fragments loaded by the map.
#include "18_fast_backward_probes.cuh"
#include "common/cuda_check.h"
#include "common/error.h"
#include "fast_backward_steps.cuh"

namespace cp::testing {
namespace {

using namespace cp::fast_backward;

template <bool kKeyRows>
__global__ void __launch_bounds__(kThreads) task1_probe_kernel(Lesson18Task1Probe p) {
  __shared__ QueryRows rows;
  __shared__ int64_t key_pos[kBc];
  for (int i = threadIdx.x; i < 64; i += kThreads) {
    rows.lse[i] = p.lse[i], rows.delta[i] = p.delta[i], rows.first[i] = p.first[i], rows.last[i] = p.last[i];
    key_pos[i] = p.key_pos[i];
  }
  __syncthreads();
  const int warp = threadIdx.x / kernels::kWarpSize, lane = threadIdx.x % kernels::kWarpSize;
  FragC s[8], dp[8];
  for (int nt = 0; nt < 8; ++nt)
    for (int e = 0; e < 4; ++e) {
      const int at = (16 * warp + kernels::frag_c_row(lane, e)) * 64 + 8 * nt + kernels::frag_c_col(lane, e);
      s[nt].x[e] = p.s[at], dp[nt].x[e] = p.dp[at];
    }
  tile_gradients<kKeyRows>(s, dp, rows, key_pos, p.n_keys, p.scale, warp, lane);
  for (int nt = 0; nt < 8; ++nt)
    for (int e = 0; e < 4; ++e) {
      const int at = (16 * warp + kernels::frag_c_row(lane, e)) * 64 + 8 * nt + kernels::frag_c_col(lane, e);
      p.p_out[at] = s[nt].x[e], p.ds_out[at] = dp[nt].x[e];
    }
}

}  // namespace

void launch_lesson18_task1_probe(const Lesson18Task1Probe& probe, cudaStream_t stream) {
#ifdef CP_LESSON18_TASK1_NOT_STARTED
  (void)probe, (void)stream;
  throw NotImplemented("lesson 18, task 1: tile_gradients (delete the #define of task 1 in fast_backward_steps.cuh "
                       "once it is written)");
#else
  if (probe.key_rows) task1_probe_kernel<true><<<1, kThreads, 0, stream>>>(probe);
  else task1_probe_kernel<false><<<1, kThreads, 0, stream>>>(probe);
  CUDA_CHECK_LAUNCH();
#endif
}

}  // namespace cp::testing
