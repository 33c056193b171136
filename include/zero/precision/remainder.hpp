// Why: an fp32 master kept as the bf16 parameter the engine holds anyway
// plus a 16-bit remainder costs 2 bytes per parameter instead of 4, and is
// exact if the bf16 copy is the fp32 value's upper half rounded so that the
// lower half always fits in 16 bits. Round to nearest even cannot be that
// rounding: an even bf16 value b is the nearest-even rounding of 65,537
// fp32 bit patterns (the ties on both sides round to it), one more than 16
// bits can tell apart. Rounding half away from zero (on the magnitude bits:
// add 0x8000, keep the upper half) gives every bf16 value exactly 65,536
// preimages, and the remainder is then simply the fp32 value's lower half,
// read as a signed offset from the rounded copy:
//
//   copy      = (bits + 0x8000) >> 16
//   remainder = bits & 0xffff
//   bits      = ((copy - (remainder >> 15)) << 16) | remainder
//
// (Apex's and Transformer Engine's `store_param_remainders` make the same
// choice.) The copy differs from nearest-even only on exact ties, one fp32
// value in 2^16; a run that wants its fp32 master compared bit for bit
// with a remainder run rounds its copies the same way
// (Options::round_ties_away). NaN: the copy is CUDA's canonical 0x7fff and
// the remainder 0, so the master reads back as a NaN (not the same NaN);
// infinities and every finite value come back bit for bit.
//
// Written once, as templates over the integer type, for scalars (U =
// uint32_t), GCC vectors of lanes (the host SIMD step) and CUDA threads.
#pragma once

#include "zero/compiler.hpp"

#include <cstdint>
#include <type_traits>

#include "zero/precision/convert.hpp"
#include "zero/precision/types.hpp"

namespace zero {
namespace detail {

// fp32 bits -> bf16 bits (low 16 bits of U), round to nearest, ties away
// from zero; NaN -> 0x7fff as the nearest-even conversion.
template <class U>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void bits_to_bf16_ties_away_generic(U& copy, const U& u) {
  const U zero{};
  copy = ((u + 0x8000u) >> 16) & 0xffffu;
  copy = (u & 0x7fffffffu) > 0x7f800000u ? zero + 0x7fffu : copy;
}

// An fp32 value's bits into the bf16 copy and the 16-bit remainder (each
// in the low 16 bits of its U).
template <class U>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void split_master_bits_generic(U& copy, U& remainder, const U& u) {
  const U zero{};
  bits_to_bf16_ties_away_generic(copy, u);
  remainder = (u & 0x7fffffffu) > 0x7f800000u ? zero : (u & 0xffffu);
}

// The fp32 value's bits from the copy and the remainder (low 16 bits each).
template <class U>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void join_master_bits_generic(U& u, const U& copy, const U& remainder) {
  u = ((copy - (remainder >> 15)) << 16) | remainder;
}

}  // namespace detail

// Scalar forms: the reference the SIMD and CUDA paths are tested against,
// and what the stores' imports and exports use.
ZERO_HOST_DEVICE ZERO_FORCE_INLINE bf16 bf16_ties_away(float f) {
  std::uint32_t copy;
  detail::bits_to_bf16_ties_away_generic(copy, __builtin_bit_cast(std::uint32_t, f));
  return bf16{static_cast<std::uint16_t>(copy)};
}

// A 16-bit (or fp32) copy of f rounded to nearest: ties to even, or (bf16,
// `ties_away`: a remainder master's rounding) away from zero. The one rule
// the fused step and the engine's host-side writes of copies share.
template <class T>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE T nearest_copy(float f, bool ties_away) {
  if constexpr (std::is_same_v<T, bf16>)
    if (ties_away) return bf16_ties_away(f);
  return from_float<T>(f);
}

ZERO_HOST_DEVICE ZERO_FORCE_INLINE void split_master(float master, bf16& copy, std::uint16_t& remainder) {
  std::uint32_t c, r;
  detail::split_master_bits_generic(c, r, __builtin_bit_cast(std::uint32_t, master));
  copy = bf16{static_cast<std::uint16_t>(c)};
  remainder = static_cast<std::uint16_t>(r);
}

ZERO_HOST_DEVICE ZERO_FORCE_INLINE float join_master(bf16 copy, std::uint16_t remainder) {
  std::uint32_t u;
  detail::join_master_bits_generic(u, std::uint32_t{copy.bits}, std::uint32_t{remainder});
  return __builtin_bit_cast(float, u);
}

}  // namespace zero
