// Lesson 16 — the probe kernels of tests/16_tensor_cores_probes.cuh: each runs one task's device
// function of the build's tensor_core_steps.cuh (the learner's or the solution's) and writes
// every fragment back through the map of kernels/mma_map.h, element by element.
#include "16_tensor_cores_probes.cuh"
#include "common/cuda_check.h"
#include "common/error.h"
#include "kernels/dtype.cuh"
#include "tensor_core_steps.cuh"

namespace cp::testing {
namespace {

using namespace cp::tensor_core;
using kernels::kWarpSize;

constexpr int kThreads = kWarps * kWarpSize;

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) task1_probe_kernel(Lesson16Task1Probe p) {
  __shared__ __align__(16) uint16_t raw[2 * kBr * kLd<D>];
  T* q_tile = reinterpret_cast<T*>(raw);
  T* k_tile = q_tile + kBr * kLd<D>;
  kernels::declare_shared(raw, sizeof raw);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  for (int i = threadIdx.x; i < kBr * D; i += blockDim.x) {
    q_tile[(i / D) * kLd<D> + i % D] = q[i];
    k_tile[(i / D) * kLd<D> + i % D] = k[i];
  }
  __syncthreads();
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  FragA q_frag[D / 16];
  load_q_fragments<T, D>(q_frag, q_tile, warp, lane);
  for (int kk = 0; kk < D / 16; ++kk)
    for (int e = 0; e < 8; ++e)
      p.q_frag[((warp * kWarpSize + lane) * (D / 16) + kk) * 8 + e] = kernels::unpack<T>(q_frag[kk].x[e / 2], e % 2);
  FragC s[kBc / 8];
  compute_scores<T, D>(s, q_frag, k_tile, lane);
  for (int nt = 0; nt < kBc / 8; ++nt)
    for (int e = 0; e < 4; ++e)
      p.s[(16 * warp + kernels::frag_c_row(lane, e)) * kBc + 8 * nt + kernels::frag_c_col(lane, e)] = s[nt].x[e];
}

constexpr int kProbeD = 64;

__global__ void __launch_bounds__(kThreads) task2_probe_kernel(Lesson16Task2Probe p) {
  __shared__ int64_t kpos_tile[kBc];
  if (threadIdx.x < kBc) kpos_tile[threadIdx.x] = p.kpos[threadIdx.x];
  __syncthreads();
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  auto row_of = [&](int e) { return 16 * warp + kernels::frag_c_row(lane, e); };
  FragC s[kBc / 8], o[kProbeD / 8];
  for (int nt = 0; nt < kBc / 8; ++nt)
    for (int e = 0; e < 4; ++e) s[nt].x[e] = p.s[row_of(e) * kBc + 8 * nt + kernels::frag_c_col(lane, e)];
  for (int dt = 0; dt < kProbeD / 8; ++dt)
    for (int e = 0; e < 4; ++e) o[dt].x[e] = p.o_in[row_of(e) * kProbeD + 8 * dt + kernels::frag_c_col(lane, e)];
  float m[2], l[2];
  int64_t first[2], last[2];
  for (int r = 0; r < 2; ++r) {
    const int row = row_of(2 * r);
    m[r] = p.m_in[row];
    l[r] = lane % 4 == 0 ? p.l_in[row] : 0.0f;
    first[r] = p.first[row];
    last[r] = p.last[row];
  }
  softmax_tile<kProbeD>(s, o, m, l, kpos_tile, p.n, first, last, p.scale, lane);
  for (int nt = 0; nt < kBc / 8; ++nt)
    for (int e = 0; e < 4; ++e) p.p[row_of(e) * kBc + 8 * nt + kernels::frag_c_col(lane, e)] = s[nt].x[e];
  for (int dt = 0; dt < kProbeD / 8; ++dt)
    for (int e = 0; e < 4; ++e) p.o_out[row_of(e) * kProbeD + 8 * dt + kernels::frag_c_col(lane, e)] = o[dt].x[e];
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];  // the row's sum: this lane's part and the other three of its quad
    sum += __shfl_xor_sync(kernels::kFullWarp, sum, 1);
    sum += __shfl_xor_sync(kernels::kFullWarp, sum, 2);
    if (lane % 4 == 0) {
      p.m_out[row_of(2 * r)] = m[r];
      p.l_out[row_of(2 * r)] = sum;
    }
  }
}

}  // namespace

void launch_lesson16_task1_probe(const Lesson16Task1Probe& probe, cudaStream_t stream) {
#ifdef CP_LESSON16_TASK1_NOT_STARTED
  (void)probe, (void)stream;
  throw NotImplemented("lesson 16, task 1: load_q_fragments and compute_scores (delete the #define of task 1 in "
                       "tensor_core_steps.cuh once they are written)");
#else
  if (probe.dtype == DType::Float16 && probe.head_dim == 64)
    task1_probe_kernel<__half, 64><<<1, kThreads, 0, stream>>>(probe);
  else if (probe.dtype == DType::BFloat16 && probe.head_dim == 128)
    task1_probe_kernel<__nv_bfloat16, 128><<<1, kThreads, 0, stream>>>(probe);
  else
    throw Error("lesson 16's task 1 probe: float16 at D = 64 or bfloat16 at D = 128", __FILE__, __LINE__);
  CUDA_CHECK_LAUNCH();
  kernels::throw_on_emulation_fault(stream, "lesson 16's task 1 probe (load_q_fragments, compute_scores)");
#endif
}

void launch_lesson16_task2_probe(const Lesson16Task2Probe& probe, cudaStream_t stream) {
#ifdef CP_LESSON16_TASK2_NOT_STARTED
  (void)probe, (void)stream;
  throw NotImplemented("lesson 16, task 2: softmax_tile (delete the #define of task 2 in tensor_core_steps.cuh once "
                       "it is written)");
#else
  task2_probe_kernel<<<1, kThreads, 0, stream>>>(probe);
  CUDA_CHECK_LAUNCH();
#endif
}

}  // namespace cp::testing
