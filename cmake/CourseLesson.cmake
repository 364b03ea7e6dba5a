# course_add_lesson() and course_add_test(): how a lesson becomes libraries, test programs and
# CTest entries (docs/architecture.md explains the whole build).

set(CP_TEST_TIMEOUT 600 CACHE STRING "CTest TIMEOUT of each test entry, in seconds")
file(MAKE_DIRECTORY ${PROJECT_BINARY_DIR}/kernel-results)

# Compiles the C++ sources of `target` with a precompiled header made once by `donor`: cp_common
# (LibTorch) for libraries and programs, cp_testing (LibTorch and GoogleTest) for test programs.
# Every target shares the donor's compile flags, so GCC accepts its header.
function(course_reuse_pch target donor)
  target_precompile_headers(${target} REUSE_FROM ${donor})
endfunction()

# Registers the test program `exe` in CTest as <name>_local (in-process, world sizes
# 1, 2, 3, 4, 8 on the local backend) and <name>_mpi<N> for each N in MPI_RANKS (under mpirun,
# on the mpi backend). With a CUDA LibTorch the CUDA-tensor suites (names ending in "Cuda") get
# entries of their own labelled `cuda`, <name>_cuda_local and <name>_cuda_mpi<N>; without one
# they run inside the CPU entry and skip with the reason; SOURCES, the program's test sources, say
# whether it has such suites (no entry that would select no test). (The nccl backend needs a GPU per rank:
# tools/gpu-check runs it.) KERNELS: the program has kernel suites (names ending in "Kernels", launch_* on
# device buffers); with CUDA they get the entry <name>_kernels_<label>, labelled cuda (nvcc) or
# cuda-cpu (CUDA on the CPU); with CUDA on the CPU the solution's entry fails if a kernel test
# skipped or none ran (the device always exists there): a kernel that did not run is unverified.
function(course_register_tests exe name)
  cmake_parse_arguments(ARG "KERNELS" "" "LABELS;MPI_RANKS;SOURCES" ${ARGN})
  set(env "GTEST_COLOR=no;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
  # The program's suites, read once from its sources: `CP_TEST(Suite, …)` lines.
  set(suites "")
  foreach(source IN LISTS ARG_SOURCES)
    file(STRINGS ${source} lines REGEX "^[A-Z_]+\\([A-Za-z0-9]*,")
    list(APPEND suites ${lines})
    # A suite added to the file later must get its entries: without this, the build compiles it
    # and no entry runs it until the next configure.
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${source})
  endforeach()
  set(cuda_suites ${suites})
  list(FILTER cuda_suites INCLUDE REGEX "^[A-Z_]+\\([A-Za-z0-9]*Cuda,")
  set(kernel_suites ${suites})
  list(FILTER kernel_suites INCLUDE REGEX "^[A-Z_]+\\([A-Za-z0-9]*Kernels,")
  # CUDA entries only for a program that has a CUDA-tensor suite: an entry whose filter selects no
  # test would run nothing and pass.
  set(cuda_entries OFF)
  set(own_entries "")
  if(cuda_suites AND CP_TORCH_CUDA)
    set(cuda_entries ON)
    list(APPEND own_entries "*Cuda.*")
  endif()
  set(kernel_entry OFF)
  if(ARG_KERNELS AND CP_WITH_CUDA)
    set(kernel_entry ON)
    list(APPEND own_entries "*Kernels.*")
  endif()
  set(cpu_filter "")
  if(own_entries)
    list(JOIN own_entries ":" excluded)
    set(cpu_filter "--gtest_filter=-${excluded}")
  endif()
  # The CPU entries, unless every suite has an entry of its own (a program of kernel suites only):
  # an entry that selects no test would pass having run nothing.
  list(LENGTH suites n_suites)
  set(n_own 0)
  if(cuda_entries)
    list(LENGTH cuda_suites n)
    math(EXPR n_own "${n_own} + ${n}")
  endif()
  if(kernel_entry)
    list(LENGTH kernel_suites n)
    math(EXPR n_own "${n_own} + ${n}")
  endif()
  set(cpu_suites OFF)
  if(n_suites GREATER n_own)
    set(cpu_suites ON)
  endif()
  if(cpu_suites)
    add_test(NAME ${name}_local COMMAND ${exe} ${cpu_filter})
    set_tests_properties(${name}_local PROPERTIES LABELS "${ARG_LABELS};local;cpu" TIMEOUT ${CP_TEST_TIMEOUT} ENVIRONMENT "${env}")
  endif()
  if(cuda_entries)
    add_test(NAME ${name}_cuda_local COMMAND ${exe} "--gtest_filter=*Cuda.*")
    set_tests_properties(${name}_cuda_local PROPERTIES LABELS "${ARG_LABELS};local;cuda" TIMEOUT ${CP_TEST_TIMEOUT} ENVIRONMENT "${env}")
  endif()
  if(kernel_entry)
    set(entry ${name}_kernels_${CP_CUDA_TEST_LABEL})
    add_test(NAME ${entry} COMMAND ${exe} "--gtest_filter=*Kernels.*")
    set_tests_properties(${entry} PROPERTIES LABELS "${ARG_LABELS};local;${CP_CUDA_TEST_LABEL}" TIMEOUT ${CP_TEST_TIMEOUT})
    if("solution" IN_LIST ARG_LABELS)
      # Results for tools/kernel-report (make test prints the counts).
      set_tests_properties(${entry} PROPERTIES ENVIRONMENT
                           "${env};CP_RESULTS_JSON=${PROJECT_BINARY_DIR}/kernel-results/${name}.jsonl")
      if(CP_CUDA_BACKEND STREQUAL "cuda-cpu")  # the CPU device always exists: a skip is a defect
        set_tests_properties(${entry} PROPERTIES FAIL_REGULAR_EXPRESSION "\\[  SKIPPED \\]|Summary: 0 passed")
      endif()
    else()
      set_tests_properties(${entry} PROPERTIES ENVIRONMENT "${env}")
    endif()
  endif()
  if(CP_WITH_MPI AND cpu_suites)
    foreach(np IN LISTS ARG_MPI_RANKS)
      add_test(NAME ${name}_mpi${np}
        COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${CP_MPIEXEC_FLAGS} $<TARGET_FILE:${exe}> ${cpu_filter})
      # One mpirun job at a time (ctest -j runs the rest beside it): the ranks of two jobs would
      # share the cores with each other's busy-polling as well.
      set_tests_properties(${name}_mpi${np} PROPERTIES LABELS "${ARG_LABELS};mpi;cpu" TIMEOUT ${CP_TEST_TIMEOUT} ENVIRONMENT "${env}"
                           RESOURCE_LOCK mpirun)
      if(cuda_entries)  # the CUDA-tensor suites on the mpi backend (staged through host memory)
        add_test(NAME ${name}_cuda_mpi${np}
          COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${CP_MPIEXEC_FLAGS} $<TARGET_FILE:${exe}> "--gtest_filter=*Cuda.*")
        set_tests_properties(${name}_cuda_mpi${np} PROPERTIES LABELS "${ARG_LABELS};mpi;cuda" TIMEOUT ${CP_TEST_TIMEOUT}
                             ENVIRONMENT "${env}" RESOURCE_LOCK mpirun)
      endif()
    endforeach()
  endif()
