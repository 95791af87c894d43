// forward() and backward() once routed: the front door's checks, the backend's, then the
// backend's run. The public entry points call them on the backend of the tensors' device;
// scripts/gpu-check's C entry point (tests/gpu/capi.cpp) on the CUDA backend directly.
#pragma once

#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"
#include "src/api/backend.hpp"
#include "src/api/checks.hpp"

namespace flashattn::detail {

void run_forward(const Backend& backend, const TensorView& q, const TensorView& k, const TensorView& v,
                 const MutableTensorView& out, const MutableTensorView& lse, const AttentionOptions& options,
                 OutputDtypes outputs = OutputDtypes::inputs);
void run_backward(const Backend& backend, const TensorView& dout, const TensorView& q, const TensorView& k,
                  const TensorView& v, const TensorView& out, const TensorView& lse, const MutableTensorView& dq,
                  const MutableTensorView& dk, const MutableTensorView& dv, const AttentionOptions& options,
                  OutputDtypes grads = OutputDtypes::inputs);

}  // namespace flashattn::detail
