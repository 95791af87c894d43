// The largest head dims, AttentionProblem::kMaxHeadDim: DeepSeek's absorbed MLA decode, Hq
// query heads on one kv head, K rows of 576 (512 latent + 64 rotary features) and V rows of
// 512 — through the forward, the backward, a paged KV cache and the paged varlen batch,
// against the float64 reference (check_forward, check_backward).
#include <gtest/gtest.h>

#include <limits>

#include "src/cpu/planner.hpp"
#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

constexpr std::int64_t kD = 576, kDv = 512, kHq = 16;

AttentionOptions options(bool causal, int threads) {
  AttentionOptions o;
  o.causal = causal;
  o.num_threads = threads;
  return o;
}

// The keys of a (batch, seqlen_k) case spread over pages of page_size slots in reverse
// order, one spare page first; slots no sequence fills hold NaN (read, they would poison
// the output).
struct Pages {
  Tensor k, v, table, seqlens;
};

Pages make_pages(const Case& c, const Inputs& in, std::int64_t page_size) {
  const AttentionProblem& p = c.problem();
  const std::int64_t per_seq = (p.seqlen_k + page_size - 1) / page_size, pages = p.batch * per_seq + 1;
  const std::int64_t k_row = p.heads_kv * p.head_dim, v_row = p.heads_kv * p.head_dim_v;
  Pages r{Tensor(p.dtype, {pages, page_size, p.heads_kv, p.head_dim}),
          Tensor(p.dtype, {pages, page_size, p.heads_kv, p.head_dim_v}), Tensor(DType::i32, {p.batch, per_seq}),
          Tensor(DType::i32, {p.batch})};
  for (std::int64_t i = 0; i < r.k.numel(); ++i) r.k.set(i, std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t i = 0; i < r.v.numel(); ++i) r.v.set(i, std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t b = 0; b < p.batch; ++b) {
    r.seqlens.set(b, static_cast<float>(p.seqlen_k));
    for (std::int64_t pg = 0; pg < per_seq; ++pg) r.table.set(b * per_seq + pg, static_cast<float>(pages - 1 - (b * per_seq + pg)));
    for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
      const auto page = static_cast<std::int64_t>(r.table.get(b * per_seq + j / page_size));
      const std::int64_t slot = page * page_size + j % page_size, row = b * p.seqlen_k + j;
      for (std::int64_t e = 0; e < k_row; ++e) r.k.set(slot * k_row + e, in.k.get(row * k_row + e));
      for (std::int64_t e = 0; e < v_row; ++e) r.v.set(slot * v_row + e, in.v.get(row * v_row + e));
    }
  }
  return r;
}

ForwardResult kvcache_forward(const Case& c, const Inputs& in, std::int64_t page_size) {
  Pages pages = make_pages(c, in, page_size);
  const KvCache cache{pages.k.view(), pages.v.view(), pages.table.view(), pages.seqlens.view()};
  return forward_with_kvcache(in.q.view(), cache, c.options());
}

// The batch as a packed one of equal lengths: q (batch · seqlen_q, heads_q, head_dim), its
// out read back as (batch, seqlen_q, ...) and lse (heads_q, total_q) as (batch, heads_q, seqlen_q).
ForwardResult varlen_paged_forward(const Case& c, const Inputs& in, std::int64_t page_size) {
  const AttentionProblem& p = c.problem();
  Pages pages = make_pages(c, in, page_size);
  const std::int64_t total = p.batch * p.seqlen_q;
  Tensor q(p.dtype, {total, p.heads_q, p.head_dim}), cu(DType::i32, {p.batch + 1});
  for (std::int64_t i = 0; i < q.numel(); ++i) q.set(i, in.q.get(i));
  for (std::int64_t b = 0; b <= p.batch; ++b) cu.set(b, static_cast<float>(b * p.seqlen_q));
  const PagedKvBatch kv{pages.k.view(), pages.v.view(), pages.table.view(), pages.seqlens.view(), {}, {}};
  const ForwardResult packed = forward_varlen_paged(q.view(), cu.view(), p.seqlen_q, kv, c.options());
  ForwardResult r{Tensor(packed.out.dtype(), {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}),
                  Tensor(DType::f32, {p.batch, p.heads_q, p.seqlen_q})};
  for (std::int64_t i = 0; i < r.out.numel(); ++i) r.out.set(i, packed.out.get(i));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      for (std::int64_t i = 0; i < p.seqlen_q; ++i)
        r.lse.set((b * p.heads_q + h) * p.seqlen_q + i, packed.lse.get(h * total + b * p.seqlen_q + i));
  return r;
}

