// The backward kernels (pre-pass, dK/dV/dQ, dQ conversion), one instantiation per
// (element type, head-dim bucket), and their launch with the float32 workspace.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <map>
#include <mutex>

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

// The backward's float32 workspace (row statistics, dQ accumulator, turn counters), in the
// order of the default stream: from a memory pool of the library's own per device where the
// device has memory pools, allocated and released with the kernels (nothing waits for the
// device; the pool keeps its memory between calls, so a training loop's backward takes memory
// from the driver once); else cudaMalloc, and the release waits for the kernels.
class Workspace {
 public:
  explicit Workspace(std::size_t bytes) {
    if (bytes == 0) return;  // none without queries
    pool_ = device_pool();
    if (pool_ != nullptr)
      check_cuda(cudaMallocFromPoolAsync(&data_, bytes, pool_, cudaStreamLegacy), "backward: workspace allocation");
    else
      check_cuda(cudaMalloc(&data_, bytes), "backward: workspace allocation");
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace() {
    if (data_ == nullptr) return;
    if (pool_ != nullptr) {
      cudaFreeAsync(data_, cudaStreamLegacy);
    } else {
      cudaDeviceSynchronize();
      cudaFree(data_);
    }
  }
  void* data() const { return data_; }

 private:
  // The current device's pool (created at its first use, never trimmed), or null where the
  // device has no memory pools.
  static cudaMemPool_t device_pool() {
    int device = 0, supported = 0;
    check_cuda(cudaGetDevice(&device), "backward: current device");
    check_cuda(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device),
               "backward: memory pool support");
    if (supported == 0) return nullptr;
    static std::mutex mutex;
    static std::map<int, cudaMemPool_t> pools;
    const std::lock_guard lock(mutex);
    if (const auto it = pools.find(device); it != pools.end()) return it->second;
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    check_cuda(cudaMemPoolCreate(&pool, &props), "backward: workspace pool");
    std::uint64_t keep = std::numeric_limits<std::uint64_t>::max();
    check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "backward: workspace pool");
    pools.emplace(device, pool);
    return pool;
  }

  void* data_ = nullptr;
  cudaMemPool_t pool_ = nullptr;
};

dim3 dims(const Grid& g) { return dim3(static_cast<unsigned>(g.x), static_cast<unsigned>(g.y), static_cast<unsigned>(g.z)); }

}  // namespace

void launch_backward(const BackwardParams& params, const CudaBackwardPlan& plan, bool bf16) {
  BackwardParams p = params;
  const std::int64_t rows = p.stats_rows;
  const std::size_t accum_bytes = static_cast<std::size_t>(rows) * plan.head_dim_padded * sizeof(float);
  const std::size_t turn_bytes = static_cast<std::size_t>(plan.batch * p.heads_q * plan.m_blocks) * sizeof(int);
  const Workspace workspace(plan.workspace_bytes);
  p.row_stats = static_cast<float*>(workspace.data());
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
}

}  // namespace flashattn::cuda
