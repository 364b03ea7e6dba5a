// Warp-level building blocks.
//
// Every thread of a block must reach every __syncthreads() and every shuffle: idle threads stay
// and mask their work (kernels/README.md, rule 1). With a full mask this is what CUDA requires,
// and on CUDA on the CPU a shuffle is a barrier of the whole block.
#pragma once

namespace cp::kernels {

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarp = 0xffffffffu;  ///< every lane of the warp takes part in the shuffle

}  // namespace cp::kernels