endfunction()

# A test program outside the lessons (the runtime's own tests; kernels/ tested by probe kernels,
# CUDA_SOURCES, whose suites end in "Kernels" and run as lessons' kernel suites do).
#   course_add_test(NAME runtime SOURCES tests/runtime_test.cpp MPI_RANKS 3 4)
function(course_add_test)
  cmake_parse_arguments(ARG "" "NAME" "SOURCES;CUDA_SOURCES;MPI_RANKS" ${ARGN})
  add_executable(${ARG_NAME}_test ${ARG_SOURCES})
  target_link_libraries(${ARG_NAME}_test PRIVATE cp_testing)
  course_reuse_pch(${ARG_NAME}_test cp_testing)
  set(kernels "")
  if(ARG_CUDA_SOURCES)
    set(kernels KERNELS)
    if(CP_WITH_CUDA)
      add_library(${ARG_NAME}_test_kernels OBJECT ${ARG_CUDA_SOURCES})
      target_include_directories(${ARG_NAME}_test_kernels PRIVATE ${PROJECT_SOURCE_DIR})
      target_link_libraries(${ARG_NAME}_test_kernels PRIVATE cp_cuda_runtime)
      target_compile_definitions(${ARG_NAME}_test_kernels PRIVATE CP_WITH_CUDA=1)
      target_sources(${ARG_NAME}_test PRIVATE $<TARGET_OBJECTS:${ARG_NAME}_test_kernels>)
      list(TRANSFORM ARG_CUDA_SOURCES PREPEND ${PROJECT_SOURCE_DIR}/ OUTPUT_VARIABLE cuda_paths)
      course_nvcc_check("${cuda_paths}" "" tests)
    endif()
  endif()
  course_register_tests(${ARG_NAME}_test ${ARG_NAME} ${kernels} LABELS "${ARG_NAME};solution" MPI_RANKS ${ARG_MPI_RANKS}
                        SOURCES ${ARG_SOURCES})
