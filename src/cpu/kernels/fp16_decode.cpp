// AVX512-FP16 products of the FP8 decode (fp16_decode.hpp). This file alone is compiled with
// -mavx512fp16 (CMakeLists.txt): clang, unlike GCC, declares the half-precision vector types
// only then. Nothing in it runs before available() (plan.cpp) has said the CPU has them.
#include "src/cpu/kernels/fp16_decode.hpp"

#if defined(__AVX512FP16__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace flashattn::cpu::fp16dot {
namespace {

// The first min(n, 32) codes from p as halves (fp16_decode.hpp), zeros past n. e4m3: 2^-8
// times their values (subnormal codes to subnormal halves, exactly) — sign-extended to 16
// bits, the sign, exponent and mantissa move up by 7 and the sign's copy at bit 14 is
// cleared; s8: the integers; u8: code − 128, the bytes' top bit flipped and read as s8.
template <KvCodes C>
inline __attribute__((always_inline)) __m512h LoadCodes(const unsigned char* p, std::int64_t n) {
  __m256i bytes = n >= kHalves ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                               : _mm256_maskz_loadu_epi8((1u << n) - 1u, p);
  if constexpr (C == KvCodes::u8) bytes = _mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m512i words = _mm512_cvtepi8_epi16(bytes);
  if constexpr (C == KvCodes::e4m3)
    return _mm512_castsi512_ph(_mm512_and_si512(_mm512_slli_epi16(words, 7), _mm512_set1_epi16(static_cast<short>(0xBFFF))));
  else
    return _mm512_cvtepi16_ph(words);
}

// Lane 4·block + k holds block `block`'s part of Σ a_k, in float: within every 128-bit block
// the four vectors' halves interleave and add down, in half precision (two more roundings),
// to eight halves — two sets of the four vectors' partial sums — which widen to float and add.
inline __attribute__((always_inline)) __m512 KeySums4(__m512h a0, __m512h a1, __m512h a2,
                                                                           __m512h a3) {
  const __m512i w0 = _mm512_castph_si512(a0), w1 = _mm512_castph_si512(a1);
  const __m512i w2 = _mm512_castph_si512(a2), w3 = _mm512_castph_si512(a3);
  const __m512h t01 = _mm512_add_ph(_mm512_castsi512_ph(_mm512_unpacklo_epi16(w0, w1)), _mm512_castsi512_ph(_mm512_unpackhi_epi16(w0, w1)));
  const __m512h t23 = _mm512_add_ph(_mm512_castsi512_ph(_mm512_unpacklo_epi16(w2, w3)), _mm512_castsi512_ph(_mm512_unpackhi_epi16(w2, w3)));
  const __m512i u01 = _mm512_castph_si512(t01), u23 = _mm512_castph_si512(t23);
  const __m512i sums = _mm512_castph_si512(_mm512_add_ph(_mm512_castsi512_ph(_mm512_unpacklo_epi32(u01, u23)),
                                                         _mm512_castsi512_ph(_mm512_unpackhi_epi32(u01, u23))));
  return _mm512_add_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(sums)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(sums, 1)));
}

// The four blocks of v added: [Σ lane 4b + i over blocks b], i < 4.
inline __attribute__((always_inline)) __m128 FoldBlocks(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

}  // namespace

void PackQ4(const float* q, std::int64_t ldq, std::int64_t rows, std::int64_t d, int top, std::uint16_t* panel,
            float* unit) {
  const std::int64_t vectors = (d + kHalves - 1) / kHalves;
  for (std::int64_t r = 0; r < 4; ++r) {
    const int shift = RowShift(q + r * ldq, d, r < rows, top);
    unit[r] = std::ldexp(1.0f, -shift);
    const __m512 scale = _mm512_set1_ps(std::ldexp(1.0f, shift));
    for (std::int64_t j = 0; j < vectors; ++j)
      for (std::int64_t half = 0; half < 2; ++half) {
        const std::int64_t e = j * kHalves + 16 * half, left = r < rows ? std::clamp<std::int64_t>(d - e, 0, 16) : 0;
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1u), q + r * ldq + e), scale);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + (4 * j + r) * kHalves + 16 * half),
                            _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
  }
}

