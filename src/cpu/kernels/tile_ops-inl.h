// Tile operations shared by the CPU kernels, compiled once per Highway target: the
// register-blocked micro-kernel behind every matrix product, and row loads/stores that
// convert from and to the storage dtype. Include inside the per-target section.
#if defined(FLASHATTN_CPU_TILE_OPS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHATTN_CPU_TILE_OPS_INL_H_
#undef FLASHATTN_CPU_TILE_OPS_INL_H_
#else
#define FLASHATTN_CPU_TILE_OPS_INL_H_
#endif

#include <hwy/highway.h>

#include <cmath>
#include <cstdint>

#include "flashattn/fp8.hpp"
#include "flashattn/kv_quant.hpp"
#include "flashattn/tensor.hpp"
#include "src/core/element.hpp"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Register blocking of the micro-kernel C(rows × 2 vectors) += A·B. Each step of the
// depth loop loads 2 vectors of B, broadcasts one A value per row and issues rows × 2
// FMAs into independent accumulators. With 2 FMA ports of 4-cycle latency at least 8
// must be in flight. AVX-512 has 32 registers: 8 rows → 16 accumulators + 2 B vectors
// + a broadcast. AVX2 has 16: 6 rows → 12 accumulators + 2 B vectors + a broadcast
// (the classic 6×16 sgemm tile). The 128-bit targets take 4 rows.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr std::int64_t kMicroRows = 8;
#elif HWY_TARGET == HWY_AVX2
constexpr std::int64_t kMicroRows = 6;
#else
constexpr std::int64_t kMicroRows = 4;
#endif
constexpr std::int64_t kMicroVecs = 2;
constexpr std::int64_t kLanes = HWY_LANES(float);
constexpr std::int64_t kMicroCols = kMicroVecs * kLanes;

// A matrix operand read one broadcast scalar at a time: element (r, p) is at
// data[r·row_stride + p·col_stride], so a transposed operand (Pᵀ, dSᵀ in the backward
// pass) needs no copy.
struct MatA {
  const float* data;
  std::int64_t row_stride;
  std::int64_t col_stride = 1;
  MatA rows_from(std::int64_t r) const { return {data + r * row_stride, row_stride, col_stride}; }
};

// The half-height micro-tile's rows: a strip of a Q tile with no more real rows than this
// computes only these (the tiled forward's float32 products), not kMicroRows of which most pad.
constexpr std::int64_t kTailRows = kMicroRows / 2;

// C(kRows × kMicroCols) (+)= A(kRows × depth) · B(depth × kMicroCols), kRows kMicroRows or
// kTailRows. B and C rows are vector-aligned.
template <bool kAccumulate, std::int64_t kRows = kMicroRows>
HWY_INLINE void MicroTile(MatA a, const float* HWY_RESTRICT b, std::int64_t ldb,
                          float* HWY_RESTRICT c, std::int64_t ldc, std::int64_t depth) {
  const DF df;
  VF acc[kRows][kMicroVecs];
  for (std::int64_t r = 0; r < kRows; ++r)
    for (std::int64_t v = 0; v < kMicroVecs; ++v)
      acc[r][v] = kAccumulate ? hn::Load(df, c + r * ldc + v * kLanes) : hn::Zero(df);
  for (std::int64_t p = 0; p < depth; ++p) {
    VF bv[kMicroVecs];
    for (std::int64_t v = 0; v < kMicroVecs; ++v) bv[v] = hn::Load(df, b + p * ldb + v * kLanes);
    for (std::int64_t r = 0; r < kRows; ++r) {
      const VF ar = hn::Set(df, a.data[r * a.row_stride + p * a.col_stride]);
      for (std::int64_t v = 0; v < kMicroVecs; ++v) acc[r][v] = hn::MulAdd(ar, bv[v], acc[r][v]);
    }
  }
  for (std::int64_t r = 0; r < kRows; ++r)
    for (std::int64_t v = 0; v < kMicroVecs; ++v) hn::Store(acc[r][v], df, c + r * ldc + v * kLanes);
}

