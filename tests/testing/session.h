// Internal to the harness: the launched world of a test program run under mpirun.
#pragma once

#include <string>

#include "common/comm.h"

namespace cp::testing::detail {

/// The mpi world when the program runs under mpirun, else nullptr.
Comm* launched_world();

/// Ends every process of the launched world (MPI_Abort): what a fatal failure on one rank
/// does instead of leaving the others waiting for it. The running test is first written to the
/// results file as failed, with `why` (on rank 0, which keeps that file), so that tools reading
/// it (make status, make mutants) name the test that ended the world.
[[noreturn]] void abort_launched_world(const std::string& why);

}  // namespace cp::testing::detail
