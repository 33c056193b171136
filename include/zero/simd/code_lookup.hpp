// Why: the 8-bit state step (kernels/host_step.hpp) reads each state code
// back through its 256-entry table and writes it as the index of the nearest
// code. With gathers that was six per 16 values for Adam, about 24 cycles
// each on a Zen 4: most of the step (bench/results/2026-12-03-8bit-states.md).
// Here a block's codes are decoded and encoded a slot at a time, so that on
// AVX-512 the tables live in registers for the whole loop: decoding is eight
// two-register permutes and a blend tree per 16 codes (any table; with VBMI,
// byte permutes of the table's four byte planes, 64 codes at a time),
// encoding is the arithmetic of quant::CodeSegments (tables with the dynamic
// code's structure; the rare value near a cell edge goes to the exact lookup). AVX2
// keeps the gathers (eight lanes; its table would not fit its 16 registers).
// Each function gives quant::dequantize's and quant::quantize's values bit
// for bit, on every instruction set.
#pragma once

#include "zero/compiler.hpp"

#if ZERO_HOST_SIMD_X86

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "zero/math.hpp"
#include "zero/quant/code_segments.hpp"
#include "zero/quant/dynamic_code.hpp"
#include "zero/simd/pack.hpp"

namespace zero::simd {

namespace detail {

#define ZERO_AVX512_CODES __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))

// Every lane. The intrinsics are called in their zero-masked forms with it:
// the plain forms' undefined sources trip g++ 12's -Wmaybe-uninitialized.
inline constexpr __mmask16 all = 0xffff;

// out[i] = code[q[i]] * scale, i < n: the table in sixteen registers.
ZERO_AVX512_CODES inline void decode_codes_avx512(const std::uint8_t* q, std::size_t n, const float* code, float scale,
                                                  float* out) {
  __m512 t[16];
  for (int r = 0; r < 16; ++r) t[r] = _mm512_loadu_ps(code + 16 * r);
  const __m512 s = _mm512_set1_ps(scale);
  const __m512i bit5 = _mm512_set1_epi32(32), bit6 = _mm512_set1_epi32(64), bit7 = _mm512_set1_epi32(128);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    Avx512::U codes;
    Avx512::widen_u8(codes, q + i);
    const __m512i idx = (__m512i)codes;
    // Entries 32p .. 32p + 31 by the index's low 5 bits, then bits 5, 6, 7 choose.
    const __mmask16 b5 = _mm512_test_epi32_mask(idx, bit5), b6 = _mm512_test_epi32_mask(idx, bit6),
                    b7 = _mm512_test_epi32_mask(idx, bit7);
    const __m512 r0 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t[0], idx, t[1]),
                                           _mm512_permutex2var_ps(t[2], idx, t[3]));
    const __m512 r1 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t[4], idx, t[5]),
                                           _mm512_permutex2var_ps(t[6], idx, t[7]));
    const __m512 r2 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t[8], idx, t[9]),
                                           _mm512_permutex2var_ps(t[10], idx, t[11]));
    const __m512 r3 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t[12], idx, t[13]),
                                           _mm512_permutex2var_ps(t[14], idx, t[15]));
    const __m512 v = _mm512_mask_blend_ps(b7, _mm512_mask_blend_ps(b6, r0, r1), _mm512_mask_blend_ps(b6, r2, r3));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(v, s));  // one rounding, as math::mul (stored: nothing to fuse with)
  }
  for (; i < n; ++i) out[i] = zero::math::mul(code[q[i]], scale);
}

#define ZERO_AVX512_VBMI_CODES __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")))

// Whether the CPU has AVX512_VBMI's byte permutes (Ice Lake, Zen 4 and
// later; Skylake-X has AVX-512 without them).
inline bool has_avx512_vbmi() {
  static const bool yes = __builtin_cpu_supports("avx512vbmi");
  return yes;
}

