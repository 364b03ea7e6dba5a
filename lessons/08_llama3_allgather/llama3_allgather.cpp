// GENERATED from solutions/08_llama3_allgather/llama3_allgather.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 08 — all-gather context parallelism (Llama 3): gather K/V once, attend each query group
// to the K/V prefix it needs, and in the backward accumulate dK/dV and reduce-scatter them home.
#include "llama3_allgather.h"

#include <chrono>
#include <tuple>
#include <utility>

#include "common/error.h"
#include "common/tensor_checks.h"

namespace cp {

std::string to_string(Llama3Mode mode) { return mode == Llama3Mode::TwoKernels ? "two kernels" : "fused"; }

std::vector<int64_t> check_cu_seqlens(const torch::Tensor& cu_seqlens, int64_t total, int world) {
  CP_CHECK(cu_seqlens.defined() && cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1 &&
               (cu_seqlens.scalar_type() == torch::kLong || cu_seqlens.scalar_type() == torch::kInt),
           "cu_seqlens: expected int64 or int32 [documents + 1], got ",
           cu_seqlens.defined() ? cu_seqlens.sizes() : torch::IntArrayRef{}, " ",
           cu_seqlens.defined() ? cu_seqlens.dtype() : caffe2::TypeMeta());
  const torch::Tensor host = cu_seqlens.to(torch::kCPU, torch::kLong).contiguous();
  std::vector<int64_t> cu(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  CP_CHECK(cu.front() == 0, "cu_seqlens: must start at 0, starts at ", cu.front());
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t length = cu[d + 1] - cu[d];
    CP_CHECK(length > 0, "cu_seqlens: must be strictly increasing; document ", d, " is [", cu[d], ", ", cu[d + 1], ")");
    CP_CHECK(length % (2 * world) == 0, "cu_seqlens: document ", d, " has length ", length,
             ", not divisible by 2N = ", 2 * world, " (each document is cut into 2N zig-zag chunks)");
  }
  CP_CHECK(total < 0 || cu.back() == total, "cu_seqlens: must end at T = ", total, " (the packed length: N × the local ", total / world,
           " tokens), ends at ", cu.back());
  return cu;
}

torch::Tensor zigzag_varlen_positions(const torch::Tensor& cu_seqlens, int world, int rank) {
  CP_CHECK(world >= 1 && rank >= 0 && rank < world, "zigzag_varlen_positions: rank ", rank, " is not in a world of ",
           world);
  const std::vector<int64_t> cu = check_cu_seqlens(cu_seqlens, /*total: any*/ -1, world);
  if (cu.size() == 1) return torch::empty({0}, torch::kLong);  // no documents, no tokens
  // BEGIN YOUR CODE task 1: the varlen zig-zag layout
  // TODO(lesson 08, task 1): per document, the packed rows of chunk `rank`, then those of chunk 2N−1−rank.
  // README, "Task 1 — `zigzag_varlen_positions`".
  (void)cu;
  throw NotImplemented("lesson 08, task 1: zigzag_varlen_positions");
  // END YOUR CODE
}

torch::Tensor zigzag_varlen_shard(const torch::Tensor& full, const torch::Tensor& cu_seqlens, int world, int rank) {
  CP_CHECK(full.defined() && full.dim() >= 1, "zigzag_varlen_shard: full must be a packed tensor [T, ...]");
  return full.index_select(0, zigzag_varlen_positions(cu_seqlens, world, rank).to(full.device()));
}

torch::Tensor zigzag_varlen_unshard(const std::vector<torch::Tensor>& shards, const torch::Tensor& cu_seqlens) {
  CP_CHECK(!shards.empty(), "zigzag_varlen_unshard: no shards");
  CP_CHECK(shards[0].defined() && shards[0].dim() >= 1, "zigzag_varlen_unshard: shards must be packed tensors [T/N, ...]");
  const int world = static_cast<int>(shards.size());
  std::vector<int64_t> shape = shards[0].sizes().vec();
  shape[0] *= world;
  const int64_t total = check_cu_seqlens(cu_seqlens, /*total: any*/ -1, world).back();
  CP_CHECK(total == shape[0], "zigzag_varlen_unshard: cu_seqlens must end at T = ", shape[0], " (", world,
           " shards of ", shards[0].size(0), " rows), ends at ", total);
  torch::Tensor full = torch::empty(shape, shards[0].options());
  for (int r = 0; r < world; ++r) {
    CP_CHECK(shards[r].defined() && shards[r].sizes() == shards[0].sizes(), "zigzag_varlen_unshard: shard ", r,
             " has shape ", shards[r].defined() ? shards[r].sizes() : torch::IntArrayRef{}, ", shard 0 has ",
             shards[0].sizes());
    full.index_copy_(0, zigzag_varlen_positions(cu_seqlens, world, r).to(full.device()), shards[r]);
  }
  return full;
}

namespace {

/// Rows [begin, begin + len) of a packed [T, H, D] tensor as one attention block [1, H, len, D].
torch::Tensor as_block(const torch::Tensor& packed, int64_t begin, int64_t len) {
  return packed.narrow(0, begin, len).transpose(0, 1).unsqueeze(0);
}

/// The inverse: a block [1, H, len, D] (or its lse [1, H, len]) as packed rows [len, H, D] ([H, len]).
torch::Tensor packed_rows(const torch::Tensor& block) { return block.squeeze(0).transpose(0, 1); }

/// The varlen calls' checks: packed q, k, v (lesson 03's checks on [1, H, T, D] views) and
/// segments that tile [0, Tq) and [0, Tk) with positions for every row.
void check_varlen_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const VarlenSegments& s) {
  for (const auto& [t, arg] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}})
    CP_CHECK(t->defined() && t->dim() == 3, arg, ": expected a packed [T, H, D] tensor, got ",
             t->defined() ? t->sizes() : torch::IntArrayRef{});
  check_attention_inputs(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                         v.transpose(0, 1).unsqueeze(0));
  const int64_t tq = q.size(0), tk = k.size(0);
  CP_CHECK(s.cu_q.size() == s.cu_k.size() && s.cu_q.size() >= 2 && s.cu_q.front() == 0 && s.cu_k.front() == 0,
           "segments: cu_q and cu_k must have the same number (≥ 2) of boundaries, starting at 0");
  CP_CHECK(s.cu_q.back() == tq && s.cu_k.back() == tk, "segments: cu_q must end at Tq = ", tq, " and cu_k at Tk = ", tk,
           "; they end at ", s.cu_q.back(), " and ", s.cu_k.back());
  for (size_t i = 0; i + 1 < s.cu_q.size(); ++i)
    CP_CHECK(s.cu_q[i] <= s.cu_q[i + 1] && s.cu_k[i] <= s.cu_k[i + 1], "segments: boundaries must not decrease; segment ",
             i, " is q [", s.cu_q[i], ", ", s.cu_q[i + 1], "), k [", s.cu_k[i], ", ", s.cu_k[i + 1], ")");
  for (const auto& [pos, n, arg] : {std::tuple{&s.q_positions, tq, "segments.q_positions"},
                                    std::tuple{&s.k_positions, tk, "segments.k_positions"}})
    CP_CHECK(pos->defined() && pos->dim() == 1 && pos->size(0) == n && pos->scalar_type() == torch::kLong, arg,
             ": expected int64 [", n, "], got ", pos->defined() ? pos->sizes() : torch::IntArrayRef{}, " ",
             pos->defined() ? pos->dtype() : caffe2::TypeMeta());
}

