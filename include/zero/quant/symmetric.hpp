// Why: ZeRO++ sends stage 3's parameters (qwZ) and gradients (qgZ) across
// nodes as block-quantized integers: each block of `block` elements travels
// as one fp32 scale and one small integer per element, half the bytes of
// 16-bit values for int8, a quarter for int4. This header is that
// quantizer, written once per element for the host loops
// (kernels/host_quantize.hpp) and the CUDA kernels (kernels/cuda_quantize.cuh),
// so both give the same bits.
//
// The code: symmetric, one scale per block. With L levels (127 for int8, 7
// for int4) and the block's largest magnitude A, the scale is s = A / L and
// element x is sent as q = round_half_even(x * (L / A)), read back as q * s.
// |q * s - x| <= s / 2 up to the rounding of L / A and of the products (a
// few parts in 2^24 of s), so a value moves by at most half a step of its
// block; a block of zeros has scale 0 and codes 0. Every operation is one
// IEEE fp32 operation (divisions for L / A and A / L, products, the
// rounding's two additions; zero/math.hpp keeps the products uncontracted),
// which the host and a GPU round alike, and none is a library call, so the
// host loops vectorise on any x86-64.
//
// The payload of n elements (Format::payload_bytes): the codes (int8: one
// byte each; int4: two to a byte, the even element in the low nibble),
// padded to a multiple of 4 bytes, then one fp32 scale per block. Blocks
// count from the payload's first element; the last one may be partial.
//
// qgZ's error feedback: quantizing y = x + e with a residual e kept per
// element, and keeping e = y - q * s for the next time, so that what one
// quantization drops the next one sends (the sum over calls of what was
// sent differs from the sum of the inputs by one residual, not by the sum
// of every call's error).
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>

#include "zero/math.hpp"
#include "zero/precision/convert.hpp"
#include "zero/precision/types.hpp"

namespace zero::quant {

ZERO_HOST_DEVICE constexpr std::size_t symmetric_blocks(std::size_t n, std::size_t block) {
  return (n + block - 1) / block;
}

// How a payload is coded: `bits` 8 or 4, one fp32 scale per `block`
// elements (int4 blocks are even, so that each starts on a byte).
struct Format {
  int bits = 8;
  std::size_t block = 256;

  // The largest code.
  ZERO_HOST_DEVICE constexpr int levels() const { return bits == 4 ? 7 : 127; }
  ZERO_HOST_DEVICE constexpr std::size_t blocks(std::size_t n) const { return symmetric_blocks(n, block); }
  // Block b of n elements is [b * block, block_end(b, n)): the last may be short.
  ZERO_HOST_DEVICE constexpr std::size_t block_end(std::size_t b, std::size_t n) const {
    return (b + 1) * block < n ? (b + 1) * block : n;
  }
  // Bytes of the codes (padded so the scales after them are 4-byte aligned).
  ZERO_HOST_DEVICE constexpr std::size_t code_bytes(std::size_t n) const {
    return ((bits == 4 ? (n + 1) / 2 : n) + 3) / 4 * 4;
  }
  // Bytes of the payload of n elements: codes, then one fp32 scale per block.
  ZERO_HOST_DEVICE constexpr std::size_t payload_bytes(std::size_t n) const { return code_bytes(n) + 4 * blocks(n); }
  // The problem with this format, or nullptr: the callers say whose format it is.
  constexpr const char* problem() const {
    if (bits != 8 && bits != 4) return "the bits must be 8 (int8 codes) or 4 (int4 codes)";
    if (block == 0) return "the block must hold at least one element";
    if (bits == 4 && block % 2 != 0) return "an int4 block holds an even number of elements (two codes to a byte)";
    return nullptr;
  }
};

// `count` pieces of `elements` values each, piece k's values at k * stride
// elements from the first piece's and its payload at k * payload_stride
// bytes from the first payload: the strided runs qgZ's exchanges are made
// of, without copying them into place first. One piece: {1, n, n, bytes}.
struct Pieces {
  std::size_t count = 1;
  std::size_t elements = 0;
  std::size_t stride = 0;          // elements between pieces' values
  std::size_t payload_stride = 0;  // bytes between pieces' payloads

