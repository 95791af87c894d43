// The FP8 decode products on AVX512-FP16 (the decode_fp16 kernel, options.hpp): e4m3 codes
// widen to half precision exactly in three integer operations, and half-precision FMAs take
// 32 lanes where float32's take 16 — the conversions and the products of the float32 decode
// kernel, halved. Partial sums stay short in half precision and move to float32 soon:
//   S = Q·Kᵀ: q rows are scaled by a power of two to a largest magnitude in [128, 256) and
//     rounded to half; each lane sums D/32 products in order, then four lanes add in a
//     two-level tree, then the sums go on in float32. A product is at most 256 · 1.875 (codes
//     read as halves 2^-8 times their values), so for D ≤ kMaxHeadDim nothing overflows; the
//     planner never chooses the kernel above it, and asking for it there is an Error.
//   õ += P·V: P, times the V descale and a power of two that keeps it ≤ 256, is rounded to
//     half; two runs of kAccumulateKeys keys are each summed in order and then added in half
//     (≤ 16 · 256 · 1.875), then added to the float32 õ.
// Each half-precision rounding is 2^-11 relative, against the e4m3 codes' own 2^-4: the
// kernel's error is the quantization's and a few percent of it more (tests/test_kvcache.cpp
// holds the kernel to twice the error of a scalar half-precision yardstick). Compiled once,
// not per Highway target, for AVX512-FP16; callers reach it only where available() says so.
#pragma once

#include <cstdint>

namespace flashattn::cpu::fp16dot {

constexpr std::int64_t kMaxHeadDim = 512;
constexpr std::int64_t kAccumulateKeys = 8;
constexpr std::int64_t kHalves = 32;  // half lanes per vector; a panel's vectors are this wide

// True when the CPU has AVX512-FP16 (checked once) and the compiler built the kernels.
bool available();

// Halves of the Q panel of four rows (row r at q + r·ldq, d floats; rows ≥ `rows` zero):
// vector j of row r at panel + (4j + r)·kHalves, elements [32j, 32j + 32), zeros past d;
// each row times 2^k_r, its largest finite magnitude brought into [128, 256). unit[r] =
// 2^-k_r: what the row's scores are to be multiplied by. panel: 4 · ceil(d / 32) vectors.
void PackQ4(const float* q, std::int64_t ldq, std::int64_t rows, std::int64_t d, std::uint16_t* panel, float* unit);

// Rows to prefetch: of keys c < count, kv head g's k_bytes at k[c] + g·k_head and v_bytes at
// v[c] + g·v_head.
struct Fetch {
  const unsigned char* const* k;
  const unsigned char* const* v;
  std::int64_t count, k_bytes, v_bytes, v_head;
};
// The scores of `count` ≤ 4 keys for every panel i < panel_count (PackQ4's, one after the
// other), head_panels to a kv head: s[(4i + r)·lds + k] = (row r of panel i)·(the d e4m3
// codes at krows[k] + g·k_head, g = i / head_panels, read as halves 2^-8 times their values).
// Before a kv head's panels, its rows of `fetch` are prefetched.
void ScoreKeys4(const std::uint16_t* panels, std::int64_t panel_count, std::int64_t head_panels,
                const unsigned char* const* krows, std::int64_t k_head, std::int64_t count, std::int64_t d, float* s,
                std::int64_t lds, const Fetch& fetch);

// dst[c] = the half of src[c] twice (both halves of a 32-bit word), c < n: P as AccumulateRows4
// broadcasts it. In place (dst == src) is allowed.
void PairHalves(const float* src, std::uint32_t* dst, std::int64_t n);

// o[r·ldo + e] += unit · Σ_{c < n} p[r·ldp + c] · (code e of vrows[c] + offset, read as a
// half 2^-8 times its value) for r < 4, e < dv; p as PairHalves wrote it (|p| ≤ 256).
void AccumulateRows4(const std::uint32_t* p, std::int64_t ldp, const unsigned char* const* vrows, std::int64_t offset,
                     std::int64_t n, std::int64_t dv, float unit, float* o, std::int64_t ldo);

}  // namespace flashattn::cpu::fp16dot
