// The CUDA side of the public forward/backward: called when the tensors live on the device.
// Plain C++ (built with or without CUDA): validation and the parameter structs are here,
// the launches in the CUDA translation units (or unavailable.cpp).
#pragma once

#include <initializer_list>
#include <utility>

#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::cuda {

// The device every named view is on; throws Error naming the first view on another device.
Device common_device(std::initializer_list<std::pair<const char*, const TensorView*>> views);

void forward(const TensorView& q, const TensorView& k, const TensorView& v, const MutableTensorView& out,
             const MutableTensorView& lse, const AttentionOptions& options);
void backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out, const TensorView& lse, const MutableTensorView& dq,
              const MutableTensorView& dk, const MutableTensorView& dv, const AttentionOptions& options);

}  // namespace flashattn::cuda
