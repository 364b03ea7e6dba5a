// GENERATED from solutions/17_fast_forward/fast_forward.cu by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 17 — the ladder of forward kernels on the matrix units. Version 1 is lesson 16's kernel;
// versions 2 to 5 are one template, fast_forward_kernel<T, D, V>, whose frame (the grid, the
// tiles, which tiles a block visits, the steps each version calls) is given; the pipeline is task 2
// and the steps are lesson 16's and fast_forward_steps.cuh's.
//
// Warps: 4 a block. Versions 2 and 3 keep lesson 16's grid, one block per (batch·query head, 64
// query rows), 16 rows a warp, Q's fragments in registers. From version 4 a block takes 128 rows,
// 32 a warp as two groups of 16, and Q stays in shared memory. Version 5 launches a 1-D grid in
// task 5's order. Shared memory: the tiles (dynamic: Q from version 4, one K and one V tile), the
// key positions of the tile in hand and of the next one, and the votes that classify a tile.
#include <climits>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/error.h"
#include "fast_forward.cuh"
#include "fast_forward_steps.cuh"
#include "kernels/async_copy.cuh"
#include "kernels/dtype.cuh"
#include "kernels/mma.cuh"
#include "kernels/strict_shared.cuh"
#include "kernels/tile.cuh"
#include "block_order.h"
#include "tensor_core_attention.cuh"

namespace cp {
namespace {

using namespace fast_forward;

/// A tile of keys a block visits: its first key, how many keys it has, and (version 3) whether
/// the mask cuts it. j0 = Sk: no tile left.
struct Visit {
  int64_t j0;
  int n;
  bool cut;
};

/// The block's rows' view of the keys: the union of their visible ranges (a tile outside it is
/// skipped whole) and their intersection (a tile inside it, with all its keys, is seen whole by
/// every row: nothing to mask).
struct BlockRange {
  int64_t any_first, any_last;  // union
  int64_t all_first, all_last;  // intersection
};

/// The next tile at or after key `from` that some row of the block sees, its positions in
/// `kpos_tile`. Every thread calls it (it has barriers); `votes` are two flags per parity, and
/// `parity` alternates from call to call, so that thread 0 never clears a flag another thread
/// may still be reading.
template <int V>
__device__ Visit next_visible_tile(int64_t from, int64_t* kpos_tile, int (&votes)[2][2], int& parity,
                                   const int64_t* __restrict__ k_pos, const BlockAttentionParams& p,
                                   const BlockRange& range) {
  for (int64_t j0 = from; j0 < p.seq_k; j0 += kBc) {
    const int n = p.seq_k - j0 < kBc ? static_cast<int>(p.seq_k - j0) : kBc;
    if (threadIdx.x < kBc) kpos_tile[threadIdx.x] = threadIdx.x < n ? k_pos[j0 + threadIdx.x] : LLONG_MAX;
    if (threadIdx.x == 0) {
      votes[parity][0] = p.masked ? 0 : 1;   // some key seen by some row
      votes[parity][1] = n < kBc ? 1 : 0;    // cut: a key missing, or one not every row sees
    }
    __syncthreads();  // the positions and the cleared flags
    if (p.masked) {
      if (threadIdx.x < n) {
        const int64_t pos = kpos_tile[threadIdx.x];
        if (pos >= range.any_first && pos <= range.any_last) atomicOr(&votes[parity][0], 1);
        if (V >= 3 && (pos < range.all_first || pos > range.all_last)) atomicOr(&votes[parity][1], 1);
      }
      __syncthreads();  // the votes
    }
    const bool seen = votes[parity][0] != 0, cut = votes[parity][1] != 0;
    parity ^= 1;
    if (seen) return {j0, n, cut};
  }
  return {p.seq_k, 0, false};
}

/// Per version: 16-row groups a warp holds, query rows a block, and the block's tiles in shared
/// memory. Versions 2 and 3 copy Q into the K tile and keep its fragments in registers (kBr = kBc
/// rows); from version 4 Q has its own kWideRows rows and stays there, read again at every tile.
template <int V>
constexpr int kGroupsOf = V >= 4 ? kGroups : 1;
template <int V>
constexpr int kRowsOf = 16 * kWarps * kGroupsOf<V>;
template <int D, int V>
constexpr int kTileBytes = ((V >= 4 ? kWideRows : 0) + 2 * kBc) * kLd<D> * 2;

/// Where a lane's rows are: lesson 16's lane_rows of group `group` (the rows, and the keys each
/// sees), computed from the block's first row and the rows' ranges in global memory.
struct RowsOfLane {
  int64_t row0;
  int warp, lane;
  const int64_t* q_first;
  const int64_t* q_last;
};

/// What a warp keeps from tile to tile: its lanes' running softmax (m in base 2 from version 3 on;
/// l this lane's part of a row's sum), O unnormalised in float32, and up to version 3 Q's
/// fragments and its lanes' rows. From version 4 the rows are read again where they are needed,
/// on cut tiles and at the end: at D = 128 O and S alone take 192 of a thread's 255 registers, and
/// 24 more for the rows' 64-bit positions made ptxas spill.
template <int D, int V>
struct WarpState {
  float m[kGroupsOf<V>][2], l[kGroupsOf<V>][2];
  FragC o[kGroupsOf<V>][D / 8];
  FragA q_frag[V >= 4 ? 1 : D / 16];      // not used from version 4 on
  LaneRows kept_rows[V >= 4 ? 1 : kGroupsOf<V>];  // not used from version 4 on

