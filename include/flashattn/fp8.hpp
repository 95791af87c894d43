// 8-bit floats (OCP FP8, docs/algorithm.md §4): the formats, their conversions, and FP8 tensors with
// descale factors — per tensor or per block of rows — as an FP8 attention or an FP8 KV
// cache stores them.
//
//   e4m3 ("E4M3FN"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448, min normal
//                    2^-6, min subnormal 2^-9; no infinities, NaN = S.1111.111.
//   e5m2:            1 sign, 5 exponent (bias 15), 2 mantissa bits; max 57344, min normal
//                    2^-14, min subnormal 2^-16; IEEE-style ±∞ (S.11111.00) and NaNs.
//
// Conversion from float rounds to nearest, ties to even, and saturates: magnitudes above
// the format's max, ±∞ included, become ±max (CUDA's "satfinite"); NaN stays NaN (e4m3
// 0x7F, e5m2 0x7E, with the input's sign).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "flashattn/tensor.hpp"

namespace flashattn {

enum class Fp8Format : std::uint8_t { e4m3, e5m2 };
const char* to_string(Fp8Format format);
// Parses "e4m3" or "e5m2"; throws Error otherwise.
Fp8Format parse_fp8_format(const std::string& name);

struct Fp8Info {
  int mantissa_bits;
  int bias;
  float max;         // largest finite magnitude
  float min_normal;  // 2^(1 − bias)
  std::uint8_t max_code;  // code of +max
  std::uint8_t nan_code;  // canonical +NaN
};
constexpr Fp8Info fp8_info(Fp8Format format) {
  return format == Fp8Format::e4m3 ? Fp8Info{3, 7, 448.0f, 0x1p-6f, 0x7E, 0x7F}
                                   : Fp8Info{2, 15, 57344.0f, 0x1p-14f, 0x7B, 0x7E};
}

// Scalar conversions (the definition; the bulk ones below are vectorised and equal).
float fp8_to_float(std::uint8_t code, Fp8Format format);
std::uint8_t float_to_fp8(float value, Fp8Format format);

// Bulk conversions on the CPU's SIMD units: dst[i] = float_to_fp8(src[i]·scale) and
// dst[i] = fp8_to_float(src[i])·descale.
void convert_to_fp8(const float* src, std::uint8_t* dst, std::size_t n, Fp8Format format,
                    float scale = 1.0f);
void convert_from_fp8(const std::uint8_t* src, float* dst, std::size_t n, Fp8Format format,
                      float descale = 1.0f);

// A read-only FP8 tensor of attention layout (batch, seqlen, heads, dim): u8 codes and
// float32 descale factors, value = fp8_to_float(code)·descale. Per tensor (block_size 0):
// descale has shape (1). Per block: one descale per block_size consecutive rows of one
// (batch, head), shape (batch, heads, ceil(seqlen / block_size)) — the kernel's tiles.
struct Fp8View {
  TensorView codes;
  TensorView descale;
  Fp8Format format = Fp8Format::e4m3;
  std::int64_t block_size = 0;
};

// An owning FP8 tensor, as quantize_fp8 makes it.
struct Fp8Tensor {
  Tensor codes;
  Tensor descale;
  Fp8Format format = Fp8Format::e4m3;
  std::int64_t block_size = 0;
  Fp8View view() const { return {codes.view(), descale.view(), format, block_size}; }
};

// Quantizes a floating (batch, seqlen, heads, dim) tensor: each tensor (block_size 0) or
// block is scaled so that its largest magnitude becomes the format's max (descale =
// max(amax / max, FLT_MIN), so that 1 / descale is finite; an all-zero block gets descale 1). Throws Error naming the element when x
// holds a NaN or ±∞ (no finite scale could represent it).
Fp8Tensor quantize_fp8(const TensorView& x, Fp8Format format, std::int64_t block_size = 0);

// The float32 values an FP8 tensor stands for, shape of its codes. Validates the view:
// u8 codes of rank 4, none of them NaN (nor, in e5m2, ±∞), descale float32 of the shape its
// block_size implies, every descale finite and > 0.
Tensor dequantize_fp8(const Fp8View& x);

}  // namespace flashattn
