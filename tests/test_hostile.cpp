// Hostile values: NaN and ±Inf in the inputs poison exactly the rows that read them; huge
// scores neither overflow nor lose exactness; denormals and zero or negative scales work.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

bool row_has_nan(const Tensor& out, std::int64_t row, std::int64_t width) {
  for (std::int64_t c = 0; c < width; ++c)
    if (std::isnan(out.get(row * width + c))) return true;
  return false;
}

// Every score of row 7 is NaN. SIMD max instructions may drop a NaN operand (x86 returns
// the second one), so the row must not pass for one without visible keys (lse −∞, out 0)
// on any target; 300 keys leave a ragged last tile whose padding is −∞.
TEST(Hostile, NaNInAQueryPoisonsOnlyItsRow) {
  for_each_simd_target([](const std::string&) {
    for (DType dtype : {DType::f32, DType::bf16})
      for (std::int64_t keys : {300, 16, 5}) {
        SCOPED_TRACE(to_string(dtype) + " keys " + std::to_string(keys));
        Tensor q = random_tensor(dtype, {1, 40, 1, 16}, 1);
        const Tensor k = random_tensor(dtype, {1, keys, 1, 16}, 2);
        q.set(7 * 16 + 3, std::nanf(""));
        const ForwardResult r = forward(q.view(), k.view(), k.view());
        for (std::int64_t i = 0; i < 40; ++i) EXPECT_EQ(row_has_nan(r.out, i, 16), i == 7) << " row " << i;
        EXPECT_TRUE(std::isnan(r.lse.get(7)));
      }
  });
}

TEST(Hostile, NaNInAKeyPoisonsTheRowsThatSeeIt) {
  // Causal with Sq = Sk: key 25 is seen by rows 25.. only.
  const Tensor q = random_tensor(DType::f32, {1, 60, 1, 16}, 3);
  Tensor k = random_tensor(DType::f32, {1, 60, 1, 16}, 4);
  Tensor v = random_tensor(DType::f32, {1, 60, 1, 16}, 5);
  k.set(25 * 16, std::nanf(""));
  AttentionOptions o;
  o.causal = true;
  const ForwardResult r = forward(q.view(), k.view(), v.view(), o);
  for (std::int64_t i = 0; i < 60; ++i) EXPECT_EQ(row_has_nan(r.out, i, 16), i >= 25) << "row " << i;
  // Rows before the poisoned key are exact.
  const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);
  for (std::int64_t e = 0; e < 25 * 16; ++e) EXPECT_NEAR(r.out.get(e), want.out[static_cast<std::size_t>(e)], 1e-5);
}

TEST(Hostile, NonFiniteValueReachesItsReadersAndItsMicroTilesOnly) {
  // Causal, Sq = Sk = 64: value 50 (column 2) is read by rows 50.. only. P·V also meets it
  // through the exact zeros of the hidden probabilities of the rows whose micro-tile strip
  // computes key 50 (0·∞ and 0·NaN are NaN, as in any dense product; PyTorch's math
  // attention spreads it over the whole head): a strip of at most 8 rows spans its keys
  // rounded out to panels of at most 32, so rows up to 10 never meet it. Every other column
  // of every row, and column 2 of the rows that do not meet it, are finite and exact.
  constexpr std::int64_t n = 64, d = 8, bad = 50, column = 2, untouched = 10;
  for (const float value : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    SCOPED_TRACE("value " + std::to_string(value));
    const Tensor q = random_tensor(DType::f32, {1, n, 1, d}, 6);
    const Tensor k = random_tensor(DType::f32, {1, n, 1, d}, 7);
    Tensor v = random_tensor(DType::f32, {1, n, 1, d}, 8);
    AttentionOptions o;
    o.causal = true;
    const reference::Result want = reference::attention(q.view(), k.view(), v.view(), o);  // before the bad value
    v.set(bad * d + column, value);
    const ForwardResult r = forward(q.view(), k.view(), v.view(), o);
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t c = 0; c < d; ++c) {
        const float got = r.out.get(i * d + c);
        const double expected = want.out[static_cast<std::size_t>(i * d + c)];
        if (c == column && i >= bad) {  // a reader: +∞ stays +∞ (a positive weight), NaN stays NaN
          if (std::isnan(value))
            EXPECT_TRUE(std::isnan(got)) << "row " << i;
          else
            EXPECT_EQ(got, value) << "row " << i;
        } else if (c == column && i > untouched) {  // may meet it through a strip's zeros
          if (std::isfinite(got)) EXPECT_NEAR(got, expected, 1e-5) << "row " << i;
          EXPECT_FALSE(std::isinf(got)) << "row " << i << ": a row that does not read it is not ±∞";
        } else {
          ASSERT_TRUE(std::isfinite(got)) << "row " << i << " column " << c;
          EXPECT_NEAR(got, expected, 1e-5) << "row " << i << " column " << c;
        }
      }
  }
}

