// The lane-to-element map of the matrix units' m16n8k16 fragments (kernels/mma.cuh): which
// (row, col) element e of a fragment held by `lane` is. Host and device code: the kernels index
// fragments with it, the tests check every load against it.
//
// Lane = 4·g + t: g = lane / 4 is the lane's group (a row of C), t = lane % 4 its place in the
// quad of four lanes that holds that row.
//
//   A 16×16 (row-major), 8 elements  B 16×8 (k × n), 4 elements  C, D 16×8 float32, 4 elements
//   e 0,1: row g,   cols 2t, 2t+1    e 0,1: rows 2t, 2t+1, col g  e 0,1: row g,   cols 2t, 2t+1
//   e 2,3: row g+8, cols 2t, 2t+1    e 2,3: rows 2t+8, 2t+9, col g  e 2,3: row g+8, cols 2t, 2t+1
//   e 4,5: row g,   cols 2t+8, 2t+9
//   e 6,7: row g+8, cols 2t+8, 2t+9
//
// A and B keep two 16-bit elements per 32-bit register (element e in register e / 2, the even
// one in the low half); C keeps one float per element.
#pragma once

#include "common/host_device.h"

namespace cp::kernels {

CP_HOST_DEVICE constexpr int frag_a_row(int lane, int e) { return lane / 4 + 8 * ((e / 2) % 2); }
CP_HOST_DEVICE constexpr int frag_a_col(int lane, int e) { return 2 * (lane % 4) + e % 2 + 8 * (e / 4); }
CP_HOST_DEVICE constexpr int frag_b_row(int lane, int e) { return 2 * (lane % 4) + e % 2 + 8 * (e / 2); }
CP_HOST_DEVICE constexpr int frag_b_col(int lane, int /*e*/) { return lane / 4; }
CP_HOST_DEVICE constexpr int frag_c_row(int lane, int e) { return lane / 4 + 8 * (e / 2); }
CP_HOST_DEVICE constexpr int frag_c_col(int lane, int e) { return 2 * (lane % 4) + e % 2; }

}  // namespace cp::kernels
