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
  // BEGIN SOLUTION task 1: normalise the shard with the global state
  // STUB: // TODO(lesson 02, task 1): exp(x − m) / l under the global state, zeros where l = 0, in x's dtype.
  // STUB: // README, "Task 1 — states on tensors: `local_row_states`, `merge_row_states`, `normalise_with`".
  // STUB: (void)x, (void)global;
  // STUB: throw NotImplemented("lesson 02, task 1: normalise_with");
  const torch::Tensor empty = (global.l == 0).unsqueeze(-1);
  const torch::Tensor m = torch::where(empty, torch::zeros_like(global.m.unsqueeze(-1)), global.m.unsqueeze(-1));
  const torch::Tensor y = torch::exp(x.to(torch::kFloat) - m) / global.l.unsqueeze(-1);
  return torch::where(empty, torch::zeros_like(y), y).to(x.scalar_type());
  // END SOLUTION
}

}  // namespace

RowStates local_row_states(const torch::Tensor& x) {
  // BEGIN SOLUTION task 1: the local states
  // STUB: // TODO(lesson 02, task 1): the float32 state (m, l) of every row of x, also for a shard of zero columns.
  // STUB: // README, "Task 1 — states on tensors: `local_row_states`, `merge_row_states`, `normalise_with`".
  // STUB: (void)x;
  // STUB: throw NotImplemented("lesson 02, task 1: local_row_states");
  const torch::Tensor xf = x.to(torch::kFloat);
  if (x.size(-1) == 0) {
    const torch::Tensor m = torch::full(x.sizes().slice(0, x.dim() - 1), -INFINITY, xf.options());
    return {m, torch::zeros_like(m)};
  }
  const torch::Tensor m = std::get<0>(xf.max(-1));
  const torch::Tensor m_safe = torch::where(m == -INFINITY, torch::zeros_like(m), m);
  return {m, torch::exp(xf - m_safe.unsqueeze(-1)).sum(-1)};
  // END SOLUTION
}

RowStates merge_row_states(const RowStates& a, const RowStates& b) {
  // BEGIN SOLUTION task 1: merge states row by row
  // STUB: // TODO(lesson 02, task 1): lesson 01's merge, row-wise on whole tensors, safe where both states are empty.
  // STUB: // README, "Task 1 — states on tensors: `local_row_states`, `merge_row_states`, `normalise_with`".
  // STUB: (void)a, (void)b;
  // STUB: throw NotImplemented("lesson 02, task 1: merge_row_states");
  const torch::Tensor m = torch::maximum(a.m, b.m);
  const torch::Tensor m_safe = torch::where(m == -INFINITY, torch::zeros_like(m), m);
  return {m, a.l * torch::exp(a.m - m_safe) + b.l * torch::exp(b.m - m_safe)};
  // END SOLUTION
}

namespace {

/// Task 2: 0 → 1 → … → N−1, then N−1 broadcasts.
RowStates chain(Comm& comm, const RowStates& mine) {
  // BEGIN SOLUTION task 2: the chain
  // STUB: // TODO(lesson 02, task 2): receive from r−1, merge yours, send to r+1; then rank N−1 broadcasts the result.
  // STUB: // README, "Task 2 — `Chain`".
  // STUB: (void)comm, (void)mine;
  // STUB: throw NotImplemented("lesson 02, task 2: chain");
  const int r = comm.rank(), n = comm.size();
  RowStates running = mine;
  if (r > 0) {
    torch::Tensor incoming = torch::empty_like(pack(mine));
    comm.recv(incoming, r - 1);
    running = merge_row_states(unpack(incoming), mine);
  }
  torch::Tensor global = pack(running);
  if (r < n - 1) comm.send(global, r + 1);
  comm.broadcast(global, n - 1);
  return unpack(global);
  // END SOLUTION
}

/// Task 3: every state travels N−1 hops around the ring.
RowStates ring(Comm& comm, const RowStates& mine) {
  // BEGIN SOLUTION task 3: the ring
  // STUB: // TODO(lesson 02, task 3): N−1 sendrecv steps: forward what you received last, merge it into your accumulator.
  // STUB: // README, "Task 3 — `Ring`".
  // STUB: (void)comm, (void)mine;
  // STUB: throw NotImplemented("lesson 02, task 3: ring");
  const int r = comm.rank(), n = comm.size();
  RowStates total = mine;
  torch::Tensor travelling = pack(mine);
  torch::Tensor arriving = torch::empty_like(travelling);
  for (int step = 0; step < n - 1; ++step) {
    comm.sendrecv(travelling, (r + 1) % n, arriving, (r - 1 + n) % n);
    total = merge_row_states(total, unpack(arriving));
    std::swap(travelling, arriving);  // forward what arrived; its buffer is free again
  }
  return total;
  // END SOLUTION
}

/// Task 4: all_reduce(max), then all_reduce(sum of exp(x − m)).
RowStates two_all_reduce(Comm& comm, const torch::Tensor& x) {
  // BEGIN SOLUTION task 4: two all-reduces
  // STUB: // TODO(lesson 02, task 4): all_reduce(Max) of the row maxima, then all_reduce(Sum) of Σ exp(x − M).
  // STUB: // README, "Task 4 — `TwoAllReduce`".
  // STUB: (void)comm, (void)x;
  // STUB: throw NotImplemented("lesson 02, task 4: two_all_reduce");
  torch::Tensor m = local_row_states(x).m.contiguous();
  comm.all_reduce(m, ReduceOp::Max);
  const torch::Tensor m_safe = torch::where(m == -INFINITY, torch::zeros_like(m), m);
  torch::Tensor l = torch::exp(x.to(torch::kFloat) - m_safe.unsqueeze(-1)).sum(-1).contiguous();
  comm.all_reduce(l, ReduceOp::Sum);
  return {m, l};
  // END SOLUTION
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
