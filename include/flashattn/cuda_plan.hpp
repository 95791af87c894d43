// Plan, then run (docs/algorithm.md §7.4) for the CUDA backend: the tile shapes, launch grid and
// shared memory of the FlashAttention-2 kernels, computed from the problem alone (no GPU is
// needed to plan). The kernels, the build's ptxas gate and the cost model read it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "flashattn/problem.hpp"

namespace flashattn {

// Whether this build has the CUDA kernels (FLASHATTN_CUDA); without them a call on cuda
// tensors throws flashattn::Error.
bool cuda_compiled();

struct CudaForwardPlan {
  int bucket = 0;          // index of the tile configuration (head-dim bucket)
  int head_dim_padded = 0; // 64, 128 or 256
  int block_m = 0;         // Q rows per thread block
  int block_n = 0;         // keys per K/V tile
  int warps = 0;
  int stages = 0;          // K/V tiles in flight (cp.async)
  int threads = 0;
  int smem_bytes = 0;      // dynamic shared memory per block
  std::int64_t m_blocks = 0;  // grid: (m_blocks, heads_q, batch)
  std::int64_t heads_q = 0;
  std::int64_t batch = 0;
  std::int64_t blocks() const;
  std::string describe() const;
};

struct CudaBackwardPlan {
  int bucket = 0;
  int head_dim_padded = 0;
  int block_m = 0;         // Q rows per visited tile
  int block_n = 0;         // keys per thread block
  int warps = 0;
  int threads = 0;
  int smem_bytes = 0;
  std::int64_t n_blocks = 0;  // grid: (n_blocks, heads_kv, batch)
  std::int64_t m_blocks = 0;  // Q tiles per (batch, q head)
  std::int64_t heads_kv = 0;
  std::int64_t batch = 0;
  bool deterministic = false;
  std::size_t workspace_bytes = 0;  // lse·log2e, delta, float32 dQ, turn counters
  std::string describe() const;
};

// Throws flashattn::Error when the problem has no CUDA kernel: head_dim above 256 (forward)
// or 128 (backward).
CudaForwardPlan plan_cuda_forward(const AttentionProblem& problem);
CudaBackwardPlan plan_cuda_backward(const AttentionProblem& problem, bool deterministic);

}  // namespace flashattn
