// GENERATED from solutions/19_paged_serving/paged_serving.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 19 — the paged KV cache (task 1), continuous batching over it (task 2), decode context
// parallelism (tasks 3 and 4), MLA's absorbed decode (task 5) and the cache a model needs (task 6).
#include "paged_serving.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "block_attention.h"
#include "common/error.h"
#include "common/tensor_checks.h"
#include "kernels/cpu_decode.h"
#include "ulysses.h"

namespace cp {

// ── Task 1: the page pool ───────────────────────────────────────────────────────────────────

namespace {

/// A pool of pages [pages, heads, page_size, dim], zeroed: a slot no token has written is read by nobody.
torch::Tensor make_pool(int64_t pages, int64_t page_size, int64_t heads, int64_t dim, const char* dim_name,
                        const torch::TensorOptions& options) {
  for (const auto& [value, name] : {std::pair{pages, "pages"}, {page_size, "page_size"}, {heads, "heads_kv"}, {dim, dim_name}})
    CP_CHECK(value >= 1, "PagedKvCache: ", name, " must be at least 1, got ", value);
  const auto dtype = options.dtype().toScalarType();
  if (options.device().is_cuda())
    CP_CHECK(dtype == torch::kFloat || dtype == torch::kHalf || dtype == torch::kBFloat16,
             "PagedKvCache: options: a CUDA pool is float32, float16 or bfloat16, got ", options.dtype());
  else
    CP_CHECK(options.device().is_cpu() && dtype == torch::kFloat,
             "PagedKvCache: options: a CPU pool is float32 (the CPU loop reads it where it lies), got ", options.dtype(),
             " on ", options.device());
  return torch::zeros({pages, heads, page_size, dim}, options);
}

}  // namespace

PagedKvCache::PagedKvCache(int64_t pages, int64_t page_size, int64_t heads_kv, int64_t key_dim, int64_t value_dim,
                           const torch::TensorOptions& options)
    : PagedKvCache(make_pool(pages, page_size, heads_kv, key_dim, "key_dim", options),
                   make_pool(pages, page_size, heads_kv, value_dim, "value_dim", options), value_dim) {}

PagedKvCache PagedKvCache::latent(int64_t pages, int64_t page_size, int64_t latent_dim, int64_t rope_dim,
                                  const torch::TensorOptions& options) {
  CP_CHECK(latent_dim >= 1 && rope_dim >= 1, "PagedKvCache::latent: latent_dim and rope_dim must be at least 1, got ",
           latent_dim, " and ", rope_dim);
  return PagedKvCache(make_pool(pages, page_size, 1, latent_dim + rope_dim, "latent_dim + rope_dim", options),
                      torch::Tensor(), latent_dim);
}

PagedKvCache::PagedKvCache(torch::Tensor key_pages, torch::Tensor value_pages, int64_t value_dim)
    : key_pages_(std::move(key_pages)), value_pages_(std::move(value_pages)), value_dim_(value_dim) {
  page_free_.assign(pages(), 1);
  for (int64_t p = pages() - 1; p >= 0; --p) free_list_.push_back(p);  // page 0 on top: taken first
}

PagedKvCache::Sequence& PagedKvCache::sequence(int64_t id, const char* what) {
  const auto it = sequences_.find(id);
  CP_CHECK(it != sequences_.end(), what, ": id: no sequence ", id, " in the cache (add_sequence starts one)");
  return it->second;
}

void PagedKvCache::add_sequence(int64_t id) {
  CP_CHECK(sequences_.count(id) == 0, "add_sequence: id: sequence ", id, " is already in the cache");
  sequences_[id] = Sequence{};
}

int64_t PagedKvCache::length(int64_t id) const {
  return const_cast<PagedKvCache*>(this)->sequence(id, "length").length;
}

const std::vector<int64_t>& PagedKvCache::block_table(int64_t id) const {
  return const_cast<PagedKvCache*>(this)->sequence(id, "block_table").table;
}

std::vector<int64_t> PagedKvCache::sequences() const {
  std::vector<int64_t> ids;
  for (const auto& entry : sequences_) ids.push_back(entry.first);
  return ids;
}

bool PagedKvCache::page_is_free(int64_t page) const {
  CP_CHECK(page >= 0 && page < pages(), "page_is_free: page ", page, " is outside the pool of ", pages(), " pages");
  return page_free_[page] != 0;
}

void PagedKvCache::append(int64_t id, const torch::Tensor& k, const torch::Tensor& v) {
  Sequence& seq = sequence(id, "append");
  check_defined(k, "append: k");
  CP_CHECK(k.dim() == 3 && k.size(1) == heads_kv() && k.size(2) == key_dim(), "append: k: expected [t, ", heads_kv(),
           ", ", key_dim(), "], got ", k.sizes());
  const int64_t t = k.size(0);
  if (is_latent()) {
    CP_CHECK(!v.defined(), "append: v: a latent cache has no values (a token's value is part of its key row)");
  } else {
    check_defined(v, "append: v");
    CP_CHECK(v.dim() == 3 && v.size(0) == t && v.size(1) == heads_kv() && v.size(2) == value_dim(),
             "append: v: expected [", t, ", ", heads_kv(), ", ", value_dim(), "], got ", v.sizes());
  }
  // BEGIN YOUR CODE task 1: take the pages, then write the tokens
  // TODO(lesson 19, task 1): give the sequence the pages its t new tokens need, then write each token
  // into its slot; a pool too small for them is a cp::Error that names the free pages and changes
  // nothing. README, "Task 1".
  (void)seq, (void)t;
  throw NotImplemented("lesson 19, task 1: PagedKvCache::append");
  // END YOUR CODE
}

void PagedKvCache::release(int64_t id) {
  Sequence& seq = sequence(id, "release");
  // BEGIN YOUR CODE task 1: give the pages back
  // TODO(lesson 19, task 1): the sequence's pages back to the free list, and the sequence gone.
  (void)seq;
  throw NotImplemented("lesson 19, task 1: PagedKvCache::release");
  // END YOUR CODE
}

// ── Task 2: continuous batching ─────────────────────────────────────────────────────────────

PagedBatch make_batch(const PagedKvCache& cache, const std::vector<int64_t>& ids, const std::vector<int64_t>& q_lens) {
  CP_CHECK(ids.size() == q_lens.size(), "make_batch: ids and q_lens: one q_len per sequence, got ", ids.size(),
           " ids and ", q_lens.size(), " q_lens");
  PagedBatch batch;
  batch.cu_seqlens_q.push_back(0);
  for (size_t b = 0; b < ids.size(); ++b) {
    const int64_t kv_len = cache.length(ids[b]);
    CP_CHECK(q_lens[b] >= 0 && q_lens[b] <= kv_len, "make_batch: q_lens[", b, "] = ", q_lens[b], ": sequence ", ids[b],
             " holds ", kv_len, " tokens (append the new tokens first)");
    batch.cu_seqlens_q.push_back(batch.cu_seqlens_q.back() + q_lens[b]);
    batch.kv_lens.push_back(kv_len);
    batch.block_tables.push_back(cache.block_table(ids[b]));
  }
  return batch;
}

namespace {

/// Where key j of one sequence lies in the pool, and which rows see it: the `keys` of
/// kernels/cpu_decode.h's loop, for one kv head.
struct PagedKeys {
  const float* keys;    // this kv head's key in slot 0 of page 0
  const float* values;  // this kv head's value in slot 0 of page 0 (a latent cache: its key row)
  const int64_t* table;  // the sequence's pages
  int64_t page_size;
  int64_t key_page, value_page;  // floats from one page of the pool to the next
  int64_t key_dim, value_dim;    // floats from one slot of a head's page to the next
  const int64_t* row_seen;       // [rows]: how many of the sequence's first keys each row sees

