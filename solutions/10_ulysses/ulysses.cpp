// Lesson 10 — Ulysses: two all-to-alls turn a sequence split into a head split and back, with
// lesson 03's attention (and lesson 05's backward) over the whole sequence in between.
#include "ulysses.h"

#include "common/error.h"
#include "common/tensor_checks.h"
#include "common/trace.h"

namespace cp {

torch::Tensor ulysses_seq_to_heads(Comm& comm, const torch::Tensor& x) {
  check_defined(x, "x", 3);
  CP_CHECK(x.size(1) % comm.size() == 0, "x: the head count ", x.size(1), " (dim 1) must be divisible by the ",
           comm.size(), " ranks");
  check_same_on_every_rank(comm, x, "x");
  const int p = comm.size();
  // BEGIN SOLUTION task 1: sequence split to head split
  // STUB: // TODO(lesson 10, task 1): cut the heads into P groups, group j to rank j (all_to_all along dim 0), and
  // STUB: // lay the received sequence chunks end to end in rank order. README, "Task 1".
  // STUB: (void)p;
  // STUB: throw NotImplemented("lesson 10, task 1: ulysses_seq_to_heads");
  if (p == 1) return x;  // one rank holds every head of the whole sequence already: no copy
  std::vector<int64_t> parts = x.sizes().vec();  // [B, H, S/P, rest...] → [P, B, H/P, S/P, rest...]
  parts[1] /= p;
  parts.insert(parts.begin() + 1, p);  // [B, P, H/P, S/P, ...]
  const torch::Tensor outgoing = x.reshape(parts).movedim(1, 0).contiguous();
  const torch::Tensor incoming = comm.all_to_all(outgoing);  // [P (source rank), B, H/P, S/P, ...]
  // The source's tokens are its chunk of the sequence: put the chunks end to end along S.
  return incoming.movedim(0, 2).flatten(2, 3).contiguous();  // [B, H/P, P·S/P, ...]
  // END SOLUTION
}

torch::Tensor ulysses_heads_to_seq(Comm& comm, const torch::Tensor& x) {
  check_defined(x, "x", 3);
  CP_CHECK(x.size(2) % comm.size() == 0, "x: the sequence length ", x.size(2), " (dim 2) must be divisible by the ",
           comm.size(), " ranks");
  check_same_on_every_rank(comm, x, "x");
  const int p = comm.size();
  // BEGIN SOLUTION task 1: head split back to sequence split
  // STUB: // TODO(lesson 10, task 1): cut the sequence into P chunks, chunk j to rank j (all_to_all along dim 0), and
  // STUB: // stack the received head groups in rank order. README, "Task 1".
  // STUB: (void)p;
  // STUB: throw NotImplemented("lesson 10, task 1: ulysses_heads_to_seq");
  if (p == 1) return x;
  std::vector<int64_t> parts = x.sizes().vec();  // [B, H/P, S, rest...] → [P, B, H/P, S/P, rest...]
  parts[2] /= p;
  parts.insert(parts.begin() + 2, p);  // [B, H/P, P, S/P, ...]
  const torch::Tensor outgoing = x.reshape(parts).movedim(2, 0).contiguous();
  const torch::Tensor incoming = comm.all_to_all(outgoing);  // [P (source's head group), B, H/P, S/P, ...]
  return incoming.movedim(0, 1).flatten(1, 2).contiguous();  // [B, H, S/P, ...]
  // END SOLUTION
}

torch::Tensor ulysses_positions(TokenLayout layout, int64_t seq, int world) {
  CP_CHECK(world >= 1, "ulysses_positions: world must be at least 1, got ", world);
  const int64_t parts = layout == TokenLayout::ZigZag ? 2 * world : world;
  CP_CHECK(seq >= 0 && seq % parts == 0, "ulysses_positions: S = ", seq, " is not divisible by ",
           layout == TokenLayout::ZigZag ? "2N = " : "N = ", parts, " (the ", to_string(layout), " layout cuts S into ",
           parts, " equal parts)");
  // BEGIN SOLUTION task 1: the positions of the gathered sequence
  // STUB: // TODO(lesson 10, task 1): the global position of every token of the sequence that ulysses_seq_to_heads
  // STUB: // gathers, in the order it lays them out. README, "Task 1".
  // STUB: (void)layout, (void)seq, (void)world;
  // STUB: throw NotImplemented("lesson 10, task 1: ulysses_positions");
  std::vector<torch::Tensor> chunks;  // the all-to-all puts rank 0's tokens first, then rank 1's, ...
  for (int r = 0; r < world; ++r) chunks.push_back(layout_positions(layout, seq, world, r));
  return torch::cat(chunks);
  // END SOLUTION
}

int64_t ulysses_kv_heads(int64_t heads_q, int64_t heads_kv, int world) {
  CP_CHECK(heads_q % world == 0, "ulysses: the query heads Hq = ", heads_q, " must be divisible by the ", world,
           " ranks (each rank takes Hq/P of them)");
  CP_CHECK(heads_kv >= 1 && heads_q % heads_kv == 0, "ulysses: Hq = ", heads_q, " must be divisible by Hkv = ", heads_kv);
  if (heads_kv % world == 0) return heads_kv;
  CP_CHECK(world % heads_kv == 0, "ulysses: the key/value heads Hkv = ", heads_kv, " must be divisible by the ", world,
           " ranks, or divide it (then each is replicated P/Hkv times)");
  return world;
}

UlyssesVolume ulysses_volume(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq, int64_t head_dim,
                             int world, int64_t element_size) {
  const int64_t kv = ulysses_kv_heads(heads_q, heads_kv, world);
  // One all-to-all of a [B, H, S/P, D] tensor sends (P-1)/P of it: (P-1)·B·H·(S/P)·D / P elements.
  auto sent = [&](int64_t heads, int64_t dim, int64_t bytes) {
    return (world - 1) * batch * heads * (seq / world) * dim / world * bytes;
  };
  const int64_t q = sent(heads_q, head_dim, element_size), k = sent(kv, head_dim, element_size),
                lse = sent(heads_q, 1, 4);
  UlyssesVolume v;
  v.forward_bytes = q + 2 * k + q + lse;  // q, k, v in; out, lse back
  v.backward_bytes = q + q + 2 * k;        // dout in; dq, dk, dv back
  return v;
}

namespace {

/// The checks of a Ulysses call; returns the K/V heads the all-to-all moves (ulysses_kv_heads).
/// Whether S fits the layout (zig-zag: 2N) is checked by ulysses_positions, before any exchange.
int64_t check_ulysses_inputs(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  check_ring_inputs(comm, q, k, v, RingOptions{});  // lesson 04: the same shards on every rank, S/N tokens each
  return ulysses_kv_heads(q.size(1), k.size(1), comm.size());
}

}  // namespace

void check_ulysses_saved(Comm& comm, const torch::Tensor& dout, const UlyssesSaved& saved) {
  check_defined(dout, "dout", 4);
  const int p = comm.size();
  check_same_on_every_rank(comm, dout, "dout");
  const auto fits = [](const torch::Tensor& t, std::vector<int64_t> shape) { return t.defined() && t.sizes() == shape; };
  const int64_t b = dout.size(0), hq = dout.size(1), s = dout.size(2) * p, d = dout.size(3);
  CP_CHECK(hq % p == 0, "dout: the head count ", hq, " (dim 1) must be divisible by the ", p, " ranks");
  CP_CHECK(saved.q.defined() && saved.heads_kv >= 1,
           "saved: empty; pass what the forward kept for this dout (UlyssesResult::saved)");
  CP_CHECK(hq % saved.heads_kv == 0, "saved: heads_kv = ", saved.heads_kv, " does not divide dout's Hq = ", hq,
           " (UlyssesResult::saved of another call?)");
  const int64_t kv = ulysses_kv_heads(hq, saved.heads_kv, p) / p;
  CP_CHECK(fits(saved.q, {b, hq / p, s, d}) && fits(saved.out, {b, hq / p, s, d}) && fits(saved.k, {b, kv, s, d}) &&
               fits(saved.v, {b, kv, s, d}) && fits(saved.lse, {b, hq / p, s}),
           "saved: expected the forward's head split for dout ", dout.sizes(), " on ", p, " ranks: q, out [", b, ", ",
           hq / p, ", ", s, ", ", d, "], k, v [", b, ", ", kv, ", ", s, ", ", d, "], lse [", b, ", ", hq / p, ", ", s,
           "] (UlyssesResult::saved)");
  CP_CHECK(saved.q.scalar_type() == dout.scalar_type() && saved.lse.scalar_type() == torch::kFloat,
           "saved: q must have dout's dtype ", dout.dtype(), " and lse float32 (UlyssesResult::saved)");
}

torch::Tensor replicate_kv_heads(const torch::Tensor& t, int64_t heads) {
  CP_CHECK(t.defined() && t.dim() >= 2 && t.size(1) >= 1 && heads % t.size(1) == 0,
           "replicate_kv_heads: t must have K/V heads along dim 1 that divide heads = ", heads);
  // BEGIN SOLUTION task 2: replicate the K/V heads
  // STUB: // TODO(lesson 10, task 2): every K/V head heads/Hkv times, laid out so that the all-to-all gives each rank
  // STUB: // the K/V head its query heads read. README, "Grouped-query attention" and "Task 2".
  // STUB: (void)t, (void)heads;
  // STUB: throw NotImplemented("lesson 10, task 2: replicate_kv_heads");
  if (heads == t.size(1)) return t;
  return t.repeat_interleave(heads / t.size(1), 1);  // copies of a head side by side: h0 h0 h1 h1 ...
  // END SOLUTION
}

torch::Tensor sum_kv_replicas(const torch::Tensor& grad, int64_t heads_kv) {
  CP_CHECK(grad.defined() && grad.dim() >= 2 && heads_kv >= 1 && grad.size(1) % heads_kv == 0,
           "sum_kv_replicas: grad must have a multiple of heads_kv = ", heads_kv, " heads along dim 1");
  // BEGIN SOLUTION task 3: sum the gradients of the K/V replicas
  // STUB: // TODO(lesson 10, task 3): the gradient of each K/V head from the gradients of its copies (the layout of
  // STUB: // replicate_kv_heads). README, "Grouped-query attention" and "Task 3".
  // STUB: (void)grad, (void)heads_kv;
  // STUB: throw NotImplemented("lesson 10, task 3: sum_kv_replicas");
  if (grad.size(1) == heads_kv) return grad;
  std::vector<int64_t> shape = grad.sizes().vec();  // [B, Hkv·r, S/P, D] → [B, Hkv, r, S/P, D]
  shape[1] = heads_kv;
  shape.insert(shape.begin() + 2, grad.size(1) / heads_kv);
  return grad.reshape(shape).sum(2);
  // END SOLUTION
}

int64_t all_to_all_bytes(const torch::Tensor& t, int world) {
  return t.numel() * t.element_size() / world * (world - 1);
}

UlyssesResult ulysses_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v, const UlyssesOptions& options) {
  const int64_t kv_heads = check_ulysses_inputs(comm, q, k, v);
  const int rank = comm.rank(), p = comm.size();
  const torch::Tensor pos = ulysses_positions(options.layout, q.size(2) * p, p).to(q.device());  // before any exchange
  UlyssesResult result;
  // BEGIN SOLUTION task 2: the forward
  // STUB: // TODO(lesson 10, task 2): q, k, v (K/V with kv_heads heads) to head-sharded; attention over the whole
  // STUB: // sequence with the positions `pos`; out and lse back to sequence-sharded; keep what the backward needs in
  // STUB: // result.saved; count the bytes. README, "Task 2".
  // STUB: (void)kv_heads, (void)rank, (void)pos;
  // STUB: throw NotImplemented("lesson 10, task 2: ulysses_attention_forward");
  const torch::Tensor k_all = replicate_kv_heads(k, kv_heads).contiguous(), v_all = replicate_kv_heads(v, kv_heads).contiguous();
  torch::Tensor qh, kh, vh;  // [B, H/P, S, D]
  {
    TraceSpan span(options.trace, rank, "comm", "all-to-all q, k, v");
    qh = ulysses_seq_to_heads(comm, q.contiguous());
    kh = ulysses_seq_to_heads(comm, k_all);
    vh = ulysses_seq_to_heads(comm, v_all);
  }
  AttnResult heads;
  {
    TraceSpan span(options.trace, rank, "compute", "attention over the whole sequence");
    heads = attention_block_forward(qh, kh, vh, AttentionMask{options.causal, pos, pos}, options.scale);
  }
  {
    TraceSpan span(options.trace, rank, "comm", "all-to-all out, lse");
    result.out = ulysses_heads_to_seq(comm, heads.out);
    result.lse = ulysses_heads_to_seq(comm, heads.lse);
  }
  for (const torch::Tensor& t : {q, k_all, v_all, result.out, result.lse}) result.stats.bytes_sent += all_to_all_bytes(t, p);
  result.saved = {qh, heads.out, kh, vh, heads.lse, k.size(1)};
  // END SOLUTION
  return result;
}

