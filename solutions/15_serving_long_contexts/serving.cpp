// Lesson 15 — serving long contexts: the sharded cache, the two prefills, the choice, decode.
#include "serving.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/error.h"
#include "common/tensor_checks.h"
#include "kernels/cpu_decode.h"

namespace cp {

std::string to_string(PrefillVariant variant) { return variant == PrefillVariant::PassKV ? "pass-KV" : "pass-Q"; }
std::string to_string(DecodeMerge merge) { return merge == DecodeMerge::Gather ? "gather" : "tree"; }

// ── The cache (given) ───────────────────────────────────────────────────────────────────────

KvCacheShard empty_cache_shard(int64_t heads_kv, int64_t head_dim, const torch::TensorOptions& options) {
  CP_CHECK(heads_kv >= 1 && head_dim >= 1, "empty_cache_shard: heads_kv and head_dim must be at least 1, got ",
           heads_kv, " and ", head_dim);
  return {torch::empty({1, heads_kv, 0, head_dim}, options), torch::empty({1, heads_kv, 0, head_dim}, options),
          torch::empty({0}, options.dtype(torch::kLong))};
}

void check_cache_shard(const KvCacheShard& shard, const std::string& arg) {
  const std::string k = arg + ".k", v = arg + ".v", pos = arg + ".positions";
  check_defined(shard.k, k.c_str(), 4);
  CP_CHECK(shard.k.dim() == 4 && shard.k.size(0) == 1, k, ": expected [1, Hkv, n, D], got ", shard.k.sizes());
  CP_CHECK(shard.v.defined() && shard.v.sizes() == shard.k.sizes() && shard.v.scalar_type() == shard.k.scalar_type() &&
               shard.v.device() == shard.k.device(),
           v, ": expected the shape, dtype and device of ", k, " ", shard.k.sizes(), ", got ",
           shard.v.defined() ? shard.v.sizes() : torch::IntArrayRef{});
  CP_CHECK(shard.positions.defined() && shard.positions.dim() == 1 && shard.positions.size(0) == shard.k.size(2) &&
               shard.positions.scalar_type() == torch::kLong && shard.positions.device() == shard.k.device(),
           pos, ": expected int64 [", shard.k.size(2), "] (one per cached token) on ", shard.k.device(), ", got ",
           shard.positions.defined() ? shard.positions.sizes() : torch::IntArrayRef{});
  CP_CHECK(shard.positions.numel() == 0 || shard.positions.min().item<int64_t>() >= 0, pos,
           ": positions must not be negative");
}

namespace {

/// Appends `rows` to t along dim, in place. A decode step appends one token, and torch::cat would
/// copy the whole shard for it, twice the bytes the step's attention reads. So t is kept as the
/// first rows of a larger buffer (std::vector's idea), and the new rows are copied into its room;
/// a full buffer is replaced by one an eighth larger (at least 64 rows more), which costs a few
/// rows a step on average. The room is written only where t alone holds the buffer: a copy of the
/// shard or a view of t shares it, and then t moves to a new buffer first.
void append_rows(torch::Tensor& t, const torch::Tensor& rows, int64_t dim) {
  const int64_t n = t.size(dim), total = n + rows.size(dim);
  int64_t row_elements = 1;
  for (int64_t i = 0; i < t.dim(); ++i) row_elements *= i == dim ? 1 : t.size(i);
  std::vector<int64_t> shape = t.sizes().vec();  // the buffer behind t, if t is the start of one
  shape[dim] = row_elements ? static_cast<int64_t>(t.storage().nbytes()) / t.element_size() / row_elements : 0;
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = t.dim() - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
  const bool has_room = t.use_count() == 1 && t.storage().use_count() == 1 && t.storage_offset() == 0 &&
                        shape[dim] >= total && t.strides() == torch::IntArrayRef(strides);
  // t becomes a tensor of its own (not a view, which would keep the old tensor and its buffer)
  // over the first `total` rows of the buffer.
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[dim] = total;
  torch::Tensor grown = torch::empty({0}, t.options());
  if (has_room) {
    grown.set_(t.storage(), 0, sizes, strides);
  } else {
    shape[dim] = total + std::max<int64_t>(total / 8, 64);
    const torch::Tensor buffer = torch::empty(shape, t.options());
    buffer.narrow(dim, 0, n).copy_(t);
    grown.set_(buffer.storage(), 0, sizes, buffer.strides());
  }
  t = grown;
  t.narrow(dim, n, total - n).copy_(rows);
}

}  // namespace

void cache_append(KvCacheShard& shard, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& positions) {
  append_rows(shard.k, k, 2);
  append_rows(shard.v, v, 2);
  append_rows(shard.positions, positions, 0);
}

// ── Task 1: where the tokens live ───────────────────────────────────────────────────────────

torch::Tensor prefill_positions(int64_t first, int64_t count, int world, int rank) {
  CP_CHECK(first >= 0 && count >= 0, "prefill_positions: first and count must not be negative, got ", first, " and ",
           count);
  CP_CHECK(world >= 1, "prefill_positions: world must be at least 1, got ", world);
  CP_CHECK(rank >= 0 && rank < world, "prefill_positions: rank ", rank, " is not in a world of ", world);
  // BEGIN SOLUTION task 1: the prefill's zig-zag over the new tokens
  // STUB: // TODO(lesson 15, task 1): the positions of parts r and 2N − 1 − r of the new tokens, cut into 2N
  // STUB: // parts as even as count allows. README, "Task 1".
  // STUB: throw NotImplemented("lesson 15, task 1: prefill_positions");
  const int64_t parts = 2 * static_cast<int64_t>(world);
  auto part = [&](int64_t i) {
    return torch::arange(first + i * count / parts, first + (i + 1) * count / parts, torch::kLong);
  };
  return torch::cat({part(rank), part(parts - 1 - rank)});
  // END SOLUTION
}

int decode_owner(int64_t position, int world) {
  CP_CHECK(position >= 0, "decode_owner: position must not be negative, got ", position);
  CP_CHECK(world >= 1, "decode_owner: world must be at least 1, got ", world);
  // BEGIN SOLUTION task 1: decode's round robin
  // STUB: // TODO(lesson 15, task 1): the rank that keeps the token at this position. README, "Task 1".
  // STUB: throw NotImplemented("lesson 15, task 1: decode_owner");
  return static_cast<int>(position % world);
  // END SOLUTION
}

// ── The checks every rank makes together (given) ────────────────────────────────────────────

namespace {

/// What every rank learns of every rank's inputs before anything else is sent.
struct Agreed {
  std::vector<int64_t> cached, fresh;  ///< per rank: tokens in its cache shard, new tokens
  std::vector<int64_t> shape;          ///< Hq, Hkv, D, dtype (the same on every rank)
};

/// Checks this rank's prefill inputs; returns its fields [n_cached, t, Hq, Hkv, D, dtype,
/// largest cached position, smallest new position]. Throws a cp::Error naming the argument.
std::vector<int64_t> local_prefill_fields(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& positions, const KvCacheShard& cache) {
  check_defined(q, "q", 4);
  check_float_dtype(q, "q");
  CP_CHECK(q.dim() == 4 && q.size(0) == 1, "q: expected [1, Hq, t, D], got ", q.sizes());
  for (const auto& [t, arg] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    check_defined(*t, arg, 4);
    CP_CHECK(t->dim() == 4 && t->size(0) == 1 && t->size(2) == q.size(2) && t->size(3) == q.size(3) &&
                 t->size(1) >= 1 && q.size(1) % t->size(1) == 0,
             arg, ": expected [1, Hkv, ", q.size(2), ", ", q.size(3), "] with Hkv dividing Hq = ", q.size(1), ", got ",
             t->sizes());
    CP_CHECK(t->scalar_type() == q.scalar_type() && t->device() == q.device(), arg, ": expected q's dtype ",
             q.scalar_type(), " on ", q.device(), ", got ", t->scalar_type(), " on ", t->device());
  }
  CP_CHECK(v.size(1) == k.size(1), "v: expected k's ", k.size(1), " heads, got ", v.size(1));
  CP_CHECK(positions.defined() && positions.dim() == 1 && positions.size(0) == q.size(2) &&
               positions.scalar_type() == torch::kLong,
           "positions: expected int64 [", q.size(2), "] (one per new token), got ",
           positions.defined() ? positions.sizes() : torch::IntArrayRef{});
  check_cache_shard(cache, "cache");
  CP_CHECK(cache.k.size(1) == k.size(1) && cache.k.size(3) == k.size(3) && cache.k.scalar_type() == k.scalar_type() &&
               cache.k.device() == k.device(),
           "cache.k: expected k's heads and head size [1, ", k.size(1), ", n, ", k.size(3), "] in ", k.scalar_type(),
           " on ", k.device(), ", got ", cache.k.sizes(), " ", cache.k.scalar_type(), " on ", cache.k.device());
  const int64_t none = std::numeric_limits<int64_t>::max();
  return {cache.k.size(2),
          q.size(2),
          q.size(1),
          k.size(1),
          q.size(3),
          static_cast<int64_t>(q.scalar_type()),
          cache.positions.numel() ? cache.positions.max().item<int64_t>() : -1,
          positions.numel() ? positions.min().item<int64_t>() : none};
}

/// The message for shards that do not hold each of a sequence's `length` positions once.
std::string missing_tokens(const std::string& arg, int64_t held, int64_t length) {
  return detail::concat(arg, ": the ranks' shards hold ", held, " tokens, but the sequence has ", length,
                        " before its new ones: each position must be in exactly one shard (was the cache sharded "
                        "over a world of another size?)");
}

/// Every rank's fields and error message together (common/tensor_checks.h), so that a bad input
/// anywhere is a cp::ErrorOnEveryRank everywhere and nobody waits for a send.
Agreed agree(Comm& comm, torch::Device device, const std::string& error, std::vector<int64_t> fields) {
  const std::vector<std::vector<int64_t>> every = agree_on_every_rank(comm, device, error, std::move(fields));
  Agreed agreed;
  int64_t last_cached = -1, first_new = std::numeric_limits<int64_t>::max();
  for (int r = 0; r < comm.size(); ++r) {
    const int64_t* f = every[r].data();
    agreed.cached.push_back(f[0]);
    agreed.fresh.push_back(f[1]);
    const std::vector<int64_t> shape(f + 2, f + 6);
    if (r == 0) agreed.shape = shape;
    if (shape != agreed.shape)
      throw ErrorOnEveryRank(detail::concat("q, k: every rank must pass the same Hq, Hkv, D and dtype; rank 0 has ",
                                            torch::IntArrayRef(agreed.shape), ", rank ", r, " has ",
                                            torch::IntArrayRef(shape), " (Hq, Hkv, D, dtype)"),
                             __FILE__, __LINE__);
    last_cached = std::max(last_cached, f[6]);
    first_new = std::min(first_new, f[7]);
  }
  if (last_cached >= first_new)
    throw ErrorOnEveryRank(detail::concat("positions: every new token must come after every cached one; a cache holds "
                                          "position ",
                                          last_cached, ", a new token is at ", first_new),
                           __FILE__, __LINE__);
  int64_t total_cached = 0;
  for (int64_t c : agreed.cached) total_cached += c;
  if (total_cached != last_cached + 1) throw ErrorOnEveryRank(missing_tokens("cache", total_cached, last_cached + 1), __FILE__, __LINE__);
  return agreed;
}

Agreed check_prefill_inputs(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& positions, const KvCacheShard& cache) {
  std::string error;
  std::vector<int64_t> fields;
  try {
    fields = local_prefill_fields(q, k, v, positions, cache);
  } catch (const Error& e) {
    error = e.what();
  }
  return agree(comm, q.defined() ? q.device() : torch::Device(torch::kCPU), error, fields);
}

/// One query row per head on the CPU (a decode step): kernels/cpu_decode.h reads the cache where
/// it lies, each row of a kv head once for the query heads that share it.
AttnResult attend_one_row_cpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              int64_t q_pos, const torch::Tensor& k_pos, std::optional<double> scale) {
  const int64_t batch = q.size(0), heads_q = q.size(1), heads_kv = k.size(1), n = k.size(2), d = q.size(3);
  const int64_t group = heads_q / heads_kv;
  const float softmax_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(d))));
  // The kernel reads float32 rows of d floats; a shard's k and v are (cache_append's buffers).
  auto float_rows = [d](const torch::Tensor& t) {
    return t.scalar_type() == torch::kFloat && t.stride(3) == 1 && t.stride(2) == d ? t : t.to(torch::kFloat).contiguous();
  };
  const torch::Tensor qf = q.to(torch::kFloat).contiguous(), kf = float_rows(k), vf = float_rows(v);
  const torch::Tensor kp = k_pos.contiguous();
  const auto f32 = q.options().dtype(torch::kFloat);
  torch::Tensor out = torch::empty({batch, heads_q, 1, d}, f32), lse = torch::empty({batch, heads_q, 1}, f32);
  std::vector<float> work(group * (d + kernels::kDecodeBlock + 2));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads_kv; ++h) {
      const int64_t row = b * heads_q + h * group;  // the group's first query head
      const kernels::ContiguousKeys keys{kf.data_ptr<float>() + b * kf.stride(0) + h * kf.stride(1),
                                         vf.data_ptr<float>() + b * vf.stride(0) + h * vf.stride(1),
                                         kp.data_ptr<int64_t>(), q_pos, d};
      kernels::simd_call<kernels::DecodeAttend>(qf.data_ptr<float>() + row * d, group, keys, n, d, d, softmax_scale,
                                                out.data_ptr<float>() + row * d, lse.data_ptr<float>() + row,
                                                work.data());
    }
  return {out.to(q.scalar_type()), lse};
}

