// Lesson 17 — the ladder of forward kernels on the matrix units. Version 1 is lesson 16's kernel;
// versions 2 and 3 are one template, fast_forward_kernel<T, D, V>, whose frame (the grid, the
// tiles, the barriers, which tiles a block visits) is given and whose steps are lesson 16's and
// fast_forward_steps.cuh's.
//
// Grid and warps as lesson 16's: one block per (batch·query head, 64 query rows), 4 warps of 16
// rows. Shared memory: one K tile and one V tile (the block's Q tile first borrows the K tile),
// the key positions of the tile in hand and of the next one, and the votes that classify a tile.
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

template <typename T, int D, int V>
__global__ void __launch_bounds__(kThreads)
    fast_forward_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        T* __restrict__ out, float* __restrict__ lse, const int64_t* __restrict__ q_first,
                        const int64_t* __restrict__ q_last, const int64_t* __restrict__ k_pos, BlockAttentionParams p) {
  static_assert(V == 2 || V == 3, "version 1 is lesson 16's kernel");
  __shared__ __align__(16) uint16_t tiles_raw[2 * kBc * kLd<D>];
  T* k_tile = reinterpret_cast<T*>(tiles_raw);  // [kBc][kLd]; first the block's Q tile (kBr = kBc rows)
  T* v_tile = k_tile + kBc * kLd<D>;             // [kBc][kLd]
  __shared__ int64_t kpos_tiles[2][kBc];         // the tile in hand's positions, and the next one's
  __shared__ BlockRange block_range;
  __shared__ int votes[2][2];
  static_assert(kBr == kBc, "the Q tile borrows the K tile's shared memory");
  kernels::declare_shared(tiles_raw, sizeof tiles_raw);  // what ldmatrix and cp.async may touch

  const int64_t bh = blockIdx.x, b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t bh_kv = b * p.heads_kv + h / (p.heads_q / p.heads_kv);
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kBr;
  const int warp = threadIdx.x / kernels::kWarpSize, lane = threadIdx.x % kernels::kWarpSize;
  const T* k_head = k + bh_kv * p.seq_k * D;
  const T* v_head = v + bh_kv * p.seq_k * D;

  // This lane's two rows and the keys each sees (rows past Sq see nothing, and stay).
  const LaneRows rows = lane_rows(row0, warp, lane, p, q_first, q_last);

  // Q by cp.async too, then into registers; the block's ranges meanwhile.
  kernels::AsyncCopies<2 * kCopiesPerThread<D, kBc>> copies;
  const int q_rows = p.seq_q - row0 < kBr ? static_cast<int>(p.seq_q - row0) : kBr;
  issue_tile_copies<T, D, kBr>(copies, k_tile, q + bh * p.seq_q * D, row0, q_rows);
  copies.commit();
  if (threadIdx.x == 0) {
    BlockRange range{LLONG_MIN, LLONG_MAX, LLONG_MIN, LLONG_MAX};
    if (p.masked) {
      kernels::covered_range(q_first + row0, q_last + row0, q_rows, range.any_first, range.any_last);
      range.all_first = LLONG_MIN, range.all_last = LLONG_MAX;
      for (int i = 0; i < q_rows; ++i) {
        range.all_first = q_first[row0 + i] > range.all_first ? q_first[row0 + i] : range.all_first;
        range.all_last = q_last[row0 + i] < range.all_last ? q_last[row0 + i] : range.all_last;
      }
    }
    block_range = range;
  }
  copies.wait_all();
  __syncthreads();  // the Q tile and the ranges
  FragA q_frag[D / 16];
  load_q_fragments<T, D>(q_frag, k_tile, warp, lane);
  const BlockRange range = block_range;
  __syncthreads();  // every warp has its Q before K's first tile overwrites it

  float m[2] = {-INFINITY, -INFINITY};  // each row's maximum so far (base 2 from version 3 on)
  float l[2] = {0.0f, 0.0f};            // this lane's part of each row's sum
  FragC o[D / 8];                       // O, unnormalised, float32
  const float scale_log2 = p.scale * 1.4426950408889634f;  // version 3: scale and log2(e) in one multiply
  int parity = 0, in_hand = 0;          // votes' parity; which kpos_tiles holds the tile in hand
  Visit tile = next_visible_tile<V>(0, kpos_tiles[in_hand], votes, parity, k_pos, p, range);

  // BEGIN SOLUTION task 2: the pipeline, in FlashAttention-2's order
  // STUB: // TODO(lesson 17, task 2): the loop over the visited tiles, with K_j's copy started before it and
  // STUB: // each tile's V in flight while S is computed, the next tile's K while the softmax and P·V run.
  // STUB: // Every read of a tile after its group has landed and a barrier; no copy into a tile some warp
  // STUB: // may still read. README, "Task 2".
  // STUB: (void)tile, (void)q_frag, (void)m, (void)l, (void)o, (void)scale_log2, (void)in_hand, (void)v_head,
  // STUB: (void)k_head, (void)copies;
  if (tile.j0 < p.seq_k) issue_tile_copies<T, D, kBc>(copies, k_tile, k_head, tile.j0, tile.n);
  copies.commit();
  while (tile.j0 < p.seq_k) {
    copies.wait_all();
    __syncthreads();  // K_j has landed for everyone, and every warp is done with V_{j-1}
    issue_tile_copies<T, D, kBc>(copies, v_tile, v_head, tile.j0, tile.n);
    copies.commit();  // V_j flies while S_j is computed
    FragC s[kBc / 8];
    compute_scores<T, D>(s, q_frag, k_tile, lane);
    const Visit next = next_visible_tile<V>(tile.j0 + kBc, kpos_tiles[in_hand ^ 1], votes, parity, k_pos, p, range);
    __syncthreads();  // every warp is done reading K_j (the search may pass no barrier at the end)
    if (next.j0 < p.seq_k) issue_tile_copies<T, D, kBc>(copies, k_tile, k_head, next.j0, next.n);
    copies.commit();  // K_{j+1} flies during the softmax and P·V_j (an empty group at the end)
    if constexpr (V >= 3) {
      const int64_t* kpos = kpos_tiles[in_hand];
      if (tile.cut) softmax_tile_exp2<D, true>(s, o, m, l, kpos, tile.n, rows.first, rows.last, scale_log2, lane);
      else softmax_tile_exp2<D, false>(s, o, m, l, kpos, tile.n, rows.first, rows.last, scale_log2, lane);
    } else {
      softmax_tile<D>(s, o, m, l, kpos_tiles[in_hand], tile.n, rows.first, rows.last, p.scale, lane);
    }
    copies.wait_all_but_newest();
    __syncthreads();  // V_j has landed for everyone (K_{j+1} may still fly)
    accumulate_pv<T, D>(o, s, v_tile, lane);
    tile = next;
    in_hand ^= 1;
  }
  // END SOLUTION

  if constexpr (V >= 3)
    for (int r = 0; r < 2; ++r) m[r] *= 0.6931471805599453f;  // back to natural units for lse
  finish_head_rows<T, D>(out, lse, bh, rows, p, o, m, l, lane);
}

