// Lesson 19 demo: the KV cache one GPU holds per token under TP and DCP (and the context that fits),
// the bytes of a DCP decode step for DeepSeek-V3, a DCP step with draft tokens on N simulated ranks
// checked against float64 attention, and paged decode's speed on this CPU beside memcpy.
//
//   make paged-serving   (= build/bin/lesson19_demo_solution)
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/cli.h"
#include "common/error.h"
#include "common/svg.h"
#include "common/world.h"
#include "paged_serving.h"

namespace {

constexpr int kTp = 8;  // one node of 8 GPUs, the usual tensor-parallel group of both models

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

/// Task 6's bytes, or nothing for a dcp the model cannot be split into (said in a line). A stub's
/// NotImplemented is a cp::Error too: it goes on to run_main, which says which task is missing.
std::optional<double> bytes_per_token(const cp::ModelShape& model, int dcp) {
  try {
    return cp::cache_bytes_per_token(model, kTp, dcp);
  } catch (const cp::NotImplemented&) {
    throw;
  } catch (const cp::Error& e) {
    std::printf("  (%s, dcp %d: skipped, %s)\n", model.name.c_str(), dcp, e.message().c_str());
    return std::nullopt;
  }
}

/// a. The cache per GPU and the longest context that fits, and with `out` its chart.
void cache_table(int64_t budget_gib, const std::string& out) {
  const int64_t budget = budget_gib << 30;
  std::printf("KV cache per GPU (task 6), tp = %d, bfloat16; max context assumes %lld GiB of cache per GPU "
              "(an assumption for illustration, not a measurement)\n", kTp, (long long)budget_gib);
  std::printf("# %-16s %4s %14s %12s\n", "model", "dcp", "KiB/token/GPU", "max_context");
  const std::vector<int> dcps = {1, 2, 4, 8};
  std::vector<cp::LineSeries> lines;
  for (const cp::ModelShape& model : {cp::qwen3_235b(), cp::deepseek_v3()}) {
    cp::LineSeries line{model.name, {}};
    for (int dcp : dcps) {
      const std::optional<double> bytes = bytes_per_token(model, dcp);
      if (!bytes) {
        line.values.push_back(NAN);  // no point: the model cannot be split that way
        continue;
      }
      const int64_t tokens = cp::max_context_tokens(model, kTp, dcp, budget);
      std::printf("  %-16s %4d %14.3f %12lld\n", model.name.c_str(), dcp, *bytes / 1024, (long long)tokens);
      line.values.push_back(static_cast<double>(tokens));
    }
    lines.push_back(line);
  }
  std::printf("(KiB: 1024 bytes; a token striped by DCP counts on the one GPU that holds it)\n\n");
  if (out.empty()) return;
  std::filesystem::create_directories(out);
  const std::string title = "Max context of one sequence, tp = " + std::to_string(kTp) + ", " +
                            std::to_string(budget_gib) + " GiB of cache a GPU (assumed)";
  cp::write_line_chart(out + "/max_context.svg", title, {1, 2, 4, 8}, lines, "DCP size", "tokens", cp::AxisScale::Log,
                       cp::AxisScale::Log);
  std::printf("Chart: %s/max_context.svg\n\n", out.c_str());
}

/// b. dcp_bytes (given) for one DeepSeek-V3 layer decoded in the absorbed form (task 5's shapes).
void bytes_table() {
  const int64_t batch = 32, heads_q = 128, key_dim = 576, value_dim = 512, element = 2;
  std::printf("Bytes one rank sends in a DCP decode step (dcp_bytes), one DeepSeek-V3 layer, absorbed: Hq %lld, "
              "key_dim %lld, value_dim %lld, bfloat16 queries, B = %lld, in KiB\n",
              (long long)heads_q, (long long)key_dim, (long long)value_dim, (long long)batch);
  std::printf("# %6s %3s %12s %12s\n", "tokens", "N", "all-to-all", "all-gather");
  for (int64_t tokens : {1, 4})
    for (int world : {2, 4, 8}) {
      auto kib = [&](cp::DcpExchange exchange) {
        return cp::dcp_bytes(exchange, world, batch, tokens, heads_q, key_dim, value_dim, element) / 1024.0;
      };
      std::printf("  %6lld %3d %12.1f %12.1f\n", (long long)tokens, world, kib(cp::DcpExchange::AllToAll),
                  kib(cp::DcpExchange::AllGather));
    }
  std::printf("(tokens 4: a token and 3 drafts; the queries' all-gather, then the partials, float32)\n\n");
}

/// The reference: T new tokens at positions L .. L + T − 1 of a sequence whose keys and values are
/// k [L + T, Hkv, Dk] and v [L + T, Hkv, Dv], each head attending every key up to its token, float64.
torch::Tensor reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t length) {
  const int64_t tokens = q.size(0), group = q.size(1) / k.size(1);
  const torch::Tensor keys = k.to(torch::kDouble).repeat_interleave(group, 1);  // head h reads kv head h / group
  const torch::Tensor values = v.to(torch::kDouble).repeat_interleave(group, 1);
  torch::Tensor scores = torch::einsum("thd,shd->hts", {q.to(torch::kDouble), keys}) / std::sqrt(double(k.size(2)));
  const torch::Tensor later = torch::arange(length + tokens).unsqueeze(0) >
                              torch::arange(length, length + tokens).unsqueeze(1);  // [T, L + T]: after the token
  scores = scores.masked_fill(later, -INFINITY);
  return torch::einsum("hts,shd->thd", {torch::softmax(scores, -1), values});
}

