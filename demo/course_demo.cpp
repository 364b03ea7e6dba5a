// The course demo (make demo): causal attention sharded over N ranks with every strategy of the
// course — ring, zig-zag ring, Llama 3 all-gather in both modes, Ulysses, hybrid Ulysses × ring —
// forward and backward, each checked against single-device attention over the whole sequence, in
// one table: error, per-rank work imbalance, bytes sent, measured peak memory, time; then the bytes
// sent against the formulas. Writes bar charts and a Chrome trace. Then one training step of
// lesson 09's layer with every strategy against the same step on one rank. It runs the solutions
// of every lesson (each lesson's own tests and demos run your code). Exit status 1 when a row of
// the tables says FAIL (2 on an error), so that scripts (tools/gpu-check) see it.
//
//   build/bin/course_demo --out build/demo                               (make demo)
//   mpirun -np 4 build/bin/course_demo --backend mpi                     (one process per rank)
//   mpirun -np 4 build/bin/course_demo --backend nccl                    (4 GPUs)
#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

#include "common/cli.h"
#include "common/device.h"
#include "common/error.h"
#include "common/memory_meter.h"
#include "common/svg.h"
#include "common/tolerance.h"
#include "common/trace.h"
#include "common/world.h"
#include "context_parallel_attention.h"
#include "hybrid.h"
#include "windows_and_documents.h"