// ±Inf in q, k or v, and NaN in dout, through forward and backward on every SIMD target.
// Causal, Sq = Sk = 150 (ragged tiles), two heads with a kv head each, the bad value in head
// 0 at row (q, dout) or key (k, v) 70, column 5. Gradients that depend on it may be NaN or
// infinite: for a bad row, its dq and the dk, dv of the keys it sees; for a bad key, the dq
// of the rows that see it, their dk (through rowsum(dO∘O)) and, for k, their dv. Beyond
// those, the bad value also meets the exact zeros of masked probabilities inside the tile
// products (0·∞ and 0·NaN are NaN, as in any dense product — PyTorch's math attention
// spreads it over the whole head): for a bad row, to the dk and dv of the keys of the K/V
// tiles its Q tile computes (dKᵀ, dVᵀ sum over the tile's rows); for a bad key, to the dq of
// the rows of the Q tiles its K/V tile meets (dQ sums over the tile's keys). Every other
// gradient — the other head, rows and keys of tiles that never meet the bad value — must be
// finite and match the float64 reference.
struct HostileCase {
  const char* name;
  char tensor;  // 'q', 'k', 'v' or 'o' (dout)
  float value;
};

constexpr std::int64_t kHostileRows = 150, kHostileDim = 24, kBad = 70;

// Whether gradient `grad` ('q', 'k', 'v') of (row, head) may be reached by the bad value,
// with Q tiles of block_q rows and K/V tiles of block_k keys (causal, Sq = Sk: the tiles of
// rows [i0, i1) and keys [j0, j1) meet where j0 < i1).
bool reached(const HostileCase& c, char grad, std::int64_t row, std::int64_t head, std::int64_t block_q,
             std::int64_t block_k) {
  if (head != 0) return false;
  if (c.tensor == 'q' || c.tensor == 'o') {
    if (grad == 'q') return row == kBad;
    const std::int64_t tile_end = std::min(kHostileRows, (kBad / block_q + 1) * block_q);
    return row <= kBad || row / block_k * block_k < tile_end;  // seen keys, or a K/V tile the Q tile meets
  }
  if (grad == 'q') return row >= kBad || (row / block_q + 1) * block_q > kBad / block_k * block_k;
  return c.tensor == 'k' || grad == 'k';  // 'v': dv = Pᵀ·dO reads no V
}

