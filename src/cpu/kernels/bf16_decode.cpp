// AVX512-BF16 products of the quantized decode (bf16_decode.hpp). This file is compiled for
// the baseline ISA; every function that uses the instructions carries them in its target
// attribute, and nothing here runs before available() (plan.cpp) has said the CPU has them.
#include "src/cpu/kernels/bf16_decode.hpp"

#include "src/cpu/kernels/bf16_dot.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>

namespace flashattn::cpu::bf16decode {
namespace {

#define FLASHATTN_BF16_DECODE_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))
#define FLASHATTN_BF16_DECODE_INLINE FLASHATTN_BF16_DECODE_TARGET inline __attribute__((always_inline))
#define FLASHATTN_BF16_VBMI_TARGET __attribute__((target("avx512vbmi,avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))
#define FLASHATTN_BF16_VBMI_INLINE FLASHATTN_BF16_VBMI_TARGET inline __attribute__((always_inline))

// AVX512-VBMI (byte permutes), which AMD's Zen 4 and Intel's cores since Ice Lake have beside
// AVX512-BF16 (Cooper Lake has not): e4m3 codes then widen through two 128-entry tables.
bool HasVbmi() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") != 0;
  }();
  return has;
}
std::atomic<bool> use_tables{HasVbmi()};

// The bf16 bits of 2^-8 times the value of every e4m3 magnitude m = code & 0x7F, the values
// LoadCodes<e4m3> gives (its half-precision route, subnormal codes included), as two byte
// tables: lo[m] and hi[m] (the sign comes from the code). m = 8·E + M is (8 + M)·2^(E − 18)
// for E > 0 and M·2^-17 for E = 0; normalized to an integer in [8, 16) times 2^s it is
// bf16's exponent s + 130 and mantissa (integer − 8)·2^4 — exact, bf16 keeping 7 bits.
struct E4m3Bytes {
  alignas(64) unsigned char lo[128];
  alignas(64) unsigned char hi[128];
};
constexpr E4m3Bytes MakeE4m3Bytes() {
  E4m3Bytes t{};
  for (int m = 0; m < 128; ++m) {
    const int e = m >> 3;
    int integer = e > 0 ? 8 + (m & 7) : m & 7, s = (e > 0 ? e : 1) - 18;
    unsigned bits = 0;
    if (integer != 0) {
      for (; integer < 8; integer *= 2) --s;
      bits = static_cast<unsigned>(s + 130) << 7 | static_cast<unsigned>(integer - 8) << 4;
    }
    t.lo[m] = static_cast<unsigned char>(bits & 0xFF);
    t.hi[m] = static_cast<unsigned char>(bits >> 8);
  }
  return t;
}
constexpr E4m3Bytes kE4m3Bytes = MakeE4m3Bytes();
static_assert(kE4m3Bytes.hi[0x38] == 0x3B && kE4m3Bytes.lo[0x38] == 0x80, "code 0x38 (1.0) is 2^-8: bf16 0x3B80");
static_assert(kE4m3Bytes.hi[0x01] == 0x37 && kE4m3Bytes.lo[0x01] == 0x00, "code 0x01 (2^-9) is 2^-17: bf16 0x3700");

