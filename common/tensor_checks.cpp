#include "common/tensor_checks.h"

#include "common/error.h"

namespace cp {

DType kernel_dtype(const torch::Tensor& t, const char* arg) {
  switch (t.scalar_type()) {
    case torch::kFloat: return DType::Float32;
    case torch::kHalf: return DType::Float16;
    case torch::kBFloat16: return DType::BFloat16;
    default: CP_FAIL(arg, ": CUDA kernels take float32, float16 or bfloat16, got ", t.dtype());
  }
}

void check_defined(const torch::Tensor& t, const char* arg, int64_t min_dim) {
  CP_CHECK(t.defined(), arg, ": tensor is undefined");
  CP_CHECK(t.dim() >= min_dim, arg, ": expected at least ", min_dim, " dimension(s), got shape ", t.sizes());
}

void check_float_dtype(const torch::Tensor& t, const char* arg) {
  if (t.is_cuda()) {
    kernel_dtype(t, arg);
    return;
  }
  CP_CHECK(t.device().is_cpu(), arg, ": expected a CPU or CUDA tensor, got ", t.device());
  CP_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kDouble, arg,
           ": the CPU path takes float32 or float64, got ", t.dtype(),
           " (float16/bfloat16 are supported on CUDA; use .to(torch::kFloat) on the CPU)");
}

}  // namespace cp
