// The scalar FP8 conversions: the definition the vectorised ones are tested against,
// written from the format's parameters with integer and power-of-two arithmetic only.
#include "flashattn/fp8.hpp"

#include <cmath>

#include "flashattn/error.hpp"

namespace flashattn {

const char* to_string(Fp8Format format) { return format == Fp8Format::e4m3 ? "e4m3" : "e5m2"; }

Fp8Format parse_fp8_format(const std::string& name) {
  if (name == "e4m3") return Fp8Format::e4m3;
  if (name == "e5m2") return Fp8Format::e5m2;
  throw Error("fp8 format: unknown format '" + name + "' (expected e4m3 or e5m2)");
}

float fp8_to_float(std::uint8_t code, Fp8Format format) {
  const Fp8Info info = fp8_info(format);
  const int exponent_field = (code & 0x7F) >> info.mantissa_bits;
  const int mantissa = code & ((1 << info.mantissa_bits) - 1);
  const float sign = (code & 0x80) != 0 ? -1.0f : 1.0f;
  const int all_ones = (1 << (7 - info.mantissa_bits)) - 1;
  const float nan = std::copysign(std::nanf(""), sign);  // NaNs keep their sign bit
  if (format == Fp8Format::e4m3 && (code & 0x7F) == 0x7F) return nan;
  if (format == Fp8Format::e5m2 && exponent_field == all_ones) return mantissa == 0 ? sign * INFINITY : nan;
  if (exponent_field == 0)  // subnormal: mantissa quanta of 2^(1 − bias − mantissa_bits)
    return sign * std::ldexp(static_cast<float>(mantissa), 1 - info.bias - info.mantissa_bits);
  return sign * std::ldexp(static_cast<float>((1 << info.mantissa_bits) + mantissa),
                           exponent_field - info.bias - info.mantissa_bits);
}

std::uint8_t float_to_fp8(float value, Fp8Format format) {
  const Fp8Info info = fp8_info(format);
  const std::uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  if (std::isnan(value)) return sign | info.nan_code;
  const float a = std::fabs(value);
  if (a >= info.max) return sign | info.max_code;  // saturation, ±∞ included
  // The quantum (value of one mantissa step) of a's binade, or of the subnormals.
  const int exponent = a < info.min_normal ? 1 - info.bias : std::ilogb(a);
  const float quantum = std::ldexp(1.0f, exponent - info.mantissa_bits);
  // a / quantum is exact (a power of two); nearbyint rounds to nearest even.
  const auto steps = static_cast<int>(std::nearbyint(a / quantum));
  // Steps count mantissa quanta from 0 (subnormals) or from the binade's implicit 1; a
  // carry into the next binade lands on the right code because codes are monotonic, and
  // a < max never rounds past max (a representable value).
  const int code = a < info.min_normal
                       ? steps
                       : ((exponent + info.bias) << info.mantissa_bits) + steps - (1 << info.mantissa_bits);
  return static_cast<std::uint8_t>(sign | code);
}

}  // namespace flashattn
