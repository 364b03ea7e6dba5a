// Internal to the harness: the launched world of a test program run under mpirun.
#pragma once

#include "common/comm.h"

namespace cp::testing::detail {

/// The mpi world when the program runs under mpirun, else nullptr.
Comm* launched_world();

/// Ends every process of the launched world (MPI_Abort): what a fatal failure on one rank
/// does instead of leaving the others waiting for it.
[[noreturn]] void abort_launched_world();

}  // namespace cp::testing::detail
