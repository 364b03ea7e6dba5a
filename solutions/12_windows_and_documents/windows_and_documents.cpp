// Lesson 12 — sliding windows and packed documents on the ring: which blocks a mask leaves
// visible, how many ring steps it needs, the work per rank, and padded layouts of any length.
#include "windows_and_documents.h"

#include <algorithm>
#include <numeric>

#include "common/error.h"

namespace cp {

namespace {

/// The AttentionMask of `mask` for the queries and keys at the given positions.
AttentionMask attention_mask(const SequenceMask& mask, const torch::Tensor& q_positions = {},
                             const torch::Tensor& k_positions = {}) {
  AttentionMask m{mask.causal, q_positions, k_positions};
  m.window = mask.window;
  m.documents = mask.documents;
  return m;
}

/// `mask` checked over `tokens` tokens (lesson 03's check_mask, and documents that end at
/// `tokens`), and its documents' bounds on the host ({0, tokens} without documents: one document).
std::vector<int64_t> checked_bounds(const SequenceMask& mask, int64_t tokens) {
  const std::vector<int64_t> c = check_mask(attention_mask(mask));
  if (c.empty()) return {0, tokens};
  CP_CHECK(c.back() == tokens, "mask.documents: must end at the number of tokens T = ", tokens, ", ends at ", c.back());
  return c;
}

/// `base`'s plan for one step, refined by the mask: skipped, computed whole, or with the mask.
BlockPlan refined_plan(const RingSchedule& base, const SequenceMask& mask, int rank, int source, int world,
                       int64_t chunk, bool causal) {
  CP_CHECK(causal == mask.causal, "options.causal (", causal, ") must be the mask's causal (", mask.causal,
           "): the ring and the mask must agree");
  BlockPlan plan = base.plan(rank, source, world, chunk, causal);
  if (!plan.compute) return plan;  // base skips only blocks the causal mask hides: so does this one
  const torch::Tensor q = base.positions(rank, world, chunk, torch::kCPU).narrow(0, plan.q_begin, plan.q_len);
  const torch::Tensor k = base.positions(source, world, chunk, torch::kCPU).narrow(0, plan.k_begin, plan.k_len);
  switch (block_visibility(q, k, mask)) {
    case Visibility::None: return BlockPlan{};
    case Visibility::All: plan.causal_mask = false; return plan;
    case Visibility::Some:
      plan.causal_mask = mask.causal;
      plan.window = mask.window;
      plan.documents = mask.documents;
      return plan;
  }
  CP_FAIL("unknown visibility");
}

}  // namespace

void check_sequence_mask(const SequenceMask& mask, int64_t tokens) { checked_bounds(mask, tokens); }

std::string to_string(Visibility visibility) {
  switch (visibility) {
    case Visibility::None: return "none";
    case Visibility::Some: return "some";
    case Visibility::All: return "all";
  }
  return "?";
}

Visibility block_visibility(const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                            const SequenceMask& mask) {
  CP_CHECK(q_positions.defined() && q_positions.dim() == 1 && q_positions.scalar_type() == torch::kLong &&
               k_positions.defined() && k_positions.dim() == 1 && k_positions.scalar_type() == torch::kLong,
           "block_visibility: positions must be int64 1-D tensors");
  if (q_positions.numel() == 0 || k_positions.numel() == 0) return Visibility::None;
  const torch::Tensor q = q_positions.cpu(), k = k_positions.cpu();
  // BEGIN SOLUTION task 1: none, some or all
  // STUB: // TODO(lesson 12, task 1): each query sees the keys positioned first .. last (lesson 03's visible_keys);
  // STUB: // count how many of the block's keys each query sees. README, "Task 1 — `block_visibility`".
  // STUB: (void)q, (void)k, (void)mask;
  // STUB: throw NotImplemented("lesson 12, task 1: block_visibility");
  const VisibleKeys keys = visible_keys(attention_mask(mask, q, k), q);
  if (!keys.masked) return Visibility::All;
  const torch::Tensor sorted = std::get<0>(k.sort());
  // Keys seen by query i: those positioned first[i] … last[i], counted by two binary searches.
  const torch::Tensor before_first = torch::searchsorted(sorted, keys.first);
  const torch::Tensor up_to_last = torch::searchsorted(sorted, keys.last, /*out_int32=*/false, /*right=*/true);
  const torch::Tensor seen = (up_to_last - before_first).clamp_min(0);
  if (seen.max().item<int64_t>() == 0) return Visibility::None;
  return seen.min().item<int64_t>() == k.numel() ? Visibility::All : Visibility::Some;
  // END SOLUTION
}

RingSchedule masked_schedule(const RingSchedule& base, const SequenceMask& mask) {
  CP_CHECK(base.positions && base.plan, "masked_schedule: the base schedule needs positions and plan");
  CP_CHECK(!base.steps, "masked_schedule: the base schedule must run every step (its steps unset)");
  RingSchedule schedule;
  schedule.positions = base.positions;
  schedule.plan = [base, mask](int rank, int source, int world, int64_t chunk, bool causal) {
    return refined_plan(base, mask, rank, source, world, chunk, causal);
  };
  schedule.steps = [base, mask](int world, int64_t chunk, bool causal) {
    return masked_ring_steps(base, mask, world, chunk, causal);
  };
  return schedule;
}

int masked_ring_steps(const RingSchedule& base, const SequenceMask& mask, int world, int64_t chunk, bool causal) {
  CP_CHECK(world >= 1, "masked_ring_steps: world must be at least 1, got ", world);
  // BEGIN SOLUTION task 2: the steps the ring needs
  // STUB: // TODO(lesson 12, task 2): 1 + the latest step t at which any rank r computes the block of rank r − t.
  // STUB: // README, "Task 2 — `masked_ring_steps`".
  // STUB: (void)base, (void)mask, (void)chunk, (void)causal;
  // STUB: throw NotImplemented("lesson 12, task 2: masked_ring_steps");
  int last = 0;  // step 0, the own chunk, always runs
  for (int rank = 0; rank < world; ++rank)
    for (int t = world - 1; t > last; --t)  // latest first: the first computed step is this rank's last
      if (refined_plan(base, mask, rank, (rank - t + world) % world, world, chunk, causal).compute) {
        last = t;
        break;
      }
  return last + 1;
  // END SOLUTION
}

int window_ring_steps(TokenLayout layout, int64_t seq, int world, int64_t window) {
  CP_CHECK(window >= 1, "window: must be at least 1, got ", window);
  layout_positions(layout, seq, world, 0);  // checks world and that S divides into the layout's parts
  CP_CHECK(seq >= world, "seq: S = ", seq, " gives no token to some of the N = ", world, " ranks");
  // BEGIN SOLUTION task 3: the prediction
  // STUB: // TODO(lesson 12, task 3): the steps a window of W keys needs in each layout, from S, N and W alone.
  // STUB: // README, "Task 3 — `window_ring_steps`".
  // STUB: throw NotImplemented("lesson 12, task 3: window_ring_steps");
  switch (layout) {
    case TokenLayout::Contiguous: {
      // Rank r's first query reaches W − 1 tokens back: ⌈(W − 1)/c⌉ chunks before its own.
      const int64_t chunk = seq / world;
      return static_cast<int>(std::min<int64_t>(world, 1 + (window - 1 + chunk - 1) / chunk));
    }
    case TokenLayout::ZigZag:
      // Rank r's late chunk 2N − 1 − r starts right after chunk 2N − 2 − r, which rank r + 1
      // holds: the ring brings it at step N − 1. Any window of two keys or more needs it.
      return window == 1 ? 1 : world;
    case TokenLayout::Stripe:
      // The W − 1 tokens before a token sit on the W − 1 ranks before its own.
      return static_cast<int>(std::min<int64_t>(world, window));
  }
  CP_FAIL("unknown layout");
  // END SOLUTION
}

int64_t masked_work(const torch::Tensor& positions, const SequenceMask& mask, int64_t tokens) {
  const std::vector<int64_t> cu = checked_bounds(mask, tokens);
  CP_CHECK(positions.defined() && positions.dim() == 1 && positions.scalar_type() == torch::kLong,
           "positions: expected an int64 1-D tensor");
  const torch::Tensor pos = positions.cpu().contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  int64_t work = 0;
  for (int64_t i = 0; i < pos.numel(); ++i) {
    if (p[i] < 0 || p[i] >= tokens) continue;  // padding: no work
    // The query's document [begin, end): the last boundary at or before it, and the next one.
    const auto next = std::upper_bound(cu.begin(), cu.end(), p[i]);
    const int64_t begin = *(next - 1), end = *next;
    // BEGIN SOLUTION task 4: the visible keys of one query
    // STUB: // TODO(lesson 12, task 4): add the number of keys the query at p[i] sees: its document [begin, end),
    // STUB: // causal or not, within the window. README, "Task 4 — `masked_work`".
    // STUB: (void)begin, (void)end;
    // STUB: throw NotImplemented("lesson 12, task 4: masked_work");
    if (!mask.causal) {
      work += end - begin;
      continue;
    }
    const int64_t first = mask.window > 0 ? std::max(begin, p[i] - mask.window + 1) : begin;
    work += p[i] - first + 1;
    // END SOLUTION
  }
  return work;
}

double imbalance(const std::vector<int64_t>& work) {
  if (work.empty()) return 1.0;
  const int64_t total = std::accumulate(work.begin(), work.end(), int64_t{0});
  if (total == 0) return 1.0;
  const double mean = static_cast<double>(total) / static_cast<double>(work.size());
  return static_cast<double>(*std::max_element(work.begin(), work.end())) / mean;
}

PaddedLayout padded_layout(TokenLayout layout, int64_t tokens, int world) {
  CP_CHECK(world >= 1, "world: must be at least 1, got ", world);
  CP_CHECK(tokens >= 0, "tokens: must be at least 0, got ", tokens);
  const int64_t parts = layout == TokenLayout::ZigZag ? 2 * world : world;
  const int64_t padded = (tokens + parts - 1) / parts * parts;
  PaddedLayout result{to_string(layout), tokens, padded / world, {}};
  for (int r = 0; r < world; ++r) result.positions.push_back(layout_positions(layout, padded, world, r));
  return result;
}

PaddedLayout document_zigzag_layout(const torch::Tensor& documents, int world) {
  CP_CHECK(world >= 1, "world: must be at least 1, got ", world);
  CP_CHECK(documents.defined(), "documents: cu_seqlens must be given");
  SequenceMask mask;
  mask.documents = documents;
  const int64_t tokens = documents.numel() ? documents.cpu()[-1].item<int64_t>() : 0;
  const std::vector<int64_t> cu = checked_bounds(mask, tokens);
  std::vector<std::vector<int64_t>> rows(world);
  int64_t next_padding = tokens;  // padding slots get T, T + 1, …
  // BEGIN SOLUTION task 5: zig-zag per document, padded
  // STUB: // TODO(lesson 12, task 5): every document laid out as lesson 07's zig-zag lays out a sequence, for any
  // STUB: // length; padding at positions no document holds. README, "Task 5 — `document_zigzag_layout`".
  // STUB: (void)cu, (void)next_padding;
  // STUB: throw NotImplemented("lesson 12, task 5: document_zigzag_layout");
  const int64_t parts = 2 * world;
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t length = cu[d + 1] - cu[d];
    const int64_t c = (length + parts - 1) / parts;  // tokens per chunk, the last chunks padded
    for (int r = 0; r < world; ++r)
      for (int64_t piece : {int64_t{r}, parts - 1 - r})
        for (int64_t i = piece * c; i < (piece + 1) * c; ++i) rows[r].push_back(i < length ? cu[d] + i : next_padding++);
  }
  // END SOLUTION
  PaddedLayout result{"zig-zag per document", tokens, static_cast<int64_t>(rows[0].size()), {}};
  for (int r = 0; r < world; ++r) {
    CP_CHECK(static_cast<int64_t>(rows[r].size()) == result.rows, "document_zigzag_layout: rank ", r, " got ",
             rows[r].size(), " rows, rank 0 got ", result.rows);
    result.positions.push_back(torch::tensor(rows[r], torch::kLong));
  }
  return result;
}

