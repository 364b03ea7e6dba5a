// Lesson 10 — Ulysses: the all-to-alls against the unsharded tensors, the positions of the gathered
// sequence against the layout, the replicated K/V heads against the query heads that read them and
// the sum of their gradients against a loop, and each rank's (out, lse, dq, dk, dv) against float64
// attention over the whole sequence, for every token layout and both GQA cases (K/V heads split or
// replicated), in float32 and float64, on local worlds of 1, 2, 3, 4, 8 ranks or the mpirun world;
// the bytes sent against the formula, tensor by tensor; lesson 09's layer trained with Ulysses.
#include <torch/types.h>

#include <cmath>
#include <sstream>

#include "common/error.h"
#include "common/world.h"
#include "layer_reference.h"
#include "testing/harness.h"
#include "testing/oracle.h"
#include "testing/trace_reader.h"
#include "ulysses.h"

namespace cp {
namespace {

using testing::all_close;
using testing::for_each_world;

const std::vector<std::string> kDims = {"b", "h", "s", "d"};

/// Heads for a world of P ranks, every way the K/V heads can reach the ranks:
///   Hq = Hkv = P             no GQA: one query head and its K/V head per rank
///   Hq = 2P, Hkv = P         GQA, the K/V heads split like the query heads
///   Hq = 2P, Hkv = 2         P = 4 or 8: each K/V head replicated P/2 times
///   Hq = 8, Hkv = 4          P = 8: each K/V head replicated twice
///   Hq = 2P, Hkv = 1         P > 1: the one K/V head replicated on every rank (last)
struct Heads {
  int64_t q, kv;
};
std::vector<Heads> heads_for(int world) {
  std::vector<Heads> heads = {{world, world}, {2 * world, world}};
  if (world == 4 || world == 8) heads.push_back({2 * world, 2});
  if (world == 8) heads.push_back({8, 4});
  if (world > 1) heads.push_back({2 * world, 1});
  return heads;
}

std::string where(const Comm& comm, const std::string& what) {
  return what + ", rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
}

// ── Task 1: the two all-to-alls ───────────────────────────────────────────────────────────────

/// Elements labelled by where they come from: 100000·b + 1000·head + token + d/4.
torch::Tensor labelled(int64_t batch, int64_t heads, int64_t seq, int64_t dim) {
  return (torch::arange(batch).view({batch, 1, 1, 1}) * 100000 + torch::arange(heads).view({1, heads, 1, 1}) * 1000 +
          torch::arange(seq).view({1, 1, seq, 1}) + torch::arange(dim).view({1, 1, 1, dim}) * 0.25)
      .to(torch::kDouble)
      .contiguous();
}

/// Empty when `got` equals `expected` (both labelled); else the first element that differs, as
/// the (b, head, token) that arrived there instead of the one expected.
std::string first_difference(const torch::Tensor& got, const torch::Tensor& expected) {
  std::ostringstream out;
  if (got.sizes() != expected.sizes()) {
    out << "shape " << got.sizes() << ", expected " << expected.sizes();
    return out.str();
  }
  const torch::Tensor wrong = (got != expected).flatten().nonzero().flatten();
  if (wrong.size(0) == 0) return "";
  auto name = [](double x) {
    const auto l = static_cast<int64_t>(x);
    return "(b " + std::to_string(l / 100000) + ", head " + std::to_string(l % 100000 / 1000) + ", token " +
           std::to_string(l % 1000) + ")";
  };
  const int64_t first = wrong[0].item<int64_t>();
  std::vector<int64_t> index(got.dim());
  for (int64_t d = got.dim() - 1, rest = first; d >= 0; --d) index[d] = rest % got.size(d), rest /= got.size(d);
  out << wrong.size(0) << " of " << got.numel() << " elements differ; first at " << torch::IntArrayRef(index)
      << ": got " << name(got.flatten()[first].item<double>()) << ", expected "
      << name(expected.flatten()[first].item<double>());
  return out.str();
}

/// Passes when `got` equals `expected` (both labelled); else `what` and the first difference.
::testing::AssertionResult same_labels(const torch::Tensor& got, const torch::Tensor& expected, const std::string& what) {
  const std::string difference = first_difference(got, expected);
  if (difference.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << difference;
}

CP_TEST(Lesson10, Task1_SeqToHeadsGivesThisRanksHeadsOfTheWholeSequence) {
  for_each_world([](Comm& comm) {
    const int p = comm.size(), r = comm.rank();
    const int64_t chunk = 5, heads = 2 * p;
    const torch::Tensor full = labelled(2, heads, chunk * p, 3);  // the unsharded tensor
    const torch::Tensor mine = full.narrow(2, r * chunk, chunk).contiguous();
    const torch::Tensor expected = full.narrow(1, r * heads / p, heads / p).contiguous();
    CP_EXPECT_RESULT(same_labels(ulysses_seq_to_heads(comm, mine), expected,
                                 where(comm, "seq_to_heads: heads [" + std::to_string(r * heads / p) + ", " +
                                                 std::to_string((r + 1) * heads / p) + ") of the whole sequence")));
    CP_EXPECT_RESULT(same_labels(ulysses_heads_to_seq(comm, expected), mine,
                                 where(comm, "heads_to_seq: tokens [" + std::to_string(r * chunk) + ", " +
                                                 std::to_string((r + 1) * chunk) + ") of every head")));
    CP_EXPECT_RESULT(same_labels(ulysses_heads_to_seq(comm, ulysses_seq_to_heads(comm, mine)), mine,
                                 where(comm, "heads_to_seq(seq_to_heads(x)) = x")));
    // lse-shaped tensors [B, H, S/P] take the same path.
    CP_EXPECT_RESULT(same_labels(ulysses_seq_to_heads(comm, mine.select(3, 0).contiguous()), expected.select(3, 0),
                                 where(comm, "seq_to_heads of a 3-D tensor")));
  });
}

/// "[0 1 2 | 9 10 11 | ...]": an int64 vector cut into `parts` equal parts (the ranks' chunks).
std::string chunks_text(const torch::Tensor& t, int parts) {
  std::ostringstream out;
  const torch::Tensor v = t.to(torch::kLong).contiguous();
  const int64_t n = v.numel(), per = parts > 0 && n % parts == 0 ? n / parts : n;
  out << "[";
  for (int64_t i = 0; i < n; ++i) out << (i == 0 ? "" : per > 0 && i % per == 0 ? " | " : " ") << v[i].item<int64_t>();
  out << "]";
  return out.str();
}

CP_TEST(Lesson10, Task1_PositionsFollowTheGatheredSequence) {
  for (TokenLayout layout : {TokenLayout::Contiguous, TokenLayout::ZigZag, TokenLayout::Stripe})
    for (int p : {1, 2, 3, 4, 8}) {
      const int64_t s = 6 * p;  // 2P zig-zag chunks of 3 tokens
      // Rank r holds the tokens of lesson 07's layout, and the all-to-all lays them out in rank order.
      std::vector<torch::Tensor> delivered;
      for (int r = 0; r < p; ++r) delivered.push_back(shard_sequence(torch::arange(s), layout, p, r, 0));
      const torch::Tensor expected = torch::cat(delivered);
      const torch::Tensor got = ulysses_positions(layout, s, p);
      const std::string what = "ulysses_positions(" + to_string(layout) + ", S = " + std::to_string(s) + ", P = " +
                               std::to_string(p) + ")";
      if (got.scalar_type() != torch::kLong || got.sizes() != expected.sizes()) {
        ADD_FAILURE() << what << ": dtype " << got.scalar_type() << " " << got.sizes() << ", expected Long (int64) ["
                      << s << "]: one position per token of the whole sequence";
        break;
      }
      if (!torch::equal(got, expected)) {
        ADD_FAILURE() << what << ": wrong positions (one | between the chunks of rank 0, 1, ...)\n  got      "
                      << chunks_text(got, p) << "\n  expected " << chunks_text(expected, p)
                      << "\n  Index i must be the global position of the token at index i of ulysses_seq_to_heads' "
                         "result: the all-to-all puts rank 0's tokens first, then rank 1's, and rank r holds the "
                         "positions lesson 07's layout gives it.";
        break;  // the next P of this layout would repeat the message
      }
    }
  // The layout's divisibility is checked before anything else (given).
  testing::expect_error([] { ulysses_positions(TokenLayout::ZigZag, 12, 4); }, "S = 12 is not divisible by 2N = 8");
}

// ── Task 2 and 3: forward and backward against the oracle ─────────────────────────────────────

struct Case {
  int64_t batch, chunk, head_dim;  // chunk = S/P, not a multiple of the kernels' tiles
  bool causal;
  TokenLayout layout;
};

/// What check_case runs: the forward, the backward (from what the forward would keep, made from
/// the reference's out and lse, so that it does not depend on the forward), or the backward from
/// what the forward kept.
enum class Pass { Forward, Backward, Both };

/// The K/V head (of the caller's Hkv) that K/V head `i` of the exchanged tensor (kv heads,
/// ulysses_kv_heads) must be: rank j = i / (kv/P) receives it as its local head l = i mod (kv/P),
/// and its query heads j·Hq/P + a with a / ((Hq/P) / (kv/P)) = l read K/V head (j·Hq/P + a) / (Hq/Hkv).
int64_t kv_head_read_by(int64_t i, int64_t hq, int64_t hkv, int64_t kv, int p) {
  const int64_t per_rank = kv / p, j = i / per_rank, l = i % per_rank, group = (hq / p) / per_rank;
  return (j * hq / p + l * group) / (hq / hkv);
}

/// The reference of replicate_kv_heads: K/V head i of the result is the head kv_head_read_by(i).
torch::Tensor reference_kv(const torch::Tensor& t, int64_t hq, int64_t kv, int p) {
  std::vector<int64_t> index;
  for (int64_t i = 0; i < kv; ++i) index.push_back(kv_head_read_by(i, hq, t.size(1), kv, p));
  return t.index_select(1, torch::tensor(index, torch::kLong).to(t.device()));
}

/// The UlyssesSaved of a forward that got out and lse right: this rank's q, k, v, out, lse brought
/// to the head split with task 1's exchange (K/V heads replicated by the test's reference, so that
/// the backward's tests do not depend on task 2).
UlyssesSaved saved_from_reference(Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& out, const torch::Tensor& lse) {
  const int p = comm.size();
  const int64_t kv = ulysses_kv_heads(q.size(1), k.size(1), p);
  auto heads = [&](const torch::Tensor& t) { return ulysses_seq_to_heads(comm, t.contiguous()); };
  return {heads(q), heads(out), heads(reference_kv(k, q.size(1), kv, p)), heads(reference_kv(v, q.size(1), kv, p)),
          heads(lse), k.size(1)};
}

/// Passes when t has the dtype `expected`; else names the tensor, both dtypes and `why`.
::testing::AssertionResult has_dtype(const torch::Tensor& t, torch::Dtype expected, const std::string& what,
                                     const std::string& why) {
  if (t.defined() && t.scalar_type() == expected) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": dtype "
                                       << (t.defined() ? c10::toString(t.scalar_type()) : "undefined") << ", expected "
                                       << c10::toString(expected) << " (" << why << ")";
}

/// One tensor's share of the bytes a rank sends: (P−1)/P of the tensor in one all-to-all.
struct Share {
  std::string name;
  int64_t bytes;
};

/// The bytes of one pass, tensor by tensor, as ulysses_volume counts them.
std::vector<Share> shares(const Case& c, const Heads& h, int p, int64_t element_size, bool forward) {
  const int64_t kv = ulysses_kv_heads(h.q, h.kv, p);
  auto sent = [&](int64_t heads, int64_t dim, int64_t bytes) {
    return (p - 1) * c.batch * heads * c.chunk * dim / p * bytes;
  };
  const int64_t q = sent(h.q, c.head_dim, element_size), k = sent(kv, c.head_dim, element_size);
  if (forward) return {{"q", q}, {"k", k}, {"v", k}, {"out", q}, {"lse", sent(h.q, 1, 4)}};
  return {{"dout", q}, {"dq", q}, {"dk", k}, {"dv", k}};
}

/// A classic miscount and the total it gives.
struct Miscount {
  std::string what;
  int64_t total;
};

/// The classic miscounts of one pass, each as all_to_all_bytes would add it up: K/V counted with the
/// caller's Hkv heads instead of the ones that travel, lse in q's dtype, gradients in float32.
std::vector<Miscount> miscounts(const Case& c, const Heads& h, int p, int64_t element_size, bool forward) {
  const int64_t kv = ulysses_kv_heads(h.q, h.kv, p);
  auto bytes = [&](int64_t heads, int64_t dim, int64_t size) { return c.batch * heads * c.chunk * dim * size / p * (p - 1); };
  const int64_t q = bytes(h.q, c.head_dim, element_size);  // dout: in the inputs' dtype whatever the gradients'
  auto total = [&](int64_t kv_heads, int64_t size, int64_t lse_size) {
    return forward ? 2 * bytes(h.q, c.head_dim, size) + 2 * bytes(kv_heads, c.head_dim, size) + bytes(h.q, 1, lse_size)
                   : q + bytes(h.q, c.head_dim, size) + 2 * bytes(kv_heads, c.head_dim, size);
  };
  std::vector<Miscount> out;
  if (kv != h.kv)
    out.push_back({std::string(forward ? "k and v" : "dk and dv") + " counted with the caller's Hkv = " +
                       std::to_string(h.kv) + " heads, not the " + std::to_string(kv) + " heads that travel" +
                       (forward ? " (after replicate_kv_heads)" : " (before the replica sum)"),
                   total(h.kv, element_size, 4)});
  if (forward && element_size != 4)
    out.push_back({"lse counted in q's dtype, not in float32", total(kv, element_size, element_size)});
  if (!forward && element_size != 4)
    out.push_back({"dq, dk, dv counted in float32 (4 bytes), not in the inputs' dtype (" +
                       std::to_string(element_size) + " bytes)",
                   total(kv, 4, 4)});
  return out;
}

/// Passes when `measured` is `expected` (ulysses_volume); else the breakdown, tensor by tensor
/// (`parts`, which sum to it), and the classic miscount or the tensors (if any) the difference is.
::testing::AssertionResult bytes_match(int64_t measured, int64_t expected, const std::vector<Share>& parts,
                                       const std::string& what, const std::string& note,
                                       const std::vector<Miscount>& known = {}) {
  if (measured == expected) return ::testing::AssertionSuccess();
  int64_t sum = 0;
  for (const Share& s : parts) sum += s.bytes;
  std::ostringstream out;
  out << what << ": stats.bytes_sent = " << measured << ", expected " << expected << " (ulysses_volume) =";
  for (size_t i = 0; i < parts.size(); ++i) out << (i ? " +" : "") << " " << parts[i].name << " " << parts[i].bytes;
  if (sum != expected) out << " (the test's breakdown sums to " << sum << ": out of date with ulysses_volume)";
  out << "\n  (each all-to-all sends (P-1)/P of its tensor, as all_to_all_bytes counts it; " << note << ")";
  for (const Miscount& m : known)
    if (m.total == measured) return ::testing::AssertionFailure() << out.str() << "\n  that is the total of " << m.what;
  // The smallest set of tensors whose bytes are exactly the difference: left out, or counted twice.
  const int64_t diff = measured - expected;
  std::string best;
  size_t best_count = parts.size() + 1;
  for (unsigned set = 1; set < (1u << parts.size()); ++set) {
    int64_t set_bytes = 0;
    std::string names;
    size_t count = 0;
    for (size_t i = 0; i < parts.size(); ++i)
      if (set & (1u << i)) set_bytes += parts[i].bytes, names += (count++ ? ", " : "") + parts[i].name;
    if (set_bytes == std::llabs(diff) && count < best_count) best = names, best_count = count;
  }
  if (!best.empty())
    out << "\n  the difference, " << diff << ", is exactly the share of " << best
        << (diff < 0 ? ": not exchanged, or not counted?" : ": counted twice?");
  else
    out << "\n  the difference, " << diff << ", is no tensor's share: a tensor counted in another dtype or with "
           "another number of heads?";
  return ::testing::AssertionFailure() << out.str();
}

/// One case on every rank: the shards of a random sequence (in `dtype`, on `device`) through the
/// forward and/or the backward, every output against float64 attention over the whole sequence in
/// position order, and the bytes sent against ulysses_volume.
void check_case(Comm& comm, const Case& c, const Heads& h, uint64_t seed, Pass pass,
                torch::Dtype dtype = torch::kFloat, torch::Device device = torch::kCPU) {
  const int p = comm.size();
  const int64_t s = c.chunk * p;
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  const torch::Tensor q = torch::randn({c.batch, h.q, s, c.head_dim}, gen).to(dtype),
                      k = torch::randn({c.batch, h.kv, s, c.head_dim}, gen).to(dtype),
                      v = torch::randn({c.batch, h.kv, s, c.head_dim}, gen).to(dtype),
                      dout = torch::randn({c.batch, h.q, s, c.head_dim}, gen).to(dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const torch::Tensor pos = torch::arange(s);
  const auto [out, lse] = testing::oracle_attention(q, k, v, c.causal, pos, pos, scale);
  auto mine = [&](const torch::Tensor& t) { return shard_sequence(t, c.layout, p, comm.rank()).contiguous(); };
  auto in = [&](const torch::Tensor& t) { return mine(t).to(device); };
  const UlyssesOptions options = ulysses_options(c.causal, c.layout);
  const UlyssesVolume volume = ulysses_volume(c.batch, h.q, h.kv, s, c.head_dim, p, q.element_size());
  const std::string what = where(comm, to_string(c.layout) + (c.causal ? " causal" : " full") + ", Hq " +
                                           std::to_string(h.q) + " Hkv " + std::to_string(h.kv) + ", " +
                                           c10::toString(dtype) + (device.is_cuda() ? " cuda" : ""));
  const int64_t kv = ulysses_kv_heads(h.q, h.kv, p);
  const std::string kv_note = kv == h.kv ? "k, v with their " + std::to_string(h.kv) + " heads"
                                         : "k, v with the " + std::to_string(kv) + " heads of the replicated K/V";
  const std::string bytes_note = kv_note + ", in " + c10::toString(dtype);
  UlyssesSaved saved;
  if (pass != Pass::Backward) {
    const UlyssesResult r = ulysses_attention_forward(comm, in(q), in(k), in(v), options);
    CP_EXPECT_RESULT(has_dtype(r.out, dtype, "out " + what, "the dtype of q"));
    CP_EXPECT_RESULT(has_dtype(r.lse, torch::kFloat, "lse " + what, "lse is float32 whatever the dtype of q"));
    CP_EXPECT_CLOSE(r.out, mine(out), "out " + what, kDims);
    CP_EXPECT_CLOSE(r.lse, mine(lse), "lse " + what, {"b", "h", "s"});
    const std::vector<Share> parts = shares(c, h, p, q.element_size(), true);
    CP_EXPECT_RESULT(bytes_match(r.stats.bytes_sent, volume.forward_bytes, parts, "forward bytes, " + what,
                                 bytes_note + ", lse float32", miscounts(c, h, p, q.element_size(), true)));
    saved = r.saved;
  } else {
    saved = saved_from_reference(comm, in(q), in(k), in(v), in(out.to(dtype)), in(lse.to(torch::kFloat)));
  }
  if (pass == Pass::Forward) return;
  const auto [dq, dk, dv] = testing::oracle_attention_grads(q, k, v, dout, c.causal, pos, pos, scale);
  const UlyssesGrads g = ulysses_attention_backward(comm, in(dout), saved, options);
  const std::string cast = "the dtype of the inputs; lesson 05's block backward returns float32 gradients";
  CP_EXPECT_RESULT(has_dtype(g.dq, dtype, "dq " + what, cast));
  CP_EXPECT_RESULT(has_dtype(g.dk, dtype, "dk " + what, cast));
  CP_EXPECT_RESULT(has_dtype(g.dv, dtype, "dv " + what, cast));
  CP_EXPECT_CLOSE(g.dq, mine(dq), "dq " + what, kDims, testing::gradient_tolerance(dtype, dq));
  CP_EXPECT_CLOSE(g.dk, mine(dk), "dk " + what, kDims, testing::gradient_tolerance(dtype, dk));
  CP_EXPECT_CLOSE(g.dv, mine(dv), "dv " + what, kDims, testing::gradient_tolerance(dtype, dv));
  const std::vector<Share> parts = shares(c, h, p, q.element_size(), false);
  CP_EXPECT_RESULT(bytes_match(g.stats.bytes_sent, volume.backward_bytes, parts, "backward bytes, " + what,
                               bytes_note + ": the gradients travel in the inputs' dtype",
                               miscounts(c, h, p, q.element_size(), false)));
}

CP_TEST(Lesson10, Task2_ReplicatedKvHeadsReachTheRanksThatReadThem) {
  // (Hq, Hkv, P): K/V heads replicated P/Hkv times, and once split (8, 8, 4) where t comes back as is.
  struct Config {
    int64_t hq, hkv;
    int p;
  };
  for (const Config& c : {Config{8, 2, 4}, Config{16, 2, 8}, Config{8, 4, 8}, Config{12, 3, 6}, Config{6, 1, 3},
                          Config{8, 8, 4}}) {
    const int64_t kv = ulysses_kv_heads(c.hq, c.hkv, c.p), per_rank = kv / c.p;
    const torch::Tensor k = labelled(2, c.hkv, 3, 2);  // head h of k carries the label 1000·h + ...
    const torch::Tensor got = replicate_kv_heads(k, kv);
    const std::string what = "replicate_kv_heads of Hkv = " + std::to_string(c.hkv) + " heads to " +
                             std::to_string(kv) + " (Hq = " + std::to_string(c.hq) + ", P = " + std::to_string(c.p) + ")";
    if (got.sizes() != torch::IntArrayRef({2, kv, 3, 2})) {
      ADD_FAILURE() << what << ": shape " << got.sizes() << ", expected [2, " << kv << ", 3, 2]";
      continue;
    }
    for (int64_t i = 0; i < kv; ++i) {
      const int64_t rank = i / per_rank, want = kv_head_read_by(i, c.hq, c.hkv, kv, c.p);
      if (torch::equal(got.select(1, i), k.select(1, want))) continue;
      const auto label = static_cast<int64_t>(got[0][i][0][0].item<double>());  // b 0, token 0, d 0: 1000·head
      ADD_FAILURE() << what << ": head " << i << " of the result goes to rank " << rank << " (ulysses_seq_to_heads "
                    << "gives rank r heads [r*" << per_rank << ", (r+1)*" << per_rank << ")), whose query heads ["
                    << rank * c.hq / c.p << ", " << (rank + 1) * c.hq / c.p << ") read K/V head " << want
                    << " (query head h reads K/V head h / (Hq/Hkv) = h / " << c.hq / c.hkv << "), but it holds "
                    << (label % 1000 == 0 && label / 1000 < c.hkv ? "K/V head " + std::to_string(label / 1000)
                                                                 : "something else than a copy of one K/V head");
      break;  // the next heads would repeat the message
    }
  }
}

CP_TEST(Lesson10, Task2_ForwardMatchesFullAttention) {
  for_each_world([](Comm& comm) {
    uint64_t seed = 100;
    for (const Heads& h : heads_for(comm.size()))
      for (bool causal : {false, true})
        check_case(comm, {2, 13, 32, causal, TokenLayout::Contiguous}, h, seed++, Pass::Forward);
    // float64 on the CPU: out in the dtype of q, lse float32, the bytes of 8-byte elements.
    check_case(comm, {1, 6, 16, true, TokenLayout::ZigZag}, heads_for(comm.size()).back(), 150, Pass::Forward,
               torch::kDouble);
  });
}

CP_TEST(Lesson10, Task2_CausalMaskFromGlobalPositionsForEveryLayout) {
  for_each_world([](Comm& comm) {
    const Heads h = heads_for(comm.size()).back();  // replicated K/V heads where P > 1
    uint64_t seed = 200;
    for (TokenLayout layout : {TokenLayout::ZigZag, TokenLayout::Stripe})
      check_case(comm, {1, 6, 64, true, layout}, h, seed++, Pass::Forward);  // S = 6P: 2P zig-zag chunks of 3
  });
}

/// Passes when `got` is `expected` exactly; else `what`, and the shapes or how many elements differ.
::testing::AssertionResult same_tensor(const torch::Tensor& got, const torch::Tensor& expected, const std::string& what) {
  if (!got.defined()) return ::testing::AssertionFailure() << what << ": undefined";
  if (got.sizes() != expected.sizes())
    return ::testing::AssertionFailure() << what << ": shape " << got.sizes() << ", expected " << expected.sizes();
  if (got.scalar_type() != expected.scalar_type())
    return ::testing::AssertionFailure() << what << ": dtype " << got.scalar_type() << ", expected "
                                         << expected.scalar_type();
  const int64_t wrong = got.ne(expected).sum().item<int64_t>();
  if (wrong == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << wrong << " of " << got.numel() << " elements differ";
}

CP_TEST(Lesson10, Task2_ForwardKeepsTheHeadSplitForTheBackward) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    const Heads h = heads_for(p).back();  // replicated K/V heads where P > 1
    const int64_t kv = ulysses_kv_heads(h.q, h.kv, p);
    torch::Generator gen = at::detail::createCPUGenerator(500);
    const torch::Tensor q = torch::randn({1, h.q, 4, 32}, gen), k = torch::randn({1, h.kv, 4, 32}, gen),
                        v = torch::randn({1, h.kv, 4, 32}, gen);
    const UlyssesResult r = ulysses_attention_forward(comm, q, k, v, ulysses_options(true));
    auto heads = [&](const torch::Tensor& t) { return ulysses_seq_to_heads(comm, t.contiguous()); };
    // What the backward reads: the tensors the attention ran on, in the head split [B, H/P, S, ...].
    const std::string why = " (the tensors the attention ran on, in the head split: ulysses_seq_to_heads of ";
    CP_EXPECT_RESULT(same_tensor(r.saved.q, heads(q), where(comm, "saved.q") + why + "q)"));
    CP_EXPECT_RESULT(same_tensor(r.saved.k, heads(reference_kv(k, h.q, kv, p)),
                                 where(comm, "saved.k") + why + "k with its " + std::to_string(kv) + " heads)"));
    CP_EXPECT_RESULT(same_tensor(r.saved.v, heads(reference_kv(v, h.q, kv, p)),
                                 where(comm, "saved.v") + why + "v with its " + std::to_string(kv) + " heads)"));
    CP_EXPECT_RESULT(same_tensor(r.saved.out, heads(r.out), where(comm, "saved.out") + why + "out)"));
    CP_EXPECT_RESULT(same_tensor(r.saved.lse, heads(r.lse), where(comm, "saved.lse") + why + "lse)"));
    EXPECT_EQ(r.saved.heads_kv, h.kv) << where(comm, "saved.heads_kv: the caller's Hkv, to which the backward sums "
                                                     "the gradients of the copies");
  });
}

CP_TEST(Lesson10, Task3_TheGradientOfAReplicatedHeadIsTheSumOverItsCopies) {
  // (Hkv, copies): the gradient [B, Hkv·copies, S/P, D] of K or V replicated as replicate_kv_heads lays it out.
  for (const auto& [hkv, copies] : std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {1, 4}, {3, 2}, {2, 4}, {4, 1}}) {
    torch::Generator gen = at::detail::createCPUGenerator(400 + hkv * 10 + copies);
    const torch::Tensor grad = torch::randn({2, hkv * copies, 5, 3}, gen).to(torch::kDouble);
    std::vector<torch::Tensor> heads;  // head h's copies are the heads h·copies ... h·copies + copies − 1
    for (int64_t h = 0; h < hkv; ++h) {
      torch::Tensor sum = torch::zeros({2, 5, 3}, torch::kDouble);
      for (int64_t c = 0; c < copies; ++c) sum += grad.select(1, h * copies + c);
      heads.push_back(sum);
    }
    CP_EXPECT_CLOSE(sum_kv_replicas(grad, hkv), torch::stack(heads, 1),
                    "sum_kv_replicas of " + std::to_string(hkv * copies) + " heads to Hkv = " + std::to_string(hkv) +
                        " (the gradient of K/V head h is the sum over its " + std::to_string(copies) +
                        " copies, heads h*" + std::to_string(copies) + " ... h*" + std::to_string(copies) + " + " +
                        std::to_string(copies - 1) + ")",
                    kDims);
  }
}

CP_TEST(Lesson10, Task3_BackwardMatchesFullAttentionForEveryLayout) {
  for_each_world([](Comm& comm) {
    uint64_t seed = 100;  // the inputs of the forward tests
    for (const Heads& h : heads_for(comm.size()))
      for (bool causal : {false, true})
        check_case(comm, {2, 13, 32, causal, TokenLayout::Contiguous}, h, seed++, Pass::Backward);
    seed = 200;
    for (TokenLayout layout : {TokenLayout::ZigZag, TokenLayout::Stripe})
      check_case(comm, {1, 6, 64, true, layout}, heads_for(comm.size()).back(), seed++, Pass::Backward);
    // float64 on the CPU: dq, dk, dv come back in the inputs' dtype (the block backward's are float32).
    check_case(comm, {1, 6, 16, true, TokenLayout::ZigZag}, heads_for(comm.size()).back(), 150, Pass::Backward,
               torch::kDouble);
  });
}

CP_TEST(Lesson10, Task2_VolumeFormulaIsZeroOnOneRankAndFollowsP) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    const torch::Tensor t = torch::zeros({1, 2, 4, 32});
    EXPECT_EQ(ulysses_attention_forward(comm, t, t, t).stats.bytes_sent, 0);
  });
  const UlyssesVolume one = ulysses_volume(2, 8, 2, 64, 32, 1, 4);
  EXPECT_EQ(one.forward_bytes, 0);
  EXPECT_EQ(one.backward_bytes, 0);
  // P = 4, Hq = Hkv = 8: each tensor sends 3/16 of B·S·H·D = 2·64·8·32 elements; lse 3/16 of B·S·H.
  const int64_t tensor = 3 * 2 * 64 * 8 * 32 / 16 * 4, lse = 3 * 2 * 64 * 8 / 16 * 4;
  const UlyssesVolume four = ulysses_volume(2, 8, 8, 64, 32, 4, 4);
  EXPECT_EQ(four.forward_bytes, 4 * tensor + lse);  // q, k, v in; out, lse back
  EXPECT_EQ(four.backward_bytes, 4 * tensor);       // dout in; dq, dk, dv back: 4·(P−1)/P²·B·S·H·D elements
  EXPECT_EQ(ulysses_kv_heads(8, 2, 4), 4);  // replicated twice
  EXPECT_EQ(ulysses_kv_heads(8, 8, 4), 8);
}