// C(rows × cols) (+)= A(rows × depth) · B(depth × cols); rows and cols are multiples of
// the micro-tile. Column panels outermost so one B panel stays in L1 across row strips.
// B's panel of columns [j, j + kMicroCols) starts at b + (j / kMicroCols)·panel_stride and
// its rows are ldb floats apart: a row-major B has panel_stride kMicroCols; a B packed as
// contiguous panels has ldb kMicroCols and panel_stride depth·kMicroCols (or more).
template <bool kAccumulate>
HWY_INLINE void TileGemm(MatA a, const float* HWY_RESTRICT b, std::int64_t ldb, float* HWY_RESTRICT c,
                         std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t depth,
                         std::int64_t panel_stride = kMicroCols) {
  for (std::int64_t j = 0; j < cols; j += kMicroCols)
    for (std::int64_t i = 0; i < rows; i += kMicroRows)
      MicroTile<kAccumulate>(a.rows_from(i), b + j / kMicroCols * panel_stride, ldb, c + i * ldc + j, ldc, depth);
}

// FP8 e4m3 codes, sign-extended to 16-bit lanes, as the bits of the halves (f16) whose
// values are 2^-8 times theirs: a code shifted up by 7 holds the sign in bits 15 and 14
// and exponent and mantissa in bits 13..7; without bit 14 it is that half (exponent bias
// 15 against 7), subnormal codes included. Halves widen to float exactly — subnormal ones
// to normal floats, so reading codes does not depend on the denormals-are-zero mode. Code
// 0x7F (NaN) reads as 480·2^-8: appends never store it.
constexpr float kE4m3HalfUnit = 256.0f;
template <class D16>
HWY_INLINE hn::Vec<D16> E4m3HalfBits(D16 d16, hn::Vec<D16> codes) {
  return hn::And(hn::ShiftLeft<7>(codes), hn::Set(d16, static_cast<std::int16_t>(0xBFFF)));
}

// dst[0, n) = scale · src[0, n), converting from the storage dtype once.
HWY_INLINE void LoadRow(const void* src, DType dtype, std::int64_t n, float scale, float* HWY_RESTRICT dst) {
  const DF df;
  const VF vscale = hn::Set(df, scale);
  std::int64_t i = 0;
  switch (dtype) {
    case DType::f32: {
      const float* s = static_cast<const float*>(src);
      for (; i + kLanes <= n; i += kLanes) hn::StoreU(hn::Mul(hn::LoadU(df, s + i), vscale), df, dst + i);
      for (; i < n; ++i) dst[i] = s[i] * scale;
      break;
    }
    case DType::bf16: {
      const hn::Rebind<hwy::bfloat16_t, DF> dbf;
      const auto* s = static_cast<const hwy::bfloat16_t*>(src);
      for (; i + kLanes <= n; i += kLanes)
        hn::StoreU(hn::Mul(hn::PromoteTo(df, hn::LoadU(dbf, s + i)), vscale), df, dst + i);
      for (; i < n; ++i) dst[i] = bf16_to_float(static_cast<const std::uint16_t*>(src)[i]) * scale;
      break;
    }
    case DType::f16: {
      const hn::Rebind<hwy::float16_t, DF> dh;
      const auto* s = static_cast<const hwy::float16_t*>(src);
      for (; i + kLanes <= n; i += kLanes)
        hn::StoreU(hn::Mul(hn::PromoteTo(df, hn::LoadU(dh, s + i)), vscale), df, dst + i);
      for (; i < n; ++i) dst[i] = f16_to_float(static_cast<const std::uint16_t*>(src)[i]) * scale;
      break;
    }
    case DType::u8: {  // FP8 e4m3 codes of a KV cache (value = code · scale)
      // As halves 2^-8 times the values (E4m3HalfBits); times 2^8 exactly, then the scale:
      // one rounding, as fp8_to_float(code) · scale.
      const hn::Rebind<std::int8_t, DF> d8;
      const hn::Rebind<std::int16_t, DF> d16;
      const hn::Rebind<hwy::float16_t, DF> dh;
      const VF vunit = hn::Set(df, kE4m3HalfUnit);
      const auto* s = static_cast<const std::int8_t*>(src);
      for (; i + kLanes <= n; i += kLanes) {
        const auto bits = E4m3HalfBits(d16, hn::PromoteTo(d16, hn::LoadU(d8, s + i)));
        hn::StoreU(hn::Mul(hn::Mul(hn::PromoteTo(df, hn::BitCast(dh, bits)), vunit), vscale), df, dst + i);
      }
      for (; i < n; ++i) dst[i] = fp8_to_float(static_cast<std::uint8_t>(s[i]), Fp8Format::e4m3) * scale;
      break;
    }
    case DType::i32: break;  // never an attention operand: rejected by validation
  }
}

