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

/// Copies that land at once and log where each goes, in the order a thread issues them: the
/// places the bank test reads.
template <int kCopies>
struct LoggedCopies {
  const uint16_t* tile;
  int32_t* places;  // [kThreads][kCopies], −1 first
  int issued = 0;

  __device__ void copy16(void* dst, const void* src) {
    if (issued < kCopies)
      places[threadIdx.x * kCopies + issued] = static_cast<int32_t>((static_cast<uint16_t*>(dst) - tile) / 8);
    ++issued;
    *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
  }
};

template <int D>
__global__ void __launch_bounds__(kThreads) task1_probe_kernel(Lesson17Task1Probe p) {
  __shared__ __align__(16) uint16_t tile[kBc * kLd<D>];
  kernels::declare_shared(tile, sizeof tile);
  for (int i = threadIdx.x; i < kBc * kLd<D>; i += kThreads) tile[i] = kUntouched;
  __syncthreads();
  if (p.places) {
    LoggedCopies<kCopiesPerThread<D, kBc>> copies{tile, p.places};
    issue_tile_copies<__half, D, kBc>(copies, reinterpret_cast<__half*>(tile), reinterpret_cast<const __half*>(p.src),
                                      p.row0, p.n);
  } else {
    kernels::AsyncCopies<kCopiesPerThread<D, kBc>> copies;
    issue_tile_copies<__half, D, kBc>(copies, reinterpret_cast<__half*>(tile), reinterpret_cast<const __half*>(p.src),
                                      p.row0, p.n);
    copies.commit();
    copies.wait_all();
  }
  __syncthreads();  // every thread's copies have landed
  for (int i = threadIdx.x; i < kBc * kLd<D>; i += kThreads) p.tile[i] = tile[i];
}

template <int D>
constexpr int kTask4ProbeBytes = (kWideRows + 2 * kBc) * kLd<D> * 2;

template <int D>
__global__ void __launch_bounds__(kThreads) task4_probe_kernel(Lesson17Task4Probe p) {
  extern __shared__ __align__(16) uint16_t tiles[];  // kTask4ProbeBytes<D>: Q, K, V
  uint16_t* q_raw = tiles;
  uint16_t* k_raw = q_raw + kWideRows * kLd<D>;
  uint16_t* v_raw = k_raw + kBc * kLd<D>;
  kernels::declare_shared(tiles, kTask4ProbeBytes<D>);
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  const uint16_t* k = static_cast<const uint16_t*>(p.k);
  const uint16_t* v = static_cast<const uint16_t*>(p.v);
  for (int i = threadIdx.x; i < kWideRows * D; i += kThreads) q_raw[(i / D) * kLd<D> + i % D] = q[i];
  for (int i = threadIdx.x; i < kBc * D; i += kThreads) {
    k_raw[(i / D) * kLd<D> + i % D] = k[i];
    v_raw[(i / D) * kLd<D> + i % D] = v[i];
  }
  __syncthreads();
  const int warp = threadIdx.x / kernels::kWarpSize, lane = threadIdx.x % kernels::kWarpSize;
  FragC s[kGroups][kBc / 8];
  FragC o[kGroups][D / 8];
  compute_scores_wide<__half, D>(s, reinterpret_cast<const __half*>(q_raw), reinterpret_cast<const __half*>(k_raw),
                                 warp, lane);
  accumulate_pv_wide<__half, D>(o, s, reinterpret_cast<const __half*>(v_raw), lane);
  for (int i = 0; i < kGroups; ++i)
    for (int e = 0; e < 4; ++e) {
      const int row = 32 * warp + 16 * i + kernels::frag_c_row(lane, e);
      for (int nt = 0; nt < kBc / 8; ++nt) p.scores[row * kBc + 8 * nt + kernels::frag_c_col(lane, e)] = s[i][nt].x[e];
      for (int dt = 0; dt < D / 8; ++dt) p.out[row * D + 8 * dt + kernels::frag_c_col(lane, e)] = o[i][dt].x[e];
    }
}

}  // namespace

void launch_lesson17_task4_probe(const Lesson17Task4Probe& probe, cudaStream_t stream) {
#ifdef CP_LESSON17_TASK4_NOT_STARTED
  (void)probe, (void)stream;
  throw NotImplemented("lesson 17, task 4: compute_scores_wide and accumulate_pv_wide (delete the #define of task 4 "
                       "in fast_forward_steps.cuh once they are written)");
#else
  auto launch = [&](auto kernel, int bytes) {
    kernels::allow_dynamic_shared(kernel, bytes);
    kernel<<<1, kThreads, bytes, stream>>>(probe);
  };
  if (probe.head_dim == 64) launch(task4_probe_kernel<64>, kTask4ProbeBytes<64>);
  else launch(task4_probe_kernel<128>, kTask4ProbeBytes<128>);
  CUDA_CHECK_LAUNCH();
  kernels::throw_on_emulation_fault(stream, "lesson 17's task 4 probe (compute_scores_wide, accumulate_pv_wide)");
#endif
}

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
