// Why: ZeRO++ sends stage 3's parameters (qwZ) and gradients (qgZ) across
// nodes as block-quantized integers: each block of `block` elements travels
// as one fp32 scale and one small integer per element, half the bytes of
// 16-bit values for int8. This header is that quantizer, written once per
// element for the host loops here and the CUDA kernels
// (kernels/cuda_quantize.cuh), so both give the same bits.
//
// The code: symmetric, one scale per block. With L = 127 (int8) and the
// block's largest magnitude A, the scale is s = A / L and element x is sent
// as q = round_half_even(clamp(x * (L / A), -L, L)), read back as q * s.
// |q * s - x| <= s / 2 up to the rounding of L / A and of the products (a
// few parts in 2^24 of s), so a parameter moves by at most half a step of
// its block; a block of zeros has scale 0 and codes 0. Every operation is
// one IEEE fp32 operation (divisions for L / A and A / L, products, the
// rounding's two additions; zero/math.hpp keeps the products uncontracted),
// which the host and a GPU round alike, and none is a library call, so the
// host loops vectorise on any x86-64.
//
// The payload of n elements: n int8 codes, padded to a multiple of 4 bytes,
// then ceil(n / block) fp32 scales: payload_bytes(n, block). Blocks count
// from the first element; the last one may be partial.
#pragma once

#include "zero/config.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "zero/math.hpp"
#include "zero/precision/convert.hpp"
#include "zero/precision/types.hpp"

namespace zero::quant {

// int8's largest code (int4 will have 7).
inline constexpr int int8_levels = 127;

ZERO_HOST_DEVICE constexpr std::size_t symmetric_blocks(std::size_t n, std::size_t block) {
  return (n + block - 1) / block;
}
// Bytes of the codes (padded so the scales after them are 4-byte aligned).
ZERO_HOST_DEVICE constexpr std::size_t int8_code_bytes(std::size_t n) { return (n + 3) / 4 * 4; }
// Bytes of the payload of n elements: codes, then one fp32 scale per block.
ZERO_HOST_DEVICE constexpr std::size_t int8_payload_bytes(std::size_t n, std::size_t block) {
  return int8_code_bytes(n) + 4 * symmetric_blocks(n, block);
}

// The factor that maps a block of largest magnitude `absmax` onto the codes
// (0 for a block of zeros, or one that is not finite: its codes are 0).
ZERO_HOST_DEVICE inline float symmetric_inverse(float absmax, int levels) {
  return absmax > 0.0f && absmax <= 3.4028234663852886e38f ? math::div(static_cast<float>(levels), absmax) : 0.0f;
}
ZERO_HOST_DEVICE inline float symmetric_scale(float absmax, int levels) {
  return absmax > 0.0f && absmax <= 3.4028234663852886e38f ? math::div(absmax, static_cast<float>(levels)) : 0.0f;
}
// One product, a mask and two additions, no library call and no branch
// (g++ vectorises neither a float select nor a float maximum, whose NaN
// rules it must keep; their integer forms it does, on any x86-64), and
// nothing may be contracted. |x| <= A in its block, so |x * (L / A)| <=
// L (1 + 2^-22) < L + 1/2: no clamp is needed. Adding and subtracting
// 1.5 x 2^23 rounds it to an integer, half to even. A NaN element (which the
// largest magnitude skips) is code 0.
ZERO_HOST_DEVICE inline std::int8_t symmetric_code(float x, float inverse) {
  const float y = math::mul(x, inverse);
  const std::int32_t bits = __builtin_bit_cast(std::int32_t, y);
  const std::int32_t nan = -static_cast<std::int32_t>((bits & 0x7fffffff) > 0x7f800000);  // all ones for a NaN
  const float kept = __builtin_bit_cast(float, bits & ~nan);
  constexpr float round = 12582912.0f;
  const float r = (kept + round) - round;
  return static_cast<std::int8_t>(static_cast<int>(r));
}
ZERO_HOST_DEVICE inline float symmetric_value(std::int8_t q, float scale) {
  return math::mul(static_cast<float>(q), scale);
}
// The bits of |x| for the largest magnitude of a block, compared as signed
// integers (their order is the magnitudes' order, and a signed maximum
// vectorises where a float one with NaN rules does not); a NaN is 0 and so
// skipped, an infinity stays (its block's codes are then 0).
ZERO_HOST_DEVICE inline std::int32_t magnitude_bits(float x) {
  const std::int32_t m = __builtin_bit_cast(std::int32_t, x) & 0x7fffffff;
  return m > 0x7f800000 ? 0 : m;
}
ZERO_HOST_DEVICE inline float magnitude_of(std::int32_t bits) { return __builtin_bit_cast(float, bits); }

// Host loops over a payload. quantize: x[0, n) of a storage type into
// codes[0, n) and scales[0, blocks). dequantize: back into out[0, n) as T
// (rounded to nearest even from the fp32 value).
template <class T>
void host_quantize_int8(const T* x, std::size_t n, std::size_t block, std::int8_t* codes, float* scales) {
  for (std::size_t b = 0; b * block < n; ++b) {
    const std::size_t begin = b * block, end = begin + block < n ? begin + block : n;
    std::int32_t largest = 0;
    for (std::size_t i = begin; i < end; ++i) {
      const std::int32_t m = magnitude_bits(to_float(x[i]));
      largest = m > largest ? m : largest;
    }
    const float absmax = magnitude_of(largest);
    const float inverse = symmetric_inverse(absmax, int8_levels);
    for (std::size_t i = begin; i < end; ++i) codes[i] = symmetric_code(to_float(x[i]), inverse);
    scales[b] = symmetric_scale(absmax, int8_levels);
  }
}
template <class T>
void host_dequantize_int8(const std::int8_t* codes, const float* scales, std::size_t n, std::size_t block, T* out) {
  for (std::size_t b = 0; b * block < n; ++b) {
    const std::size_t begin = b * block, end = begin + block < n ? begin + block : n;
    const float scale = scales[b];
    for (std::size_t i = begin; i < end; ++i) out[i] = from_float<T>(symmetric_value(codes[i], scale));
  }
}

// The payload layout in one byte buffer (int8_payload_bytes(n, block)).
struct Int8Payload {
  std::int8_t* codes;
  float* scales;
  static Int8Payload at(void* bytes, std::size_t n) {
    auto* p = static_cast<unsigned char*>(bytes);
    return {reinterpret_cast<std::int8_t*>(p), reinterpret_cast<float*>(p + int8_code_bytes(n))};
  }
};

}  // namespace zero::quant
