// The decode kernel's scores on AMX tiles (amx_decode.hpp). Every function that uses the
// instructions carries them in its target attribute: this file is compiled for the baseline
// ISA, and nothing here is inlined into code that runs on CPUs without them.
#include "src/cpu/kernels/amx_decode.hpp"

#include "src/cpu/kernels/bf16_dot.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace flashattn::cpu::amxdecode {
namespace {

#define FLASHATTN_AMX_DECODE_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))

// The tiles (the intrinsics take their numbers as literals): 0 and 1 two key tiles' scores
// (16 keys × rows), 2 and 3 their K rows, 4 and 5 Q's head-dim chunks, alternating so that a
// load never waits on the product still reading the other.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t bytes_per_row[16] = {};
  std::uint8_t rows[16] = {};
};

FLASHATTN_AMX_DECODE_TARGET void Configure(std::int64_t rows) {
  TileConfig c;
  for (int t : {0, 1, 4, 5}) {  // scores and Q: a column per row
    c.rows[t] = kKeys;
    c.bytes_per_row[t] = static_cast<std::uint16_t>(4 * rows);
  }
  for (int t : {2, 3}) {  // K rows
    c.rows[t] = kKeys;
    c.bytes_per_row[t] = 64;
  }
  // GCC 12 takes LDTILECFG to read only the first byte of its operand (bf16_dot.cpp): the
  // empty asm makes the whole configuration be stored first.
  asm volatile("" : : "m"(c));
  _tile_loadconfig(&c);
}

FLASHATTN_AMX_DECODE_TARGET void SaveTiles(unsigned char* config) { _tile_storeconfig(config); }
FLASHATTN_AMX_DECODE_TARGET void LoadTiles(const unsigned char* config) { _tile_loadconfig(config); }
FLASHATTN_AMX_DECODE_TARGET void ReleaseTiles() { _tile_release(); }

// A row's 16 scores, scaled, the keys of mask `keys` only.
FLASHATTN_AMX_DECODE_TARGET inline __attribute__((always_inline)) void StoreScores(float* s, __mmask16 keys, __m512 scale,
                                                                                    __m512 x) {
  _mm512_mask_storeu_ps(s, keys, _mm512_mul_ps(scale, x));
}

// A score tile (16 keys × rows, key k's scores of every row side by side) into rows of s,
// scaled; only the first `count` keys' columns are written.
FLASHATTN_AMX_DECODE_TARGET void SpreadScores(const float* st, std::int64_t rows, std::int64_t count, float scale,
                                               float* s, std::int64_t lds) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const auto keys = static_cast<__mmask16>(count >= kKeys ? 0xFFFF : (1u << count) - 1);
  if (rows == 1) {
    StoreScores(s, keys, vscale, _mm512_load_ps(st));
  } else if (rows == 2) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512 z0 = _mm512_load_ps(st), z1 = _mm512_load_ps(st + 16);
    StoreScores(s, keys, vscale, _mm512_permutex2var_ps(z0, even, z1));
    StoreScores(s + 1 * lds, keys, vscale, _mm512_permutex2var_ps(z0, odd, z1));
  } else if (rows == 4) {
    // Keys 0–7 and 8–15 of rows (0, 1) and (2, 3), then each row's two halves joined.
    const __m512i rows01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i rows23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const __m512 z0 = _mm512_load_ps(st), z1 = _mm512_load_ps(st + 16);
    const __m512 z2 = _mm512_load_ps(st + 32), z3 = _mm512_load_ps(st + 48);
    const __m512 a01 = _mm512_permutex2var_ps(z0, rows01, z1), a23 = _mm512_permutex2var_ps(z0, rows23, z1);
    const __m512 b01 = _mm512_permutex2var_ps(z2, rows01, z3), b23 = _mm512_permutex2var_ps(z2, rows23, z3);
    StoreScores(s, keys, vscale, _mm512_permutex2var_ps(a01, lo, b01));
    StoreScores(s + 1 * lds, keys, vscale, _mm512_permutex2var_ps(a01, hi, b01));
    StoreScores(s + 2 * lds, keys, vscale, _mm512_permutex2var_ps(a23, lo, b23));
    StoreScores(s + 3 * lds, keys, vscale, _mm512_permutex2var_ps(a23, hi, b23));
  } else {
    const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(rows)));
    for (std::int64_t r = 0; r < rows; ++r) StoreScores(s + r * lds, keys, vscale, _mm512_i32gather_ps(index, st + r, 4));
  }
}

// The `chunks` 64-byte lines of a K tile's 16 rows into L1: what its tile loads wait on
// otherwise (each row comes from L2 a line at a time).
inline void FetchTile(const KeyTile& tile, std::int64_t chunks) {
  for (std::int64_t i = 0; i < kKeys; ++i)
    for (std::int64_t c = 0; c < chunks; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(tile.rows + i * tile.stride + 64 * c), _MM_HINT_T0);
}

