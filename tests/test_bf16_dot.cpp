// The bf16 micro-kernel (src/cpu/kernels/bf16_dot.hpp) against float64 products of the same bf16
// values, on AMX tiles and on VDPBF16PS (AMX switched off) where the CPU has them: every
// entry point, depths that are and are not whole AMX chunks, strided operands; and the
// exact layout helpers (pairing rows, transposing words, rounding); and the kernels' use of
// the thread's AMX tile state, which other libraries in the process share.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <hwy/aligned_allocator.h>
#include <omp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "src/core/element.hpp"
#include "src/cpu/kernels/bf16_dot.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

namespace dot = cpu::bf16dot;

template <class T>
hwy::AlignedFreeUniquePtr<T[]> Random(std::size_t n, std::uint64_t seed) {
  auto p = hwy::AllocateAligned<T>(n);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>)
      p[i] = u(rng);
    else
      p[i] = float_to_bf16(u(rng));
  }
  return p;
}

// Why an engine cannot run here, or "" where it can: the VDPBF16PS path needs AVX512-BF16;
// the AMX path AMX-BF16 too, and the OS's grant of the tile state.
std::string Missing(bool amx) {
  if (!dot::available()) return "no AVX512-BF16 on this CPU: the bf16 micro-kernel cannot run here";
  if (amx && !dot::uses_amx()) return "no AMX on this CPU (or no tile state granted): the AMX path cannot run here";
  return "";
}

// Runs body on one engine: VDPBF16PS (AMX switched off where the CPU has it), or AMX.
void OnEngine(bool amx, const std::function<void()>& body) {
  dot::set_amx_enabled(amx);
  SCOPED_TRACE(amx ? "AMX" : "VDPBF16PS");
  body();
  dot::set_amx_enabled(true);
}

// C(rows × cols) of A (row r, pair p at a[r·lda + 2p]) times B (column c, pair p
// at b[(c / kCols)·panel_stride + p·b_step + (c % kCols)·2]) in float64, and the sum of the
// terms' magnitudes (the scale of float32 accumulation error).
struct Product {
  std::vector<double> value, magnitude;
};
Product Reference(const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b,
                  std::int64_t panel_stride, std::int64_t b_step, std::int64_t pairs, std::int64_t rows,
                  std::int64_t cols) {
  Product r{std::vector<double>(static_cast<std::size_t>(rows * cols)), std::vector<double>(static_cast<std::size_t>(rows * cols))};
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t c = 0; c < cols; ++c)
      for (std::int64_t p = 0; p < pairs; ++p)
        for (std::int64_t t = 0; t < 2; ++t) {
          const double x = bf16_to_float(a[i * lda + 2 * p + t]);
          const double y = bf16_to_float(b[c / dot::kCols * panel_stride + p * b_step + c % dot::kCols * 2 + t]);
          r.value[static_cast<std::size_t>(i * cols + c)] += x * y;
          r.magnitude[static_cast<std::size_t>(i * cols + c)] += std::fabs(x * y);
        }
  return r;
}

void ExpectNear(const float* c, std::int64_t ldc, const Product& want, double scale, const float* before,
                std::int64_t rows, std::int64_t cols) {
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) {
      const std::size_t e = static_cast<std::size_t>(i * cols + j);
      const double expect = scale * want.value[e] + (before != nullptr ? before[i * ldc + j] : 0.0);
      ASSERT_NEAR(c[i * ldc + j], expect, 1e-6 * (std::fabs(scale) * want.magnitude[e] + 1.0)) << i << ", " << j;
    }
}

void MicroTiles() {
  for (std::int64_t pairs : {1, 15, 16, 17, 40, 64}) {
    SCOPED_TRACE("pairs " + std::to_string(pairs));
    const std::int64_t lda = 2 * pairs + 6, ldc = 48;
    auto a = Random<std::uint16_t>(static_cast<std::size_t>(dot::kRows * lda), 1 + pairs);
    auto b = Random<std::uint16_t>(static_cast<std::size_t>(pairs * dot::kPairStep), 2 + pairs);
    auto c = Random<float>(static_cast<std::size_t>(dot::kRows * ldc), 3 + pairs);
    const Product want = Reference(a.get(), lda, b.get(), 0, dot::kPairStep, pairs, dot::kRows, dot::kCols);
    dot::DotStore(a.get(), lda, b.get(), pairs, 0.75f, c.get(), ldc);
    ExpectNear(c.get(), ldc, want, 0.75, nullptr, dot::kRows, dot::kCols);
    std::vector<float> before(c.get(), c.get() + dot::kRows * ldc);
    dot::DotAccumulate(a.get(), lda, b.get(), pairs, c.get(), ldc);
    ExpectNear(c.get(), ldc, want, 1.0, before.data(), dot::kRows, dot::kCols);
  }
}

