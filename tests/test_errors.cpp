// Every invalid argument gets a flashattn::Error whose message names it and its values.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

struct Inputs {
  Tensor q = random_tensor(DType::f32, {2, 5, 4, 8}, 1);
  Tensor k = random_tensor(DType::f32, {2, 6, 2, 8}, 2);
  Tensor v = random_tensor(DType::f32, {2, 6, 2, 8}, 3);
  Tensor out{DType::f32, {2, 5, 4, 8}};
  Tensor lse{DType::f32, {2, 4, 5}};
  void run(const AttentionOptions& options = {}) {
    forward(q.view(), k.view(), v.view(), out.view(), lse.view(), options);
  }
};

TEST(Errors, ValidInputsPass) {
  Inputs in;
  EXPECT_NO_THROW(in.run());
}

TEST(Errors, MismatchedShapes) {
  {
    Inputs in;
    in.k = random_tensor(DType::f32, {3, 6, 2, 8}, 2);
    expect_error([&] { in.run(); }, {"k: batch 3", "q batch 2"});
  }
  {
    Inputs in;
    in.v = random_tensor(DType::f32, {2, 7, 2, 8}, 3);
    expect_error([&] { in.run(); }, {"v: seqlen 7", "k seqlen 6"});
  }
  {
    Inputs in;
    in.v = random_tensor(DType::f32, {2, 6, 1, 8}, 3);
    expect_error([&] { in.run(); }, {"v: heads 1", "k heads 2"});
  }
  {
    Inputs in;
    in.k = random_tensor(DType::f32, {2, 6, 2, 16}, 2);
    expect_error([&] { in.run(); }, {"k: head_dim 16", "q head_dim 8"});
  }
  {
    Inputs in;
    in.k = random_tensor(DType::f32, {2, 6, 3, 8}, 2);
    in.v = random_tensor(DType::f32, {2, 6, 3, 8}, 3);
    expect_error([&] { in.run(); }, {"q has 4 heads", "3 heads"});
  }
  {
    Inputs in;
    in.out = Tensor(DType::f32, {2, 5, 4, 9});
    expect_error([&] { in.run(); }, {"out: shape (2, 5, 4, 9)", "expected (2, 5, 4, 8)"});
  }
  {
    Inputs in;
    in.lse = Tensor(DType::f32, {2, 5, 4});
    expect_error([&] { in.run(); }, {"lse: shape (2, 5, 4)", "expected (2, 4, 5)"});
  }
  {
    Inputs in;
    in.q = random_tensor(DType::f32, {2, 5, 4}, 1);
    expect_error([&] { in.run(); }, {"q: expected rank 4", "got rank 3"});
  }
}

TEST(Errors, MismatchedDtypes) {
  {
    Inputs in;
    in.k = random_tensor(DType::bf16, {2, 6, 2, 8}, 2);
    expect_error([&] { in.run(); }, {"k: dtype bf16", "expected f32"});
  }
  {
    Inputs in;
    in.out = Tensor(DType::f16, {2, 5, 4, 8});
    expect_error([&] { in.run(); }, {"out: dtype f16", "expected f32"});
  }
  {
    Inputs in;
    in.lse = Tensor(DType::bf16, {2, 4, 5});
    expect_error([&] { in.run(); }, {"lse: dtype bf16", "float32"});
  }
}

TEST(Errors, HeadDimOutOfRange) {
  for (std::int64_t d : {577, 1000}) {
    const Tensor q = random_tensor(DType::f32, {1, 2, 1, d}, 1);
    expect_error([&] { forward(q.view(), q.view(), q.view()); },
                 {"head_dim: " + std::to_string(d), "[1, 576]"});
  }
  const Tensor q(DType::f32, {1, 2, 1, 0});
  expect_error([&] { forward(q.view(), q.view(), q.view()); }, {"head_dim: 0"});
  const Tensor big = random_tensor(DType::f32, {1, 2, 1, 600}, 1);
  const Tensor small = random_tensor(DType::f32, {1, 2, 1, 8}, 1);
  expect_error([&] { forward(small.view(), small.view(), big.view()); }, {"head_dim_v: 600"});
}

TEST(Errors, NullDataNegativeSizesAndStrides) {
  Inputs in;
  TensorView null_q(nullptr, DType::f32, {2, 5, 4, 8});
  expect_error([&] { forward(null_q, in.k.view(), in.v.view(), in.out.view(), in.lse.view()); },
               {"q: null data with 320 elements"});
  TensorView negative(in.q.data(), DType::f32, {2, -5, 4, 8});
  expect_error([&] { forward(negative, in.k.view(), in.v.view()); }, {"q: negative size -5", "dim 1"});
  TensorView neg_stride(in.q.data(), DType::f32, {2, 5, 4, 8}, {160, -32, 8, 1});
  expect_error([&] { forward(neg_stride, in.k.view(), in.v.view()); }, {"q: negative stride -32"});
  TensorView empty_null(nullptr, DType::f32, {0, 5, 4, 8});  // no elements: null is fine
  const Tensor k0(DType::f32, {0, 6, 2, 8});
  EXPECT_NO_THROW(forward(empty_null, k0.view(), k0.view()));
}

