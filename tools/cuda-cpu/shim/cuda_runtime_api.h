// CUDA-on-the-CPU shim (tools/cuda-cpu/shim, installed into <prefix>/include/cuspv-shim).
// This directory goes first on the include path of CUDA code, so `#include <cuda_runtime_api.h>` lands
// here and then continues with chipStar's own header.
//
// With nvcc, __CUDA_ARCH__ is defined only while device code is compiled; host code uses
// `#ifdef __CUDA_ARCH__` to pick device-only branches. chipStar's headers define it in the host
// pass as well, so host code takes those branches too: LibTorch's c10/util/Half.h then fails to
// compile, and the course's own host/device helpers would change behaviour. After chipStar's header,
// we remove the definition again unless this really is the device pass (__HIP_DEVICE_COMPILE__).
// cuda_runtime.h and cuda_runtime_api.h both carry this fix: code may include either one first.
#pragma once
#include_next <cuda_runtime_api.h>
#if defined(__CUDA_ARCH__) && !defined(__HIP_DEVICE_COMPILE__)
#undef __CUDA_ARCH__
#endif
