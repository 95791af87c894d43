// The CPU planner as the library's own entry points call it: plan_forward and
// plan_forward_together (flashattn/plan.hpp) on problems with their internals (an FP8 KV
// cache takes the kernels of one). The public functions plan a problem as given — k and v
// in its dtype — which is these with default internals.
#pragma once

#include <span>
#include <vector>

#include "flashattn/plan.hpp"
#include "src/core/problem_internals.hpp"

namespace flashattn::cpu {

// plan_forward(problem, hardware, options) of flashattn/plan.hpp, k and v stored as
// `internals` says.
CpuForwardPlan plan_forward(const AttentionProblem& problem, const detail::ProblemInternals& internals,
                            const CpuHardware& hardware, const AttentionOptions& options);

// plan_forward(problem, hardware, num_splits, block_q, kernel) of flashattn/plan.hpp, k and v
// stored as `internals` says.
CpuForwardPlan plan_forward(const AttentionProblem& problem, const detail::ProblemInternals& internals,
                            const CpuHardware& hardware, int num_splits = 0, std::int64_t block_q = 0,
                            ForwardKernel kernel = ForwardKernel::automatic);

// plan_forward_together of flashattn/plan.hpp; internals[i] belongs to problems[i] (as many).
std::vector<CpuForwardPlan> plan_forward_together(std::span<const AttentionProblem> problems,
                                                  std::span<const detail::ProblemInternals> internals,
                                                  const CpuHardware& hardware, const AttentionOptions& options);

}  // namespace flashattn::cpu
