// Ring attention (context parallelism) over MPI: a sequence too long for one machine's time
// or memory is split across the P ranks of a communicator. Every rank keeps its shard of
// Q, K, V, (B, S/P, H, D); the K/V shards travel around the ring rank → rank + 1 while each
// rank computes its queries against the shard it holds, and the partial results are merged
// exactly through their log-sum-exps (merge_attention_states, OnlineSoftmaxState::merge).
// The backward pass sends dK/dV accumulators around the ring behind the K/V shards, so every
// gradient arrives back at the rank that owns its keys. See docs/distributed.md.
//
// Link flashattn::dist (built when MPI is found). MPI must be initialized; with
// MPI_THREAD_SERIALIZED or higher a helper thread drives the transfers while the kernels
// compute (real overlap); with less, transfers progress only when the kernels are done.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::dist {

// How the global sequence of S tokens is cut among P ranks.
//   contiguous: rank r holds the r-th of P contiguous, near-equal pieces (the longer ones
//               first: shard_ranges). With a causal mask rank r's queries see r + 1 of the P
//               key shards: the last rank computes about 2P − 1 times the score pairs of the
//               first, and the ring runs at the pace of the last.
//   zigzag:     the sequence is cut into 2P near-equal chunks and rank r holds chunks r and
//               2P − 1 − r, in that order. Under a causal mask every rank then has the same
//               work at every step (one early and one late chunk), so no rank idles.
enum class ShardLayout { contiguous, zigzag };

// Global token positions [begin, end).
struct TokenRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int64_t size() const { return end - begin; }
};

// The global token ranges rank `rank` of `ranks` holds, in the order its shard stores them
// (ascending). Near-equal: sizes differ by at most one token, the larger ones first.
std::vector<TokenRange> shard_ranges(std::int64_t seqlen, int ranks, int rank, ShardLayout layout);
// Number of tokens in that shard: the seqlen of every local tensor.
std::int64_t shard_length(std::int64_t seqlen, int ranks, int rank, ShardLayout layout);

struct RingOptions {
  MPI_Comm comm = MPI_COMM_WORLD;  // the ring: rank r sends to r + 1 and receives from r − 1
  std::int64_t seqlen = 0;         // global sequence length S, the same on every rank
  ShardLayout layout = ShardLayout::zigzag;
  // Every wait for a peer (set-up, each transfer) gives up after this long with a
  // flashattn::Error naming the step and the peer, so a dead or stalled rank never hangs the
  // others. It bounds the imbalance between neighbours, so it must exceed one step's compute
  // time. After such an error the communicator's state is unknown: abort the job.
  double timeout_seconds = 300.0;
};

// What one call did on this rank.
struct RingStats {
  int steps = 0;                 // ring steps: P
  std::int64_t bytes_sent = 0;   // payload this rank sent (K/V shards, dK/dV accumulators)
  double seconds = 0.0;          // the whole call
  double compute_seconds = 0.0;  // attention kernels, merges and accumulations
  // Time blocked on peers after the local work of a step was done: communication that the
  // computation did not hide, plus any imbalance between neighbours.
  double wait_seconds = 0.0;
};

// Forward on this rank's shard. q (B, Sl, Hq, D), k (B, Sl, Hkv, D), v (B, Sl, Hkv, Dv), out
// (B, Sl, Hq, Dv) in q's dtype, lse (B, Hq, Sl) float32, as flashattn::forward, with Sl =
// shard_length(ring.seqlen, P, rank, ring.layout). out and lse are those of the whole
// sequence's attention for the local queries. Supported options: causal, softmax_scale,
// softcap, grouped-query heads, num_threads, num_splits; window_size, alibi_slopes,
// dropout_p and block_mask depend on positions inside one call and are rejected. Every rank
// must pass the same sizes, dtype and options (checked — the sizes, dtype, causal,
// softmax_scale, softcap and the options that choose the arithmetic: exp2, its poly3
// fraction, rescale_threshold, kernel, backward_kernel, num_splits, block_q, pack_gqa,
// deterministic — an Error on every rank otherwise; num_threads may differ).
RingStats ring_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const MutableTensorView& out, const MutableTensorView& lse,
                       const AttentionOptions& options, const RingOptions& ring);

// Backward on this rank's shard, with out and lse from ring_forward: dq, dk, dv of the whole
// sequence's loss for the local q, k, v (shapes and dtypes of q, k, v). Partial gradients are
// accumulated in float32 and rounded once. options.deterministic makes the result
// bit-identical on every run (the ring's order of summation is fixed). A row whose |lse| ≥
// 710 (scores that large) takes P from the global lse as given, exact to its float32 rounding
// (P within |lse·log2e|·2^-21·ln 2 relative, 5e-4 at |lse| = 1000), where flashattn::backward
// over all the keys recomputes the row's normaliser exactly (docs/algorithm.md).
RingStats ring_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse,
                        const MutableTensorView& dq, const MutableTensorView& dk,
                        const MutableTensorView& dv, const AttentionOptions& options,
                        const RingOptions& ring);

}  // namespace flashattn::dist
