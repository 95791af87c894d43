// Variable-length packed batches: equal to running each sequence on its own, forward and
// backward, with every variant that applies; bad offsets rejected.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

Tensor offsets(const std::vector<std::int32_t>& lengths) {
  Tensor t(DType::i32, {static_cast<std::int64_t>(lengths.size()) + 1});
  std::int32_t sum = 0;
  t.data_as<std::int32_t>()[0] = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) t.data_as<std::int32_t>()[i + 1] = (sum += lengths[i]);
  return t;
}

// Rows [begin, begin + len) of a packed (total, H, D) tensor as a (1, len, H, D) tensor.
Tensor slice(const Tensor& t, std::int64_t begin, std::int64_t len) {
  Tensor r(t.dtype(), {1, len, t.shape()[1], t.shape()[2]});
  const std::int64_t row = t.shape()[1] * t.shape()[2];
  for (std::int64_t i = 0; i < len * row; ++i) r.set(i, t.get(begin * row + i));
  return r;
}

void expect_bitwise_equal_rows(const Tensor& packed, std::int64_t begin, const Tensor& single,
                               const char* what) {
  const std::int64_t n = single.numel();
  const std::int64_t row = packed.shape()[1] * packed.shape()[2];
  for (std::int64_t i = 0; i < n; ++i)
    ASSERT_EQ(packed.get(begin * row + i), single.get(i)) << what << " element " << i;
}

void check_varlen(const std::vector<std::int32_t>& lq, const std::vector<std::int32_t>& lk,
                  AttentionOptions o, std::uint64_t seed) {
  const Tensor cu_q = offsets(lq), cu_k = offsets(lk);
  const std::int64_t tq = cu_q.get(cu_q.numel() - 1), tk = cu_k.get(cu_k.numel() - 1);
  const std::int64_t hq = 4, hkv = 2, d = 24, dv = 16, batch = static_cast<std::int64_t>(lq.size());
  const Tensor q = random_tensor(DType::f32, {tq, hq, d}, seed);
  const Tensor k = random_tensor(DType::f32, {tk, hkv, d}, seed + 1);
  const Tensor v = random_tensor(DType::f32, {tk, hkv, dv}, seed + 2);
  const Tensor dout = random_tensor(DType::f32, {tq, hq, dv}, seed + 3);
  Tensor slopes(DType::f32, {batch, hq});
  for (std::int64_t i = 0; i < slopes.numel(); ++i) slopes.set(i, 0.05f * static_cast<float>(i + 1));
  const bool alibi = o.alibi_slopes.rank != 0;
  if (alibi) o.alibi_slopes = slopes.view();
  VarlenSeqlens s{cu_q.view(), cu_k.view(), *std::max_element(lq.begin(), lq.end()),
                  *std::max_element(lk.begin(), lk.end())};
  o.deterministic = true;  // per-sequence results then compare bit for bit
  o.num_splits = 1;        // as forward() plans it: a sequence alone in a varlen batch plans its own key splits
  Tensor sinks(DType::f32, {hq}), dsinks(DType::f32, {hq}), dsinks_b(DType::f32, {hq});
  for (std::int64_t h = 0; h < hq; ++h) sinks.set(h, 0.75f * static_cast<float>(h) - 1.0f);
  const bool with_sinks = o.sinks.rank != 0;  // a marker: filled here, with dsinks
  if (with_sinks) o.sinks = sinks.view(), o.dsinks = dsinks.view();
  const bool with_dlse = o.dlse.rank != 0;  // a marker: filled here with lse's gradient, (heads_q, total_q)
  const Tensor dlse = random_tensor(DType::f32, {hq, tq}, seed + 4);
  if (with_dlse) o.dlse = dlse.view();
  const ForwardResult f = forward_varlen(q.view(), k.view(), v.view(), s, o);
  const BackwardResult g =
      backward_varlen(dout.view(), q.view(), k.view(), v.view(), f.out.view(), f.lse.view(), s, o);
  std::vector<double> dsinks_sum(static_cast<std::size_t>(hq), 0.0);
  if (with_sinks) o.dsinks = dsinks_b.view();
  for (std::int64_t b = 0; b < batch; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    const std::int64_t q0 = cu_q.get(b), sq = lq[b], k0 = cu_k.get(b), sk = lk[b];
    AttentionOptions ob = o;
    Tensor row_slopes(DType::f32, {hq});
    if (alibi) {
      for (std::int64_t h = 0; h < hq; ++h) row_slopes.set(h, slopes.get(b * hq + h));
      ob.alibi_slopes = row_slopes.view();
    }
    Tensor dlse_b(DType::f32, {1, hq, sq});
    for (std::int64_t h = 0; with_dlse && h < hq; ++h)
      for (std::int64_t i = 0; i < sq; ++i) dlse_b.set(h * sq + i, dlse.get(h * tq + q0 + i));
    if (with_dlse) ob.dlse = dlse_b.view();
    const Tensor qb = slice(q, q0, sq), kb = slice(k, k0, sk), vb = slice(v, k0, sk), dob = slice(dout, q0, sq);
    const ForwardResult fb = forward(qb.view(), kb.view(), vb.view(), ob);
    expect_bitwise_equal_rows(f.out, q0, fb.out, "out");
    for (std::int64_t h = 0; h < hq; ++h)
      for (std::int64_t i = 0; i < sq; ++i) ASSERT_EQ(f.lse.get(h * tq + q0 + i), fb.lse.get(h * sq + i));
    const BackwardResult gb = backward(dob.view(), qb.view(), kb.view(), vb.view(), fb.out.view(), fb.lse.view(), ob);
    expect_bitwise_equal_rows(g.dq, q0, gb.dq, "dq");
    expect_bitwise_equal_rows(g.dk, k0, gb.dk, "dk");
    expect_bitwise_equal_rows(g.dv, k0, gb.dv, "dv");
    for (std::int64_t h = 0; with_sinks && h < hq; ++h) dsinks_sum[static_cast<std::size_t>(h)] += dsinks_b.get(h);
  }
  if (with_sinks) EXPECT_LE(max_abs_error(dsinks, dsinks_sum), 1e-5) << "dsinks: the sum of the sequences'";
}

