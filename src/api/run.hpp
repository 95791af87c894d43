// forward() and backward() once routed: the front door's checks, the backend's, then the
// backend's run. The public entry points call them on the backend of the tensors' device;
// scripts/gpu-check's C entry point (tests/gpu/capi.cpp) on the CUDA backend directly.
#pragma once

#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"
#include "src/api/backend.hpp"
#include "src/api/checks.hpp"

namespace flashattn::detail {

// With lse_sums (the CPU backend only), lse receives each row's softmax state: its max (log2
// units), and lse_sums (laid out as lse) its ℓ (ForwardJob::lse_sums).
void run_forward(const Backend& backend, const TensorView& q, const TensorView& k, const TensorView& v,
                 const MutableTensorView& out, const MutableTensorView& lse, const AttentionOptions& options,
                 OutputDtypes outputs = OutputDtypes::inputs, float* lse_sums = nullptr);
void run_backward(const Backend& backend, const TensorView& dout, const TensorView& q, const TensorView& k,
                  const TensorView& v, const TensorView& out, const TensorView& lse, const MutableTensorView& dq,
                  const MutableTensorView& dk, const MutableTensorView& dv, const AttentionOptions& options,
                  OutputDtypes grads = OutputDtypes::inputs);

}  // namespace flashattn::detail
