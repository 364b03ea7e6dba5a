// Built instead of the nccl backend when CMake found MPI but no CUDA or no NCCL.
#include "common/error.h"
#include "common/world.h"

namespace cp {

std::shared_ptr<Comm> nccl_world() {
  CP_FAIL("this build has no NCCL backend (it needs nvcc and NCCL at configure time: set NCCL_ROOT "
          "if NCCL is not next to the CUDA toolkit); use --backend local or --backend mpi");
}

}  // namespace cp