AttentionMask segment_mask(const VarlenSegments& s, size_t i) {
  return {true, s.q_positions.narrow(0, s.cu_q[i], s.cu_q[i + 1] - s.cu_q[i]),
          s.k_positions.narrow(0, s.cu_k[i], s.cu_k[i + 1] - s.cu_k[i])};
}

}  // namespace

AttnResult varlen_attention_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const VarlenSegments& segments, std::optional<double> scale) {
  check_varlen_inputs(q, k, v, segments);
  AttnResult result{torch::empty_like(q), torch::empty({q.size(1), q.size(0)}, q.options().dtype(torch::kFloat))};
  for (size_t i = 0; i + 1 < segments.cu_q.size(); ++i) {
    const int64_t q0 = segments.cu_q[i], lq = segments.cu_q[i + 1] - q0;
    const int64_t k0 = segments.cu_k[i], lk = segments.cu_k[i + 1] - k0;
    const AttnResult block = attention_block_forward(as_block(q, q0, lq), as_block(k, k0, lk), as_block(v, k0, lk),
                                                     segment_mask(segments, i), scale);
    result.out.narrow(0, q0, lq).copy_(packed_rows(block.out));
    result.lse.narrow(1, q0, lq).copy_(block.lse.squeeze(0));
  }
  return result;
}

