#include "testing/oracle.h"

#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <sstream>

namespace cp::testing {

Tolerance tolerance_for(torch::ScalarType dtype) {
  switch (dtype) {
    // The kernels accumulate in float32 whatever the input, so float32 and float64 results
    // carry float32 rounding: unit roundoff 6e-8, grown by sums over up to a few thousand
    // terms and by exp() of arguments up to ~1e4 in magnitude -> 1e-5 relative.
    case torch::kDouble:
    case torch::kFloat: return {1e-6, 1e-5};
    // The result is computed in float32 and rounded once to the output type: unit roundoff
    // 4.9e-4 (fp16) and 3.9e-3 (bf16), plus the rounding of the inputs; 4 ulp of margin.
    case torch::kHalf: return {1e-4, 2e-3};
    case torch::kBFloat16: return {1e-3, 1.6e-2};
    default: return {0.0, 0.0};  // integers: exact
  }
}

Tolerance gradient_tolerance(torch::ScalarType dtype, const torch::Tensor& expected) {
  const Tolerance base = tolerance_for(dtype);
  const double scale = expected.numel() ? expected.abs().max().item<double>() : 0.0;
  return {std::max(base.abs, base.rel * scale), base.rel};
}

namespace {
std::mutex checks_mutex;
std::vector<detail::CheckRecord> checks;  // of the running test; ranks may add concurrently

std::string index_of(int64_t flat, torch::IntArrayRef sizes, const std::vector<std::string>& dims) {
  std::vector<int64_t> index(sizes.size());
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    index[d] = flat % sizes[d];
    flat /= sizes[d];
  }
  std::ostringstream out;
  out << "[";
  for (size_t d = 0; d < index.size(); ++d) {
    if (d) out << ",";
    if (dims.size() == index.size()) out << dims[d] << "=";
    out << index[d];
  }
  out << "]";
  return out.str();
}
}  // namespace

namespace detail {
std::vector<CheckRecord> take_checks() {
  std::lock_guard<std::mutex> lock(checks_mutex);
  return std::exchange(checks, {});
}
}  // namespace detail

::testing::AssertionResult all_close(const torch::Tensor& actual_in, const torch::Tensor& expected_in,
                                     const std::string& what, const std::vector<std::string>& dims,
                                     std::optional<Tolerance> tolerance) {
  if (!actual_in.defined()) return ::testing::AssertionFailure() << what << ": result is undefined";
  if (actual_in.sizes() != expected_in.sizes())
    return ::testing::AssertionFailure() << what << ": shape " << actual_in.sizes() << ", expected "
                                         << expected_in.sizes();
  const Tolerance tol = tolerance.value_or(tolerance_for(actual_in.scalar_type()));
  const torch::Tensor actual = actual_in.detach().to(torch::kCPU, torch::kDouble).contiguous();
  const torch::Tensor expected = expected_in.detach().to(torch::kCPU, torch::kDouble).contiguous();
  const double* a = actual.data_ptr<double>();
  const double* e = expected.data_ptr<double>();

  double max_abs = 0, max_rel = 0;
  int64_t wrong = 0;
  std::ostringstream mismatches;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    bool ok;
    if (std::isnan(a[i]) || std::isnan(e[i])) {
      ok = false;
      max_abs = max_rel = std::numeric_limits<double>::infinity();
    } else if (std::isinf(a[i]) || std::isinf(e[i])) {
      ok = a[i] == e[i];
      if (!ok) max_abs = max_rel = std::numeric_limits<double>::infinity();
    } else {
      const double err = std::abs(a[i] - e[i]);
      ok = err <= tol.abs + tol.rel * std::abs(e[i]);
      max_abs = std::max(max_abs, err);
      if (std::abs(e[i]) > tol.abs) max_rel = std::max(max_rel, err / std::abs(e[i]));
    }
    if (!ok && wrong++ < 5)
      mismatches << "\n    " << index_of(i, actual.sizes(), dims) << " got " << a[i] << ", expected " << e[i];
  }
  {
    std::lock_guard<std::mutex> lock(checks_mutex);
    checks.push_back({what, max_abs, max_rel, wrong, tol});
  }
  if (wrong == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << " " << actual_in.scalar_type() << " " << actual_in.sizes() << ": " << wrong << " of "
         << actual.numel() << " elements wrong (tolerance " << tol.abs << " + " << tol.rel
         << "·|expected|); max abs error " << max_abs << ", max rel error " << max_rel
         << "; first mismatches:" << mismatches.str();
}