// dst[0, n) = the values of n int8 KV-cache codes (u8, or s8 read as two's complement):
// (code − zero_point)·scale, as int8_code_value (kv_quant.hpp) defines them.
HWY_INLINE void LoadInt8Row(const void* src, KvCodes codes, std::int64_t n, float scale, float zero_point,
                            float* HWY_RESTRICT dst) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const VF vscale = hn::Set(df, scale);
  const auto* bytes = static_cast<const std::uint8_t*>(src);
  std::int64_t i = 0;
  if (codes == KvCodes::s8) {
    const hn::Rebind<std::int8_t, DF> d8;
    const auto* s = static_cast<const std::int8_t*>(src);
    for (; i + kLanes <= n; i += kLanes)
      hn::StoreU(hn::Mul(hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, s + i))), vscale), df, dst + i);
  } else {
    const hn::Rebind<std::uint8_t, DF> d8;
    const VF vzero = hn::Set(df, zero_point);
    for (; i + kLanes <= n; i += kLanes)
      hn::StoreU(hn::Mul(hn::Sub(hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, bytes + i))), vzero), vscale), df,
                 dst + i);
  }
  for (; i < n; ++i) dst[i] = int8_code_value(codes, bytes[i], scale, zero_point);
}

HWY_INLINE const void* RowPointer(const TensorView& t, std::int64_t b, std::int64_t s, std::int64_t h) {
  return static_cast<const unsigned char*>(t.data) +
         detail::offset4(t, b, s, h, 0) * static_cast<std::int64_t>(dtype_size(t.dtype));
}

HWY_INLINE void StoreRow(const float* HWY_RESTRICT src, std::int64_t n, float scale, void* dst, DType dtype) {
  switch (dtype) {
    case DType::f32: {
      float* d = static_cast<float*>(dst);
      for (std::int64_t i = 0; i < n; ++i) d[i] = src[i] * scale;
      break;
    }
    case DType::bf16: {
      // float_to_bf16 a vector at a time: round to nearest even by adding 0x7FFF plus the
      // lowest kept bit; a NaN keeps its high half, quieted.
      const DF df;
      const hn::RebindToUnsigned<DF> du;
      const hn::RebindToSigned<DF> di;
      const hn::Rebind<std::uint16_t, DF> du16;
      const VF vscale = hn::Set(df, scale);
      auto* d = static_cast<std::uint16_t*>(dst);
      std::int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        const VF x = hn::Mul(hn::LoadU(df, src + i), vscale);
        const auto bits = hn::BitCast(du, x);
        const auto high = hn::ShiftRight<16>(bits);
        const auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(hn::And(high, hn::Set(du, 1u)), hn::Set(du, 0x7FFFu))));
        const auto quiet = hn::Or(high, hn::Set(du, 0x40u));
        const auto result = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(x)), quiet, rounded);
        hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, result)), du16, d + i);  // values below 2^16: exact
      }
      for (; i < n; ++i) d[i] = float_to_bf16(src[i] * scale);
      break;
    }
    case DType::f16:
      for (std::int64_t i = 0; i < n; ++i)
        static_cast<std::uint16_t*>(dst)[i] = float_to_f16(src[i] * scale);
      break;
    case DType::i32:
    case DType::u8: break;  // never attention outputs: rejected by validation
  }
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