  // BEGIN YOUR CODE task 2: where key j lies
  // TODO(lesson 19, task 2): key j of the sequence, found through its block table. README, "Task 2".
  const float* key(int64_t j) const {
    (void)j;
    throw NotImplemented("lesson 19, task 2: PagedKeys::key");
  }
  const float* value(int64_t j) const {
    (void)j;
    throw NotImplemented("lesson 19, task 2: PagedKeys::value");
  }
  // END YOUR CODE
  bool visible(int64_t j, int64_t row) const { return j < row_seen[row]; }
};

/// The rows of one sequence on the CPU: q [t, Hq, key_dim] float32, token i seeing the first seen[i]
/// of the kv_len keys in the pages of `table`; writes out [t, Hq, value_dim] and lse [t, Hq]
/// (float32, contiguous). Each kv head's query heads go through kernels/cpu_decode.h's loop
/// together, which reads every key and value row once for all of them, in the pool.
void attend_pages_cpu(const torch::Tensor& q, const PagedKvCache& cache, const std::vector<int64_t>& table,
                      int64_t kv_len, const std::vector<int64_t>& seen, float scale, torch::Tensor out,
                      torch::Tensor lse) {
  const int64_t tokens = q.size(0);
  if (tokens == 0) return;
  const int64_t heads_kv = cache.heads_kv(), group = q.size(1) / heads_kv;
  const int64_t key_dim = cache.key_dim(), value_dim = cache.value_dim();
  for (int64_t i = 0; i < tokens; ++i)  // a wrong count would read outside the sequence's pages
    CP_CHECK(seen[i] >= 0 && seen[i] <= kv_len, "row ", i, " of a sequence of ", kv_len,
             " keys in this cache would see ", seen[i], " of them: a count must lie in 0 .. ", kv_len);
  const int64_t n = *std::max_element(seen.begin(), seen.end());
  // A head's page is page_size rows of its dim in a row ([pages, Hkv, page_size, dim]): the loop
  // below, one kv head at a time, reads each page front to back.
  const float* key_pool = cache.key_pages().data_ptr<float>();
  const float* value_pool = cache.is_latent() ? key_pool : cache.value_pages().data_ptr<float>();
  const int64_t value_row = cache.is_latent() ? key_dim : value_dim;  // a latent value: the front of the key row
  const int64_t key_page = heads_kv * cache.page_size() * key_dim, value_page = heads_kv * cache.page_size() * value_row;
  std::vector<int64_t> row_seen(tokens * group);  // rows are token-major: row r is token r / group
  for (int64_t r = 0; r < tokens * group; ++r) row_seen[r] = seen[r / group];
  std::vector<float> work(tokens * group * (value_dim + kernels::kDecodeBlock + 2));
  for (int64_t h = 0; h < heads_kv; ++h) {
    const torch::Tensor rows = q.narrow(1, h * group, group).contiguous();  // [t, group, key_dim]
    torch::Tensor rows_out = torch::empty({tokens, group, value_dim}, q.options());
    torch::Tensor rows_lse = torch::empty({tokens, group}, q.options());
    const PagedKeys keys{key_pool + h * cache.page_size() * key_dim, value_pool + h * cache.page_size() * value_row,
                         table.data(), cache.page_size(), key_page, value_page, key_dim, value_row, row_seen.data()};
    kernels::simd_call<kernels::DecodeAttend>(rows.data_ptr<float>(), tokens * group, keys, n, key_dim, value_dim,
                                              scale, rows_out.data_ptr<float>(), rows_lse.data_ptr<float>(),
                                              work.data());
    out.narrow(1, h * group, group).copy_(rows_out);
    lse.narrow(1, h * group, group).copy_(rows_lse);
  }
}

/// How many keys of its sequence each row of a chunk sees: the chunk is the last q_len of the
/// sequence's kv_len tokens, and a token sees every token up to itself.
std::vector<int64_t> keys_seen(int64_t q_len, int64_t kv_len) {
  std::vector<int64_t> seen(q_len);
  // BEGIN YOUR CODE task 2: which keys each row sees
  // TODO(lesson 19, task 2): how many of its sequence's keys row i of the chunk sees. README, "Task 2".
  (void)kv_len;
  throw NotImplemented("lesson 19, task 2: which keys each row sees");
  // END YOUR CODE
  return seen;
}

/// The batch's checks (given): everything paged_attention and mla_decode read is in range.
void check_batch(const PagedKvCache& cache, const PagedBatch& batch, int64_t tokens, const char* what) {
  const size_t count = batch.kv_lens.size();
  CP_CHECK(batch.cu_seqlens_q.size() == count + 1 && batch.block_tables.size() == count, what,
           ": batch: cu_seqlens_q needs B + 1 entries and block_tables B, for B = kv_lens.size() = ", count, "; got ",
           batch.cu_seqlens_q.size(), " and ", batch.block_tables.size());
  CP_CHECK(batch.cu_seqlens_q[0] == 0, what, ": batch.cu_seqlens_q[0] must be 0, got ", batch.cu_seqlens_q[0]);
  for (size_t b = 0; b < count; ++b) {
    const int64_t q_len = batch.cu_seqlens_q[b + 1] - batch.cu_seqlens_q[b], kv_len = batch.kv_lens[b];
    CP_CHECK(q_len >= 0, what, ": batch.cu_seqlens_q must not decrease, entry ", b + 1, " is below entry ", b);
    CP_CHECK(kv_len >= q_len, what, ": batch.kv_lens[", b, "] = ", kv_len, " is fewer than the sequence's ", q_len,
             " new tokens (append them to the cache first)");
    const auto& table = batch.block_tables[b];
    CP_CHECK(static_cast<int64_t>(table.size()) * cache.page_size() >= kv_len, what, ": batch.block_tables[", b,
             "] has ", table.size(), " page(s) of ", cache.page_size(), " tokens, too few for kv_lens[", b, "] = ", kv_len);
    for (size_t i = 0; i < table.size(); ++i) {
      CP_CHECK(table[i] >= 0 && table[i] < cache.pages(), what, ": batch.block_tables[", b, "][", i, "] = ", table[i],
               " is outside the pool of ", cache.pages(), " pages");
      CP_CHECK(!cache.page_is_free(table[i]), what, ": batch.block_tables[", b, "][", i, "] = page ", table[i],
               ", which is free (a finished sequence's table? its page may already hold another sequence)");
    }
  }
  CP_CHECK(batch.cu_seqlens_q.back() == tokens, what, ": q has ", tokens, " token rows, batch.cu_seqlens_q ends at ",
           batch.cu_seqlens_q.back());
}

void check_queries(const torch::Tensor& q, const PagedKvCache& cache, const char* what) {
  check_defined(q, what);
  check_float_dtype(q, what);
  CP_CHECK(q.dim() == 3 && q.size(2) == cache.key_dim() && q.size(1) >= 1 && q.size(1) % cache.heads_kv() == 0, what,
           ": expected [T, Hq, ", cache.key_dim(), "] with Hq a multiple of the cache's ", cache.heads_kv(),
           " kv heads, got ", q.sizes());
  CP_CHECK(q.device() == cache.key_pages().device(), what, ": on ", q.device(), ", the cache on ",
           cache.key_pages().device());
}

/// paged_attention on CUDA tensors: each sequence's pages gathered into one tensor for lesson 03's
/// kernel. A paged GPU kernel (vLLM's, FlashInfer's) reads the pages in place; this lesson's kernel
/// that does so is the CPU one, and the gather is the simple stand-in on a GPU.
PagedResult paged_attention_gathered(const torch::Tensor& q, const PagedKvCache& cache, const PagedBatch& batch,
                                     double scale) {
  CP_CHECK(!cache.is_latent() && cache.key_dim() == cache.value_dim(),
           "paged_attention: cache: on CUDA tensors lesson 03's kernel needs key_dim = value_dim; a latent cache (MLA) "
           "runs on the CPU in this lesson");
  const int64_t tokens = q.size(0), heads_q = q.size(1), heads_kv = cache.heads_kv(), dim = cache.key_dim();
  PagedResult result{torch::zeros({tokens, heads_q, dim}, q.options()),
                     torch::full({tokens, heads_q}, -std::numeric_limits<float>::infinity(),
                                 q.options().dtype(torch::kFloat))};
  const auto longs = torch::TensorOptions().dtype(torch::kLong).device(q.device());
  for (size_t b = 0; b < batch.kv_lens.size(); ++b) {
    const int64_t first = batch.cu_seqlens_q[b], q_len = batch.cu_seqlens_q[b + 1] - first, kv_len = batch.kv_lens[b];
    if (q_len == 0) continue;
    const torch::Tensor pages = torch::tensor(batch.block_tables[b], torch::kLong).to(q.device());
    auto gather = [&](const torch::Tensor& pool) {  // [1, Hkv, kv_len, D]
      return pool.index_select(0, pages).transpose(0, 1).reshape({heads_kv, -1, dim}).narrow(1, 0, kv_len).unsqueeze(0);
    };
    const std::vector<int64_t> seen = keys_seen(q_len, kv_len);
    AttentionMask mask;
    mask.causal = true;
    mask.q_positions = torch::tensor(seen, torch::kLong).to(q.device()) - 1;  // the last key a row sees
    mask.k_positions = torch::arange(kv_len, longs);
    // Lesson 03's kernel takes q in the pool's dtype; out returns to q's in the copy below.
    const torch::Tensor rows = q.narrow(0, first, q_len).to(cache.key_pages().scalar_type());
    const AttnResult r = attention_block_forward(rows.permute({1, 0, 2}).unsqueeze(0), gather(cache.key_pages()),
                                                 gather(cache.value_pages()), mask, scale);
    result.out.narrow(0, first, q_len).copy_(r.out[0].permute({1, 0, 2}));
    result.lse.narrow(0, first, q_len).copy_(r.lse[0].t());
  }
  return result;
}

}  // namespace

PagedResult paged_attention(const torch::Tensor& q, const PagedKvCache& cache, const PagedBatch& batch,
                            std::optional<double> scale) {
  check_queries(q, cache, "paged_attention: q");
  check_batch(cache, batch, q.size(0), "paged_attention");
  const double softmax_scale = scale.value_or(1.0 / std::sqrt(static_cast<double>(cache.key_dim())));
  if (q.is_cuda()) return paged_attention_gathered(q, cache, batch, softmax_scale);
  const torch::Tensor qf = q.to(torch::kFloat).contiguous();
  const auto f32 = qf.options();
  torch::Tensor out = torch::empty({q.size(0), q.size(1), cache.value_dim()}, f32);
  torch::Tensor lse = torch::empty({q.size(0), q.size(1)}, f32);
  for (size_t b = 0; b < batch.kv_lens.size(); ++b) {
    const int64_t first = batch.cu_seqlens_q[b], q_len = batch.cu_seqlens_q[b + 1] - first;
    attend_pages_cpu(qf.narrow(0, first, q_len), cache, batch.block_tables[b], batch.kv_lens[b],
                     keys_seen(q_len, batch.kv_lens[b]), static_cast<float>(softmax_scale), out.narrow(0, first, q_len),
                     lse.narrow(0, first, q_len));
  }
  return {out.to(q.scalar_type()), lse};
}

// ── Task 3: decode context parallelism, where the tokens live ──────────────────────────────

namespace {

void check_stripes(int world, int64_t interleave, const char* what) {
  CP_CHECK(world >= 1, what, ": world must be at least 1, got ", world);
  CP_CHECK(interleave >= 1, what, ": interleave must be at least 1, got ", interleave);
}

}  // namespace

int dcp_owner(int64_t position, int world, int64_t interleave) {
  check_stripes(world, interleave, "dcp_owner");
  CP_CHECK(position >= 0, "dcp_owner: position must be >= 0, got ", position);
  // BEGIN YOUR CODE task 3: the owner
  // TODO(lesson 19, task 3): the rank whose shard holds `position`. README, "Task 3".
  throw NotImplemented("lesson 19, task 3: dcp_owner");
  // END YOUR CODE
}

int64_t dcp_local_length(int64_t length, int rank, int world, int64_t interleave) {
  check_stripes(world, interleave, "dcp_local_length");
  CP_CHECK(length >= 0, "dcp_local_length: length must be >= 0, got ", length);
  CP_CHECK(rank >= 0 && rank < world, "dcp_local_length: rank ", rank, " is outside the world of ", world);
  // BEGIN YOUR CODE task 3: the shard's length
  // TODO(lesson 19, task 3): how many of the positions below `length` rank `rank` holds, without a loop
  // over them. README, "Task 3".
  throw NotImplemented("lesson 19, task 3: dcp_local_length");
  // END YOUR CODE
}

// ── Task 4: the DCP decode step ─────────────────────────────────────────────────────────────

std::string to_string(DcpExchange exchange) {
  return exchange == DcpExchange::AllToAll ? "all-to-all" : "all-gather";
}

int64_t dcp_bytes(DcpExchange exchange, int world, int64_t batch, int64_t tokens, int64_t heads_q, int64_t key_dim,
                  int64_t value_dim, int64_t element_size) {
  CP_CHECK(world >= 1 && heads_q % world == 0, "dcp_bytes: heads_q = ", heads_q, " must be divisible by world = ", world);
  const int64_t own_rows = batch * tokens * heads_q / world;  // this rank's (token, head) pairs
  const int64_t queries = (world - 1) * own_rows * key_dim * element_size;
  const int64_t partial = (value_dim + 1) * 4;  // out and lse of one row, float32
  const int64_t rows_sent = exchange == DcpExchange::AllToAll ? own_rows : batch * tokens * heads_q;
  return queries + (world - 1) * rows_sent * partial;
}

namespace {

/// Runs a local check; its cp::Error becomes the message agree_on_every_rank shares ("" if none).
/// A stub's NotImplemented goes through: every rank meets it at the same point.
template <typename Check>
std::string local_error(Check check) {
  try {
    check();
  } catch (const NotImplemented&) {
    throw;
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

void check_dcp_inputs(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                      const PagedKvCache& cache, const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths,
                      int64_t interleave) {
  const int world = comm.size();
  std::string error = local_error([&] {
    check_defined(q, "dcp_decode_step: q", 4);
    check_float_dtype(q, "dcp_decode_step: q");
    CP_CHECK(q.device().is_cpu(), "dcp_decode_step: q: the DCP step runs on the CPU in this lesson, got ", q.device());
    CP_CHECK(q.dim() == 4 && q.size(3) == cache.key_dim(), "dcp_decode_step: q: expected [B, T, Hq/N, ",
             cache.key_dim(), "], got ", q.sizes());
    CP_CHECK(q.size(2) * world % cache.heads_kv() == 0, "dcp_decode_step: q: Hq = ", q.size(2), " x ", world,
             " ranks must be divisible by the cache's ", cache.heads_kv(), " kv heads");
    const std::vector<int64_t> kv_shape{q.size(0), q.size(1), cache.heads_kv()};
    check_defined(k, "dcp_decode_step: k");
    CP_CHECK(k.dim() == 4 && k.sizes().slice(0, 3) == torch::IntArrayRef(kv_shape) && k.size(3) == cache.key_dim(),
             "dcp_decode_step: k: expected [", q.size(0), ", ", q.size(1), ", ", cache.heads_kv(), ", ",
             cache.key_dim(), "], got ", k.sizes());
    if (cache.is_latent()) {
      CP_CHECK(!v.defined(), "dcp_decode_step: v: a latent cache has no values");
    } else {
      check_defined(v, "dcp_decode_step: v");
      CP_CHECK(v.dim() == 4 && v.sizes().slice(0, 3) == torch::IntArrayRef(kv_shape) && v.size(3) == cache.value_dim(),
               "dcp_decode_step: v: expected [", q.size(0), ", ", q.size(1), ", ", cache.heads_kv(), ", ",
               cache.value_dim(), "], got ", v.sizes());
    }
    CP_CHECK(static_cast<int64_t>(ids.size()) == q.size(0) && lengths.size() == ids.size(),
             "dcp_decode_step: ids and lengths: one of each per sequence of q (", q.size(0), "), got ", ids.size(),
             " and ", lengths.size());
    for (size_t b = 0; b < ids.size(); ++b) {
      CP_CHECK(lengths[b] >= 0, "dcp_decode_step: lengths[", b, "] must be >= 0, got ", lengths[b]);
      cache.length(ids[b]);  // an unknown id is an error
    }
    CP_CHECK(interleave >= 1, "dcp_decode_step: interleave must be at least 1, got ", interleave);
  });
  const bool defined = q.defined() && q.dim() == 4;
  std::vector<int64_t> fields{defined ? q.size(0) : -1, defined ? q.size(1) : -1, defined ? q.size(2) : -1,
                              defined ? q.size(3) : -1, q.defined() ? static_cast<int64_t>(q.scalar_type()) : -1,
                              cache.heads_kv(), cache.value_dim(), interleave};
  const auto every = agree_on_every_rank(comm, torch::kCPU, error, fields);
  for (int r = 1; r < world; ++r)
    if (every[r] != every[0])
      throw ErrorOnEveryRank(detail::concat("q, cache, interleave: every rank must pass the same B, T, Hq/N, key_dim, "
                                            "dtype, Hkv, value_dim and interleave; rank 0 has ",
                                            torch::IntArrayRef(every[0].data(), 8), ", rank ", r, " has ",
                                            torch::IntArrayRef(every[r].data(), 8)),
                             __FILE__, __LINE__);
  // The same sequences at the same lengths everywhere (B agrees now, so the rows have one size).
  std::vector<int64_t> mine = ids;
  mine.insert(mine.end(), lengths.begin(), lengths.end());
  const torch::Tensor all = comm.all_gather(torch::tensor(mine, torch::kLong).unsqueeze(0));
  for (int r = 1; r < world; ++r)
    if (!torch::equal(all[r], all[0]))
      throw ErrorOnEveryRank(detail::concat("ids, lengths: every rank decodes the same sequences at the same lengths; "
                                            "rank 0 has ", all[0], ", rank ", r, " has ", all[r]),
                             __FILE__, __LINE__);
  // Each shard holds its share of each sequence (dcp_local_length: task 3), and has the pages for
  // the new tokens it will keep: an append that failed on one rank would leave the others waiting.
  error = local_error([&] {
    int64_t pages_needed = 0;
    for (size_t b = 0; b < ids.size(); ++b) {
      const int64_t share = dcp_local_length(lengths[b], comm.rank(), world, interleave);
      CP_CHECK(cache.length(ids[b]) == share, "cache: sequence ", ids[b], " has ", cache.length(ids[b]),
               " tokens in this rank's shard, its share of ", lengths[b], " tokens striped over ", world,
               " ranks by ", interleave, " is ", share);
      const int64_t after = dcp_local_length(lengths[b] + q.size(1), comm.rank(), world, interleave);
      pages_needed += (after + cache.page_size() - 1) / cache.page_size() -
                      static_cast<int64_t>(cache.block_table(ids[b]).size());
    }
    CP_CHECK(pages_needed <= cache.free_pages(), "cache: this rank's shard needs ", pages_needed,
             " more page(s) for the step's new tokens, its pool has ", cache.free_pages(), " free");
  });
  agree_on_every_rank(comm, torch::kCPU, error, {});
}

}  // namespace

DcpResult dcp_decode_step(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          PagedKvCache& cache, const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths,
                          int64_t interleave, DcpExchange exchange, std::optional<double> scale) {
  check_dcp_inputs(comm, q, k, v, cache, ids, lengths, interleave);
  const int world = comm.size(), rank = comm.rank();
  const int64_t batch = q.size(0), tokens = q.size(1), own_heads = q.size(2), heads_q = own_heads * world;
  const int64_t key_dim = cache.key_dim(), value_dim = cache.value_dim();
  const float softmax_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(key_dim))));
  DcpResult result;
  // 1. Each new token into its owner's shard, in position order.
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < tokens; ++i)
      if (dcp_owner(lengths[b] + i, world, interleave) == rank)
        cache.append(ids[b], k[b].narrow(0, i, 1), cache.is_latent() ? torch::Tensor() : v[b].narrow(0, i, 1));
  // 2. Every head's queries on every rank: [B, T, Hq, key_dim].
  const torch::Tensor gathered = comm.all_gather(q.contiguous().unsqueeze(0));  // [N, B, T, Hq/N, key_dim]
  result.bytes_sent += (world - 1) * q.numel() * q.element_size();
  const torch::Tensor q_all =
      gathered.permute({1, 2, 0, 3, 4}).reshape({batch, tokens, heads_q, key_dim}).to(torch::kFloat).contiguous();
  // 3. Every head against this rank's shard: partial results, float32.
  const auto f32 = q_all.options();
  torch::Tensor out_all = torch::empty({batch, tokens, heads_q, value_dim}, f32);
  torch::Tensor lse_all = torch::empty({batch, tokens, heads_q}, f32);
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<int64_t> seen(tokens);
    // BEGIN YOUR CODE task 4: the keys of this shard each new token sees
    // TODO(lesson 19, task 4): seen[i]: how many keys of this rank's shard new token i sees. README,
    // "Task 4".
    throw NotImplemented("lesson 19, task 4: the keys each new token sees");
    // END YOUR CODE
    attend_pages_cpu(q_all[b], cache, cache.block_table(ids[b]), cache.length(ids[b]), seen, softmax_scale, out_all[b],
                     lse_all[b]);
  }
  // 4. Each rank's heads back to it, merged.
  // BEGIN YOUR CODE task 4: the exchange
  // TODO(lesson 19, task 4): every rank's partial (out, lse) of this rank's heads here, as `exchange` says,
  // merged into result.out and result.lse in an order that gives the same bits whichever exchange ran;
  // add what this rank sends to result.bytes_sent. README, "Task 4".
  (void)out_all, (void)lse_all;
  throw NotImplemented("lesson 19, task 4: the exchange");
  // END YOUR CODE
  return result;
}

