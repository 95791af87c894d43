// FP8 conversions on float lanes (docs/algorithm.md §4), compiled once per Highway target: codes
// travel in 32-bit lanes, so a vector of floats converts in place. Same results as the
// scalar definition in src/core/fp8.cpp (tests/test_fp8.cpp checks every code).
// Include from inside the per-target section.
#if defined(FLASHATTN_CPU_FP8_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHATTN_CPU_FP8_INL_H_
#undef FLASHATTN_CPU_FP8_INL_H_
#else
#define FLASHATTN_CPU_FP8_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>

#include "flashattn/fp8.hpp"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// float → FP8 code (in the low byte of each 32-bit lane): round to nearest even,
// saturate to ±max, NaN to the canonical NaN with its sign.
template <class D, class V = hn::Vec<D>>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> EncodeFp8(D d, V x, Fp8Format format) {
  const hn::RebindToUnsigned<D> du;
  using VU = hn::Vec<decltype(du)>;
  const Fp8Info info = fp8_info(format);
  const int drop = 23 - info.mantissa_bits;  // float mantissa bits rounded away
  const VU sign = hn::ShiftRight<24>(hn::And(hn::BitCast(du, x), hn::Set(du, 0x80000000u)));
  const V a = hn::Min(hn::Abs(x), hn::Set(d, info.max));  // saturation; NaN handled last
  // Normal range: add half a kept ulp minus one, plus the kept lsb (ties to even), then
  // drop the bits and rebias the exponent from float's 127 to the format's bias.
  const VU u = hn::BitCast(du, a);
  const VU lsb = hn::And(hn::ShiftRightSame(u, drop), hn::Set(du, 1u));
  const VU rounded = hn::Add(u, hn::Add(hn::Set(du, (1u << (drop - 1)) - 1u), lsb));
  const VU normal = hn::Sub(hn::ShiftRightSame(rounded, drop),
                            hn::Set(du, static_cast<std::uint32_t>(127 - info.bias) << info.mantissa_bits));
  // Subnormal range: adding 2^k, whose float ulp is the format's subnormal quantum
  // 2^(1 − bias − mantissa_bits), rounds a to a multiple of that quantum (ties to even in
  // the FPU); the count of quanta is the code (2^mantissa_bits quanta = min normal's code).
  const int k = 1 - info.bias - info.mantissa_bits + 23;
  const V magic = hn::Set(d, static_cast<float>(1u << k));
  const VU subnormal = hn::Sub(hn::BitCast(du, hn::Add(a, magic)), hn::BitCast(du, magic));
  const VU magnitude = hn::IfThenElse(hn::RebindMask(du, hn::Lt(a, hn::Set(d, info.min_normal))), subnormal, normal);
  const VU code = hn::Or(sign, hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(x)), hn::Set(du, info.nan_code), magnitude));
  return code;
}

// FP8 code (low byte of each 32-bit lane) → float.
template <class D, class VU = hn::Vec<hn::RebindToUnsigned<D>>>
HWY_INLINE hn::Vec<D> DecodeFp8(D d, VU code, Fp8Format format) {
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const Fp8Info info = fp8_info(format);
  const VU magnitude = hn::And(code, hn::Set(du, 0x7Fu));
  const VU sign = hn::ShiftLeft<24>(hn::And(code, hn::Set(du, 0x80u)));
  // Normal: exponent and mantissa move up into float's fields, the exponent rebiased.
  const VU normal = hn::Add(hn::ShiftLeftSame(magnitude, 23 - info.mantissa_bits),
                            hn::Set(du, static_cast<std::uint32_t>(127 - info.bias) << 23));
  // Subnormal (exponent field 0): mantissa · 2^(1 − bias − mantissa_bits), exact.
  const hn::Vec<D> subnormal =
      hn::Mul(hn::ConvertTo(d, hn::BitCast(di, magnitude)),
              hn::Set(d, 1.0f / static_cast<float>(1u << (info.bias - 1 + info.mantissa_bits))));
  // Magnitudes are 0..127: compare them as signed lanes (every target has those compares).
  const auto signed_magnitude = hn::BitCast(di, magnitude);
  const auto is_subnormal = hn::RebindMask(du, hn::Lt(signed_magnitude, hn::Set(di, 1 << info.mantissa_bits)));
  VU bits = hn::IfThenElse(is_subnormal, hn::BitCast(du, subnormal), normal);
  // Specials: e4m3's S.1111.111 is NaN; e5m2's exponent field 31 is ±∞ (mantissa 0) or NaN.
  const VU float_exponent = hn::Set(du, 0x7F800000u);
  if (format == Fp8Format::e4m3) {
    bits = hn::IfThenElse(hn::Eq(magnitude, hn::Set(du, 0x7Fu)), hn::Set(du, 0x7FC00000u), bits);
  } else {
    const auto special = hn::RebindMask(du, hn::Gt(signed_magnitude, hn::Set(di, 0x7B)));
    bits = hn::IfThenElse(special, hn::Or(float_exponent, hn::ShiftLeft<21>(hn::And(magnitude, hn::Set(du, 3u)))), bits);
  }
  return hn::BitCast(d, hn::Or(bits, sign));
}

// x rounded to the nearest FP8 value (in float): what a tensor core multiplies after a
// conversion to FP8.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V RoundToFp8(D d, V x, Fp8Format format) {
  return DecodeFp8(d, EncodeFp8(d, x, format), format);
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
