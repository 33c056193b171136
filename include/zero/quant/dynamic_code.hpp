// Why: Adam's two fp32 moments are 8 of the 16 bytes per parameter that ZeRO
// shards. 8-bit block-wise quantization (Dettmers et al. 2022, "8-bit
// Optimizers via Block-wise Quantization", bitsandbytes) stores each moment
// as one byte per element plus one fp32 absmax per block of 2048 elements,
// and keeps fp32 training quality. This header holds what a fused 8-bit step
// needs from it, written once for host and device (like fused_step.hpp): the
// two code tables, the per-element quantize/dequantize and block loops. It
// depends on nothing of the engine: the engine decides which tensors are
// quantized (bitsandbytes keeps tensors under 4096 elements in fp32).
//
// The codes. An element x of a block with absmax N is stored as the index of
// the table value nearest to x / N; it is read back as code[index] * N. The
// table is bitsandbytes' "dynamic" map (create_dynamic_map), the dynamic tree
// code of Dettmers 2015 ("8-Bit Approximations for Parallelism in Deep
// Learning"): after the sign, a run of zero bits sets a decimal exponent
// 10^-6 .. 10^0 and the remaining bits a linear fraction in [0.1, 1], so
// relative precision is kept over 7 decades instead of the 2 that a linear
// 8-bit code covers. Concretely, for level i = 0..6 the values are
// 10^(i-6) * (b[j] + b[j+1]) / 2 for the 2^i (signed) or 2^(i+1) (unsigned)
// cells of b = linspace(0.1, 1, cells + 1), mirrored to negative for the
// signed table, plus 0 and 1, sorted ascending: 256 distinct values. The
// signed table (first moment m) spans [-0.99296875, 1]; the unsigned one
// (second moment v >= 0: the sign bit becomes one more fraction bit, the
// paper's "dynamic quantization") spans [0, 1].
//
// Bit for bit, as bitsandbytes' tables hold them: PyTorch computes them in
// fp32, so the last bit of an entry depends on how torch.linspace rounds.
// PyTorch 2's CPU kernel computes point k as start + step*k for the first
// half and end - step*(steps-1-k) for the second, and its x86-64 AVX2/AVX-512
// builds (GCC, whose default is fp-contract=fast) fuse each into one FMA, as
// the published table shows. The tables below round exactly so (an integer
// emulation of that FMA, so that they are constexpr):
// the signed one equals a published dump of bitsandbytes' map in all 256
// entries (entry 20 is -0x1.6c6668p-1, where correctly rounded linspace
// points would give -0x1.6c6666p-1). Unfused or torch 1.x (vectorised)
// linspace changes 16 to 46 entries of a table by 1 or 2 ulp.
// The functions take the table as a pointer, so the map saved with a
// bitsandbytes checkpoint (state qmap1/qmap2) can be used as it is.
//
// Rounding to the nearest code. bitsandbytes' CUDA quantizer (dQuantize,
// kernels.cu) compares x with the fp32 midpoint (code[j] + code[j+1]) * 0.5f
// of its two neighbours; a value exactly on that midpoint goes to the
// even index of the two (its fixed 7-step search always ends on an even
// pivot and keeps it on equality). quantize() gives the same index for every
// input, NaN and infinities included (checked against a transcription of
// that search on every midpoint and its neighbours, every code and its
// neighbours, and 40k other values, for both tables). bitsandbytes'
// torch fallback (bucketize) sends such ties to the lower index instead, and
// its current CPU kernel reads a 65536-entry lookup table, which is not exact.
// Normalisation is a correctly rounded x / N, so the element equal to N in
// magnitude maps to exactly +-1 and host and device agree bit for bit
// (bitsandbytes' kernels, built with --use_fast_math, multiply by an
// approximate 1/N or divide approximately).
//
// Left to the step that adopts this: bitsandbytes' 8-bit optimizers also move
// an updated m whose code has the other sign (a small negative m rounded to
// the 0.0 code) one index back towards its sign.
#pragma once

#include "zero/compiler.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "zero/math.hpp"  // mul/div: one rounding each, never contracted into an FMA

