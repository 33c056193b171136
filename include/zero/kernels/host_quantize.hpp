// Why: ZeRO++'s payloads on the host (qwZ's int8 parameters, qgZ's int4
// gradients, hpZ's int8 copy): the loops that quantize and dequantize them
// ran at a tenth of their bytes' bandwidth for bf16 and a fortieth for fp16
// (bench_quant_host, 2026-12-05), compiled for whatever the user's flags
// allow (plain x86-64: SSE2, no F16C, so every fp16 value was converted in
// software). Like the optimizer step they are bodies compiled once per
// instruction set and chosen at run time (zero/simd/dispatch.hpp), on packs
// of fp32 lanes with the library's exact conversions; the per-element
// arithmetic is quant/symmetric.hpp's (the CUDA kernels' too), so every
// instruction set writes the same bytes. A block without an infinity or NaN
// (nearly all) skips the NaN screens and bf16 goes to int8 four packs at a
// time, which brought bf16 quantize to 0.8-0.9 of its probe
// (bench/results/2026-12-05-host-quantizer-isa.md).
#pragma once

#include "zero/compiler.hpp"

#if ZERO_HOST_SIMD_X86
#include <immintrin.h>
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "zero/math.hpp"
#include "zero/precision/convert.hpp"
#include "zero/quant/symmetric.hpp"
#include "zero/simd/dispatch.hpp"
#include "zero/simd/pack.hpp"

namespace zero::kernels::detail {

#if ZERO_HOST_SIMD_X86
// Signed 32-bit lanes of an instruction set's pack.
template <class Isa>
using SignedLanes = std::conditional_t<Isa::width == 16, std::int32_t __attribute__((vector_size(64))),
                                       std::int32_t __attribute__((vector_size(32)))>;

// quant::symmetric_code on a pack: the same IEEE operations lane by lane (a
// product no compiler may contract, the NaN mask, the two rounding
// additions), so the codes are the scalar loop's. In a Finite block (no
// infinity or NaN among its values, so a finite largest magnitude and a
// finite product in every lane) the NaN mask has nothing to do and is left
// out, and the rounding is the conversion's own, to nearest even: the same
// integer as the two additions wherever |t| < 2^22 (here |t| <= L (1 +
// 2^-22)), in one instruction instead of three.
template <class Isa, bool Finite = false>
ZERO_FORCE_INLINE void symmetric_codes(const simd::Pack<Isa>& y, float inverse, SignedLanes<Isa>& q) {
  using U = typename Isa::U;
  const simd::Pack<Isa> t = y * simd::broadcast<Isa>(inverse);
  if constexpr (Finite) {
    U r;
    Isa::round_to_int(r, t.v);
    q = (SignedLanes<Isa>)r;
  } else {
    const U bits = (U)t.v;
    const U nan = (U)((bits & 0x7fffffffu) > 0x7f800000u);  // all ones for a NaN
    const typename Isa::F kept = (typename Isa::F)(bits & ~nan);
    constexpr float round = 12582912.0f;
    const typename Isa::F r = (kept + round) - round;
    q = __builtin_convertvector(r, SignedLanes<Isa>);
  }
}

// W int4 codes (lanes of q, in [-8, 7]) packed into W / 2 bytes at p, two to
// a byte, the even element's in the low nibble (quant::pack_int4).
template <class Isa>
ZERO_FORCE_INLINE void store_int4(std::uint8_t* p, const SignedLanes<Isa>& q) {
  __m128i w;
  Isa::narrow_u8(w, (typename Isa::U)q);  // in a register: no store read back
  // As 16-bit words: the even code in the low byte, the odd one in the high.
  const __m128i packed = _mm_or_si128(_mm_and_si128(w, _mm_set1_epi16(0x0F)),
                                      _mm_and_si128(_mm_srli_epi16(w, 4), _mm_set1_epi16(0xF0)));
  const __m128i bytes = _mm_packus_epi16(packed, packed);
  if constexpr (Isa::width == 16) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), bytes);
  } else {
    const std::int32_t four = _mm_cvtsi128_si32(bytes);
    std::memcpy(p, &four, sizeof four);
  }
}
#endif