/// Causal attention of queries at q_pos over keys at k_pos: lesson 03's, or for one query row on
/// the CPU the decode kernel.
AttnResult attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& q_pos,
                  const torch::Tensor& k_pos, std::optional<double> scale) {
  if (q.device().is_cpu() && q.size(2) == 1) return attend_one_row_cpu(q, k, v, q_pos.item<int64_t>(), k_pos, scale);
  AttentionMask mask;
  mask.causal = true;
  mask.q_positions = q_pos.to(q.device());
  mask.k_positions = k_pos.to(q.device());
  return attention_block_forward(q, k, v, mask, scale);
}

/// Float32 accumulators that hold nothing yet: out 0, lse −inf.
std::pair<torch::Tensor, torch::Tensor> empty_accumulators(const torch::Tensor& q) {
  const auto f32 = q.options().dtype(torch::kFloat);
  return {torch::zeros(q.sizes(), f32),
          torch::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<float>::infinity(), f32)};
}

}  // namespace

// ── Tasks 2 and 3: the prefill ──────────────────────────────────────────────────────────────

int64_t prefill_bytes(PrefillVariant variant, const std::vector<int64_t>& cached, const std::vector<int64_t>& fresh,
                      int rank, int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t element_size) {
  const int n = static_cast<int>(fresh.size());
  CP_CHECK(n >= 1 && cached.size() == fresh.size() && rank >= 0 && rank < n,
           "prefill_bytes: one cached and one new count per rank, and a rank of the world");
  const int next = (rank + 1) % n;
  int64_t total_cached = 0, total_fresh = 0;
  for (int r = 0; r < n; ++r) total_cached += cached[r], total_fresh += fresh[r];
  if (n == 1) return 0;
  if (variant == PrefillVariant::PassKV)
    return (2 * heads_kv * head_dim * element_size + 8) * (total_cached + total_fresh - cached[next] - fresh[next]);
  const int64_t partial = heads_q * head_dim * element_size + 4 * heads_q;
  return (heads_q * head_dim * element_size + 8) * (total_fresh - fresh[next]) + partial * (total_fresh - fresh[rank]);
}

