// Where the keys and values of one sequence live when they are not an ordinary view: the
// page pools of a paged KV cache, quantized pools (u8 codes) with their scales, or both. The
// front door (src/api/kvcache.cpp, paged_varlen.cpp) fills it per sequence; the kernels read
// keys through it.
#pragma once

#include <cstdint>

#include "flashattn/kv_quant.hpp"

namespace flashattn::detail {

// How one quantized pool's codes become values (include/flashattn/kv_quant.hpp): row j of
// kv head h, in page `page` at slot `slot`, reads with
//   scale[page · page_stride + slot · slot_stride + h · head_stride]
// and the zero point at the same offset of zero_point (u8 codes; null otherwise). Per
// (page, kv head) scales have slot_stride 0. `scale` null: the pool holds values.
struct KvScales {
  KvCodes codes = KvCodes::e4m3;
  const float* scale = nullptr;
  const float* zero_point = nullptr;
  std::int64_t page_stride = 0, slot_stride = 0, head_stride = 0;

  bool int8() const { return scale != nullptr && codes != KvCodes::e4m3; }
  std::int64_t offset(std::int64_t page, std::int64_t slot, std::int64_t head) const {
    return page * page_stride + slot * slot_stride + head * head_stride;
  }
};

// Paged (block_table set): key j of the sequence is row j % page_size of page
// block_table[(j / page_size) · table_stride] of the k and v views (the page pools).
// Otherwise k and v are the sequence's rows (batch 1): page 0, slot j. Quantized pools (k
// and v of dtype u8) carry their scales.
struct PagedKv {
  const std::int32_t* block_table = nullptr;  // null: k and v are ordinary views
  std::int64_t table_stride = 0;
  std::int64_t page_size = 0;
  KvScales k, v;
};

}  // namespace flashattn::detail