template <typename T, int D>
void launch_version(int version, const void* q, const void* k, const void* v, void* out, float* lse,
                    const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos, const BlockAttentionParams& p,
                    cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.batch * p.heads_q), static_cast<unsigned>((p.seq_q + kBr - 1) / kBr));
  const T* q_t = static_cast<const T*>(q);
  const T* k_t = static_cast<const T*>(k);
  const T* v_t = static_cast<const T*>(v);
  T* out_t = static_cast<T*>(out);
  // BEGIN SOLUTION task 2: launch
  // STUB: // TODO(lesson 17, task 2): launch fast_forward_kernel<T, D, version> once the pipeline is written.
  // STUB: (void)version, (void)grid, (void)q_t, (void)k_t, (void)v_t, (void)out_t, (void)lse, (void)q_first,
  // STUB: (void)q_last, (void)k_pos, (void)p, (void)stream;
  // STUB: throw NotImplemented("lesson 17, task 2: the pipeline of version 2, then its launch");
  if (version == 2)
    fast_forward_kernel<T, D, 2><<<grid, kThreads, 0, stream>>>(q_t, k_t, v_t, out_t, lse, q_first, q_last, k_pos, p);
  else
    fast_forward_kernel<T, D, 3><<<grid, kThreads, 0, stream>>>(q_t, k_t, v_t, out_t, lse, q_first, q_last, k_pos, p);
  CUDA_CHECK_LAUNCH();
  // END SOLUTION
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
  if (version >= 3) throw NotImplemented("lesson 17, task 3: softmax_tile_exp2 (version 3)");
#endif
  if (p.batch * p.heads_q == 0 || p.seq_q == 0) return;
  kernels::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      if (p.head_dim == 64) launch_version<T, 64>(version, q, k, v, out, lse, q_first, q_last, k_pos, p, stream);
      else launch_version<T, 128>(version, q, k, v, out, lse, q_first, q_last, k_pos, p, stream);
    }
  });
  kernels::throw_on_emulation_fault(stream, "fast_forward_kernel");
}

}  // namespace cp
