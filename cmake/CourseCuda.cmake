# Which CUDA the kernels are built with, and the one target that carries its runtime.
#
#   nvcc      NVIDIA's compiler and cudart: runs on a GPU (on a machine without one the kernels
#             compile and their tests skip).
#   cuda-cpu  the same .cu files compiled by chipStar's cucc to SPIR-V and run on the CPU by
#             PoCL: every kernel executes in the tests on a machine without a GPU. Checks results,
#             not speed (docs/cuda-on-cpu.md).
#   none      no CUDA: the CPU path only.
#
# CP_CUDA=auto picks nvcc when a GPU is visible, else cuda-cpu when the toolchain is installed
# (make setup), else nvcc when it exists (compile only), else none. After this file:
#   CP_CUDA_BACKEND   nvcc | cuda-cpu | none
#   CP_WITH_CUDA      1/0
#   cp_cuda_runtime   INTERFACE target: the CUDA runtime API (headers, library, definitions) for
#                     every kernel library and for cp_common
#   CP_CUDA_TEST_LABEL  the CTest label of the tests that execute kernels: cuda or cuda-cpu

set(CP_CUDA "auto" CACHE STRING "CUDA for the kernels: auto, nvcc, cuda-cpu or none")
set_property(CACHE CP_CUDA PROPERTY STRINGS auto nvcc cuda-cpu none)
set(CP_CUDA_CPU_ROOT "/opt/cuda-cpu" CACHE PATH "Install prefix of CUDA on the CPU (chipStar + PoCL; make setup)")
set(CP_CUDA_ARCHS "80;90" CACHE STRING "GPU architectures of the nvcc build (e.g. 90a for an H100 only)")

find_program(CP_NVCC nvcc HINTS ENV CUDACXX PATHS /usr/local/cuda/bin)
if(DEFINED ENV{CUDACXX})
  set(CP_NVCC $ENV{CUDACXX})
endif()
set(cp_cucc ${CP_CUDA_CPU_ROOT}/bin/cucc)

# The choice is made once per build folder: CMake cannot switch CUDA compilers in place. A
# CP_CUDA=none folder stays none: a CUDA LibTorch sets CMAKE_CUDA_COMPILER there too, which
# would read as nvcc at the next configure.
if(CP_CUDA STREQUAL "none" AND "$CACHE{CP_CUDA_BACKEND}" STREQUAL "none")
  set(CP_CUDA_BACKEND none)
elseif(CMAKE_CUDA_COMPILER MATCHES "cucc$")
  set(CP_CUDA_BACKEND cuda-cpu)
elseif(CMAKE_CUDA_COMPILER)
  set(CP_CUDA_BACKEND nvcc)
elseif(CP_CUDA STREQUAL "auto")
  execute_process(COMMAND nvidia-smi -L RESULT_VARIABLE cp_no_gpu OUTPUT_QUIET ERROR_QUIET)
  if(CP_NVCC AND cp_no_gpu EQUAL 0)
    set(CP_CUDA_BACKEND nvcc)
  elseif(EXISTS ${cp_cucc})
    set(CP_CUDA_BACKEND cuda-cpu)
  elseif(CP_NVCC)
    set(CP_CUDA_BACKEND nvcc)
  else()
    set(CP_CUDA_BACKEND none)
  endif()
else()
  set(CP_CUDA_BACKEND ${CP_CUDA})
endif()
if(NOT CP_CUDA STREQUAL "auto" AND NOT CP_CUDA STREQUAL CP_CUDA_BACKEND)
  message(FATAL_ERROR "CP_CUDA=${CP_CUDA}, but this build folder was configured with ${CP_CUDA_BACKEND} "
                      "(${CMAKE_CUDA_COMPILER}); use a new build folder (make clean)")
endif()

# Kept in the cache too: tools/kernel-report reads it from CMakeCache.txt.
set(CP_CUDA_BACKEND ${CP_CUDA_BACKEND} CACHE INTERNAL "The CUDA of this build folder: nvcc, cuda-cpu or none")

add_library(cp_cuda_runtime INTERFACE)
set(CP_WITH_CUDA 1)
if(CP_CUDA_BACKEND STREQUAL "nvcc")
  if(NOT CMAKE_CUDA_COMPILER)
    if(NOT CP_NVCC)
      message(FATAL_ERROR "CP_CUDA=nvcc but nvcc was not found (set CUDACXX)")
    endif()
    set(CMAKE_CUDA_COMPILER ${CP_NVCC})
  endif()
  set(CMAKE_CUDA_ARCHITECTURES ${CP_CUDA_ARCHS})
  set(CMAKE_CUDA_STANDARD 17)
  enable_language(CUDA)
  # nvcc compiles the host side of the .cu files with a GCC it supports, which may be older than
  # the C++ compiler (Debian 13: nvcc 12.4 takes g++-13, g++ is 14). Executables with kernels are
  # linked by the C++ compiler, but CMake also passes it nvcc's implicit link folders, among them
  # the older GCC's own (/usr/lib/gcc/<triple>/13), whose libstdc++ then comes first and lacks
  # what the newer GCC's objects and Debian's libraries need (__cxa_call_terminate@CXXABI_1.3.15).
  # The C++ compiler brings its own GCC folder; the newer libstdc++ serves the older objects too.
  list(FILTER CMAKE_CUDA_IMPLICIT_LINK_DIRECTORIES EXCLUDE REGEX "/gcc/[^/]+/[^/]+/?$")
  find_package(CUDAToolkit REQUIRED)
  target_link_libraries(cp_cuda_runtime INTERFACE CUDA::cudart)
  set(CP_CUDA_TEST_LABEL cuda)
  course_report("CUDA" ON "${CUDAToolkit_VERSION} (nvcc ${CMAKE_CUDA_COMPILER}, archs ${CP_CUDA_ARCHS})")
