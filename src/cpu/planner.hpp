// The CPU planner as the library's own entry points call it: plan_forward and
// plan_forward_together (flashattn/plan.hpp) on problems with their internals (an FP8 KV
// cache takes the kernels of one). The public functions plan a problem as given — k and v
// in its dtype — which is these with default internals.
#pragma once

#include <optional>
#include <span>
#include <vector>

#include "flashattn/plan.hpp"
#include "src/core/problem_internals.hpp"

namespace flashattn::cpu {

// plan_forward(problem, hardware, options) of flashattn/plan.hpp, k and v stored as
// `internals` says.
CpuForwardPlan plan_forward(const AttentionProblem& problem, const detail::ProblemInternals& internals,
                            const CpuHardware& hardware, const AttentionOptions& options);

// The kernel plan_forward would choose for `requested` (automatic: the planner's choice), k
// and v stored as `internals` says: an Error naming a kernel the inputs or the hardware rule
// out. The checks of a plan, without the rest of it.
ForwardKernel forward_kernel(const AttentionProblem& problem, const detail::ProblemInternals& internals,
                             const CpuHardware& hardware, ForwardKernel requested);

// plan_forward(problem, hardware, num_splits, block_q, kernel) of flashattn/plan.hpp, k and v
// stored as `internals` says; pack_gqa as AttentionOptions::pack_gqa (a problem whose
// variants differ per q head is never packed: pack_gqa_request turns a request into an Error).
CpuForwardPlan plan_forward(const AttentionProblem& problem, const detail::ProblemInternals& internals,
                            const CpuHardware& hardware, int num_splits = 0, std::int64_t block_q = 0,
                            ForwardKernel kernel = ForwardKernel::automatic,
                            std::optional<bool> pack_gqa = std::nullopt);

// options.pack_gqa for this problem: false where a variant differs per q head (alibi_slopes,
// dropout, attn_mask, score_hook) and pack_gqa is unset, an Error naming it where it is true.
std::optional<bool> pack_gqa_request(const AttentionProblem& problem, const AttentionOptions& options);

// The plan of one sequence of a batch that runs together (forward_varlen_paged): from the
// problem and the options alone, never the thread count or the rest of the batch, so that
// the sequence's results are bit-identical in any batch and on any number of threads. Its
// tiles are those of plan_forward on one thread; a decode kernel splits the keys into
// shares of about kSplitKeys (options.num_splits, when set, instead); the tiled kernels
// split them only as options.num_splits asks. `threads` is hardware.threads, capped by the
// work items.
constexpr std::int64_t kSplitKeys = 2048;
CpuForwardPlan plan_forward_alone(const AttentionProblem& problem, const detail::ProblemInternals& internals,
                                  const CpuHardware& hardware, const AttentionOptions& options);

// plan_forward_together of flashattn/plan.hpp; internals[i] belongs to problems[i] (as many).
std::vector<CpuForwardPlan> plan_forward_together(std::span<const AttentionProblem> problems,
                                                  std::span<const detail::ProblemInternals> internals,
                                                  const CpuHardware& hardware, const AttentionOptions& options);

}  // namespace flashattn::cpu