// A vector of `Bytes` bytes of Lane. (The typedef form: g++ 12 ignores
// vector_size on an alias of a dependent type or size.)
template <class Lane, std::size_t Bytes>
struct VectorOf {
  typedef Lane type __attribute__((vector_size(Bytes)));
};

// The largest lane of an unsigned vector: its halves folded down to one lane.
template <class V>
ZERO_FORCE_INLINE auto largest_lane(const V& v) {
  using Lane = std::remove_cvref_t<decltype(v[0])>;
  if constexpr (sizeof(V) == sizeof(Lane)) {
    return static_cast<Lane>(v[0]);
  } else {
    using Half = typename VectorOf<Lane, sizeof(V) / 2>::type;
    Half low, high;
    std::memcpy(&low, &v, sizeof(Half));
    std::memcpy(&high, reinterpret_cast<const unsigned char*>(&v) + sizeof(Half), sizeof(Half));
    return largest_lane(low > high ? low : high);
  }
}

// quant::host_quantize's body: per block, the largest magnitude, then codes
// (and residuals). On packs the last partial pack of a block goes through
// the same pack code, from and to zero-padded copies: g++ vectorises a
// scalar tail with fused multiply-adds where the target has them, through
// math::mul's barrier, which changed a residual's or a sum's last bit.
template <class T>
struct QuantizeBody {
  template <class Isa>
  ZERO_FLATTEN static void run(const T* x, float* residual, std::size_t n, const quant::Format& f, void* payload) {
#if ZERO_HOST_SIMD_X86
    if constexpr (Isa::width > 1) {
      packs<Isa>(x, residual, n, f, payload);
      return;
    }
#endif
    const quant::PayloadView p = quant::PayloadView::at(payload, n, f);
    const int levels = f.levels();
    for (std::size_t b = 0; b < f.blocks(n); ++b) {
      const std::size_t begin = b * f.block, end = f.block_end(b, n);
      std::int32_t largest = 0;
      for (std::size_t i = begin; i < end; ++i) {
        const std::int32_t m = quant::magnitude_bits(quant::fed(x, residual, i));
        largest = m > largest ? m : largest;
      }
      const float absmax = quant::magnitude_of(largest);
      const float inverse = quant::symmetric_inverse(absmax, levels);
      const float scale = quant::symmetric_scale(absmax, levels);
      if (f.bits == 8) {
        for (std::size_t i = begin; i < end; ++i) quant::quantize_int8_at(x, residual, i, inverse, scale, p.codes);
      } else {  // begin is even: the block's bytes are its own
        for (std::size_t i = begin; i < end; i += 2)
          quant::quantize_int4_at(x, residual, i, end, inverse, scale, p.codes);
      }
      p.scales[b] = scale;
    }
  }

#if ZERO_HOST_SIMD_X86
  template <class Isa>
  ZERO_FLATTEN static void packs(const T* x, float* residual, std::size_t n, const quant::Format& f, void* payload) {
    using U = typename Isa::U;
    constexpr int W = Isa::width;
    const quant::PayloadView p = quant::PayloadView::at(payload, n, f);
    const int levels = f.levels();
    for (std::size_t b = 0; b < f.blocks(n); ++b) {
      const std::size_t begin = b * f.block, end = f.block_end(b, n);
      const std::size_t whole = begin + (end - begin) / W * W, rest = end - whole;
      // The partial pack, zero-padded (zeros change neither the maximum nor
      // the codes kept).
      T x_tail[W] = {};
      float residual_tail[W] = {};
      std::uint8_t codes_tail[W] = {};
      for (std::size_t l = 0; l < rest; ++l) {
        x_tail[l] = x[whole + l];
        if (residual != nullptr) residual_tail[l] = residual[whole + l];
      }
      float* const tail_residual = residual != nullptr ? residual_tail : nullptr;
      // The largest magnitude, first without screening NaNs (a 16-bit type
      // without a residual over its storage bits themselves: see
      // largest_half_magnitude_bits); a block whose largest bits are an
      // infinity's or a NaN's is folded again with them screened out.
      U most[2] = {};  // two chains of maxima, so each waits on half the loads
      auto fold = [&](auto screen, int c, const T* xs, const float* rs) ZERO_FLATTEN {
        U m = (U)fed<Isa>(xs, rs).v & 0x7fffffffu;
        if constexpr (decltype(screen)::value) m &= ~(U)(m > 0x7f800000u);  // a NaN is 0
        most[c] = m > most[c] ? m : most[c];
      };
      auto fold_block = [&](auto screen) ZERO_FLATTEN {
        most[0] = most[1] = U{};
        std::size_t i = begin;
        for (; i + 2 * W <= whole; i += 2 * W) {
          fold(screen, 0, x + i, residual != nullptr ? residual + i : nullptr);
          fold(screen, 1, x + i + W, residual != nullptr ? residual + i + W : nullptr);
        }
        if (i < whole) fold(screen, 0, x + i, residual != nullptr ? residual + i : nullptr);
        if (rest != 0) fold(screen, 1, x_tail, tail_residual);
        most[0] = most[1] > most[0] ? most[1] : most[0];
        return static_cast<std::uint32_t>(largest_lane(most[0]));
      };
      std::uint32_t largest = 0;
      if constexpr (sizeof(T) == 2)
        largest = residual == nullptr ? largest_half_magnitude_bits<Isa>(x + begin, end - begin)
                                      : fold_block(std::false_type{});
      else
        largest = fold_block(std::false_type{});
      const bool finite = largest < 0x7f800000u;
      if (!finite) largest = fold_block(std::true_type{});
      const float absmax = __builtin_bit_cast(float, largest);
      const float inverse = quant::symmetric_inverse(absmax, levels);
      const float scale = quant::symmetric_scale(absmax, levels);
      // Codes (int4: W codes in W / 2 bytes; packs start even) and residuals.
      auto code = [&](auto finite_block, const T* xs, float* rs, std::uint8_t* codes) ZERO_FLATTEN {
        const simd::Pack<Isa> y = fed<Isa>(xs, rs);
        SignedLanes<Isa> q;
        symmetric_codes<Isa, decltype(finite_block)::value>(y, inverse, q);
        if (f.bits == 8)
          simd::store_u8_narrowed<Isa>(codes, (U)q);
        else
          store_int4<Isa>(codes, q);
        if (rs != nullptr) {
          const simd::Pack<Isa> value{__builtin_convertvector(q, typename Isa::F)};
          simd::store(rs, y - value * simd::broadcast<Isa>(scale));
        }
      };
      auto code_block = [&](auto finite_block) ZERO_FLATTEN {
        std::size_t i = begin;
        // bf16 to int8 (qwZ's parameters, hpZ's copy), four packs at a
        // time: unpacking bf16 bits beside zeros makes the fp32 values and
        // the saturating packs make the bytes, in half the instructions of
        // widening and narrowing each pack; the packs put back in order
        // the lanes the unpacks interleave.
        if constexpr (decltype(finite_block)::value && std::is_same_v<T, bf16>)
          if (residual == nullptr && f.bits == 8)
            for (; i + 4 * W <= whole; i += 4 * W) {
              simd::Pack<Isa> y[4];
              Isa::load_bf16_interleaved(y[0].v, y[1].v, x + i);
              Isa::load_bf16_interleaved(y[2].v, y[3].v, x + i + 2 * W);
              SignedLanes<Isa> q[4];
              for (int k = 0; k < 4; ++k) symmetric_codes<Isa, true>(y[k], inverse, q[k]);
              Isa::store_s8_interleaved(p.codes + i, (U)q[0], (U)q[1], (U)q[2], (U)q[3]);
            }
        for (; i < whole; i += W)
          code(finite_block, x + i, residual != nullptr ? residual + i : nullptr, p.codes + (f.bits == 8 ? i : i / 2));
        if (rest != 0) code(finite_block, x_tail, tail_residual, codes_tail);
      };
      if (finite)
        code_block(std::true_type{});
      else
        code_block(std::false_type{});
      if (rest != 0) {
        std::memcpy(p.codes + (f.bits == 8 ? whole : whole / 2), codes_tail, f.bits == 8 ? rest : (rest + 1) / 2);
        if (residual != nullptr) std::memcpy(residual + whole, residual_tail, rest * sizeof(float));
      }
      p.scales[b] = scale;
    }
  }