TEST(Mla, DecodeRowsMatchTheReference) {
  std::uint64_t seed = 100;
  for (DType dtype : {DType::f32, DType::bf16})
    for (std::int64_t sq : {1, 2, 3, 4})
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE("seqlen_q " + std::to_string(sq) + " threads " + std::to_string(threads));
        check_forward(Case({2, sq, 157, kHq, 1, kD, kDv}, dtype, options(sq % 2 == 0, threads), seed++));
      }
}

TEST(Mla, PrefillMatchesTheReference) {
  for (DType dtype : {DType::f32, DType::bf16})
    for (int threads : {1, 3})
      check_forward(Case({1, 70, 70, kHq, 1, kD, kDv}, dtype, options(true, threads), 200 + threads));
  check_forward(Case({1, 70, 70, 2, 2, kD, kD}, DType::f32, options(false, 2), 210));  // Dv 576 too
}

TEST(Mla, BackwardMatchesTheReference) {
  check_backward(Case({1, 45, 70, 4, 1, kD, kDv}, DType::f32, options(true, 2), 300));
  check_backward(Case({1, 33, 50, 2, 1, kD, kDv}, DType::bf16, options(false, 3), 301));
}

TEST(Mla, PagedKvCacheMatchesTheReference) {
  std::uint64_t seed = 400;
  for (DType dtype : {DType::f32, DType::bf16})
    for (std::int64_t sq : {1, 4})
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE("seqlen_q " + std::to_string(sq) + " threads " + std::to_string(threads));
        const Case c({2, sq, 157, kHq, 1, kD, kDv}, dtype, options(true, threads), seed++);
        check_forward(c, [](const Case& cc, const Inputs& in) { return kvcache_forward(cc, in, 64); });
      }
  const Case prefill({1, 70, 70, kHq, 1, kD, kDv}, DType::f32, options(true, 2), seed++);
  check_forward(prefill, [](const Case& cc, const Inputs& in) { return kvcache_forward(cc, in, 16); });
}

TEST(Mla, VarlenPagedMatchesTheReference) {
  std::uint64_t seed = 500;
  for (DType dtype : {DType::f32, DType::bf16})
    for (std::int64_t sq : {1, 3})
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE("seqlen_q " + std::to_string(sq) + " threads " + std::to_string(threads));
        const Case c({2, sq, 157, kHq, 1, kD, kDv}, dtype, options(true, threads), seed++);
        check_forward(c, [](const Case& cc, const Inputs& in) { return varlen_paged_forward(cc, in, 16); });
      }
  const Case prefill({2, 70, 70, kHq, 1, kD, kDv}, DType::bf16, options(true, 3), seed++);
  check_forward(prefill, [](const Case& cc, const Inputs& in) { return varlen_paged_forward(cc, in, 32); });
}

// decode_fp16 bounds its half-precision sums for head_dim ≤ 512 (fp16_decode.hpp): the
// planner takes decode for an FP8 cache above it, and a request for it is an Error.
TEST(Mla, DecodeFp16IsNeverPlannedAboveItsHeadDim) {
  CpuHardware with = CpuHardware::detect(1);
  with.decode_fp16 = true;
  with.decode_bf16 = false;  // AVX512-BF16 CPUs without AMX (Zen 4) would plan it in decode's place
  constexpr detail::ProblemInternals kFp8Cache{.fp8_kv_cache = true};
  const AttentionProblem mla = AttentionProblem::from_sizes(1, 1, 500, kHq, 1, kD, kDv, DType::bf16, {});
  EXPECT_EQ(cpu::plan_forward(mla, kFp8Cache, with).kernel, ForwardKernel::decode);
  expect_error([&] { cpu::plan_forward(mla, kFp8Cache, with, 0, 0, ForwardKernel::decode_fp16); },
               {"kernel decode_fp16", "head_dim 576", "limit 512"});
  const AttentionProblem at_bound = AttentionProblem::from_sizes(1, 1, 500, kHq, 1, 512, 512, DType::bf16, {});
  EXPECT_EQ(cpu::plan_forward(at_bound, kFp8Cache, with).kernel, ForwardKernel::decode_fp16);
}

TEST(Mla, ValueDimAboveTheLimitNamesTheArgument) {
  const Tensor q = random_tensor(DType::f32, {1, 2, 1, kD + 1}, 1);  // Errors.HeadDimOutOfRange: as q, k
  const Tensor k = random_tensor(DType::f32, {1, 2, 1, kD}, 2);
  expect_error([&] { forward(k.view(), k.view(), q.view()); }, {"head_dim_v: 577", "[1, 576]"});
  expect_error([&] { AttentionProblem::from_sizes(1, 1, 8, kHq, 1, kD + 1, kDv, DType::f32, {}); },
               {"head_dim: 577"});
}

}  // namespace
}  // namespace flashattn::test
