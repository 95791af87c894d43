// AVX512-VNNI scores of the quantized decode over int8 K codes (int8_dot.hpp). This file is
// compiled for the baseline ISA; every function that uses the instructions carries them in its
// target attribute, and nothing here runs before available() (plan.cpp) has said the CPU has
// them.
#include "src/cpu/kernels/int8_dot.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "flashattn/problem.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

namespace flashattn::cpu::int8dot {
namespace {

#define FLASHATTN_INT8_DOT_TARGET __attribute__((target("avx512vnni,avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define FLASHATTN_INT8_DOT_INLINE FLASHATTN_INT8_DOT_TARGET inline __attribute__((always_inline))

constexpr std::int64_t kCodes = 32;  // codes per vector: one plane's half of a zmm
static_assert(fp16dot::kHalves * 2 == 2 * kCodes, "a panel vector is 64 bytes: two planes of 32 codes");
// The exactness bound of the header: a lane's sums stay far inside int32 and float32's 2^24
// steps of one at the largest head dim.
static_assert(AttentionProblem::kMaxHeadDim / 4 * 4 * 255 * (1 << (kTop - 8)) < (1 << 24), "hi sums exact");
static_assert(AttentionProblem::kMaxHeadDim / 4 * 4 * 255 * 128 < (1 << 25), "lo sums well inside int32");

// The min(n, 32) codes at p as unsigned bytes (s8: plus 128), zeros past n, in both halves.
template <KvCodes C>
FLASHATTN_INT8_DOT_INLINE __m512i LoadCodes(const unsigned char* p, std::int64_t n) {
  __m512i codes;
  if (n >= kCodes) {
    codes = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    const __m256i part = _mm256_maskz_loadu_epi8(static_cast<__mmask32>((1ull << n) - 1u), p);
    codes = _mm512_broadcast_i64x4(part);
  }
  if constexpr (C == KvCodes::s8) codes = _mm512_xor_si512(codes, _mm512_set1_epi8(static_cast<char>(0x80)));
  return codes;
}

// Lane 4·block + k holds block `block`'s part of Σ lanes of a_k: within every 128-bit block
// the four vectors' lanes interleave and add down (exact, in int32).
FLASHATTN_INT8_DOT_INLINE __m512i KeySums4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
}

// 256·(blocks 0 + 1) + (blocks 2 + 3) of KeySums4's result: the four keys' scores (the hi
// plane's sums in the low 256 bits, the lo plane's in the high) in float32: Σhi exact, Σlo and
// the sum each rounded once (int8_dot.hpp).
FLASHATTN_INT8_DOT_INLINE __m128 Scores(__m512i sums) {
  const __m256i hi = _mm512_castsi512_si256(sums), lo = _mm512_extracti64x4_epi64(sums, 1);
  const __m128i hi4 = _mm_add_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  const __m128i lo4 = _mm_add_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
  return _mm_fmadd_ps(_mm_cvtepi32_ps(hi4), _mm_set1_ps(256.0f), _mm_cvtepi32_ps(lo4));
}

// The scores of one panel (four rows) and four K rows: s[r·lds + k] for k < count.
template <KvCodes C>
FLASHATTN_INT8_DOT_INLINE void ScorePanel(const unsigned char* panel, const unsigned char* const* row,
                                          std::int64_t count, std::int64_t d, float* s, std::int64_t lds) {
  __m512i acc[4][4];  // [key][row]
  for (auto& key : acc)
    for (__m512i& a : key) a = _mm512_setzero_si512();
  // Each Q vector loaded once for the four keys (per key it took as many loads as products).
  for (std::int64_t e = 0; e < d; e += kCodes, panel += 4 * 2 * kCodes) {
    __m512i codes[4];
    for (std::int64_t k = 0; k < 4; ++k) codes[k] = LoadCodes<C>(row[k] + e, d - e);
    for (std::int64_t r = 0; r < 4; ++r) {
      const __m512i q = _mm512_loadu_si512(panel + r * 2 * kCodes);
      for (std::int64_t k = 0; k < 4; ++k) acc[k][r] = _mm512_dpbusd_epi32(acc[k][r], codes[k], q);
    }
  }
  alignas(16) float sums[4][4];  // [row][key]
  for (std::int64_t r = 0; r < 4; ++r) _mm_store_ps(sums[r], Scores(KeySums4(acc[0][r], acc[1][r], acc[2][r], acc[3][r])));
  for (std::int64_t r = 0; r < 4; ++r)
    for (std::int64_t k = 0; k < count; ++k) s[r * lds + k] = sums[r][k];
}

template <KvCodes C>
FLASHATTN_INT8_DOT_TARGET void ScoreCodes4(const unsigned char* panels, std::int64_t panel_count,
                                           std::int64_t head_panels, const unsigned char* const* krows,
                                           std::int64_t k_head, std::int64_t count, std::int64_t d, float* s,
                                           std::int64_t lds, const fp16dot::Fetch& fetch) {
  const std::int64_t panel_bytes = 4 * ((d + kCodes - 1) / kCodes) * 2 * kCodes;
  const unsigned char* row[4];
  for (std::int64_t i = 0; i < panel_count; ++i) {
    fp16dot::StartHead(fetch, i, head_panels, krows, k_head, count, row);
    ScorePanel<C>(panels + i * panel_bytes, row, count, d, s + i * 4 * lds, lds);
  }
}

}  // namespace

