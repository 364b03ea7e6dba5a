// Lesson 15 demo: the two prefills at several cache hit rates on N simulated ranks (bytes, time,
// every row checked against one-device attention), the planner's choice between them for a
// Llama-3.1-70B layer on one H100 node, and decode steps merged by a gather and by a tree.
//
//   make serve        (= build/bin/lesson15_demo_solution)
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "common/cli.h"
#include "common/error.h"
#include "common/svg.h"
#include "common/world.h"
#include "serving.h"

namespace {

constexpr int64_t kHeadsQ = 8, kHeadsKv = 2, kDim = 64;  // the shapes of the measured runs

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// Causal attention of the whole sequence on one device (lesson 03's, float64 in and out, float32
/// inside): the reference of every row.
cp::AttnResult one_device(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  return cp::attention_block_forward(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble),
                                     cp::causal_mask(true));
}

void prefill_table(int64_t fresh, int world) {
  std::printf("Prefill of T = %lld new tokens after P cached (a cache that grew round robin), N = %d ranks (threads),"
              " Hq %lld, Hkv %lld, D %lld, float32\n",
              (long long)fresh, world, (long long)kHeadsQ, (long long)kHeadsKv, (long long)kDim);
  std::printf("# %8s %8s %6s %-8s %10s %9s %9s  %s\n", "hit", "P", "T", "variant", "MiB_sent", "ms", "max_err", "check");
  for (double hit : {0.0, 0.5, 0.9, 0.99}) {
    const int64_t cached = static_cast<int64_t>(std::llround(fresh * hit / (1 - hit)));
    const int64_t length = cached + fresh;
    torch::manual_seed(15);
    const torch::Tensor q = torch::randn({1, kHeadsQ, length, kDim}), k = torch::randn({1, kHeadsKv, length, kDim}),
                        v = torch::randn({1, kHeadsKv, length, kDim});
    const cp::AttnResult expected = one_device(q, k, v);
    for (cp::PrefillVariant variant : {cp::PrefillVariant::PassKV, cp::PrefillVariant::PassQ}) {
      std::vector<int64_t> bytes(world);
      std::vector<double> error(world), ms(world);
      cp::run_local_world(world, [&](cp::Comm& comm) {
        const int r = comm.rank();
        const torch::Tensor held = torch::arange(r, std::max<int64_t>(cached, r), world, torch::kLong);
        cp::KvCacheShard cache{k.index_select(2, held), v.index_select(2, held), held};
        const torch::Tensor mine = cp::prefill_positions(cached, fresh, world, r);
        auto pick = [&](const torch::Tensor& t) { return t.index_select(2, mine); };
        comm.barrier();
        const auto start = std::chrono::steady_clock::now();
        const cp::PrefillResult result =
            variant == cp::PrefillVariant::PassKV
                ? cp::pass_kv_prefill(comm, pick(q), pick(k), pick(v), mine, cache)
                : cp::pass_q_prefill(comm, pick(q), pick(k), pick(v), mine, cache);
        ms[r] = 1e3 * seconds_since(start);
        bytes[r] = result.bytes_sent;
        error[r] = (result.out.to(torch::kDouble) - expected.out.index_select(2, mine)).abs().max().item<double>();
      });
      const double worst = *std::max_element(error.begin(), error.end());
      std::printf("  %7.0f%% %8lld %6lld %-8s %10.3f %9.1f %9.1e  %s\n", 100 * hit, (long long)cached, (long long)fresh,
                  cp::to_string(variant).c_str(), *std::max_element(bytes.begin(), bytes.end()) / 1048576.0,
                  *std::max_element(ms.begin(), ms.end()), worst, worst < 1e-4 ? "ok" : "WRONG");
    }
  }
  std::printf("MiB_sent, ms: the busiest rank. max_err: largest |out − one device's out| (lesson 03).\n\n");
}

