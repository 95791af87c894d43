// The CPU drivers behind the public entry points, with the one parameter the public API
// does not expose: the batch index of element 0 (variable-length batches run each
// sequence as its own problem, and its dropout mask is keyed by its index in the batch).
#pragma once

#include <cstdint>
#include <vector>

#include "flashattn/fp8.hpp"
#include "flashattn/options.hpp"
#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::detail {

// Every check of one forward call — inputs, options, every output view, the kernel the
// planner would run — without writing anything: entry points that run several problems
// (varlen, the KV cache) check them all before the first one writes (docs/reliability.md).
AttentionProblem validate_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const TensorView& lse,
                                  const AttentionOptions& options, std::int64_t batch_offset);

void forward_impl(const TensorView& q, const TensorView& k, const TensorView& v,
                  const MutableTensorView& out, const MutableTensorView& lse,
                  const AttentionOptions& options, std::int64_t batch_offset);

// Runs a problem the caller validated and adjusted (the FP8 forward sets fp8_probabilities).
void run_forward_problem(const AttentionProblem& problem, const TensorView& q, const TensorView& k,
                         const TensorView& v, const MutableTensorView& out, const MutableTensorView& lse,
                         const AttentionOptions& options);

// The float32 values of FP8 tensor `name` (q, k, v) after validating its view.
Tensor dequantize_fp8(const char* name, const Fp8View& x);

// Where one sequence's keys live in a KV cache. Paged (block_table set): key j in page
// block_table[(j / page_size) · table_stride] (page_size = the pools' dim 1) at slot
// j % page_size. Otherwise the pools are that sequence's rows (batch 1). FP8 e4m3 pools
// (dtype u8) scale row j by descale[page · descale_page_stride + kv_head · descale_head_stride]
// (page 0 without a table).
struct CacheSource {
  const std::int32_t* block_table = nullptr;
  std::int64_t table_stride = 0;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  std::int64_t descale_page_stride = 0, descale_head_stride = 0;
};

// One sequence (q batch 1) of seqlen_k keys over a cache the caller validated; its options
// are the call's, restricted to the sequence (sequence_options).
struct CacheSequence {
  TensorView q, k_pool, v_pool;
  CacheSource source;
  std::int64_t seqlen_k = 0;
  MutableTensorView out, lse;
  AttentionOptions options;
  std::int64_t batch_offset = 0;
};

// The checks forward_cache makes of one sequence, and the kernel it would plan; nothing is
// written. forward_with_kvcache runs them for every sequence before its append.
void validate_cache_sequence(const CacheSequence& sequence);

// Attends every sequence: when all of them take the decode kernel, in one parallel region
// (forward.cpp, run_forward_jobs).
void forward_cache(const std::vector<CacheSequence>& sequences);

// The checks of backward_impl, without writing anything (see validate_forward).
AttentionProblem validate_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& out, const TensorView& lse,
                                   const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                   const AttentionOptions& options, std::int64_t batch_offset);

void backward_impl(const TensorView& dout, const TensorView& q, const TensorView& k,
                   const TensorView& v, const TensorView& out, const TensorView& lse,
                   const MutableTensorView& dq, const MutableTensorView& dk,
                   const MutableTensorView& dv, const AttentionOptions& options,
                   std::int64_t batch_offset);

// The options of sequence b of a batch run one sequence at a time: ALiBi slopes of shape
// (batch, heads_q) become that sequence's row. check_sequence_options validates those
// slopes against the whole batch first.
void check_sequence_options(const AttentionOptions& options, std::int64_t batch, std::int64_t heads_q);
AttentionOptions sequence_options(const AttentionOptions& options, std::int64_t b);

}  // namespace flashattn::detail
