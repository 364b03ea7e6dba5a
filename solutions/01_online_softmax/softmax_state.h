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
    // BEGIN SOLUTION task 1: add one value
    // STUB: // TODO(lesson 01, task 1): add x to the state with one exp (the online update).
    // STUB: // README, "Task 1 — the state: `SoftmaxState::add` and `merge` (`softmax_state.h`)": -inf, NaN and +inf.
    // STUB: CP_NOT_IMPLEMENTED_HD("lesson 01, task 1: SoftmaxState::add");
    if (x == -INFINITY) return;  // exp(-inf) = 0; skipping it also avoids -inf - (-inf)
    if (x > m || x != x) {  // a new maximum; a NaN too, so that it propagates (x > m is false for NaN)
      // l was relative to the old maximum: rescale it. The new term exp(x - x) is 1, but NaN for
      // x = +inf, as every exp(+inf - (+inf)) is: softmax is then undefined (NaN), like torch's.
      l = l * expf(m - x) + (x == INFINITY ? NAN : 1.0f);
      m = x;
    } else {
      l += expf(x - m);
    }
    // END SOLUTION
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
  // BEGIN SOLUTION task 1: merge two states
  // STUB: // TODO(lesson 01, task 1): the state of the union: rescale both sums to the larger maximum, add them.
  // STUB: // README, "Task 1 — the state: `SoftmaxState::add` and `merge` (`softmax_state.h`)": empty states, a NaN maximum.
  // STUB: CP_NOT_IMPLEMENTED_HD("lesson 01, task 1: merge(SoftmaxState, SoftmaxState)");
  // STUB: return SoftmaxState::empty();
  const float m = (b.m > a.m || b.m != b.m) ? b.m : a.m;  // the larger; NaN wins (fmaxf would drop it)
  if (m == -INFINITY) return SoftmaxState::empty();  // both empty
  return {m, a.l * expf(a.m - m) + b.l * expf(b.m - m)};
  // END SOLUTION
}

}  // namespace cp
