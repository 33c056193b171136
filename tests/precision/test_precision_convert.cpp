// The fp32 <-> fp16/bf16 conversions must round exactly like CUDA, or a step
// computed on the CPU (ZeRO-Offload) and one on the GPU drift apart. There are
// only 2^32 fp32 inputs, so this test checks all of them, on the scalar path
// and through host_convert under every instruction set this CPU can run, and
// all 65536 patterns of each 16-bit type on the way back.
//
// The reference is CUDA's own host code (__float2half, __float2bfloat16,
// __half2float, __bfloat162float), compiled by g++ from cuda_fp16.h /
// cuda_bf16.h when the build finds them (ZERO_TEST_CUDA_REFERENCE). Without
// CUDA the reference is the branchy textbook conversion below, written from
// the IEEE 754 definition: it shares no code or trick with the library's
// branch-free algorithms. When CUDA is present, the textbook version is held
// to CUDA's too, so the fallback is known to be right.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#if ZERO_TEST_CUDA_REFERENCE
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "zero/kernels/host_convert.hpp"
#include "zero/precision/convert.hpp"
#include "zero/precision/types.hpp"
#include "zero/simd/dispatch.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

using zero::bf16;
using zero::fp16;

namespace {

// ---- Independent reference: IEEE 754 by the book -----------------------------

// Rounds the fp32 `x` (bits) to a binary format with MantBits stored mantissa
// bits and ExpBits exponent bits, to nearest with ties to even, by writing |x|
// as an integer significand times a power of two and comparing the dropped
// remainder with half a unit in the last place. NaN becomes 0x7fff (CUDA's
// canonical NaN for both formats).
template <int MantBits, int ExpBits>
std::uint16_t textbook_narrow(std::uint32_t x) {
  constexpr int bias = (1 << (ExpBits - 1)) - 1;
  constexpr int emin = 1 - bias;  // exponent of the smallest normal number
  constexpr std::uint32_t inf_out = ((1u << ExpBits) - 1u) << MantBits;
  const std::uint32_t sign_out = (x >> 31) << (MantBits + ExpBits);
  const int biased = static_cast<int>((x >> 23) & 0xffu);
  const std::uint32_t frac = x & 0x7fffffu;

  if (biased == 0xff) return frac != 0 ? std::uint16_t{0x7fff} : static_cast<std::uint16_t>(sign_out | inf_out);

  // |x| = sig * 2^e exactly, and 2^exponent <= |x| < 2^(exponent + 1).
  std::uint32_t sig;
  int e;
  int exponent;
  if (biased != 0) {
    sig = frac | 0x800000u;
    e = biased - 150;
    exponent = biased - 127;
  } else {
    if (frac == 0) return static_cast<std::uint16_t>(sign_out);
    sig = frac;
    e = -149;
    exponent = static_cast<int>(std::bit_width(frac)) - 1 - 149;
  }
  // The target's unit in the last place at this magnitude is 2^q.
  const int q = (exponent < emin ? emin : exponent) - MantBits;
  const int shift = q - e;  // >= 1 for every fp32 input and both targets
  if (shift > 24) return static_cast<std::uint16_t>(sign_out);  // sig < 2^24 <= half a unit
  std::uint32_t kept = sig >> shift;
  const std::uint32_t remainder = sig & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  if (remainder > half || (remainder == half && (kept & 1u) != 0)) ++kept;

  if (exponent < emin) {
    // Subnormal range: the field is the count of units; 2^MantBits units is
    // the smallest normal number, whose encoding is exactly that count.
    return static_cast<std::uint16_t>(sign_out | kept);
  }
  if (kept == (2u << MantBits)) {  // rounded up to the next power of two
    kept >>= 1;
    ++exponent;
  }
  if (exponent > bias) return static_cast<std::uint16_t>(sign_out | inf_out);
  const std::uint32_t field = (static_cast<std::uint32_t>(exponent + bias) << MantBits) | (kept - (1u << MantBits));
  return static_cast<std::uint16_t>(sign_out | field);
}

// The exact value of a 16-bit pattern as fp32, built with ldexp. NaN: fp16
// NaNs become 0x7fffffff (CUDA discards sign and payload); bf16 NaNs keep their
// bits (CUDA's bf16 -> fp32 is a shift).
std::uint32_t textbook_widen(std::uint16_t h, int mant_bits, int exp_bits, bool keep_nan_payload) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const bool negative = (h >> (mant_bits + exp_bits)) != 0;
  const int biased = (h >> mant_bits) & ((1 << exp_bits) - 1);
  const int frac = h & ((1 << mant_bits) - 1);
  float v;
  if (biased == (1 << exp_bits) - 1) {
    if (frac != 0) return keep_nan_payload ? std::uint32_t{h} << 16 : 0x7fffffffu;
    v = std::numeric_limits<float>::infinity();
  } else if (biased == 0) {
    v = std::ldexp(static_cast<float>(frac), 1 - bias - mant_bits);
  } else {
    v = std::ldexp(static_cast<float>(frac + (1 << mant_bits)), biased - bias - mant_bits);
  }
  return std::bit_cast<std::uint32_t>(negative ? -v : v);
}

