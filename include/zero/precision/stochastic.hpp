// Why: bf16 keeps 8 bits of mantissa, so tiny updates to a bf16 weight are
// rounded away every step. Stochastic rounding makes the rounding error zero
// in expectation. The random bits come from a counter-based hash of
// (seed, step, element index), so the result does not depend on thread
// count, shard boundaries or device: host and CUDA kernels agree bit for bit.
#pragma once

#include "zero/compiler.hpp"

#include <cstdint>

#include "zero/precision/convert.hpp"
#include "zero/precision/types.hpp"

namespace zero {

struct StochasticRounding {
  bool enabled = false;
  std::uint64_t seed = 0;
  std::uint64_t step = 0;
};

namespace detail {

// SplitMix64 finaliser: a bijective 64-bit mix with good avalanche, cheap on
// both CPUs and GPUs.
ZERO_HOST_DEVICE ZERO_FORCE_INLINE std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

ZERO_HOST_DEVICE ZERO_FORCE_INLINE std::uint32_t rounding_bits(const StochasticRounding& r, std::uint64_t index) {
  return static_cast<std::uint32_t>(mix64(mix64(r.seed ^ (r.step * 0xd1b54a32d192ed03ull)) + index) >> 32);
}

}  // namespace detail

// Rounds f to T choosing the upper neighbour with probability equal to the
// distance from the lower one (in units of the last place). NaN and infinity
// convert as with round-to-nearest.
template <class T>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE T stochastic_round(float f, const StochasticRounding& r, std::uint64_t index);

template <>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE bf16 stochastic_round<bf16>(float f, const StochasticRounding& r,
                                                                std::uint64_t index) {
  const std::uint32_t u = __builtin_bit_cast(std::uint32_t, f);
  if ((u & 0x7f800000u) == 0x7f800000u) return from_float<bf16>(f);  // inf, NaN
  // Adding 16 uniform random bits below the kept ones and truncating rounds up
  // with probability (dropped bits) / 2^16.
  const std::uint32_t noisy = u + (detail::rounding_bits(r, index) >> 16);
  return bf16{static_cast<std::uint16_t>(noisy >> 16)};
}

template <>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE fp16 stochastic_round<fp16>(float f, const StochasticRounding&, std::uint64_t) {
  // fp16 keeps 10 mantissa bits; nearest-even is what mixed fp16 training uses.
  return from_float<fp16>(f);
}

template <>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE float stochastic_round<float>(float f, const StochasticRounding&, std::uint64_t) {
  return f;
}

}  // namespace zero