void expect_backward_contained(DType dtype, BackwardKernel kernel) {
  constexpr std::int64_t heads = 2, n = kHostileRows, d = kHostileDim;
  const HostileCase cases[] = {{"+Inf in q", 'q', INFINITY}, {"-Inf in q", 'q', -INFINITY},
                               {"+Inf in k", 'k', INFINITY}, {"-Inf in k", 'k', -INFINITY},
                               {"+Inf in v", 'v', INFINITY}, {"-Inf in v", 'v', -INFINITY},
                               {"NaN in dout", 'o', std::numeric_limits<float>::quiet_NaN()}};
  AttentionOptions o;
  o.causal = true;
  o.num_threads = 2;
  o.backward_kernel = kernel;
  const CpuBackwardPlan plan = plan_backward(AttentionProblem::from_sizes(1, n, n, heads, heads, d, d, dtype, o),
                                             CpuHardware::detect(2), false, kernel);
  for (const HostileCase& c : cases) {
    SCOPED_TRACE(std::string(c.name) + " " + to_string(dtype) + " " + to_string(kernel));
    Tensor q = random_tensor(dtype, {1, n, heads, d}, 31), k = random_tensor(dtype, {1, n, heads, d}, 32);
    Tensor v = random_tensor(dtype, {1, n, heads, d}, 33), dout = random_tensor(dtype, {1, n, heads, d}, 34);
    Tensor& bad = c.tensor == 'q' ? q : c.tensor == 'k' ? k : c.tensor == 'v' ? v : dout;
    bad.set((kBad * heads + 0) * d + 5, c.value);
    const ForwardResult fwd = forward(q.view(), k.view(), v.view(), o);
    const BackwardResult got = backward(dout.view(), q.view(), k.view(), v.view(), fwd.out.view(), fwd.lse.view(), o);
    const reference::Gradients want = reference::attention_backward(dout.view(), q.view(), k.view(), v.view(), o);
    const double tolerance = dtype == DType::f32 ? 1e-4 : 0.05;  // relative to 1 + |reference|
    for (const auto& [name, grad, expected] : {std::tuple{'q', &got.dq, &want.dq}, std::tuple{'k', &got.dk, &want.dk},
                                               std::tuple{'v', &got.dv, &want.dv}}) {
      int leaks = 0, poisoned = 0;
      for (std::int64_t row = 0; row < n; ++row)
        for (std::int64_t h = 0; h < heads; ++h)
          for (std::int64_t e = 0; e < d; ++e) {
            const std::int64_t i = (row * heads + h) * d + e;
            const double x = grad->get(i), x_ref = (*expected)[static_cast<std::size_t>(i)];
            if (reached(c, name, row, h, plan.block_q, plan.block_k)) {
              poisoned += std::isfinite(x) ? 0 : 1;
            } else if (!std::isfinite(x) || std::fabs(x - x_ref) > tolerance * (1.0 + std::fabs(x_ref))) {
              if (++leaks <= 3)
                ADD_FAILURE() << "d" << name << " row " << row << " head " << h << " column " << e << ": " << x
                              << ", reference " << x_ref;
            }
          }
      EXPECT_EQ(leaks, 0) << "d" << name << " entries that the bad value must not reach";
      // The gradients that depend on it do show it: a bad value never vanishes silently.
      if (c.tensor != 'v' || name != 'v') EXPECT_GT(poisoned, 0) << "d" << name;
    }
  }
}

TEST(Hostile, InfinitiesAndNaNsStayContainedInTheBackward) {
  for_each_simd_target([](const std::string&) {
    expect_backward_contained(DType::f32, BackwardKernel::tiled);
    expect_backward_contained(DType::bf16, BackwardKernel::tiled);
  });
}

TEST(Hostile, InfinitiesAndNaNsStayContainedInTheBf16Backward) {
  int ran = 0;
  for_each_simd_target([&](const std::string&) {
    if (!CpuHardware::detect(2).bf16_dot) return;  // this target has no tiled_bf16
    ++ran;
    expect_backward_contained(DType::bf16, BackwardKernel::tiled_bf16);
  });
  EXPECT_EQ(ran > 0, cpu_has_avx512bf16());
  if (ran == 0) GTEST_SKIP() << "no AVX512-BF16 on this CPU: tiled_bf16 cannot run here";
}

TEST(Hostile, HugeScoresStayExactInLowPrecision) {
  // Scores of magnitude ~1e4 in bf16: the running maximum keeps exp from overflowing.
  Tensor q = random_tensor(DType::bf16, {1, 33, 2, 32}, 9);
  const Tensor k = random_tensor(DType::bf16, {1, 257, 2, 32}, 10);
  const Tensor v = random_tensor(DType::bf16, {1, 257, 2, 32}, 11);
  for (std::int64_t i = 0; i < q.numel(); ++i) q.set(i, q.get(i) * 400.0f);
  const ForwardResult got = forward(q.view(), k.view(), v.view());
  const reference::Result want = reference::attention(q.view(), k.view(), v.view());
  const AttentionProblem p = AttentionProblem::from_inputs(q.view(), k.view(), v.view(), {});
  const double tol = 2.0 * naive_output_error(naive_same_precision(p, {}, q, k, v), want.out, p.dtype, Exp2Impl::exact) + 1e-5;
  EXPECT_LE(max_abs_error(got.out, want.out), tol);
  for (std::int64_t i = 0; i < got.lse.numel(); ++i) EXPECT_TRUE(std::isfinite(got.lse.get(i)));
}