// The byte indices decode_codes_vbmi permutes by, computed at compile time.
struct VbmiDecodeIndices {
  // pick[p][j]: byte p of float j of two registers (4j + p), mod 128 for
  // j >= 32, where the same index picks from the next two.
  alignas(64) std::uint8_t pick[4][64];
  // The unpacks interleave within 128-bit lanes, so float k of output
  // register f (lane L = k / 4) comes from byte 16 L + 4 f + k % 4 of the
  // looked-up planes: the codes are permuted first so that it is code 16 f + k.
  alignas(64) std::uint8_t order[64];
};
inline constexpr VbmiDecodeIndices vbmi_decode_indices = [] {
  VbmiDecodeIndices x{};
  for (int p = 0; p < 4; ++p)
    for (int j = 0; j < 64; ++j) x.pick[p][j] = static_cast<std::uint8_t>((4 * j + p) & 127);
  for (int lane = 0; lane < 4; ++lane)
    for (int f = 0; f < 4; ++f)
      for (int b = 0; b < 4; ++b) x.order[16 * lane + 4 * f + b] = static_cast<std::uint8_t>(16 * f + 4 * lane + b);
  return x;
}();

// decode_codes_avx512's values, 64 codes at a time with byte permutes: the
// table as four byte planes (plane p holds byte p of every entry: four
// registers of 64 bytes), each looked up by two two-register byte permutes
// (seven index bits) and a blend by the eighth, then the four bytes
// interleaved back into floats. About a third of the instructions of sixteen
// codes at a time through float permutes.
ZERO_AVX512_VBMI_CODES inline void decode_codes_vbmi(const std::uint8_t* q, std::size_t n, const float* code,
                                                     float scale, float* out) {
  // Planes from the table: byte p of entries 64r + j, the lower 32 from two
  // registers of floats and the upper 32 from the next two, blended.
  __m512i plane[4][4];
  {
    __m512i t[16];
    for (int r = 0; r < 16; ++r) t[r] = _mm512_loadu_si512(code + 16 * r);
    constexpr __mmask64 upper = 0xffffffff00000000ull;
    for (int p = 0; p < 4; ++p) {
      const __m512i idx = _mm512_load_si512(vbmi_decode_indices.pick[p]);
      for (int r = 0; r < 4; ++r)
        plane[p][r] = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(t[4 * r], idx, t[4 * r + 1]),
                                             _mm512_permutex2var_epi8(t[4 * r + 2], idx, t[4 * r + 3]));
    }
  }
  const __m512i shuffle = _mm512_load_si512(vbmi_decode_indices.order);
  const __m512 s = _mm512_set1_ps(scale);
  for (std::size_t i = 0; i < n; i += 64) {
    const std::size_t left = n - i;
    const __mmask64 in = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
    const __m512i idx = _mm512_maskz_permutexvar_epi8(~__mmask64{0}, shuffle, _mm512_maskz_loadu_epi8(in, q + i));
    const __mmask64 high = _mm512_movepi8_mask(idx);
    __m512i bytes[4];
    for (int p = 0; p < 4; ++p)
      bytes[p] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(plane[p][0], idx, plane[p][1]),
                                        _mm512_permutex2var_epi8(plane[p][2], idx, plane[p][3]));
    const __m512i low01 = _mm512_unpacklo_epi8(bytes[0], bytes[1]), high01 = _mm512_unpackhi_epi8(bytes[0], bytes[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(bytes[2], bytes[3]), high23 = _mm512_unpackhi_epi8(bytes[2], bytes[3]);
    const __m512i f[4] = {_mm512_unpacklo_epi16(low01, low23), _mm512_unpackhi_epi16(low01, low23),
                          _mm512_unpacklo_epi16(high01, high23), _mm512_unpackhi_epi16(high01, high23)};
    for (int r = 0; r < 4; ++r) {
      const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(f[r]), s);  // one rounding, as math::mul
      const std::size_t at = 16 * static_cast<std::size_t>(r);
      if (left >= at + 16)
        _mm512_storeu_ps(out + i + at, v);
      else if (left > at)
        _mm512_mask_storeu_ps(out + i + at, static_cast<__mmask16>((1u << (left - at)) - 1), v);
    }
  }
}

