// AVX512-BF16 micro-kernel (bf16_dot.hpp), on AMX tiles where the CPU and the OS offer them.
// Every function that uses the instructions carries them in its target attribute: this file
// is compiled for the baseline ISA, and nothing here is inlined into code that runs on CPUs
// without them.
#include "src/cpu/kernels/bf16_dot.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>
#include <cstring>

namespace flashattn::cpu::bf16dot {
namespace {

#define FLASHATTN_BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))

// C(kRows × kCols) = scale·A·B, or C += A·B when kAccumulate.
template <bool kAccumulate>
FLASHATTN_BF16_TARGET inline __attribute__((always_inline)) void Tile(const std::uint16_t* a, std::int64_t lda,
                                                                      const std::uint16_t* b, std::int64_t pairs,
                                                                      float scale, float* c, std::int64_t ldc,
                                                                      std::int64_t b_step = kPairStep) {
  __m512 acc[kRows][2];
  for (std::int64_t r = 0; r < kRows; ++r)
    for (std::int64_t v = 0; v < 2; ++v)
      acc[r][v] = kAccumulate ? _mm512_load_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (std::int64_t p = 0; p < pairs; ++p, b += b_step) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(b);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(b + kCols);
    for (std::int64_t r = 0; r < kRows; ++r) {
      std::uint32_t pair;  // row r's elements 2p and 2p + 1
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (std::int64_t r = 0; r < kRows; ++r)
    for (std::int64_t v = 0; v < 2; ++v)
      _mm512_store_ps(c + r * ldc + 16 * v, kAccumulate ? acc[r][v] : _mm512_mul_ps(acc[r][v], vscale));
}

// AMX: TDPBF16PS multiplies an A tile (rows × 16 pairs, each row contiguous in memory) by a
// B tile (16 pairs × 16 columns, a pair per column side by side — a half step of a B panel)
// into a float32 C tile, at a rate one core's FMAs cannot approach (3.1 TFLOP/s on one core
// of the Sapphire Rapids of docs/performance.md, against 0.24 for float32 FMA). The tiles
// here: 0 and 1 the micro-tile's two 16-column halves of C, 2 the A rows, 3 and 4 the two
// halves of 16 steps of the B panel.
#define FLASHATTN_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl")))
constexpr std::int64_t kAmxPairs = 16;  // depth pairs per TDPBF16PS

// The CPU has AMX-TILE and AMX-BF16 and Linux lets this process use the tile data (the
// permission is per process, requested once).
bool AmxUsable() {
  static const bool usable = [] {
#if defined(__linux__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
    if ((edx & (kAmxBf16 | kAmxTile)) != (kAmxBf16 | kAmxTile)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return usable;
}

std::atomic<bool> amx_enabled{true};  // set_amx_enabled: tests reach the VDPBF16PS path too

bool UseAmx() { return AmxUsable() && amx_enabled.load(std::memory_order_relaxed); }

// The tile configuration of this file (part of the thread's saved state, which other
// libraries in the process change too: TileScope).
struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t bytes_per_row[16] = {};
  std::uint8_t rows[16] = {};
};

// Two configurations: kMicro for the 8-row micro-tile (tiles 0, 1: C; 2: A; 3, 4: B) and
// kBlock for 32 × 32 blocks (tiles 0–3: C; 4, 5: A; 6, 7: B), all 16 columns (64 bytes)
// wide. Within a TileScope loaded when its first product needs one or switches between them;
// outside any scope by every product.
enum class Tiles { kNone, kMicro, kBlock };
thread_local int scope_depth = 0;
thread_local Tiles loaded = Tiles::kNone;  // valid only while scope_depth > 0

FLASHATTN_AMX_TARGET void ConfigureTiles(Tiles tiles) {
  if (scope_depth > 0 && loaded == tiles) return;
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    if (tiles == Tiles::kMicro)
      config.rows[t] = t < 3 ? kRows : t < 5 ? kAmxPairs : 0;
    else
      config.rows[t] = 16;
  }
  if (tiles == Tiles::kMicro)
    for (int t = 5; t < 8; ++t) config.bytes_per_row[t] = 0;
  // GCC 12 takes LDTILECFG to read only the first byte of its operand: where the stores
  // above are constants (ConfigureTiles inlined with its argument known), it drops all but
  // the palette's, and the tiles come out unconfigured (SIGILL at the first tile
  // instruction). The empty asm reads the whole configuration first.
  asm volatile("" : : "m"(config));
  _tile_loadconfig(&config);
  loaded = scope_depth > 0 ? tiles : Tiles::kNone;
}

// C(32 × 32) (+)= A·B over `chunks` · kAmxPairs depth pairs, the tiles configured as
// Tiles::kBlock by the caller (once per DotBlock: the configuration's check reads two
// thread-locals, a __tls_get_addr call each in the Python module).
template <bool kAccumulate>
FLASHATTN_AMX_TARGET void AmxBlock(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b,
                                   std::int64_t b_step, std::int64_t chunks, float* c, std::int64_t ldc) {
  const long c_stride = static_cast<long>(ldc * sizeof(float));
  float* c16 = c + 16 * ldc;
  if (kAccumulate) {
    _tile_loadd(0, c, c_stride);
    _tile_loadd(1, c + 16, c_stride);
    _tile_loadd(2, c16, c_stride);
    _tile_loadd(3, c16 + 16, c_stride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const long a_stride = static_cast<long>(lda * sizeof(std::uint16_t));
  const long step_bytes = static_cast<long>(b_step * sizeof(std::uint16_t));
  const std::uint16_t* a16 = a + 16 * lda;
  for (std::int64_t k = 0; k < chunks; ++k, b += kAmxPairs * b_step) {
    _tile_loadd(4, a + 2 * kAmxPairs * k, a_stride);
    _tile_loadd(5, a16 + 2 * kAmxPairs * k, a_stride);
    _tile_loadd(6, b, step_bytes);
    _tile_loadd(7, b + kCols, step_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, c_stride);
  _tile_stored(1, c + 16, c_stride);
  _tile_stored(2, c16, c_stride);
  _tile_stored(3, c16 + 16, c_stride);
}

// C (+)= A·B over `chunks` · kAmxPairs depth pairs; A's rows lda elements apart, pairs
// contiguous.
template <bool kAccumulate>
FLASHATTN_AMX_TARGET void AmxTile(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b,
                                  std::int64_t chunks, float* c, std::int64_t ldc) {
  ConfigureTiles(Tiles::kMicro);
  const long c_stride = static_cast<long>(ldc * sizeof(float));
  if (kAccumulate) {
    _tile_loadd(0, c, c_stride);
    _tile_loadd(1, c + 16, c_stride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
  }
  constexpr long kStepBytes = kPairStep * sizeof(std::uint16_t);
  for (std::int64_t k = 0; k < chunks; ++k, b += kAmxPairs * kPairStep) {
    _tile_loadd(2, a + 2 * kAmxPairs * k, static_cast<long>(lda * sizeof(std::uint16_t)));
    _tile_loadd(3, b, kStepBytes);
    _tile_loadd(4, b + kCols, kStepBytes);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, c, c_stride);
  _tile_stored(1, c + 16, c_stride);
}

// ConfigureTiles(Tiles::kBlock) for DotBlock, whose target has no AMX (the AMX function
// cannot be inlined into it).
FLASHATTN_AMX_TARGET void ConfigureBlockTiles() { ConfigureTiles(Tiles::kBlock); }

FLASHATTN_BF16_TARGET void Scale(float* c, std::int64_t ldc, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (std::int64_t r = 0; r < kRows; ++r)
    for (std::int64_t v = 0; v < 2; ++v)
      _mm512_store_ps(c + r * ldc + 16 * v, _mm512_mul_ps(_mm512_load_ps(c + r * ldc + 16 * v), vscale));
}

}  // namespace

bool available() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return has;
}

// With AMX: whole chunks of kAmxPairs on tiles, the rest on VDPBF16PS.
FLASHATTN_BF16_TARGET void DotStore(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b,
                                    std::int64_t pairs, float scale, float* c, std::int64_t ldc) {
  const std::int64_t chunks = UseAmx() ? pairs / kAmxPairs : 0;
  if (chunks == 0) return Tile<false>(a, lda, b, pairs, scale, c, ldc);
  AmxTile<false>(a, lda, b, chunks, c, ldc);
  if (pairs > chunks * kAmxPairs)
    Tile<true>(a + 2 * kAmxPairs * chunks, lda, b + chunks * kAmxPairs * kPairStep, pairs - chunks * kAmxPairs,
               1.0f, c, ldc);
  if (scale != 1.0f) Scale(c, ldc, scale);
}

FLASHATTN_BF16_TARGET void DotAccumulate(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b,
                                         std::int64_t pairs, float* c, std::int64_t ldc) {
  const std::int64_t chunks = UseAmx() ? pairs / kAmxPairs : 0;
  if (chunks > 0) AmxTile<true>(a, lda, b, chunks, c, ldc);
  if (pairs > chunks * kAmxPairs)
    Tile<true>(a + 2 * kAmxPairs * chunks, lda, b + chunks * kAmxPairs * kPairStep, pairs - chunks * kAmxPairs, 1.0f,
               c, ldc);
}

FLASHATTN_BF16_TARGET void PairRows(const float* row0, const float* row1, std::uint16_t* dst, std::int64_t n) {
  // Word k of the result takes element k of the rounded row0 (lanes 0..15 of the
  // conversion) and of row1 (lanes 16..31).
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (std::int64_t k = 0; k < n; k += 16) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row1 + k), _mm512_loadu_ps(row0 + k));
    _mm512_storeu_si512(dst + 2 * k, _mm512_permutexvar_epi16(interleave, (__m512i)h));
  }
}

FLASHATTN_BF16_TARGET void RoundToBf16(const float* src, std::uint16_t* dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; i += kCols) {
    // Lanes 0..15 of the result come from the second operand, 16..31 from the first.
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, (__m512i)h);
  }
}

