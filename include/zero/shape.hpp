// Why: a parameter's shape travels from add_param through the checkpoint
// manifest to the Hugging Face export and back through import, and every
// message about a mismatch prints it the same way.
#pragma once

#include "zero/compiler.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace zero {

// A tensor's dimensions, outermost first (e.g. {out, in} for a linear
// layer's weight). Empty where none was given: the tensor is flat.
using Shape = std::vector<std::uint64_t>;

// "[256, 784]"
inline std::string shape_text(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace zero
