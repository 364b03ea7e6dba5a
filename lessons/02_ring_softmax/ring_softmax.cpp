// GENERATED from solutions/02_ring_softmax/ring_softmax.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 02 — distributed ring softmax: three ways for the ranks to agree on each row's state.
//
// Only the per-row states (two float32 numbers per row) travel; the shards never move. States
// are computed and merged with tensor operations, so the same code serves CPU and CUDA tensors.
//
// Why (m, l) and not just lse = m + log l: lse would be rounded at the magnitude of m. With
// values around 1e4 a float32 lse is off by ~5e-4, and so would be every exp(x − lse); the max m
// is one of the inputs, exact, and l carries the rest.
#include "ring_softmax.h"

#include "common/error.h"
#include "common/tensor_checks.h"

namespace cp {
namespace {

/// One tensor [2, rows...] holding m and l, so that a state travels in one message.
torch::Tensor pack(const RowStates& s) { return torch::stack({s.m, s.l}); }
RowStates unpack(const torch::Tensor& packed) { return {packed[0], packed[1]}; }

/// Task 1: softmax of the local shard under the global state: exp(x − m) / l, 0 where l = 0.
torch::Tensor normalise_with(const torch::Tensor& x, const RowStates& global) {
  // BEGIN YOUR CODE task 1: normalise the shard with the global state
  // TODO(lesson 02, task 1): exp(x − m) / l under the global state, zeros where l = 0, in x's dtype.
  // README, "Task 1 — states on tensors: `local_row_states`, `merge_row_states`, `normalise_with`".
  (void)x, (void)global;
  throw NotImplemented("lesson 02, task 1: normalise_with");
  // END YOUR CODE
}

}  // namespace

RowStates local_row_states(const torch::Tensor& x) {
  // BEGIN YOUR CODE task 1: the local states
  // TODO(lesson 02, task 1): the float32 state (m, l) of every row of x, also for a shard of zero columns.
  // README, "Task 1 — states on tensors: `local_row_states`, `merge_row_states`, `normalise_with`".
  (void)x;
  throw NotImplemented("lesson 02, task 1: local_row_states");
  // END YOUR CODE
}

RowStates merge_row_states(const RowStates& a, const RowStates& b) {
  // BEGIN YOUR CODE task 1: merge states row by row
  // TODO(lesson 02, task 1): lesson 01's merge, row-wise on whole tensors, safe where both states are empty.
  // README, "Task 1 — states on tensors: `local_row_states`, `merge_row_states`, `normalise_with`".
  (void)a, (void)b;
  throw NotImplemented("lesson 02, task 1: merge_row_states");
  // END YOUR CODE
}

namespace {

/// Task 2: 0 → 1 → … → N−1, then N−1 broadcasts.
RowStates chain(Comm& comm, const RowStates& mine) {
  // BEGIN YOUR CODE task 2: the chain
  // TODO(lesson 02, task 2): receive from r−1, merge yours, send to r+1; then rank N−1 broadcasts the result.
  // README, "Task 2 — `Chain`".
  (void)comm, (void)mine;
  throw NotImplemented("lesson 02, task 2: chain");
  // END YOUR CODE
}

/// Task 3: every state travels N−1 hops around the ring.
RowStates ring(Comm& comm, const RowStates& mine) {
  // BEGIN YOUR CODE task 3: the ring
  // TODO(lesson 02, task 3): N−1 sendrecv steps: forward what you received last, merge it into your accumulator.
  // README, "Task 3 — `Ring`".
  (void)comm, (void)mine;
  throw NotImplemented("lesson 02, task 3: ring");
  // END YOUR CODE
}

/// Task 4: all_reduce(max), then all_reduce(sum of exp(x − m)).
RowStates two_all_reduce(Comm& comm, const torch::Tensor& x) {
  // BEGIN YOUR CODE task 4: two all-reduces
  // TODO(lesson 02, task 4): all_reduce(Max) of the row maxima, then all_reduce(Sum) of Σ exp(x − M).
  // README, "Task 4 — `TwoAllReduce`".
  (void)comm, (void)x;
  throw NotImplemented("lesson 02, task 4: two_all_reduce");
  // END YOUR CODE
}

}  // namespace

torch::Tensor ring_softmax(Comm& comm, const torch::Tensor& x_local, RingSoftmaxAlgo algo) {
  check_defined(x_local, "x_local", 1);
  check_float_dtype(x_local, "x_local");
  const torch::Tensor x = x_local.contiguous();
  RowStates global;
  switch (algo) {
    case RingSoftmaxAlgo::Chain: global = chain(comm, local_row_states(x)); break;
    case RingSoftmaxAlgo::Ring: global = ring(comm, local_row_states(x)); break;
    case RingSoftmaxAlgo::TwoAllReduce: global = two_all_reduce(comm, x); break;
  }
  return normalise_with(x, global);
}

}  // namespace cp
