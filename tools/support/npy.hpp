// Minimal NumPy .npy reader/writer for the CLI and the tests: little-endian float32 / float16
// arrays (and int32 offsets, bool/uint8 masks) in C order, rank 0..5 (kMaxRank). Everything
// else is rejected with a flashattn::Error that names the file and the problem.
#pragma once

#include <string>

#include "flashattn/error.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::support {

// Reads a .npy file (format 1.0, 2.0 or 3.0) holding '<f4' or '<f2' data in C order.
// Returns a contiguous Tensor of dtype f32 or f16 with the file's shape.
flashattn::Tensor read_npy(const std::string& path);

// Writes an f32 or f16 tensor as .npy format 1.0, data aligned to 64 bytes as numpy does.
// bf16 has no numpy equivalent and throws; convert to f32 first.
void write_npy(const std::string& path, const flashattn::Tensor& tensor);

}  // namespace flashattn::support
