// Many application threads calling forward and backward at once — on their own data and on
// shared read-only inputs — get exactly the results of serial calls.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

TEST(Concurrency, ParallelCallersMatchSerialCalls) {
  constexpr int kCallers = 6;
  const Tensor shared_k = random_tensor(DType::f32, {1, 150, 2, 32}, 99);
  std::vector<Tensor> qs, douts;
  for (int c = 0; c < kCallers; ++c) {
    qs.push_back(random_tensor(DType::f32, {1, 70 + 9 * c, 4, 32}, 100 + static_cast<std::uint64_t>(c)));
    douts.push_back(random_tensor(DType::f32, {1, 70 + 9 * c, 4, 32}, 200 + static_cast<std::uint64_t>(c)));
  }
  AttentionOptions o;
  o.causal = true;
  o.deterministic = true;
  o.num_threads = 2;
  std::vector<ForwardResult> serial_fwd;
  std::vector<BackwardResult> serial_bwd;
  for (int c = 0; c < kCallers; ++c) {
    serial_fwd.push_back(forward(qs[c].view(), shared_k.view(), shared_k.view(), o));
    serial_bwd.push_back(backward(douts[c].view(), qs[c].view(), shared_k.view(), shared_k.view(),
                                  serial_fwd[c].out.view(), serial_fwd[c].lse.view(), o));
  }
  std::vector<int> mismatches(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c)
    callers.emplace_back([&, c] {
      for (int repeat = 0; repeat < 3; ++repeat) {
        const ForwardResult f = forward(qs[c].view(), shared_k.view(), shared_k.view(), o);
        const BackwardResult g = backward(douts[c].view(), qs[c].view(), shared_k.view(), shared_k.view(),
                                          f.out.view(), f.lse.view(), o);
        mismatches[c] += !bitwise_equal(f.out, serial_fwd[c].out) + !bitwise_equal(f.lse, serial_fwd[c].lse) +
                         !bitwise_equal(g.dq, serial_bwd[c].dq) + !bitwise_equal(g.dk, serial_bwd[c].dk) +
                         !bitwise_equal(g.dv, serial_bwd[c].dv);
      }
    });
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) EXPECT_EQ(mismatches[c], 0) << "caller " << c;
}

TEST(Concurrency, MoreThreadsThanWork) {
  const Tensor q = random_tensor(DType::f32, {1, 3, 1, 8}, 1);
  const Tensor k = random_tensor(DType::f32, {1, 5, 1, 8}, 2);
  AttentionOptions o;
  o.num_threads = 64;
  const ForwardResult r = forward(q.view(), k.view(), k.view(), o);
  EXPECT_LE(max_abs_error(r.out, reference::attention(q.view(), k.view(), k.view(), o).out), 1e-5);
}

}  // namespace
}  // namespace flashattn::test
