// GENERATED from solutions/14_choosing_a_strategy/planner.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 14 — the planner: the work of every ring step (task 1), time with overlap (task 2),
// memory (task 3), the prediction of a candidate (given) and the choice (task 4).
#include <algorithm>
#include <cstdio>
#include <numeric>

#include "common/error.h"
#include "planner.h"
#include "ulysses.h"

namespace cp {

std::string to_string(PlanStrategy strategy) {
  switch (strategy) {
    case PlanStrategy::Ring: return "ring";
    case PlanStrategy::ZigZagRing: return "zig-zag ring";
    case PlanStrategy::StripeRing: return "stripe ring";
    case PlanStrategy::Llama3: return "llama3 all-gather";
    case PlanStrategy::Ulysses: return "ulysses";
    case PlanStrategy::Hybrid: return "hybrid";
  }
  return "unknown";
}

std::string to_string(const Candidate& candidate) {
  const std::string name = to_string(candidate.strategy);
  if (candidate.strategy != PlanStrategy::Hybrid) return name;
  return name + " " + std::to_string(candidate.mesh.ulysses) + "x" + std::to_string(candidate.mesh.ring);
}

std::vector<Candidate> candidates(int gpus) {
  std::vector<Candidate> all;
  if (gpus < 1) return all;
  for (PlanStrategy s : {PlanStrategy::Ring, PlanStrategy::ZigZagRing, PlanStrategy::StripeRing, PlanStrategy::Llama3})
    all.push_back({s, {1, gpus}});
  all.push_back({PlanStrategy::Ulysses, {gpus, 1}});
  for (int pu = 2; pu < gpus; ++pu)
    if (gpus % pu == 0) all.push_back({PlanStrategy::Hybrid, {pu, gpus / pu}});
  return all;
}

namespace {

/// The token layout a candidate's shards follow (the hybrid's groups hold zig-zag shards).
TokenLayout layout_of(PlanStrategy strategy) {
  switch (strategy) {
    case PlanStrategy::Ring: return TokenLayout::Contiguous;
    case PlanStrategy::StripeRing: return TokenLayout::Stripe;
    case PlanStrategy::Ulysses: return TokenLayout::Contiguous;
    default: return TokenLayout::ZigZag;
  }
}

/// The ring schedule of a layout (lessons 04 and 07).
RingSchedule schedule_of(TokenLayout layout) {
  switch (layout) {
    case TokenLayout::Contiguous: return contiguous_schedule();
    case TokenLayout::ZigZag: return zigzag_schedule();
    case TokenLayout::Stripe: return stripe_schedule();
  }
  CP_FAIL("layout: unknown");
}

/// The K/V heads one GPU of a Ulysses group of `pu` holds (lesson 10's rule), or −1 with `why`.
int64_t kv_heads_per_gpu(const AttentionShape& shape, int pu, std::string& why) {
  try {
    return ulysses_kv_heads(shape.heads_q, shape.heads_kv, pu) / pu;
  } catch (const Error& e) {
    why = e.message();
    return -1;
  }
}

}  // namespace

std::string constraint(const Candidate& candidate, const AttentionShape& shape) {
  const int p = candidate.mesh.ulysses * candidate.mesh.ring;
  if (p < 1 || candidate.mesh.ulysses < 1 || candidate.mesh.ring < 1)
    return detail::concat("the mesh ", candidate.mesh.ulysses, " x ", candidate.mesh.ring, " has no GPUs");
  // The rings split the sequence into P chunks (2P for zig-zag shards); Ulysses into P; the hybrid
  // into 2P (its groups hold zig-zag shards of S/P_r tokens, split over P_u GPUs).
  const int64_t parts = layout_of(candidate.strategy) == TokenLayout::ZigZag ? 2 * int64_t{p} : p;
  if (shape.seq % parts != 0)
    return detail::concat("S = ", shape.seq, " is not divisible by ", parts, " (", to_string(candidate.strategy),
                          " cuts it into ", parts, " chunks)");
  if (candidate.mesh.ulysses > 1) {
    std::string why;
    if (kv_heads_per_gpu(shape, candidate.mesh.ulysses, why) < 0) {
      const std::string prefix = "ulysses: ";  // lesson 10's message names its function: here, the group
      if (why.rfind(prefix, 0) == 0) why = why.substr(prefix.size());
      return detail::concat("Ulysses over ", candidate.mesh.ulysses, " GPUs: ", why);
    }
  }
  return "";
}

// ── Task 1 ───────────────────────────────────────────────────────────────────────────────────

std::vector<std::vector<RingBlock>> ring_blocks(TokenLayout layout, int64_t seq, int world) {
  CP_CHECK(world >= 1, "world: a ring needs at least 1 rank, got ", world);
  const RingSchedule schedule = schedule_of(layout);
  std::vector<torch::Tensor> positions;  // of every rank's tokens, ascending (checks S)
  for (int r = 0; r < world; ++r) positions.push_back(layout_positions(layout, seq, world, r));
  const int64_t chunk = seq / world;
  const int steps = ring_steps(schedule, world, chunk, /*causal=*/true);
  std::vector<std::vector<RingBlock>> blocks(steps, std::vector<RingBlock>(world));
  // BEGIN YOUR CODE task 1: the blocks of every step
  // TODO(lesson 14, task 1): for each step and rank: the source whose chunk it holds, the schedule's
  // plan for that block, its pairs and the pairs the causal mask keeps. README, "Task 1 — `ring_blocks`".
  (void)schedule, (void)positions, (void)chunk;
  throw NotImplemented("lesson 14, task 1: ring_blocks");
  // END YOUR CODE
  return blocks;
}

// ── Task 2 ───────────────────────────────────────────────────────────────────────────────────

double transfer_ms(int64_t bytes, int messages, const Link& link) {
  if (bytes <= 0 && messages <= 0) return 0;
  CP_CHECK(link.gbytes_per_s > 0, "link: its bandwidth must be > 0 GB/s to move ", bytes, " bytes");
  return bytes / (link.gbytes_per_s * 1e6) + messages * link.latency_us / 1e3;
}

double ring_pass_ms(const std::vector<StepCost>& steps, bool overlap) {
  // BEGIN YOUR CODE task 2: the ring's time with and without overlap
  // TODO(lesson 14, task 2): sum over the steps of the larger of compute and transfer (overlap), or of
  // both (no overlap). README, "Task 2 — `ring_pass_ms`".
  (void)steps, (void)overlap;
  throw NotImplemented("lesson 14, task 2: ring_pass_ms");
  // END YOUR CODE
}

// ── Task 3 ───────────────────────────────────────────────────────────────────────────────────

MemoryEstimate attention_memory(const Candidate& candidate, const AttentionShape& shape) {
  const int p = candidate.mesh.ulysses * candidate.mesh.ring;
  CP_CHECK(p >= 1 && shape.seq % p == 0, "shape: S = ", shape.seq, " does not split over ", p, " GPUs");
  const int64_t e = shape.element_size, f32 = sizeof(float);
  const int64_t chunk = shape.seq / p;                                    // tokens per GPU
  const int64_t q = shape.batch * chunk * shape.heads_q * shape.head_dim;  // elements of q, out, dq
  const int64_t kv = shape.batch * chunk * shape.heads_kv * shape.head_dim;  // of k, of v
  const int64_t lse = shape.batch * chunk * shape.heads_q;
  MemoryEstimate m;
  m.saved_bytes = (2 * q + 2 * kv) * e + lse * f32;
  // BEGIN YOUR CODE task 3: the memory model
  // TODO(lesson 14, task 3): the buffers each strategy holds at its peak, forward and backward.
  // README, "Task 3 — `attention_memory`".
  (void)e, (void)f32, (void)q, (void)kv, (void)lse, (void)p;
  throw NotImplemented("lesson 14, task 3: attention_memory");
  // END YOUR CODE
  return m;
}

// ── The prediction ──────────────────────────────────────────────────────────────────────────

namespace {

/// FLOPs of one visible (query, key) pair of one head: QKᵀ and PV, 2·D multiply-adds each in the
/// forward; the backward recomputes QKᵀ and adds dV, dP, dQ, dK: 2.5 times the forward.
double forward_flops(const AttentionShape& s) { return 4.0 * s.head_dim; }
double backward_flops(const AttentionShape& s) { return 10.0 * s.head_dim; }

double compute_ms(double pairs, double flops_per_pair, double tflops) { return pairs * flops_per_pair / (tflops * 1e9); }

/// The throughput of a causal call whose diagonal spans `tokens` query rows (Cluster's rule): the
/// same rule for the ideal's call over S and for a ring's masked blocks, so that no strategy can
/// look faster than one GPU only because its blocks are shorter or longer than the figure's.
double causal_tflops_at(double tflops, double causal_tflops, double tokens, const Cluster& c) {
  return tflops / (1 + (tflops / causal_tflops - 1) * c.causal_tokens / tokens);
}
double forward_causal(double tokens, const Cluster& c) {
  return causal_tflops_at(c.forward_tflops, c.forward_causal_tflops, tokens, c);
}
double backward_causal(double tokens, const Cluster& c) {
  return causal_tflops_at(c.backward_tflops, c.backward_causal_tflops, tokens, c);
}
double memory_ms(double bytes, const Cluster& c) { return bytes / (c.memory_gbytes_per_s * 1e6); }

/// The GPUs first, first + stride, … (`size` of them): do they share one node?
bool one_node(const Cluster& c, int first, int stride, int size) {
  return first / c.gpus_per_node == (first + stride * (size - 1)) / c.gpus_per_node;
}

/// A ring collective (all-gather, reduce-scatter) among a group of `size` consecutive GPUs, in
/// which each GPU sends `bytes` in `size` − 1 messages to its neighbour: bound by the slowest hop,
/// the NIC when the group spans nodes.
double ring_collective_ms(int64_t bytes, int size, const Cluster& c) {
  if (size <= 1) return 0;
  return transfer_ms(bytes, size - 1, one_node(c, 0, 1, size) ? c.intra : c.inter);
}

/// All-to-alls of `tensors` tensors among a group of `size` consecutive GPUs, in which each GPU
/// sends `bytes` in all, evenly over the others: the part for GPUs of other nodes goes over the
/// NIC while the rest goes over NVLink, at the same time.
double all_to_all_ms(int64_t bytes, int tensors, int size, const Cluster& c) {
  if (size <= 1) return 0;
  const int near_peers = std::min(size, c.gpus_per_node) - 1, far_peers = size - 1 - near_peers;
  const double per_peer = static_cast<double>(bytes) / (size - 1);
  return std::max(transfer_ms(static_cast<int64_t>(per_peer * near_peers), tensors * near_peers, c.intra),
                  transfer_ms(static_cast<int64_t>(per_peer * far_peers), tensors * far_peers, c.inter));
}

/// A causal ring over `ring` GPUs (the hybrid's: over its groups) in which each GPU computes
/// `heads` query heads of the batch with `kv_heads` K/V heads: its passes, step by step.
struct RingPasses {
  std::vector<StepCost> forward, backward;
  double final_hop_ms = 0;  ///< the backward's last dK/dV hop home, after the last step
  int64_t busiest_pairs = 0, busiest_visible = 0, total_visible = 0;  ///< per head and sequence
};

RingPasses ring_passes(TokenLayout layout, const AttentionShape& s, int ring, int64_t heads, int64_t kv_heads,
                       const Link& link, const Cluster& c) {
  const std::vector<std::vector<RingBlock>> blocks = ring_blocks(layout, s.seq, ring);
  const int64_t e = s.element_size, f32 = sizeof(float);
  const int64_t kv_chunk = s.batch * (s.seq / ring) * kv_heads * s.head_dim;  // elements of K (or V) on one GPU
  RingPasses passes;
  std::vector<int64_t> pairs(ring, 0), visible(ring, 0);
  for (size_t step = 0; step < blocks.size(); ++step) {
    StepCost fwd, bwd;
    for (int r = 0; r < ring; ++r) {
      const RingBlock& b = blocks[step][r];
      pairs[r] += b.pairs;
      visible[r] += b.visible;
      if (b.pairs == 0) continue;
      const double work = static_cast<double>(b.visible) * s.batch * heads;
      // The merges: forward, the block's rows of out (float32 accumulator read and written, the
      // block's out read) after the first step; backward, dq of its rows and the travelling dK, dV
      // of its keys, each read, added to and written in float32.
      const double q_elems = static_cast<double>(s.batch) * b.q_rows * heads * s.head_dim;
      const double k_elems = static_cast<double>(s.batch) * b.k_rows * kv_heads * s.head_dim;
      const double merge_fwd = step == 0 ? 0 : memory_ms(q_elems * (2 * f32 + e), c);
      const double merge_bwd = memory_ms((q_elems + 2 * k_elems) * 3 * f32, c);
      // The block's kernel (the causal one, over its rows, when it has the mask), its call, its merge.
      auto block_ms = [&](double flops, double tflops, double causal_tflops, double merge) {
        return compute_ms(work, flops, b.masked ? causal_tflops : tflops) + c.launch_us / 1e3 + merge;
      };
      fwd.compute_ms = std::max(fwd.compute_ms, block_ms(forward_flops(s), c.forward_tflops,
                                                         forward_causal(b.q_rows, c), merge_fwd));
      bwd.compute_ms = std::max(bwd.compute_ms, block_ms(backward_flops(s), c.backward_tflops,
                                                         backward_causal(b.q_rows, c), merge_bwd));
    }
    if (step + 1 < blocks.size()) {  // the next step's K and V (backward: and the dK, dV behind them)
      fwd.transfer_ms = transfer_ms(2 * kv_chunk * e, 2, link);
      bwd.transfer_ms = transfer_ms(2 * kv_chunk * (e + f32), 4, link);
    }
    passes.forward.push_back(fwd);
    passes.backward.push_back(bwd);
  }
  if (ring > 1) passes.final_hop_ms = transfer_ms(2 * kv_chunk * f32, 2, link);
  const size_t busiest = std::max_element(visible.begin(), visible.end()) - visible.begin();
  passes.busiest_pairs = *std::max_element(pairs.begin(), pairs.end());
  passes.busiest_visible = visible[busiest];
  passes.total_visible = std::accumulate(visible.begin(), visible.end(), int64_t{0});
  return passes;
}

/// The time of a ring's passes into `pred`, with what the transfers left exposed.
void add_ring_time(const RingPasses& r, Prediction& pred) {
  const double fwd = ring_pass_ms(r.forward), bwd = ring_pass_ms(r.backward) + r.final_hop_ms;
  double compute = 0;
  for (const std::vector<StepCost>* pass : {&r.forward, &r.backward})
    for (const StepCost& step : *pass) compute += step.compute_ms;
  pred.forward_ms += fwd;
  pred.backward_ms += bwd;
  pred.exposed_ms += fwd + bwd - compute;
}

/// Pairs of lesson 08's two-kernel plan on each GPU, for one sequence of S tokens (what
/// Llama3Stats::pairs counts).
std::vector<int64_t> llama3_pairs(int64_t seq, int world) {
  std::vector<int64_t> pairs(world, 0);
  for (int rank = 0; rank < world; ++rank)
    for (const Llama3Call& call : llama3_plan({0, seq}, world, rank, Llama3Mode::TwoKernels))
      pairs[rank] += call_pairs(call);
  return pairs;
}

}  // namespace

double forward_causal_tflops(const Cluster& cluster, double tokens) { return forward_causal(tokens, cluster); }

Prediction predict(const Candidate& candidate, const AttentionShape& s, const Cluster& c) {
  const int pu = candidate.mesh.ulysses, pr = candidate.mesh.ring, p = pu * pr;
  CP_CHECK(p == c.gpus(), "candidate: the mesh ", pu, " x ", pr, " has ", p, " GPUs, the cluster '", c.name,
           "' has ", c.gpus());
  Prediction pred;
  pred.candidate = candidate;
  pred.constraint = constraint(candidate, s);
  if (!pred.constraint.empty()) return pred;
  const int64_t e = s.element_size, f32 = sizeof(float), chunk = s.seq / p;
  // One GPU, the whole batch: every visible pair of the causal sequence in one causal call per pass.
  const double all_visible = static_cast<double>(s.seq) * (s.seq + 1) / 2 * s.batch * s.heads_q;
  pred.ideal_ms = (compute_ms(all_visible, forward_flops(s), forward_causal(s.seq, c)) +
                   compute_ms(all_visible, backward_flops(s), backward_causal(s.seq, c)) + 2 * c.launch_us / 1e3) /
                  p;
  pred.memory = attention_memory(candidate, s);
  const UlyssesVolume volume = hybrid_volume(s.batch, s.heads_q, s.heads_kv, s.seq, s.head_dim, candidate.mesh, e);
  pred.forward_bytes = volume.forward_bytes;
  pred.backward_bytes = volume.backward_bytes;
  switch (candidate.strategy) {
    case PlanStrategy::Ring:
    case PlanStrategy::ZigZagRing:
    case PlanStrategy::StripeRing: {
      const RingPasses r = ring_passes(layout_of(candidate.strategy), s, p, s.heads_q, s.heads_kv,
                                       one_node(c, 0, 1, p) ? c.intra : c.inter, c);
      pred.pairs = r.busiest_pairs * s.batch;
      pred.imbalance = r.busiest_visible / (static_cast<double>(r.total_visible) / p);
      add_ring_time(r, pred);
      break;
    }
    case PlanStrategy::Llama3: {
      // K/V all-gathered (forward and backward), dK/dV reduce-scattered in float32: exposed.
      const int64_t kv_shard = 2 * s.batch * chunk * s.heads_kv * s.head_dim;
      pred.forward_bytes = (p - 1) * kv_shard * e;
      pred.backward_bytes = (p - 1) * kv_shard * (e + f32);
      const std::vector<int64_t> pairs = llama3_pairs(s.seq, p);
      pred.pairs = *std::max_element(pairs.begin(), pairs.end()) * s.batch;
      const std::vector<int64_t> work = causal_work(TokenLayout::ZigZag, s.seq, p);
      const int64_t busiest = *std::max_element(work.begin(), work.end());
      pred.imbalance = busiest / (std::accumulate(work.begin(), work.end(), 0.0) / p);
      const double visible = static_cast<double>(busiest) * s.batch * s.heads_q;
      const double gather = ring_collective_ms((p - 1) * kv_shard * e, p, c);
      const double scatter = ring_collective_ms((p - 1) * kv_shard * f32, p, c);
      // Two causal calls per pass, one per query chunk of S/(2P) rows.
      const double rows = static_cast<double>(s.seq) / (2 * p);
      pred.forward_ms = gather + compute_ms(visible, forward_flops(s), forward_causal(rows, c)) + 2 * c.launch_us / 1e3;
      pred.backward_ms = gather + compute_ms(visible, backward_flops(s), backward_causal(rows, c)) +
                         2 * c.launch_us / 1e3 + scatter;
      pred.exposed_ms = 2 * gather + scatter;
      break;
    }
    case PlanStrategy::Ulysses:
    case PlanStrategy::Hybrid: {
      // The all-to-alls inside a group of P_u consecutive GPUs (exposed: the attention needs all
      // their data), around a zig-zag ring over the P_r groups of H/P_u heads (none for P_r = 1).
      std::string why;
      const int64_t kv_heads = kv_heads_per_gpu(s, pu, why);
      const UlyssesVolume a2a = ulysses_volume(s.batch, s.heads_q, s.heads_kv, s.seq / pr, s.head_dim, pu, e);
      // Forward: q, k, v in, out and lse back; backward: dout in, dq, dk, dv back.
      const double a2a_forward = all_to_all_ms(a2a.forward_bytes, 5, pu, c);
      const double a2a_backward = all_to_all_ms(a2a.backward_bytes, 4, pu, c);
      pred.forward_ms += a2a_forward;
      pred.backward_ms += a2a_backward;
      pred.exposed_ms += a2a_forward + a2a_backward;
      if (pr == 1) {  // attention over the whole sequence on H/P heads: one causal call per pass
        const double visible = static_cast<double>(s.seq) * (s.seq + 1) / 2 * s.batch * (s.heads_q / pu);
        pred.pairs = s.batch * s.seq * s.seq / pu;
        pred.imbalance = 1;
        pred.forward_ms += compute_ms(visible, forward_flops(s), forward_causal(s.seq, c)) + c.launch_us / 1e3;
        pred.backward_ms += compute_ms(visible, backward_flops(s), backward_causal(s.seq, c)) + c.launch_us / 1e3;
      } else {
        const RingPasses r = ring_passes(TokenLayout::ZigZag, s, pr, s.heads_q / pu, kv_heads,
                                         one_node(c, 0, pu, pr) ? c.intra : c.inter, c);
        pred.pairs = r.busiest_pairs * s.batch / pu;  // as lesson 11 counts: H/P_u of the ring's heads
        pred.imbalance = r.busiest_visible / (static_cast<double>(r.total_visible) / pr);
        add_ring_time(r, pred);
      }
      break;
    }
  }
  return pred;
}

std::vector<Prediction> predict_all(const AttentionShape& shape, const Cluster& cluster) {
  std::vector<Prediction> all;
  for (const Candidate& candidate : candidates(cluster.gpus())) all.push_back(predict(candidate, shape, cluster));
  return all;
}


int64_t step_memory(const Prediction& prediction, int64_t layers) {
  const MemoryEstimate& m = prediction.memory;
  return layers * m.saved_bytes + std::max(m.forward_bytes, m.backward_bytes);
}

Recommendation recommend(const std::vector<Prediction>& predictions, int64_t layers, int64_t memory_bytes) {
  Recommendation choice;
  // BEGIN YOUR CODE task 4: the choice and its reason
  // TODO(lesson 14, task 4): the fastest candidate that can run and fits, the runner-up, and a reason;
  // or what stopped each. README, "Task 4 — `recommend`".
  (void)predictions, (void)layers, (void)memory_bytes;
  throw NotImplemented("lesson 14, task 4: recommend");
  // END YOUR CODE
  return choice;
}

}  // namespace cp
