// Non-owning tensor views (data pointer, dtype, shape, strides in elements) and a
// small owning Tensor for callers who want the library to allocate.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "flashattn/error.hpp"

namespace flashattn {

// Floating dtypes hold attention operands; i32 (sequence offsets) and u8 (boolean masks)
// hold the integer side inputs of some options.
enum class DType : std::uint8_t { f32, bf16, f16, i32, u8 };
inline bool is_floating(DType dtype) { return dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16; }

std::string to_string(DType dtype);
// Parses "f32" / "float32", "bf16" / "bfloat16", "f16" / "float16" (the floating dtypes);
// throws Error otherwise.
DType parse_dtype(const std::string& name);
// Bytes of one element. Inline: the kernels compute row addresses with it per row.
constexpr std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32:
    case DType::i32: return 4;
    case DType::bf16:
    case DType::f16: return 2;
    case DType::u8: return 1;
  }
  return 1;
}
// Unit roundoff of a floating dtype, half the distance from 1 to the next value: 2^-24
// (f32, 23 stored mantissa bits), 2^-8 (bf16, 7), 2^-11 (f16, 10). Throws Error for the
// integer dtypes.
double unit_roundoff(DType dtype);

// Scalar conversions with round-to-nearest-even (NaN stays NaN).
float bf16_to_float(std::uint16_t bits);
std::uint16_t float_to_bf16(float value);
float f16_to_float(std::uint16_t bits);
std::uint16_t float_to_f16(float value);
// Rounds a float to the nearest value representable in `dtype` (identity for f32).
float round_to(DType dtype, float value);

// Where a view's data lives: host memory, or the memory of the current CUDA device. The
// attention entry points run on the device of their tensors; all must agree.
enum class Device : std::uint8_t { cpu, cuda };
std::string to_string(Device device);

// Attention tensors have rank 4; split-KV partial outputs (splits, batch, seqlen, heads,
// dim) have rank 5.
// The blocks of `size` (≥ 1) that cover n ≥ 0 elements, for any size up to INT64_MAX (where
// (n + size − 1) / size overflows: a block size from a caller is any int64).
constexpr std::int64_t blocks_of(std::int64_t n, std::int64_t size) { return n / size + (n % size != 0 ? 1 : 0); }

inline constexpr int kMaxRank = 5;

// A strided view of up to kMaxRank dimensions. Shapes and strides are in elements.
// `Ptr` is `const void*` for inputs and `void*` for outputs.
template <class Ptr>
struct BasicTensorView {
  Ptr data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> strides{};
  Device device = Device::cpu;

  BasicTensorView() = default;
  // Row-major contiguous view.
  BasicTensorView(Ptr data_, DType dtype_, std::initializer_list<std::int64_t> shape_)
      : data(data_), dtype(dtype_), rank(static_cast<int>(shape_.size())) {
    if (rank > kMaxRank)
      throw Error("tensor view: rank " + std::to_string(rank) + " exceeds " + std::to_string(kMaxRank));
    int i = 0;
    for (std::int64_t s : shape_) shape[i++] = s;
    std::int64_t stride = 1;
    for (int d = rank - 1; d >= 0; --d) {
      strides[d] = stride;
      stride *= shape[d];
    }
  }
  BasicTensorView(Ptr data_, DType dtype_, std::initializer_list<std::int64_t> shape_,
                  std::initializer_list<std::int64_t> strides_)
      : BasicTensorView(data_, dtype_, shape_) {
    if (strides_.size() != shape_.size())
      throw Error("tensor view: " + std::to_string(strides_.size()) + " strides for " +
                  std::to_string(shape_.size()) + " dimensions");
    int i = 0;
    for (std::int64_t s : strides_) strides[i++] = s;
  }
  // Mutable views convert to read-only ones.
  template <class Other>
    requires(!std::is_same_v<Other, Ptr> && std::is_convertible_v<Other, Ptr>)
  BasicTensorView(const BasicTensorView<Other>& other)  // NOLINT(google-explicit-constructor)
      : data(other.data), dtype(other.dtype), rank(other.rank), shape(other.shape),
        strides(other.strides), device(other.device) {}

  // The same view, its data on `where`.
  BasicTensorView on(Device where) const {
    BasicTensorView view = *this;
    view.device = where;
    return view;
  }

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= shape[d];
    return n;
  }
};

using TensorView = BasicTensorView<const void*>;
using MutableTensorView = BasicTensorView<void*>;

// An owning, contiguous, row-major tensor.
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, std::vector<std::int64_t> shape);

  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t numel() const;
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }
  template <class T>
  T* data_as() { return reinterpret_cast<T*>(storage_.data()); }
  template <class T>
  const T* data_as() const { return reinterpret_cast<const T*>(storage_.data()); }

  MutableTensorView view();
  TensorView view() const;

  // Element access through float (converting from/to the storage dtype).
  float get(std::int64_t flat_index) const;
  void set(std::int64_t flat_index, float value);

 private:
  DType dtype_ = DType::f32;
  std::vector<std::int64_t> shape_;
  std::vector<unsigned char> storage_;
};

}  // namespace flashattn