double padding_overhead(const PaddedLayout& layout) {
  if (layout.tokens == 0) return 0.0;
  const int64_t rows = layout.rows * static_cast<int64_t>(layout.positions.size());
  return static_cast<double>(rows - layout.tokens) / static_cast<double>(layout.tokens);
}

namespace {
void check_layout_world(const PaddedLayout& layout, int world, const char* what) {
  CP_CHECK(static_cast<int>(layout.positions.size()) == world, what, ": the layout is for ", layout.positions.size(),
           " ranks, not ", world);
}
}  // namespace

torch::Tensor shard_padded(const torch::Tensor& full, const PaddedLayout& layout, int rank) {
  CP_CHECK(full.defined() && full.dim() == 4 && full.size(2) == layout.tokens, "full: expected [B, H, T = ",
           layout.tokens, ", D], got ", full.defined() ? full.sizes() : torch::IntArrayRef{});
  CP_CHECK(rank >= 0 && rank < static_cast<int>(layout.positions.size()), "rank: ", rank, " is not in the layout's ",
           layout.positions.size(), " ranks");
  const torch::Tensor pos = layout.positions[rank].to(full.device());
  const torch::Tensor real_rows = (pos < layout.tokens).nonzero().view(-1);
  torch::Tensor shard = torch::zeros({full.size(0), full.size(1), layout.rows, full.size(3)}, full.options());
  shard.index_copy_(2, real_rows, full.index_select(2, pos.index_select(0, real_rows)));
  return shard;
}