namespace {

// The scores of one panel (four rows) and four K rows: s[r·lds + k] for k < count.
template <KvCodes C>
inline __attribute__((always_inline)) void ScorePanel(const std::uint16_t* panel, const unsigned char* const* row,
                                                      std::int64_t count, std::int64_t d, float* s, std::int64_t lds) {
  __m512h acc[4][4];  // [key][row]
  for (auto& key : acc)
    for (__m512h& a : key) a = _mm512_setzero_ph();
  for (std::int64_t e = 0; e < d; e += kHalves, panel += 4 * kHalves)
    for (std::int64_t k = 0; k < 4; ++k) {
      const __m512h v = LoadCodes<C>(row[k] + e, d - e);
      for (std::int64_t r = 0; r < 4; ++r) acc[k][r] = _mm512_fmadd_ph(_mm512_loadu_ph(panel + r * kHalves), v, acc[k][r]);
    }
  alignas(16) float sums[4][4];  // [row][key]
  for (std::int64_t r = 0; r < 4; ++r) _mm_store_ps(sums[r], FoldBlocks(KeySums4(acc[0][r], acc[1][r], acc[2][r], acc[3][r])));
  for (std::int64_t r = 0; r < 4; ++r)
    for (std::int64_t k = 0; k < count; ++k) s[r * lds + k] = sums[r][k];
}

template <KvCodes C>
void ScoreCodes4(const std::uint16_t* panels, std::int64_t panel_count, std::int64_t head_panels,
                 const unsigned char* const* krows, std::int64_t k_head, std::int64_t count, std::int64_t d, float* s,
                 std::int64_t lds, const Fetch& fetch) {
  const std::int64_t panel_halves = 4 * ((d + kHalves - 1) / kHalves) * kHalves;
  const unsigned char* row[4];
  for (std::int64_t i = 0; i < panel_count; ++i) {
    StartHead(fetch, i, head_panels, krows, k_head, count, row);
    ScorePanel<C>(panels + i * panel_halves, row, count, d, s + i * 4 * lds, lds);
  }
}

// The code format as a template argument: fn(integral_constant<C>).
template <class Fn>
inline __attribute__((always_inline)) void WithCodes(KvCodes codes, Fn fn) {
  switch (codes) {
    case KvCodes::e4m3: return fn(std::integral_constant<KvCodes, KvCodes::e4m3>());
    case KvCodes::u8: return fn(std::integral_constant<KvCodes, KvCodes::u8>());
    case KvCodes::s8: return fn(std::integral_constant<KvCodes, KvCodes::s8>());
  }
}

}  // namespace

void ScoreKeys4(KvCodes codes, const std::uint16_t* panels, std::int64_t panel_count, std::int64_t head_panels,
                const unsigned char* const* krows, std::int64_t k_head, std::int64_t count, std::int64_t d, float* s,
                std::int64_t lds, const Fetch& fetch) {
  WithCodes(codes, [&](auto c) {
    ScoreCodes4<decltype(c)::value>(panels, panel_count, head_panels, krows, k_head, count, d, s, lds, fetch);
  });
}

