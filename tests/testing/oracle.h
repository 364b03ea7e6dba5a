// The oracle side of every test: float64 references, one tolerance table, one comparison.
#pragma once

#include <gtest/gtest.h>
#include <torch/types.h>

#include <optional>
#include <string>
#include <vector>

#include "common/tolerance.h"

namespace cp::testing {

// The tolerance table lives in common/ (the demos mark their errors with it too).
using cp::gradient_tolerance;
using cp::merged_tolerance;
using cp::Tolerance;
using cp::tolerance_for;

/// Compares `actual` (any dtype/device) with `expected` (the float64 oracle) elementwise.
/// -inf matches -inf; NaN never matches. On failure the message is one summary: the number of
/// wrong elements, the first one (index named by `dims`, e.g. {"b", "h", "s", "d"}, when given)
/// with got, expected and its error against the allowed one, a few more, the tolerance, the
/// largest errors, the NaN and inf mismatches, and a hint where the pattern has one likely cause.
/// `inputs`, for a row-wise result (softmax, logsumexp: `actual` is [..., n] or [...] for
/// `inputs` [..., n]): the message also shows the input row of the first wrong element. Every
/// call is recorded for make compare.
::testing::AssertionResult all_close(const torch::Tensor& actual, const torch::Tensor& expected,
                                     const std::string& what, const std::vector<std::string>& dims = {},
                                     std::optional<Tolerance> tolerance = std::nullopt,
                                     const torch::Tensor& inputs = {});

/// all_close where NaN matches NaN: the NaN positions of `actual` and `expected` must be the same,
/// every other element must be within the tolerance (by default the dtype of `actual`'s). For
/// the tests of non-finite inputs, where the oracle's NaN is the right answer.
::testing::AssertionResult all_close_or_nan(const torch::Tensor& actual, const torch::Tensor& expected,
                                            const std::string& what, const std::vector<std::string>& dims = {},
                                            std::optional<Tolerance> tolerance = std::nullopt,
                                            const torch::Tensor& inputs = {});

/// The tolerance of dq or dk (`expected`) under a sliding window of `window` keys (0: none):
/// gradient_tolerance(dtype, expected), except for a window of one key. There every row sees only
/// itself, P = 1 and dS = dP − D = 0, so dq = dk = 0 exactly and what float32 code gives is the
/// rounding of dP − D: it is measured against the size of dv (the oracle's) instead.
Tolerance query_key_gradient_tolerance(torch::ScalarType dtype, const torch::Tensor& expected,
                                       const torch::Tensor& dv, int64_t window);

/// Softmax over the last dim in float64; a row of -inf only gives zeros (the course's
/// definition: such a row attends to nothing), where torch::softmax gives NaN.
torch::Tensor oracle_softmax(const torch::Tensor& x);

/// log(sum(exp(x))) over the last dim in float64 (-inf for a row of -inf only).
torch::Tensor oracle_logsumexp(const torch::Tensor& x);

/// The mask of an oracle call, as in lesson 03's AttentionMask but with the positions given
/// (int64 [Sq] and [Sk]): causal, a sliding window of `window` keys (0: none), and packed
/// documents (`documents`: cu_seqlens int64 [n + 1]; undefined: one document).
struct OracleMask {
  bool causal = false;
  torch::Tensor q_pos, k_pos;
  int64_t window = 0;
  torch::Tensor documents;
};

/// The visible (query, key) pairs of `mask`, [Sq, Sk] bool on the CPU, straight from the
/// definitions (a token's document is the number of boundaries c_1 … c_n at or before its
/// position; n: padding, which sees nothing and is never seen), not from the kernels' ranges.
torch::Tensor oracle_visible(const OracleMask& mask);

/// Attention in float64 (out [B, Hq, Sq, D], lse [B, Hq, Sq]) from matmul and softmax: key j is
/// visible to query i iff !causal or k_pos[j] <= q_pos[i] (positions: int64 [Sq] and [Sk]).
/// GQA: query head h uses kv head h / (Hq / Hkv). A row without visible keys gives out 0 and
/// lse -inf. A hidden key is left out of its row entirely: a NaN or inf in it (or in a query that
/// cannot see it) never reaches that row's out, lse or gradients, as in a tiled kernel that never
/// reads it. (matmul would multiply it by a weight of 0: 0 · NaN = NaN.) Inputs with a non-finite
/// value therefore take a per-(query, key) path, O(B·H·Sq·Sk·D) memory: for small tests only.
std::pair<torch::Tensor, torch::Tensor> oracle_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                         const torch::Tensor& v, bool causal,
                                                         const torch::Tensor& q_pos, const torch::Tensor& k_pos,
                                                         double scale);

