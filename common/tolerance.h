// The one tolerance table of the course: what "equal to the float64 reference" means for each
// dtype. The tests check with it (tests/testing/oracle.h) and the demos mark their errors ok or
// FAIL with it, so a figure a demo calls ok is one a test would pass.
#pragma once

#include <torch/types.h>

namespace cp {

/// An element is right when |actual - expected| <= abs + rel * |expected|.
struct Tolerance {
  double abs;
  double rel;
};

/// The tolerance for a result of dtype `dtype` (see tolerance.cpp for why each value is what it is).
Tolerance tolerance_for(torch::ScalarType dtype);

/// The tolerance for a gradient: the dtype's, with the absolute part scaled by the largest
/// |element| of `expected`. A gradient element is a sum of terms of both signs (dS = P∘(dP − D)
/// sums to zero over each row), so its rounding error follows the size of the terms, not of
/// the element: a near-zero element of dK carries the absolute error of its large neighbours.
Tolerance gradient_tolerance(torch::ScalarType dtype, const torch::Tensor& expected);

/// The tolerance for out of attention on the matrix units (lesson 16), whose inputs are 16-bit:
/// P is rounded to v's dtype before P·V (the units take nothing wider), as FlashAttention-2 does,
/// so out carries that rounding, about u · max|v| (unit roundoff u: 2⁻¹¹ float16, 2⁻⁸ bfloat16),
/// on top of the dtype's tolerance: twice that is added to its absolute part.
Tolerance matrix_unit_tolerance(const torch::Tensor& v);

/// The tolerance of a gradient of attention on the matrix units (lesson 18), whose products take
/// 16-bit operands: P is rounded to the inputs' dtype before dV = Pᵀ·dO, and dS before
/// dK = scale·dSᵀ·Q and dQ = scale·dS·K, as FlashAttention-2 does. Each rounding moves its
/// factor by at most u·|factor| (u: 2⁻¹¹ float16, 2⁻⁸ bfloat16), so the gradient moves by at most
/// u · weight_sum · other_max, where weight_sum is the largest sum of |P| or |dS| along the summed
/// index (query rows for dV and dK, keys for dQ) and other_max the largest |dO|, or scale · |Q|
/// or scale · |K|. Twice that is added to gradient_tolerance's absolute part.
Tolerance matrix_unit_gradient_tolerance(torch::ScalarType dtype, const torch::Tensor& expected, double weight_sum,
                                         double other_max);

/// The tolerance for out of a ring (lessons 04-16): out merged from blocks whose outs were each
/// rounded to v's dtype before the merge, since the block kernel writes the input's dtype (as
/// FlashAttention's does; ring-flash-attention and TransformerEngine merge such outs the same
/// way). out = Σₛ wₛ·outₛ with Σₛ wₛ = 1 and |outₛ| ≤ max|v|, so those roundings add at most
/// u · max|v| (u as above; 2⁻²⁴ for float32) to `base`'s absolute part.
Tolerance merged_tolerance(const torch::Tensor& v, Tolerance base);
/// merged_tolerance on v's dtype's own tolerance.
Tolerance merged_tolerance(const torch::Tensor& v);

}  // namespace cp
