// Fault scenarios of the mpi backend, one per run: mpirun -np 3 fault_test <scenario>.
//
// Each scenario makes one rank (or every rank) misbehave; tests/fault_tests.cmake runs it under
// mpirun and checks how the job ends: its exit status, its output, and that it ended in time
// (a hang is the failure these tests exist to catch). The watchdog's timeout is set low there
// (CP_MPI_TIMEOUT_S=3). Scenarios:
//   throw_after_start         rank 1 throws between start() and wait() of a ring exchange: the
//                             world is aborted with its message, no crash in the unwinding
//   throw_after_start_caught  every rank abandons a posted receive (throws and catches), then
//                             exchanges again: the abandoned receive takes no message and
//                             writes no memory (its batch cancelled it)
//   one_rank_fails            rank 2 fails alone while the others wait for it in a collective
//                             and a receive: the world is aborted within seconds, naming rank 2
//   collective_shape          rank 1 passes all_reduce a different shape: the same error on
//                             every rank, every rank exits with status 2, no hang
//   ring_shape                rank 1 uses a different shape in a ring exchange: the ranks that
//                             see the mismatch abort the world with it
//   naive_ring                every rank sends (blocking) before it receives: a deadlock,
//                             reported by the watchdog and the world aborted
//   busy_third                ranks 0 and 1 deadlock while rank 2 computes: the per-call
//                             watchdog reports it anyway (the local backend's cannot)
#include <torch/types.h>
#include <torch/utils.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>

#include "common/error.h"
#include "common/world.h"

namespace {

using cp::Comm;
using cp::P2POp;

int next_of(const Comm& comm) { return (comm.rank() + 1) % comm.size(); }
int prev_of(const Comm& comm) { return (comm.rank() + comm.size() - 1) % comm.size(); }

void throw_after_start(Comm& comm) {
  const int64_t n = 32768;  // 128 KiB of float32: a rendezvous message, large enough to be sent by rendezvous
  const torch::Tensor out = torch::full({n}, static_cast<float>(comm.rank()));
  torch::Tensor in = torch::empty({n});
  cp::Request request = comm.start({P2POp::send(out, next_of(comm)), P2POp::recv(in, prev_of(comm))});
  if (comm.rank() == 1) CP_FAIL("fault scenario: rank 1 gives up between start() and wait()");
  request.wait();
  comm.barrier();  // waits for rank 1, which never comes
}

void throw_after_start_caught(Comm& comm) {
  const int64_t n = 16384;  // 64 KiB: freed to the heap, so that a new tensor of that size reuses it
  try {
    torch::Tensor abandoned = torch::empty({n});
    const cp::Request request = comm.start({P2POp::recv(abandoned, prev_of(comm))});
    CP_FAIL("fault scenario: gave up before wait()");
  } catch (const cp::Error&) {
    // The batch and its tensor are gone. Without cancellation, MPI would still hold the receive
    // and write the next message from prev into the freed memory.
  }
  const torch::Tensor canary = torch::full({n}, -1.0f);  // likely where `abandoned` was
  comm.barrier();  // nobody sends before every rank has abandoned its receive
  torch::Tensor in = torch::empty({n});
  comm.sendrecv(torch::full({n}, static_cast<float>(comm.rank())), next_of(comm), in, prev_of(comm));
  CP_CHECK(in.eq(prev_of(comm)).all().item<bool>(), "the message from rank ", prev_of(comm),
           " did not arrive in the new receive");
  CP_CHECK(canary.eq(-1.0f).all().item<bool>(), "memory of the abandoned receive was written after it was freed");
  comm.barrier();
  std::printf("rank %d: PASS (the abandoned receive was cancelled)\n", comm.rank());
}

void one_rank_fails(Comm& comm) {
  if (comm.rank() == 2) CP_FAIL("fault scenario: a failure seen by rank 2 only");
  if (comm.rank() == 0) {
    torch::Tensor t = torch::empty({4});
    comm.recv(t, 2);  // waits for rank 2
  }
  torch::Tensor t = torch::ones({4});
  comm.all_reduce(t, cp::ReduceOp::Sum);  // waits for rank 2
}

void collective_shape(Comm& comm) {
  torch::Tensor t = torch::ones({comm.rank() == 1 ? 5 : 4});
  comm.all_reduce(t, cp::ReduceOp::Sum);
}

void ring_shape(Comm& comm) {
  const int64_t n = comm.rank() == 1 ? 5 : 4;
  torch::Tensor in = torch::empty({n});
  comm.sendrecv(torch::ones({n}), next_of(comm), in, prev_of(comm));
  comm.barrier();
}

void naive_ring(Comm& comm) {
  const torch::Tensor out = torch::ones({1 << 18});  // 1 MiB
  torch::Tensor in = torch::empty({1 << 18});
  comm.send(out, next_of(comm));  // every rank sends first: nobody reaches its receive
  comm.recv(in, prev_of(comm));
}

void busy_third(Comm& comm) {
  if (comm.rank() >= 2) {  // computes (here: sleeps) for longer than the test may run
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return;
  }
  const torch::Tensor out = torch::ones({1024});
  torch::Tensor in = torch::empty({1024});
  comm.send(out, 1 - comm.rank());  // ranks 0 and 1 both send first
  comm.recv(in, 1 - comm.rank());
}

const std::map<std::string, void (*)(Comm&)>& scenarios() {
  static const std::map<std::string, void (*)(Comm&)> all = {
      {"throw_after_start", throw_after_start}, {"throw_after_start_caught", throw_after_start_caught},
      {"one_rank_fails", one_rank_fails},       {"collective_shape", collective_shape},
      {"ring_shape", ring_shape},               {"naive_ring", naive_ring},
      {"busy_third", busy_third}};
  return all;
}

int run_scenario(int argc, char** argv) {
  std::string names;
  for (const auto& [name, fn] : scenarios()) names += " " + name;
  CP_CHECK(argc == 2 && scenarios().count(argv[1]), "usage: mpirun -np 3 fault_test <scenario>; scenarios:", names);
  CP_CHECK(cp::launched_by_mpirun(), "fault_test runs under mpirun (the scenarios test the mpi backend)");
  torch::set_num_threads(1);
  cp::run_world(cp::Backend::Mpi, 0, scenarios().at(argv[1]));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cp::run_main([&] { return run_scenario(argc, argv); });
}
