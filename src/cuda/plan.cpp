// The CUDA plans: plain C++ (no CUDA needed), from the tile table the kernels instantiate.
#include <sstream>
#include <string>

#include "flashattn/cuda_plan.hpp"
#include "flashattn/error.hpp"
#include "src/cuda/layout.hpp"

namespace flashattn {
namespace {

template <class Tile, std::size_t N>
int bucket_for(const Tile (&tiles)[N], std::int64_t head_dim, const char* pass) {
  for (std::size_t i = 0; i < N; ++i)
    if (head_dim <= tiles[i].head_dim) return static_cast<int>(i);
  throw Error(std::string("head_dim: ") + std::to_string(head_dim) + " is not supported by the cuda " + pass +
              " (at most " + std::to_string(tiles[N - 1].head_dim) + ")");
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The fields both plans copy from their tile-table entry.
template <class Plan, class Tile>
void copy_tile(Plan& plan, int bucket, const Tile& t) {
  plan.bucket = bucket;
  plan.head_dim_padded = t.head_dim;
  plan.block_m = t.block_m;
  plan.block_n = t.block_n;
  plan.warps = t.warps;
  plan.threads = t.threads();
  plan.smem_bytes = t.smem_bytes();
}

}  // namespace

std::int64_t CudaForwardPlan::blocks() const { return m_blocks * heads_q * batch; }

std::string CudaForwardPlan::describe() const {
  std::ostringstream s;
  s << "cuda forward: head dim bucket " << head_dim_padded << ", tile " << block_m << "x" << block_n << ", "
    << warps << " warps (" << block_m / warps << " rows each), " << stages << " stages, " << smem_bytes
    << " B shared memory, grid " << m_blocks << "x" << heads_q << "x" << batch;
  return s.str();
}

std::string CudaBackwardPlan::describe() const {
  std::ostringstream s;
  s << "cuda backward: head dim bucket " << head_dim_padded << ", " << block_n << " keys per block ("
    << block_n / warps << " per warp), Q tiles of " << block_m << ", " << smem_bytes << " B shared memory, grid "
    << n_blocks << "x" << heads_kv << "x" << batch << ", dQ " << (deterministic ? "in K/V-tile order" : "by atomics")
    << ", workspace " << workspace_bytes << " B";
  return s.str();
}

CudaForwardPlan plan_cuda_forward(const AttentionProblem& p) {
  const int bucket = bucket_for(cuda::kForwardTiles, p.head_dim, "forward");
  const cuda::ForwardTile& t = cuda::kForwardTiles[bucket];
  CudaForwardPlan plan;
  copy_tile(plan, bucket, t);
  plan.stages = t.stages;
  plan.m_blocks = ceil_div(p.seqlen_q, t.block_m);
  plan.heads_q = p.heads_q;
  plan.batch = p.batch;
  return plan;
}

CudaBackwardPlan plan_cuda_backward(const AttentionProblem& p, bool deterministic) {
  const int bucket = bucket_for(cuda::kBackwardTiles, p.head_dim, "backward");
  const cuda::BackwardTile& t = cuda::kBackwardTiles[bucket];
  CudaBackwardPlan plan;
  copy_tile(plan, bucket, t);
  plan.n_blocks = ceil_div(p.seqlen_k, t.block_n);
  plan.m_blocks = ceil_div(p.seqlen_q, t.block_m);
  plan.heads_kv = p.heads_kv;
  plan.batch = p.batch;
  plan.deterministic = deterministic;
  // lse·log2e and delta per padded row, the float32 dQ accumulator, one turn counter per Q tile
  const auto rows = static_cast<std::size_t>(p.batch * p.heads_q * plan.m_blocks * t.block_m);
  plan.workspace_bytes = rows * (2 + static_cast<std::size_t>(t.head_dim)) * sizeof(float) +
                         static_cast<std::size_t>(p.batch * p.heads_q * plan.m_blocks) * sizeof(int);
  return plan;
}

}  // namespace flashattn
