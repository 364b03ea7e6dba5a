#include "common/mpi_session.h"

#include <mutex>

namespace cp::detail {

std::shared_ptr<MpiSession> MpiSession::get() {
  // MPI itself is process-wide state; this only remembers the live session, if any.
  static std::mutex mutex;
  static std::weak_ptr<MpiSession> current;
  std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<MpiSession> session = current.lock();
  if (!session) {
    session.reset(new MpiSession());
    current = session;
  }
  return session;
}

MpiSession::MpiSession() {
  int initialized = 0;
  MPI_CHECK(MPI_Initialized(&initialized));
  if (initialized) return;
  int provided = 0;
  MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided));
  owns_mpi_ = true;
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_mpi_ && !finalized) MPI_Finalize();
}

MPI_Comm duplicate_world() {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  return comm;
}

}  // namespace cp::detail
