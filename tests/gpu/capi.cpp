// A C entry point to the CUDA backend for scripts/gpu-check, which drives it from Python
// (torch allocates the device tensors, ctypes passes their pointers). Contiguous
// (batch, seqlen, heads, dim) operands and (batch, heads, seqlen) lse; returns null on
// success or the flashattn::Error message.
#include <cstdint>
#include <exception>
#include <string>

#include "flashattn/tensor.hpp"
#include "src/api/run.hpp"

namespace {

thread_local std::string g_error;

flashattn::TensorView view(const void* data, flashattn::DType dtype, std::int64_t b, std::int64_t s, std::int64_t h,
                           std::int64_t d) {
  return flashattn::TensorView(data, dtype, {b, s, h, d}).on(flashattn::Device::cuda);
}
flashattn::MutableTensorView output(void* data, flashattn::DType dtype, std::int64_t b, std::int64_t s, std::int64_t h,
                                    std::int64_t d) {
  return flashattn::MutableTensorView(data, dtype, {b, s, h, d}).on(flashattn::Device::cuda);
}

template <class F>
const char* guarded(F f) {
  try {
    f();
    return nullptr;
  } catch (const std::exception& e) {
    g_error = e.what();
    return g_error.c_str();
  }
}

}  // namespace

extern "C" {

const char* flashattn_cuda_forward(const void* q, const void* k, const void* v, void* out, float* lse, int bf16,
                                   std::int64_t batch, std::int64_t seqlen_q, std::int64_t seqlen_k,
                                   std::int64_t heads_q, std::int64_t heads_kv, std::int64_t head_dim, int causal) {
  return guarded([&] {
    const flashattn::DType t = bf16 ? flashattn::DType::bf16 : flashattn::DType::f16;
    flashattn::AttentionOptions options;
    options.causal = causal != 0;
    flashattn::detail::run_forward(flashattn::detail::cuda_backend(), view(q, t, batch, seqlen_q, heads_q, head_dim), view(k, t, batch, seqlen_k, heads_kv, head_dim),
                             view(v, t, batch, seqlen_k, heads_kv, head_dim), output(out, t, batch, seqlen_q, heads_q, head_dim),
                             flashattn::MutableTensorView(lse, flashattn::DType::f32, {batch, heads_q, seqlen_q})
                                 .on(flashattn::Device::cuda),
                             options);
  });
}

const char* flashattn_cuda_backward(const void* dout, const void* q, const void* k, const void* v, const void* out,
                                    const float* lse, void* dq, void* dk, void* dv, int bf16, std::int64_t batch,
                                    std::int64_t seqlen_q, std::int64_t seqlen_k, std::int64_t heads_q,
                                    std::int64_t heads_kv, std::int64_t head_dim, int causal, int deterministic) {
  return guarded([&] {
    const flashattn::DType t = bf16 ? flashattn::DType::bf16 : flashattn::DType::f16;
    flashattn::AttentionOptions options;
    options.causal = causal != 0;
    options.deterministic = deterministic != 0;
    flashattn::detail::run_backward(
        flashattn::detail::cuda_backend(), view(dout, t, batch, seqlen_q, heads_q, head_dim), view(q, t, batch, seqlen_q, heads_q, head_dim),
        view(k, t, batch, seqlen_k, heads_kv, head_dim), view(v, t, batch, seqlen_k, heads_kv, head_dim),
        view(out, t, batch, seqlen_q, heads_q, head_dim),
        flashattn::TensorView(lse, flashattn::DType::f32, {batch, heads_q, seqlen_q}).on(flashattn::Device::cuda),
        output(dq, t, batch, seqlen_q, heads_q, head_dim), output(dk, t, batch, seqlen_k, heads_kv, head_dim),
        output(dv, t, batch, seqlen_k, heads_kv, head_dim), options);
  });
}

}  // extern "C"
