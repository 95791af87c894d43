// Bulk FP8 conversions on the SIMD units (dispatched once per call) and the FP8 tensors
// built on them: quantization with per-tensor or per-block scales, and dequantization.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/cpu/fp8_convert.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "src/cpu/kernels/fp8-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void ConvertToFp8(const float* HWY_RESTRICT src, std::uint8_t* HWY_RESTRICT dst, std::size_t n, Fp8Format format,
                  float scale) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<std::uint8_t, decltype(df)> d8;
  const hn::RebindToSigned<decltype(df)> di;
  const std::size_t lanes = hn::Lanes(df);
  const auto vscale = hn::Set(df, scale);
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto code = EncodeFp8(df, hn::Mul(hn::LoadU(df, src + i), vscale), format);
    hn::StoreU(hn::DemoteTo(d8, hn::BitCast(di, code)), d8, dst + i);  // codes are 0..255
  }
  for (; i < n; ++i) dst[i] = float_to_fp8(src[i] * scale, format);
}

void ConvertFromFp8(const std::uint8_t* HWY_RESTRICT src, float* HWY_RESTRICT dst, std::size_t n, Fp8Format format,
                    float descale) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<std::uint8_t, decltype(df)> d8;
  const hn::RebindToUnsigned<decltype(df)> du;
  const std::size_t lanes = hn::Lanes(df);
  const auto vdescale = hn::Set(df, descale);
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes)
    hn::StoreU(hn::Mul(DecodeFp8(df, hn::PromoteTo(du, hn::LoadU(d8, src + i)), format), vdescale), df, dst + i);
  for (; i < n; ++i) dst[i] = fp8_to_float(src[i], format) * descale;
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "flashattn/error.hpp"
#include "src/core/element.hpp"
#include "src/core/validate.hpp"
#include "src/cpu/drivers.hpp"

namespace flashattn {
namespace cpu {
HWY_EXPORT(ConvertToFp8);
HWY_EXPORT(ConvertFromFp8);
}  // namespace cpu

void convert_to_fp8(const float* src, std::uint8_t* dst, std::size_t n, Fp8Format format, float scale) {
  HWY_DYNAMIC_DISPATCH(cpu::ConvertToFp8)(src, dst, n, format, scale);
}

void convert_from_fp8(const std::uint8_t* src, float* dst, std::size_t n, Fp8Format format, float descale) {
  HWY_DYNAMIC_DISPATCH(cpu::ConvertFromFp8)(src, dst, n, format, descale);
}

namespace {

constexpr const char* kLayout = "(batch, seqlen, heads, dim)";

// Descale blocks per (b, h): one per tensor (block_size 0).
std::int64_t descale_blocks(std::int64_t seqlen, std::int64_t block_size) {
  return block_size == 0 ? 1 : blocks_of(seqlen, block_size);
}

// Index into descale of row s of (b, h): 0 per tensor.
std::int64_t descale_index(const TensorView& x, std::int64_t block_size, std::int64_t b, std::int64_t s,
                           std::int64_t h) {
  if (block_size == 0) return 0;
  return (b * x.shape[2] + h) * descale_blocks(x.shape[1], block_size) + s / block_size;
}

}  // namespace

Fp8Tensor quantize_fp8(const TensorView& x, Fp8Format format, std::int64_t block_size) {
  detail::check_view("x", x, 4, kLayout);
  if (!is_floating(x.dtype)) throw Error("x: dtype " + to_string(x.dtype) + " is not a floating dtype");
  if (block_size < 0)
    throw Error("block_size: must be >= 0 (0 = one scale per tensor), got " + std::to_string(block_size));
  const std::int64_t batch = x.shape[0], seqlen = x.shape[1], heads = x.shape[2], dim = x.shape[3];
  Fp8Tensor result{Tensor(DType::u8, {batch, seqlen, heads, dim}),
                   block_size == 0 ? Tensor(DType::f32, {1})
                                   : Tensor(DType::f32, {batch, heads, descale_blocks(seqlen, block_size)}),
                   format, block_size};
  float* descale = result.descale.data_as<float>();
  std::fill(descale, descale + result.descale.numel(), 0.0f);  // amax first
  std::vector<float> row(static_cast<std::size_t>(dim));
  auto load = [&](std::int64_t b, std::int64_t s, std::int64_t h) {
    for (std::int64_t c = 0; c < dim; ++c) row[c] = detail::load_element(x, detail::offset4(x, b, s, h, c));
  };
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s < seqlen; ++s)
      for (std::int64_t h = 0; h < heads; ++h) {
        load(b, s, h);
        float& amax = descale[descale_index(x, block_size, b, s, h)];
        for (std::int64_t c = 0; c < dim; ++c) {
          if (!std::isfinite(row[c]))
            throw Error("x: element (" + std::to_string(b) + ", " + std::to_string(s) + ", " + std::to_string(h) +
                        ", " + std::to_string(c) + ") is " + std::to_string(row[c]) +
                        ": no finite FP8 scale represents it");
          amax = std::max(amax, std::fabs(row[c]));
        }
      }
  const float max = fp8_info(format).max;
  // At least FLT_MIN: 1 / descale stays finite (a block of tiny values would otherwise encode
  // its zeros as 0·∞ = NaN and the rest as ±max).
  for (std::int64_t e = 0; e < result.descale.numel(); ++e)
    descale[e] = descale[e] == 0.0f ? 1.0f : std::max(descale[e] / max, FLT_MIN);
  auto* codes = result.codes.data_as<std::uint8_t>();
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s < seqlen; ++s)
      for (std::int64_t h = 0; h < heads; ++h) {
        load(b, s, h);
        convert_to_fp8(row.data(), codes + ((b * seqlen + s) * heads + h) * dim, static_cast<std::size_t>(dim), format,
                       1.0f / descale[descale_index(x, block_size, b, s, h)]);
      }
  return result;
}

Tensor detail::dequantize_fp8(const char* name, const Fp8View& x) {
  check_fp8_input(name, x);
  const std::int64_t batch = x.codes.shape[0], seqlen = x.codes.shape[1], heads = x.codes.shape[2];
  const std::int64_t dim = x.codes.shape[3];
  auto descale_at = [&](std::int64_t b, std::int64_t h, std::int64_t block) {
    if (x.block_size == 0) return load_element(x.descale, 0);
    return load_element(x.descale, b * x.descale.strides[0] + h * x.descale.strides[1] + block * x.descale.strides[2]);
  };
  Tensor out(DType::f32, {batch, seqlen, heads, dim});
  float* dst = out.data_as<float>();
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s < seqlen; ++s)
      for (std::int64_t h = 0; h < heads; ++h)
        convert_from_fp8(static_cast<const std::uint8_t*>(x.codes.data) + offset4(x.codes, b, s, h, 0),
                         dst + ((b * seqlen + s) * heads + h) * dim, static_cast<std::size_t>(dim), x.format,
                         descale_at(b, h, x.block_size == 0 ? 0 : s / x.block_size));
  return out;
}

Tensor dequantize_fp8(const Fp8View& x) { return detail::dequantize_fp8("x", x); }

}  // namespace flashattn
#endif  // HWY_ONCE
