// flex::detail::affine_span (include/flashattn/flex.hpp): a score hook's coefficients and
// mask bytes applied to a span of scores, dispatched to the CPU's widest SIMD target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/cpu/flex_span.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <cstdint>
#include <limits>

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Whole vectors where every operand is contiguous or broadcast, the rest (and any other
// stride) one score at a time, by the same formula.
void AffineSpan(float* HWY_RESTRICT s, float* HWY_RESTRICT grad, std::int64_t n, const float* HWY_RESTRICT a,
                std::int64_t a_step, const float* HWY_RESTRICT c, std::int64_t c_step, float c_scale,
                const std::uint8_t* HWY_RESTRICT keep, std::int64_t keep_step) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du32;
  const hn::Rebind<std::uint8_t, decltype(df)> du8;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
  const bool vectors = (a == nullptr || a_step == 0 || a_step == 1) && (c == nullptr || c_step == 0 || c_step == 1) &&
                       (keep == nullptr || keep_step == 1);
  std::int64_t k = 0;
  if (vectors) {
    const auto neg_inf = hn::Set(df, kNegInf), scale = hn::Set(df, c_scale);
    for (; k + lanes <= n; k += lanes) {
      const auto v = hn::LoadU(df, s + k);
      auto kept = hn::Ne(v, neg_inf);
      if (keep != nullptr)
        kept = hn::And(kept, hn::RebindMask(df, hn::Ne(hn::PromoteTo(du32, hn::LoadU(du8, keep + k)), hn::Zero(du32))));
      const auto ak = a == nullptr ? hn::Set(df, 1.0f) : a_step == 0 ? hn::Set(df, a[0]) : hn::LoadU(df, a + k);
      auto r = a == nullptr ? v : hn::Mul(ak, v);
      if (c != nullptr) r = hn::MulAdd(c_step == 0 ? hn::Set(df, c[0]) : hn::LoadU(df, c + k), scale, r);
      hn::StoreU(hn::IfThenElse(kept, r, neg_inf), df, s + k);
      if (grad != nullptr) {
        const auto g = hn::LoadU(df, grad + k);
        hn::StoreU(hn::IfThenElseZero(kept, a == nullptr ? g : hn::Mul(g, ak)), df, grad + k);
      }
    }
  }
  const hn::CappedTag<float, 1> d1;  // the tail's formula, the vectors' rounding
  for (; k < n; ++k) {
    if (s[k] == kNegInf || (keep != nullptr && keep[k * keep_step] == 0)) {
      s[k] = kNegInf;
      if (grad != nullptr) grad[k] = 0.0f;
      continue;
    }
    const float ak = a == nullptr ? 1.0f : a[k * a_step];
    float r = a == nullptr ? s[k] : ak * s[k];
    if (c != nullptr) r = hn::GetLane(hn::MulAdd(hn::Set(d1, c[k * c_step]), hn::Set(d1, c_scale), hn::Set(d1, r)));
    s[k] = r;
    if (grad != nullptr) grad[k] *= ak;
  }
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "flashattn/flex.hpp"

namespace flashattn {
namespace cpu {
HWY_EXPORT(AffineSpan);
}  // namespace cpu

void flex::detail::affine_span(float* scores, float* grad, std::int64_t n, const float* a, std::int64_t a_step,
                               const float* c, std::int64_t c_step, float c_scale, const std::uint8_t* keep,
                               std::int64_t keep_step) {
  HWY_DYNAMIC_DISPATCH(cpu::AffineSpan)(scores, grad, n, a, a_step, c, c_step, c_scale, keep, keep_step);
}

}  // namespace flashattn
#endif  // HWY_ONCE
