// AVX512-BF16 micro-kernel (bf16_dot.hpp). Every function that uses the instructions
// carries them in its target attribute: this file is compiled for the baseline ISA, and
// nothing here is inlined into code that runs on CPUs without them.
#include "src/cpu/bf16_dot.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>

namespace flashattn::cpu::bf16dot {
namespace {

#define FLASHATTN_BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))

// C(kRows × kCols) = scale·A·B, or C += A·B when kAccumulate.
template <bool kAccumulate>
FLASHATTN_BF16_TARGET inline __attribute__((always_inline)) void Tile(const std::uint16_t* a, std::int64_t lda,
                                                                      const std::uint16_t* b, std::int64_t pairs,
                                                                      float scale, float* c, std::int64_t ldc) {
  __m512 acc[kRows][2];
  for (std::int64_t r = 0; r < kRows; ++r)
    for (std::int64_t v = 0; v < 2; ++v)
      acc[r][v] = kAccumulate ? _mm512_load_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (std::int64_t p = 0; p < pairs; ++p, b += kPairStep) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(b);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(b + kCols);
    for (std::int64_t r = 0; r < kRows; ++r) {
      std::uint32_t pair;  // row r's elements 2p and 2p + 1
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (std::int64_t r = 0; r < kRows; ++r)
    for (std::int64_t v = 0; v < 2; ++v)
      _mm512_store_ps(c + r * ldc + 16 * v, kAccumulate ? acc[r][v] : _mm512_mul_ps(acc[r][v], vscale));
}

}  // namespace

bool available() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return has;
}

FLASHATTN_BF16_TARGET void DotStore(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b,
                                    std::int64_t pairs, float scale, float* c, std::int64_t ldc) {
  Tile<false>(a, lda, b, pairs, scale, c, ldc);
}

FLASHATTN_BF16_TARGET void DotAccumulate(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b,
                                         std::int64_t pairs, float* c, std::int64_t ldc) {
  Tile<true>(a, lda, b, pairs, 1.0f, c, ldc);
}

FLASHATTN_BF16_TARGET void RoundToBf16(const float* src, std::uint16_t* dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; i += kCols) {
    // Lanes 0..15 of the result come from the second operand, 16..31 from the first.
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, (__m512i)h);
  }
}

bool outpaces_fma() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return available() && amd;
}

#undef FLASHATTN_BF16_TARGET

}  // namespace flashattn::cpu::bf16dot

#else  // AVX512-BF16 is x86-only: elsewhere the bf16 tiled kernel is never planned

namespace flashattn::cpu::bf16dot {
bool available() { return false; }
bool outpaces_fma() { return false; }
}  // namespace flashattn::cpu::bf16dot

#endif
