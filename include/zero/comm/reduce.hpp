// Why: the in-process and MPI communicators reduce 16-bit floats themselves
// (MPI has no bf16/fp16 sum). Summing in fp32 in a fixed rank order and
// rounding once makes the result independent of thread timing, so tests are
// reproducible bit for bit.
#pragma once

#include "zero/config.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "zero/comm/communicator.hpp"
#include "zero/error.hpp"
#include "zero/precision/convert.hpp"

namespace zero::comm::detail {

template <class T>
inline T combine(T a, T b, ReduceOp op) {
  return op == ReduceOp::sum ? a + b : (a > b ? a : b);
}

// out[i] = op over k of inputs[k][i], for i in [begin, end). `out` may alias
// inputs[j] for any j (each element is read from all inputs before it is written).
template <class T>
void reduce_typed(void* out, const void* const* inputs, int n_inputs, std::size_t begin, std::size_t end, ReduceOp op) {
  using Acc = std::conditional_t<std::is_same_v<T, fp16> || std::is_same_v<T, bf16>, float, T>;
  T* o = static_cast<T*>(out);
  for (std::size_t i = begin; i < end; ++i) {
    Acc acc;
    if constexpr (std::is_same_v<Acc, float> && !std::is_same_v<T, float>)
      acc = to_float(static_cast<const T*>(inputs[0])[i]);
    else
      acc = static_cast<const T*>(inputs[0])[i];
    for (int k = 1; k < n_inputs; ++k) {
      Acc x;
      if constexpr (std::is_same_v<Acc, float> && !std::is_same_v<T, float>)
        x = to_float(static_cast<const T*>(inputs[k])[i]);
      else
        x = static_cast<const T*>(inputs[k])[i];
      acc = combine(acc, x, op);
    }
    if constexpr (std::is_same_v<Acc, float> && !std::is_same_v<T, float>)
      o[i] = from_float<T>(acc);
    else
      o[i] = acc;
  }
}

inline void reduce(DType t, void* out, const void* const* inputs, int n_inputs, std::size_t begin, std::size_t end,
                   ReduceOp op) {
  switch (t) {
    case DType::f32: return reduce_typed<float>(out, inputs, n_inputs, begin, end, op);
    case DType::f16: return reduce_typed<fp16>(out, inputs, n_inputs, begin, end, op);
    case DType::bf16: return reduce_typed<bf16>(out, inputs, n_inputs, begin, end, op);
    case DType::f64: return reduce_typed<double>(out, inputs, n_inputs, begin, end, op);
    case DType::u64: return reduce_typed<std::uint64_t>(out, inputs, n_inputs, begin, end, op);
  }
}

}  // namespace zero::comm::detail
