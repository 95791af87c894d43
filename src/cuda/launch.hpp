// What the API layer (backend.cpp) calls in the CUDA translation units.
#pragma once

#include "flashattn/cuda_plan.hpp"
#include "src/cuda/params.hpp"

namespace flashattn::cuda {

// Throws flashattn::Error naming `what` and the CUDA error when `status` is not success.
void check_cuda(int status, const char* what);

void launch_forward(const ForwardParams& params, const CudaForwardPlan& plan, bool bf16);
void launch_backward(const BackwardParams& params, const CudaBackwardPlan& plan, bool bf16);

}  // namespace flashattn::cuda
