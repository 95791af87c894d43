// The CPU drivers behind the CPU backend (backend.cpp): each runs jobs the front door
// (src/api) checked and the backend's own checks passed.
#pragma once

#include <span>

#include "flashattn/fp8.hpp"
#include "flashattn/tensor.hpp"
#include "src/api/backend.hpp"

namespace flashattn::detail {

// The float32 values of FP8 tensor `name` (q, k, v) after validating its view.
Tensor dequantize_fp8(const char* name, const Fp8View& x);

}  // namespace flashattn::detail

namespace flashattn::cpu {

// The kernel the planner would run for a job, without writing anything: an Error for one
// this CPU cannot run.
void check_forward(const detail::ForwardJob& job);
void check_backward(const detail::BackwardJob& job);

// Runs the jobs: when all of them take the decode kernel (the sequences of a KV cache), in
// one parallel region; otherwise one after the other (forward.cpp).
void run_forward_jobs(std::span<const detail::ForwardJob> jobs);
// Runs the sequences of a paged batch in one parallel region, each planned on its own
// (plan_forward_alone), then the merges in the same region: forward_varlen_paged (forward.cpp).
void run_forward_batch(std::span<const detail::ForwardJob> jobs, std::span<const detail::StateMerge> merges);
void run_backward(const detail::BackwardJob& job);

}  // namespace flashattn::cpu
