// What the `mpi` and `nccl` backends share: MPI_CHECK, the MPI lifetime, a collective guard.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "common/error.h"

/// Throws cp::Error (with rank, file, line) when an MPI call fails.
#define MPI_CHECK(call)                                                                \
  do {                                                                                 \
    const int cp_mpi_status = (call);                                                  \
    if (cp_mpi_status != MPI_SUCCESS) {                                                \
      char cp_mpi_text[MPI_MAX_ERROR_STRING];                                          \
      int cp_mpi_length = 0;                                                           \
      MPI_Error_string(cp_mpi_status, cp_mpi_text, &cp_mpi_length);                    \
      CP_FAIL("MPI error in ", #call, ": ", std::string(cp_mpi_text, cp_mpi_length)); \
    }                                                                                  \
  } while (0)

namespace cp::detail {

/// MPI is initialised once per process and finalised when the last communicator using it is
/// gone; every Comm over MPI holds this session.
class MpiSession {
 public:
  /// The process's session, initialising MPI if nothing has yet.
  static std::shared_ptr<MpiSession> get();
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

 private:
  MpiSession();
  bool owns_mpi_ = false;  // false when someone else (a test main, a user) initialised MPI
};

/// A duplicate of MPI_COMM_WORLD whose errors are returned (and thrown by MPI_CHECK) instead
/// of aborting inside MPI.
MPI_Comm duplicate_world();

/// Makes this process's GPU the current device and returns its index: the process's rank among
/// the processes of `comm` on its node (MPI_COMM_TYPE_SHARED, in the order of their ranks in
/// comm), modulo the GPUs it sees. Without it every process of an mpirun world would work on
/// cuda:0; with it each has its own GPU while the node has as many as it runs processes. The mpi
/// and nccl worlds call it; collective over comm. A cp::Error when no GPU is visible.
int use_node_gpu(MPI_Comm comm);

}  // namespace cp::detail
