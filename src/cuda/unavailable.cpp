// A build without CUDA (FLASHATTN_CUDA off, or no nvcc): calls on cuda tensors are an Error.
#include "flashattn/error.hpp"
#include "src/cuda/launch.hpp"

namespace flashattn {

bool cuda_compiled() { return false; }

namespace cuda {
namespace {
[[noreturn]] void unavailable() {
  throw Error("device: tensors are on cuda but this flashattn was built without CUDA (FLASHATTN_CUDA=OFF or no nvcc)");
}
}  // namespace

void check_cuda(int, const char*) { unavailable(); }
void launch_forward(const ForwardParams&, const CudaForwardPlan&, bool) { unavailable(); }
void launch_backward(const BackwardParams&, const CudaBackwardPlan&, bool) { unavailable(); }

}  // namespace cuda
}  // namespace flashattn
