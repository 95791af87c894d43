// The products of a quantized decode on AVX512-FP16 (the decode_fp16 kernel, options.hpp):
// one-byte codes widen to half precision exactly in a few integer operations — e4m3 codes as
// halves 2^-8 times their values, int8 codes (kv_quant.hpp) as the integers they are, u8 read
// as code − 128 and s8 as is — and half-precision FMAs take 32 lanes where float32's take 16:
// the conversions and the products of the float32 decode kernel, halved. Partial sums stay
// short in half precision and move to float32 soon:
//   S = Q·Kᵀ: q rows are scaled by a power of two to a largest magnitude in
//     [2^(e−1), 2^e), e = q_exponent(codes), and rounded to half; each lane sums D/32
//     products in order, then four lanes add in a two-level tree, then the sums go on in
//     float32. A product is at most 2^e times the largest code read (1.875 for e4m3, 128 for
//     int8), so for D ≤ kMaxHeadDim a half sum of 4·16 products stays below half's largest
//     finite 65504 (e4m3: 64 · 2^8 · 1.875 = 30720; int8: 64 · 2^2 · 128 = 32768); the
//     planner never chooses the kernel above it, and asking for it there is an Error.
//   õ += P·V: P (≤ 1: these rows rescale at every new maximum, whatever the problem's
//     rescale threshold — decode_forward.cpp's SoftmaxRows), times the V factor and a power
//     of two that keeps it ≤ 2^p_exponent(codes), is rounded to half; two runs of
//     kAccumulateKeys keys are each summed in order and then added in half (≤ 16 · 2^p ·
//     the largest code ≤ 2^15), then added to the float32 õ.
// Each half-precision rounding is 2^-11 relative, against the codes' own quantization —
// 2^-4 relative for e4m3, half a step (1/256 of a u8 row's range, 1/254 of an s8 row's
// largest value) for int8: the kernel's error is the quantization's and a few percent of it
// more (tests/test_kvcache.cpp and tests/test_int8_cache.cpp hold the kernel to twice the
// error of a scalar half-precision yardstick). Compiled once, not per Highway target, for
// AVX512-FP16; callers reach it only where available() says so.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "flashattn/kv_quant.hpp"

