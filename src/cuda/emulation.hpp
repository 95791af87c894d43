// The CPU emulation of the CUDA kernels: the kernel bodies (forward_body.hpp,
// backward_body.hpp) are templates over a warp's operations; on the device every thread
// runs them with scalar registers, here one call runs a whole warp with Lanes<T> registers
// (32 values, one per lane) and software mma / ldmatrix / shuffles that follow the PTX ISA
// tables of layout.hpp. Thread blocks run one warp after the other between barriers, which
// is one of the schedules the hardware may choose; cp.async copies land only when the
// issuing warp waits for their group, so a wrong wait count reads poisoned shared memory.
// Host only: tests and nothing else use it.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "flashattn/tensor.hpp"
#include "src/cuda/layout.hpp"

namespace flashattn::cuda::emulation {

template <class T>
struct Lanes {
  std::array<T, kWarpSize> v{};
  Lanes() = default;
  Lanes(T x) { v.fill(x); }  // NOLINT(google-explicit-constructor): a uniform value
  T& operator[](int i) { return v[static_cast<std::size_t>(i)]; }
  const T& operator[](int i) const { return v[static_cast<std::size_t>(i)]; }
};

template <class T> struct is_lanes : std::false_type {};
template <class T> struct is_lanes<Lanes<T>> : std::true_type {};
template <class A, class B>
concept AnyLanes = is_lanes<std::remove_cvref_t<A>>::value || is_lanes<std::remove_cvref_t<B>>::value;

template <class T> const T& at(const Lanes<T>& x, int i) { return x[i]; }
template <class T> const T& at(const T& x, int) { return x; }

template <class F, class A, class B>
auto zip(F f, const A& a, const B& b) {
  using R = decltype(f(at(a, 0), at(b, 0)));
  Lanes<R> r;
  for (int i = 0; i < kWarpSize; ++i) r[i] = f(at(a, i), at(b, i));
  return r;
}
template <class F, class A>
auto map(F f, const A& a) {
  using R = decltype(f(at(a, 0)));
  Lanes<R> r;
  for (int i = 0; i < kWarpSize; ++i) r[i] = f(at(a, i));
  return r;
}

#define FLASHATTN_LANES_BINARY(op)                                                  \
  template <class A, class B>                                                       \
    requires AnyLanes<A, B>                                                         \
  auto operator op(const A& a, const B& b) {                                        \
    return zip([](const auto& x, const auto& y) { return x op y; }, a, b);          \
  }
FLASHATTN_LANES_BINARY(+)
FLASHATTN_LANES_BINARY(-)
FLASHATTN_LANES_BINARY(*)
FLASHATTN_LANES_BINARY(/)
FLASHATTN_LANES_BINARY(%)
FLASHATTN_LANES_BINARY(&)
FLASHATTN_LANES_BINARY(|)
FLASHATTN_LANES_BINARY(^)
FLASHATTN_LANES_BINARY(<<)
FLASHATTN_LANES_BINARY(>>)
FLASHATTN_LANES_BINARY(<)
FLASHATTN_LANES_BINARY(<=)
FLASHATTN_LANES_BINARY(>)
FLASHATTN_LANES_BINARY(>=)
FLASHATTN_LANES_BINARY(==)
FLASHATTN_LANES_BINARY(!=)
FLASHATTN_LANES_BINARY(&&)
FLASHATTN_LANES_BINARY(||)
#undef FLASHATTN_LANES_BINARY

template <class T, class B> Lanes<T>& operator+=(Lanes<T>& a, const B& b) { return a = Lanes<T>(a + b); }
template <class T, class B> Lanes<T>& operator*=(Lanes<T>& a, const B& b) { return a = Lanes<T>(a * b); }

template <class E> constexpr DType dtype_of() { return E::kIsBf16 ? DType::bf16 : DType::f16; }

inline float to_float(DType dtype, std::uint16_t bits) {
  return dtype == DType::bf16 ? bf16_to_float(bits) : f16_to_float(bits);
}
inline std::uint16_t from_float(DType dtype, float x) {
  return dtype == DType::bf16 ? float_to_bf16(x) : float_to_f16(x);
}

// The operations of one warp: registers are Lanes, shared memory is the block's bytes.
class HostWarp {
 public:
  using F = Lanes<float>;
  using I = Lanes<int>;
  using L = Lanes<std::int64_t>;
  using U = Lanes<std::uint32_t>;
  using P = Lanes<bool>;

