// How a quantized KV cache stores its values (docs/algorithm.md §4, quantized KV caches):
// the pools (k_cache, v_cache) hold one byte per element — u8 tensors — and each pool reads
// them in its own format, chosen independently for K and V (KvCache::k_quant, v_quant;
// PagedKvBatch likewise):
//
//   e4m3  FP8 e4m3 codes (fp8.hpp), x = fp8_to_float(code)·scale, one scale per (page,
//         kv head) that an append computes and grows (KvCache's FP8 paragraph). per_page only.
//   u8    asymmetric: x = (code − zero_point)·scale, code 0..255 — the u8 cache of OpenVINO's
//         CPU plugin — with a float32 scale and a float32 zero point.
//   s8    symmetric: x = code·scale, the byte read as a two's-complement int8 (−128..127; an
//         append writes −127..127), a float32 scale and no zero point. A torch.int8 cache is
//         passed as its .view(torch.uint8).
//
// Granularity of u8 and s8 scales (and zero points, same shape and strides as the scales):
//   per_page   one per (page, kv head), shape (pages or batch_cache, heads_kv) — per (cache
//              row, kv head) in a contiguous cache. The caller sets them (as OpenVINO's
//              by-channel groups and vLLM's static scales): an append only reads them, and
//              every page an append writes or a call reads must have a finite scale > 0 and a
//              finite zero point. An appended x becomes code = round(x/scale + zero_point)
//              (s8: round(x/scale)), ties to even, clamped to 0..255 (s8: −127..127): values
//              beyond the page's range saturate to its ends.
//   per_token  one per (token, kv head), shape (pages or batch_cache, page_size or
//              seqlen_cache, heads_kv): the slot's own. An append computes them from the token's
//              row (its head_dim or head_dim_v values x): u8 scale = (max x − min x)/255,
//              zero_point = −min x / scale; s8 scale = max|x| / 127. A constant row c (u8)
//              gets every code 128 with scale |c| and zero_point 128 − sign c (scale 1 and
//              zero_point 128 for zeros), an all-zero row (s8) scale 1: both are stored
//              exactly, and the narrow decode kernels below read their codes as 0 (no
//              half-precision rounding of 128·scale); a row whose step would underflow
//              float32 gets scale 1 (within the bound).
//
// Error bound (tests/test_int8_cache.cpp): every appended x reads back as x̂ with
//   |x̂ − x| ≤ (1/2 + 2^-23·(1 + |zero_point|))·scale
// (half a step; the second term covers the double-precision rounding of x/scale + zero_point
// and, per token, the zero point's rounding to float32) — per token always, per page for x
// within the page's range [(lo − zero_point)·scale, (hi − zero_point)·scale], lo..hi the
// codes an append writes. Per token that is about (max x − min x)/510 (u8) or max|x|/254 (s8).
// The tiled and decode kernels read the values (code − zero_point)·scale in float32. The
// tiled kernel dequantizes each element as it packs (int8_code_value exactly); the decode
// kernel applies scales and zero points to what its products give, (Q·(code − 128) −
// ΣQ·(zero_point − 128))·scale for a u8 key (likewise for P·V), so zero points far from 128
// — values far from 0 next to their spread — lose float32 precision in that difference.
// decode_fp16 (AVX512-FP16, where the planner takes it for int8 codes as for FP8) takes the same steps
// with Q·(code − 128) and (P·scale)·(code − 128) in half precision (codes exact, Q and P·scale
// rounded to half, partial sums of a few terms): roundings of 2^-11 relative, a small part of
// the half step above (src/cpu/kernels/fp16_decode.hpp; tests/test_int8_cache.cpp holds it
// to twice a half-precision yardstick's error). decode_bf16 (AVX512-BF16 without AVX512-FP16,
// planned on AMD's cores) rounds P·scale to bf16 (2^-9 relative) and sums in float32, and
// multiplies the K codes on AVX512-VNNI's integer products by Q rounded to integers of 2^-13
// of each row's largest magnitude, exactly (src/cpu/kernels/bf16_decode.hpp and
// int8_dot.hpp; held to twice the error of a yardstick that rounds the same operands).
#pragma once

#include <cstdint>
#include <string>

namespace flashattn {

enum class KvCodes : std::uint8_t { e4m3, u8, s8 };
enum class KvScaleGranularity : std::uint8_t { per_page, per_token };

// One pool's format; the default is the FP8 e4m3 cache.
struct KvQuant {
  KvCodes codes = KvCodes::e4m3;
  KvScaleGranularity granularity = KvScaleGranularity::per_page;
  bool operator==(const KvQuant&) const = default;
};

const char* to_string(KvCodes codes);
const char* to_string(KvScaleGranularity granularity);
// Parse "e4m3", "u8", "s8" and "per_page", "per_token"; throw Error otherwise.
KvCodes parse_kv_codes(const std::string& name);
KvScaleGranularity parse_kv_scale_granularity(const std::string& name);

// The value of an int8 code (u8 or s8; zero_point is ignored for s8), the definition every
// kernel follows: (code − zero_point)·scale in float32.
float int8_code_value(KvCodes codes, std::uint8_t code, float scale, float zero_point);

// Quantizes n floats as an append does: with (scale, zero_point) as given (per page), or —
// choose_scale — first computing them from the n values (per token) into *scale and
// *zero_point. codes u8 or s8; the values must be finite.
void quantize_int8(KvCodes codes, const float* x, std::int64_t n, bool choose_scale, float* scale, float* zero_point,
                   std::uint8_t* out);

}  // namespace flashattn
