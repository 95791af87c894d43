// Aligned float buffers for the kernels' workspaces. Highway's allocator returns null when
// memory runs out; this turns that into an Error naming the size, never a null write.
#pragma once

#include <cstddef>
#include <string>

#include <hwy/aligned_allocator.h>

#include "flashattn/error.hpp"

namespace flashattn::cpu {

inline hwy::AlignedFreeUniquePtr<float[]> allocate_floats(std::size_t count) {
  hwy::AlignedFreeUniquePtr<float[]> p = hwy::AllocateAligned<float>(count);
  if (p == nullptr)
    throw Error("workspace: cannot allocate " + std::to_string(count * sizeof(float)) + " bytes");
  return p;
}

}  // namespace flashattn::cpu