void Blocks() {
  for (const auto& [rows, cols, pairs] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{8, 32, 20},
                                          {32, 64, 16}, {64, 32, 37}, {96, 96, 64}, {40, 64, 48}}) {
    SCOPED_TRACE("rows " + std::to_string(rows) + " cols " + std::to_string(cols) + " pairs " + std::to_string(pairs));
    const std::int64_t lda = 2 * pairs + 2, ldc = cols + 16;
    const std::int64_t b_step = 2 * cols, panel_stride = 2 * dot::kCols;  // a matrix paired by rows
    auto a = Random<std::uint16_t>(static_cast<std::size_t>(rows * lda), 10 + rows);
    auto b = Random<std::uint16_t>(static_cast<std::size_t>(pairs * b_step), 11 + cols);
    auto c = Random<float>(static_cast<std::size_t>(rows * ldc), 12 + pairs);
    const Product want = Reference(a.get(), lda, b.get(), panel_stride, b_step, pairs, rows, cols);
    dot::DotBlock(a.get(), lda, b.get(), panel_stride, b_step, pairs, -1.5f, false, c.get(), ldc, rows, cols);
    ExpectNear(c.get(), ldc, want, -1.5, nullptr, rows, cols);
    std::vector<float> before(c.get(), c.get() + rows * ldc);
    dot::DotBlock(a.get(), lda, b.get(), panel_stride, b_step, pairs, 1.0f, true, c.get(), ldc, rows, cols);
    ExpectNear(c.get(), ldc, want, 1.0, before.data(), rows, cols);
  }
}

TEST(Bf16Dot, MicroTilesOnVdpbf16ps) {
  if (const std::string why = Missing(false); !why.empty()) GTEST_SKIP() << why;
  OnEngine(false, MicroTiles);
}

TEST(Bf16Dot, MicroTilesOnAmx) {
  if (const std::string why = Missing(true); !why.empty()) GTEST_SKIP() << why;
  OnEngine(true, MicroTiles);
}

TEST(Bf16Dot, BlocksOnVdpbf16ps) {
  if (const std::string why = Missing(false); !why.empty()) GTEST_SKIP() << why;
  OnEngine(false, Blocks);
}

TEST(Bf16Dot, BlocksOnAmx) {
  if (const std::string why = Missing(true); !why.empty()) GTEST_SKIP() << why;
  OnEngine(true, Blocks);
}

TEST(Bf16Dot, LayoutHelpersAreExact) {
  if (!dot::available()) GTEST_SKIP() << "no AVX512-BF16 on this CPU: the bf16 micro-kernel cannot run here";
  constexpr std::int64_t n = 64;
  auto f0 = Random<float>(n, 20), f1 = Random<float>(n, 21);
  f0[5] = std::nanf("");
  f1[9] = 1e-40f;  // below float's normal range: zero, as VDPBF16PS reads it
  auto paired = hwy::AllocateAligned<std::uint16_t>(2 * n);
  dot::PairRows(f0.get(), f1.get(), paired.get(), n);
  for (std::int64_t k = 0; k < n; ++k) {
    if (k == 5) {
      EXPECT_TRUE(std::isnan(bf16_to_float(paired[2 * k])));
    } else {
      EXPECT_EQ(paired[2 * k], float_to_bf16(f0[k])) << k;
    }
    EXPECT_EQ(paired[2 * k + 1], k == 9 ? 0 : float_to_bf16(f1[k])) << k;
  }
  auto rounded = hwy::AllocateAligned<std::uint16_t>(n);
  dot::RoundToBf16(f1.get(), rounded.get(), n);
  for (std::int64_t k = 0; k < n; ++k) EXPECT_EQ(rounded[k], k == 9 ? 0 : float_to_bf16(f1[k])) << k;
  auto h0 = Random<std::uint16_t>(n, 22), h1 = Random<std::uint16_t>(n, 23);
  dot::PairRowsBf16(h0.get(), h1.get(), paired.get(), n);
  for (std::int64_t k = 0; k < n; ++k) {
    EXPECT_EQ(paired[2 * k], h0[k]) << k;
    EXPECT_EQ(paired[2 * k + 1], h1[k]) << k;
  }
  constexpr std::int64_t rows = 32, cols = 48, src_stride = 56, dst_stride = 40;
  std::vector<std::uint32_t> src(rows * src_stride), dst(cols * dst_stride, 0xFFFFFFFFu);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint32_t>(i * 2654435761u);
  dot::TransposeWords(src.data(), src_stride, dst.data(), dst_stride, rows, cols);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) ASSERT_EQ(dst[j * dst_stride + i], src[i * src_stride + j]) << i << ", " << j;
  for (std::int64_t j = 0; j < cols; ++j)  // nothing written past each row's `rows` words
    for (std::int64_t i = rows; i < dst_stride; ++i) ASSERT_EQ(dst[j * dst_stride + i], 0xFFFFFFFFu);
}

