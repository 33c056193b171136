// Why: the host optimizer step is memory-bound only if its arithmetic keeps
// up, and with a user's plain -O2 build (math-errno on, no -march) g++ will
// neither vectorise sqrt nor use AVX. So the host kernels run on explicit
// packs of float lanes (GCC vector extensions) and are compiled several
// times, once per instruction set, behind target attributes (see
// zero/simd/dispatch.hpp). Arithmetic on a pack is generic vector code; the
// operations with no generic form (sqrt, fma, F16C conversions, gathers), or
// whose generic form the compilers lower poorly (16- and 8-bit widening and
// narrowing, rounding to int), come from the instruction-set descriptor Isa.
#pragma once

#include "zero/compiler.hpp"

#if ZERO_HOST_SIMD_X86

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "zero/math.hpp"
#include "zero/precision/convert.hpp"
#include "zero/precision/remainder.hpp"
#include "zero/precision/types.hpp"

namespace zero::simd {

// Instruction-set descriptors. Their functions take references, never vector
// values: if a call is not inlined (e.g. at -O0) no vector crosses a function
// boundary between code compiled for different targets, so the ABI matches.
struct Avx512 {
  static constexpr int width = 16;
  static constexpr const char* name = "avx512";
  using F = float __attribute__((vector_size(64)));
  using U = std::uint32_t __attribute__((vector_size(64)));
  using H = std::uint16_t __attribute__((vector_size(32)));
  __attribute__((target("avx512f"))) static inline void sqrt(F& x) {
#if defined(__clang__)
    x = (F)_mm512_sqrt_ps((__m512)x);
#else
    // g++'s builtin with x as pass-through: the intrinsic's undefined source trips -Wmaybe-uninitialized.
    x = (F)__builtin_ia32_sqrtps512_mask((__v16sf)x, (__v16sf)x, (__mmask16)-1, _MM_FROUND_CUR_DIRECTION);
#endif
  }
  // A product no compiler may fuse with a later add. g++ contracts across
  // statements (-ffp-contract=fast is its default), so it gets the
  // rounding-mode builtin, which is opaque to contraction (an assoc barrier on
  // 512-bit vectors would make g++ 12 split the vector into lanes). Clang
  // contracts only within one expression (-ffp-contract=on), never a product
  // returned from a function, and has no such builtin.
  __attribute__((target("avx512f"))) static inline void mul(F& r, const F& a, const F& b) {
#if defined(__clang__)
    r = a * b;
#else
    r = (F)__builtin_ia32_mulps512_mask((__v16sf)a, (__v16sf)b, (__v16sf)a, (__mmask16)-1, _MM_FROUND_CUR_DIRECTION);
#endif
  }
  // Non-temporal store of 16 lanes of 16 bits (p 32-byte aligned), and the
  // fence that orders such stores before the data is handed to other threads.
  __attribute__((target("avx"))) static inline void stream(void* p, const H& h) {
    _mm256_stream_si256(static_cast<__m256i*>(p), (__m256i)h);
  }
  static inline void stream_fence() { _mm_sfence(); }
  // r[l] = base[idx[l]] (the 8-bit state's code tables), and the byte at
  // base + idx[l] (4 bytes are read: base needs 3 bytes of padding).
  __attribute__((target("avx512f"))) static inline void gather(F& r, const float* base, const U& idx) {
    // (the masked form with a zero source: the plain one's undefined source
    // trips g++'s -Wmaybe-uninitialized)
    r = (F)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), (__mmask16)-1, (__m512i)idx, base, 4);
  }
  __attribute__((target("avx512f"))) static inline void gather_bytes(U& r, const std::uint8_t* base, const U& idx) {
    r = (U)_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)-1, (__m512i)idx, base, 1) & 0xffu;
  }
  __attribute__((target("avx512f"))) static inline void fma(F& r, const F& a, const F& b, const F& c) {
    r = (F)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
  }
  // 16 bytes to 32-bit lanes (zero-extended), and back (each lane's low
  // byte): one instruction each, which g++ 12 does not find for a generic
  // __builtin_convertvector (it narrows lane by lane).
  __attribute__((target("avx512f"))) static inline void widen_u8(U& r, const std::uint8_t* p) {
    r = (U)_mm512_maskz_cvtepu8_epi32((__mmask16)-1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  __attribute__((target("avx512f"))) static inline void narrow_u8(std::uint8_t* p, const U& u) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_maskz_cvtepi32_epi8((__mmask16)-1, (__m512i)u));
  }
  // The same bytes as the first 16 of a register, to be packed further
  // without a trip through memory (a narrow store read back as one 16-byte
  // load stalls on store forwarding).
  __attribute__((target("avx512f"))) static inline void narrow_u8(__m128i& r, const U& u) {
    r = _mm512_maskz_cvtepi32_epi8((__mmask16)-1, (__m512i)u);
  }
  // 16 lanes of 16 bits to 32-bit lanes (zero-extended), and back (each
  // lane's low 16 bits): one instruction each, where g++ 12 makes a generic
  // __builtin_convertvector five (two half-width widenings and an insert)
  // in every bf16 load of the step and the quantizer.
  __attribute__((target("avx512f"))) static inline void widen_u16(U& r, const void* p) {
    r = (U)_mm512_maskz_cvtepu16_epi32((__mmask16)-1, _mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
  __attribute__((target("avx512f"))) static inline void narrow_u16(H& h, const U& u) {
    h = (H)_mm512_maskz_cvtepi32_epi16((__mmask16)-1, (__m512i)u);
  }
  // Each lane rounded to the nearest integer, ties to even (as a signed
  // 32-bit lane).
  __attribute__((target("avx512f"))) static inline void round_to_int(U& q, const F& f) {
    q = (U)_mm512_maskz_cvt_roundps_epi32((__mmask16)-1, (__m512)f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // 2W bf16 values at p as fp32 in two packs, their lanes interleaved as
  // the unpack instructions leave them: in each 128 bits, lo holds
  // elements 8L .. 8L + 3 and hi 8L + 4 .. 8L + 7. store_s8_interleaved
  // puts such lanes back in order.
  __attribute__((target("avx512bw"))) static inline void load_bf16_interleaved(F& lo, F& hi, const void* p) {
    const __m512i v = _mm512_loadu_si512(p), zero = _mm512_setzero_si512();
    lo = (F)_mm512_unpacklo_epi16(zero, v);
    hi = (F)_mm512_unpackhi_epi16(zero, v);
  }
  // 4W signed 32-bit lanes, in [-128, 127], as 4W bytes at p in element
  // order: a and b the first 2W elements as load_bf16_interleaved leaves
  // them, c and d the next 2W.
  __attribute__((target("avx512bw"))) static inline void store_s8_interleaved(std::uint8_t* p, const U& a, const U& b,
                                                                             const U& c, const U& d) {
    const __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32((__m512i)a, (__m512i)b),
                                             _mm512_packs_epi32((__m512i)c, (__m512i)d));
    _mm512_storeu_si512(p, _mm512_maskz_permutexvar_epi64((__mmask8)-1, _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), bytes));
  }
  // fp16 to fp32 and back in one instruction each (F16C's, here at 512
  // bits), both exact but for a NaN's bits (pack.hpp's load and store of
  // fp16 make them the library's).
  __attribute__((target("avx512f"))) static inline void half_to_float(F& r, const H& h) {
    r = (F)_mm512_maskz_cvtph_ps((__mmask16)-1, (__m256i)h);  // (maskz: the plain form trips -Wmaybe-uninitialized)
  }
  __attribute__((target("avx512f"))) static inline void float_to_half(H& h, const F& f) {
    h = (H)_mm512_maskz_cvtps_ph((__mmask16)-1, (__m512)f, _MM_FROUND_TO_NEAREST_INT);
  }
};

struct Avx2 {
  static constexpr int width = 8;
  static constexpr const char* name = "avx2";
  using F = float __attribute__((vector_size(32)));
  using U = std::uint32_t __attribute__((vector_size(32)));
  using H = std::uint16_t __attribute__((vector_size(16)));
  __attribute__((target("avx"))) static inline void sqrt(F& x) { x = (F)_mm256_sqrt_ps((__m256)x); }
  static inline void mul(F& r, const F& a, const F& b) {
#if defined(__has_builtin) && __has_builtin(__builtin_assoc_barrier)
    r = __builtin_assoc_barrier(a * b);  // never fused with a later add
#else
    r = a * b;
#endif
  }
  static inline void stream(void* p, const H& h) { _mm_stream_si128(static_cast<__m128i*>(p), (__m128i)h); }
  static inline void stream_fence() { _mm_sfence(); }
  __attribute__((target("avx2"))) static inline void gather(F& r, const float* base, const U& idx) {
    r = (F)_mm256_i32gather_ps(base, (__m256i)idx, 4);
  }
  __attribute__((target("avx2"))) static inline void gather_bytes(U& r, const std::uint8_t* base, const U& idx) {
    r = (U)_mm256_i32gather_epi32(reinterpret_cast<const int*>(base), (__m256i)idx, 1) & 0xffu;
  }
  __attribute__((target("avx2,fma"))) static inline void fma(F& r, const F& a, const F& b, const F& c) {
    r = (F)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
  }
  // 8 bytes to 32-bit lanes, and back (see Avx512).
  __attribute__((target("avx2"))) static inline void widen_u8(U& r, const std::uint8_t* p) {
    r = (U)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  __attribute__((target("avx2"))) static inline void narrow_u8(std::uint8_t* p, const U& u) {
    __m128i both;
    narrow_u8(both, u);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), both);
  }
  // The same bytes as the first 8 of a register (the other 8 zero).
  __attribute__((target("avx2"))) static inline void narrow_u8(__m128i& r, const U& u) {
    // Each 128-bit half's four low bytes to its first dword, then the two dwords side by side.
    const __m256i low = _mm256_shuffle_epi8((__m256i)u, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                          -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1,
                                                                          -1, -1, -1, -1, -1, -1, -1));
    r = _mm_unpacklo_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
  }
  // 8 lanes of 16 bits to 32-bit lanes and back (see Avx512): each lane's
  // low 16 bits kept, then packed with unsigned saturation, which keeps
  // them.
  __attribute__((target("avx2"))) static inline void widen_u16(U& r, const void* p) {
    r = (U)_mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  __attribute__((target("avx2"))) static inline void narrow_u16(H& h, const U& u) {
    const __m256i low = (__m256i)(u & 0xffffu);
    h = (H)_mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
  }
  // Each lane rounded to the nearest integer, ties to even (in the default
  // rounding mode, as the reference's rounding additions).
  __attribute__((target("avx"))) static inline void round_to_int(U& q, const F& f) {
    q = (U)_mm256_cvtps_epi32((__m256)f);
  }
  // bf16 values in interleaved lanes and signed bytes back in order (see Avx512).
  __attribute__((target("avx2"))) static inline void load_bf16_interleaved(F& lo, F& hi, const void* p) {
    const __m256i v = _mm256_loadu_si256(static_cast<const __m256i*>(p)), zero = _mm256_setzero_si256();
    lo = (F)_mm256_unpacklo_epi16(zero, v);
    hi = (F)_mm256_unpackhi_epi16(zero, v);
  }
  __attribute__((target("avx2"))) static inline void store_s8_interleaved(std::uint8_t* p, const U& a, const U& b,
                                                                         const U& c, const U& d) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32((__m256i)a, (__m256i)b),
                                             _mm256_packs_epi32((__m256i)c, (__m256i)d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(bytes, 0xD8));
  }
  // fp16 to fp32 and back through F16C (see Avx512).
  __attribute__((target("avx,f16c"))) static inline void half_to_float(F& r, const H& h) {
    r = (F)_mm256_cvtph_ps((__m128i)h);
  }
  __attribute__((target("avx,f16c"))) static inline void float_to_half(H& h, const F& f) {
    h = (H)_mm256_cvtps_ph((__m256)f, _MM_FROUND_TO_NEAREST_INT);
  }
};