/// The choice for one Llama-3.1-70B layer on one H100 node with 128k tokens of context, and with
/// `out` the charts of both variants' bytes and predicted times against the new tokens T.
void choice_table(const std::string& out) {
  const cp::Cluster& cluster = cp::cluster_preset("h100x8");
  const int64_t context = 131072, heads_q = 64, heads_kv = 8, dim = 128, element = 2;
  const int gpus = cluster.gpus_per_node;
  auto predict = [&](int64_t fresh) {
    return cp::choose_prefill({fresh, context - fresh, heads_q, heads_kv, dim, element, gpus}, cluster);
  };
  std::printf("The choice (task 4) for one Llama-3.1-70B layer (Hq 64, Hkv 8, D 128, bfloat16) on %s, "
              "P + T = %lld tokens\n", cluster.name.c_str(), (long long)context);
  std::printf("# %8s %8s %8s %11s %11s  %s\n", "hit", "P", "T", "pass-KV_ms", "pass-Q_ms", "choice");
  for (double hit : {0.0, 0.5, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999}) {
    const int64_t fresh = std::max<int64_t>(1, std::llround(context * (1 - hit)));
    const cp::PrefillChoice c = predict(fresh);
    std::printf("  %7.1f%% %8lld %8lld %11.3f %11.3f  %s\n", 100 * hit, (long long)(context - fresh), (long long)fresh,
                c.pass_kv_ms, c.pass_q_ms, cp::to_string(c.choice).c_str());
  }
  std::printf("(the model of task 4: predictions, not runs)\n\n");
  if (out.empty()) return;
  std::vector<double> news;
  std::vector<cp::LineSeries> mib = {{"pass-KV", {}}, {"pass-Q", {}}}, ms = mib;
  for (int64_t fresh = context; fresh >= 128; fresh /= 2) {
    news.push_back(static_cast<double>(fresh));
    const std::vector<int64_t> cached(gpus, (context - fresh) / gpus), fresh_each(gpus, fresh / gpus);
    for (cp::PrefillVariant variant : {cp::PrefillVariant::PassKV, cp::PrefillVariant::PassQ})
      mib[variant == cp::PrefillVariant::PassKV ? 0 : 1].values.push_back(
          cp::prefill_bytes(variant, cached, fresh_each, 0, heads_q, heads_kv, dim, element) / 1048576.0);
    const cp::PrefillChoice c = predict(fresh);
    ms[0].values.push_back(c.pass_kv_ms);
    ms[1].values.push_back(c.pass_q_ms);
  }
  const std::string what = "one Llama-3.1-70B layer, P + T = 128k, " + cluster.name;
  cp::write_line_chart(out + "/prefill_bytes.svg", "MiB each GPU sends, " + what, news, mib, "new tokens T",
                       "MiB", cp::AxisScale::Log, cp::AxisScale::Log);
  cp::write_line_chart(out + "/prefill_ms.svg", "Predicted attention time (task 4), " + what, news, ms,
                       "new tokens T", "ms", cp::AxisScale::Log, cp::AxisScale::Log);
  std::printf("Charts: %s/prefill_bytes.svg, %s/prefill_ms.svg\n\n", out.c_str(), out.c_str());
}

/// Seconds the slowest rank takes for fn(comm) after a barrier.
double slowest_seconds(int world, const std::function<void(cp::Comm&)>& fn) {
  std::vector<double> seconds(world);
  cp::run_local_world(world, [&](cp::Comm& comm) {
    comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    fn(comm);
    seconds[comm.rank()] = seconds_since(start);
  });
  return *std::max_element(seconds.begin(), seconds.end());
}

