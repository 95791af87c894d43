// The tests' own support code (tests/support, tools/support): the random inputs every test,
// the CLI and the benchmarks draw, and the case type's description and ALiBi slopes.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * dtype_size(a.dtype())) == 0;
}

// Several blocks of the generator (65536 elements each) and a ragged last one.
constexpr std::int64_t kElements = 3 * 65536 + 1234;

TEST(RandomInputs, DependOnTheSeedAloneNotOnTheThreadCount) {
  const int threads = omp_get_max_threads();
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(to_string(dtype));
    omp_set_num_threads(1);
    const Tensor one = random_tensor(dtype, {1, kElements, 1, 1}, 42);
    omp_set_num_threads(3);
    const Tensor three = random_tensor(dtype, {1, kElements, 1, 1}, 42);
    omp_set_num_threads(threads);
    EXPECT_TRUE(same_bits(one, three));
    EXPECT_FALSE(same_bits(one, random_tensor(dtype, {1, kElements, 1, 1}, 43)));
    // Normal values rounded to the dtype, none zero; every block drawn (mean ≈ 0, variance ≈ 1).
    double sum = 0.0, squares = 0.0;
    for (std::int64_t i = 0; i < one.numel(); ++i) {
      const float x = one.get(i);
      ASSERT_NE(x, 0.0f) << "element " << i;
      ASSERT_EQ(round_to(dtype, x), x) << "element " << i;
      sum += x;
      squares += static_cast<double>(x) * x;
    }
    EXPECT_NEAR(sum / kElements, 0.0, 0.01);
    EXPECT_NEAR(squares / kElements, 1.0, 0.02);
  }
  // Blocks are not copies of each other.
  const Tensor t = random_tensor(DType::f32, {kElements}, 7);
  EXPECT_NE(std::memcmp(t.data_as<float>(), t.data_as<float>() + 65536, 1024 * sizeof(float)), 0);
  expect_error([] { random_tensor(DType::i32, {4}, 1); }, {"random_tensor", "i32"});
}

TEST(RandomInputs, QkvInTheProblemsLayoutFromConsecutiveSeeds) {
  const AttentionProblem p = AttentionProblem::from_sizes(2, 5, 7, 4, 2, 8, 6, DType::bf16, {});
  const support::Qkv in = support::random_inputs(p, 11);
  EXPECT_EQ(in.q.shape(), (std::vector<std::int64_t>{2, 5, 4, 8}));
  EXPECT_EQ(in.k.shape(), (std::vector<std::int64_t>{2, 7, 2, 8}));
  EXPECT_EQ(in.v.shape(), (std::vector<std::int64_t>{2, 7, 2, 6}));
  EXPECT_TRUE(same_bits(in.q, random_tensor(DType::bf16, {2, 5, 4, 8}, 11)));
  EXPECT_TRUE(same_bits(in.k, random_tensor(DType::bf16, {2, 7, 2, 8}, 12)));
  EXPECT_TRUE(same_bits(in.v, random_tensor(DType::bf16, {2, 7, 2, 6}, 13)));
}

TEST(TestCase, DescribesTheProblemTheCallsOptionsAndTheSeed) {
  AttentionOptions o;
  o.causal = true;
  o.num_threads = 3;
  o.num_splits = 2;
  o.deterministic = true;
  const Case c({1, 9, 17, 4, 2, 40, 24}, DType::f16, o, 77);
  const std::string d = c.describe();
  for (const char* field : {"seqlen_q=9", "seqlen_k=17", "heads_q=4", "heads_kv=2", "head_dim=40", "head_dim_v=24",
                            "dtype=f16", "causal=true", "threads=3", "num_splits=2", "deterministic", "input_seed=77"})
    EXPECT_NE(d.find(field), std::string::npos) << "'" << d << "' lacks " << field;
  EXPECT_EQ(c.inputs().dout.shape(), (std::vector<std::int64_t>{1, 9, 4, 24}));
  expect_error([] { Case({1, 9, 17, 3, 2, 40, 24}, DType::f32); }, {"heads", "3", "2"});
}

TEST(TestCase, AlibiSlopesLiveAsLongAsAnyCopy) {
  Case copy({1, 30, 40, 3, 1, 16, 16}, DType::f32);
  {
    const Case with = Case({1, 30, 40, 3, 1, 16, 16}, DType::f32, {}, 5).with_alibi();
    copy = with.with([](AttentionOptions& o) { o.causal = true; });
  }
  ASSERT_TRUE(copy.problem().alibi);
  const TensorView slopes = copy.options().alibi_slopes;
  ASSERT_EQ(slopes.shape[0], 3);
  EXPECT_EQ(static_cast<const float*>(slopes.data)[2], 0.25f);  // 2^(−1 − 2/2)
  check_forward(copy);
}

}  // namespace
}  // namespace flashattn::test
