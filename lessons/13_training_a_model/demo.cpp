// Lesson 13 demo, two runs.
//   --run train: the small language model trained on a generated text on N simulated ranks,
//     its loss curve beside the same model trained on one device, and beside the classic mistake
//     (local positions in the rotary embeddings); then each model's loss on held-out text, on one
//     device. Writes loss_curves.svg.
//   --run precision: ring attention with bfloat16 partial results, out/lse/dq/dk/dv against
//     float64 as the ring grows from 1 to 64 ranks, for each accumulator and merge form. Writes
//     precision.svg.
//
//   build/bin/lesson13_demo_solution --run train
//   build/bin/lesson13_demo_solution --run precision
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "common/cli.h"
#include "common/error.h"
#include "common/svg.h"
#include "common/world.h"
#include "training.h"

namespace {

// ── The text: sentences of a small grammar, as characters ──────────────────────────────────

const std::string kAlphabet = " .abcdefghijklmnopqrstuvwxyz";

/// `chars` characters of sentences such as "the small cat sees a red ball." drawn with `seed`:
/// words repeat and follow rules, so there is something to learn, and no download.
std::string generated_text(int64_t chars, uint64_t seed) {
  const std::vector<std::vector<std::string>> words = {
      {"the", "a", "one", "every"},
      {"small", "red", "old", "quick", "quiet", "bright"},
      {"cat", "dog", "bird", "ring", "rank", "token", "model"},
      {"sees", "sends", "finds", "holds", "follows", "merges"},
  };
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  auto pick = [&](const std::vector<std::string>& list) {
    return list[torch::randint(static_cast<int64_t>(list.size()), {1}, gen).item<int64_t>()];
  };
  std::string text;
  while (static_cast<int64_t>(text.size()) < chars)
    text += pick(words[0]) + " " + pick(words[1]) + " " + pick(words[2]) + " " + pick(words[3]) + " " +
            pick(words[0]) + " " + pick(words[1]) + " " + pick(words[2]) + ". ";
  return text.substr(0, chars);
}

torch::Tensor encode(const std::string& text) {
  std::vector<int64_t> ids;
  for (char ch : text) ids.push_back(static_cast<int64_t>(kAlphabet.find(ch)));
  return torch::tensor(ids, torch::kLong);
}

/// `batch` windows of `seq` tokens of `ids`, at offsets drawn with `seed`: every rank draws the
/// same batch.
torch::Tensor sample_batch(const torch::Tensor& ids, int64_t batch, int64_t seq, uint64_t seed) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  const torch::Tensor starts = torch::randint(ids.size(0) - seq, {batch}, gen, torch::kLong);
  std::vector<torch::Tensor> rows;
  for (int64_t b = 0; b < batch; ++b) rows.push_back(ids.narrow(0, starts[b].item<int64_t>(), seq));
  return torch::stack(rows);
}

// ── --run train ─────────────────────────────────────────────────────────────────────────────

struct TrainConfig {
  int world = 4, steps = 80;
  int64_t batch = 4, seq = 128;
};

cp::TinyLMOptions model_options(const cp::Strategy& strategy) {
  cp::TinyLMOptions o;
  o.vocab = static_cast<int64_t>(kAlphabet.size());
  o.embed_dim = 64;
  o.layers = 2;
  o.heads_q = 4;
  o.heads_kv = 2;
  o.mlp_dim = 128;
  o.seed = 7;
  o.strategy = strategy;
  return o;
}

torch::optim::AdamWOptions adamw_options() { return torch::optim::AdamWOptions(3e-3).weight_decay(0.01); }

struct Curve {
  std::vector<double> losses;
  std::vector<torch::Tensor> weights;  // rank 0's parameters at the end
};