PrefillResult pass_kv_prefill(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& positions, KvCacheShard& cache, std::optional<double> scale,
                              Trace* trace) {
  const Agreed agreed = check_prefill_inputs(comm, q, k, v, positions, cache);
  const int p = comm.size(), rank = comm.rank(), next = (rank + 1) % p, prev = (rank + p - 1) % p;
  PrefillResult result;
  // BEGIN SOLUTION task 2: pass-KV
  // STUB: // TODO(lesson 15, task 2): this rank's K/V (its cache shard and its new tokens, with their positions)
  // STUB: // around the ring; the new queries attend every block with the causal mask of global positions; the
  // STUB: // new k, v end in the cache. README, "Task 2".
  // STUB: (void)agreed, (void)next, (void)prev, (void)scale, (void)trace, (void)result;
  // STUB: throw NotImplemented("lesson 15, task 2: pass_kv_prefill");
  const torch::Tensor q_pos = positions.to(q.device());
  torch::Tensor blk_k = torch::cat({cache.k, k}, 2).contiguous(), blk_v = torch::cat({cache.v, v}, 2).contiguous();
  torch::Tensor blk_pos = torch::cat({cache.positions, q_pos});
  auto [out, lse] = empty_accumulators(q);
  for (int step = 0; step < p; ++step) {
    // The block arriving next is the previous rank's block of the step before: its length is known.
    const int source = (rank - step - 1 + 2 * p) % p;
    const int64_t n_next = agreed.cached[source] + agreed.fresh[source];
    torch::Tensor next_k, next_v, next_pos;
    Request pending;
    if (step + 1 < p) {
      std::vector<int64_t> shape = blk_k.sizes().vec();
      shape[2] = n_next;
      next_k = torch::empty(shape, blk_k.options());
      next_v = torch::empty(shape, blk_v.options());
      next_pos = torch::empty({n_next}, blk_pos.options());
      pending = comm.start({P2POp::send(blk_k, next), P2POp::send(blk_v, next), P2POp::send(blk_pos, next),
                            P2POp::recv(next_k, prev), P2POp::recv(next_v, prev), P2POp::recv(next_pos, prev)});
      result.bytes_sent += blk_k.numel() * blk_k.element_size() * 2 + blk_pos.numel() * 8;
    }
    {
      const TraceSpan span(trace, rank, "compute", "step " + std::to_string(step));
      const AttnResult blk = attend(q, blk_k, blk_v, q_pos, blk_pos, scale);  // while the next block travels
      merge_attention(out, lse, blk.out, blk.lse);
    }
    if (step + 1 < p) {
      pending.wait();
      blk_k = next_k, blk_v = next_v, blk_pos = next_pos;
    }
  }
  result.out = out.to(q.scalar_type());
  result.lse = lse;
  cache_append(cache, k, v, q_pos);
  // END SOLUTION
  return result;
}