::testing::AssertionResult all_close_or_nan(const torch::Tensor& actual_in, const torch::Tensor& expected_in,
                                            const std::string& what, const std::vector<std::string>& dims,
                                            std::optional<Tolerance> tolerance) {
  if (!actual_in.defined() || actual_in.sizes() != expected_in.sizes())
    return all_close(actual_in, expected_in, what, dims, tolerance);  // reports the problem
  const torch::Tensor actual = actual_in.detach().cpu(), expected = expected_in.detach().cpu();
  // NaN where both have it becomes 0 in both; a NaN in one of them only is left for all_close
  // to report as a mismatch.
  const torch::Tensor both = actual.isnan() & expected.isnan();
  return all_close(actual.masked_fill(both, 0), expected.masked_fill(both, 0), what, dims,
                   tolerance.value_or(tolerance_for(actual_in.scalar_type())));
}

torch::Tensor oracle_softmax(const torch::Tensor& x) {
  const torch::Tensor x64 = x.detach().to(torch::kCPU, torch::kDouble);
  const torch::Tensor empty_row = (x64 == -INFINITY).all(-1, /*keepdim=*/true);
  return torch::where(empty_row, torch::zeros_like(x64), torch::softmax(x64, -1));
}

torch::Tensor oracle_logsumexp(const torch::Tensor& x) {
  return torch::logsumexp(x.detach().to(torch::kCPU, torch::kDouble), -1);
}

