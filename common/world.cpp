#include <cstdlib>

#include "common/error.h"
#include "common/world.h"

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

}  // namespace cp
