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
  // BEGIN SOLUTION task 3: the backward ring
  // STUB: // TODO(lesson 05, task 3): the backward ring: K/V rotate, dq stays, dk and dv travel with their chunk (N hops;
  // STUB: // with fewer `steps`, the last hop goes straight to the chunk's owner).
  // STUB: // README, "Task 3 — the ring backward (`ring_attention_backward.cpp`)" and "The ring backward".
  // STUB: (void)dout, (void)out, (void)options, (void)q_pos, (void)n, (void)steps;
  // STUB: throw NotImplemented("lesson 05, task 3: ring_attention_backward");
  const auto f32 = q.options().dtype(torch::kFloat);
  torch::Tensor dq = torch::zeros(q.sizes(), f32);
  // As in the forward: the caller's k, v are only read; arriving chunks alternate between two
  // buffers of our own. The accumulators are ours from the start, so they simply swap.
  torch::Tensor k_cur = k.contiguous(), v_cur = v.contiguous();
  torch::Tensor k_buf[2] = {torch::empty_like(k_cur), torch::empty_like(k_cur)};
  torch::Tensor v_buf[2] = {torch::empty_like(v_cur), torch::empty_like(v_cur)};
  torch::Tensor dk_cur = torch::zeros(k.sizes(), f32), dv_cur = torch::zeros(k.sizes(), f32);
  torch::Tensor dk_next = torch::empty_like(dk_cur), dv_next = torch::empty_like(dv_cur);
  auto start_kv_exchange = [&](int t) {
    result.stats.bytes_sent += 2 * k_cur.numel() * k_cur.element_size();
    TraceSpan span(options.trace, rank, "comm", "start K/V step " + std::to_string(t));
    return options.exchange(comm, {k_cur, v_cur}, {k_buf[t % 2], v_buf[t % 2]});
  };
  for (int t = 0; t < steps; ++t) {
    const int source = (rank - t + n) % n;
    const bool more_kv = t < steps - 1;
    Request kv;
    if (more_kv && options.overlap) kv = start_kv_exchange(t);
    const BlockPlan plan = options.schedule.plan(rank, source, n, chunk, options.causal);
    if (!plan.compute) {
      ++result.stats.steps_skipped;  // nothing visible; the chunk and its accumulators still move on
    } else {
      wait_for_device_work(q);  // on a GPU, the time and the span below cover this block's kernels only
      TraceSpan compute(options.trace, rank, "compute", "backward block of rank " + std::to_string(source));
      const auto start = std::chrono::steady_clock::now();
      const AttentionMask mask = plan_mask(plan, q_pos, options.schedule.positions(source, n, chunk, q.device()));
      auto q_rows = [&](const torch::Tensor& t) { return t.narrow(2, plan.q_begin, plan.q_len); };
      auto k_rows = [&](const torch::Tensor& t) { return t.narrow(2, plan.k_begin, plan.k_len); };
      const AttnGrads g = attention_block_backward(q_rows(dout), q_rows(q), k_rows(k_cur), k_rows(v_cur), q_rows(out),
                                                   lse.narrow(2, plan.q_begin, plan.q_len), mask, options.scale);
      q_rows(dq).add_(g.dq);  // views: the adds land in dq, dk_cur, dv_cur
      k_rows(dk_cur).add_(g.dk);
      k_rows(dv_cur).add_(g.dv);
      wait_for_device_work(dq);
      ++result.stats.steps_computed;
      result.stats.steps.push_back({source, plan.q_len * plan.k_len,
                                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count()});
    }
    if (more_kv && !options.overlap) kv = start_kv_exchange(t);
    // The accumulators can only leave once this step has added to them. On one rank they are
    // home already: no hop, nothing sent. After the last step they go straight home: to the
    // source's rank, while ours come from rank + steps − 1 (with steps = N: the ring's next hop).
    Request grads;
    if (n > 1) {
      result.stats.bytes_sent += 2 * dk_cur.numel() * dk_cur.element_size();
      if (more_kv || steps == n) {
        grads = options.exchange(comm, {dk_cur, dv_cur}, {dk_next, dv_next});
      } else {
        const int holder = (rank + steps - 1) % n;  // holds our accumulators after the last step
        grads = comm.start({P2POp::send(dk_cur, source), P2POp::send(dv_cur, source), P2POp::recv(dk_next, holder),
                            P2POp::recv(dv_next, holder)});
      }
    }
    {
      TraceSpan wait(options.trace, rank, "comm", "wait step " + std::to_string(t));
      kv.wait();
      grads.wait();
    }
    k_cur = k_buf[t % 2];  // after the last step unused: no K/V arrived
    v_cur = v_buf[t % 2];
    if (n > 1) {
      std::swap(dk_cur, dk_next);
      std::swap(dv_cur, dv_next);
    }
  }
  // After the last hop the accumulators in hand are those of this rank's own chunk.
  result.dq = dq.to(q.scalar_type());
  result.dk = dk_cur.to(k.scalar_type());
  result.dv = dv_cur.to(v.scalar_type());
  // END SOLUTION
  return result;
}

}  // namespace cp
