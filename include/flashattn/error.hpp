// flashattn::Error — the one exception type the library throws for bad input.
#pragma once

#include <stdexcept>
#include <string>

namespace flashattn {

// Thrown for every invalid argument. The message names the argument and the
// offending values, e.g. "k: head_dim 96 does not match q head_dim 128".
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace flashattn
