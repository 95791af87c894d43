// The CPU backend: the backend table's entries on the drivers, and cpu_simd_target.
#include <string>

#include "flashattn/attention.hpp"
#include "src/api/backend.hpp"
#include "src/cpu/drivers.hpp"
#include "src/cpu/kernels/forward_kernel.hpp"

namespace flashattn {
namespace {

void forward_one(const detail::ForwardJob& job) { cpu::run_forward_jobs({&job, 1}); }

// The sequences of a packed batch are one schedule (cpu::run_forward_batch): every
// (sequence, Q tile, key split) an item of one parallel region, each sequence planned alone, so
// its output and lse do not depend on the rest of the batch or on the thread count.
void forward_batch(std::span<const detail::ForwardJob> jobs) { cpu::run_forward_batch(jobs, {}); }

// cpu::run_backward adds its sequence's share to options.dsinks: zeroed once per call.
void zero_dsinks(const AttentionOptions& options) {
  const MutableTensorView& d = options.dsinks;
  for (std::int64_t h = 0; d.data != nullptr && h < d.shape[0]; ++h) static_cast<float*>(d.data)[h * d.strides[0]] = 0.0f;
}

void backward_one(const detail::BackwardJob& job) {
  zero_dsinks(job.options);
  cpu::run_backward(job);
}

// Every sequence's job carries the same options.dsinks; the shares add up in sequence order.
void backward_each(std::span<const detail::BackwardJob> jobs) {
  if (!jobs.empty()) zero_dsinks(jobs.front().options);
  for (const detail::BackwardJob& job : jobs) cpu::run_backward(job);
}

// What the CPU runs for forward_fp8: the float32 values of the codes, with FP8 probabilities.
constexpr detail::ProblemInternals kFp8Forward{.fp8_probabilities = true};

// The plan's checks read the problem and options alone.
void check_forward_fp8(const detail::Fp8ForwardJob& fp8) {
  cpu::check_forward({fp8.problem, kFp8Forward, {}, {}, {}, fp8.out, fp8.lse, fp8.options, {}});
}

// The CPU computes in float32 from the FP8 values (FP8 numerics, not FP8 speed): decoded
// once per call, 4 bytes per element of q, k and v for its duration.

void forward_fp8(const detail::Fp8ForwardJob& fp8) {
  const Tensor qf = detail::dequantize_fp8("q", fp8.q);
  const Tensor kf = detail::dequantize_fp8("k", fp8.k);
  const Tensor vf = detail::dequantize_fp8("v", fp8.v);
  const detail::ForwardJob job{fp8.problem, kFp8Forward, qf.view(), kf.view(), vf.view(),
                               fp8.out, fp8.lse, fp8.options, {}};
  forward_one(job);
}

}  // namespace

const detail::Backend& detail::cpu_backend() {
  static constexpr Backend backend{
      .name = "cpu",
      .check_forward = cpu::check_forward,
      .check_backward = cpu::check_backward,
      .forward = forward_one,
      .backward = backward_one,
      .forward_varlen = forward_batch,
      .backward_varlen = backward_each,
      .forward_with_kvcache = cpu::run_forward_jobs,
      .forward_varlen_paged = cpu::run_forward_batch,
      .check_forward_fp8 = check_forward_fp8,
      .forward_fp8 = forward_fp8,
  };
  return backend;
}

std::string cpu_simd_target() { return cpu::kernel_geometry().target; }

}  // namespace flashattn