  // quant::fed on a pack: x, plus the residual where there is one.
  template <class Isa>
  static ZERO_FORCE_INLINE simd::Pack<Isa> fed(const T* x, const float* residual) {
    const simd::Pack<Isa> v = simd::load<Isa>(x);
    return residual != nullptr ? v + simd::load<Isa>(residual) : v;
  }

  // The fp32 bits of the largest magnitude among the 16-bit values
  // x[0, count), NaNs not screened out: at least an infinity's bits
  // (0x7f800000) where there is an infinity or a NaN. Over the storage bits
  // themselves: bf16's and fp16's magnitudes order as their bits without
  // the sign, compared unsigned, so a pack's bytes fold twice the lanes of
  // fp32 values, unconverted, and only the largest is converted (exactly).
  template <class Isa>
  static ZERO_FORCE_INLINE std::uint32_t largest_half_magnitude_bits(const T* x, std::size_t count) {
    static_assert(sizeof(T) == 2);
    using V = typename VectorOf<std::uint16_t, sizeof(typename Isa::U)>::type;
    constexpr std::size_t lanes = sizeof(V) / 2;
    V most{};
    auto fold = [&](V& v) ZERO_FLATTEN {
      v &= 0x7fffu;
      most = v > most ? v : most;
    };
    std::size_t i = 0;
    for (; i + lanes <= count; i += lanes) {
      V v;
      std::memcpy(&v, x + i, sizeof v);
      fold(v);
    }
    if (i < count) {
      V v{};
      std::memcpy(&v, x + i, (count - i) * sizeof(T));
      fold(v);
    }
    // An fp16 NaN or infinity stays one.
    return __builtin_bit_cast(std::uint32_t, to_float(T{largest_lane(most)}));
  }
#endif
};

