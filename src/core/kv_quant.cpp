// The int8 KV-cache formats' scalar definitions (include/flashattn/kv_quant.hpp): the value
// of a code, which the kernels' vectorised reads follow, and the quantization an append
// applies. Scales and steps are computed in double, so that the only roundings the stated
// error bound has to cover are those of the stored float32 scale and zero point.
#include "flashattn/kv_quant.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "flashattn/error.hpp"

namespace flashattn {
namespace {

// The codes an append writes: u8 0..255, s8 −127..127 (symmetric, so that −x stores −code).
constexpr double kU8Max = 255.0, kS8Max = 127.0;

}  // namespace

const char* to_string(KvCodes codes) {
  switch (codes) {
    case KvCodes::e4m3: return "e4m3";
    case KvCodes::u8: return "u8";
    case KvCodes::s8: return "s8";
  }
  return "?";
}

const char* to_string(KvScaleGranularity granularity) {
  return granularity == KvScaleGranularity::per_page ? "per_page" : "per_token";
}

KvCodes parse_kv_codes(const std::string& name) {
  for (KvCodes codes : {KvCodes::e4m3, KvCodes::u8, KvCodes::s8})
    if (name == to_string(codes)) return codes;
  throw Error("kv cache codes: unknown format '" + name + "' (expected e4m3, u8 or s8)");
}

KvScaleGranularity parse_kv_scale_granularity(const std::string& name) {
  for (KvScaleGranularity g : {KvScaleGranularity::per_page, KvScaleGranularity::per_token})
    if (name == to_string(g)) return g;
  throw Error("kv cache scale granularity: unknown '" + name + "' (expected per_page or per_token)");
}

float int8_code_value(KvCodes codes, std::uint8_t code, float scale, float zero_point) {
  if (codes == KvCodes::s8) return static_cast<float>(static_cast<std::int8_t>(code)) * scale;
  return (static_cast<float>(code) - zero_point) * scale;
}

void quantize_int8(KvCodes codes, const float* x, std::int64_t n, bool choose_scale, float* scale, float* zero_point,
                   std::uint8_t* out) {
  if (codes != KvCodes::u8 && codes != KvCodes::s8)
    throw Error(std::string("quantize_int8: codes ") + to_string(codes) + " are not int8 (u8 or s8)");
  const bool u8 = codes == KvCodes::u8;
  if (choose_scale) {
    double lo = 0.0, hi = 0.0, amax = 0.0;
    if (n > 0) lo = hi = x[0];
    for (std::int64_t i = 0; i < n; ++i) {
      lo = std::min(lo, static_cast<double>(x[i]));
      hi = std::max(hi, static_cast<double>(x[i]));
      amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
    }
    // An all-zero (s8) or constant (u8) row: step 1. A step below FLT_MIN would keep only a
    // subnormal's few bits — rounded down, the row's extremes would clamp at the last code —
    // so it is FLT_MIN, which fits the row's spread in fewer codes.
    const double step = u8 ? (hi - lo) / kU8Max : amax / kS8Max;
    *scale = step >= FLT_MIN ? static_cast<float>(step) : step > 0.0 ? FLT_MIN : 1.0f;
    *zero_point = u8 ? static_cast<float>(-lo / static_cast<double>(*scale)) : 0.0f;
    if (u8 && hi == lo && std::isfinite(lo)) {
      // A constant row c (u8): every code 128 — which the narrow decode kernels read as 0, so
      // no product of theirs rounds it — and c = (128 − zero_point)·scale exactly.
      const auto c = static_cast<float>(lo);  // a float: lo is one of x
      *scale = c != 0.0f ? std::fabs(c) : 1.0f;
      *zero_point = c > 0.0f ? 127.0f : c < 0.0f ? 129.0f : 128.0f;
    }
  }
  const double s = *scale, z = u8 ? static_cast<double>(*zero_point) : 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double code = std::nearbyint(static_cast<double>(x[i]) / s + z);  // ties to even (default rounding)
    if (u8)
      out[i] = static_cast<std::uint8_t>(std::clamp(code, 0.0, kU8Max));
    else
      out[i] = static_cast<std::uint8_t>(static_cast<std::int8_t>(std::clamp(code, -kS8Max, kS8Max)));
  }
}

}  // namespace flashattn
