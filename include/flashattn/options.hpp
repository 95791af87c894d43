// Options shared by every attention entry point. Later features (window, softcap,
// ALiBi, dropout, ...) add fields here, named as upstream FlashAttention's arguments.
#pragma once

#include <optional>

namespace flashattn {

struct AttentionOptions {
  // Scale applied to Q·Kᵀ before the softmax; 1/sqrt(head_dim) when unset.
  std::optional<float> softmax_scale;
  // Causal mask aligned to the bottom-right corner of the (seqlen_q, seqlen_k) score
  // matrix, as upstream: query i sees key j iff j <= i + seqlen_k - seqlen_q.
  bool causal = false;
  // Worker threads; 0 means the OpenMP default (all cores).
  int num_threads = 0;
  // Backward only: bit-identical dq, dk, dv on every run and for every thread count
  // (dQ is computed in its own pass in a fixed order instead of being accumulated
  // across K/V blocks as they finish). Costs two extra matrix products per tile.
  bool deterministic = false;
};

}  // namespace flashattn