  HostWarp(std::vector<unsigned char>& smem, int warp) : smem_(smem), warp_(warp) {}

  static I lane() {
    I l;
    for (int i = 0; i < kWarpSize; ++i) l[i] = i;
    return l;
  }
  int warp() const { return warp_; }

  // ---- arithmetic
  static F max(const F& a, const F& b) { return zip([](float x, float y) { return std::fmax(x, y); }, a, b); }
  static F exp2(const F& a) { return map([](float x) { return std::exp2(x); }, a); }
  static F log2(const F& a) { return map([](float x) { return std::log2(x); }, a); }
  template <class A, class B> static auto select(const P& p, const A& a, const B& b) {
    Lanes<std::common_type_t<std::remove_cvref_t<decltype(at(a, 0))>, std::remove_cvref_t<decltype(at(b, 0))>>> r;
    for (int i = 0; i < kWarpSize; ++i) r[i] = p[i] ? at(a, i) : at(b, i);
    return r;
  }
  static L widen(const I& a) { return map([](int x) { return static_cast<std::int64_t>(x); }, a); }
  static F shfl_xor(const F& x, int mask) {
    F r;
    for (int i = 0; i < kWarpSize; ++i) r[i] = x[i ^ mask];
    return r;
  }
  static bool any(const P& p) {
    for (int i = 0; i < kWarpSize; ++i)
      if (p[i]) return true;
    return false;
  }

  // Two floats rounded to the element type, lo in the low half (PTX cvt.rn.*x2 order).
  template <class E> static U pack(const F& lo, const F& hi) {
    U r;
    for (int i = 0; i < kWarpSize; ++i)
      r[i] = from_float(dtype_of<E>(), lo[i]) | static_cast<std::uint32_t>(from_float(dtype_of<E>(), hi[i])) << 16;
    return r;
  }

  // ---- tensor cores: d += a · b with the fragment maps of layout.hpp
  template <class E> static void mma(F (&d)[4], const U (&a)[4], const U& b0, const U& b1) {
    float A[kMmaM][kMmaK], B[kMmaK][kMmaN];
    for (int lane = 0; lane < kWarpSize; ++lane) {
      for (int e = 0; e < 8; ++e) {
        const RowCol rc = mma_a_element(lane, e);
        A[rc.row][rc.col] = half_of(dtype_of<E>(), a[e / 2][lane], e % 2);
      }
      for (int e = 0; e < 4; ++e) {
        const RowCol rc = mma_b_element(lane, e);
        B[rc.row][rc.col] = half_of(dtype_of<E>(), (e < 2 ? b0 : b1)[lane], e % 2);
      }
    }
    for (int lane = 0; lane < kWarpSize; ++lane)
      for (int e = 0; e < 4; ++e) {
        const RowCol rc = mma_c_element(lane, e);
        float acc = d[e][lane];
        for (int k = 0; k < kMmaK; ++k) acc += A[rc.row][k] * B[k][rc.col];
        d[e][lane] = acc;
      }
  }

  // ---- shared memory
  template <bool kTrans> void ldmatrix_x4(U (&r)[4], const I& addr) const {
    for (int lane = 0; lane < kWarpSize; ++lane)
      for (int m = 0; m < 4; ++m) {
        std::uint32_t packed = 0;
        for (int half = 0; half < 2; ++half) {
          const RowCol rc = ldmatrix_element(lane, half, kTrans);
          // the row rc.row of matrix m was supplied by lane 8 m + rc.row
          const int a = addr[8 * m + rc.row] + 2 * rc.col;
          packed |= static_cast<std::uint32_t>(load16(a)) << (16 * half);
        }
        r[m][lane] = packed;
      }
  }
  F lds_f32(const I& addr) const {
    F r;
    for (int i = 0; i < kWarpSize; ++i) std::memcpy(&r[i], bytes(addr[i], 4), 4);
    return r;
  }
  void sts_f32(const P& p, const I& addr, const F& x) {
    for (int i = 0; i < kWarpSize; ++i)
      if (p[i]) std::memcpy(bytes(addr[i], 4), &x[i], 4);
  }
  void sts_u16(const I& addr, const U& x) {
    for (int i = 0; i < kWarpSize; ++i) {
      const auto h = static_cast<std::uint16_t>(x[i]);
      std::memcpy(bytes(addr[i], 2), &h, 2);
    }
  }

