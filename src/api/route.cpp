#include "src/api/route.hpp"

#include <string>

#include "flashattn/error.hpp"
#include "flashattn/plan.hpp"

namespace flashattn::detail {

Device common_device(std::initializer_list<NamedView> views) {
  const NamedView* first = nullptr;
  for (const NamedView& named : views) {
    if (named.view.rank == 0 && named.view.data == nullptr) continue;
    if (first == nullptr) first = &named;
    if (named.view.device != first->view.device)
      throw Error(std::string(named.name) + ": on " + to_string(named.view.device) + " but " + first->name +
                  " is on " + to_string(first->view.device) + " (all tensors of a call must be on one device)");
  }
  return first != nullptr ? first->view.device : Device::cpu;
}

void begin_run(const AttentionOptions& options) {
  if (options.plans_run != nullptr) *options.plans_run = PlansRun{};
}

void lacking(const char* entry_point, const Backend& backend) {
  throw Error(std::string(entry_point) + ": not implemented by the " + backend.name + " backend (the tensors are on " +
              backend.name + ")");
}

}  // namespace flashattn::detail
