// ring_forward: P steps; at step s rank r holds the K/V shard of rank r − s, computes its
// queries' partial (out and softmax state) against it with flashattn::forward while the next
// shard is already on its way, and merges the partial into its running result
// (detail::merge_states: OnlineSoftmaxState::merge).
#include <omp.h>

#include <chrono>
#include <limits>
#include <string>

#include "flashattn/attention.hpp"
#include "flashattn/dist.hpp"
#include "ring_comm.hpp"
#include "ring_setup.hpp"
#include "src/api/float32_out.hpp"
#include "src/core/merge.hpp"
#include "src/core/validate.hpp"
#include "views.hpp"

namespace flashattn::dist {
namespace {

using detail::Payload;

// A contiguous (B, S, H, D) copy of `src` at the start of `dst`'s storage.
MutableTensorView pack(const TensorView& src, Tensor& dst, int threads) {
  MutableTensorView packed(dst.data(), src.dtype, {src.shape[0], src.shape[1], src.shape[2], src.shape[3]});
  detail::copy(packed, src, threads);
  return packed;
}

}  // namespace

RingStats ring_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const MutableTensorView& out, const MutableTensorView& lse,
                       const AttentionOptions& options, const RingOptions& ring) {
  const auto start = std::chrono::steady_clock::now();
  detail::RingComm comm(ring, "ring_forward");
  const AttentionProblem p = detail::check_arguments(
      comm, ring, q, k, v, options,
      [&](const AttentionProblem& local) { flashattn::detail::check_forward_outputs(local, q, k, v, out, lse); });
  const int ranks = comm.size(), me = comm.rank();
  const detail::RingGeometry geometry(ring, ranks, p.causal);
  const std::int64_t sl = p.seqlen_q, smax = geometry.max_length();
  const std::int64_t b = p.batch, hq = p.heads_q, hkv = p.heads_kv, d = p.head_dim, dv = p.head_dim_v;
  const std::size_t element = dtype_size(p.dtype);

  // Two K and two V buffers: the shard being computed on and the one arriving.
  Tensor k_buffers[2] = {Tensor(p.dtype, {b, smax, hkv, d}), Tensor(p.dtype, {b, smax, hkv, d})};
  Tensor v_buffers[2] = {Tensor(p.dtype, {b, smax, hkv, dv}), Tensor(p.dtype, {b, smax, hkv, dv})};
  const int threads = options.num_threads;
  pack(k, k_buffers[0], threads);
  pack(v, v_buffers[0], threads);
  // Running result (split 0) and the step's partial (split 1), float32 as the merge wants
  // them; two sets, since a merge writes into the other one's split 0. Each row's softmax
  // state, max (log2 units, in `maxes`, laid out as lses) and ℓ (`sums`, the same layout),
  // not one float32 lse: that rounds m + log ℓ to m where the scores are huge, and the merge
  // would weigh shards of different lengths alike.
  Tensor outs[2] = {Tensor(DType::f32, {2, b, sl, hq, dv}), Tensor(DType::f32, {2, b, sl, hq, dv})};
  Tensor maxes[2] = {Tensor(DType::f32, {2, b, hq, sl}), Tensor(DType::f32, {2, b, hq, sl})};
  Tensor sums[2] = {Tensor(DType::f32, {2, b, hq, sl}), Tensor(DType::f32, {2, b, hq, sl})};
  const auto split = [&](int set, std::int64_t index) {
    return std::pair{detail::slice(outs[set].view(), 0, index, 1), detail::slice(maxes[set].view(), 0, index, 1)};
  };
  // Split `index` of `set`'s ℓ for the view `max_view` of its maxima (the same offsets).
  const auto sums_of = [&](int set, const MutableTensorView& max_view) {
    return sums[set].data_as<float>() + (static_cast<float*>(max_view.data) - maxes[set].data_as<float>());
  };
  const int merge_threads = threads > 0 ? threads : omp_get_max_threads();
  // merge_states over every row of `outs`' splits, in as many shares as threads.
  const auto merge = [&](const TensorView& split_outs, const TensorView& split_maxes, const float* split_sums,
                         const MutableTensorView& merged_out, const MutableTensorView& merged_lse, float* merged_sums) {
    const std::int64_t rows = b * sl * hq;
#pragma omp parallel for schedule(static) num_threads(merge_threads)
    for (int share = 0; share < merge_threads; ++share)
      flashattn::detail::merge_states(split_outs, split_maxes, split_sums, merged_out, merged_lse, merged_sums,
                                      rows * share / merge_threads, rows * (share + 1) / merge_threads);
  };
  const auto drop_split = [](MutableTensorView view) {  // (1, ...) → (...)
    for (int i = 1; i < view.rank; ++i) view.shape[i - 1] = view.shape[i], view.strides[i - 1] = view.strides[i];
    --view.rank;
    return view;
  };

  // This rank's queries against the keys of `key_rank`'s shard, into split `index` of `set`.
  const auto partial = [&](int key_rank, const Tensor& k_shard, const Tensor& v_shard, int set, std::int64_t index) {
    const auto [outs_split, maxes_split] = split(set, index);
    const MutableTensorView split_out = drop_split(outs_split), split_max = drop_split(maxes_split);
    const std::int64_t keys_in_shard = geometry.length(key_rank);
    const TensorView k_all(k_shard.data(), p.dtype, {b, keys_in_shard, hkv, d});
    const TensorView v_all(v_shard.data(), p.dtype, {b, keys_in_shard, hkv, dv});
    for (const detail::QueryRange& range : geometry.query_ranges(me)) {
      const std::int64_t n = range.global.size();
      const MutableTensorView range_out = detail::tokens(split_out, range.local_begin, n);
      const MutableTensorView range_max = detail::lse_tokens(split_max, range.local_begin, n);
      MutableTensorView range_sum = range_max;
      range_sum.data = sums_of(set, range_max);
      const detail::KeyPrefix prefix = geometry.visible_keys(range, key_rank);
      if (prefix.keys == 0) {  // nothing visible: the merge's empty state
        detail::fill(range_out, 0.0f, threads);
        detail::fill(range_max, -std::numeric_limits<float>::infinity(), threads);
        detail::fill(range_sum, 0.0f, threads);
        continue;
      }
      AttentionOptions call = options;
      call.causal = prefix.causal;
      // Straight into the float32 split whatever q's dtype: partials are rounded only once, merged.
      flashattn::detail::forward_into_float32(detail::tokens(q, range.local_begin, n),
                                              detail::tokens(k_all, 0, prefix.keys),
                                              detail::tokens(v_all, 0, prefix.keys), range_out, range_max, call,
                                              static_cast<float*>(range_sum.data));
    }
  };

  int set = 0;
  for (int step = 0; step < ranks; ++step) {
    const int key_rank = (me - step + ranks) % ranks;
    const int now = step % 2, next = 1 - now;
    detail::Transfers kv(detail::kv_exchange_name(comm, step, key_rank));
    if (step + 1 < ranks) {
      const std::int64_t sent = geometry.length(key_rank);
      const std::int64_t arriving = geometry.length((key_rank - 1 + ranks) % ranks);
      comm.send(kv, k_buffers[now].data(), static_cast<std::size_t>(b * sent * hkv * d) * element, Payload::k);
      comm.send(kv, v_buffers[now].data(), static_cast<std::size_t>(b * sent * hkv * dv) * element, Payload::v);
      comm.receive(kv, k_buffers[next].data(), static_cast<std::size_t>(b * arriving * hkv * d) * element, Payload::k);
      comm.receive(kv, v_buffers[next].data(), static_cast<std::size_t>(b * arriving * hkv * dv) * element, Payload::v);
    }
    comm.overlap({&kv}, [&] {
      if (step == 0) {
        partial(key_rank, k_buffers[now], v_buffers[now], set, 0);
        return;
      }
      partial(key_rank, k_buffers[now], v_buffers[now], set, 1);
      if (step + 1 < ranks) {  // the last merge writes the caller's out and lse below
        const auto [merged_out, merged_max] = split(1 - set, 0);
        merge(outs[set].view(), maxes[set].view(), sums[set].data_as<float>(), drop_split(merged_out),
              drop_split(merged_max), sums_of(1 - set, merged_max));
        set = 1 - set;
      }
    });
    comm.wait(kv);
  }
  const std::int64_t splits = ranks > 1 ? 2 : 1;
  const auto compute_start = std::chrono::steady_clock::now();
  merge(detail::slice(outs[set].view(), 0, 0, splits), detail::slice(maxes[set].view(), 0, 0, splits),
        sums[set].data_as<float>(), out, lse, nullptr);
  const auto end = std::chrono::steady_clock::now();

  RingStats stats;
  stats.steps = ranks;
  stats.bytes_sent = comm.bytes_sent();
  stats.compute_seconds = comm.compute_seconds() + std::chrono::duration<double>(end - compute_start).count();
  stats.wait_seconds = comm.wait_seconds();
  stats.seconds = std::chrono::duration<double>(end - start).count();
  return stats;
}

}  // namespace flashattn::dist