void decode_table(int world, int64_t batch, int64_t length, int steps) {
  std::printf("Decode: %lld sequences of about %lld tokens, cache round robin over N = %d ranks (threads), %d steps\n",
              (long long)batch, (long long)length, world, steps);
  std::printf("# %-7s %9s %12s %8s %12s  %s\n", "merge", "tokens/s", "bytes/step", "rounds", "cache_GB/s", "check");
  torch::manual_seed(16);
  std::vector<int64_t> lengths;
  for (int64_t b = 0; b < batch; ++b) lengths.push_back(length / 2 + b * length / batch);
  std::vector<torch::Tensor> ks, vs;
  for (int64_t len : lengths) {
    ks.push_back(torch::randn({1, kHeadsKv, len + steps, kDim}));
    vs.push_back(torch::randn({1, kHeadsKv, len + steps, kDim}));
  }
  const torch::Tensor queries = torch::randn({steps, batch, kHeadsQ, 1, kDim});
  // Each rank's shards, as a prefill leaves them (cache_append: room for the tokens to come).
  auto prefilled = [&](int rank) {
    std::vector<cp::KvCacheShard> caches;
    for (int64_t b = 0; b < batch; ++b) {
      const torch::Tensor held = torch::arange(rank, std::max<int64_t>(lengths[b], rank), world, torch::kLong);
      caches.push_back(cp::empty_cache_shard(kHeadsKv, kDim, torch::TensorOptions()));
      cp::cache_append(caches.back(), ks[b].index_select(2, held), vs[b].index_select(2, held), held);
    }
    return caches;
  };
  // The last step's one-device answer: each sequence's last query over its whole sequence.
  std::vector<torch::Tensor> expected;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pos = lengths[b] + steps - 1;
    cp::AttentionMask mask;
    mask.causal = true;
    mask.q_positions = torch::tensor({pos}, torch::kLong);
    mask.k_positions = torch::arange(pos + 1, torch::kLong);
    expected.push_back(cp::attention_block_forward(queries[steps - 1][b].unsqueeze(0).to(torch::kDouble),
                                                   ks[b].narrow(2, 0, pos + 1).to(torch::kDouble),
                                                   vs[b].narrow(2, 0, pos + 1).to(torch::kDouble), mask)
                           .out);
  }
  const torch::Tensor expected_last = torch::cat(expected);
  std::vector<int64_t> cache_bytes(world);  // K and V of each rank's shards after the last step
  double decode_gb_s = 0;
  for (cp::DecodeMerge merge : {cp::DecodeMerge::Gather, cp::DecodeMerge::Tree}) {
    std::vector<std::vector<cp::KvCacheShard>> caches(world);
    std::vector<cp::DecodeResult> results(world);
    for (int r = 0; r < world; ++r) caches[r] = prefilled(r);
    const double seconds = slowest_seconds(world, [&](cp::Comm& comm) {
      const int r = comm.rank();
      for (int s = 0; s < steps; ++s) {
        std::vector<torch::Tensor> k, v;
        std::vector<int64_t> at;
        for (int64_t b = 0; b < batch; ++b) {
          at.push_back(lengths[b] + s);
          k.push_back(ks[b].narrow(2, lengths[b] + s, 1));
          v.push_back(vs[b].narrow(2, lengths[b] + s, 1));
        }
        results[r] = cp::decode_step(comm, queries[s], torch::cat(k), torch::cat(v), torch::tensor(at), caches[r], merge);
      }
    });
    int64_t bytes = 0, rounds = 0;
    for (int r = 0; r < world; ++r) {
      cache_bytes[r] = 0;
      for (const cp::KvCacheShard& c : caches[r]) cache_bytes[r] += 2 * c.k.numel() * c.k.element_size();
      bytes = std::max(bytes, results[r].bytes_sent);
      rounds = std::max<int64_t>(rounds, results[r].rounds);
    }
    const double gb_s = *std::max_element(cache_bytes.begin(), cache_bytes.end()) * steps / seconds / 1e9;
    decode_gb_s = std::max(decode_gb_s, gb_s);
    const double error = (results[0].out.to(torch::kDouble) - expected_last).abs().max().item<double>();
    std::printf("  %-7s %9.0f %12lld %8lld %12.2f  %s (%.1e)\n", cp::to_string(merge).c_str(), steps * batch / seconds,
                (long long)bytes, (long long)rounds, gb_s, error < 1e-4 ? "ok" : "WRONG", error);
  }
  // The yardstick: every rank copies as many bytes as its shards hold, once a step, at the same time.
  std::vector<std::vector<char>> from(world), to(world);
  for (int r = 0; r < world; ++r) from[r].assign(cache_bytes[r], 1), to[r].assign(cache_bytes[r], 0);
  const double copy_seconds = slowest_seconds(world, [&](cp::Comm& comm) {
    const int r = comm.rank();
    for (int s = 0; s < steps; ++s) std::memcpy(to[r].data(), from[r].data(), from[r].size());
  });
  const double copy_gb_s = *std::max_element(cache_bytes.begin(), cache_bytes.end()) * steps / copy_seconds / 1e9;
  std::printf("  %-7s %9s %12s %8s %12.2f  (the same bytes copied once a step, the same threads)\n", "memcpy", "", "",
              "", copy_gb_s);
  std::printf("bytes/step: the busiest rank's, last step. cache_GB/s: the busiest rank's K/V bytes read a second.\n"
              "check: the last step's out against one device (largest difference).\n"
              "Decode reads its cache at %.2f× the speed of memcpy on this machine.\n",
              decode_gb_s / copy_gb_s);
}

}  // namespace

int main(int argc, char** argv) {
  return cp::run_main([&] {
    const cp::CommandLine cli(argc, argv, "Context parallelism for serving: prefills and decode.",
                              {{"--new", "256", "new tokens T of the prefill table"},
                               {"--world", "4", "ranks N (simulated: threads of this process)"},
                               {"--batch", "4", "sequences in the decode table"},
                               {"--context", "32768", "about how many tokens each decoded sequence holds"},
                               {"--out", "", "folder for the charts (none: no charts)"}});
    if (cli.help_requested()) return 0;
    torch::set_num_threads(1);
    const int world = cli.get_int("--world");
    CP_CHECK(world >= 1 && world <= 64, "--world ", world, " must be 1 … 64");
    const int64_t fresh = cli.get_int("--new"), batch = cli.get_int("--batch"), context = cli.get_int("--context");
    CP_CHECK(fresh >= 1 && fresh <= 65536, "--new ", fresh, " must be 1 … 65536");
    CP_CHECK(batch >= 1 && context >= 2, "--batch ", batch, " and --context ", context, " must be at least 1 and 2");
    prefill_table(fresh, world);
    choice_table(cli.get("--out"));
    decode_table(world, batch, context, 16);
    return 0;
  }, [](const cp::NotImplemented& e) {
    std::printf("\nThis demo runs your lesson 15 code, which is not written yet:\n  %s\n", e.what());
  });
}
