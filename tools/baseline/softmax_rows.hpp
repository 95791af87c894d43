#pragma once

#include <cstdint>

namespace flashattn::baseline {

// row[begin, end) ← softmax(scale · row[begin, end)); the rest of row[0, cols) ← 0;
// *lse ← natural-log log-sum-exp (−∞ when the range is empty).
void softmax_row(float* row, std::int64_t begin, std::int64_t end, std::int64_t cols, float scale,
                 float* lse);

}  // namespace flashattn::baseline
