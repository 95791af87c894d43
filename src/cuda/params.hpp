// The plain parameter structs the API layer fills once and every CUDA kernel (and its
// CPU emulation) reads. Strides are in elements; the last dimension is contiguous.
#pragma once

#include <cstdint>

namespace flashattn::cuda {

// A (batch, seqlen, heads, dim) operand of 16-bit elements.
struct Operand {
  const void* data;
  std::int64_t batch_stride, row_stride, head_stride;
};
struct MutableOperand {
  void* data;
  std::int64_t batch_stride, row_stride, head_stride;
};

struct ForwardParams {
  Operand q, k, v;
  MutableOperand out;
  float* lse;  // (batch, heads_q, seqlen_q)
  std::int64_t lse_batch_stride, lse_head_stride;
  int seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  float scale_log2;  // softmax_scale · log2(e): scores go through exp2
  bool causal;
};

struct BackwardParams {
  Operand q, k, v, out, dout;
  MutableOperand dq, dk, dv;
  const float* lse;  // (batch, heads_q, seqlen_q), natural log
  std::int64_t lse_batch_stride, lse_head_stride;
  // Workspaces, contiguous, in rows of (batch, heads_q, seqlen_q padded to whole Q tiles):
  float* row_stats;   // lse·log2(e) of every row, then delta = rowsum(dO ∘ O) of every row
  std::int64_t stats_rows;  // rows of each of the two
  float* dq_accum;    // Σ over K/V tiles of dS·K, float32, head_dim_padded per row
  int* dq_turn;       // deterministic: per (batch, q head, Q tile), the K/V tile whose turn it is
  int head_dim_padded;
  int seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  float scale, scale_log2;
  bool causal, deterministic;
};

}  // namespace flashattn::cuda
