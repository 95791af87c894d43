// ring_backward: the K/V shards take the forward's path around the ring, and behind each one
// travels its float32 dK/dV accumulator. flashattn::backward given the *global* out and lse
// recomputes the global P of a block pair from that lse (for a row with |lse| ≥ 710 too: it
// keeps a given lse that its keys disagree with), so the dq, dk, dv it returns for one
// (query range, visiting shard) pair are exact shares of the gradients: dq's are summed on
// this rank, dk/dv's are added to the visiting accumulator, which moves on to rank + 1 and,
// after P steps, is back at the shard's owner with every rank's share in it.
#include <chrono>
#include <string>

#include "flashattn/attention.hpp"
#include "flashattn/dist.hpp"
#include "ring_comm.hpp"
#include "ring_setup.hpp"
#include "src/api/float32_out.hpp"
#include "src/core/validate.hpp"
#include "views.hpp"

namespace flashattn::dist {
namespace {

using detail::Payload;

// The checks of flashattn::backward, before the ring turns: the ring writes dq, dk, dv itself.
void check_tensors(const AttentionProblem& p, const TensorView& dout, const TensorView& q, const TensorView& k,
                   const TensorView& v, const TensorView& out, const TensorView& lse, const MutableTensorView& dq,
                   const MutableTensorView& dk, const MutableTensorView& dv) {
  using namespace flashattn::detail;
  constexpr const char* kOutLayout = "(batch, local seqlen, heads_q, head_dim_v)";
  for (const auto& [name, view] : {std::pair{"dout", dout}, {"out", out}}) {
    check_view(name, view, 4, kOutLayout);
    check_dtype(name, view, p.dtype, "as q");
    check_shape(name, view, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}, kOutLayout);
  }
  check_view("lse", lse, 3, "(batch, heads_q, local seqlen)");
  check_dtype("lse", lse, DType::f32, "lse is always float32");
  check_shape("lse", lse, {p.batch, p.heads_q, p.seqlen_q}, "(batch, heads_q, local seqlen)");
  const std::pair<const char*, const MutableTensorView*> grads[] = {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  const std::pair<const char*, const TensorView*> inputs[] = {{"dout", &dout}, {"q", &q}, {"k", &k},
                                                              {"v", &v},       {"out", &out}, {"lse", &lse}};
  for (int g = 0; g < 3; ++g) {
    const auto& [name, grad] = grads[g];
    const TensorView& like = *inputs[g + 1].second;
    check_view(name, *grad, 4, "(like its input)");
    check_dtype(name, *grad, like.dtype, "gradients have their input's dtype");
    check_shape(name, *grad, {like.shape[0], like.shape[1], like.shape[2], like.shape[3]}, "(like its input)");
    check_output_layout(name, *grad);
    for (const auto& [input_name, input] : inputs) check_no_overlap(name, *grad, input_name, *input);
    for (int o = 0; o < g; ++o) check_no_overlap(name, *grad, grads[o].first, *grads[o].second);
  }
}

MutableTensorView pack(const TensorView& src, Tensor& dst, int threads) {
  MutableTensorView packed(dst.data(), src.dtype, {src.shape[0], src.shape[1], src.shape[2], src.shape[3]});
  detail::copy(packed, src, threads);
  return packed;
}

}  // namespace

RingStats ring_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse,
                        const MutableTensorView& dq, const MutableTensorView& dk,
                        const MutableTensorView& dv, const AttentionOptions& options,
                        const RingOptions& ring) {
  const auto start = std::chrono::steady_clock::now();
  detail::RingComm comm(ring, "ring_backward");
  const AttentionProblem p = detail::check_arguments(comm, ring, q, k, v, options, [&](const AttentionProblem& local) {
    check_tensors(local, dout, q, k, v, out, lse, dq, dk, dv);
  });
  const int ranks = comm.size(), me = comm.rank();
  const detail::RingGeometry geometry(ring, ranks, p.causal);
  const std::int64_t sl = p.seqlen_q, smax = geometry.max_length();
  const std::int64_t b = p.batch, hq = p.heads_q, hkv = p.heads_kv, d = p.head_dim, dvd = p.head_dim_v;
  const std::size_t element = dtype_size(p.dtype), f32 = sizeof(float);

  Tensor k_buffers[2] = {Tensor(p.dtype, {b, smax, hkv, d}), Tensor(p.dtype, {b, smax, hkv, d})};
  Tensor v_buffers[2] = {Tensor(p.dtype, {b, smax, hkv, dvd}), Tensor(p.dtype, {b, smax, hkv, dvd})};
  const int threads = options.num_threads;
  pack(k, k_buffers[0], threads);
  pack(v, v_buffers[0], threads);
  // The travelling accumulators (the one being added to and sent, the one arriving), this
  // step's share of the visiting shard's gradients, and dq's sum.
  Tensor dk_acc[2] = {Tensor(DType::f32, {b, smax, hkv, d}), Tensor(DType::f32, {b, smax, hkv, d})};
  Tensor dv_acc[2] = {Tensor(DType::f32, {b, smax, hkv, dvd}), Tensor(DType::f32, {b, smax, hkv, dvd})};
  Tensor dk_step(DType::f32, {b, smax, hkv, d}), dv_step(DType::f32, {b, smax, hkv, dvd});
  Tensor dq_sum(DType::f32, {b, sl, hq, d});
  // The kernel's gradients, float32 whatever the inputs' dtype, before they are added in float32:
  // a shard's gradients are rounded once, at the end.
  Tensor dq_call(DType::f32, {b, sl, hq, d}), dk_call(DType::f32, {b, smax, hkv, d}),
      dv_call(DType::f32, {b, smax, hkv, dvd});

  const auto view_of = [](Tensor& t, std::int64_t tokens) {  // the first `tokens` tokens, contiguous
    return MutableTensorView(t.data(), t.dtype(), {t.shape()[0], tokens, t.shape()[2], t.shape()[3]});
  };
  const auto accumulator_bytes = [&](std::int64_t tokens) {
    return std::pair{static_cast<std::size_t>(b * tokens * hkv * d) * f32,
                     static_cast<std::size_t>(b * tokens * hkv * dvd) * f32};
  };

  // This rank's queries against `key_rank`'s shard: dq into dq_sum, dk/dv into the step's share.
  const auto partial = [&](int key_rank, Tensor& k_shard, Tensor& v_shard) {
    const std::int64_t keys_in_shard = geometry.length(key_rank);
    const MutableTensorView dk_share = view_of(dk_step, keys_in_shard), dv_share = view_of(dv_step, keys_in_shard);
    detail::fill(dk_share, 0.0f, threads);
    detail::fill(dv_share, 0.0f, threads);
    for (const detail::QueryRange& range : geometry.query_ranges(me)) {
      const detail::KeyPrefix prefix = geometry.visible_keys(range, key_rank);
      if (prefix.keys == 0) continue;
      const std::int64_t n = range.global.size(), at = range.local_begin;
      AttentionOptions call = options;
      call.causal = prefix.causal;
      const MutableTensorView dq_range = detail::tokens(dq_call.view(), at, n);
      const MutableTensorView dk_prefix = view_of(dk_call, prefix.keys), dv_prefix = view_of(dv_call, prefix.keys);
      flashattn::detail::backward_into_float32(
          detail::tokens(dout, at, n), detail::tokens(q, at, n),
          detail::tokens(view_of(k_shard, keys_in_shard), 0, prefix.keys),
          detail::tokens(view_of(v_shard, keys_in_shard), 0, prefix.keys), detail::tokens(out, at, n),
          detail::lse_tokens(lse, at, n), dq_range, dk_prefix, dv_prefix, call);
      detail::accumulate(detail::tokens(dq_sum.view(), at, n), dq_range, threads);
      detail::accumulate(detail::tokens(dk_share, 0, prefix.keys), dk_prefix, threads);
      detail::accumulate(detail::tokens(dv_share, 0, prefix.keys), dv_prefix, threads);
    }
  };

  // sent[i]: the sends of dk_acc[i], dv_acc[i], waited for before the buffers are reused.
  detail::Transfers sent[2] = {detail::Transfers("the send of a dK/dV accumulator"),
                               detail::Transfers("the send of a dK/dV accumulator")};
  for (int step = 0; step < ranks; ++step) {
    const int key_rank = (me - step + ranks) % ranks;
    const int now = step % 2, next = 1 - now;
    const int arriving_rank = (key_rank - 1 + ranks) % ranks;
    detail::Transfers kv(detail::kv_exchange_name(comm, step, key_rank));
    if (step + 1 < ranks) {
      const std::int64_t sent_tokens = geometry.length(key_rank), arriving = geometry.length(arriving_rank);
      comm.send(kv, k_buffers[now].data(), static_cast<std::size_t>(b * sent_tokens * hkv * d) * element, Payload::k);
      comm.send(kv, v_buffers[now].data(), static_cast<std::size_t>(b * sent_tokens * hkv * dvd) * element, Payload::v);
      comm.receive(kv, k_buffers[next].data(), static_cast<std::size_t>(b * arriving * hkv * d) * element, Payload::k);
      comm.receive(kv, v_buffers[next].data(), static_cast<std::size_t>(b * arriving * hkv * dvd) * element, Payload::v);
    }
    // The accumulator of the visiting shard, from rank − 1 who added its share last step.
    detail::Transfers accumulator("the dK/dV accumulator of rank " + std::to_string(key_rank) + "'s keys (step " +
                                  std::to_string(step) + ")");
    if (step > 0) {
      comm.wait(sent[now]);
      const auto [dk_bytes, dv_bytes] = accumulator_bytes(geometry.length(key_rank));
      comm.receive(accumulator, dk_acc[now].data(), dk_bytes, Payload::dk);
      comm.receive(accumulator, dv_acc[now].data(), dv_bytes, Payload::dv);
    }
    comm.overlap({&kv, &accumulator, &sent[next]}, [&] { partial(key_rank, k_buffers[now], v_buffers[now]); });
    comm.wait(kv);
    comm.wait(accumulator);
    const std::int64_t keys = geometry.length(key_rank);
    detail::accumulate(view_of(dk_acc[now], keys), view_of(dk_step, keys), threads);  // zeros at step 0
    detail::accumulate(view_of(dv_acc[now], keys), view_of(dv_step, keys), threads);
    if (ranks > 1) {
      const auto [dk_bytes, dv_bytes] = accumulator_bytes(keys);
      comm.send(sent[now], dk_acc[now].data(), dk_bytes, Payload::dk);
      comm.send(sent[now], dv_acc[now].data(), dv_bytes, Payload::dv);
    }
  }
  // This rank's own accumulator comes back from rank − 1 after its P-th step, into the
  // buffer last sent two steps before.
  const int own = ranks > 1 ? ranks % 2 : 0;
  if (ranks > 1) {
    comm.wait(sent[own]);
    detail::Transfers home("the finished dK/dV of this rank's keys");
    const auto [dk_bytes, dv_bytes] = accumulator_bytes(sl);
    comm.receive(home, dk_acc[own].data(), dk_bytes, Payload::dk);
    comm.receive(home, dv_acc[own].data(), dv_bytes, Payload::dv);
    comm.wait(home);
    comm.wait(sent[1 - own]);
  }
  const auto store_start = std::chrono::steady_clock::now();
  detail::copy(dq, dq_sum.view(), threads);
  detail::copy(dk, view_of(dk_acc[own], sl), threads);
  detail::copy(dv, view_of(dv_acc[own], sl), threads);
  const auto end = std::chrono::steady_clock::now();

  RingStats stats;
  stats.steps = ranks;
  stats.bytes_sent = comm.bytes_sent();
  stats.compute_seconds = comm.compute_seconds() + std::chrono::duration<double>(end - store_start).count();
  stats.wait_seconds = comm.wait_seconds();
  stats.seconds = std::chrono::duration<double>(end - start).count();
  return stats;
}

}  // namespace flashattn::dist
