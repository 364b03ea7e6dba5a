// Lesson 04 — ring attention forward: K/V chunks go around the ring while each rank computes.
#include "ring_attention.h"

#include <chrono>
#include <utility>

#include "common/device.h"
#include "common/error.h"
#include "common/tensor_checks.h"

namespace cp {

AttentionMask plan_mask(const BlockPlan& plan, const torch::Tensor& q_positions, const torch::Tensor& k_positions) {
  AttentionMask mask{plan.causal_mask, q_positions.narrow(0, plan.q_begin, plan.q_len),
                     k_positions.narrow(0, plan.k_begin, plan.k_len)};
  mask.window = plan.window;
  mask.documents = plan.documents;
  return mask;
}

int ring_steps(const RingSchedule& schedule, int world, int64_t chunk, bool causal) {
  if (!schedule.steps) return world;
  const int steps = schedule.steps(world, chunk, causal);
  CP_CHECK(steps >= 1 && steps <= world, "options.schedule.steps: must give 1 … N = ", world, " ring steps, gave ",
           steps);
  return steps;
}

RingSchedule contiguous_schedule() {
  RingSchedule layout;
  layout.positions = [](int rank, int, int64_t chunk, torch::Device device) {
    return torch::arange(rank * chunk, (rank + 1) * chunk, torch::TensorOptions().dtype(torch::kLong).device(device));
  };
  layout.plan = [](int rank, int source, int, int64_t chunk, bool causal) {
    BlockPlan full{true, 0, chunk, 0, chunk, false};
    if (!causal || source < rank) return full;  // an earlier chunk is entirely visible: no mask needed
    if (source > rank) return BlockPlan{};      // a later chunk is entirely masked: skip it
    full.causal_mask = true;                    // the own chunk: causal inside it
    return full;
  };
  return layout;
}

Request batched_ring_exchange(Comm& comm, const std::vector<torch::Tensor>& outgoing,
                              const std::vector<torch::Tensor>& incoming) {
  const int next = (comm.rank() + 1) % comm.size(), prev = (comm.rank() - 1 + comm.size()) % comm.size();
  std::vector<P2POp> ops;
  for (const torch::Tensor& t : outgoing) ops.push_back(P2POp::send(t, next));
  for (const torch::Tensor& t : incoming) ops.push_back(P2POp::recv(t, prev));
  return comm.start(ops);
}

int64_t check_ring_inputs(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const RingOptions& options) {
  check_attention_inputs(q, k, v);
  const std::string hint = detail::concat("Is S divisible by N = ", comm.size(), "?");
  check_same_on_every_rank(comm, q, "q", hint);
  check_same_on_every_rank(comm, k, "k", hint);
  CP_CHECK(k.size(2) == q.size(2), "k: every rank holds S/N tokens of q, k and v; q has ", q.size(2), ", k has ",
           k.size(2));
  const int64_t chunk = q.size(2);
  CP_CHECK(options.exchange, "options.exchange: empty; leave the default (batched_ring_exchange) or set a strategy");
  CP_CHECK(options.schedule.positions && options.schedule.plan,
           "options.schedule: positions and plan must both be set (e.g. contiguous_schedule())");
  // A layout is the caller's code: check that it places exactly S/N tokens on every rank, or
  // the masks below would silently use the wrong tokens' positions.
  for (int r = 0; r < comm.size(); ++r) {
    const torch::Tensor pos = options.schedule.positions(r, comm.size(), chunk, q.device());
    CP_CHECK(pos.defined() && pos.dim() == 1 && pos.size(0) == chunk && pos.scalar_type() == torch::kLong,
             "options.schedule.positions: rank ", r, " of ", comm.size(), " must get int64 [S/N = ", chunk, "], got ",
             pos.defined() ? pos.sizes() : torch::IntArrayRef{}, " ", pos.defined() ? pos.dtype() : caffe2::TypeMeta());
  }
  return chunk;
}

RingResult ring_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const RingOptions& options) {
  const int64_t chunk = check_ring_inputs(comm, q, k, v, options);
  const int rank = comm.rank(), n = comm.size();
  const torch::Tensor q_pos = options.schedule.positions(rank, n, chunk, q.device());
  const int steps = ring_steps(options.schedule, n, chunk, options.causal);  // N unless the schedule stops early

  RingResult result;
  result.stats.steps_not_run = n - steps;
  // BEGIN SOLUTION task 1: the ring loop
  // STUB: // TODO(lesson 04, task 1): the ring loop: `steps` steps (N, unless the schedule stops early) of exchange,
  // STUB: // block and merge, with the stats and trace spans.
  // STUB: // README, "Task 1 — the ring loop (`ring_attention.cpp`)" and "The ring, step by step".
  // STUB: (void)options, (void)q_pos, (void)rank, (void)n, (void)steps;
  // STUB: throw NotImplemented("lesson 04, task 1: the ring loop");
  torch::Tensor out = torch::zeros(q.sizes(), q.options().dtype(torch::kFloat));
  torch::Tensor lse = torch::full({q.size(0), q.size(1), chunk}, -INFINITY, q.options().dtype(torch::kFloat));
  // The chunk in hand is first the caller's own k, v (only read, never overwritten); arriving
  // chunks alternate between two buffers of our own: receive into one while computing on the other.
  torch::Tensor k_cur = k.contiguous(), v_cur = v.contiguous();
  torch::Tensor k_buf[2] = {torch::empty_like(k_cur), torch::empty_like(k_cur)};
  torch::Tensor v_buf[2] = {torch::empty_like(v_cur), torch::empty_like(v_cur)};
  const int64_t chunk_bytes = 2 * k_cur.numel() * k_cur.element_size();
  for (int t = 0; t < steps; ++t) {
    const int source = (rank - t + n) % n;  // whose chunk this rank holds at step t
    const bool exchange = t < steps - 1;    // the last chunk goes nowhere
    auto start_exchange = [&] {
      result.stats.bytes_sent += chunk_bytes;
      return options.exchange(comm, {k_cur, v_cur}, {k_buf[t % 2], v_buf[t % 2]});
    };
    Request pending;
    std::optional<TraceSpan> comm_span;
    if (exchange && options.overlap) {
      comm_span.emplace(options.trace, rank, "comm", "K/V step " + std::to_string(t));
      pending = start_exchange();  // in flight while we compute below
    }
    const BlockPlan plan = options.schedule.plan(rank, source, n, chunk, options.causal);
    if (!plan.compute) {
      ++result.stats.steps_skipped;
    } else {
      wait_for_device_work(q);  // on a GPU, the time and the span below cover this block's kernels only
      TraceSpan compute(options.trace, rank, "compute", "block from rank " + std::to_string(source));
      const auto start = std::chrono::steady_clock::now();
      const AttentionMask mask = plan_mask(plan, q_pos, options.schedule.positions(source, n, chunk, q.device()));
      const AttnResult block = attention_block_forward(q.narrow(2, plan.q_begin, plan.q_len),
                                                       k_cur.narrow(2, plan.k_begin, plan.k_len),
                                                       v_cur.narrow(2, plan.k_begin, plan.k_len), mask, options.scale);
      torch::Tensor out_rows = out.narrow(2, plan.q_begin, plan.q_len);  // views: the merge writes into out
      torch::Tensor lse_rows = lse.narrow(2, plan.q_begin, plan.q_len);
      merge_attention(out_rows, lse_rows, block.out, block.lse);
      wait_for_device_work(out);
      ++result.stats.steps_computed;
      result.stats.steps.push_back({source, plan.q_len * plan.k_len,
                                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count()});
    }
    if (exchange) {
      if (!options.overlap) {
        comm_span.emplace(options.trace, rank, "comm", "K/V step " + std::to_string(t));
        pending = start_exchange();
      }
      pending.wait();
      comm_span.reset();
      k_cur = k_buf[t % 2];
      v_cur = v_buf[t % 2];
    }
  }
  result.out = out.to(q.scalar_type());
  result.lse = lse;
  // END SOLUTION
  return result;
}

}  // namespace cp