TEST(Errors, LastDimensionMustBeContiguous) {
  Inputs in;
  TensorView strided(in.k.data(), DType::f32, {2, 6, 2, 4}, {96, 16, 8, 2});
  expect_error([&] { forward(in.q.view(), strided, in.v.view()); },
               {"k: last dimension must be contiguous", "got stride 2"});
}

TEST(Errors, BadOptions) {
  Inputs in;
  AttentionOptions nan_scale;
  nan_scale.softmax_scale = std::nanf("");
  expect_error([&] { in.run(nan_scale); }, {"softmax_scale: must be finite", "nan"});
  // Finite but past float32's largest / log2(e): scale·log2(e) was inf, the output NaN. The
  // limit, AttentionProblem::kLargestScaled, is named in the message.
  AttentionOptions huge_scale;
  huge_scale.softmax_scale = 3e38f;
  expect_error([&] { in.run(huge_scale); }, {"softmax_scale", "at most 2.35e+38", "3e+38"});
  // Between the limit and float32's largest / log2(e) (2.3587e38), where scale·log2(e) may
  // round up to inf: refused as well.
  AttentionOptions boundary_scale;
  boundary_scale.softmax_scale = 2.355e38f;
  expect_error([&] { in.run(boundary_scale); }, {"softmax_scale", "at most 2.35e+38", "2.355e+38"});
  AttentionOptions huge_softcap;
  huge_softcap.softcap = 3e38f;
  expect_error([&] { in.run(huge_softcap); }, {"softcap", "at most 2.35e+38", "3e+38"});
  // Sink logits and ALiBi slopes likewise (sink·log2 e was inf: out and lse NaN; a slope's
  // inf times the diagonal's distance 0 was NaN).
  Tensor sinks(DType::f32, {4}), slopes(DType::f32, {2, 4});
  for (std::int64_t h = 0; h < 4; ++h) sinks.set(h, h == 2 ? 3e38f : 0.5f);
  for (std::int64_t i = 0; i < 8; ++i) slopes.set(i, i == 6 ? std::nanf("") : 0.25f);
  AttentionOptions huge_sink;
  huge_sink.sinks = sinks.view();
  expect_error([&] { in.run(huge_sink); }, {"sinks: sink logit of head 2", "at most 2.35e+38"});
  AttentionOptions bad_slope;
  bad_slope.alibi_slopes = slopes.view();
  expect_error([&] { in.run(bad_slope); }, {"alibi_slopes: slope of batch 1, head 2 is nan"});
  slopes.set(6, -3e38f);
  expect_error([&] { in.run(bad_slope); }, {"alibi_slopes: slope of batch 1, head 2", "at most 3.91667e+37",
                                             "over the largest query-key distance 6"});
  // A slope within kLargestScaled whose product with a distance is not: slope·log2e·distance
  // overflowed in float32 — −1e38 gave NaN rows (∞ − ∞), +1e38 rows taken as seeing no key.
  for (const float slope : {-1e38f, 1e38f}) {
    slopes.set(6, slope);
    expect_error([&] { in.run(bad_slope); }, {"alibi_slopes: slope of batch 1, head 2", "distance 6"});
  }
  slopes.set(6, -3.9e37f);  // just within: every score finite, out finite, lse +inf at most
  in.run(bad_slope);
  for (std::int64_t e = 0; e < in.out.numel(); ++e) ASSERT_TRUE(std::isfinite(in.out.get(e))) << "out element " << e;
  AttentionOptions threads;
  threads.num_threads = -2;
  expect_error([&] { in.run(threads); }, {"num_threads", "-2"});
  threads.num_threads = kMaxThreads + 1;  // a team (and a workspace) per thread: refused by name
  expect_error([&] { in.run(threads); }, {"num_threads: must be in [0, 4096]", "got 4097"});
}

TEST(Errors, OutputsMayNotOverlapInputsOrThemselves) {
  Inputs in;
  Tensor shared(DType::f32, {2, 5, 4, 8});
  const Tensor q = random_tensor(DType::f32, {2, 5, 4, 8}, 1);
  std::copy_n(q.data_as<float>(), q.numel(), shared.data_as<float>());
  expect_error([&] { forward(shared.view(), in.k.view(), in.v.view(), shared.view(), in.lse.view()); },
               {"out: output memory overlaps input q"});
  MutableTensorView broadcast(in.out.data(), DType::f32, {2, 5, 4, 8}, {0, 32, 8, 1});
  expect_error([&] { forward(in.q.view(), in.k.view(), in.v.view(), broadcast, in.lse.view()); },
               {"out: stride 0 of dim 0", "overlap"});
  EXPECT_EQ(std::vector<float>(shared.data_as<float>(), shared.data_as<float>() + shared.numel()),
            std::vector<float>(q.data_as<float>(), q.data_as<float>() + q.numel()))
      << "a rejected call must not write";
}

TEST(Errors, IndexOverflowIsRejected) {
  Inputs in;
  TensorView huge(in.q.data(), DType::f32, {2, 5, 4, 8}, {std::int64_t{1} << 62, 32, 8, 1});
  expect_error([&] { forward(huge, in.k.view(), in.v.view()); }, {"q: shape (2, 5, 4, 8)", "overflows"});
}

}  // namespace
}  // namespace flashattn::test
