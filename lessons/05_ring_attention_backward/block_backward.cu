// GENERATED from solutions/05_ring_attention_backward/block_backward.cu by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 05, task 2 — the block backward on the GPU, as two kernels without atomics:
//   dq_kernel    owns query rows (like the forward): loops over key tiles, accumulates dQ;
//   dkdv_kernel  owns key rows: loops over the query heads of its GQA group and over query
//                tiles, accumulates dK and dV.
// Each output element is written by exactly one thread, so the result is deterministic; the
// price is that both kernels recompute P = exp(scale·q·k − lse) and dP = dO·v.
#include <climits>

#include "block_backward.cuh"
#include "common/cuda_check.h"
#include "common/error.h"
#include "kernels/dtype.cuh"
#include "kernels/tile.cuh"
#include "kernels/warp.cuh"

namespace cp {
namespace {

using kernels::kFullWarp;

constexpr int kRows = 64;  // rows (queries for dQ, keys for dK/dV) owned per block
constexpr int kTile = 32;  // rows of the other side streamed through shared memory per step

using kernels::group_sum;

template <typename T, int D>
__global__ void __launch_bounds__(kRows * (D / 32))
    dq_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
              const float* __restrict__ lse, const float* __restrict__ delta, const int64_t* __restrict__ q_first,
              const int64_t* __restrict__ q_last, const int64_t* __restrict__ k_pos, float* __restrict__ dq,
              BlockAttentionParams p) {
  constexpr int kSlice = 32;
  using L = kernels::PaddedTile<D, kSlice>;
  extern __shared__ __align__(16) float smem[];  // 16-byte aligned: the tiles are read as float4
  float* k_tile = smem;                   // [kTile][kStride]
  float* v_tile = smem + kTile * L::kStride;
  __shared__ int64_t kpos_tile[kTile];
  __shared__ int64_t block_first, block_last;  // the smallest first and the largest last of the block's rows

  const int64_t bh = blockIdx.x, b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t bh_kv = b * p.heads_kv + h / (p.heads_q / p.heads_kv);
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRows;
  const int g = threadIdx.x % L::kGroup;
  const int64_t i = row0 + threadIdx.x / L::kGroup;
  const bool active = i < p.seq_q;

  float q_reg[kSlice], do_reg[kSlice], dq_acc[kSlice];
  for (int d = 0; d < kSlice; ++d) {
    const int64_t at = (bh * p.seq_q + i) * D + g * kSlice + d;
    q_reg[d] = active ? kernels::to_float(q[at]) * p.scale : 0.0f;
    do_reg[d] = active ? kernels::to_float(dout[at]) : 0.0f;
    dq_acc[d] = 0.0f;
  }
  const float lse_i = active ? lse[bh * p.seq_q + i] : -INFINITY;
  const float delta_i = active ? delta[bh * p.seq_q + i] : 0.0f;
  const int64_t my_first = active && p.masked ? q_first[i] : LLONG_MIN;  // this row sees my_first .. my_last
  const int64_t my_last = active && p.masked ? q_last[i] : LLONG_MAX;
  if (threadIdx.x == 0 && p.masked) {
    const int rows = p.seq_q - row0 < kRows ? static_cast<int>(p.seq_q - row0) : kRows;
    int64_t first, last;  // locals: the shared variables are written once, below
    kernels::covered_range(q_first + row0, q_last + row0, rows, first, last);
    block_first = first;
    block_last = last;
  }

  for (int64_t j0 = 0; j0 < p.seq_k; j0 += kTile) {
    const int n = p.seq_k - j0 < kTile ? static_cast<int>(p.seq_k - j0) : kTile;
    if (threadIdx.x < kTile) kpos_tile[threadIdx.x] = threadIdx.x < n ? k_pos[j0 + threadIdx.x] : LLONG_MAX;
    __syncthreads();  // kpos_tile, block_first and block_last are visible
    if (p.masked) {
      int64_t min_k_pos, max_k_pos;
      kernels::covered_range(kpos_tile, kpos_tile, n, min_k_pos, max_k_pos);
      if (min_k_pos > block_last || max_k_pos < block_first) {  // no query of the block sees a key of the tile
        __syncthreads();                  // nobody rewrites kpos_tile while others still read it
        continue;
      }
    }
    L::template load<kTile>(k_tile, k + bh_kv * p.seq_k * D, j0, n);
    L::template load<kTile>(v_tile, v + bh_kv * p.seq_k * D, j0, n);
    __syncthreads();  // the tiles are complete

    // BEGIN YOUR CODE task 2: dQ of one key tile
    // TODO(lesson 05, task 2): (a) for each key of the tile: s and dP (group_sum), then ds and dq_acc += ds·k.
    // README, "Task 2 — the two kernels and their launch (`block_backward.cu`)", (a).
    (void)lse_i, (void)delta_i, (void)my_first, (void)my_last, (void)q_reg, (void)do_reg;
    // END YOUR CODE
    __syncthreads();  // done with the tiles before the next iteration overwrites them
  }
  if (!active) return;
  for (int d = 0; d < kSlice; ++d) dq[(bh * p.seq_q + i) * D + g * kSlice + d] = dq_acc[d] * p.scale;
}

template <typename T, int D>
__global__ void __launch_bounds__(kRows * (D / 16))
    dkdv_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                const int64_t* __restrict__ q_first, const int64_t* __restrict__ q_last,
                const int64_t* __restrict__ k_pos, float* __restrict__ dk, float* __restrict__ dv,
                BlockAttentionParams p) {
  constexpr int kSlice = 16;  // four accumulators per row (k, v, dk, dv): smaller slices, fewer registers
  using L = kernels::PaddedTile<D, kSlice>;
  extern __shared__ __align__(16) float smem[];  // 16-byte aligned: the tiles are read as float4
  float* q_tile = smem;                    // [kTile][kStride]
  float* do_tile = smem + kTile * L::kStride;
  __shared__ float lse_tile[kTile], delta_tile[kTile];
  __shared__ int64_t first_tile[kTile], last_tile[kTile];  // the keys each query of the tile sees
  __shared__ int64_t block_min_k_pos, block_max_k_pos;

  const int64_t bkv = blockIdx.x, b = bkv / p.heads_kv, h_kv = bkv % p.heads_kv;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRows;
  const int g = threadIdx.x % L::kGroup;
  const int64_t j = row0 + threadIdx.x / L::kGroup;
  const bool active = j < p.seq_k;

  float k_reg[kSlice], v_reg[kSlice], dk_acc[kSlice], dv_acc[kSlice];
  for (int d = 0; d < kSlice; ++d) {
    const int64_t at = (bkv * p.seq_k + j) * D + g * kSlice + d;
    k_reg[d] = active ? kernels::to_float(k[at]) * p.scale : 0.0f;
    v_reg[d] = active ? kernels::to_float(v[at]) : 0.0f;
    dk_acc[d] = dv_acc[d] = 0.0f;
  }
  const int64_t my_pos = active ? k_pos[j] : LLONG_MAX;
  if (threadIdx.x == 0) {
    const int rows = p.seq_k - row0 < kRows ? static_cast<int>(p.seq_k - row0) : kRows;
    int64_t min_pos, max_pos;  // locals: the shared variables are written once, below
    kernels::covered_range(k_pos + row0, k_pos + row0, rows, min_pos, max_pos);
    block_min_k_pos = min_pos;
    block_max_k_pos = max_pos;
  }

  for (int64_t hq = b * p.heads_q + h_kv * group; hq < b * p.heads_q + (h_kv + 1) * group; ++hq) {
    for (int64_t i0 = 0; i0 < p.seq_q; i0 += kTile) {
      const int n = p.seq_q - i0 < kTile ? static_cast<int>(p.seq_q - i0) : kTile;
      if (threadIdx.x < kTile) {
        const bool in = threadIdx.x < n;
        first_tile[threadIdx.x] = !in ? LLONG_MAX : p.masked ? q_first[i0 + threadIdx.x] : LLONG_MIN;
        last_tile[threadIdx.x] = !in ? LLONG_MIN : p.masked ? q_last[i0 + threadIdx.x] : LLONG_MAX;
        lse_tile[threadIdx.x] = in ? lse[hq * p.seq_q + i0 + threadIdx.x] : -INFINITY;
        delta_tile[threadIdx.x] = in ? delta[hq * p.seq_q + i0 + threadIdx.x] : 0.0f;
      }
      __syncthreads();  // the query tile's ranges, lse and delta are visible
      if (p.masked) {
        int64_t first, last;
        kernels::covered_range(first_tile, last_tile, n, first, last);
        if (last < block_min_k_pos || first > block_max_k_pos) {  // no query of the tile sees a key of the block
          __syncthreads();                  // nobody rewrites the tile arrays while others still read them
          continue;
        }
      }
      L::template load<kTile>(q_tile, q + hq * p.seq_q * D, i0, n);
      L::template load<kTile>(do_tile, dout + hq * p.seq_q * D, i0, n);
      __syncthreads();  // the tiles are complete

      // BEGIN YOUR CODE task 2: dK and dV of one query tile
      // TODO(lesson 05, task 2): (b) for each query of the tile: s, p, dv_acc += p·dO, dP, ds, dk_acc += ds·q.
      // README, "Task 2 — the two kernels and their launch (`block_backward.cu`)", (b).
      (void)my_pos, (void)k_reg, (void)v_reg;
      // END YOUR CODE
      __syncthreads();  // done with the tiles before the next iteration overwrites them
    }
  }
  if (!active) return;
  for (int d = 0; d < kSlice; ++d) {
    const int64_t at = (bkv * p.seq_k + j) * D + g * kSlice + d;
    dk[at] = dk_acc[d] * p.scale;
    dv[at] = dv_acc[d];
  }
}