std::uint16_t textbook_float_to_half(std::uint32_t x) { return textbook_narrow<10, 5>(x); }
std::uint16_t textbook_float_to_bf16(std::uint32_t x) { return textbook_narrow<7, 8>(x); }
std::uint32_t textbook_half_to_float(std::uint16_t h) { return textbook_widen(h, 10, 5, false); }
std::uint32_t textbook_bf16_to_float(std::uint16_t h) { return textbook_widen(h, 7, 8, true); }

// ---- The reference the library is held to -----------------------------------

#if ZERO_TEST_CUDA_REFERENCE
constexpr const char* reference_name = "CUDA host conversions (cuda_fp16.h, cuda_bf16.h)";
std::uint16_t ref_float_to_half(std::uint32_t x) {
  const __half h = __float2half(std::bit_cast<float>(x));
  return std::bit_cast<std::uint16_t>(h);
}
std::uint16_t ref_float_to_bf16(std::uint32_t x) {
  const __nv_bfloat16 b = __float2bfloat16(std::bit_cast<float>(x));
  return std::bit_cast<std::uint16_t>(b);
}
std::uint32_t ref_half_to_float(std::uint16_t h) {
  return std::bit_cast<std::uint32_t>(__half2float(std::bit_cast<__half>(h)));
}
std::uint32_t ref_bf16_to_float(std::uint16_t b) {
  return std::bit_cast<std::uint32_t>(__bfloat162float(std::bit_cast<__nv_bfloat16>(b)));
}
#else
constexpr const char* reference_name = "textbook IEEE 754 reference (CUDA headers not found)";
std::uint16_t ref_float_to_half(std::uint32_t x) { return textbook_float_to_half(x); }
std::uint16_t ref_float_to_bf16(std::uint32_t x) { return textbook_float_to_bf16(x); }
std::uint32_t ref_half_to_float(std::uint16_t h) { return textbook_half_to_float(h); }
std::uint32_t ref_bf16_to_float(std::uint16_t b) { return textbook_bf16_to_float(b); }
#endif

