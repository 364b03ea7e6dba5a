#include "testing/oracle.h"

#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <iomanip>
#include <limits>
#include <mutex>
#include <sstream>

#include "common/error.h"

namespace cp::testing {

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

/// A number as a learner reads it: 6 significant digits ("1e-06", not 9.9999999999999995e-07;
/// `digits` more where two close values must differ visibly), NaN as NaN.
std::string num(double v, int digits = 6) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream out;
  out << std::setprecision(digits) << v;
  return out.str();
}

/// The input row that produced element `flat` of a row-wise result: `inputs` is [..., n] and
/// the result is [..., n] (one output per input, e.g. softmax) or [...] (one per row, e.g. lse).
/// Shows the row's length, its first values and its maximum.
std::string describe_row(const torch::Tensor& result, int64_t flat, const torch::Tensor& inputs,
                         const std::vector<std::string>& dims) {
  const int64_t n = inputs.size(-1);
  const bool per_element = result.dim() == inputs.dim();
  const int64_t row = per_element ? flat / std::max<int64_t>(n, 1) : flat;
  if (n == 0) return "its input row is empty (n = 0)";
  if (row >= inputs.numel() / n) return "";  // `inputs` does not fit the result: nothing to show
  const torch::Tensor x = inputs.detach().to(torch::kCPU, torch::kDouble).contiguous().view({-1, n})[row];
  const double* v = x.data_ptr<double>();
  const torch::IntArrayRef row_sizes = inputs.sizes().slice(0, inputs.dim() - 1);
  const bool named = dims.size() == static_cast<size_t>(result.dim());
  const std::vector<std::string> row_dims =
      named && per_element ? std::vector<std::string>(dims.begin(), dims.end() - 1) : dims;
  std::ostringstream out;
  out << "its input row " << (row_sizes.empty() ? "" : index_of(row, row_sizes, row_dims)) << " (n = " << n << "): ";
  const int64_t shown = std::min<int64_t>(n, 6);
  for (int64_t j = 0; j < shown; ++j) out << (j ? ", " : "") << num(v[j], 4);
  if (n > shown) out << ", ...";
  if (n > 0) {
    int64_t arg = 0;  // the maximum, NaN first: what the row's state is relative to
    for (int64_t j = 1; j < n; ++j)
      if (!std::isnan(v[arg]) && (std::isnan(v[j]) || v[j] > v[arg])) arg = j;
    out << "; max " << num(v[arg], 4) << " at " << arg;
  }
  return out.str();
}

