// CUDA-on-the-CPU shim (tools/cuda-cpu/shim, installed into <prefix>/include/cuspv-shim).
// This directory goes first on the include path of CUDA code, so `#include <cuda_bf16.h>` lands
// here and then continues with chipStar's own header.
//
// Adds __float2bfloat16_rn, which chipStar (1.2.1) does not provide. CUDA's version converts a float
// to bfloat16 rounding to nearest, ties to even; chipStar's __float2bfloat16 already rounds exactly
// that way, so the missing function is simply an alias of it.
#pragma once
#include_next <cuda_bf16.h>

#ifndef CP_CUDA_CPU_SHIM_FLOAT2BFLOAT16_RN
#define CP_CUDA_CPU_SHIM_FLOAT2BFLOAT16_RN
static inline __host__ __device__ __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
#endif
