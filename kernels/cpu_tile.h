// Tiles of the course's CPU attention (lessons 03 and 05), the CPU counterpart of tile.cuh: the
// tile shape, packing into float32 tiles and the positions that decide a masked tile's skip. The
// SIMD vectors that compute on the tiles, of the width the CPU has, are in cpu_simd.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <new>
#include <vector>

namespace cp::kernels {

constexpr int64_t kBc = 32;        ///< keys per tile, as in the CUDA kernels
constexpr int64_t kBr = 32;        ///< query rows per tile
constexpr int64_t kDimAlign = 32;  ///< packed rows: zeros up to a multiple of 32 dims, summed 32 at a time
/// Key tiles that meet the query tiles together (a pass), forward and backward: every query tile
/// of the head takes the pass's 8 · kBc = 256 keys, in order, while they stay in the core's L2
/// cache, and the next query tile finds them there. A query tile walking all the keys alone read
/// each key tile again from L3 or memory (the backward: each key tile, all the query rows); from
/// S = 4096 on, one head's packed rows no longer fit the caches (docs/performance.md).
constexpr int64_t kKeyTilesPerPass = 8;

/// Rows that meet a tile together in the CPU loops (lesson 03's query rows; lesson 05's query rows
/// or keys), for W floats per SIMD register: each vector loaded from the tile serves every row of
/// the group, and the group's register tile, rows × 2 vectors, holds 2 · group sums. Four rows fill
/// 8 of the 16 registers of SSE2 and AVX2 (the others hold the loaded vectors; six rows measured no
/// faster). AVX-512 has 32: eight rows ran lesson 03's forward 1.09-1.11 times and lesson 05's
/// backward 1.05-1.12 times as fast as four on an Intel Xeon (docs/performance.md, "Row groups at
/// AVX-512").
constexpr int64_t row_group(int w) { return w == 16 ? 8 : 4; }

/// An allocator whose arrays start on a 64-byte cache line. The packed rows below are multiples of
/// 32 floats, so every row and tile then starts on one too, and no vector load (8 floats at AVX2,
/// 16 at AVX-512) reads two cache lines. glibc's malloc puts a large block 16 bytes past a page
/// boundary, where half the 32-byte loads and every 64-byte load straddled two lines. Measured in
/// a copy of the forward's loops with AVX-512 on an Intel Xeon: 1.06-1.09 times as fast on lines;
/// with AVX2 on an AMD EPYC the real passes showed no difference beyond the noise
/// (docs/performance.md, "Tiles on cache lines").
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kAlignment); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
/// Float32 tiles and packed rows, on cache lines.
using TileFloats = std::vector<float, CacheLineAllocator<float>>;

/// The head dim of packed rows: d_model rounded up to a multiple of kDimAlign.
inline int64_t padded_dim(int64_t d_model) { return (d_model + kDimAlign - 1) / kDimAlign * kDimAlign; }

/// Rows of a [seq, d_model] matrix as float32 rows of dp floats (zeros past the head dim and past
/// the last row, up to a multiple of `tile` rows).
template <typename T>
void pack_rows(const T* x, int64_t seq, int64_t d_model, int64_t dp, int64_t tile, TileFloats& rows) {
  rows.assign((seq + tile - 1) / tile * tile * dp, 0.0f);
  for (int64_t i = 0; i < seq; ++i)
    for (int64_t d = 0; d < d_model; ++d) rows[i * dp + d] = static_cast<float>(x[i * d_model + d]);
}

/// A [seq, d_model] matrix in tiles of kBc rows, each transposed: [tile][dim][kBc], zero-padded,
/// so that dim d of a tile's rows is kBc consecutive floats (kKeyVecs vectors).
template <typename T>
void pack_transposed(const T* x, int64_t seq, int64_t d_model, int64_t dp, TileFloats& tiles) {
  tiles.assign((seq + kBc - 1) / kBc * dp * kBc, 0.0f);
  for (int64_t j = 0; j < seq; ++j) {
    float* tile = tiles.data() + j / kBc * dp * kBc;
    for (int64_t d = 0; d < d_model; ++d) tile[d * kBc + j % kBc] = static_cast<float>(x[j * d_model + d]);
  }
}

/// The smallest and largest position of each tile of `tile` consecutive positions: a causal tile
/// pair is skipped, or computed without a mask, from these alone, so any layout (even unsorted
/// positions) is handled.
inline void tile_position_bounds(const int64_t* pos, int64_t n, int64_t tile, std::vector<int64_t>& min_pos,
                                 std::vector<int64_t>& max_pos) {
  min_pos.assign((n + tile - 1) / tile, std::numeric_limits<int64_t>::max());
  max_pos.assign(min_pos.size(), std::numeric_limits<int64_t>::min());
  for (int64_t i = 0; i < n; ++i) {
    min_pos[i / tile] = std::min(min_pos[i / tile], pos[i]);
    max_pos[i / tile] = std::max(max_pos[i / tile], pos[i]);
  }
}

/// The visible keys of a tile of query rows (row i sees the key positions first[i] .. last[i],
/// lesson 03's VisibleKeys; first = nullptr: every key), summarised so that a whole key tile is
/// decided from its smallest and largest position (tile_position_bounds).
struct RowRanges {
  bool masked = false;
  int64_t first_min = 0, first_max = 0, last_min = 0, last_max = 0;
  /// No row sees a key positioned in [lo, hi]: the tile is skipped.
  bool misses(int64_t lo, int64_t hi) const { return masked && (lo > last_max || hi < first_min); }
  /// Every row sees every key positioned in [lo, hi]: the tile needs no mask.
  bool sees_all(int64_t lo, int64_t hi) const { return !masked || (lo >= first_max && hi <= last_min); }
};

/// The RowRanges of rows [begin, begin + rows) of first/last (both nullptr: unmasked).
inline RowRanges row_ranges(const int64_t* first, const int64_t* last, int64_t begin, int64_t rows) {
  RowRanges r;
  if (first == nullptr) return r;
  r.masked = true;
  r.first_min = r.last_min = std::numeric_limits<int64_t>::max();
  r.first_max = r.last_max = std::numeric_limits<int64_t>::min();
  for (int64_t i = begin; i < begin + rows; ++i) {
    r.first_min = std::min(r.first_min, first[i]);
    r.first_max = std::max(r.first_max, first[i]);
    r.last_min = std::min(r.last_min, last[i]);
    r.last_max = std::max(r.last_max, last[i]);
  }
  return r;
}

}  // namespace cp::kernels
