// GENERATED from solutions/16_tensor_cores/tensor_cores.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 16 — the torch side of the matrix-unit kernel: lesson 03's checks, then the launch.
#include "tensor_cores.h"

#include <cmath>

#include "common/error.h"
#include "common/tensor_checks.h"

#if CP_WITH_CUDA
#include "common/device.h"
#include "tensor_core_attention.cuh"
#endif

namespace cp {

namespace {

/// The matrix units' own demands first: the shared checks would refuse float16 on the CPU with the
/// CPU path's advice, which is not this kernel's reason.
AttentionShapes check_matrix_unit_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  if (q.defined()) {
    CP_CHECK(q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16,
             "q: the matrix units take float16 or bfloat16, got ", q.dtype());
    CP_CHECK(q.is_cuda(), "q: the matrix units are a GPU's; q is on ", q.device());
  }
  return check_attention_inputs(q, k, v);
}

}  // namespace

#if CP_WITH_CUDA
AttnResult attention_forward_matrix_units(MatrixUnitLaunch launch, int variant, const torch::Tensor& q_in,
                                          const torch::Tensor& k_in, const torch::Tensor& v_in,
                                          const AttentionMask& mask, std::optional<double> scale) {
  const AttentionShapes s = check_matrix_unit_inputs(q_in, k_in, v_in);
  CP_CHECK(tensor_core_attention_supports_head_dim(s.head_dim), "q: head dim ", s.head_dim,
           " is not supported by the tensor-core kernel (64 or 128)");
  const torch::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const torch::Tensor q_pos = mask_positions(mask.q_positions, s.seq_q, q.device(), "mask.q_positions");
  const torch::Tensor k_pos = mask_positions(mask.k_positions, s.seq_k, q.device(), "mask.k_positions");
  const VisibleKeys keys = visible_keys(mask, q_pos);
  const float softmax_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(s.head_dim))));
  AttnResult result{torch::empty_like(q), torch::empty({s.batch, s.heads_q, s.seq_q}, q.options().dtype(torch::kFloat))};
  const BlockAttentionParams params{s.batch, s.heads_q, s.heads_kv, s.seq_q, s.seq_k, s.head_dim, softmax_scale,
                                    keys.masked};
  const CudaDeviceScope cuda(q.device());
  launch(variant, q.data_ptr(), k.data_ptr(), v.data_ptr(), result.out.data_ptr(), result.lse.data_ptr<float>(),
         keys.masked ? keys.first.data_ptr<int64_t>() : nullptr, keys.masked ? keys.last.data_ptr<int64_t>() : nullptr,
         k_pos.data_ptr<int64_t>(), params, kernel_dtype(q, "q"), cuda.stream());
  return result;
}

namespace {
/// Lesson 16's kernel as a MatrixUnitLaunch (it has one variant).
void launch_lesson16(int /*variant*/, const void* q, const void* k, const void* v, void* out, float* lse,
                     const int64_t* q_first, const int64_t* q_last, const int64_t* k_pos,
                     const BlockAttentionParams& params, DType dtype, cudaStream_t stream) {
  launch_tensor_core_attention_forward(q, k, v, out, lse, q_first, q_last, k_pos, params, dtype, stream);
}
}  // namespace
#endif

AttnResult attention_forward_tensor_cores(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const AttentionMask& mask, std::optional<double> scale) {
#if CP_WITH_CUDA
  return attention_forward_matrix_units(&launch_lesson16, 0, q, k, v, mask, scale);
#else
  (void)mask, (void)scale;
  check_matrix_unit_inputs(q, k, v);
  CP_FAIL("q is a CUDA tensor (", q.device(), ") but this build has no CUDA (nvcc was not found)");
#endif
}

bool takes_tensor_cores(torch::ScalarType dtype, int64_t head_dim, int compute_capability_major) {
  return (dtype == torch::kHalf || dtype == torch::kBFloat16) && (head_dim == 64 || head_dim == 128) &&
         compute_capability_major >= 8;
}

namespace {

/// Lesson 03's override: the matrix units for the inputs they take, nothing for the others.
std::optional<AttnResult> forward_on_tensor_cores(const torch::Tensor& q, const torch::Tensor& k,
                                                  const torch::Tensor& v, const AttentionMask& mask,
                                                  std::optional<double> scale) {
#if CP_WITH_CUDA
  if (!takes_tensor_cores(q.scalar_type(), q.size(3), compute_capability_major(q.device()))) return std::nullopt;
  return attention_forward_tensor_cores(q, k, v, mask, scale);
#else
  (void)q, (void)k, (void)v, (void)mask, (void)scale;
  return std::nullopt;  // no CUDA tensor reaches here without CUDA
#endif
}

}  // namespace

void use_tensor_cores(bool on) { set_cuda_forward_override(on ? &forward_on_tensor_cores : nullptr); }

}  // namespace cp
