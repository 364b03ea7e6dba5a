// The probe of kernels/mma.cuh: every fragment load and the product, one warp, written back
// element by element through the map (tests/kernels_test.cpp compares them with the matrices).
#include "common/cuda_check.h"
#include "common/error.h"
#include "kernels/dtype.cuh"
#include "kernels/mma.cuh"
#include "tests/kernels/mma_probe.cuh"

namespace cp::testing {
namespace {

using namespace cp::kernels;

constexpr int kLd = 24;  // row stride in shared memory, in elements: 48 bytes keeps rows 16-byte aligned

template <typename T>
__global__ void mma_probe_kernel(MmaProbe p) {
  // Raw 16-bit shared memory (the __half and __nv_bfloat16 types have constructors, which
  // __shared__ arrays may not), viewed as T.
  __shared__ __align__(16) uint16_t a_raw[16 * kLd], bt_raw[8 * kLd], b_raw[16 * kLd];
  T* a_s = reinterpret_cast<T*>(a_raw);    // A, row-major
  T* bt_s = reinterpret_cast<T*>(bt_raw);  // Bᵀ: row n holds column n of B
  T* b_s = reinterpret_cast<T*>(b_raw);    // B, row-major
  kernels::declare_shared(a_raw, sizeof a_raw, bt_raw, sizeof bt_raw, b_raw, sizeof b_raw);
  const int lane = threadIdx.x;
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  for (int i = lane; i < 16 * 16; i += kWarpSize) a_s[(i / 16) * kLd + i % 16] = a[i];
  for (int i = lane; i < 16 * 8; i += kWarpSize) {
    bt_s[(i % 8) * kLd + i / 8] = b[i];
    b_s[(i / 8) * kLd + i % 8] = b[i];
  }
  __syncthreads();

  FragA fa;
  FragB fb, fbt;
  ldmatrix_x4(fa.x, a_s + (lane % 16) * kLd + 8 * (lane / 16));
  ldmatrix_x2(fb.x, bt_s + (lane % 8) * kLd + 8 * ((lane / 8) % 2));
  ldmatrix_x2_trans(fbt.x, b_s + (lane % 16) * kLd);
  uint32_t a_as_b[4];  // A read as two B fragments (k × n, n-tiles 0 and 1): .x4.trans
  ldmatrix_x4_trans(a_as_b, a_s + (lane % 16) * kLd + 8 * (lane / 16));
  FragA wrong_a;
  FragB wrong_b;
  if (p.misuse == 1) ldmatrix_x4(wrong_a.x, a + (lane % 16) * 16 + 8 * (lane / 16));
  if (p.misuse == 2) ldmatrix_x2(wrong_b.x, bt_s + (lane % 8) * kLd + 1);
  if (p.misuse == 3) ldmatrix_x2_trans(wrong_b.x, b + (lane % 16) * 8);
  if (p.misuse == 4) ldmatrix_x4_trans(wrong_a.x, a + (lane % 16) * 16 + 8 * (lane / 16));
  if (p.misuse == 5) ldmatrix_x2(wrong_b.x, a_s + 2 * (lane % 8) * kLd);  // rows 96 bytes apart: 4 groups of banks
  (void)wrong_a, (void)wrong_b;
  for (int e = 0; e < 8; ++e) p.a_frag[lane * 8 + e] = unpack<T>(fa.x[e / 2], e % 2);
  for (int e = 0; e < 4; ++e) {
    p.b_frag[lane * 4 + e] = unpack<T>(fb.x[e / 2], e % 2);
    p.bt_frag[lane * 4 + e] = unpack<T>(fbt.x[e / 2], e % 2);
  }
  for (int e = 0; e < 8; ++e) p.a_as_b_frags[lane * 8 + e] = unpack<T>(a_as_b[e / 2], e % 2);

  // Fragments read from global memory by the map alone: the product without ldmatrix.
  FragA ma;
  FragB mb;
  for (int r = 0; r < 4; ++r)
    ma.x[r] = pack2<T>(to_float(a[frag_a_row(lane, 2 * r) * 16 + frag_a_col(lane, 2 * r)]),
                       to_float(a[frag_a_row(lane, 2 * r + 1) * 16 + frag_a_col(lane, 2 * r + 1)]));
  for (int r = 0; r < 2; ++r)
    mb.x[r] = pack2<T>(to_float(b[frag_b_row(lane, 2 * r) * 8 + frag_b_col(lane, 2 * r)]),
                       to_float(b[frag_b_row(lane, 2 * r + 1) * 8 + frag_b_col(lane, 2 * r + 1)]));
  FragC d_map, d_ld;
  for (int e = 0; e < 4; ++e) d_map.x[e] = d_ld.x[e] = p.c[frag_c_row(lane, e) * 8 + frag_c_col(lane, e)];
  mma<T>(d_map, ma, mb);
  mma<T>(d_ld, fa, fb);
  for (int e = 0; e < 4; ++e) {
    p.d_map[frag_c_row(lane, e) * 8 + frag_c_col(lane, e)] = d_map.x[e];
    p.d_ld[frag_c_row(lane, e) * 8 + frag_c_col(lane, e)] = d_ld.x[e];
  }
}

}  // namespace

void launch_mma_probe(const MmaProbe& probe, DType dtype, cudaStream_t stream) {
  CP_CHECK(dtype != DType::Float32, "launch_mma_probe: the matrix units take float16 or bfloat16");
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      mma_probe_kernel<T><<<1, kWarpSize, 0, stream>>>(probe);
      CUDA_CHECK_LAUNCH();
    }
  });
  kernels::throw_on_emulation_fault(stream, "mma_probe_kernel");
}

}  // namespace cp::testing