template <class Isa>
struct Pack {
  typename Isa::F v;
};

template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> broadcast(float x) {
  Pack<Isa> p;
  p.v = typename Isa::F{} + x;
  return p;
}

// Arithmetic. operator* is not contractible (same rule as math::mul).
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator+(const Pack<Isa>& a, const Pack<Isa>& b) { return {a.v + b.v}; }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator-(const Pack<Isa>& a, const Pack<Isa>& b) { return {a.v - b.v}; }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator/(const Pack<Isa>& a, const Pack<Isa>& b) { return {a.v / b.v}; }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator-(const Pack<Isa>& a) { return {-a.v}; }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator*(const Pack<Isa>& a, const Pack<Isa>& b) {
  Pack<Isa> r;
  Isa::mul(r.v, a.v, b.v);
  return r;
}
// Mixed pack/scalar forms broadcast the scalar (hyper-parameters are scalars).
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator+(const Pack<Isa>& a, float b) { return a + broadcast<Isa>(b); }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator+(float a, const Pack<Isa>& b) { return broadcast<Isa>(a) + b; }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator-(const Pack<Isa>& a, float b) { return a - broadcast<Isa>(b); }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator-(float a, const Pack<Isa>& b) { return broadcast<Isa>(a) - b; }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator*(const Pack<Isa>& a, float b) { return a * broadcast<Isa>(b); }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator*(float a, const Pack<Isa>& b) { return broadcast<Isa>(a) * b; }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator/(const Pack<Isa>& a, float b) { return a / broadcast<Isa>(b); }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> operator/(float a, const Pack<Isa>& b) { return broadcast<Isa>(a) / b; }

