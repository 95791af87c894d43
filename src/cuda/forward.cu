// The forward kernels: one instantiation per (element type, head-dim bucket), chosen through
// a table from the Plan's bucket, and their launch.
#include <cuda_runtime.h>

#include "src/cuda/device_warp.cuh"
#include "src/cuda/forward_body.hpp"
#include "src/cuda/launch.hpp"

namespace flashattn::cuda {
namespace {

template <int kBucket, class E>
__global__ void __launch_bounds__(kForwardTiles[kBucket].threads(), 1)
    forward_kernel(const ForwardParams p) {
  DeviceBlock block;
  forward_block<kForwardTiles[kBucket], E>(block, p, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
                                           static_cast<int>(blockIdx.z));
}

using ForwardKernel = void (*)(ForwardParams);
template <class E>
constexpr ForwardKernel kForwardKernels[] = {forward_kernel<0, E>, forward_kernel<1, E>, forward_kernel<2, E>};
static_assert(std::size(kForwardKernels<Bf16>) == std::size(kForwardTiles));

}  // namespace

void launch_forward(const ForwardParams& params, const CudaForwardPlan& plan, bool bf16) {
  const ForwardKernel kernel = (bf16 ? kForwardKernels<Bf16> : kForwardKernels<F16>)[plan.bucket];
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.smem_bytes),
             "forward: shared memory size");
  kernel<<<dim3(static_cast<unsigned>(plan.m_blocks), static_cast<unsigned>(params.heads_q),
                static_cast<unsigned>(plan.batch)),
           plan.threads, plan.smem_bytes>>>(params);
  check_cuda(cudaGetLastError(), "forward: launch");
}

}  // namespace flashattn::cuda
