// Scalar element access through a view, for the reference and other non-hot paths.
#pragma once

#include <cstdint>

#include "flashattn/tensor.hpp"

namespace flashattn::detail {

inline std::int64_t offset4(const TensorView& v, std::int64_t i0, std::int64_t i1,
                            std::int64_t i2, std::int64_t i3) {
  return i0 * v.strides[0] + i1 * v.strides[1] + i2 * v.strides[2] + i3 * v.strides[3];
}

inline float load_element(const TensorView& v, std::int64_t offset) {
  switch (v.dtype) {
    case DType::f32: return static_cast<const float*>(v.data)[offset];
    case DType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(v.data)[offset]);
    case DType::f16: return f16_to_float(static_cast<const std::uint16_t*>(v.data)[offset]);
    case DType::i32: return static_cast<float>(static_cast<const std::int32_t*>(v.data)[offset]);
    case DType::u8: return static_cast<float>(static_cast<const std::uint8_t*>(v.data)[offset]);
  }
  return 0.0f;
}

inline void store_element(const MutableTensorView& v, std::int64_t offset, float value) {
  switch (v.dtype) {
    case DType::f32: static_cast<float*>(v.data)[offset] = value; break;
    case DType::bf16: static_cast<std::uint16_t*>(v.data)[offset] = float_to_bf16(value); break;
    case DType::f16: static_cast<std::uint16_t*>(v.data)[offset] = float_to_f16(value); break;
    case DType::i32: static_cast<std::int32_t*>(v.data)[offset] = static_cast<std::int32_t>(value); break;
    case DType::u8: static_cast<std::uint8_t*>(v.data)[offset] = static_cast<std::uint8_t>(value); break;
  }
}

}  // namespace flashattn::detail
