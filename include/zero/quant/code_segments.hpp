// Why: the host's 8-bit step spent most of its time in gathers (about 24
// cycles per 16 values each on a Zen 4, six per 16 values for Adam:
// bench/results/2026-12-03-8bit-states.md). A code table with the dynamic
// code's structure needs no per-value table read to find the nearest code:
// its codes fall into a few runs ("segments") of equally spaced values (one
// run per decimal level and sign), so within a segment the nearest code is
// floor(y * slope + offset) arithmetically, and which segment holds y is
// decided by y's sign and binary exponent (32 exponents per sign, each
// crossing at most one segment boundary) plus one comparison. The host's
// AVX-512 step keeps these few small tables in registers
// (zero/simd/code_lookup.hpp).
//
// Exact, not approximate. Let a segment hold codes a .. b. For each of its
// inner midpoints m_k (between codes a + k and a + k + 1) the constructor
// checks that t(m_k) = fma(m_k, slope, offset), computed in fp32 as the
// SIMD code computes it, lies within near/2 of a + k + 1: t counts code
// indices. t is monotone in y (fma rounds monotonically and slope > 0), so
// for a y whose t is not within `near` of an integer, floor(t) clamped to
// [a, b] is quantize()'s index. A y whose t is that near an integer (an
// inner edge, or one of the segment's ends, which the bound decided but
// which is cheaper to defer than to tell apart: about 2 in 1000 values), or
// that equals a segment's bound, is deferred to the exact search
// (NearestCode). (A negative y under an unsigned table, which an optimizer's
// non-negative state never holds, has t below a and defers near every
// integer: exact, and slower.) A table without this structure (a user's
// own) is marked unusable and the step keeps its gathers.
#pragma once

#include "zero/compiler.hpp"

#include <cmath>
#include <cstdint>
#include <limits>

#include "zero/quant/dynamic_code.hpp"

namespace zero::quant {

class CodeSegments {
 public:
  static constexpr int max_segments = 16;  // one AVX-512 register of lanes
  static constexpr int buckets = 32;       // per sign: binary exponents lowest_exponent .. 127
  static constexpr std::uint32_t lowest_exponent = 96;  // |y| < 2^-30 shares 2^-31's bucket
  static constexpr float near = 1.0f / 1024.0f;         // in cells: t this near an inner edge defers

  explicit CodeSegments(const float* code) { usable_ = build(code); }

  bool usable() const { return usable_; }
  int segments() const { return count_; }

  // The SIMD encoder's arithmetic for one value y in [-1, 1], lane for lane:
  // the code index, or -1 where it defers to the exact search.
  int index_or_defer(float y) const {
    const std::uint32_t bits = __builtin_bit_cast(std::uint32_t, y);
    const std::uint32_t magnitude = bits & 0x7fffffffu;
    const std::uint32_t least_bits = lowest_exponent << 23;
    const std::uint32_t b = ((magnitude > least_bits ? magnitude : least_bits) >> 23) - lowest_exponent;
    const std::uint32_t sign = bits >> 31;
    const float bound = bound_[sign][b];
    if (bound == y) return -1;
    const int s = first_[sign][b] + (bound < y ? 1 : 0);
    const float t = std::fma(y, slope_[s], offset_[s]);
    if (std::fabs(t - std::nearbyint(t)) < near) return -1;
    float k = std::floor(t);
    k = k > least_[s] ? k : least_[s];
    k = k < most_[s] ? k : most_[s];
    return static_cast<int>(k);
  }

  // The tables, as the SIMD code loads them: [sign][bucket] the segment of
  // the bucket's least value and the bound (a segment's least midpoint)
  // inside the bucket, +inf where there is none; [segment] the slope and
  // offset (t counts code indices: its integer part is the index, before
  // the clamp) and the segment's least and greatest code index, as floats.
  const float* bounds(std::uint32_t sign) const { return bound_[sign]; }
  const std::int32_t* firsts(std::uint32_t sign) const { return first_[sign]; }
  const float* slopes() const { return slope_; }
  const float* offsets() const { return offset_; }
  const float* leasts() const { return least_; }
  const float* mosts() const { return most_; }