  __device__ __forceinline__ LaneRows rows(int group, const RowsOfLane& where, const BlockAttentionParams& p) const {
    if constexpr (V >= 4)
      return lane_rows(where.row0, kGroupsOf<V> * where.warp + group, where.lane, p, where.q_first, where.q_last);
    else return kept_rows[group];
  }
};

/// The version's steps on a tile, given: the scores S = Q·Kᵀ, the softmax that turns them into P
/// (`scale` is scale·log2(e) from version 3 on), and O += P·V.
template <typename T, int D, int V>
__device__ __forceinline__ void tile_scores(FragC (&s)[kGroupsOf<V>][kBc / 8], const WarpState<D, V>& w,
                                            const T* q_tile, const T* k_tile, int warp, int lane) {
  if constexpr (V >= 4) compute_scores_wide<T, D>(s, q_tile, k_tile, warp, lane);
  else compute_scores<T, D>(s[0], w.q_frag, k_tile, lane);
}

template <int D, int V>
__device__ __forceinline__ void tile_softmax(FragC (&s)[kGroupsOf<V>][kBc / 8], WarpState<D, V>& w,
                                             const Visit& tile, const int64_t* kpos, float scale,
                                             const RowsOfLane& where, const BlockAttentionParams& p) {
  const int lane = where.lane;
CP_FRAGMENT_LOOP
  for (int i = 0; i < kGroupsOf<V>; ++i) {
    if (V == 2 || tile.cut) {  // the rows' ranges are read (from version 4: loaded) only here
      const LaneRows r = w.rows(i, where, p);
      if constexpr (V == 2) softmax_tile<D>(s[i], w.o[i], w.m[i], w.l[i], kpos, tile.n, r.first, r.last, scale, lane);
      else softmax_tile_exp2<D, true>(s[i], w.o[i], w.m[i], w.l[i], kpos, tile.n, r.first, r.last, scale, lane);
    } else {
      const int64_t unused[2] = {0, 0};  // an uncut tile tests no key
      softmax_tile_exp2<D, false>(s[i], w.o[i], w.m[i], w.l[i], kpos, tile.n, unused, unused, scale, lane);
    }
  }
}

template <typename T, int D, int V>
__device__ __forceinline__ void tile_pv(WarpState<D, V>& w, const FragC (&s)[kGroupsOf<V>][kBc / 8], const T* v_tile,
                                        int lane) {
  if constexpr (V >= 4) accumulate_pv_wide<T, D>(w.o, s, v_tile, lane);
  else accumulate_pv<T, D>(w.o[0], s[0], v_tile, lane);
}

template <typename T, int D, int V>
__global__ void __launch_bounds__(kThreads)
    fast_forward_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        T* __restrict__ out, float* __restrict__ lse, const int64_t* __restrict__ q_first,
                        const int64_t* __restrict__ q_last, const int64_t* __restrict__ k_pos, BlockAttentionParams p) {
  static_assert(V >= 2 && V <= kFastForwardVersions, "version 1 is lesson 16's kernel");
  static_assert(kBr == kBc, "versions 2 and 3 copy the block's Q tile into the K tile");
  extern __shared__ __align__(16) uint16_t tiles_raw[];  // kTileBytes<D, V> (the launch's dynamic size)
  T* q_tile = reinterpret_cast<T*>(tiles_raw);           // [kRowsOf<V>][kLd]
  T* k_tile = q_tile + (V >= 4 ? kWideRows * kLd<D> : 0);  // [kBc][kLd]; versions 2 and 3: Q's place
  T* v_tile = k_tile + kBc * kLd<D>;                       // [kBc][kLd]
  __shared__ int64_t kpos_tiles[2][kBc];                   // the tile in hand's positions, and the next one's
  __shared__ BlockRange block_range;
  __shared__ int votes[2][2];
  kernels::declare_shared(tiles_raw, kTileBytes<D, V>);  // what ldmatrix and cp.async may touch

  // The block's work: lesson 16's grid (heads × row blocks), or from version 5 task 5's order.
  const int64_t row_blocks = (p.seq_q + kRowsOf<V> - 1) / kRowsOf<V>;
  const BlockWork work = V >= 5 ? block_work(static_cast<int>(blockIdx.x), static_cast<int>(p.batch * p.heads_q),
                                           static_cast<int>(row_blocks))
                                : BlockWork{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y)};
  const int64_t bh = work.bh, b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t bh_kv = b * p.heads_kv + h / (p.heads_q / p.heads_kv);
  const int64_t row0 = static_cast<int64_t>(work.row_block) * kRowsOf<V>;
  const int warp = threadIdx.x / kernels::kWarpSize, lane = threadIdx.x % kernels::kWarpSize;
  const T* k_head = k + bh_kv * p.seq_k * D;
  const T* v_head = v + bh_kv * p.seq_k * D;