// The first min(n, 32) codes from p as bf16 (bf16_decode.hpp), zeros past n. e4m3: the
// half-precision bits of fp16_decode.cpp's LoadCodes (2^-8 times the value, subnormal codes
// as subnormal halves), widened to float32 and narrowed to bf16 — both exact, a code having
// at most four significant bits and 2^-17 ≤ |value·2^-8| ≤ 1.75, inside bf16's normal range;
// int8: the integers (u8: code − 128) through float32, exact in bf16's eight bits.
template <KvCodes C>
FLASHATTN_BF16_DECODE_INLINE __m512bh LoadCodes(const unsigned char* p, std::int64_t n) {
  __m256i bytes = n >= kPanelLanes ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                   : _mm256_maskz_loadu_epi8(static_cast<__mmask32>((1ull << n) - 1u), p);
  __m512 lo, hi;
  if constexpr (C == KvCodes::e4m3) {
    const __m512i words = _mm512_cvtepi8_epi16(bytes);
    const __m512i halves = _mm512_and_si512(_mm512_slli_epi16(words, 7), _mm512_set1_epi16(static_cast<short>(0xBFFF)));
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
  } else {
    if constexpr (C == KvCodes::u8) bytes = _mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80)));
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  }
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// The byte orders of WidenE4m3Pair's two-source permute (index bit 6 picks the second key's
// codes): unpacklo_epi8 and unpackhi_epi8 take bytes 16b..16b+7 and 16b+8..16b+15 of each
// 128-bit block b to words.
struct E4m3Orders {
  alignas(64) unsigned char keys[64];   // words: first key's codes 0–31, then the second's
  alignas(64) unsigned char pairs[64];  // dwords: (first, second) of columns 0–15, then 16–31
};
constexpr E4m3Orders MakeE4m3Orders() {
  E4m3Orders o{};
  for (int b = 0; b < 4; ++b)
    for (int i = 0; i < 8; ++i) {
      o.keys[16 * b + i] = static_cast<unsigned char>(8 * b + i);
      o.keys[16 * b + 8 + i] = static_cast<unsigned char>(64 + 8 * b + i);
      const int column = 4 * b + i / 2, second = i % 2 == 1 ? 64 : 0;  // even bytes: the first key
      o.pairs[16 * b + i] = static_cast<unsigned char>(second + column);
      o.pairs[16 * b + 8 + i] = static_cast<unsigned char>(second + 16 + column);
    }
  return o;
}
constexpr E4m3Orders kE4m3Orders = MakeE4m3Orders();

// The tables in registers and the sign bit.
struct E4m3Widen {
  __m512i lo0, lo1, hi0, hi1, sign;
};
FLASHATTN_BF16_VBMI_INLINE E4m3Widen LoadE4m3Widen() {
  return {_mm512_load_si512(kE4m3Bytes.lo), _mm512_load_si512(kE4m3Bytes.lo + 64), _mm512_load_si512(kE4m3Bytes.hi),
          _mm512_load_si512(kE4m3Bytes.hi + 64), _mm512_set1_epi8(static_cast<char>(0x80))};
}

// The first min(n, 32) codes at p in the low half of a vector, zeros past them.
FLASHATTN_BF16_VBMI_INLINE __m512i LoadCodes32(const unsigned char* p, std::int64_t n) {
  return _mm512_zextsi256_si512(n >= kPanelLanes ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                                 : _mm256_maskz_loadu_epi8(static_cast<__mmask32>((1ull << n) - 1u), p));
}

// The first min(n, 32) e4m3 codes at a and at b (b null: zeros), as LoadCodes<e4m3> widens
// them, in the order `order` of kE4m3Orders gives: the two keys' codes interleaved by one
// permute, two table lookups on their low seven bits, the sign put back and the bytes
// interleaved — six instructions for 64 codes where LoadCodes takes fourteen.
FLASHATTN_BF16_VBMI_INLINE void WidenE4m3Pair(const E4m3Widen& t, __m512i order, const unsigned char* a,
                                              const unsigned char* b, std::int64_t n, __m512i& first,
                                              __m512i& second) {
  const __m512i codes =
      _mm512_permutex2var_epi8(LoadCodes32(a, n), order, b != nullptr ? LoadCodes32(b, n) : _mm512_setzero_si512());
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, codes, t.lo1);
  // hi | (codes & sign)
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, codes, t.hi1), codes, t.sign, 0xF8);
  first = _mm512_unpacklo_epi8(lo, hi);
  second = _mm512_unpackhi_epi8(lo, hi);
}

