// GENERATED from solutions/18_fast_backward/fast_backward.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 18 — the torch side of the matrix-unit backward: lesson 05's checks and tensors around
// this lesson's kernels, and the switch that puts them under attention_block_backward.
#include "fast_backward.h"

#include "common/error.h"
#include "fast_forward.h"
#include "tensor_cores.h"

#if CP_WITH_CUDA
#include "fast_backward.cuh"
#endif

namespace cp {

namespace {

#if CP_WITH_CUDA
/// The kernels for every input (attention_backward_fast has checked them).
bool backward_always(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                     const float* delta, const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos,
                     float* dq, float* dk, float* dv, const BlockAttentionParams& params, DType dtype,
                     cudaStream_t stream, int /*compute_capability_major*/) {
  launch_fast_backward(q, k, v, dout, lse, delta, q_first, q_last, k_pos, dq, dk, dv, params, dtype, stream);
  return true;
}

/// Lesson 05's override: the kernels for the inputs the matrix units take, nothing for the others.
bool backward_if_taken(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                       const float* delta, const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos,
                       float* dq, float* dk, float* dv, const BlockAttentionParams& params, DType dtype,
                       cudaStream_t stream, int compute_capability_major) {
  const torch::ScalarType type = dtype == DType::Float16    ? torch::kHalf
                                 : dtype == DType::BFloat16 ? torch::kBFloat16
                                                            : torch::kFloat;
  if (!takes_tensor_cores(type, params.head_dim, compute_capability_major)) return false;
  return backward_always(q, k, v, dout, lse, delta, q_first, q_last, k_pos, dq, dk, dv, params, dtype, stream,
                         compute_capability_major);
}
#endif

}  // namespace

AttnGrads attention_backward_fast(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                  const AttentionMask& mask, std::optional<double> scale) {
  // The matrix units' own demands first (lesson 05's checks would take float32 and the CPU).
  if (q.defined()) {
    CP_CHECK(q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16,
             "q: the matrix units take float16 or bfloat16, got ", q.dtype());
    CP_CHECK(q.is_cuda(), "q: the matrix units are a GPU's; q is on ", q.device());
    CP_CHECK(q.dim() != 4 || q.size(3) == 64 || q.size(3) == 128, "q: head dim ", q.dim() == 4 ? q.size(3) : -1,
             " is not supported by the matrix-unit backward (64 or 128)");
  }
#if CP_WITH_CUDA
  return attention_block_backward_on(&backward_always, dout, q, k, v, out, lse, mask, scale);
#else
  (void)dout, (void)k, (void)v, (void)out, (void)lse, (void)mask, (void)scale;
  CP_FAIL("q is a CUDA tensor (", q.device(), ") but this build has no CUDA (nvcc was not found)");
#endif
}

void use_fast_backward(bool on) {
#if CP_WITH_CUDA
  set_cuda_backward_override(on ? &backward_if_taken : nullptr);
#else
  (void)on;  // no CUDA tensor exists without CUDA
#endif
}

void use_matrix_units(bool on) {
  use_fast_forward(on ? kFastestMeasuredVersion : 0);
  use_fast_backward(on);
}

}  // namespace cp