  // This lane's rows and the keys each sees (rows past Sq see nothing, and stay).
  const RowsOfLane where{row0, warp, lane, q_first, q_last};
  WarpState<D, V> w;
CP_FRAGMENT_LOOP
  for (int i = 0; i < kGroupsOf<V>; ++i) {
    if constexpr (V < 4) w.kept_rows[i] = lane_rows(row0, warp, lane, p, q_first, q_last);
    w.m[i][0] = w.m[i][1] = -INFINITY;
    w.l[i][0] = w.l[i][1] = 0.0f;
  }

  // Q by cp.async too; the block's ranges meanwhile.
  kernels::AsyncCopies<2 * kCopiesPerThread<D, kBc>> copies;
  static_assert(kCopiesPerThread<D, kRowsOf<V>> <= 2 * kCopiesPerThread<D, kBc>, "Q's copies fit the record");
  const int q_rows = p.seq_q - row0 < kRowsOf<V> ? static_cast<int>(p.seq_q - row0) : kRowsOf<V>;
  issue_tile_copies<T, D, kRowsOf<V>>(copies, q_tile, q + bh * p.seq_q * D, row0, q_rows);
  copies.commit();
  if (threadIdx.x == 0) {
    BlockRange range{LLONG_MIN, LLONG_MAX, LLONG_MIN, LLONG_MAX};
    if (p.masked) {
      kernels::covered_range(q_first + row0, q_last + row0, q_rows, range.any_first, range.any_last);
      for (int i = 0; i < q_rows; ++i) {
        range.all_first = q_first[row0 + i] > range.all_first ? q_first[row0 + i] : range.all_first;
        range.all_last = q_last[row0 + i] < range.all_last ? q_last[row0 + i] : range.all_last;
      }
    }
    block_range = range;
  }
  copies.wait_all();
  __syncthreads();  // the Q tile and the ranges
  if constexpr (V < 4) load_q_fragments<T, D>(w.q_frag, q_tile, warp, lane);
  const BlockRange& range = block_range;  // read where used: 8 registers fewer across the loop
  __syncthreads();  // every warp has its Q before K's first tile overwrites it (versions 2 and 3)

  const float scale = V >= 3 ? p.scale * 1.4426950408889634f : p.scale;  // version 3: scale and log2(e) at once
  int parity = 0, in_hand = 0;  // votes' parity; which kpos_tiles holds the tile in hand
  Visit tile = next_visible_tile<V>(0, kpos_tiles[in_hand], votes, parity, k_pos, p, range);