// Lane 4·block + k holds block `block`'s part of Σ lanes of a_k: within every 128-bit block
// the four vectors' lanes interleave and add down.
FLASHATTN_BF16_DECODE_INLINE __m512 KeySums4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d u01 = _mm512_castps_pd(t01), u23 = _mm512_castps_pd(t23);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u01, u23)), _mm512_castpd_ps(_mm512_unpackhi_pd(u01, u23)));
}

// The four blocks of v added: [Σ lane 4b + i over blocks b], i < 4.
FLASHATTN_BF16_DECODE_INLINE __m128 FoldBlocks(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// acc[k][r] += (row r's vector of the panel)·codes[k], each Q vector loaded once for the four
// keys (per key, Zen 4 took as many loads as products).
FLASHATTN_BF16_DECODE_INLINE void AddScores(const std::uint16_t* panel, const __m512i* codes, __m512 (*acc)[4]) {
  for (std::int64_t r = 0; r < 4; ++r) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(panel + r * kPanelLanes);
    for (std::int64_t k = 0; k < 4; ++k) acc[k][r] = _mm512_dpbf16_ps(acc[k][r], q, (__m512bh)codes[k]);
  }
}

// s[r·lds + k] = the score of row r and key k that acc[k][r]'s lanes add to, k < count.
FLASHATTN_BF16_DECODE_INLINE void StoreScores(__m512 (*acc)[4], std::int64_t count, float* s, std::int64_t lds) {
  alignas(16) float sums[4][4];  // [row][key]
  for (std::int64_t r = 0; r < 4; ++r) _mm_store_ps(sums[r], FoldBlocks(KeySums4(acc[0][r], acc[1][r], acc[2][r], acc[3][r])));
  for (std::int64_t r = 0; r < 4; ++r)
    for (std::int64_t k = 0; k < count; ++k) s[r * lds + k] = sums[r][k];
}

// The scores of one panel (four rows) and four K rows: s[r·lds + k] for k < count.
template <KvCodes C>
FLASHATTN_BF16_DECODE_INLINE void ScorePanel(const std::uint16_t* panel, const unsigned char* const* row,
                                             std::int64_t count, std::int64_t d, float* s, std::int64_t lds) {
  __m512 acc[4][4] = {};  // [key][row]
  for (std::int64_t e = 0; e < d; e += kPanelLanes, panel += 4 * kPanelLanes) {
    __m512i codes[4];
    for (std::int64_t k = 0; k < 4; ++k) codes[k] = (__m512i)LoadCodes<C>(row[k] + e, d - e);
    AddScores(panel, codes, acc);
  }
  StoreScores(acc, count, s, lds);
}

// ScorePanel<e4m3> on WidenE4m3Pair (the same products in the same order: the same bits).
FLASHATTN_BF16_VBMI_INLINE void ScorePanelE4m3(const E4m3Widen& t, const std::uint16_t* panel,
                                               const unsigned char* const* row, std::int64_t count, std::int64_t d,
                                               float* s, std::int64_t lds) {
  const __m512i order = _mm512_load_si512(kE4m3Orders.keys);
  __m512 acc[4][4] = {};  // [key][row]
  for (std::int64_t e = 0; e < d; e += kPanelLanes, panel += 4 * kPanelLanes) {
    __m512i codes[4];
    WidenE4m3Pair(t, order, row[0] + e, row[1] + e, d - e, codes[0], codes[1]);
    WidenE4m3Pair(t, order, row[2] + e, row[3] + e, d - e, codes[2], codes[3]);
    AddScores(panel, codes, acc);
  }
  StoreScores(acc, count, s, lds);
}

