// Routing a call by the device of its tensors, in one place for every entry point.
#pragma once

#include <initializer_list>

#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"
#include "src/api/backend.hpp"
#include "src/core/validate.hpp"

namespace flashattn::detail {

// The device every named view that is set is on; throws Error naming the first view on
// another device. Views left unset (rank 0, no data: an absent optional input) are skipped.
Device common_device(std::initializer_list<NamedView> views);

// The backend of the views' device. Throws Error naming `entry_point` and the backend when
// the backend lacks it (its `entry` is null): before any argument is read.
// The call's checks, its backend's included, have passed and it is about to run: the plans
// it runs replace what options.plans_run held (flashattn/plan.hpp: PlansRun).
void begin_run(const AttentionOptions& options);

[[noreturn]] void lacking(const char* entry_point, const Backend& backend);
template <class Fn>
const Backend& route(const char* entry_point, Fn Backend::*entry, std::initializer_list<NamedView> views) {
  const Backend& backend = common_device(views) == Device::cuda ? cuda_backend() : cpu_backend();
  if (backend.*entry == nullptr) lacking(entry_point, backend);
  return backend;
}

}  // namespace flashattn::detail