namespace flashattn::cpu::fp16dot {

constexpr std::int64_t kMaxHeadDim = 512;
constexpr std::int64_t kAccumulateKeys = 8;
constexpr std::int64_t kHalves = 32;  // half lanes per vector; a panel's vectors are this wide

// The exponents above, per code format: q rows are brought below 2^q_exponent, the P·V
// weights to at most 2^p_exponent.
constexpr int q_exponent(KvCodes codes) { return codes == KvCodes::e4m3 ? 8 : 2; }
constexpr int p_exponent(KvCodes codes) { return codes == KvCodes::e4m3 ? 8 : 4; }

// True when the CPU has AVX512-FP16 (checked once) and the compiler built the kernels.
bool available();

// Halves of the Q panel of four rows (row r at q + r·ldq, d floats; rows ≥ `rows` zero):
// vector j of row r at panel + (4j + r)·kHalves, elements [32j, 32j + 32), zeros past d;
// each row times 2^k_r, its largest finite magnitude brought into [2^(top − 1), 2^top).
// unit[r] = 2^-k_r: what the row's scores are to be multiplied by. panel: 4 · ceil(d / 32)
// vectors.
void PackQ4(const float* q, std::int64_t ldq, std::int64_t rows, std::int64_t d, int top, std::uint16_t* panel,
            float* unit);

// The power of two 2^shift that brings the largest finite |x| of the d values at row into
// [2^(top − 1), 2^top) (0 for a row of zeros, or when !live): PackQ4's scaling of each Q row,
// in either narrow type. shift is within ±126, so that 2^shift and 2^-shift are normal
// floats: every finite row's largest (below 2^128) is brought down into the range; rows
// below 2^(top − 126) stay below it, which rounds them to 0 in half precision: scores of at
// most 2^-112 of the largest.
inline int RowShift(const float* row, std::int64_t d, bool live, int top) {
  float largest = 0.0f;
  if (live)
    for (std::int64_t e = 0; e < d; ++e)
      if (std::isfinite(row[e])) largest = std::max(largest, std::fabs(row[e]));
  int exponent = 0;
  if (largest > 0.0f) std::frexp(largest, &exponent);  // largest in [2^(exponent - 1), 2^exponent)
  return std::clamp(top - exponent, -126, 126);
}

// Rows to prefetch: of keys c < count, kv head g's k_bytes at k[c] + g·k_head and v_bytes at
// v[c] + g·v_head.
struct Fetch {
  const unsigned char* const* k;
  const unsigned char* const* v;
  std::int64_t count, k_bytes, v_bytes, v_head;
};

// The cache line at p into L2: the instruction itself on x86 (asm volatile, an effect the
// compiler keeps), because GCC drops a call to a function whose only effect is
// __builtin_prefetch or _mm_prefetch — its IPA sees no side effect — unless it inlined the
// call first, and PrefetchHead below is such a function (it cost decode_fp16 half its speed
// once; tests/prefetch_emitted.sh checks the objects).
inline void FetchLineToL2(const unsigned char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Prefetches kv head g's rows of `fetch` into L2 (k rows k_head apart per kv head).
inline void PrefetchHead(const Fetch& fetch, std::int64_t g, std::int64_t k_head) {
  for (std::int64_t c = 0; c < fetch.count; ++c) {
    for (std::int64_t off = 0; off < fetch.k_bytes; off += 64) FetchLineToL2(fetch.k[c] + g * k_head + off);
    for (std::int64_t off = 0; off < fetch.v_bytes; off += 64) FetchLineToL2(fetch.v[c] + g * fetch.v_head + off);
  }
}

// The panel walk of ScoreKeys4 (every narrow product's): before panel i, the first of kv head
// g = i / head_panels, that head's rows of `fetch` are prefetched (into L2, as ScoreBlock) and
// row[k] set to its rows of the keys (a short group repeats its last key).
inline void StartHead(const Fetch& fetch, std::int64_t i, std::int64_t head_panels, const unsigned char* const* krows,
                      std::int64_t k_head, std::int64_t count, const unsigned char** row) {
  if (i % head_panels != 0) return;
  const std::int64_t g = i / head_panels;
  PrefetchHead(fetch, g, k_head);
  for (std::int64_t k = 0; k < 4; ++k) row[k] = krows[std::min<std::int64_t>(k, count - 1)] + g * k_head;
}
// The scores of `count` ≤ 4 keys for every panel i < panel_count (PackQ4's, one after the
// other), head_panels to a kv head: s[(4i + r)·lds + k] = (row r of panel i)·(the d codes
// at krows[k] + g·k_head, g = i / head_panels, read as the header says). Before a kv head's
// panels, its rows of `fetch` are prefetched.
void ScoreKeys4(KvCodes codes, const std::uint16_t* panels, std::int64_t panel_count, std::int64_t head_panels,
                const unsigned char* const* krows, std::int64_t k_head, std::int64_t count, std::int64_t d, float* s,
                std::int64_t lds, const Fetch& fetch);

// dst[c] = the half of src[c] twice (both halves of a 32-bit word), c < n: P as AccumulateRows4
// broadcasts it. In place (dst == src) is allowed.
void PairHalves(const float* src, std::uint32_t* dst, std::int64_t n);

// o[r·ldo + e] += unit · Σ_{c < n} p[r·ldp + c] · (code e of vrows[c] + offset, read as the
// header says) for r < 4, e < dv; p as PairHalves wrote it (|p| ≤ 2^p_exponent(codes)).
void AccumulateRows4(KvCodes codes, const std::uint32_t* p, std::int64_t ldp, const unsigned char* const* vrows, std::int64_t offset,
                     std::int64_t n, std::int64_t dv, float unit, float* o, std::int64_t ldo);

}  // namespace flashattn::cpu::fp16dot