  static Pieces one(std::size_t n, const Format& f) { return {1, n, n, f.payload_bytes(n)}; }
};

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

// int4 codes, two to a byte: the even element's in the low nibble.
ZERO_HOST_DEVICE inline std::uint8_t pack_int4(std::int8_t even, std::int8_t odd) {
  return static_cast<std::uint8_t>((static_cast<unsigned>(even) & 0xFu) | ((static_cast<unsigned>(odd) & 0xFu) << 4));
}
// Element i's code, of either width (sign-extended from its nibble for int4).
ZERO_HOST_DEVICE inline std::int8_t code_at(const std::uint8_t* codes, std::size_t i, int bits) {
  if (bits == 8) return static_cast<std::int8_t>(codes[i]);
  const std::uint8_t b = codes[i / 2];
  const std::uint8_t nibble = (i & 1) != 0 ? static_cast<std::uint8_t>(b >> 4) : static_cast<std::uint8_t>(b & 0xFu);
  return static_cast<std::int8_t>(static_cast<std::int8_t>(nibble << 4) >> 4);
}

// One payload's parts in its bytes (Format::payload_bytes(n)).
struct PayloadView {
  std::uint8_t* codes;
  float* scales;
  ZERO_HOST_DEVICE static PayloadView at(void* bytes, std::size_t n, const Format& f) {
    auto* p = static_cast<std::uint8_t*>(bytes);
    return {p, reinterpret_cast<float*>(p + f.code_bytes(n))};
  }
};
struct ConstPayloadView {
  const std::uint8_t* codes;
  const float* scales;
  ZERO_HOST_DEVICE static ConstPayloadView at(const void* bytes, std::size_t n, const Format& f) {
    const auto* p = static_cast<const std::uint8_t*>(bytes);
    return {p, reinterpret_cast<const float*>(p + f.code_bytes(n))};
  }
};

// The value quantized: x, plus the residual where error feedback keeps one.
template <class T>
ZERO_HOST_DEVICE inline float fed(const T* x, const float* residual, std::size_t i) {
  return residual != nullptr ? to_float(x[i]) + residual[i] : to_float(x[i]);
}

// The work of every quantizer loop for one code: element i's int8 code
// (and its residual), or the int4 byte of elements i and i + 1 (i even; the
// odd one only where i + 1 < end, a missing one coded 0).
template <class T>
ZERO_HOST_DEVICE inline void quantize_int8_at(const T* x, float* residual, std::size_t i, float inverse, float scale,
                                              std::uint8_t* codes) {
  const float y = fed(x, residual, i);
  const std::int8_t q = symmetric_code(y, inverse);
  codes[i] = static_cast<std::uint8_t>(q);
  if (residual != nullptr) residual[i] = y - symmetric_value(q, scale);
}
template <class T>
ZERO_HOST_DEVICE inline void quantize_int4_at(const T* x, float* residual, std::size_t i, std::size_t end,
                                              float inverse, float scale, std::uint8_t* codes) {
  const bool pair = i + 1 < end;
  const float y0 = fed(x, residual, i), y1 = pair ? fed(x, residual, i + 1) : 0.0f;
  const std::int8_t q0 = symmetric_code(y0, inverse), q1 = symmetric_code(y1, inverse);
  codes[i / 2] = pack_int4(q0, q1);
  if (residual != nullptr) {
    residual[i] = y0 - symmetric_value(q0, scale);
    if (pair) residual[i + 1] = y1 - symmetric_value(q1, scale);
  }
}

// The host loops over payloads (quant::host_quantize, host_dequantize,
// host_dequantize_sum) are in zero/kernels/host_quantize.hpp, compiled per
// instruction set.

}  // namespace zero::quant