#undef ZERO_AVX512_VBMI_CODES

// q[j] = quantize(x[j] / absmax), j < n, through the segments' arithmetic;
// lanes it defers (t near an integer, or y on a segment bound) and the
// tail go to the exact lookup.
ZERO_AVX512_CODES inline void encode_codes_avx512(const float* x, std::size_t n, float absmax,
                                                  const quant::NearestCode& exact, const quant::CodeSegments& seg,
                                                  std::uint8_t* q) {
  const __m512 bound_pos0 = _mm512_load_ps(seg.bounds(0)), bound_pos1 = _mm512_load_ps(seg.bounds(0) + 16);
  const __m512 bound_neg0 = _mm512_load_ps(seg.bounds(1)), bound_neg1 = _mm512_load_ps(seg.bounds(1) + 16);
  const __m512i first_pos0 = _mm512_load_si512(seg.firsts(0)), first_pos1 = _mm512_load_si512(seg.firsts(0) + 16);
  const __m512i first_neg0 = _mm512_load_si512(seg.firsts(1)), first_neg1 = _mm512_load_si512(seg.firsts(1) + 16);
  const __m512 slope = _mm512_load_ps(seg.slopes()), offset = _mm512_load_ps(seg.offsets());
  const __m512 least = _mm512_load_ps(seg.leasts()), most = _mm512_load_ps(seg.mosts());
  const __m512i magnitude_bits = _mm512_set1_epi32(0x7fffffff);
  const __m512i lowest_bits = _mm512_set1_epi32(static_cast<int>(quant::CodeSegments::lowest_exponent << 23));
  const __m512 divisor = _mm512_set1_ps(absmax);
  const __m512 near = _mm512_set1_ps(quant::CodeSegments::near);
  std::size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 y = _mm512_div_ps(_mm512_loadu_ps(x + j), divisor);  // correctly rounded, as quantize_block
    const __m512i bits = _mm512_castps_si512(y);
    // The bucket: sign, and the exponent from 2^-31 (below: the lowest) up,
    // whose low five bits (the permutes read no more) count from 2^-31.
    const __m512i b = _mm512_maskz_srli_epi32(
        all, _mm512_maskz_max_epu32(all, _mm512_and_si512(bits, magnitude_bits), lowest_bits), 23);
    const __mmask16 negative = _mm512_movepi32_mask(bits);
    const __m512 bound = _mm512_mask_blend_ps(negative, _mm512_permutex2var_ps(bound_pos0, b, bound_pos1),
                                              _mm512_permutex2var_ps(bound_neg0, b, bound_neg1));
    const __m512i first = _mm512_mask_blend_epi32(negative, _mm512_permutex2var_epi32(first_pos0, b, first_pos1),
                                                  _mm512_permutex2var_epi32(first_neg0, b, first_neg1));
    const __mmask16 above = _mm512_cmp_ps_mask(bound, y, _CMP_LT_OQ);
    __mmask16 defer = _mm512_cmp_ps_mask(bound, y, _CMP_EQ_OQ);
    const __m512i s = _mm512_mask_add_epi32(first, above, first, _mm512_set1_epi32(1));
    // Within the segment: t = fma(y, slope, offset) counts code indices;
    // floor(t) cut to the segment's codes is the index.
    const __m512 t =
        _mm512_fmadd_ps(y, _mm512_maskz_permutexvar_ps(all, s, slope), _mm512_maskz_permutexvar_ps(all, s, offset));
    // t - round(t), exactly (vreduceps): t near any integer defers, the
    // segment's ends included (the bound decided those; deferring them
    // costs a few more exact lookups and saves comparisons).
    const __m512 distance = _mm512_abs_ps(_mm512_maskz_reduce_ps(all, t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    defer |= _mm512_cmp_ps_mask(distance, near, _CMP_LT_OQ);
    const __m512 floor = _mm512_maskz_roundscale_ps(all, t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 k = _mm512_maskz_min_ps(all, _mm512_maskz_max_ps(all, floor, _mm512_maskz_permutexvar_ps(all, s, least)),
                                         _mm512_maskz_permutexvar_ps(all, s, most));
    const __m512i index = _mm512_maskz_cvttps_epi32(all, k);
    Avx512::narrow_u8(q + j, (Avx512::U)index);
    if (defer != 0) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, y);
      for (int l = 0; l < 16; ++l)
        if ((defer >> l) & 1u) q[j + static_cast<std::size_t>(l)] = exact(lanes[l]);
    }
  }
  for (; j < n; ++j) q[j] = exact(zero::math::div(x[j], absmax));
}

