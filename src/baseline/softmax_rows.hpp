#pragma once

#include <cstdint>

namespace flashattn::baseline {

// row[0, visible) ← softmax(scale · row[0, visible)); row[visible, cols) ← 0;
// *lse ← natural-log log-sum-exp (−∞ when visible = 0).
void softmax_row(float* row, std::int64_t visible, std::int64_t cols, float scale, float* lse);

}  // namespace flashattn::baseline