FLASHATTN_BF16_VBMI_TARGET void ScoreE4m3Tables(const std::uint16_t* panels, std::int64_t panel_count,
                                                std::int64_t head_panels, const unsigned char* const* krows,
                                                std::int64_t k_head, std::int64_t count, std::int64_t d, float* s,
                                                std::int64_t lds, const fp16dot::Fetch& fetch) {
  const E4m3Widen t = LoadE4m3Widen();
  const std::int64_t panel_lanes = 4 * ((d + kPanelLanes - 1) / kPanelLanes) * kPanelLanes;
  const unsigned char* row[4];
  for (std::int64_t i = 0; i < panel_count; ++i) {
    fp16dot::StartHead(fetch, i, head_panels, krows, k_head, count, row);
    ScorePanelE4m3(t, panels + i * panel_lanes, row, count, d, s + i * 4 * lds, lds);
  }
}

template <KvCodes C>
FLASHATTN_BF16_DECODE_TARGET void ScoreCodes4(const std::uint16_t* panels, std::int64_t panel_count,
                                              std::int64_t head_panels, const unsigned char* const* krows,
                                              std::int64_t k_head, std::int64_t count, std::int64_t d, float* s,
                                              std::int64_t lds, const fp16dot::Fetch& fetch) {
  const std::int64_t panel_lanes = 4 * ((d + kPanelLanes - 1) / kPanelLanes) * kPanelLanes;
  const unsigned char* row[4];
  for (std::int64_t i = 0; i < panel_count; ++i) {
    fp16dot::StartHead(fetch, i, head_panels, krows, k_head, count, row);
    ScorePanel<C>(panels + i * panel_lanes, row, count, d, s + i * 4 * lds, lds);
  }
}

// Columns [0, 16) and [16, 32) of a pair of keys' sums: AccumulateCodes4's lo vector holds
// columns 8b..8b+3 in block b, its hi vector 8b+4..8b+7 (unpacklo/hi of 16-bit words).
FLASHATTN_BF16_DECODE_INLINE void InOrder(__m512 lo, __m512 hi, __m512& first, __m512& second) {
  const __m512i first_index = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_index = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  first = _mm512_permutex2var_ps(lo, first_index, hi);
  second = _mm512_permutex2var_ps(lo, second_index, hi);
}

// lo[r], hi[r] += the bf16 pair of weights of row r for keys c, c + 1 times the keys' pairs.
FLASHATTN_BF16_DECODE_INLINE void AddPair(const std::uint32_t* p, std::int64_t ldp, std::int64_t c, __m512bh pairs_lo,
                                          __m512bh pairs_hi, __m512* lo, __m512* hi) {
  for (std::int64_t r = 0; r < 4; ++r) {
    const __m512bh weights = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * ldp + c / 2]));
    lo[r] = _mm512_dpbf16_ps(lo[r], weights, pairs_lo);
    hi[r] = _mm512_dpbf16_ps(hi[r], weights, pairs_hi);
  }
}

// o[r·ldo + j] += unit·(column j of row r: lanes of first[r], then of second[r]), j < left ≤ 32.
FLASHATTN_BF16_DECODE_INLINE void AddColumns(float* o, std::int64_t ldo, std::int64_t left, __m512 vunit,
                                             const __m512* first, const __m512* second) {
  const auto m0 = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1u);
  const auto m1 = static_cast<__mmask16>(left >= 32 ? 0xFFFF : left <= 16 ? 0 : (1u << (left - 16)) - 1u);
  for (std::int64_t r = 0; r < 4; ++r) {
    float* out = o + r * ldo;
    _mm512_mask_storeu_ps(out, m0, _mm512_fmadd_ps(first[r], vunit, _mm512_maskz_loadu_ps(m0, out)));
    _mm512_mask_storeu_ps(out + 16, m1, _mm512_fmadd_ps(second[r], vunit, _mm512_maskz_loadu_ps(m1, out + 16)));
  }
}