#if ZERO_HOST_SIMD_X86
// The values of W codes from element i of a payload (int4: i even).
template <class Isa>
ZERO_FORCE_INLINE simd::Pack<Isa> code_values(const std::uint8_t* codes, std::size_t i, int bits, float scale) {
  using U = typename Isa::U;
  U u;
  if (bits == 8) {
    simd::load_u8_widened<Isa>(u, codes + i);
  } else {
    // Each code in a byte's top four bits, in element order: the packed
    // bytes' low nibbles shifted up, interleaved with their high nibbles.
    std::uint64_t packed = 0;
    std::memcpy(&packed, codes + i / 2, Isa::width / 2);
    const __m128i v = _mm_cvtsi64_si128(static_cast<long long>(packed)), top = _mm_set1_epi8(static_cast<char>(0xF0));
    alignas(16) std::uint8_t nibbles[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(nibbles),
                    _mm_unpacklo_epi8(_mm_and_si128(_mm_slli_epi16(v, 4), top), _mm_and_si128(v, top)));
    simd::load_u8_widened<Isa>(u, nibbles);
  }
  // Sign-extended: the byte's value (int8), or its top nibble's (int4).
  u = (U)((SignedLanes<Isa>)(u << 24) >> (bits == 8 ? 24 : 28));
  const simd::Pack<Isa> q{__builtin_convertvector((SignedLanes<Isa>)u, typename Isa::F)};
  return q * simd::broadcast<Isa>(scale);
}

// Each block's whole packs of codes, then its partial pack from a
// zero-padded copy of its codes: visit(values, first element, count).
template <class Isa, class Visit>
ZERO_FORCE_INLINE ZERO_FLATTEN void each_pack_of_values(const quant::ConstPayloadView& p, std::size_t n,
                                                        const quant::Format& f, Visit&& visit) {
  constexpr int W = Isa::width;
  for (std::size_t b = 0; b < f.blocks(n); ++b) {
    const std::size_t begin = b * f.block, end = f.block_end(b, n);
    const std::size_t whole = begin + (end - begin) / W * W, rest = end - whole;
    const float scale = p.scales[b];
    for (std::size_t i = begin; i < whole; i += W)
      visit(code_values<Isa>(p.codes, i, f.bits, scale), i, std::size_t{W});
    if (rest != 0) {
      std::uint8_t codes[W] = {};
      std::memcpy(codes, p.codes + (f.bits == 8 ? whole : whole / 2), f.bits == 8 ? rest : (rest + 1) / 2);
      visit(code_values<Isa>(codes, 0, f.bits, scale), whole, rest);
    }
  }
}
#endif

