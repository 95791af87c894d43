// The backward kernels (pre-pass, dK/dV/dQ, dQ conversion), one instantiation per
// (element type, head-dim bucket), and their launch with the float32 workspace.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <memory>

#include "src/cuda/backward_body.hpp"
#include "src/cuda/device_warp.cuh"
#include "src/cuda/launch.hpp"

namespace flashattn::cuda {
namespace {

template <class E>
__device__ float to_float(std::uint16_t bits) {
  if constexpr (E::kIsBf16) return __bfloat162float(__ushort_as_bfloat16(bits));
  else return __half2float(__ushort_as_half(bits));
}
template <class E>
__device__ std::uint16_t from_float(float x) {
  if constexpr (E::kIsBf16) return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  else return __half_as_ushort(__float2half_rn(x));
}

// Grid: (row blocks, heads_q, batch); one thread per (padded) row.
template <class E>
__global__ void __launch_bounds__(kRowThreads) prepare_kernel(const BackwardParams p, int block_m) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kRowThreads + threadIdx.x;
  if (row < padded_rows(p.seqlen_q, block_m))
    prepare_row(p, block_m, static_cast<int>(blockIdx.z), static_cast<int>(blockIdx.y), row, to_float<E>);
}

template <class E>
__global__ void __launch_bounds__(kRowThreads) convert_kernel(const BackwardParams p, int block_m) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kRowThreads + threadIdx.x;
  if (row < p.seqlen_q)
    convert_dq_row(p, block_m, static_cast<int>(blockIdx.z), static_cast<int>(blockIdx.y), row, from_float<E>);
}

template <int kBucket, class E>
__global__ void __launch_bounds__(kBackwardTiles[kBucket].threads(), 1)
    backward_kernel(const BackwardParams p) {
  DeviceBlock block;
  backward_block<kBackwardTiles[kBucket], E>(block, p, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
                                             static_cast<int>(blockIdx.z));
}

using BackwardKernel = void (*)(BackwardParams);
template <class E>
constexpr BackwardKernel kBackwardKernels[] = {backward_kernel<0, E>, backward_kernel<1, E>};
static_assert(std::size(kBackwardKernels<Bf16>) == std::size(kBackwardTiles));

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};

dim3 dims(const Grid& g) { return dim3(static_cast<unsigned>(g.x), static_cast<unsigned>(g.y), static_cast<unsigned>(g.z)); }

}  // namespace

void launch_backward(const BackwardParams& params, const CudaBackwardPlan& plan, bool bf16) {
  BackwardParams p = params;
  const std::int64_t rows = p.stats_rows;
  const std::size_t accum_bytes = static_cast<std::size_t>(rows) * plan.head_dim_padded * sizeof(float);
  const std::size_t turn_bytes = static_cast<std::size_t>(plan.batch * p.heads_q * plan.m_blocks) * sizeof(int);
  void* workspace = nullptr;
  if (plan.workspace_bytes > 0)  // none without queries
    check_cuda(cudaMalloc(&workspace, plan.workspace_bytes), "backward: workspace allocation");
  const std::unique_ptr<void, DeviceFree> owner(workspace);
  p.row_stats = static_cast<float*>(workspace);
  p.dq_accum = p.row_stats + 2 * rows;
  p.dq_turn = reinterpret_cast<int*>(p.dq_accum + rows * plan.head_dim_padded);
  if (accum_bytes + turn_bytes > 0)
    check_cuda(cudaMemsetAsync(p.dq_accum, 0, accum_bytes + turn_bytes), "backward: workspace clear");

  const BackwardKernel kernel = (bf16 ? kBackwardKernels<Bf16> : kBackwardKernels<F16>)[plan.bucket];
  run_backward_passes(backward_grids(p, plan.batch, plan.block_m, plan.n_blocks), [&](BackwardPass pass, const Grid& grid) {
    switch (pass) {
      case BackwardPass::prepare:
        (bf16 ? prepare_kernel<Bf16> : prepare_kernel<F16>)<<<dims(grid), kRowThreads>>>(p, plan.block_m);
        return check_cuda(cudaGetLastError(), "backward: pre-pass launch");
      case BackwardPass::blocks:
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.smem_bytes),
                   "backward: shared memory size");
        kernel<<<dims(grid), plan.threads, plan.smem_bytes>>>(p);
        return check_cuda(cudaGetLastError(), "backward: launch");
      case BackwardPass::convert:
        (bf16 ? convert_kernel<Bf16> : convert_kernel<F16>)<<<dims(grid), kRowThreads>>>(p, plan.block_m);
        return check_cuda(cudaGetLastError(), "backward: dQ conversion launch");
    }
  });
  check_cuda(cudaDeviceSynchronize(), "backward");  // the workspace is freed on return
}

}  // namespace flashattn::cuda
