// Why: an optimizer update written once must give bit-identical results on
// the CPU (ZeRO-Offload) and the GPU. Compilers may fuse a*b+c into one FMA
// (nvcc by default, g++ in GNU mode), which changes the last bit. Library
// update rules therefore spell out each rounding: mul() is never fused,
// fma() always is. The same names are overloaded for the host SIMD packs
// (zero/simd/pack.hpp), so one update rule serves scalars, packs and CUDA.
#pragma once

#include "zero/compiler.hpp"

#include <cmath>

namespace zero::math {

// A product that no compiler may contract into a following add.
ZERO_HOST_DEVICE ZERO_FORCE_INLINE float mul(float a, float b) {
#if ZERO_DEVICE_PASS
  return __fmul_rn(a, b);
#elif !ZERO_COMPILING_WITH_NVCC && defined(__has_builtin)
#if __has_builtin(__builtin_assoc_barrier)
  return __builtin_assoc_barrier(a * b);
#else
  return a * b;
#endif
#else
  return a * b;
#endif
}

// a*b + c with a single rounding.
ZERO_HOST_DEVICE ZERO_FORCE_INLINE float fma(float a, float b, float c) {
#if ZERO_DEVICE_PASS
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

ZERO_HOST_DEVICE ZERO_FORCE_INLINE float div(float a, float b) {
#if ZERO_DEVICE_PASS
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Correctly rounded square root (IEEE), as the hardware gives on both sides.
ZERO_HOST_DEVICE ZERO_FORCE_INLINE float sqrt(float x) {
#if ZERO_DEVICE_PASS
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

ZERO_HOST_DEVICE ZERO_FORCE_INLINE float abs(float x) { return std::fabs(x); }
ZERO_HOST_DEVICE ZERO_FORCE_INLINE float min(float a, float b) { return a < b ? a : b; }
ZERO_HOST_DEVICE ZERO_FORCE_INLINE float max(float a, float b) { return a > b ? a : b; }
// -1, 0 or +1 (0 for NaN), as torch.sign.
ZERO_HOST_DEVICE ZERO_FORCE_INLINE float sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

}  // namespace zero::math
