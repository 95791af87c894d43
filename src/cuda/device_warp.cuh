// The warp operations of the kernel bodies on the device: scalar registers per thread and
// the PTX instructions the emulation (emulation.hpp) models. sm_80 and later.
#pragma once

#include <cstdint>
#include <type_traits>

#include "src/cuda/layout.hpp"

namespace flashattn::cuda {

struct DeviceWarp {
  using F = float;
  using I = int;
  using L = std::int64_t;
  using U = std::uint32_t;
  using P = bool;

  __device__ static int lane() { return static_cast<int>(threadIdx.x) % kWarpSize; }
  __device__ static int warp() { return static_cast<int>(threadIdx.x) / kWarpSize; }

  __device__ static float max(float a, float b) { return fmaxf(a, b); }
  // The multi-function unit's 2^x (ex2.approx, 2 ulp): P is rounded to 16 bits right after.
  __device__ static float exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
  __device__ static float log2(float x) { return __log2f(x); }
  template <class A, class B>
  __device__ static std::common_type_t<A, B> select(bool p, A a, B b) {
    return p ? std::common_type_t<A, B>(a) : std::common_type_t<A, B>(b);
  }
  __device__ static std::int64_t widen(int x) { return x; }
  __device__ static float shfl_xor(float x, int mask) { return __shfl_xor_sync(0xffffffffu, x, mask); }
  __device__ static bool any(bool p) { return __any_sync(0xffffffffu, p); }

  // Two floats rounded to the element type, lo in the low half.
  template <class E>
  __device__ static std::uint32_t pack(float lo, float hi) {
    std::uint32_t r;
    if constexpr (E::kIsBf16)
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }

  template <class E>
  __device__ static void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
    if constexpr (E::kIsBf16)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }

  template <bool kTrans>
  __device__ static void ldmatrix_x4(std::uint32_t (&r)[4], int addr) {
    if constexpr (kTrans)
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    else
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  }
  __device__ static float lds_f32(int addr) {
    float x;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x) : "r"(addr));
    return x;
  }
  __device__ static void sts_f32(bool p, int addr, float x) {
    if (p) asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(x));
  }
  __device__ static void sts_u16(int addr, std::uint32_t x) {
    asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(static_cast<unsigned short>(x)));
  }

  // 16 bytes global → shared, bypassing L1; bytes past src_bytes are zero-filled.
  __device__ static void cp_async(int smem_addr, const void* base, std::int64_t offset, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr),
                 "l"(static_cast<const char*>(base) + offset), "r"(src_bytes));
  }
  __device__ static void cp_async_if(bool p, int smem_addr, const void* base, std::int64_t offset) {
    if (p)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr),
                   "l"(static_cast<const char*>(base) + offset));
  }
  __device__ static void commit() { asm volatile("cp.async.commit_group;"); }
  template <int N>
  __device__ static void wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
  }

  template <class E>
  __device__ static void store(bool p, void* base, std::int64_t index, float x) {
    if (!p) return;
    std::uint16_t bits;
    if constexpr (E::kIsBf16)
      asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(x));
    else
      asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(x));
    static_cast<std::uint16_t*>(base)[index] = bits;
  }
  __device__ static void store_f32(bool p, float* base, std::int64_t index, float x) {
    if (p) base[index] = x;
  }
  __device__ static float load_f32(const float* base, std::int64_t index) { return base[index]; }
  __device__ static void atomic_add(bool p, float* base, std::int64_t index, float x) {
    if (p) atomicAdd(base + index, x);
  }
};

// A thread block on the device: each thread runs the body once for its own warp.
struct DeviceBlock {
  using Warp = DeviceWarp;
  static constexpr int kLocalWarps = 1;
  __device__ static int smem_base() {
    extern __shared__ __align__(128) unsigned char smem[];
    return static_cast<int>(__cvta_generic_to_shared(smem));
  }
  template <class Body>
  __device__ void each_warp(Body&& body) {
    DeviceWarp w;
    body(w, 0);
  }
  __device__ static void barrier() { __syncthreads(); }
  // Deterministic dQ: one thread spins until the counter says it is this block's turn; the
  // block's adds are made visible device-wide before the next block's turn is released.
  // Blocks of lower K/V tiles have lower indices and start first, so the wait ends.
  __device__ static void wait_turn(const int* turn, int value) {
    if (threadIdx.x == 0) {
      int seen;
      do {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(turn) : "memory");
      } while (seen != value);
    }
    __syncthreads();
  }
  __device__ static void release_turn(int* turn, int value) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(turn), "r"(value) : "memory");
  }
};

}  // namespace flashattn::cuda
