// Aligned buffers (float32, and bf16 as uint16) for the kernels' workspaces. Highway's allocator returns null when
// memory runs out; this turns that into an Error naming the size, never a null write.
#pragma once

#include <cstddef>
#include <string>

#include <hwy/aligned_allocator.h>

#include "flashattn/error.hpp"

namespace flashattn::cpu {

template <class T>
hwy::AlignedFreeUniquePtr<T[]> allocate_array(std::size_t count) {
  // Highway asserts a non-empty payload; buffers a kernel does not use get one element.
  hwy::AlignedFreeUniquePtr<T[]> p = hwy::AllocateAligned<T>(count > 0 ? count : 1);
  if (p == nullptr)
    throw Error("workspace: cannot allocate " + std::to_string(count * sizeof(T)) + " bytes");
  return p;
}

inline hwy::AlignedFreeUniquePtr<float[]> allocate_floats(std::size_t count) { return allocate_array<float>(count); }

}  // namespace flashattn::cpu