// The reference for the consecutive inputs first, first + 1, ... (n of them).
// This is the exhaustive test's hot loop, so where the CPU has AVX-512 it is
// also compiled for it: g++ then vectorises the branchy reference with masks,
// about twice as fast. Same source, same results; only the speed differs.
// Clang does not vectorise it and says so at -O2 and above (-Wpass-failed);
// the hint is for g++.
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpass-failed"
#endif
inline __attribute__((always_inline)) void reference_run_body(std::uint64_t first, std::size_t n,
                                                              std::uint16_t* half, std::uint16_t* bf) {
#pragma omp simd
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t x = static_cast<std::uint32_t>(first + i);
    half[i] = ref_float_to_half(x);
    bf[i] = ref_float_to_bf16(x);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((flatten, target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx2,bmi,bmi2,lzcnt"))) void
reference_run_avx512(std::uint64_t first, std::size_t n, std::uint16_t* half, std::uint16_t* bf) {
  reference_run_body(first, n, half, bf);
}
#endif

void reference_run(std::uint64_t first, std::size_t n, std::uint16_t* half, std::uint16_t* bf) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool avx512 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
  }();
  if (avx512) {
    reference_run_avx512(first, n, half, bf);
    return;
  }
#endif
  reference_run_body(first, n, half, bf);
}

// ---- Bookkeeping ---------------------------------------------------------------

// Counts mismatches from many threads and keeps the first few of each path
// (scalar, or host_convert under one instruction set) for the report.
class Mismatches {
 public:
  static constexpr std::size_t kKeepPerPath = 4;

  void record(const std::string& path, std::uint32_t input, std::uint32_t got, std::uint32_t want) {
    count_.fetch_add(1, std::memory_order_relaxed);
    char line[96];
    std::snprintf(line, sizeof line, "input 0x%08x gave 0x%08x, reference 0x%08x", input, got, want);
#pragma omp critical(zero_test_mismatch_report)
    {
      std::vector<std::string>& lines = by_path_[path];
      if (lines.size() < kKeepPerPath) lines.push_back(line);
    }
  }
  std::uint64_t count() const { return count_.load(); }
  std::string report() const {
    std::string s = std::string("reference: ") + reference_name + "\n";
    for (const auto& [path, lines] : by_path_)
      for (const std::string& l : lines) s += path + ": " + l + "\n";
    return s;
  }

 private:
  std::atomic<std::uint64_t> count_{0};
  std::map<std::string, std::vector<std::string>> by_path_;
};

// Restores the instruction set that was active when the test began (the best
// the CPU has, unless ZERO_HOST_ISA says otherwise), even when a REQUIRE fails.
struct IsaGuard {
  zero::simd::IsaLevel saved = zero::simd::active_isa();
  ~IsaGuard() { zero::simd::force_isa(saved); }
};

template <class From, class To>
std::string path_name(zero::simd::IsaLevel isa) {
  return std::string("host_convert<") + zero::dtype_traits<From>::name + "," + zero::dtype_traits<To>::name + ">[" +
         zero::simd::isa_name(isa) + "]";
}

std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }
std::uint32_t bits_of(fp16 h) { return h.bits; }
std::uint32_t bits_of(bf16 b) { return b.bits; }

int thread_index() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

int thread_count() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Counts where got differs from want (a loop that vectorises); only when
// there are some does a second pass name the first few.
template <class Got>
std::uint64_t count_and_record(const Got* got, const std::uint16_t* want, std::size_t n, std::uint64_t first_input,
                               const char* path, const char* isa, Mismatches& bad) {
  std::uint32_t wrong = 0;  // n is a piece, far below 2^32
  for (std::size_t i = 0; i < n; ++i) wrong += got[i].bits != want[i] ? 1u : 0u;
  if (wrong != 0) {
    const std::string name = std::string(path) + (isa[0] != '\0' ? std::string("[") + isa + "]" : std::string());
    std::size_t named = 0;
    for (std::size_t i = 0; i < n && named < Mismatches::kKeepPerPath; ++i) {
      if (got[i].bits != want[i]) {
        bad.record(name, static_cast<std::uint32_t>(first_input + i), got[i].bits, want[i]);
        ++named;
      }
    }
  }
  return wrong;
}

}  // namespace

