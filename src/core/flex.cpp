// The library's side of create_block_mask (include/flashattn/flex.hpp): its rows of blocks
// on the library's threads.
#include <exception>
#include <mutex>
#include <vector>

#include "flashattn/flex.hpp"

namespace flashattn::flex::detail {

void parallel_rows(std::int64_t count, const std::function<void(std::int64_t)>& row) {
  std::exception_ptr first;
  std::mutex guard;
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t item = 0; item < count; ++item) {
    try {
      row(item);
    } catch (...) {  // an exception must not leave the parallel region
      const std::lock_guard<std::mutex> lock(guard);
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

std::vector<std::int64_t> number_partial_blocks(const std::uint8_t* states, std::int64_t n, std::int32_t* slots) {
  std::vector<std::int64_t> at;
  for (std::int64_t e = 0; e < n; ++e) {
    const bool partial = states[e] == static_cast<std::uint8_t>(ScoreBlock::partial);
    slots[e] = partial ? static_cast<std::int32_t>(at.size()) : -1;
    if (partial) at.push_back(e);
  }
  return at;
}

}  // namespace flashattn::flex::detail
