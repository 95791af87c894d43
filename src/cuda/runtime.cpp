// The CUDA runtime calls of the API layer (linked only into CUDA builds).
#include <cuda_runtime.h>

#include <string>

#include "flashattn/cuda_plan.hpp"
#include "flashattn/error.hpp"
#include "src/cuda/launch.hpp"

namespace flashattn {

bool cuda_compiled() { return true; }

void cuda::check_cuda(int status, const char* what) {
  if (status != cudaSuccess)
    throw Error(std::string("cuda: ") + what + ": " + cudaGetErrorString(static_cast<cudaError_t>(status)));
}

}  // namespace flashattn
