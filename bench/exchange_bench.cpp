// Lesson 06 benchmark: latency and bandwidth of one ring step (send to r+1, receive from r−1)
// for each deadlock-free strategy and message sizes from 4 KiB to 64 MiB.
//
//   build/bin/exchange_bench                          local backend, 4 ranks (threads)
//   mpirun -np 4 build/bin/exchange_bench --backend mpi
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "common/cli.h"
#include "common/error.h"
#include "common/world.h"
#include "odd_even_exchange.h"

namespace {

/// The median over repeats of the slowest rank's time of `step` (a ring step is as slow as its
/// slowest rank), in microseconds.
double median_us(cp::Comm& comm, int repeats, const std::function<void()>& step) {
  std::vector<double> times;
  for (int i = 0; i <= repeats; ++i) {
    comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    step();
    torch::Tensor us =
        torch::tensor({std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count()});
    comm.all_reduce(us, cp::ReduceOp::Max);
    if (i > 0) times.push_back(us.item<double>());  // the first run warms up
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void bench(cp::Comm& comm, const std::string& backend) {
  if (comm.rank() == 0) {
    std::printf("# ring exchange, backend %s, %d ranks: median over repeats of the slowest rank's time\n",
                backend.c_str(), comm.size());
    std::printf("# memcpy: every rank copies its own send buffer into its receive buffer at the same time, no\n"
                "# exchange: the ceiling. of_memcpy = memcpy's time / the strategy's (1: as fast as a copy)\n");
    std::printf("# %-9s %10s %12s %12s %10s\n", "strategy", "bytes", "latency_us", "GB_per_s", "of_memcpy");
  }
  const std::vector<int64_t> sizes = {int64_t(4) << 10, int64_t(64) << 10, int64_t(1) << 20, int64_t(16) << 20,
                                      int64_t(64) << 20};
  std::vector<double> memcpy_us;
  for (int64_t bytes : sizes) {
    const torch::Tensor send = torch::ones({bytes / 4});
    torch::Tensor recv = torch::empty_like(send);
    const int repeats = bytes <= (int64_t(1) << 20) ? 50 : 8;
    memcpy_us.push_back(median_us(comm, repeats, [&] { std::memcpy(recv.data_ptr(), send.data_ptr(), bytes); }));
    if (comm.rank() == 0)
      std::printf("  %-9s %10lld %12.1f %12.2f %10.2f\n", "memcpy", (long long)bytes, memcpy_us.back(),
                  bytes / (memcpy_us.back() * 1e3), 1.0);
  }
  for (cp::ExchangeMethod how : {cp::ExchangeMethod::OddEven, cp::ExchangeMethod::SendRecv, cp::ExchangeMethod::Batched}) {
    for (size_t s = 0; s < sizes.size(); ++s) {
      const int64_t bytes = sizes[s];
      const torch::Tensor send = torch::ones({bytes / 4});
      torch::Tensor recv = torch::empty_like(send);
      const int repeats = bytes <= (int64_t(1) << 20) ? 50 : 8;
      const double median = median_us(comm, repeats, [&] { cp::ring_exchange(comm, send, recv, how); });
      if (comm.rank() == 0)
        std::printf("  %-9s %10lld %12.1f %12.2f %10.2f\n", cp::to_string(how).c_str(), (long long)bytes, median,
                    bytes / (median * 1e3), memcpy_us[s] / median);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return cp::run_main([&] {
    const cp::CommandLine cli(argc, argv, "Latency and bandwidth of the ring exchange strategies (lesson 06).",
                              {{"--backend", "local", "local (threads) or mpi (under mpirun)"},
                               {"--world", "4", "ranks of the local backend"}});
    if (cli.help_requested()) return 0;
    torch::set_num_threads(1);
    const cp::Backend backend = cp::parse_backend(cli.get("--backend"));
    CP_CHECK(backend != cp::Backend::Local || cli.get_int("--world") >= 2, "--world: a ring exchange needs at least 2 "
             "ranks, got ", cli.get_int("--world"));
    cp::run_world(backend, cli.get_int("--world"), [&](cp::Comm& comm) {
      if (comm.size() < 2)
        throw cp::ErrorOnEveryRank(cp::detail::concat("a ring exchange needs at least 2 ranks, got ", comm.size()),
                                   __FILE__, __LINE__);
      bench(comm, cli.get("--backend"));
    });
    return 0;
  });
}
