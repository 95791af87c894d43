#include "ring_setup.hpp"

#include <algorithm>
#include <bit>
#include <string>

#include "flashattn/error.hpp"
#include "flashattn/plan.hpp"

namespace flashattn::dist::detail {

RingGeometry::RingGeometry(const RingOptions& ring, int ranks, bool causal_) : causal(causal_) {
  for (int r = 0; r < ranks; ++r) shards.push_back(shard_ranges(ring.seqlen, ranks, r, ring.layout));
}

std::int64_t RingGeometry::length(int rank) const {
  std::int64_t n = 0;
  for (const TokenRange& r : shards[static_cast<std::size_t>(rank)]) n += r.size();
  return n;
}

std::int64_t RingGeometry::max_length() const {
  std::int64_t n = 0;
  for (int r = 0; r < static_cast<int>(shards.size()); ++r) n = std::max(n, length(r));
  return n;
}

std::vector<QueryRange> RingGeometry::query_ranges(int rank) const {
  const std::vector<TokenRange>& shard = shards[static_cast<std::size_t>(rank)];
  if (!causal) return {{0, {0, length(rank)}}};  // global positions do not matter unmasked
  std::vector<QueryRange> ranges;
  std::int64_t local = 0;
  for (const TokenRange& r : shard) {
    if (r.size() > 0) ranges.push_back({local, r});
    local += r.size();
  }
  return ranges;
}

KeyPrefix RingGeometry::visible_keys(const QueryRange& query, int key_rank) const {
  const std::vector<TokenRange>& shard = shards[static_cast<std::size_t>(key_rank)];
  KeyPrefix prefix;
  if (!causal) {
    prefix.keys = length(key_rank);
    return prefix;
  }
  for (const TokenRange& r : shard) {
    if (r.size() == 0) continue;
    if (r.end <= query.global.begin) {  // wholly before: every key visible
      prefix.keys += r.size();
    } else if (r.begin == query.global.begin) {  // the same chunk: the diagonal block
      prefix.keys += r.size();
      prefix.causal = true;
      break;
    } else {  // wholly after: masked, and so is every later range
      break;
    }
  }
  return prefix;
}

namespace {

void reject_unsupported(const char* operation, const AttentionOptions& options) {
  const std::string op = operation;
  const std::string why = " is not supported by the ring (it depends on positions within one call)";
  if (options.window_size.left != -1 || options.window_size.right != -1)
    throw Error(op + ": window_size (" + std::to_string(options.window_size.left) + ", " +
                std::to_string(options.window_size.right) + ")" + why);
  if (options.alibi_slopes.data != nullptr) throw Error(op + ": alibi_slopes" + why);
  if (options.dropout_p != 0.0f) throw Error(op + ": dropout_p " + std::to_string(options.dropout_p) + why);
  if (options.block_mask.data != nullptr) throw Error(op + ": block_mask" + why);
  if (options.attn_mask.data != nullptr || options.attn_mask.rank != 0) throw Error(op + ": attn_mask" + why);
  if (options.causal_alignment != CausalAlignment::bottom_right)
    throw Error(op + ": causal_alignment " + to_string(options.causal_alignment) + why);
  if (options.score_hook.apply != nullptr) throw Error(op + ": score_hook" + why);
  if (options.sinks.data != nullptr || options.sinks.rank != 0)  // each block's forward would add the sink again
    throw Error(op + ": sinks are not supported by the ring (each block's partial would count the sink again)");
  if (options.rescale_counts.data != nullptr || options.rescale_counts.rank != 0)
    throw Error(op + ": rescale_counts are reported by forward() and forward_fp8() only, not by the ring");
  if (options.dsinks.data != nullptr || options.dsinks.rank != 0) throw Error(op + ": dsinks (the ring takes no sinks)");
  if (options.dbias.data != nullptr || options.dbias.rank != 0) throw Error(op + ": dbias (the ring takes no attn_mask)");
  if (options.dlse.data != nullptr || options.dlse.rank != 0)
    throw Error(op + ": dlse (the ring's lse is not differentiable)");
}

// The kernels the steps will run, planned here on every rank before the ring turns: a rank
// whose shard has no tokens (causal, S < P) never calls them, and a step that threw while
// the next shard's transfers were posted left them writing into freed buffers. A shard of
// one token at least, so that the planner sees the dtype and options the steps pass.
void check_kernels(const AttentionProblem& local, const AttentionOptions& options, bool backward) {
  AttentionProblem p = local;
  p.seqlen_q = std::max<std::int64_t>(p.seqlen_q, 1);
  p.seqlen_k = std::max<std::int64_t>(p.seqlen_k, 1);
  const CpuHardware hw = CpuHardware::detect(options.num_threads);
  plan_forward(p, hw, options.num_splits, options.block_q, options.kernel);
  if (backward) plan_backward(p, hw, options.deterministic, options.backward_kernel);
}

}  // namespace

AttentionProblem check_arguments(RingComm& comm, const RingOptions& ring, const TensorView& q,
                                 const TensorView& k, const TensorView& v,
                                 const AttentionOptions& options,
                                 const std::function<void(const AttentionProblem&)>& local_checks) {
  const std::string op = comm.operation();
  AttentionProblem problem;
  std::string failure;
  try {
    if (!comm.options_error().empty()) throw Error(comm.options_error());
    reject_unsupported(comm.operation(), options);
    problem = AttentionProblem::from_inputs(q, k, v, options);
    const std::int64_t expected = shard_length(ring.seqlen, comm.size(), comm.rank(), ring.layout);
    const char* layout = ring.layout == ShardLayout::zigzag ? "zigzag" : "contiguous";
    for (const auto& [name, seqlen] : {std::pair{"q", problem.seqlen_q}, {"k", problem.seqlen_k}})
      if (seqlen != expected)
        throw Error(op + ": " + name + " holds " + std::to_string(seqlen) + " tokens but rank " +
                    std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + " holds " +
                    std::to_string(expected) + " of the global seqlen " + std::to_string(ring.seqlen) +
                    " (" + layout + " shards, dist::shard_length)");
    local_checks(problem);
    check_kernels(problem, options, op == "ring_backward");
  } catch (const Error& e) {
    failure = e.what();
  }
  comm.agree(failure.empty(), failure);

  // The same call, sizes and options everywhere: the message sizes and the merged result
  // depend on them (ring_forward on some ranks and ring_backward on another would exchange
  // alike until the backward's accumulators, then time out).
  const std::pair<const char*, std::int64_t> fields[] = {
      {"operation (ring_forward or ring_backward)", op == "ring_backward"},
      {"global seqlen", ring.seqlen},
      {"layout", static_cast<std::int64_t>(ring.layout)},
      {"batch", problem.batch},
      {"heads_q", problem.heads_q},
      {"heads_kv", problem.heads_kv},
      {"head_dim", problem.head_dim},
      {"head_dim_v", problem.head_dim_v},
      {"dtype", static_cast<std::int64_t>(problem.dtype)},
      {"causal", problem.causal},
      {"softmax_scale", std::bit_cast<std::int32_t>(problem.softmax_scale)},
      {"softcap", std::bit_cast<std::int32_t>(problem.softcap)},
      // The options that choose the arithmetic, as passed (each rank resolves them on its own CPU).
      {"exp2", static_cast<std::int64_t>(options.exp2)},
      {"exp2_poly3_fraction", std::bit_cast<std::int32_t>(options.exp2_poly3_fraction)},
      {"rescale_threshold", options.rescale_threshold ? std::bit_cast<std::int32_t>(*options.rescale_threshold) + (1ll << 32) : 0},
      {"kernel", static_cast<std::int64_t>(options.kernel)},
      {"backward_kernel", static_cast<std::int64_t>(options.backward_kernel)},
      {"num_splits", options.num_splits},
      {"block_q", options.block_q},
      {"pack_gqa", options.pack_gqa ? 1 + static_cast<std::int64_t>(*options.pack_gqa) : 0},
      {"deterministic", options.deterministic},
  };
  constexpr std::size_t kFields = std::size(fields);
  std::vector<std::int64_t> extremes(2 * kFields);  // max of v and of −v: max and −min
  for (std::size_t i = 0; i < kFields; ++i) {
    extremes[i] = fields[i].second;
    extremes[kFields + i] = -fields[i].second;
  }
  comm.allreduce_max(extremes);
  std::string differing;
  for (std::size_t i = 0; i < kFields; ++i)
    if (extremes[i] != -extremes[kFields + i]) differing += (differing.empty() ? "" : ", ") + std::string(fields[i].first);
  if (!differing.empty())
    throw Error(op + ": the ranks pass different " + differing + " (rank " + std::to_string(comm.rank()) +
                " has " + problem.describe() + ", global seqlen " + std::to_string(ring.seqlen) + ")");
  return problem;
}

}  // namespace flashattn::dist::detail
