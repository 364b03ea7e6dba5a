#!/bin/sh
# llvm-spirv wrapper, installed as <prefix>/libexec/chipstar-tools/llvm-spirv (tools/build-cuda-on-cpu).
#
# Why: when clang 19 compiles CUDA for SPIR-V (its HIPSPV toolchain, as shipped by Debian), it turns
# the device code into SPIR-V by running
#     llvm-spirv --spirv-max-version=1.1 ...
# but the sub-group operations behind chipStar's warp shuffles (__shfl_sync, __shfl_xor_sync, ...)
# need SPIR-V 1.2. With 1.1 the translation of any kernel that shuffles fails. chipStar's own LLVM
# fork changes that one number in clang; with the unpatched Debian clang we change it here instead.
#
# How it is found: cucc / clang look for tools in the directories given with -B before PATH, so the
# course passes -B<prefix>/libexec/chipstar-tools (or puts that directory first on PATH). The real
# translator is <prefix>/bin/llvm-spirv; every other argument is passed through unchanged.
real="$(dirname "$(readlink -f "$0")")/../../bin/llvm-spirv"

# Rebuild the argument list, replacing only the version cap.
first=1
for arg in "$@"; do
  if [ "$first" = 1 ]; then set --; first=0; fi
  case "$arg" in
    --spirv-max-version=1.1) set -- "$@" --spirv-max-version=1.2 ;;
    *) set -- "$@" "$arg" ;;
  esac
done
exec "$real" "$@"
