#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "common/error.h"
#include "common/world.h"

#if CP_WITH_MPI
#include <mpi.h>

#include "common/mpi_session.h"
#endif

namespace cp {

bool launched_by_mpirun() {
  // Open MPI sets OMPI_COMM_WORLD_SIZE; PMI/PMIx launchers (srun, MPICH) set PMI_SIZE/PMIX_RANK.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(name)) return true;
  return false;
}

void run_world(Backend backend, int local_size, const std::function<void(Comm&)>& fn) {
  switch (backend) {
    case Backend::Local:
      run_local_world(local_size, fn);
      return;
    case Backend::Mpi:
      fn(*mpi_world());
      return;
    case Backend::Nccl:
      fn(*nccl_world());
      return;
  }
}

namespace {

/// True while MPI is initialised and not finalised in this process: MPI_Abort can be called.
bool mpi_is_active() {
#if CP_WITH_MPI
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
#else
  return false;
#endif
}

/// This process's rank in the launched world (from MPI, else from the launcher's environment).
std::string launched_rank() {
#if CP_WITH_MPI
  if (mpi_is_active()) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    return std::to_string(rank);
  }
#endif
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* value = std::getenv(name)) return value;
  return "?";
}

/// Under mpirun: ends every process of the world with `status` when MPI is running; returns
/// `status` otherwise (MPI not started yet, or finalised: nobody waits for this process in
/// MPI, and mpirun ends the job when a process exits with a non-zero status).
int end_launched_world(int status) {
  std::fflush(stdout);
  std::fflush(stderr);
#if CP_WITH_MPI
  if (mpi_is_active()) {
    std::fprintf(stderr, "rank %s: aborting the world (MPI_Abort) so that the other ranks do not wait for it forever\n",
                 launched_rank().c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, status);
  }
#endif
  return status;
}

}  // namespace

int run_main(const std::function<int()>& body, const std::function<void(const NotImplemented&)>& on_not_implemented) {
  const bool launched = launched_by_mpirun();
  const std::string who = launched ? "rank " + launched_rank() + ": " : "";
#if CP_WITH_MPI
  // Under mpirun MPI lives until the error below is handled: when an exception unwinds the
  // body's Comm, the last Comm would otherwise call MPI_Finalize, which waits for every process
  // (those waiting for this one) — a hang before MPI_Abort is reached.
  std::shared_ptr<detail::MpiSession> session;
#endif
  try {
#if CP_WITH_MPI
    if (launched) session = detail::MpiSession::get();
#endif
    return body();
  } catch (const NotImplemented& e) {
    std::fflush(stdout);
    if (on_not_implemented) {
      on_not_implemented(e);
    } else {
      std::fprintf(stderr, "%serror: %s\n", who.c_str(), e.what());
    }
    return launched ? end_launched_world(1) : 1;
  } catch (const ErrorOnEveryRank& e) {
    // Every rank raised it at the same call: each reports it, nobody waits, no abort needed.
    // The ranks would all write at once, and mpirun (Open MPI 5's at least) relays their output
    // in the pieces it happens to read, so one rank's line could land inside another's: rank r
    // waits r · 20 ms first.
    if (launched) std::this_thread::sleep_for(std::chrono::milliseconds(20 * std::atoi(launched_rank().c_str())));
    std::fflush(stdout);
    std::fprintf(stderr, "%serror: %s\n", who.c_str(), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "%serror: %s\n", who.c_str(), e.what());
    return launched ? end_launched_world(2) : 2;
  } catch (...) {
    std::fflush(stdout);
    std::fprintf(stderr, "%serror: unknown exception\n", who.c_str());
    return launched ? end_launched_world(2) : 2;
  }
}

}  // namespace cp
