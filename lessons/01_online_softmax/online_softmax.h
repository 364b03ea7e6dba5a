// Lesson 01 — online softmax: the contract the tests use.
//
// The learner writes the bodies in softmax_state.h (task 1), online_softmax.cpp (tasks 2, 3)
// and online_softmax.cu (task 4). This header is hand written and never generated.
#pragma once

#include <torch/types.h>

// Angle brackets on purpose: the include path, not this header's folder, decides whose
// softmax_state.h is used (the learner's in the learner build, the solution's in the solution
// build and in later lessons).
#include <softmax_state.h>

namespace cp {

/// Softmax over the last dimension in three passes over each row (max, sum, normalise).
/// The textbook "safe" softmax: the reference the online version improves on.
/// @param x  [..., n] float32 or float64 CPU tensor (any leading dims, contiguous or not).
/// @return   [..., n] same dtype; a row that is entirely -inf gives zeros (see README).
torch::Tensor safe_softmax(const torch::Tensor& x);

/// Softmax over the last dimension with the online (m, l) state: one pass over each row
/// computes the statistics, a second one writes the output.
/// @param x  [..., n] CPU float32/float64, or CUDA float32/float16/bfloat16 (float32 math).
/// @return   [..., n] same dtype and device; an all -inf row gives zeros, never NaN.
torch::Tensor online_softmax(const torch::Tensor& x);

/// log(sum(exp(x))) over the last dimension, in one pass, with the same (m, l) state.
/// @param x  [..., n] as for online_softmax.
/// @return   [...] float32 on the same device; an all -inf (or empty) row gives -inf, a row with
///           a NaN gives NaN, one with +inf (and no NaN) +inf (README, "NaN and inf are never hidden").
torch::Tensor row_logsumexp(const torch::Tensor& x);

}  // namespace cp