TEST(Hostile, DenormalInputs) {
  Tensor q = random_tensor(DType::f32, {1, 20, 1, 16}, 12);
  Tensor v = random_tensor(DType::f32, {1, 20, 1, 16}, 13);
  for (std::int64_t i = 0; i < q.numel(); ++i) {
    q.set(i, q.get(i) * 1e-39f);  // subnormal floats
    v.set(i, v.get(i) * 1e-39f);
  }
  const ForwardResult got = forward(q.view(), q.view(), v.view());
  const reference::Result want = reference::attention(q.view(), q.view(), v.view());
  EXPECT_LE(max_abs_error(got.out, want.out), 1e-44);
}

}  // namespace
}  // namespace flashattn::test

#include <sys/mman.h>

namespace flashattn::test {
namespace {

// k and v rows 2^29 elements apart in a sparse 8 GiB mapping: offsets reach 2^31 and
// beyond, while only the touched pages cost memory. The results must equal, bit for bit,
// those of the same values stored densely — for the decode kernel (3 queries), the tiled
// kernel (40 queries, more than the decode kernel takes), the backward, and a paged KV
// cache whose pages lie 2^29 elements apart (decode and tiled).
struct SparseRows {
  static constexpr std::int64_t kRowStride = std::int64_t{1} << 29, kRows = 5, kDim = 16;
  std::size_t bytes = static_cast<std::size_t>(kRows * kRowStride) * sizeof(float);
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  Tensor dense;
  explicit SparseRows(std::uint64_t seed) : dense(random_tensor(DType::f32, {1, kRows, 1, kDim}, seed)) {
    if (map == MAP_FAILED) return;
    auto* base = static_cast<float*>(map);
    for (std::int64_t j = 0; j < kRows; ++j)
      for (std::int64_t c = 0; c < kDim; ++c) base[j * kRowStride + c] = dense.get(j * kDim + c);
  }
  ~SparseRows() {
    if (map != MAP_FAILED) munmap(map, bytes);
  }
  // As (1, rows, 1, dim); as pages of one row each: (rows, 1, 1, dim).
  TensorView rows() const { return TensorView(map, DType::f32, {1, kRows, 1, kDim}, {kRows * kRowStride, kRowStride, kDim, 1}); }
  MutableTensorView pages() const {
    return MutableTensorView(map, DType::f32, {kRows, 1, 1, kDim}, {kRowStride, kDim, kDim, 1});
  }
};

TEST(Hostile, ElementOffsetsBeyondTwoToTheThirtyOne) {
  const SparseRows sparse(21);
  ASSERT_NE(sparse.map, MAP_FAILED) << "mmap of " << sparse.bytes << " bytes";
  const TensorView far_kv = sparse.rows();
  for (std::int64_t queries : {3, 40}) {
    const Tensor q = random_tensor(DType::f32, {1, queries, 1, SparseRows::kDim}, 22);
    const ForwardKernel kernel = queries == 3 ? ForwardKernel::decode : ForwardKernel::tiled;
    for (bool det : {false, true}) {
      SCOPED_TRACE(std::string(to_string(kernel)) + (det ? " deterministic" : ""));
      AttentionOptions o;
      o.deterministic = det;
      o.kernel = kernel;
      const ForwardResult far = forward(q.view(), far_kv, far_kv, o);
      const ForwardResult near = forward(q.view(), sparse.dense.view(), sparse.dense.view(), o);
      EXPECT_TRUE(bitwise_equal(far.out, near.out));
      const Tensor dout = random_tensor(DType::f32, {1, queries, 1, SparseRows::kDim}, 23);
      const BackwardResult g_far = backward(dout.view(), q.view(), far_kv, far_kv, far.out.view(), far.lse.view(), o);
      const BackwardResult g_near =
          backward(dout.view(), q.view(), sparse.dense.view(), sparse.dense.view(), near.out.view(), near.lse.view(), o);
      EXPECT_TRUE(bitwise_equal(g_far.dq, g_near.dq));
      EXPECT_TRUE(bitwise_equal(g_far.dk, g_near.dk));
      EXPECT_TRUE(bitwise_equal(g_far.dv, g_near.dv));
    }
  }
}

TEST(Hostile, PagedCacheOffsetsBeyondTwoToTheThirtyOne) {
  const SparseRows k_pool(25), v_pool(26);  // pages of one row each
  ASSERT_NE(k_pool.map, MAP_FAILED) << "mmap of " << k_pool.bytes << " bytes";
  ASSERT_NE(v_pool.map, MAP_FAILED) << "mmap of " << v_pool.bytes << " bytes";
  constexpr std::int64_t kRows = SparseRows::kRows;
  Tensor table(DType::i32, {1, kRows}), seqlens(DType::i32, {1});
  for (std::int64_t pg = 0; pg < kRows; ++pg) table.set(pg, static_cast<float>(kRows - 1 - pg));  // reversed
  seqlens.set(0, static_cast<float>(kRows));
  Tensor k(DType::f32, {1, kRows, 1, SparseRows::kDim}), v = k;  // the logical sequence, dense
  for (std::int64_t j = 0; j < kRows; ++j)
    for (std::int64_t c = 0; c < SparseRows::kDim; ++c) {
      k.set(j * SparseRows::kDim + c, k_pool.dense.get((kRows - 1 - j) * SparseRows::kDim + c));
      v.set(j * SparseRows::kDim + c, v_pool.dense.get((kRows - 1 - j) * SparseRows::kDim + c));
    }
  for (std::int64_t queries : {1, 40}) {
    const Tensor q = random_tensor(DType::f32, {1, queries, 1, SparseRows::kDim}, 24);
    AttentionOptions o;
    o.kernel = queries == 1 ? ForwardKernel::decode : ForwardKernel::tiled;
    SCOPED_TRACE(to_string(o.kernel));
    const KvCache paged{k_pool.pages(), v_pool.pages(), table.view(), seqlens.view()};
    const ForwardResult far = forward_with_kvcache(q.view(), paged, o);
    const ForwardResult near = forward(q.view(), k.view(), v.view(), o);
    EXPECT_TRUE(bitwise_equal(far.out, near.out));
    EXPECT_TRUE(bitwise_equal(far.lse, near.lse));
  }
}

}  // namespace
}  // namespace flashattn::test

