#include "src/api/run.hpp"

#include <exception>
#include <string>
#include <string_view>

#include "flashattn/error.hpp"
#include "src/api/checks.hpp"
#include "src/api/route.hpp"

namespace flashattn::detail {
namespace {
// The view with its device set to cpu: the checks read only shapes and strides (and the
// addresses, for overlap), which mean the same on every device.
TensorView host(const TensorView& view) { return view.on(Device::cpu); }
AttentionOptions host(const AttentionOptions& options) {
  AttentionOptions o = options;
  o.alibi_slopes = host(options.alibi_slopes);
  o.block_mask = host(options.block_mask);
  o.attn_mask = host(options.attn_mask);
  o.dlse = host(options.dlse);
  o.rescale_counts = options.rescale_counts.on(Device::cpu);
  return o;
}

// What a score hook's apply caught on the library's threads (ScoreHook::take_error): taken
// before a run (a stale one from a call that failed otherwise) and rethrown after it.
std::exception_ptr take_hook_error(const AttentionOptions& options) {
  const ScoreHook& hook = options.score_hook;
  return hook.take_error != nullptr ? hook.take_error(hook.mods) : nullptr;
}
void rethrow_hook_error(const AttentionOptions& options) {
  if (const std::exception_ptr e = take_hook_error(options)) std::rethrow_exception(e);
}

// The hook's mods held by this call, from before its run to after its rethrow
// (ScoreHook::enter, leave).
class HookHold {
 public:
  explicit HookHold(const ScoreHook& hook) : hook_(hook) {
    if (hook_.enter != nullptr && !hook_.enter(hook_.mods))
      throw Error("score_hook: its mods serve another call now (FlexMods keeps one call's exception); give each "
                  "concurrent call its own copy of the FlexMods");
  }
  ~HookHold() {
    if (hook_.leave != nullptr) hook_.leave(hook_.mods);
  }
  HookHold(const HookHold&) = delete;
  HookHold& operator=(const HookHold&) = delete;

 private:
  const ScoreHook& hook_;
};
}  // namespace

void run_forward(const Backend& backend, const TensorView& q, const TensorView& k, const TensorView& v,
                 const MutableTensorView& out, const MutableTensorView& lse, const AttentionOptions& options,
                 OutputDtypes outputs, float* lse_sums) {
  const ForwardJob job{check_forward_call(host(q), host(k), host(v), host(out), host(lse), host(options), outputs),
                       {}, q, k, v, out, lse, options, {}, lse_sums};
  if (lse_sums != nullptr && std::string_view(backend.name) != "cpu")
    throw Error(std::string("lse_sums: the ") + backend.name + " backend writes no softmax states (the CPU backend does)");
  backend.check_forward(job);
  const HookHold hold(options.score_hook);
  begin_run(options);
  take_hook_error(options);
  backend.forward(job);
  rethrow_hook_error(options);
}

void run_backward(const Backend& backend, const TensorView& dout, const TensorView& q, const TensorView& k,
                  const TensorView& v, const TensorView& out, const TensorView& lse, const MutableTensorView& dq,
                  const MutableTensorView& dk, const MutableTensorView& dv, const AttentionOptions& options,
                  OutputDtypes grads) {
  const BackwardJob job{check_backward_call(host(dout), host(q), host(k), host(v), host(out), host(lse), host(dq),
                                            host(dk), host(dv), host(options), grads),
                        {}, dout, q, k, v, out, lse, dq, dk, dv, options};
  backend.check_backward(job);
  const HookHold hold(options.score_hook);
  begin_run(options);
  take_hook_error(options);
  backend.backward(job);
  rethrow_hook_error(options);
}

}  // namespace flashattn::detail