namespace zero::quant {

inline constexpr int code_size = 256;
// The paper's block size. bitsandbytes' optimizers have since used 256.
inline constexpr std::size_t default_block = 2048;
using CodeTable = std::array<float, code_size>;

namespace detail {

// A positive normal float as m * 2^e with m < 2^24 (exact).
struct Dyadic {
  std::int64_t m;
  int e;
};

constexpr Dyadic to_dyadic(float x) {
  const auto bits = __builtin_bit_cast(std::uint32_t, x);
  return {static_cast<std::int64_t>((bits & 0x7fffffu) | 0x800000u), static_cast<int>((bits >> 23) & 0xffu) - 150};
}

// m * 2^e (m > 0, result in the normal range) rounded to the nearest float,
// ties to even.
constexpr float round_dyadic(std::int64_t m, int e) {
  int length = 0;
  for (std::int64_t t = m; t != 0; t >>= 1) ++length;
  if (length <= 24) {
    m <<= 24 - length;
    e -= 24 - length;
  } else {
    int shift = length - 24;
    std::int64_t kept = m >> shift;
    const std::int64_t rest = m - (kept << shift), half = std::int64_t{1} << (shift - 1);
    if (rest > half || (rest == half && (kept & 1) != 0)) ++kept;
    if (kept == (std::int64_t{1} << 24)) {  // rounded up to the next power of two
      kept >>= 1;
      ++shift;
    }
    m = kept;
    e += shift;
  }
  const auto bits = (static_cast<std::uint32_t>(e + 150) << 23) | static_cast<std::uint32_t>(m - (1 << 23));
  return __builtin_bit_cast(float, bits);
}

// base + sign * step * k with one rounding: the FMA of a compiled
// torch.linspace. std::fma is not constexpr, and the exact value needs under
// 40 bits here (24-bit mantissas, k <= 128, exponents a few apart).
constexpr float fused_point(float base, float step, int k, int sign) {
  const Dyadic b = to_dyadic(base), s = to_dyadic(step);
  const int e = b.e < s.e ? b.e : s.e;
  const std::int64_t exact = (b.m << (b.e - e)) + sign * ((s.m * k) << (s.e - e));
  return round_dyadic(exact, e);
}

// torch.linspace(start, end, points) in fp32 as PyTorch 2 computes it on an
// x86-64 CPU with FMA (see the header comment).
constexpr void linspace(float start, float end, int points, float* out) {
  const float step = (end - start) / static_cast<float>(points - 1);
  const int halfway = points / 2;
  for (int k = 0; k < points; ++k)
    out[k] = k < halfway ? fused_point(start, step, k, +1) : fused_point(end, step, points - 1 - k, -1);
}

}  // namespace detail

// bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8).
constexpr CodeTable make_dynamic_code(bool is_signed) {
  // Python's 10 ** (i - 6), a double, which torch rounds to fp32 when it
  // multiplies the fp32 means by it.
  constexpr double scales[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  CodeTable table{};
  int count = 0;
  for (int level = 0; level < 7; ++level) {
    const int cells = is_signed ? (1 << level) : (2 << level);
    float edges[129] = {};
    detail::linspace(static_cast<float>(0.1), 1.0f, cells + 1, edges);
    const float scale = static_cast<float>(scales[level]);
    for (int j = 0; j < cells; ++j) {
      const float value = scale * ((edges[j] + edges[j + 1]) / 2.0f);
      table[count++] = value;
      if (is_signed) table[count++] = -value;
    }
  }
  table[count++] = 0.0f;
  table[count++] = 1.0f;
  for (int i = 1; i < code_size; ++i)  // insertion sort: constexpr, and 256 entries once
    for (int j = i; j > 0 && table[j] < table[j - 1]; --j) {
      const float t = table[j];
      table[j] = table[j - 1];
      table[j - 1] = t;
    }
  return table;
}

// First moment m (and any signed state).
inline constexpr CodeTable dynamic_code_signed = make_dynamic_code(true);
// Second moment v (non-negative).
inline constexpr CodeTable dynamic_code_unsigned = make_dynamic_code(false);

// The table for a state slot: unsigned for values never negative.
constexpr const float* code_for(bool non_negative) {
  return non_negative ? dynamic_code_unsigned.data() : dynamic_code_signed.data();
}

// Index of the code value nearest to `normalized` (x / absmax, in [-1, 1]),
// for a table of 256 strictly increasing values. A value exactly on the fp32
// midpoint of two neighbours gets the even index of the two, as bitsandbytes'
// CUDA quantizer. Out of range: the nearest end (an unsigned table maps
// negatives to its 0). NaN: index 0. Fixed work: 8 steps of a branch-free
// binary search, then one midpoint.
ZERO_HOST_DEVICE ZERO_FORCE_INLINE std::uint8_t quantize(float normalized, const float* code) {
  const float x = normalized;
  unsigned below = 0;  // ends as the number of code[0..254] below x (NaN: 0)
  for (unsigned half = 128; half > 0; half >>= 1) below = code[below + half - 1] < x ? below + half : below;
  if (below == 0) return 0;  // x <= code[0]
  // Now code[below - 1] < x, and x <= code[below] unless below == 255.
  const float midpoint = (code[below - 1] + code[below]) * 0.5f;
  if (x > midpoint) return static_cast<std::uint8_t>(below);
  if (x < midpoint) return static_cast<std::uint8_t>(below - 1);
  return static_cast<std::uint8_t>(below & ~1u);
}

ZERO_HOST_DEVICE ZERO_FORCE_INLINE float dequantize(std::uint8_t q, const float* code, float absmax) {
  return zero::math::mul(code[q], absmax);
}

// quantize() without its eight-step search, for the host's SIMD step (two
// table reads instead of eight dependent ones; gathers in a vector).
// quantize(x) is the number of fp32 midpoints of neighbouring codes that lie
// below x, plus one when x equals the next midpoint and that count is odd
// (a tie goes to the even index). Floats are cut into buckets by sign,
// exponent and the top 7 mantissa bits (magnitudes under 2^-24 share one
// bucket); the table holds, for each bucket, the count of midpoints below its
// smallest value, and no bucket holds more than one midpoint (checked when
// the table is built: the codes' cells are at least 0.007 wide where the
// buckets are 0.004 wide), so x's index is that count plus one comparison
// with the next midpoint. For finite x in [-1, 1] (a normalised value);
// equal to quantize() there (tests/quant: every midpoint and its
// neighbours, and random values).
class NearestCode {
 public:
  static constexpr int mantissa_bits = 7;
  static constexpr std::uint32_t lowest_exponent = 103;  // 2^-24, below half of either table's least code
  static constexpr std::uint32_t bucket_base = (lowest_exponent << mantissa_bits) - 1;
  // Buckets per sign: the tiny one, then 24 exponents x 128 up to 1.0's.
  static constexpr std::uint32_t per_sign = ((127 - lowest_exponent) << mantissa_bits) + 2;

  explicit NearestCode(const float* code) {
    for (int j = 0; j + 1 < code_size; ++j) midpoint_[j] = (code[j] + code[j + 1]) * 0.5f;
    midpoint_[code_size - 1] = std::numeric_limits<float>::infinity();
    for (std::uint32_t sign = 0; sign < 2; ++sign)
      for (std::uint32_t t = 0; t < per_sign; ++t) {
        // The bucket's magnitudes [lo, hi] as bits.
        const std::uint32_t lo = t == 0 ? 0u : (t + bucket_base) << (23 - mantissa_bits);
        const std::uint32_t hi = t == 0 ? (lowest_exponent << 23) - 1 : lo + ((1u << (23 - mantissa_bits)) - 1);
        const float smallest = sign ? -__builtin_bit_cast(float, hi) : __builtin_bit_cast(float, lo);
        const float largest = sign ? -__builtin_bit_cast(float, lo) : __builtin_bit_cast(float, hi);
        const unsigned below = count_below(smallest);
        // At most one midpoint in [smallest, largest] (see above).
        unsigned at_most = 0;
        while (at_most < code_size - 1 && midpoint_[at_most] <= largest) ++at_most;
        if (at_most > below + 1) __builtin_trap();  // a code table denser than the dynamic codes
        count_[sign * per_sign + t] = static_cast<std::uint8_t>(below);
      }
  }

  // The bucket of x's bits (magnitude at most 1.0).
  static constexpr std::uint32_t bucket(std::uint32_t bits) {
    const std::uint32_t magnitude = bits & 0x7fffffffu;
    const std::uint32_t key = magnitude >> (23 - mantissa_bits);
    std::uint32_t t = key > bucket_base ? key - bucket_base : 0u;
    t = t < per_sign ? t : per_sign - 1;
    return t + (bits >> 31) * per_sign;
  }

  std::uint8_t operator()(float x) const {
    const unsigned c = count_[bucket(__builtin_bit_cast(std::uint32_t, x))];
    const float m = midpoint_[c];
    return static_cast<std::uint8_t>(c + ((x > m || (x == m && (c & 1u) != 0)) ? 1u : 0u));
  }

  // For SIMD gathers: count_ is read 4 bytes at a time (3 bytes of padding).
  const std::uint8_t* counts() const { return count_; }
  const float* midpoints() const { return midpoint_; }

 private:
  unsigned count_below(float v) const {
    unsigned c = 0;
    while (c < code_size - 1 && midpoint_[c] < v) ++c;
    return c;
  }

  alignas(64) float midpoint_[code_size];  // [j]: (code[j] + code[j + 1]) * 0.5f; [255]: +inf
  std::uint8_t count_[2 * per_sign + 3] = {};
};

// The two built-in tables' lookups, built once on first use.
inline const NearestCode& nearest_code_signed() {
  static const NearestCode table(dynamic_code_signed.data());
  return table;
}
inline const NearestCode& nearest_code_unsigned() {
  static const NearestCode table(dynamic_code_unsigned.data());
  return table;
}
// The lookup of a table given as a pointer: a built-in's, or null (callers
// then use quantize()).
inline const NearestCode* nearest_code_for(const float* code) {
  if (code == dynamic_code_signed.data()) return &nearest_code_signed();
  if (code == dynamic_code_unsigned.data()) return &nearest_code_unsigned();
  return nullptr;
}

// Number of absmax values (blocks) for n elements; the last block may be short.
ZERO_HOST_DEVICE constexpr std::size_t block_count(std::size_t n, std::size_t block) {
  return block == 0 ? 0 : (n + block - 1) / block;
}

// Blocks of `block` elements over elements [0, n) of a range that starts
// `phase` elements into its first block (a shard that begins inside a
// parameter's block): block b covers [b * block - phase, (b + 1) * block -
// phase) cut to [0, n). The one statement of that geometry, for the fused
// step, the engine's runs and the stores.
struct PhasedBlocks {
  std::size_t n = 0, block = 1, phase = 0;

  ZERO_HOST_DEVICE constexpr std::size_t count() const { return n == 0 ? 0 : (n + phase + block - 1) / block; }
  ZERO_HOST_DEVICE constexpr std::size_t of(std::size_t i) const { return (phase + i) / block; }  // block of element i
  ZERO_HOST_DEVICE constexpr std::size_t begin(std::size_t b) const { return b == 0 ? 0 : b * block - phase; }
  ZERO_HOST_DEVICE constexpr std::size_t end(std::size_t b) const {
    const std::size_t e = (b + 1) * block - phase;
    return e < n ? e : n;
  }
};

// Quantizes one block in place of q[0..n) and returns its absmax = max |x|.
// An all-zero block (or n == 0) returns 0 with every code the table's 0.0,
// so it reads back as zeros. A block holding a NaN or an infinity returns
// NaN (0x7fc00000) with every code the table's 0.0: every element then reads
// back as NaN, so a non-finite state shows instead of being clamped to a
// finite value (bitsandbytes' max ignores NaN and stores it as code 0).
ZERO_HOST_DEVICE inline float quantize_block(const float* x, std::size_t n, const float* code, std::uint8_t* q) {
  float absmax = 0.0f;
  bool finite = true;
  for (std::size_t i = 0; i < n; ++i) {
    const float a = zero::math::abs(x[i]);
    finite &= a <= 3.40282347e+38f;  // false for NaN and infinity
    absmax = a > absmax ? a : absmax;
  }
  if (!finite || absmax == 0.0f) {
    const std::uint8_t zero = quantize(0.0f, code);
    for (std::size_t i = 0; i < n; ++i) q[i] = zero;
    return finite ? 0.0f : __builtin_bit_cast(float, 0x7fc00000u);
  }
  for (std::size_t i = 0; i < n; ++i) q[i] = quantize(zero::math::div(x[i], absmax), code);
  return absmax;
}

// quantize_block for values that were read back from a quantized block
// (a checkpoint's fp32 state): it returns a scale that gives every value
// back exactly when one exists, so a reload is bit for bit. quantize_block
// alone finds the original absmax only when the largest magnitude read back
// is the code 1.0; the signed table's most negative code is -0.99296875, so
// a block led by a negative value reads back with a smaller maximum. Then
// the scales around max |x| / |end| for either end of the table are tried
// (a few ulps each way). Values that no scale reproduces (not a read-back)
// are quantized as quantize_block does.
inline float requantize_block(const float* x, std::size_t n, const float* code, std::uint8_t* q) {
  const float absmax = quantize_block(x, n, code, q);
  auto reproduces = [&](float scale) {
    for (std::size_t i = 0; i < n; ++i)
      if (zero::math::mul(code[q[i]], scale) != x[i]) return false;
    return true;
  };
  if (!(absmax > 0.0f) || absmax > 3.40282347e+38f || reproduces(absmax)) return absmax;
  // The original absmax made its largest value an end of the table (+1, or
  // the signed table's -0.99296875): the read-back maximum is that code's
  // magnitude times it.
  std::vector<std::uint8_t> trial(n);
  for (const float end : {zero::math::abs(code[0]), zero::math::abs(code[code_size - 1])}) {
    if (!(end > 0.0f)) continue;
    const float guess = static_cast<float>(static_cast<double>(absmax) / static_cast<double>(end));
    const std::uint32_t bits = __builtin_bit_cast(std::uint32_t, guess);
    for (int d = -4; d <= 4; ++d) {
      const float scale = __builtin_bit_cast(float, bits + static_cast<std::uint32_t>(d));
      for (std::size_t i = 0; i < n; ++i) trial[i] = quantize(zero::math::div(x[i], scale), code);
      bool same = true;
      for (std::size_t i = 0; i < n && same; ++i) same = zero::math::mul(code[trial[i]], scale) == x[i];
      if (same) {
        for (std::size_t i = 0; i < n; ++i) q[i] = trial[i];
        return scale;
      }
    }
  }
  return absmax;
}

ZERO_HOST_DEVICE inline void dequantize_block(const std::uint8_t* q, std::size_t n, const float* code, float absmax,
                                              float* x) {
  for (std::size_t i = 0; i < n; ++i) x[i] = dequantize(q[i], code, absmax);
}

// A whole array in blocks of `block` elements (block >= 1; 0 does nothing):
// codes to q[0..n), one absmax per block to absmax[0..block_count(n, block)).
// Serial: the engine's kernels own the parallel loops.
ZERO_HOST_DEVICE inline void quantize_blockwise(const float* x, std::size_t n, std::size_t block, const float* code,
                                                std::uint8_t* q, float* absmax) {
  for (std::size_t b = 0; b < block_count(n, block); ++b) {
    const std::size_t begin = b * block, length = n - begin < block ? n - begin : block;
    absmax[b] = quantize_block(x + begin, length, code, q + begin);
  }
}

ZERO_HOST_DEVICE inline void quantize_blockwise(const float* x, std::size_t n, const float* code, std::uint8_t* q,
                                                float* absmax) {
  quantize_blockwise(x, n, default_block, code, q, absmax);
}

ZERO_HOST_DEVICE inline void dequantize_blockwise(const std::uint8_t* q, const float* absmax, std::size_t n,
                                                  std::size_t block, const float* code, float* x) {
  for (std::size_t b = 0; b < block_count(n, block); ++b) {
    const std::size_t begin = b * block, length = n - begin < block ? n - begin : block;
    dequantize_block(q + begin, length, code, absmax[b], x + begin);
  }
}

ZERO_HOST_DEVICE inline void dequantize_blockwise(const std::uint8_t* q, const float* absmax, std::size_t n,
                                                  const float* code, float* x) {
  dequantize_blockwise(q, absmax, n, default_block, code, x);
}

}  // namespace zero::quant
