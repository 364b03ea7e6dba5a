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
  // TODO(lesson 02, task 1): broadcast m and l over the last dim (unsqueeze(-1)); rows
  // with l = 0 (−inf everywhere) give zeros, and must not compute −inf − (−inf).
  (void)x, (void)global;
  throw NotImplemented("lesson 02, task 1: normalise_with");
  // END YOUR CODE
}

}  // namespace

RowStates local_row_states(const torch::Tensor& x) {
  // BEGIN YOUR CODE task 1: the local states
  // TODO(lesson 02, task 1): m = the row max (−inf for an empty shard: max over zero
  // columns is an error, so handle it), l = Σ exp(x − m) with a finite stand-in for m where
  // m = −inf. Compute in float32 whatever x's dtype.
  (void)x;
  throw NotImplemented("lesson 02, task 1: local_row_states");
  // END YOUR CODE
}

RowStates merge_row_states(const RowStates& a, const RowStates& b) {
  // BEGIN YOUR CODE task 1: merge states row by row
  // TODO(lesson 02, task 1): lesson 01's merge on whole tensors: m = max(m_a, m_b),
  // l = l_a·exp(m_a − m) + l_b·exp(m_b − m). Where both are empty, m = −inf: use a finite
  // stand-in for m there so that exp(−inf − m) = 0 instead of NaN.
  (void)a, (void)b;
  throw NotImplemented("lesson 02, task 1: merge_row_states");
  // END YOUR CODE
}

namespace {

/// Task 2: 0 → 1 → … → N−1, then N−1 broadcasts.
RowStates chain(Comm& comm, const RowStates& mine) {
  // BEGIN YOUR CODE task 2: the chain
  // TODO(lesson 02, task 2): receive the running state from rank r−1 (rank 0 starts
  // with its own), merge yours, send it to r+1; rank N−1 then broadcasts the result.
  // Hint: pack() the two tensors into one message; blocking send/recv are fine here.
  (void)comm, (void)mine;
  throw NotImplemented("lesson 02, task 2: chain");
  // END YOUR CODE
}

/// Task 3: every state travels N−1 hops around the ring.
RowStates ring(Comm& comm, const RowStates& mine) {
  // BEGIN YOUR CODE task 3: the ring
  // TODO(lesson 02, task 3): N−1 steps; at each, sendrecv the state you received last
  // (your own at step 0) to r+1 while receiving from r−1, and merge what arrives into
  // your accumulator. Forward what you received, not your accumulator.
  (void)comm, (void)mine;
  throw NotImplemented("lesson 02, task 3: ring");
  // END YOUR CODE
}

/// Task 4: all_reduce(max), then all_reduce(sum of exp(x − m)).
RowStates two_all_reduce(Comm& comm, const torch::Tensor& x) {
  // BEGIN YOUR CODE task 4: two all-reduces
  // TODO(lesson 02, task 4): start from the local states; all_reduce(Max) their m; then
  // l = Σ exp(x − m_global) over the shard (0 for rows that are −inf everywhere), and
  // all_reduce(Sum) of it.
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
