// The forward's schedule (flashattn/plan.hpp): work item → (batch, head, Q block, split,
// key range), the one formula the kernels, the planner and the cost model share.
#include <algorithm>

#include "flashattn/plan.hpp"

namespace flashattn {

std::int64_t forward_work_items(const AttentionProblem& p, const ForwardSchedule& s) {
  return s.decode ? p.batch * s.splits : p.batch * (p.heads_q / s.heads_per_item) * s.q_blocks * s.splits;
}

std::int64_t forward_items_per_kv_head(const AttentionProblem& p, const ForwardSchedule& s) {
  return s.decode ? s.splits : p.heads_q / p.heads_kv / s.heads_per_item * s.q_blocks * s.splits;
}

ForwardWorkItem forward_work_item(const AttentionProblem& p, const ForwardSchedule& s, std::int64_t item) {
  ForwardWorkItem w;
  const std::int64_t bc = s.block_k;
  w.split = item % s.splits;
  if (s.decode) {
    w.batch = item / s.splits;
    w.rows = p.seqlen_q;
  } else {
    const std::int64_t t = item / s.splits % s.q_blocks, bh = item / s.splits / s.q_blocks;
    const std::int64_t head_groups = p.heads_q / s.heads_per_item;
    w.head = bh % head_groups * s.heads_per_item;
    w.heads = s.heads_per_item;
    w.batch = bh / head_groups;
    w.q_block = p.causal ? s.q_blocks - 1 - t : t;
    w.row_begin = w.q_block * s.block_q;
    w.rows = std::min(s.block_q, p.seqlen_q - w.row_begin);
  }
  const AttentionProblem::KeyRange first = p.key_range(w.row_begin), last = p.key_range(w.row_begin + w.rows - 1);
  if (s.decode) {  // equal shares of the keys (decode blocks start at an item's first key)
    const std::int64_t keys = std::max<std::int64_t>(0, last.end - first.begin);
    w.key_begin = first.begin + keys * w.split / s.splits;
    w.key_end = first.begin + keys * (w.split + 1) / s.splits;
    w.first_block = w.key_begin;
    return w;
  }
  const std::int64_t first_tile = first.begin / bc;
  const std::int64_t tiles = std::max<std::int64_t>(0, (last.end + bc - 1) / bc - first_tile);
  w.key_begin = std::max(first.begin, (first_tile + tiles * w.split / s.splits) * bc);
  w.key_end = std::min(last.end, (first_tile + tiles * (w.split + 1) / s.splits) * bc);
  w.first_block = w.key_begin / bc * bc;
  return w;
}

}  // namespace flashattn
