// SIMD vectors of any width for the course's CPU loops, and the run-time choice of width.
//
// A loop is written once, as a template on the vector width W (floats per register), with the
// vector types of GCC's and Clang's vector extension (`a * b + c` acts lane by lane; no
// intrinsics). simd_call<Kernel>(args...) runs Kernel::run<W>(args...) compiled three times: for
// every x86-64 CPU (SSE2, W = 4), for AVX2 with FMA (W = 8) and for AVX-512 (W = 16), and picks the
// widest that simd_level() (common/cpu_features.h) allows. The helpers are always inlined, so each
// copy is compiled for its instruction set: one binary is fast on a new CPU and correct on an old one.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "common/cpu_features.h"

namespace cp::kernels {

#define CP_SIMD_INLINE inline __attribute__((always_inline))
/// The same for a lambda inside a SIMD loop, after its parameter list: `[&](int i) CP_SIMD_LAMBDA
/// { ... }`. Without it a lambda called twice is compiled once, as a function of its own for the
/// default target (SSE2), and every vector of 8 or 16 floats in it is split into pieces: the
/// backward ran 12 times slower.
#define CP_SIMD_LAMBDA __attribute__((always_inline))

/// W floats in one SIMD register (W = 4, 8 or 16).
template <int W>
struct FloatVec {
  typedef float type __attribute__((vector_size(4 * W)));
};
template <int W>
using fvec = typename FloatVec<W>::type;

/// The unsigned 32-bit vector of the same width, for bit manipulation.
template <int W>
struct UintVec {
  typedef uint32_t type __attribute__((vector_size(4 * W)));
};

/// Floats per vector of type V.
template <typename V>
constexpr int lanes_of = sizeof(V) / sizeof(float);

template <typename V>
CP_SIMD_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);  // unaligned: any row start
  return v;
}
template <typename V>
CP_SIMD_INLINE void store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
#if defined(__clang__)
template <typename V, size_t... Lane>
CP_SIMD_INLINE V lane0_everywhere(V v, std::index_sequence<Lane...>) {
  return __builtin_shufflevector(v, v, (Lane * 0)...);
}
#endif
/// Every lane equal to x, as a register broadcast with GCC's -O2 and -O3 alike (a shuffle of
/// lane 0; GCC and Clang name it differently). Simpler forms compile badly in the SIMD copies
/// (GCC 12): `V{} + x` as a scalar add and a broadcast, a loop over the lanes or `x - V{}` as
/// one insert per lane at -O3.
///
/// In a hot loop, multiply by the scalar itself, read from memory: `q[d] * v` broadcasts q[d]
/// within its load (one load, nothing on the arithmetic pipes), where splat's register
/// broadcast takes a shuffle slot beside the FMAs. Measured on an AMD EPYC (Zen 3) with AVX2:
/// the forward's inner loops ran 1.4 times slower through splat.
template <typename V>
CP_SIMD_INLINE V splat(float x) {
  V v = {};
  v[0] = x;
#if defined(__clang__)
  return lane0_everywhere(v, std::make_index_sequence<lanes_of<V>>{});
#else
  return __builtin_shuffle(v, typename UintVec<lanes_of<V>>::type{});
#endif
}

/// The bits of `from` read as a `To` of the same size.
template <typename To, typename From>
CP_SIMD_INLINE To bits(From from) {
  static_assert(sizeof(To) == sizeof(From), "bits: sizes differ");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

/// The larger of a and b, lane by lane, where a NaN in either wins (std::max and maxps drop it).
/// At W = 16 GCC 12 and 14 compile it lane by lane, one scalar comparison each (two comparisons
/// joined in one select; a select on one comparison, `a > b ? a : b`, stays one vector
/// instruction): keep it out of loops over every score (lesson 03 takes it once per row group).
template <typename V>
CP_SIMD_INLINE V max_keep_nan(V a, V b) {
  return (a > b || a != a) ? a : b;
}

/// The lanes [half, 2 · half) of v as a vector of `half` lanes (half: 0 for the low half's copy).
template <typename V>
CP_SIMD_INLINE fvec<lanes_of<V> / 2> half_of(V v, int which) {
  fvec<lanes_of<V> / 2> h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + which * sizeof h, sizeof h);
  return h;
}

/// The largest lane; NaN if a lane is NaN. Halves are folded onto each other (log2 W vector
/// steps), not lane after lane: a scalar loop of compares with a NaN test each step was a third
/// of the forward's time.
template <typename V>
CP_SIMD_INLINE float max_lane(V v) {
  if constexpr (lanes_of<V> == 1) {
    return v[0];
  } else {
    return max_lane(max_keep_nan(half_of(v, 0), half_of(v, 1)));
  }
}

/// The largest lane by plain comparisons: max_lane without its NaN test, so a NaN lane may be
/// dropped. For a loop in which a NaN reaches the result another way (lesson 03's forward: the
/// score's p = e^NaN joins l and O).
template <typename V>
CP_SIMD_INLINE float max_lane_fast(V v) {
  if constexpr (lanes_of<V> == 1) {
    return v[0];
  } else {
    const auto lo = half_of(v, 0), hi = half_of(v, 1);
    return max_lane_fast(lo > hi ? lo : hi);
  }
}

/// The sum of the lanes, halves folded onto each other.
template <typename V>
CP_SIMD_INLINE float sum_lanes(V v) {
  if constexpr (lanes_of<V> == 1) {
    return v[0];
  } else {
    return sum_lanes(half_of(v, 0) + half_of(v, 1));
  }
}

