// Lesson 19 — serving at scale: the page pool's contents, continuous batching over pages, the DCP
// decode step (draft tokens, both exchanges, every byte sent) and MLA's absorbed decode against
// float64 attention over each whole sequence on one device (explicit heads for MLA), on local
// worlds of 1, 2, 3, 4 and 8 ranks and under mpirun; the cache arithmetic against the test's own
// count.
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "common/error.h"
#include "common/memory_meter.h"
#include "paged_serving.h"
#include "testing/counting_comm.h"
#include "testing/harness.h"
#include "testing/oracle.h"

namespace cp {
namespace {

using testing::CountingComm;
using testing::expect_error;
using testing::for_each_world;

const std::vector<std::string> kRowDims = {"t", "h", "d"};
const std::vector<std::string> kLseDims = {"t", "h"};
const auto kF32 = torch::TensorOptions().dtype(torch::kFloat);
const auto kF64 = torch::TensorOptions().dtype(torch::kDouble);

std::string where(const Comm& comm) { return "rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()); }

/// One sequence in the serving layout, float64: q [L, Hq, key_dim], k [L, Hkv, key_dim], v [L, Hkv, value_dim].
struct Sequence {
  torch::Tensor q, k, v;
};

Sequence make_sequence(int64_t length, int64_t heads_q, int64_t heads_kv, int64_t key_dim, int64_t value_dim,
                       uint64_t seed) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  // Scores well away from N(0, 1): a spread of 2 in q and k, so that the maxima matter.
  return {2 * torch::randn({length, heads_q, key_dim}, gen, kF64), 2 * torch::randn({length, heads_kv, key_dim}, gen, kF64),
          torch::randn({length, heads_kv, value_dim}, gen, kF64)};
}

/// Causal attention of rows [first, first + count) of a sequence over its first `first + count`
/// keys, float64: out [count, Hq, value_dim], lse [count, Hq].
std::pair<torch::Tensor, torch::Tensor> oracle_rows(const Sequence& seq, int64_t first, int64_t count, double scale) {
  auto heads_first = [](const torch::Tensor& t) { return t.permute({1, 0, 2}).unsqueeze(0); };
  const int64_t keys = first + count;
  const auto [out, lse] = testing::oracle_attention(
      heads_first(seq.q.narrow(0, first, count)), heads_first(seq.k.narrow(0, 0, keys)),
      heads_first(seq.v.narrow(0, 0, keys)), true, torch::arange(first, keys), torch::arange(keys), scale);
  return {out[0].permute({1, 0, 2}), lse[0].t()};
}

double default_scale(int64_t key_dim) { return 1.0 / std::sqrt(static_cast<double>(key_dim)); }

// ── Task 1: the page pool ───────────────────────────────────────────────────────────────────

/// Token i of sequence `id` as the pool holds it: [Hkv, dim], read through the block table by the
/// contract's rule (slot i % page_size of page table[i / page_size]).
torch::Tensor pool_row(const PagedKvCache& cache, const torch::Tensor& pool, int64_t id, int64_t i) {
  const std::vector<int64_t>& table = cache.block_table(id);
  return pool[table.at(i / cache.page_size())].select(1, i % cache.page_size());
}

/// Every invariant of a pool: each page in at most one table, never a free page in a table, a
/// table of exactly ⌈length / page_size⌉ pages, and every page free or in a table.
void expect_pool_consistent(const PagedKvCache& cache, const std::string& what) {
  std::set<int64_t> used;
  for (int64_t id : cache.sequences()) {
    const std::vector<int64_t>& table = cache.block_table(id);
    const int64_t want = (cache.length(id) + cache.page_size() - 1) / cache.page_size();
    EXPECT_EQ(static_cast<int64_t>(table.size()), want)
        << what << ": sequence " << id << " of " << cache.length(id) << " tokens holds " << table.size()
        << " pages of " << cache.page_size() << " (a page is taken only when the last one is full)";
    for (int64_t page : table) {
      EXPECT_TRUE(used.insert(page).second) << what << ": page " << page << " is in two block tables";
      EXPECT_FALSE(cache.page_is_free(page)) << what << ": page " << page << " of sequence " << id << " is on the free list";
    }
  }
  int64_t free = 0;
  for (int64_t page = 0; page < cache.pages(); ++page) free += cache.page_is_free(page);
  EXPECT_EQ(free, cache.free_pages()) << what << ": free_pages() disagrees with page_is_free()";
  EXPECT_EQ(free + static_cast<int64_t>(used.size()), cache.pages())
      << what << ": " << free << " free and " << used.size() << " used pages, the pool has " << cache.pages();
}

/// Every token of `seq` (its first `length` k and v rows) where the block table says.
void expect_tokens(const PagedKvCache& cache, int64_t id, const Sequence& seq, const std::string& what) {
  ASSERT_EQ(cache.length(id), seq.k.size(0)) << what << ": length of sequence " << id;
  for (int64_t i = 0; i < seq.k.size(0); ++i) {
    EXPECT_TRUE(torch::equal(pool_row(cache, cache.key_pages(), id, i), seq.k[i].to(torch::kFloat)))
        << what << ": key of token " << i << " of sequence " << id << " is not in slot " << i % cache.page_size()
        << " of page block_table[" << i / cache.page_size() << "]";
    if (!cache.is_latent())
      EXPECT_TRUE(torch::equal(pool_row(cache, cache.value_pages(), id, i), seq.v[i].to(torch::kFloat)))
          << what << ": value of token " << i << " of sequence " << id;
  }
}

/// Appends sequences' tokens in chunks, round robin over the sequences, so that their pages
/// interleave in the pool: chunk c of sequence s has (c + s) % 5 + 1 tokens (1 to 5).
void append_interleaved(PagedKvCache& cache, const std::vector<int64_t>& ids, const std::vector<Sequence>& seqs) {
  std::vector<int64_t> done(ids.size(), 0);
  for (int64_t chunk = 0;; ++chunk) {
    bool any = false;
    for (size_t s = 0; s < ids.size(); ++s) {
      const int64_t left = seqs[s].k.size(0) - done[s];
      if (left == 0) continue;
      any = true;
      const int64_t count = std::min<int64_t>(left, (chunk + s) % 5 + 1);
      cache.append(ids[s], seqs[s].k.narrow(0, done[s], count),
                   cache.is_latent() ? torch::Tensor() : seqs[s].v.narrow(0, done[s], count));
      done[s] += count;
    }
    if (!any) return;
  }
}

CP_TEST(Lesson19, Task1_AppendedTokensReadBackThroughTheBlockTable) {
  for (int64_t page_size : {1, 4, 5}) {
    const std::string what = "page_size " + std::to_string(page_size);
    PagedKvCache cache(40, page_size, 2, 3, 5, kF32);
    const std::vector<int64_t> ids = {7, 3, 11};
    const std::vector<Sequence> seqs = {make_sequence(13, 2, 2, 3, 5, 1), make_sequence(1, 2, 2, 3, 5, 2),
                                        make_sequence(20, 2, 2, 3, 5, 3)};
    for (int64_t id : ids) cache.add_sequence(id);
    cache.append(3, seqs[1].k.narrow(0, 0, 0), seqs[1].v.narrow(0, 0, 0));  // nothing: no page
    EXPECT_TRUE(cache.block_table(3).empty()) << what << ": appending 0 tokens took a page";
    append_interleaved(cache, ids, seqs);
    for (size_t s = 0; s < ids.size(); ++s) expect_tokens(cache, ids[s], seqs[s], what);
    expect_pool_consistent(cache, what);
  }
  // A latent cache (MLA): one row per token, no values.
  PagedKvCache latent = PagedKvCache::latent(10, 4, 6, 2, kF32);
  const Sequence seq = make_sequence(9, 1, 1, 8, 6, 4);
  latent.add_sequence(0);
  append_interleaved(latent, {0}, {seq});
  expect_tokens(latent, 0, seq, "latent cache");
  expect_pool_consistent(latent, "latent cache");
}

CP_TEST(Lesson19, Task1_PagesAreTakenOnlyWhenNeededAndReused) {
  // 9 pages of 4: A takes 3 (10 tokens), B 2 (8), C 4 (13): the pool is full.
  PagedKvCache cache(9, 4, 1, 2, 2, kF32);
  const Sequence a = make_sequence(10, 1, 1, 2, 2, 5), b = make_sequence(8, 1, 1, 2, 2, 6), c = make_sequence(13, 1, 1, 2, 2, 7);
  for (int64_t id : {0, 1, 2}) cache.add_sequence(id);
  append_interleaved(cache, {0, 1, 2}, {a, b, c});
  EXPECT_EQ(cache.free_pages(), 0) << "three sequences of 10, 8 and 13 tokens in pages of 4 fill 9 pages";
  expect_pool_consistent(cache, "full pool");
  const std::vector<int64_t> pages_of_a = cache.block_table(0);
  cache.release(0);
  EXPECT_EQ(cache.free_pages(), 3) << "A's 3 pages back on the free list";
  for (int64_t page : pages_of_a) EXPECT_TRUE(cache.page_is_free(page)) << "A's page " << page << " after release";
  EXPECT_EQ(cache.sequences(), (std::vector<int64_t>{1, 2})) << "A is gone after release";
  expect_error([&] { cache.length(0); }, "no sequence 0");
  expect_pool_consistent(cache, "after A's release");
  // D reuses A's pages, and B and C are untouched.
  const Sequence d = make_sequence(12, 1, 1, 2, 2, 8);
  cache.add_sequence(3);
  cache.append(3, d.k, d.v);
  for (int64_t page : cache.block_table(3))
    EXPECT_TRUE(std::count(pages_of_a.begin(), pages_of_a.end(), page)) << "D's page " << page << " was not A's";
  expect_tokens(cache, 1, b, "B after A left and D came");
  expect_tokens(cache, 2, c, "C after A left and D came");
  expect_tokens(cache, 3, d, "D in A's pages");
  expect_pool_consistent(cache, "after D");
  // Everything released: every page free again.
  for (int64_t id : {1, 2, 3}) cache.release(id);
  EXPECT_EQ(cache.free_pages(), 9) << "every sequence released";
  expect_pool_consistent(cache, "empty pool");
}

CP_TEST(Lesson19, Task1_AFullPoolIsAnErrorThatChangesNothing) {
  // 4 pages of 4: A has 6 tokens (2 pages, room for 2), B 5 (2 pages, room for 3). No page free.
  PagedKvCache cache(4, 4, 2, 3, 3, kF32);
  const Sequence a = make_sequence(12, 2, 2, 3, 3, 9), b = make_sequence(12, 2, 2, 3, 3, 10);
  cache.add_sequence(0);
  cache.add_sequence(1);
  cache.append(0, a.k.narrow(0, 0, 6), a.v.narrow(0, 0, 6));
  cache.append(1, b.k.narrow(0, 0, 5), b.v.narrow(0, 0, 5));
  const torch::Tensor keys = cache.key_pages().clone(), values = cache.value_pages().clone();
  const std::vector<int64_t> table_b = cache.block_table(1);
  // B's 7 more tokens need 1 page: 0 free. The error says how many are free, and nothing moved.
  expect_error([&] { cache.append(1, b.k.narrow(0, 5, 7), b.v.narrow(0, 5, 7)); }, "0 free");
  EXPECT_EQ(cache.length(1), 5) << "B's length after a failed append";
  EXPECT_EQ(cache.block_table(1), table_b) << "B's block table after a failed append";
  EXPECT_TRUE(torch::equal(cache.key_pages(), keys) && torch::equal(cache.value_pages(), values))
      << "the pool's contents changed in an append that failed";
  expect_pool_consistent(cache, "after a failed append");
  // What fits in the room of the last page needs no free page.
  cache.append(0, a.k.narrow(0, 6, 2), a.v.narrow(0, 6, 2));
  cache.append(1, b.k.narrow(0, 5, 3), b.v.narrow(0, 5, 3));
  expect_tokens(cache, 0, {a.q, a.k.narrow(0, 0, 8), a.v.narrow(0, 0, 8)}, "A filled to its pages");
  expect_tokens(cache, 1, {b.q, b.k.narrow(0, 0, 8), b.v.narrow(0, 0, 8)}, "B filled to its pages");
  // A pool of 2 pages cannot take 9 tokens at once, even into an empty sequence.
  PagedKvCache small(2, 4, 1, 2, 2, kF32);
  small.add_sequence(0);
  const Sequence c = make_sequence(9, 1, 1, 2, 2, 11);
  expect_error([&] { small.append(0, c.k, c.v); }, "2 free");
  EXPECT_EQ(small.free_pages(), 2) << "a failed append took pages";
  EXPECT_TRUE(small.block_table(0).empty()) << "a failed append left pages in the table";
}

CP_TEST(Lesson19, Task1_BadInputGivesClearErrors) {
  PagedKvCache cache(4, 4, 2, 3, 5, kF32);
  cache.add_sequence(0);
  const torch::Tensor k = torch::zeros({2, 2, 3}), v = torch::zeros({2, 2, 5});
  cache.append(0, k, v);  // counts once implemented
  PagedKvCache latent = PagedKvCache::latent(4, 4, 6, 2, kF32);
  latent.add_sequence(0);
  testing::expect_errors({
      {"an unknown id", [&] { cache.append(7, k, v); }, "append: id: no sequence 7"},
      {"k of another head dim", [&] { cache.append(0, torch::zeros({2, 2, 4}), v); }, "append: k: expected [t, 2, 3]"},
      {"v of other tokens", [&] { cache.append(0, k, torch::zeros({3, 2, 5})); }, "append: v: expected [2, 2, 5]"},
      {"no v", [&] { cache.append(0, k); }, "append: v: tensor is undefined"},
      {"a v for a latent cache", [&] { latent.append(0, torch::zeros({1, 1, 8}), torch::zeros({1, 1, 6})); },
       "a latent cache has no values"},
      {"an id twice", [&] { cache.add_sequence(0); }, "sequence 0 is already in the cache"},
      {"release of an unknown id", [&] { cache.release(5); }, "release: id: no sequence 5"},
      {"page_size 0", [] { PagedKvCache(4, 0, 1, 2, 2, kF32); }, "page_size must be at least 1, got 0"},
      {"a float64 CPU pool", [] { PagedKvCache(4, 4, 1, 2, 2, kF64); }, "a CPU pool is float32"},
      {"a page outside the pool", [&] { cache.page_is_free(4); }, "page 4 is outside the pool of 4 pages"},
  });
}

// ── Task 2: continuous batching ─────────────────────────────────────────────────────────────

/// One request of a step: its sequence and how many of its last tokens are new queries.
struct Request {
  int64_t length, q_len;
};

/// A pool holding each request's whole sequence (its new tokens included), pages interleaved.
struct BatchCase {
  PagedKvCache cache;
  std::vector<int64_t> ids;
  std::vector<Sequence> seqs;
};

BatchCase make_batch_case(const std::vector<Request>& requests, int64_t page_size, int64_t heads_q, int64_t heads_kv,
                          int64_t dim, uint64_t seed, int64_t spare_pages = 3) {
  int64_t pages = spare_pages;
  for (const Request& r : requests) pages += (r.length + page_size - 1) / page_size;
  BatchCase c{PagedKvCache(pages, page_size, heads_kv, dim, dim, kF32), {}, {}};
  for (size_t i = 0; i < requests.size(); ++i) {
    c.ids.push_back(100 + static_cast<int64_t>(i));
    c.seqs.push_back(make_sequence(requests[i].length, heads_q, heads_kv, dim, dim, seed + i));
    c.cache.add_sequence(c.ids.back());
  }
  append_interleaved(c.cache, c.ids, c.seqs);
  return c;
}

/// The batch's queries, [T, Hq, D]: each request's last q_len rows, in batch order.
torch::Tensor batch_queries(const BatchCase& c, const std::vector<Request>& requests) {
  std::vector<torch::Tensor> rows;
  for (size_t i = 0; i < requests.size(); ++i)
    rows.push_back(c.seqs[i].q.narrow(0, requests[i].length - requests[i].q_len, requests[i].q_len));
  return torch::cat(rows);
}

/// Runs paged_attention on the batch and checks every row against its sequence alone.
PagedResult expect_batch_matches(const BatchCase& c, const std::vector<Request>& requests, torch::ScalarType dtype,
                                 std::optional<double> scale, const std::string& what) {
  std::vector<int64_t> q_lens;
  for (const Request& r : requests) q_lens.push_back(r.q_len);
  const PagedBatch batch = make_batch(c.cache, c.ids, q_lens);
  const PagedResult r = paged_attention(batch_queries(c, requests).to(dtype), c.cache, batch, scale);
  EXPECT_EQ(r.out.scalar_type(), dtype) << what << ": out in q's dtype";
  for (size_t i = 0; i < requests.size(); ++i) {
    const int64_t first = batch.cu_seqlens_q[i], q_len = requests[i].q_len;
    const auto [out, lse] = oracle_rows(c.seqs[i], requests[i].length - q_len, q_len,
                                        scale.value_or(default_scale(c.seqs[i].q.size(2))));
    const std::string request = what + ", request " + std::to_string(i) + " (" + std::to_string(q_len) + " of " +
                                std::to_string(requests[i].length) + " tokens new)";
    CP_EXPECT_CLOSE(r.out.narrow(0, first, q_len), out, "out, " + request, kRowDims);
    CP_EXPECT_CLOSE(r.lse.narrow(0, first, q_len), lse, "lse, " + request, kLseDims);
  }
  return r;
}

/// A mix: a whole prompt (prefill), a chunk at the end of a longer one (chunked prefill), decode
/// tokens, a request with no new token, a sequence of one token.
const std::vector<Request> kMix = {{23, 23}, {40, 7}, {64, 1}, {9, 0}, {1, 1}, {33, 1}};

CP_TEST(Lesson19, Task2_EveryRowEqualsItsSequenceAlone) {
  for (int64_t page_size : {1, 8, 5}) {
    for (auto [heads_q, heads_kv] : {std::pair<int64_t, int64_t>{4, 2}, {3, 3}, {4, 1}}) {
      const BatchCase c = make_batch_case(kMix, page_size, heads_q, heads_kv, 16, 19);
      const std::string what = "page_size " + std::to_string(page_size) + ", Hq " + std::to_string(heads_q) + ", Hkv " +
                               std::to_string(heads_kv);
      const PagedResult mixed = expect_batch_matches(c, kMix, torch::kFloat, std::nullopt, what);
      expect_batch_matches(c, kMix, torch::kDouble, 0.3, what + ", float64 q, scale 0.3");
      // Whatever the mix: each request alone gives the same bits as in the batch.
      std::vector<int64_t> offset = {0};
      for (const Request& r : kMix) offset.push_back(offset.back() + r.q_len);
      for (size_t i = 0; i < kMix.size(); ++i) {
        const BatchCase alone{c.cache, {c.ids[i]}, {c.seqs[i]}};
        const PagedResult r = paged_attention(batch_queries(alone, {kMix[i]}).to(torch::kFloat), c.cache,
                                              make_batch(c.cache, {c.ids[i]}, {kMix[i].q_len}));
        EXPECT_TRUE(torch::equal(r.out, mixed.out.narrow(0, offset[i], kMix[i].q_len)))
            << what << ": request " << i << " alone differs from the same request in the mixed batch";
      }
    }
  }
}

CP_TEST(Lesson19, Task2_ReadsThePoolInPlace) {
  // Two long sequences, one decode token each. Free pages and the unused slots of each last page
  // hold NaN: a read outside the tables' tokens shows. Gathering a sequence into one tensor would
  // allocate its keys and values again: the bytes allocated during the call stay far below them.
  const std::vector<Request> requests = {{1021, 1}, {770, 1}};
  BatchCase c = make_batch_case(requests, 16, 8, 2, 64, 23, 5);
  for (int64_t page = 0; page < c.cache.pages(); ++page)
    if (c.cache.page_is_free(page)) c.cache.key_pages()[page].fill_(NAN), c.cache.value_pages()[page].fill_(NAN);
  for (size_t i = 0; i < requests.size(); ++i) {
    const int64_t last = c.cache.block_table(c.ids[i]).back(), used = requests[i].length % 16;
    c.cache.key_pages()[last].narrow(1, used, 16 - used).fill_(NAN);
    c.cache.value_pages()[last].narrow(1, used, 16 - used).fill_(NAN);
  }
  const torch::Tensor q = batch_queries(c, requests).to(torch::kFloat);
  const PagedBatch batch = make_batch(c.cache, c.ids, {1, 1});
  int64_t peak = 0;
  {
    const MemoryMeter meter;
    paged_attention(q, c.cache, batch);
    peak = meter.peak_bytes();
  }
  const int64_t smallest = 770 * 2 * 64 * 2 * 4;  // the shorter sequence's keys and values, float32
  EXPECT_LT(peak, smallest / 4) << "paged_attention allocated " << peak << " bytes; the shorter sequence's keys and "
                                << "values alone are " << smallest << ": were the pages copied out of the pool?";
  expect_batch_matches(c, requests, torch::kFloat, std::nullopt, "NaN in every slot no token holds");
}

CP_TEST(Lesson19, Task2_BadInputGivesClearErrors) {
  BatchCase c = make_batch_case({{10, 2}, {6, 1}}, 4, 2, 1, 8, 29);
  const torch::Tensor q = torch::zeros({3, 2, 8});
  const PagedBatch good = make_batch(c.cache, c.ids, {2, 1});
  paged_attention(q, c.cache, good);  // counts once implemented
  auto with = [&](auto change) {
    PagedBatch b = good;
    change(b);
    return b;
  };
  const PagedBatch outside = with([](PagedBatch& b) { b.block_tables[1][0] = 99; });
  const PagedBatch too_long = with([](PagedBatch& b) { b.kv_lens[1] = 9; });
  const PagedBatch short_kv = with([](PagedBatch& b) { b.kv_lens[0] = 1; });
  const PagedBatch uneven = with([](PagedBatch& b) { b.cu_seqlens_q.pop_back(); });
  const PagedBatch only_first = make_batch(c.cache, {c.ids[0]}, {2});
  // A finished sequence's table kept past its release: its pages are free (and may be reused).
  PagedBatch stale = good;
  c.cache.release(c.ids[1]);
  const torch::Tensor keys = c.cache.key_pages().clone();
  testing::expect_errors({
      {"a table entry outside the pool", [&] { paged_attention(q, c.cache, outside); },
       "batch.block_tables[1][0] = 99 is outside the pool of 8 pages"},
      {"a released sequence's table", [&] { paged_attention(q, c.cache, stale); }, "which is free"},
      {"a kv_len its pages cannot hold", [&] { paged_attention(q, c.cache, too_long); },
       "too few for kv_lens[1] = 9"},
      {"a kv_len below its new tokens", [&] { paged_attention(q, c.cache, short_kv); },
       "batch.kv_lens[0] = 1 is fewer than the sequence's 2 new tokens"},
      {"cu_seqlens_q one short", [&] { paged_attention(q, c.cache, uneven); }, "cu_seqlens_q needs B + 1 entries"},
      {"q of another head dim", [&] { paged_attention(torch::zeros({3, 2, 4}), c.cache, stale); },
       "paged_attention: q: expected [T, Hq, 8]"},
      {"q with more rows than the batch", [&] { paged_attention(q, c.cache, only_first); },
       "q has 3 token rows, batch.cu_seqlens_q ends at 2"},
      {"Hq not a multiple of Hkv", [&] { PagedKvCache two(4, 4, 2, 8, 8, kF32);
                                         paged_attention(torch::zeros({0, 3, 8}), two, PagedBatch{{0}, {}, {}}); },
       "Hq a multiple of the cache's 2 kv heads"},
      {"a q_len above the sequence's length", [&] { make_batch(c.cache, {c.ids[0]}, {11}); },
       "make_batch: q_lens[0] = 11"},
  });
  EXPECT_TRUE(torch::equal(c.cache.key_pages(), keys)) << "a rejected batch changed the pool";
}

// ── Task 3: where the tokens live ───────────────────────────────────────────────────────────

/// The stripes by their definition, token by token: runs of `interleave` tokens, rank 0 first.
std::vector<int> reference_owners(int64_t length, int world, int64_t interleave) {
  std::vector<int> owners;
  int rank = 0;
  for (int64_t p = 0; p < length; ++p) {
    if (p > 0 && p % interleave == 0) rank = (rank + 1) % world;
    owners.push_back(rank);
  }
  return owners;
}

CP_TEST(Lesson19, Task3_OwnerStripesPositionsByInterleave) {
  EXPECT_EQ(dcp_owner(13, 4, 1), 1) << "position 13, round robin over 4 ranks";
  EXPECT_EQ(dcp_owner(13, 2, 4), 1) << "position 13 over 2 ranks in runs of 4: runs 0..3, 4..7, 8..11, 12..15";
  EXPECT_EQ(dcp_owner(16, 2, 16), 1) << "position 16 over 2 ranks in pages of 16: the second page";
  for (int world : {1, 2, 3, 4, 8})
    for (int64_t interleave : {1, 3, 16}) {
      const std::vector<int> owners = reference_owners(200, world, interleave);
      for (int64_t p = 0; p < 200; ++p)
        ASSERT_EQ(dcp_owner(p, world, interleave), owners[p])
            << "position " << p << ", " << world << " ranks, interleave " << interleave;
    }
}

CP_TEST(Lesson19, Task3_LocalLengthCountsTheShard) {
  for (int world : {1, 2, 3, 4, 5, 8})
    for (int64_t interleave : {1, 2, 5, 16}) {
      const std::vector<int> owners = reference_owners(150, world, interleave);
      std::vector<int64_t> held(world, 0);
      for (int64_t length = 0; length <= 150; ++length) {
        for (int rank = 0; rank < world; ++rank)
          ASSERT_EQ(dcp_local_length(length, rank, world, interleave), held[rank])
              << "rank " << rank << " of " << world << ", interleave " << interleave << ", the first " << length
              << " positions";
        if (length < 150) ++held[owners[length]];
      }
    }
  // A length no loop over positions would finish: the shards still add up.
  const int64_t huge = int64_t{1} << 50;
  int64_t total = 0;
  for (int rank = 0; rank < 8; ++rank) total += dcp_local_length(huge + 5, rank, 8, 16);
  EXPECT_EQ(total, huge + 5) << "the shards of 2^50 + 5 tokens over 8 ranks in pages of 16";
  EXPECT_EQ(dcp_local_length(huge + 5, 0, 8, 16), huge / 8 + 5) << "rank 0 of 8, pages of 16, 2^50 + 5 tokens";
}

CP_TEST(Lesson19, Task3_BadInputGivesClearErrors) {
  dcp_owner(0, 1, 1);  // counts once implemented
  testing::expect_errors({
      {"position -1", [] { dcp_owner(-1, 2, 1); }, "dcp_owner: position must be >= 0, got -1"},
      {"world 0", [] { dcp_owner(3, 0, 1); }, "dcp_owner: world must be at least 1, got 0"},
      {"interleave 0", [] { dcp_local_length(3, 0, 2, 0); }, "dcp_local_length: interleave must be at least 1, got 0"},
      {"rank 2 of 2", [] { dcp_local_length(3, 2, 2, 1); }, "dcp_local_length: rank 2 is outside the world of 2"},
      {"length -4", [] { dcp_local_length(-4, 0, 2, 1); }, "dcp_local_length: length must be >= 0, got -4"},
  });
}

// ── Task 4: the DCP decode step ─────────────────────────────────────────────────────────────

/// This rank's shard of sequences striped by the stripes' definition (not by dcp_owner: a test
/// of task 4 must not lean on task 3's answer), each sequence's first lengths[s] tokens; `full`:
/// a pool of exactly the pages they fill, otherwise one with room to spare.
PagedKvCache striped_shard(const Comm& comm, const std::vector<Sequence>& seqs, const std::vector<int64_t>& lengths,
                           int64_t interleave, int64_t page_size, bool latent, int64_t value_dim, bool full = false) {
  const int64_t heads_kv = seqs[0].k.size(1), key_dim = seqs[0].k.size(2);
  int64_t pages = full ? 0 : 4;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const std::vector<int> owners = reference_owners(lengths[s], comm.size(), interleave);
    const int64_t held = std::count(owners.begin(), owners.end(), comm.rank());
    pages += full ? (held + page_size - 1) / page_size : seqs[s].k.size(0) / page_size + 2;
  }
  pages = std::max<int64_t>(pages, 1);
  PagedKvCache cache = latent ? PagedKvCache::latent(pages, page_size, value_dim, key_dim - value_dim, kF32)
                              : PagedKvCache(pages, page_size, heads_kv, key_dim, value_dim, kF32);
  for (size_t s = 0; s < seqs.size(); ++s) {
    cache.add_sequence(static_cast<int64_t>(s));
    const std::vector<int> owners = reference_owners(lengths[s], comm.size(), interleave);
    for (int64_t p = 0; p < lengths[s]; ++p)
      if (owners[p] == comm.rank())
        cache.append(static_cast<int64_t>(s), seqs[s].k.narrow(0, p, 1), latent ? torch::Tensor() : seqs[s].v.narrow(0, p, 1));
  }
  return cache;
}

/// One DCP step's inputs: rows lengths[s] .. lengths[s] + T of every sequence. q: this rank's heads.
struct StepInputs {
  torch::Tensor q, k, v;  // [B, T, Hq/N, key_dim], [B, T, Hkv, key_dim], [B, T, Hkv, value_dim]
};

StepInputs step_inputs(const Comm& comm, const std::vector<Sequence>& seqs, const std::vector<int64_t>& lengths,
                       int64_t tokens, bool latent, torch::ScalarType dtype) {
  std::vector<torch::Tensor> q, k, v;
  const int64_t own = seqs[0].q.size(1) / comm.size();
  for (size_t s = 0; s < seqs.size(); ++s) {
    q.push_back(seqs[s].q.narrow(0, lengths[s], tokens).narrow(1, comm.rank() * own, own));
    k.push_back(seqs[s].k.narrow(0, lengths[s], tokens));
    v.push_back(seqs[s].v.narrow(0, lengths[s], tokens));
  }
  return {torch::stack(q).to(dtype), torch::stack(k).to(torch::kFloat),
          latent ? torch::Tensor() : torch::stack(v).to(torch::kFloat)};
}

/// Checks a step's result: token i of sequence s against its sequence alone, this rank's heads.
void expect_step_matches(const Comm& comm, const DcpResult& r, const std::vector<Sequence>& seqs,
                         const std::vector<int64_t>& lengths, int64_t tokens, double scale, const std::string& what) {
  const int64_t own = seqs[0].q.size(1) / comm.size();
  for (size_t s = 0; s < seqs.size(); ++s) {
    const auto [out, lse] = oracle_rows(seqs[s], lengths[s], tokens, scale);
    const std::string at = what + ", sequence " + std::to_string(s) + " at length " + std::to_string(lengths[s]) +
                           ", " + where(comm);
    // Each rank's partial is rounded to float32 before the merge: lesson 04's merged tolerance.
    CP_EXPECT_CLOSE(r.out[s], out.narrow(1, comm.rank() * own, own), "out, " + at, kRowDims,
                    testing::merged_tolerance(seqs[s].v.to(torch::kFloat)));
    CP_EXPECT_CLOSE(r.lse[s], lse.narrow(1, comm.rank() * own, own), "lse, " + at, kLseDims);
  }
}

/// Sequences of 0, 3, 17 and 70 tokens before the step: at N = 8 and pages of 8, some shards hold
/// nothing of a sequence (lse −inf) and the new tokens cross from one rank's run to the next.
const std::vector<int64_t> kLengths = {0, 3, 17, 70};

std::vector<Sequence> step_sequences(int world, int64_t heads_kv, int64_t tokens, uint64_t seed) {
  std::vector<Sequence> seqs;
  for (size_t s = 0; s < kLengths.size(); ++s)
    seqs.push_back(make_sequence(kLengths[s] + tokens, 2 * world, heads_kv, 16, 16, seed + s));
  return seqs;
}

CP_TEST(Lesson19, Task4_DecodeStepMatchesOneDevice) {
  for_each_world([](Comm& comm) {
    for (int64_t heads_kv : {1, 2})
      for (int64_t interleave : {1, 8})
        for (DcpExchange exchange : {DcpExchange::AllToAll, DcpExchange::AllGather}) {
          const std::vector<Sequence> seqs = step_sequences(comm.size(), heads_kv, 1, 41);
          PagedKvCache cache = striped_shard(comm, seqs, kLengths, interleave, 8, false, 16);
          const StepInputs in = step_inputs(comm, seqs, kLengths, 1, false, torch::kFloat);
          const DcpResult r = dcp_decode_step(comm, in.q, in.k, in.v, cache, {0, 1, 2, 3}, kLengths, interleave, exchange);
          const std::string what = to_string(exchange) + ", Hkv " + std::to_string(heads_kv) + ", interleave " +
                                   std::to_string(interleave);
          expect_step_matches(comm, r, seqs, kLengths, 1, default_scale(16), what);
          // The new token joined its owner's shard.
          for (size_t s = 0; s < seqs.size(); ++s) {
            const std::vector<int> owners = reference_owners(kLengths[s] + 1, comm.size(), interleave);
            EXPECT_EQ(cache.length(static_cast<int64_t>(s)),
                      std::count(owners.begin(), owners.end(), comm.rank()))
                << what << ": sequence " << s << "'s shard after the step, " << where(comm);
          }
        }
  });
}

CP_TEST(Lesson19, Task4_DraftTokensSeeTheirOwnKeys) {
  // T tokens at positions L … L + T − 1: each sees the shard's keys up to its own position.
  for_each_world([](Comm& comm) {
    for (int64_t tokens : {2, 3, 4})
      for (int64_t interleave : {1, 8}) {
        const std::vector<Sequence> seqs = step_sequences(comm.size(), 1, tokens, 43 + tokens);
        PagedKvCache cache = striped_shard(comm, seqs, kLengths, interleave, 8, false, 16);
        const StepInputs in = step_inputs(comm, seqs, kLengths, tokens, false, torch::kDouble);
        const DcpResult r =
            dcp_decode_step(comm, in.q, in.k, in.v, cache, {0, 1, 2, 3}, kLengths, interleave, DcpExchange::AllToAll, 0.2);
        expect_step_matches(comm, r, seqs, kLengths, tokens, 0.2,
                            std::to_string(tokens) + " tokens, interleave " + std::to_string(interleave) + ", float64 q");
      }
  });
}

CP_TEST(Lesson19, Task4_BothExchangesGiveTheSameBits) {
  for_each_world([](Comm& comm) {
    const std::vector<Sequence> seqs = step_sequences(comm.size(), 2, 3, 47);
    DcpResult results[2];
    int i = 0;
    for (DcpExchange exchange : {DcpExchange::AllToAll, DcpExchange::AllGather}) {
      PagedKvCache cache = striped_shard(comm, seqs, kLengths, 1, 4, false, 16);
      const StepInputs in = step_inputs(comm, seqs, kLengths, 3, false, torch::kFloat);
      results[i++] = dcp_decode_step(comm, in.q, in.k, in.v, cache, {0, 1, 2, 3}, kLengths, 1, exchange);
    }
    EXPECT_TRUE(torch::equal(results[0].out, results[1].out) && torch::equal(results[0].lse, results[1].lse))
        << "all-to-all and all-gather merged the same partials into different bits, " << where(comm)
        << ": is the merge order fixed by the ranks?";
    expect_step_matches(comm, results[0], seqs, kLengths, 3, default_scale(16), "all-to-all");
  });
}

CP_TEST(Lesson19, Task4_BytesMatchTheFormula) {
  for_each_world([](Comm& comm) {
    for (torch::ScalarType dtype : {torch::kFloat, torch::kDouble})
      for (int64_t tokens : {1, 3})
        for (DcpExchange exchange : {DcpExchange::AllToAll, DcpExchange::AllGather}) {
          const std::vector<Sequence> seqs = step_sequences(comm.size(), 1, tokens, 53);
          PagedKvCache cache = striped_shard(comm, seqs, kLengths, 8, 8, false, 16);
          const StepInputs in = step_inputs(comm, seqs, kLengths, tokens, false, dtype);
          CountingComm counting(comm);
          const DcpResult r = dcp_decode_step(counting, in.q, in.k, in.v, cache, {0, 1, 2, 3}, kLengths, 8, exchange);
          const int64_t expected = dcp_bytes(exchange, comm.size(), 4, tokens, 2 * comm.size(), 16, 16,
                                             torch::elementSize(dtype));
          const std::string what = to_string(exchange) + ", " + std::to_string(tokens) + " token(s), " +
                                   std::string(c10::toString(dtype)) + ", " + where(comm);
          EXPECT_EQ(counting.bytes_sent(), expected) << "bytes sent (counted by the test), " << what;
          EXPECT_EQ(r.bytes_sent, expected) << "DcpResult::bytes_sent, " << what;
        }
  });
  EXPECT_EQ(dcp_bytes(DcpExchange::AllToAll, 4, 2, 1, 8, 64, 64, 2), 3 * 2 * 2 * 64 * 2 + 3 * 2 * 2 * 65 * 4)
      << "4 ranks, B 2, one token, Hq 8 (2 a rank), 64 dims, bfloat16 queries";
  EXPECT_EQ(dcp_bytes(DcpExchange::AllGather, 4, 2, 1, 8, 64, 64, 2), 3 * 2 * 2 * 64 * 2 + 3 * 2 * 8 * 65 * 4)
      << "the same with an all-gather of every head's partials";
}

CP_TEST(Lesson19, Task4_LatentCacheWithUnequalDims) {
  // MLA under DCP: the queries are absorbed (key_dim 24 = latent 16 + rope 8), the values are the
  // latent's 16: the partials and their merge have 16 numbers, the scores 24.
  for_each_world([](Comm& comm) {
    std::vector<Sequence> seqs;
    for (size_t s = 0; s < kLengths.size(); ++s) {
      Sequence seq = make_sequence(kLengths[s] + 2, 2 * comm.size(), 1, 24, 16, 59 + s);
      seq.k /= 2;                      // latent rows of spread 1, as the values of the other tests
      seq.v = seq.k.narrow(2, 0, 16);  // a token's value is the first 16 numbers of its latent row
      seqs.push_back(seq);
    }
    PagedKvCache cache = striped_shard(comm, seqs, kLengths, 1, 4, true, 16);
    const StepInputs in = step_inputs(comm, seqs, kLengths, 2, true, torch::kFloat);
    const DcpResult r = dcp_decode_step(comm, in.q, in.k, torch::Tensor(), cache, {0, 1, 2, 3}, kLengths, 1,
                                        DcpExchange::AllToAll, 0.25);
    expect_step_matches(comm, r, seqs, kLengths, 2, 0.25, "latent cache");
  });
}

CP_TEST(Lesson19, Task4_BadInputIsAnErrorOnEveryRank) {
  for_each_world([](Comm& comm) {
    const std::vector<Sequence> seqs = step_sequences(comm.size(), 1, 1, 61);
    auto fresh = [&] { return striped_shard(comm, seqs, kLengths, 1, 8, false, 16); };
    const StepInputs in = step_inputs(comm, seqs, kLengths, 1, false, torch::kFloat);
    {
      PagedKvCache cache = fresh();
      dcp_decode_step(comm, in.q, in.k, in.v, cache, {0, 1, 2, 3}, kLengths, 1, DcpExchange::AllToAll);  // counts once implemented
    }
    const bool last = comm.rank() == comm.size() - 1;
    PagedKvCache cache = fresh(), broken = fresh();
    if (comm.rank() == 0) broken.append(2, in.k[0], in.v[0]);  // sequence 2 (17 tokens) holds one more here
    std::vector<testing::BadInput> table = {
        {"an unknown id", [&] { dcp_decode_step(comm, in.q, in.k, in.v, cache, {0, 1, 2, 9}, kLengths, 1, DcpExchange::AllToAll); },
         "no sequence 9"},
        {"q of another head dim",
         [&] { dcp_decode_step(comm, in.q.narrow(3, 0, 8), in.k, in.v, cache, {0, 1, 2, 3}, kLengths, 1, DcpExchange::AllToAll); },
         "dcp_decode_step: q: expected [B, T, Hq/N, 16]"},
        {"a shard of rank 0 with a token too many",
         [&] { dcp_decode_step(comm, in.q, in.k, in.v, broken, {0, 1, 2, 3}, kLengths, 1, DcpExchange::AllToAll); },
         "its share of 17 tokens striped over"},
    };
    // Pools of exactly the pages their tokens fill (pages of 1): no room for a new token.
    PagedKvCache full = striped_shard(comm, seqs, kLengths, 1, 1, false, 16, true);
    table.push_back({"a shard whose pool is full",
                     [&] { dcp_decode_step(comm, in.q, in.k, in.v, full, {0, 1, 2, 3}, kLengths, 1, DcpExchange::AllToAll); },
                     "more page(s) for the step's new tokens"});
    if (comm.size() > 1) {
      // Only the last rank is wrong; every rank must say so, and none may wait for it.
      table.push_back({"other lengths on the last rank",
                       [&] {
                         std::vector<int64_t> lengths = kLengths;
                         if (last) lengths[2] += 1;
                         dcp_decode_step(comm, in.q, in.k, in.v, cache, {0, 1, 2, 3}, lengths, 1, DcpExchange::AllToAll);
                       },
                       "every rank decodes the same sequences"});
      table.push_back({"another head count on the last rank",
                       [&] {
                         const torch::Tensor q = last ? torch::cat({in.q, in.q}, 2) : in.q;
                         dcp_decode_step(comm, q, in.k, in.v, cache, {0, 1, 2, 3}, kLengths, 1, DcpExchange::AllToAll);
                       },
                       "every rank must pass the same B, T, Hq/N"});
    }
    testing::expect_errors(table);
    for (size_t s = 0; s < kLengths.size(); ++s)
      EXPECT_EQ(cache.length(static_cast<int64_t>(s)), fresh().length(static_cast<int64_t>(s)))
          << "a rejected step changed sequence " << s << "'s shard, " << where(comm);
  });
}

// ── Task 5: MLA's latent cache ──────────────────────────────────────────────────────────────

CP_TEST(Lesson19, Task5_AbsorbedEqualsExplicitHeads) {
  // 4 heads, nope 16, rope 8, latent 32, values 12; a mixed batch over a latent cache in pages.
  const int64_t heads = 4, nope = 16, rope = 8, latent_dim = 32, value_dim = 12;
  torch::Generator gen = at::detail::createCPUGenerator(67);
  const torch::Tensor w_uk = torch::randn({heads, nope, latent_dim}, gen, kF64) / std::sqrt(double(latent_dim)) * 2;
  const torch::Tensor w_uv = torch::randn({heads, value_dim, latent_dim}, gen, kF64) / std::sqrt(double(latent_dim));
  const std::vector<Request> requests = {{30, 30}, {45, 1}, {12, 3}};
  PagedKvCache cache = PagedKvCache::latent(40, 4, latent_dim, rope, kF32);
  std::vector<torch::Tensor> rows, q_nope, q_rope;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> expected;
  for (size_t i = 0; i < requests.size(); ++i) {
    const int64_t length = requests[i].length, first = length - requests[i].q_len;
    const torch::Tensor c = torch::randn({length, latent_dim}, gen, kF64);
    const torch::Tensor k_rope = 2 * torch::randn({length, rope}, gen, kF64);
    const torch::Tensor qn = 2 * torch::randn({length, heads, nope}, gen, kF64);
    const torch::Tensor qr = 2 * torch::randn({length, heads, rope}, gen, kF64);
    cache.add_sequence(static_cast<int64_t>(i));
    cache.append(static_cast<int64_t>(i), torch::cat({c, k_rope}, 1).unsqueeze(1));
    // The explicit heads: k_h = [w_uk[h] c, k_rope], v_h = w_uv[h] c, plain multi-head attention.
    const torch::Tensor k_nope = torch::einsum("hnc,lc->lhn", {w_uk, c});
    const Sequence explicit_heads{torch::cat({qn, qr}, 2), torch::cat({k_nope, k_rope.unsqueeze(1).expand({length, heads, rope})}, 2),
                                  torch::einsum("hvc,lc->lhv", {w_uv, c})};
    expected.push_back(oracle_rows(explicit_heads, first, requests[i].q_len, default_scale(nope + rope)));
    q_nope.push_back(qn.narrow(0, first, requests[i].q_len));
    q_rope.push_back(qr.narrow(0, first, requests[i].q_len));
  }
  const PagedBatch batch = make_batch(cache, {0, 1, 2}, {30, 1, 3});
  for (torch::ScalarType dtype : {torch::kFloat, torch::kDouble}) {
    const PagedResult r = mla_decode(torch::cat(q_nope).to(dtype), torch::cat(q_rope).to(dtype),
                                     {w_uk.to(dtype), w_uv.to(dtype)}, cache, batch);
    ASSERT_EQ(r.out.sizes(), torch::IntArrayRef({34, heads, value_dim})) << "out: [T, H, value_dim]";
    for (size_t i = 0; i < requests.size(); ++i) {
      const std::string what = "request " + std::to_string(i) + ", " + std::string(c10::toString(dtype));
      CP_EXPECT_CLOSE(r.out.narrow(0, batch.cu_seqlens_q[i], requests[i].q_len), expected[i].first, "out, " + what,
                      kRowDims);
      CP_EXPECT_CLOSE(r.lse.narrow(0, batch.cu_seqlens_q[i], requests[i].q_len), expected[i].second, "lse, " + what,
                      kLseDims);
    }
  }
}

CP_TEST(Lesson19, Task5_BadInputGivesClearErrors) {
  PagedKvCache cache = PagedKvCache::latent(8, 4, 8, 4, kF32);
  cache.add_sequence(0);
  cache.append(0, torch::zeros({3, 1, 12}));
  const PagedBatch batch = make_batch(cache, {0}, {1});
  const torch::Tensor q_nope = torch::zeros({1, 2, 6}), q_rope = torch::zeros({1, 2, 4});
  const MlaWeights w{torch::zeros({2, 6, 8}), torch::zeros({2, 5, 8})};
  mla_decode(q_nope, q_rope, w, cache, batch);  // counts once implemented
  PagedKvCache plain(8, 4, 1, 12, 12, kF32);
  testing::expect_errors({
      {"a cache with values", [&] { mla_decode(q_nope, q_rope, w, plain, batch); }, "expected a latent cache"},
      {"q_rope of another size", [&] { mla_decode(q_nope, torch::zeros({1, 2, 3}), w, cache, batch); },
       "mla_decode: q_rope: expected [1, 2, 4]"},
      {"w_uk of another latent", [&] { mla_decode(q_nope, q_rope, {torch::zeros({2, 6, 7}), w.w_uv}, cache, batch); },
       "mla_decode: weights.w_uk: expected [2, 6, 8]"},
      {"w_uv of other heads", [&] { mla_decode(q_nope, q_rope, {w.w_uk, torch::zeros({3, 5, 8})}, cache, batch); },
       "mla_decode: weights.w_uv: expected [2, value_dim, 8]"},
  });
}

// ── Task 6: the cache a model needs ─────────────────────────────────────────────────────────

/// The test's own count, from a token's whole cache (every layer, kv head, key and value).
double reference_bytes(const ModelShape& m, int tp, int dcp) {
  const double whole = static_cast<double>(m.layers * m.heads_kv * (m.key_dim + m.value_dim) * m.element_size);
  return whole / std::min<int64_t>(tp, m.heads_kv) / dcp;
}

CP_TEST(Lesson19, Task6_CacheBytesPerToken) {
  const ModelShape deepseek = deepseek_v3(), qwen = qwen3_235b();
  EXPECT_DOUBLE_EQ(cache_bytes_per_token(deepseek, 8, 1), 61 * 576 * 2) << "DeepSeek-V3 on TP 8: the whole latent row";
  EXPECT_DOUBLE_EQ(cache_bytes_per_token(deepseek, 8, 8), 61 * 576 * 2 / 8.0) << "DeepSeek-V3 on TP 8 with DCP 8";
  EXPECT_DOUBLE_EQ(cache_bytes_per_token(qwen, 8, 1), 94 * 256 * 2) << "Qwen3-235B on TP 8: one kv head per GPU";
  EXPECT_DOUBLE_EQ(cache_bytes_per_token(qwen, 2, 1), 94 * 2 * 256 * 2) << "Qwen3-235B on TP 2: two kv heads per GPU";
  for (const ModelShape& m : {deepseek, qwen})
    for (int tp : {1, 2, 4, 8, 16})
      for (int dcp : {1, 2, 4, 8, 16}) {
        const int copies = std::max<int>(1, tp / static_cast<int>(m.heads_kv));
        if (copies % dcp != 0) continue;
        EXPECT_DOUBLE_EQ(cache_bytes_per_token(m, tp, dcp), reference_bytes(m, tp, dcp))
            << m.name << ", tp " << tp << ", dcp " << dcp;
        const int64_t budget = int64_t{40} << 30;
        EXPECT_EQ(max_context_tokens(m, tp, dcp, budget),
                  static_cast<int64_t>(std::floor(budget / reference_bytes(m, tp, dcp))))
            << m.name << ", tp " << tp << ", dcp " << dcp << ", 40 GiB of cache per GPU";
      }
}

CP_TEST(Lesson19, Task6_BadShapesAreErrors) {
  cache_bytes_per_token(deepseek_v3(), 8, 2);  // counts once implemented
  testing::expect_errors({
      {"DCP 4 where 2 GPUs hold each kv head", [] { cache_bytes_per_token(qwen3_235b(), 8, 4); },
       "dcp = 4 must divide the 2 GPU(s)"},
      {"DCP 2 where no kv head is copied", [] { cache_bytes_per_token(qwen3_235b(), 4, 2); },
       "dcp = 2 must divide the 1 GPU(s)"},
      {"DCP 3 in a TP group of 8", [] { cache_bytes_per_token(deepseek_v3(), 8, 3); }, "dcp = 3 must divide the 8"},
      {"TP 3 over 4 kv heads", [] { cache_bytes_per_token(qwen3_235b(), 3, 1); }, "must divide one another"},
      {"TP 0", [] { cache_bytes_per_token(qwen3_235b(), 0, 1); }, "tp and dcp must be at least 1"},
  });
}

// ── CUDA tensors ────────────────────────────────────────────────────────────────────────────

CP_TEST(Lesson19Cuda, PagedAttentionMatchesOneDeviceOnCuda) {
  CP_REQUIRE_GPU();
  // The pages on the GPU in bfloat16 (gathered for lesson 03's kernel): the oracle takes the same
  // rounded values.
  const int64_t page_size = 8, dim = 64;
  std::vector<Sequence> seqs;
  std::vector<int64_t> ids;
  int64_t pages = 2;
  for (size_t i = 0; i < kMix.size(); ++i) {
    Sequence s = make_sequence(kMix[i].length, 4, 2, dim, dim, 71 + i);
    for (torch::Tensor* t : {&s.q, &s.k, &s.v}) *t = t->to(torch::kBFloat16).to(torch::kDouble);
    seqs.push_back(s);
    ids.push_back(static_cast<int64_t>(i));
    pages += (kMix[i].length + page_size - 1) / page_size;
  }
  PagedKvCache cache(pages, page_size, 2, dim, dim, torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA));
  for (int64_t id : ids) cache.add_sequence(id);
  append_interleaved(cache, ids, seqs);
  std::vector<int64_t> q_lens;
  std::vector<torch::Tensor> rows;
  for (size_t i = 0; i < kMix.size(); ++i) {
    q_lens.push_back(kMix[i].q_len);
    rows.push_back(seqs[i].q.narrow(0, kMix[i].length - kMix[i].q_len, kMix[i].q_len));
  }
  const PagedBatch batch = make_batch(cache, ids, q_lens);
  const PagedResult r = paged_attention(torch::cat(rows).to(torch::kCUDA, torch::kBFloat16), cache, batch);
  for (size_t i = 0; i < kMix.size(); ++i) {
    const auto [out, lse] = oracle_rows(seqs[i], kMix[i].length - kMix[i].q_len, kMix[i].q_len, default_scale(dim));
    const std::string what = "request " + std::to_string(i) + " on CUDA";
    CP_EXPECT_CLOSE(r.out.narrow(0, batch.cu_seqlens_q[i], kMix[i].q_len).cpu(), out, "out, " + what, kRowDims,
                    testing::merged_tolerance(seqs[i].v.to(torch::kBFloat16)));
    CP_EXPECT_CLOSE(r.lse.narrow(0, batch.cu_seqlens_q[i], kMix[i].q_len).cpu(), lse, "lse, " + what, kLseDims);
  }
  PagedKvCache latent = PagedKvCache::latent(4, 4, 8, 4, torch::TensorOptions().device(torch::kCUDA));
  latent.add_sequence(0);
  latent.append(0, torch::zeros({2, 1, 12}, torch::kCUDA));
  expect_error([&] { paged_attention(torch::zeros({1, 2, 12}, torch::kCUDA), latent, make_batch(latent, {0}, {1})); },
               "a latent cache (MLA) runs on the CPU");
}

}  // namespace
}  // namespace cp
