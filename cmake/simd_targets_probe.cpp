// Run at configure time for FLASHATTN_SIMD_TARGETS=native (cmake/simd_targets.cmake):
// prints, on two lines, the Highway targets a default build compiles that this machine does
// not dispatch to — as a HWY_DISABLED_TARGETS mask, then by name. The best target the CPU
// supports and the static baseline (which Highway cannot leave out) stay.
#include <hwy/targets.h>

#include <cstdint>
#include <cstdio>
#include <string>

int main() {
  const std::int64_t compiled = HWY_TARGETS;
  const std::int64_t usable = hwy::SupportedTargets() & compiled;
  const std::int64_t best = usable & -usable;  // lower bits are better targets
  const std::int64_t left_out = compiled & ~best & ~static_cast<std::int64_t>(HWY_STATIC_TARGET);
  std::string names;
  for (std::int64_t bit = 1; bit != 0 && bit <= left_out; bit <<= 1)
    if ((left_out & bit) != 0) names += (names.empty() ? "" : " ") + std::string(hwy::TargetName(bit));
  std::printf("%lld\n%s\n", static_cast<long long>(left_out), names.c_str());
  return 0;
}
