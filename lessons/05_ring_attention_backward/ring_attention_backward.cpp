// GENERATED from solutions/05_ring_attention_backward/ring_attention_backward.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 05, task 3 — ring attention backward: K/V rotate as in the forward, dQ stays home, and
// the dK/dV accumulators travel with their K/V chunk, arriving home after N hops.
#include <chrono>
#include <utility>

#include "common/device.h"
#include "common/error.h"
#include "common/tensor_checks.h"
#include "ring_attention_backward.h"

namespace cp {

RingGrads ring_attention_backward(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                  const RingOptions& options) {
  const int64_t chunk = check_ring_inputs(comm, q, k, v, options);
  for (const auto& [t, arg] : {std::pair{&dout, "dout"}, std::pair{&out, "out"}})
    CP_CHECK(t->defined() && t->sizes() == q.sizes(), arg, ": expected q's shape ", q.sizes(), ", got ",
             t->defined() ? t->sizes() : torch::IntArrayRef{});
  CP_CHECK(lse.defined() && lse.sizes() == q.sizes().slice(0, 3), "lse: expected shape ", q.sizes().slice(0, 3),
           " ([B, Hq, S/N] of q), got ", lse.defined() ? lse.sizes() : torch::IntArrayRef{});
  const int rank = comm.rank(), n = comm.size();
  const torch::Tensor q_pos = options.schedule.positions(rank, n, chunk, q.device());
  const int steps = ring_steps(options.schedule, n, chunk, options.causal);  // N unless the schedule stops early

  RingGrads result;
  result.stats.steps_not_run = n - steps;
  // BEGIN YOUR CODE task 3: the backward ring
  // TODO(lesson 05, task 3): the backward ring: K/V rotate, dq stays, dk and dv travel with their chunk (N hops;
  // with fewer `steps`, the last hop goes straight to the chunk's owner).
  // README, "Task 3 — the ring backward (`ring_attention_backward.cpp`)" and "The ring backward".
  (void)dout, (void)out, (void)options, (void)q_pos, (void)n, (void)steps;
  throw NotImplemented("lesson 05, task 3: ring_attention_backward");
  // END YOUR CODE
  return result;
}

}  // namespace cp