 private:
  bool build(const float* code) {
    float mid[code_size - 1];
    for (int j = 0; j + 1 < code_size; ++j) {
      if (!(code[j] < code[j + 1])) return false;
      mid[j] = (code[j] + code[j + 1]) * 0.5f;
    }
    // Segments: maximal runs of equally spaced codes (within 1/1000 of the
    // run's first spacing; a run's first two codes set it).
    float lower[max_segments];  // least midpoint of each segment (-inf for the first)
    int a = 0;
    count_ = 0;
    while (a < code_size) {
      int b = a;
      if (b + 1 < code_size) {
        const double spacing = static_cast<double>(code[a + 1]) - code[a];
        b = a + 1;
        while (b + 1 < code_size &&
               std::fabs((static_cast<double>(code[b + 1]) - code[b]) - spacing) <= 1e-3 * spacing)
          ++b;
      }
      if (count_ == max_segments) return false;
      const int s = count_++;
      const int codes = b - a + 1;
      lower[s] = a == 0 ? -std::numeric_limits<float>::infinity() : mid[a - 1];
      least_[s] = static_cast<float>(a);
      most_[s] = static_cast<float>(b);
      if (codes == 1) {
        slope_[s] = 0.0f;
        offset_[s] = static_cast<float>(a) + 0.5f;
      } else {
        // t(mid[a]) = a + 1 and t(mid[b - 1]) = b; a two-code segment has
        // one inner midpoint, at 1 cell of code spacing.
        const double first = mid[a];
        const double slope = codes == 2 ? 1.0 / (static_cast<double>(code[a + 1]) - code[a])
                                        : (codes - 2) / (static_cast<double>(mid[b - 1]) - first);
        slope_[s] = static_cast<float>(slope);
        offset_[s] = static_cast<float>(a + 1.0 - static_cast<double>(slope_[s]) * first);
        if (!(slope_[s] > 0.0f)) return false;
        for (int k = 0; k + 1 < codes; ++k) {
          const float t = std::fma(mid[a + k], slope_[s], offset_[s]);
          if (!(std::fabs(t - static_cast<float>(a + k + 1)) < near * 0.5f)) return false;
        }
      }
      a = b + 1;
    }
    for (int s = count_; s < max_segments; ++s) {  // unused lanes: harmless values
      slope_[s] = 0.0f;
      offset_[s] = 0.5f;
      least_[s] = 0.0f;
      most_[s] = 0.0f;
    }
    // Buckets: the values with one sign and binary exponent, [lo, hi] in y's
    // order. At most one segment bound may lie inside.
    for (std::uint32_t sign = 0; sign < 2; ++sign)
      for (std::uint32_t bucket = 0; bucket < static_cast<std::uint32_t>(buckets); ++bucket) {
        const std::uint32_t e = bucket + lowest_exponent;
        const float least = bucket == 0 ? 0.0f : __builtin_bit_cast(float, e << 23);  // least magnitude
        const float most = __builtin_bit_cast(float, ((e + 1) << 23) - 1);            // greatest magnitude
        const float lo = sign ? -most : least, hi = sign ? -least : most;
        int first = 0;
        for (int s = 1; s < count_; ++s) first += lower[s] < lo ? 1 : 0;
        float bound = std::numeric_limits<float>::infinity();
        int inside = 0;
        for (int s = 1; s < count_; ++s)
          if (lower[s] >= lo && lower[s] <= hi) {
            bound = lower[s];
            ++inside;
          }
        if (inside > 1) return false;
        first_[sign][bucket] = first;
        bound_[sign][bucket] = bound;
      }
    return true;
  }

  bool usable_ = false;
  int count_ = 0;
  alignas(64) float bound_[2][buckets] = {};
  alignas(64) std::int32_t first_[2][buckets] = {};
  alignas(64) float slope_[max_segments] = {};
  alignas(64) float offset_[max_segments] = {};
  alignas(64) float least_[max_segments] = {};
  alignas(64) float most_[max_segments] = {};
};

// The two built-in tables' segments, built once on first use.
inline const CodeSegments& code_segments_signed() {
  static const CodeSegments segments(dynamic_code_signed.data());
  return segments;
}
inline const CodeSegments& code_segments_unsigned() {
  static const CodeSegments segments(dynamic_code_unsigned.data());
  return segments;
}
// A built-in table's segments, or null (another table: the step keeps its gathers).
inline const CodeSegments* code_segments_for(const float* code) {
  const CodeSegments* s = code == dynamic_code_signed.data()     ? &code_segments_signed()
                          : code == dynamic_code_unsigned.data() ? &code_segments_unsigned()
                                                                 : nullptr;
  return s != nullptr && s->usable() ? s : nullptr;
}

}  // namespace zero::quant