endfunction()

# nvcc and clang reject different mistakes. When the kernels are built for CUDA on the CPU and
# nvcc is installed too, nvcc also compiles each .cu file for every architecture of
# CP_CUDA_ARCHS (compile only: objects in nvcc-check/, never linked or run); the target
# nvcc_check, part of the default build, depends on them.
set(CP_NVCC_CHECK_OUTPUTS "" CACHE INTERNAL "")
function(course_nvcc_check sources include_dirs out_dir)
  if(NOT (CP_CUDA_BACKEND STREQUAL "cuda-cpu" AND CP_NVCC))
    return()
  endif()
  set(flags -std=c++17 -DCP_WITH_CUDA=1 -I${PROJECT_SOURCE_DIR})
  foreach(dir IN LISTS include_dirs)
    list(APPEND flags -I${dir})
  endforeach()
  foreach(arch IN LISTS CP_CUDA_ARCHS)
    list(APPEND flags -gencode arch=compute_${arch},code=sm_${arch})
  endforeach()
  set(outputs ${CP_NVCC_CHECK_OUTPUTS})
  foreach(source IN LISTS sources)
    get_filename_component(name ${source} NAME)
    set(object ${PROJECT_BINARY_DIR}/nvcc-check/${out_dir}/${name}.o)
    add_custom_command(OUTPUT ${object}
      COMMAND ${CP_NVCC} ${flags} -MD -MF ${object}.d -c ${source} -o ${object}
      DEPENDS ${source} DEPFILE ${object}.d
      COMMENT "nvcc compile check (${CP_CUDA_ARCHS}): ${out_dir}/${name}" VERBATIM)
    list(APPEND outputs ${object})
  endforeach()
  set(CP_NVCC_CHECK_OUTPUTS ${outputs} CACHE INTERNAL "")
endfunction()

