// Element types as the kernels see them: host code maps torch dtypes to these, so that .cu
// files never include torch headers.
#pragma once

namespace cp {

enum class DType { Float32, Float16, BFloat16 };

}  // namespace cp