UlyssesGrads ulysses_attention_backward(Comm& comm, const torch::Tensor& dout, const UlyssesSaved& saved,
                                        const UlyssesOptions& options) {
  check_ulysses_saved(comm, dout, saved);
  const int rank = comm.rank(), p = comm.size();
  const torch::Tensor pos = ulysses_positions(options.layout, dout.size(2) * p, p).to(dout.device());
  UlyssesGrads grads;
  // BEGIN SOLUTION task 3: the backward
  // STUB: // TODO(lesson 10, task 3): dout to the head split, lesson 05's block backward over the whole sequence with
  // STUB: // what the forward saved, dq, dk, dv back (dk, dv summed over the replicas of a K/V head); count the
  // STUB: // bytes. README, "Task 3".
  // STUB: (void)rank, (void)p, (void)pos, (void)saved;
  // STUB: throw NotImplemented("lesson 10, task 3: ulysses_attention_backward");
  torch::Tensor dout_heads;
  {
    TraceSpan span(options.trace, rank, "comm", "all-to-all dout");
    dout_heads = ulysses_seq_to_heads(comm, dout.contiguous());
    grads.stats.bytes_sent += all_to_all_bytes(dout, p);
  }
  AttnGrads g;
  {
    TraceSpan span(options.trace, rank, "compute", "backward over the whole sequence");
    g = attention_block_backward(dout_heads, saved.q, saved.k, saved.v, saved.out, saved.lse,
                                 AttentionMask{options.causal, pos, pos}, options.scale);
  }
  {
    TraceSpan span(options.trace, rank, "comm", "all-to-all dq, dk, dv");
    // In the inputs' dtype: each head group's gradient is complete, only replicas remain to be summed.
    const torch::Tensor dq = g.dq.to(dout.scalar_type()), dk = g.dk.to(dout.scalar_type()),
                        dv = g.dv.to(dout.scalar_type());
    grads.dq = ulysses_heads_to_seq(comm, dq);
    grads.dk = sum_kv_replicas(ulysses_heads_to_seq(comm, dk), saved.heads_kv);
    grads.dv = sum_kv_replicas(ulysses_heads_to_seq(comm, dv), saved.heads_kv);
    for (const torch::Tensor& t : {dq, dk, dv}) grads.stats.bytes_sent += all_to_all_bytes(t, p);
  }
  // END SOLUTION
  return grads;
}