// The tiled_bf16 kernels end to end, forward and backward, with AMX on or off, under
// variants that let the softmax take softmax_scale·log2e in its exponent (causal, a boolean
// attn_mask: they only hide scores) and under those that need the products to apply it
// (softcap, an additive bias, a negative scale).
void KernelsMatchTheReference(bool amx) {
  struct {
    Tensor q, k, v;
  } in{random_tensor(DType::bf16, {1, 77, 2, 64}, 30), random_tensor(DType::bf16, {1, 150, 2, 64}, 31),
       random_tensor(DType::bf16, {1, 150, 2, 64}, 32)};
  const Tensor dout = random_tensor(DType::bf16, {1, 77, 2, 64}, 33);
  Tensor hidden(DType::u8, {1, 1, 77, 150}), bias = random_tensor(DType::f32, {1, 2, 77, 150}, 34);
  for (std::int64_t e = 0; e < hidden.numel(); ++e)  // every row keeps its first key and about 2 in 3 others
    hidden.data_as<std::uint8_t>()[e] = e % 150 == 0 || (e * 7919) % 3 != 0 ? 1 : 0;
  struct Variant {
    const char* name;
    AttentionOptions options;
  };
  std::vector<Variant> variants(5);
  variants[0] = {"causal", {}};
  variants[0].options.causal = true;
  variants[1] = {"boolean attn_mask", {}};
  variants[1].options.attn_mask = hidden.view();
  variants[2] = {"softcap", {}};
  variants[2].options.softcap = 2.0f;
  variants[3] = {"additive bias", {}};
  variants[3].options.attn_mask = bias.view();
  variants[4] = {"negative softmax_scale", {}};
  variants[4].options.softmax_scale = -0.125f;
  for (Variant& variant : variants) {
    SCOPED_TRACE(variant.name);
    AttentionOptions& o = variant.options;
    o.kernel = ForwardKernel::tiled_bf16;
    o.backward_kernel = BackwardKernel::tiled_bf16;
    dot::set_amx_enabled(amx);
    const ForwardResult got = forward(in.q.view(), in.k.view(), in.v.view(), o);
    const BackwardResult g =
        backward(dout.view(), in.q.view(), in.k.view(), in.v.view(), got.out.view(), got.lse.view(), o);
    dot::set_amx_enabled(true);
    const reference::Result want = reference::attention(in.q.view(), in.k.view(), in.v.view(), o);
    const AttentionProblem p = AttentionProblem::from_inputs(in.q.view(), in.k.view(), in.v.view(), o);
    EXPECT_LE(max_abs_error(got.out, want.out),
              2.0 * naive_output_error(naive_same_precision(p, o, in.q, in.k, in.v), want.out, p.dtype, o.exp2) + 1e-5);
    const reference::Gradients wg = reference::attention_backward(dout.view(), in.q.view(), in.k.view(), in.v.view(), o);
    const NaiveGradients n = naive_backward_same_precision(p, o, dout, in.q, in.k, in.v);
    EXPECT_LE(max_abs_error(g.dq, wg.dq), 3.0 * yardstick_error(n.dq, wg.dq, "the naive dq", INFINITY) + 1e-4);
    EXPECT_LE(max_abs_error(g.dk, wg.dk), 3.0 * yardstick_error(n.dk, wg.dk, "the naive dk", INFINITY) + 1e-4);
    EXPECT_LE(max_abs_error(g.dv, wg.dv), 3.0 * yardstick_error(n.dv, wg.dv, "the naive dv", INFINITY) + 1e-4);
  }
}