PrefillResult pass_q_prefill(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& positions, KvCacheShard& cache, std::optional<double> scale,
                             Trace* trace) {
  const Agreed agreed = check_prefill_inputs(comm, q, k, v, positions, cache);
  const int p = comm.size(), rank = comm.rank(), next = (rank + 1) % p, prev = (rank + p - 1) % p;
  PrefillResult result;
  // BEGIN SOLUTION task 3: pass-Q
  // STUB: // TODO(lesson 15, task 3): append the new k, v to the cache; the queries (with their positions) around
  // STUB: // the ring, each rank attending the visitors with its own K/V; each partial (out, lse) back to the
  // STUB: // queries' owner, which merges them. README, "Task 3".
  // STUB: (void)agreed, (void)next, (void)prev, (void)scale, (void)trace, (void)result;
  // STUB: throw NotImplemented("lesson 15, task 3: pass_q_prefill");
  const torch::Tensor q_pos = positions.to(q.device());
  cache_append(cache, k, v, q_pos);  // the new K/V join this rank's own: the queries come to them
  // partials[j]: this rank's partial result for rank j's queries.
  std::vector<AttnResult> partials(p);
  torch::Tensor visitor = q.contiguous(), visitor_pos = q_pos;
  for (int step = 0; step < p; ++step) {
    const int owner = (rank - step + p) % p, source = (rank - step - 1 + 2 * p) % p;
    torch::Tensor next_q, next_pos;
    Request pending;
    if (step + 1 < p) {
      std::vector<int64_t> shape = visitor.sizes().vec();
      shape[2] = agreed.fresh[source];
      next_q = torch::empty(shape, visitor.options());
      next_pos = torch::empty({agreed.fresh[source]}, visitor_pos.options());
      pending = comm.start({P2POp::send(visitor, next), P2POp::send(visitor_pos, next), P2POp::recv(next_q, prev),
                            P2POp::recv(next_pos, prev)});
      result.bytes_sent += visitor.numel() * visitor.element_size() + visitor_pos.numel() * 8;
    }
    {
      const TraceSpan span(trace, rank, "compute", "step " + std::to_string(step));
      partials[owner] = attend(visitor, cache.k, cache.v, visitor_pos, cache.positions, scale);
    }
    if (step + 1 < p) {
      pending.wait();
      visitor = next_q, visitor_pos = next_pos;
    }
  }
  // Every partial home: rank j's to rank j, and this rank's own from every other.
  std::vector<AttnResult> mine(p);
  std::vector<P2POp> ops;
  for (int j = 0; j < p; ++j) {
    if (j == rank) {
      mine[j] = partials[j];
      continue;
    }
    const torch::Tensor out_j = partials[j].out.contiguous(), lse_j = partials[j].lse.contiguous();
    ops.push_back(P2POp::send(out_j, j));
    ops.push_back(P2POp::send(lse_j, j));
    result.bytes_sent += out_j.numel() * out_j.element_size() + lse_j.numel() * 4;
    mine[j] = {torch::empty_like(q), torch::empty({1, q.size(1), q.size(2)}, q.options().dtype(torch::kFloat))};
    ops.push_back(P2POp::recv(mine[j].out, j));
    ops.push_back(P2POp::recv(mine[j].lse, j));
  }
  comm.start(ops).wait();
  auto [out, lse] = empty_accumulators(q);
  for (int j = 0; j < p; ++j) merge_attention(out, lse, mine[j].out, mine[j].lse);
  result.out = out.to(q.scalar_type());
  result.lse = lse;
  // END SOLUTION
  return result;
}

