// The suite every matrix-unit forward kernel passes (lesson 16's kernel, every version of lesson
// 17's ladder): lesson 03's launch contract against float64 attention, on device buffers (a GPU,
// or CUDA on the CPU). float16 and bfloat16, D = 64 and 128, GQA and MQA, Sq and Sk that are not
// multiples of the tiles, causal masks from every layout of the rings' positions (rows that see no
// key included), lesson 12's windows and documents, scores far below and above 0 with maxima that
// rise from tile to tile, a scale of the caller's. The tolerance is matrix_unit_tolerance's model:
// P rounded to 16 bits before P·V.
#pragma once

#include <torch/types.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "block_attention.h"
#include "testing/oracle.h"

#if CP_WITH_CUDA
#include "block_attention.cuh"
#include "common/device_buffer.h"
#include "common/tensor_checks.h"
#include "common/tolerance.h"
#include "testing/harness.h"
#endif

namespace cp::testing {

struct KernelCase {
  int64_t batch, heads_q, heads_kv, seq_q, seq_k, head_dim;
};

/// q, k, v in the dtype under test, on the CPU.
struct KernelInputs {
  torch::Tensor q, k, v;
};

inline KernelInputs random_kernel_inputs(const KernelCase& c, torch::ScalarType dtype, uint64_t seed) {
  auto make = [&](int64_t heads, int64_t seq, uint64_t salt) {
    return random_with_outliers({c.batch, heads, seq, c.head_dim}, seed * 3 + salt, 1.0, 0.0).to(dtype);
  };
  return {make(c.heads_q, c.seq_q, 0), make(c.heads_kv, c.seq_k, 1), make(c.heads_kv, c.seq_k, 2)};
}

#if CP_WITH_CUDA
/// A launch with lesson 03's signature (launch_block_attention_forward's).
using AttentionLaunch =
    std::function<void(const void* q, const void* k, const void* v, void* out, float* lse, const int64_t* q_first,
                       const int64_t* q_last, const int64_t* k_pos, const BlockAttentionParams& params, DType dtype,
                       cudaStream_t stream)>;

/// Runs `launch` on device copies of `in` with the mask's visible ranges; out and lse on the CPU.
inline AttnResult run_attention_kernel(const AttentionLaunch& launch, const KernelInputs& in, const OracleMask& mask,
                                       double scale) {
  AttentionMask am;
  am.causal = mask.causal;
  am.q_positions = mask.q_pos;
  am.k_positions = mask.k_pos;
  am.window = mask.window;
  am.documents = mask.documents;
  const VisibleKeys keys = visible_keys(am, mask.q_pos);
  const BlockAttentionParams p{in.q.size(0), in.q.size(1), in.k.size(1), in.q.size(2), in.k.size(2), in.q.size(3),
                               static_cast<float>(scale), keys.masked};
  CudaStream stream;
  DeviceBuffer q(in.q), k(in.k), v(in.v), k_pos(mask.k_pos);
  DeviceBuffer first(keys.masked ? keys.first : mask.q_pos), last(keys.masked ? keys.last : mask.q_pos);
  DeviceBuffer out(in.q.sizes().vec(), in.q.scalar_type()), lse({p.batch, p.heads_q, p.seq_q}, torch::kFloat);
  launch(q.get(), k.get(), v.get(), out.get(), lse.as<float>(), first.as<int64_t>(), last.as<int64_t>(),
         k_pos.as<int64_t>(), p, kernel_dtype(in.q, "q"), stream.get());
  return {out.to_host(stream.get()), lse.to_host(stream.get())};
}

/// The kernel's out and lse on `in` against float64 attention (positions 0 … S − 1 by default).
inline void expect_kernel_matches_oracle(const AttentionLaunch& launch, const KernelCase& c, const KernelInputs& in,
                                         OracleMask mask, double scale, const std::string& what) {
  if (!mask.q_pos.defined()) mask.q_pos = torch::arange(c.seq_q);
  if (!mask.k_pos.defined()) mask.k_pos = torch::arange(c.seq_k);
  const auto [out, lse] = oracle_attention(in.q.to(torch::kDouble), in.k.to(torch::kDouble), in.v.to(torch::kDouble),
                                           mask, scale);
  const AttnResult got = run_attention_kernel(launch, in, mask, scale);
  const std::string name = what + ", " + std::string(in.q.scalar_type() == torch::kHalf ? "float16" : "bfloat16") +
                           ", B" + std::to_string(c.batch) + " Hq" + std::to_string(c.heads_q) + " Hkv" +
                           std::to_string(c.heads_kv) + " Sq" + std::to_string(c.seq_q) + " Sk" +
                           std::to_string(c.seq_k) + " D" + std::to_string(c.head_dim);
  CP_EXPECT_CLOSE(got.out, out, "out, " + name, {"b", "h", "s", "d"}, matrix_unit_tolerance(in.v));
  CP_EXPECT_CLOSE(got.lse, lse, "lse, " + name, {"b", "h", "s"});
}

/// expect_kernel_matches_oracle on random inputs with the default scale 1/√D.
inline void expect_kernel_matches_oracle(const AttentionLaunch& launch, const KernelCase& c, const OracleMask& mask,
                                         torch::ScalarType dtype, uint64_t seed, const std::string& what) {
  expect_kernel_matches_oracle(launch, c, random_kernel_inputs(c, dtype, seed), mask,
                               1.0 / std::sqrt(static_cast<double>(c.head_dim)), what);
}

/// float16 and bfloat16, D = 64 and 128, GQA 2 and MQA, one query and one key, Sq and Sk not
/// multiples of the tiles, fewer queries than a warp's rows, causal or not.
inline void expect_kernel_for_every_dtype_head_dim_and_group(const AttentionLaunch& launch, const std::string& who) {
  const std::vector<KernelCase> cases = {
      {1, 1, 1, 1, 1, 64},      // one query, one key
      {2, 4, 2, 70, 130, 64},   // GQA 2, neither length a multiple of a tile
      {1, 8, 1, 64, 64, 128},   // MQA, exactly one tile
      {1, 4, 4, 17, 200, 128},  // fewer queries than a warp's 16 rows in the last block, four key tiles
  };
  uint64_t seed = 160;
  for (auto dtype : {torch::kHalf, torch::kBFloat16})
    for (const KernelCase& c : cases)
      for (bool causal : {false, true})
        expect_kernel_matches_oracle(launch, c, {causal, {}, {}}, dtype, seed++,
                                     who + (causal ? ", causal" : ", full"));
}

/// The rings' position layouts (rows that see no key included), D = 64 and 128.
inline void expect_kernel_causal_mask_from_global_positions(const AttentionLaunch& launch, const std::string& who) {
  const int64_t s = 150;  // three 64-row blocks and three 64-key tiles, a multiple of neither
  for (const PositionLayout& layout : causal_position_layouts(s))
    for (int64_t d : {64, 128})
      expect_kernel_matches_oracle(launch, {1, 4, 2, s, s, d}, {true, layout.q_pos, layout.k_pos},
                                   d == 64 ? torch::kBFloat16 : torch::kHalf, 161, who + ", " + layout.name);
}

/// Lesson 12's sliding windows and packed documents.
inline void expect_kernel_windows_and_documents(const AttentionLaunch& launch, const std::string& who) {
  const int64_t s = 150;
  for (const auto& [name, mask] : window_and_document_masks(s))
    for (auto dtype : {torch::kHalf, torch::kBFloat16})
      expect_kernel_matches_oracle(launch, {1, 4, 2, s, s, 64}, mask, dtype, 162, who + ", " + name);
}

/// The shape of inputs_far_from_zero: 80 rows (five groups of 16) against 200 keys.
constexpr KernelCase kFarFromZeroCase{1, 2, 1, 80, 200, 64};

/// Random inputs of kFarFromZeroCase whose keys share a large first dim and whose queries' first
/// dim sets each row's level: with a scale of 0.2, rows 0-15 score about −112 (a maximum started
/// at 0 underflows every p), rows 16-31 about +112 (exp without the maximum overflows), and rows
/// 32-47, through a second dim that grows with the key, have maxima that rise from tile to tile.
inline KernelInputs inputs_far_from_zero(torch::ScalarType dtype, uint64_t seed) {
  const KernelCase c = kFarFromZeroCase;
  KernelInputs in = random_kernel_inputs(c, dtype, seed);
  torch::Tensor q = in.q.to(torch::kFloat), k = in.k.to(torch::kFloat);
  k.select(3, 0).fill_(8.0);
  k.select(3, 1).copy_(torch::linspace(-8, 8, c.seq_k).view({1, 1, c.seq_k}));
  q.select(3, 0).zero_();
  q.select(3, 1).zero_();
  q.narrow(2, 0, 16).select(3, 0).fill_(-70.0);  // rows 0-15: scores about −112
  q.narrow(2, 16, 16).select(3, 0).fill_(70.0);  // rows 16-31: about +112
  q.narrow(2, 32, 16).select(3, 1).fill_(6.0);   // rows 32-47: rising by 4.8 a tile
  in.q = q.to(dtype);
  in.k = k.to(dtype);
  return in;
}

/// inputs_far_from_zero's rows near −112 and +112 and with rising maxima, causal or not, with a
/// scale of the caller's (0.2), not 1/√D.
inline void expect_kernel_rows_far_from_zero(const AttentionLaunch& launch, const std::string& who) {
  const KernelCase c = kFarFromZeroCase;
  const double scale = 0.2;
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    const KernelInputs in = inputs_far_from_zero(dtype, 166);
    for (bool causal : {false, true})
      expect_kernel_matches_oracle(launch, c, in, {causal, {}, {}}, scale,
                                   who + (causal ? ", causal" : ", full") +
                                       ", scores far from 0, rising maxima, scale 0.2");
  }
}

#endif  // CP_WITH_CUDA

}  // namespace cp::testing
