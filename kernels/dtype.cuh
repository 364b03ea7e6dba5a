// Loads and stores of fp32/fp16/bf16 elements with float32 math, and the dispatch from
// cp::DType to a kernel template argument.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/dtype.h"

namespace cp::kernels {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

/// Calls fn(T{}) with T the C++ element type of `dtype`: one place maps DType to types.
template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::Float32: fn(float{}); break;
    case DType::Float16: fn(__half{}); break;
    case DType::BFloat16: fn(__nv_bfloat16{}); break;
  }
}

}  // namespace cp::kernels