CP_TEST(Lesson10, Task2_TraceRecordsTheExchangesAndTheAttention) {
  Trace trace;
  run_local_world(3, [&](Comm& comm) {
    const torch::Tensor t = torch::ones({1, 3, 4, 32});
    ulysses_attention_forward(comm, t, t, t, ulysses_options(true, TokenLayout::Contiguous, &trace));
  });
  const testing::TraceContents seen = testing::read_trace(trace);
  for (const char* lane : {"comm", "compute"})
    EXPECT_TRUE(seen.spans_per_lane.count(lane))
        << "a forward on 3 ranks with options.trace set: no span on lane '" << lane << "' (" << seen.describe()
        << "). The exchanges go on lane 'comm', the attention on 'compute'.";
  EXPECT_TRUE(seen.spans_per_rank.count(2)) << "a forward on 3 ranks with options.trace set: no span of rank 2 ("
                                            << seen.describe() << "). Each rank records its spans under its own rank.";
}

CP_TEST(Lesson10, Task3_EmptyInputGivesEmptyResults) {
  for_each_world([](Comm& comm) {
    const int p = comm.size();
    for (const auto& shape : {std::vector<int64_t>{0, p, 4, 32}, std::vector<int64_t>{1, p, 0, 32}}) {
      const torch::Tensor t = torch::zeros(shape);
      const UlyssesResult r = ulysses_attention_forward(comm, t, t, t, ulysses_options(true));
      const UlyssesGrads g = ulysses_attention_backward(comm, t, r.saved, ulysses_options(true));
      EXPECT_EQ(r.out.sizes(), t.sizes());
      EXPECT_EQ(r.lse.sizes(), t.sizes().slice(0, 3));
      EXPECT_EQ(g.dk.sizes(), t.sizes());
    }
  });
}