// ── Task 5: MLA's latent cache ──────────────────────────────────────────────────────────────

PagedResult mla_decode(const torch::Tensor& q_nope, const torch::Tensor& q_rope, const MlaWeights& weights,
                       const PagedKvCache& cache, const PagedBatch& batch, std::optional<double> scale) {
  CP_CHECK(cache.is_latent(), "mla_decode: cache: expected a latent cache (PagedKvCache::latent)");
  const int64_t latent_dim = cache.value_dim(), rope_dim = cache.key_dim() - latent_dim;
  check_defined(q_nope, "mla_decode: q_nope", 3);
  check_float_dtype(q_nope, "mla_decode: q_nope");
  CP_CHECK(q_nope.dim() == 3 && q_nope.device().is_cpu(), "mla_decode: q_nope: expected a CPU tensor [T, H, nope_dim], got ",
           q_nope.sizes(), " on ", q_nope.device());
  const int64_t tokens = q_nope.size(0), heads = q_nope.size(1), nope_dim = q_nope.size(2);
  check_defined(q_rope, "mla_decode: q_rope");
  CP_CHECK(q_rope.sizes() == torch::IntArrayRef({tokens, heads, rope_dim}) && q_rope.dtype() == q_nope.dtype(),
           "mla_decode: q_rope: expected [", tokens, ", ", heads, ", ", rope_dim, "] in q_nope's dtype, got ",
           q_rope.sizes(), " ", q_rope.dtype());
  check_defined(weights.w_uk, "mla_decode: weights.w_uk");
  CP_CHECK(weights.w_uk.sizes() == torch::IntArrayRef({heads, nope_dim, latent_dim}),
           "mla_decode: weights.w_uk: expected [", heads, ", ", nope_dim, ", ", latent_dim, "], got ",
           weights.w_uk.sizes());
  check_defined(weights.w_uv, "mla_decode: weights.w_uv", 3);
  CP_CHECK(weights.w_uv.dim() == 3 && weights.w_uv.size(0) == heads && weights.w_uv.size(2) == latent_dim,
           "mla_decode: weights.w_uv: expected [", heads, ", value_dim, ", latent_dim, "], got ", weights.w_uv.sizes());
  const double softmax_scale = scale.value_or(1.0 / std::sqrt(static_cast<double>(nope_dim + rope_dim)));
  // BEGIN YOUR CODE task 5: the absorbed form
  // TODO(lesson 19, task 5): attention over the latent rows themselves, every head's w_uk and w_uv
  // applied where they cost least. README, "Task 5".
  (void)batch, (void)softmax_scale;
  throw NotImplemented("lesson 19, task 5: mla_decode");
  // END YOUR CODE
}