// The math functions of zero/math.hpp for packs, so that one update rule
// (written against zero::math, called unqualified) compiles for floats and,
// through argument-dependent lookup, for packs.

template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> mul(const Pack<Isa>& a, const Pack<Isa>& b) { return a * b; }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> mul(const Pack<Isa>& a, float b) { return a * b; }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> mul(float a, const Pack<Isa>& b) { return a * b; }

template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> div(const Pack<Isa>& a, const Pack<Isa>& b) { return a / b; }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> div(const Pack<Isa>& a, float b) { return a / b; }
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> div(float a, const Pack<Isa>& b) { return a / b; }

namespace detail {
template <class T, class Isa>
ZERO_FORCE_INLINE Pack<Isa> as_pack(const T& x) {
  if constexpr (std::is_same_v<T, Pack<Isa>>) {
    return x;
  } else {
    return broadcast<Isa>(static_cast<float>(x));
  }
}
template <class... T>
struct first_pack;
template <class Isa, class... T>
struct first_pack<Pack<Isa>, T...> {
  using type = Isa;
};
template <class Head, class... T>
struct first_pack<Head, T...> : first_pack<T...> {};
}  // namespace detail

// fma over any mix of packs and scalars (at least one pack).
template <class A, class B, class C, class Isa = typename detail::first_pack<A, B, C>::type>
ZERO_FORCE_INLINE Pack<Isa> fma(const A& a, const B& b, const C& c) {
  Pack<Isa> r;
  Isa::fma(r.v, detail::as_pack<A, Isa>(a).v, detail::as_pack<B, Isa>(b).v, detail::as_pack<C, Isa>(c).v);
  return r;
}

