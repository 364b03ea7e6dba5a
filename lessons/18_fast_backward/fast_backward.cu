// GENERATED from solutions/18_fast_backward/fast_backward.cu by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 18 — the backward on the matrix units: lesson 05's block backward (dQ, dK, dV from q, k,
// v, dO, lse and Δ = rowsum(dO ∘ O)) with every product on mma.m16n8k16. Two kernels, whose
// frames (grids, tiles, barriers, which tiles a block visits) are given:
//   key_gradients_kernel    one block per (batch·K/V head, 64 keys): walks the query tiles of
//                           every query head of its GQA group and keeps dK, dV in registers
//                           (task 2);
//   query_gradients_kernel  one block per (batch·query head, 64 query rows): walks the key tiles
//                           and keeps dQ in registers (task 3).
// No atomics and no transposes through memory: README, "Two kernels, no transposes".
#include <climits>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/error.h"
#include "fast_backward.cuh"
#include "fast_backward_steps.cuh"
#include "kernels/dtype.cuh"
#include "kernels/mma.cuh"
#include "kernels/strict_shared.cuh"
#include "kernels/tile.cuh"
#include "tensor_core_attention.cuh"

namespace cp {
namespace {

using namespace fast_backward;

/// Four tiles of 64 rows in shared memory (dynamic: above 48 KiB at D = 128).
template <int D>
constexpr int kTilesBytes = 4 * 64 * kLd<D> * 2;

/// Rows [row0, row0 + n) of a [rows, D] matrix into a [64][kLd<D>] tile, zeros from row n on (a
/// hidden row must hold numbers: its products are multiplied by 0, and 0 times a NaN is NaN).
template <typename T, int D>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int64_t row0, int n) {
  constexpr int kChunks = D / 8;  // 16-byte pieces of a row
  for (int piece = threadIdx.x; piece < 64 * kChunks; piece += kThreads) {
    const int r = piece / kChunks, c = piece % kChunks;
    *reinterpret_cast<uint4*>(tile + r * kLd<D> + 8 * c) =
        r < n ? *reinterpret_cast<const uint4*>(src + (row0 + r) * D + 8 * c) : make_uint4(0, 0, 0, 0);
  }
}

/// The lse, Δ and visible keys of rows [row0, row0 + n) of head bh; a row past n sees nothing.
__device__ __forceinline__ void load_query_rows(QueryRows& rows, const float* lse, const float* delta,
                                                const int64_t* q_first, const int64_t* q_last, int64_t bh,
                                                int64_t row0, int n, const BlockAttentionParams& p) {
  for (int r = threadIdx.x; r < kBr; r += kThreads) {
    const bool active = r < n;
    const int64_t at = bh * p.seq_q + row0 + r;
    rows.lse[r] = active ? lse[at] : 0.0f;
    rows.delta[r] = active ? delta[at] : 0.0f;
    rows.first[r] = !active ? LLONG_MAX : p.masked ? q_first[row0 + r] : LLONG_MIN;
    rows.last[r] = !active ? LLONG_MIN : p.masked ? q_last[row0 + r] : LLONG_MAX;
  }
}

/// A warp's 16 rows of float32 gradients (C fragments) times `factor` into rows [row0, row0 + n)
/// of a [rows, D] float32 matrix.
template <int D>
__device__ __forceinline__ void store_rows(float* dst, const FragC (&g)[D / 8], float factor, int64_t row0, int n,
                                           int warp, int lane) {
CP_FRAGMENT_LOOP
  for (int dt = 0; dt < D / 8; ++dt)
CP_FRAGMENT_LOOP
    for (int e = 0; e < 4; ++e) {
      const int r = 16 * warp + kernels::frag_c_row(lane, e);
      if (r < n) dst[(row0 + r) * D + 8 * dt + kernels::frag_c_col(lane, e)] = g[dt].x[e] * factor;
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    key_gradients_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                         const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                         const int64_t* __restrict__ q_first, const int64_t* __restrict__ q_last,
                         const int64_t* __restrict__ k_pos, float* __restrict__ dk, float* __restrict__ dv,
                         BlockAttentionParams p) {
  extern __shared__ __align__(16) uint16_t tiles_raw[];  // kTilesBytes<D>
  T* k_tile = reinterpret_cast<T*>(tiles_raw);            // the block's 64 keys   [64][kLd]
  T* v_tile = k_tile + 64 * kLd<D>;                       // their values          [64][kLd]
  T* q_tile = v_tile + 64 * kLd<D>;                       // a tile of query rows  [64][kLd]
  T* do_tile = q_tile + 64 * kLd<D>;                      // their dO              [64][kLd]
  __shared__ QueryRows rows;
  __shared__ int64_t key_pos[kBc];
  __shared__ int64_t key_range[2];  // the block's smallest and largest key position
  __shared__ int seen;
  kernels::declare_shared(tiles_raw, kTilesBytes<D>);

  const int64_t bh_kv = blockIdx.x, b = bh_kv / p.heads_kv, h_kv = bh_kv % p.heads_kv;
  const int64_t key0 = static_cast<int64_t>(blockIdx.y) * kBc;
  const int n_keys = p.seq_k - key0 < kBc ? static_cast<int>(p.seq_k - key0) : kBc;
  const int warp = threadIdx.x / kernels::kWarpSize, lane = threadIdx.x % kernels::kWarpSize;
  load_tile<T, D>(k_tile, k + bh_kv * p.seq_k * D, key0, n_keys);
  load_tile<T, D>(v_tile, v + bh_kv * p.seq_k * D, key0, n_keys);
  if (threadIdx.x < kBc) key_pos[threadIdx.x] = threadIdx.x < n_keys ? k_pos[key0 + threadIdx.x] : 0;
  if (threadIdx.x == 0) {
    int64_t lo = LLONG_MAX, hi = LLONG_MIN;
    for (int j = 0; j < n_keys; ++j) {
      lo = k_pos[key0 + j] < lo ? k_pos[key0 + j] : lo;
      hi = k_pos[key0 + j] > hi ? k_pos[key0 + j] : hi;
    }
    key_range[0] = lo, key_range[1] = hi;
  }

  FragC dk_acc[D / 8], dv_acc[D / 8];  // the warp's 16 keys, float32
  const int64_t group = p.heads_q / p.heads_kv;
  for (int64_t g = 0; g < group; ++g) {  // every query head that shares this K/V head (GQA)
    const int64_t bh = b * p.heads_q + h_kv * group + g;
    for (int64_t row0 = 0; row0 < p.seq_q; row0 += kBr) {
      const int n_rows = p.seq_q - row0 < kBr ? static_cast<int>(p.seq_q - row0) : kBr;
      __syncthreads();  // every warp is done with the previous query tile (and the keys are loaded)
      if (threadIdx.x == 0) seen = 0;
      load_query_rows(rows, lse, delta, q_first, q_last, bh, row0, n_rows, p);
      __syncthreads();
      // A tile no row of which can see a key of the block is skipped whole.
      if (threadIdx.x < kBr && rows.first[threadIdx.x] <= key_range[1] && rows.last[threadIdx.x] >= key_range[0])
        atomicOr(&seen, 1);
      load_tile<T, D>(q_tile, q + bh * p.seq_q * D, row0, n_rows);
      load_tile<T, D>(do_tile, dout + bh * p.seq_q * D, row0, n_rows);
      __syncthreads();  // the tiles and the vote
      if (!seen) continue;

      // BEGIN YOUR CODE task 2: dV += Pᵀ·dO and dK += dSᵀ·Q from fragments whose rows are keys
      // TODO(lesson 18, task 2): this tile's part of dV and dK for the warp's 16 keys, with lesson 16's
      // steps and tile_gradients (task 1); nothing goes through shared memory but the tiles above.
      // README, "Task 2".
      (void)k_tile, (void)v_tile, (void)q_tile, (void)do_tile, (void)warp, (void)lane, (void)n_keys;
      // END YOUR CODE
    }
  }
  store_rows<D>(dk + bh_kv * p.seq_k * D, dk_acc, p.scale, key0, n_keys, warp, lane);
  store_rows<D>(dv + bh_kv * p.seq_k * D, dv_acc, 1.0f, key0, n_keys, warp, lane);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    query_gradients_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const T* __restrict__ dout, const float* __restrict__ lse,
                           const float* __restrict__ delta, const int64_t* __restrict__ q_first,
                           const int64_t* __restrict__ q_last, const int64_t* __restrict__ k_pos,
                           float* __restrict__ dq, BlockAttentionParams p) {
  extern __shared__ __align__(16) uint16_t tiles_raw[];  // kTilesBytes<D>
  T* q_tile = reinterpret_cast<T*>(tiles_raw);            // the block's 64 query rows  [64][kLd]
  T* do_tile = q_tile + 64 * kLd<D>;                      // their dO                   [64][kLd]
  T* k_tile = do_tile + 64 * kLd<D>;                      // a tile of keys             [64][kLd]
  T* v_tile = k_tile + 64 * kLd<D>;                       // their values               [64][kLd]
  __shared__ QueryRows rows;
  __shared__ int64_t key_pos[kBc];
  __shared__ int64_t row_range[2];  // the union of the block's rows' visible positions
  __shared__ int seen;
  kernels::declare_shared(tiles_raw, kTilesBytes<D>);

  const int64_t bh = blockIdx.x, b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t bh_kv = b * p.heads_kv + h / (p.heads_q / p.heads_kv);
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kBr;
  const int n_rows = p.seq_q - row0 < kBr ? static_cast<int>(p.seq_q - row0) : kBr;
  const int warp = threadIdx.x / kernels::kWarpSize, lane = threadIdx.x % kernels::kWarpSize;
  load_query_rows(rows, lse, delta, q_first, q_last, bh, row0, n_rows, p);
  load_tile<T, D>(q_tile, q + bh * p.seq_q * D, row0, n_rows);
  load_tile<T, D>(do_tile, dout + bh * p.seq_q * D, row0, n_rows);
  __syncthreads();
  if (threadIdx.x == 0) kernels::covered_range(rows.first, rows.last, kBr, row_range[0], row_range[1]);
  FragA qa[D / 16], doa[D / 16];  // the warp's 16 rows of Q and of dO, for the whole kernel
  load_q_fragments<T, D>(qa, q_tile, warp, lane);
  load_q_fragments<T, D>(doa, do_tile, warp, lane);

  FragC dq_acc[D / 8];
  for (int64_t key0 = 0; key0 < p.seq_k; key0 += kBc) {
    const int n_keys = p.seq_k - key0 < kBc ? static_cast<int>(p.seq_k - key0) : kBc;
    __syncthreads();  // every warp is done with the previous key tile (and the range is set)
    if (threadIdx.x == 0) seen = 0;
    if (threadIdx.x < kBc) key_pos[threadIdx.x] = threadIdx.x < n_keys ? k_pos[key0 + threadIdx.x] : 0;
    __syncthreads();
    // A tile none of whose keys some row can see is skipped whole.
    if (threadIdx.x < n_keys && key_pos[threadIdx.x] >= row_range[0] && key_pos[threadIdx.x] <= row_range[1])
      atomicOr(&seen, 1);
    load_tile<T, D>(k_tile, k + bh_kv * p.seq_k * D, key0, n_keys);
    load_tile<T, D>(v_tile, v + bh_kv * p.seq_k * D, key0, n_keys);
    __syncthreads();  // the tiles and the vote
    if (!seen) continue;

    // BEGIN YOUR CODE task 3: dQ += dS·K from fragments whose rows are query rows
    // TODO(lesson 18, task 3): this key tile's part of dQ for the warp's 16 rows, with lesson 16's
    // steps and tile_gradients (task 1). README, "Task 3".
    (void)qa, (void)doa, (void)k_tile, (void)v_tile, (void)lane, (void)n_keys;
    // END YOUR CODE
  }
  store_rows<D>(dq + bh * p.seq_q * D, dq_acc, p.scale, row0, n_rows, warp, lane);
}

/// The checks shared by both halves; false when there is nothing to launch.
bool check_fast_backward(const char* half, const void* q, const void* k, const void* v, const void* dout,
                         const BlockAttentionParams& p, DType dtype) {
  check_launch(half, q, k, v, p, dtype);
  CP_CHECK(reinterpret_cast<uintptr_t>(dout) % 16 == 0, half, ": dout must start on a 16-byte boundary");
  CP_CHECK(p.batch * p.heads_kv <= INT32_MAX && (p.seq_k + kBc - 1) / kBc <= 65535, half, ": grid too large (B·Hkv = ",
           p.batch * p.heads_kv, ", Sk = ", p.seq_k, ")");
#ifdef CP_LESSON18_TASK1_NOT_STARTED
  throw NotImplemented("lesson 18, task 1: tile_gradients (both kernels call it)");
#endif
  return p.batch * p.heads_q > 0;
}

}  // namespace

void launch_fast_backward_keys(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                               const float* delta, const int64_t* q_first, const int64_t* q_last,
                               const int64_t* k_pos, float* dk, float* dv, const BlockAttentionParams& p, DType dtype,
                               cudaStream_t stream) {
  if (!check_fast_backward("fast backward (keys)", q, k, v, dout, p, dtype) || p.seq_k == 0) return;
  const dim3 grid(static_cast<unsigned>(p.batch * p.heads_kv), static_cast<unsigned>((p.seq_k + kBc - 1) / kBc));
  kernels::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      auto run = [&](auto kernel, int bytes) {
        // BEGIN YOUR CODE task 2: launch
        // TODO(lesson 18, task 2): launch `kernel` on `grid` once its tile's products are written.
        (void)kernel, (void)bytes;
        throw NotImplemented("lesson 18, task 2: the key kernel's products, then its launch");
        // END YOUR CODE
      };
      if (p.head_dim == 64) run(key_gradients_kernel<T, 64>, kTilesBytes<64>);
      else run(key_gradients_kernel<T, 128>, kTilesBytes<128>);
    }
  });
  kernels::throw_on_emulation_fault(stream, "key_gradients_kernel");
}