TEST(Varlen, EqualsEachSequenceOnItsOwn) {
  const std::vector<std::int32_t> lq{37, 0, 129, 1, 64}, lk{50, 7, 129, 300, 0};
  check_varlen(lq, lk, {}, 1);
  AttentionOptions causal;
  causal.causal = true;
  check_varlen(lq, lk, causal, 2);
  AttentionOptions everything;
  everything.causal = true;
  everything.window_size = {40, 0};
  everything.softcap = 2.0f;
  everything.alibi_slopes.rank = 2;  // filled per call with (batch, heads_q) slopes
  check_varlen(lq, lk, everything, 3);
  AttentionOptions sinks;
  sinks.causal = true;
  sinks.sinks.rank = 1;  // filled per call with (heads_q) sink logits
  check_varlen(lq, lk, sinks, 4);
  sinks.dlse.rank = 2;  // filled per call with lse's gradient
  check_varlen(lq, lk, sinks, 5);
}

// Batch invariance: a sequence's out and lse are bit-identical whether it runs alone (a batch
// of one) or in a batch, on any thread count, with the key splits the library chooses — long
// decode rows split, short prefill chunks, empty sequences.
TEST(Varlen, EachSequenceIsBitIdenticalAloneOrInABatchOnAnyThreads) {
  const std::vector<std::int32_t> lq{1, 37, 0, 129, 1, 3}, lk{3000, 50, 7, 129, 300, 2100};
  const std::int64_t hq = 4, hkv = 2, d = 24, batch = static_cast<std::int64_t>(lq.size());
  const Tensor cu_q = offsets(lq), cu_k = offsets(lk);
  const std::int64_t tq = cu_q.get(batch), tk = cu_k.get(batch);
  const Tensor q = random_tensor(DType::f32, {tq, hq, d}, 11);
  const Tensor k = random_tensor(DType::f32, {tk, hkv, d}, 12);
  const Tensor v = random_tensor(DType::f32, {tk, hkv, d}, 13);
  const VarlenSeqlens s{cu_q.view(), cu_k.view(), 129, 3000};
  for (const int threads : {1, 2, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    AttentionOptions o;
    o.causal = true;
    o.num_threads = threads;
    const ForwardResult f = forward_varlen(q.view(), k.view(), v.view(), s, o);
    for (std::int64_t b = 0; b < batch; ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      const std::int64_t q0 = cu_q.get(b), sq = lq[b], k0 = cu_k.get(b), sk = lk[b];
      const Tensor qb = slice(q, q0, sq), kb = slice(k, k0, sk), vb = slice(v, k0, sk);
      const Tensor cu_qb = offsets({lq[b]}), cu_kb = offsets({lk[b]});
      AttentionOptions alone = o;
      alone.num_threads = 1;
      const ForwardResult fb = forward_varlen(TensorView(qb.data(), DType::f32, {sq, hq, d}),
                                              TensorView(kb.data(), DType::f32, {sk, hkv, d}),
                                              TensorView(vb.data(), DType::f32, {sk, hkv, d}),
                                              {cu_qb.view(), cu_kb.view(), sq, sk}, alone);
      expect_bitwise_equal_rows(f.out, q0, fb.out, "out");
      for (std::int64_t h = 0; h < hq; ++h)
        for (std::int64_t i = 0; i < sq; ++i) ASSERT_EQ(f.lse.get(h * tq + q0 + i), fb.lse.get(h * sq + i));
    }
  }
}

TEST(Varlen, DropoutIsKeyedByTheSequenceIndexAsInABatch) {
  // Equal lengths: the packed batch and the ordinary (batch, seqlen) batch are the same
  // problem, dropout masks included.
  const std::int64_t b = 3, s = 70, h = 2, d = 16;
  const Tensor q = random_tensor(DType::f32, {b, s, h, d}, 1);
  const Tensor k = random_tensor(DType::f32, {b, s, h, d}, 2);
  const Tensor cu = offsets({s, s, s});
  AttentionOptions o;
  o.dropout_p = 0.25f;
  o.seed = 7;
  o.causal = true;
  const ForwardResult batched = forward(q.view(), k.view(), k.view(), o);
  TensorView qp(q.data(), DType::f32, {b * s, h, d}), kp(k.data(), DType::f32, {b * s, h, d});
  const ForwardResult packed = forward_varlen(qp, kp, kp, {cu.view(), cu.view(), s, s}, o);
  ASSERT_EQ(std::memcmp(batched.out.data(), packed.out.data(), static_cast<std::size_t>(batched.out.numel()) * 4), 0);
}

TEST(Varlen, BadOffsetsNameTheArgument) {
  const Tensor q = random_tensor(DType::f32, {10, 2, 8}, 1);
  auto expect = [&](const Tensor& cu_q, const Tensor& cu_k, std::int64_t max_q, const std::string& fragment) {
    try {
      forward_varlen(q.view(), q.view(), q.view(), {cu_q.view(), cu_k.view(), max_q, 10});
      ADD_FAILURE() << "expected flashattn::Error containing " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  const Tensor good = offsets({4, 6});
  Tensor bad_start = offsets({4, 6});
  bad_start.set(0, 1.0f);
  expect(bad_start, good, 10, "cu_seqlens_q: must start at 0, got 1");
  Tensor decreasing(DType::i32, {3});
  decreasing.set(1, 7.0f);
  decreasing.set(2, 5.0f);
  expect(decreasing, good, 10, "cu_seqlens_q: must be non-decreasing");
  expect(offsets({4, 5}), good, 10, "cu_seqlens_q: last offset 9 does not match the 10 packed tokens");
  expect(good, good, 5, "cu_seqlens_q: sequence 1 has length 6 > max_seqlen_q = 5");
  expect(offsets({10}), good, 10, "cu_seqlens_k: 3 offsets but cu_seqlens_q has 2");
  const Tensor float_offsets(DType::f32, {3});
  expect(float_offsets, good, 10, "cu_seqlens_q: dtype f32");
}

}  // namespace
}  // namespace flashattn::test