AttnGrads varlen_attention_backward(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                    const VarlenSegments& segments, std::optional<double> scale) {
  check_varlen_inputs(q, k, v, segments);
  for (const auto& [t, arg] : {std::pair{&dout, "dout"}, std::pair{&out, "out"}})
    CP_CHECK(t->defined() && t->sizes() == q.sizes(), arg, ": expected q's shape ", q.sizes(), ", got ",
             t->defined() ? t->sizes() : torch::IntArrayRef{});
  CP_CHECK(lse.defined() && lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
           "lse: expected [Hq, Tq] = [", q.size(1), ", ", q.size(0), "] from the forward, got ",
           lse.defined() ? lse.sizes() : torch::IntArrayRef{});
  const auto f32 = q.options().dtype(torch::kFloat);
  AttnGrads grads{torch::empty(q.sizes(), f32), torch::empty(k.sizes(), f32), torch::empty(v.sizes(), f32)};
  for (size_t i = 0; i + 1 < segments.cu_q.size(); ++i) {
    const int64_t q0 = segments.cu_q[i], lq = segments.cu_q[i + 1] - q0;
    const int64_t k0 = segments.cu_k[i], lk = segments.cu_k[i + 1] - k0;
    const AttnGrads block = attention_block_backward(as_block(dout, q0, lq), as_block(q, q0, lq), as_block(k, k0, lk),
                                                     as_block(v, k0, lk), as_block(out, q0, lq),
                                                     lse.narrow(1, q0, lq).unsqueeze(0), segment_mask(segments, i), scale);
    grads.dq.narrow(0, q0, lq).copy_(packed_rows(block.dq));
    grads.dk.narrow(0, k0, lk).copy_(packed_rows(block.dk));
    grads.dv.narrow(0, k0, lk).copy_(packed_rows(block.dv));
  }
  return grads;
}

std::vector<Llama3Call> llama3_plan(const std::vector<int64_t>& cu, int world, int rank, Llama3Mode mode) {
  CP_CHECK(world >= 1 && rank >= 0 && rank < world, "llama3_plan: rank ", rank, " is not in a world of ", world);
  // BEGIN YOUR CODE task 2: query groups and K/V slices
  // TODO(lesson 08, task 2): the calls: the early and late query chunks of every document, with their K/V slices.
  // README, "Task 2 — `llama3_plan`" and "Two kernels or one fused call".
  (void)cu, (void)mode;
  throw NotImplemented("lesson 08, task 2: llama3_plan");
  // END YOUR CODE
}

int64_t call_pairs(const Llama3Call& call) {
  int64_t pairs = 0;
  for (size_t i = 0; i + 1 < call.segments.cu_q.size(); ++i)
    pairs += (call.segments.cu_q[i + 1] - call.segments.cu_q[i]) * (call.segments.cu_k[i + 1] - call.segments.cu_k[i]);
  return pairs;
}