FLASHATTN_BF16_TARGET void PairRowsBf16(const std::uint16_t* row0, const std::uint16_t* row1, std::uint16_t* dst,
                                        std::int64_t n) {
  // Indices below 32 pick row0's element, from 32 on row1's: words k of the two halves.
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                       5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (std::int64_t k = 0; k < n; k += 32) {
    const __m512i a = _mm512_loadu_si512(row0 + k), b = _mm512_loadu_si512(row1 + k);
    _mm512_storeu_si512(dst + 2 * k, _mm512_permutex2var_epi16(a, low, b));
    _mm512_storeu_si512(dst + 2 * k + 32, _mm512_permutex2var_epi16(a, high, b));
  }
}

FLASHATTN_BF16_TARGET void DotBlock(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b,
                                    std::int64_t b_panel_stride, std::int64_t b_step, std::int64_t pairs, float scale,
                                    bool accumulate, float* c, std::int64_t ldc, std::int64_t rows, std::int64_t cols) {
  const std::int64_t chunks = UseAmx() && rows % 32 == 0 ? pairs / kAmxPairs : 0;
  const std::int64_t done = chunks * kAmxPairs, rest = pairs - done;
  if (chunks > 0) ConfigureBlockTiles();
  for (std::int64_t j = 0; j < cols; j += kCols) {
    const std::uint16_t* panel = b + j / kCols * b_panel_stride;
    if (chunks > 0)
      for (std::int64_t r = 0; r < rows; r += 32) {
        if (accumulate)
          AmxBlock<true>(a + r * lda, lda, panel, b_step, chunks, c + r * ldc + j, ldc);
        else
          AmxBlock<false>(a + r * lda, lda, panel, b_step, chunks, c + r * ldc + j, ldc);
      }
    for (std::int64_t r = 0; r < rows; r += kRows) {
      float* cr = c + r * ldc + j;
      if (chunks == 0 && !accumulate) {
        Tile<false>(a + r * lda, lda, panel, pairs, scale, cr, ldc, b_step);
        continue;
      }
      if (rest > 0) Tile<true>(a + r * lda + 2 * done, lda, panel + done * b_step, rest, 1.0f, cr, ldc, b_step);
      if (!accumulate && scale != 1.0f) Scale(cr, ldc, scale);
    }
  }
}