  // BEGIN YOUR CODE task 2: the pipeline, in FlashAttention-2's order
  // TODO(lesson 17, task 2): the loop over the visited tiles, with K_j's copy started before it and
  // each tile's V in flight while S is computed, the next tile's K while the softmax and P·V run.
  // Every read of a tile after its group has landed and a barrier; no copy into a tile some warp
  // may still read. README, "Task 2".
  (void)tile, (void)w, (void)scale, (void)in_hand, (void)v_head, (void)k_head, (void)copies, (void)v_tile;
  // END YOUR CODE

CP_FRAGMENT_LOOP
  for (int i = 0; i < kGroupsOf<V>; ++i) {
    if constexpr (V >= 3)
      for (int r = 0; r < 2; ++r) w.m[i][r] *= 0.6931471805599453f;  // back to natural units for lse
    finish_head_rows<T, D>(out, lse, bh, w.rows(i, where, p), p, w.o[i], w.m[i], w.l[i], lane);
  }
}

template <typename T, int D, int V>
void launch_version(const void* q, const void* k, const void* v, void* out, float* lse, const int64_t* q_first,
                    const int64_t* q_last, const int64_t* k_pos, const BlockAttentionParams& p, cudaStream_t stream) {
  const int64_t heads = p.batch * p.heads_q, row_blocks = (p.seq_q + kRowsOf<V> - 1) / kRowsOf<V>;
  CP_CHECK(V < 5 || heads * row_blocks <= INT32_MAX, "fast forward: grid too large (B·Hq = ", heads, ", Sq = ",
           p.seq_q, ")");
  const dim3 grid = V >= 5 ? dim3(static_cast<unsigned>(heads * row_blocks))
                           : dim3(static_cast<unsigned>(heads), static_cast<unsigned>(row_blocks));
  kernels::allow_dynamic_shared(fast_forward_kernel<T, D, V>, kTileBytes<D, V>);
  fast_forward_kernel<T, D, V><<<grid, kThreads, kTileBytes<D, V>, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<T*>(out), lse, q_first,
      q_last, k_pos, p);
  CUDA_CHECK_LAUNCH();
}

template <typename T, int D>
void launch_versions(int version, const void* q, const void* k, const void* v, void* out, float* lse,
                     const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos, const BlockAttentionParams& p,
                     cudaStream_t stream) {
  // BEGIN YOUR CODE task 2: launch
  // TODO(lesson 17, task 2): launch version `version` (2 … 5) with launch_version once the pipeline is
  // written.
  (void)version, (void)q, (void)k, (void)v, (void)out, (void)lse, (void)q_first, (void)q_last, (void)k_pos,
  (void)p, (void)stream;
  throw NotImplemented("lesson 17, task 2: the pipeline of version 2, then its launch");
  // END YOUR CODE
}

}  // namespace

void launch_fast_forward(int version, const void* q, const void* k, const void* v, void* out, float* lse,
                         const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos,
                         const BlockAttentionParams& p, DType dtype, cudaStream_t stream) {
  fast_forward_version_name(version);  // checks the number
  if (version == 1) {
    launch_tensor_core_attention_forward(q, k, v, out, lse, q_first, q_last, k_pos, p, dtype, stream);
    return;
  }
  check_launch("fast forward", q, k, v, p, dtype);
#ifdef CP_LESSON17_TASK1_NOT_STARTED
  throw NotImplemented("lesson 17, task 1: issue_tile_copies (versions 2 and up copy their tiles with it)");
#endif
#ifdef CP_LESSON17_TASK3_NOT_STARTED
  if (version >= 3) throw NotImplemented("lesson 17, task 3: softmax_tile_exp2 (versions 3 and up)");
#endif
#ifdef CP_LESSON17_TASK4_NOT_STARTED
  if (version >= 4) throw NotImplemented("lesson 17, task 4: compute_scores_wide and accumulate_pv_wide (versions 4 "
                                         "and up)");
#endif
#ifdef CP_LESSON17_TASK5_NOT_STARTED
  if (version >= 5) throw NotImplemented("lesson 17, task 5: block_work (version 5)");
#endif
  if (p.batch * p.heads_q == 0 || p.seq_q == 0) return;
  kernels::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      if (p.head_dim == 64) launch_versions<T, 64>(version, q, k, v, out, lse, q_first, q_last, k_pos, p, stream);
      else launch_versions<T, 128>(version, q, k, v, out, lse, q_first, q_last, k_pos, p, stream);
    }
  });
  kernels::throw_on_emulation_fault(stream, "fast_forward_kernel");
}

}  // namespace cp
