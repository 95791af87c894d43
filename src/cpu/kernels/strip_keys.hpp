// The keys one row strip of a Q tile computes (FindStripKeys, score_mods-inl.h): shared by
// the tiled forward and the tiled backward.
#pragma once

#include <cstdint>

namespace flashattn::cpu {

// Columns [begin, end) of a K/V tile that one row strip of a Q tile (the micro-kernel's
// rows) computes, in whole micro-kernel panels; begin == end: none.
struct StripKeys {
  std::int64_t begin = 0;
  std::int64_t end = 0;
};

}  // namespace flashattn::cpu
