// Why: conversions must round exactly as CUDA does (round to nearest even,
// NaN canonicalised to 0x7fff / 0x7fffffff), so that a step computed on the
// CPU (ZeRO-Offload) and on the GPU produce bit-identical parameters. The host
// versions are branch-free integer/float code: the same expressions compile to
// SIMD inside the host kernels (see zero/simd/pack.hpp) and are the reference
// that the exhaustive tests hold the vectorised batch converters to.
#pragma once

#include "zero/compiler.hpp"

#include <cstdint>

#include "zero/precision/types.hpp"

#if ZERO_COMPILING_WITH_NVCC
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace zero {
namespace detail {

// The conversion algorithms are written once, as templates over the integer
// and float types, so that the same text serves a scalar (U = uint32_t,
// F = float) and a GCC vector of lanes inside the host SIMD kernels. They use
// only shifts, masks, one exact float add and selects: no branches, so loops
// and packs over them vectorise, and every step is exact.
//
// No function here takes or returns a vector by value: each writes its result
// through a reference, and bits are reinterpreted with __builtin_bit_cast (an
// expression, not a function). A function returning a 256/512-bit vector has
// a different ABI with and without AVX, and g++ says so (-Wpsabi) in every
// translation unit that instantiates one, whatever pragma surrounds it.

// fp32 -> fp16 bits (in the low 16 bits of U), round to nearest even.
template <class U, class F>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void float_to_half_bits_generic(U& r, const F& f) {
  const U zero{};
  const U u = __builtin_bit_cast(U, f);
  const U sign = (u >> 16) & 0x8000u;
  const U a = u & 0x7fffffffu;
  // Normal fp16 range: rebias the exponent (127 -> 15) and round the 13
  // dropped mantissa bits to nearest even by adding 0xfff plus the kept LSB.
  const U normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // Subnormal fp16 range (|f| < 2^-14): adding 0.5f aligns the value so that the
  // FPU's own round-to-nearest-even drops exactly the bits fp16 cannot hold.
  // (Correct under flush-to-zero too: a float subnormal rounds to fp16 zero.)
  // It follows the thread's rounding mode, as the optimizer arithmetic does; an
  // integer-only version matches CUDA under FE_UPWARD etc. as well but halves
  // the speed of SIMD fp16 stores, and nothing here changes the rounding mode.
  const F aligned = __builtin_bit_cast(F, a) + 0.5f;
  const U sub = __builtin_bit_cast(U, aligned) - 0x3f000000u;
  r = a < 0x38800000u ? sub : normal;
  r = a >= 0x477ff000u ? zero + 0x7c00u : r;  // rounds past 65504: infinity
  r = r | sign;
  r = a > 0x7f800000u ? zero + 0x7fffu : r;   // any NaN: CUDA's canonical 0x7fff
}

// fp16 bits (low 16 bits of U) -> fp32, exact; NaN becomes 0x7fffffff as in CUDA.
template <class U, class F>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void half_bits_to_float_generic(F& out, const U& h) {
  const U zero{};
  const U sign = (h & 0x8000u) << 16;
  const U a = h & 0x7fffu;
  const U normal = (a << 13) + 0x38000000u;  // rebias 15 -> 127
  // Subnormal: (1 + m/1024) * 2^-14 - 2^-14 = m * 2^-24, both steps exact.
  const F scaled = __builtin_bit_cast(F, (a << 13) | 0x38800000u) - 6.103515625e-05f;
  const U sub = __builtin_bit_cast(U, scaled);
  U r = a < 0x0400u ? sub : normal;
  r = a >= 0x7c00u ? zero + 0x7f800000u : r;
  r = r | sign;
  r = a > 0x7c00u ? zero + 0x7fffffffu : r;
  out = __builtin_bit_cast(F, r);
}

// fp32 -> bf16 bits (low 16 bits of U), round to nearest even; NaN -> 0x7fff.
template <class U, class F>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void float_to_bf16_bits_generic(U& r, const F& f) {
  const U zero{};
  const U u = __builtin_bit_cast(U, f);
  const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  r = (u & 0x7fffffffu) > 0x7f800000u ? zero + 0x7fffu : rounded;
}

template <class U, class F>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void bf16_bits_to_float_generic(F& out, const U& b) {
  out = __builtin_bit_cast(F, b << 16);
}

ZERO_HOST_DEVICE ZERO_FORCE_INLINE std::uint16_t float_to_half_bits(float f) {
  std::uint32_t r;
  float_to_half_bits_generic(r, f);
  return static_cast<std::uint16_t>(r);
}
ZERO_HOST_DEVICE ZERO_FORCE_INLINE float half_bits_to_float(std::uint16_t h) {
  float f;
  half_bits_to_float_generic(f, std::uint32_t{h});
  return f;
}
ZERO_HOST_DEVICE ZERO_FORCE_INLINE std::uint16_t float_to_bf16_bits(float f) {
  std::uint32_t r;
  float_to_bf16_bits_generic(r, f);
  return static_cast<std::uint16_t>(r);
}
ZERO_HOST_DEVICE ZERO_FORCE_INLINE float bf16_bits_to_float(std::uint16_t b) {
  float f;
  bf16_bits_to_float_generic(f, std::uint32_t{b});
  return f;
}

}  // namespace detail

// The conversions every other part of the library uses: to_float(x) and
// from_float<T>(f) for T in {float, fp16, bf16}. On the device they are the
// hardware instructions, which round the same way.
ZERO_HOST_DEVICE ZERO_FORCE_INLINE float to_float(float x) { return x; }

ZERO_HOST_DEVICE ZERO_FORCE_INLINE float to_float(fp16 x) {
#if ZERO_DEVICE_PASS
  return __half2float(__ushort_as_half(x.bits));
#else
  return detail::half_bits_to_float(x.bits);
#endif
}

ZERO_HOST_DEVICE ZERO_FORCE_INLINE float to_float(bf16 x) { return detail::bf16_bits_to_float(x.bits); }

template <class T>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE T from_float(float f);

template <>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE float from_float<float>(float f) {
  return f;
}

template <>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE fp16 from_float<fp16>(float f) {
#if ZERO_DEVICE_PASS
  return fp16{__half_as_ushort(__float2half_rn(f))};
#else
  return fp16{detail::float_to_half_bits(f)};
#endif
}

template <>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE bf16 from_float<bf16>(float f) {
#if ZERO_DEVICE_PASS
  return bf16{__bfloat16_as_ushort(__float2bfloat16_rn(f))};
#else
  return bf16{detail::float_to_bf16_bits(f)};
#endif
}

}  // namespace zero
