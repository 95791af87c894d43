// What forward and backward share before the ring turns: the shards of every rank, what a
// local query range sees of a visiting K/V shard, and the checks of the arguments.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "flashattn/dist.hpp"
#include "flashattn/problem.hpp"
#include "ring_comm.hpp"

namespace flashattn::dist::detail {

// Local queries that share one mask against every visiting shard.
struct QueryRange {
  std::int64_t local_begin = 0;  // first token in the local shard
  TokenRange global;             // the same tokens in the whole sequence
};

// Keys [0, keys) of a visiting shard's buffer are visible to a query range, the rest are
// not; causal: the last of them are the query range's own chunk (the diagonal block), and a
// bottom-right aligned causal mask on the prefix is exactly the global causal mask.
struct KeyPrefix {
  std::int64_t keys = 0;
  bool causal = false;
};

struct RingGeometry {
  bool causal = false;
  std::vector<std::vector<TokenRange>> shards;  // per rank, in storage order

  RingGeometry(const RingOptions& ring, int ranks, bool causal);
  std::int64_t length(int rank) const;
  std::int64_t max_length() const;
  // Causal: every range of the shard (their masks differ). Otherwise the whole shard at once.
  std::vector<QueryRange> query_ranges(int rank) const;
  // What `query` sees of rank `key_rank`'s shard. The shards' ranges are ascending and come
  // from one cut of the sequence, so a key range lies wholly before the query range, is the
  // same chunk, or lies wholly after it: the visible ranges form a prefix of the buffer.
  KeyPrefix visible_keys(const QueryRange& query, int key_rank) const;
};

// Rejects the options the ring cannot express, runs `local_checks` (the call's own argument
// checks), then makes every rank agree: all pass, and with the same global seqlen, layout,
// sizes, dtype and options, or every rank throws. Returns the local problem of q, k, v.
AttentionProblem check_arguments(RingComm& comm, const RingOptions& ring, const TensorView& q,
                                 const TensorView& k, const TensorView& v,
                                 const AttentionOptions& options,
                                 const std::function<void(const AttentionProblem&)>& local_checks);

}  // namespace flashattn::dist::detail