void PairHalves(const float* src, std::uint32_t* dst, std::int64_t n) {
  for (std::int64_t c = 0; c < n; c += 16) {
    const auto mask = static_cast<__mmask16>(n - c >= 16 ? 0xFFFF : (1u << (n - c)) - 1u);
    const __m512i h = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(_mm512_maskz_loadu_ps(mask, src + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm512_mask_storeu_epi32(dst + c, mask, _mm512_or_si512(h, _mm512_slli_epi32(h, 16)));
  }
}

namespace {

template <KvCodes C>
void AccumulateCodes4(const std::uint32_t* p, std::int64_t ldp, const unsigned char* const* vrows, std::int64_t offset,
                      std::int64_t n, std::int64_t dv, float unit, float* o, std::int64_t ldo) {
  const __m512 vunit = _mm512_set1_ps(unit);
  for (std::int64_t e = 0; e < dv; e += kHalves) {
    const std::int64_t left = std::min<std::int64_t>(kHalves, dv - e);
    const auto m0 = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1u);
    const auto m1 = static_cast<__mmask16>(left >= 32 ? 0xFFFF : left <= 16 ? 0 : (1u << (left - 16)) - 1u);
    __m512 lo[4], hi[4];  // õ rows, columns [e, e + 16) and [e + 16, e + 32)
    for (std::int64_t r = 0; r < 4; ++r) {
      lo[r] = _mm512_maskz_loadu_ps(m0, o + r * ldo + e);
      hi[r] = _mm512_maskz_loadu_ps(m1, o + r * ldo + e + 16);
    }
    for (std::int64_t c0 = 0; c0 < n; c0 += 2 * kAccumulateKeys) {
      // Two runs of kAccumulateKeys keys, each summed in order, then added: as exact as one
      // run (a rounding more), for half the conversions to float; and taken in step, eight
      // FMA chains, for the FMA latency.
      __m512h acc[2][4];
      for (auto& run : acc)
        for (__m512h& a : run) a = _mm512_setzero_ph();
      auto step = [&](__m512h(&a)[4], std::int64_t c) {
        const __m512h v = LoadCodes<C>(vrows[c] + offset + e, left);
        for (std::int64_t r = 0; r < 4; ++r)
          a[r] = _mm512_fmadd_ph(_mm512_castsi512_ph(_mm512_set1_epi32(static_cast<int>(p[r * ldp + c]))), v, a[r]);
      };
      if (n - c0 >= 2 * kAccumulateKeys) {
        for (std::int64_t i = 0; i < kAccumulateKeys; ++i) {
          step(acc[0], c0 + i);
          step(acc[1], c0 + kAccumulateKeys + i);
        }
      } else {
        for (std::int64_t c = c0; c < std::min(c0 + kAccumulateKeys, n); ++c) step(acc[0], c);
        for (std::int64_t c = c0 + kAccumulateKeys; c < n; ++c) step(acc[1], c);
      }
      for (std::int64_t r = 0; r < 4; ++r) {
        const __m512i bits = _mm512_castph_si512(_mm512_add_ph(acc[0][r], acc[1][r]));
        lo[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(bits)), vunit, lo[r]);
        hi[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1)), vunit, hi[r]);
      }
    }
    for (std::int64_t r = 0; r < 4; ++r) {
      _mm512_mask_storeu_ps(o + r * ldo + e, m0, lo[r]);
      _mm512_mask_storeu_ps(o + r * ldo + e + 16, m1, hi[r]);
    }
  }
}

}  // namespace

void AccumulateRows4(KvCodes codes, const std::uint32_t* p, std::int64_t ldp, const unsigned char* const* vrows,
                     std::int64_t offset, std::int64_t n, std::int64_t dv, float unit, float* o, std::int64_t ldo) {
  WithCodes(codes, [&](auto c) { AccumulateCodes4<decltype(c)::value>(p, ldp, vrows, offset, n, dv, unit, o, ldo); });
}

}  // namespace flashattn::cpu::fp16dot

#else  // a compiler without -mavx512fp16, or not x86: decode_fp16 is never planned (available())

namespace flashattn::cpu::fp16dot {
void PackQ4(const float*, std::int64_t, std::int64_t, std::int64_t, int, std::uint16_t*, float*) {}
void ScoreKeys4(KvCodes, const std::uint16_t*, std::int64_t, std::int64_t, const unsigned char* const*, std::int64_t, std::int64_t,
                std::int64_t, float*, std::int64_t, const Fetch&) {}
void PairHalves(const float*, std::uint32_t*, std::int64_t) {}
void AccumulateRows4(KvCodes, const std::uint32_t*, std::int64_t, const unsigned char* const*, std::int64_t, std::int64_t,
                     std::int64_t, float, float*, std::int64_t) {}
}  // namespace flashattn::cpu::fp16dot

#endif