template <KvCodes C>
FLASHATTN_BF16_DECODE_TARGET void AccumulateCodes4(const std::uint32_t* p, std::int64_t ldp,
                                                   const unsigned char* const* vrows, std::int64_t offset,
                                                   std::int64_t n, std::int64_t dv, float unit, float* o,
                                                   std::int64_t ldo) {
  const __m512 vunit = _mm512_set1_ps(unit);
  for (std::int64_t e = 0; e < dv; e += kPanelLanes) {
    const std::int64_t left = std::min<std::int64_t>(kPanelLanes, dv - e);
    __m512 lo[4] = {}, hi[4] = {};  // [row]: the columns as InOrder takes them
    for (std::int64_t c = 0; c < n; c += 2) {
      const __m512i a = (__m512i)LoadCodes<C>(vrows[c] + offset + e, left);
      const __m512i b = c + 1 < n ? (__m512i)LoadCodes<C>(vrows[c + 1] + offset + e, left) : _mm512_setzero_si512();
      AddPair(p, ldp, c, (__m512bh)_mm512_unpacklo_epi16(a, b), (__m512bh)_mm512_unpackhi_epi16(a, b), lo, hi);
    }
    __m512 first[4], second[4];
    for (std::int64_t r = 0; r < 4; ++r) InOrder(lo[r], hi[r], first[r], second[r]);
    AddColumns(o + e, ldo, left, vunit, first, second);
  }
}

// AccumulateCodes4<e4m3> on WidenE4m3Pair (the same products in the same order: the same bits),
// whose pairs order puts columns e..e+15 of a pair of keys in one vector and e+16..e+31 in the
// other, in order (no InOrder). int8 codes keep LoadCodes: the same lookups over their 256
// codes (two a plane, blended by the top bit) measured no faster on a Zen 4.
FLASHATTN_BF16_VBMI_TARGET void AccumulateE4m3Tables(const std::uint32_t* p, std::int64_t ldp,
                                                     const unsigned char* const* vrows, std::int64_t offset,
                                                     std::int64_t n, std::int64_t dv, float unit, float* o,
                                                     std::int64_t ldo) {
  const E4m3Widen t = LoadE4m3Widen();
  const __m512i order = _mm512_load_si512(kE4m3Orders.pairs);
  const __m512 vunit = _mm512_set1_ps(unit);
  for (std::int64_t e = 0; e < dv; e += kPanelLanes) {
    const std::int64_t left = std::min<std::int64_t>(kPanelLanes, dv - e);
    __m512 lo[4] = {}, hi[4] = {};  // [row]: columns e..e+15, e+16..e+31
    for (std::int64_t c = 0; c < n; c += 2) {
      __m512i pairs_lo, pairs_hi;
      WidenE4m3Pair(t, order, vrows[c] + offset + e, c + 1 < n ? vrows[c + 1] + offset + e : nullptr, left, pairs_lo,
                    pairs_hi);
      AddPair(p, ldp, c, (__m512bh)pairs_lo, (__m512bh)pairs_hi, lo, hi);
    }
    AddColumns(o + e, ldo, left, vunit, lo, hi);
  }
}

FLASHATTN_BF16_DECODE_TARGET void PackRows(const float* q, std::int64_t ldq, std::int64_t rows, std::int64_t d,
                                           int top, std::uint16_t* panel, float* unit) {
  const std::int64_t vectors = (d + kPanelLanes - 1) / kPanelLanes;
  for (std::int64_t r = 0; r < 4; ++r) {
    const int shift = fp16dot::RowShift(q + r * ldq, d, r < rows, top);
    unit[r] = std::ldexp(1.0f, -shift);
    const __m512 scale = _mm512_set1_ps(std::ldexp(1.0f, shift));
    for (std::int64_t j = 0; j < vectors; ++j) {
      __m512 x[2];
      for (std::int64_t half = 0; half < 2; ++half) {
        const std::int64_t e = j * kPanelLanes + 16 * half, left = r < rows ? std::clamp<std::int64_t>(d - e, 0, 16) : 0;
        x[half] = _mm512_mul_ps(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1u), q + r * ldq + e), scale);
      }
      _mm512_storeu_si512(panel + (4 * j + r) * kPanelLanes, (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
    }
  }
}

