// Which (batch, kv head) a thread's packed K/V buffers hold, and which keys of it are
// packed: the forward and backward kernels pack a head once per thread and extend the
// packed range as later work items need more keys (tile-major buffers). The backward places
// key j at j; the forward at j − begin, so that a work item whose keys start where the packed
// ones end (the next document of a packed batch under a mask, the next key split) packs over
// the same few hundred KB, which the caches hold, instead of the next part of a head-sized
// buffer.
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
  // continues up to `to`: a different head, or a range that needs none of the packed keys
  // (from before begin, or from end on), starts over at `from`. Call done(to) once they are
  // packed.
  std::int64_t first_to_pack(std::int64_t b, std::int64_t head, std::int64_t from) {
    if (batch != b || kv_head != head || from < begin || from >= end) {
      batch = b;
      kv_head = head;
      begin = end = from;
    }
    return end;
  }
  void done(std::int64_t to) { end = std::max(end, to); }
};

}  // namespace flashattn::cpu
