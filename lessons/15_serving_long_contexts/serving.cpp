// GENERATED from solutions/15_serving_long_contexts/serving.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
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
  // BEGIN YOUR CODE task 1: the prefill's zig-zag over the new tokens
  // TODO(lesson 15, task 1): the positions of parts r and 2N − 1 − r of the new tokens, cut into 2N
  // parts as even as count allows. README, "Task 1".
  throw NotImplemented("lesson 15, task 1: prefill_positions");
  // END YOUR CODE
}

int decode_owner(int64_t position, int world) {
  CP_CHECK(position >= 0, "decode_owner: position must not be negative, got ", position);
  CP_CHECK(world >= 1, "decode_owner: world must be at least 1, got ", world);
  // BEGIN YOUR CODE task 1: decode's round robin
  // TODO(lesson 15, task 1): the rank that keeps the token at this position. README, "Task 1".
  throw NotImplemented("lesson 15, task 1: decode_owner");
  // END YOUR CODE
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
  // BEGIN YOUR CODE task 2: pass-KV
  // TODO(lesson 15, task 2): this rank's K/V (its cache shard and its new tokens, with their positions)
  // around the ring; the new queries attend every block with the causal mask of global positions; the
  // new k, v end in the cache. README, "Task 2".
  (void)agreed, (void)next, (void)prev, (void)scale, (void)trace, (void)result;
  throw NotImplemented("lesson 15, task 2: pass_kv_prefill");
  // END YOUR CODE
  return result;
}

PrefillResult pass_q_prefill(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& positions, KvCacheShard& cache, std::optional<double> scale,
                             Trace* trace) {
  const Agreed agreed = check_prefill_inputs(comm, q, k, v, positions, cache);
  const int p = comm.size(), rank = comm.rank(), next = (rank + 1) % p, prev = (rank + p - 1) % p;
  PrefillResult result;
  // BEGIN YOUR CODE task 3: pass-Q
  // TODO(lesson 15, task 3): append the new k, v to the cache; the queries (with their positions) around
  // the ring, each rank attending the visitors with its own K/V; each partial (out, lse) back to the
  // queries' owner, which merges them. README, "Task 3".
  (void)agreed, (void)next, (void)prev, (void)scale, (void)trace, (void)result;
  throw NotImplemented("lesson 15, task 3: pass_q_prefill");
  // END YOUR CODE
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
  // BEGIN YOUR CODE task 4: the two predictions and the choice
  // TODO(lesson 15, task 4): each variant's N steps (compute or transfer, whichever is longer), pass-Q's
  // return of the partials, the faster of the two and why. README, "Task 4".
  (void)choice;
  throw NotImplemented("lesson 15, task 4: choose_prefill");
  // END YOUR CODE
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
  // BEGIN YOUR CODE task 5: decode
  // TODO(lesson 15, task 5): the new token into its owner's shard; each sequence's query over this rank's
  // shard; the partials merged by a gather (every rank, in rank order) or a tree (up to rank 0, then a
  // broadcast), identical on every rank. README, "Task 5".
  (void)p, (void)rank, (void)pos, (void)batch, (void)merge, (void)scale, (void)result;
  throw NotImplemented("lesson 15, task 5: decode_step");
  // END YOUR CODE
  return result;
}

}  // namespace cp
