// GENERATED from solutions/07_zigzag_balancing/zigzag.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 07 — layouts of a sequence over the ranks, the causal work model, and the balanced
// zig-zag ring schedule.
#include "zigzag.h"

#include "common/error.h"

namespace cp {

std::string to_string(TokenLayout layout) {
  switch (layout) {
    case TokenLayout::Contiguous: return "contiguous";
    case TokenLayout::ZigZag: return "zig-zag";
    case TokenLayout::Stripe: return "stripe";
  }
  return "?";
}

torch::Tensor layout_positions(TokenLayout layout, int64_t seq, int world, int rank) {
  CP_CHECK(world >= 1 && rank >= 0 && rank < world, "layout_positions: rank ", rank, " is not in a world of ", world);
  const int64_t parts = layout == TokenLayout::ZigZag ? 2 * world : world;
  CP_CHECK(seq >= 0 && seq % parts == 0, "layout_positions: S = ", seq, " is not divisible by ",
           layout == TokenLayout::ZigZag ? "2N = " : "N = ", parts, " (the ", to_string(layout), " layout cuts S into ",
           parts, " equal parts)");
  // BEGIN YOUR CODE task 1: the three layouts
  // TODO(lesson 07, task 1): the ascending int64 positions of `rank` in the contiguous, zig-zag or stripe layout.
  // README, "Task 1 — `layout_positions`".
  throw NotImplemented("lesson 07, task 1: layout_positions");
  // END YOUR CODE
}

torch::Tensor shard_sequence(const torch::Tensor& full, TokenLayout layout, int world, int rank, int64_t dim) {
  CP_CHECK(full.defined() && dim >= 0 && dim < full.dim(), "shard_sequence: full must have a dimension ", dim);
  const torch::Tensor positions = layout_positions(layout, full.size(dim), world, rank).to(full.device());
  return full.index_select(dim, positions);
}

torch::Tensor unshard_sequence(const std::vector<torch::Tensor>& shards, TokenLayout layout, int64_t dim) {
  CP_CHECK(!shards.empty(), "unshard_sequence: no shards");
  const int world = static_cast<int>(shards.size());
  std::vector<int64_t> shape = shards[0].sizes().vec();
  CP_CHECK(dim >= 0 && dim < static_cast<int64_t>(shape.size()), "unshard_sequence: shards have no dimension ", dim);
  shape[dim] *= world;
  torch::Tensor full = torch::empty(shape, shards[0].options());
  for (int r = 0; r < world; ++r) {
    CP_CHECK(shards[r].sizes() == shards[0].sizes(), "unshard_sequence: shard ", r, " has shape ", shards[r].sizes(),
             ", shard 0 has ", shards[0].sizes());
    full.index_copy_(dim, layout_positions(layout, shape[dim], world, r).to(full.device()), shards[r]);
  }
  return full;
}

std::vector<int64_t> causal_work(TokenLayout layout, int64_t seq, int world) {
  CP_CHECK(world >= 1, "causal_work: world must be at least 1, got ", world);
  std::vector<int64_t> work(world);
  for (int r = 0; r < world; ++r) {
    const torch::Tensor positions = layout_positions(layout, seq, world, r);
    // BEGIN YOUR CODE task 2: the work model
    // TODO(lesson 07, task 2): the query at position p sees the keys at positions 0 … p.
    (void)positions;
    throw NotImplemented("lesson 07, task 2: causal_work");
    // END YOUR CODE
  }
  return work;
}

namespace {
/// RingSchedule::positions of one of this lesson's layouts (chunk = tokens per rank).
auto ring_positions(TokenLayout which) {
  return [which](int rank, int world, int64_t chunk, torch::Device device) {
    return layout_positions(which, chunk * world, world, rank).to(device);
  };
}
}  // namespace

RingSchedule zigzag_schedule() {
  RingSchedule layout;
  layout.positions = ring_positions(TokenLayout::ZigZag);
  layout.plan = [](int rank, int source, int, int64_t chunk, bool causal) -> BlockPlan {
    const int64_t c = chunk / 2;  // this rank's chunks: rows [0, c) = chunk r, rows [c, 2c) = chunk 2N−1−r
    // BEGIN YOUR CODE task 3: the balanced schedule
    // TODO(lesson 07, task 3): the step's BlockPlan: which query rows meet which K/V rows, with or without the mask.
    // README, "Task 3 — the zig-zag plan in `zigzag_schedule()`".
    (void)rank, (void)source, (void)causal, (void)c;
    throw NotImplemented("lesson 07, task 3: the zig-zag schedule");
    // END YOUR CODE
  };
  return layout;
}

RingSchedule stripe_schedule() {
  RingSchedule layout;
  layout.positions = ring_positions(TokenLayout::Stripe);
  // Interleaved tokens: every visiting chunk is partly visible, so every step computes the whole
  // block with the mask from positions (balanced, but half of each block is masked work).
  layout.plan = [](int, int, int, int64_t chunk, bool causal) { return BlockPlan{true, 0, chunk, 0, chunk, causal}; };
  return layout;
}

namespace {
void check_zigzag_shard(const torch::Tensor& q) {
  CP_CHECK(q.defined() && q.dim() == 4 && q.size(2) % 2 == 0, "q: a zig-zag shard holds two chunks of S/(2N) tokens, "
           "so its length must be even; got ", q.defined() ? q.sizes() : torch::IntArrayRef{}, " (is S divisible by 2N?)");
}
}  // namespace

RingResult zigzag_ring_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, RingOptions options) {
  check_zigzag_shard(q);
  options.schedule = zigzag_schedule();
  return ring_attention_forward(comm, q, k, v, options);
}

RingGrads zigzag_ring_attention_backward(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q,
                                         const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                         const torch::Tensor& lse, RingOptions options) {
  check_zigzag_shard(q);
  options.schedule = zigzag_schedule();
  return ring_attention_backward(comm, dout, q, k, v, out, lse, options);
}

}  // namespace cp