TEST_CASE("Every fp32 pattern rounds to fp16 and bf16 like the reference, on every path",
          "[precision][convert][exhaustive]") {
  IsaGuard guard;
  const std::vector<zero::simd::IsaLevel> isas = zero::simd::supported_isas();
  REQUIRE(isas.front() == zero::simd::IsaLevel::portable);

  // The range is walked in 256 blocks of 2^24 inputs whose reference results
  // are kept (64 MiB). force_isa is process-wide, so each pass over a block
  // (the scalar path, then host_convert under each instruction set) is one
  // OpenMP loop over pieces of 2^14 inputs, which threads take as they come
  // free: the reference is computed once per input, there are only about a
  // thousand synchronisations, and a thread the OS pauses (other builds share
  // these cores) does not hold up the rest. A piece is below host_convert's
  // threading threshold, so each call runs on the thread that makes it; the
  // odd-length case below covers the threaded splits.
  constexpr std::uint64_t total = std::uint64_t{1} << 32;
  constexpr std::size_t block = std::size_t{1} << 24;
  constexpr std::size_t piece = std::size_t{1} << 14;
  constexpr std::int64_t pieces = static_cast<std::int64_t>(block / piece);
  std::vector<std::uint16_t> want_half(block), want_bf16(block);
  struct Scratch {
    std::vector<float> src = std::vector<float>(piece);
    std::vector<fp16> half = std::vector<fp16>(piece);
    std::vector<bf16> bf = std::vector<bf16>(piece);
  };
  std::vector<Scratch> scratch(static_cast<std::size_t>(thread_count()));
  Mismatches bad;
  std::uint64_t wrong = 0;
  std::uint64_t checked_scalar = 0;
  std::uint64_t checked_batch = 0;

  for (std::uint64_t base = 0; base < total; base += block) {
    // The reference, and (a) the scalar conversions the library uses.
#pragma omp parallel for schedule(dynamic) reduction(+ : wrong, checked_scalar)
    for (std::int64_t p = 0; p < pieces; ++p) {
      Scratch& s = scratch[static_cast<std::size_t>(thread_index())];
      const std::size_t offset = static_cast<std::size_t>(p) * piece;
      const std::uint64_t first = base + offset;
      std::uint16_t* wh = want_half.data() + offset;
      std::uint16_t* wb = want_bf16.data() + offset;
      reference_run(first, piece, wh, wb);
      for (std::size_t i = 0; i < piece; ++i) {
        const float f = std::bit_cast<float>(static_cast<std::uint32_t>(first + i));
        s.half[i] = zero::from_float<fp16>(f);
        s.bf[i] = zero::from_float<bf16>(f);
      }
      wrong += count_and_record(s.half.data(), wh, piece, first, "from_float<fp16>", "", bad);
      wrong += count_and_record(s.bf.data(), wb, piece, first, "from_float<bf16>", "", bad);
      checked_scalar += piece;
    }

    // (b) The batch converter under each instruction set.
    for (const zero::simd::IsaLevel isa : isas) {
      zero::simd::force_isa(isa);
#pragma omp parallel for schedule(dynamic) reduction(+ : wrong, checked_batch)
      for (std::int64_t p = 0; p < pieces; ++p) {
        Scratch& s = scratch[static_cast<std::size_t>(thread_index())];
        const std::size_t offset = static_cast<std::size_t>(p) * piece;
        const std::uint64_t first = base + offset;
        for (std::size_t i = 0; i < piece; ++i) s.src[i] = std::bit_cast<float>(static_cast<std::uint32_t>(first + i));
        std::fill(s.half.begin(), s.half.end(), fp16{0x5a5a});
        std::fill(s.bf.begin(), s.bf.end(), bf16{0x5a5a});
        zero::kernels::host_convert(s.src.data(), s.half.data(), piece);
        zero::kernels::host_convert(s.src.data(), s.bf.data(), piece);
        const char* name = zero::simd::isa_name(isa);
        wrong += count_and_record(s.half.data(), want_half.data() + offset, piece, first, "host_convert<fp32,fp16>", name, bad);
        wrong += count_and_record(s.bf.data(), want_bf16.data() + offset, piece, first, "host_convert<fp32,bf16>", name, bad);
        checked_batch += piece;
      }
    }
  }

  INFO(bad.report());
  CHECK(checked_scalar == total);
  CHECK(checked_batch == total * isas.size());
  REQUIRE(wrong == 0);
}