/// When every (finite, wrong) element of the first wrong element's row is the same multiple of
/// the expected value, the row's values are right up to one factor: a per-row normaliser is off.
std::string constant_factor_hint(const double* a, const double* e, int64_t flat, torch::IntArrayRef sizes) {
  if (sizes.size() < 2 || sizes.back() < 2) return "";  // rows of at least two values
  const int64_t n = sizes.back(), begin = flat / n * n;
  double lo = INFINITY, hi = -INFINITY;
  int64_t used = 0;
  for (int64_t j = begin; j < begin + n; ++j) {
    if (!std::isfinite(a[j]) || !std::isfinite(e[j])) return "";
    if (std::abs(e[j]) < 1e-30) continue;
    lo = std::min(lo, a[j] / e[j]), hi = std::max(hi, a[j] / e[j]);
    ++used;
  }
  if (used < 2 || hi - lo > 1e-3 * std::abs(hi) || std::abs(hi - 1) < 1e-3) return "";
  std::ostringstream out;
  if (hi == 0) {  // not a factor: nothing reached this row
    out << "every value of this row is 0: nothing was accumulated into it (was a block skipped, or a step "
        << "not run, or a result never written back?)";
    return out.str();
  }
  out << "every value of this row is " << num(hi, 4) << " × the expected one: right up to one factor per row, "
      << "so the row's normaliser is " << (hi < 1 ? "too large" : "too small")
      << " (a softmax: is l rescaled when the maximum changes? a merge of partial results: does a part that "
      << "saw no key carry lse = -inf, or does its lse = 0 count as a key of weight 1? a mean or a gradient "
      << "averaged over ranks: is the count or the factor the right one?)";
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
                                     std::optional<Tolerance> tolerance, const torch::Tensor& inputs) {
  if (!actual_in.defined()) return ::testing::AssertionFailure() << what << ": result is undefined";
  if (actual_in.sizes() != expected_in.sizes())
    return ::testing::AssertionFailure() << what << ": shape " << actual_in.sizes() << ", expected "
                                         << expected_in.sizes();
  const Tolerance tol = tolerance.value_or(tolerance_for(actual_in.scalar_type()));
  const torch::Tensor actual = actual_in.detach().to(torch::kCPU, torch::kDouble).contiguous();
  const torch::Tensor expected = expected_in.detach().to(torch::kCPU, torch::kDouble).contiguous();
  const double* a = actual.data_ptr<double>();
  const double* e = expected.data_ptr<double>();

  double max_abs = 0, max_rel = 0;  // over the finite pairs (inf as soon as a NaN or inf is wrong)
  double finite_abs = 0, finite_rel = 0;
  int64_t wrong = 0, finite_wrong = 0, got_nan = 0, expected_nan = 0, inf_wrong = 0, got_inf = 0, first = -1;
  std::vector<int64_t> others;  // a few more wrong elements after the first
  for (int64_t i = 0; i < actual.numel(); ++i) {
    bool ok;
    if (std::isnan(a[i]) || std::isnan(e[i])) {
      ok = false;
      max_abs = max_rel = std::numeric_limits<double>::infinity();
      got_nan += std::isnan(a[i]) && !std::isnan(e[i]);
      expected_nan += std::isnan(e[i]) && !std::isnan(a[i]);
    } else if (std::isinf(a[i]) || std::isinf(e[i])) {
      ok = a[i] == e[i];
      if (!ok) max_abs = max_rel = std::numeric_limits<double>::infinity();
      inf_wrong += !ok;
      got_inf += !ok && std::isinf(a[i]) && std::isfinite(e[i]);
    } else {
      const double err = std::abs(a[i] - e[i]);
      ok = err <= tol.abs + tol.rel * std::abs(e[i]);
      finite_wrong += !ok;
      max_abs = std::max(max_abs, err), finite_abs = std::max(finite_abs, err);
      if (std::abs(e[i]) > tol.abs) {
        max_rel = std::max(max_rel, err / std::abs(e[i]));
        finite_rel = std::max(finite_rel, err / std::abs(e[i]));
      }
    }
    if (ok) continue;
    if (wrong++ == 0)
      first = i;
    else if (others.size() < 2)
      others.push_back(i);
  }
  {
    std::lock_guard<std::mutex> lock(checks_mutex);
    checks.push_back({what, max_abs, max_rel, wrong, tol});
  }
  if (wrong == 0) return ::testing::AssertionSuccess();

  // One summary, built in a plain stream: gtest's Message would print 17 digits.
  std::ostringstream out;
  auto at = [&](int64_t i) { return index_of(i, actual.sizes(), dims); };
  out << what << ": " << wrong << " of " << actual.numel() << " elements wrong (" << actual_in.scalar_type() << " "
      << actual_in.sizes() << ", against the float64 reference)";
  out << "\n  first wrong " << at(first) << ": got " << num(a[first], 8) << ", expected " << num(e[first], 8);
  if (std::isfinite(a[first]) && std::isfinite(e[first]))
    out << " (error " << num(std::abs(a[first] - e[first]), 3) << ", allowed "
        << num(tol.abs + tol.rel * std::abs(e[first]), 3) << ")";
  if (inputs.defined()) out << "\n  " << describe_row(actual, first, inputs, dims);
  if (!others.empty()) {
    out << "\n  also";
    for (int64_t i : others) out << " " << at(i) << ": got " << num(a[i], 8) << ", expected " << num(e[i], 8) << ";";
    if (wrong > 1 + static_cast<int64_t>(others.size())) out << " ...";
  }
  out << "\n  tolerance: |got - expected| <= " << num(tol.abs, 3) << " + " << num(tol.rel, 3) << " × |expected|";
  std::vector<std::string> kinds;  // what went wrong, by kind
  if (finite_wrong)
    kinds.push_back(std::to_string(finite_wrong) + (finite_wrong == 1 ? " number" : " numbers") +
                    " off (largest error " + num(finite_abs, 3) + " abs, " +
                    num(finite_rel, 3) + " rel)");
  if (got_nan) kinds.push_back("NaN in " + std::to_string(got_nan) + " where the reference is a number");
  if (expected_nan) kinds.push_back("a number in " + std::to_string(expected_nan) + " where the reference is NaN");
  if (inf_wrong) kinds.push_back(std::to_string(inf_wrong) + " with an infinity on one side only, or of the other sign");
  if (!kinds.empty()) {
    out << "\n  wrong:";
    for (size_t k = 0; k < kinds.size(); ++k) out << (k ? "; " : " ") << kinds[k];
  }

  // Hints, only for patterns with one likely cause.
  if (got_nan)
    out << "\n  hint: NaN where the reference is a number: some step computed 0·inf, inf - inf or 0/0 (e.g. "
           "exp(-inf - (-inf)), or a rescale of the empty state {m = -inf, l = 0} by exp(x - m) = inf)";
  else if (expected_nan)
    out << "\n  hint: the reference is NaN where the input holds a NaN or +inf: it must reach the output, not be "
           "dropped (lesson 01, \"NaN and inf are never hidden\")";
  else if (got_inf)
    out << "\n  hint: inf where the reference is finite: an overflow, e.g. exp() of a value not shifted by the "
           "maximum";
  else if (const std::string hint = constant_factor_hint(a, e, first, actual.sizes()); !hint.empty())
    out << "\n  hint: " << hint;
  return ::testing::AssertionFailure() << out.str();
}