FLASHATTN_BF16_TARGET void TransposeWords(const std::uint32_t* src, std::int64_t src_stride, std::uint32_t* dst,
                                          std::int64_t dst_stride, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t i0 = 0; i0 < rows; i0 += 16)
    for (std::int64_t j0 = 0; j0 < cols; j0 += 16) {
      // One 16 × 16 block: words of row pairs interleaved, then row quads (each 128-bit lane
      // then holds a 4 × 4 block transposed), then the 4 × 4 grid of lanes transposed.
      __m512i r[16], t[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (i0 + i) * src_stride + j0);
      for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
      }
      for (int g = 0; g < 16; g += 4) {  // u[g + k]: lane L holds rows g..g+3 of column 4L + k
        r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
      }
      for (int k = 0; k < 4; ++k) {  // output row 4L + k: lane L of r[k], r[4 + k], r[8 + k], r[12 + k]
        const __m512i v0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), v1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
        _mm512_storeu_si512(dst + (j0 + k) * dst_stride + i0, _mm512_shuffle_i32x4(v0, v2, 0x88));
        _mm512_storeu_si512(dst + (j0 + 4 + k) * dst_stride + i0, _mm512_shuffle_i32x4(v0, v2, 0xDD));
        _mm512_storeu_si512(dst + (j0 + 8 + k) * dst_stride + i0, _mm512_shuffle_i32x4(v1, v3, 0x88));
        _mm512_storeu_si512(dst + (j0 + 12 + k) * dst_stride + i0, _mm512_shuffle_i32x4(v1, v3, 0xDD));
      }
    }
}

