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
                                                                      std::int64_t a_pair_stride,
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
      std::memcpy(&pair, a + r * lda + p * a_pair_stride, sizeof pair);
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
  Tile<false>(a, lda, 2, b, pairs, scale, c, ldc);
}

FLASHATTN_BF16_TARGET void DotAccumulate(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b,
                                         std::int64_t pairs, float* c, std::int64_t ldc, std::int64_t a_pair_stride) {
  if (a_pair_stride == 2)  // the row-major case: the compiler folds the stride into the addressing
    Tile<true>(a, lda, 2, b, pairs, 1.0f, c, ldc);
  else
    Tile<true>(a, lda, a_pair_stride, b, pairs, 1.0f, c, ldc);
}

FLASHATTN_BF16_TARGET void PairRows(const float* row0, const float* row1, std::uint16_t* dst, std::int64_t n) {
  // Word k of the result takes element k of the rounded row0 (lanes 0..15 of the
  // conversion) and of row1 (lanes 16..31).
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (std::int64_t k = 0; k < n; k += 16) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row1 + k), _mm512_loadu_ps(row0 + k));
    _mm512_storeu_si512(dst + 2 * k, _mm512_permutexvar_epi16(interleave, (__m512i)h));
  }
}

FLASHATTN_BF16_TARGET void RoundToBf16(const float* src, std::uint16_t* dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; i += kCols) {
    // Lanes 0..15 of the result come from the second operand, 16..31 from the first.
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, (__m512i)h);
  }
}

FLASHATTN_BF16_TARGET void PairRowsBf16(const std::uint16_t* row0, const std::uint16_t* row1, std::uint16_t* dst,
                                        std::int64_t n) {
  // Indices below 32 pick row0's element, from 32 on row1's: words k of the two halves.
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                       5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (std::int64_t k = 0; k < n; k += 32) {
    const __m512i a = _mm512_loadu_si512(row0 + k), b = _mm512_loadu_si512(row1 + k);
    _mm512_storeu_si512(dst + 2 * k, _mm512_permutex2var_epi16(a, low, b));
    _mm512_storeu_si512(dst + 2 * k + 32, _mm512_permutex2var_epi16(a, high, b));
  }
}

#undef FLASHATTN_BF16_TARGET

}  // namespace flashattn::cpu::bf16dot

#else  // AVX512-BF16 is x86-only: elsewhere the bf16 tiled kernel is never planned

namespace flashattn::cpu::bf16dot {
bool available() { return false; }
}  // namespace flashattn::cpu::bf16dot

#endif
