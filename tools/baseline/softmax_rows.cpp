// Row softmax of the materialized score matrix for the standard-attention baseline,
// vectorized with Highway's exp so the baseline is the strong textbook, not a strawman.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tools/baseline/softmax_rows.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "tools/baseline/softmax_rows.hpp"

HWY_BEFORE_NAMESPACE();
namespace flashattn::baseline::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void SoftmaxRow(float* HWY_RESTRICT all, std::int64_t begin, std::int64_t end, std::int64_t cols,
                float scale, float* HWY_RESTRICT lse) {
  const hn::ScalableTag<float> df;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
  end = std::max(begin, end);
  std::fill(all, all + begin, 0.0f);
  std::fill(all + end, all + cols, 0.0f);
  float* row = all + begin;
  const std::int64_t visible = end - begin;
  if (visible == 0) {
    *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  float m = -std::numeric_limits<float>::infinity();
  for (std::int64_t j = 0; j < visible; ++j) m = std::max(m, row[j] * scale);
  const auto vscale = hn::Set(df, scale), vm = hn::Set(df, m);
  auto vsum = hn::Zero(df);
  std::int64_t j = 0;
  for (; j + lanes <= visible; j += lanes) {
    const auto e = hn::Exp(df, hn::MulSub(hn::LoadU(df, row + j), vscale, vm));
    hn::StoreU(e, df, row + j);
    vsum = hn::Add(vsum, e);
  }
  float sum = hn::GetLane(hn::SumOfLanes(df, vsum));
  for (; j < visible; ++j) sum += (row[j] = std::exp(row[j] * scale - m));
  const auto inv = hn::Set(df, 1.0f / sum);
  for (j = 0; j + lanes <= visible; j += lanes)
    hn::StoreU(hn::Mul(hn::LoadU(df, row + j), inv), df, row + j);
  for (; j < visible; ++j) row[j] /= sum;
  *lse = m + std::log(sum);
}

}  // namespace flashattn::baseline::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashattn::baseline {
HWY_EXPORT(SoftmaxRow);
void softmax_row(float* row, std::int64_t begin, std::int64_t end, std::int64_t cols, float scale,
                 float* lse) {
  HWY_DYNAMIC_DISPATCH(SoftmaxRow)(row, begin, end, cols, scale, lse);
}
}  // namespace flashattn::baseline
#endif
