#include "src/api/kv_quant.hpp"

#include <cfloat>
#include <cmath>

#include "flashattn/error.hpp"
#include "src/core/validate.hpp"

namespace flashattn::detail {
namespace {

std::string str(std::int64_t v) { return std::to_string(v); }
bool is_set(const TensorView& t) { return t.data != nullptr || t.rank != 0; }

// Whether every x[i], i < n, is finite and positive (all_positive_finite) or finite
// (all_finite); NaN is neither.
bool all_positive_finite(const float* x, std::int64_t n) {
  int bad = 0;
  for (std::int64_t i = 0; i < n; ++i) bad |= static_cast<int>(!(x[i] > 0.0f)) | static_cast<int>(x[i] > FLT_MAX);
  return bad == 0;
}
bool all_finite(const float* x, std::int64_t n) {
  int bad = 0;
  for (std::int64_t i = 0; i < n; ++i) bad |= static_cast<int>(!(std::fabs(x[i]) <= FLT_MAX));
  return bad == 0;
}

}  // namespace

void reject_pool_scales(const PoolScales& p, DType cache_dtype) {
  if (is_set(p.zero_point))
    throw Error(std::string(p.zero_name) + ": zero points belong to a cache of u8 codes, not a " +
                to_string(cache_dtype) + " cache");
  if (p.quant != KvQuant{})
    throw Error(std::string(p.quant_name) + ": " + to_string(p.quant.codes) + " " +
                to_string(p.quant.granularity) + " describes u8 codes, not a " + to_string(cache_dtype) + " cache");
}

void check_pool_scales(const PoolScales& p, const TensorView& pool) {
  if (p.quant.codes == KvCodes::e4m3 && p.per_token())
    throw Error(std::string(p.quant_name) + ": e4m3 codes take per_page descales (an append grows them), not per_token");
  const char* layout = p.per_token() ? "(pages or batch_cache, page_size or seqlen_cache, heads_kv)"
                                     : "(pages or batch_cache, heads_kv)";
  const char* why = p.quant.codes == KvCodes::e4m3 ? "float32 descales" : "float32 scales";
  if (p.per_token())
    check_tensor(p.scale_name, p.scale, DType::f32, why, {pool.shape[0], pool.shape[1], pool.shape[2]}, layout);
  else
    check_tensor(p.scale_name, p.scale, DType::f32, why, {pool.shape[0], pool.shape[2]}, layout);
  if (!p.has_zero_point()) {
    if (is_set(p.zero_point))
      throw Error(std::string(p.zero_name) + ": " + to_string(p.quant.codes) + " codes have no zero point (u8 only)");
    return;
  }
  if (!is_set(p.zero_point))
    throw Error(std::string(p.zero_name) + ": u8 codes read as (code - zero_point) * scale need their zero points");
  if (p.per_token())
    check_tensor(p.zero_name, p.zero_point, DType::f32, "float32 zero points",
                 {pool.shape[0], pool.shape[1], pool.shape[2]}, layout);
  else
    check_tensor(p.zero_name, p.zero_point, DType::f32, "float32 zero points", {pool.shape[0], pool.shape[2]}, layout);
  for (int d = 0; d < p.scale.rank; ++d)
    if (p.zero_point.strides[d] != p.scale.strides[d])
      throw Error(std::string(p.zero_name) + ": strides differ from " + p.scale_name + "'s; give both the same layout");
  check_no_overlap(p.zero_name, p.zero_point, p.scale_name, p.scale);
}

void check_scale_values(const PoolScales& p, std::int64_t page, std::int64_t slot_begin, std::int64_t slot_end,
                        std::int64_t heads, const std::function<std::string()>& why) {
  const auto* scale = static_cast<const float*>(p.scale.data);
  const auto* zero = static_cast<const float*>(p.zero_point.data);
  if (slot_end <= slot_begin) return;
  if (!p.per_token()) slot_end = slot_begin + 1;  // one scale for every slot
  // Every call reads the scales of every cached token (a 32k-token step, 8 kv heads: 1M
  // floats with the zero points): where the slots' heads follow each other, one run of
  // floats through branch-free loops the compiler vectorizes.
  const std::int64_t head_stride = p.scale.strides[p.per_token() ? 2 : 1];
  const bool contiguous = head_stride == 1 && (!p.per_token() || p.scale.strides[1] == heads);
  bool ok = true;  // NaN fails both comparisons
  if (contiguous) {
    const std::int64_t at = p.offset(page, slot_begin, 0), n = (slot_end - slot_begin) * heads;
    ok = all_positive_finite(scale + at, n) && (zero == nullptr || all_finite(zero + at, n));
  } else {
    for (std::int64_t slot = slot_begin; slot < slot_end; ++slot)
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t at = p.offset(page, slot, h);
        ok &= (scale[at] > 0.0f) & (scale[at] <= FLT_MAX);
        if (zero != nullptr) ok &= std::fabs(zero[at]) <= FLT_MAX;
      }
  }
  if (ok) return;
  auto entry = [&](std::int64_t slot, std::int64_t h) {
    std::string e(1, '[');  // appended to, not "[" + string: GCC 12 warns (-Wrestrict) on that here
    e += str(page) + ", ";
    if (p.per_token()) e += str(slot) + ", ";
    return e + str(h) + "]";
  };
  for (std::int64_t slot = slot_begin; slot < slot_end; ++slot)
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t at = p.offset(page, slot, h);
      if (!(std::isfinite(scale[at]) && scale[at] > 0.0f))
        throw Error(std::string(p.scale_name) + ": " + entry(slot, h) + " = " + std::to_string(scale[at]) +
                    " is not a finite positive " + (p.quant.codes == KvCodes::e4m3 ? "descale" : "scale") + " (" +
                    why() + ")");
      if (zero != nullptr && !std::isfinite(zero[at]))
        throw Error(std::string(p.zero_name) + ": " + entry(slot, h) + " = " + std::to_string(zero[at]) +
                    " is not a finite zero point (" + why() + ")");
    }
}

KvScales kv_scales(const PoolScales& p, bool paged, std::int64_t row, std::int64_t first_slot) {
  const std::int64_t at = p.offset(row, p.per_token() ? first_slot : 0, 0);
  KvScales s;
  s.codes = p.quant.codes;
  s.scale = static_cast<const float*>(p.scale.data) + at;
  s.zero_point = p.has_zero_point() ? static_cast<const float*>(p.zero_point.data) + at : nullptr;
  s.page_stride = paged ? p.scale.strides[0] : 0;
  s.slot_stride = p.per_token() ? p.scale.strides[1] : 0;
  s.head_stride = p.scale.strides[p.per_token() ? 2 : 1];
  return s;
}

ProblemInternals cache_internals(std::int64_t batch_offset, bool quantized, const KvQuant& k, const KvQuant& v) {
  const bool e4m3 = k.codes == KvCodes::e4m3 && v.codes == KvCodes::e4m3;
  return {.batch_offset = batch_offset, .fp8_kv_cache = quantized && e4m3, .int8_kv_cache = quantized && !e4m3};
}

}  // namespace flashattn::detail