template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> sqrt(const Pack<Isa>& x) {
  Pack<Isa> r = x;
  Isa::sqrt(r.v);
  return r;
}

template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> abs(const Pack<Isa>& x) {
  using U = typename Isa::U;
  return {(typename Isa::F)((U)x.v & 0x7fffffffu)};
}
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> min(const Pack<Isa>& a, const Pack<Isa>& b) {
  return {a.v < b.v ? a.v : b.v};
}
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> max(const Pack<Isa>& a, const Pack<Isa>& b) {
  return {a.v > b.v ? a.v : b.v};
}
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> sign(const Pack<Isa>& x) {
  using F = typename Isa::F;
  const F zero{};
  return {x.v > zero ? zero + 1.0f : (x.v < zero ? zero - 1.0f : zero)};
}

// Loads and stores of W consecutive elements of any storage type as a pack of
// fp32 lanes, with the library's exact conversions (zero/precision/convert.hpp).
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> load(const float* p) {
  Pack<Isa> r;
  std::memcpy(&r.v, p, sizeof r.v);
  return r;
}
template <class Isa>
ZERO_FORCE_INLINE void load_u16_widened(typename Isa::U& out, const void* p) {
  Isa::widen_u16(out, p);
}
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> load(const bf16* p) {
  typename Isa::U u;
  load_u16_widened<Isa>(u, p);
  Pack<Isa> r;
  zero::detail::bf16_bits_to_float_generic(r.v, u);
  return r;
}
// fp16 through F16C, which gives convert.hpp's exact values: 3-4 instructions
// a pack where the generic shifts and selects took about fifteen (fp16
// quantization ran at 0.19 of its probe, bench_quant_host). F16C quiets a
// NaN and keeps its sign and payload; the library's NaN is CUDA's canonical
// one (fp32 0x7fffffff, fp16 0x7fff), so NaN lanes are replaced.
template <class Isa>
ZERO_FORCE_INLINE Pack<Isa> load(const fp16* p) {
  using U = typename Isa::U;
  typename Isa::H h;
  std::memcpy(&h, p, sizeof h);
  Pack<Isa> r;
  Isa::half_to_float(r.v, h);
  const U bits = (U)r.v;
  r.v = (typename Isa::F)((bits & 0x7fffffffu) > 0x7f800000u ? U{} + 0x7fffffffu : bits);
  return r;
}
template <class Isa>
ZERO_FORCE_INLINE void half_bits(typename Isa::H& h, const Pack<Isa>& x) {
  Isa::float_to_half(h, x.v);
  using H = typename Isa::H;
  h = (h & 0x7fffu) > 0x7c00u ? H{} + 0x7fffu : h;
}