bool available() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0 && __builtin_cpu_supports("avx512bw") != 0 &&
           __builtin_cpu_supports("avx512vl") != 0;
  }();
  return has;
}

FLASHATTN_INT8_DOT_TARGET void PackQ4(const float* q, std::int64_t ldq, std::int64_t rows, std::int64_t d, int top,
                                      std::uint16_t* panel, float* unit) {
  auto* bytes = reinterpret_cast<unsigned char*>(panel);
  const std::int64_t vectors = (d + kCodes - 1) / kCodes;
  std::fill(bytes, bytes + 4 * vectors * 2 * kCodes, static_cast<unsigned char>(0));
  for (std::int64_t r = 0; r < 4; ++r) {
    const float* row = q + r * ldq;
    const bool live = r < rows;
    const bool finite = !live || std::all_of(row, row + d, [](float x) { return std::isfinite(x); });
    const int shift = fp16dot::RowShift(row, d, live, top);
    unit[r] = finite ? std::ldexp(1.0f, -shift) : std::numeric_limits<float>::quiet_NaN();
    if (!live || !finite) continue;
    const __m512 scale = _mm512_set1_ps(std::ldexp(1.0f, shift));  // exact: |q·scale| < 2^top
    for (std::int64_t e = 0; e < d; e += 16) {
      const auto mask = static_cast<__mmask16>(d - e >= 16 ? 0xFFFF : (1u << (d - e)) - 1u);
      // Rounded to the nearest integer (ties to even, the default rounding), at most 2^top.
      const __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + e), scale));
      const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(128)), 8);  // lo = x − 256·hi in [−128, 128)
      const __m512i lo = _mm512_sub_epi32(x, _mm512_slli_epi32(hi, 8));
      unsigned char* vec = bytes + (4 * (e / kCodes) + r) * 2 * kCodes + e % kCodes;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(vec), _mm512_cvtepi32_epi8(hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(vec + kCodes), _mm512_cvtepi32_epi8(lo));
    }
  }
}

void ScoreKeys4(KvCodes codes, const std::uint16_t* panels, std::int64_t panel_count, std::int64_t head_panels,
                const unsigned char* const* krows, std::int64_t k_head, std::int64_t count, std::int64_t d, float* s,
                std::int64_t lds, const fp16dot::Fetch& fetch) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(panels);
  if (codes == KvCodes::s8)
    return ScoreCodes4<KvCodes::s8>(bytes, panel_count, head_panels, krows, k_head, count, d, s, lds, fetch);
  ScoreCodes4<KvCodes::u8>(bytes, panel_count, head_panels, krows, k_head, count, d, s, lds, fetch);
}

}  // namespace flashattn::cpu::int8dot

#else  // not x86: the int8 scores are never planned (available())

namespace flashattn::cpu::int8dot {
bool available() { return false; }
void PackQ4(const float*, std::int64_t, std::int64_t, std::int64_t, int, std::uint16_t*, float*) {}
void ScoreKeys4(KvCodes, const std::uint16_t*, std::int64_t, std::int64_t, const unsigned char* const*, std::int64_t,
                std::int64_t, std::int64_t, float*, std::int64_t, const fp16dot::Fetch&) {}
}  // namespace flashattn::cpu::int8dot

#endif