template <class T>
struct DequantizeBody {
  template <class Isa>
  ZERO_FLATTEN static void run(const void* payload, std::size_t n, const quant::Format& f, T* out) {
    const quant::ConstPayloadView p = quant::ConstPayloadView::at(payload, n, f);
#if ZERO_HOST_SIMD_X86
    if constexpr (Isa::width > 1) {
      each_pack_of_values<Isa>(p, n, f,
                               [&](const simd::Pack<Isa>& v, std::size_t i, std::size_t count) ZERO_FLATTEN_INLINE {
        if (count == Isa::width) {
          simd::store(out + i, v);
          return;
        }
        T tail[Isa::width];
        simd::store(tail, v);
        std::memcpy(out + i, tail, count * sizeof(T));
      });
      return;
    }
#endif
    for (std::size_t b = 0; b < f.blocks(n); ++b) {
      const std::size_t begin = b * f.block, end = f.block_end(b, n);
      for (std::size_t i = begin; i < end; ++i)
        out[i] = from_float<T>(quant::symmetric_value(quant::code_at(p.codes, i, f.bits), p.scales[b]));
    }
  }
};

struct DequantizeSumBody {
  template <class Isa>
  ZERO_FLATTEN static void run(const void* payloads, std::size_t count, std::size_t payload_stride, std::size_t n,
                               const quant::Format& f, float* out) {
    for (std::size_t k = 0; k < count; ++k) {
      const quant::ConstPayloadView p =
          quant::ConstPayloadView::at(static_cast<const std::uint8_t*>(payloads) + k * payload_stride, n, f);
#if ZERO_HOST_SIMD_X86
      if constexpr (Isa::width > 1) {
        each_pack_of_values<Isa>(p, n, f,
                                 [&](const simd::Pack<Isa>& v, std::size_t i,
                                     std::size_t elements) ZERO_FLATTEN_INLINE {
          if (elements == Isa::width) {
            simd::store(out + i, k == 0 ? v : simd::load<Isa>(out + i) + v);
            return;
          }
          float sum[Isa::width] = {};
          if (k != 0) std::memcpy(sum, out + i, elements * sizeof(float));
          simd::store(sum, k == 0 ? v : simd::load<Isa>(sum) + v);
          std::memcpy(out + i, sum, elements * sizeof(float));
        });
        continue;
      }
#endif
      for (std::size_t b = 0; b < f.blocks(n); ++b) {
        const std::size_t begin = b * f.block, end = f.block_end(b, n);
        for (std::size_t i = begin; i < end; ++i) {
          const float v = quant::symmetric_value(quant::code_at(p.codes, i, f.bits), p.scales[b]);
          out[i] = k == 0 ? v : out[i] + v;
        }
      }
    }
  }
};

}  // namespace zero::kernels::detail

namespace zero::quant {

// Host loops over one payload, on the instruction set simd::active_isa()
// names, one thread (the engine calls them per piece). quantize: x[0, n) of
// a storage type (plus residual[0, n), replaced by the new error, where it
// is not null) into the payload. dequantize: back into out[0, n) as T
// (rounded to nearest even from the fp32 value). dequantize_sum: out[0, n)
// = the sum of `count` payloads of n elements, payload_stride bytes apart,
// added in fp32 in their order (the CUDA kernel's order).
template <class T>
void host_quantize(const T* x, float* residual, std::size_t n, const Format& f, void* payload) {
  simd::dispatch<kernels::detail::QuantizeBody<T>>(simd::active_isa(), x, residual, n, f, payload);
}

template <class T>
void host_dequantize(const void* payload, std::size_t n, const Format& f, T* out) {
  simd::dispatch<kernels::detail::DequantizeBody<T>>(simd::active_isa(), payload, n, f, out);
}

inline void host_dequantize_sum(const void* payloads, std::size_t count, std::size_t payload_stride, std::size_t n,
                                const Format& f, float* out) {
  simd::dispatch<kernels::detail::DequantizeSumBody>(simd::active_isa(), payloads, count, payload_stride, n, f, out);
}

}  // namespace zero::quant