Strategy ulysses_strategy() {
  // Work per rank, in the unit of the other strategies (pairs of one head): H/P heads of the whole
  // S × S block (masked pairs included, as the ring counts its blocks) is S·S/P pairs of one head.
  auto pairs = [](const Comm& comm, int64_t batch, int64_t chunk) {
    const int64_t s = chunk * comm.size();
    return batch * s * s / comm.size();
  };
  return {"ulysses", TokenLayout::Contiguous,
          [pairs](Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, Trace* trace) {
            const UlyssesResult r = ulysses_attention_forward(comm, q, k, v, ulysses_options(true, TokenLayout::Contiguous, trace));
            return StrategyForward{r.out, r.lse, {pairs(comm, q.size(0), q.size(2)), r.stats.bytes_sent},
                                   to_saved_tensors(r.saved)};
          },
          [pairs](Comm& comm, const torch::Tensor& dout, const std::vector<torch::Tensor>& saved, Trace* trace) {
            const UlyssesGrads g = ulysses_attention_backward(comm, dout, from_saved_tensors(saved),
                                                              ulysses_options(true, TokenLayout::Contiguous, trace));
            return StrategyBackward{g.dq, g.dk, g.dv, {pairs(comm, dout.size(0), dout.size(2)), g.stats.bytes_sent}};
          }};
}

std::vector<torch::Tensor> to_saved_tensors(const UlyssesSaved& saved) {
  // Autograd keeps tensors: Hkv travels as a 0-dim int64 tensor.
  return {saved.q, saved.out, saved.k, saved.v, saved.lse, torch::tensor(saved.heads_kv)};
}

UlyssesSaved from_saved_tensors(const std::vector<torch::Tensor>& saved) {
  check_saved(saved, 6, "ulysses");
  return {saved[0], saved[1], saved[2], saved[3], saved[4], saved[5].item<int64_t>()};
}

}  // namespace cp
