#include "common/mpi_session.h"

#include <mutex>

#if CP_WITH_CUDA
#include "common/cuda_check.h"
#endif

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

int use_node_gpu(MPI_Comm comm) {
#if CP_WITH_CUDA
  MPI_Comm node = MPI_COMM_NULL;  // the processes of comm on this node (key 0: in comm's rank order)
  MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int local_rank = 0;
  const int status = MPI_Comm_rank(node, &local_rank);
  MPI_Comm_free(&node);
  MPI_CHECK(status);
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  CP_CHECK(gpus > 0, "use_node_gpu: this process sees no GPU");
  const int device = local_rank % gpus;
  CUDA_CHECK(cudaSetDevice(device));
  return device;
#else
  (void)comm;
  CP_FAIL("use_node_gpu: this build has no CUDA");
#endif
}

}  // namespace cp::detail