#undef ZERO_AVX512_CODES

}  // namespace detail

// out[i] = quant::dequantize(q[i], code, scale) for i < n.
template <class Isa>
ZERO_FORCE_INLINE void decode_codes(const std::uint8_t* q, std::size_t n, const float* code, float scale, float* out) {
  if constexpr (std::is_same_v<Isa, Avx512>) {
    if (detail::has_avx512_vbmi())
      detail::decode_codes_vbmi(q, n, code, scale, out);
    else
      detail::decode_codes_avx512(q, n, code, scale, out);
  } else {
    std::size_t i = 0;
    if constexpr (Isa::width > 1) {
      using P = Pack<Isa>;
      const P s = broadcast<Isa>(scale);
      for (; i + Isa::width <= n; i += Isa::width) {
        typename Isa::U idx;
        load_u8_widened<Isa>(idx, q + i);
        P c;
        Isa::gather(c.v, code, idx);
        store(out + i, c * s);
      }
    }
    for (; i < n; ++i) out[i] = zero::math::mul(code[q[i]], scale);
  }
}

// q[j] = quant::quantize(x[j] / absmax, code) for j < n, where `exact` is
// the code's NearestCode and `segments` its CodeSegments (null: a table
// without their structure).
template <class Isa>
ZERO_FORCE_INLINE void encode_codes(const float* x, std::size_t n, float absmax, const quant::NearestCode& exact,
                                    const quant::CodeSegments* segments, std::uint8_t* q) {
  if constexpr (std::is_same_v<Isa, Avx512>) {
    if (segments != nullptr) {
      detail::encode_codes_avx512(x, n, absmax, exact, *segments, q);
      return;
    }
  }
  std::size_t j = 0;
  if constexpr (Isa::width > 1) {
    // The bucket of y, the count of midpoints below the bucket, then one
    // comparison with the next midpoint (quant::NearestCode), by gathers.
    using P = Pack<Isa>;
    using U = typename Isa::U;
    using F = typename Isa::F;
    using NC = quant::NearestCode;
    const F divisor = F{} + absmax;
    for (; j + Isa::width <= n; j += Isa::width) {
      const P v = load<Isa>(x + j);
      const F y = v.v / divisor;  // correctly rounded, as quant::quantize_block
      const U bits = (U)y;
      const U key = (bits & 0x7fffffffu) >> (23 - NC::mantissa_bits);
      U t = key > NC::bucket_base ? key - NC::bucket_base : U{};
      t = t < NC::per_sign ? t : U{} + (NC::per_sign - 1);
      t += (bits >> 31) * NC::per_sign;
      U c;
      Isa::gather_bytes(c, exact.counts(), t);
      F m;
      Isa::gather(m, exact.midpoints(), c);
      const U up = (U)(y > m) | ((U)(y == m) & (U)((c & 1u) != 0));
      store_u8_narrowed<Isa>(q + j, c + (up & 1u));
    }
  }
  for (; j < n; ++j) q[j] = exact(zero::math::div(x[j], absmax));
}

}  // namespace zero::simd

#endif  // ZERO_HOST_SIMD_X86
