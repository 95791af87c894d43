// Umbrella header: everything a C++ caller needs.
#pragma once

#include "flashattn/attention.hpp"
#include "flashattn/cost_model.hpp"
#include "flashattn/counters.hpp"
#include "flashattn/cuda_plan.hpp"
#include "flashattn/dropout.hpp"
#include "flashattn/error.hpp"
#include "flashattn/exp2.hpp"
#include "flashattn/flex.hpp"
#include "flashattn/fp8.hpp"
#include "flashattn/hadamard.hpp"
#include "flashattn/online_softmax.hpp"
#include "flashattn/options.hpp"
#include "flashattn/plan.hpp"
#include "flashattn/problem.hpp"
#include "flashattn/reference.hpp"
#include "flashattn/tensor.hpp"