CP_TEST(Lesson10, Task3_TheLayerTrainsWithUlysses) {
  for_each_world([](Comm& comm) {
    // Hq = 2P query heads over one K/V head: the layer's GQA with K/V replicated where P > 1.
    testing::expect_training_step_matches_one_device(comm, ulysses_strategy(), 130, 32 * 2 * comm.size(),
                                                     2 * comm.size(), 1);
  });
}

CP_TEST(Lesson10, Task2_BadInputGivesClearErrors) {
  run_local_world(1, [](Comm& comm) {  // counts once implemented
    const torch::Tensor t = torch::zeros({1, 2, 4, 32});
    ulysses_attention_forward(comm, t, t, t);
  });
  auto on_4_ranks = [](std::function<void(Comm&)> body) { return [body] { run_local_world(4, body); }; };
  auto forward = [](int64_t hq, int64_t hkv, int64_t chunk, TokenLayout layout = TokenLayout::Contiguous) {
    return [=](Comm& comm) {
      ulysses_attention_forward(comm, torch::zeros({1, hq, chunk, 32}), torch::zeros({1, hkv, chunk, 32}),
                                torch::zeros({1, hkv, chunk, 32}), ulysses_options(false, layout));
    };
  };
  testing::expect_errors({
      {"Hq = 6 over 4 ranks", on_4_ranks(forward(6, 6, 4)), "query heads Hq = 6 must be divisible by the 4 ranks"},
      {"Hkv = 3 over 4 ranks", on_4_ranks(forward(12, 3, 4)), "Hkv = 3 must be divisible by the 4 ranks, or divide it"},
      {"Hq = 8 not divisible by Hkv = 3", on_4_ranks(forward(8, 3, 4)), "H_q (8) must be divisible by H_kv (3)"},
      {"zig-zag with S = 4·3, not divisible by 2·4", on_4_ranks(forward(4, 4, 3, TokenLayout::ZigZag)), "S = 12 is not divisible by 2N = 8"},
      {"rank 2 holds 5 tokens", on_4_ranks([](Comm& comm) {
         const torch::Tensor t = torch::zeros({1, 4, comm.rank() == 2 ? 5 : 4, 32});
         ulysses_attention_forward(comm, t, t, t);
       }), "Is S divisible by N = 4?"},
      {"3-D q", on_4_ranks([](Comm& comm) {
         const torch::Tensor t = torch::zeros({1, 4, 4, 32});
         ulysses_attention_forward(comm, t[0], t, t);
       }), "q: expected"},
      {"seq_to_heads of 3 heads over 4 ranks", on_4_ranks([](Comm& comm) {
         ulysses_seq_to_heads(comm, torch::zeros({1, 3, 2}));
       }), "head count 3 (dim 1) must be divisible by the 4 ranks"},
  });
}

