// The backend table: what the front door (src/api) hands a call to once it has checked
// every argument. A backend — the CPU (src/cpu/backend.cpp), CUDA (src/cuda/backend.cpp) —
// fills one Backend; the front door routes by the tensors' device (route.hpp). An entry
// point a backend lacks is a null function, which the front door turns into an Error
// naming the entry point and the backend.
#pragma once

#include <span>

#include "flashattn/fp8.hpp"
#include "flashattn/options.hpp"
#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"
#include "src/core/paged_kv.hpp"
#include "src/core/problem_internals.hpp"

namespace flashattn::detail {

// One checked forward problem and what it reads and writes; `paged` (when its table or
// descales are set) says where the keys of batch element 0 live in the k and v pools;
// `internals` what the entry point knows beyond the problem (a sequence's batch index, an
// FP8 cache, FP8 probabilities).
struct ForwardJob {
  AttentionProblem problem;
  ProblemInternals internals;
  TensorView q, k, v;
  MutableTensorView out, lse;
  AttentionOptions options;
  PagedKv paged;
  // Set for a pass that a StateMerge combines: lse then receives each row's softmax state,
  // its max (log2 units), and lse_sums (laid out as lse, from its own pointer) its ℓ.
  float* lse_sums = nullptr;
};

// One checked backward problem (`internals`: a sequence's batch index).
struct BackwardJob {
  AttentionProblem problem;
  ProblemInternals internals;
  TensorView dout, q, k, v, out, lse;
  MutableTensorView dq, dk, dv;
  AttentionOptions options;
};

// One checked FP8 forward problem, the problem of the values the codes stand for (its
// probabilities are rounded to FP8: ProblemInternals::fp8_probabilities): q, k, v as codes
// with their descales, every view and descale checked.
struct Fp8ForwardJob {
  AttentionProblem problem;
  Fp8View q, k, v;
  MutableTensorView out, lse;
  AttentionOptions options;
};

// One merge of partial results over disjoint key sets (a shared prefix's pass and a
// sequence's own): outs (splits, batch, seqlen_q, heads_q, head_dim_v) float32 and each
// row's softmax state as the passes' jobs wrote it (ForwardJob::lse_sums) — maxes laid out
// as (splits, batch, heads_q, seqlen_q) lses, sums at the same offsets — into out and lse.
struct StateMerge {
  TensorView outs, maxes;
  const float* sums;
  MutableTensorView out, lse;
};

struct Backend {
  const char* name;  // "cpu", "cuda": the name errors give
  // What only this backend rejects in a checked job — its kernels, its limits — without
  // writing anything. Entry points that run several problems (varlen, the KV cache) check
  // every one before the first writes.
  void (*check_forward)(const ForwardJob&);
  void (*check_backward)(const BackwardJob&);
  // The entry points, each on jobs that passed check_forward / check_backward; null where
  // the backend lacks the entry point.
  void (*forward)(const ForwardJob&);
  void (*backward)(const BackwardJob&);
  // forward_varlen: the sequences of a packed batch, all together, each computed as it would
  // be on its own (as forward_varlen_paged's). backward_varlen: one after the other.
  void (*forward_varlen)(std::span<const ForwardJob>);
  void (*backward_varlen)(std::span<const BackwardJob>);
  // forward_with_kvcache: the sequences of a KV cache after the append, all together.
  void (*forward_with_kvcache)(std::span<const ForwardJob>);
  // forward_varlen_paged: the sequences of a paged batch, all together, each computed as it
  // would be on its own (bit for bit: its plan depends on its own problem alone); then the
  // merges, which read what the jobs wrote (shared prefixes' partial results).
  void (*forward_varlen_paged)(std::span<const ForwardJob>, std::span<const StateMerge>);
  // forward_fp8 on a job that passed check_forward_fp8 (the plan's checks, before any
  // operand is decoded).
  void (*check_forward_fp8)(const Fp8ForwardJob&);
  void (*forward_fp8)(const Fp8ForwardJob&);
};

const Backend& cpu_backend();
const Backend& cuda_backend();

}  // namespace flashattn::detail