torch::Tensor unshard_padded(const std::vector<torch::Tensor>& shards, const PaddedLayout& layout) {
  check_layout_world(layout, static_cast<int>(shards.size()), "unshard_padded");
  CP_CHECK(shards[0].defined() && shards[0].dim() == 4 && shards[0].size(2) == layout.rows,
           "unshard_padded: shards must be [B, H, rows = ", layout.rows, ", D]");
  torch::Tensor full = torch::zeros({shards[0].size(0), shards[0].size(1), layout.tokens, shards[0].size(3)},
                                    shards[0].options());
  for (size_t r = 0; r < shards.size(); ++r) {
    CP_CHECK(shards[r].sizes() == shards[0].sizes(), "unshard_padded: shard ", r, " has shape ", shards[r].sizes(),
             ", shard 0 has ", shards[0].sizes());
    const torch::Tensor pos = layout.positions[r].to(full.device());
    const torch::Tensor real_rows = (pos < layout.tokens).nonzero().view(-1);
    full.index_copy_(2, pos.index_select(0, real_rows), shards[r].index_select(2, real_rows));
  }
  return full;
}

RingSchedule layout_schedule(const PaddedLayout& layout) {
  RingSchedule schedule;
  schedule.positions = [layout](int rank, int world, int64_t chunk, torch::Device device) {
    check_layout_world(layout, world, "layout_schedule");
    CP_CHECK(chunk == layout.rows, "layout_schedule: every rank holds ", layout.rows, " rows of the layout, not ", chunk);
    return layout.positions[rank].to(device);
  };
  schedule.plan = [](int, int, int, int64_t chunk, bool causal) { return BlockPlan{true, 0, chunk, 0, chunk, causal}; };
  return schedule;
}

