// Tiles of the course's CPU attention (lessons 03 and 05), the CPU counterpart of tile.cuh: the
// tile shape, packing into float32 tiles, the positions that decide a masked tile's skip, and four-float
// SIMD vectors. The vectors are GCC's and Clang's vector extension, so the same code is SSE2 on
// x86-64 and NEON on arm64 with no intrinsics and no -march flag.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace cp::kernels {

/// Four floats in one SIMD register. `a * b`, `a + b`, `a * 2.0f` act on the four lanes; `v[k]`
/// reads lane k.
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));

constexpr int64_t kLanes = 4;  ///< floats per f32x4

inline f32x4 load4(const float* p) {
  f32x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store4(float* p, f32x4 v) { std::memcpy(p, &v, sizeof v); }

/// The bits of `from` read as a `To` of the same size.
template <typename To, typename From>
inline To bits(From from) {
  static_assert(sizeof(To) == sizeof(From), "bits: sizes differ");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

/// The larger of a and b, lane by lane, where a NaN in either wins (std::max and maxps drop it).
inline f32x4 max_keep_nan(f32x4 a, f32x4 b) { return (a > b || a != a) ? a : b; }

/// The largest of the four lanes; NaN if a lane is NaN.
inline float max_lane(f32x4 v) {
  float m = v[0];
  for (int k = 1; k < kLanes; ++k) m = (v[k] > m || v[k] != v[k]) ? v[k] : m;
  return m;
}

/// e^x lane by lane for the online update's x <= 0 (about 1 ulp): e^-inf = 0 (so is anything
/// below -87), e^0 = 1, NaN stays NaN (above 88: +inf). Cephes' expf without a branch or a library
/// call, so it stays in the vector registers (std::exp is one scalar call per element). No
/// float-to-int conversion: n = round(x log2 e) is read from the low bits of x log2 e + 1.5·2^23.
inline f32x4 exp_nonpos(f32x4 x) {
  const f32x4 magic = f32x4{} + 12582912.0f;  // 1.5 · 2^23
  const f32x4 t = x * 1.44269504088896341f + magic;
  const f32x4 n = t - magic;
  const f32x4 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // x - n ln 2, in two parts
  f32x4 p = f32x4{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;  // e^r
  const u32x4 two_n = ((bits<u32x4>(t) - 0x4B400000u) + 127u) << 23;  // 2^n, in the exponent field
  const u32x4 keep = bits<u32x4>(!(x < -87.0f));                         // all ones unless x < -87 (NaN: kept)
  const u32x4 big = bits<u32x4>(x > 88.0f);                              // beyond float's range: +inf
  return bits<f32x4>((bits<u32x4>(p * bits<f32x4>(two_n)) & keep & ~big) | (big & 0x7F800000u));
}


constexpr int64_t kBc = 32;                       ///< keys per tile, as in the CUDA kernels
constexpr int64_t kBr = 32;                       ///< query rows per tile
constexpr int64_t kKeyVecs = kBc / kLanes;        ///< a row's kBc values of one tile: 8 vectors
constexpr int64_t kDimVecs = 8;                   ///< sums over the head dim run 8 vectors (32 dims) at a time
constexpr int64_t kDimAlign = kDimVecs * kLanes;  ///< packed rows: zeros up to a multiple of 32 dims

/// The head dim of packed rows: d_model rounded up to a multiple of kDimAlign.
inline int64_t padded_dim(int64_t d_model) { return (d_model + kDimAlign - 1) / kDimAlign * kDimAlign; }

/// Rows of a [seq, d_model] matrix as float32 rows of dp floats (zeros past the head dim and past
/// the last row, up to a multiple of `tile` rows).
template <typename T>
void pack_rows(const T* x, int64_t seq, int64_t d_model, int64_t dp, int64_t tile, std::vector<float>& rows) {
  rows.assign((seq + tile - 1) / tile * tile * dp, 0.0f);
  for (int64_t i = 0; i < seq; ++i)
    for (int64_t d = 0; d < d_model; ++d) rows[i * dp + d] = static_cast<float>(x[i * d_model + d]);
}

/// A [seq, d_model] matrix in tiles of kBc rows, each transposed: [tile][dim][kBc], zero-padded,
/// so that dim d of a tile's rows is kBc consecutive floats (kKeyVecs vectors).
template <typename T>
void pack_transposed(const T* x, int64_t seq, int64_t d_model, int64_t dp, std::vector<float>& tiles) {
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
