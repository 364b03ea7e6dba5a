// Worlds: where the ranks of a Comm come from.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include "common/comm.h"

namespace cp {

struct LocalWorldOptions {
  /// How long every live rank must have been blocked in point-to-point calls before the
  /// watchdog declares a deadlock (the condition is exact; the delay only avoids reporting a
  /// state that another thread is about to leave).
  std::chrono::milliseconds deadlock_timeout{2000};
};

/// Runs fn(comm) on `world_size` ranks, each a thread of this process with a `local` Comm.
/// Returns when every rank has returned. If a rank throws, the others are released (their
/// communication calls throw cp::WorldAborted) and the first rank's exception is rethrown
/// here with its original type; a deadlock throws cp::DeadlockError naming the cycle.
void run_local_world(int world_size, const std::function<void(Comm&)>& fn,
                     const LocalWorldOptions& options = {});

/// True when this process was started by mpirun (Open MPI or another PMI launcher).
bool launched_by_mpirun();

/// The `mpi` Comm over all launched processes; initialises MPI on first use and finalises it
/// when the last Comm is destroyed. A cp::Error when the build has no MPI.
std::shared_ptr<Comm> mpi_world();

/// The `nccl` Comm: one GPU per process, bootstrapped over MPI. Refuses two ranks on one GPU
/// (NCCL cannot do it) with a message pointing to the `local` and `mpi` backends.
std::shared_ptr<Comm> nccl_world();

/// Runs fn on the world a program was asked for: `local` with `local_size` threads, or the
/// launched `mpi`/`nccl` world (local_size is then ignored). Used by demos and benches.
void run_world(Backend backend, int local_size, const std::function<void(Comm&)>& fn);

}  // namespace cp