# One lesson: for each variant (learner = lessons/NN_slug, solution = solutions/NN_slug) a
# library lessonNN_<variant>, a test program lessonNN_<variant>_test built from
# tests/NN_slug_test.cpp, and, if lessons/NN_slug/demo.cpp exists, lessonNN_demo_<variant>.
# The learner variant links the *solutions* of the earlier lessons (docs/architecture.md).
#   course_add_lesson(01 online_softmax MPI_RANKS 3 4)
function(course_add_lesson nn slug)
  cmake_parse_arguments(ARG "" "" "MPI_RANKS" ${ARGN})
  set(folder ${nn}_${slug})
  set(lesson_dir ${PROJECT_SOURCE_DIR}/lessons/${folder})
  set(solution_dir ${PROJECT_SOURCE_DIR}/solutions/${folder})
  # The learner sources are the files of the solution folder; the learner has the same names.
  file(GLOB cpp_names RELATIVE ${solution_dir} CONFIGURE_DEPENDS ${solution_dir}/*.cpp)
  file(GLOB cu_names RELATIVE ${solution_dir} CONFIGURE_DEPENDS ${solution_dir}/*.cu)

  set(variants solution)
  if(CP_LEARNER_BUILD)
    set(variants learner solution)
  endif()
  foreach(variant ${variants})
    if(variant STREQUAL "learner")
      set(src_dir ${lesson_dir})
    else()
      set(src_dir ${solution_dir})
    endif()
    set(lib lesson${nn}_${variant})
    list(TRANSFORM cpp_names PREPEND ${src_dir}/ OUTPUT_VARIABLE cpp_sources)
    list(TRANSFORM cu_names PREPEND ${src_dir}/ OUTPUT_VARIABLE cu_sources)
    # Search order: this variant's own files, then earlier solutions, then contract headers.
    set(include_dirs ${src_dir} ${CP_SOLUTION_INCLUDE_DIRS} ${CP_LESSON_INCLUDE_DIRS} ${lesson_dir})

    add_library(${lib} STATIC ${cpp_sources})
    target_include_directories(${lib} PUBLIC ${include_dirs})
    target_link_libraries(${lib} PUBLIC cp_common ${CP_SOLUTION_LIBRARIES})
    course_reuse_pch(${lib} cp_common)
    if(CP_WITH_CUDA AND cu_sources)
      # Kernels never see torch: an object library with only the CUDA runtime and our headers.
      add_library(${lib}_kernels OBJECT ${cu_sources})
      target_include_directories(${lib}_kernels PRIVATE ${include_dirs} ${PROJECT_SOURCE_DIR})
      target_link_libraries(${lib}_kernels PRIVATE cp_cuda_runtime)
      target_compile_definitions(${lib}_kernels PRIVATE CP_WITH_CUDA=1)
      target_sources(${lib} PRIVATE $<TARGET_OBJECTS:${lib}_kernels>)
      course_nvcc_check("${cu_sources}" "${include_dirs}" ${variant}/${folder})
    endif()

    add_executable(${lib}_test ${PROJECT_SOURCE_DIR}/tests/${folder}_test.cpp)
    target_link_libraries(${lib}_test PRIVATE ${lib} cp_testing)
    course_reuse_pch(${lib}_test cp_testing)
    # Probe kernels of the tests (tests/NN_slug_probes.cu), compiled against this variant's sources
    # so that a test can run one task's device function on its own.
    set(probes ${PROJECT_SOURCE_DIR}/tests/${folder}_probes.cu)
    if(CP_WITH_CUDA AND EXISTS ${probes})
      add_library(${lib}_test_probes OBJECT ${probes})
      target_include_directories(${lib}_test_probes PRIVATE ${include_dirs} ${PROJECT_SOURCE_DIR}
                                 ${PROJECT_SOURCE_DIR}/tests)
      target_link_libraries(${lib}_test_probes PRIVATE cp_cuda_runtime)
      target_compile_definitions(${lib}_test_probes PRIVATE CP_WITH_CUDA=1)
      target_sources(${lib}_test PRIVATE $<TARGET_OBJECTS:${lib}_test_probes>)
      course_nvcc_check("${probes}" "${include_dirs};${PROJECT_SOURCE_DIR}/tests" ${variant}/${folder})
    endif()
    if(cu_sources)
      set(kernels KERNELS)
    else()
      set(kernels "")
    endif()
    course_register_tests(${lib}_test ${lib} ${kernels} LABELS "lesson${nn};${variant}" MPI_RANKS ${ARG_MPI_RANKS}
                          SOURCES ${PROJECT_SOURCE_DIR}/tests/${folder}_test.cpp)

    if(EXISTS ${lesson_dir}/demo.cpp)
      add_executable(lesson${nn}_demo_${variant} ${lesson_dir}/demo.cpp)
      target_link_libraries(lesson${nn}_demo_${variant} PRIVATE ${lib})
      course_reuse_pch(lesson${nn}_demo_${variant} cp_common)
    endif()
  endforeach()

  # What the next lessons build on.
  set(CP_SOLUTION_INCLUDE_DIRS ${CP_SOLUTION_INCLUDE_DIRS} ${solution_dir} PARENT_SCOPE)
  set(CP_LESSON_INCLUDE_DIRS ${CP_LESSON_INCLUDE_DIRS} ${lesson_dir} PARENT_SCOPE)
  set(CP_SOLUTION_LIBRARIES ${CP_SOLUTION_LIBRARIES} lesson${nn}_solution PARENT_SCOPE)
endfunction()