#if ZERO_TEST_CUDA_REFERENCE
TEST_CASE("The textbook fallback reference agrees with CUDA's conversions", "[precision][convert]") {
  // Without CUDA headers the exhaustive test trusts the textbook version, so
  // it is held to CUDA's here, over every input whose rounding is delicate:
  // all exponents, signs and low 16 mantissa bits (every bf16 rounding case
  // and every fp16 normal one) for the top mantissa bits at either end and in
  // the middle, and every input from fp16's subnormal range to past its
  // overflow threshold, and the exponents at the ends of fp32's range.
  std::vector<std::uint32_t> blocks;  // each block: 2^16 consecutive patterns
  for (std::uint32_t sign = 0; sign < 2; ++sign)
    for (std::uint32_t exponent = 0; exponent < 256; ++exponent)
      for (std::uint32_t top = 0; top < 128; ++top) {
        const bool edge_of_mantissa = top <= 1 || top == 0x3f || top == 0x40 || top >= 0x7e;
        const bool delicate_exponent = (exponent >= 0x65 && exponent <= 0x71) || (exponent >= 0x8e && exponent <= 0x8f) ||
                                       exponent <= 1 || exponent >= 0xfe;
        if (edge_of_mantissa || delicate_exponent) blocks.push_back((sign << 31) | (exponent << 23) | (top << 16));
      }
  std::uint64_t wrong = 0;
  Mismatches bad;
#pragma omp parallel for schedule(dynamic, 64) reduction(+ : wrong)
  for (std::int64_t k = 0; k < static_cast<std::int64_t>(blocks.size()); ++k) {
    for (std::uint32_t low = 0; low < 65536; ++low) {
      const std::uint32_t x = blocks[static_cast<std::size_t>(k)] | low;
      const std::uint16_t h = ref_float_to_half(x);
      const std::uint16_t b = ref_float_to_bf16(x);
      const std::uint16_t th = textbook_float_to_half(x);
      const std::uint16_t tb = textbook_float_to_bf16(x);
      if (th != h) {
        ++wrong;
        bad.record("textbook fp32->fp16", x, th, h);
      }
      if (tb != b) {
        ++wrong;
        bad.record("textbook fp32->bf16", x, tb, b);
      }
    }
  }
  INFO(bad.report());
  INFO(blocks.size() * 65536 << " patterns compared");
  CHECK(blocks.size() * 65536 > (std::size_t{1} << 28));
  REQUIRE(wrong == 0);
}
#endif

TEST_CASE("Every fp16 and bf16 pattern widens, narrows back and crosses over like the reference",
          "[precision][convert][exhaustive]") {
  IsaGuard guard;
  constexpr std::size_t n = 65536;
  std::vector<fp16> halves(n);
  std::vector<bf16> bf16s(n);
  for (std::size_t i = 0; i < n; ++i) {
    halves[i].bits = static_cast<std::uint16_t>(i);
    bf16s[i].bits = static_cast<std::uint16_t>(i);
  }
  Mismatches bad;

  // Scalar paths, and the reference's round trips through fp32.
  std::size_t half_nans = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint16_t p = static_cast<std::uint16_t>(i);
    const std::uint32_t hw = ref_half_to_float(p);
    const std::uint32_t bw = ref_bf16_to_float(p);
    const std::uint32_t hs = bits_of(zero::to_float(halves[i]));
    const std::uint32_t bs = bits_of(zero::to_float(bf16s[i]));
    if (hs != hw) bad.record("to_float(fp16)", p, hs, hw);
    if (bs != bw) bad.record("to_float(bf16)", p, bs, bw);
    // Back to 16 bits: every pattern returns to itself, NaNs to 0x7fff.
    const bool half_nan = (p & 0x7fffu) > 0x7c00u;
    const bool bf16_nan = (p & 0x7fffu) > 0x7f80u;
    half_nans += half_nan ? 1 : 0;
    const std::uint16_t h_back = zero::from_float<fp16>(zero::to_float(halves[i])).bits;
    const std::uint16_t b_back = zero::from_float<bf16>(zero::to_float(bf16s[i])).bits;
    if (h_back != (half_nan ? 0x7fffu : p)) bad.record("fp16 -> fp32 -> fp16", p, h_back, half_nan ? 0x7fffu : p);
    if (b_back != (bf16_nan ? 0x7fffu : p)) bad.record("bf16 -> fp32 -> bf16", p, b_back, bf16_nan ? 0x7fffu : p);
    if (half_nan && hw != 0x7fffffffu) bad.record("reference fp16 NaN -> fp32 (0x7fffffff expected)", p, hw, 0x7fffffffu);
#if ZERO_TEST_CUDA_REFERENCE
    if (textbook_half_to_float(p) != hw) bad.record("textbook fp16->fp32 (fallback reference)", p, textbook_half_to_float(p), hw);
    if (textbook_bf16_to_float(p) != bw) bad.record("textbook bf16->fp32 (fallback reference)", p, textbook_bf16_to_float(p), bw);
#endif
  }
  CHECK(half_nans == 2 * 1023);

  // Batch paths: widening, fp16 <-> bf16 (one rounding, as through the
  // reference's fp32), and same-type copies that keep every bit.
  std::vector<float> wide(n);
  std::vector<fp16> to_half(n);
  std::vector<bf16> to_bf16(n);
  for (const zero::simd::IsaLevel isa : zero::simd::supported_isas()) {
    zero::simd::force_isa(isa);
    zero::kernels::host_convert(halves.data(), wide.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint16_t p = static_cast<std::uint16_t>(i);
      if (bits_of(wide[i]) != ref_half_to_float(p)) bad.record(path_name<fp16, float>(isa), p, bits_of(wide[i]), ref_half_to_float(p));
    }
    zero::kernels::host_convert(bf16s.data(), wide.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint16_t p = static_cast<std::uint16_t>(i);
      if (bits_of(wide[i]) != ref_bf16_to_float(p)) bad.record(path_name<bf16, float>(isa), p, bits_of(wide[i]), ref_bf16_to_float(p));
    }
    zero::kernels::host_convert(halves.data(), to_bf16.data(), n);
    zero::kernels::host_convert(bf16s.data(), to_half.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint16_t p = static_cast<std::uint16_t>(i);
      const std::uint16_t hb = ref_float_to_bf16(ref_half_to_float(p));
      const std::uint16_t bh = ref_float_to_half(ref_bf16_to_float(p));
      if (to_bf16[i].bits != hb) bad.record(path_name<fp16, bf16>(isa), p, to_bf16[i].bits, hb);
      if (to_half[i].bits != bh) bad.record(path_name<bf16, fp16>(isa), p, to_half[i].bits, bh);
    }
    zero::kernels::host_convert(halves.data(), to_half.data(), n);
    zero::kernels::host_convert(bf16s.data(), to_bf16.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      if (to_half[i].bits != i) bad.record(path_name<fp16, fp16>(isa), static_cast<std::uint32_t>(i), to_half[i].bits, static_cast<std::uint32_t>(i));
      if (to_bf16[i].bits != i) bad.record(path_name<bf16, bf16>(isa), static_cast<std::uint32_t>(i), to_bf16[i].bits, static_cast<std::uint32_t>(i));
    }
  }

  INFO(bad.report());
  REQUIRE(bad.count() == 0);
}

