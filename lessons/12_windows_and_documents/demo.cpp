// Lesson 12 demo: what a sliding window and packed documents do to the ring — the steps it runs,
// the bytes each rank sends (measured by the ring), and the work per rank (the exact model, and
// the pairs the ring computed) for the contiguous and zig-zag layouts and the zig-zag per
// document, on N simulated ranks.
//
//   build/bin/lesson12_demo_solution
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "common/cli.h"
#include "common/error.h"
#include "common/world.h"
#include "windows_and_documents.h"

namespace {

constexpr int64_t kBatch = 1, kHeads = 2, kDim = 64;  // the shapes of the measured runs

struct Run {
  int steps = 0;                  // ring steps run (the same on every rank)
  double mib_sent = 0;            // the forward's bytes of the busiest rank, MiB
  std::vector<int64_t> computed;  // per rank: query × key pairs of the blocks the ring computed
};

/// The masked ring forward on `world` threads: steps, bytes and computed pairs per rank.
Run run_ring(const cp::PaddedLayout& layout, const cp::SequenceMask& mask, int world) {
  torch::manual_seed(1);
  auto make = [&] { return torch::randn({kBatch, kHeads, layout.tokens, kDim}); };
  const torch::Tensor q = make(), k = make(), v = make();
  Run run;
  run.computed.assign(world, 0);
  std::vector<int64_t> bytes(world);
  cp::run_local_world(world, [&](cp::Comm& comm) {
    const int r = comm.rank();
    auto mine = [&](const torch::Tensor& t) { return cp::shard_padded(t, layout, r); };
    const cp::RingStats stats =
        cp::masked_ring_attention_forward(comm, mine(q), mine(k), mine(v), layout, mask).stats;
    for (const cp::StepWork& step : stats.steps) run.computed[r] += step.pairs;
    bytes[r] = stats.bytes_sent;
    if (r == 0) run.steps = world - stats.steps_not_run;
  });
  run.mib_sent = static_cast<double>(*std::max_element(bytes.begin(), bytes.end())) / (1 << 20);
  return run;
}

std::vector<int64_t> model_work(const cp::PaddedLayout& layout, const cp::SequenceMask& mask) {
  std::vector<int64_t> work;
  for (const torch::Tensor& p : layout.positions) work.push_back(cp::masked_work(p, mask, layout.tokens));
  return work;
}

void window_table(int64_t seq, int world) {
  const int64_t c = seq / world;
  std::printf("Sliding window, S = %lld tokens on N = %d ranks (chunks of c = S/N = %lld), B·H = %lld, D = %lld\n",
              (long long)seq, world, (long long)c, (long long)(kBatch * kHeads), (long long)kDim);
  std::printf("# %6s %6s %-11s %6s %9s %9s %13s %15s %12s\n", "W", "W/c", "layout", "steps", "predicted", "MiB_sent",
              "busiest_pairs", "model_imbalance", "block_pairs");
  std::vector<int64_t> windows = {c / 8, c / 2};  // below a chunk, then 1, 2, …, N − 1 chunks, then S
  for (int64_t chunks = 1; chunks < world; ++chunks) windows.push_back(chunks * c);
  windows.push_back(seq);
  for (const int64_t window : windows) {
    cp::SequenceMask mask;
    mask.window = window;
    for (cp::TokenLayout layout : {cp::TokenLayout::Contiguous, cp::TokenLayout::ZigZag}) {
      const cp::PaddedLayout padded = cp::padded_layout(layout, seq, world);
      const Run run = run_ring(padded, mask, world);
      const int64_t computed = std::accumulate(run.computed.begin(), run.computed.end(), int64_t{0});
      const std::vector<int64_t> work = model_work(padded, mask);
      std::printf("  %6lld %6.3g %-11s %6d %9d %9.2f %13.3g %15.3f %12.3g\n", (long long)window,
                  static_cast<double>(window) / c, padded.name.c_str(), run.steps,
                  cp::window_ring_steps(layout, seq, world, window), run.mib_sent,
                  static_cast<double>(*std::max_element(work.begin(), work.end())), cp::imbalance(work),
                  static_cast<double>(computed));
    }
  }
  std::printf("steps: ring steps run, of N (measured); predicted: window_ring_steps. MiB_sent: K/V the busiest\n"
              "rank sent in the forward (measured). busiest_pairs: the visible pairs of the busiest rank (the model),\n"
              "which set the compute time; model_imbalance: their max/mean over the ranks.\n"
              "block_pairs: query x key pairs of the blocks the ring computed, all ranks; inside them the kernels\n"
              "skip every 32 x 32 tile the mask hides, so the work done lies between the model and this.\n\n");
}

void document_table(int world) {
  // One long document and many short ones, as a packed batch holds them; lengths that no layout
  // divides: every layout pads.
  const std::vector<int64_t> lengths = {1500, 37, 61, 250, 9, 130, 333, 77, 400, 4};
  std::vector<int64_t> cu = {0};
  for (int64_t l : lengths) cu.push_back(cu.back() + l);
  cp::SequenceMask mask;
  mask.documents = torch::tensor(cu, torch::kLong);
  std::printf("Packed documents: %zu documents, T = %lld tokens (longest %lld), causal, on N = %d ranks\n",
              lengths.size(), (long long)cu.back(), (long long)lengths[0], world);
  std::printf("# %-21s %9s %6s %9s %13s %15s %12s\n", "layout", "padding", "steps", "MiB_sent", "busiest_pairs",
              "model_imbalance", "block_pairs");
  for (const cp::PaddedLayout& layout : {cp::padded_layout(cp::TokenLayout::Contiguous, cu.back(), world),
                                         cp::padded_layout(cp::TokenLayout::ZigZag, cu.back(), world),
                                         cp::document_zigzag_layout(mask.documents, world)}) {
    const Run run = run_ring(layout, mask, world);
    const int64_t computed = std::accumulate(run.computed.begin(), run.computed.end(), int64_t{0});
    const std::vector<int64_t> work = model_work(layout, mask);
    std::printf("  %-21s %8.1f%% %6d %9.2f %13.3g %15.3f %12.3g\n", layout.name.c_str(), 100 * cp::padding_overhead(layout),
                run.steps, run.mib_sent, static_cast<double>(*std::max_element(work.begin(), work.end())),
                cp::imbalance(work), static_cast<double>(computed));
  }
  std::printf("padding: rows added over the real tokens. The other columns as above.\n");
}

}  // namespace

int main(int argc, char** argv) {
  return cp::run_main([&] {
    const cp::CommandLine cli(argc, argv, "Sliding windows and packed documents on the ring.",
                              {{"--seq", "2048", "sequence length S of the window table (divisible by 2N)"},
                               {"--world", "8", "ranks N (simulated: threads of this process)"}});
    if (cli.help_requested()) return 0;
    torch::set_num_threads(1);
    const int64_t seq = cli.get_int("--seq");
    const int world = cli.get_int("--world");
    CP_CHECK(world >= 1 && world <= 64, "--world ", world, " must be 1 … 64");
    CP_CHECK(seq >= 16 * world && seq % (16 * world) == 0, "--seq ", seq, " must be a positive multiple of 16N = ",
             16 * world, ": the windows of the table are c/8 … S with c = S/N, and the zig-zag cuts S into 2N");
    window_table(seq, world);
    document_table(world);
    return 0;
  }, [](const cp::NotImplemented& e) {
    std::printf("\nThis demo runs your lesson 12 code, which is not written yet:\n  %s\n", e.what());
  });
}
