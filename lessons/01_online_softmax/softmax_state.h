// GENERATED from solutions/01_online_softmax/softmax_state.h by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 01, task 1 — the online softmax state (m, l): adding a value, merging two states.
//
// Compiled by both the C++ compiler and nvcc: everything here is CP_HOST_DEVICE so that the
// CPU loop, the CUDA kernel and later lessons use the very same arithmetic.
#pragma once

#include <cmath>

#include "common/host_device.h"

namespace cp {

/// Summary of a set of values x_i: m = max_i x_i and l = sum_i exp(x_i - m), so that
/// softmax(x)_i = exp(x_i - m) / l and logsumexp(x) = m + log(l).
/// The empty set, and a set of -inf values only, is {m = -inf, l = 0}. NaN and +inf are never
/// dropped (README, "NaN and inf"): a set with a NaN has m = l = NaN, a set with +inf (and no
/// NaN) has m = +inf and l = NaN (its terms exp(+inf − (+inf)) are undefined).
struct SoftmaxState {
  float m;  ///< running maximum
  float l;  ///< running sum of exp(x_i - m)

  /// The state of the empty set: the identity of merge().
  CP_HOST_DEVICE static SoftmaxState empty() { return {-INFINITY, 0.0f}; }

  /// Adds one value: the online update, one exp per value.
  CP_HOST_DEVICE void add(float x) {
    // BEGIN YOUR CODE task 1: add one value
    // TODO(lesson 01, task 1): add x to the state with one exp (the online update).
    // README, "Task 1 — the state: `SoftmaxState::add` and `merge` (`softmax_state.h`)": -inf, NaN and +inf.
    CP_NOT_IMPLEMENTED_HD("lesson 01, task 1: SoftmaxState::add");
    // END YOUR CODE
  }

  /// log(sum exp(x_i)); -inf for the empty state, +inf if some x_i is +inf, NaN if some x_i is NaN.
  CP_HOST_DEVICE float logsumexp() const {
    if (m == INFINITY) return INFINITY;  // the sum is +inf, though l (inf/inf) is NaN
    return l == 0.0f ? -INFINITY : m + logf(l);  // `l > 0` would call a NaN state empty
  }
};

/// The state of the union of two disjoint sets. Associative and commutative, with identity
/// SoftmaxState::empty(): sets can be summarised in any order and combined in any tree (a loop,
/// a warp, a ring of GPUs).
CP_HOST_DEVICE inline SoftmaxState merge(SoftmaxState a, SoftmaxState b) {
  // BEGIN YOUR CODE task 1: merge two states
  // TODO(lesson 01, task 1): the state of the union: rescale both sums to the larger maximum, add them.
  // README, "Task 1 — the state: `SoftmaxState::add` and `merge` (`softmax_state.h`)": empty states, a NaN maximum.
  CP_NOT_IMPLEMENTED_HD("lesson 01, task 1: merge(SoftmaxState, SoftmaxState)");
  return SoftmaxState::empty();
  // END YOUR CODE
}

}  // namespace cp