namespace {
/// The options of a masked ring call: the layout's schedule refined by the mask, where padding
/// (positions >= T) lies outside every document, so that it never attends and is never attended.
RingOptions masked_options(Comm& comm, const PaddedLayout& layout, const SequenceMask& mask, RingOptions options) {
  check_sequence_mask(mask, layout.tokens);
  check_layout_world(layout, comm.size(), "layout");
  SequenceMask with_padding = mask;
  if (!with_padding.documents.defined()) with_padding.documents = torch::tensor(std::vector<int64_t>{0, layout.tokens});
  options.causal = mask.causal;
  options.schedule = masked_schedule(layout_schedule(layout), with_padding);
  return options;
}
}  // namespace

RingResult masked_ring_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const PaddedLayout& layout,
                                         const SequenceMask& mask, RingOptions options) {
  return ring_attention_forward(comm, q, k, v, masked_options(comm, layout, mask, std::move(options)));
}

RingGrads masked_ring_attention_backward(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q,
                                         const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                         const torch::Tensor& lse, const PaddedLayout& layout,
                                         const SequenceMask& mask, RingOptions options) {
  return ring_attention_backward(comm, dout, q, k, v, out, lse,
                                 masked_options(comm, layout, mask, std::move(options)));
}

namespace {

/// The chunks of the windowed gather: rank r needs the `behind` ranks before it (at most r).
int gather_depth(int64_t window, int64_t chunk, int world) {
  CP_CHECK(window >= 1, "window: must be at least 1, got ", window);
  if (chunk == 0) return 0;
  return static_cast<int>(std::min<int64_t>(world - 1, (window - 1 + chunk - 1) / chunk));
}

/// Sends `mine` to the `depth` ranks after this one and receives theirs from the `depth` before,
/// all at once; returns the chunks of ranks r − g … r (g = min(r, depth)) concatenated along the
/// sequence, and adds the bytes sent to `bytes`.
torch::Tensor gather_behind(Comm& comm, const torch::Tensor& mine, int depth, int64_t& bytes) {
  const int r = comm.rank(), n = comm.size(), g = std::min(r, depth);
  std::vector<torch::Tensor> chunks(g + 1);
  std::vector<P2POp> ops;
  for (int d = 1; d <= depth && r + d < n; ++d) {
    ops.push_back(P2POp::send(mine, r + d));
    bytes += mine.numel() * mine.element_size();
  }
  for (int d = 1; d <= g; ++d) {
    chunks[g - d] = torch::empty_like(mine);
    ops.push_back(P2POp::recv(chunks[g - d], r - d));
  }
  comm.start(ops).wait();
  chunks[g] = mine;
  return torch::cat(chunks, 2);
}

/// The window mask of rank r's queries against the gathered chunks r − g … r.
AttentionMask gathered_mask(int rank, int g, int64_t chunk, int64_t window, torch::Device device) {
  const auto long_on = torch::TensorOptions().dtype(torch::kLong).device(device);
  AttentionMask mask{true, torch::arange(rank * chunk, (rank + 1) * chunk, long_on),
                     torch::arange((rank - g) * chunk, (rank + 1) * chunk, long_on)};
  mask.window = window;
  return mask;
}

}  // namespace