  // ---- global → shared copies (cp.async.cg, 16 bytes; bytes past src_bytes are zero)
  void cp_async(const I& smem_addr, const void* base, const L& offset, const I& src_bytes) {
    for (int i = 0; i < kWarpSize; ++i) {
      Copy c{smem_addr[i], {}};
      std::memcpy(c.data.data(), static_cast<const char*>(base) + offset[i],
                  static_cast<std::size_t>(src_bytes[i]));
      pending_.push_back(c);
    }
  }
  // Only the lanes where p holds copy (all 16 bytes).
  void cp_async_if(const P& p, const I& smem_addr, const void* base, const L& offset) {
    for (int i = 0; i < kWarpSize; ++i) {
      if (!p[i]) continue;
      Copy c{smem_addr[i], {}};
      std::memcpy(c.data.data(), static_cast<const char*>(base) + offset[i], kChunkBytes);
      pending_.push_back(c);
    }
  }
  void commit() { groups_.push_back(std::exchange(pending_, {})); }
  template <int N> void wait() {
    while (static_cast<int>(groups_.size()) > N) {
      for (const Copy& c : groups_.front()) std::memcpy(bytes(c.addr, kChunkBytes), c.data.data(), kChunkBytes);
      groups_.pop_front();
    }
  }
  bool idle() const { return groups_.empty() && pending_.empty(); }

  // ---- global stores and reductions
  template <class E> static void store(const P& p, void* base, const L& index, const F& x) {
    for (int i = 0; i < kWarpSize; ++i)
      if (p[i]) static_cast<std::uint16_t*>(base)[index[i]] = from_float(dtype_of<E>(), x[i]);
  }
  static void store_f32(const P& p, float* base, const L& index, const F& x) {
    for (int i = 0; i < kWarpSize; ++i)
      if (p[i]) base[index[i]] = x[i];
  }
  static F load_f32(const float* base, const L& index) {
    F r;
    for (int i = 0; i < kWarpSize; ++i) r[i] = base[index[i]];
    return r;
  }
  static void atomic_add(const P& p, float* base, const L& index, const F& x) {
    for (int i = 0; i < kWarpSize; ++i)
      if (p[i]) base[index[i]] += x[i];
  }

 private:
  struct Copy {
    int addr;
    std::array<unsigned char, kChunkBytes> data;
  };
  static float half_of(DType dtype, std::uint32_t reg, int half) {
    return to_float(dtype, static_cast<std::uint16_t>(reg >> (16 * half)));
  }
  unsigned char* bytes(int addr, std::size_t n) const {
    if (addr < 0 || static_cast<std::size_t>(addr) + n > smem_.size()) throw std::out_of_range("emulated shared memory access out of bounds");
    return smem_.data() + addr;
  }
  std::uint16_t load16(int addr) const {
    std::uint16_t h;
    std::memcpy(&h, bytes(addr, 2), 2);
    return h;
  }

  std::vector<unsigned char>& smem_;
  int warp_;
  std::vector<Copy> pending_;
  std::deque<std::vector<Copy>> groups_;
};

// One thread block: its shared memory (poisoned with NaN bytes before the kernel runs) and
// its warps, run one after the other between barriers.
class HostBlock {
 public:
  using Warp = HostWarp;
  HostBlock(int warps, int smem_bytes) : smem_(static_cast<std::size_t>(smem_bytes), 0xFF) {
    if (warps > kLocalWarps) throw std::invalid_argument("emulated block: too many warps");
    for (int w = 0; w < warps; ++w) warps_.emplace_back(smem_, w);
  }
  int warps() const { return static_cast<int>(warps_.size()); }
  template <class Body> void each_warp(Body body) {
    for (HostWarp& w : warps_) body(w, w.warp());
  }
  static constexpr int kLocalWarps = 8;  // warp states a block body keeps: all its warps
  static int smem_base() { return 0; }
  void barrier() {}
  // Deterministic dQ: blocks run here in the order of their K/V tile, so the turn must have
  // come already; on the device a block spins until it has.
  static void wait_turn(const int* turn, int value) {
    if (*turn != value) throw std::logic_error("emulated block: dQ turn taken out of order");
  }
  static void release_turn(int* turn, int value) { *turn = value; }
  // Copies still pending when the block ends would be a kernel bug (lost data).
  bool idle() const {
    for (const HostWarp& w : warps_)
      if (!w.idle()) return false;
    return true;
  }

 private:
  std::vector<unsigned char> smem_;
  std::deque<HostWarp> warps_;
};

}  // namespace flashattn::cuda::emulation