namespace {

using cp::gradient_tolerance;
using cp::Tolerance;
using cp::tolerance_for;

struct Problem {
  int64_t batch, heads_q, heads_kv, seq, dim;
  torch::Device device;
  torch::ScalarType dtype;
};

/// Inputs and single-device results over the whole sequence: lessons 03 and 05 on one device
/// (checked against float64 LibTorch by their tests), the yardstick of every strategy.
struct Reference {
  torch::Tensor q, k, v, dout;       // [B, H, S, D]
  torch::Tensor out, lse, dq, dk, dv;  // whole-sequence results
};

Reference make_reference(const Problem& p, const cp::AttentionMask& mask = cp::causal_mask(true)) {
  // A generator of our own, seeded alike in every process: all ranks see the same inputs.
  torch::Generator gen = at::detail::createCPUGenerator(2026);
  auto input = [&](int64_t heads) {
    return torch::randn({p.batch, heads, p.seq, p.dim}, gen).to(p.device, p.dtype);
  };
  Reference r;
  r.q = input(p.heads_q);
  r.k = input(p.heads_kv);
  r.v = input(p.heads_kv);
  r.dout = input(p.heads_q);
  const cp::AttnResult f = cp::attention_block_forward(r.q, r.k, r.v, mask);
  const cp::AttnGrads g = cp::attention_block_backward(r.dout, r.q, r.k, r.v, f.out, f.lse, mask);
  r.out = f.out;
  r.lse = f.lse;
  r.dq = g.dq;
  r.dk = g.dk;
  r.dv = g.dv;
  return r;
}

/// One rank's figures for one strategy; gathered to rank 0 as a row of doubles (kOk*: 1 or 0).
enum Field { kErrOut, kOkOut, kErrGrad, kOkGrad, kPairs, kMiBSent, kPeakFwd, kPeakBwd, kMsFwd, kMsBwd, kFields };

/// The largest |got − expected| and whether every element is within the tolerance.
struct Comparison {
  double error = 0;
  bool ok = true;
};

Comparison compare(const torch::Tensor& got, const torch::Tensor& expected, Tolerance tol) {
  const torch::Tensor finite = expected.isfinite();  // lse of a row with no key is −inf on both sides
  const torch::Tensor e = expected.to(torch::kDouble).masked_select(finite);
  const torch::Tensor error = (got.to(torch::kDouble).masked_select(finite) - e).abs();
  return {error.max().item<double>(), (error <= tol.abs + tol.rel * e.abs()).all().item<bool>()};
}

Comparison worst(std::initializer_list<Comparison> comparisons) {
  Comparison w;
  for (const Comparison& c : comparisons) w = {std::max(w.error, c.error), w.ok && c.ok};
  return w;
}

/// A strategy of the demo, with the mesh whose volume formula (lesson 11's hybrid_volume) counts
/// its bytes: 1 × N for the rings, N × 1 for Ulysses; none for Llama 3 (lesson 08 has its own).
struct DemoStrategy {
  cp::Strategy strategy;
  std::optional<cp::HybridMesh> mesh;
};

/// The strategies of the course that can run these heads on `world` ranks: lesson 09's four, then
/// Ulysses (lesson 10: Hq divisible by N, Hkv dividing N or divisible by it) and the hybrid on the
/// mesh the course picks (lesson 11). What cannot run is named in `skipped`, with the reason.
std::vector<DemoStrategy> course_strategies(const Problem& p, int world, std::vector<std::string>& skipped) {
  const cp::HybridMesh ring{1, world};
  std::vector<DemoStrategy> strategies = {{cp::ring_strategy(), ring},
                                          {cp::zigzag_ring_strategy(), ring},
                                          {cp::llama3_strategy(cp::Llama3Mode::TwoKernels), std::nullopt},
                                          {cp::llama3_strategy(cp::Llama3Mode::Fused), std::nullopt}};
  try {
    cp::ulysses_kv_heads(p.heads_q, p.heads_kv, world);  // the head rule, with its message
    strategies.push_back({cp::ulysses_strategy(), cp::HybridMesh{world, 1}});
  } catch (const cp::Error& e) {
    skipped.push_back(e.message());
  }
  const cp::HybridMesh mesh = cp::default_hybrid_mesh(world, p.heads_q, p.heads_kv);
  strategies.push_back({cp::hybrid_strategy(mesh), mesh});
  return strategies;
}

double elapsed_ms(std::chrono::steady_clock::time_point start, torch::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

std::vector<double> run_strategy(cp::Comm& comm, const Problem& p, const Reference& ref, const cp::Strategy& strategy,
                                 cp::Trace* trace) {
  auto mine = [&](const torch::Tensor& t) {
    return cp::shard_sequence(t, cp::layout_of(strategy), comm.size(), comm.rank()).contiguous();
  };
  const torch::Tensor q = mine(ref.q), k = mine(ref.k), v = mine(ref.v), dout = mine(ref.dout);
  const std::string name = cp::to_string(strategy);
  if (trace) trace->set_phase(comm.rank(), name);  // every span of this rank until the next strategy
  std::vector<double> row(kFields);
  comm.barrier();
  auto start = std::chrono::steady_clock::now();
  cp::StrategyForward f;
  {
    cp::TraceSpan span(trace, comm.rank(), "strategy", name + " forward");
    cp::MemoryMeter meter;  // everything the forward allocates on this rank, outputs included
    f = cp::strategy_forward(comm, q, k, v, strategy, trace);
    row[kMsFwd] = elapsed_ms(start, p.device);
    row[kPeakFwd] = meter.peak_bytes() / 1048576.0;
  }
  comm.barrier();
  start = std::chrono::steady_clock::now();
  cp::StrategyBackward g;
  {
    cp::TraceSpan span(trace, comm.rank(), "strategy", name + " backward");
    cp::MemoryMeter meter;
    g = cp::strategy_backward(comm, dout, f.saved, strategy, trace);
    row[kMsBwd] = elapsed_ms(start, p.device);
    row[kPeakBwd] = meter.peak_bytes() / 1048576.0;
  }
  if (trace) trace->set_phase(comm.rank(), "");
  const Tolerance tol = tolerance_for(p.dtype);
  const Comparison fwd =
      worst({compare(f.out, mine(ref.out), cp::merged_tolerance(ref.v)), compare(f.lse, mine(ref.lse), tol)});
  const Comparison bwd = worst({compare(g.dq, mine(ref.dq), gradient_tolerance(p.dtype, ref.dq)),
                                compare(g.dk, mine(ref.dk), gradient_tolerance(p.dtype, ref.dk)),
                                compare(g.dv, mine(ref.dv), gradient_tolerance(p.dtype, ref.dv))});
  row[kErrOut] = fwd.error;
  row[kOkOut] = fwd.ok;
  row[kErrGrad] = bwd.error;
  row[kOkGrad] = bwd.ok;
  row[kPairs] = static_cast<double>(f.stats.pairs);
  row[kMiBSent] = (f.stats.bytes_sent + g.stats.bytes_sent) / 1048576.0;
  return row;
}

/// Every rank's row of figures, in rank order (a collective: all ranks take part).
std::vector<std::vector<double>> gather_rows(cp::Comm& comm, const std::vector<double>& row, torch::Device device) {
  const torch::Tensor table = comm.all_gather(torch::tensor(row, torch::kDouble).to(device)).cpu();
  std::vector<std::vector<double>> rows(comm.size());
  for (int r = 0; r < comm.size(); ++r) {
    const double* first = table.data_ptr<double>() + r * row.size();
    rows[r].assign(first, first + row.size());
  }
  return rows;
}

double imbalance(const std::vector<double>& per_rank) {
  const double mean = std::accumulate(per_rank.begin(), per_rank.end(), 0.0) / per_rank.size();
  return mean > 0 ? *std::max_element(per_rank.begin(), per_rank.end()) / mean : 1.0;
}

/// figures[s][rank][field] → the table, and the charts in `out_dir`. Returns false when a row
/// has a FAIL. `mask`: "" for the causal runs (with the legend and the charts), else what the
/// mask adds to causal (lesson 12's runs: the table only).
bool report(const Problem& p, int world, const std::string& backend, const std::vector<DemoStrategy>& strategies,
            const std::vector<std::vector<std::vector<double>>>& figures, const std::string& out_dir,
            const std::string& mask = "") {
  auto column = [&](size_t s, Field f) {
    std::vector<double> c;
    for (const std::vector<double>& rank : figures[s]) c.push_back(rank[f]);
    return c;
  };
  auto max_of = [&](size_t s, Field f) {
    const std::vector<double> c = column(s, f);
    return *std::max_element(c.begin(), c.end());
  };
  bool all_ok = true;
  auto mark = [&](size_t s, Field ok) {  // "ok" when every rank is within the tolerance
    const std::vector<double> c = column(s, ok);
    const bool row_ok = *std::min_element(c.begin(), c.end()) == 1;
    all_ok = all_ok && row_ok;
    return row_ok ? "ok" : "FAIL";
  };
  std::printf("\nCausal attention%s%s, B = %lld, S = %lld, Hq = %lld, Hkv = %lld, D = %lld, %s, on %d ranks "
              "(%s backend, %s)\n",
              mask.empty() ? "" : " with ", mask.c_str(), (long long)p.batch, (long long)p.seq, (long long)p.heads_q, (long long)p.heads_kv, (long long)p.dim,
              c10::toString(p.dtype), world, backend.c_str(), p.device.str().c_str());
  std::printf("# %-21s %10s %-4s %10s %-4s %9s %9s %9s %9s %9s %9s\n", "strategy", "err_fwd", "", "err_bwd", "",
              "imbalance", "MiB_sent", "peak_fwd", "peak_bwd", "fwd_ms", "bwd_ms");
  for (size_t s = 0; s < strategies.size(); ++s)
    std::printf("  %-21s %10.2e %-4s %10.2e %-4s %9.3f %9.2f %9.2f %9.2f %9.1f %9.1f\n",
                strategies[s].strategy.name.c_str(), max_of(s, kErrOut), mark(s, kOkOut), max_of(s, kErrGrad),
                mark(s, kOkGrad), imbalance(column(s, kPairs)), max_of(s, kMiBSent),
                max_of(s, kPeakFwd), max_of(s, kPeakBwd), max_of(s, kMsFwd), max_of(s, kMsBwd));
  if (!mask.empty()) return all_ok;  // the columns are those of the causal table
  const Tolerance tol = tolerance_for(p.dtype);
  std::printf(
      "\nerr_fwd: max |error| of out and lse; err_bwd: of the gradients dq, dk, dv — against lessons 03/05\n"
      "  on one device over the whole sequence (same dtype). ok: every element within the tests' tolerance\n"
      "  for %s (common/tolerance.cpp): |error| <= %g + %g·|expected|, and u·max|v| more for out\n"
      "  (a ring rounds each block's out to %s before the merge; u: the dtype's unit roundoff); for the\n"
      "  gradients max(%g, %g·max|expected|) + %g·|expected|. imbalance: max/mean over ranks of the\n"
      "  (query, key) pairs computed in the forward (1.000 is perfect). MiB_sent: payload a rank sends,\n"
      "  forward + backward (collectives counted as ring algorithms do). peak_fwd/peak_bwd: MiB allocated\n"
      "  at once by a rank during the call, outputs included (cp::MemoryMeter). fwd_ms/bwd_ms: wall time\n"
      "  of the call. Each column: the worst rank.\n"
      "Why llama3 covers more pairs than it needs and holds more memory in the backward: lesson 08,\n"
      "  \"The forward: gather once, then two query groups\" and \"Memory per rank\". ulysses: lesson 10;\n"
      "  hybrid PuxPr: lesson 11, Ulysses in groups of Pu ranks and the zig-zag ring over Pr groups.\n",
      c10::toString(p.dtype), tol.abs, tol.rel, c10::toString(p.dtype), tol.abs, tol.rel, tol.rel);
  std::vector<std::string> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back("rank " + std::to_string(r));
  std::vector<cp::BarSeries> work, memory;
  for (size_t s = 0; s < strategies.size(); ++s) {
    work.push_back({strategies[s].strategy.name, column(s, kPairs)});
    memory.push_back({strategies[s].strategy.name, column(s, kPeakBwd)});
  }
  const std::string shape = "S = " + std::to_string(p.seq) + ", N = " + std::to_string(world);
  cp::write_bar_chart(out_dir + "/work_per_rank.svg", "Forward (query, key) pairs per rank, causal, " + shape, ranks,
                      work, "(query, key) pairs");
  cp::write_bar_chart(out_dir + "/peak_memory_per_rank.svg", "Backward peak memory per rank, " + shape, ranks, memory,
                      "MiB");
  return all_ok;
}

/// Lesson 12's masks on the demo's sequence, each with its single-device reference: a sliding
/// window of half a chunk (the contiguous ring stops after 2 steps, the zig-zag ring cannot), and
/// three documents of uneven lengths, the same in every sequence of the batch.
struct MaskedRun {
  std::string name;
  cp::SequenceMask mask;
  Reference ref;
};

std::vector<MaskedRun> masked_runs(const Problem& p, int world) {
  std::vector<MaskedRun> runs(2);
  runs[0].mask.window = std::max<int64_t>(1, p.seq / world / 2);
  runs[0].name = "a sliding window of W = " + std::to_string(runs[0].mask.window) + " keys (S/(2N), lesson 12)";
  const int64_t first = p.seq / 2 + p.seq / 8, second = p.seq / 4;
  runs[1].mask.documents = torch::tensor(std::vector<int64_t>{0, first, first + second, p.seq});
  runs[1].name = "3 packed documents of " + std::to_string(first) + ", " + std::to_string(second) + " and " +
                 std::to_string(p.seq - first - second) + " tokens (lesson 12)";
  for (MaskedRun& run : runs) {
    cp::AttentionMask mask = cp::causal_mask(true);
    mask.window = run.mask.window;
    mask.documents = run.mask.documents;
    run.ref = make_reference(p, mask);
  }
  return runs;
}

/// Bytes a rank sends in one forward + backward, from lesson 11's formula: a mesh of 1 × N is the
/// ring (lessons 04-05, the zig-zag ring moves the same), N × 1 is Ulysses (lesson 10).
double formula_mib(const Problem& p, cp::HybridMesh mesh) {
  const cp::UlyssesVolume v = cp::hybrid_volume(p.batch, p.heads_q, p.heads_kv, p.seq, p.dim, mesh,
                                                c10::elementSize(p.dtype));
  return (v.forward_bytes + v.backward_bytes) / 1048576.0;
}

/// Rank 0: measured bytes against the formulas at this N, and the formulas' chart over N.
void report_volume(const Problem& p, const std::vector<DemoStrategy>& strategies,
                   const std::vector<std::vector<std::vector<double>>>& figures, const std::string& out_dir) {
  std::printf("\nBytes sent per rank, forward + backward, measured (MiB_sent above) and from the formulas\n");
  std::printf("# %-19s %12s %12s\n", "strategy", "MiB_measured", "MiB_formula");
  for (size_t s = 0; s < strategies.size(); ++s) {
    if (!strategies[s].mesh) continue;
    double measured = 0;
    for (const std::vector<double>& rank : figures[s]) measured = std::max(measured, rank[kMiBSent]);
    std::printf("  %-19s %12.2f %12.2f\n", strategies[s].strategy.name.c_str(), measured,
                formula_mib(p, *strategies[s].mesh));
  }
  std::printf("Formulas (lessons 05, 10, 11): the ring sends N−1 hops of its K/V chunk and, backward, N hops of\n"
              "  the float32 dK/dV; Ulysses sends (N−1)/N of every tensor it exchanges: forward q, k, v in and\n"
              "  out, lse back, backward dout in and dq, dk, dv back (the rest its forward kept); the hybrid\n"
              "  Pu × Pr adds Ulysses over Pu ranks and the ring over Pr groups. With GQA (Hkv < Hq) the ring\n"
              "  moves only the small K/V while Ulysses moves q and out in full, so Ulysses can send more; with\n"
              "  Hkv = Hq its forward sends N/2 times less than the ring's (lesson 10). Chart over N\n"
              "  (formulas): bytes_per_rank.svg.\n");
  std::vector<std::string> sizes;
  std::vector<cp::BarSeries> series = {{"ring", {}}, {"ulysses", {}}, {"hybrid (course mesh)", {}}};
  for (int n = 2; n <= 16; n *= 2) {
    sizes.push_back("N = " + std::to_string(n));
    series[0].values.push_back(formula_mib(p, {1, n}));
    bool ulysses_fits = true;
    try {
      cp::ulysses_kv_heads(p.heads_q, p.heads_kv, n);
    } catch (const cp::Error&) {
      ulysses_fits = false;  // more ranks than heads: Ulysses cannot split them
    }
    series[1].values.push_back(ulysses_fits ? formula_mib(p, {n, 1}) : 0.0);
    series[2].values.push_back(formula_mib(p, cp::default_hybrid_mesh(n, p.heads_q, p.heads_kv)));
  }
  cp::write_bar_chart(out_dir + "/bytes_per_rank.svg",
                      "Bytes sent per rank, forward + backward, from the formulas (S = " + std::to_string(p.seq) +
                          ", Hq = " + std::to_string(p.heads_q) + ", Hkv = " + std::to_string(p.heads_kv) +
                          "; Ulysses 0 where N > Hq)",
                      sizes, series, "MiB");
}

// ── Lesson 09's layer: one training step on N ranks against the same step on one rank ─────────

struct LayerProblem {
  torch::Tensor x, target;            // [B, S, E]
  std::vector<torch::Tensor> weights;  // Wq, Wk, Wv, Wo as the Linear layers hold them
  double lr = 0.5;
};

LayerProblem make_layer_problem(const Problem& p, int64_t seq) {
  torch::Generator gen = at::detail::createCPUGenerator(2027);
  const int64_t e = p.heads_q * p.dim;
  auto data = [&](std::vector<int64_t> shape, double scale) {
    return (torch::randn(shape, gen) * scale).to(p.device, p.dtype);
  };
  const double w = 1.0 / std::sqrt(static_cast<double>(e));
  return {data({p.batch, seq, e}, 1.0), data({p.batch, seq, e}, 1.0),
          {data({p.heads_q * p.dim, e}, w), data({p.heads_kv * p.dim, e}, w), data({p.heads_kv * p.dim, e}, w),
           data({e, p.heads_q * p.dim}, w)}};
}

struct StepResult {
  torch::Tensor y;                     // this rank's output shard [B, S/N, E]
  double loss;                         // the global loss: the mean over all tokens
  std::vector<torch::Tensor> weights;  // after one SGD step
  double ms;
};

/// Forward, loss, backward, gradient all-reduce and one SGD step of ContextParallelAttention on
/// this rank's shard of lp.x, the way a training loop runs it.
StepResult layer_step(cp::Comm& comm, const Problem& p, const LayerProblem& lp, const cp::Strategy& strategy) {
  cp::ContextParallelAttention layer(
      comm, cp::ContextParallelAttentionOptions{p.heads_q * p.dim, p.heads_q, p.heads_kv, strategy});
  layer->to(p.device, p.dtype);
  {
    torch::NoGradGuard no_grad;
    const std::vector<torch::Tensor> params = layer->parameters();  // registration order: q, k, v, o
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(lp.weights[i]);
  }
  auto mine = [&](const torch::Tensor& t) {
    return cp::shard_sequence(t, cp::layout_of(strategy), comm.size(), comm.rank(), 1).contiguous();
  };
  comm.barrier();
  const auto start = std::chrono::steady_clock::now();
  const torch::Tensor y = layer->forward(mine(lp.x));
  const torch::Tensor local_loss = (y * mine(lp.target)).sum() / (y.size(0) * y.size(1));  // mean over my tokens
  local_loss.backward();
  cp::all_reduce_gradients(comm, *layer);
  StepResult r;
  {
    torch::NoGradGuard no_grad;
    for (torch::Tensor& w : layer->parameters()) {
      w.sub_(w.grad() * lp.lr);
      r.weights.push_back(w.detach().clone());
    }
  }
  r.ms = elapsed_ms(start, p.device);
  torch::Tensor loss = local_loss.detach().to(torch::kDouble).reshape({1});
  comm.all_reduce(loss, cp::ReduceOp::Sum);
  r.loss = loss.item<double>() / comm.size();
  r.y = y.detach();
  return r;
}

/// One rank's figures of the layer's step, as a row of doubles (kLayerOk*: 1 or 0).
enum LayerField { kErrLoss, kOkLoss, kErrY, kOkY, kErrWeights, kOkWeights, kStepMs, kLayerFields };

/// Rank 0 prints the layer table: figures[s][rank][LayerField]. Returns false when a row has a
/// FAIL.
bool report_layer(const Problem& p, int64_t seq, const std::vector<DemoStrategy>& strategies,
                  const std::vector<std::vector<std::vector<double>>>& figures) {
  bool all_ok = true;
  std::printf("\nOne training step of lesson 09's layer (E = %lld, S = %lld, SGD): N ranks against one rank\n",
              (long long)(p.heads_q * p.dim), (long long)seq);
  std::printf("# %-19s %10s %-4s %10s %-4s %11s %-4s %9s\n", "strategy", "err_loss", "", "err_y", "", "err_weights",
              "", "step_ms");
  for (size_t s = 0; s < figures.size(); ++s) {
    std::vector<double> worst = figures[s][0];  // over the ranks: the largest error and time, the smallest ok
    for (const std::vector<double>& rank : figures[s])
      for (int f = 0; f < kLayerFields; ++f) {
        const bool is_ok = f == kOkLoss || f == kOkY || f == kOkWeights;
        worst[f] = is_ok ? std::min(worst[f], rank[f]) : std::max(worst[f], rank[f]);
      }
    auto mark = [&](LayerField ok) {
      all_ok = all_ok && worst[ok] == 1;
      return worst[ok] == 1 ? "ok" : "FAIL";
    };
    std::printf("  %-19s %10.2e %-4s %10.2e %-4s %11.2e %-4s %9.1f\n", strategies[s].strategy.name.c_str(),
                worst[kErrLoss], mark(kOkLoss), worst[kErrY], mark(kOkY), worst[kErrWeights], mark(kOkWeights),
                worst[kStepMs]);
  }
  const Tolerance tol = tolerance_for(p.dtype);
  std::printf(
      "\nerr_loss: |loss on N ranks − loss on one rank|; err_y: max |error| of the layer's output y;\n"
      "  err_weights: of Wq, Wk, Wv, Wo after the step. ok: %g·(1 + |loss|) for the loss,\n"
      "  %g + %g·|expected| for the weights, and for y, a sum of E products of both signs, the\n"
      "  gradients' max(%g, %g·max|expected|) + %g·|expected| (common/tolerance.h). step_ms:\n"
      "  forward, loss, backward, gradient all-reduce and SGD step, worst rank. Every figure but the\n"
      "  times is the same on every run (fixed seeds, sums over ranks in rank order, one LibTorch thread\n"
      "  per rank); another CPU can change the last digits (OpenBLAS picks its kernels by CPU; they\n"
      "  round differently).\n",
      tol.rel, tol.abs, tol.rel, tol.abs, tol.rel, tol.rel);
  return all_ok;
}

/// The same cp::ErrorOnEveryRank on every rank (all check the same arguments): nobody waits.
void check_on_every_rank(bool ok, const std::string& message) {
  if (!ok) throw cp::ErrorOnEveryRank(message, __FILE__, __LINE__);
}

}  // namespace

int main(int argc, char** argv) {
  return cp::run_main([&] {
    const cp::CommandLine cli(
        argc, argv, "Every context-parallel strategy of the course against single-device attention.",
        {{"--backend", "local", "local (N threads), mpi or nccl (one process per rank, under mpirun)"},
         {"--world", "4", "number of ranks of the local backend"},
         {"--seq", "4096", "sequence length S (divisible by 2N)"},
         {"--batch", "1", "batch size B"},
         {"--heads", "8", "query heads Hq"},
         {"--kv-heads", "2", "key/value heads Hkv (dividing Hq: grouped-query attention)"},
         {"--dim", "64", "head dim D (CUDA kernels: 32, 64 or 128)"},
         {"--dtype", "float32", "float32 or float64 (CPU); float32, float16 or bfloat16 (CUDA)"},
         {"--device", "auto", "cpu, cuda, or auto (cuda when a GPU is usable; the nccl backend needs cuda)"},
         {"--layer-seq", "1024", "sequence length of the layer's training step (divisible by 2N)"},
         {"--out", "build/demo", "folder for the charts and the trace"}});
    if (cli.help_requested()) return 0;
    torch::set_num_threads(1);  // the ranks share the machine's cores
    const cp::Backend backend = cp::parse_backend(cli.get("--backend"));
    const std::string device_name = cli.get("--device");
    const bool cuda = device_name == "cuda" || (device_name == "auto" && cp::cuda_unavailable_reason().empty());
    CP_CHECK(device_name == "cpu" || device_name == "cuda" || device_name == "auto",
             "--device: expected cpu, cuda or auto, got '", device_name, "'");
    CP_CHECK(!cuda || cp::cuda_unavailable_reason().empty(), "--device cuda: ", cp::cuda_unavailable_reason());
    // The device kind: each rank's own device is set in the world (below).
    const Problem problem{cli.get_int("--batch"),
                          cli.get_int("--heads"),
                          cli.get_int("--kv-heads"),
                          cli.get_int("--seq"),
                          cli.get_int("--dim"),
                          cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU),
                          cp::parse_dtype(cli.get("--dtype"), "--dtype")};
    const int64_t layer_seq = cli.get_int("--layer-seq");
    // Up front, before any work: a wrong shape must be an error, never a table of wrong numbers.
    CP_CHECK(problem.batch >= 1 && problem.heads_q >= 1 && problem.heads_kv >= 1 && problem.dim >= 1 &&
                 problem.seq >= 1 && layer_seq >= 1,
             "--batch, --heads, --kv-heads, --dim, --seq and --layer-seq must be positive");
    CP_CHECK(problem.heads_q % problem.heads_kv == 0, "--heads ", problem.heads_q, " must be a multiple of --kv-heads ",
             problem.heads_kv, " (grouped-query attention: each key/value head serves Hq/Hkv query heads)");
    CP_CHECK(!cuda || problem.dim == 32 || problem.dim == 64 || problem.dim == 128, "--dim ", problem.dim,
             ": the CUDA kernels support head dims 32, 64 and 128");
    CP_CHECK(backend != cp::Backend::Local || cli.get_int("--world") >= 1, "--world: expected at least 1 rank, got ",
             cli.get_int("--world"));
    if (backend == cp::Backend::Local) {  // the world size is known now; under mpirun, in the world
      const int64_t two_n = 2 * cli.get_int("--world");
      for (const auto& [option, seq] :
           {std::pair<const char*, int64_t>{"--seq", problem.seq}, {"--layer-seq", layer_seq}})
        CP_CHECK(seq % two_n == 0, option, " ", seq, " must be divisible by 2·world = ", two_n,
                 " for the zig-zag layout (it cuts S into 2N chunks)");
    }
    const std::string out_dir = cli.get("--out");
    std::filesystem::create_directories(out_dir);

    // Inputs and single-device results, made once per process by the first rank that gets there,
    // on its device: inside the world, where an mpi or nccl world has given the process its own
    // GPU (made before, they would all be on cuda:0, and the nccl backend refuses them on every
    // rank but those of GPU 0). The rank threads of a local world share them (all on cuda:0).
    std::once_flag made;
    Reference ref;
    std::vector<MaskedRun> masked;
    double reference_s = 0;
    LayerProblem layer;
    StepResult one_rank;
    cp::Trace trace;
    std::string trace_path = out_dir + "/trace.json";
    int world = 0;
    bool all_ok = true;
    cp::run_world(backend, cli.get_int("--world"), [&](cp::Comm& comm) {
      Problem p = problem;
      if (p.device.is_cuda()) p.device = cp::current_cuda_device();  // this rank's GPU
      std::call_once(made, [&] {
        const auto start = std::chrono::steady_clock::now();
        ref = make_reference(p);
        reference_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        masked = masked_runs(p, comm.size());
        layer = make_layer_problem(p, layer_seq);
        // The layer's step on a world of one rank (plain attention over all of S), the yardstick
        // of the N-rank steps: its own world, once per process.
        cp::run_local_world(1, [&](cp::Comm& one) { one_rank = layer_step(one, p, layer, cp::ring_strategy()); });
      });
      const int n = comm.size();
      for (const auto& [option, seq] : {std::pair<const char*, int64_t>{"--seq", p.seq}, {"--layer-seq", layer_seq}})
        check_on_every_rank(seq % (2 * n) == 0, cp::detail::concat(option, " ", seq, " must be divisible by 2·world = ",
                                                                   2 * n, " for the zig-zag layout (it cuts S into 2N chunks)"));
      std::vector<std::string> skipped;
      const std::vector<DemoStrategy> strategies = course_strategies(p, n, skipped);
      std::vector<std::vector<std::vector<double>>> figures;  // [strategy][rank][field]
      for (const DemoStrategy& s : strategies)
        figures.push_back(gather_rows(comm, run_strategy(comm, p, ref, s.strategy, &trace), p.device));
      if (comm.rank() == 0) {
        all_ok = report(p, n, cp::to_string(comm.backend()), strategies, figures, out_dir);
        for (const std::string& reason : skipped) std::printf("Not run: %s\n", reason.c_str());
        report_volume(p, strategies, figures, out_dir);
      }
      // Lesson 12: the rings under a sliding window and under packed documents, against lessons
      // 03/05 on one device under the same mask.
      for (const MaskedRun& run : masked) {
        std::vector<DemoStrategy> rings;
        for (cp::TokenLayout layout : {cp::TokenLayout::Contiguous, cp::TokenLayout::ZigZag})
          rings.push_back({cp::masked_ring_strategy(layout, run.mask), std::nullopt});
        std::vector<std::vector<std::vector<double>>> masked_figures;
        for (const DemoStrategy& s : rings)
          masked_figures.push_back(gather_rows(comm, run_strategy(comm, p, run.ref, s.strategy, nullptr), p.device));
        if (comm.rank() == 0)
          all_ok = report(p, n, cp::to_string(comm.backend()), rings, masked_figures, out_dir, run.name) && all_ok;
      }
      std::vector<std::vector<std::vector<double>>> layer_figures;  // [strategy][rank][LayerField]
      const Tolerance tol = tolerance_for(p.dtype);  // loss, weights: as tests/09_*_test.cpp checks them
      for (const DemoStrategy& s : strategies) {
        const cp::Strategy& strategy = s.strategy;
        const StepResult r = layer_step(comm, p, layer, strategy);
        Comparison weights;
        for (size_t i = 0; i < r.weights.size(); ++i)
          weights = worst({weights, compare(r.weights[i], one_rank.weights[i], tol)});
        const torch::Tensor y_ref = cp::shard_sequence(one_rank.y, cp::layout_of(strategy), n, comm.rank(), 1);
        // y = attention · Woᵀ sums E products of both signs: like a gradient, its rounding follows
        // their size, not its own (and a ring's out differs from one rank's by its block roundings).
        const Comparison y = compare(r.y, y_ref, gradient_tolerance(p.dtype, one_rank.y));
        const double err_loss = std::abs(r.loss - one_rank.loss);
        const bool ok_loss = err_loss <= tol.rel * (1 + std::abs(one_rank.loss));
        layer_figures.push_back(gather_rows(
            comm, {err_loss, double(ok_loss), y.error, double(y.ok), weights.error, double(weights.ok), r.ms}, p.device));
      }
      // One process per rank: each writes its own spans.
      if (backend != cp::Backend::Local) trace_path = out_dir + "/trace.rank" + std::to_string(comm.rank()) + ".json";
      if (comm.rank() != 0) return;
      world = n;
      all_ok = report_layer(p, layer_seq, strategies, layer_figures) && all_ok;
    });
    trace.write(trace_path);
    if (world == 0) return 0;  // not rank 0 of an mpirun world: rank 0 prints
    std::printf("\nReference: lessons 03/05's forward and backward over the whole sequence on one device, one\n"
                "  LibTorch thread: %.1f s.", reference_s);
    if (backend == cp::Backend::Local && !cuda)
      std::printf(" The %d ranks are %d threads on this machine's %u cores, one LibTorch thread\n"
                  "  each: their times compare the strategies with each other; they cannot show a speed-up.",
                  world, world, std::thread::hardware_concurrency());
    std::printf("\nFiles in %s/:\n"
                "  work_per_rank.svg, peak_memory_per_rank.svg,  bar charts (open in a browser)\n"
                "  bytes_per_rank.svg\n"
                "  %-44s compute and communication spans of every strategy\n"
                "                                               (chrome://tracing or ui.perfetto.dev)\n",
                out_dir.c_str(), std::filesystem::path(trace_path).filename().string().c_str());
    if (!all_ok) {
      std::fflush(stdout);
      std::fprintf(stderr, "course_demo: FAILED: results outside the tolerance (FAIL in the tables above)\n");
      return 1;
    }
    return 0;
  });
}