elseif(CP_CUDA_BACKEND STREQUAL "cuda-cpu")
  if(NOT EXISTS ${cp_cucc})
    message(FATAL_ERROR "CP_CUDA=cuda-cpu but ${cp_cucc} does not exist: run make setup, or set CP_CUDA_CPU_ROOT")
  endif()
  # cucc stands in for nvcc: CMake's compiler check accepts it when it answers --version as nvcc.
  set(ENV{CUCC_VERSION_STRING} "nvcc: NVIDIA (R) Cuda compiler driver")
  set(CMAKE_CUDA_COMPILER ${cp_cucc})
  set(CMAKE_CUDA_RUNTIME_LIBRARY None)  # chipStar's libCHIP replaces cudart (below)
  set(CMAKE_CUDA_ARCHITECTURES OFF)     # one SPIR-V target; no sm_XX
  set(CMAKE_CUDA_STANDARD 17)
  # -B: clang finds the llvm-spirv wrapper (SPIR-V 1.2, which the shuffles need) before the real
  # one. Its own headers warn about APIs the course does not use (cudaMallocAsync, textures).
  set(CMAKE_CUDA_FLAGS_INIT "-B${CP_CUDA_CPU_ROOT}/libexec/chipstar-tools -Wno-#warnings -Wno-deprecated-declarations -Wno-unused-command-line-argument")
  enable_language(CUDA)
  # Host code (g++) sees the same runtime API: the shim first (it fixes __CUDA_ARCH__ in host
  # passes and adds __float2bfloat16_rn), then chipStar's CUDA headers.
  # (SYSTEM for g++ only: CMake writes it as nvcc's "-isystem=", which clang reads as a sysroot path.)
  set(cp_dirs ${CP_CUDA_CPU_ROOT}/include/cuspv-shim ${CP_CUDA_CPU_ROOT}/include/cuspv ${CP_CUDA_CPU_ROOT}/include)
  target_include_directories(cp_cuda_runtime SYSTEM INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${cp_dirs}>)
  target_include_directories(cp_cuda_runtime INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:${cp_dirs}>)
  target_compile_options(cp_cuda_runtime INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Wno-cpp>)  # the same #warnings, in g++
  target_compile_definitions(cp_cuda_runtime INTERFACE __HIP_PLATFORM_SPIRV__=
                             CP_CUDA_CPU_ROOT="${CP_CUDA_CPU_ROOT}")
  target_link_libraries(cp_cuda_runtime INTERFACE ${CP_CUDA_CPU_ROOT}/lib/libCHIP.so)
  # PoCL's LLVM goes first among the libraries of every program with kernels. Debian 13's
  # LibTorch (2.6) holds a copy of LLVM inside libtorch_cpu and exports its C functions; the
  # dynamic loader looks a symbol up in the program's libraries in link order, and PoCL's LLVM,
  # which comes in later, would then see PoCL's start-up calls LLVMInitializeX86Target... go
  # to LibTorch's copy: its own target registry then has no x86 target, and the first kernel
  # compiled crashes PoCL (a segmentation fault in pocl_llvm_codegen2). Linked first, its
  # functions are the ones found. (LibTorch's copy serves TorchScript's CPU fuser, unused here.)
  execute_process(COMMAND readelf -d ${CP_CUDA_CPU_ROOT}/lib/libpocl.so OUTPUT_VARIABLE cp_pocl_needed)
  string(REGEX MATCH "libLLVM[^]]*" cp_pocl_llvm "${cp_pocl_needed}")
  find_library(CP_POCL_LLVM NAMES "${cp_pocl_llvm}" PATHS /usr/lib/llvm-19/lib)
  if(NOT cp_pocl_llvm OR NOT CP_POCL_LLVM)
    message(FATAL_ERROR "CUDA on the CPU: the LLVM library of ${CP_CUDA_CPU_ROOT}/lib/libpocl.so "
                        "('${cp_pocl_llvm}', from readelf -d) was not found: make setup installs it")
  endif()
  target_link_options(cp_cuda_runtime INTERFACE "LINKER:--push-state,--no-as-needed" ${CP_POCL_LLVM}
                      "LINKER:--pop-state")
  set(CP_CUDA_TEST_LABEL cuda-cpu)
  file(STRINGS ${CP_CUDA_CPU_ROOT}/include/chipStarConfig.hh cp_chipstar REGEX "define CHIPSTAR_VERSION ")
  string(REGEX REPLACE ".*\"(.*)\".*" "\\1" cp_chipstar "${cp_chipstar}")
  file(STRINGS ${CP_CUDA_CPU_ROOT}/lib/pkgconfig/pocl.pc cp_pocl REGEX "^Version:")
  string(REGEX REPLACE "Version: *" "" cp_pocl "${cp_pocl}")
  course_report("CUDA on the CPU" ON "(chipStar ${cp_chipstar}, PoCL ${cp_pocl}: ${CP_CUDA_CPU_ROOT})")
else()
  set(CP_WITH_CUDA 0)
  if(CP_CUDA STREQUAL "none")
    course_report("CUDA" OFF "(CP_CUDA=none: the CPU path only)")
  else()
    course_report("CUDA" OFF "(neither nvcc nor CUDA on the CPU found: the CPU path only; make setup-cuda-cpu builds CUDA on the CPU)")
  endif()
endif()