namespace {

// Random patterns of a storage type, NaNs, infinities and subnormals included.
template <class T>
std::vector<T> random_patterns(std::size_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<T> v(n);
  for (T& x : v) {
    const std::uint32_t r = static_cast<std::uint32_t>(gen());
    if constexpr (std::is_same_v<T, float>) {
      x = std::bit_cast<float>(r);
    } else {
      x.bits = static_cast<std::uint16_t>(r);
    }
  }
  return v;
}

template <class T>
T sentinel() {
  if constexpr (std::is_same_v<T, float>) {
    return std::bit_cast<float>(0x5a5a5a5au);
  } else {
    return T{0x5a5a};
  }
}

template <class From, class To>
void check_batch_against_scalar(std::size_t n, std::size_t misalign, Mismatches& bad) {
  const std::vector<From> storage = random_patterns<From>(n + misalign, static_cast<std::uint32_t>(n * 7 + misalign));
  const From* src = storage.data() + misalign;
  std::vector<To> out(n + misalign + 1, sentinel<To>());
  To* dst = out.data() + misalign;
  zero::kernels::host_convert(src, dst, n);
  const std::string path = path_name<From, To>(zero::simd::active_isa()) + " n=" + std::to_string(n) +
                           " misalign=" + std::to_string(misalign);
  for (std::size_t i = 0; i < n; ++i) {
    // Same type: a bit copy. Otherwise: what the exhaustively checked scalar
    // conversions give.
    To want;
    if constexpr (std::is_same_v<From, To>) {
      want = src[i];
    } else {
      want = zero::from_float<To>(zero::to_float(src[i]));
    }
    if (bits_of(dst[i]) != bits_of(want)) bad.record(path, bits_of(src[i]), bits_of(dst[i]), bits_of(want));
  }
  for (std::size_t i = 0; i < misalign; ++i)
    if (bits_of(out[i]) != bits_of(sentinel<To>())) bad.record(path + " wrote before dst", 0, bits_of(out[i]), bits_of(sentinel<To>()));
  if (bits_of(out[n + misalign]) != bits_of(sentinel<To>()))
    bad.record(path + " wrote past the end", 0, bits_of(out[n + misalign]), bits_of(sentinel<To>()));
}

template <class From>
void check_all_targets(std::size_t n, std::size_t misalign, Mismatches& bad) {
  check_batch_against_scalar<From, float>(n, misalign, bad);
  check_batch_against_scalar<From, fp16>(n, misalign, bad);
  check_batch_against_scalar<From, bf16>(n, misalign, bad);
}

}  // namespace

