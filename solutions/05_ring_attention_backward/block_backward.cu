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

    // BEGIN SOLUTION task 2: dQ of one key tile
    // STUB: // TODO(lesson 05, task 2): (a) for each key of the tile: s and dP (group_sum), then ds and dq_acc += ds·k.
    // STUB: // README, "Task 2 — the two kernels and their launch (`block_backward.cu`)", (a).
    // STUB: (void)lse_i, (void)delta_i, (void)my_first, (void)my_last, (void)q_reg, (void)do_reg;
    for (int jj = 0; jj < kTile; ++jj) {
      const float* k_row = k_tile + L::at(jj, g * kSlice);
      const float* v_row = v_tile + L::at(jj, g * kSlice);
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int c = 0; c < kSlice / 4; ++c) {  // four dims per shared load
        const float4 k4 = L::load4(k_row, c), v4 = L::load4(v_row, c);
        s += q_reg[4 * c] * k4.x + q_reg[4 * c + 1] * k4.y + q_reg[4 * c + 2] * k4.z + q_reg[4 * c + 3] * k4.w;
        dp += do_reg[4 * c] * v4.x + do_reg[4 * c + 1] * v4.y + do_reg[4 * c + 2] * v4.z + do_reg[4 * c + 3] * v4.w;
      }
      s = group_sum<L::kGroup>(s);
      dp = group_sum<L::kGroup>(dp);
      // `!= -INFINITY`, not `> -INFINITY`: a NaN row is not an empty one.
      const bool visible = jj < n && lse_i != -INFINITY && my_first <= kpos_tile[jj] && kpos_tile[jj] <= my_last;
      if (visible) {  // a hidden pair adds nothing, not 0 · NaN (its k may be NaN)
        const float ds = expf(s - lse_i) * (dp - delta_i);
#pragma unroll
        for (int c = 0; c < kSlice / 4; ++c) {
          const float4 k4 = L::load4(k_row, c);
          dq_acc[4 * c] += ds * k4.x;
          dq_acc[4 * c + 1] += ds * k4.y;
          dq_acc[4 * c + 2] += ds * k4.z;
          dq_acc[4 * c + 3] += ds * k4.w;
        }
      }
    }
    // END SOLUTION
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

      // BEGIN SOLUTION task 2: dK and dV of one query tile
      // STUB: // TODO(lesson 05, task 2): (b) for each query of the tile: s, p, dv_acc += p·dO, dP, ds, dk_acc += ds·q.
      // STUB: // README, "Task 2 — the two kernels and their launch (`block_backward.cu`)", (b).
      // STUB: (void)my_pos, (void)k_reg, (void)v_reg;
      for (int ii = 0; ii < kTile; ++ii) {
        const float* q_row = q_tile + L::at(ii, g * kSlice);
        const float* do_row = do_tile + L::at(ii, g * kSlice);
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int c = 0; c < kSlice / 4; ++c) {  // four dims per shared load
          const float4 q4 = L::load4(q_row, c), do4 = L::load4(do_row, c);
          s += k_reg[4 * c] * q4.x + k_reg[4 * c + 1] * q4.y + k_reg[4 * c + 2] * q4.z + k_reg[4 * c + 3] * q4.w;
          dp += v_reg[4 * c] * do4.x + v_reg[4 * c + 1] * do4.y + v_reg[4 * c + 2] * do4.z + v_reg[4 * c + 3] * do4.w;
        }
        s = group_sum<L::kGroup>(s);
        dp = group_sum<L::kGroup>(dp);
        // `!= -INFINITY`, not `> -INFINITY`: a NaN row is not an empty one.
        const bool visible = ii < n && lse_tile[ii] != -INFINITY && first_tile[ii] <= my_pos && my_pos <= last_tile[ii];
        if (visible) {  // a hidden pair adds nothing, not 0 · NaN (its q or dO may be NaN)
          const float prob = expf(s - lse_tile[ii]);
          const float ds = prob * (dp - delta_tile[ii]);
#pragma unroll
          for (int c = 0; c < kSlice / 4; ++c) {
            const float4 q4 = L::load4(q_row, c), do4 = L::load4(do_row, c);
            dv_acc[4 * c] += prob * do4.x;
            dv_acc[4 * c + 1] += prob * do4.y;
            dv_acc[4 * c + 2] += prob * do4.z;
            dv_acc[4 * c + 3] += prob * do4.w;
            dk_acc[4 * c] += ds * q4.x;
            dk_acc[4 * c + 1] += ds * q4.y;
            dk_acc[4 * c + 2] += ds * q4.z;
            dk_acc[4 * c + 3] += ds * q4.w;
          }
        }
      }
      // END SOLUTION
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
  // BEGIN SOLUTION task 2: launch both kernels
  // STUB: // TODO(lesson 05, task 2): (c) launch dq_kernel and dkdv_kernel on `stream`, each launch checked.
  // STUB: // README, "Task 2 — the two kernels and their launch (`block_backward.cu`)", (c).
  // STUB: (void)tq, (void)tk, (void)tv, (void)tdo, (void)lse, (void)delta, (void)q_first, (void)q_last, (void)k_pos,
  // STUB: (void)dq, (void)dk, (void)dv, (void)p, (void)stream;
  // STUB: throw NotImplemented("lesson 05, task 2: launch the backward kernels");
  if (p.seq_q > 0) {
    const dim3 grid(static_cast<unsigned>(p.batch * p.heads_q), static_cast<unsigned>((p.seq_q + kRows - 1) / kRows));
    dq_kernel<T, D><<<grid, kRows * (D / 32), dq_smem, stream>>>(tq, tk, tv, tdo, lse, delta, q_first, q_last, k_pos, dq, p);
    CUDA_CHECK_LAUNCH();
  }
  if (p.seq_k > 0) {
    const dim3 grid(static_cast<unsigned>(p.batch * p.heads_kv), static_cast<unsigned>((p.seq_k + kRows - 1) / kRows));
    dkdv_kernel<T, D><<<grid, kRows * (D / 16), dkdv_smem, stream>>>(tq, tk, tv, tdo, lse, delta, q_first, q_last, k_pos, dk, dv,
                                                                     p);
    CUDA_CHECK_LAUNCH();
  }
  // END SOLUTION
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
