// Qualifiers for code shared by host and device (the softmax state, later the attention merge).
#pragma once

#include "common/error.h"

#if defined(__CUDACC__)
#define CP_HOST_DEVICE __host__ __device__
#else
#define CP_HOST_DEVICE
#endif

/// A learner stub inside a CP_HOST_DEVICE function: throws cp::NotImplemented on the host.
/// Device code cannot throw; there the stub falls through to its placeholder return value,
/// and the host-side launcher of the kernel is the one that reports "not started".
#if defined(__CUDA_ARCH__)
#define CP_NOT_IMPLEMENTED_HD(what) ((void)0)
#else
#define CP_NOT_IMPLEMENTED_HD(what) throw ::cp::NotImplemented(what)
#endif
