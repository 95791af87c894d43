// Which (batch, kv head) a thread's packed K/V buffers hold, and which keys of it are
// packed: the forward and backward kernels pack a head once per thread and extend the
// packed range as later work items need more keys (tile-major buffers, so a key's place
// does not depend on what else is packed).
#pragma once

#include <algorithm>
#include <cstdint>

namespace flashattn::cpu {

struct PackedHead {
  std::int64_t batch = -1;
  std::int64_t kv_head = -1;
  std::int64_t begin = 0;  // keys [begin, end) are packed
  std::int64_t end = 0;

  // First key to pack so that keys [from, to) of (b, head) are packed, given that packing
  // continues up to `to`: a different head, or a range that does not touch the packed one,
  // starts over at `from`. Call done(to) once they are packed.
  std::int64_t first_to_pack(std::int64_t b, std::int64_t head, std::int64_t from) {
    if (batch != b || kv_head != head || from < begin || from > end) {
      batch = b;
      kv_head = head;
      begin = end = from;
    }
    return end;
  }
  void done(std::int64_t to) { end = std::max(end, to); }
};

}  // namespace flashattn::cpu
