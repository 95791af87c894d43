#include "flashattn/tensor.hpp"

#include <bit>
#include <cmath>
#include <cstring>

#include "flashattn/error.hpp"

namespace flashattn {

std::string to_string(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::u8: return "u8";
  }
  return "unknown";
}

std::string to_string(Device device) { return device == Device::cuda ? "cuda" : "cpu"; }

DType parse_dtype(const std::string& name) {
  if (name == "f32" || name == "float32" || name == "fp32") return DType::f32;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "f16" || name == "float16" || name == "fp16") return DType::f16;
  throw Error("dtype: unknown dtype '" + name + "' (expected f32, bf16 or f16)");
}

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::f32: return std::ldexp(1.0, -24);
    case DType::bf16: return std::ldexp(1.0, -8);
    case DType::f16: return std::ldexp(1.0, -11);
    default: throw Error("unit_roundoff: dtype must be f32, bf16 or f16, got " + to_string(dtype));
  }
}

float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t float_to_bf16(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if (std::isnan(value)) return static_cast<std::uint16_t>((bits >> 16) | 0x40);  // quiet
  // Round to nearest even: add 0x7FFF plus the lowest kept bit, then truncate.
  const std::uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

float f16_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1Fu;
  const std::uint32_t mantissa = bits & 0x3FFu;
  if (exponent == 0x1F)  // inf or NaN
    return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa · 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

std::uint16_t float_to_f16(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const float magnitude = std::fabs(value);
  if (std::isnan(value)) return sign | 0x7E00u;
  if (magnitude >= 65520.0f) return sign | 0x7C00u;  // rounds to infinity
  if (magnitude < 6.103515625e-05f) {                // below 2^-14: subnormal half
    // Subnormal halves are multiples of 2^-24; nearbyint rounds half to even.
    return sign | static_cast<std::uint16_t>(std::nearbyint(magnitude * 16777216.0f));
  }
  // Normal: drop 13 mantissa bits with round-to-nearest-even and rebias 127 → 15.
  const std::uint32_t abs_bits = bits & 0x7FFFFFFFu;
  const std::uint32_t rounding = 0xFFFu + ((abs_bits >> 13) & 1u);
  const std::uint32_t rounded = (abs_bits + rounding) >> 13;
  return sign | static_cast<std::uint16_t>(rounded - (112u << 10));
}

float round_to(DType dtype, float value) {
  switch (dtype) {
    case DType::bf16: return bf16_to_float(float_to_bf16(value));
    case DType::f16: return f16_to_float(float_to_f16(value));
    case DType::f32:
    case DType::i32:
    case DType::u8: return value;
  }
  return value;
}

Tensor::Tensor(DType dtype, std::vector<std::int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  if (shape_.size() > static_cast<std::size_t>(kMaxRank))
    throw Error("Tensor: rank " + std::to_string(shape_.size()) + " exceeds " +
                std::to_string(kMaxRank));
  for (std::size_t d = 0; d < shape_.size(); ++d)
    if (shape_[d] < 0)
      throw Error("Tensor: negative size " + std::to_string(shape_[d]) + " in dim " +
                  std::to_string(d));
  storage_.assign(static_cast<std::size_t>(numel()) * dtype_size(dtype_), 0);
}

std::int64_t Tensor::numel() const {
  std::int64_t n = 1;
  for (std::int64_t s : shape_) n *= s;
  return n;
}

namespace {
template <class View, class Ptr>
View make_view(Ptr data, DType dtype, const std::vector<std::int64_t>& shape) {
  View view;
  view.data = data;
  view.dtype = dtype;
  view.rank = static_cast<int>(shape.size());
  std::int64_t stride = 1;
  for (int d = view.rank - 1; d >= 0; --d) {
    view.shape[d] = shape[d];
    view.strides[d] = stride;
    stride *= shape[d];
  }
  return view;
}
}  // namespace

MutableTensorView Tensor::view() {
  return make_view<MutableTensorView>(data(), dtype_, shape_);
}
TensorView Tensor::view() const { return make_view<TensorView>(data(), dtype_, shape_); }

float Tensor::get(std::int64_t i) const {
  switch (dtype_) {
    case DType::f32: return data_as<float>()[i];
    case DType::bf16: return bf16_to_float(data_as<std::uint16_t>()[i]);
    case DType::f16: return f16_to_float(data_as<std::uint16_t>()[i]);
    case DType::i32: return static_cast<float>(data_as<std::int32_t>()[i]);
    case DType::u8: return static_cast<float>(data_as<std::uint8_t>()[i]);
  }
  return 0.0f;
}

void Tensor::set(std::int64_t i, float value) {
  switch (dtype_) {
    case DType::f32: data_as<float>()[i] = value; break;
    case DType::bf16: data_as<std::uint16_t>()[i] = float_to_bf16(value); break;
    case DType::f16: data_as<std::uint16_t>()[i] = float_to_f16(value); break;
    case DType::i32: data_as<std::int32_t>()[i] = static_cast<std::int32_t>(value); break;
    case DType::u8: data_as<std::uint8_t>()[i] = static_cast<std::uint8_t>(value); break;
  }
}

}  // namespace flashattn