// On the VDPBF16PS path where AMX would otherwise take the products.
TEST(Bf16Dot, KernelsWithoutAmxMatchTheReference) {
  if (!dot::uses_amx()) GTEST_SKIP() << "no AMX on this CPU: the bf16 kernels already run on VDPBF16PS (or not at all)";
  KernelsMatchTheReference(false);
}

TEST(Bf16Dot, KernelsOnAmxMatchTheReference) {
  if (const std::string why = Missing(true); !why.empty()) GTEST_SKIP() << why;
  KernelsMatchTheReference(true);
}

#if defined(__x86_64__)
// A thread's tile configuration as another library in the process leaves it: 64 bytes of
// LDTILECFG's format, all zeros when the thread holds no tiles.
struct alignas(64) TileState {
  unsigned char bytes[64] = {};
  bool operator==(const TileState&) const = default;
};
__attribute__((target("amx-tile"))) TileState ReadTileState() {
  TileState s;
  _tile_storeconfig(s.bytes);
  return s;
}
__attribute__((target("amx-tile"))) void SetTileState(const TileState& s) {
  if (s.bytes[0] == 0)
    _tile_release();
  else
    _tile_loadconfig(s.bytes);
}

// oneDNN under PyTorch configures AMX tiles of its own shapes on the same OpenMP threads and
// releases them after its products. Between calls of the tiled_bf16 kernels, every thread is
// left as such a library leaves it: released, or configured with other shapes (8 tiles of 4
// rows × 32 bytes). The kernels give the same bits as after their own calls, and hand every
// thread back the state it had (a library that caches its configuration keeps working).
TEST(Bf16Dot, KernelsOnAmxLoadTheirTilesAndGiveBackTheThreadsState) {
  if (const std::string why = Missing(true); !why.empty()) GTEST_SKIP() << why;
  const Tensor q = random_tensor(DType::bf16, {1, 96, 2, 64}, 40);
  const Tensor k = random_tensor(DType::bf16, {1, 160, 2, 64}, 41);
  const Tensor v = random_tensor(DType::bf16, {1, 160, 2, 64}, 42);
  const Tensor dout = random_tensor(DType::bf16, {1, 96, 2, 64}, 43);
  AttentionOptions o;
  o.kernel = ForwardKernel::tiled_bf16;
  o.backward_kernel = BackwardKernel::tiled_bf16;
  o.num_threads = 2;
  const ForwardResult want = forward(q.view(), k.view(), v.view(), o);
  const BackwardResult want_g = backward(dout.view(), q.view(), k.view(), v.view(), want.out.view(), want.lse.view(), o);
  TileState other;
  other.bytes[0] = 1;  // palette 1
  for (int t = 0; t < 8; ++t) {
    other.bytes[16 + 2 * t] = 32;  // bytes per row
    other.bytes[48 + t] = 4;       // rows
  }
  for (const TileState& state : {TileState{}, other}) {
    SCOPED_TRACE(state.bytes[0] == 0 ? "released" : "another configuration");
    for (int threads : {1, 2}) {
      o.num_threads = threads;
#pragma omp parallel num_threads(2)
      SetTileState(state);
      const ForwardResult got = forward(q.view(), k.view(), v.view(), o);
#pragma omp parallel num_threads(2)
      SetTileState(state);
      const BackwardResult g = backward(dout.view(), q.view(), k.view(), v.view(), got.out.view(), got.lse.view(), o);
      EXPECT_TRUE(bitwise_equal(got.out, want.out)) << threads << " threads";
      EXPECT_TRUE(bitwise_equal(got.lse, want.lse)) << threads << " threads";
      EXPECT_TRUE(bitwise_equal(g.dq, want_g.dq) && bitwise_equal(g.dk, want_g.dk) && bitwise_equal(g.dv, want_g.dv))
          << threads << " threads";
      int changed = 0;
#pragma omp parallel num_threads(2) reduction(+ : changed)
      changed += ReadTileState() == state ? 0 : 1;
      EXPECT_EQ(changed, 0) << "threads whose tile state the kernels changed, after a call on " << threads;
    }
  }
}
#endif

}  // namespace
}  // namespace flashattn::test
