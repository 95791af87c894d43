// Which (batch, kv head) a thread's packed K/V buffers hold, and how many of its keys are
// packed: the forward and backward kernels pack a head once per thread and extend the
// packed prefix as later work items need more keys.
#pragma once

#include <algorithm>
#include <cstdint>

namespace flashattn::cpu {

struct PackedHead {
  std::int64_t batch = -1;
  std::int64_t kv_head = -1;
  std::int64_t keys = 0;  // keys [0, keys) are packed

  // Keys [first, end) still to pack so that the first `end` keys of (b, kv_head) are;
  // switching heads starts over. Call done(end) once they are packed.
  std::int64_t first_to_pack(std::int64_t b, std::int64_t head) {
    if (batch != b || kv_head != head) {
      batch = b;
      kv_head = head;
      keys = 0;
    }
    return keys;
  }
  void done(std::int64_t end) { keys = std::max(keys, end); }
};

}  // namespace flashattn::cpu
