// The public API on cuda tensors, without a GPU: every unsupported or inconsistent call is
// a flashattn::Error naming the argument and the values, raised before any device work.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <tuple>
#include <utility>

#include "flashattn/cuda_plan.hpp"
#include "flashattn/flashattn.hpp"
#include "flashattn/flex.hpp"

namespace flashattn {
namespace {

// Views of a device buffer that is never touched: every call below fails validation first.
alignas(16) unsigned char g_never_read[16];

TensorView device_view(DType dtype, std::initializer_list<std::int64_t> shape) {
  return TensorView(g_never_read, dtype, shape).on(Device::cuda);
}
MutableTensorView device_output(DType dtype, std::initializer_list<std::int64_t> shape) {
  return MutableTensorView(g_never_read, dtype, shape).on(Device::cuda);
}

std::string forward_error(const TensorView& q, const TensorView& k, const TensorView& v, const MutableTensorView& out,
                          const MutableTensorView& lse, const AttentionOptions& options = {}) {
  try {
    forward(q, k, v, out, lse, options);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(CudaApi, ViewsDefaultToCpuAndKeepTheirDevice) {
  float x[4];
  const MutableTensorView m(x, DType::f32, {4});
  EXPECT_EQ(m.device, Device::cpu);
  const TensorView v = m.on(Device::cuda);
  EXPECT_EQ(v.device, Device::cuda);
  EXPECT_EQ(TensorView(m.on(Device::cuda)).device, Device::cuda);
  EXPECT_EQ(to_string(Device::cuda), "cuda");
}

TEST(CudaApi, MixedDevicesNameTheTensor) {
  const TensorView q = device_view(DType::bf16, {1, 4, 1, 64});
  Tensor k(DType::bf16, {1, 4, 1, 64});
  const std::string msg = forward_error(q, k.view(), k.view(), device_output(DType::bf16, {1, 4, 1, 64}),
                                        device_output(DType::f32, {1, 1, 4}));
  EXPECT_NE(msg.find("k: on cpu but q is on cuda"), std::string::npos) << msg;
}

TEST(CudaApi, UnsupportedInputsAreErrorsWithTheirValues) {
  const auto q = device_view(DType::bf16, {1, 4, 2, 64});
  const auto kv = device_view(DType::bf16, {1, 4, 1, 64});
  const auto out = device_output(DType::bf16, {1, 4, 2, 64});
  const auto lse = device_output(DType::f32, {1, 2, 4});
  // Overlap checks would fire first for views of one buffer: give each its own storage.
  alignas(16) static unsigned char buffers[5][1 << 16];
  auto own = [](auto view, int i) {
    view.data = buffers[i];
    return view;
  };
  const std::string f32 = forward_error(own(device_view(DType::f32, {1, 4, 2, 64}), 0), own(device_view(DType::f32, {1, 4, 1, 64}), 1),
                                        own(device_view(DType::f32, {1, 4, 1, 64}), 2),
                                        own(device_output(DType::f32, {1, 4, 2, 64}), 3), own(lse, 4));
  EXPECT_NE(f32.find("dtype f32 is not supported on cuda"), std::string::npos) << f32;

  const std::string big = forward_error(own(device_view(DType::bf16, {1, 4, 1, 264}), 0), own(device_view(DType::bf16, {1, 4, 1, 264}), 1),
                                        own(device_view(DType::bf16, {1, 4, 1, 264}), 2),
                                        own(device_output(DType::bf16, {1, 4, 1, 264}), 3),
                                        own(device_output(DType::f32, {1, 1, 4}), 4));
  EXPECT_NE(big.find("head_dim: 264"), std::string::npos) << big;

  const std::string odd = forward_error(own(device_view(DType::bf16, {1, 4, 1, 60}), 0), own(device_view(DType::bf16, {1, 4, 1, 60}), 1),
                                        own(device_view(DType::bf16, {1, 4, 1, 60}), 2),
                                        own(device_output(DType::bf16, {1, 4, 1, 60}), 3),
                                        own(device_output(DType::f32, {1, 1, 4}), 4));
  EXPECT_NE(odd.find("stride 60"), std::string::npos) << odd;

  AttentionOptions softcap;
  softcap.softcap = 30.0f;
  const std::string cap = forward_error(own(q, 0), own(kv, 1), own(kv, 2), own(out, 3), own(lse, 4), softcap);
  EXPECT_NE(cap.find("softcap"), std::string::npos) << cap;

  AttentionOptions window;
  window.window_size = {16, 0};
  const std::string win = forward_error(own(q, 0), own(kv, 1), own(kv, 2), own(out, 3), own(lse, 4), window);
  EXPECT_NE(win.find("window_size: (16, 0)"), std::string::npos) << win;
}

// A backward without keys must still write dq (zero), and one without queries dk and dv
// (zero): both reach the launch (src/cuda: run_backward_passes leaves out the empty grids),
// which in this build without CUDA is the Error that says so — not a silent return that
// leaves the gradients unwritten. Only an empty batch has nothing to write.
TEST(CudaApi, BackwardWithoutKeysOrQueriesStillWritesItsGradients) {
  if (cuda_compiled())
    GTEST_SKIP() << "this build has CUDA: these views are host memory, never to be launched on (tests/gpu runs the "
                    "case on a device)";
  alignas(16) static unsigned char buffers[10][1 << 12];
  auto view = [](int i, DType dtype, std::initializer_list<std::int64_t> shape) {
    return TensorView(buffers[i], dtype, shape).on(Device::cuda);
  };
  auto output = [](int i, DType dtype, std::initializer_list<std::int64_t> shape) {
    return MutableTensorView(buffers[i], dtype, shape).on(Device::cuda);
  };
  for (const auto& [sq, sk, batch] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{4, 0, 1}, {0, 4, 1}, {4, 4, 0}}) {
    SCOPED_TRACE("Sq " + std::to_string(sq) + " Sk " + std::to_string(sk) + " batch " + std::to_string(batch));
    std::string message = "no error";
    try {
      backward(view(0, DType::bf16, {batch, sq, 2, 64}), view(1, DType::bf16, {batch, sq, 2, 64}),
               view(2, DType::bf16, {batch, sk, 1, 64}), view(3, DType::bf16, {batch, sk, 1, 64}),
               view(4, DType::bf16, {batch, sq, 2, 64}), view(5, DType::f32, {batch, 2, sq}),
               output(6, DType::bf16, {batch, sq, 2, 64}), output(7, DType::bf16, {batch, sk, 1, 64}),
               output(8, DType::bf16, {batch, sk, 1, 64}));
    } catch (const Error& e) {
      message = e.what();
    }
    if (batch == 0)
      EXPECT_EQ(message, "no error");
    else
      EXPECT_NE(message.find("built without CUDA"), std::string::npos) << message;
  }
}

// Entry points the CUDA backend lacks fail at the route, before any argument (the offsets,
// the block table: device memory) is read, with an Error naming the entry point and the backend.
TEST(CudaApi, EntryPointsTheCudaBackendLacksNameThemselves) {
  const auto packed = device_view(DType::bf16, {4, 1, 64});
  const auto packed_out = device_output(DType::bf16, {4, 1, 64});
  const auto cu = device_view(DType::i32, {2});
  const VarlenSeqlens seqlens{cu, cu, 4, 4};
  const auto q = device_view(DType::bf16, {1, 1, 1, 64});
  const auto cache = device_output(DType::bf16, {1, 8, 1, 64});
  const Fp8View fp8{device_view(DType::u8, {1, 4, 1, 64}), device_view(DType::f32, {1}), Fp8Format::e4m3, 0};
  const auto out = device_output(DType::bf16, {1, 4, 1, 64});
  const auto lse = device_output(DType::f32, {1, 1, 4});
  KvCache kv;
  kv.k_cache = cache;
  kv.v_cache = cache;
  const PagedKvBatch paged{cache, cache, device_view(DType::i32, {1, 1}), device_view(DType::i32, {1}), {}, {}};
  const std::pair<const char*, std::function<void()>> calls[] = {
      {"forward_varlen", [&] { forward_varlen(packed, packed, packed, seqlens); }},
      {"forward_varlen", [&] { forward_varlen(packed, packed, packed, seqlens, packed_out, device_output(DType::f32, {1, 4})); }},
      {"backward_varlen", [&] { backward_varlen(packed, packed, packed, packed, packed, device_view(DType::f32, {1, 4}), seqlens); }},
      {"forward_with_kvcache", [&] { forward_with_kvcache(q, kv); }},
      {"forward_with_kvcache", [&] { forward_with_kvcache(q, kv, device_output(DType::bf16, {1, 1, 1, 64}), device_output(DType::f32, {1, 1, 1})); }},
      {"forward_varlen_paged", [&] { forward_varlen_paged(packed, cu, 4, paged); }},
      {"forward_varlen_paged", [&] { forward_varlen_paged(packed, cu, 4, paged, packed_out, device_output(DType::f32, {1, 4})); }},
      {"forward_fp8", [&] { forward_fp8(fp8, fp8, fp8, DType::bf16); }},
      {"forward_fp8", [&] { forward_fp8(fp8, fp8, fp8, out, lse); }},
  };
  for (const auto& [entry_point, call] : calls) {
    SCOPED_TRACE(entry_point);
    try {
      call();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()),
                std::string(entry_point) + ": not implemented by the cuda backend (the tensors are on cuda)");
    }
  }
}

// The backward's argument checks are the front door's, one set for every backend: a
// gradient of the wrong shape reads the same on cuda as on the cpu.
TEST(CudaApi, BackwardChecksAreSharedWithTheCpu) {
  alignas(16) static unsigned char buffers[9][1 << 12];
  auto call = [](Device device, std::int64_t dk_keys) {
    auto view = [device](int i, DType dtype, std::initializer_list<std::int64_t> shape) {
      return TensorView(buffers[i], dtype, shape).on(device);
    };
    auto output = [device](int i, DType dtype, std::initializer_list<std::int64_t> shape) {
      return MutableTensorView(buffers[i], dtype, shape).on(device);
    };
    try {
      backward(view(0, DType::bf16, {1, 4, 2, 64}), view(1, DType::bf16, {1, 4, 2, 64}),
               view(2, DType::bf16, {1, 4, 1, 64}), view(3, DType::bf16, {1, 4, 1, 64}),
               view(4, DType::bf16, {1, 4, 2, 64}), view(5, DType::f32, {1, 2, 4}),
               output(6, DType::bf16, {1, 4, 2, 64}), output(7, DType::bf16, {1, dk_keys, 1, 64}),
               output(8, DType::bf16, {1, 4, 1, 64}));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string cuda = call(Device::cuda, 3);
  EXPECT_EQ(cuda, "dk: shape (1, 3, 1, 64) but expected (1, 4, 1, 64) (the shape of its input)");
  EXPECT_EQ(cuda, call(Device::cpu, 3));
}

TEST(CudaApi, RescaleCountsPlansRunAndSinksAreRejectedOnCuda) {
  alignas(16) static unsigned char buffers[6][1 << 12];
  auto view = [](int i, DType dtype, std::initializer_list<std::int64_t> shape) {
    return TensorView(buffers[i], dtype, shape).on(Device::cuda);
  };
  auto output = [](int i, DType dtype, std::initializer_list<std::int64_t> shape) {
    return MutableTensorView(buffers[i], dtype, shape).on(Device::cuda);
  };
  AttentionOptions options;
  options.rescale_counts = output(5, DType::i32, {1, 2, 4});
  const std::string msg = forward_error(view(0, DType::bf16, {1, 4, 2, 64}), view(1, DType::bf16, {1, 4, 1, 64}),
                                        view(2, DType::bf16, {1, 4, 1, 64}), output(3, DType::bf16, {1, 4, 2, 64}),
                                        output(4, DType::f32, {1, 2, 4}), options);
  EXPECT_NE(msg.find("rescale_counts: not supported on cuda"), std::string::npos) << msg;
  PlansRun plans;
  plans.forward.resize(2);
  AttentionOptions reporting;
  reporting.plans_run = &plans;
  const std::string plans_msg =
      forward_error(view(0, DType::bf16, {1, 4, 2, 64}), view(1, DType::bf16, {1, 4, 1, 64}),
                    view(2, DType::bf16, {1, 4, 1, 64}), output(3, DType::bf16, {1, 4, 2, 64}),
                    output(4, DType::f32, {1, 2, 4}), reporting);
  EXPECT_NE(plans_msg.find("plans_run: not supported on cuda"), std::string::npos) << plans_msg;
  EXPECT_EQ(plans.forward.size(), 2u);  // a rejected call leaves it as it was
  AttentionOptions sinks;
  sinks.sinks = view(5, DType::f32, {2});
  const std::string sinks_msg =
      forward_error(view(0, DType::bf16, {1, 4, 2, 64}), view(1, DType::bf16, {1, 4, 1, 64}),
                    view(2, DType::bf16, {1, 4, 1, 64}), output(3, DType::bf16, {1, 4, 2, 64}),
                    output(4, DType::f32, {1, 2, 4}), sinks);
  EXPECT_NE(sinks_msg.find("sinks are not supported on cuda"), std::string::npos) << sinks_msg;
}

// causal_alignment top_left and a score_hook: forward and backward name the option, and
// the outputs (host bytes posing as device memory) stay as they were.
TEST(CudaApi, TopLeftAndScoreHookAreRejectedOnCuda) {
  alignas(16) static unsigned char buffers[9][1 << 12];
  constexpr unsigned char kUnwritten = 0xA5;
  for (auto& b : buffers) std::fill(std::begin(b), std::end(b), kUnwritten);
  auto view = [](int i, DType dtype, std::initializer_list<std::int64_t> shape) {
    return TensorView(buffers[i], dtype, shape).on(Device::cuda);
  };
  auto output = [](int i, DType dtype, std::initializer_list<std::int64_t> shape) {
    return MutableTensorView(buffers[i], dtype, shape).on(Device::cuda);
  };
  AttentionOptions top_left;
  top_left.causal = true;
  top_left.causal_alignment = CausalAlignment::top_left;
  const FlexMods mods([](auto s, std::int64_t, std::int64_t, std::int64_t q_idx, std::int64_t kv_idx) {
    return s + 0.01f * static_cast<float>(q_idx - kv_idx);
  });
  AttentionOptions hooked;
  hooked.score_hook = mods.hook();
  for (const auto& [options, message] : {std::pair{top_left, "causal_alignment: top_left is not supported on cuda"},
                                         std::pair{hooked, "score_hook: not supported on cuda"}}) {
    SCOPED_TRACE(message);
    EXPECT_EQ(forward_error(view(0, DType::bf16, {1, 4, 2, 64}), view(1, DType::bf16, {1, 4, 1, 64}),
                            view(2, DType::bf16, {1, 4, 1, 64}), output(3, DType::bf16, {1, 4, 2, 64}),
                            output(4, DType::f32, {1, 2, 4}), options),
              message);
    std::string backward_message = "no error";
    try {
      backward(view(8, DType::bf16, {1, 4, 2, 64}), view(0, DType::bf16, {1, 4, 2, 64}),
               view(1, DType::bf16, {1, 4, 1, 64}), view(2, DType::bf16, {1, 4, 1, 64}),
               view(3, DType::bf16, {1, 4, 2, 64}), view(4, DType::f32, {1, 2, 4}),
               output(5, DType::bf16, {1, 4, 2, 64}), output(6, DType::bf16, {1, 4, 1, 64}),
               output(7, DType::bf16, {1, 4, 1, 64}), options);
    } catch (const Error& e) {
      backward_message = e.what();
    }
    EXPECT_EQ(backward_message, message);
    for (const auto& b : buffers)
      EXPECT_TRUE(std::all_of(std::begin(b), std::end(b), [](unsigned char x) { return x == kUnwritten; }))
          << "a rejected call wrote to buffer " << (&b - buffers);
  }
}

TEST(CudaApi, PlansComeFromTheTileTable) {
  AttentionOptions options;
  const AttentionProblem p = AttentionProblem::from_sizes(2, 1000, 1000, 16, 4, 96, 96, DType::bf16, options);
  const CudaForwardPlan f = plan_cuda_forward(p);
  EXPECT_EQ(f.head_dim_padded, 128);
  EXPECT_EQ(f.m_blocks, (1000 + f.block_m - 1) / f.block_m);
  EXPECT_EQ(f.threads, 32 * f.warps);
  EXPECT_EQ(f.blocks(), f.m_blocks * 16 * 2);
  const CudaBackwardPlan b = plan_cuda_backward(p, true);
  EXPECT_EQ(b.n_blocks, (1000 + b.block_n - 1) / b.block_n);
  EXPECT_TRUE(b.deterministic);
  EXPECT_NE(b.describe().find("K/V-tile order"), std::string::npos);
  const AttentionProblem wide = AttentionProblem::from_sizes(1, 8, 8, 1, 1, 192, 192, DType::bf16, options);
  EXPECT_EQ(plan_cuda_forward(wide).head_dim_padded, 256);
  EXPECT_THROW(plan_cuda_backward(wide, false), Error);
}

}  // namespace
}  // namespace flashattn
