// What the library's own entry points know of a problem beyond the public AttentionProblem:
// the problem is one part of a larger call, its k and v are stored in another form, or its
// probabilities are rounded as an FP8 tensor core rounds them. The front door (src/api) sets
// these on the jobs it hands a backend; the CPU planner (src/cpu/planner.hpp) and kernels
// read them. A problem planned or computed from the public API alone has the defaults.
#pragma once

#include <cstdint>

#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::detail {

struct ProblemInternals {
  // Index of batch element 0 in a larger batch: a variable-length batch and a KV cache run
  // each sequence as its own problem, and sequence b keys its dropout mask and (batch,
  // heads) ALiBi slopes with batch index b.
  std::int64_t batch_offset = 0;
  // k and v are an FP8 e4m3 KV cache: codes (u8) with per-block descales, not values in
  // the problem's dtype. The planner's decode_fp16 and decode_bf16 kernels read only such caches and
  // int8_kv_cache's.
  bool fp8_kv_cache = false;
  // k and v are a quantized KV cache (u8 codes) of which at least one pool holds int8 codes
  // (u8 or s8, include/flashattn/kv_quant.hpp; the other may be e4m3): PagedKv says how each
  // reads. Not fp8_kv_cache: only e4m3 pools take an FP8 kernel's paths.
  bool int8_kv_cache = false;
  // Set by forward_fp8 only: P is rounded to FP8 e4m3 before P·V, as an FP8 tensor core
  // multiplies it (ℓ sums the unrounded P).
  bool fp8_probabilities = false;

  // The dtype k and v are stored in: the problem's, or u8 for a quantized cache.
  DType kv_dtype(const AttentionProblem& problem) const {
    return fp8_kv_cache || int8_kv_cache ? DType::u8 : problem.dtype;
  }
};

}  // namespace flashattn::detail
