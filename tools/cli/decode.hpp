// The decode bench case: one decoding step over a KV cache, as `run --decode` and `bench`
// time it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "flashattn/flashattn.hpp"

namespace flashattn::cli {

// One decoding step over a KV cache of `cached` tokens: q is one token per sequence, one new
// token is appended (contiguous cache when page_size is 0, else paged). The cache has q's
// dtype (cache_format empty), or codes: "e4m3" (FP8, one descale per page or cache row and kv
// head), "u8" or "s8" (int8, one scale — and for u8 one zero point — per token and kv head,
// include/flashattn/kv_quant.hpp). `kernel`: the request (--kernel), as AttentionOptions::kernel.
struct DecodeCase {
  std::int64_t batch = 1, heads = 32, heads_kv = 8, dim = 128, cached = 32768, page_size = 0;
  DType dtype = DType::bf16;
  std::string cache_format;
  // What the cache stores: cache_format, or q's dtype.
  std::string cache_name() const { return cache_format.empty() ? to_string(dtype) : cache_format; }
  int threads = 0;
  ForwardKernel kernel = ForwardKernel::automatic;
};
struct DecodeMeasurement {
  double seconds = 0.0;
  double gbps = 0.0;       // K and V bytes read (the whole cache once) per second
  double max_error = 0.0;  // against float64 on the logical cache, sampled heads
  std::size_t cache_bytes = 0;
  std::string kernel;  // the plan's
};
DecodeMeasurement measure_decode(const DecodeCase& c, int repeats);

}  // namespace flashattn::cli