template <class Isa>
ZERO_FORCE_INLINE void store(float* p, const Pack<Isa>& x) {
  std::memcpy(p, &x.v, sizeof x.v);
}
template <class Isa>
ZERO_FORCE_INLINE void store_u16_narrowed(void* p, const typename Isa::U& u) {
  typename Isa::H h;
  Isa::narrow_u16(h, u);
  std::memcpy(p, &h, sizeof h);
}
// Streaming (non-temporal) stores of a 16-bit copy: for large write-only
// arrays, skipping the read-for-ownership of each line saves its traffic.
// p must be aligned to the pack's size; call Isa::stream_fence() after.
template <class Isa, class T>
ZERO_FORCE_INLINE void stream_store(T* p, const Pack<Isa>& x) {
  typename Isa::H h;
  if constexpr (std::is_same_v<T, bf16>) {
    typename Isa::U u;
    zero::detail::float_to_bf16_bits_generic(u, x.v);
    Isa::narrow_u16(h, u);
  } else {
    half_bits<Isa>(h, x);
  }
  Isa::stream(p, h);
}

template <class Isa>
ZERO_FORCE_INLINE void store(bf16* p, const Pack<Isa>& x) {
  typename Isa::U u;
  zero::detail::float_to_bf16_bits_generic(u, x.v);
  store_u16_narrowed<Isa>(p, u);
}
template <class Isa>
ZERO_FORCE_INLINE void store(fp16* p, const Pack<Isa>& x) {
  typename Isa::H h;
  half_bits<Isa>(h, x);
  std::memcpy(p, &h, sizeof h);
}

// W 8-bit codes, widened to 32-bit lanes, and back.
template <class Isa>
ZERO_FORCE_INLINE void load_u8_widened(typename Isa::U& out, const std::uint8_t* p) {
  Isa::widen_u8(out, p);
}
template <class Isa>
ZERO_FORCE_INLINE void store_u8_narrowed(std::uint8_t* p, const typename Isa::U& u) {
  Isa::narrow_u8(p, u);
}

// A remainder master (zero/precision/remainder.hpp): the fp32 values from
// the bf16 copies and the 16-bit remainders, and back; and bf16 copies
// rounded half away from zero. (Templates over the copy's type C, always
// bf16 when called: a step compiled for other types names them in code it
// discards, which Clang resolves before discarding.)
template <class Isa, class C>
ZERO_FORCE_INLINE Pack<Isa> load_joined(const C* copy, const std::uint16_t* remainder) {
  typename Isa::U c, r, u;
  load_u16_widened<Isa>(c, copy);
  load_u16_widened<Isa>(r, remainder);
  zero::detail::join_master_bits_generic(u, c, r);
  return {(typename Isa::F)u};
}
template <class Isa, class C>
ZERO_FORCE_INLINE void store_split(C* copy, std::uint16_t* remainder, const Pack<Isa>& x) {
  typename Isa::U c, r;
  zero::detail::split_master_bits_generic(c, r, (typename Isa::U)x.v);
  store_u16_narrowed<Isa>(copy, c);
  store_u16_narrowed<Isa>(remainder, r);
}
template <class Isa>
ZERO_FORCE_INLINE void store_ties_away(bf16* p, const Pack<Isa>& x) {
  typename Isa::U c;
  zero::detail::bits_to_bf16_ties_away_generic(c, (typename Isa::U)x.v);
  store_u16_narrowed<Isa>(p, c);
}

}  // namespace zero::simd

#endif  // ZERO_HOST_SIMD_X86
