// Built instead of the mpi and nccl backends when CMake found no MPI.
#include "common/error.h"
#include "common/world.h"

namespace cp {

std::shared_ptr<Comm> mpi_world() {
  CP_FAIL("this build has no MPI (CMake did not find it); install Open MPI (make setup) and rebuild, "
          "or use the local backend");
}

std::shared_ptr<Comm> nccl_world() {
  CP_FAIL("the nccl backend is bootstrapped over MPI, and this build has no MPI; install Open MPI "
          "(make setup) and rebuild, or use the local backend");
}

}  // namespace cp