::testing::AssertionResult all_close_or_nan(const torch::Tensor& actual_in, const torch::Tensor& expected_in,
                                            const std::string& what, const std::vector<std::string>& dims,
                                            std::optional<Tolerance> tolerance, const torch::Tensor& inputs) {
  if (!actual_in.defined() || actual_in.sizes() != expected_in.sizes())
    return all_close(actual_in, expected_in, what, dims, tolerance, inputs);  // reports the problem
  const torch::Tensor actual = actual_in.detach().cpu(), expected = expected_in.detach().cpu();
  // NaN where both have it becomes 0 in both; a NaN in one of them only is left for all_close
  // to report as a mismatch.
  const torch::Tensor both = actual.isnan() & expected.isnan();
  return all_close(actual.masked_fill(both, 0), expected.masked_fill(both, 0), what, dims,
                   tolerance.value_or(tolerance_for(actual_in.scalar_type())), inputs);
}

Tolerance query_key_gradient_tolerance(torch::ScalarType dtype, const torch::Tensor& expected,
                                       const torch::Tensor& dv, int64_t window) {
  return gradient_tolerance(dtype, window == 1 ? dv : expected);
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
                                                    const torch::Tensor& v, const OracleMask& mask, double scale,
                                                    bool pairwise) {
  auto f64 = [](const torch::Tensor& t) { return t.to(torch::kCPU, torch::kDouble); };
  const int64_t group = q.size(1) / k.size(1);
  const torch::Tensor q64 = f64(q), k64 = f64(k).repeat_interleave(group, 1), v64 = f64(v).repeat_interleave(group, 1);
  const int64_t sq = q.size(2), sk = k.size(2);
  const torch::Tensor hidden = oracle_visible(mask).logical_not();  // [Sq, Sk]
  CP_CHECK(hidden.size(0) == sq && hidden.size(1) == sk, "oracle_attention: positions ", hidden.sizes(),
           " for Sq = ", sq, ", Sk = ", sk);
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
  scores = scores.masked_fill(hidden, -INFINITY);
  const torch::Tensor lse = torch::logsumexp(scores, -1).detach();
  // Rows without a visible key: softmax of zeros instead of -inf (finite, so autograd stays
  // finite too), then replaced by zeros.
  const torch::Tensor empty = (lse == -INFINITY).unsqueeze(-1);
  const torch::Tensor p = torch::where(empty, torch::zeros_like(scores),
                                       torch::softmax(torch::where(empty, torch::zeros_like(scores), scores), -1));
  return {pairwise ? (p.unsqueeze(-1) * v_pairs).sum(-2) : torch::matmul(p, v64), lse};
}

}  // namespace

