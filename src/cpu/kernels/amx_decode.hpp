// The decode kernel's scores on AMX tiles: where the CPU has AMX-BF16 (and the OS grants the
// tile state), S = Q·Kᵀ of bf16 queries against a cache of bf16 values runs as TDPBF16PS —
// a tile of 16 keys' K rows (32 head-dim values each, read in place: TILELOADD takes the
// cache's row stride) times the kv head's Q rows laid out as pairs of head-dim values per
// column (PackQ), into a float32 tile of scores. Every product of two bf16 values is exact
// in float32 and the sums are float32, as in the decode kernel's FMA chains; Q is not
// rounded (it is bf16 already) and not scaled before its product — its scores are, by
// softmax_scale·log2e. P·V stays the decode kernel's own (P in float32).
//
// Why: the FMA path pays a reduction per (row, four keys) and a widening per K vector, about
// 60 cycles per (kv head, key) at head dim 64 on the Sapphire Rapids of docs/performance.md;
// a TDPBF16PS on 16 keys takes about 16 cycles there, whatever its columns (the rows of a kv
// head), so 2 cycles per key and 32 head-dim values. Keys that do not lie one stride apart
// within a tile — a page boundary inside 16 keys, the block's last keys — load from a copy
// (the caller's staging, KeyTile). Compiled for the baseline ISA, each function carrying
// AMX and AVX-512 in its target attribute; callers reach it only where available() says so.
#pragma once

#include <cstdint>

namespace flashattn::cpu::amxdecode {

constexpr std::int64_t kKeys = 16;     // keys per tile
constexpr std::int64_t kChunk = 32;    // head-dim values per tile row (64 bytes of bf16)
constexpr std::int64_t kMaxRows = 16;  // query rows per kv head (a tile's 16 columns)

// True where the tiles run: AMX-BF16 usable and not switched off (bf16dot::uses_amx).
bool available();

// The tile configuration of an item whose kv heads have `rows` (1 ≤ rows ≤ kMaxRows) rows,
// loaded for the scope's span; the thread's previous configuration (another library's, or
// none) comes back on leaving.
class ItemTiles {
 public:
  explicit ItemTiles(std::int64_t rows);
  ~ItemTiles();
  ItemTiles(const ItemTiles&) = delete;
  ItemTiles& operator=(const ItemTiles&) = delete;

 private:
  alignas(64) unsigned char saved_[64];
};

// 16 K rows of a tile: row i at rows + i·stride (bytes), each of at least the head dim's
// bf16 values; every row must be readable (the caller stages what is not).
struct KeyTile {
  const unsigned char* rows;
  std::int64_t stride;
};

// Rows to fetch into L2 while the products run (the next kv head's K rows, this one's V
// rows): `count` keys' K rows (k_bytes at k_offset from k[i]) and V rows (likewise), spread
// over the products' tiles.
struct Fetch {
  const unsigned char* const* k = nullptr;
  const unsigned char* const* v = nullptr;
  std::int64_t k_count = 0, v_count = 0;
  std::int64_t k_offset = 0, v_offset = 0, k_bytes = 0, v_bytes = 0;
};

// Q of one kv head for Scores: qt[(c·16 + p)·rows + r] holds elements 32c + 2p (low half)
// and 32c + 2p + 1 (high half) of row r — q[r] the row's d bf16 values, null for a padding
// row (zeros) — d a multiple of kChunk.
void PackQ(const std::uint16_t* const* q, std::int64_t rows, std::int64_t d, std::uint32_t* qt);

// s[r·lds + c] = scale · (row r of Q)·(key c % 16 of tile c / 16), r < rows, c < n: the n
// keys' ⌈n / 16⌉ tiles of k (columns past n are not written).
void Scores(const std::uint32_t* qt, std::int64_t rows, std::int64_t d, const KeyTile* k, std::int64_t n,
            float scale, float* s, std::int64_t lds, const Fetch& fetch);

}  // namespace flashattn::cpu::amxdecode