FLASHATTN_BF16_DECODE_TARGET void PairRows(const float* src, std::uint32_t* dst, std::int64_t n) {
  for (std::int64_t c = 0; c < n; c += 32) {
    const std::int64_t left = std::min<std::int64_t>(32, n - c);
    const auto m0 = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1u);
    const auto m1 = static_cast<__mmask16>(left >= 32 ? 0xFFFF : left <= 16 ? 0 : (1u << (left - 16)) - 1u);
    const __m512 lo = _mm512_maskz_loadu_ps(m0, src + c), hi = _mm512_maskz_loadu_ps(m1, src + c + 16);
    const auto words = static_cast<__mmask16>(left >= 32 ? 0xFFFF : (1u << ((left + 1) / 2)) - 1u);
    _mm512_mask_storeu_epi32(dst + c / 2, words, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

}  // namespace

bool available() { return bf16dot::available(); }

bool byte_tables() { return use_tables.load(std::memory_order_relaxed); }
void set_byte_tables(bool on) { use_tables.store(on && HasVbmi(), std::memory_order_relaxed); }

void PackQ4(const float* q, std::int64_t ldq, std::int64_t rows, std::int64_t d, int top, std::uint16_t* panel,
            float* unit) {
  PackRows(q, ldq, rows, d, top, panel, unit);
}

void ScoreKeys4(KvCodes codes, const std::uint16_t* panels, std::int64_t panel_count, std::int64_t head_panels,
                const unsigned char* const* krows, std::int64_t k_head, std::int64_t count, std::int64_t d, float* s,
                std::int64_t lds, const fp16dot::Fetch& fetch) {
  (void)codes;  // e4m3: int8 K codes score on int8dot (the header)
  if (byte_tables()) return ScoreE4m3Tables(panels, panel_count, head_panels, krows, k_head, count, d, s, lds, fetch);
  ScoreCodes4<KvCodes::e4m3>(panels, panel_count, head_panels, krows, k_head, count, d, s, lds, fetch);
}

void PairKeys(const float* src, std::uint32_t* dst, std::int64_t n) { PairRows(src, dst, n); }

void AccumulateRows4(KvCodes codes, const std::uint32_t* p, std::int64_t ldp, const unsigned char* const* vrows,
                     std::int64_t offset, std::int64_t n, std::int64_t dv, float unit, float* o, std::int64_t ldo) {
  switch (codes) {
    case KvCodes::e4m3:
      if (byte_tables()) return AccumulateE4m3Tables(p, ldp, vrows, offset, n, dv, unit, o, ldo);
      return AccumulateCodes4<KvCodes::e4m3>(p, ldp, vrows, offset, n, dv, unit, o, ldo);
    case KvCodes::u8: return AccumulateCodes4<KvCodes::u8>(p, ldp, vrows, offset, n, dv, unit, o, ldo);
    case KvCodes::s8: return AccumulateCodes4<KvCodes::s8>(p, ldp, vrows, offset, n, dv, unit, o, ldo);
  }
}

}  // namespace flashattn::cpu::bf16decode

#else  // not x86: decode_bf16 is never planned (available())

namespace flashattn::cpu::bf16decode {
bool available() { return false; }
bool byte_tables() { return false; }
void set_byte_tables(bool) {}
void PackQ4(const float*, std::int64_t, std::int64_t, std::int64_t, int, std::uint16_t*, float*) {}
void ScoreKeys4(KvCodes, const std::uint16_t*, std::int64_t, std::int64_t, const unsigned char* const*, std::int64_t,
                std::int64_t, std::int64_t, float*, std::int64_t, const fp16dot::Fetch&) {}
void PairKeys(const float*, std::uint32_t*, std::int64_t) {}
void AccumulateRows4(KvCodes, const std::uint32_t*, std::int64_t, const unsigned char* const*, std::int64_t,
                     std::int64_t, std::int64_t, float, float*, std::int64_t) {}
}  // namespace flashattn::cpu::bf16decode

#endif