CP_TEST(Lesson10, Task3_BackwardRejectsSavedTensorsThatDoNotFitDout) {
  const torch::Tensor t = torch::zeros({1, 4, 4, 32});
  run_local_world(1, [&](Comm& comm) {  // counts once implemented
    ulysses_attention_backward(comm, t, ulysses_attention_forward(comm, t, t, t).saved);
  });
  // On 2 ranks: the forward of t, then a backward given `dout` and something else than its saved.
  auto backward = [&](torch::Tensor dout, std::function<UlyssesSaved(const UlyssesSaved&)> change) {
    return [=] {
      run_local_world(2, [&](Comm& comm) {
        ulysses_attention_backward(comm, dout, change(ulysses_attention_forward(comm, t, t, t).saved));
      });
    };
  };
  const auto as_is = [](const UlyssesSaved& s) { return s; };
  testing::expect_errors({
      {"no saved tensors", backward(t, [](const UlyssesSaved&) { return UlyssesSaved{}; }), "saved: empty"},
      {"dout of 6 tokens for a forward of 4", backward(torch::zeros({1, 4, 6, 32}), as_is),
       "saved: expected the forward's head split for dout [1, 4, 6, 32] on 2 ranks"},
      {"lse saved in float64", backward(t, [](UlyssesSaved s) { s.lse = s.lse.to(torch::kDouble); return s; }),
       "saved: q must have dout's dtype"},
      {"3-D dout", backward(t[0], as_is), "dout: expected"},
  });
}

CP_TEST(Lesson10Cuda, Task3_ForwardAndBackwardOnCudaForEveryDtype) {
  // Every output in float32, float16 and bfloat16, D = 32 and 128, zig-zag chunks of 40 tokens
  // (not a multiple of the kernels' 64-row blocks), K/V heads replicated where P > 1.
  CP_REQUIRE_GPU();
  for_each_world([](Comm& comm) {
    const Heads h = heads_for(comm.size()).back();
    uint64_t seed = 300;
    for (torch::Dtype dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16})
      for (int64_t d : {32, 128}) check_case(comm, {1, 40, d, true, TokenLayout::ZigZag}, h, seed++, Pass::Both, dtype, torch::kCUDA);
  });
}

}  // namespace
}  // namespace cp