RingResult windowed_gather_attention_forward(Comm& comm, const torch::Tensor& q, const torch::Tensor& k,
                                             const torch::Tensor& v, int64_t window, std::optional<double> scale) {
  RingOptions options;  // the ring's checks: shapes, the same on every rank
  const int64_t chunk = check_ring_inputs(comm, q, k, v, options);
  const int depth = gather_depth(window, chunk, comm.size()), g = std::min(comm.rank(), depth);
  RingResult result;
  const torch::Tensor kv = gather_behind(comm, torch::cat({k, v}, 1).contiguous(), depth, result.stats.bytes_sent);
  const int64_t hkv = k.size(1);
  const AttnResult a = attention_block_forward(q, kv.narrow(1, 0, hkv), kv.narrow(1, hkv, hkv),
                                               gathered_mask(comm.rank(), g, chunk, window, q.device()), scale);
  result.out = a.out;
  result.lse = a.lse;
  result.stats.steps_computed = 1;
  result.stats.steps.push_back({comm.rank(), chunk * (g + 1) * chunk, 0.0});
  return result;
}

RingGrads windowed_gather_attention_backward(Comm& comm, const torch::Tensor& dout, const torch::Tensor& q,
                                             const torch::Tensor& k, const torch::Tensor& v,
                                             const torch::Tensor& out, const torch::Tensor& lse, int64_t window,
                                             std::optional<double> scale) {
  RingOptions options;
  const int64_t chunk = check_ring_inputs(comm, q, k, v, options);
  const int r = comm.rank(), n = comm.size();
  const int depth = gather_depth(window, chunk, n), g = std::min(r, depth);
  RingGrads result;
  const torch::Tensor kv = gather_behind(comm, torch::cat({k, v}, 1).contiguous(), depth, result.stats.bytes_sent);
  const int64_t hkv = k.size(1);
  const AttnGrads a = attention_block_backward(dout, q, kv.narrow(1, 0, hkv), kv.narrow(1, hkv, hkv), out, lse,
                                               gathered_mask(r, g, chunk, window, q.device()), scale);
  // dK/dV of chunk r − d go back to rank r − d; ours come from the ranks after us that saw it.
  const torch::Tensor dkv = torch::cat({a.dk, a.dv}, 1);  // [B, 2·Hkv, (g + 1)·c, D] float32
  std::vector<P2POp> ops;
  for (int d = 1; d <= g; ++d) {
    const torch::Tensor part = dkv.narrow(2, (g - d) * chunk, chunk).contiguous();
    ops.push_back(P2POp::send(part, r - d));
    result.stats.bytes_sent += part.numel() * part.element_size();
  }
  std::vector<torch::Tensor> arriving;
  for (int d = 1; d <= depth && r + d < n; ++d) {
    arriving.push_back(torch::empty({dkv.size(0), dkv.size(1), chunk, dkv.size(3)}, dkv.options()));
    ops.push_back(P2POp::recv(arriving.back(), r + d));
  }
  comm.start(ops).wait();
  torch::Tensor own = dkv.narrow(2, g * chunk, chunk).clone();
  for (const torch::Tensor& t : arriving) own.add_(t);
  result.dq = a.dq.to(q.scalar_type());
  result.dk = own.narrow(1, 0, hkv).to(k.scalar_type());
  result.dv = own.narrow(1, hkv, hkv).to(v.scalar_type());
  result.stats.steps_computed = 1;
  return result;
}

Strategy masked_ring_strategy(TokenLayout layout, const SequenceMask& mask) {
  CP_CHECK(mask.causal, "mask.causal: the layer's strategies are causal");
  CP_CHECK(layout != TokenLayout::Stripe, "layout: the stripe layout has no ring strategy (lesson 07)");
  std::string name = layout == TokenLayout::ZigZag ? "zig-zag ring" : "ring";
  if (mask.window > 0) name += " W=" + std::to_string(mask.window);
  if (mask.documents.defined()) name += ", " + std::to_string(mask.documents.numel() - 1) + " docs";
  auto padded = [layout](Comm& comm, const torch::Tensor& q) {  // the layout of this call's S = N · rows
    return padded_layout(layout, q.size(2) * comm.size(), comm.size());
  };
  return ring_family_strategy(
      name, layout,
      [mask, padded](Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     RingOptions options) {
        return masked_ring_attention_forward(comm, q, k, v, padded(comm, q), mask, std::move(options));
      },
      [mask, padded](Comm& comm, const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse, RingOptions options) {
        return masked_ring_attention_backward(comm, dout, q, k, v, out, lse, padded(comm, q), mask,
                                              std::move(options));
      });
}

}  // namespace cp
