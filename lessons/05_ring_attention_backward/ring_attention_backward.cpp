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
  const torch::Tensor q_pos = options.layout.positions(rank, n, chunk, q.device());

  RingGrads result;
  // BEGIN YOUR CODE task 3: the backward ring
  // TODO(lesson 05, task 3): dq (float32 zeros) stays here. The current K/V chunk comes with
  // float32 accumulators dk, dv (zeros at first). At step t = 0 … N−1 (chunk of rank (r − t) mod N):
  // start the K/V exchange for the next step (t < N−1; before computing if options.overlap),
  // then, as the forward does with options.layout.plan, add attention_block_backward's grads of the
  // planned rows into the planned rows of dq, dk, dv (narrow views); then send dk, dv
  // to r+1 with their chunk and receive the accumulators of the arriving chunk from r−1 — also
  // after the last step: that hop brings your own chunk's gradients home. Fill result.stats.
  // Move chunks and accumulators with options.exchange (it sends to r+1, receives from r−1).
  (void)dout, (void)out, (void)options, (void)q_pos, (void)n;
  throw NotImplemented("lesson 05, task 3: ring_attention_backward");
  // END YOUR CODE
  return result;
}

}  // namespace cp
