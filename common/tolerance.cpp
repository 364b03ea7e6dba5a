#include "common/tolerance.h"

#include <algorithm>
#include <cmath>

namespace cp {

namespace {

/// The unit roundoff of a floating dtype: the largest relative error of one rounding to it.
double unit_roundoff(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kHalf: return std::ldexp(1.0, -11);
    case torch::kBFloat16: return std::ldexp(1.0, -8);
    case torch::kFloat: return std::ldexp(1.0, -24);
    default: return std::ldexp(1.0, -53);
  }
}

double largest_magnitude(const torch::Tensor& t) { return t.numel() ? t.abs().max().item<double>() : 0.0; }

}  // namespace

Tolerance tolerance_for(torch::ScalarType dtype) {
  switch (dtype) {
    // The kernels accumulate in float32 whatever the input, so float32 and float64 results
    // carry float32 rounding: unit roundoff 6e-8, grown by sums over up to a few thousand
    // terms and by exp() of arguments up to ~1e4 in magnitude -> 1e-5 relative.
    case torch::kDouble:
    case torch::kFloat: return {1e-6, 1e-5};
    // The result is computed in float32 and rounded once to the output type: unit roundoff
    // 4.9e-4 (fp16) and 3.9e-3 (bf16), plus the rounding of the inputs; 4 ulp of margin.
    case torch::kHalf: return {1e-4, 2e-3};
    case torch::kBFloat16: return {1e-3, 1.6e-2};
    default: return {0.0, 0.0};  // integers: exact
  }
}

Tolerance gradient_tolerance(torch::ScalarType dtype, const torch::Tensor& expected) {
  const Tolerance base = tolerance_for(dtype);
  return {std::max(base.abs, base.rel * largest_magnitude(expected)), base.rel};
}

Tolerance matrix_unit_tolerance(const torch::Tensor& v) {
  const Tolerance base = tolerance_for(v.scalar_type());
  return {base.abs + 2 * unit_roundoff(v.scalar_type()) * largest_magnitude(v), base.rel};
}

Tolerance matrix_unit_gradient_tolerance(torch::ScalarType dtype, const torch::Tensor& expected, double weight_sum,
                                         double other_max) {
  const Tolerance base = gradient_tolerance(dtype, expected);
  return {base.abs + 2 * unit_roundoff(dtype) * weight_sum * other_max, base.rel};
}

Tolerance merged_tolerance(const torch::Tensor& v, Tolerance base) {
  return {base.abs + unit_roundoff(v.scalar_type()) * largest_magnitude(v), base.rel};
}

Tolerance merged_tolerance(const torch::Tensor& v) { return merged_tolerance(v, tolerance_for(v.scalar_type())); }

}  // namespace cp