void launch_fast_backward_queries(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                                  const float* delta, const int64_t* q_first, const int64_t* q_last,
                                  const int64_t* k_pos, float* dq, const BlockAttentionParams& p, DType dtype,
                                  cudaStream_t stream) {
  if (!check_fast_backward("fast backward (queries)", q, k, v, dout, p, dtype) || p.seq_q == 0) return;
  const dim3 grid(static_cast<unsigned>(p.batch * p.heads_q), static_cast<unsigned>((p.seq_q + kBr - 1) / kBr));
  kernels::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      auto run = [&](auto kernel, int bytes) {
        // BEGIN YOUR CODE task 3: launch
        // TODO(lesson 18, task 3): launch `kernel` on `grid` once its tile's products are written.
        (void)kernel, (void)bytes;
        throw NotImplemented("lesson 18, task 3: the query kernel's products, then its launch");
        // END YOUR CODE
      };
      if (p.head_dim == 64) run(query_gradients_kernel<T, 64>, kTilesBytes<64>);
      else run(query_gradients_kernel<T, 128>, kTilesBytes<128>);
    }
  });
  kernels::throw_on_emulation_fault(stream, "query_gradients_kernel");
}

void launch_fast_backward(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                          const float* delta, const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos,
                          float* dq, float* dk, float* dv, const BlockAttentionParams& p, DType dtype,
                          cudaStream_t stream) {
  launch_fast_backward_keys(q, k, v, dout, lse, delta, q_first, q_last, k_pos, dk, dv, p, dtype, stream);
  launch_fast_backward_queries(q, k, v, dout, lse, delta, q_first, q_last, k_pos, dq, p, dtype, stream);
}

}  // namespace cp