namespace {

/// The packed positions of the rows of an all-gather (or of a reduce-scatter's input): rank 0's
/// local rows, then rank 1's, … each in its zig-zag local order.
torch::Tensor gathered_positions(const torch::Tensor& cu_seqlens, int world, torch::Device device) {
  std::vector<torch::Tensor> positions;
  for (int r = 0; r < world; ++r) positions.push_back(zigzag_varlen_positions(cu_seqlens, world, r));
  return torch::cat(positions).to(device);
}

/// The K/V rows of every rank gathered (one collective) and put in document order:
/// [T, 2, Hkv, D], k at [:, 0] and v at [:, 1].
/// @param positions gathered_positions(...): where each gathered row belongs
torch::Tensor gather_kv(Comm& comm, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& positions,
                        Llama3Stats& stats, Trace* trace) {
  TraceSpan span(trace, comm.rank(), "comm", "all-gather K/V");
  // BEGIN YOUR CODE task 3: gather K/V in document order
  // TODO(lesson 08, task 3a): stack k and v, all_gather them, and put every row at its packed position.
  // README, "Task 3 — the gather (3a) and the forward (3b)", 3a.
  (void)comm, (void)k, (void)v, (void)positions, (void)stats;
  throw NotImplemented("lesson 08, task 3a: gather_kv");
  // END YOUR CODE
}

/// rows of t (dim 0) given by index, or t itself when index is undefined (all rows, in order).
torch::Tensor select_rows(const torch::Tensor& t, const torch::Tensor& index) {
  return index.defined() ? t.index_select(0, index.to(t.device())) : t;
}

/// Moves a plan's index tensors to `device` (the plan is built on the host).
std::vector<Llama3Call> plan_on(const std::vector<int64_t>& cu, int world, int rank, Llama3Mode mode,
                                torch::Device device) {
  std::vector<Llama3Call> calls = llama3_plan(cu, world, rank, mode);
  for (Llama3Call& call : calls) {
    if (call.q_rows.defined()) call.q_rows = call.q_rows.to(device);
    if (call.kv_rows.defined()) call.kv_rows = call.kv_rows.to(device);
    call.segments.q_positions = call.segments.q_positions.to(device);
    call.segments.k_positions = call.segments.k_positions.to(device);
  }
  return calls;
}


/// Checks the local packed shards and cu_seqlens; returns cu_seqlens on the host.
std::vector<int64_t> check_llama3_inputs(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const torch::Tensor& cu_seqlens) {
  check_defined(q, "q");
  check_defined(k, "k");
  check_defined(v, "v");
  CP_CHECK(q.dim() == 3 && k.dim() == 3, "q, k, v: expected packed [T/N, H, D] tensors, got q ", q.sizes(), ", k ",
           k.sizes());
  // Lesson 03's check on the [1, H, T/N, D] views: dtypes, devices, head dims, Hq % Hkv.
  check_attention_inputs(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                         v.transpose(0, 1).unsqueeze(0));
  CP_CHECK(k.size(0) == q.size(0), "k: every rank holds T/N tokens of q, k and v; q has ", q.size(0), ", k has ",
           k.size(0));
  check_same_on_every_rank(comm, q, "q");
  const std::vector<int64_t> cu = check_cu_seqlens(cu_seqlens, q.size(0) * comm.size(), comm.size());
  // Other boundaries on another rank would silently attend across the wrong tokens. Every rank
  // sees the same collective results, so every rank fails alike (no rank is left waiting).
  const int64_t mine = static_cast<int64_t>(cu.size());
  torch::Tensor extremes = torch::tensor({mine, -mine}, torch::kLong).to(q.device());  // → max, −min
  comm.all_reduce(extremes, ReduceOp::Max);
  const int64_t most = extremes[0].item<int64_t>(), fewest = -extremes[1].item<int64_t>();
  CP_CHECK(most == fewest, "cu_seqlens: every rank must pass the same document boundaries; ranks pass between ",
           fewest - 1, " and ", most - 1, " documents");
  const torch::Tensor all = comm.all_gather(torch::tensor(cu, torch::kLong).to(q.device())).cpu().view({comm.size(), -1});
  for (int r = 0; r < comm.size(); ++r)
    CP_CHECK(torch::equal(all[r], all[0]), "cu_seqlens: every rank must pass the same document boundaries; rank 0 has ",
             torch::IntArrayRef(all[0].data_ptr<int64_t>(), most), ", rank ", r, " has ",
             torch::IntArrayRef(all[r].data_ptr<int64_t>(), most));
  return cu;
}

}  // namespace