// ── Task 4: which prefill ───────────────────────────────────────────────────────────────────

PrefillChoice choose_prefill(const PrefillCase& c, const Cluster& cluster) {
  CP_CHECK(c.new_tokens >= 0 && c.cached_tokens >= 0 && c.world >= 1 && c.heads_q >= 1 && c.heads_kv >= 1 &&
               c.heads_q % c.heads_kv == 0 && c.head_dim >= 1 && c.element_size >= 1,
           "choose_prefill: T, P >= 0, N >= 1, Hkv dividing Hq, D and the element size >= 1; got T = ", c.new_tokens,
           ", P = ", c.cached_tokens, ", N = ", c.world, ", Hq = ", c.heads_q, ", Hkv = ", c.heads_kv, ", D = ",
           c.head_dim, ", e = ", c.element_size);
  CP_CHECK(cluster.forward_tflops > 0 && cluster.intra.gbytes_per_s > 0, "cluster: ", cluster.name,
           " has no forward throughput or NVLink bandwidth");
  PrefillChoice choice;
  // BEGIN SOLUTION task 4: the two predictions and the choice
  // STUB: // TODO(lesson 15, task 4): each variant's N steps (compute or transfer, whichever is longer), pass-Q's
  // STUB: // return of the partials, the faster of the two and why. README, "Task 4".
  // STUB: (void)choice;
  // STUB: throw NotImplemented("lesson 15, task 4: choose_prefill");
  const double n = c.world, t = static_cast<double>(c.new_tokens), cached = static_cast<double>(c.cached_tokens);
  const double e = static_cast<double>(c.element_size), flops_per_pair = 4.0 * c.head_dim * c.heads_q;
  // The whole prefill computes T·P pairs without a mask (new queries, cached keys) and a causal
  // call over the T new tokens (T²/2 pairs) at lesson 14's causal rate for a diagonal of T rows;
  // the ring spreads it evenly over N ranks and N steps.
  const double unmasked_ms = t * cached * flops_per_pair / (cluster.forward_tflops * 1e9);
  const double causal_ms = t > 0 ? t * t / 2 * flops_per_pair / (forward_causal_tflops(cluster, t) * 1e9) : 0;
  const double compute_ms = (unmasked_ms + causal_ms) / (n * n);
  // One step's exchange is one batch of messages: one latency. Pass-KV sends an average rank's
  // block, (P + T)/N tokens of K/V; pass-Q its T/N queries; positions travel with both.
  auto link_ms = [&](double bytes) { return transfer_ms(static_cast<int64_t>(bytes), 1, cluster.intra); };
  const double kv_ms = link_ms((cached + t) / n * (2.0 * c.heads_kv * c.head_dim * e + 8));
  const double q_ms = link_ms(t / n * (c.heads_q * c.head_dim * e + 8));
  // N − 1 steps overlap a transfer, the last computes alone. Pass-Q then returns the partials of
  // the N − 1 other ranks' queries, (N − 1)·T/N rows, all sent at once: one batch, one latency.
  const double ring = n > 1 ? 1 : 0;
  choice.pass_kv_ms = (n - 1) * std::max(compute_ms, kv_ms) + compute_ms;
  choice.pass_q_ms = (n - 1) * std::max(compute_ms, q_ms) + compute_ms +
                     ring * link_ms(t / n * (n - 1) * (c.heads_q * c.head_dim * e + 4.0 * c.heads_q));
  choice.choice = choice.pass_q_ms < choice.pass_kv_ms ? PrefillVariant::PassQ : PrefillVariant::PassKV;
  const bool hidden_kv = kv_ms <= compute_ms, hidden_q = q_ms <= compute_ms;
  choice.reason = detail::concat(
      to_string(choice.choice), ": pass-KV ", choice.pass_kv_ms, " ms, pass-Q ", choice.pass_q_ms, " ms; ",
      hidden_kv ? "K/V transfers hide behind the compute" : "K/V transfers are exposed", ", ",
      hidden_q ? "query transfers hide" : "query transfers are exposed",
      n > 1 ? ", pass-Q's partials return after the ring" : "");
  // END SOLUTION
  return choice;
}

