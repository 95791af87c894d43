// exp2_array: the kernels' exp2 implementations over an array, dispatched once per call.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/cpu/exp2.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <algorithm>
#include <string>
#include <vector>

#include "src/cpu/kernels/simd_math-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void Exp2Array(bool poly3, const float* HWY_RESTRICT x, float* HWY_RESTRICT y, std::size_t n) {
  const hn::ScalableTag<float> df;
  const std::size_t lanes = hn::Lanes(df);
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto v = hn::LoadU(df, x + i);
    hn::StoreU(poly3 ? Exp2Poly3(df, v) : Exp2(df, v), df, y + i);
  }
  if (i == n) return;
  std::vector<float> tail(lanes, 0.0f);  // the last partial vector, padded
  std::copy(x + i, x + n, tail.begin());
  const auto v = hn::LoadU(df, tail.data());
  hn::StoreU(poly3 ? Exp2Poly3(df, v) : Exp2(df, v), df, tail.data());
  std::copy(tail.begin(), tail.begin() + static_cast<std::ptrdiff_t>(n - i), y + i);
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "flashattn/error.hpp"
#include "flashattn/exp2.hpp"

namespace flashattn {
namespace cpu {
HWY_EXPORT(Exp2Array);
}  // namespace cpu

void exp2_array(Exp2Impl impl, const float* x, float* y, std::size_t n) {
  if (impl != Exp2Impl::exact && impl != Exp2Impl::poly3)
    throw Error(std::string("exp2_array: impl must be exact or poly3, got ") + to_string(impl));
  HWY_DYNAMIC_DISPATCH(cpu::Exp2Array)(impl == Exp2Impl::poly3, x, y, n);
}

}  // namespace flashattn
#endif  // HWY_ONCE