/// e^x lane by lane for the online update's x <= 0, within about 1 ulp: e^-inf = 0 exactly, e^0 = 1,
/// NaN stays NaN. x > 0 is read as 0 (e^x = 1): the callers' x is a score minus a maximum, which
/// rounding may leave a hair above 0. Below -87.7 the result is 0 (the true one is under 1e-38).
/// No branch or library call, so it stays in the vector registers (std::exp is one scalar call per
/// element): e^x = 2^n · e^r with n = round(x log2 e) and |r| <= ln2 / 2.
/// - n is read from the low bits of x log2 e + 1.5·2^23, with no float-to-int conversion.
/// - e^r is 1 + r + r² q(r), q of degree 4 fitted for the least largest relative error on
///   [-ln2/2, ln2/2] (3e-9, far below float's 6e-8). Measured against double exp on every float
///   in [-87.3, 0]: at most 1.02 ulp.
/// - Clamping x to [-88, 0] first keeps n in [-127, 0]: 2^n is then its exponent field alone,
///   and n = -127 gives that field 0, the float 0, so e^-inf = 0 costs no extra test. The two
///   comparisons are false for NaN, which passes through.
/// Lesson 05's backward runs it once per score: each operation here counts (docs/performance.md).
template <typename V>
CP_SIMD_INLINE V exp_nonpos(V x) {
  using U = typename UintVec<lanes_of<V>>::type;
  x = x > 0.0f ? V{} : x;
  x = x < -88.0f ? splat<V>(-88.0f) : x;
  const V magic = splat<V>(12582912.0f);  // 1.5 · 2^23
  const V t = x * 1.44269504088896341f + magic;
  const V n = t - magic;
  const V r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // x - n ln 2, in two parts
  V q = splat<V>(1.3814604750e-3f);
  q = q * r + 8.3687102191e-3f;
  q = q * r + 4.1668387501e-2f;
  q = q * r + 1.6666520687e-1f;
  q = q * r + 4.9999993451e-1f;
  const V e_r = q * r * r + r + 1.0f;
  const U two_n = (bits<U>(t) - (0x4B400000u - 127u)) << 23;  // (n + 127) in the exponent field
  return e_r * bits<V>(two_n);
}

/// 2^x lane by lane for x <= 0 (a rounding's hair above 0 is computed as it is): 2^-inf = 0
/// exactly, 2^0 = 1, NaN stays NaN, and below -126.5 the result is 0 (the true one is under
/// 8.5e-39). Measured against double exp2 on every float in [-126, 0]: at most 0.95 ulp with FMA,
/// 1.23 without. exp_nonpos's method in base 2 (FlashAttention's `exp2f`): lesson 03's forward
/// multiplies its scores by scale · log2 e, which costs it nothing, and then needs 2^x instead of
/// e^x, which saves exp_nonpos's multiply by log2 e, half its reduction and its test of x > 0.
/// - n = round(x) is read from the low bits of x + 1.5·2^23, and r = x - n, in [-1/2, 1/2], is
///   exact.
/// - 2^r is 1 + r p(r), p of degree 5 fitted for the least largest relative error on [-1/2, 1/2]
///   (2e-9).
/// - Clamping x at -127 keeps n in [-127, 0]; n = -127 gives 2^n the exponent field 0, the float
///   0, so 2^-inf = 0 with no extra test. The comparison is false for NaN, which passes through.
/// Lesson 03's forward runs it once per score: each operation here counts (docs/performance.md).
template <typename V>
CP_SIMD_INLINE V exp2_nonpos(V x) {
  using U = typename UintVec<lanes_of<V>>::type;
  x = x < -127.0f ? splat<V>(-127.0f) : x;
  const V magic = splat<V>(12582912.0f);  // 1.5 · 2^23
  const V t = x + magic;
  const V r = x - (t - magic);
  V p = splat<V>(1.535336196e-4f);
  p = p * r + 1.339887502e-3f;
  p = p * r + 9.618436918e-3f;
  p = p * r + 5.550332367e-2f;
  p = p * r + 2.402264774e-1f;
  p = p * r + 6.931471825e-1f;
  const U two_n = (bits<U>(t) - (0x4B400000u - 127u)) << 23;  // (n + 127) in the exponent field
  return (p * r + 1.0f) * bits<V>(two_n);
}

// The copies of a kernel, one per instruction set. target("...") compiles that function (and
// everything always inlined into it) for the named instructions; the vector width is the
// template argument. On other architectures there is one copy, of width 4 (NEON on arm64).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
template <typename Kernel, typename... Args>
__attribute__((target("avx512f,avx2,fma"))) void simd_call_avx512(Args&&... args) {
  Kernel::template run<16>(args...);
}
template <typename Kernel, typename... Args>
__attribute__((target("avx2,fma"))) void simd_call_avx2(Args&&... args) {
  Kernel::template run<8>(args...);
}
#endif

/// Runs Kernel::run<W>(args...) with the widest vectors simd_level() allows.
template <typename Kernel, typename... Args>
void simd_call(Args&&... args) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  switch (simd_level()) {
    case SimdLevel::kAvx512: return simd_call_avx512<Kernel>(std::forward<Args>(args)...);
    case SimdLevel::kAvx2: return simd_call_avx2<Kernel>(std::forward<Args>(args)...);
    case SimdLevel::kBaseline: break;
  }
#endif
  Kernel::template run<4>(args...);
}

}  // namespace cp::kernels