/// c. dcp_decode_step on `world` simulated ranks, both exchanges, two stripes.
void dcp_table(int world) {
  const int64_t batch = 2, tokens = 3, heads_q = 8, heads_kv = 1, dim = 64, page = 16, own = heads_q / world;
  const std::vector<int64_t> ids{7, 11}, lengths{300, 517};
  torch::manual_seed(19);
  std::vector<torch::Tensor> ks, vs;  // every token of each sequence, the new ones last
  for (int64_t length : lengths) {
    ks.push_back(torch::randn({length + tokens, heads_kv, dim}));
    vs.push_back(torch::randn({length + tokens, heads_kv, dim}));
  }
  const torch::Tensor q = torch::randn({batch, tokens, heads_q, dim});
  std::vector<torch::Tensor> new_k, new_v, expected;
  for (int64_t b = 0; b < batch; ++b) {
    new_k.push_back(ks[b].narrow(0, lengths[b], tokens));
    new_v.push_back(vs[b].narrow(0, lengths[b], tokens));
    expected.push_back(reference(q[b], ks[b], vs[b], lengths[b]));
  }
  const torch::Tensor k_step = torch::stack(new_k), v_step = torch::stack(new_v);  // [B, T, Hkv, D], every rank
  const torch::Tensor want = torch::stack(expected);                                // [B, T, Hq, D]
  std::printf("A DCP decode step (task 4) on N = %d ranks (threads): sequences of %lld and %lld tokens, T = %lld new "
              "tokens each (1 + 2 drafts), Hq %lld, Hkv %lld, D %lld, float32, pages of %lld\n",
              world, (long long)lengths[0], (long long)lengths[1], (long long)tokens, (long long)heads_q,
              (long long)heads_kv, (long long)dim, (long long)page);
  std::printf("# %10s %-10s %10s %10s %9s  %s\n", "interleave", "exchange", "bytes_sent", "dcp_bytes", "max_err",
              "check");
  for (int64_t interleave : {1, 16}) {
    torch::Tensor first;  // the all-to-all's result, which the all-gather must equal bit for bit
    for (cp::DcpExchange exchange : {cp::DcpExchange::AllToAll, cp::DcpExchange::AllGather}) {
      std::vector<torch::Tensor> outs(world);
      std::vector<int64_t> sent(world);
      cp::run_local_world(world, [&](cp::Comm& comm) {
        const int r = comm.rank();
        // This rank's shard: of each sequence, the tokens dcp_owner gives it, in position order.
        cp::PagedKvCache cache(batch * ((lengths[1] + tokens) / page + 1), page, heads_kv, dim, dim,
                               torch::TensorOptions());
        for (int64_t b = 0; b < batch; ++b) {
          cache.add_sequence(ids[b]);
          for (int64_t p = 0; p < lengths[b]; ++p)
            if (cp::dcp_owner(p, world, interleave) == r)
              cache.append(ids[b], ks[b].narrow(0, p, 1), vs[b].narrow(0, p, 1));
        }
        const cp::DcpResult result = cp::dcp_decode_step(comm, q.narrow(2, r * own, own), k_step, v_step, cache, ids,
                                                         lengths, interleave, exchange);
        outs[r] = result.out;
        sent[r] = result.bytes_sent;
      });
      const torch::Tensor out = torch::cat(outs, 2);  // every rank's heads: [B, T, Hq, D]
      const double error = (out.to(torch::kDouble) - want).abs().max().item<double>();
      const bool same_bits = exchange == cp::DcpExchange::AllToAll || torch::equal(out, first);
      if (exchange == cp::DcpExchange::AllToAll) first = out;
      std::printf("  %10lld %-10s %10lld %10lld %9.1e  %s%s\n", (long long)interleave, cp::to_string(exchange).c_str(),
                  (long long)*std::max_element(sent.begin(), sent.end()),
                  (long long)cp::dcp_bytes(exchange, world, batch, tokens, heads_q, dim, dim, 4), error,
                  error < 1e-4 ? "ok" : "WRONG", same_bits ? "" : ", bits differ from all-to-all");
    }
  }
  std::printf("bytes_sent: the busiest rank's. max_err: largest |out − float64 causal attention over the whole "
              "sequence|.\n\n");
}

