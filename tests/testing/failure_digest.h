// Internal to the harness: a failing test reads in one screen.
#pragma once

#include <gtest/gtest.h>

#include <memory>

namespace cp::testing::detail {

/// True when CP_VERBOSE=1: every failure is printed in full, on every rank.
bool verbose();

/// Wraps gtest's printer (`printer`, owned; null on the ranks > 0 of an mpirun world, which print
/// only failures, prefixed with their rank). Unless verbose(), a failing test prints its first
/// failure in full, then one line for each of the next few (where it failed, the first line of
/// its message, its world and configuration) and a count of the rest. Under mpirun only the
/// lowest failing rank prints its failures (see note_failing_ranks); rank 0 names the others.
std::unique_ptr<::testing::TestEventListener> failure_digest(::testing::TestEventListener* printer, int rank);

/// Under mpirun: the lowest rank that failed in the running test, learnt by every rank from
/// for_each_world's exchange of outcomes (-1: none failed, or the test never exchanged them).
void note_failing_rank(int rank);
int first_failing_rank();

}  // namespace cp::testing::detail