template <typename T, int D>
void launch(const void* q, const void* k, const void* v, const void* dout, const float* lse, const float* delta,
            const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos, float* dq, float* dk, float* dv,
            const BlockAttentionParams& p, cudaStream_t stream) {
  constexpr size_t dq_smem = 2 * kTile * kernels::PaddedTile<D, 32>::kStride * sizeof(float);
  constexpr size_t dkdv_smem = 2 * kTile * kernels::PaddedTile<D, 16>::kStride * sizeof(float);
  int device = 0, max_shared = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlock, device));
  CP_CHECK(dq_smem <= static_cast<size_t>(max_shared) && dkdv_smem <= static_cast<size_t>(max_shared),
           "block backward: the tiles need ", dq_smem, " and ", dkdv_smem, " bytes of shared memory, the device allows ",
           max_shared);
  const auto* tq = static_cast<const T*>(q);
  const auto* tk = static_cast<const T*>(k);
  const auto* tv = static_cast<const T*>(v);
  const auto* tdo = static_cast<const T*>(dout);
  // BEGIN YOUR CODE task 2: launch both kernels
  // TODO(lesson 05, task 2): (c) launch dq_kernel and dkdv_kernel on `stream`, each launch checked.
  // README, "Task 2 — the two kernels and their launch (`block_backward.cu`)", (c).
  (void)tq, (void)tk, (void)tv, (void)tdo, (void)lse, (void)delta, (void)q_first, (void)q_last, (void)k_pos,
  (void)dq, (void)dk, (void)dv, (void)p, (void)stream;
  throw NotImplemented("lesson 05, task 2: launch the backward kernels");
  // END YOUR CODE
}

}  // namespace

void launch_block_attention_backward(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                                     const float* delta, const int64_t* q_first, const int64_t* q_last,
                                     const int64_t* k_pos, float* dq, float* dk, float* dv,
                                     const BlockAttentionParams& p, DType dtype, cudaStream_t stream) {
  CP_CHECK(block_attention_supports_head_dim(p.head_dim), "block backward: unsupported head dim ", p.head_dim);
  CP_CHECK((p.seq_q + kRows - 1) / kRows <= 65535 && (p.seq_k + kRows - 1) / kRows <= 65535,
           "block backward: sequence too long for one launch (Sq = ", p.seq_q, ", Sk = ", p.seq_k, ")");
  if (p.batch * p.heads_q == 0) return;
  kernels::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (p.head_dim) {
      case 32: launch<T, 32>(q, k, v, dout, lse, delta, q_first, q_last, k_pos, dq, dk, dv, p, stream); break;
      case 64: launch<T, 64>(q, k, v, dout, lse, delta, q_first, q_last, k_pos, dq, dk, dv, p, stream); break;
      case 128: launch<T, 128>(q, k, v, dout, lse, delta, q_first, q_last, k_pos, dq, dk, dv, p, stream); break;
    }
  });
}

}  // namespace cp