// ── Task 5: decode ──────────────────────────────────────────────────────────────────────────

DecodeVolume decode_bytes(DecodeMerge merge, int world, int rank, int64_t batch, int64_t heads_q, int64_t head_dim,
                          int64_t element_size) {
  CP_CHECK(world >= 1 && rank >= 0 && rank < world, "decode_bytes: rank ", rank, " is not in a world of ", world);
  DecodeVolume volume;
  if (world == 1) return volume;
  const int64_t rows = batch * heads_q;
  if (merge == DecodeMerge::Gather) {
    volume.bytes = (world - 1) * rows * (head_dim * element_size + 4);
    volume.rounds = 1;
    return volume;
  }
  int levels = 0;
  while ((1 << levels) < world) ++levels;
  volume.rounds = levels + 1;                                      // up the tree, then the broadcast
  if (rank != 0) volume.bytes = rows * (head_dim * 4 + 4);         // to its parent, in float32
  else volume.bytes = (world - 1) * rows * (head_dim * element_size + 4);  // the broadcast
  return volume;
}

namespace {

std::vector<int64_t> local_decode_fields(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         const torch::Tensor& positions, const std::vector<KvCacheShard>& caches) {
  check_defined(q, "q", 4);
  check_float_dtype(q, "q");
  CP_CHECK(q.dim() == 4 && q.size(2) == 1, "q: expected [B, Hq, 1, D] (one new token per sequence), got ", q.sizes());
  for (const auto& [t, arg] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    check_defined(*t, arg, 4);
    CP_CHECK(t->dim() == 4 && t->size(0) == q.size(0) && t->size(2) == 1 && t->size(3) == q.size(3) &&
                 t->size(1) >= 1 && q.size(1) % t->size(1) == 0 && t->scalar_type() == q.scalar_type() &&
                 t->device() == q.device(),
             arg, ": expected [", q.size(0), ", Hkv, 1, ", q.size(3), "] with Hkv dividing Hq = ", q.size(1), " in ",
             q.scalar_type(), " on ", q.device(), ", got ", t->sizes(), " ", t->scalar_type(), " on ", t->device());
  }
  CP_CHECK(v.size(1) == k.size(1), "v: expected k's ", k.size(1), " heads, got ", v.size(1));
  CP_CHECK(positions.defined() && positions.dim() == 1 && positions.size(0) == q.size(0) &&
               positions.scalar_type() == torch::kLong,
           "positions: expected int64 [", q.size(0), "] (one per sequence), got ",
           positions.defined() ? positions.sizes() : torch::IntArrayRef{});
  CP_CHECK(static_cast<int64_t>(caches.size()) == q.size(0), "caches: expected one shard per sequence (",
           q.size(0), "), got ", caches.size());
  const torch::Tensor pos = positions.cpu();
  for (size_t b = 0; b < caches.size(); ++b) {
    const std::string arg = "caches[" + std::to_string(b) + "]";
    check_cache_shard(caches[b], arg);
    CP_CHECK(caches[b].k.size(1) == k.size(1) && caches[b].k.size(3) == k.size(3) &&
                 caches[b].k.scalar_type() == k.scalar_type() && caches[b].k.device() == k.device(),
             arg, ".k: expected [1, ", k.size(1), ", n, ", k.size(3), "] in ", k.scalar_type(), " on ", k.device(),
             ", got ", caches[b].k.sizes(), " ", caches[b].k.scalar_type(), " on ", caches[b].k.device());
    const int64_t at = pos[b].item<int64_t>();
    CP_CHECK(caches[b].positions.numel() == 0 || caches[b].positions.max().item<int64_t>() < at, arg,
             ".positions: the cache holds position ", caches[b].positions.max().item<int64_t>(),
             ", at or after the new token's ", at);
  }
  // agree()'s fields: no prefill counts, the shape, no positions to order.
  return {0, 0, q.size(1), k.size(1), q.size(3), static_cast<int64_t>(q.scalar_type()), -1,
          std::numeric_limits<int64_t>::max()};
}

/// Every rank decodes the same positions (`pos`: int64 [B] on the CPU, contiguous), and sequence
/// b's shards hold its positions before pos[b], each once: one all-gather of [positions, tokens
/// held] (a cp::ErrorOnEveryRank).
void check_decode_batch(Comm& comm, torch::Device device, const torch::Tensor& pos,
                        const std::vector<KvCacheShard>& caches) {
  const int64_t batch = pos.size(0);
  std::vector<int64_t> row(pos.data_ptr<int64_t>(), pos.data_ptr<int64_t>() + batch);
  for (const KvCacheShard& shard : caches) row.push_back(shard.positions.size(0));
  const torch::Tensor all =
      comm.all_gather(torch::tensor(row, torch::kLong).to(device).unsqueeze(0)).cpu().view({comm.size(), 2, batch});
  for (int r = 1; r < comm.size(); ++r)
    if (!torch::equal(all[r][0], all[0][0]))
      throw ErrorOnEveryRank(detail::concat("positions: every rank decodes the same batch; rank 0 has ",
                                            torch::IntArrayRef(all[0][0].contiguous().data_ptr<int64_t>(), batch),
                                            ", rank ", r, " has ",
                                            torch::IntArrayRef(all[r][0].contiguous().data_ptr<int64_t>(), batch)),
                             __FILE__, __LINE__);
  const torch::Tensor held = all.select(1, 1).sum(0);
  for (int64_t b = 0; b < batch; ++b)
    if (held[b].item<int64_t>() != all[0][0][b].item<int64_t>())
      throw ErrorOnEveryRank(missing_tokens("caches[" + std::to_string(b) + "]", held[b].item<int64_t>(),
                                            all[0][0][b].item<int64_t>()),
                             __FILE__, __LINE__);
}

}  // namespace

