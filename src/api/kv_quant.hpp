// The scales of a quantized KV cache's pools (include/flashattn/kv_quant.hpp) as
// forward_with_kvcache and forward_varlen_paged take them: their checks, and the KvScales a
// kernel reads a pool with. Each check throws Error naming the argument and the values.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "flashattn/kv_quant.hpp"
#include "flashattn/tensor.hpp"
#include "src/core/paged_kv.hpp"
#include "src/core/problem_internals.hpp"

namespace flashattn::detail {

// One pool of a cache and what reads it, with the names its arguments have in the call.
struct PoolScales {
  const char* pool;        // "k_cache"
  const char* scale_name;  // "k_scale"
  const char* zero_name;   // "k_zero_point"
  const char* quant_name;  // "k_quant"
  KvQuant quant;
  TensorView scale, zero_point;

  bool per_token() const { return quant.granularity == KvScaleGranularity::per_token; }
  bool has_zero_point() const { return quant.codes == KvCodes::u8; }
  // Offset of (page, slot, kv head) in the scales (and the zero points, which share their strides).
  std::int64_t offset(std::int64_t page, std::int64_t slot, std::int64_t head) const {
    return per_token() ? page * scale.strides[0] + slot * scale.strides[1] + head * scale.strides[2]
                       : page * scale.strides[0] + head * scale.strides[1];
  }
};

// A cache of q's dtype takes no scales, zero points or formats (their defaults): checked
// by check_cache_pools for both pools.
void reject_pool_scales(const PoolScales& p, DType cache_dtype);

// The views of a u8 pool's scales and zero points: float32 of the shape the granularity
// gives — (pages, heads_kv) per page, (pages, slots, heads_kv) per token, the pool's dims —
// zero points set exactly for u8 codes, with the scales' strides; e4m3 codes per page only.
void check_pool_scales(const PoolScales& p, const TensorView& pool);

// Every scale that reads slots [slot_begin, slot_end) of `page` (kv heads [0, heads)) finite
// and > 0, every zero point finite; `why()` ends the message (which sequence reads the page).
// A decode step checks every per-token scale of its sequence: one branch-free pass over them,
// the message made only for a failure.
void check_scale_values(const PoolScales& p, std::int64_t page, std::int64_t slot_begin, std::int64_t slot_end,
                        std::int64_t heads, const std::function<std::string()>& why);

// The KvScales a kernel reads the pool with: from (page, slot) = (row, first_slot) on
// (a contiguous cache's sequence: one page, its slots from first_slot), or the whole pool
// (paged: row 0, first_slot 0).
KvScales kv_scales(const PoolScales& p, bool paged, std::int64_t row, std::int64_t first_slot);

// What a sequence's problem knows of its cache: its batch index, and whether the pools are
// an FP8 cache (both e4m3) or hold int8 codes in either.
ProblemInternals cache_internals(std::int64_t batch_offset, bool quantized, const KvQuant& k, const KvQuant& v);

}  // namespace flashattn::detail