/// `config.steps` AdamW steps on `world` threads. local_positions: the mistake, each rank's
/// rotary angles from 0 … S/N − 1 instead of its tokens' positions.
Curve train(const torch::Tensor& ids, const TrainConfig& config, int world, bool local_positions) {
  Curve curve;
  cp::run_local_world(world, [&](cp::Comm& comm) {
    const cp::Strategy strategy = cp::zigzag_ring_strategy();
    cp::TinyLM model(comm, model_options(strategy));
    torch::optim::AdamW adamw(model->parameters(), adamw_options());
    for (int step = 0; step < config.steps; ++step) {
      const torch::Tensor batch = sample_batch(ids, config.batch, config.seq, 1000 + step);
      cp::TokenShard shard = cp::shard_batch(batch, cp::layout_of(strategy), world, comm.rank());
      if (local_positions) shard.positions = torch::arange(shard.positions.size(0), torch::kLong);
      const cp::ShardedLoss loss = cp::train_step(comm, model, adamw, shard);
      if (comm.rank() == 0) curve.losses.push_back(loss.loss);
    }
    if (comm.rank() == 0)
      for (const torch::Tensor& p : model->parameters()) curve.weights.push_back(p.detach().clone());
  });
  return curve;
}

/// The mean loss of trained weights on held-out batches, on one device with global positions.
double held_out_loss(const torch::Tensor& ids, const TrainConfig& config, const std::vector<torch::Tensor>& weights) {
  double total = 0;
  cp::run_local_world(1, [&](cp::Comm& comm) {
    cp::TinyLM model(comm, model_options(cp::zigzag_ring_strategy()));
    torch::NoGradGuard no_grad;
    auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(weights[i]);
    for (int b = 0; b < 4; ++b) {
      const cp::TokenShard all = cp::shard_batch(sample_batch(ids, config.batch, config.seq, 9000 + b),
                                                 cp::TokenLayout::Contiguous, 1, 0);
      total += cp::sharded_cross_entropy(comm, model->forward(all.tokens, all.positions), all.labels).loss / 4;
    }
  });
  return total;
}

void run_train(const TrainConfig& config, const std::string& out_dir) {
  const torch::Tensor text = encode(generated_text(40000, 1)), held_out = encode(generated_text(8000, 2));
  std::printf("A %zu-character alphabet, 40000 characters of generated sentences (\"%s…\").\n", kAlphabet.size(),
              generated_text(60, 1).c_str());
  std::printf("TinyLM: 2 layers, E = 64, 4 query heads over 2 K/V heads, rotary, SwiGLU 128; AdamW lr 3e-3.\n");
  std::printf("Batches of %lld × %lld tokens; the zig-zag ring on %d simulated ranks.\n\n",
              static_cast<long long>(config.batch), static_cast<long long>(config.seq), config.world);
  const Curve one = train(text, config, 1, false);
  const Curve sharded = train(text, config, config.world, false);
  const Curve mistake = train(text, config, config.world, true);
  std::printf("%6s  %12s  %14s  %10s  %18s\n", "step", "one device", "N ranks", "|diff|", "local positions");
  double largest = 0;
  for (int s = 0; s < config.steps; ++s) {
    const double diff = std::abs(one.losses[s] - sharded.losses[s]);
    largest = std::max(largest, diff);
    if (s % 10 == 0 || s == config.steps - 1)
      std::printf("%6d  %12.6f  %14.6f  %10.2e  %18.6f\n", s + 1, one.losses[s], sharded.losses[s], diff,
                  mistake.losses[s]);
  }
  std::printf("\nLargest |one device − N ranks| over %d steps: %.2e (float32: the same steps, up to rounding).\n",
              config.steps, largest);
  std::printf("Held-out loss on one device, global positions: trained on one device %.4f, on N ranks %.4f, "
              "on N ranks with local positions %.4f.\n",
              held_out_loss(held_out, config, one.weights), held_out_loss(held_out, config, sharded.weights),
              held_out_loss(held_out, config, mistake.weights));
  std::vector<double> steps;
  for (int s = 1; s <= config.steps; ++s) steps.push_back(s);
  const std::string path = out_dir + "/loss_curves.svg";
  cp::write_line_chart(path, "TinyLM loss: one device, N = " + std::to_string(config.world) + " ranks, local positions",
                       steps,
                       {{"one device", one.losses},
                        {std::to_string(config.world) + " ranks (zig-zag ring)", sharded.losses},
                        {std::to_string(config.world) + " ranks, local positions (mistake)", mistake.losses}},
                       "step", "training loss (nats per token)");
  std::printf("Chart: %s\n", path.c_str());
}

// ── --run precision ─────────────────────────────────────────────────────────────────────────