torch::Tensor oracle_visible(const OracleMask& mask) {
  const torch::Tensor qp = mask.q_pos.cpu().view({-1, 1}), kp = mask.k_pos.cpu().view({1, -1});
  torch::Tensor visible = torch::ones({qp.size(0), kp.size(1)}, torch::kBool);
  if (mask.causal) visible &= kp <= qp;
  if (mask.window > 0) visible &= (qp - kp) < mask.window;
  if (mask.documents.defined()) {
    const torch::Tensor bounds = mask.documents.cpu().narrow(0, 1, mask.documents.size(0) - 1);  // c_1 … c_n
    auto document = [&](const torch::Tensor& pos) { return (pos.reshape({-1, 1}) >= bounds).sum(-1); };
    const torch::Tensor dq = document(qp).view({-1, 1}), dk = document(kp).view({1, -1});
    visible &= (dq == dk) & (dq < bounds.size(0));  // same document, and not padding
  }
  return visible;
}

std::pair<torch::Tensor, torch::Tensor> oracle_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                         const torch::Tensor& v, const OracleMask& mask, double scale) {
  return attention64(q, k, v, mask, scale, any_non_finite({q, k, v}));
}

std::pair<torch::Tensor, torch::Tensor> oracle_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                         const torch::Tensor& v, bool causal,
                                                         const torch::Tensor& q_pos, const torch::Tensor& k_pos,
                                                         double scale) {
  return oracle_attention(q, k, v, OracleMask{causal, q_pos, k_pos}, scale);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> oracle_attention_grads(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& dout, bool causal,
    const torch::Tensor& q_pos, const torch::Tensor& k_pos, double scale) {
  return oracle_attention_grads(q, k, v, dout, OracleMask{causal, q_pos, k_pos}, scale);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> oracle_attention_grads(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& dout,
    const OracleMask& mask, double scale) {
  auto leaf = [](const torch::Tensor& t) { return t.detach().to(torch::kCPU, torch::kDouble).requires_grad_(true); };
  const torch::Tensor q64 = leaf(q), k64 = leaf(k), v64 = leaf(v);
  const torch::Tensor out = attention64(q64, k64, v64, mask, scale, any_non_finite({q, k, v, dout})).first;
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

std::vector<std::pair<std::string, OracleMask>> window_and_document_masks(int64_t s) {
  const torch::Tensor documents = torch::tensor(std::vector<int64_t>{0, 1, 8, 40, s - 5});
  const torch::Tensor pos = torch::arange(s), later = torch::arange(s) + s / 2;
  const int64_t c = s / 2;
  const torch::Tensor zigzag_q = torch::cat({torch::arange(0, c), torch::arange(3 * c, 3 * c + s - c)});
  return {
      {"window 1", {true, pos, pos, 1, {}}},
      {"window 5", {true, pos, pos, 5, {}}},
      {"window 40", {true, pos, pos, 40, {}}},
      {"window 10 S (all of causal)", {true, pos, pos, 10 * s, {}}},
      {"window 40, keys half a sequence earlier", {true, later, pos, 40, {}}},
      {"window 30, zig-zag queries", {true, zigzag_q, torch::arange(c, c + s), 30, {}}},
      {"documents 1, 7, 32, rest, padding 5", {true, pos, pos, 0, documents}},
      {"documents, not causal", {false, pos, pos, 0, documents}},
      {"documents and window 9", {true, pos, pos, 9, documents}},
      {"documents, keys half a sequence earlier", {true, later, pos, 0, documents}},
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