namespace {

bool any_non_finite(std::initializer_list<torch::Tensor> ts) {
  for (const torch::Tensor& t : ts)
    if (!torch::isfinite(t.detach()).all().item<bool>()) return true;
  return false;
}

/// oracle_attention, differentiable (oracle_attention_grads runs autograd through it). `pairwise`:
/// q, k and v are expanded to one copy per (query, key) pair, zeroed where the key is hidden, so
/// that a hidden key's values meet nothing but zeros, in the forward and in the backward.
std::pair<torch::Tensor, torch::Tensor> attention64(const torch::Tensor& q, const torch::Tensor& k,
                                                    const torch::Tensor& v, bool causal, const torch::Tensor& q_pos,
                                                    const torch::Tensor& k_pos, double scale, bool pairwise) {
  auto f64 = [](const torch::Tensor& t) { return t.to(torch::kCPU, torch::kDouble); };
  const int64_t group = q.size(1) / k.size(1);
  const torch::Tensor q64 = f64(q), k64 = f64(k).repeat_interleave(group, 1), v64 = f64(v).repeat_interleave(group, 1);
  const int64_t sq = q.size(2), sk = k.size(2);
  const torch::Tensor hidden = causal ? k_pos.cpu().view({1, -1}) > q_pos.cpu().view({-1, 1})  // [Sq, Sk]
                                      : torch::zeros({sq, sk}, torch::kBool);
  torch::Tensor scores, v_pairs;  // scores [B, Hq, Sq, Sk]; v_pairs [B, Hq, Sq, Sk, D] (pairwise only)
  if (pairwise) {
    const torch::Tensor visible = hidden.logical_not().view({1, 1, sq, sk, 1});
    const torch::Tensor zero = torch::zeros({}, q64.options());
    auto pairs = [&](const torch::Tensor& t, int64_t new_dim) { return torch::where(visible, t.unsqueeze(new_dim), zero); };
    scores = (pairs(q64, 3) * pairs(k64, 2)).sum(-1) * scale;
    v_pairs = pairs(v64, 2);
  } else {
    scores = torch::matmul(q64, k64.transpose(-1, -2)) * scale;
  }
  if (causal) scores = scores.masked_fill(hidden, -INFINITY);
  const torch::Tensor lse = torch::logsumexp(scores, -1).detach();
  // Rows without a visible key: softmax of zeros instead of -inf (finite, so autograd stays
  // finite too), then replaced by zeros.
  const torch::Tensor empty = (lse == -INFINITY).unsqueeze(-1);
  const torch::Tensor p = torch::where(empty, torch::zeros_like(scores),
                                       torch::softmax(torch::where(empty, torch::zeros_like(scores), scores), -1));
  return {pairwise ? (p.unsqueeze(-1) * v_pairs).sum(-2) : torch::matmul(p, v64), lse};
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> oracle_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                         const torch::Tensor& v, bool causal,
                                                         const torch::Tensor& q_pos, const torch::Tensor& k_pos,
                                                         double scale) {
  return attention64(q, k, v, causal, q_pos, k_pos, scale, any_non_finite({q, k, v}));
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> oracle_attention_grads(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& dout, bool causal,
    const torch::Tensor& q_pos, const torch::Tensor& k_pos, double scale) {
  auto leaf = [](const torch::Tensor& t) { return t.detach().to(torch::kCPU, torch::kDouble).requires_grad_(true); };
  const torch::Tensor q64 = leaf(q), k64 = leaf(k), v64 = leaf(v);
  const torch::Tensor out =
      attention64(q64, k64, v64, causal, q_pos, k_pos, scale, any_non_finite({q, k, v, dout})).first;
  const auto grads = torch::autograd::grad({(out * dout.to(torch::kCPU, torch::kDouble)).sum()}, {q64, k64, v64});
  return {grads[0], grads[1], grads[2]};
}

std::vector<PositionLayout> causal_position_layouts(int64_t s) {
  torch::Generator gen = at::detail::createCPUGenerator(77);
  auto sorted_random = [&](int64_t n) { return std::get<0>(torch::randperm(4 * n, gen).narrow(0, 0, n).sort()); };
  auto unsorted_random = [&](int64_t n) { return torch::randperm(4 * n, gen).narrow(0, 0, n); };
  // Zig-zag with N = 2 over 4 chunks of c tokens: rank 0 holds chunks 0 and 3 (its queries),
  // rank 1 holds chunks 1 and 2 (the keys visiting it).
  const int64_t c = s / 2;
  const torch::Tensor zigzag_q = torch::cat({torch::arange(0, c), torch::arange(3 * c, 3 * c + s - c)});
  return {
      {"contiguous", torch::arange(s), torch::arange(s)},
      {"keys before queries (a later ring step)", torch::arange(s) + 3 * s, torch::arange(s) + s},
      {"keys after queries (fully masked)", torch::arange(s), torch::arange(s) + s},
      {"shifted by half a chunk", torch::arange(s) + s / 2, torch::arange(s)},
      {"zig-zag chunk pairs", zigzag_q, torch::arange(c, c + s)},
      {"random sorted", sorted_random(s), sorted_random(s)},
      {"random unsorted", unsorted_random(s), unsorted_random(s)},
  };
}

torch::Tensor random_with_outliers(std::vector<int64_t> shape, uint64_t seed, double scale, double outlier) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  torch::Tensor x = torch::randn(shape, gen, torch::kFloat) * scale;
  if (outlier == 0) return x;
  const torch::Tensor pick = torch::rand(shape, gen) < (1.0 / 64);
  const torch::Tensor sign = torch::where(torch::rand(shape, gen) < 0.5, -1.0, 1.0).to(torch::kFloat);
  return torch::where(pick, sign * outlier, x);
}

}  // namespace cp::testing
