# Fault tests of the mpi backend: tests/fault_test.cpp runs one scenario per mpirun, and
# tests/fault_check.cmake checks how the job ended. One CTest entry per scenario,
# fault_<scenario>, labelled `mpi`, `fault` and `solution` (make test runs them). The watchdog's
# timeout is 3 s here (CP_MPI_TIMEOUT_S), mpirun kills a job after MPIEXEC_TIMEOUT seconds, and
# each entry has a TIMEOUT, so that a regression shows as a failure within a minute, never as a
# hung CI job.
if(NOT CP_WITH_MPI)
  return()
endif()

add_executable(fault_test ${PROJECT_SOURCE_DIR}/tests/fault_test.cpp)
target_link_libraries(fault_test PRIVATE cp_common)
course_reuse_pch(fault_test cp_common)

# course_fault_test(<entry> [SCENARIO <scenario>] NP <n> STATUS zero|nonzero REQUIRE <regex>...
#                   [FORBID <regex>...] [SECONDS <max>]): runs fault_test <scenario> (default:
# <entry>) on n ranks; every REQUIRE must match the output, no FORBID may, the exit status must
# be as given, and the job must end within SECONDS (default 30). The entry is fault_<entry>.
function(course_fault_test entry)
  cmake_parse_arguments(ARG "" "SCENARIO;NP;STATUS;SECONDS" "REQUIRE;FORBID" ${ARGN})
  if(NOT ARG_SECONDS)
    set(ARG_SECONDS 30)
  endif()
  set(scenario ${entry})
  if(ARG_SCENARIO)
    set(scenario ${ARG_SCENARIO})
  endif()
  # Lists travel through add_test as one argument each: ';' becomes $<SEMICOLON>.
  set(command ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ARG_NP} ${CP_MPIEXEC_FLAGS} $<TARGET_FILE:fault_test> ${scenario})
  foreach(var command ARG_REQUIRE ARG_FORBID)
    string(REPLACE ";" "$<SEMICOLON>" ${var} "${${var}}")
  endforeach()
  add_test(NAME fault_${entry}
    COMMAND ${CMAKE_COMMAND} "-DCOMMAND=${command}" -DSTATUS=${ARG_STATUS} "-DREQUIRE=${ARG_REQUIRE}"
            "-DFORBID=${ARG_FORBID}" -DSECONDS=${ARG_SECONDS} -P ${PROJECT_SOURCE_DIR}/tests/fault_check.cmake)
  math(EXPR ctest_limit "${ARG_SECONDS} + 30")
  # RUN_SERIAL: the scenarios time their ends in seconds; nothing else runs beside them.
  set_tests_properties(fault_${entry} PROPERTIES LABELS "runtime;solution;fault;mpi;cpu" TIMEOUT ${ctest_limit} RUN_SERIAL ON
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;CP_MPI_TIMEOUT_S=3;MPIEXEC_TIMEOUT=${ARG_SECONDS}")
endfunction()

set(abort "aborting the world \\(MPI_Abort\\)")
course_fault_test(throw_after_start NP 3 STATUS nonzero
  REQUIRE "rank 1: error: .*rank 1 gives up between start\\(\\) and wait\\(\\)" "rank 1: ${abort}"
  FORBID "AddressSanitizer" "Segmentation fault" "signal 11")
course_fault_test(throw_after_start_caught NP 3 STATUS zero
  REQUIRE "rank 0: PASS" "rank 1: PASS" "rank 2: PASS"
  FORBID "error" "AddressSanitizer")
course_fault_test(one_rank_fails NP 3 STATUS nonzero SECONDS 10
  REQUIRE "rank 2: error: .*a failure seen by rank 2 only" "rank 2: ${abort}")
course_fault_test(collective_shape NP 3 STATUS nonzero
  REQUIRE "error: .*\\[rank 0\\].*all_reduce: every rank must pass the same shape and dtype; rank 0 has \\[4\\]"
          "error: .*\\[rank 1\\].*all_reduce: every rank must pass the same shape and dtype; rank 1 has \\[5\\]"
          "error: .*\\[rank 2\\].*all_reduce: every rank must pass the same shape and dtype; rank 2 has \\[4\\]"
  FORBID "MPI_ABORT" "has not completed")
course_fault_test(ring_shape NP 3 STATUS nonzero
  REQUIRE "rank [12]: error: .*send/recv mismatch" "rank [12]: ${abort}"
  FORBID "has not completed")
course_fault_test(naive_ring NP 3 STATUS nonzero
  REQUIRE "rank [0-2]: send→[0-2] has not completed after 3 s: every rank may be waiting on another \\(a deadlock, lesson 06\\)")
course_fault_test(naive_ring4 SCENARIO naive_ring NP 4 STATUS nonzero
  REQUIRE "rank [0-3]: send→[0-3] has not completed after 3 s: every rank may be waiting on another \\(a deadlock, lesson 06\\)")
course_fault_test(busy_third NP 3 STATUS nonzero
  REQUIRE "rank [01]: send→[01] has not completed after 3 s")
