#include "tests/support/harness.hpp"

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cstdint>

#include "flashattn/error.hpp"

namespace flashattn::test {

void for_each_simd_target(const std::function<void(const std::string&)>& body) {
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = hwy::TargetName(target);
    SCOPED_TRACE("simd target " + name);
    body(name);
  }
  hwy::SetSupportedTargetsForTest(0);
}

void expect_error(const std::function<void()>& call, const std::vector<std::string>& fragments) {
  try {
    call();
    ADD_FAILURE() << "expected flashattn::Error";
  } catch (const Error& e) {
    for (const auto& f : fragments)
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos)
          << "message '" << e.what() << "' lacks '" << f << "'";
  }
}

bool cpu_has_avx512bf16() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") != 0;
#else
  return false;
#endif
}

}  // namespace flashattn::test
