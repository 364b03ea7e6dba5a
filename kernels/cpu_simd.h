// Four-float SIMD building blocks of the course's CPU attention (lessons 03 and 05): the CPU
// counterpart of the kernels' tile helpers. GCC's and Clang's vector extension, so the same code
// is SSE2 on x86-64 and NEON on arm64 with no intrinsics and no -march flag.
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace cp::kernels
