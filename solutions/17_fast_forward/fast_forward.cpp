// Lesson 17 — the ladder's names (host code; the kernels are in fast_forward.cu).
#include "fast_forward.h"

#include "common/error.h"

namespace cp {

const char* fast_forward_version_name(int version) {
  CP_CHECK(version >= 1 && version <= kFastForwardVersions, "version: expected 1 … ", kFastForwardVersions, ", got ",
           version);
  static const char* const names[] = {"lesson 16's kernel", "cp.async in FlashAttention-2's order",
                                      "masks only on cut tiles, exp2", "128 rows a block, ldmatrix.x4",
                                      "the longest blocks first"};
  return names[version - 1];
}

}  // namespace cp
