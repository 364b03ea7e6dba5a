// Worlds: where the ranks of a Comm come from.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include "common/comm.h"
#include "common/error.h"

namespace cp {

struct LocalWorldOptions {
  /// How long every live rank must have been blocked in point-to-point calls before the
  /// watchdog declares a deadlock (the condition is exact; the delay only avoids reporting a
  /// state that another thread is about to leave).
  ///
  /// Blind spot: the condition is "*every* rank that has not returned is blocked". A rank that
  /// is computing (or waiting outside cp::Comm: a lock, a collective of another library, a
  /// sleep) counts as able to make progress, so while it runs nothing is reported. When 2 of 3
  /// ranks wait on each other and the third is busy, the deadlock is reported only once the
  /// third also blocks in a Comm call or returns (then after deadlock_timeout), and never if it
  /// loops forever. A per-call timeout (the mpi backend's watchdog) has no such blind spot, but
  /// can report a slow peer as a deadlock.
  std::chrono::milliseconds deadlock_timeout{2000};
};

/// Runs fn(comm) on `world_size` ranks, each a thread of this process with a `local` Comm.
/// Returns when every rank has returned. If a rank throws, the others are released (their
/// communication calls throw cp::WorldAborted) and the first rank's exception is rethrown
/// here with its original type; a deadlock throws cp::DeadlockError naming the cycle, once
/// every live rank is blocked (see LocalWorldOptions::deadlock_timeout for what it misses).
void run_local_world(int world_size, const std::function<void(Comm&)>& fn,
                     const LocalWorldOptions& options = {});

/// True when this process was started by mpirun (Open MPI or another PMI launcher).
bool launched_by_mpirun();

/// The `mpi` Comm over all launched processes; initialises MPI on first use and finalises it
/// when the last Comm is destroyed. A cp::Error when the build has no MPI. Where CUDA tensors can
/// be used, each process's current device becomes its own GPU, as in nccl_world (its rank among
/// the processes of its node, modulo the node's GPUs; processes share GPUs when there are fewer).
///
/// Watchdog: a blocking point-to-point call (send, recv, Request::wait) that has not completed
/// after CP_MPI_TIMEOUT_S seconds (environment variable; default 20; 0 disables it) prints
/// "rank R: send→P has not completed after T s: ... Aborting the world." and ends every
/// process (MPI_Abort, exit status 2). Unlike the local backend's watchdog, which needs every
/// live rank blocked, this timeout is per call and per process: it fires even while another
/// rank is busy computing, so it also catches 2 ranks deadlocked beside a busy third, and it
/// needs no global view. The price: a peer that computes for longer than the timeout between
/// two exchanges is reported as a deadlock; raise CP_MPI_TIMEOUT_S for such runs. Collectives
/// (all_gather, reduce_scatter, all_reduce, broadcast, barrier) are MPI's blocking calls and
/// have no watchdog.
std::shared_ptr<Comm> mpi_world();

/// The `nccl` Comm: one GPU per process (its rank among the processes of its node), made the
/// current device, bootstrapped over MPI. Refuses two ranks on one GPU (NCCL cannot do it) with a
/// message pointing to the `local` and `mpi` backends.
std::shared_ptr<Comm> nccl_world();

/// Runs fn on the world a program was asked for: `local` with `local_size` threads, or the
/// launched `mpi`/`nccl` world (local_size is then ignored). Used by demos and benches.
void run_world(Backend backend, int local_size, const std::function<void(Comm&)>& fn);

/// The body of a demo's or bench's main(): returns what `body` returns, or, when an exception
/// escapes it, prints it and ends the program with status 2:
///  - run on its own: prints "error: <what>" and returns 2;
///  - under mpirun (one process per rank): prints "rank R: error: <what>" and ends every
///    process of the world with MPI_Abort(MPI_COMM_WORLD, 2). Returning instead would leave the
///    other ranks waiting forever for this one (in a send, a collective, or MPI_Finalize, which
///    waits for every process). Exception: a cp::ErrorOnEveryRank, which every rank has seen,
///    returns 2 on every rank without aborting (mpirun then reports the exit status).
/// `on_not_implemented`, if given, prints what a learner should do about a cp::NotImplemented
/// (a lesson's stub not written yet) instead of the error line; the status is then 1.
///   int main(int argc, char** argv) { return cp::run_main([&] { ...; return 0; }); }
int run_main(const std::function<int()>& body,
             const std::function<void(const NotImplemented&)>& on_not_implemented = nullptr);

}  // namespace cp