TEST_CASE("host_convert handles every type pair, odd lengths, unaligned buffers and thread splits",
          "[precision][convert]") {
  IsaGuard guard;
  Mismatches bad;
  // Lengths around the pack widths (8, 16), the 64-element thread grain and
  // the 2^15 elements from which the work is split across threads.
  const std::size_t lengths[] = {0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 32767, 32768, 32769, (1u << 17) + 13};
  for (const zero::simd::IsaLevel isa : zero::simd::supported_isas()) {
    zero::simd::force_isa(isa);
    for (const std::size_t n : lengths) {
      for (const std::size_t misalign : {std::size_t{0}, std::size_t{1}, std::size_t{3}}) {
        check_all_targets<float>(n, misalign, bad);
        check_all_targets<fp16>(n, misalign, bad);
        check_all_targets<bf16>(n, misalign, bad);
      }
    }
  }
  INFO(bad.report());
  REQUIRE(bad.count() == 0);
}

TEST_CASE("Named values convert as IEEE 754 and CUDA specify", "[precision][convert]") {
  IsaGuard guard;
  auto h = [](float f) { return zero::from_float<fp16>(f).bits; };
  auto b = [](float f) { return zero::from_float<bf16>(f).bits; };
  auto f_of = [](std::uint32_t bits) { return std::bit_cast<float>(bits); };
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();

  // fp16 top of the range: 65504 is the largest finite; 65520 is the tie
  // between 65504 (odd mantissa) and 65536 (not representable), so it goes to inf.
  CHECK(h(65504.0f) == 0x7bff);
  CHECK(h(f_of(0x477fefffu)) == 0x7bff);  // just below 65520
  CHECK(h(65520.0f) == 0x7c00);
  CHECK(h(-65520.0f) == 0xfc00);
  CHECK(h(1e9f) == 0x7c00);
  CHECK(h(inf) == 0x7c00);
  CHECK(h(-inf) == 0xfc00);
  CHECK(h(nan) == 0x7fff);
  CHECK(h(-nan) == 0x7fff);
  CHECK(h(f_of(0x7f800001u)) == 0x7fff);  // signalling NaN

  // fp16 bottom of the range.
  CHECK(h(0.0f) == 0x0000);
  CHECK(h(-0.0f) == 0x8000);
  CHECK(h(std::ldexp(1.0f, -14)) == 0x0400);               // smallest normal
  CHECK(h(std::ldexp(1023.0f, -24)) == 0x03ff);            // largest subnormal
  CHECK(h(std::ldexp(1.0f, -24)) == 0x0001);               // smallest subnormal
  CHECK(h(-std::ldexp(1.0f, -24)) == 0x8001);
  CHECK(h(std::ldexp(1.0f, -25)) == 0x0000);               // tie 0 / 2^-24: to even, zero
  CHECK(h(-std::ldexp(1.0f, -25)) == 0x8000);
  CHECK(h(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);  // just above the tie
  CHECK(h(std::ldexp(3.0f, -25)) == 0x0002);               // tie 1 / 2 units: to even, 2
  CHECK(h(std::ldexp(5.0f, -25)) == 0x0002);               // tie 2 / 3 units: to even, 2
  CHECK(h(std::ldexp(2047.0f, -25)) == 0x0400);            // tie largest subnormal / smallest normal
  CHECK(h(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(h(-std::numeric_limits<float>::denorm_min()) == 0x8000);
  CHECK(h(std::numeric_limits<float>::min()) == 0x0000);

  // fp16 normal ties: 1 + 2^-11 lies halfway between 1 and 1 + 2^-10.
  CHECK(h(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);
  CHECK(h(1.0f + std::ldexp(3.0f, -11)) == 0x3c02);
  CHECK(h(2049.0f) == 0x6800);  // 2048 and 2050 are neighbours: tie to even 2048
  CHECK(h(2051.0f) == 0x6802);  // tie to even 2052

  // fp16 -> fp32.
  CHECK(zero::to_float(fp16{0x0001}) == std::ldexp(1.0f, -24));
  CHECK(zero::to_float(fp16{0x8001}) == -std::ldexp(1.0f, -24));
  CHECK(zero::to_float(fp16{0x03ff}) == std::ldexp(1023.0f, -24));
  CHECK(zero::to_float(fp16{0x7bff}) == 65504.0f);
  CHECK(zero::to_float(fp16{0x7c00}) == inf);
  CHECK(zero::to_float(fp16{0xfc00}) == -inf);
  CHECK(bits_of(zero::to_float(fp16{0x8000})) == 0x80000000u);
  CHECK(bits_of(zero::to_float(fp16{0x7e00})) == 0x7fffffffu);
  CHECK(bits_of(zero::to_float(fp16{0xfc01})) == 0x7fffffffu);

  // bf16: round to nearest even on the 16 dropped bits, no saturation.
  CHECK(b(1.0f) == 0x3f80);
  CHECK(b(f_of(0x3f808000u)) == 0x3f80);  // 1 + 2^-8: tie to even, down
  CHECK(b(f_of(0x3f818000u)) == 0x3f82);  // 1 + 3*2^-8: tie to even, up
  CHECK(b(f_of(0x3f808001u)) == 0x3f81);  // just above the tie
  CHECK(b(f_of(0x3f807fffu)) == 0x3f80);  // just below
  CHECK(b(-0.0f) == 0x8000);
  CHECK(b(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(b(f_of(0x00008000u)) == 0x0000);  // subnormal tie to even
  CHECK(b(f_of(0x00018000u)) == 0x0002);
  CHECK(b(f_of(0x7f7f7fffu)) == 0x7f7f);  // largest finite bf16
  CHECK(b(f_of(0x7f7f8000u)) == 0x7f80);  // tie above it: to even, inf
  CHECK(b(std::numeric_limits<float>::max()) == 0x7f80);
  CHECK(b(-std::numeric_limits<float>::max()) == 0xff80);
  CHECK(b(inf) == 0x7f80);
  CHECK(b(-inf) == 0xff80);
  CHECK(b(nan) == 0x7fff);
  CHECK(b(-nan) == 0x7fff);
  CHECK(b(f_of(0x7fffffffu)) == 0x7fff);  // would carry into the sign if treated as a number
  CHECK(bits_of(zero::to_float(bf16{0x0001})) == 0x00010000u);
  CHECK(bits_of(zero::to_float(bf16{0xffc1})) == 0xffc10000u);  // bf16 NaN payload survives, as in CUDA

  // The batch paths on the same named values.
  const std::vector<float> named = {65504.0f, 65520.0f, std::ldexp(1.0f, -25), std::ldexp(3.0f, -25), -0.0f,
                                    f_of(0x3f808000u), f_of(0x3f818000u), inf, -inf, nan};
  for (const zero::simd::IsaLevel isa : zero::simd::supported_isas()) {
    zero::simd::force_isa(isa);
    // Padded to 2 packs so the SIMD loop, not the scalar tail, handles them.
    std::vector<float> in(32, 1.0f);
    std::copy(named.begin(), named.end(), in.begin());
    std::vector<fp16> oh(in.size());
    std::vector<bf16> ob(in.size());
    zero::kernels::host_convert(in.data(), oh.data(), in.size());
    zero::kernels::host_convert(in.data(), ob.data(), in.size());
    INFO("isa " << zero::simd::isa_name(isa));
    const std::uint16_t want_h[] = {0x7bff, 0x7c00, 0x0000, 0x0002, 0x8000, 0x3c04, 0x3c0c, 0x7c00, 0xfc00, 0x7fff};
    const std::uint16_t want_b[] = {0x4780, 0x4780, 0x3300, 0x33c0, 0x8000, 0x3f80, 0x3f82, 0x7f80, 0xff80, 0x7fff};
    for (std::size_t i = 0; i < named.size(); ++i) {
      INFO("value " << named[i]);
      CHECK(oh[i].bits == want_h[i]);
      CHECK(ob[i].bits == want_b[i]);
    }
  }
}
