// Aligned buffers (float32, and bf16 as uint16) for the kernels' workspaces. Highway's allocator returns null when
// memory runs out; this turns that into an Error naming the size, never a null write.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <hwy/aligned_allocator.h>

#include "flashattn/error.hpp"

namespace flashattn::cpu {

// A large buffer its caller writes whole (allocate_floats_written) is advised to transparent
// huge pages (Linux, where the system leaves THP to madvise): such a buffer (the backward's
// float32 dQ accumulator, 32 MiB at 64 heads of 1024 queries) comes from the kernel fresh each
// call, and faulting it in 4 KiB at a time cost 4–7% of a backward. Buffers written in parts
// (a thread's packed tiles) are not: a 2 MiB page would back the parts it never writes. Only
// the 2 MiB-aligned interior is advised; failure to advise changes nothing.
inline constexpr std::size_t kHugePageAdviceBytes = std::size_t{8} << 20;

inline void advise_huge_pages(void* data, std::size_t bytes) {
#if defined(__linux__)
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  const auto begin = (reinterpret_cast<std::uintptr_t>(data) + kHuge - 1) / kHuge * kHuge;
  const auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) / kHuge * kHuge;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

template <class T>
hwy::AlignedFreeUniquePtr<T[]> allocate_array(std::size_t count) {
  // Highway asserts a non-empty payload; buffers a kernel does not use get one element.
  hwy::AlignedFreeUniquePtr<T[]> p = hwy::AllocateAligned<T>(count > 0 ? count : 1);
  if (p == nullptr)
    throw Error("workspace: cannot allocate " + std::to_string(count * sizeof(T)) + " bytes");
  return p;
}

inline hwy::AlignedFreeUniquePtr<float[]> allocate_floats(std::size_t count) { return allocate_array<float>(count); }

// allocate_floats for a buffer the caller writes whole before use: huge pages advised from
// kHugePageAdviceBytes on.
inline hwy::AlignedFreeUniquePtr<float[]> allocate_floats_written(std::size_t count) {
  hwy::AlignedFreeUniquePtr<float[]> p = allocate_floats(count);
  if (count * sizeof(float) >= kHugePageAdviceBytes) advise_huge_pages(p.get(), count * sizeof(float));
  return p;
}

}  // namespace flashattn::cpu