DecodeResult decode_step(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& positions, std::vector<KvCacheShard>& caches, DecodeMerge merge,
                         std::optional<double> scale) {
  std::string error;
  std::vector<int64_t> fields;
  try {
    fields = local_decode_fields(q, k, v, positions, caches);
  } catch (const Error& e) {
    error = e.what();
  }
  agree(comm, q.defined() ? q.device() : torch::Device(torch::kCPU), error, fields);
  const torch::Tensor pos = positions.cpu().contiguous();
  check_decode_batch(comm, q.device(), pos, caches);
  const int p = comm.size(), rank = comm.rank();
  const int64_t batch = q.size(0);
  DecodeResult result;
  // BEGIN SOLUTION task 5: decode
  // STUB: // TODO(lesson 15, task 5): the new token into its owner's shard; each sequence's query over this rank's
  // STUB: // shard; the partials merged by a gather (every rank, in rank order) or a tree (up to rank 0, then a
  // STUB: // broadcast), identical on every rank. README, "Task 5".
  // STUB: (void)p, (void)rank, (void)pos, (void)batch, (void)merge, (void)scale, (void)result;
  // STUB: throw NotImplemented("lesson 15, task 5: decode_step");
  std::vector<torch::Tensor> outs, lses;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t at = pos[b].item<int64_t>();
    KvCacheShard& shard = caches[b];
    if (decode_owner(at, p) == rank)
      cache_append(shard, k.narrow(0, b, 1), v.narrow(0, b, 1), torch::tensor({at}, torch::kLong));
    const AttnResult part = attend(q.narrow(0, b, 1), shard.k, shard.v, torch::tensor({at}, torch::kLong),
                                   shard.positions, scale);
    outs.push_back(part.out);
    lses.push_back(part.lse);
  }
  const torch::Tensor out_part = torch::cat(outs), lse_part = torch::cat(lses);  // [B, Hq, 1, D], [B, Hq, 1]
  if (merge == DecodeMerge::Gather) {
    const torch::Tensor all_out = comm.all_gather(out_part.unsqueeze(0)), all_lse = comm.all_gather(lse_part.unsqueeze(0));
    if (p > 1) result.bytes_sent = (p - 1) * (out_part.numel() * out_part.element_size() + lse_part.numel() * 4);
    auto [out, lse] = empty_accumulators(q);
    for (int r = 0; r < p; ++r) merge_attention(out, lse, all_out[r], all_lse[r]);  // rank order, on every rank
    result.out = out.to(q.scalar_type());
    result.lse = lse;
    result.rounds = p > 1 ? 1 : 0;
  } else {
    auto [out, lse] = empty_accumulators(q);
    merge_attention(out, lse, out_part, lse_part);
    // Round i: a rank whose lowest set bit is 2^i sends its accumulator to rank − 2^i, which
    // merges it after its own (the lower ranks' keys first, the same order on every run).
    int levels = 0;
    for (int step = 1; step < p; step *= 2, ++levels) {
      if (rank % (2 * step) == step) {
        comm.send(out, rank - step);
        comm.send(lse, rank - step);
        result.bytes_sent += out.numel() * 4 + lse.numel() * 4;
      } else if (rank % (2 * step) == 0 && rank + step < p) {
        torch::Tensor their_out = torch::empty_like(out), their_lse = torch::empty_like(lse);
        comm.recv(their_out, rank + step);
        comm.recv(their_lse, rank + step);
        merge_attention(out, lse, their_out, their_lse);
      }
    }
    torch::Tensor final_out = out.to(q.scalar_type()).contiguous();
    comm.broadcast(final_out, 0);
    comm.broadcast(lse, 0);
    if (rank == 0 && p > 1) result.bytes_sent += (p - 1) * (final_out.numel() * final_out.element_size() + lse.numel() * 4);
    result.out = final_out;
    result.lse = lse;
    result.rounds = p > 1 ? levels + 1 : 0;
  }
  // END SOLUTION
  return result;
}

}  // namespace cp
