// Shared-memory tiles of the attention kernels (lessons 03 and 05).
//
// A block owns some rows (queries or keys) and streams tiles of the other side's rows through
// shared memory. Each owned row is split over a row group of D / kSlice adjacent threads, one
// slice of kSlice dims per thread, which a thread reads four floats at a time (load4: one 16-byte
// shared load where four floats would take four). In shared memory every slice is followed by
// four floats of padding: the threads of a group read the same dims of different slices, and the
// padding puts those reads on different banks instead of the same ones, while keeping every slice
// 16-byte aligned (one float of padding would break the alignment).
#pragma once

#include <climits>
#include <cstdint>

#include "kernels/dtype.cuh"
#include "kernels/warp.cuh"

namespace cp::kernels {

/// Where element (row, dim) of a tile of D-dim float rows lives in shared memory.
template <int D, int kSlice>
struct PaddedTile {
  static_assert(D % kSlice == 0, "the head dim must be a multiple of the slice");
  static_assert(kSlice % 4 == 0, "slices are read four floats at a time");
  static constexpr int kPad = 4;                            ///< floats after each slice
  static constexpr int kGroup = D / kSlice;                 ///< threads per row (a row group)
  static constexpr int kStride = kGroup * (kSlice + kPad);  ///< floats per tile row, padding included

  static __device__ __forceinline__ int at(int row, int dim) {
    return row * kStride + (dim / kSlice) * (kSlice + kPad) + dim % kSlice;
  }

  /// Dims 4c .. 4c + 3 of the slice that starts at `slice` (tile + at(row, g * kSlice)), in one
  /// 16-byte load. The tile itself must be 16-byte aligned (kernels declare their shared memory so).
  static __device__ __forceinline__ float4 load4(const float* slice, int c) {
    return reinterpret_cast<const float4*>(slice)[c];
  }

  /// Loads rows [row0, row0 + n) of a [rows, D] matrix `src` into tile rows 0 .. kRows − 1, as
  /// float; rows past n become zeros (a partial last tile). Every thread of the block takes part,
  /// consecutive threads reading consecutive dims (coalesced). The caller's __syncthreads()
  /// makes the tile visible.
  template <int kRows, typename T>
  static __device__ void load(float* tile, const T* src, int64_t row0, int n) {
    for (int idx = threadIdx.x; idx < kRows * D; idx += blockDim.x) {
      const int r = idx / D, d = idx % D;
      tile[at(r, d)] = r < n ? to_float(src[(row0 + r) * D + d]) : 0.0f;
    }
  }
};

/// The positions n ranges first[i] … last[i] cover together: the smallest first and the largest
/// last (n = 0: LLONG_MAX and LLONG_MIN, a range that contains nothing). With first = last = a
/// tile's positions, their smallest and largest. The keys a block's rows see against a tile's
/// positions decide whether the block skips the tile whole. Read by one thread or by all.
__device__ __forceinline__ void covered_range(const int64_t* first, const int64_t* last, int n, int64_t& lo,
                                              int64_t& hi) {
  lo = LLONG_MAX;
  hi = LLONG_MIN;
  for (int i = 0; i < n; ++i) {
    lo = first[i] < lo ? first[i] : lo;
    hi = last[i] > hi ? last[i] : hi;
  }
}

/// The sum of x over the kGroup adjacent threads of a row group, in every one of them: a
/// butterfly of xor shuffles (kGroup a power of two, at most a warp). Every lane of the warp must
/// call it (rule 1 of kernels/README.md).
template <int kGroup>
__device__ __forceinline__ float group_sum(float x) {
  static_assert(kGroup >= 1 && kGroup <= kWarpSize && (kGroup & (kGroup - 1)) == 0, "kGroup: a power of two <= 32");
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullWarp, x, offset);
  return x;
}

}  // namespace cp::kernels
