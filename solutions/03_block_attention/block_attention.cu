// Lesson 03, task 3 — block attention forward on the GPU: tiles of keys through shared memory,
// (m, l, O) per query row in registers.
//
// Grid: one block per (batch·query head, tile of kBr = 64 query rows). Each query row is owned
// by a "row group" of D/32 adjacent threads; thread g of the group holds dims [32g, 32g + 32) of
// the row's q (pre-scaled) and of its output accumulator O. K and V tiles of kBc = 32 keys are
// loaded once per block into shared memory and read by all 64 rows: that reuse is the point of
// tiling. This is the readable form of the algorithm: no tensor cores, no asynchronous copies.
#include <cfloat>
#include <climits>

#include "block_attention.cuh"
#include "common/cuda_check.h"
#include "common/error.h"
#include "kernels/dtype.cuh"
#include "kernels/tile.cuh"
#include "kernels/warp.cuh"

namespace cp {
namespace {

using kernels::kFullWarp;

constexpr int kBr = 64;        // query rows per block
constexpr int kBc = 32;        // keys per tile
constexpr int kSlice = 32;     // dims per thread

template <int D>
using Tile = kernels::PaddedTile<D, kSlice>;  // a key's D floats in shared memory, padded per slice

template <int D>
constexpr size_t kSharedBytes = 2 * kBc * Tile<D>::kStride * sizeof(float);  // the K and V tiles

// At least 2 blocks per SM: with float4 loads ptxas would take ~160 registers per thread, which
// leaves one block of 256 threads (D = 128) per SM and nothing to hide a barrier's wait behind.
// The price at D = 128: 128 registers and a spill of 80 to 88 bytes (make kernel-stats).
template <typename T, int D>
__global__ void __launch_bounds__(kBr * (D / kSlice), 2)
    block_attention_forward_kernel(const T* __restrict__ q,        // [B, Hq, Sq, D]
                                   const T* __restrict__ k,        // [B, Hkv, Sk, D]
                                   const T* __restrict__ v,        // [B, Hkv, Sk, D]
                                   T* __restrict__ out,            // [B, Hq, Sq, D]
                                   float* __restrict__ lse,        // [B, Hq, Sq]
                                   const int64_t* __restrict__ q_first,  // [Sq]: the first and last key
                                   const int64_t* __restrict__ q_last,   // [Sq]  position each query sees
                                   const int64_t* __restrict__ k_pos,    // [Sk]
                                   BlockAttentionParams p) {
  constexpr int kGroup = D / kSlice;  // threads per query row
  extern __shared__ __align__(16) float smem[];  // 16-byte aligned: the tiles are read as float4
  float* k_tile = smem;                          // [kBc][Tile::kStride]
  float* v_tile = smem + kBc * Tile<D>::kStride;  // [kBc][Tile::kStride]
  __shared__ __align__(16) int64_t kpos_tile[kBc];  // aligned: two positions per 16-byte load
  __shared__ int64_t block_first, block_last;  // the smallest first and the largest last of the block's rows

  const int64_t bh = blockIdx.x;  // b * Hq + h
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t bh_kv = b * p.heads_kv + h / (p.heads_q / p.heads_kv);  // GQA: the group's kv head
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kBr;
  const int t = threadIdx.x, g = t % kGroup;
  const int64_t i = row0 + t / kGroup;  // this thread's query row
  const bool active = i < p.seq_q;      // inactive threads still join every barrier and shuffle
  const T* k_head = k + bh_kv * p.seq_k * D;
  const T* v_head = v + bh_kv * p.seq_k * D;

  float q_reg[kSlice];  // this thread's slice of q, times the scale
  float o[kSlice];      // and of the output accumulator O
  for (int d = 0; d < kSlice; ++d) {
    q_reg[d] = active ? kernels::to_float(q[(bh * p.seq_q + i) * D + g * kSlice + d]) * p.scale : 0.0f;
    o[d] = 0.0f;
  }
  const int64_t my_first = active && p.masked ? q_first[i] : LLONG_MIN;  // this row sees my_first .. my_last
  const int64_t my_last = active && p.masked ? q_last[i] : LLONG_MAX;
  float m = -INFINITY, l = 0.0f;

  if (t == 0 && p.masked) {  // the keys any row of the block sees: tiles outside them are skipped whole
    const int rows = p.seq_q - row0 < kBr ? static_cast<int>(p.seq_q - row0) : kBr;
    int64_t first, last;  // locals: the shared variables are written once, below
    kernels::covered_range(q_first + row0, q_last + row0, rows, first, last);
    block_first = first;
    block_last = last;
  }

  for (int64_t j0 = 0; j0 < p.seq_k; j0 += kBc) {
    const int n = p.seq_k - j0 < kBc ? static_cast<int>(p.seq_k - j0) : kBc;  // keys in this tile
    if (t < kBc) kpos_tile[t] = t < n ? k_pos[j0 + t] : LLONG_MAX;
    __syncthreads();  // kpos_tile, block_first and block_last are visible to all threads

    if (p.masked) {  // the same answer in every thread: the whole block skips or none does
      int64_t min_k_pos, max_k_pos;
      kernels::covered_range(kpos_tile, kpos_tile, n, min_k_pos, max_k_pos);
      if (min_k_pos > block_last || max_k_pos < block_first) {
        __syncthreads();  // nobody rewrites kpos_tile while another thread still reads it
        continue;
      }
    }

    Tile<D>::template load<kBc>(k_tile, k_head, j0, n);
    Tile<D>::template load<kBc>(v_tile, v_head, j0, n);
    __syncthreads();  // the K and V tiles are complete

    // BEGIN SOLUTION task 3: scores of the tile and the (m, l, O) update
    // STUB: // TODO(lesson 03, task 3): (a) the tile's scores (dot product, shuffle, mask), then the (m, l, O) update.
    // STUB: // README, "Task 3 — the CUDA kernel and its launch (`block_attention.cu`)", (a): steps 4 and 5.
    // STUB: (void)m, (void)l, (void)my_first, (void)my_last, (void)q_reg;
    uint32_t visible = 0;  // bit jj: key jj of the tile is in this row's range
#pragma unroll
    for (int jj = 0; jj < kBc; ++jj) {  // no shuffle in this loop: two positions per shared load
      const int64_t pos = kpos_tile[jj];
      visible |= jj < n && my_first <= pos && pos <= my_last ? 1u << jj : 0u;
    }
    float s[kBc];
    float tile_max = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < kBc; ++jj) {
      const float* k_row = k_tile + Tile<D>::at(jj, g * kSlice);
      float part = 0.0f;
#pragma unroll
      for (int c = 0; c < kSlice / 4; ++c) {  // four dims per shared load
        const float4 k4 = Tile<D>::load4(k_row, c);
        part += q_reg[4 * c] * k4.x;
        part += q_reg[4 * c + 1] * k4.y;
        part += q_reg[4 * c + 2] * k4.z;
        part += q_reg[4 * c + 3] * k4.w;
      }
#pragma unroll
      for (int offset = kGroup / 2; offset > 0; offset /= 2) part += __shfl_xor_sync(kFullWarp, part, offset);
      s[jj] = (visible >> jj) & 1u ? part : -INFINITY;
      tile_max = (s[jj] > tile_max || s[jj] != s[jj]) ? s[jj] : tile_max;  // NaN wins: fmaxf drops it
    }
    if (tile_max != -INFINITY) {  // same in the whole row group; no barrier or shuffle inside
      const float m_new = (tile_max > m || tile_max != tile_max) ? tile_max : m;  // NaN in m or tile_max wins
      const float alpha = expf(m - m_new);  // 0 on the first visible tile (m = -inf)
      l *= alpha;
      for (int d = 0; d < kSlice; ++d) o[d] *= alpha;
#pragma unroll
      for (int jj = 0; jj < kBc; ++jj) {
        if (s[jj] == -INFINITY) continue;  // masked: left out, even a NaN in its v (0 · NaN = NaN)
        const float pj = expf(s[jj] - m_new);
        const float* v_row = v_tile + Tile<D>::at(jj, g * kSlice);
        l += pj;
#pragma unroll
        for (int c = 0; c < kSlice / 4; ++c) {
          const float4 v4 = Tile<D>::load4(v_row, c);
          o[4 * c] += pj * v4.x;
          o[4 * c + 1] += pj * v4.y;
          o[4 * c + 2] += pj * v4.z;
          o[4 * c + 3] += pj * v4.w;
        }
      }
      m = m_new;
    }
    // END SOLUTION
    __syncthreads();  // every row is done with the tiles before the next iteration overwrites them
  }

