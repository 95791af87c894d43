// Small named SIMD helpers shared by the CPU kernels, compiled once per Highway target.
// Include from inside HWY_BEFORE_NAMESPACE / HWY_AFTER_NAMESPACE (per-target guard).
#if defined(FLASHATTN_CPU_SIMD_MATH_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHATTN_CPU_SIMD_MATH_INL_H_
#undef FLASHATTN_CPU_SIMD_MATH_INL_H_
#else
#define FLASHATTN_CPU_SIMD_MATH_INL_H_
#endif

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Adding 1.5·2^23 to a float of magnitude below 2^22 leaves round-to-nearest-even(x) in
// the low mantissa bits of the sum: y = 1.5·2^23 + n exactly, and y − 1.5·2^23 = n. The
// bits of y give 2^n without a float-to-int conversion (whose overflow fix-up costs four
// more instructions on AVX2): the bias 127 added to them and shifted into the exponent
// field, where the bits of 1.5·2^23 itself (none below bit 9) shift out.
constexpr float kRoundingBias = 12582912.0f;  // 1.5 · 2^23

// 2^n for n = y − kRoundingBias integral in [−127, 127], from y's bits; n = −127 gives +0.0f.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V Pow2FromRounded(D d, V y) {
  const hn::RebindToSigned<D> di;
  return hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(hn::BitCast(di, y), hn::Set(di, 127))));
}

// x clamped to [−127, 127] for Exp2 and Exp2Poly3. On x86 MAXPS and MINPS return their
// second operand when either is NaN, so with x second a NaN comes through the clamp and
// through the polynomial (NaN times 2^n is NaN): no test-and-blend per vector, two of the
// exponential's sixteen instructions. Elsewhere the clamp may turn a NaN into a number,
// and the caller puts it back (kClampKeepsNaN false).
#if HWY_ARCH_X86 && HWY_TARGET != HWY_EMU128 && HWY_TARGET != HWY_SCALAR
constexpr bool kClampKeepsNaN = true;
#else
constexpr bool kClampKeepsNaN = false;
#endif
template <class D, class V = hn::Vec<D>>
HWY_INLINE V ClampExponent(D d, V x) {
  return hn::Min(hn::Set(d, 127.0f), hn::Max(hn::Set(d, -127.0f), x));
}

// 2^x on the FMA units (docs/algorithm.md §5): x = n + f with n = round(x), |f| ≤ 1/2; 2^f
// from a degree-5 polynomial by Horner's rule, 2^n applied to it. The coefficients are the
// minimax fit of 2^f for relative error on [−1/2, 1/2] with p(0) = 1 fixed, so 2^0 is exactly
// 1 (a linear program over 4001 points; docs/numerics.md §2): fit error 6.8e-8, 2.2e-7
// relative with float32's roundings — as the degree-6 Taylor polynomial it replaced, one FMA
// fewer. Inputs below −126.5 (−∞, the masked score, included) give exactly 0; NaN stays NaN.
// On AVX-512, VSCALEFPS multiplies by 2^n in one instruction and a compare zeroes the lanes
// whose n is below −126, in place of the lower clamp and the exponent-bit arithmetic: 11
// instructions where the generic form takes 13, with the same result bit for bit (both round
// the exact product p·2^n once).
template <class D, class V = hn::Vec<D>>
HWY_INLINE V Exp2(D d, V x) {
  constexpr float kC5 = 1.3202981790527701e-3f;
  constexpr float kC4 = 9.674952365458012e-3f;
  constexpr float kC3 = 5.5510472506284714e-2f;
  constexpr float kC2 = 2.4022166430950165e-1f;
  constexpr float kC1 = 6.931465864181519e-1f;
  const auto poly = [&](V f) {
    V p = hn::MulAdd(hn::Set(d, kC5), f, hn::Set(d, kC4));
    p = hn::MulAdd(p, f, hn::Set(d, kC3));
    p = hn::MulAdd(p, f, hn::Set(d, kC2));
    p = hn::MulAdd(p, f, hn::Set(d, kC1));
    return hn::MulAdd(p, f, hn::Set(d, 1.0f));
  };
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if constexpr (sizeof(hn::TFromD<D>) * hn::MaxLanes(d) == 64) {
    x = hn::Min(hn::Set(d, 127.0f), x);  // as ClampExponent's upper half: NaN comes through
    const V n = hn::Sub(hn::Add(x, hn::Set(d, kRoundingBias)), hn::Set(d, kRoundingBias));
    const V p = poly(hn::Sub(x, n));  // −∞: f is NaN, and the lane is zeroed below
    // Lanes kept: n > −127, or NaN (not-less-or-equal, unordered: true).
    const __mmask16 kept = _mm512_cmp_ps_mask(n.raw, _mm512_set1_ps(-127.0f), _CMP_NLE_UQ);
    return V{_mm512_maskz_scalef_ps(kept, p.raw, n.raw)};
  }
#endif
  const V input = x;
  x = ClampExponent(d, x);
  const V y = hn::Add(x, hn::Set(d, kRoundingBias));  // n = round(x) in its low bits
  const V result = hn::Mul(poly(hn::Sub(x, hn::Sub(y, hn::Set(d, kRoundingBias)))), Pow2FromRounded(d, y));
  // A NaN score must poison its row.
  return kClampKeepsNaN ? result : hn::IfThenElse(hn::IsNaN(input), input, result);
}

// 2^x by Cody–Waite range reduction with a cubic (docs/algorithm.md §5, FlashAttention-4's software
// exp2): x = n + f with n = floor(x), 0 ≤ f < 1; 2^n goes into the exponent bits, 2^f
// comes from a degree-3 polynomial by Horner's rule. Coefficients: the minimax fit of
// 2^f for relative error on [0, 1) (Remez exchange, 5 alternation points), max relative
// error 7.5e-5 — far above Exp2's 1.2e-7, but 50× below half a bf16 ulp (2^-8 ≈ 3.9e-3
// relative at most), so P rounded to bf16 changes in under 1% of cases, by one ulp. Three FMAs instead of six. Inputs below −127 give 0;
// NaN stays NaN.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V Exp2Poly3(D d, V x) {
  constexpr float kC3 = 0.07802452147006989f;
  constexpr float kC2 = 0.22606715559959412f;
  constexpr float kC1 = 0.6958335638046265f;
  constexpr float kC0 = 0.9999251961708069f;
  const V input = x;
  x = ClampExponent(d, x);
  const V n = hn::Floor(x);
  const V f = hn::Sub(x, n);
  V p = hn::MulAdd(hn::Set(d, kC3), f, hn::Set(d, kC2));
  p = hn::MulAdd(p, f, hn::Set(d, kC1));
  p = hn::MulAdd(p, f, hn::Set(d, kC0));
  // 2^n; n = −127 (x < −126) gives +0.0f.
  const V pow2 = Pow2FromRounded(d, hn::Add(n, hn::Set(d, kRoundingBias)));
  const V result = hn::Mul(p, pow2);
  return kClampKeepsNaN ? result : hn::IfThenElse(hn::IsNaN(input), input, result);
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