namespace flashattn::test {
namespace {

// The bytes an out-of-memory Error names ("cannot allocate N bytes"), or -1 without one.
double bytes_named(const std::string& message) {
  const std::size_t at = message.find("cannot allocate ");
  if (at == std::string::npos) return -1.0;
  return std::strtod(message.c_str() + at + std::strlen("cannot allocate "), nullptr);
}

// 2^34 keys broadcast from one row (stride 0): valid input whose packed K and V would need
// terabytes (K alone: 2^34 keys × 128 × 4 bytes = 2^43). The call must fail with a
// flashattn::Error naming the size it could not allocate — not std::bad_alloc, not any other
// exception, not a crash — and write nothing: the Error names at least `min_bytes`.
void expect_out_of_memory_error(const AttentionOptions& options, double min_bytes) {
  const Tensor row = random_tensor(DType::f32, {1, 1, 1, 128}, 1);
  const TensorView k(row.data(), DType::f32, {1, std::int64_t{1} << 34, 1, 128}, {0, 0, 128, 1});
  const Tensor q = random_tensor(DType::f32, {1, 64, 1, 128}, 2);
  Tensor out(DType::f32, {1, 64, 1, 128}), lse(DType::f32, {1, 1, 64});
  for (std::int64_t i = 0; i < lse.numel(); ++i) lse.set(i, 5.0f);
  try {
    forward(q.view(), k, k, out.view(), lse.view(), options);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_GE(bytes_named(e.what()), min_bytes) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a flashattn::Error: " << e.what();
  }
  for (std::int64_t i = 0; i < lse.numel(); ++i) ASSERT_EQ(lse.get(i), 5.0f);
}

TEST(Hostile, OutOfMemoryIsAnErrorNamingTheSize) { expect_out_of_memory_error({}, 0x1p43); }

// The split-KV partial results are allocated per call too: 2^20 splits of 64 rows × 128
// floats (32 GiB). They came from std::vector, whose std::bad_alloc is not a flashattn::Error.
TEST(Hostile, SplitKvPartialsOutOfMemoryIsAnError) {
  AttentionOptions o;
  o.num_splits = 1 << 20;
  expect_out_of_memory_error(o, 0x1p33);
}

}  // namespace
}  // namespace flashattn::test
