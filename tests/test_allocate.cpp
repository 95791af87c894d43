// The workspaces' allocator (src/cpu/allocate.hpp): a buffer written whole from
// kHugePageAdviceBytes on is advised to transparent huge pages, a smaller one and one written
// in parts are not. Read back from the Linux kernel's own account of the process's mappings
// (/proc/self/smaps, VmFlags "hg" = MADV_HUGEPAGE), not from the allocator.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

#include "src/cpu/allocate.hpp"

namespace flashattn::test {
namespace {

// The VmFlags of the mapping that holds `address`, or "" where /proc/self/smaps has none.
std::string vm_flags_at(const void* address) {
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    std::uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = begin <= at && at < end;
      continue;
    }
    if (inside && line.rfind("VmFlags:", 0) == 0) return line.substr(8);
  }
  return "";
}

bool advised(const std::string& flags) { return (" " + flags + " ").find(" hg ") != std::string::npos; }

// The first 2 MiB boundary inside [p, p + bytes): the part advise_huge_pages advises.
const void* huge_interior(const float* p) {
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  return reinterpret_cast<const void*>((reinterpret_cast<std::uintptr_t>(p) + kHuge - 1) / kHuge * kHuge);
}

TEST(Allocate, BuffersWrittenWholeAreAdvisedToHugePagesFromTheThreshold) {
#if !defined(__linux__)
  GTEST_SKIP() << "huge-page advice is Linux-only (madvise)";
#else
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  if (!thp) GTEST_SKIP() << "this kernel has no transparent huge pages: nothing is advised";
  const std::size_t large = cpu::kHugePageAdviceBytes / sizeof(float);
  const auto written = cpu::allocate_floats_written(large);
  const std::string flags = vm_flags_at(huge_interior(written.get()));
  ASSERT_FALSE(flags.empty()) << "no mapping in /proc/self/smaps holds the buffer";
  EXPECT_TRUE(advised(flags)) << "a buffer of " << cpu::kHugePageAdviceBytes << " bytes written whole, VmFlags:" << flags;

  // The same size written in parts (allocate_floats), and one float under the threshold
  // written whole: glibc maps each anew (above its mmap threshold), and neither is advised.
  const auto parts = cpu::allocate_floats(large);
  const std::string part_flags = vm_flags_at(huge_interior(parts.get()));
  ASSERT_FALSE(part_flags.empty());
  EXPECT_FALSE(advised(part_flags)) << "VmFlags:" << part_flags;
  const auto below = cpu::allocate_floats_written(large - 1);
  const std::string below_flags = vm_flags_at(huge_interior(below.get()));
  ASSERT_FALSE(below_flags.empty());
  EXPECT_FALSE(advised(below_flags)) << "VmFlags:" << below_flags;
#endif
}

}  // namespace
}  // namespace flashattn::test