bool outpaces_fma() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return available() && (amd || AmxUsable());
}

bool uses_amx() { return available() && UseAmx(); }

namespace {
FLASHATTN_AMX_TARGET void SaveTiles(unsigned char* config) { _tile_storeconfig(config); }
FLASHATTN_AMX_TARGET void LoadTiles(const unsigned char* config) { _tile_loadconfig(config); }
FLASHATTN_AMX_TARGET void ReleaseTiles() { _tile_release(); }
}  // namespace

TileScope::TileScope() : saved_{}, active_(available() && UseAmx()) {
  if (!active_) return;
  SaveTiles(saved_);  // all zeros (palette 0) when the thread holds no tiles
  ++scope_depth;
  loaded = Tiles::kNone;  // whatever ran before may have changed the configuration
}

TileScope::~TileScope() {
  if (!active_) return;
  loaded = Tiles::kNone;
  // The enclosing scope's configuration, or the one the thread came in with.
  if (--scope_depth > 0 || saved_[0] != 0)
    LoadTiles(saved_);
  else
    ReleaseTiles();
}

void set_amx_enabled(bool enabled) { amx_enabled.store(enabled, std::memory_order_relaxed); }

#undef FLASHATTN_BF16_TARGET

}  // namespace flashattn::cpu::bf16dot

#else  // AVX512-BF16 is x86-only: elsewhere the bf16 tiled kernel is never planned

namespace flashattn::cpu::bf16dot {
bool available() { return false; }
bool outpaces_fma() { return false; }
bool uses_amx() { return false; }
void set_amx_enabled(bool) {}
TileScope::TileScope() : saved_{}, active_(false) {}
TileScope::~TileScope() = default;
}  // namespace flashattn::cpu::bf16dot

#endif