// ── Task 6: the cache a model needs ─────────────────────────────────────────────────────────

ModelShape qwen3_235b() { return {"Qwen3-235B-A22B", 94, 64, 4, 128, 128, 2}; }
ModelShape deepseek_v3() { return {"DeepSeek-V3", 61, 128, 1, 512 + 64, 0, 2}; }

double cache_bytes_per_token(const ModelShape& model, int tp, int dcp) {
  CP_CHECK(tp >= 1 && dcp >= 1, "cache_bytes_per_token: tp and dcp must be at least 1, got ", tp, " and ", dcp);
  CP_CHECK(model.heads_kv >= 1 && (model.heads_kv % tp == 0 || tp % model.heads_kv == 0), "cache_bytes_per_token: tp = ",
           tp, " and ", model.name, "'s ", model.heads_kv, " kv heads must divide one another");
  // BEGIN YOUR CODE task 6: bytes per token on one GPU
  // TODO(lesson 19, task 6): the kv heads one GPU holds under TP, and what DCP does to them; a dcp that
  // the GPUs holding the same heads cannot be split into is a cp::Error naming dcp. README, "Task 6".
  throw NotImplemented("lesson 19, task 6: cache_bytes_per_token");
  // END YOUR CODE
}

int64_t max_context_tokens(const ModelShape& model, int tp, int dcp, int64_t cache_bytes) {
  CP_CHECK(cache_bytes >= 0, "max_context_tokens: cache_bytes must be >= 0, got ", cache_bytes);
  return static_cast<int64_t>(std::floor(static_cast<double>(cache_bytes) / cache_bytes_per_token(model, tp, dcp)));
}

}  // namespace cp