void run_precision(const cp::PrecisionSetup& setup, int max_world, const std::string& out_dir) {
  std::printf("Ring attention with bfloat16 partial results against float64, chunk %lld tokens per rank, "
              "%lld heads, D = %lld, causal.\n",
              static_cast<long long>(setup.chunk), static_cast<long long>(setup.heads),
              static_cast<long long>(setup.dim));
  std::printf("Mean |error| / mean |float64| (lse: mean |error|) of the last rank's out, lse, dq, and of chunk "
              "0's dk, dv.\n\n");
  std::printf("%4s %7s  %-9s %-8s  %9s %9s %9s %9s %9s\n", "N", "S", "accum", "form", "out", "lse", "dq", "dk", "dv");
  // The chart: out for the four ways, dk for the two accumulators (the backward has no form).
  std::vector<double> worlds;
  std::vector<cp::LineSeries> out_series, dk_series;
  for (int n = 1; n <= max_world; n *= 2) {
    worlds.push_back(n);
    const std::vector<cp::PrecisionResult> results = cp::ring_precision(n, setup);
    for (size_t i = 0; i < results.size(); ++i) {
      const cp::PrecisionResult& r = results[i];
      const cp::PrecisionErrors& e = r.errors;
      const std::string accumulator = cp::to_string(r.accumulator), form = cp::to_string(r.form);
      std::printf("%4d %7lld  %-9s %-8s  %9.2e %9.2e %9.2e %9.2e %9.2e\n", n,
                  static_cast<long long>(n * setup.chunk), accumulator.c_str(), form.c_str(), e.out, e.lse, e.dq,
                  e.dk, e.dv);
      if (out_series.size() == i) out_series.push_back({"out, " + accumulator + " sums, " + form + " merge", {}});
      out_series[i].values.push_back(e.out);
      if (r.form != cp::MergeForm::Exp) continue;
      const size_t d = i / 2;
      if (dk_series.size() == d) dk_series.push_back({"dk, " + accumulator + " sums", {}});
      dk_series[d].values.push_back(e.dk);
    }
  }
  std::vector<cp::LineSeries> series = out_series;
  series.insert(series.end(), dk_series.begin(), dk_series.end());
  const std::string path = out_dir + "/precision.svg";
  cp::write_line_chart(path, "bfloat16 ring attention: error against float64 as the ring grows", worlds, series,
                       "ranks N (S = N × chunk)", "mean relative error", cp::AxisScale::Log, cp::AxisScale::Log);
  std::printf("\nChart: %s\n", path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  return cp::run_main([&] {
    const cp::CommandLine cli(argc, argv, "Training a small language model under context parallelism.",
                              {{"--run", "train", "train (loss curves) or precision (the bfloat16 ring)"},
                               {"--world", "4", "train: ranks N (simulated: threads of this process)"},
                               {"--steps", "80", "train: AdamW steps"},
                               {"--max-world", "64", "precision: the largest ring (1, 2, 4, … up to it)"},
                               {"--chunk", "128", "precision: tokens per rank"},
                               {"--out", "build/lesson13", "folder for the SVG charts"}});
    if (cli.help_requested()) return 0;
    torch::set_num_threads(1);
    const std::string run = cli.get("--run"), out_dir = cli.get("--out");
    std::filesystem::create_directories(out_dir);
    if (run == "train") {
      TrainConfig config;
      config.world = cli.get_int("--world");
      config.steps = cli.get_int("--steps");
      CP_CHECK(config.world >= 1 && config.seq % (2 * config.world) == 0, "--world ", config.world,
               " must divide S/2 = ", config.seq / 2, " (the zig-zag cuts the 128 tokens into 2N chunks)");
      CP_CHECK(config.steps >= 1, "--steps must be at least 1, got ", config.steps);
      run_train(config, out_dir);
    } else if (run == "precision") {
      cp::PrecisionSetup setup;
      setup.chunk = cli.get_int("--chunk");
      const int max_world = cli.get_int("--max-world");
      CP_CHECK(max_world >= 1 && max_world <= 256, "--max-world ", max_world, " must be 1 … 256");
      run_precision(setup, max_world, out_dir);
    } else {
      CP_CHECK(false, "--run must be train or precision, got '", run, "'");
    }
    return 0;
  }, [](const cp::NotImplemented& e) {
    std::printf("\nThis demo runs your lesson 13 code, which is not written yet:\n  %s\n", e.what());
  });
}
