// Where the keys and values of one sequence live when they are not an ordinary view: the
// page pools of a paged KV cache, FP8 e4m3 pools with their descales, or both. The front
// door (src/api/kvcache.cpp) fills it per sequence; the kernels read keys through it.
#pragma once

#include <cstdint>

namespace flashattn::detail {

// Paged (block_table set): key j of the sequence is row j % page_size of page
// block_table[(j / page_size) · table_stride] of the k and v views (the page pools).
// Otherwise k and v are the sequence's rows (batch 1). FP8 e4m3 pools (k and v of dtype
// u8) carry descales: row j's value is its codes times
// descale[page · descale_page_stride + kv_head · descale_head_stride] (page 0 without a table).
struct PagedKv {
  const std::int32_t* block_table = nullptr;  // null: k and v are ordinary views
  std::int64_t table_stride = 0;
  std::int64_t page_size = 0;
  const float* k_descale = nullptr;  // null: not FP8
  const float* v_descale = nullptr;
  std::int64_t descale_page_stride = 0, descale_head_stride = 0;
};

}  // namespace flashattn::detail