// Keys [begin, end) of `fetch` into L2: their K rows, then their V rows.
inline void FetchRows(const Fetch& fetch, std::int64_t begin, std::int64_t end) {
  for (std::int64_t i = begin; i < std::min(end, fetch.k_count); ++i)
    for (std::int64_t at = 0; at < fetch.k_bytes; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(fetch.k[i] + fetch.k_offset + at), _MM_HINT_T1);
  for (std::int64_t i = begin; i < std::min(end, fetch.v_count); ++i)
    for (std::int64_t at = 0; at < fetch.v_bytes; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(fetch.v[i] + fetch.v_offset + at), _MM_HINT_T1);
}

FLASHATTN_AMX_DECODE_TARGET void ScoresImpl(const std::uint32_t* qt, std::int64_t rows, std::int64_t d,
                                             const KeyTile* k, std::int64_t n, float scale, float* s,
                                             std::int64_t lds, const Fetch& fetch) {
  alignas(64) float st[2][kKeys * kMaxRows];
  const long q_stride = static_cast<long>(4 * rows);
  const std::int64_t chunks = d / kChunk, tiles = (n + kKeys - 1) / kKeys;
  const std::int64_t per_step = (std::max(fetch.k_count, fetch.v_count) + tiles - 1) / tiles * 2;  // keys fetched per two tiles
  for (std::int64_t t = 0; t < tiles; t += 2) {
    const bool pair = t + 1 < tiles;  // two tiles in flight: each one's products wait on its loads
    FetchRows(fetch, t / 2 * per_step, (t / 2 + 1) * per_step);
    for (std::int64_t u = t + 2; u < std::min(t + 4, tiles); ++u) FetchTile(k[u], chunks);
    _tile_zero(0);
    _tile_zero(1);
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::uint32_t* q = qt + c * kKeys * rows;
      const std::int64_t at = c * kChunk * 2;  // bytes into a row
      if (c % 2 == 0) {
        _tile_loadd(4, q, q_stride);
        _tile_loadd(2, k[t].rows + at, k[t].stride);
        _tile_dpbf16ps(0, 2, 4);
        if (pair) {
          _tile_loadd(3, k[t + 1].rows + at, k[t + 1].stride);
          _tile_dpbf16ps(1, 3, 4);
        }
      } else {
        _tile_loadd(5, q, q_stride);
        _tile_loadd(2, k[t].rows + at, k[t].stride);
        _tile_dpbf16ps(0, 2, 5);
        if (pair) {
          _tile_loadd(3, k[t + 1].rows + at, k[t + 1].stride);
          _tile_dpbf16ps(1, 3, 5);
        }
      }
    }
    _tile_stored(0, st[0], q_stride);
    if (pair) _tile_stored(1, st[1], q_stride);
    SpreadScores(st[0], rows, n - t * kKeys, scale, s + t * kKeys, lds);
    if (pair) SpreadScores(st[1], rows, n - (t + 1) * kKeys, scale, s + (t + 1) * kKeys, lds);
  }
}

#undef FLASHATTN_AMX_DECODE_TARGET

}  // namespace

bool available() { return bf16dot::uses_amx(); }

ItemTiles::ItemTiles(std::int64_t rows) : saved_{} {
  SaveTiles(saved_);  // all zeros (palette 0) when the thread holds no tiles
  Configure(rows);
}

ItemTiles::~ItemTiles() {
  if (saved_[0] != 0)
    LoadTiles(saved_);
  else
    ReleaseTiles();
}

void PackQ(const std::uint16_t* const* q, std::int64_t rows, std::int64_t d, std::uint32_t* qt) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = 0; i < d / 2; ++i) {
      std::uint32_t pair = 0;  // elements 2i (low) and 2i + 1 (high), as stored
      if (q[r] != nullptr) std::memcpy(&pair, q[r] + 2 * i, sizeof pair);
      qt[i * rows + r] = pair;
    }
}

void Scores(const std::uint32_t* qt, std::int64_t rows, std::int64_t d, const KeyTile* k, std::int64_t n,
            float scale, float* s, std::int64_t lds, const Fetch& fetch) {
  ScoresImpl(qt, rows, d, k, n, scale, s, lds, fetch);
}

}  // namespace flashattn::cpu::amxdecode

#else  // AMX is x86-only: elsewhere the decode kernel computes its scores with FMA

namespace flashattn::cpu::amxdecode {
bool available() { return false; }
ItemTiles::ItemTiles(std::int64_t) : saved_{} {}
ItemTiles::~ItemTiles() = default;
void PackQ(const std::uint16_t* const*, std::int64_t, std::int64_t, std::uint32_t*) {}
void Scores(const std::uint32_t*, std::int64_t, std::int64_t, const KeyTile*, std::int64_t, float, float*,
            std::int64_t, const Fetch&) {}
}  // namespace flashattn::cpu::amxdecode

#endif