/// oracle_attention under any OracleMask (window and documents too).
std::pair<torch::Tensor, torch::Tensor> oracle_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                         const torch::Tensor& v, const OracleMask& mask, double scale);

/// Gradients (dq, dk, dv) in float64 of sum(out · dout) for oracle_attention's out, by autograd
/// (the per-pair path when q, k, v or dout holds a non-finite value).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> oracle_attention_grads(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& dout, bool causal,
    const torch::Tensor& q_pos, const torch::Tensor& k_pos, double scale);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> oracle_attention_grads(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& dout,
    const OracleMask& mask, double scale);

/// Global token positions of `s` queries and `s` keys for causal masks: each layout a ring
/// attention step can produce (keys before, after or interleaved with the queries, zig-zag
/// chunk pairs, sorted and unsorted random positions). Some leave query rows without a visible
/// key. Positions are int64 [s] on the CPU.
struct PositionLayout {
  std::string name;
  torch::Tensor q_pos, k_pos;
};
std::vector<PositionLayout> causal_position_layouts(int64_t s);

/// Sliding windows and packed documents (lesson 12's masks) over s >= 75 queries and keys, with
/// positions contiguous, shifted (the keys of an earlier ring step) and zig-zag: windows of one
/// key, fewer keys than a tile, several tiles and ten times the sequence; documents of 1, 7 and 32
/// tokens and the rest, then 5 tokens of padding, causal or not, and with a window.
std::vector<std::pair<std::string, OracleMask>> window_and_document_masks(int64_t s);

/// Random float32 values ~ N(0, scale²) of the given shape with a fixed seed, plus a few
/// outliers of ±outlier (one in every ~64 elements) to stress the max-shift; outlier = 0
/// gives none.
torch::Tensor random_with_outliers(std::vector<int64_t> shape, uint64_t seed, double scale = 3.0,
                                   double outlier = 1e4);

namespace detail {
struct CheckRecord {
  std::string what;
  double max_abs, max_rel;
  int64_t wrong;
  Tolerance tolerance;
};
/// The checks made by the running test (read by the results file writer).
std::vector<CheckRecord> take_checks();
}  // namespace detail

}  // namespace cp::testing

/// EXPECT / ASSERT that a check (an AssertionResult: all_close, all_close_or_nan, a test's own
/// helper) passed. A failure prints the check's message only: EXPECT_TRUE would add the whole
/// expression and "Actual: false ... Expected: true" around it. ASSERT stops the test at the
/// first failing case: in a loop over cases the next ones mostly repeat the same message.
#define CP_EXPECT_RESULT(result)                                \
  do {                                                          \
    const ::testing::AssertionResult cp_result = (result);      \
    if (!cp_result) ADD_FAILURE() << cp_result.message();       \
  } while (0)
#define CP_ASSERT_RESULT(result)                                \
  do {                                                          \
    const ::testing::AssertionResult cp_result = (result);      \
    if (!cp_result) GTEST_FAIL() << cp_result.message();        \
  } while (0)

/// EXPECT that `actual` matches the float64 oracle `expected` (see all_close).
#define CP_EXPECT_CLOSE(actual, expected, ...) \
  CP_EXPECT_RESULT(::cp::testing::all_close((actual), (expected), __VA_ARGS__))
