#include "tests/support/harness.hpp"

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cstdint>
#include <cstring>

#include "flashattn/error.hpp"
#include "src/cpu/kernels/forward_kernel.hpp"

namespace flashattn::test {

void for_each_simd_target(const std::function<void(const std::string&)>& body) {
  // Each target's kernels alone: short bf16/f16 decode calls would otherwise run the AVX2
  // decode kernel under an AVX-512 target (CpuHardware::short_decode_bytes).
  cpu::set_avx2_decode_enabled(false);
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = hwy::TargetName(target);
    SCOPED_TRACE("simd target " + name);
    body(name);
  }
  hwy::SetSupportedTargetsForTest(0);
  cpu::set_avx2_decode_enabled(true);
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

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         (a.numel() == 0 ||  // an empty tensor has no data to compare (memcmp of null is UB)
          std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * dtype_size(a.dtype())) == 0);
}

ForwardResult packed_rows(const ForwardResult& all, std::int64_t q0, std::int64_t n) {
  const std::int64_t total = all.out.shape()[0], heads = all.out.shape()[1], dim_v = all.out.shape()[2];
  ForwardResult r{Tensor(all.out.dtype(), {1, n, heads, dim_v}), Tensor(DType::f32, {1, heads, n})};
  for (std::int64_t i = 0; i < n * heads * dim_v; ++i) r.out.set(i, all.out.get(q0 * heads * dim_v + i));
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t i = 0; i < n; ++i) r.lse.set(h * n + i, all.lse.get(h * total + q0 + i));
  return r;
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