Llama3Result zigzag_llama3_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                             const torch::Tensor& v, const torch::Tensor& cu_seqlens, Llama3Mode mode,
                                             const Llama3Options& options) {
  const std::vector<int64_t> cu = check_llama3_inputs(comm, q, k, v, cu_seqlens);
  if (q.size(0) == 0)  // no tokens on any rank (checked above): nothing to gather or attend
    return {torch::empty_like(q), torch::empty({q.size(1), 0}, q.options().dtype(torch::kFloat)), {}};
  const std::vector<Llama3Call> calls = plan_on(cu, comm.size(), comm.rank(), mode, q.device());
  Llama3Result result;
  const torch::Tensor positions = gathered_positions(cu_seqlens, comm.size(), q.device());
  const torch::Tensor kv = gather_kv(comm, k, v, positions, result.stats, options.trace);  // [T, 2, Hkv, D]
  // BEGIN YOUR CODE task 3: the forward
  // TODO(lesson 08, task 3b): run each call of the plan and write its out and lse back at its query rows.
  // README, "Task 3 — the gather (3a) and the forward (3b)", 3b.
  (void)calls, (void)kv, (void)mode;
  throw NotImplemented("lesson 08, task 3b: zigzag_llama3_attention_forward");
  // END YOUR CODE
  return result;
}

Llama3Grads zigzag_llama3_attention_backward(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q,
                                             const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                             const torch::Tensor& lse, const torch::Tensor& cu_seqlens, Llama3Mode mode,
                                             const Llama3Options& options) {
  const std::vector<int64_t> cu = check_llama3_inputs(comm, q, k, v, cu_seqlens);
  CP_CHECK(dout.defined() && out.defined() && dout.sizes() == q.sizes() && out.sizes() == q.sizes(),
           "dout, out: expected the shape of q ", q.sizes());
  CP_CHECK(lse.defined() && lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
           "lse: expected [Hq, T/N] = [", q.size(1), ", ", q.size(0), "] float32 from the forward, got ",
           lse.defined() ? lse.sizes() : torch::IntArrayRef{});
  if (q.size(0) == 0)  // no tokens on any rank (checked above): no gradients to compute
    return {torch::empty_like(q), torch::empty_like(k), torch::empty_like(v), {}};
  const std::vector<Llama3Call> calls = plan_on(cu, comm.size(), comm.rank(), mode, q.device());
  Llama3Grads result;
  const torch::Tensor positions = gathered_positions(cu_seqlens, comm.size(), q.device());
  const torch::Tensor kv = gather_kv(comm, k, v, positions, result.stats, options.trace);  // [T, 2, Hkv, D]
  // BEGIN YOUR CODE task 4: the backward
  // TODO(lesson 08, task 4): each call's backward, dK/dV added at its kv_rows, then reduce_scatter to the owners.
  // README, "Task 4 — the backward" and "The backward: gather again, add, reduce-scatter".
  (void)calls, (void)kv, (void)dout, (void)out, (void)lse;
  throw NotImplemented("lesson 08, task 4: zigzag_llama3_attention_backward");
  // END YOUR CODE
  return result;
}

}  // namespace cp