  if (!active) return;
  // BEGIN SOLUTION task 3: write out and lse
  // STUB: // TODO(lesson 03, task 3): (b) out = O / l and lse = m + log l of the row.
  // STUB: // README, "Task 3 — the CUDA kernel and its launch (`block_attention.cu`)", (b).
  // STUB: (void)out, (void)lse;
  // l = 0: no visible key, out 0 and lse -inf. Not `l > 0`, which a NaN row (l = NaN) would fail.
  const float inv_l = l == 0.0f ? 0.0f : 1.0f / l;
  T* out_row = out + (bh * p.seq_q + i) * D + g * kSlice;
  for (int d = 0; d < kSlice; ++d) out_row[d] = kernels::from_float<T>(o[d] * inv_l);
  if (g == 0) lse[bh * p.seq_q + i] = l == 0.0f ? -INFINITY : m == INFINITY ? INFINITY : m + logf(l);  // +inf: l is NaN
  // END SOLUTION
}

template <typename T, int D>
void launch(const void* q, const void* k, const void* v, void* out, float* lse, const int64_t* q_first,
            const int64_t* q_last, const int64_t* k_pos, const BlockAttentionParams& p, cudaStream_t stream) {
  const auto kernel = block_attention_forward_kernel<T, D>;
  int device = 0, max_shared = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlock, device));
  CP_CHECK(kSharedBytes<D> <= static_cast<size_t>(max_shared), "block attention: the tiles need ",
           kSharedBytes<D>, " bytes of shared memory per block, the device allows ", max_shared);
  const dim3 grid(static_cast<unsigned>(p.batch * p.heads_q), static_cast<unsigned>((p.seq_q + kBr - 1) / kBr));
  // BEGIN SOLUTION task 3: launch
  // STUB: // TODO(lesson 03, task 3): (c) launch `kernel` on `grid`, with its threads and dynamic shared memory, and check it.
  // STUB: // README, "Task 3 — the CUDA kernel and its launch (`block_attention.cu`)", (c).
  // STUB: (void)kernel, (void)grid, (void)q, (void)k, (void)v, (void)out, (void)lse, (void)q_first, (void)q_last,
  // STUB: (void)k_pos, (void)stream;
  // STUB: throw NotImplemented("lesson 03, task 3: launch the block attention kernel");
  kernel<<<grid, kBr * (D / kSlice), kSharedBytes<D>, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<T*>(out), lse,
      q_first, q_last, k_pos, p);
  CUDA_CHECK_LAUNCH();
  // END SOLUTION
}

}  // namespace

bool block_attention_supports_head_dim(int64_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
}

void launch_block_attention_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                                    const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos,
                                    const BlockAttentionParams& p, DType dtype, cudaStream_t stream) {
  CP_CHECK(block_attention_supports_head_dim(p.head_dim), "block attention: unsupported head dim ", p.head_dim);
  CP_CHECK(p.batch * p.heads_q <= INT32_MAX && (p.seq_q + kBr - 1) / kBr <= 65535,
           "block attention: grid too large (B·Hq = ", p.batch * p.heads_q, ", Sq = ", p.seq_q, ")");
  if (p.batch * p.heads_q == 0 || p.seq_q == 0) return;
  kernels::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (p.head_dim) {
      case 32: launch<T, 32>(q, k, v, out, lse, q_first, q_last, k_pos, p, stream); break;
      case 64: launch<T, 64>(q, k, v, out, lse, q_first, q_last, k_pos, p, stream); break;
      case 128: launch<T, 128>(q, k, v, out, lse, q_first, q_last, k_pos, p, stream); break;
    }
  });
}

}  // namespace cp
