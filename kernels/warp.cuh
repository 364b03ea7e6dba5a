// Warp-level building blocks.
#pragma once

namespace cp::kernels {

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarp = 0xffffffffu;

}  // namespace cp::kernels