/// d. One decode step read through the block tables against memcpy of the same bytes, one thread.
void speed_table(int repeats) {
  const int64_t batch = 8, length = 4096, heads_q = 32, heads_kv = 8, dim = 128, page = 16;
  cp::PagedKvCache cache(batch * length / page, page, heads_kv, dim, dim, torch::TensorOptions());
  std::vector<int64_t> ids;
  for (int64_t b = 0; b < batch; ++b) {
    cache.add_sequence(b);
    ids.push_back(b);
  }
  // One page of each sequence in turn, as sequences that grow together fill a pool: consecutive
  // pages of a sequence lie `batch` pages apart.
  torch::manual_seed(19);
  for (int64_t at = 0; at < length; at += page)
    for (int64_t b = 0; b < batch; ++b)
      cache.append(b, torch::randn({page, heads_kv, dim}), torch::randn({page, heads_kv, dim}));
  const cp::PagedBatch step = cp::make_batch(cache, ids, std::vector<int64_t>(batch, 1));
  const torch::Tensor q = torch::randn({batch, heads_q, dim});
  const int64_t bytes = batch * length * heads_kv * 2 * dim * 4;
  cp::paged_attention(q, cache, step);  // warm-up
  std::vector<double> decode, copy;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    cp::paged_attention(q, cache, step);
    decode.push_back(seconds_since(start));
  }
  std::vector<char> from(bytes, 1), to(bytes, 0);
  std::memcpy(to.data(), from.data(), bytes);  // warm-up: every page of both buffers touched
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(to.data(), from.data(), bytes);
    copy.push_back(seconds_since(start));
  }
  volatile char sink = to[bytes / 2];  // the copies are used: the compiler keeps them
  (void)sink;
  std::printf("Paged decode (task 2) on this CPU, one thread: B %lld sequences of %lld tokens in pages of %lld, "
              "interleaved in the pool, Hq %lld, Hkv %lld, D %lld, float32: %lld MiB of keys and values a step\n",
              (long long)batch, (long long)length, (long long)page, (long long)heads_q, (long long)heads_kv,
              (long long)dim, (long long)(bytes >> 20));
  std::printf("# %-13s %9s %9s\n", "what", "ms", "GB/s");
  const double decode_s = median(decode), copy_s = median(copy);
  std::printf("  %-13s %9.2f %9.2f\n", "paged decode", 1e3 * decode_s, bytes / decode_s / 1e9);
  std::printf("  %-13s %9.2f %9.2f\n", "memcpy", 1e3 * copy_s, bytes / copy_s / 1e9);
  std::printf("Medians of %d runs after a warm-up; GB/s: the cache's bytes a second (memcpy also writes them).\n"
              "Paged decode reads its cache at %.2f× memcpy's speed on this machine.\n",
              repeats, copy_s / decode_s);
}

}  // namespace

int main(int argc, char** argv) {
  return cp::run_main([&] {
    const cp::CommandLine cli(argc, argv, "Serving at scale: the paged cache, DCP, MLA and the cache per GPU.",
                              {{"--world", "4", "ranks N of the DCP step (simulated: threads); divides Hq = 8"},
                               {"--cache-gib", "40", "GiB of KV cache per GPU assumed in the first table"},
                               {"--repeats", "10", "timed runs of the decode step and of memcpy"},
                               {"--out", "", "folder for the chart (none: no chart)"}});
    if (cli.help_requested()) return 0;
    torch::set_num_threads(1);
    const int world = cli.get_int("--world"), budget = cli.get_int("--cache-gib"), repeats = cli.get_int("--repeats");
    CP_CHECK(world >= 1 && 8 % world == 0, "--world ", world, " must be 1, 2, 4 or 8 (it splits Hq = 8 heads)");
    CP_CHECK(budget >= 1 && repeats >= 1, "--cache-gib ", budget, " and --repeats ", repeats, " must be at least 1");
    cache_table(budget, cli.get("--out"));
    bytes_table();
    dcp_table(world);
    speed_table(repeats);
    return 0;
  }, [](const cp::NotImplemented& e) {
    std::printf("\nThis demo runs your lesson 19 code, which is not written yet:\n  %s\n", e.what());
  });
}
