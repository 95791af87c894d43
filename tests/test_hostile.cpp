// Hostile values: NaN and ±Inf in the inputs poison exactly the rows that read them; huge
// scores neither overflow nor lose exactness; denormals and zero or negative scales work.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "test_util.hpp"

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

TEST(Hostile, InfinityInAValueReachesOnlyItsReaders) {
  const Tensor q = random_tensor(DType::f32, {1, 30, 1, 8}, 6);
  const Tensor k = random_tensor(DType::f32, {1, 30, 1, 8}, 7);
  Tensor v = random_tensor(DType::f32, {1, 30, 1, 8}, 8);
  v.set(10 * 8 + 2, std::numeric_limits<float>::infinity());
  AttentionOptions o;
  o.causal = true;
  const ForwardResult r = forward(q.view(), k.view(), v.view(), o);
  for (std::int64_t i = 0; i < 30; ++i)
    EXPECT_EQ(std::isinf(r.out.get(i * 8 + 2)), i >= 10) << "row " << i;
  EXPECT_TRUE(std::isfinite(r.out.get(0)));
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
  const double tol = 2.0 * max_abs_error(naive_same_precision(p, {}, q, k, v), want.out) + 1e-5;
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

TEST(Hostile, ElementOffsetsBeyondTwoToTheThirtyOne) {
  // k and v rows 2^29 elements apart in a sparse 8 GiB mapping: offsets reach 2^31 and
  // beyond, while only the touched pages cost memory.
  constexpr std::int64_t kRowStride = std::int64_t{1} << 29, kRows = 5, kDim = 16;
  const std::size_t bytes = static_cast<std::size_t>(kRows * kRowStride) * sizeof(float);
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(map, MAP_FAILED) << "mmap of " << bytes << " bytes";
  auto* base = static_cast<float*>(map);
  const Tensor dense = random_tensor(DType::f32, {1, kRows, 1, kDim}, 21);
  for (std::int64_t j = 0; j < kRows; ++j)
    for (std::int64_t c = 0; c < kDim; ++c) base[j * kRowStride + c] = dense.get(j * kDim + c);
  const TensorView sparse(base, DType::f32, {1, kRows, 1, kDim}, {kRows * kRowStride, kRowStride, kDim, 1});
  const Tensor q = random_tensor(DType::f32, {1, 3, 1, kDim}, 22);
  for (bool det : {false, true}) {
    AttentionOptions o;
    o.deterministic = det;
    const ForwardResult far = forward(q.view(), sparse, sparse, o);
    const ForwardResult near = forward(q.view(), dense.view(), dense.view(), o);
    EXPECT_EQ(std::memcmp(far.out.data(), near.out.data(), static_cast<std::size_t>(near.out.numel()) * 4), 0);
    const Tensor dout = random_tensor(DType::f32, {1, 3, 1, kDim}, 23);
    const BackwardResult g_far = backward(dout.view(), q.view(), sparse, sparse, far.out.view(), far.lse.view(), o);
    const BackwardResult g_near = backward(dout.view(), q.view(), dense.view(), dense.view(), near.out.view(), near.lse.view(), o);
    EXPECT_EQ(std::memcmp(g_far.dk.data(), g_near.dk.data(), static_cast<std::size_t>(g_near.dk.numel()) * 4), 0);
  }
  munmap(map, bytes);
}

}  // namespace
}  // namespace flashattn::test

namespace flashattn::test {
namespace {

TEST(Hostile, OutOfMemoryIsAnErrorNotACrash) {
  // 2^34 keys broadcast from one row (stride 0): valid input whose packed K and V would
  // need terabytes. The call must fail with an Error and write nothing.
  const Tensor row = random_tensor(DType::f32, {1, 1, 1, 128}, 1);
  const TensorView k(row.data(), DType::f32, {1, std::int64_t{1} << 34, 1, 128}, {0, 0, 128, 1});
  const Tensor q = random_tensor(DType::f32, {1, 64, 1, 128}, 2);
  Tensor out(DType::f32, {1, 64, 1, 128}), lse(DType::f32, {1, 1, 64});
  for (std::int64_t i = 0; i < lse.numel(); ++i) lse.set(i, 5.0f);
  EXPECT_THROW(forward(q.view(), k, k, out.view(), lse.view()), std::exception);
  for (std::int64_t i = 0; i < lse.numel(); ++i) ASSERT_EQ(lse.get(i), 5.0f);
}

}  // namespace
}  // namespace flashattn::test
